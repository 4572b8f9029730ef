//! Combine: `[C1]`..`[C5]` (and the Global schedule's `[G1]` barrier), as the kernels run them.
//!
//! Contract: the rows returned are the live output of the last dispatch; each is sent back to
//! the rank that owns its token into the combine region that the combine sequence's parity
//! picks, and every rank reduces its own tokens in rank order.

use epcomm_topology::Schedule;

use super::violation::Region;
use super::{Rank, Stop};
use crate::config::{Mutation, combine_word, data_word, routes_to, split_data_word};
use crate::outcome::OpOutput;
use crate::step::Step;
use crate::sync::Ordering;

impl Rank<'_> {
    /// Runs one combine op as this rank and returns its output.
    pub(super) fn combine(&mut self) -> Result<OpOutput, Stop> {
        let (me, wsz, tokens, blocks) = (
            self.me,
            self.world_size(),
            self.cfg.tokens(),
            self.cfg.blocks(),
        );
        self.seq.combine_seq += 1;
        let c = self.seq.combine_seq;
        let parity = self.cfg.parity(c);
        if self.cfg.schedule() == Schedule::Global {
            // [G1] barrier: every rank finished its previous op.
            self.barrier(Step::G1)?;
        }
        let live = self.live.clone().unwrap_or_default();
        let flag_store = self.ordering(Mutation::FlagStoreRelaxed, Ordering::Release);
        let mut local: Vec<Option<u64>> = vec![None; tokens];
        // The kernel's blocks run concurrently, each one push -> reduce -> [C2]; the model runs
        // them as one of their interleavings: every block's push first (a block's reduction may
        // wait for contributions that a peer's later block pushes), then per block its
        // reduction and its done signal.
        for b in 0..blocks {
            // [C1] write contributions: block b returns rows r with r % blocks == b, read from
            // the live dispatch output, to their owner's comb[c%2][me][token] (relaxed), each
            // followed by the owner's per-token flag flags[me][token] := c (release).
            self.step(Step::C1)?;
            for (slot, &expected) in live
                .rows
                .iter()
                .enumerate()
                .filter(|(r, _)| r % blocks == b)
            {
                let row = self.w.recv(me, live.parity, slot).load(Ordering::Relaxed);
                if row != expected {
                    return Err(self
                        .data_violation(Step::C1, Region::Recv, live.parity, slot, expected, row)
                        .into());
                }
                let (_, owner, token) = split_data_word(row);
                let value = combine_word(c, me, row);
                if owner == me {
                    local[token] = Some(value);
                } else {
                    self.write(Step::C1, || {
                        self.w
                            .comb(owner, parity, me, token)
                            .store(value, Ordering::Relaxed);
                        self.w.flag(owner, me, token).store(c, flag_store);
                    })?;
                }
            }
        }
        self.seq.done_expected += blocks as u64;

        let flag_load = self.ordering(Mutation::FlagWaitRelaxed, Ordering::Acquire);
        let row_seq = live.seq;
        let layout_seq = self.layout.seq;
        let mut reduced = vec![0u64; tokens];
        for b in 0..blocks {
            let mine: Vec<usize> = (0..tokens).filter(|t| t % blocks == b).collect();
            // [C3] wait flags[s][t] >= c (acquire) for exactly the ranks s that hold a
            // contribution to my token t (known locally from the layout).
            self.step(Step::C3)?;
            for &t in &mine {
                for s in (0..wsz).filter(|&s| s != me && routes_to(layout_seq, me, t, s)) {
                    self.wait_geq(Step::C3, s, self.w.flag(me, s, t), c, flag_load)?;
                }
            }
            // [C4] reduce in rank order: comb[c%2][s][t] for s != me, local data for s == me.
            self.step(Step::C4)?;
            for &t in &mine {
                let row = data_word(row_seq, me, t);
                let mut acc = 0u64;
                for s in (0..wsz).filter(|&s| routes_to(layout_seq, me, t, s)) {
                    let expected = combine_word(c, s, row);
                    let (found, region, slot) = if s == me {
                        // Local row: a missing one reads as 0 (slot = the token index).
                        (local[t].unwrap_or(0), Region::Recv, t)
                    } else {
                        let v = self.w.comb(me, parity, s, t).load(Ordering::Relaxed);
                        (v, Region::Comb, s * tokens + t)
                    };
                    if found != expected {
                        return Err(self
                            .data_violation(Step::C4, region, parity, slot, expected, found)
                            .into());
                    }
                    acc = acc.wrapping_add(found);
                }
                reduced[t] = acc;
            }
            // [C2] signal done: release increment after this block's contributions and
            // reductions.
            self.signal_done(Step::C2)?;
        }

        // [C5] wait done[s] >= expected for all s (acquire): every peer finished this combine,
        // including its reads of my contributions, before I start the next op.
        if !self.cfg.has(Mutation::SkipFinalWait) {
            self.wait_done(Step::C5)?;
        }
        Ok(OpOutput::Combine { seq: c, reduced })
    }
}
