//! The coordinator (store) run by rank 0: accepts every rank's connection, checks handshakes,
//! matches collective contributions by round, enforces timeouts and reports dead peers.
//!
//! Threads: one acceptor (non-blocking accept, polled), one reader per connection (blocking
//! reads, forwarding decoded messages as [`Event`]s and stamping every received byte as a sign
//! of life), the heartbeat thread (sends `Heartbeat` to the ranks that are waiting for an
//! answer), and the coordinator thread, which owns all state, receives the events over a
//! channel, declares silent ranks dead and does all other writes to clients. Writes to one
//! connection are serialised by its write lock; a lock is held across I/O only for one frame.
//!
//! One idea per submodule: [`handle`] starts and stops the threads, [`accept`] turns
//! connections into [`Event`]s, [`handshake`] admits ranks, [`rounds`] runs the collectives,
//! [`liveness`] sends heartbeats and declares silent ranks dead. This module holds the state
//! they share and the coordinator thread's event loop.

mod accept;
mod handle;
mod handshake;
mod liveness;
mod rounds;

use std::collections::{BTreeMap, HashMap};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

pub(crate) use handle::CoordinatorHandle;
use liveness::{Beats, ConnShared};
use rounds::{FailedRound, Round};

use crate::wire::{self, HelloMsg, OpMsg, RemoteError, ServerMsg};

/// How long the coordinator waits, at shutdown, for clients to close their connections.
const SHUTDOWN_LINGER: Duration = Duration::from_millis(500);

type ConnId = u64;

/// Milliseconds since the coordinator started; the clock of the liveness stamps.
fn ms_since(origin: Instant) -> u64 {
    u64::try_from(origin.elapsed().as_millis()).unwrap_or(u64::MAX)
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

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

    /// Applies every deadline passed by `now`. Silent ranks first: a round waiting for a
    /// frozen rank fails naming it, not as a timeout; then the join deadline, then rounds.
    fn expire(&mut self, now: Instant) {
        self.expire_silent(now);
        self.expire_join(now);
        self.expire_rounds(now);
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
