//! The coordinator (store) run by rank 0: accepts every rank's connection, checks handshakes,
//! matches collective contributions by round, enforces timeouts and reports dead peers.
//!
//! Threads: one acceptor (non-blocking accept, polled), one reader per connection (blocking
//! reads, forwarding decoded messages as [`Event`]s and stamping every received byte as a sign
//! of life), the heartbeat thread (sends `Heartbeat` to the ranks that are waiting for an
//! answer), and the coordinator thread, which owns all state, receives the events over a
//! channel, declares silent ranks dead and does all other writes to clients. Writes to one
//! connection are serialised by its write lock; a lock is held across I/O only for one frame.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, PoisonError, TryLockError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::config::Liveness;
use crate::error::OpKind;
use crate::wire::{
    self, ClientMsg, FrameReader, Hello, HelloMsg, MAX_FRAME, MAX_HANDSHAKE_FRAME, OpMsg,
    PROTOCOL_VERSION, Progress, RemoteError, ServerMsg,
};

/// How long a fresh connection may take to send its `Hello`.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the coordinator waits, at shutdown, for clients to close their connections.
const SHUTDOWN_LINGER: Duration = Duration::from_millis(500);
/// Poll interval of the acceptor thread.
const ACCEPT_POLL: Duration = Duration::from_millis(5);
/// Lower bound on the write timeout used for client sockets.
const MIN_WRITE_TIMEOUT: Duration = Duration::from_secs(1);
/// Bounds on the heartbeat thread's poll period (a quarter of the shortest interval).
const MIN_BEAT_TICK: Duration = Duration::from_millis(5);
const MAX_BEAT_TICK: Duration = Duration::from_millis(250);

type ConnId = u64;

/// Milliseconds since the coordinator started; the clock of the liveness stamps.
fn ms_since(origin: Instant) -> u64 {
    u64::try_from(origin.elapsed().as_millis()).unwrap_or(u64::MAX)
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A joined rank's socket as seen by the coordinator and heartbeat threads.
#[derive(Debug)]
struct ConnShared {
    stream: TcpStream,
    /// Held while one frame is written, so frames of the two writer threads never interleave.
    write_lock: Mutex<()>,
    /// The rank waits for an answer (joining, or contributed to an open round): it reads its
    /// socket, so it gets heartbeats. A rank that is not waiting does not read, so heartbeats
    /// would only pile up in its buffers.
    waiting: AtomicBool,
    /// Heartbeat interval requested by the rank (zero: none).
    heartbeat_every: Duration,
    /// When the last heartbeat was sent, in [`ms_since`] time.
    last_beat_ms: AtomicU64,
    /// The connection is closed or being closed; the heartbeat thread leaves it alone.
    gone: AtomicBool,
}

impl ConnShared {
    fn send(&self, body: &[u8]) -> io::Result<()> {
        wire::write_frame_locked(&self.write_lock, &self.stream, body)
    }
}

/// Connections that asked for heartbeats, shared with the heartbeat thread.
type Beats = Arc<Mutex<Vec<Arc<ConnShared>>>>;

/// Messages from the acceptor/reader threads (and the handle) to the coordinator thread.
#[derive(Debug)]
enum Event {
    Hello {
        conn: ConnId,
        writer: TcpStream,
        peer: String,
        hello: HelloMsg,
        /// When bytes last arrived on this connection, in [`ms_since`] time.
        heard: Arc<AtomicU64>,
    },
    Op {
        conn: ConnId,
        op: OpMsg,
    },
    Goodbye {
        conn: ConnId,
    },
    Closed {
        conn: ConnId,
    },
    Stop,
}

type Registry = Arc<Mutex<Vec<(TcpStream, JoinHandle<()>)>>>;

/// Owner of the coordinator threads. Dropping it (or calling [`CoordinatorHandle::shutdown`])
/// tells connected ranks the coordinator is going away and joins every thread it started.
#[derive(Debug)]
pub(crate) struct CoordinatorHandle {
    events: Sender<Event>,
    stop_accept: Arc<AtomicBool>,
    coordinator: Option<JoinHandle<()>>,
    acceptor: Option<JoinHandle<()>>,
    registry: Registry,
    stop_beats: Option<Sender<()>>,
    beater: Option<JoinHandle<()>>,
}

impl CoordinatorHandle {
    /// Starts serving `listener` for a group of `world_size` ranks that must all report
    /// `crate_version`. `liveness` gives the keepalive settings of accepted sockets; heartbeat
    /// settings are each rank's own, from its handshake.
    pub(crate) fn start(
        listener: TcpListener,
        world_size: usize,
        crate_version: String,
        liveness: Liveness,
    ) -> io::Result<Self> {
        listener.set_nonblocking(true)?;
        let origin = Instant::now();
        let (tx, rx) = mpsc::channel();
        let stop_accept = Arc::new(AtomicBool::new(false));
        let registry: Registry = Arc::new(Mutex::new(Vec::new()));
        let beats: Beats = Arc::new(Mutex::new(Vec::new()));
        let (stop_beats, beats_stopped) = mpsc::channel();
        let beater = {
            let beats = beats.clone();
            thread::Builder::new()
                .name("epcomm-bootstrap-beat".into())
                .spawn(move || heartbeat_loop(beats, beats_stopped, origin))?
        };
        let state = Coordinator::new(world_size, crate_version, origin, beats);
        let coordinator = thread::Builder::new()
            .name("epcomm-bootstrap-coordinator".into())
            .spawn(move || state.run(rx));
        let coordinator = match coordinator {
            Ok(c) => c,
            Err(e) => {
                drop(stop_beats);
                let _ = beater.join();
                return Err(e);
            }
        };
        let acceptor = {
            let (tx, stop, registry) = (tx.clone(), stop_accept.clone(), registry.clone());
            thread::Builder::new()
                .name("epcomm-bootstrap-accept".into())
                .spawn(move || accept_loop(listener, tx, stop, registry, liveness, origin))
        };
        let acceptor = match acceptor {
            Ok(a) => a,
            Err(e) => {
                let _ = tx.send(Event::Stop);
                let _ = coordinator.join();
                drop(stop_beats);
                let _ = beater.join();
                return Err(e);
            }
        };
        Ok(CoordinatorHandle {
            events: tx,
            stop_accept,
            coordinator: Some(coordinator),
            acceptor: Some(acceptor),
            registry,
            stop_beats: Some(stop_beats),
            beater: Some(beater),
        })
    }

    /// Stops accepting, sends `Shutdown` to connected ranks, waits briefly for them to close,
    /// then closes every socket and joins all threads. Idempotent.
    pub(crate) fn shutdown(&mut self) {
        self.stop_accept.store(true, Ordering::SeqCst);
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
        if let Some(c) = self.coordinator.take() {
            let _ = self.events.send(Event::Stop);
            let _ = c.join();
        }
        let conns =
            std::mem::take(&mut *self.registry.lock().unwrap_or_else(PoisonError::into_inner));
        for (stream, _) in &conns {
            // Wakes readers blocked in read() (they then see end-of-stream and exit).
            let _ = stream.shutdown(Shutdown::Both);
        }
        for (_, reader) in conns {
            let _ = reader.join();
        }
        // Last: a heartbeat write blocked on a stuck peer was woken by the shutdowns above.
        self.stop_beats.take();
        if let Some(b) = self.beater.take() {
            let _ = b.join();
        }
    }
}

/// Sends `Heartbeat` to every waiting connection whose interval has passed, until stopped.
/// A connection whose write lock is taken is skipped: the coordinator is writing to it, and
/// those bytes are a sign of life too.
fn heartbeat_loop(beats: Beats, stop: Receiver<()>, origin: Instant) {
    let body = wire::encode_server(&ServerMsg::Heartbeat);
    let mut tick = MAX_BEAT_TICK;
    while let Err(RecvTimeoutError::Timeout) = stop.recv_timeout(tick) {
        let conns = beats.lock().unwrap_or_else(PoisonError::into_inner).clone();
        tick = MAX_BEAT_TICK;
        for c in conns {
            tick = tick.min(c.heartbeat_every / 4);
            if c.gone.load(Ordering::SeqCst) || !c.waiting.load(Ordering::SeqCst) {
                continue;
            }
            let now = ms_since(origin);
            let last = c.last_beat_ms.load(Ordering::SeqCst);
            if now.saturating_sub(last) < millis(c.heartbeat_every) {
                continue;
            }
            let _guard = match c.write_lock.try_lock() {
                Ok(g) => g,
                Err(TryLockError::Poisoned(p)) => p.into_inner(),
                Err(TryLockError::WouldBlock) => continue,
            };
            // A failed write needs no action here: the connection's reader sees the failure.
            let _ = wire::write_frame(&mut &c.stream, &body);
            c.last_beat_ms.store(now, Ordering::SeqCst);
        }
        tick = tick.max(MIN_BEAT_TICK);
    }
}

impl Drop for CoordinatorHandle {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn accept_loop(
    listener: TcpListener,
    tx: Sender<Event>,
    stop: Arc<AtomicBool>,
    reg: Registry,
    liveness: Liveness,
    origin: Instant,
) {
    let mut next_id: ConnId = 0;
    while !stop.load(Ordering::SeqCst) {
        let (stream, peer) = match listener.accept() {
            Ok(s) => s,
            // WouldBlock: nothing pending. Other errors (EMFILE, ECONNABORTED) are transient
            // from the listener's point of view; keep serving.
            Err(_) => {
                thread::sleep(ACCEPT_POLL);
                continue;
            }
        };
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_nodelay(true);
        let _ = liveness.apply_keepalive(&stream);
        let Ok(registered) = stream.try_clone() else {
            continue;
        };
        let id = next_id;
        next_id += 1;
        let tx = tx.clone();
        let spawned = thread::Builder::new()
            .name(format!("epcomm-bootstrap-conn-{id}"))
            .spawn(move || reader_loop(id, stream, peer.to_string(), tx, origin));
        if let Ok(handle) = spawned {
            let mut reg = reg.lock().unwrap_or_else(PoisonError::into_inner);
            // Release the descriptors of connections whose reader has finished (strangers,
            // departed ranks); the coordinator keeps its own handle where it still needs one.
            reg.retain(|(_, reader)| !reader.is_finished());
            reg.push((registered, handle));
        }
    }
}

/// Reads the handshake, then forwards every client message to the coordinator, stamping each
/// arrival of bytes (heartbeats included) as a sign of life. A connection that does not start
/// with a valid `Hello` (wrong magic, garbage, silence) is dropped without affecting the group.
fn reader_loop(
    conn: ConnId,
    mut stream: TcpStream,
    peer: String,
    tx: Sender<Event>,
    origin: Instant,
) {
    let _ = stream.set_read_timeout(Some(HELLO_TIMEOUT));
    let mut reader = FrameReader::new(MAX_HANDSHAKE_FRAME);
    let Ok(body) = reader.read_frame(&mut stream) else {
        return;
    };
    let Ok(hello) = wire::decode_hello(&body) else {
        return;
    };
    if stream.set_read_timeout(None).is_err() {
        return;
    }
    let Ok(writer) = stream.try_clone() else {
        return;
    };
    let heard = Arc::new(AtomicU64::new(ms_since(origin)));
    if tx
        .send(Event::Hello {
            conn,
            writer,
            peer,
            hello,
            heard: heard.clone(),
        })
        .is_err()
    {
        return;
    }
    reader.set_max(MAX_FRAME);
    let mut source = Progress {
        inner: &stream,
        on_progress: || heard.store(ms_since(origin), Ordering::SeqCst),
    };
    loop {
        let event = match reader
            .read_frame(&mut source)
            .map(|b| wire::decode_client(&b))
        {
            Ok(Ok(ClientMsg::Heartbeat)) => continue,
            Ok(Ok(ClientMsg::Op(op))) => Event::Op { conn, op },
            Ok(Ok(ClientMsg::Goodbye)) => {
                let _ = tx.send(Event::Goodbye { conn });
                return;
            }
            // End of stream, socket error, oversized frame or undecodable message: the peer is
            // treated as dead.
            Ok(Err(_)) | Err(_) => {
                let _ = tx.send(Event::Closed { conn });
                return;
            }
        };
        if tx.send(event).is_err() {
            return;
        }
    }
}

#[derive(Debug)]
struct Conn {
    shared: Arc<ConnShared>,
    rank: usize,
    op_timeout: Duration,
    peer: String,
    /// When bytes last arrived, in [`ms_since`] time (stamped by the reader thread).
    heard: Arc<AtomicU64>,
    /// Silence after which the rank is declared dead (zero: never), as the rank asked.
    peer_timeout: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Empty,
    Joined(ConnId),
    Dead,
    Left,
    /// Declared dead after this many milliseconds of silence.
    Unresponsive(u64),
}

impl Slot {
    /// The error a departure of `rank` in this way causes.
    fn departure_error(self, rank: usize) -> Option<RemoteError> {
        match self {
            Slot::Dead => Some(RemoteError::PeerDied { rank }),
            Slot::Left => Some(RemoteError::PeerLeft { rank }),
            Slot::Unresponsive(silent_ms) => {
                Some(RemoteError::PeerUnresponsive { rank, silent_ms })
            }
            Slot::Empty | Slot::Joined(_) => None,
        }
    }
}

#[derive(Debug)]
enum Phase {
    /// Waiting for all ranks; `deadline` is the earliest join deadline of the ranks present.
    Joining {
        deadline: Option<Instant>,
    },
    Running,
    /// The rendezvous failed; every later `Hello` is answered with this error.
    Aborted(RemoteError),
}

#[derive(Debug)]
struct Round {
    kind: OpKind,
    tag: String,
    root: usize,
    first_rank: usize,
    data: Vec<Option<Vec<u8>>>,
    deadline: Instant,
}

impl Round {
    fn describe(kind: OpKind, tag: &str, root: usize) -> String {
        match kind {
            OpKind::Broadcast => format!("{kind}(tag {tag:?}, root {root})"),
            _ => format!("{kind}(tag {tag:?})"),
        }
    }
}

#[derive(Debug)]
struct FailedRound {
    error: RemoteError,
    notified: Vec<bool>,
}

#[derive(Debug)]
struct Coordinator {
    world_size: usize,
    crate_version: String,
    conns: HashMap<ConnId, Conn>,
    slots: Vec<Slot>,
    phase: Phase,
    rounds: BTreeMap<u64, Round>,
    failed: HashMap<u64, FailedRound>,
    /// Connections whose write failed during the current event; handled as dead afterwards.
    write_failed: Vec<ConnId>,
    /// Clock of the liveness stamps.
    origin: Instant,
    /// Connections the heartbeat thread serves.
    beats: Beats,
}

impl Coordinator {
    fn new(world_size: usize, crate_version: String, origin: Instant, beats: Beats) -> Self {
        Coordinator {
            world_size,
            crate_version,
            conns: HashMap::new(),
            slots: vec![Slot::Empty; world_size],
            phase: Phase::Joining { deadline: None },
            rounds: BTreeMap::new(),
            failed: HashMap::new(),
            write_failed: Vec::new(),
            origin,
            beats,
        }
    }

    fn run(mut self, rx: Receiver<Event>) {
        loop {
            let now = Instant::now();
            self.expire(now);
            self.reap_failed_writes();
            self.update_waiting();
            let wait = self
                .next_deadline()
                .map(|d| d.saturating_duration_since(now))
                .unwrap_or(Duration::from_secs(3600));
            match rx.recv_timeout(wait) {
                Ok(Event::Stop) | Err(RecvTimeoutError::Disconnected) => break,
                Ok(event) => self.handle(event),
                Err(RecvTimeoutError::Timeout) => {}
            }
            self.reap_failed_writes();
        }
        self.close_gracefully(&rx);
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::Hello {
                conn,
                writer,
                peer,
                hello,
                heard,
            } => self.on_hello(conn, writer, peer, hello, heard),
            Event::Op { conn, op } => self.on_op(conn, op),
            Event::Goodbye { conn } => self.on_departed(conn, Slot::Left),
            Event::Closed { conn } => self.on_departed(conn, Slot::Dead),
            Event::Stop => {}
        }
    }

    /// Tells every client the coordinator is leaving, then waits up to [`SHUTDOWN_LINGER`]
    /// for them to close so no reply still in flight is cut off by a reset.
    fn close_gracefully(&mut self, rx: &Receiver<Event>) {
        self.beats
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        let body = wire::encode_server(&ServerMsg::Shutdown);
        for conn in self.conns.values() {
            let c = &conn.shared;
            c.gone.store(true, Ordering::SeqCst);
            let _ = c.stream.set_write_timeout(Some(Duration::from_millis(100)));
            let _ = c.send(&body);
            let _ = c.stream.shutdown(Shutdown::Write);
        }
        let deadline = Instant::now() + SHUTDOWN_LINGER;
        while !self.conns.is_empty() {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                break;
            }
            match rx.recv_timeout(remaining) {
                Ok(Event::Closed { conn }) | Ok(Event::Goodbye { conn }) => {
                    self.conns.remove(&conn);
                }
                Ok(Event::Hello { writer, .. }) => {
                    let _ = writer.shutdown(Shutdown::Both);
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        let join = match self.phase {
            Phase::Joining { deadline } => deadline,
            _ => None,
        };
        let round = self.rounds.values().map(|r| r.deadline).min();
        let silence = self
            .conns
            .values()
            .filter(|c| !c.peer_timeout.is_zero())
            .map(|c| {
                let heard = Duration::from_millis(c.heard.load(Ordering::SeqCst));
                self.origin + heard + c.peer_timeout
            })
            .min();
        [join, round, silence].into_iter().flatten().min()
    }

    /// Tells the heartbeat thread which ranks are waiting for an answer.
    fn update_waiting(&self) {
        for conn in self.conns.values() {
            let waiting = match self.phase {
                Phase::Joining { .. } => true,
                Phase::Running => self.rounds.values().any(|r| r.data[conn.rank].is_some()),
                Phase::Aborted(_) => false,
            };
            conn.shared.waiting.store(waiting, Ordering::SeqCst);
        }
    }

    fn expire(&mut self, now: Instant) {
        // Silent ranks first: a round waiting for a frozen rank fails naming it, not as a timeout.
        let now_ms = u64::try_from(now.saturating_duration_since(self.origin).as_millis())
            .unwrap_or(u64::MAX);
        let mut silent: Vec<(usize, ConnId, u64)> = self
            .conns
            .iter()
            .filter(|(_, c)| !c.peer_timeout.is_zero())
            .filter_map(|(&id, c)| {
                let quiet = now_ms.saturating_sub(c.heard.load(Ordering::SeqCst));
                (quiet >= millis(c.peer_timeout)).then_some((c.rank, id, quiet))
            })
            .collect();
        silent.sort_unstable();
        for (_, id, quiet) in silent {
            self.on_departed(id, Slot::Unresponsive(quiet));
        }
        if let Phase::Joining { deadline: Some(d) } = self.phase
            && d <= now
        {
            let missing = (0..self.world_size)
                .filter(|&r| self.slots[r] == Slot::Empty)
                .collect();
            self.abort(RemoteError::Timeout { missing });
        }
        let expired: Vec<u64> = self
            .rounds
            .iter()
            .filter(|(_, r)| r.deadline <= now)
            .map(|(&s, _)| s)
            .collect();
        for seq in expired {
            let Some(round) = self.rounds.get(&seq) else {
                continue;
            };
            let missing = (0..self.world_size)
                .filter(|&r| round.data[r].is_none())
                .collect();
            self.fail_round(seq, RemoteError::Timeout { missing });
        }
    }

    fn send_body(&mut self, conn: ConnId, body: &[u8]) {
        if let Some(c) = self.conns.get(&conn)
            && c.shared.send(body).is_err()
        {
            self.write_failed.push(conn);
        }
    }

    fn reap_failed_writes(&mut self) {
        while let Some(conn) = self.write_failed.pop() {
            self.on_departed(conn, Slot::Dead);
        }
    }

    /// Answers a connection that will not join with `error`, then closes our side.
    fn reject(writer: &TcpStream, error: RemoteError) {
        let _ = writer.set_write_timeout(Some(MIN_WRITE_TIMEOUT));
        let _ = wire::write_frame(
            &mut &*writer,
            &wire::encode_server(&ServerMsg::Reject(error)),
        );
        let _ = writer.shutdown(Shutdown::Write);
    }

    /// Stops heartbeats to a connection that is closing.
    fn forget_beats(&self, shared: &Arc<ConnShared>) {
        shared.gone.store(true, Ordering::SeqCst);
        self.beats
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|c| !Arc::ptr_eq(c, shared));
    }

    /// Fails the rendezvous: every joined rank gets `error`, as will any later arrival.
    fn abort(&mut self, error: RemoteError) {
        let conns: Vec<Conn> = self.conns.drain().map(|(_, c)| c).collect();
        for conn in conns {
            self.forget_beats(&conn.shared);
            let _guard = conn
                .shared
                .write_lock
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            Self::reject(&conn.shared.stream, error.clone());
        }
        self.slots.fill(Slot::Empty);
        self.phase = Phase::Aborted(error);
    }

    fn check_hello(&self, h: &Hello, peer: &str) -> Result<(), RemoteError> {
        if h.crate_version != self.crate_version {
            return Err(RemoteError::CrateMismatch {
                coordinator: self.crate_version.clone(),
                peer: h.crate_version.clone(),
                peer_rank: h.rank,
            });
        }
        if h.world_size != self.world_size {
            return Err(RemoteError::WorldMismatch {
                coordinator: self.world_size,
                peer: h.world_size,
                peer_rank: h.rank,
            });
        }
        if h.rank >= self.world_size {
            return Err(RemoteError::RankOutOfRange {
                rank: h.rank,
                world_size: self.world_size,
            });
        }
        match self.slots[h.rank] {
            Slot::Joined(other) => Err(RemoteError::DuplicateRank {
                rank: h.rank,
                first: self
                    .conns
                    .get(&other)
                    .map(|c| c.peer.clone())
                    .unwrap_or_default(),
                second: peer.to_string(),
            }),
            Slot::Dead | Slot::Left | Slot::Unresponsive(_) => {
                Err(RemoteError::RendezvousClosed { rank: h.rank })
            }
            Slot::Empty => Ok(()),
        }
    }

    fn on_hello(
        &mut self,
        id: ConnId,
        writer: TcpStream,
        peer: String,
        hello: HelloMsg,
        heard: Arc<AtomicU64>,
    ) {
        let checked = match &hello {
            HelloMsg::Foreign { protocol, rank, .. } => Err(RemoteError::ProtocolMismatch {
                coordinator: PROTOCOL_VERSION,
                peer: *protocol,
                peer_rank: *rank,
            }),
            HelloMsg::Ours(h) => self.check_hello(h, &peer).map(|()| h),
        };
        match (&self.phase, checked) {
            (Phase::Aborted(e), _) => Self::reject(&writer, e.clone()),
            (Phase::Running, Err(e)) => Self::reject(&writer, e),
            (Phase::Running, Ok(h)) => {
                let rank = h.rank;
                Self::reject(&writer, RemoteError::RendezvousClosed { rank });
            }
            (Phase::Joining { .. }, Err(e)) => {
                Self::reject(&writer, e.clone());
                self.abort(e);
            }
            (Phase::Joining { deadline }, Ok(h)) => {
                let op_timeout = Duration::from_millis(h.op_timeout_ms.max(1));
                let join_deadline = Instant::now() + Duration::from_millis(h.join_budget_ms);
                let deadline = Some(deadline.map_or(join_deadline, |d| d.min(join_deadline)));
                let rank = h.rank;
                let peer_timeout = Duration::from_millis(h.peer_timeout_ms);
                // A rank that takes no bytes for its peer timeout is as dead as a silent one.
                let write_timeout = if peer_timeout.is_zero() {
                    op_timeout
                } else {
                    op_timeout.min(peer_timeout)
                };
                let _ = writer.set_write_timeout(Some(write_timeout.max(MIN_WRITE_TIMEOUT)));
                let heartbeat_every = if peer_timeout.is_zero() {
                    Duration::ZERO
                } else {
                    Duration::from_millis(h.heartbeat_ms)
                };
                let shared = Arc::new(ConnShared {
                    stream: writer,
                    write_lock: Mutex::new(()),
                    waiting: AtomicBool::new(true),
                    heartbeat_every,
                    last_beat_ms: AtomicU64::new(0),
                    gone: AtomicBool::new(false),
                });
                if !heartbeat_every.is_zero() {
                    self.beats
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push(shared.clone());
                }
                self.conns.insert(
                    id,
                    Conn {
                        shared,
                        rank,
                        op_timeout,
                        peer,
                        heard,
                        peer_timeout,
                    },
                );
                self.slots[rank] = Slot::Joined(id);
                self.phase = Phase::Joining { deadline };
                if self.slots.iter().all(|s| matches!(s, Slot::Joined(_))) {
                    self.phase = Phase::Running;
                    let body = wire::encode_server(&ServerMsg::Welcome {
                        protocol: PROTOCOL_VERSION,
                        crate_version: self.crate_version.clone(),
                        world_size: self.world_size,
                    });
                    self.send_to_ranks(&body, |_| true);
                }
            }
        }
    }

    /// The error that makes every new round impossible, if some rank has gone.
    fn departed_error(&self) -> Option<RemoteError> {
        self.slots
            .iter()
            .enumerate()
            .find_map(|(rank, s)| s.departure_error(rank))
    }

    fn on_op(&mut self, id: ConnId, op: OpMsg) {
        let Some(conn) = self.conns.get(&id) else {
            return;
        };
        let (rank, op_timeout) = (conn.rank, conn.op_timeout);
        let well_formed = matches!(self.phase, Phase::Running)
            && op.kind != OpKind::Connect
            && op.root < self.world_size;
        if !well_formed {
            // A client that breaks the protocol is cut off like a dead one.
            self.on_departed(id, Slot::Dead);
            return;
        }
        let seq = op.seq;
        if let Some(f) = self.failed.get_mut(&seq) {
            if std::mem::replace(&mut f.notified[rank], true) {
                self.on_departed(id, Slot::Dead);
                return;
            }
            let body = wire::encode_server(&ServerMsg::OpErr {
                seq,
                error: f.error.clone(),
            });
            self.send_body(id, &body);
            self.collect_failed();
            return;
        }
        let now = Instant::now();
        if !self.rounds.contains_key(&seq) {
            if let Some(error) = self.departed_error() {
                let mut notified = vec![false; self.world_size];
                notified[rank] = true;
                let body = wire::encode_server(&ServerMsg::OpErr {
                    seq,
                    error: error.clone(),
                });
                self.failed.insert(seq, FailedRound { error, notified });
                self.send_body(id, &body);
                self.collect_failed();
                return;
            }
            self.rounds.insert(
                seq,
                Round {
                    kind: op.kind,
                    tag: op.tag.clone(),
                    root: op.root,
                    first_rank: rank,
                    data: vec![None; self.world_size],
                    deadline: now + op_timeout,
                },
            );
        }
        let Some(round) = self.rounds.get_mut(&seq) else {
            return;
        };
        if round.data[rank].is_some() {
            self.on_departed(id, Slot::Dead);
            return;
        }
        let same_call = round.kind == op.kind
            && round.tag == op.tag
            && (op.kind != OpKind::Broadcast || round.root == op.root);
        round.data[rank] = Some(op.data);
        round.deadline = round.deadline.min(now + op_timeout);
        if !same_call {
            let error = RemoteError::OpMismatch {
                rank_a: round.first_rank,
                call_a: Round::describe(round.kind, &round.tag, round.root),
                rank_b: rank,
                call_b: Round::describe(op.kind, &op.tag, op.root),
            };
            self.fail_round(seq, error);
        } else if round.data.iter().all(Option::is_some) {
            self.complete_round(seq);
        }
    }

    fn complete_round(&mut self, seq: u64) {
        let Some(round) = self.rounds.get(&seq) else {
            return;
        };
        let payload_len = |r: usize| round.data[r].as_ref().map_or(0, Vec::len) as u64 + 4;
        let payload_bytes: u64 = match round.kind {
            OpKind::AllGather => (0..self.world_size).map(payload_len).sum(),
            OpKind::Broadcast => payload_len(round.root),
            OpKind::Barrier | OpKind::Connect => 0,
        };
        // Type byte, sequence number and payload count precede the payloads.
        let size = payload_bytes + 13;
        if size > MAX_FRAME as u64 {
            self.fail_round(
                seq,
                RemoteError::TooLarge {
                    size,
                    limit: MAX_FRAME as u64,
                },
            );
            return;
        }
        let Some(round) = self.rounds.remove(&seq) else {
            return;
        };
        let data: Vec<Vec<u8>> = round
            .data
            .into_iter()
            .map(Option::unwrap_or_default)
            .collect();
        let payloads = match round.kind {
            OpKind::AllGather => data,
            OpKind::Broadcast => data.into_iter().nth(round.root).into_iter().collect(),
            OpKind::Barrier | OpKind::Connect => Vec::new(),
        };
        let body = wire::encode_server(&ServerMsg::OpOk { seq, payloads });
        self.send_to_ranks(&body, |_| true);
    }

    /// Sends `body` to every connected rank selected by `include`, rank 0 last: rank 0 hosts
    /// this coordinator, and once it has its answer it may exit, taking the coordinator with
    /// it, so every other rank's answer must already be written by then.
    fn send_to_ranks(&mut self, body: &[u8], include: impl Fn(usize) -> bool) {
        let order = (1..self.world_size).chain(std::iter::once(0));
        let ids: Vec<ConnId> = order
            .filter(|&rank| include(rank))
            .filter_map(|rank| match self.slots.get(rank) {
                Some(Slot::Joined(id)) => Some(*id),
                _ => None,
            })
            .collect();
        for id in ids {
            self.send_body(id, body);
        }
    }

    /// Ends round `seq` with `error` for everyone: ranks already waiting get it now, ranks
    /// arriving later get it on arrival.
    fn fail_round(&mut self, seq: u64, error: RemoteError) {
        let Some(round) = self.rounds.remove(&seq) else {
            return;
        };
        let notified: Vec<bool> = round.data.iter().map(Option::is_some).collect();
        let body = wire::encode_server(&ServerMsg::OpErr {
            seq,
            error: error.clone(),
        });
        self.send_to_ranks(&body, |rank| notified[rank]);
        self.failed.insert(seq, FailedRound { error, notified });
        self.collect_failed();
    }

    /// Forgets failed rounds that every rank still connected has been told about.
    fn collect_failed(&mut self) {
        let slots = &self.slots;
        self.failed.retain(|_, f| {
            slots
                .iter()
                .zip(&f.notified)
                .any(|(s, &n)| matches!(s, Slot::Joined(_)) && !n)
        });
    }

    /// A client said goodbye (`Slot::Left`), its connection broke (`Slot::Dead`) or it went
    /// silent (`Slot::Unresponsive`).
    fn on_departed(&mut self, id: ConnId, how: Slot) {
        let Some(conn) = self.conns.remove(&id) else {
            return;
        };
        self.forget_beats(&conn.shared);
        let _ = conn.shared.stream.shutdown(Shutdown::Both);
        let rank = conn.rank;
        self.slots[rank] = how;
        let error = how
            .departure_error(rank)
            .unwrap_or(RemoteError::PeerDied { rank });
        match self.phase {
            Phase::Joining { .. } => self.abort(error),
            Phase::Running => {
                let stuck: Vec<u64> = self
                    .rounds
                    .iter()
                    .filter(|(_, r)| r.data[rank].is_none())
                    .map(|(&s, _)| s)
                    .collect();
                for seq in stuck {
                    self.fail_round(seq, error.clone());
                }
                self.collect_failed();
            }
            Phase::Aborted(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpStream;
    use std::thread;
    use std::time::{Duration, Instant};

    use crate::launch::free_port;
    use crate::wire::{self, Hello, PROTOCOL_VERSION};
    use crate::{Bootstrap, BootstrapConfig, BootstrapError, CRATE_VERSION, OpKind};

    use crate::testing::{LONG, fast_liveness as fast};

    fn cfg(port: u16, rank: usize, world_size: usize, timeout: Duration) -> BootstrapConfig {
        BootstrapConfig::single_host(port, rank, world_size, timeout)
    }

    /// Joins as `rank` over a raw socket with a valid `Hello` announcing `peer_timeout_ms`,
    /// then never sends another byte (a frozen process whose kernel keeps the socket open).
    fn silent_rank(port: u16, rank: usize, world_size: usize, peer_timeout_ms: u64) -> TcpStream {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut s = loop {
            match TcpStream::connect(("127.0.0.1", port)) {
                Ok(s) => break s,
                Err(e) if Instant::now() > deadline => panic!("cannot connect: {e}"),
                Err(_) => thread::sleep(Duration::from_millis(5)),
            }
        };
        let hello = Hello {
            protocol: PROTOCOL_VERSION,
            rank,
            world_size,
            crate_version: CRATE_VERSION.into(),
            local_rank: rank,
            local_world_size: world_size,
            op_timeout_ms: 60_000,
            join_budget_ms: 60_000,
            heartbeat_ms: 100,
            peer_timeout_ms,
        };
        wire::write_frame(&mut s, &wire::encode_hello(&hello)).unwrap();
        s
    }

    #[test]
    fn silent_rank_is_declared_unresponsive_on_every_other_rank() {
        let port = free_port().unwrap();
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                thread::spawn(move || {
                    let bs = Bootstrap::connect_with_liveness(cfg(port, rank, 3, LONG), fast())
                        .expect("connect");
                    let start = Instant::now();
                    let err = bs.barrier("frozen").expect_err("rank 2 is silent");
                    let waited = start.elapsed();
                    let again = bs.all_gather("later", b"x").expect_err("rank 2 is dead");
                    (err, waited, again)
                })
            })
            .collect();
        let _silent = silent_rank(port, 2, 3, 1000);
        for h in ranks {
            let (err, waited, again) = h.join().unwrap();
            match err {
                BootstrapError::PeerUnresponsive {
                    rank: 2,
                    op: OpKind::Barrier,
                    tag,
                    silent_for,
                } => {
                    assert_eq!(tag, "frozen");
                    assert!(silent_for >= Duration::from_millis(1000), "{silent_for:?}");
                }
                other => panic!("expected PeerUnresponsive naming rank 2, got {other}"),
            }
            // Bounded by the silent rank's 1 s lease, not by the 60 s operation timeout.
            assert!(waited < Duration::from_secs(5), "{waited:?}");
            assert!(
                matches!(
                    again,
                    BootstrapError::PeerUnresponsive {
                        rank: 2,
                        op: OpKind::AllGather,
                        ..
                    }
                ),
                "{again}"
            );
        }
    }

    #[test]
    fn rank_without_a_lease_is_only_bounded_by_the_op_timeout() {
        // The silent rank announces peer_timeout 0 (heartbeats off), so the coordinator must
        // not judge it by the other ranks' settings: the round times out naming it.
        let port = free_port().unwrap();
        let timeout = Duration::from_millis(1500);
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                thread::spawn(move || {
                    let bs = Bootstrap::connect_with_liveness(cfg(port, rank, 3, timeout), fast())
                        .expect("connect");
                    bs.barrier("slow").expect_err("rank 2 never arrives")
                })
            })
            .collect();
        let _silent = silent_rank(port, 2, 3, 0);
        for h in ranks {
            match h.join().unwrap() {
                BootstrapError::Timeout { missing_ranks, .. } => assert_eq!(missing_ranks, [2]),
                other => panic!("expected Timeout naming rank 2, got {other}"),
            }
        }
    }
}
