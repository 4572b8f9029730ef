//! Dispatch and cached dispatch: the Epoch schedule's `[E1]`..`[E7]` and the Global
//! schedule's `[G1]`..`[G5]`, as the kernels run them.
//!
//! Contract: a non-cached dispatch advances the notify sequence and publishes a fresh layout; a
//! cached one reuses the last layout. Both write their rows into the receive region that the
//! dispatch sequence's parity picks, and leave them live (re-checked by `[R]`) until the next
//! dispatch starts.

use epcomm_topology::Schedule;

use super::wait::Poll;
use super::{Layout, Live, Rank, Stop};
use crate::config::{Mutation, count_word, data_word, route_count, routes_to, split_count_word};
use crate::outcome::OpOutput;
use crate::reference::expected_rows;
use crate::step::Step;
use crate::sync::Ordering;

impl Rank<'_> {
    /// Runs one dispatch as this rank (`cached`: reusing the last layout) and returns its output.
    pub(super) fn dispatch(&mut self, cached: bool) -> Result<OpOutput, Stop> {
        let (me, wsz, tokens, blocks) = (
            self.me,
            self.world_size(),
            self.cfg.tokens(),
            self.cfg.blocks(),
        );
        let global = self.cfg.schedule() == Schedule::Global;
        self.seq.dispatch_seq += 1;
        let e = self.seq.dispatch_seq;
        // The kernels' regions: receive rows by the dispatch sequence, counts by the notify
        // sequence (non-cached dispatches only), each through `Parity::of_epoch`, under both
        // schedules.
        let parity = self.cfg.parity(e);
        if !cached {
            self.seq.notify_seq += 1;
        }
        let n = self.seq.notify_seq;
        let npar = self.cfg.parity(n);
        if global {
            // [G1] barrier: every rank finished its previous op, including reading its output.
            self.barrier(Step::G1)?;
        }
        let count_load = self.ordering(Mutation::CountLoadsRelaxed, Ordering::Acquire);
        if !cached {
            // [E1] / [G2] write my row of counts, tagged with n, into every rank. Relaxed: the
            // word carries its value and its tag, so it publishes nothing but itself.
            let write_step = if global { Step::G2 } else { Step::E1 };
            self.step(write_step)?;
            for d in 0..wsz {
                for dst in 0..wsz {
                    let word = count_word(n, route_count(e, tokens, me, dst));
                    self.write(write_step, || {
                        self.w
                            .count(d, npar, me, dst)
                            .store(word, Ordering::Relaxed);
                    })?;
                }
            }
            if global {
                // [G3] barrier: every rank's counts have landed.
                self.barrier(Step::G3)?;
            }
            let read_step = if global { Step::G4 } else { Step::E2 };
            self.step(read_step)?;
            let mut counts = vec![0u64; wsz * wsz];
            for s in 0..wsz {
                for dst in 0..wsz {
                    let word = self.w.count(me, npar, s, dst);
                    let count = if global {
                        // [G4] read counts (acquire): the barrier guarantees tag n.
                        let (tag, count) = split_count_word(word.load(count_load));
                        if tag != n {
                            return Err(self.count_tag(read_step, npar, s, dst, n, tag).into());
                        }
                        count
                    } else {
                        // [E2] wait count row: bounded wait until the tag is n (acquire; the
                        // tag equality is what validates the value).
                        self.wait(read_step, s, n, || {
                            let (tag, count) = split_count_word(word.load(count_load));
                            if tag == n {
                                Ok(Poll::Ready(count))
                            } else if tag > n {
                                Err(self.count_tag(read_step, npar, s, dst, n, tag))
                            } else {
                                Ok(Poll::Pending(tag))
                            }
                        })?
                    };
                    counts[s * wsz + dst] = self.check_count(read_step, e, s, dst, count)?;
                }
            }
            if global {
                // [G5] barrier before any data is written.
                self.barrier(Step::G5)?;
            }
            self.layout = Layout { seq: e, counts };
        }

        // [E3] compute offsets: my rows in rank d start at sum_{s<me} count(s->d); my k-th token
        // for d (in token order) goes to slot offset + k.
        self.step(Step::E3)?;
        let layout = self.layout.clone();
        let mut next: Vec<usize> = (0..wsz)
            .map(|d| (0..me).map(|s| layout.counts[s * wsz + d] as usize).sum())
            .collect();
        let mut sends = Vec::new();
        for t in 0..tokens {
            for (d, slot) in next.iter_mut().enumerate() {
                if routes_to(layout.seq, me, t, d) {
                    sends.push((t, d, *slot));
                    *slot += 1;
                }
            }
        }

        for b in 0..blocks {
            // [E4] write data (relaxed): block b sends the tokens t with t % blocks == b.
            self.step(Step::E4)?;
            for &(t, d, slot) in sends.iter().filter(|(t, _, _)| t % blocks == b) {
                self.write(Step::E4, || {
                    self.w
                        .recv(d, parity, slot)
                        .store(data_word(e, me, t), Ordering::Relaxed);
                })?;
            }
            // [E5] signal done: release increment after all of this block's data.
            self.signal_done(Step::E5)?;
        }
        self.seq.done_expected += blocks as u64;

        // [E6] wait done[s] >= expected for all s (acquire).
        if !(cached && self.cfg.has(Mutation::SkipCachedDoneWait)) {
            self.wait_done(Step::E6)?;
        }

        // [E7] read output: per-source counts (fresh dispatch: re-read the count words, which
        // must still carry tag n; cached: the cached layout), then the rows.
        self.step(Step::E7)?;
        if !cached {
            for s in 0..wsz {
                let (tag, count) = split_count_word(self.w.count(me, npar, s, me).load(count_load));
                if tag != n {
                    return Err(self.count_tag(Step::E7, npar, s, me, n, tag).into());
                }
                self.check_count(Step::E7, layout.seq, s, me, count)?;
            }
        }
        let live = Live {
            seq: e,
            parity,
            rows: expected_rows(self.cfg, layout.seq, e, me),
        };
        self.check_rows(Step::E7, &live)?;
        let output = OpOutput::Dispatch {
            seq: e,
            rows: live.rows.clone(),
        };
        self.live = Some(live);
        Ok(output)
    }
}
