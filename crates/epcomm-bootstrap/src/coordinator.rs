//! The coordinator (store) run by rank 0: accepts every rank's connection, checks handshakes,
//! matches collective contributions by round, enforces timeouts and reports dead peers.
//!
//! Threads: one acceptor (non-blocking accept, polled), one reader per connection (blocking
//! reads, forwarding decoded messages as [`Event`]s), and the coordinator thread, which owns all
//! state, receives the events over a channel and does all writes to clients. No lock is held
//! across I/O except the short-lived registry lock used to collect reader threads.

use std::collections::{BTreeMap, HashMap};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::error::OpKind;
use crate::wire::{
    self, ClientMsg, FrameReader, Hello, HelloMsg, MAX_FRAME, MAX_HANDSHAKE_FRAME, OpMsg,
    PROTOCOL_VERSION, RemoteError, ServerMsg,
};

/// How long a fresh connection may take to send its `Hello`.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the coordinator waits, at shutdown, for clients to close their connections.
const SHUTDOWN_LINGER: Duration = Duration::from_millis(500);
/// Poll interval of the acceptor thread.
const ACCEPT_POLL: Duration = Duration::from_millis(5);
/// Lower bound on the write timeout used for client sockets.
const MIN_WRITE_TIMEOUT: Duration = Duration::from_secs(1);

type ConnId = u64;

/// Messages from the acceptor/reader threads (and the handle) to the coordinator thread.
#[derive(Debug)]
enum Event {
    Hello {
        conn: ConnId,
        writer: TcpStream,
        peer: String,
        hello: HelloMsg,
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
}

impl CoordinatorHandle {
    /// Starts serving `listener` for a group of `world_size` ranks that must all report
    /// `crate_version`.
    pub(crate) fn start(
        listener: TcpListener,
        world_size: usize,
        crate_version: String,
    ) -> std::io::Result<Self> {
        listener.set_nonblocking(true)?;
        let (tx, rx) = mpsc::channel();
        let stop_accept = Arc::new(AtomicBool::new(false));
        let registry: Registry = Arc::new(Mutex::new(Vec::new()));
        let state = Coordinator::new(world_size, crate_version);
        let coordinator = thread::Builder::new()
            .name("epcomm-bootstrap-coordinator".into())
            .spawn(move || state.run(rx))?;
        let acceptor = {
            let (tx, stop, registry) = (tx.clone(), stop_accept.clone(), registry.clone());
            thread::Builder::new()
                .name("epcomm-bootstrap-accept".into())
                .spawn(move || accept_loop(listener, tx, stop, registry))
        };
        let acceptor = match acceptor {
            Ok(a) => a,
            Err(e) => {
                let _ = tx.send(Event::Stop);
                let _ = coordinator.join();
                return Err(e);
            }
        };
        Ok(CoordinatorHandle {
            events: tx,
            stop_accept,
            coordinator: Some(coordinator),
            acceptor: Some(acceptor),
            registry,
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
    }
}

impl Drop for CoordinatorHandle {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn accept_loop(listener: TcpListener, tx: Sender<Event>, stop: Arc<AtomicBool>, reg: Registry) {
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
        let Ok(registered) = stream.try_clone() else {
            continue;
        };
        let id = next_id;
        next_id += 1;
        let tx = tx.clone();
        let spawned = thread::Builder::new()
            .name(format!("epcomm-bootstrap-conn-{id}"))
            .spawn(move || reader_loop(id, stream, peer.to_string(), tx));
        if let Ok(handle) = spawned {
            let mut reg = reg.lock().unwrap_or_else(PoisonError::into_inner);
            // Release the descriptors of connections whose reader has finished (strangers,
            // departed ranks); the coordinator keeps its own handle where it still needs one.
            reg.retain(|(_, reader)| !reader.is_finished());
            reg.push((registered, handle));
        }
    }
}

/// Reads the handshake, then forwards every client message to the coordinator. A connection
/// that does not start with a valid `Hello` (wrong magic, garbage, silence) is dropped without
/// affecting the group.
fn reader_loop(conn: ConnId, mut stream: TcpStream, peer: String, tx: Sender<Event>) {
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
    if tx
        .send(Event::Hello {
            conn,
            writer,
            peer,
            hello,
        })
        .is_err()
    {
        return;
    }
    reader.set_max(MAX_FRAME);
    loop {
        let event = match reader
            .read_frame(&mut stream)
            .map(|b| wire::decode_client(&b))
        {
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
    writer: TcpStream,
    rank: usize,
    op_timeout: Duration,
    peer: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Empty,
    Joined(ConnId),
    Dead,
    Left,
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
}

impl Coordinator {
    fn new(world_size: usize, crate_version: String) -> Self {
        Coordinator {
            world_size,
            crate_version,
            conns: HashMap::new(),
            slots: vec![Slot::Empty; world_size],
            phase: Phase::Joining { deadline: None },
            rounds: BTreeMap::new(),
            failed: HashMap::new(),
            write_failed: Vec::new(),
        }
    }

    fn run(mut self, rx: Receiver<Event>) {
        loop {
            let now = Instant::now();
            self.expire(now);
            self.reap_failed_writes();
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
            } => self.on_hello(conn, writer, peer, hello),
            Event::Op { conn, op } => self.on_op(conn, op),
            Event::Goodbye { conn } => self.on_departed(conn, Slot::Left),
            Event::Closed { conn } => self.on_departed(conn, Slot::Dead),
            Event::Stop => {}
        }
    }

    /// Tells every client the coordinator is leaving, then waits up to [`SHUTDOWN_LINGER`]
    /// for them to close so no reply still in flight is cut off by a reset.
    fn close_gracefully(&mut self, rx: &Receiver<Event>) {
        let body = wire::encode_server(&ServerMsg::Shutdown);
        for conn in self.conns.values_mut() {
            let _ = conn
                .writer
                .set_write_timeout(Some(Duration::from_millis(100)));
            let _ = wire::write_frame(&mut conn.writer, &body);
            let _ = conn.writer.shutdown(Shutdown::Write);
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
        match (join, round) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn expire(&mut self, now: Instant) {
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
        if let Some(c) = self.conns.get_mut(&conn)
            && wire::write_frame(&mut c.writer, body).is_err()
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
    fn reject(mut writer: TcpStream, error: RemoteError) {
        let _ = writer.set_write_timeout(Some(MIN_WRITE_TIMEOUT));
        let _ = wire::write_frame(&mut writer, &wire::encode_server(&ServerMsg::Reject(error)));
        let _ = writer.shutdown(Shutdown::Write);
    }

    /// Fails the rendezvous: every joined rank gets `error`, as will any later arrival.
    fn abort(&mut self, error: RemoteError) {
        for (_, conn) in self.conns.drain() {
            Self::reject(conn.writer, error.clone());
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
            Slot::Dead | Slot::Left => Err(RemoteError::RendezvousClosed { rank: h.rank }),
            Slot::Empty => Ok(()),
        }
    }

    fn on_hello(&mut self, id: ConnId, writer: TcpStream, peer: String, hello: HelloMsg) {
        let checked = match &hello {
            HelloMsg::Foreign { protocol, rank, .. } => Err(RemoteError::ProtocolMismatch {
                coordinator: PROTOCOL_VERSION,
                peer: *protocol,
                peer_rank: *rank,
            }),
            HelloMsg::Ours(h) => self.check_hello(h, &peer).map(|()| h),
        };
        match (&self.phase, checked) {
            (Phase::Aborted(e), _) => Self::reject(writer, e.clone()),
            (Phase::Running, Err(e)) => Self::reject(writer, e),
            (Phase::Running, Ok(h)) => {
                let rank = h.rank;
                Self::reject(writer, RemoteError::RendezvousClosed { rank });
            }
            (Phase::Joining { .. }, Err(e)) => {
                Self::reject(writer, e.clone());
                self.abort(e);
            }
            (Phase::Joining { deadline }, Ok(h)) => {
                let op_timeout = Duration::from_millis(h.op_timeout_ms.max(1));
                let join_deadline = Instant::now() + Duration::from_millis(h.join_budget_ms);
                let deadline = Some(deadline.map_or(join_deadline, |d| d.min(join_deadline)));
                let rank = h.rank;
                let _ = writer.set_write_timeout(Some(op_timeout.max(MIN_WRITE_TIMEOUT)));
                self.conns.insert(
                    id,
                    Conn {
                        writer,
                        rank,
                        op_timeout,
                        peer,
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
        self.slots.iter().enumerate().find_map(|(rank, s)| match s {
            Slot::Dead => Some(RemoteError::PeerDied { rank }),
            Slot::Left => Some(RemoteError::PeerLeft { rank }),
            _ => None,
        })
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

    /// A client said goodbye (`Slot::Left`) or its connection broke (`Slot::Dead`).
    fn on_departed(&mut self, id: ConnId, how: Slot) {
        let Some(conn) = self.conns.remove(&id) else {
            return;
        };
        let _ = conn.writer.shutdown(Shutdown::Both);
        let rank = conn.rank;
        self.slots[rank] = how;
        let error = if how == Slot::Left {
            RemoteError::PeerLeft { rank }
        } else {
            RemoteError::PeerDied { rank }
        };
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
