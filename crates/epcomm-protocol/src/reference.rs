//! The sequential expectation: what every rank must output if the ops ran one at a time.

use crate::config::{ModelConfig, OpKind, combine_word, data_word, routes_to};

/// What one op produced on one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpOutput {
    /// Rows received by a dispatch, ordered by source rank then token (the `[E3]` offsets).
    Dispatch {
        /// Dispatch sequence number (the epoch).
        seq: u64,
        /// The received data words.
        rows: Vec<u64>,
    },
    /// Per-token reductions of a combine (wrapping sum over contributors in rank order).
    Combine {
        /// Combine sequence number.
        seq: u64,
        /// One reduced word per token this rank owns.
        reduced: Vec<u64>,
    },
}

/// Everything one rank produced, one entry per op.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankReport {
    /// The rank.
    pub rank: usize,
    /// One output per op, in op order.
    pub outputs: Vec<OpOutput>,
}

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

/// Computes the sequential expectation for every rank of `cfg`.
pub fn sequential_reference(cfg: &ModelConfig) -> Vec<RankReport> {
    (0..cfg.world())
        .map(|me| {
            let mut dispatch_seq = 0u64;
            let mut combine_seq = 0u64;
            let mut layout_seq = 0u64;
            let mut outputs = Vec::with_capacity(cfg.ops().len());
            for op in cfg.ops() {
                match op {
                    OpKind::Dispatch | OpKind::CachedDispatch => {
                        dispatch_seq += 1;
                        if *op == OpKind::Dispatch {
                            layout_seq = dispatch_seq;
                        }
                        outputs.push(OpOutput::Dispatch {
                            seq: dispatch_seq,
                            rows: expected_rows(cfg, layout_seq, dispatch_seq, me),
                        });
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
                        outputs.push(OpOutput::Combine {
                            seq: combine_seq,
                            reduced,
                        });
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
    use crate::config::{OpKind::*, Strategy, route_count};

    #[test]
    fn dispatch_rows_match_counts() {
        let cfg = ModelConfig::new(
            3,
            4,
            1,
            Strategy::Epoch,
            vec![Dispatch, CachedDispatch, Combine],
        )
        .unwrap();
        let reps = sequential_reference(&cfg);
        assert_eq!(reps.len(), 3);
        for (me, r) in reps.iter().enumerate() {
            let total: u64 = (0..3).map(|s| route_count(1, 4, s, me)).sum();
            let OpOutput::Dispatch { seq, rows } = &r.outputs[0] else {
                panic!("op 0 is a dispatch")
            };
            assert_eq!(*seq, 1);
            assert_eq!(rows.len() as u64, total);
            // The cached dispatch keeps the layout but carries its own sequence number.
            let OpOutput::Dispatch { seq, rows: cached } = &r.outputs[1] else {
                panic!("op 1 is a dispatch")
            };
            assert_eq!(*seq, 2);
            assert_eq!(cached.len(), rows.len());
            assert!(cached.iter().all(|w| w >> 32 == 2));
            let OpOutput::Combine { seq, reduced } = &r.outputs[2] else {
                panic!("op 2 is a combine")
            };
            assert_eq!((*seq, reduced.len()), (1, 4));
        }
    }
}
