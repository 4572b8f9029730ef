//! The outcome of a run in which a rank stops ([`StoppedRank`]): the survivors' reference
//! ([`survivor_reference`]) and the stop rule that [`crate::check_outcome`] applies.
//!
//! A stopped rank publishes nothing more and no abort word, so what happens to its peers
//! depends only on their waits for it: a wait that needs a signal it never published expires.
//! In a low-latency op with masking the peer then masks it and completes without it (and every
//! later such op skips it at once); in any other op the expiry is the kernels' `kTimeout`,
//! which fails the op and publishes the abort word, so every later op of every survivor ends
//! in an error.

use crate::config::{ModelConfig, StoppedRank};
use crate::outcome::{
    OpError, OutcomeViolation, RankReport, check_allowed, check_output, check_refused,
};
use crate::reference::{sequential_reference, sequential_reference_masked};
use crate::step::Step;

/// What every op of every rank must produce if it completes, in a run of `cfg` with a stopped
/// rank `s` and masking ([`ModelConfig::with_ll_masking`]): the sequential reference, except
/// that the low-latency ops in which the survivors treat `s` as absent
/// ([`StoppedRank::absent_in`]) receive no rows from `s` (dispatch) and add nothing for the
/// entries whose expert is on `s` (combine). Without a stopped rank or without masking (no
/// survivor completes an LL op that needs `s` then) it is [`sequential_reference`].
///
/// The stopped rank's own entries are meaningful only for the ops before its stop.
pub fn survivor_reference(cfg: &ModelConfig) -> Vec<RankReport> {
    match cfg.stopped_rank() {
        Some(s) if cfg.ll_masking() => {
            sequential_reference_masked(cfg, |op| if s.absent_in(op) { 1 << s.rank } else { 0 })
        }
        _ => sequential_reference(cfg),
    }
}

/// The first op from the stop op on that a survivor cannot complete: it waits for the stopped
/// rank without masking it (`None`: the survivors complete every op).
fn first_cut(cfg: &ModelConfig, s: StoppedRank) -> Option<usize> {
    (s.op..cfg.ops().len()).find(|&op| {
        let with_it = op == s.op && s.after_done();
        let masked = cfg.ll_masking() && cfg.ops()[op].is_low_latency();
        !with_it && !masked
    })
}

/// The stop rule of [`crate::check_outcome`] for a run of `cfg` in which rank `s.rank` stops
/// (`reports`: one per rank, in rank order, lengths already checked).
///
/// # Errors
/// The first [`OutcomeViolation`] found, rank by rank, op by op.
pub(crate) fn check_outcome_stopped(
    cfg: &ModelConfig,
    s: StoppedRank,
    reports: &[RankReport],
) -> Result<(), OutcomeViolation> {
    let reference = survivor_reference(cfg);
    let cut = first_cut(cfg, s).unwrap_or(cfg.ops().len());
    // The survivors whose wait expired on the stopped rank: the origins of every abort word.
    let expired: Vec<usize> = reports
        .iter()
        .filter(|r| {
            r.rank != s.rank
                && r.outputs
                    .iter()
                    .any(|o| matches!(o, Err(OpError::Expired { .. })))
        })
        .map(|r| r.rank)
        .collect();
    for (rank, report) in reports.iter().enumerate() {
        if rank == s.rank {
            check_stopped_rank(s, &reference, report)?;
            continue;
        }
        let mut failed: Option<usize> = None;
        for (op, result) in report.outputs.iter().enumerate() {
            if let Some(failed) = failed {
                let refused = matches!(result, Err(OpError::Refused { by })
                    if *by == rank || expired.contains(by));
                check_refused(rank, op, failed, result, refused)?;
                continue;
            }
            match result {
                Ok(found) => {
                    if op >= cut {
                        return Err(OutcomeViolation::CompletedWithoutStoppedPeer {
                            rank,
                            op,
                            stopped: s.rank,
                            stop_op: s.op,
                        });
                    }
                    check_output(&reference, rank, op, found)?;
                }
                Err(error) => {
                    let allowed = match error {
                        OpError::Expired { peer, .. } => op == cut && *peer == s.rank,
                        // Seen while still waiting in the op before (as for a failure).
                        OpError::Aborted { by, .. } => op + 1 >= cut && expired.contains(by),
                        OpError::Refused { by } => op >= cut && expired.contains(by),
                        OpError::TimedOut { .. } | OpError::Stopped { .. } => false,
                    };
                    check_allowed(rank, op, error, allowed)?;
                    failed = Some(op);
                }
            }
        }
    }
    Ok(())
}

/// The stopped rank completes every op before its stop (nobody failed yet: the survivors'
/// waits expire only once it stopped) and reports [`OpError::Stopped`] for the others.
fn check_stopped_rank(
    s: StoppedRank,
    reference: &[RankReport],
    report: &RankReport,
) -> Result<(), OutcomeViolation> {
    for (op, result) in report.outputs.iter().enumerate() {
        let mismatch = |expected: Option<OpError>| OutcomeViolation::StoppedRankResult {
            rank: s.rank,
            stop_op: s.op,
            op,
            expected,
            found: result.clone(),
        };
        if op < s.op {
            let found = result.as_ref().map_err(|_| mismatch(None))?;
            check_output(reference, s.rank, op, found)?;
        } else {
            let step = if op == s.op { s.at } else { Step::F1 };
            let expected = OpError::Stopped { step };
            if *result != Err(expected.clone()) {
                return Err(mismatch(Some(expected)));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::OpKind::*;
    use crate::config::{ll_combine_word, ll_routes_to, ll_row_word};
    use crate::outcome::{OpOutput, check_lengths};
    use epcomm_topology::Schedule;

    /// What `check_outcome` runs for a configuration with a stopped rank.
    fn check_outcome(cfg: &ModelConfig, reports: &[RankReport]) -> Result<(), OutcomeViolation> {
        check_lengths(cfg, reports)?;
        let s = cfg.stopped_rank().expect("a stopped rank");
        check_outcome_stopped(cfg, s, reports)
    }

    fn stopped(masking: bool, at: Step, op: usize) -> ModelConfig {
        ModelConfig::new(
            3,
            4,
            1,
            Schedule::Epoch,
            vec![LlDispatch, LlCombine, LlDispatch],
        )
        .unwrap()
        .with_ll_masking(masking)
        .with_stopped_rank(StoppedRank { rank: 2, op, at })
        .unwrap()
    }

    #[test]
    fn survivor_reference_leaves_out_the_stopped_rank() {
        // Rank 2 stops before the LL combine (op 1): the dispatch before it has its rows, the
        // combine and the dispatch after it do not.
        let cfg = stopped(true, Step::F1, 1);
        let full = sequential_reference(&cfg);
        let masked = survivor_reference(&cfg);
        for me in 0..2 {
            assert_eq!(masked[me].outputs[0], full[me].outputs[0]);
            let Ok(OpOutput::LlDispatch { rows, .. }) = &masked[me].outputs[2] else {
                panic!("{:?}", masked[me].outputs[2]);
            };
            assert!(
                rows.iter()
                    .all(|&r| crate::config::split_data_word(r).1 != 2),
                "no row of rank 2"
            );
            let Ok(OpOutput::LlCombine { reduced, .. }) = &masked[me].outputs[1] else {
                panic!("{:?}", masked[me].outputs[1]);
            };
            for (t, &got) in reduced.iter().enumerate() {
                let row = ll_row_word(1, me, t);
                let want = (0..2)
                    .filter(|&k| ll_routes_to(1, me, t, k))
                    .fold(0u64, |a, k| a.wrapping_add(ll_combine_word(1, k, row)));
                assert_eq!(got, want, "rank {me}, token {t}");
            }
        }
        assert_ne!(
            masked, full,
            "the routing sends something to or from rank 2"
        );
        // A stop after the last signal keeps the rank in that op.
        let late = stopped(true, Step::L9, 1);
        assert_eq!(survivor_reference(&late)[0].outputs[1], full[0].outputs[1]);
        // Without masking the survivors complete nothing that needs rank 2.
        assert_eq!(survivor_reference(&stopped(false, Step::F1, 1)), full);
    }

    #[test]
    fn the_stop_rule_judges_survivors_and_the_stopped_rank() {
        let cfg = stopped(true, Step::F1, 1);
        let masked = survivor_reference(&cfg);
        let stop = |step| Err(OpError::Stopped { step });
        let good = || {
            let mut r = masked.clone();
            r[2].outputs = vec![masked[2].outputs[0].clone(), stop(Step::F1), stop(Step::F1)];
            r
        };
        assert_eq!(check_outcome(&cfg, &good()), Ok(()));
        // A survivor that returns the full reference (rank 2's rows) is wrong.
        let full = sequential_reference(&cfg);
        let mut wrong = good();
        let differs = (0..2).find(|&r| full[r].outputs[2] != masked[r].outputs[2]);
        let r = differs.expect("some survivor receives a row of rank 2");
        wrong[r].outputs[2] = full[r].outputs[2].clone();
        assert!(matches!(
            check_outcome(&cfg, &wrong),
            Err(OutcomeViolation::Output { op: 2, .. })
        ));
        // The stopped rank must report where it stopped.
        let mut unstopped = good();
        unstopped[2].outputs[1] = stop(Step::L8);
        assert!(matches!(
            check_outcome(&cfg, &unstopped),
            Err(OutcomeViolation::StoppedRankResult { op: 1, .. })
        ));
        // Without masking a survivor cannot complete the LL combine; it expires on rank 2 or
        // learns of a survivor that did.
        let off = stopped(false, Step::F1, 1);
        assert!(matches!(
            check_outcome(&off, &good()),
            Err(OutcomeViolation::CompletedWithoutStoppedPeer { op: 1, .. })
        ));
        let mut failing = good();
        failing[0].outputs[1] = Err(OpError::Expired {
            step: Step::L5,
            peer: 2,
        });
        failing[0].outputs[2] = Err(OpError::Refused { by: 0 });
        failing[1].outputs[1] = Err(OpError::Aborted {
            step: Step::L5,
            peer: 2,
            by: 0,
        });
        failing[1].outputs[2] = Err(OpError::Refused { by: 1 });
        assert_eq!(check_outcome(&off, &failing), Ok(()));
        // An abort word from nowhere (no survivor expired) is not allowed.
        failing[0].outputs[1] = Err(OpError::Aborted {
            step: Step::L5,
            peer: 2,
            by: 1,
        });
        assert!(matches!(
            check_outcome(&off, &failing),
            Err(OutcomeViolation::UnexpectedError { rank: 0, op: 1, .. })
        ));
    }
}
