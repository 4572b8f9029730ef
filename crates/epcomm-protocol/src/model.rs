//! The protocol model: shared per-rank buffers and the per-rank program.
//!
//! Every rank is a thread running [`run_rank`]; every shared word is an atomic (see
//! [`crate::sync`]). The code is written step by step with the stable labels of [`Step`]; the
//! CUDA kernels mirror it and cite the labels.
//!
//! The model checks itself while it runs, against the routing oracle of [`crate::config`]:
//! a count word with the wrong epoch tag, a count that disagrees with the routing, or a data word
//! that differs from the sequential expectation is reported as a [`Violation`] instead of being
//! used. Under loom every interleaving (within the preemption bound) is explored, so a
//! [`Violation`] in any schedule is found.

use std::fmt;

use crate::config::{
    ModelConfig, OpKind, Strategy, combine_word, count_word, data_word, route_count, routes_to,
    split_count_word, split_data_word,
};
use crate::reference::{OpOutput, RankReport, expected_rows};
use crate::step::Step;
use crate::sync::{AtomicU64, Ordering, spin_wait};

/// Observer called by every rank before each labelled step.
///
/// Tests use it to inject delays (std stress tests) or to force one specific interleaving
/// (deterministic negative tests). Under loom use [`NoHook`]: loom already explores schedules.
pub trait StepHook: Send + Sync {
    /// Called by rank `rank` right before it executes `step` of op number `op` (0-based) of
    /// kind `kind`. Steps that repeat per sender block (`[E4]`, `[E5]`, `[C1]`, `[C2]`) are
    /// reported once per block.
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
    /// A count word carried another epoch than the op's: stale (older) or written by a peer more
    /// than one op ahead (newer). Property (a).
    #[error(
        "rank {rank}, op {op} ({kind:?}), {step}: count_matrix[{parity}][{src}][{dst}] carries epoch {found}, the op runs epoch {expected}"
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
        /// The op's epoch.
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
        /// Region index (parity, or 0 for single-region strategies).
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
    /// `count_matrix[parity][src][dst]`: tagged words `(epoch << 32) | count`.
    count: Vec<AtomicU64>,
    /// `recv[parity][slot]`.
    recv: Vec<AtomicU64>,
    /// `comb[parity][src][token]`.
    comb: Vec<AtomicU64>,
    /// `done[src]`: monotonic, one increment per sender block per op.
    done: Vec<AtomicU64>,
    /// `barrier[src]`: monotonic, one increment per barrier (Global only).
    barrier: Vec<AtomicU64>,
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
        let (w, t, p) = (cfg.world(), cfg.tokens(), cfg.strategy().regions());
        let ranks = (0..w)
            .map(|_| RankBuffer {
                count: zeroed(p * w * w),
                recv: zeroed(p * cfg.recv_slots()),
                comb: zeroed(p * w * t),
                done: zeroed(w),
                barrier: zeroed(w),
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
}

/// Layout of the last non-cached dispatch: its epoch and the full count matrix `[s * W + d]`.
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

struct Rank<'a> {
    me: usize,
    w: &'a World,
    cfg: &'a ModelConfig,
    hook: &'a dyn StepHook,
    op: usize,
    kind: OpKind,
    dispatch_seq: u64,
    combine_seq: u64,
    done_expected: u64,
    barrier_round: u64,
    layout: Layout,
    live: Option<Live>,
    outputs: Vec<OpOutput>,
}

/// Runs every op of the world's configuration as rank `rank` and returns what it produced.
///
/// Must be called once per rank, concurrently (under loom: from loom threads inside
/// `loom::model`). Returns [`RunError::Violation`] at the first protocol violation it detects.
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
        dispatch_seq: 0,
        combine_seq: 0,
        done_expected: 0,
        barrier_round: 0,
        layout: Layout::default(),
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

/// Runs the whole model with one std thread per rank.
///
/// Returns every rank's report, or every violation (causes first) if any rank found one.
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
            self.recheck()?;
            match kind {
                OpKind::Dispatch => self.dispatch(false)?,
                OpKind::CachedDispatch => self.dispatch(true)?,
                OpKind::Combine => self.combine()?,
            }
        }
        Ok(())
    }

    fn step(&self, step: Step) {
        self.hook.at(self.me, self.op, self.kind, step);
    }

    fn parity(&self, seq: u64) -> usize {
        (seq % self.cfg.strategy().regions() as u64) as usize
    }

    fn world_size(&self) -> usize {
        self.cfg.world()
    }

    /// Bounded spin-wait on `peer`'s word; `poll` loads it (acquire) and says whether it is ready.
    fn wait<T>(
        &self,
        step: Step,
        peer: usize,
        expected: u64,
        mut poll: impl FnMut() -> Result<Poll<T>, Violation>,
    ) -> Result<T, Violation> {
        // Under loom the waits are unbounded (loom reports a schedule where nobody can progress).
        #[cfg(loom)]
        let _ = (step, peer, expected);
        #[cfg(not(loom))]
        let start = std::time::Instant::now();
        #[cfg(not(loom))]
        let mut spins: u32 = 0;
        loop {
            match poll()? {
                Poll::Ready(value) => return Ok(value),
                Poll::Pending(_seen) => {
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
                            });
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
                                });
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
    fn recheck(&mut self) -> Result<(), Violation> {
        self.step(Step::Recheck);
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
    fn barrier(&mut self, step: Step) -> Result<(), Violation> {
        self.step(step);
        self.barrier_round += 1;
        let round = self.barrier_round;
        for r in 0..self.world_size() {
            self.w.ranks[r].barrier[self.me].fetch_add(1, Ordering::Release);
        }
        for s in 0..self.world_size() {
            let word = &self.w.ranks[self.me].barrier[s];
            self.wait(step, s, round, || {
                let seen = word.load(Ordering::Acquire);
                Ok(if seen >= round {
                    Poll::Ready(())
                } else {
                    Poll::Pending(seen)
                })
            })?;
        }
        Ok(())
    }

    /// `[E6]`/`[C3]`: wait until every source signalled all its blocks of this op.
    fn wait_done(&self, step: Step) -> Result<(), Violation> {
        self.step(step);
        let expected = self.done_expected;
        for s in 0..self.world_size() {
            let word = &self.w.ranks[self.me].done[s];
            self.wait(step, s, expected, || {
                let seen = word.load(Ordering::Acquire);
                Ok(if seen >= expected {
                    Poll::Ready(())
                } else {
                    Poll::Pending(seen)
                })
            })?;
        }
        Ok(())
    }

    /// `[E5]`/`[C2]`: one sender block is finished with all its data for every destination.
    fn signal_done(&self, step: Step) {
        self.step(step);
        for d in 0..self.world_size() {
            self.w.ranks[d].done[self.me].fetch_add(1, Ordering::Release);
        }
    }

    fn dispatch(&mut self, cached: bool) -> Result<(), Violation> {
        let (me, wsz, tokens, blocks) = (
            self.me,
            self.world_size(),
            self.cfg.tokens(),
            self.cfg.blocks(),
        );
        let global = self.cfg.strategy() == Strategy::Global;
        self.dispatch_seq += 1;
        let e = self.dispatch_seq;
        let parity = self.parity(e);
        if global {
            // [G1] barrier: every rank finished its previous op, including reading its output.
            self.barrier(Step::G1)?;
        }
        if !cached {
            // [E1] / [G2] write my row of counts, tagged with e, into every rank (release).
            self.step(if global { Step::G2 } else { Step::E1 });
            for d in 0..wsz {
                for dst in 0..wsz {
                    let word = count_word(e, route_count(e, tokens, me, dst));
                    self.w
                        .count(d, parity, me, dst)
                        .store(word, Ordering::Release);
                }
            }
            if global {
                // [G3] barrier: every rank's counts have landed.
                self.barrier(Step::G3)?;
            }
            let read_step = if global { Step::G4 } else { Step::E2 };
            self.step(read_step);
            let mut counts = vec![0u64; wsz * wsz];
            for s in 0..wsz {
                for dst in 0..wsz {
                    let word = self.w.count(me, parity, s, dst);
                    let count = if global {
                        // [G4] read counts (acquire): the barrier guarantees tag e.
                        let (tag, count) = split_count_word(word.load(Ordering::Acquire));
                        if tag != e {
                            return Err(self.count_tag(read_step, parity, s, dst, e, tag));
                        }
                        count
                    } else {
                        // [E2] wait count row: bounded wait until the tag is e (acquire).
                        self.wait(read_step, s, e, || {
                            let (tag, count) = split_count_word(word.load(Ordering::Acquire));
                            if tag == e {
                                Ok(Poll::Ready(count))
                            } else if tag > e {
                                Err(self.count_tag(read_step, parity, s, dst, e, tag))
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
        self.step(Step::E3);
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
            self.step(Step::E4);
            for &(t, d, slot) in sends.iter().filter(|(t, _, _)| t % blocks == b) {
                self.w
                    .recv(d, parity, slot)
                    .store(data_word(e, me, t), Ordering::Relaxed);
            }
            // [E5] signal done: release increment after all of this block's data.
            self.signal_done(Step::E5);
        }
        self.done_expected += blocks as u64;

        // [E6] wait done[s] >= expected for all s (acquire).
        self.wait_done(Step::E6)?;

        // [E7] read output: per-source counts (fresh dispatch: re-read the count words, which
        // must still carry tag e; cached: the cached layout), then the rows.
        self.step(Step::E7);
        if !cached {
            for s in 0..wsz {
                let (tag, count) =
                    split_count_word(self.w.count(me, parity, s, me).load(Ordering::Acquire));
                if tag != e {
                    return Err(self.count_tag(Step::E7, parity, s, me, e, tag));
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
        self.outputs.push(OpOutput::Dispatch {
            seq: e,
            rows: live.rows.clone(),
        });
        self.live = Some(live);
        Ok(())
    }

    fn combine(&mut self) -> Result<(), Violation> {
        let (me, wsz, tokens, blocks) = (
            self.me,
            self.world_size(),
            self.cfg.tokens(),
            self.cfg.blocks(),
        );
        self.combine_seq += 1;
        let c = self.combine_seq;
        let parity = self.parity(c);
        if self.cfg.strategy() == Strategy::Global {
            // [G1] barrier: every rank finished its previous op (single comb region).
            self.barrier(Step::G1)?;
        }
        let live = self.live.clone().unwrap_or_default();
        let mut local: Vec<Option<u64>> = vec![None; tokens];
        for b in 0..blocks {
            // [C1] write contributions: block b returns rows r with r % blocks == b, read from
            // the live dispatch output, to their owner's comb[c%2][me][token] (relaxed).
            self.step(Step::C1);
            for (slot, &expected) in live
                .rows
                .iter()
                .enumerate()
                .filter(|(r, _)| r % blocks == b)
            {
                let row = self.w.recv(me, live.parity, slot).load(Ordering::Relaxed);
                if row != expected {
                    return Err(self.data_violation(
                        Step::C1,
                        Region::Recv,
                        live.parity,
                        slot,
                        expected,
                        row,
                    ));
                }
                let (_, owner, token) = split_data_word(row);
                let value = combine_word(c, me, row);
                if owner == me {
                    local[token] = Some(value);
                } else {
                    self.w
                        .comb(owner, parity, me, token)
                        .store(value, Ordering::Relaxed);
                }
            }
            // [C2] signal done: release increment after this block's contributions.
            self.signal_done(Step::C2);
        }
        self.done_expected += blocks as u64;

        // [C3] wait done[s] >= expected for all s (acquire).
        self.wait_done(Step::C3)?;

        // [C4] reduce in rank order: comb[c%2][s][t] for s != me, local data for s == me.
        self.step(Step::C4);
        let mut reduced = Vec::with_capacity(tokens);
        for (t, &local_t) in local.iter().enumerate() {
            let row = data_word(live.seq, me, t);
            let mut acc = 0u64;
            for s in 0..wsz {
                if !routes_to(self.layout.seq, me, t, s) {
                    continue;
                }
                let expected = combine_word(c, s, row);
                let (found, region, slot) = if s == me {
                    // Local row: a missing one reads as 0 (slot = the token index).
                    (local_t.unwrap_or(0), Region::Recv, t)
                } else {
                    let v = self.w.comb(me, parity, s, t).load(Ordering::Relaxed);
                    (v, Region::Comb, s * tokens + t)
                };
                if found != expected {
                    return Err(self.data_violation(
                        Step::C4,
                        region,
                        parity,
                        slot,
                        expected,
                        found,
                    ));
                }
                acc = acc.wrapping_add(found);
            }
            reduced.push(acc);
        }
        self.outputs.push(OpOutput::Combine { seq: c, reduced });
        Ok(())
    }
}
