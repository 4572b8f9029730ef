//! The round table: matching each rank's n-th collective call into round n, answering a
//! complete round and failing a round as a whole.
//!
//! Contracts: a round completes when every rank contributed the same call (kind, tag and, for
//! broadcast, root); its `OpOk` goes to every rank, rank 0 last. A round fails with one error
//! for everyone: at its earliest deadline (timeout naming the ranks missing), on a mismatch, on
//! a result larger than a frame, or when a rank that has not contributed departs; ranks that
//! arrive at a failed round get the same `OpErr` at once, and no new round can start once a
//! rank has departed. A rank that breaks the protocol (contributes twice, sends an op before
//! the group formed) is cut off like a dead one.

use std::time::Instant;

use super::{ConnId, Coordinator, Phase, Slot};
use crate::error::OpKind;
use crate::wire::{self, MAX_FRAME, OpMsg, RemoteError, ServerMsg};

#[derive(Debug)]
pub(super) struct Round {
    pub(super) kind: OpKind,
    pub(super) tag: String,
    pub(super) root: usize,
    pub(super) first_rank: usize,
    pub(super) data: Vec<Option<Vec<u8>>>,
    pub(super) deadline: Instant,
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
pub(super) struct FailedRound {
    pub(super) error: RemoteError,
    pub(super) notified: Vec<bool>,
}

impl Coordinator {
    /// Fails every round whose deadline has passed by `now` with a timeout naming the ranks
    /// that have not contributed.
    pub(super) fn expire_rounds(&mut self, now: Instant) {
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

    /// The error that makes every new round impossible, if some rank has gone.
    fn departed_error(&self) -> Option<RemoteError> {
        self.slots
            .iter()
            .enumerate()
            .find_map(|(rank, s)| s.departure_error(rank))
    }

    pub(super) fn on_op(&mut self, id: ConnId, op: OpMsg) {
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

    /// Ends round `seq` with `error` for everyone: ranks already waiting get it now, ranks
    /// arriving later get it on arrival.
    pub(super) fn fail_round(&mut self, seq: u64, error: RemoteError) {
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
    pub(super) fn collect_failed(&mut self) {
        let slots = &self.slots;
        self.failed.retain(|_, f| {
            slots
                .iter()
                .zip(&f.notified)
                .any(|(s, &n)| matches!(s, Slot::Joined(_)) && !n)
        });
    }
}
