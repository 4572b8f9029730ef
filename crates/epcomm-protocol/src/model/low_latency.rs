//! The low-latency ops (`kernels/ll/`): dispatch (`[L1]`..`[L7]`) and combine (`[L8]`, `[L4]`,
//! `[L5]`, `[L9]`), each a send phase and a receive phase of the same rank, with the Global
//! schedule's `[G1]` (send) and `[G2]` (receive) barriers.
//!
//! Contract: an LL op takes its own sequence number (`ll_dispatch` or `ll_combine`, the LL
//! epoch `l`) and uses the LL regions that `l`'s parity picks; its senders signal the same
//! monotonic `done` counters as every other op (one release increment per sender block), and
//! its receive phase waits for the cumulative target (`expected += B`) before it reads. The
//! receive phase must read exactly what this op's send phases wrote: the count word of every
//! source tagged `l` with the routing's row count, and every row of this op.
//!
//! With masking ([`crate::ModelConfig::with_ll_masking`]) the send phase skips masked
//! destinations (`[L2]`, `[L3]`, `[L8]`, not `[L4]`), and the receive phase re-reads the mask
//! after `[L5]` and treats a masked rank as absent: no rows from it (`[L6]`, `[L7]`), nothing
//! for an entry whose expert it holds (`[L9]`). The result is the sequential reference
//! without the masked ranks ([`crate::reference::sequential_reference_masked`]).
//!
//! The kernels run the two phases as two kernels on one stream (the caller keeps a hook) or as
//! one fused kernel (`kFlagFused`) that runs the receive steps right after `[L4]`. Within a
//! rank both forms execute the same steps in the same order, and the model runs the blocks of
//! a rank one after the other anyway, so the fused form *is* this model: it is not modelled
//! twice.

use epcomm_topology::Schedule;

use super::violation::{Region, Violation};
use super::{LlLive, Rank, Stop};
use crate::config::{
    Mutation, count_word, ll_combine_word, ll_route_count, ll_routes_to, ll_row_word,
    split_count_word, split_data_word,
};
use crate::outcome::OpOutput;
use crate::step::Step;
use crate::sync::Ordering;

impl Rank<'_> {
    /// Runs one low-latency dispatch as this rank: its send phase, then its receive phase;
    /// returns the packed rows.
    pub(super) fn ll_dispatch(&mut self) -> Result<OpOutput, Stop> {
        let (me, wsz, tokens, blocks) = (
            self.me,
            self.world_size(),
            self.cfg.tokens(),
            self.cfg.blocks(),
        );
        self.seq.ll_dispatch_seq += 1;
        let l = self.seq.ll_dispatch_seq;
        let parity = self.cfg.ll_parity(l);

        // ---- send phase --------------------------------------------------------------------
        // Masking: the mask as the send phase sees it (the kernels' block copy, loaded in the
        // prologue: a peer masked by the [G1] barrier below is still sent to, harmlessly).
        let sent_mask = self.mask_bits();
        let sends_to = |d: usize| (sent_mask >> d) & 1 == 0;
        if self.cfg.schedule() == Schedule::Global {
            // [G1] barrier: every rank finished its previous op, receive phase included.
            self.barrier(Step::G1)?;
        }
        // [L1] routing masks: every block derives the whole batch's routing locally; token t
        // goes to rank d at slot j, its index among my tokens for d.
        self.step(Step::L1)?;
        let mut next = vec![0usize; wsz];
        let mut sends = Vec::new();
        for t in 0..tokens {
            for (d, j) in next.iter_mut().enumerate() {
                if ll_routes_to(l, me, t, d) {
                    sends.push((t, d, *j));
                    *j += 1;
                }
            }
        }
        for b in 0..blocks {
            if b == 0 {
                // [L2] counts (block 0): (l << 32) | rows into every rank's ll_counts[l%2][me],
                // relaxed (published by this block's [L4]); a masked rank is sent nothing.
                self.step(Step::L2)?;
                for (d, &rows) in next.iter().enumerate().filter(|&(d, _)| sends_to(d)) {
                    let word = if self.cfg.has(Mutation::LlUntaggedCount) {
                        rows as u64
                    } else {
                        count_word(l, rows as u64)
                    };
                    self.write(Step::L2, || {
                        self.w
                            .ll_count(d, parity, me)
                            .store(word, Ordering::Relaxed);
                    })?;
                }
            }
            // [L3] rows (relaxed): block b sends the tokens t with t % blocks == b (none to a
            // masked rank).
            self.step(Step::L3)?;
            for &(t, d, j) in sends
                .iter()
                .filter(|&&(t, d, _)| t % blocks == b && sends_to(d))
            {
                self.write(Step::L3, || {
                    self.w
                        .ll_x(d, parity, me, j)
                        .store(ll_row_word(l, me, t), Ordering::Relaxed);
                })?;
            }
            // [L4] signal done: release increment after this block's rows (and counts), to
            // every rank, masked ones included.
            self.signal_done(Step::L4)?;
        }
        self.seq.done_expected += blocks as u64;

        // ---- receive phase (the fused kernel runs the same steps right here) ---------------
        self.ll_await_sends()?;
        // Masking: the mask re-read after the waits, which may have masked sources.
        let absent = self.mask_bits();
        let keep_masked = self.cfg.has(Mutation::LlMaskedCountsKept);
        // [L6] first rows: the tagged counts (relaxed: [L5]'s acquire published them); the tag
        // must be l and the count the routing's. A masked source counts no rows (its count
        // word is not read: it may be stale, or this op's without the done signal that
        // publishes its rows).
        self.step(Step::L6)?;
        let mut counts = vec![0u64; wsz];
        for (s, count) in counts.iter_mut().enumerate() {
            let masked = (absent >> s) & 1 == 1;
            if masked && !keep_masked {
                continue;
            }
            let word = self.w.ll_count(me, parity, s).load(Ordering::Relaxed);
            let (tag, rows) = split_count_word(word);
            if tag != l && masked {
                // LlMaskedCountsKept: the kernels' count wait gives 0 for a masked source
                // whose word is not this op's.
                continue;
            }
            if tag != l {
                return Err(Violation::LlCountTag {
                    rank: me,
                    op: self.op,
                    kind: self.kind,
                    step: Step::L6,
                    parity,
                    src: s,
                    expected: l,
                    found: tag,
                }
                .into());
            }
            let expected = ll_route_count(l, tokens, s, me);
            *count = self.check_count_value(Step::L6, expected, s, me, rows)?;
        }
        // [L7] pack: copy each source's rows (relaxed), by source then slot.
        self.step(Step::L7)?;
        let mut rows = Vec::new();
        for (s, &count) in counts.iter().enumerate() {
            let mine = (0..tokens).filter(|&t| ll_routes_to(l, s, t, me));
            for (j, t) in mine.enumerate().take(count as usize) {
                let expected = ll_row_word(l, s, t);
                let found = self.w.ll_x(me, parity, s, j).load(Ordering::Relaxed);
                if found != expected {
                    let slot = s * tokens + j;
                    return Err(self
                        .data_violation(Step::L7, Region::LlX, parity, slot, expected, found)
                        .into());
                }
                rows.push(found);
            }
        }
        self.ll_live = Some(LlLive {
            seq: l,
            rows: rows.clone(),
        });
        Ok(OpOutput::LlDispatch { seq: l, rows })
    }

    /// Runs one low-latency combine as this rank: the rows of the last LL dispatch go back to
    /// their owners (send phase), which reduce them (receive phase).
    pub(super) fn ll_combine(&mut self) -> Result<OpOutput, Stop> {
        let (me, wsz, tokens, blocks) = (
            self.me,
            self.world_size(),
            self.cfg.tokens(),
            self.cfg.blocks(),
        );
        self.seq.ll_combine_seq += 1;
        let c = self.seq.ll_combine_seq;
        let parity = self.cfg.ll_parity(c);
        let live = self.ll_live.clone().unwrap_or_default();

        // ---- send phase --------------------------------------------------------------------
        // Masking: the mask as the send phase sees it (the prologue's copy, as in dispatch).
        let sent_mask = self.mask_bits();
        if self.cfg.schedule() == Schedule::Global {
            // [G1] barrier: every rank finished its previous op, receive phase included.
            self.barrier(Step::G1)?;
        }
        for b in 0..blocks {
            // [L8] combine rows: block b returns packed rows r with r % blocks == b to their
            // source's ll_comb[c%2][token][k = me] (relaxed); none to a masked source.
            self.step(Step::L8)?;
            for &row in live.rows.iter().skip(b).step_by(blocks) {
                let (_, owner, token) = split_data_word(row);
                if (sent_mask >> owner) & 1 == 1 {
                    continue;
                }
                self.write(Step::L8, || {
                    self.w
                        .ll_comb(owner, parity, token, me)
                        .store(ll_combine_word(c, me, row), Ordering::Relaxed);
                })?;
            }
            // [L4] signal done: release increment after this block's rows, to every rank.
            self.signal_done(Step::L4)?;
        }
        self.seq.done_expected += blocks as u64;

        // ---- receive phase ---------------------------------------------------------------
        self.ll_await_sends()?;
        // Masking: the mask re-read after the waits; an entry whose expert's rank is masked
        // contributes nothing (its combine row is not read).
        let absent = if self.cfg.has(Mutation::LlMaskedEntriesReduced) {
            0
        } else {
            self.mask_bits()
        };
        // [L9] reduce: per token, its valid top-k slots (the ranks it went to) in increasing k.
        self.step(Step::L9)?;
        let mut reduced = vec![0u64; tokens];
        for (t, acc) in reduced.iter_mut().enumerate() {
            let row = ll_row_word(live.seq, me, t);
            let entries = (0..wsz).filter(|&k| ll_routes_to(live.seq, me, t, k));
            for k in entries.filter(|&k| (absent >> k) & 1 == 0) {
                let expected = ll_combine_word(c, k, row);
                let found = self.w.ll_comb(me, parity, t, k).load(Ordering::Relaxed);
                if found != expected {
                    let slot = t * wsz + k;
                    return Err(self
                        .data_violation(Step::L9, Region::LlComb, parity, slot, expected, found)
                        .into());
                }
                *acc = acc.wrapping_add(found);
            }
        }
        Ok(OpOutput::LlCombine { seq: c, reduced })
    }

    /// The start of every LL receive phase: `[G2]` (Global) and `[L5]`, the wait for the
    /// cumulative done target the send phase left (dropped by [`Mutation::LlSkipDoneWait`]).
    fn ll_await_sends(&mut self) -> Result<(), Stop> {
        if self.cfg.schedule() == Schedule::Global {
            // [G2] barrier: starts the receive phase under the Global schedule.
            self.barrier(Step::G2)?;
        }
        if self.cfg.has(Mutation::LlSkipDoneWait) {
            self.step(Step::L5)
        } else {
            // [L5] wait done[s] >= expected for all s (acquire).
            self.wait_done(Step::L5)
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use crate::config::{ModelConfig, Mutation, OpKind::*};
    use crate::model::{NoHook, Violation, run_model};
    use crate::reference::sequential_reference;
    use crate::step::Step;
    use epcomm_topology::Schedule;

    #[test]
    fn low_latency_mixes_match_the_reference() {
        for schedule in Schedule::ALL {
            for ops in [
                vec![LlDispatch, LlCombine, LlDispatch, LlCombine],
                vec![LlDispatch, LlDispatch, LlCombine, LlCombine, LlDispatch],
                vec![
                    Dispatch,
                    LlDispatch,
                    Combine,
                    LlCombine,
                    CachedDispatch,
                    Combine,
                ],
            ] {
                let cfg = ModelConfig::new(3, 4, 2, schedule, ops).unwrap();
                let got = run_model(&cfg, &NoHook).unwrap_or_else(|f| panic!("{cfg:?}: {f}"));
                assert_eq!(got, sequential_reference(&cfg));
            }
        }
    }

    #[test]
    fn an_untagged_count_word_is_rejected() {
        let cfg = ModelConfig::new(2, 2, 1, Schedule::Epoch, vec![LlDispatch])
            .unwrap()
            .with_mutation(Mutation::LlUntaggedCount);
        let failure = run_model(&cfg, &NoHook).unwrap_err();
        assert!(
            matches!(
                failure.violations[0],
                Violation::LlCountTag {
                    step: Step::L6,
                    expected: 1,
                    found: 0,
                    ..
                }
            ),
            "{failure}"
        );
    }
}
