//! Liveness on the coordinator's side: heartbeats to the ranks that wait for an answer, and
//! declaring silent ranks dead.
//!
//! Contracts: a rank gets `Heartbeat` frames every `heartbeat_ms` it asked for, but only while
//! it waits for an answer (an idle rank does not read its socket); a rank from which no byte
//! arrived for its own `peer_timeout_ms` departs as [`Slot::Unresponsive`], which fails its
//! pending and later rounds with error 12 naming it. A rank that announced no peer timeout is
//! never judged by silence, only by the operation timeout.

use std::io;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex, PoisonError, TryLockError};
use std::time::{Duration, Instant};

use super::{ConnId, Coordinator, Phase, Slot, millis, ms_since};
use crate::wire::{self, ServerMsg};

/// Bounds on the heartbeat thread's poll period (a quarter of the shortest interval).
const MIN_BEAT_TICK: Duration = Duration::from_millis(5);
const MAX_BEAT_TICK: Duration = Duration::from_millis(250);

/// A joined rank's socket as seen by the coordinator and heartbeat threads.
#[derive(Debug)]
pub(super) struct ConnShared {
    pub(super) stream: TcpStream,
    /// Held while one frame is written, so frames of the two writer threads never interleave.
    pub(super) write_lock: Mutex<()>,
    /// The rank waits for an answer (joining, or contributed to an open round): it reads its
    /// socket, so it gets heartbeats. A rank that is not waiting does not read, so heartbeats
    /// would only pile up in its buffers.
    pub(super) waiting: AtomicBool,
    /// Heartbeat interval requested by the rank (zero: none).
    pub(super) heartbeat_every: Duration,
    /// When the last heartbeat was sent, in [`ms_since`] time.
    pub(super) last_beat_ms: AtomicU64,
    /// The connection is closed or being closed; the heartbeat thread leaves it alone.
    pub(super) gone: AtomicBool,
}

impl ConnShared {
    /// Writes one frame under the write lock, so it never interleaves with a heartbeat.
    pub(super) fn send(&self, body: &[u8]) -> io::Result<()> {
        wire::write_frame_locked(&self.write_lock, &self.stream, body)
    }
}

/// Connections that asked for heartbeats, shared with the heartbeat thread.
pub(super) type Beats = Arc<Mutex<Vec<Arc<ConnShared>>>>;

/// Sends `Heartbeat` to every waiting connection whose interval has passed, until stopped.
/// A connection whose write lock is taken is skipped: the coordinator is writing to it, and
/// those bytes are a sign of life too.
pub(super) fn heartbeat_loop(beats: Beats, stop: Receiver<()>, origin: Instant) {
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

impl Coordinator {
    /// Tells the heartbeat thread which ranks are waiting for an answer.
    pub(super) fn update_waiting(&self) {
        for conn in self.conns.values() {
            let waiting = match self.phase {
                Phase::Joining { .. } => true,
                Phase::Running => self.rounds.values().any(|r| r.data[conn.rank].is_some()),
                Phase::Aborted(_) => false,
            };
            conn.shared.waiting.store(waiting, Ordering::SeqCst);
        }
    }

    /// Declares every rank silent for its peer timeout by `now` unresponsive, in rank order.
    pub(super) fn expire_silent(&mut self, now: Instant) {
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
    }

    /// Stops heartbeats to a connection that is closing.
    pub(super) fn forget_beats(&self, shared: &Arc<ConnShared>) {
        shared.gone.store(true, Ordering::SeqCst);
        self.beats
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|c| !Arc::ptr_eq(c, shared));
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
                    // Kept open until every rank has its errors: a rank that closed early
                    // would be what its peer's all_gather reports instead of rank 2.
                    (err, waited, again, bs)
                })
            })
            .collect();
        let _silent = silent_rank(port, 2, 3, 1000);
        let results: Vec<_> = ranks.into_iter().map(|h| h.join().unwrap()).collect();
        for (err, waited, again, _bs) in results {
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
