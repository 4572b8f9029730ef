//! The sequential expectation, what every rank must output if the ops ran one at a time, and
//! [`check_outcome`], which judges a run's results against it (with or without an injected
//! failure or a stopped rank).

use crate::config::{
    ModelConfig, OpKind, combine_word, data_word, inter_combine_word, ll_combine_word,
    ll_routes_to, ll_row_word, routes_to,
};
use crate::model::OpError;
use crate::step::Step;

pub use crate::internode_outcome::{check_outcome_internode, failure_fires};
pub use crate::stopped_outcome::survivor_reference;

/// What one op produced on one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpOutput {
    /// Rows received by a dispatch, ordered by source rank then token (the `[E3]` offsets).
    /// Also the output of the internode dispatches (`seq`: their own sequence number).
    Dispatch {
        /// Dispatch sequence number (the epoch).
        seq: u64,
        /// The received data words.
        rows: Vec<u64>,
    },
    /// Per-token reductions of a combine (wrapping sum over contributors in rank order).
    /// Also the output of the internode combine (`seq`: its own sequence number; the sum of
    /// the contributors' [`crate::config::inter_combine_word`]s, whatever the grouping).
    Combine {
        /// Combine sequence number.
        seq: u64,
        /// One reduced word per token this rank owns.
        reduced: Vec<u64>,
    },
    /// The packed rows of a low-latency dispatch, ordered by source rank then token (the model
    /// has one expert per rank, so the packed order of `[L6]`/`[L7]` is the source order).
    LlDispatch {
        /// LL dispatch sequence number (the kernels' `ll_dispatch`).
        seq: u64,
        /// The received rows ([`crate::config::ll_row_word`]).
        rows: Vec<u64>,
    },
    /// Per-token reductions of a low-latency combine (wrapping sum over the token's valid top-k
    /// slots in increasing `k`).
    LlCombine {
        /// LL combine sequence number (the kernels' `ll_combine`).
        seq: u64,
        /// One reduced word per token this rank owns (0 for a token routed nowhere).
        reduced: Vec<u64>,
    },
}

/// How one op ended on one rank: its output, or the error it ended in.
pub type OpResult = Result<OpOutput, OpError>;

/// Everything one rank produced, one entry per op.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankReport {
    /// The rank.
    pub rank: usize,
    /// One result per op, in op order.
    pub outputs: Vec<OpResult>,
}

/// A property of a run's final results that the run broke; found by [`check_outcome`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OutcomeViolation {
    /// The reports do not cover every rank and every op.
    #[error("rank {rank}: {found} results for {expected} ops (or a missing rank)")]
    Length {
        /// The rank.
        rank: usize,
        /// Number of ops.
        expected: usize,
        /// Number of results.
        found: usize,
    },
    /// A completed op produced something else than the sequential reference. Property (d).
    #[error(
        "rank {rank}, op {op}: completed with {found:?}, the sequential reference is {expected:?}"
    )]
    Output {
        /// The rank.
        rank: usize,
        /// The op.
        op: usize,
        /// The sequential reference.
        expected: OpOutput,
        /// What the op returned.
        found: OpOutput,
    },
    /// An op ended in an error that the configuration cannot cause at that rank and op (no
    /// failure injected, or one that cannot reach this op yet).
    #[error("rank {rank}, op {op}: ended in an error the configuration cannot cause: {error}")]
    UnexpectedError {
        /// The rank.
        rank: usize,
        /// The op.
        op: usize,
        /// The error.
        error: OpError,
    },
    /// The injected failure did not happen where it was configured.
    #[error("rank {rank}, op {op}: the injected failure must end this op, found {found:?}")]
    MissingFailure {
        /// The failing rank.
        rank: usize,
        /// The failing op.
        op: usize,
        /// What the op returned instead.
        found: OpResult,
    },
    /// An op ran although an earlier op of the same rank failed: the prologue `[F1]` must
    /// refuse every later op before it writes anything. Property (e).
    #[error(
        "rank {rank}, op {op}: op {failed} failed, so [F1] must refuse this op; found {found:?}"
    )]
    NotRefused {
        /// The rank.
        rank: usize,
        /// The op.
        op: usize,
        /// The earlier op that failed.
        failed: usize,
        /// What the op returned.
        found: OpResult,
    },
    /// A peer completed an op that needs a signal the failing rank never published. Property (e).
    #[error(
        "rank {rank}, op {op}: completed, but rank {failing} failed in op {fail_op} before signalling what this op waits for"
    )]
    CompletedWithoutPeer {
        /// The rank.
        rank: usize,
        /// The op.
        op: usize,
        /// The failing rank.
        failing: usize,
        /// The op it failed in.
        fail_op: usize,
    },
    /// A run with a stopped rank: a survivor completed an op that waits for the stopped rank
    /// without masking it (masking off, or not a low-latency op), at or after the op it
    /// stopped in.
    #[error(
        "rank {rank}, op {op}: completed, but it waits for rank {stopped}, which stopped in op {stop_op}, without masking it"
    )]
    CompletedWithoutStoppedPeer {
        /// The rank.
        rank: usize,
        /// The op.
        op: usize,
        /// The stopped rank.
        stopped: usize,
        /// The op it stopped in.
        stop_op: usize,
    },
    /// A run with a stopped rank: the stopped rank's result of an op is not what its stop
    /// makes it (completed before the stop op, [`OpError::Stopped`] from it on).
    #[error(
        "rank {rank} (stopped in op {stop_op}), op {op}: expected {}, found {found:?}",
        expected.as_ref().map_or("a completed op".to_string(), |e| format!("{e:?}"))
    )]
    StoppedRankResult {
        /// The stopped rank.
        rank: usize,
        /// The op it stopped in.
        stop_op: usize,
        /// The op.
        op: usize,
        /// The [`OpError::Stopped`] the op must report; `None`: it must complete.
        expected: Option<OpError>,
        /// What it reported.
        found: OpResult,
    },
    /// An internode-family run: an op completed although a signal one of its waits needs was
    /// never published (its writer failed, or gave up, before publishing it), directly or
    /// through a forwarder or a credit. Property (e), [`check_outcome_internode`].
    #[error(
        "rank {rank}, op {op}: completed, but its wait {step:?} on peer {peer} needs a signal no report published (rank {failing} failed in op {fail_op})"
    )]
    CompletedWithoutSignal {
        /// The rank.
        rank: usize,
        /// The op.
        op: usize,
        /// The wait's step (`None`: the coarse wait of an intranode op for every done signal).
        step: Option<Step>,
        /// The peer the wait names.
        peer: usize,
        /// The failing rank.
        failing: usize,
        /// The op it failed in.
        fail_op: usize,
    },
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

/// `found`, the output rank `rank` reported for op `op`, against the sequential reference's.
///
/// # Errors
/// [`OutcomeViolation::Output`] when they differ.
pub(crate) fn check_output(
    reference: &[RankReport],
    rank: usize,
    op: usize,
    found: &OpOutput,
) -> Result<(), OutcomeViolation> {
    let expected = reference[rank].outputs[op]
        .as_ref()
        .expect("the reference completes every op");
    if found != expected {
        return Err(OutcomeViolation::Output {
            rank,
            op,
            expected: expected.clone(),
            found: found.clone(),
        });
    }
    Ok(())
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

/// Every rank has a report, in rank order, with one result per op.
///
/// # Errors
/// [`OutcomeViolation::Length`] for the first rank whose report is missing or short.
fn check_lengths(cfg: &ModelConfig, reports: &[RankReport]) -> Result<(), OutcomeViolation> {
    let ops = cfg.ops().len();
    if reports.len() != cfg.world() {
        return Err(OutcomeViolation::Length {
            rank: reports.len().min(cfg.world()),
            expected: ops,
            found: 0,
        });
    }
    for (rank, report) in reports.iter().enumerate() {
        if report.rank != rank || report.outputs.len() != ops {
            return Err(OutcomeViolation::Length {
                rank,
                expected: ops,
                found: report.outputs.len(),
            });
        }
    }
    Ok(())
}

/// Judges the results of a run of `cfg`, one report per rank in rank order.
///
/// Without an injected failure every op must complete with the sequential reference. With a
/// failure of rank `f` in op `n`:
/// * every op that completes, on any rank, equals the sequential reference (no stale or missing
///   data is ever returned as a result);
/// * rank `f` completes ops `0..n`, op `n` ends in the injected [`OpError::TimedOut`];
/// * a peer completes ops `0..n-1` (they finished before `f` could fail); op `n-1` may end in
///   [`OpError::Aborted`] (the abort word can be seen before the last signal); no peer completes
///   an op that needs a signal `f` never published: op `n` (unless `f` failed after its done
///   signals, [`crate::config::Failure::after_done`]) and every later op;
/// * after an op of a rank failed, every later op of that rank is [`OpError::Refused`] by the
///   prologue `[F1]`: it ends in an error, not a hang, and writes nothing.
///
/// With a failure and internode ops ([`OpKind::is_internode_family`]) in the sequence, the
/// rule above does not hold (with waits only on senders a peer can legitimately finish an op
/// without the failed rank) and the run is judged by [`check_outcome_internode`] instead.
///
/// With a rank `s` that stops in op `k` ([`crate::config::StoppedRank`]), the stop rule:
/// * `s` completes ops `0..k` with the sequential reference, and reports
///   [`OpError::Stopped`] for op `k` (at its stop step) and for every later op (at `[F1]`);
/// * let `m` be the first op from `k` on that a survivor cannot complete because it waits for
///   `s` without masking it: not op `k` when `s` stopped after its last signal there
///   ([`crate::config::StoppedRank::after_done`]), and, with masking, no low-latency op.
///   Every survivor completes ops `0..m` (op `m - 1` may end in [`OpError::Aborted`] instead,
///   as for a failure), each equal to [`survivor_reference`]: the low-latency ops with
///   masking treat `s` as absent from op `k` on (from `k + 1` when it stopped after its last
///   signal), every other op is the sequential reference;
/// * no survivor completes op `m` or a later one: its first error is a wait that expired on
///   `s` in op `m` ([`OpError::Expired`]) or an [`OpError::Aborted`] / [`OpError::Refused`]
///   naming a survivor whose wait expired, and every later op is refused.
pub fn check_outcome(cfg: &ModelConfig, reports: &[RankReport]) -> Result<(), OutcomeViolation> {
    if cfg.failure().is_some() && cfg.ops().iter().any(|k| k.is_internode_family()) {
        return check_outcome_internode(cfg, reports);
    }
    check_lengths(cfg, reports)?;
    if let Some(stopped) = cfg.stopped_rank() {
        return crate::stopped_outcome::check_outcome_stopped(cfg, stopped, reports);
    }
    let reference = sequential_reference(cfg);
    let failure = cfg.failure();
    for (rank, report) in reports.iter().enumerate() {
        let mut failed: Option<usize> = None;
        for (op, result) in report.outputs.iter().enumerate() {
            if let Some(failed) = failed {
                if !matches!(result, Err(OpError::Refused { .. })) {
                    return Err(OutcomeViolation::NotRefused {
                        rank,
                        op,
                        failed,
                        found: result.clone(),
                    });
                }
                continue;
            }
            let injected = failure.is_some_and(|f| f.rank == rank && f.op == op);
            match result {
                Ok(found) => {
                    if injected {
                        return Err(OutcomeViolation::MissingFailure {
                            rank,
                            op,
                            found: result.clone(),
                        });
                    }
                    if let Some(f) = failure
                        && f.rank != rank
                        && (op > f.op || (op == f.op && !f.after_done()))
                    {
                        return Err(OutcomeViolation::CompletedWithoutPeer {
                            rank,
                            op,
                            failing: f.rank,
                            fail_op: f.op,
                        });
                    }
                    check_output(&reference, rank, op, found)?;
                }
                Err(error) => {
                    let allowed = match (failure, error) {
                        (None, _) => false,
                        (Some(f), OpError::TimedOut { step }) => injected && *step == f.at,
                        (Some(_), _) if injected => false,
                        // A peer sees the abort word at the earliest in op n-1 (it waits there
                        // while the failing rank already runs op n), and is refused at the
                        // earliest at the start of op n.
                        (Some(f), OpError::Aborted { .. }) => rank != f.rank && op + 1 >= f.op,
                        (Some(f), OpError::Refused { .. }) => rank != f.rank && op >= f.op,
                        // Only a stopped rank (not configured here) causes these.
                        (Some(_), OpError::Expired { .. } | OpError::Stopped { .. }) => false,
                    };
                    if injected && !allowed {
                        return Err(OutcomeViolation::MissingFailure {
                            rank,
                            op,
                            found: result.clone(),
                        });
                    }
                    if !allowed {
                        return Err(OutcomeViolation::UnexpectedError {
                            rank,
                            op,
                            error: error.clone(),
                        });
                    }
                    failed = Some(op);
                }
            }
        }
    }
    Ok(())
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

    mod outcome {
        use super::super::*;
        use crate::config::{Failure, OpKind::*};
        use crate::step::Step;
        use epcomm_topology::Schedule;

        fn cfg(ops: &[OpKind], failure: Option<Failure>) -> ModelConfig {
            let c = ModelConfig::new(2, 2, 1, Schedule::Epoch, ops.to_vec()).unwrap();
            match failure {
                Some(f) => c.with_failure(f).unwrap(),
                None => c,
            }
        }

        const REFUSED_0: OpResult = Err(OpError::Refused { by: 0 });
        const REFUSED_1: OpResult = Err(OpError::Refused { by: 1 });

        fn aborted(step: Step, by: usize) -> OpResult {
            Err(OpError::Aborted { step, peer: by, by })
        }

        /// The reports of a two-rank run: rank 0's results, then rank 1's.
        fn two_ranks(r0: &[OpResult], r1: &[OpResult]) -> Vec<RankReport> {
            [r0, r1]
                .into_iter()
                .enumerate()
                .map(|(rank, outputs)| RankReport {
                    rank,
                    outputs: outputs.to_vec(),
                })
                .collect()
        }

        #[test]
        fn without_failure_every_op_completes_with_the_reference() {
            let c = cfg(&[Dispatch, Combine], None);
            let mut reports = sequential_reference(&c);
            assert_eq!(check_outcome(&c, &reports), Ok(()));
            assert!(matches!(
                check_outcome(&c, &reports[..1]),
                Err(OutcomeViolation::Length { .. })
            ));
            let Ok(OpOutput::Combine { reduced, .. }) = &mut reports[1].outputs[1] else {
                panic!("op 1 is a combine")
            };
            reduced[0] ^= 1;
            assert!(matches!(
                check_outcome(&c, &reports),
                Err(OutcomeViolation::Output { rank: 1, op: 1, .. })
            ));
            reports[1].outputs[1] = REFUSED_0;
            assert!(matches!(
                check_outcome(&c, &reports),
                Err(OutcomeViolation::UnexpectedError { rank: 1, op: 1, .. })
            ));
            reports[1].outputs.pop();
            assert!(matches!(
                check_outcome(&c, &reports),
                Err(OutcomeViolation::Length {
                    rank: 1,
                    expected: 2,
                    found: 1
                })
            ));
        }

        /// Rank 1 fails in op 1 (of 3) before `at`: the configuration, the sequential
        /// reference and rank 1's results as the protocol allows them.
        fn rank_1_fails_in_op_1(
            ops: [OpKind; 3],
            at: Step,
        ) -> (ModelConfig, Vec<RankReport>, [OpResult; 3]) {
            let c = cfg(&ops, Some(Failure { rank: 1, op: 1, at }));
            let reference = sequential_reference(&c);
            let r1 = [
                reference[1].outputs[0].clone(),
                Err(OpError::TimedOut { step: at }),
                REFUSED_1,
            ];
            (c, reference, r1)
        }

        #[test]
        fn failure_before_done_ends_every_later_op_in_an_error() {
            let (c, reference, r1) =
                rank_1_fails_in_op_1([Dispatch, Combine, CachedDispatch], Step::C2);
            let good = |r0: [OpResult; 3]| two_ranks(&r0, &r1);
            let r0 = |i: usize| reference[0].outputs[i].clone();
            // Every outcome the protocol allows.
            for r in [
                good([r0(0), aborted(Step::C5, 1), REFUSED_0]),
                good([r0(0), REFUSED_1, REFUSED_0]),
                good([aborted(Step::E6, 1), REFUSED_0, REFUSED_0]),
            ] {
                assert_eq!(check_outcome(&c, &r), Ok(()), "{r:?}");
            }
            // Rank 0 cannot complete the op rank 1 never signalled.
            assert!(matches!(
                check_outcome(&c, &good([r0(0), r0(1), REFUSED_0])),
                Err(OutcomeViolation::CompletedWithoutPeer {
                    rank: 0,
                    op: 1,
                    failing: 1,
                    fail_op: 1
                })
            ));
            // After a failure every later op is refused.
            assert!(matches!(
                check_outcome(&c, &good([r0(0), aborted(Step::C5, 1), r0(2)])),
                Err(OutcomeViolation::NotRefused {
                    rank: 0,
                    op: 2,
                    failed: 1,
                    ..
                })
            ));
            assert!(matches!(
                check_outcome(
                    &c,
                    &good([r0(0), aborted(Step::C5, 1), aborted(Step::E6, 1)])
                ),
                Err(OutcomeViolation::NotRefused {
                    rank: 0,
                    op: 2,
                    failed: 1,
                    ..
                })
            ));
            // A peer is never refused before the failing op, nor times out itself.
            assert!(matches!(
                check_outcome(&c, &good([REFUSED_1, REFUSED_0, REFUSED_0])),
                Err(OutcomeViolation::UnexpectedError { rank: 0, op: 0, .. })
            ));
            assert!(matches!(
                check_outcome(
                    &c,
                    &good([r0(0), Err(OpError::TimedOut { step: Step::C2 }), REFUSED_0])
                ),
                Err(OutcomeViolation::UnexpectedError { rank: 0, op: 1, .. })
            ));
            // The injected failure must happen.
            let mut missing = good([r0(0), aborted(Step::C5, 1), REFUSED_0]);
            missing[1].outputs[1] = reference[1].outputs[1].clone();
            assert!(matches!(
                check_outcome(&c, &missing),
                Err(OutcomeViolation::MissingFailure { rank: 1, op: 1, .. })
            ));
            missing[1].outputs[1] = aborted(Step::C3, 0);
            assert!(matches!(
                check_outcome(&c, &missing),
                Err(OutcomeViolation::MissingFailure { rank: 1, op: 1, .. })
            ));
        }

        #[test]
        fn failure_after_done_lets_peers_complete_that_op_only() {
            let (c, reference, r1) =
                rank_1_fails_in_op_1([Dispatch, CachedDispatch, Combine], Step::E6);
            let reports = |r0_2: OpResult| {
                let r0 = [
                    reference[0].outputs[0].clone(),
                    reference[0].outputs[1].clone(),
                    r0_2,
                ];
                two_ranks(&r0, &r1)
            };
            assert_eq!(check_outcome(&c, &reports(aborted(Step::C5, 1))), Ok(()));
            assert!(matches!(
                check_outcome(&c, &reports(reference[0].outputs[2].clone())),
                Err(OutcomeViolation::CompletedWithoutPeer { rank: 0, op: 2, .. })
            ));
        }
    }
}
