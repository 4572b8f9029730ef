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
//!
//! The model is split by idea; each file keeps the step labels next to the code that
//! implements them:
//!
//! - `mod.rs`: the state, [`World`] (the shared memory of the simulated ranks) and each rank's
//!   private state;
//! - `runner.rs`: [`run_rank`], [`run_model`], the op loop and the failure injection;
//! - `dispatch.rs`: dispatch and cached dispatch, `[E1]`..`[E7]` and `[G1]`..`[G5]`;
//! - `combine.rs`: combine, `[C1]`..`[C5]` (and `[G1]`);
//! - `low_latency.rs`: the low-latency dispatch and combine, `[L1]`..`[L9]` (and `[G1]`, `[G2]`);
//! - `internode.rs`: the hierarchical internode dispatch (model only), `[I1]`..`[I12]`;
//! - `internode_ring.rs`: the rail rings (model only): chunked forwarding of the internode
//!   dispatch, `[I6c]`, `[I8c]`, `[I9c]`, and streamed partials of its combine, `[J6c]`,
//!   `[J8c]`, `[J9c]`;
//! - `internode_combine.rs`: the hierarchical internode combine (model only), `[J1]`..`[J9]`;
//! - `wait.rs`: the bounded waits, the done counters (`[E5]`/`[C2]` signal, `[E6]`/`[C5]`
//!   wait) and the barrier of `[G1]`/`[G3]`/`[G5]`;
//! - `failure.rs`: failure propagation, `[F1]`, `[F2]` and the guard that a failed rank writes
//!   nothing;
//! - `agreement.rs`: op agreement, `[A1]` (publish the op's intent word) and `[A2]` (check every
//!   peer's after the final wait): two slots suffice;
//! - `masking.rs`: rank masking of the low-latency ops (the mask words, the expiry of a wait
//!   for a stopped rank);
//! - `violation.rs`: what the model reports ([`Violation`], [`OpError`], [`RunError`]) and the
//!   checks behind it, `[R]` included.
//!
//! The state lives here so that the step files, child modules, use its fields directly.
//! Contract of the shared memory: every word starts at 0 ("never written"); the count, recv
//! and comb regions have [`ModelConfig::regions`] copies, indexed by the parity that the op's
//! sequence number picks; the low-latency regions (`ll_x`, `ll_counts`, `ll_comb`) have
//! [`ModelConfig::ll_regions`] copies, indexed by the parity of the LL op's own sequence number.

mod agreement;
mod combine;
mod dispatch;
mod failure;
mod internode;
mod internode_combine;
mod internode_ring;
mod low_latency;
mod masking;
mod runner;
mod violation;
mod wait;

use std::fmt;

use crate::config::{ModelConfig, OpKind};
use crate::outcome::OpOutput;
use crate::step::Step;
use crate::sync::AtomicU64;
use internode_ring::RingOf;

#[cfg(not(loom))]
pub use runner::run_model;
pub use runner::run_rank;
#[cfg(not(loom))]
pub use violation::ModelFailure;
pub use violation::{OpError, Region, RunError, Violation};

/// Observer called by every rank before each labelled step.
///
/// Tests use it to inject delays (std stress tests) or to force one specific interleaving
/// (deterministic negative tests). Under loom use [`NoHook`]: loom already explores schedules.
pub trait StepHook: Send + Sync {
    /// Called by rank `rank` right before it executes `step` of op number `op` (0-based) of
    /// kind `kind`. Steps that repeat per sender block (`[E4]`, `[E5]`, `[C1]`, `[C3]`, `[C4]`,
    /// `[C2]`, `[L3]`, `[L4]`, `[L8]`) are reported once per block; `[I8]` and `[I9]` once
    /// per rail source node the rank forwards for, and so are `[J5]`, `[J6]` and `[J7]`;
    /// `[I6c]` and `[J6c]` once per chunk sent, `[I8c]`, `[I9c]`, `[J8c]` and `[J9c]` once per
    /// chunk taken.
    fn at(&self, rank: usize, op: usize, kind: OpKind, step: Step);
}

/// A [`StepHook`] that does nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoHook;

impl StepHook for NoHook {
    fn at(&self, _rank: usize, _op: usize, _kind: OpKind, _step: Step) {}
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
    /// `ll_x[parity][src][slot]`: low-latency receive rows, `slot` the row's index among the
    /// tokens `src` sends me (parity of the LL dispatch sequence).
    ll_x: Vec<AtomicU64>,
    /// `ll_counts[parity][src]`: tagged words `(ll_dispatch << 32) | rows`.
    ll_counts: Vec<AtomicU64>,
    /// `ll_comb[parity][token][k]`: low-latency combine rows for my `token` from its top-k slot
    /// `k` (one expert per rank in the model: `k` is the contributing rank; parity of the LL
    /// combine sequence).
    ll_comb: Vec<AtomicU64>,
    /// Internode: `rail_count[parity][src_node][j]`, tagged words from my rail peer in
    /// `src_node`: its count for rank `(my node, j)` (`j < L`) and, at `j = L`, its rows that
    /// cross to my node (parity of the internode notify sequence).
    rail_count: Vec<AtomicU64>,
    /// Internode: `rail_buf[parity][src_node][r]`, the rows my rail peer in `src_node` sends
    /// over the network (parity of the internode sequence).
    rail_buf: Vec<AtomicU64>,
    /// Internode: `rail_done[src_node]`, monotonic: the internode sequence number of the last
    /// op whose rail rows from `src_node` all landed.
    rail_done: Vec<AtomicU64>,
    /// Chunked forwarding: `ring[src_node][slot][row]`, the chunk (up to `C` rows) my rail peer
    /// in `src_node` put in slot `slot` (one region: chunks are counted since setup).
    ring: Vec<AtomicU64>,
    /// Chunked forwarding: `chunks_in[src_node]`, monotonic since setup: the chunks my rail
    /// peer in `src_node` has sent me whose rows landed.
    chunks_in: Vec<AtomicU64>,
    /// Chunked forwarding: `ring_credit[node]`, monotonic since setup: the chunks of mine my
    /// rail peer in `node` has forwarded (slots it will not read again).
    ring_credit: Vec<AtomicU64>,
    /// Streamed partials: `pring[node][slot][row]`, the partials my rail peer in `node` (the
    /// forwarder of my tokens there) put in slot `slot`.
    pring: Vec<AtomicU64>,
    /// Streamed partials: `pchunks_in[node]`, monotonic since setup: its chunks of partials
    /// that landed.
    pchunks_in: Vec<AtomicU64>,
    /// Streamed partials: `pring_credit[node]`, monotonic since setup: the chunks of partials
    /// of mine my rail peer in `node` has reduced.
    pring_credit: Vec<AtomicU64>,
    /// Internode: `xcount[parity][src]`, tagged `(m << 32) | count(src -> me)`, written by
    /// `src` (same node) or relayed by its forwarder (parity of the notify sequence).
    xcount: Vec<AtomicU64>,
    /// Internode: `xrecv[parity][src][j]`, my `j`-th row from `src` (parity of the internode
    /// sequence).
    xrecv: Vec<AtomicU64>,
    /// Internode: `idone[src]`, monotonic: the internode sequence number of the last op whose
    /// rows from `src` (direct or forwarded) all landed.
    idone: Vec<AtomicU64>,
    /// Internode: `credit[r]`, monotonic: rank `r` reads nothing of internode ops `<=` this.
    credit: Vec<AtomicU64>,
    /// Internode combine: `cdirect[parity][src][token]`, the contribution of rank `src` (my
    /// node) to my `token` (parity of the internode combine sequence).
    cdirect: Vec<AtomicU64>,
    /// Internode combine: `cfwd[parity][src][token][j]`, the contribution of rank `(my node,
    /// j)` to `token` of `src` (another node), which I forward as part of one partial.
    cfwd: Vec<AtomicU64>,
    /// Internode combine: `cpart[parity][node][token]`, the partial of `node` for my `token`,
    /// from my rail peer in `node`.
    cpart: Vec<AtomicU64>,
    /// Internode combine: `cdone[src]`, monotonic: the internode combine sequence number of
    /// the last combine whose contributions from `src` (my node) to me all landed.
    cdone: Vec<AtomicU64>,
    /// Internode combine: `cpdone[node]`, monotonic: the internode combine sequence number of
    /// the last combine whose partials from my rail peer in `node` all landed.
    cpdone: Vec<AtomicU64>,
    /// Internode combine: `ccredit[r]`, monotonic: rank `r` reads nothing of internode
    /// combines `<=` this.
    ccredit: Vec<AtomicU64>,
    /// The abort word: `1 + rank` of a failed rank, 0 while none failed. Never reset.
    abort: AtomicU64,
    /// `intent[a%2][src]`: `src`'s intent word `(a << 32) | kind` for agreed op `a` (`[A1]`).
    intent: Vec<AtomicU64>,
}

fn zeroed(n: usize) -> Vec<AtomicU64> {
    (0..n).map(|_| AtomicU64::new(0)).collect()
}

/// The shared memory of all ranks for one model run.
pub struct World {
    cfg: ModelConfig,
    ranks: Vec<RankBuffer>,
    /// `stopped[r]`: 1 once rank `r` reached its configured stop point
    /// ([`crate::config::StoppedRank`]); stored (release) after the last thing it did. Not a GPU
    /// word: the model's stand-in for time, which says that a wait for `r` may expire (a rank
    /// that stopped never answers; a live one always does within the timeout). Read only when
    /// the configuration stops a rank.
    stopped: Vec<AtomicU64>,
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
        let ring_rows = cfg.nodes() * cfg.rail_ring().map_or(0, |r| r.slots * r.chunk_rows);
        let ranks = (0..w)
            .map(|_| RankBuffer {
                count: zeroed(p * w * w),
                recv: zeroed(p * cfg.recv_slots()),
                comb: zeroed(p * w * t),
                flags: zeroed(w * t),
                done: zeroed(w),
                barrier: zeroed(w),
                ll_x: zeroed(cfg.ll_regions() * w * t),
                ll_counts: zeroed(cfg.ll_regions() * w),
                ll_comb: zeroed(cfg.ll_regions() * t * w),
                rail_count: zeroed(p * cfg.nodes() * (cfg.local_ranks() + 1)),
                rail_buf: zeroed(p * cfg.nodes() * t),
                rail_done: zeroed(cfg.nodes()),
                ring: zeroed(ring_rows),
                chunks_in: zeroed(cfg.nodes()),
                ring_credit: zeroed(cfg.nodes()),
                pring: zeroed(ring_rows),
                pchunks_in: zeroed(cfg.nodes()),
                pring_credit: zeroed(cfg.nodes()),
                xcount: zeroed(p * w),
                xrecv: zeroed(p * w * t),
                idone: zeroed(w),
                credit: zeroed(w),
                cdirect: zeroed(p * w * t),
                cfwd: zeroed(p * w * t * cfg.local_ranks()),
                cpart: zeroed(p * cfg.nodes() * t),
                cdone: zeroed(w),
                cpdone: zeroed(cfg.nodes()),
                ccredit: zeroed(w),
                abort: AtomicU64::new(0),
                intent: zeroed(2 * w),
            })
            .collect();
        Self {
            cfg: cfg.clone(),
            ranks,
            stopped: zeroed(w),
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

    /// `rank.ll_x[parity][src][slot]`; its index within the parity is `src * tokens + slot`.
    fn ll_x(&self, rank: usize, parity: usize, src: usize, slot: usize) -> &AtomicU64 {
        let (w, t) = (self.cfg.world(), self.cfg.tokens());
        &self.ranks[rank].ll_x[(parity * w + src) * t + slot]
    }

    /// `rank.intent[parity][src]`.
    fn intent(&self, rank: usize, parity: usize, src: usize) -> &AtomicU64 {
        &self.ranks[rank].intent[parity * self.cfg.world() + src]
    }

    fn ll_count(&self, rank: usize, parity: usize, src: usize) -> &AtomicU64 {
        &self.ranks[rank].ll_counts[parity * self.cfg.world() + src]
    }

    /// `rank.ll_comb[parity][token][k]`; its index within the parity is `token * world + k`.
    fn ll_comb(&self, rank: usize, parity: usize, token: usize, k: usize) -> &AtomicU64 {
        let (w, t) = (self.cfg.world(), self.cfg.tokens());
        &self.ranks[rank].ll_comb[(parity * t + token) * w + k]
    }
}

impl World {
    fn rail_count(&self, rank: usize, parity: usize, node: usize, j: usize) -> &AtomicU64 {
        let (n, l) = (self.cfg.nodes(), self.cfg.local_ranks());
        &self.ranks[rank].rail_count[(parity * n + node) * (l + 1) + j]
    }

    fn rail_buf(&self, rank: usize, parity: usize, node: usize, r: usize) -> &AtomicU64 {
        let (n, t) = (self.cfg.nodes(), self.cfg.tokens());
        &self.ranks[rank].rail_buf[(parity * n + node) * t + r]
    }

    /// `rank.ring[node][slot][row]` (the dispatch's) or `rank.pring[node][slot][row]`.
    fn ring_row(
        &self,
        of: RingOf,
        rank: usize,
        node: usize,
        slot: usize,
        row: usize,
    ) -> &AtomicU64 {
        let (r, c) = self
            .cfg
            .rail_ring()
            .map_or((0, 0), |r| (r.slots, r.chunk_rows));
        let b = &self.ranks[rank];
        let ring = match of {
            RingOf::Dispatch => &b.ring,
            RingOf::Combine => &b.pring,
        };
        &ring[(node * r + slot) * c + row]
    }

    /// `rank`'s chunk counts and credits of ring `of`, per peer node.
    fn ring_words(&self, of: RingOf, rank: usize) -> RingWords<'_> {
        let b = &self.ranks[rank];
        match of {
            RingOf::Dispatch => RingWords {
                chunks_in: &b.chunks_in,
                credit: &b.ring_credit,
            },
            RingOf::Combine => RingWords {
                chunks_in: &b.pchunks_in,
                credit: &b.pring_credit,
            },
        }
    }

    fn xcount(&self, rank: usize, parity: usize, src: usize) -> &AtomicU64 {
        &self.ranks[rank].xcount[parity * self.cfg.world() + src]
    }

    /// `rank.xrecv[parity][src][j]`; its index within the parity is `src * tokens + j`.
    fn xrecv(&self, rank: usize, parity: usize, src: usize, j: usize) -> &AtomicU64 {
        let (w, t) = (self.cfg.world(), self.cfg.tokens());
        &self.ranks[rank].xrecv[(parity * w + src) * t + j]
    }
}

impl World {
    /// `rank.cdirect[parity][src][token]`; its index within the parity is `src * tokens + token`.
    fn cdirect(&self, rank: usize, parity: usize, src: usize, token: usize) -> &AtomicU64 {
        let (w, t) = (self.cfg.world(), self.cfg.tokens());
        &self.ranks[rank].cdirect[(parity * w + src) * t + token]
    }

    /// `rank.cfwd[parity][src][token][j]`; its index within the parity is
    /// `(src * tokens + token) * L + j`.
    fn cfwd(&self, rank: usize, parity: usize, src: usize, token: usize, j: usize) -> &AtomicU64 {
        let (w, t, l) = (self.cfg.world(), self.cfg.tokens(), self.cfg.local_ranks());
        &self.ranks[rank].cfwd[((parity * w + src) * t + token) * l + j]
    }

    /// `rank.cpart[parity][node][token]`; its index within the parity is `node * tokens + token`.
    fn cpart(&self, rank: usize, parity: usize, node: usize, token: usize) -> &AtomicU64 {
        let (n, t) = (self.cfg.nodes(), self.cfg.tokens());
        &self.ranks[rank].cpart[(parity * n + node) * t + token]
    }
}

/// One rank's words of one rail ring, per peer node: `chunks_in` (written by the peer that
/// sends me chunks) and `credit` (written by the peer that takes mine).
struct RingWords<'a> {
    chunks_in: &'a [AtomicU64],
    credit: &'a [AtomicU64],
}

/// Layout of the last non-cached internode dispatch, as this rank learned it from the count
/// words (the kernels keep it on the device): what a cached one reuses.
#[derive(Debug, Clone, Default)]
struct InterLayout {
    /// Its internode sequence number (which picks the routing).
    seq: u64,
    /// `recv[s]`: `count(s -> me)`, from `xcount` ([`Step::I10`]).
    recv: Vec<u64>,
    /// `rail[k]`: rows my rail peer in node `k` sends me, from `rail_count[k][L]` ([`Step::I4`]).
    rail: Vec<u64>,
    /// `fwd[k * L + j]`: `count((k, l) -> (n, j))`, the rows I forward from node `k` to rank
    /// `j` of my node, from `rail_count[k][j]` ([`Step::I4`]).
    fwd: Vec<u64>,
}

/// The output of the last internode dispatch, live until the next one starts.
#[derive(Debug, Clone, Default)]
struct InterLive {
    parity: usize,
    /// `(src, j, row)`: `xrecv[parity][src][j]` must hold `row`.
    rows: Vec<(usize, usize, u64)>,
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

/// The output of the last low-latency dispatch (the packed rows, local memory): the rows the
/// next low-latency combine returns.
#[derive(Debug, Clone, Default)]
struct LlLive {
    /// Its LL dispatch sequence number (which picks the LL routing).
    seq: u64,
    /// The packed rows, ordered by source rank then token.
    rows: Vec<u64>,
}

/// Why a rank stopped an op early: a protocol violation ends the rank's run, an [`OpError`]
/// only the op, and the configured stop point ([`crate::config::StoppedRank`]) the rank's run
/// (before the step it names).
enum Stop {
    Violation(Violation),
    Failed(OpError),
    Halt(Step),
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
    /// Combines so far: the combine region and the value of the per-token flags.
    combine_seq: u64,
    /// `done` increments expected from every source so far (one per sender block per op).
    done_expected: u64,
    /// Barriers so far (Global schedule): the round the next barrier waits for, minus one.
    barrier_round: u64,
    /// Low-latency dispatches so far (the kernels' `ll_dispatch`): the `ll_x`/`ll_counts`
    /// region and the count words' tag.
    ll_dispatch_seq: u64,
    /// Low-latency combines so far (the kernels' `ll_combine`): the `ll_comb` region.
    ll_combine_seq: u64,
    /// Internode dispatches so far, cached or not: the data regions and the done values.
    inter_seq: u64,
    /// Non-cached internode dispatches so far: the count words' tag and region.
    inter_notify_seq: u64,
    /// Internode combines so far: the combine regions, done values and credits.
    inter_combine_seq: u64,
    /// Agreed ops so far (every op but the internode ones, which the kernels do not run): the
    /// intent words' tag and slot (the kernels' `op`).
    agree_seq: u64,
}

/// One simulated rank: its place in the world, its op cursor and its private state.
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
    /// This rank's mask words (the kernels' `[world]` u32 in its stats region, 1 = masked), as
    /// a bit set: bit `d` = peer `d` masked. Only this rank's own waits write them (the host's
    /// writes, `ll_set_masked` / `ll_clear_mask`, are not modelled), so they are private state;
    /// like the kernels' words they survive failed ops. Used only by the low-latency ops with
    /// masking ([`ModelConfig::ll_masking`]).
    mask: std::cell::Cell<u64>,
    layout: Layout,
    live: Option<Live>,
    ll_live: Option<LlLive>,
    inter_layout: InterLayout,
    inter_live: Option<InterLive>,
    /// The rail rings, per ring ([`RingOf::index`]) and node `k`: the chunks this rank has
    /// sent its rail peer in `k` since setup (the sender's `g`), and the chunks of that peer
    /// it has taken.
    ring_sent: [Vec<u64>; 2],
    ring_taken: [Vec<u64>; 2],
    outputs: Vec<Result<OpOutput, OpError>>,
}
