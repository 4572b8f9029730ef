//! Op agreement: every op publishes one intent word per peer (`[A1]`, after `[F1]`) and checks
//! every peer's after its final wait (`[A2]`, after `[E6]`, `[C5]` or `[L5]`), so ranks that run
//! different ops (or one op with different arguments, in the kernels) fail instead of passing
//! each other's waits. The model's ranks run the same ops, so what it checks is the slots: an
//! intent word of agreed op `a` lives in `intent[a%2][src]`, and `[A2]` of op `a` must never find
//! that slot overwritten by op `a + 2` (a peer two ops ahead), whatever the interleaving.
//!
//! Contract: internode ops (model only, not run by the kernels) neither publish nor check, and
//! do not count as agreed ops. A low-latency op with masking publishes to every peer, masked
//! ones included, and checks only the peers it has not masked.

use super::violation::Violation;
use super::wait::Poll;
use super::{Rank, Stop};
use crate::config::{Mutation, OpKind};
use crate::step::Step;
use crate::sync::Ordering;

impl Rank<'_> {
    /// Whether this op takes part in op agreement.
    fn agrees(&self) -> bool {
        !self.kind.is_internode_family()
    }

    /// The intent slot of the current agreed op: its parity (one slot under
    /// [`Mutation::IntentOneSlot`]).
    fn intent_parity(&self) -> usize {
        if self.cfg.has(Mutation::IntentOneSlot) {
            0
        } else {
            (self.seq.agree_seq % 2) as usize
        }
    }

    /// This rank's intent word for the current agreed op (`agree_seq` already advanced).
    fn intent_word(&self) -> u64 {
        let kind = match self.kind {
            OpKind::Dispatch => 1,
            OpKind::CachedDispatch => 2,
            OpKind::Combine => 3,
            OpKind::LlDispatch => 4,
            OpKind::LlCombine => 5,
            _ => 0,
        };
        (self.seq.agree_seq << 32) | kind
    }

    /// `[A1]`: store this op's intent word into `intent[a%2][me]` of every peer (relaxed: the
    /// word carries its tag). Advances `agree_seq` (restored if the op fails).
    pub(super) fn publish_intent(&mut self) -> Result<(), Stop> {
        if !self.agrees() {
            return Ok(());
        }
        self.step(Step::A1)?;
        self.seq.agree_seq += 1;
        let (parity, word) = (self.intent_parity(), self.intent_word());
        for d in (0..self.world_size()).filter(|&d| d != self.me) {
            self.write(Step::A1, || {
                self.w
                    .intent(d, parity, self.me)
                    .store(word, Ordering::Relaxed);
            })?;
        }
        Ok(())
    }

    /// `[A2]`: after the final wait, every peer's intent word for this op (bounded wait for its
    /// tag) must be this rank's. A tag beyond this op's is a [`Violation::Intent`]: a peer two
    /// agreed ops ahead wrote the slot this rank still reads. Under masking a masked peer is
    /// not checked (nor one masked while its word is waited for).
    pub(super) fn check_intent(&self) -> Result<(), Stop> {
        if !self.agrees() {
            return Ok(());
        }
        self.step(Step::A2)?;
        let (a, mine, parity) = (self.seq.agree_seq, self.intent_word(), self.intent_parity());
        for s in (0..self.world_size()).filter(|&s| s != self.me && !self.is_masked(s)) {
            let word = self.w.intent(self.me, parity, s);
            self.wait_or_masked(Step::A2, s, a, Some(()), || {
                let seen = word.load(Ordering::Relaxed);
                match (seen >> 32).cmp(&a) {
                    std::cmp::Ordering::Less => Ok(Poll::Pending(seen >> 32)),
                    std::cmp::Ordering::Equal if seen == mine => Ok(Poll::Ready(())),
                    _ => Err(Violation::Intent {
                        rank: self.me,
                        op: self.op,
                        kind: self.kind,
                        peer: s,
                        expected: mine,
                        seen,
                    }),
                }
            })?;
        }
        Ok(())
    }
}
