//! The runner: the op loop that drives one simulated rank ([`run_rank`]), all of them on std
//! threads ([`run_model`]), and the per-step hook that injects the configured failure.
//!
//! Contract: an op that ends in an [`OpError`] leaves the sequence state as it was before the
//! op (the kernels advance `SeqState` only on completion) and sets the rank's failure claim; a
//! [`Violation`] ends the rank's run; so does the configured stop point of a stopped rank
//! ([`crate::config::StoppedRank`]), which reports [`OpError::Stopped`] for the op it stops
//! in and every later one.

use super::StepHook;
#[cfg(not(loom))]
use super::violation::ModelFailure;
use super::violation::{OpError, RunError, Violation};
use super::{Layout, Rank, SeqState, Stop, World};
#[cfg(not(loom))]
use crate::config::ModelConfig;
use crate::config::{Mutation, OpKind};
#[cfg(not(loom))]
use crate::judge::check_outcome;
use crate::outcome::RankReport;
use crate::step::Step;
use crate::sync::Ordering;

/// Runs every op of the world's configuration as rank `rank` and returns what it produced.
///
/// Must be called once per rank, concurrently (under loom: from loom threads inside
/// `loom::model`). Ops that fail (the injected failure and its consequences) are reported as
/// [`OpError`]s in the report; [`RunError::Violation`] is returned at the first protocol
/// violation the rank detects. Judge the reports of all ranks with [`crate::check_outcome`].
pub fn run_rank(world: &World, rank: usize, hook: &dyn StepHook) -> Result<RankReport, RunError> {
    let cfg = world.config();
    if rank >= cfg.world() {
        return Err(RunError::Rank {
            rank,
            world: cfg.world(),
        });
    }
    let mut r = Rank {
        me: rank,
        w: world,
        cfg,
        hook,
        op: 0,
        kind: OpKind::Dispatch,
        seq: SeqState {
            notify_seq: 0,
            dispatch_seq: 0,
            combine_seq: 0,
            done_expected: 0,
            barrier_round: 0,
            ll_dispatch_seq: 0,
            ll_combine_seq: 0,
            inter_seq: 0,
            inter_notify_seq: 0,
            inter_combine_seq: 0,
            agree_seq: 0,
        },
        claim: false,
        mask: std::cell::Cell::new(0),
        layout: Layout {
            seq: 0,
            counts: vec![0; cfg.world() * cfg.world()],
        },
        live: None,
        ll_live: None,
        inter_layout: super::InterLayout::default(),
        inter_live: None,
        ring_sent: [vec![0; cfg.nodes()], vec![0; cfg.nodes()]],
        ring_taken: [vec![0; cfg.nodes()], vec![0; cfg.nodes()]],
        outputs: Vec::with_capacity(cfg.ops().len()),
    };
    let result = r.run();
    #[cfg(not(loom))]
    if let Err(v) = &result
        && !v.is_secondary()
    {
        let _ = world.failed.compare_exchange(
            usize::MAX,
            rank,
            std::sync::atomic::Ordering::AcqRel,
            std::sync::atomic::Ordering::Acquire,
        );
    }
    result?;
    Ok(RankReport {
        rank,
        outputs: r.outputs,
    })
}

/// Runs the whole model with one std thread per rank and judges the outcome.
///
/// Returns every rank's report, or every violation (causes first) if any rank found one or the
/// reports break [`crate::check_outcome`].
#[cfg(not(loom))]
pub fn run_model(cfg: &ModelConfig, hook: &dyn StepHook) -> Result<Vec<RankReport>, ModelFailure> {
    let world = World::new(cfg);
    let results: Vec<Result<RankReport, RunError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..cfg.world())
            .map(|rank| {
                let world = &world;
                scope.spawn(move || run_rank(world, rank, hook))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    let mut reports = Vec::with_capacity(results.len());
    let mut violations = Vec::new();
    for result in results {
        match result {
            Ok(report) => reports.push(report),
            Err(RunError::Violation(v)) => violations.push(v),
            // Ranks come from 0..world, so run_rank cannot reject them.
            Err(RunError::Rank { .. }) => {}
        }
    }
    if violations.is_empty()
        && let Err(v) = check_outcome(cfg, &reports)
    {
        violations.push(v.into());
    }
    if violations.is_empty() {
        Ok(reports)
    } else {
        violations.sort_by_key(Violation::is_secondary);
        Err(ModelFailure { violations })
    }
}

impl Rank<'_> {
    fn run(&mut self) -> Result<(), Violation> {
        for (op, &kind) in self.cfg.ops().iter().enumerate() {
            self.op = op;
            self.kind = kind;
            let before = self.seq;
            let result = self.prologue().and_then(|()| {
                self.publish_intent()?;
                self.recheck()?;
                match kind {
                    OpKind::Dispatch => self.dispatch(false),
                    OpKind::CachedDispatch => self.dispatch(true),
                    OpKind::Combine => self.combine(),
                    OpKind::LlDispatch => self.ll_dispatch(),
                    OpKind::LlCombine => self.ll_combine(),
                    OpKind::InternodeDispatch => self.internode_dispatch(false),
                    OpKind::InternodeCachedDispatch => self.internode_dispatch(true),
                    OpKind::InternodeCombine => self.internode_combine(),
                }
            });
            match result {
                Ok(output) => self.outputs.push(Ok(output)),
                Err(Stop::Violation(v)) => return Err(v),
                Err(Stop::Halt(step)) => {
                    // The configured stop: this op and every later one do not run.
                    self.halt();
                    self.outputs.push(Err(OpError::Stopped { step }));
                    let later = self.cfg.ops().len() - op - 1;
                    self.outputs.extend(std::iter::repeat_n(
                        Err(OpError::Stopped { step: Step::F1 }),
                        later,
                    ));
                    return Ok(());
                }
                Err(Stop::Failed(error)) => {
                    // The op exits without advancing the sequence state.
                    self.seq = before;
                    if matches!(error, OpError::TimedOut { .. } | OpError::Expired { .. }) {
                        self.publish_abort();
                    }
                    self.claim = true;
                    self.outputs.push(Err(error));
                }
            }
        }
        Ok(())
    }

    /// Announces `step` to the hook, then fails there if the configuration injects a failure,
    /// or stops there if it stops this rank.
    pub(super) fn step(&self, step: Step) -> Result<(), Stop> {
        self.hook.at(self.me, self.op, self.kind, step);
        if let Some(s) = self.cfg.stopped_rank()
            && (s.rank, s.op, s.at) == (self.me, self.op, step)
        {
            return Err(Stop::Halt(step));
        }
        match self.cfg.failure() {
            Some(f) if (f.rank, f.op, f.at) == (self.me, self.op, step) => {
                Err(Stop::Failed(OpError::TimedOut { step }))
            }
            _ => Ok(()),
        }
    }

    /// `Relaxed` if `mutation` is applied, `strong` otherwise.
    pub(super) fn ordering(&self, mutation: Mutation, strong: Ordering) -> Ordering {
        if self.cfg.has(mutation) {
            Ordering::Relaxed
        } else {
            strong
        }
    }

    /// `W`, the number of ranks.
    pub(super) fn world_size(&self) -> usize {
        self.cfg.world()
    }
}
