//! The collectives: [`Bootstrap::all_gather`], [`Bootstrap::broadcast`] and
//! [`Bootstrap::barrier`], each one round of the coordinator's round table.
//!
//! Contract: arguments are checked locally before anything is sent (tag length, payload size,
//! broadcast root); a call on a broken connection fails at once with
//! [`BootstrapError::ConnectionBroken`]; otherwise the call sends one `Op` and waits for the
//! answer to that sequence number, at most the timeout plus a grace period.

use std::io;
use std::sync::PoisonError;
use std::time::{Duration, Instant};

use super::remote_error::remote_error;
use super::{Bootstrap, COORDINATOR_GRACE, MAX_PAYLOAD, MAX_TAG_LEN};
use crate::error::{BootstrapError, OpKind, Result};
use crate::wire::{self, ClientMsg, OpMsg, ServerMsg};

impl Bootstrap {
    /// Gathers `data` from every rank; element `r` of the result is rank `r`'s contribution.
    ///
    /// Contributions may differ in length. Fails with [`BootstrapError::Timeout`] if some rank
    /// does not arrive within the timeout, [`BootstrapError::PeerDied`] /
    /// [`BootstrapError::PeerLeft`] if a rank is gone, [`BootstrapError::OpMismatch`] if ranks
    /// called different collectives or tags in this round.
    pub fn all_gather(&self, tag: &str, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let out = self.collective(OpKind::AllGather, tag, 0, data)?;
        self.expect_len(OpKind::AllGather, tag, out, self.world_size)
    }

    /// Sends `root`'s data to every rank and returns it (on the root too).
    ///
    /// The root must pass `Some(data)`; other ranks' `data` is ignored and may be `None`.
    /// `root` must be below `world_size` and the same on all ranks. Errors as for
    /// [`Bootstrap::all_gather`].
    pub fn broadcast(&self, tag: &str, root: usize, data: Option<&[u8]>) -> Result<Vec<u8>> {
        if root >= self.world_size {
            return Err(BootstrapError::InvalidArgument {
                op: OpKind::Broadcast,
                argument: "root",
                rule: format!("root {root} must be below world_size {}", self.world_size),
            });
        }
        let data = match (self.rank == root, data) {
            (true, None) => {
                return Err(BootstrapError::InvalidArgument {
                    op: OpKind::Broadcast,
                    argument: "data",
                    rule: format!("rank {root} is the root and must supply Some(data)"),
                });
            }
            (true, Some(d)) => d,
            (false, _) => &[],
        };
        let out = self.collective(OpKind::Broadcast, tag, root, data)?;
        let mut out = self.expect_len(OpKind::Broadcast, tag, out, 1)?;
        Ok(out.pop().unwrap_or_default())
    }

    /// Returns once every rank has entered the barrier with the same tag.
    /// Errors as for [`Bootstrap::all_gather`].
    pub fn barrier(&self, tag: &str) -> Result<()> {
        let out = self.collective(OpKind::Barrier, tag, 0, &[])?;
        self.expect_len(OpKind::Barrier, tag, out, 0).map(|_| ())
    }

    fn expect_len(
        &self,
        op: OpKind,
        tag: &str,
        out: Vec<Vec<u8>>,
        want: usize,
    ) -> Result<Vec<Vec<u8>>> {
        if out.len() == want {
            return Ok(out);
        }
        Err(BootstrapError::Protocol {
            detail: format!(
                "{op} (tag {tag:?}) result has {} payloads, expected {want}",
                out.len()
            ),
        })
    }

    fn collective(&self, op: OpKind, tag: &str, root: usize, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        if tag.len() > MAX_TAG_LEN {
            return Err(BootstrapError::InvalidArgument {
                op,
                argument: "tag",
                rule: format!("{} bytes exceeds the limit of {MAX_TAG_LEN}", tag.len()),
            });
        }
        if data.len() > MAX_PAYLOAD {
            return Err(BootstrapError::PayloadTooLarge {
                op,
                tag: tag.to_string(),
                size: data.len() as u64,
                limit: MAX_PAYLOAD as u64,
            });
        }
        let mut guard = self.channel.lock().unwrap_or_else(PoisonError::into_inner);
        let ch = &mut *guard;
        if let Some(cause) = &ch.broken {
            return Err(BootstrapError::ConnectionBroken {
                op,
                tag: tag.to_string(),
                cause: cause.clone(),
            });
        }
        let seq = ch.next_seq;
        ch.next_seq += 1;
        let start = Instant::now();
        let body = wire::encode_client(&ClientMsg::Op(OpMsg {
            seq,
            kind: op,
            tag: tag.to_string(),
            root,
            data: data.to_vec(),
        }));
        let _ = ch.link.stream.set_write_timeout(Some(self.write_timeout));
        if let Err(e) = ch.link.send(&body) {
            ch.broken = Some(format!("sending {op} (tag {tag:?}) failed: {e}"));
            // The coordinator may have said why it went away before closing.
            ch.last_heard = Instant::now();
            let peek = Instant::now() + Duration::from_millis(50);
            let stalled = matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            );
            return Err(match ch.receive(op, tag, seq, start, peek) {
                Ok(ServerMsg::Shutdown) => BootstrapError::PeerLeft {
                    rank: 0,
                    op,
                    tag: tag.into(),
                },
                // The coordinator accepted no bytes for the whole write timeout.
                _ if stalled => BootstrapError::PeerUnresponsive {
                    rank: 0,
                    op,
                    tag: tag.to_string(),
                    silent_for: self.write_timeout,
                },
                _ => BootstrapError::PeerDied {
                    rank: 0,
                    op,
                    tag: tag.to_string(),
                },
            });
        }
        // The coordinator may have been silent while we were not listening; count from now.
        ch.last_heard = Instant::now();
        let deadline = start + self.timeout + COORDINATOR_GRACE;
        loop {
            match ch.receive(op, tag, seq, start, deadline)? {
                ServerMsg::OpOk { seq: s, payloads } if s == seq => return Ok(payloads),
                ServerMsg::OpErr { seq: s, error } if s == seq => {
                    return Err(remote_error(error, op, tag, seq, start.elapsed()));
                }
                // Late answer to an earlier op this rank gave up on.
                ServerMsg::OpOk { seq: s, .. } | ServerMsg::OpErr { seq: s, .. } if s < seq => {}
                ServerMsg::Shutdown => {
                    ch.broken = Some("the coordinator (rank 0) shut down".into());
                    return Err(BootstrapError::PeerLeft {
                        rank: 0,
                        op,
                        tag: tag.to_string(),
                    });
                }
                other => {
                    let detail = format!("unexpected message during {op} round {seq}: {other:?}");
                    ch.broken = Some(detail.clone());
                    return Err(BootstrapError::Protocol { detail });
                }
            }
        }
    }
}
