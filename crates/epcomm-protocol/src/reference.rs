//! The sequential expectation: what every rank must output if the ops ran one at a time
//! (the outcome rules, [`crate::check_outcome`], judge a run's results against it).

use crate::config::{
    ModelConfig, OpKind, combine_word, data_word, inter_combine_word, ll_combine_word,
    ll_routes_to, ll_row_word, routes_to,
};

pub use crate::outcome::{OpError, OpOutput, OpResult, OutcomeViolation, RankReport};

/// The rows rank `me` receives in a dispatch with sequence `seq` under layout `layout_seq`.
pub(crate) fn expected_rows(cfg: &ModelConfig, layout_seq: u64, seq: u64, me: usize) -> Vec<u64> {
    let mut rows = Vec::new();
    for s in 0..cfg.world() {
        for t in 0..cfg.tokens() {
            if routes_to(layout_seq, s, t, me) {
                rows.push(data_word(seq, s, t));
            }
        }
    }
    rows
}

/// The packed rows rank `me` receives in the low-latency dispatch `ll_seq`: by source, then
/// token; none from the ranks of `absent` (bit `s`: source `s` masked).
pub(crate) fn expected_ll_rows(cfg: &ModelConfig, ll_seq: u64, me: usize, absent: u64) -> Vec<u64> {
    let mut rows = Vec::new();
    for s in (0..cfg.world()).filter(|&s| (absent >> s) & 1 == 0) {
        for t in 0..cfg.tokens() {
            if ll_routes_to(ll_seq, s, t, me) {
                rows.push(ll_row_word(ll_seq, s, t));
            }
        }
    }
    rows
}

/// What rank `me` reduces for its token `token` in the LL combine `ll_combine_seq` that
/// returns the rows of the LL dispatch `ll_seq`; the entries whose expert is on a rank of
/// `absent` (bit `k`: rank `k` masked) contribute nothing.
pub(crate) fn expected_ll_reduction(
    cfg: &ModelConfig,
    ll_seq: u64,
    ll_combine_seq: u64,
    me: usize,
    token: usize,
    absent: u64,
) -> u64 {
    let row = ll_row_word(ll_seq, me, token);
    (0..cfg.world())
        .filter(|&k| ll_routes_to(ll_seq, me, token, k) && (absent >> k) & 1 == 0)
        .fold(0u64, |acc, k| {
            acc.wrapping_add(ll_combine_word(ll_combine_seq, k, row))
        })
}

/// What rank `me` reduces for its token `token` in the internode combine `inter_combine_seq`
/// that returns the rows of the internode dispatch `inter_seq` under the layout `layout_seq`:
/// the wrapping sum of one [`inter_combine_word`] per rank the token went to. The hierarchical
/// path groups the contributors of each other node into one partial; the sum is the same.
pub(crate) fn expected_inter_reduction(
    cfg: &ModelConfig,
    layout_seq: u64,
    inter_seq: u64,
    inter_combine_seq: u64,
    me: usize,
    token: usize,
) -> u64 {
    let row = data_word(inter_seq, me, token);
    (0..cfg.world())
        .filter(|&d| routes_to(layout_seq, me, token, d))
        .fold(0u64, |acc, d| {
            acc.wrapping_add(inter_combine_word(inter_combine_seq, d, row))
        })
}

/// Computes the sequential expectation for every rank of `cfg`.
pub fn sequential_reference(cfg: &ModelConfig) -> Vec<RankReport> {
    // The reference ignores any injected failure or stopped rank: it is what every op must
    // produce if it completes at all, with every rank present.
    sequential_reference_masked(cfg, |_| 0)
}

/// The sequential expectation of `cfg` when the low-latency ops treat some ranks as absent
/// (masked): `absent(op)` is the set of op `op` (bit `r`: rank `r`), used only by
/// [`OpKind::LlDispatch`] and [`OpKind::LlCombine`]. An LL dispatch receives no rows from an
/// absent source; an LL combine adds nothing for an entry whose expert is on an absent rank
/// (the rows it returns are those its last LL dispatch received, which that dispatch's own set
/// decided). With `absent = |_| 0` this is [`sequential_reference`]. A rank's own entries mean
/// something only for the ops in which it is not absent itself.
pub fn sequential_reference_masked(
    cfg: &ModelConfig,
    absent: impl Fn(usize) -> u64,
) -> Vec<RankReport> {
    (0..cfg.world())
        .map(|me| {
            let mut dispatch_seq = 0u64;
            let mut combine_seq = 0u64;
            let mut layout_seq = 0u64;
            let mut ll_seq = 0u64;
            let mut ll_combine_seq = 0u64;
            let mut inter_seq = 0u64;
            let mut inter_layout_seq = 0u64;
            let mut inter_combine_seq = 0u64;
            let mut outputs = Vec::with_capacity(cfg.ops().len());
            for (index, op) in cfg.ops().iter().enumerate() {
                match op {
                    OpKind::InternodeDispatch | OpKind::InternodeCachedDispatch => {
                        // The hierarchical path delivers exactly the flat dispatch's rows.
                        inter_seq += 1;
                        if *op == OpKind::InternodeDispatch {
                            inter_layout_seq = inter_seq;
                        }
                        outputs.push(Ok(OpOutput::Dispatch {
                            seq: inter_seq,
                            rows: expected_rows(cfg, inter_layout_seq, inter_seq, me),
                        }));
                    }
                    OpKind::InternodeCombine => {
                        inter_combine_seq += 1;
                        let reduced = (0..cfg.tokens())
                            .map(|t| {
                                expected_inter_reduction(
                                    cfg,
                                    inter_layout_seq,
                                    inter_seq,
                                    inter_combine_seq,
                                    me,
                                    t,
                                )
                            })
                            .collect();
                        outputs.push(Ok(OpOutput::Combine {
                            seq: inter_combine_seq,
                            reduced,
                        }));
                    }
                    OpKind::Dispatch | OpKind::CachedDispatch => {
                        dispatch_seq += 1;
                        if *op == OpKind::Dispatch {
                            layout_seq = dispatch_seq;
                        }
                        outputs.push(Ok(OpOutput::Dispatch {
                            seq: dispatch_seq,
                            rows: expected_rows(cfg, layout_seq, dispatch_seq, me),
                        }));
                    }
                    OpKind::Combine => {
                        combine_seq += 1;
                        let reduced = (0..cfg.tokens())
                            .map(|t| {
                                let row = data_word(dispatch_seq, me, t);
                                (0..cfg.world())
                                    .filter(|&d| routes_to(layout_seq, me, t, d))
                                    .fold(0u64, |acc, d| {
                                        acc.wrapping_add(combine_word(combine_seq, d, row))
                                    })
                            })
                            .collect();
                        outputs.push(Ok(OpOutput::Combine {
                            seq: combine_seq,
                            reduced,
                        }));
                    }
                    OpKind::LlDispatch => {
                        ll_seq += 1;
                        outputs.push(Ok(OpOutput::LlDispatch {
                            seq: ll_seq,
                            rows: expected_ll_rows(cfg, ll_seq, me, absent(index)),
                        }));
                    }
                    OpKind::LlCombine => {
                        ll_combine_seq += 1;
                        let reduced = (0..cfg.tokens())
                            .map(|t| {
                                let absent = absent(index);
                                expected_ll_reduction(cfg, ll_seq, ll_combine_seq, me, t, absent)
                            })
                            .collect();
                        outputs.push(Ok(OpOutput::LlCombine {
                            seq: ll_combine_seq,
                            reduced,
                        }));
                    }
                }
            }
            RankReport { rank: me, outputs }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{OpKind::*, route_count};
    use epcomm_topology::Schedule;

    #[test]
    fn dispatch_rows_match_counts() {
        let cfg = ModelConfig::new(
            3,
            4,
            1,
            Schedule::Epoch,
            vec![Dispatch, CachedDispatch, Combine],
        )
        .unwrap();
        let reps = sequential_reference(&cfg);
        assert_eq!(reps.len(), 3);
        for (me, r) in reps.iter().enumerate() {
            let total: u64 = (0..3).map(|s| route_count(1, 4, s, me)).sum();
            let Ok(OpOutput::Dispatch { seq, rows }) = &r.outputs[0] else {
                panic!("op 0 is a dispatch")
            };
            assert_eq!(*seq, 1);
            assert_eq!(rows.len() as u64, total);
            // The cached dispatch keeps the layout but carries its own sequence number.
            let Ok(OpOutput::Dispatch { seq, rows: cached }) = &r.outputs[1] else {
                panic!("op 1 is a dispatch")
            };
            assert_eq!(*seq, 2);
            assert_eq!(cached.len(), rows.len());
            assert!(cached.iter().all(|w| w >> 32 == 2));
            let Ok(OpOutput::Combine { seq, reduced }) = &r.outputs[2] else {
                panic!("op 2 is a combine")
            };
            assert_eq!((*seq, reduced.len()), (1, 4));
        }
    }
}
