//! The handshake on the coordinator's side: checking each `Hello`, welcoming the group once all
//! ranks are present, and failing the rendezvous.
//!
//! Contracts: the first mismatch (protocol, crate version, world size, rank out of range,
//! duplicate rank, rank that already departed) fails the whole rendezvous: the offender and
//! every rank that had joined get the same `Reject`, and so does every later arrival. A `Hello`
//! after the group formed is rejected without disturbing it. `Welcome` goes to every rank at
//! once when the last one joins, rank 0 last.

use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::liveness::ConnShared;
use super::{Conn, ConnId, Coordinator, Phase, Slot};
use crate::wire::{self, Hello, HelloMsg, PROTOCOL_VERSION, RemoteError, ServerMsg};

/// Lower bound on the write timeout used for client sockets.
const MIN_WRITE_TIMEOUT: Duration = Duration::from_secs(1);

impl Coordinator {
    /// Fails the rendezvous with a timeout naming the missing ranks once the earliest join
    /// deadline has passed by `now`.
    pub(super) fn expire_join(&mut self, now: Instant) {
        if let Phase::Joining { deadline: Some(d) } = self.phase
            && d <= now
        {
            let missing = (0..self.world_size)
                .filter(|&r| self.slots[r] == Slot::Empty)
                .collect();
            self.abort(RemoteError::Timeout { missing });
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

    /// Fails the rendezvous: every joined rank gets `error`, as will any later arrival.
    pub(super) fn abort(&mut self, error: RemoteError) {
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

    pub(super) fn on_hello(
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
}
