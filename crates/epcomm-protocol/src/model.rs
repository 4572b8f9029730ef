//! The protocol model: shared per-rank buffers and the per-rank program.
//!
//! Every rank is a thread running [`run_rank`]; every shared word is an atomic (loom's under
//! `--cfg loom`, std's otherwise). The code is written step by step with the stable labels of
//! [`Step`]; the CUDA kernels mirror it and cite the labels.
//!
//! The model checks itself while it runs, against the routing oracle of [`crate::config`]:
//! a count word with the wrong epoch tag, a count that disagrees with the routing, a data word
//! that differs from the sequential expectation, or a shared write by a rank that already
//! failed is reported as a [`Violation`] instead of being used. Under loom every interleaving
//! (within the preemption bound) is explored, so a [`Violation`] in any schedule is found.
//!
//! An op can also end in an [`OpError`]: the failure injected by the configuration
//! ([`crate::config::Failure`]), a wait that gave up because of it, or the prologue `[F1]`
//! refusing to start after it. [`crate::check_outcome`] judges whether the errors and results
//! of all ranks together are what the protocol promises.

use std::fmt;

use epcomm_topology::Schedule;

use crate::config::{
    ModelConfig, Mutation, OpKind, combine_word, count_word, data_word, route_count, routes_to,
    split_count_word, split_data_word,
};
#[cfg(not(loom))]
use crate::reference::check_outcome;
use crate::reference::{OpOutput, OutcomeViolation, RankReport, expected_rows};
use crate::step::Step;
use crate::sync::{AtomicU64, Ordering, spin_wait};

/// Observer called by every rank before each labelled step.
///
/// Tests use it to inject delays (std stress tests) or to force one specific interleaving
/// (deterministic negative tests). Under loom use [`NoHook`]: loom already explores schedules.
pub trait StepHook: Send + Sync {
    /// Called by rank `rank` right before it executes `step` of op number `op` (0-based) of
    /// kind `kind`. Steps that repeat per sender block (`[E4]`, `[E5]`, `[C1]`, `[C3]`, `[C4]`,
    /// `[C2]`) are reported once per block.
    fn at(&self, rank: usize, op: usize, kind: OpKind, step: Step);
}

/// A [`StepHook`] that does nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoHook;

impl StepHook for NoHook {
    fn at(&self, _rank: usize, _op: usize, _kind: OpKind, _step: Step) {}
}

/// Which data region a [`Violation::Data`] was found in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Region {
    /// `recv[parity][slot]`, the dispatch receive slots.
    Recv,
    /// `comb[parity][src][token]`, the combine receive slots (slot = `src * tokens + token`).
    Comb,
}

impl fmt::Display for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Region::Recv => "recv",
            Region::Comb => "comb",
        })
    }
}

/// A protocol violation detected by the model: the protocol (or the variant run) is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Violation {
    /// A count word carried another notify epoch than the op's: stale (older) or written by a
    /// peer more than one op ahead (newer). Property (a).
    #[error(
        "rank {rank}, op {op} ({kind:?}), {step}: count_matrix[{parity}][{src}][{dst}] carries notify epoch {found}, the op runs notify epoch {expected}"
    )]
    CountTag {
        /// Rank that read the word.
        rank: usize,
        /// Op index.
        op: usize,
        /// Op kind.
        kind: OpKind,
        /// Step that read it.
        step: Step,
        /// Count region index.
        parity: usize,
        /// Row (sender).
        src: usize,
        /// Column (receiver).
        dst: usize,
        /// The op's notify epoch.
        expected: u64,
        /// The tag found.
        found: u64,
    },
    /// A count word carried the right tag but a count the routing does not produce.
    #[error(
        "rank {rank}, op {op} ({kind:?}), {step}: count {src}->{dst} is {found}, the routing gives {expected}"
    )]
    CountValue {
        /// Rank that read the word.
        rank: usize,
        /// Op index.
        op: usize,
        /// Op kind.
        kind: OpKind,
        /// Step that read it.
        step: Step,
        /// Sender.
        src: usize,
        /// Receiver.
        dst: usize,
        /// The routing's count.
        expected: u64,
        /// The count read.
        found: u64,
    },
    /// A data slot held another value than the sequential expectation: it was overwritten before
    /// its owner consumed it, or read before it landed. Properties (b) and (d).
    #[error(
        "rank {rank}, op {op} ({kind:?}), {step}: {region}[{parity}] slot {slot} holds {found:#x}, expected {expected:#x}"
    )]
    Data {
        /// Rank that read the slot.
        rank: usize,
        /// Op index.
        op: usize,
        /// Op kind.
        kind: OpKind,
        /// Step that read it.
        step: Step,
        /// Which region.
        region: Region,
        /// Region index (the parity, or 0 under [`Mutation::SingleRegion`]).
        parity: usize,
        /// Slot within the region.
        slot: usize,
        /// The sequential expectation.
        expected: u64,
        /// The value read.
        found: u64,
    },
    /// A bounded wait expired (std runs only; loom reports deadlock itself). Property (c).
    #[error(
        "rank {rank}, op {op} ({kind:?}), wait {step}: timed out after {waited_ms} ms on peer {peer}: waiting for {expected}, last seen {seen}"
    )]
    Timeout {
        /// Waiting rank.
        rank: usize,
        /// Op index.
        op: usize,
        /// Op kind.
        kind: OpKind,
        /// The wait.
        step: Step,
        /// Peer whose word never arrived.
        peer: usize,
        /// Value (or epoch) waited for.
        expected: u64,
        /// Last value (or epoch) seen.
        seen: u64,
        /// How long it waited.
        waited_ms: u64,
    },
    /// A rank that failed wrote shared memory again (a count, data, flag or done word): its
    /// prologue `[F1]` must stop every later op before the first write. Property (e).
    #[error("rank {rank}, op {op} ({kind:?}), {step}: writes shared memory after this rank failed")]
    WriteAfterFailure {
        /// The rank.
        rank: usize,
        /// Op index.
        op: usize,
        /// Op kind.
        kind: OpKind,
        /// The writing step.
        step: Step,
    },
    /// The results of all ranks break a property of the outcome (see [`crate::check_outcome`]).
    #[error(transparent)]
    Outcome(#[from] OutcomeViolation),
    /// A wait was abandoned because another rank already reported a violation (std runs only).
    #[error(
        "rank {rank}, op {op} ({kind:?}), wait {step}: abandoned on peer {peer} because rank {failed} reported a violation"
    )]
    PeerFailed {
        /// Waiting rank.
        rank: usize,
        /// Op index.
        op: usize,
        /// Op kind.
        kind: OpKind,
        /// The wait.
        step: Step,
        /// Peer waited on.
        peer: usize,
        /// Rank that failed first.
        failed: usize,
    },
}

impl Violation {
    /// Whether this violation is a consequence of another rank's violation.
    pub fn is_secondary(&self) -> bool {
        matches!(self, Violation::PeerFailed { .. })
    }
}

/// How an op ended when it did not complete: the protocol's failure path, not a violation.
#[derive(Debug, Clone, PartialEq, Eq, Hash, thiserror::Error)]
pub enum OpError {
    /// The injected failure ([`crate::config::Failure`]): this rank's wait before `step` timed
    /// out; it recorded the failure and published the abort word (`[F2]`).
    #[error("{step}: timed out (injected failure)")]
    TimedOut {
        /// The step the failure was injected before.
        step: Step,
    },
    /// A bounded wait gave up because rank `by` failed: the abort word it published, or (when
    /// `by` is this rank) this rank's own failure claim.
    #[error("wait {step}: gave up on peer {peer}, rank {by} failed")]
    Aborted {
        /// The wait.
        step: Step,
        /// The peer it waited on.
        peer: usize,
        /// The rank that failed.
        by: usize,
    },
    /// `[F1]`: the op exited at its prologue, before writing anything, because rank `by` failed
    /// (this rank's failure claim, or the abort word).
    #[error("[F1] refused: rank {by} failed")]
    Refused {
        /// The rank that failed.
        by: usize,
    },
}

/// Misuse of [`run_rank`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RunError {
    /// `rank` is not below the world size.
    #[error("rank = {rank}: must be below the world size {world}")]
    Rank {
        /// The rejected rank.
        rank: usize,
        /// World size of the [`World`].
        world: usize,
    },
    /// The protocol was violated.
    #[error(transparent)]
    Violation(#[from] Violation),
}

/// Every violation of a failed [`run_model`], causes first.
#[cfg(not(loom))]
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{} protocol violation(s); first: {}", violations.len(), violations.first().map(ToString::to_string).unwrap_or_default())]
pub struct ModelFailure {
    /// The violations, primary ones (not [`Violation::PeerFailed`]) first.
    pub violations: Vec<Violation>,
}

/// The buffer of one rank, written by its peers' remote stores.
struct RankBuffer {
    /// `count_matrix[parity][src][dst]`: tagged words `(notify << 32) | count`.
    count: Vec<AtomicU64>,
    /// `recv[parity][slot]`.
    recv: Vec<AtomicU64>,
    /// `comb[parity][src][token]`.
    comb: Vec<AtomicU64>,
    /// `flags[src][token]`: monotonic, the combine sequence number of the last contribution of
    /// `src` to my `token` (one region: the combine parity alternates the data, not the flag).
    flags: Vec<AtomicU64>,
    /// `done[src]`: monotonic, one increment per sender block per op.
    done: Vec<AtomicU64>,
    /// `barrier[src]`: monotonic, one increment per barrier (Global only).
    barrier: Vec<AtomicU64>,
    /// The abort word: `1 + rank` of a failed rank, 0 while none failed. Never reset.
    abort: AtomicU64,
}

fn zeroed(n: usize) -> Vec<AtomicU64> {
    (0..n).map(|_| AtomicU64::new(0)).collect()
}

/// The shared memory of all ranks for one model run.
pub struct World {
    cfg: ModelConfig,
    ranks: Vec<RankBuffer>,
    /// First rank that reported a violation (`usize::MAX`: none), so std waits end early.
    #[cfg(not(loom))]
    failed: std::sync::atomic::AtomicUsize,
}

impl fmt::Debug for World {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("World")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

impl World {
    /// Allocates zeroed buffers for every rank of `cfg` ("never written" everywhere).
    pub fn new(cfg: &ModelConfig) -> Self {
        let (w, t, p) = (cfg.world(), cfg.tokens(), cfg.regions());
        let ranks = (0..w)
            .map(|_| RankBuffer {
                count: zeroed(p * w * w),
                recv: zeroed(p * cfg.recv_slots()),
                comb: zeroed(p * w * t),
                flags: zeroed(w * t),
                done: zeroed(w),
                barrier: zeroed(w),
                abort: AtomicU64::new(0),
            })
            .collect();
        Self {
            cfg: cfg.clone(),
            ranks,
            #[cfg(not(loom))]
            failed: std::sync::atomic::AtomicUsize::new(usize::MAX),
        }
    }

    /// The configuration the world was built for.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn count(&self, rank: usize, parity: usize, src: usize, dst: usize) -> &AtomicU64 {
        let w = self.cfg.world();
        &self.ranks[rank].count[(parity * w + src) * w + dst]
    }

    fn recv(&self, rank: usize, parity: usize, slot: usize) -> &AtomicU64 {
        &self.ranks[rank].recv[parity * self.cfg.recv_slots() + slot]
    }

    fn comb(&self, rank: usize, parity: usize, src: usize, token: usize) -> &AtomicU64 {
        let (w, t) = (self.cfg.world(), self.cfg.tokens());
        &self.ranks[rank].comb[(parity * w + src) * t + token]
    }

    fn flag(&self, rank: usize, src: usize, token: usize) -> &AtomicU64 {
        &self.ranks[rank].flags[src * self.cfg.tokens() + token]
    }
}

/// Layout of the last non-cached dispatch: its dispatch sequence number (which picks the
/// routing) and the full count matrix `[s * W + d]`.
#[derive(Debug, Clone, Default)]
struct Layout {
    seq: u64,
    counts: Vec<u64>,
}

/// The output of the last dispatch, which the user may read until the next dispatch starts.
#[derive(Debug, Clone, Default)]
struct Live {
    seq: u64,
    parity: usize,
    rows: Vec<u64>,
}

enum Poll<T> {
    Ready(T),
    Pending(u64),
}

/// Why a rank stopped an op early: a protocol violation ends the rank's run, an [`OpError`]
/// only the op.
enum Stop {
    Violation(Violation),
    Failed(OpError),
}

impl From<Violation> for Stop {
    fn from(v: Violation) -> Self {
        Stop::Violation(v)
    }
}

/// The sequence state a failed op leaves unchanged (the kernels' `SeqState`, advanced only by
/// an op that completes).
#[derive(Debug, Clone, Copy)]
struct SeqState {
    /// Non-cached dispatches so far: the count words' tag and region (the kernels' `notify`).
    notify_seq: u64,
    /// Dispatches so far, cached or not: the receive region and the data words' sequence.
    dispatch_seq: u64,
    combine_seq: u64,
    done_expected: u64,
    barrier_round: u64,
}

struct Rank<'a> {
    me: usize,
    w: &'a World,
    cfg: &'a ModelConfig,
    hook: &'a dyn StepHook,
    op: usize,
    kind: OpKind,
    seq: SeqState,
    /// This rank's failure claim: set when one of its ops failed.
    claim: bool,
    layout: Layout,
    live: Option<Live>,
    outputs: Vec<Result<OpOutput, OpError>>,
}

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
        },
        claim: false,
        layout: Layout {
            seq: 0,
            counts: vec![0; cfg.world() * cfg.world()],
        },
        live: None,
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
                self.recheck()?;
                match kind {
                    OpKind::Dispatch => self.dispatch(false),
                    OpKind::CachedDispatch => self.dispatch(true),
                    OpKind::Combine => self.combine(),
                }
            });
            match result {
                Ok(output) => self.outputs.push(Ok(output)),
                Err(Stop::Violation(v)) => return Err(v),
                Err(Stop::Failed(error)) => {
                    // The op exits without advancing the sequence state.
                    self.seq = before;
                    if matches!(error, OpError::TimedOut { .. }) {
                        self.publish_abort();
                    }
                    self.claim = true;
                    self.outputs.push(Err(error));
                }
            }
        }
        Ok(())
    }

    /// Announces `step` to the hook, then fails there if the configuration injects a failure.
    fn step(&self, step: Step) -> Result<(), Stop> {
        self.hook.at(self.me, self.op, self.kind, step);
        match self.cfg.failure() {
            Some(f) if (f.rank, f.op, f.at) == (self.me, self.op, step) => {
                Err(Stop::Failed(OpError::TimedOut { step }))
            }
            _ => Ok(()),
        }
    }

    /// `Relaxed` if `mutation` is applied, `strong` otherwise.
    fn ordering(&self, mutation: Mutation, strong: Ordering) -> Ordering {
        if self.cfg.has(mutation) {
            Ordering::Relaxed
        } else {
            strong
        }
    }

    fn world_size(&self) -> usize {
        self.cfg.world()
    }

    /// The rank whose failure this rank knows of: itself (its claim) or the abort word's.
    fn failure_seen(&self) -> Option<usize> {
        if self.claim {
            return Some(self.me);
        }
        // Relaxed: the abort word is self-contained, it publishes nothing else.
        let word = self.w.ranks[self.me].abort.load(Ordering::Relaxed);
        (word != 0).then(|| (word - 1) as usize)
    }

    /// `[F1]`: exit before writing anything when this rank or a peer failed.
    fn prologue(&self) -> Result<(), Stop> {
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
    fn publish_abort(&self) {
        self.hook.at(self.me, self.op, self.kind, Step::F2);
        for d in (0..self.world_size()).filter(|&d| d != self.me) {
            self.w.ranks[d]
                .abort
                .store(self.me as u64 + 1, Ordering::Relaxed);
        }
    }

    /// Every shared write goes through here: a rank that failed must not write again.
    fn write(&self, step: Step, write: impl FnOnce()) -> Result<(), Violation> {
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

    /// Bounded spin-wait on `peer`'s word; `poll` loads it and says whether it is ready. Gives
    /// up ([`OpError::Aborted`]) when this rank or a peer failed.
    fn wait<T>(
        &self,
        step: Step,
        peer: usize,
        expected: u64,
        mut poll: impl FnMut() -> Result<Poll<T>, Violation>,
    ) -> Result<T, Stop> {
        // Under loom a wait is bounded only by the abort word (loom reports a schedule where
        // nobody can progress); std runs also time out.
        #[cfg(loom)]
        let _ = expected;
        #[cfg(not(loom))]
        let start = std::time::Instant::now();
        #[cfg(not(loom))]
        let mut spins: u32 = 0;
        loop {
            match poll()? {
                Poll::Ready(value) => return Ok(value),
                Poll::Pending(_seen) => {
                    if !self.cfg.has(Mutation::SkipAbortPoll)
                        && let Some(by) = self.failure_seen()
                    {
                        return Err(Stop::Failed(OpError::Aborted { step, peer, by }));
                    }
                    #[cfg(not(loom))]
                    {
                        let failed = self.w.failed.load(std::sync::atomic::Ordering::Acquire);
                        if failed != usize::MAX {
                            return Err(Violation::PeerFailed {
                                rank: self.me,
                                op: self.op,
                                kind: self.kind,
                                step,
                                peer,
                                failed,
                            }
                            .into());
                        }
                        spins = spins.wrapping_add(1);
                        if spins.is_multiple_of(64) {
                            let waited = start.elapsed();
                            if waited > self.cfg.wait_timeout() {
                                return Err(Violation::Timeout {
                                    rank: self.me,
                                    op: self.op,
                                    kind: self.kind,
                                    step,
                                    peer,
                                    expected,
                                    seen: _seen,
                                    waited_ms: u64::try_from(waited.as_millis())
                                        .unwrap_or(u64::MAX),
                                }
                                .into());
                            }
                        }
                    }
                    spin_wait();
                }
            }
        }
    }

    /// `[R]`: the output of the last dispatch must be intact when the next op starts; a new
    /// dispatch then releases it.
    fn recheck(&mut self) -> Result<(), Stop> {
        self.step(Step::Recheck)?;
        if let Some(live) = &self.live {
            self.check_rows(Step::Recheck, live)?;
        }
        if self.kind.is_dispatch() {
            self.live = None;
        }
        Ok(())
    }

    fn check_rows(&self, step: Step, live: &Live) -> Result<(), Violation> {
        for (slot, &expected) in live.rows.iter().enumerate() {
            let found = self
                .w
                .recv(self.me, live.parity, slot)
                .load(Ordering::Relaxed);
            if found != expected {
                return Err(self.data_violation(
                    step,
                    Region::Recv,
                    live.parity,
                    slot,
                    expected,
                    found,
                ));
            }
        }
        Ok(())
    }

    fn data_violation(
        &self,
        step: Step,
        region: Region,
        parity: usize,
        slot: usize,
        expected: u64,
        found: u64,
    ) -> Violation {
        Violation::Data {
            rank: self.me,
            op: self.op,
            kind: self.kind,
            step,
            region,
            parity,
            slot,
            expected,
            found,
        }
    }

    fn count_tag(
        &self,
        step: Step,
        parity: usize,
        src: usize,
        dst: usize,
        expected: u64,
        found: u64,
    ) -> Violation {
        Violation::CountTag {
            rank: self.me,
            op: self.op,
            kind: self.kind,
            step,
            parity,
            src,
            dst,
            expected,
            found,
        }
    }

    fn check_count(
        &self,
        step: Step,
        layout_seq: u64,
        src: usize,
        dst: usize,
        found: u64,
    ) -> Result<u64, Violation> {
        let expected = route_count(layout_seq, self.cfg.tokens(), src, dst);
        if found == expected {
            Ok(found)
        } else {
            Err(Violation::CountValue {
                rank: self.me,
                op: self.op,
                kind: self.kind,
                step,
                src,
                dst,
                expected,
                found,
            })
        }
    }

    /// Round-aware barrier: bump `barrier[me]` on every rank, wait for `barrier[s] >= round`.
    fn barrier(&mut self, step: Step) -> Result<(), Stop> {
        self.step(step)?;
        self.seq.barrier_round += 1;
        let round = self.seq.barrier_round;
        for r in 0..self.world_size() {
            self.write(step, || {
                self.w.ranks[r].barrier[self.me].fetch_add(1, Ordering::Release);
            })?;
        }
        for s in 0..self.world_size() {
            self.wait_geq(
                step,
                s,
                &self.w.ranks[self.me].barrier[s],
                round,
                Ordering::Acquire,
            )?;
        }
        Ok(())
    }

    /// Bounded wait until `word` (written by `peer`) reaches `target`, loading with `order`.
    fn wait_geq(
        &self,
        step: Step,
        peer: usize,
        word: &AtomicU64,
        target: u64,
        order: Ordering,
    ) -> Result<(), Stop> {
        self.wait(step, peer, target, || {
            let seen = word.load(order);
            Ok(if seen >= target {
                Poll::Ready(())
            } else {
                Poll::Pending(seen)
            })
        })
    }

    /// `[E6]`/`[C5]`: wait until every source signalled all its blocks of this op.
    fn wait_done(&self, step: Step) -> Result<(), Stop> {
        self.step(step)?;
        let expected = self.seq.done_expected;
        let order = self.ordering(Mutation::DoneWaitRelaxed, Ordering::Acquire);
        for s in 0..self.world_size() {
            self.wait_geq(step, s, &self.w.ranks[self.me].done[s], expected, order)?;
        }
        Ok(())
    }

    /// `[E5]`/`[C2]`: one sender block is finished with all its data for every destination
    /// (combine: and with its reductions).
    fn signal_done(&self, step: Step) -> Result<(), Stop> {
        self.step(step)?;
        let order = self.ordering(Mutation::DoneAddRelaxed, Ordering::Release);
        for d in 0..self.world_size() {
            self.write(step, || {
                self.w.ranks[d].done[self.me].fetch_add(1, order);
            })?;
        }
        Ok(())
    }

    fn dispatch(&mut self, cached: bool) -> Result<OpOutput, Stop> {
        let (me, wsz, tokens, blocks) = (
            self.me,
            self.world_size(),
            self.cfg.tokens(),
            self.cfg.blocks(),
        );
        let global = self.cfg.schedule() == Schedule::Global;
        self.seq.dispatch_seq += 1;
        let e = self.seq.dispatch_seq;
        // The kernels' regions: receive rows by the dispatch sequence, counts by the notify
        // sequence (non-cached dispatches only), each through `Parity::of_epoch`, under both
        // schedules.
        let parity = self.cfg.parity(e);
        if !cached {
            self.seq.notify_seq += 1;
        }
        let n = self.seq.notify_seq;
        let npar = self.cfg.parity(n);
        if global {
            // [G1] barrier: every rank finished its previous op, including reading its output.
            self.barrier(Step::G1)?;
        }
        let count_load = self.ordering(Mutation::CountLoadsRelaxed, Ordering::Acquire);
        if !cached {
            // [E1] / [G2] write my row of counts, tagged with n, into every rank. Relaxed: the
            // word carries its value and its tag, so it publishes nothing but itself.
            let write_step = if global { Step::G2 } else { Step::E1 };
            self.step(write_step)?;
            for d in 0..wsz {
                for dst in 0..wsz {
                    let word = count_word(n, route_count(e, tokens, me, dst));
                    self.write(write_step, || {
                        self.w
                            .count(d, npar, me, dst)
                            .store(word, Ordering::Relaxed);
                    })?;
                }
            }
            if global {
                // [G3] barrier: every rank's counts have landed.
                self.barrier(Step::G3)?;
            }
            let read_step = if global { Step::G4 } else { Step::E2 };
            self.step(read_step)?;
            let mut counts = vec![0u64; wsz * wsz];
            for s in 0..wsz {
                for dst in 0..wsz {
                    let word = self.w.count(me, npar, s, dst);
                    let count = if global {
                        // [G4] read counts (acquire): the barrier guarantees tag n.
                        let (tag, count) = split_count_word(word.load(count_load));
                        if tag != n {
                            return Err(self.count_tag(read_step, npar, s, dst, n, tag).into());
                        }
                        count
                    } else {
                        // [E2] wait count row: bounded wait until the tag is n (acquire; the
                        // tag equality is what validates the value).
                        self.wait(read_step, s, n, || {
                            let (tag, count) = split_count_word(word.load(count_load));
                            if tag == n {
                                Ok(Poll::Ready(count))
                            } else if tag > n {
                                Err(self.count_tag(read_step, npar, s, dst, n, tag))
                            } else {
                                Ok(Poll::Pending(tag))
                            }
                        })?
                    };
                    counts[s * wsz + dst] = self.check_count(read_step, e, s, dst, count)?;
                }
            }
            if global {
                // [G5] barrier before any data is written.
                self.barrier(Step::G5)?;
            }
            self.layout = Layout { seq: e, counts };
        }

        // [E3] compute offsets: my rows in rank d start at sum_{s<me} count(s->d); my k-th token
        // for d (in token order) goes to slot offset + k.
        self.step(Step::E3)?;
        let layout = self.layout.clone();
        let mut next: Vec<usize> = (0..wsz)
            .map(|d| (0..me).map(|s| layout.counts[s * wsz + d] as usize).sum())
            .collect();
        let mut sends = Vec::new();
        for t in 0..tokens {
            for (d, slot) in next.iter_mut().enumerate() {
                if routes_to(layout.seq, me, t, d) {
                    sends.push((t, d, *slot));
                    *slot += 1;
                }
            }
        }

        for b in 0..blocks {
            // [E4] write data (relaxed): block b sends the tokens t with t % blocks == b.
            self.step(Step::E4)?;
            for &(t, d, slot) in sends.iter().filter(|(t, _, _)| t % blocks == b) {
                self.write(Step::E4, || {
                    self.w
                        .recv(d, parity, slot)
                        .store(data_word(e, me, t), Ordering::Relaxed);
                })?;
            }
            // [E5] signal done: release increment after all of this block's data.
            self.signal_done(Step::E5)?;
        }
        self.seq.done_expected += blocks as u64;

        // [E6] wait done[s] >= expected for all s (acquire).
        if !(cached && self.cfg.has(Mutation::SkipCachedDoneWait)) {
            self.wait_done(Step::E6)?;
        }

        // [E7] read output: per-source counts (fresh dispatch: re-read the count words, which
        // must still carry tag n; cached: the cached layout), then the rows.
        self.step(Step::E7)?;
        if !cached {
            for s in 0..wsz {
                let (tag, count) = split_count_word(self.w.count(me, npar, s, me).load(count_load));
                if tag != n {
                    return Err(self.count_tag(Step::E7, npar, s, me, n, tag).into());
                }
                self.check_count(Step::E7, layout.seq, s, me, count)?;
            }
        }
        let live = Live {
            seq: e,
            parity,
            rows: expected_rows(self.cfg, layout.seq, e, me),
        };
        self.check_rows(Step::E7, &live)?;
        let output = OpOutput::Dispatch {
            seq: e,
            rows: live.rows.clone(),
        };
        self.live = Some(live);
        Ok(output)
    }

    fn combine(&mut self) -> Result<OpOutput, Stop> {
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
