//! What a model run executes: world size, shapes, schedule, the op sequence, an optional
//! injected failure, optional protocol mutations, and the deterministic routing oracle that
//! defines the sequential expectation.
//!
//! The schedule is the kernels' own [`Schedule`] type; the region an op uses is the kernels'
//! rule, [`Parity::of_epoch`] of its sequence number, under both schedules.

use std::time::Duration;

use epcomm_topology::{Parity, Schedule};

use crate::step::Step;

/// Largest world the model accepts (routing uses one hash bit per destination).
pub const MAX_WORLD: usize = 8;
/// Largest number of tokens per rank (token ids are encoded in 16 bits of a data word).
pub const MAX_TOKENS: usize = 1 << 12;
/// Largest number of sender blocks per rank.
pub const MAX_BLOCKS: usize = 64;
/// Largest op sequence (epochs are 32-bit tags).
pub const MAX_OPS: usize = 1 << 20;
/// Largest ring of chunked forwarding the model accepts ([`ModelConfig::with_rail_ring`]).
pub const MAX_RING_SLOTS: usize = 4;
/// Largest chunk of chunked forwarding the model accepts, in rows.
pub const MAX_CHUNK_ROWS: usize = 4;

/// The ring of chunked forwarding ([`ModelConfig::with_rail_ring`]): `slots` slots (`R`) of
/// `chunk_rows` rows (`C`) per source node at each forwarder.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RailRing {
    /// `R`: chunks in flight per source node.
    pub slots: usize,
    /// `C`: rows per chunk (an op's last chunk to a peer may hold fewer).
    pub chunk_rows: usize,
}

impl RailRing {
    /// Chunks of an op that sends `rows` rows to one rail peer: `ceil(rows / C)`.
    pub fn chunks(&self, rows: u64) -> u64 {
        rows.div_ceil(self.chunk_rows as u64)
    }
}

/// One collective op; every rank calls the same sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// Dispatch with a fresh layout: exchanges counts, then data.
    Dispatch,
    /// Dispatch reusing the layout (offsets) of the last [`OpKind::Dispatch`]; skips `[E1]`-`[E2]`
    /// (Global: `[G2]`-`[G5]`) but consumes the next dispatch sequence number.
    CachedDispatch,
    /// Combine: every rank returns the rows of the last dispatch to their owners, which reduce.
    Combine,
    /// Low-latency dispatch (`kernels/ll/`): a send phase (`[L1]`..`[L4]`) and a receive phase
    /// (`[L5]``[L6]``[L7]`) of the same rank, with its own sequence number `l` (the kernels'
    /// `ll_dispatch`) and its own routing ([`ll_routes_to`]); no count exchange, no offsets.
    /// The kernels' fused form (one kernel runs both phases) executes the same steps back to
    /// back, so it is this op.
    LlDispatch,
    /// Low-latency combine: every rank returns the rows of its last [`OpKind::LlDispatch`] to
    /// their owners (send phase `[L8]`, `[L4]`), which reduce them (receive phase `[L5]`,
    /// `[L9]`); its own sequence number (the kernels' `ll_combine`).
    LlCombine,
    /// Hierarchical internode dispatch (model only; no kernel yet): ranks are `(node, local)`,
    /// a token crosses the network once per destination node, to its rail peer, which forwards
    /// it over NVLink (`[I1]`..`[I12]`). Exchanges counts (tagged with its own notify sequence)
    /// and has its own sequence number, regions, layout and live output; its output equals the
    /// flat [`OpKind::Dispatch`]'s for the same layout.
    InternodeDispatch,
    /// Hierarchical dispatch reusing the layout of the last [`OpKind::InternodeDispatch`]: no
    /// count exchange (`[I2]`..`[I4]`, `[I10]` skipped); waits only on the peers it receives
    /// from (and on the credits of the peers it writes into).
    InternodeCachedDispatch,
    /// Hierarchical internode combine (model only; no kernel yet): every rank returns the rows
    /// of its last internode dispatch (cached or not) to their sources, reusing its layout
    /// (`[J1]`..`[J9]`). Rows of a source in another node go to the rail peer that forwarded
    /// them, which reduces its node's rows into one partial per token and returns it over the
    /// rail; rows of a source in the same node go to it directly. Its own sequence number `q`
    /// (combine regions `q % 2`, done values) and credits; its output equals the flat
    /// [`OpKind::Combine`]'s for the same layout (with [`inter_combine_word`] contributions).
    InternodeCombine,
}

impl OpKind {
    /// Whether the op is a normal dispatch (cached or not): it writes the receive region and
    /// releases the live output of the last one. Low-latency ops are not.
    pub fn is_dispatch(self) -> bool {
        matches!(self, OpKind::Dispatch | OpKind::CachedDispatch)
    }

    /// Whether the op is a low-latency op ([`OpKind::LlDispatch`] or [`OpKind::LlCombine`]).
    pub fn is_low_latency(self) -> bool {
        matches!(self, OpKind::LlDispatch | OpKind::LlCombine)
    }

    /// Whether the op is a hierarchical internode dispatch (cached or not): it writes the
    /// internode receive regions and releases the live output of the last one.
    pub fn is_internode(self) -> bool {
        matches!(
            self,
            OpKind::InternodeDispatch | OpKind::InternodeCachedDispatch
        )
    }

    /// Whether the op belongs to the hierarchical internode family (a dispatch, cached or
    /// not, or [`OpKind::InternodeCombine`]).
    pub fn is_internode_family(self) -> bool {
        self.is_internode() || self == OpKind::InternodeCombine
    }
}

/// A deliberate change to the protocol, for mutation tests: each one weakens one ordering or
/// drops one check that the CUDA kernels rely on, and the model checker must catch it (the
/// exception, [`Mutation::CountLoadsRelaxed`], is benign and the checker must accept it).
///
/// Never mirror a mutation in CUDA.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mutation {
    /// `[C1]`: the per-token flag store is `Relaxed` instead of `Release`, so the flag no
    /// longer publishes the contribution row stored before it.
    FlagStoreRelaxed,
    /// `[C3]`: the per-token flag wait loads with `Relaxed` instead of `Acquire`.
    FlagWaitRelaxed,
    /// `[E5]`/`[C2]`: the done increment is `Relaxed` instead of `Release`.
    DoneAddRelaxed,
    /// `[E6]`/`[C5]`: the done wait loads with `Relaxed` instead of `Acquire`.
    DoneWaitRelaxed,
    /// `[E2]`/`[E7]`/`[G4]`: the count words are loaded with `Relaxed` instead of `Acquire`.
    /// **Benign**: a count word is self-validating (the value travels with its tag) and its
    /// store `[E1]` is relaxed, so the acquire publishes nothing; the model must still pass.
    CountLoadsRelaxed,
    /// **Deliberately unsound** under [`Schedule::Epoch`]: one count, receive and combine
    /// region instead of the two parity regions ([`ModelConfig::parity`] is always 0). The
    /// checker must catch the bugs parity buffering prevents (stale counts, receive rows
    /// overwritten before use). Two things it leaves safe, which the tests also show: a single
    /// combine region (done is signalled after the reduction and `[C5]` waits for it), and
    /// [`Schedule::Global`], whose `[G1]` barrier alone protects single regions (DeepEP's
    /// design). Never mirror it in CUDA.
    SingleRegion,
    /// Drops `[C5]`, combine's final wait for every rank's done signal. A rank that holds no
    /// token for a peer then waits for nothing from it and can run combines ahead of it.
    SkipFinalWait,
    /// Drops `[E6]` in a cached dispatch: the receiver reads its rows without waiting for them.
    SkipCachedDoneWait,
    /// Drops `[F1]`, the prologue's failure check: after a failed op the rank runs its next op
    /// anyway, with the sequence numbers it did not advance.
    SkipPrologueCheck,
    /// The bounded waits stop polling the abort word (and the failure claim): a peer of a failed
    /// rank waits for a signal that never comes.
    SkipAbortPoll,
    /// **Deliberately unsound**: one low-latency region (`ll_x`, `ll_counts`, `ll_comb`) instead
    /// of two parities ([`ModelConfig::ll_parity`] is always 0). A send phase then writes a
    /// region a peer may still be reading in its receive phase of the previous op (its done
    /// signal comes before its reads). Under [`Schedule::Global`] the `[G1]` barrier alone
    /// protects single regions, as for the normal ops.
    LlSingleRegion,
    /// Drops `[L5]`: the low-latency receive phase reads counts and rows without waiting for
    /// the senders' done signals.
    LlSkipDoneWait,
    /// `[L2]` stores the bare row count, without the LL epoch tag: `[L6]` can no longer tell
    /// this op's word from "never written" or from op `l - 2`'s, and must reject it.
    LlUntaggedCount,
    /// `[I4]`: the forwarder takes the rail count words as they are, without waiting for the
    /// notify tag: it relays (and expects rows by) a count that may be stale or never written.
    InterSkipRailCountWait,
    /// `[I11]`: the final receiver does not wait for the done signal of the sources whose rows
    /// are forwarded (other nodes): it reads rows the forwarder has not written yet.
    InterSkipForwardDoneWait,
    /// `[I5]`: the writers do not wait for the credit of the peers they write into: a cached
    /// dispatch that waits on nobody can overwrite the live output a peer still reads.
    InterSkipCredit,
    /// `[J5]`: the forwarder does not wait for the done signals of its node's contributors
    /// before it reduces: it sends a partial built from contributions that have not landed.
    InterCombineSkipLocalWait,
    /// `[J8]`: the source does not wait for the rail partials' done signals: it reads a
    /// partial before it lands.
    InterCombineSkipPartialWait,
    /// `[J2]`: the contributors do not wait for the combine credit of the ranks they write
    /// into: a combine can overwrite a region a slower peer has not reduced yet.
    InterCombineSkipCredit,
    /// `[I8]`: the forwarder's wait for its rail peer's rows does not poll the abort word:
    /// after that peer (or any rank) failed, the forwarder keeps waiting for rows that never
    /// come, until its bounded wait expires, instead of ending the op in an error.
    InterForwarderIgnoresAbort,
    /// `[A1]`/`[A2]`: one intent slot per source instead of two (by agreed-op parity): a rank
    /// that finished an op writes its next op's intent word over the one a slower peer is
    /// still checking.
    IntentOneSlot,
    /// `[L6]` under masking ([`ModelConfig::with_ll_masking`]): the receive phase keeps what the
    /// count read gives for a masked source (its word, when it carries this op's tag: what the
    /// kernels' tagged count wait returns) instead of counting no rows from it, as if it did not
    /// re-read the mask after the count waits. A source masked by `[L5]` (its done signal never
    /// came) may have stored its counts and rows before it stopped: they are packed, without the
    /// done signal that would publish them.
    LlMaskedCountsKept,
    /// `[L9]` under masking: the reduction adds the entries whose expert's rank is masked
    /// instead of skipping them: it reads a combine row that rank never wrote in this op (never
    /// written, or a stale one of an earlier combine of the same parity).
    LlMaskedEntriesReduced,
    /// `[I6c]` (chunked forwarding): the sender does not wait for the forwarder's ring credit:
    /// it overwrites a ring slot whose chunk the forwarder has not forwarded yet.
    RingSkipCredit,
    /// `[I8c]` (chunked forwarding): the forwarder does not wait for the chunk count: it reads
    /// a ring slot before the chunk in it landed.
    RingSkipChunkWait,
    /// `[I9c]` (chunked forwarding): the forwarder's credit counts one chunk past those it
    /// forwarded, as a credit stored out of order would (chunk `g + 1` credited while chunk
    /// `g + 1` is still unread): the sender may overwrite that chunk's slot before it is read.
    RingCreditAhead,
    /// `[J8c]` (streamed partials): the source does not wait for the chunk count: it takes a
    /// partial from its ring before it landed.
    PartialRingSkipChunkWait,
}

impl Mutation {
    /// Every mutation.
    pub const ALL: [Mutation; 27] = [
        Mutation::FlagStoreRelaxed,
        Mutation::FlagWaitRelaxed,
        Mutation::DoneAddRelaxed,
        Mutation::DoneWaitRelaxed,
        Mutation::CountLoadsRelaxed,
        Mutation::SingleRegion,
        Mutation::SkipFinalWait,
        Mutation::SkipCachedDoneWait,
        Mutation::SkipPrologueCheck,
        Mutation::SkipAbortPoll,
        Mutation::LlSingleRegion,
        Mutation::LlSkipDoneWait,
        Mutation::LlUntaggedCount,
        Mutation::InterSkipRailCountWait,
        Mutation::InterSkipForwardDoneWait,
        Mutation::InterSkipCredit,
        Mutation::InterCombineSkipLocalWait,
        Mutation::InterCombineSkipPartialWait,
        Mutation::InterCombineSkipCredit,
        Mutation::InterForwarderIgnoresAbort,
        Mutation::IntentOneSlot,
        Mutation::LlMaskedCountsKept,
        Mutation::LlMaskedEntriesReduced,
        Mutation::RingSkipCredit,
        Mutation::RingSkipChunkWait,
        Mutation::RingCreditAhead,
        Mutation::PartialRingSkipChunkWait,
    ];

    /// Whether the protocol stays correct under this mutation (the checker must accept it).
    pub fn is_benign(self) -> bool {
        matches!(self, Mutation::CountLoadsRelaxed)
    }
}

/// The failure a model run injects: rank `rank` fails in op `op` (0-based) right before it
/// executes `at`, as if a bounded wait there had timed out.
///
/// The failing rank records the failure (its local claim), publishes the abort word to every
/// peer (`[F2]`) and leaves the op without advancing its sequence numbers; its later ops, and
/// every op of a peer that saw the failure, must exit at the prologue check `[F1]`.
///
/// In an internode op (`[I*]`, `[J*]`, `[G1]`, `[R]`) the failure fires at the first time the
/// rank announces `at`; a forwarder step (`[I8]`, `[I9]`, `[J5]`..`[J7]`) is announced only by
/// a rank that forwards rows in that op ([`crate::failure_fires`] says whether it
/// does). The peers' rule is [`crate::check_outcome_internode`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Failure {
    /// The failing rank.
    pub rank: usize,
    /// Index of the op in which it fails.
    pub op: usize,
    /// The step before which it fails (first sender block for per-block steps).
    pub at: Step,
}

impl Failure {
    /// Whether the failing rank has already published every done signal of the failing op
    /// (it fails in or after the op's final wait, `[E6]`, `[E7]` or `[C5]`; in a low-latency
    /// op at or after `[L5]`): its peers may then complete that op; otherwise none of them can.
    /// (A failure at the low-latency receive phase's `[G2]` barrier is not: the peers' `[G2]`
    /// waits for it.)
    pub fn after_done(&self) -> bool {
        matches!(
            self.at,
            Step::E6 | Step::E7 | Step::C5 | Step::L5 | Step::L6 | Step::L7 | Step::L9
        )
    }

    /// Whether `at` is a step an op of kind `kind` executes under `schedule`.
    pub fn step_is_valid(schedule: Schedule, kind: OpKind, at: Step) -> bool {
        use Step::*;
        let global = schedule == Schedule::Global;
        if kind.is_internode_family() {
            let cached = kind == OpKind::InternodeCachedDispatch;
            return match at {
                Recheck => true,
                G1 => global,
                I1 | I5 | I6 | I7 | I8 | I9 | I11 | I12 => kind.is_internode(),
                I2 | I3 | I4 | I10 => kind.is_internode() && !cached,
                J1 | J2 | J3 | J4 | J5 | J6 | J7 | J8 | J9 => kind == OpKind::InternodeCombine,
                _ => false,
            };
        }
        match at {
            Recheck => true,
            E1 | E2 => kind == OpKind::Dispatch && !global,
            G2 => (kind == OpKind::Dispatch || kind.is_low_latency()) && global,
            G3 | G4 | G5 => kind == OpKind::Dispatch && global,
            G1 => global,
            E3 | E4 | E5 | E6 | E7 => kind.is_dispatch(),
            C1 | C2 | C3 | C4 | C5 => kind == OpKind::Combine,
            L1 | L2 | L3 | L6 | L7 => kind == OpKind::LlDispatch,
            L4 | L5 => kind.is_low_latency(),
            L8 | L9 => kind == OpKind::LlCombine,
            F1 | F2 => false,
            I1 | I2 | I3 | I4 | I5 | I6 | I7 | I8 | I9 | I10 | I11 | I12 => false,
            // The ring's steps: reached in an order the schedule decides, so no failure is
            // injected there (before and after them it is).
            I6c | I8c | I9c | J6c | J8c | J9c => false,
            J1 | J2 | J3 | J4 | J5 | J6 | J7 | J8 | J9 => false,
            A1 | A2 => false,
        }
    }
}

/// A rank that stops (a hung or killed process): rank `rank` runs ops `0..op` to completion,
/// then stops right before it executes `at` in op `op` and runs nothing more, of that op or of
/// a later one. Unlike a [`Failure`] it claims nothing and publishes no abort word; it stays
/// alive in the sense that its memory stays mapped (peers may keep writing into it) and keeps
/// what it stored before it stopped.
///
/// `at = `[`Step::F1`] stops the rank before op `op` starts (it stops calling ops); any other
/// step the op executes ([`Failure::step_is_valid`]) stops it in the middle of the op (as
/// for a failure, at the first time the rank announces `at`: the first sender block for
/// per-block steps). Only intranode ops: a configuration with a stopped rank runs no internode
/// op and injects no [`Failure`].
///
/// What the peers (the survivors) must do is [`crate::check_outcome`]'s stop rule: their waits
/// for the stopped rank expire; with [`ModelConfig::with_ll_masking`] a low-latency op masks it
/// and completes without it, every other op fails ([`crate::OpError::Expired`], then the
/// abort word).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StoppedRank {
    /// The rank that stops.
    pub rank: usize,
    /// Index of the op in which it stops.
    pub op: usize,
    /// The step before which it stops ([`Step::F1`]: before the op starts).
    pub at: Step,
}

impl StoppedRank {
    /// Whether `at` is a stop point of an op of kind `kind` under `schedule`: [`Step::F1`]
    /// (before the op), or a step the op executes ([`Failure::step_is_valid`]).
    pub fn step_is_valid(schedule: Schedule, kind: OpKind, at: Step) -> bool {
        at == Step::F1 || Failure::step_is_valid(schedule, kind, at)
    }

    /// Whether the stopped rank published every signal of the op it stops in before it stopped
    /// (the same steps as [`Failure::after_done`]): its peers then complete that op with it, as
    /// if it had not stopped; otherwise every wait of theirs for it in that op expires.
    pub fn after_done(&self) -> bool {
        Failure {
            rank: self.rank,
            op: self.op,
            at: self.at,
        }
        .after_done()
    }

    /// Whether the peers of the stopped rank treat it as absent in op `op`: the op is the stop
    /// op and the rank stopped before its last signal, or a later op.
    pub fn absent_in(&self, op: usize) -> bool {
        op > self.op || (op == self.op && !self.after_done())
    }
}

/// A configuration rejected by [`ModelConfig::new`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// `world` outside `1..=MAX_WORLD`.
    #[error("world = {world}: the model needs 1..={MAX_WORLD} ranks")]
    World {
        /// The rejected value.
        world: usize,
    },
    /// `tokens` outside `1..=MAX_TOKENS`.
    #[error("tokens = {tokens}: each rank needs 1..={MAX_TOKENS} tokens")]
    Tokens {
        /// The rejected value.
        tokens: usize,
    },
    /// `blocks` outside `1..=MAX_BLOCKS`.
    #[error("blocks = {blocks}: each rank needs 1..={MAX_BLOCKS} sender blocks")]
    Blocks {
        /// The rejected value.
        blocks: usize,
    },
    /// `ops` is empty or longer than `MAX_OPS`.
    #[error("ops has {len} entries: the model needs 1..={MAX_OPS} ops")]
    OpCount {
        /// The rejected length.
        len: usize,
    },
    /// A cached dispatch with no earlier [`OpKind::Dispatch`] to take its layout from.
    #[error(
        "ops[{index}] is CachedDispatch but no Dispatch precedes it (a cached dispatch reuses the layout of an earlier Dispatch)"
    )]
    CachedWithoutLayout {
        /// Index of the offending op.
        index: usize,
    },
    /// A combine with no earlier dispatch whose rows it could return.
    #[error(
        "ops[{index}] is Combine but no dispatch precedes it (combine returns the rows of the last dispatch)"
    )]
    CombineWithoutDispatch {
        /// Index of the offending op.
        index: usize,
    },
    /// A low-latency combine with no earlier low-latency dispatch whose rows it could return.
    #[error(
        "ops[{index}] is LlCombine but no LlDispatch precedes it (a low-latency combine returns the rows of the last low-latency dispatch)"
    )]
    LlCombineWithoutLlDispatch {
        /// Index of the offending op.
        index: usize,
    },
    /// A cached internode dispatch with no earlier internode dispatch to take its layout from.
    #[error("ops[{index}] is InternodeCachedDispatch but no InternodeDispatch precedes it")]
    InternodeCachedWithoutLayout {
        /// Index of the offending op.
        index: usize,
    },
    /// An internode combine with no earlier internode dispatch whose rows it could return.
    #[error("ops[{index}] is InternodeCombine but no InternodeDispatch precedes it")]
    InternodeCombineWithoutDispatch {
        /// Index of the offending op.
        index: usize,
    },
    /// `nodes` is zero or does not divide the world.
    #[error("nodes = {nodes}: must be positive and divide the world size {world}")]
    Nodes {
        /// The rejected value.
        nodes: usize,
        /// The world size.
        world: usize,
    },
    /// A zero wait timeout.
    #[error("wait_timeout is zero: bounded waits need a positive timeout")]
    ZeroTimeout,
    /// An injected failure names a rank outside the world.
    #[error("failure.rank = {rank}: must be below the world size {world}")]
    FailureRank {
        /// The rejected rank.
        rank: usize,
        /// The world size.
        world: usize,
    },
    /// An injected failure names an op outside the op sequence.
    #[error("failure.op = {op}: the configuration has {len} ops")]
    FailureOp {
        /// The rejected op index.
        op: usize,
        /// Number of ops.
        len: usize,
    },
    /// An injected failure names a step the op does not execute.
    #[error(
        "failure.at = {at}: ops[{op}] ({kind:?}) does not execute it under the {schedule} schedule"
    )]
    FailureStep {
        /// The op index.
        op: usize,
        /// Its kind.
        kind: OpKind,
        /// The schedule.
        schedule: Schedule,
        /// The rejected step.
        at: Step,
    },
    /// A stopped rank outside the world.
    #[error("stopped.rank = {rank}: must be below the world size {world}")]
    StopRank {
        /// The rejected rank.
        rank: usize,
        /// The world size.
        world: usize,
    },
    /// A stopped rank's op outside the op sequence.
    #[error("stopped.op = {op}: the configuration has {len} ops")]
    StopOp {
        /// The rejected op index.
        op: usize,
        /// Number of ops.
        len: usize,
    },
    /// A stop point the op does not execute ([`StoppedRank::step_is_valid`]).
    #[error(
        "stopped.at = {at}: ops[{op}] ({kind:?}) does not execute it under the {schedule} schedule"
    )]
    StopStep {
        /// The op index.
        op: usize,
        /// Its kind.
        kind: OpKind,
        /// The schedule.
        schedule: Schedule,
        /// The rejected step.
        at: Step,
    },
    /// A stopped rank together with an injected failure: the model judges one at a time.
    #[error("a configuration injects a failure or stops a rank, not both")]
    StopWithFailure,
    /// A stopped rank in a configuration with internode ops (their rule is
    /// [`crate::check_outcome_internode`]'s, for failures only).
    #[error("ops[{index}] is an internode op: a stopped rank is modelled with intranode ops only")]
    StopWithInternode {
        /// Index of the first internode op.
        index: usize,
    },
    /// A ring of chunked forwarding of `slots` slots, outside `1..=MAX_RING_SLOTS`.
    #[error("ring slots = {slots}: chunked forwarding needs 1..={MAX_RING_SLOTS} slots")]
    RingSlots {
        /// The rejected value.
        slots: usize,
    },
    /// Chunks of `chunk_rows` rows, outside `1..=MAX_CHUNK_ROWS`.
    #[error(
        "chunk rows = {chunk_rows}: chunked forwarding needs 1..={MAX_CHUNK_ROWS} rows per chunk"
    )]
    RingChunkRows {
        /// The rejected value.
        chunk_rows: usize,
    },
}

/// A validated model configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelConfig {
    world: usize,
    tokens: usize,
    blocks: usize,
    schedule: Schedule,
    ops: Vec<OpKind>,
    nodes: usize,
    wait_timeout: Duration,
    failure: Option<Failure>,
    stopped: Option<StoppedRank>,
    ll_masking: bool,
    rail_ring: Option<RailRing>,
    mutations: Vec<Mutation>,
}

impl ModelConfig {
    /// Default bound of every spin-wait in std runs (ignored under loom, which detects deadlock).
    pub const DEFAULT_WAIT_TIMEOUT: Duration = Duration::from_secs(10);

    /// Validates and builds a configuration.
    ///
    /// `world` ranks each own `tokens` tokens and send with `blocks` sender blocks; every rank
    /// runs `ops` in order. The first dispatch must be a [`OpKind::Dispatch`], every
    /// [`OpKind::Combine`] must follow some dispatch and every [`OpKind::LlCombine`] some
    /// [`OpKind::LlDispatch`].
    pub fn new(
        world: usize,
        tokens: usize,
        blocks: usize,
        schedule: Schedule,
        ops: Vec<OpKind>,
    ) -> Result<Self, ConfigError> {
        if !(1..=MAX_WORLD).contains(&world) {
            return Err(ConfigError::World { world });
        }
        if !(1..=MAX_TOKENS).contains(&tokens) {
            return Err(ConfigError::Tokens { tokens });
        }
        if !(1..=MAX_BLOCKS).contains(&blocks) {
            return Err(ConfigError::Blocks { blocks });
        }
        if !(1..=MAX_OPS).contains(&ops.len()) {
            return Err(ConfigError::OpCount { len: ops.len() });
        }
        let mut seen_dispatch = false;
        let mut seen_ll_dispatch = false;
        let mut seen_internode = false;
        for (index, op) in ops.iter().enumerate() {
            match op {
                OpKind::InternodeDispatch => seen_internode = true,
                OpKind::InternodeCachedDispatch if !seen_internode => {
                    return Err(ConfigError::InternodeCachedWithoutLayout { index });
                }
                OpKind::InternodeCombine if !seen_internode => {
                    return Err(ConfigError::InternodeCombineWithoutDispatch { index });
                }
                OpKind::InternodeCachedDispatch | OpKind::InternodeCombine => {}
                OpKind::Dispatch => seen_dispatch = true,
                OpKind::LlDispatch => seen_ll_dispatch = true,
                OpKind::LlCombine if !seen_ll_dispatch => {
                    return Err(ConfigError::LlCombineWithoutLlDispatch { index });
                }
                OpKind::LlCombine => {}
                OpKind::CachedDispatch if !seen_dispatch => {
                    return Err(ConfigError::CachedWithoutLayout { index });
                }
                OpKind::Combine if !seen_dispatch => {
                    return Err(ConfigError::CombineWithoutDispatch { index });
                }
                OpKind::CachedDispatch | OpKind::Combine => {}
            }
        }
        Ok(Self {
            world,
            tokens,
            blocks,
            schedule,
            ops,
            nodes: 1,
            wait_timeout: Self::DEFAULT_WAIT_TIMEOUT,
            failure: None,
            stopped: None,
            ll_masking: false,
            rail_ring: None,
            mutations: Vec::new(),
        })
    }

    /// Injects `failure` into the run (replacing any earlier one). Rejected when a rank stops
    /// ([`ModelConfig::with_stopped_rank`]).
    pub fn with_failure(mut self, failure: Failure) -> Result<Self, ConfigError> {
        if self.stopped.is_some() {
            return Err(ConfigError::StopWithFailure);
        }
        if failure.rank >= self.world {
            return Err(ConfigError::FailureRank {
                rank: failure.rank,
                world: self.world,
            });
        }
        let Some(&kind) = self.ops.get(failure.op) else {
            return Err(ConfigError::FailureOp {
                op: failure.op,
                len: self.ops.len(),
            });
        };
        if !Failure::step_is_valid(self.schedule, kind, failure.at) {
            return Err(ConfigError::FailureStep {
                op: failure.op,
                kind,
                schedule: self.schedule,
                at: failure.at,
            });
        }
        self.failure = Some(failure);
        Ok(self)
    }

    /// Stops rank `stopped.rank` in op `stopped.op` before `stopped.at` (replacing any earlier
    /// stop). Rejected with an injected failure or with internode ops in the sequence.
    pub fn with_stopped_rank(mut self, stopped: StoppedRank) -> Result<Self, ConfigError> {
        if self.failure.is_some() {
            return Err(ConfigError::StopWithFailure);
        }
        if let Some(index) = self.ops.iter().position(|k| k.is_internode_family()) {
            return Err(ConfigError::StopWithInternode { index });
        }
        if stopped.rank >= self.world {
            return Err(ConfigError::StopRank {
                rank: stopped.rank,
                world: self.world,
            });
        }
        let Some(&kind) = self.ops.get(stopped.op) else {
            return Err(ConfigError::StopOp {
                op: stopped.op,
                len: self.ops.len(),
            });
        };
        if !StoppedRank::step_is_valid(self.schedule, kind, stopped.at) {
            return Err(ConfigError::StopStep {
                op: stopped.op,
                kind,
                schedule: self.schedule,
                at: stopped.at,
            });
        }
        self.stopped = Some(stopped);
        Ok(self)
    }

    /// Turns rank masking of the low-latency ops on or off (the kernels' `kFlagMasking`,
    /// `docs/low-latency.md` "Masking ranks"; default off). With masking, in an
    /// [`OpKind::LlDispatch`] or [`OpKind::LlCombine`]: a wait for a masked peer ends at once
    /// (as if satisfied); a wait that expires on a peer masks it instead of failing the op;
    /// the send phase sends masked peers no counts (`[L2]`) and no rows (`[L3]`, `[L8]`), but
    /// still its done signal (`[L4]`); the receive phase re-reads the mask after `[L5]` and
    /// counts no rows from a masked source (`[L6]`, `[L7]`) and adds nothing for an entry whose
    /// expert's rank is masked (`[L9]`); `[A2]` skips masked peers. The other ops never mask.
    pub fn with_ll_masking(mut self, on: bool) -> Self {
        self.ll_masking = on;
        self
    }

    /// Applies `mutation` to the protocol every rank runs (mutations accumulate).
    pub fn with_mutation(mut self, mutation: Mutation) -> Self {
        if !self.mutations.contains(&mutation) {
            self.mutations.push(mutation);
        }
        self
    }

    /// Splits the world into `nodes` nodes of `world / nodes` local ranks each (rank
    /// `node * local_ranks + local`); only the internode ops use the split. Default: one node.
    pub fn with_nodes(mut self, nodes: usize) -> Result<Self, ConfigError> {
        if nodes == 0 || !self.world.is_multiple_of(nodes) {
            return Err(ConfigError::Nodes {
                nodes,
                world: self.world,
            });
        }
        self.nodes = nodes;
        Ok(self)
    }

    /// Chunked forwarding (docs/protocol.md, "Chunked forwarding"): the internode dispatch
    /// sends its rail rows through a ring of `ring.slots` slots of `ring.chunk_rows` rows at
    /// each forwarder, `[I6c]`, `[I8c]`, `[I9c]`, instead of a per-op region (`[I6]`..`[I9]`'s
    /// rail half). Chunks are counted since setup, so the ring needs no per-op credit: the
    /// writers' `[I5]` skips their rail peers. Each rank interleaves its sender and forwarder
    /// roles without blocking (the kernels give them different blocks). An injected failure is
    /// never inside the ring's steps ([`Failure::step_is_valid`]): the order in which one
    /// rank's interleaved roles reach them depends on the schedule.
    pub fn with_rail_ring(mut self, ring: RailRing) -> Result<Self, ConfigError> {
        if !(1..=MAX_RING_SLOTS).contains(&ring.slots) {
            return Err(ConfigError::RingSlots { slots: ring.slots });
        }
        if !(1..=MAX_CHUNK_ROWS).contains(&ring.chunk_rows) {
            return Err(ConfigError::RingChunkRows {
                chunk_rows: ring.chunk_rows,
            });
        }
        self.rail_ring = Some(ring);
        Ok(self)
    }

    /// Replaces the bound of every spin-wait in std runs (must be positive).
    pub fn with_wait_timeout(mut self, timeout: Duration) -> Result<Self, ConfigError> {
        if timeout.is_zero() {
            return Err(ConfigError::ZeroTimeout);
        }
        self.wait_timeout = timeout;
        Ok(self)
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }
    /// Number of nodes (the internode ops' `N`).
    pub fn nodes(&self) -> usize {
        self.nodes
    }
    /// Ranks per node (the internode ops' `L`): rank `r` is `(r / L, r % L)`.
    pub fn local_ranks(&self) -> usize {
        self.world / self.nodes
    }
    /// The node of rank `rank`.
    pub fn node_of(&self, rank: usize) -> usize {
        rank / self.local_ranks()
    }
    /// The local index of rank `rank` within its node.
    pub fn local_of(&self, rank: usize) -> usize {
        rank % self.local_ranks()
    }
    /// The rank `(node, local)`.
    pub fn rank_of(&self, node: usize, local: usize) -> usize {
        node * self.local_ranks() + local
    }
    /// Tokens owned by each rank.
    pub fn tokens(&self) -> usize {
        self.tokens
    }
    /// Sender blocks per rank per op (each signals `done` once).
    pub fn blocks(&self) -> usize {
        self.blocks
    }
    /// The schedule (the kernels' [`Schedule`]).
    pub fn schedule(&self) -> Schedule {
        self.schedule
    }
    /// Number of alternating count, receive and combine regions: 2 (the kernels' parity
    /// regions, under both schedules), 1 under [`Mutation::SingleRegion`].
    pub fn regions(&self) -> usize {
        if self.has(Mutation::SingleRegion) {
            1
        } else {
            Parity::ALL.len()
        }
    }
    /// The region index an op with sequence number `seq` uses: the kernels' rule,
    /// [`Parity::of_epoch`], under both schedules; 0 under [`Mutation::SingleRegion`].
    pub fn parity(&self, seq: u64) -> usize {
        if self.has(Mutation::SingleRegion) {
            0
        } else {
            Parity::of_epoch(seq).index()
        }
    }
    /// Number of alternating low-latency regions (`ll_x`, `ll_counts`, `ll_comb`): 2 (the
    /// kernels' parities), 1 under [`Mutation::LlSingleRegion`].
    pub fn ll_regions(&self) -> usize {
        if self.has(Mutation::LlSingleRegion) {
            1
        } else {
            Parity::ALL.len()
        }
    }
    /// The low-latency region index of an LL op with LL sequence number `seq` (`ll_dispatch`
    /// for the dispatch regions, `ll_combine` for the combine region): [`Parity::of_epoch`],
    /// 0 under [`Mutation::LlSingleRegion`].
    pub fn ll_parity(&self, seq: u64) -> usize {
        if self.has(Mutation::LlSingleRegion) {
            0
        } else {
            Parity::of_epoch(seq).index()
        }
    }
    /// The op sequence every rank runs.
    pub fn ops(&self) -> &[OpKind] {
        &self.ops
    }
    /// Bound of every spin-wait in std runs.
    pub fn wait_timeout(&self) -> std::time::Duration {
        self.wait_timeout
    }
    /// The injected failure, if any.
    pub fn failure(&self) -> Option<Failure> {
        self.failure
    }
    /// The stopped rank, if any.
    pub fn stopped_rank(&self) -> Option<StoppedRank> {
        self.stopped
    }
    /// The ring of chunked forwarding ([`ModelConfig::with_rail_ring`]); `None`: the per-op
    /// rail region.
    pub fn rail_ring(&self) -> Option<RailRing> {
        self.rail_ring
    }
    /// Whether the low-latency ops mask ranks ([`ModelConfig::with_ll_masking`]).
    pub fn ll_masking(&self) -> bool {
        self.ll_masking
    }
    /// The mutations applied to the protocol (empty: the protocol as the kernels run it).
    pub fn mutations(&self) -> &[Mutation] {
        &self.mutations
    }
    /// Whether `mutation` is applied.
    pub fn has(&self, mutation: Mutation) -> bool {
        self.mutations.contains(&mutation)
    }
    /// Receive slots per region: the worst case, every token of every rank.
    pub fn recv_slots(&self) -> usize {
        self.world * self.tokens
    }
}

fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The routing oracle: whether token `token` of rank `src` goes to rank `dst` under the layout
/// produced by the dispatch with sequence number `layout_seq`.
///
/// Deterministic and different from one layout to the next, so a stale count or a stale row is
/// visible. Ranks outside `0..MAX_WORLD` never receive anything.
pub fn routes_to(layout_seq: u64, src: usize, token: usize, dst: usize) -> bool {
    if dst >= MAX_WORLD {
        return false;
    }
    let h = mix64(layout_seq ^ ((src as u64) << 20) ^ ((token as u64) << 36));
    (h >> (3 + 7 * dst)) & 1 == 1
}

/// Number of tokens `src` sends to `dst` under layout `layout_seq` with `tokens` tokens per rank.
pub fn route_count(layout_seq: u64, tokens: usize, src: usize, dst: usize) -> u64 {
    (0..tokens)
        .filter(|&t| routes_to(layout_seq, src, t, dst))
        .count() as u64
}

/// Salt that separates the low-latency routing (and data words) from the normal ones.
const LL_SALT: u64 = 1 << 62;
/// Bit that marks a low-latency sequence number inside a data or combine word.
const LL_WORD_BIT: u64 = 1 << 31;

/// The low-latency routing oracle: whether token `token` of rank `src` goes to rank `dst` in the
/// low-latency dispatch with LL sequence number `ll_seq` (the model has one expert per rank, so
/// the top-k slot `k` of a token is the rank `dst` itself).
///
/// Deterministic, different from one LL dispatch to the next and from [`routes_to`].
pub fn ll_routes_to(ll_seq: u64, src: usize, token: usize, dst: usize) -> bool {
    routes_to(ll_seq ^ LL_SALT, src, token, dst)
}

/// Number of tokens `src` sends to `dst` in the LL dispatch `ll_seq` with `tokens` tokens per
/// rank: the row count of `[L2]`.
pub fn ll_route_count(ll_seq: u64, tokens: usize, src: usize, dst: usize) -> u64 {
    (0..tokens)
        .filter(|&t| ll_routes_to(ll_seq, src, t, dst))
        .count() as u64
}

/// The row rank `src` sends for its token `token` in the LL dispatch `ll_seq` (`[L3]`): a
/// [`data_word`] whose sequence field carries a low-latency marker bit, so it never equals a
/// normal dispatch's row; never 0.
pub fn ll_row_word(ll_seq: u64, src: usize, token: usize) -> u64 {
    data_word(ll_seq | LL_WORD_BIT, src, token)
}

/// The contribution rank `contributor` returns in the LL combine `ll_combine_seq` for the row
/// `row` (an [`ll_row_word`]) (`[L8]`); never 0, never a normal [`combine_word`] of the same row.
pub fn ll_combine_word(ll_combine_seq: u64, contributor: usize, row: u64) -> u64 {
    combine_word(ll_combine_seq | LL_WORD_BIT, contributor, row)
}

/// Bit that marks an internode combine sequence number inside a combine word.
const INTER_WORD_BIT: u64 = 1 << 30;

/// The contribution rank `contributor` returns in the internode combine `inter_combine_seq`
/// for the received row `row` (a [`data_word`] of an internode dispatch) (`[J3]`); never 0,
/// never a normal [`combine_word`] of the same row. A forwarder's partial and a source's
/// reduction are wrapping sums of these: one hash per contributor, so a missing, extra or
/// stale contribution changes the sum.
pub fn inter_combine_word(inter_combine_seq: u64, contributor: usize, row: u64) -> u64 {
    combine_word(inter_combine_seq | INTER_WORD_BIT, contributor, row)
}

/// Encodes a count word: `(epoch << 32) | count`. Epochs start at 1, so 0 means never written.
pub fn count_word(epoch: u64, count: u64) -> u64 {
    (epoch << 32) | (count & 0xFFFF_FFFF)
}

/// Splits a count word into `(epoch, count)`.
pub fn split_count_word(word: u64) -> (u64, u64) {
    (word >> 32, word & 0xFFFF_FFFF)
}

/// The data word rank `src` sends for its token `token` in the dispatch with sequence `seq`:
/// `(seq << 32) | (src << 16) | token`; never 0 because `seq >= 1`.
pub fn data_word(seq: u64, src: usize, token: usize) -> u64 {
    (seq << 32) | ((src as u64 & 0xFFFF) << 16) | (token as u64 & 0xFFFF)
}

/// Splits a data word into `(seq, src, token)`.
pub fn split_data_word(word: u64) -> (u64, usize, usize) {
    (
        word >> 32,
        ((word >> 16) & 0xFFFF) as usize,
        (word & 0xFFFF) as usize,
    )
}

/// The contribution rank `contributor` returns in the combine with sequence `combine_seq` for
/// the received row holding `row` (a [`data_word`]); never 0.
pub fn combine_word(combine_seq: u64, contributor: usize, row: u64) -> u64 {
    mix64(row ^ combine_seq.rotate_left(48) ^ ((contributor as u64) << 8)) | 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rail_ring_is_validated() {
        use OpKind::*;
        let base = ModelConfig::new(2, 3, 1, Schedule::Epoch, vec![InternodeDispatch])
            .unwrap()
            .with_nodes(2)
            .unwrap();
        assert_eq!(base.rail_ring(), None);
        let ring = |slots, chunk_rows| RailRing { slots, chunk_rows };
        for slots in [0, MAX_RING_SLOTS + 1] {
            assert_eq!(
                base.clone().with_rail_ring(ring(slots, 1)),
                Err(ConfigError::RingSlots { slots })
            );
        }
        for chunk_rows in [0, MAX_CHUNK_ROWS + 1] {
            assert_eq!(
                base.clone().with_rail_ring(ring(1, chunk_rows)),
                Err(ConfigError::RingChunkRows { chunk_rows })
            );
        }
        let ok = base.with_rail_ring(ring(2, 3)).unwrap();
        assert_eq!(ok.rail_ring(), Some(ring(2, 3)));
        // An op's chunks: ceil(rows / C), the last one partial.
        assert_eq!(
            [0, 1, 3, 4, 7].map(|rows| ring(2, 3).chunks(rows)),
            [0, 1, 1, 2, 3]
        );
        for step in [Step::I6c, Step::I8c, Step::I9c] {
            assert!(!Failure::step_is_valid(
                Schedule::Epoch,
                InternodeDispatch,
                step
            ));
        }
    }

    #[test]
    fn rejects_bad_shapes() {
        use OpKind::*;
        let d = || vec![Dispatch];
        let cases: [(usize, usize, usize, Vec<OpKind>, ConfigError); 8] = [
            (0, 1, 1, d(), ConfigError::World { world: 0 }),
            (9, 1, 1, d(), ConfigError::World { world: 9 }),
            (2, 0, 1, d(), ConfigError::Tokens { tokens: 0 }),
            (2, 1, 0, d(), ConfigError::Blocks { blocks: 0 }),
            (2, 1, 1, vec![], ConfigError::OpCount { len: 0 }),
            (
                2,
                1,
                1,
                vec![CachedDispatch],
                ConfigError::CachedWithoutLayout { index: 0 },
            ),
            (
                2,
                1,
                1,
                vec![Combine, Dispatch],
                ConfigError::CombineWithoutDispatch { index: 0 },
            ),
            (
                2,
                1,
                1,
                vec![Dispatch, LlCombine, LlDispatch],
                ConfigError::LlCombineWithoutLlDispatch { index: 1 },
            ),
        ];
        for (world, tokens, blocks, ops, error) in cases {
            for schedule in Schedule::ALL {
                assert_eq!(
                    ModelConfig::new(world, tokens, blocks, schedule, ops.clone()),
                    Err(error.clone())
                );
            }
        }
        // Low-latency ops need no normal dispatch, and mix with the normal ops.
        for ops in [
            vec![LlDispatch, LlCombine, LlDispatch, LlDispatch],
            vec![LlDispatch, Dispatch, LlCombine, Combine],
        ] {
            assert!(ModelConfig::new(2, 1, 1, Schedule::Epoch, ops).is_ok());
        }
        let ok = ModelConfig::new(2, 1, 1, Schedule::Epoch, d()).unwrap();
        assert_eq!(
            ok.with_wait_timeout(Duration::ZERO),
            Err(ConfigError::ZeroTimeout)
        );
    }

    #[test]
    fn parity_is_the_kernels_rule_under_both_schedules() {
        for schedule in Schedule::ALL {
            let cfg = ModelConfig::new(2, 1, 1, schedule, vec![OpKind::Dispatch]).unwrap();
            assert_eq!(cfg.regions(), 2);
            for seq in 1..6 {
                assert_eq!(cfg.parity(seq), Parity::of_epoch(seq).index());
            }
            assert_eq!(cfg.ll_regions(), 2);
            for seq in 1..6 {
                assert_eq!(cfg.ll_parity(seq), Parity::of_epoch(seq).index());
            }
            let single = cfg.clone().with_mutation(Mutation::SingleRegion);
            assert_eq!(single.regions(), 1);
            assert!((1..6).all(|seq| single.parity(seq) == 0));
            // The two single-region mutations are independent.
            assert_eq!(single.ll_regions(), 2);
            let ll_single = cfg.with_mutation(Mutation::LlSingleRegion);
            assert_eq!((ll_single.regions(), ll_single.ll_regions()), (2, 1));
            assert!((1..6).all(|seq| ll_single.ll_parity(seq) == 0));
        }
    }

    #[test]
    fn validates_failures_and_records_mutations() {
        use OpKind::*;
        let base = ModelConfig::new(2, 1, 1, Schedule::Epoch, vec![Dispatch, Combine]).unwrap();
        let fail = |rank, op, at| base.clone().with_failure(Failure { rank, op, at });
        assert_eq!(
            fail(2, 0, Step::E5),
            Err(ConfigError::FailureRank { rank: 2, world: 2 })
        );
        assert_eq!(
            fail(0, 2, Step::E5),
            Err(ConfigError::FailureOp { op: 2, len: 2 })
        );
        assert!(matches!(
            fail(0, 1, Step::E5),
            Err(ConfigError::FailureStep {
                op: 1,
                kind: Combine,
                at: Step::E5,
                ..
            })
        ));
        assert!(matches!(
            fail(0, 0, Step::G2),
            Err(ConfigError::FailureStep { at: Step::G2, .. })
        ));
        assert!(matches!(
            fail(0, 0, Step::F1),
            Err(ConfigError::FailureStep { at: Step::F1, .. })
        ));
        let ok = fail(1, 1, Step::C2).unwrap();
        assert_eq!(
            ok.failure(),
            Some(Failure {
                rank: 1,
                op: 1,
                at: Step::C2
            })
        );
        assert!(!ok.failure().unwrap().after_done());
        assert!(
            Failure {
                rank: 0,
                op: 0,
                at: Step::C5
            }
            .after_done()
        );
        for (schedule, kind, at, valid) in [
            (Schedule::Global, Dispatch, Step::G4, true),
            (Schedule::Global, CachedDispatch, Step::G4, false),
            (Schedule::Epoch, CachedDispatch, Step::E1, false),
            (Schedule::Epoch, Dispatch, Step::G1, false),
            (Schedule::Global, LlDispatch, Step::G2, true),
            (Schedule::Epoch, LlDispatch, Step::G2, false),
            (Schedule::Global, LlCombine, Step::G3, false),
            (Schedule::Epoch, LlDispatch, Step::L2, true),
            (Schedule::Epoch, LlCombine, Step::L2, false),
            (Schedule::Epoch, LlCombine, Step::L4, true),
            (Schedule::Epoch, LlCombine, Step::L9, true),
            (Schedule::Epoch, LlDispatch, Step::L9, false),
            (Schedule::Epoch, LlDispatch, Step::E4, false),
            (Schedule::Epoch, Dispatch, Step::L3, false),
        ] {
            assert_eq!(Failure::step_is_valid(schedule, kind, at), valid);
        }
        let m = base
            .with_mutation(Mutation::SkipFinalWait)
            .with_mutation(Mutation::SkipFinalWait);
        assert_eq!(m.mutations(), &[Mutation::SkipFinalWait]);
        assert!(m.has(Mutation::SkipFinalWait) && !m.has(Mutation::DoneAddRelaxed));
        assert_eq!(
            Mutation::ALL.iter().filter(|m| m.is_benign()).count(),
            1,
            "only CountLoadsRelaxed is benign"
        );
    }

    #[test]
    fn validates_stopped_ranks_and_masking() {
        use OpKind::*;
        let base = ModelConfig::new(3, 1, 1, Schedule::Epoch, vec![LlDispatch, LlCombine]).unwrap();
        assert!(!base.ll_masking() && base.stopped_rank().is_none());
        assert!(base.clone().with_ll_masking(true).ll_masking());
        let stop = |rank, op, at| base.clone().with_stopped_rank(StoppedRank { rank, op, at });
        assert_eq!(
            stop(3, 0, Step::F1),
            Err(ConfigError::StopRank { rank: 3, world: 3 })
        );
        assert_eq!(
            stop(0, 2, Step::F1),
            Err(ConfigError::StopOp { op: 2, len: 2 })
        );
        assert!(matches!(
            stop(0, 1, Step::L2),
            Err(ConfigError::StopStep { at: Step::L2, .. })
        ));
        let ok = stop(1, 1, Step::F1).unwrap();
        assert_eq!(ok.stopped_rank().map(|s| (s.rank, s.op)), Some((1, 1)));
        let failure = Failure {
            rank: 0,
            op: 0,
            at: Step::L3,
        };
        assert_eq!(
            ok.clone().with_failure(failure),
            Err(ConfigError::StopWithFailure)
        );
        assert_eq!(
            base.clone()
                .with_failure(failure)
                .unwrap()
                .with_stopped_rank(StoppedRank {
                    rank: 1,
                    op: 0,
                    at: Step::F1
                }),
            Err(ConfigError::StopWithFailure)
        );
        let inter = ModelConfig::new(
            2,
            1,
            1,
            Schedule::Epoch,
            vec![LlDispatch, InternodeDispatch],
        )
        .unwrap()
        .with_stopped_rank(StoppedRank {
            rank: 0,
            op: 0,
            at: Step::F1,
        });
        assert_eq!(inter, Err(ConfigError::StopWithInternode { index: 1 }));
        // Who is absent where: from the stop op, unless the rank stopped after its last signal.
        let at = |at| StoppedRank { rank: 0, op: 2, at };
        assert!(!at(Step::F1).absent_in(1) && at(Step::F1).absent_in(2));
        assert!(at(Step::L4).absent_in(2) && !at(Step::L5).absent_in(2));
        assert!(at(Step::L9).absent_in(3));
    }

    #[test]
    fn nodes_split_the_world() {
        use OpKind::*;
        let base = ModelConfig::new(6, 1, 1, Schedule::Epoch, vec![InternodeDispatch]).unwrap();
        assert_eq!((base.nodes(), base.local_ranks()), (1, 6));
        for nodes in [0, 4] {
            assert_eq!(
                base.clone().with_nodes(nodes),
                Err(ConfigError::Nodes { nodes, world: 6 })
            );
        }
        let c = base.with_nodes(3).unwrap();
        assert_eq!((c.nodes(), c.local_ranks()), (3, 2));
        assert_eq!((c.node_of(5), c.local_of(5), c.rank_of(2, 1)), (2, 1, 5));
        assert_eq!(
            ModelConfig::new(2, 1, 1, Schedule::Epoch, vec![InternodeCachedDispatch]),
            Err(ConfigError::InternodeCachedWithoutLayout { index: 0 })
        );
        assert_eq!(
            ModelConfig::new(2, 1, 1, Schedule::Epoch, vec![Dispatch, InternodeCombine]),
            Err(ConfigError::InternodeCombineWithoutDispatch { index: 1 })
        );
        // The internode steps are valid failure points of the internode ops only.
        assert!(Failure::step_is_valid(
            Schedule::Epoch,
            InternodeDispatch,
            Step::I6
        ));
        assert!(!Failure::step_is_valid(
            Schedule::Epoch,
            InternodeCachedDispatch,
            Step::I10
        ));
        assert!(!Failure::step_is_valid(
            Schedule::Epoch,
            InternodeCombine,
            Step::I6
        ));
        assert!(Failure::step_is_valid(
            Schedule::Global,
            InternodeCombine,
            Step::G1
        ));
        assert!(!Failure::step_is_valid(Schedule::Epoch, Dispatch, Step::I6));
    }

    #[test]
    fn error_messages_name_argument() {
        let e = ConfigError::CachedWithoutLayout { index: 3 };
        assert!(e.to_string().contains("ops[3]"));
        assert!(
            ConfigError::Blocks { blocks: 0 }
                .to_string()
                .contains("blocks = 0")
        );
    }

    #[test]
    fn words_round_trip_and_are_nonzero() {
        assert_eq!(split_count_word(count_word(7, 3)), (7, 3));
        assert_ne!(count_word(1, 0), 0);
        assert_eq!(split_data_word(data_word(5, 3, 9)), (5, 3, 9));
        assert_ne!(data_word(1, 0, 0), 0);
        assert_ne!(combine_word(1, 0, 0), 0);
        assert_ne!(combine_word(1, 0, 5), combine_word(2, 0, 5));
        let row = ll_row_word(3, 1, 2);
        assert_eq!(split_data_word(row).1..=split_data_word(row).2, 1..=2);
        assert_ne!(row, data_word(3, 1, 2));
        assert_ne!(ll_row_word(1, 0, 0), 0);
        assert_ne!(ll_combine_word(1, 0, row), combine_word(1, 0, row));
        assert_ne!(ll_combine_word(1, 0, row), ll_combine_word(3, 0, row));
    }

    #[test]
    fn routing_varies_between_layouts() {
        let layouts: Vec<Vec<bool>> = (1..=8u64)
            .map(|seq| {
                (0..2)
                    .flat_map(|s| (0..2).flat_map(move |t| (0..2).map(move |d| (s, t, d))))
                    .map(|(s, t, d)| routes_to(seq, s, t, d))
                    .collect()
            })
            .collect();
        assert!(layouts.windows(2).any(|w| w[0] != w[1]));
        assert!(layouts.iter().flatten().any(|&b| b));
        assert!(layouts.iter().flatten().any(|&b| !b));
        assert!(!routes_to(1, 0, 0, MAX_WORLD));
        let ll: Vec<bool> = (1..=8u64)
            .flat_map(|seq| (0..4).map(move |t| ll_routes_to(seq, 0, t, 1)))
            .collect();
        let normal: Vec<bool> = (1..=8u64)
            .flat_map(|seq| (0..4).map(move |t| routes_to(seq, 0, t, 1)))
            .collect();
        assert_ne!(ll, normal, "the LL routing is its own");
        assert_eq!(
            ll_route_count(2, 4, 0, 1),
            (0..4).filter(|&t| ll_routes_to(2, 0, t, 1)).count() as u64
        );
        assert_eq!(
            route_count(3, 4, 1, 0),
            (0..4).filter(|&t| routes_to(3, 1, t, 0)).count() as u64
        );
    }
}
