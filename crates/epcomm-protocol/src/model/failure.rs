//! Failure propagation (property (e)): `[F1]` refuses an op once this rank or a peer failed,
//! `[F2]` publishes the abort word, and every shared write goes through [`Rank::write`], which
//! reports a failed rank that writes again.
//!
//! Contract: a rank's failure claim is local and set by the runner when one of its ops fails;
//! the abort word of a peer is set once (`1 + rank`) and never reset.

use super::violation::{OpError, Violation};
use super::{Rank, Stop};
use crate::config::Mutation;
use crate::step::Step;
use crate::sync::Ordering;

impl Rank<'_> {
    /// The rank whose failure this rank knows of: itself (its claim) or the abort word's.
    pub(super) fn failure_seen(&self) -> Option<usize> {
        if self.claim {
            return Some(self.me);
        }
        // Relaxed: the abort word is self-contained, it publishes nothing else.
        let word = self.w.ranks[self.me].abort.load(Ordering::Relaxed);
        (word != 0).then(|| (word - 1) as usize)
    }

    /// `[F1]`: exit before writing anything when this rank or a peer failed.
    pub(super) fn prologue(&self) -> Result<(), Stop> {
        self.step(Step::F1)?;
        if self.cfg.has(Mutation::SkipPrologueCheck) {
            return Ok(());
        }
        match self.failure_seen() {
            Some(by) => Err(Stop::Failed(OpError::Refused { by })),
            None => Ok(()),
        }
    }

    /// `[F2]`: publish the abort word to every peer (the failing rank's own claim is local).
    pub(super) fn publish_abort(&self) {
        self.hook.at(self.me, self.op, self.kind, Step::F2);
        for d in (0..self.world_size()).filter(|&d| d != self.me) {
            self.w.ranks[d]
                .abort
                .store(self.me as u64 + 1, Ordering::Relaxed);
        }
    }

    /// Every shared write goes through here: a rank that failed must not write again.
    pub(super) fn write(&self, step: Step, write: impl FnOnce()) -> Result<(), Violation> {
        if self.claim {
            return Err(Violation::WriteAfterFailure {
                rank: self.me,
                op: self.op,
                kind: self.kind,
                step,
            });
        }
        write();
        Ok(())
    }
}
