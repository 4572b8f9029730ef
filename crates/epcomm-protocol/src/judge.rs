//! [`check_outcome`]: which rule judges a run, by what its configuration injects.

use crate::config::ModelConfig;
#[cfg(doc)]
use crate::config::OpKind;
use crate::internode_outcome::check_outcome_internode;
#[cfg(doc)]
use crate::outcome::OpError;
use crate::outcome::{OutcomeViolation, RankReport, check_lengths};
use crate::sequential_outcome::check_outcome_sequential;
use crate::stopped_outcome::check_outcome_stopped;

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
///   as for a failure), each equal to [`survivor_reference`](crate::survivor_reference): the low-latency ops with
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
        return check_outcome_stopped(cfg, stopped, reports);
    }
    check_outcome_sequential(cfg, reports)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::OpKind;
    use crate::config::{Failure, OpKind::*};
    use crate::outcome::{OpError, OpOutput, OpResult};
    use crate::reference::sequential_reference;
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
