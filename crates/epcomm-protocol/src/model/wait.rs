//! The bounded waits and what they wait for: the done counters (`[E5]`/`[C2]` signal,
//! `[E6]`/`[C5]` wait) and the round-aware barrier of the Global schedule (`[G1]`, `[G3]`,
//! `[G5]`).
//!
//! Contract: every wait gives up with [`OpError::Aborted`] as soon as this rank or a peer
//! failed (unless [`Mutation::SkipAbortPoll`] is applied); under std it also ends with
//! [`Violation::Timeout`] after the configured timeout, or [`Violation::PeerFailed`] when
//! another rank already reported a violation. Under loom a wait is a `yield_now` loop, so a
//! schedule in which nobody can progress is reported as a deadlock. A wait for a rank that
//! stopped ([`crate::config::StoppedRank`]) expires instead: it masks the rank in a
//! low-latency op with masking (the wait then ends as if satisfied, and so does every later
//! wait of such ops for it), and fails the op with [`OpError::Expired`] otherwise.

use super::violation::{OpError, Violation};
use super::{Rank, Stop};
use crate::config::Mutation;
use crate::step::Step;
use crate::sync::{AtomicU64, Ordering, spin_wait};

/// What one poll of a waited-on word found.
pub(super) enum Poll<T> {
    /// The word is ready; the value the wait returns.
    Ready(T),
    /// Not yet: the value (or epoch) seen, reported if the wait times out.
    Pending(u64),
}

impl Rank<'_> {
    /// Bounded spin-wait on `peer`'s word; `poll` loads it and says whether it is ready. Gives
    /// up ([`OpError::Aborted`]) when this rank or a peer failed. Never ends masked: for the
    /// waits of ops that do not mask.
    pub(super) fn wait<T>(
        &self,
        step: Step,
        peer: usize,
        expected: u64,
        poll: impl FnMut() -> Result<Poll<T>, Violation>,
    ) -> Result<T, Stop> {
        self.wait_or_masked(step, peer, expected, None, poll)
    }

    /// [`Rank::wait`] for a wait that masking may end. When the op masks ([`Rank::masks`]),
    /// `if_masked` is what the wait returns for a masked peer (the kernels' waits return
    /// "reached", or the value 0): at once once `peer` is masked, and after masking `peer`
    /// when the wait expires on it. `None`: the wait never ends masked.
    ///
    /// A wait expires only on a peer that stopped ([`Rank::peer_stopped`]; std: after the
    /// configured timeout, loom: at once) and, after one more poll (the peer's last stores are
    /// visible once it is seen stopped), finds the word still not ready: with masking it
    /// masks the peer, otherwise the op fails with [`OpError::Expired`]. Under std a wait that
    /// outlasts the timeout on a live peer is a [`Violation::Timeout`].
    pub(super) fn wait_or_masked<T>(
        &self,
        step: Step,
        peer: usize,
        expected: u64,
        if_masked: Option<T>,
        mut poll: impl FnMut() -> Result<Poll<T>, Violation>,
    ) -> Result<T, Stop> {
        let mut if_masked = if_masked.filter(|_| self.masks() && peer != self.me);
        // Under loom a wait is bounded only by the abort word and a stopped peer (loom
        // reports a schedule where nobody can progress); std runs also time out.
        #[cfg(loom)]
        let _ = expected;
        #[cfg(not(loom))]
        let start = std::time::Instant::now();
        #[cfg(not(loom))]
        let mut spins: u32 = 0;
        loop {
            let _seen = match poll()? {
                Poll::Ready(value) => return Ok(value),
                Poll::Pending(seen) => seen,
            };
            // Masking: a masked peer is not waited for (the kernels' `peer_masked`).
            if self.is_masked(peer)
                && let Some(value) = if_masked.take()
            {
                return Ok(value);
            }
            if !self.ignores_abort(step)
                && let Some(by) = self.failure_seen()
            {
                return Err(Stop::Failed(OpError::Aborted { step, peer, by }));
            }
            #[cfg(loom)]
            let expired = self.peer_stopped(peer);
            #[cfg(not(loom))]
            let expired = {
                let failed = self.w.failed.load(std::sync::atomic::Ordering::Acquire);
                if failed != usize::MAX {
                    return Err(Violation::PeerFailed {
                        rank: self.me,
                        op: self.op,
                        kind: self.kind,
                        step,
                        peer,
                        failed,
                    }
                    .into());
                }
                spins = spins.wrapping_add(1);
                if spins.is_multiple_of(64) && start.elapsed() > self.cfg.wait_timeout() {
                    if !self.peer_stopped(peer) {
                        let waited = start.elapsed();
                        return Err(Violation::Timeout {
                            rank: self.me,
                            op: self.op,
                            kind: self.kind,
                            step,
                            peer,
                            expected,
                            seen: _seen,
                            waited_ms: u64::try_from(waited.as_millis()).unwrap_or(u64::MAX),
                        }
                        .into());
                    }
                    true
                } else {
                    false
                }
            };
            if expired {
                if let Poll::Ready(value) = poll()? {
                    return Ok(value);
                }
                return match if_masked.take() {
                    // Masking: the expired peer is masked instead of failing the op.
                    Some(value) => {
                        self.mask_peer(peer);
                        Ok(value)
                    }
                    None => Err(Stop::Failed(OpError::Expired { step, peer })),
                };
            }
            spin_wait();
        }
    }

    /// Whether the wait at `step` stops polling the abort word (a mutation).
    fn ignores_abort(&self, step: Step) -> bool {
        self.cfg.has(Mutation::SkipAbortPoll)
            || (step == Step::I8 && self.cfg.has(Mutation::InterForwarderIgnoresAbort))
    }

    /// Round-aware barrier: bump `barrier[me]` on every rank, wait for `barrier[s] >= round`.
    pub(super) fn barrier(&mut self, step: Step) -> Result<(), Stop> {
        self.step(step)?;
        self.seq.barrier_round += 1;
        let round = self.seq.barrier_round;
        for r in 0..self.world_size() {
            self.write(step, || {
                self.w.ranks[r].barrier[self.me].fetch_add(1, Ordering::Release);
            })?;
        }
        for s in 0..self.world_size() {
            self.wait_geq(
                step,
                s,
                &self.w.ranks[self.me].barrier[s],
                round,
                Ordering::Acquire,
            )?;
        }
        Ok(())
    }

    /// Bounded wait until `word` (written by `peer`) reaches `target`, loading with `order`;
    /// under masking it also ends when `peer` is (or gets) masked.
    pub(super) fn wait_geq(
        &self,
        step: Step,
        peer: usize,
        word: &AtomicU64,
        target: u64,
        order: Ordering,
    ) -> Result<(), Stop> {
        self.wait_or_masked(step, peer, target, Some(()), || {
            let seen = word.load(order);
            Ok(if seen >= target {
                Poll::Ready(())
            } else {
                Poll::Pending(seen)
            })
        })
    }

    /// `[E6]`/`[C5]`: wait until every source signalled all its blocks of this op.
    pub(super) fn wait_done(&self, step: Step) -> Result<(), Stop> {
        self.step(step)?;
        let expected = self.seq.done_expected;
        let order = self.ordering(Mutation::DoneWaitRelaxed, Ordering::Acquire);
        for s in 0..self.world_size() {
            self.wait_geq(step, s, &self.w.ranks[self.me].done[s], expected, order)?;
        }
        self.check_intent()
    }

    /// `[E5]`/`[C2]`: one sender block is finished with all its data for every destination
    /// (combine: and with its reductions).
    pub(super) fn signal_done(&self, step: Step) -> Result<(), Stop> {
        self.step(step)?;
        let order = self.ordering(Mutation::DoneAddRelaxed, Ordering::Release);
        for d in 0..self.world_size() {
            self.write(step, || {
                self.w.ranks[d].done[self.me].fetch_add(1, order);
            })?;
        }
        Ok(())
    }
}
