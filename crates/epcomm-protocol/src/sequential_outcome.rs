//! The outcome rule of a run without a stopped rank and without internode ops under a failure:
//! every op that completes equals the sequential reference, and an injected failure ends ops
//! only as [`crate::check_outcome`] describes.

use crate::config::ModelConfig;
use crate::outcome::{
    OpError, OutcomeViolation, RankReport, check_allowed, check_output, check_refused,
};
use crate::reference::sequential_reference;

/// [`crate::check_outcome`]'s rule without a stopped rank (the reports' lengths checked).
///
/// # Errors
/// The first [`OutcomeViolation`] found.
pub(crate) fn check_outcome_sequential(
    cfg: &ModelConfig,
    reports: &[RankReport],
) -> Result<(), OutcomeViolation> {
    let reference = sequential_reference(cfg);
    let failure = cfg.failure();
    for (rank, report) in reports.iter().enumerate() {
        let mut failed: Option<usize> = None;
        for (op, result) in report.outputs.iter().enumerate() {
            if let Some(failed) = failed {
                let refused = matches!(result, Err(OpError::Refused { .. }));
                check_refused(rank, op, failed, result, refused)?;
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
                    check_allowed(rank, op, error, allowed)?;
                    failed = Some(op);
                }
            }
        }
    }
    Ok(())
}
