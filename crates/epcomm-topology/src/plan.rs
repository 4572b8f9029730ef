//! The plan of the symmetric buffer the intranode kernels use: its regions, their sizes and offsets.

use crate::{Result, RingShape, RowDtype, RowFormat, Tiers, TopologyError};

/// Alignment of every region's offset, in bytes.
pub const REGION_ALIGN: u64 = 256;

/// Tokens per combine progress flag: a sender publishes each token's row as soon as it landed,
/// so the owner reduces while the rest is still in flight.
pub const COMBINE_CHUNK_TOKENS: u64 = 1;

/// Size of the stats region (per-peer wait timestamps, see DESIGN §3), in bytes.
pub const STATS_BYTES: u64 = 4096;

/// Which of the two alternating copies of the per-op regions an op uses (`epoch % 2`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Parity {
    /// Even epochs.
    Even,
    /// Odd epochs.
    Odd,
}

impl Parity {
    /// Both parities, in index order.
    pub const ALL: [Parity; 2] = [Parity::Even, Parity::Odd];

    /// The parity an op with sequence number `epoch` uses.
    pub fn of_epoch(epoch: u64) -> Self {
        if epoch.is_multiple_of(2) {
            Parity::Even
        } else {
            Parity::Odd
        }
    }

    /// 0 for [`Parity::Even`], 1 for [`Parity::Odd`].
    pub fn index(self) -> usize {
        match self {
            Parity::Even => 0,
            Parity::Odd => 1,
        }
    }

    /// The other parity.
    pub fn other(self) -> Self {
        match self {
            Parity::Even => Parity::Odd,
            Parity::Odd => Parity::Even,
        }
    }
}

impl TryFrom<usize> for Parity {
    type Error = TopologyError;

    /// `0` → Even, `1` → Odd.
    fn try_from(value: usize) -> Result<Self> {
        match value {
            0 => Ok(Parity::Even),
            1 => Ok(Parity::Odd),
            _ => Err(TopologyError::IndexOutOfRange {
                arg: "parity",
                value: value as u64,
                bound_name: "2",
                bound: 2,
            }),
        }
    }
}

/// The regions of a [`BufferPlan`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RegionKind {
    /// Dispatch receive rows of x, `[world * max_tokens][hidden * 2]` bytes (bf16 size, which
    /// also holds fp8 rows).
    DispatchX,
    /// Dispatch receive fp8 scales, `[world * max_tokens][hidden / 128]` f32 (empty when the
    /// plan is not fp8-capable).
    DispatchScales,
    /// Dispatch receive top-k ids, `[world * max_tokens][top_k]` i64.
    DispatchTopkIdx,
    /// Dispatch receive top-k weights, `[world * max_tokens][top_k]` f32.
    DispatchTopkWeights,
    /// Dispatch receive source token indices, `[world * max_tokens]` i32.
    DispatchSrcIdx,
    /// Combine receive rows, `[world * max_tokens][hidden]` bf16.
    CombineX,
    /// Combine receive weights, `[world * max_tokens][top_k]` f32.
    CombineWeights,
    /// Token-count matrix, `[world][world]` u64 (row-major).
    CountMatrix,
    /// Per-expert counts, `[world][experts_per_rank]` u64 (row-major).
    ExpertCounts,
    /// Completion counters, `[world]` u64 (shared by both parities; monotonic).
    DoneCounters,
    /// Barrier counters, `[world]` u64 (shared by both parities; monotonic).
    BarrierCounters,
    /// Diagnostics, [`STATS_BYTES`] bytes (shared).
    Stats,
    /// Combine progress flags, `[world][combine_chunks]` u64 (shared by both parities;
    /// monotonic: each holds the sequence number of the last combine whose chunk landed).
    CombineFlags,
    /// Low-latency dispatch receive rows, `[world * ll_max_tokens][hidden * 2]` bytes
    /// (`[source][slot]`; bf16 size, which also holds fp8 rows).
    LlDispatchX,
    /// Low-latency dispatch receive fp8 scales, `[world * ll_max_tokens][hidden / 128]` f32
    /// (empty when not fp8-capable).
    LlDispatchScales,
    /// Low-latency dispatch metadata, `[world * ll_max_tokens][top_k + 1]` i32.
    LlMeta,
    /// Low-latency dispatch counts, `[world][1 + experts_per_rank]` tagged u64.
    LlCounts,
    /// Low-latency combine receive rows, `[ll_max_tokens * top_k][hidden]` bf16.
    LlCombineX,
    /// Low-latency FP8 send rows, the put source for put/signal peers (shared):
    /// `[ll_max_tokens][hidden]` fp8 bytes, then `[ll_max_tokens][hidden / 128]` f32 (empty
    /// when not fp8-capable).
    LlSendFp8,
    /// Low-latency metadata send rows (shared): `[world][ll_max_tokens][top_k + 1]` i32, each
    /// destination's metadata rows as they land there: the put source of kernel images that
    /// send a metadata row as one transfer (the CPU proxy's); unused by the others.
    LlSendMeta,
    /// Rail forwarding ([`BufferPlan::with_forwarding`]; empty without): tokens each source
    /// node's rail peer sends through this rank, `[nodes]` tagged u64.
    NodeCounts,
    /// Rail forwarding: ring entries (shared), `[source node][slots * chunk_rows]` entries of
    /// [`ring_entry_bytes`](crate::ring_entry_bytes).
    RingEntries,
    /// Rail forwarding: entries landed per ring slot (shared; monotonic),
    /// `[source node][slots]` u64.
    RingLanded,
    /// Rail forwarding: entries the rail peer in each node freed per slot (shared; monotonic),
    /// `[destination node][slots]` u64.
    RingFreed,
    /// Rail forwarding: this rank's ring counters (shared, local): `[2][2][nodes]` u64 entries
    /// sent and taken before an op by dispatch parity, then `[nodes]` forwarding blocks done.
    RingState,
}

impl RegionKind {
    /// Regions that exist once per [`Parity`], in layout order.
    pub const PER_PARITY: [RegionKind; 15] = [
        RegionKind::DispatchX,
        RegionKind::DispatchScales,
        RegionKind::DispatchTopkIdx,
        RegionKind::DispatchTopkWeights,
        RegionKind::DispatchSrcIdx,
        RegionKind::CombineX,
        RegionKind::CombineWeights,
        RegionKind::CountMatrix,
        RegionKind::ExpertCounts,
        RegionKind::LlDispatchX,
        RegionKind::LlDispatchScales,
        RegionKind::LlMeta,
        RegionKind::LlCounts,
        RegionKind::LlCombineX,
        RegionKind::NodeCounts,
    ];

    /// Regions that exist once, in layout order.
    pub const SHARED: [RegionKind; 10] = [
        RegionKind::DoneCounters,
        RegionKind::BarrierCounters,
        RegionKind::Stats,
        RegionKind::CombineFlags,
        RegionKind::LlSendFp8,
        RegionKind::LlSendMeta,
        RegionKind::RingEntries,
        RegionKind::RingLanded,
        RegionKind::RingFreed,
        RegionKind::RingState,
    ];

    /// Whether the region exists once per parity.
    pub fn is_per_parity(self) -> bool {
        Self::PER_PARITY.contains(&self)
    }
}

/// A byte range of the buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Region {
    /// Offset from the buffer's base, a multiple of [`REGION_ALIGN`].
    pub offset: u64,
    /// Length in bytes (exact, not padded; may be 0).
    pub len: u64,
}

impl Region {
    /// One past the last byte.
    pub fn end(&self) -> u64 {
        self.offset + self.len
    }
}

/// Layout of the symmetric buffer of the intranode (fixed-slot) kernels.
///
/// Receive rows are addressed `[source rank][token slot]`: source `s` writes its rows at
/// `s * max_tokens_per_rank ..`, so a receive region has `world_size * max_tokens_per_rank`
/// rows. Every array is its own region (x, scales, top-k ids, top-k weights, source index),
/// each aligned to [`REGION_ALIGN`]. The per-op regions exist twice, one per [`Parity`]
/// (`epoch % 2`); the done/barrier counters and the stats are shared and monotonic.
/// Layout order: all [`RegionKind::PER_PARITY`] regions of `Even`, then of `Odd`, then
/// [`RegionKind::SHARED`].
///
/// The x region is sized for bf16 rows (`hidden * 2` bytes), which also fits fp8 rows
/// (`hidden` bytes); the scales region exists (non-empty) only when `hidden % 128 == 0`
/// ([`fp8_capable`](Self::fp8_capable)).
///
/// The low-latency regions (`Ll*`) are sized by `ll_max_tokens_per_rank`
/// ([`BufferPlan::with_low_latency`]); [`BufferPlan::new`] plans none (all empty).
///
/// **Symmetric allocation:** every rank must build the plan from identical arguments so
/// that each region sits at the same offset in every rank's buffer; the plan is a pure
/// function of its arguments, so equal arguments give equal plans.
///
/// For DeepSeek-V3 on two ranks (`BufferPlan::new(2, 4096, 7168, 8, 256)`) the buffer is
/// **475,669,504 bytes (~453.6 MiB)** per rank: per parity 117,440,512 B of dispatch x,
/// 1,835,008 B of scales, 524,288 + 262,144 + 32,768 B of top-k ids/weights/source index,
/// 117,440,512 + 262,144 B of combine rows/weights, plus small count and flag regions (checked by a
/// unit test).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BufferPlan {
    world_size: usize,
    max_tokens_per_rank: usize,
    ll_max_tokens_per_rank: usize,
    hidden: usize,
    top_k: usize,
    num_experts: usize,
    fp8_capable: bool,
    row: RowFormat,
    forwarding: Option<(Tiers, RingShape)>,
    per_parity: [[Region; 15]; 2],
    shared: [Region; 10],
    total_bytes: u64,
}

impl BufferPlan {
    /// Plans the buffer.
    ///
    /// # Errors
    /// All arguments must be > 0; `hidden % 8 == 0` (bf16 rows move in 16-byte vectors);
    /// `num_experts % world_size == 0`; `top_k <= num_experts`;
    /// `max_tokens_per_rank <= i32::MAX` (source indices are i32); [`TopologyError::Overflow`]
    /// when the sizes do not fit in `u64`.
    pub fn new(
        world_size: usize,
        max_tokens_per_rank: usize,
        hidden: usize,
        top_k: usize,
        num_experts: usize,
    ) -> Result<Self> {
        Self::with_low_latency(
            world_size,
            max_tokens_per_rank,
            hidden,
            top_k,
            num_experts,
            0,
        )
    }

    /// Plans the buffer with low-latency regions for `ll_max_tokens_per_rank` tokens per rank
    /// (0: none).
    ///
    /// # Errors
    /// As [`BufferPlan::new`]; `ll_max_tokens_per_rank < 65536` and
    /// `experts_per_rank < 32768` (a metadata entry packs both in an i32).
    pub fn with_low_latency(
        world_size: usize,
        max_tokens_per_rank: usize,
        hidden: usize,
        top_k: usize,
        num_experts: usize,
        ll_max_tokens_per_rank: usize,
    ) -> Result<Self> {
        TopologyError::zero_check("world_size", world_size)?;
        TopologyError::zero_check("max_tokens_per_rank", max_tokens_per_rank)?;
        TopologyError::zero_check("hidden", hidden)?;
        TopologyError::zero_check("top_k", top_k)?;
        TopologyError::zero_check("num_experts", num_experts)?;
        let row = RowFormat::new(hidden, RowDtype::Bf16)?;
        TopologyError::multiple_check("num_experts", num_experts, "world_size", world_size)?;
        if top_k > num_experts {
            return Err(TopologyError::OutOfRange {
                arg: "top_k",
                value: top_k as u64,
                min: 1,
                max: num_experts as u64,
                rule: "a token picks at most num_experts experts",
            });
        }
        if max_tokens_per_rank > i32::MAX as usize {
            return Err(TopologyError::OutOfRange {
                arg: "max_tokens_per_rank",
                value: max_tokens_per_rank as u64,
                min: 1,
                max: i32::MAX as u64,
                rule: "source token indices are carried as i32",
            });
        }
        if ll_max_tokens_per_rank > 0xffff {
            return Err(TopologyError::OutOfRange {
                arg: "ll_max_tokens_per_rank",
                value: ll_max_tokens_per_rank as u64,
                min: 0,
                max: 0xffff,
                rule: "a low-latency metadata entry packs the index in 16 bits",
            });
        }
        if ll_max_tokens_per_rank > 0 && num_experts / world_size > 0x7fff {
            return Err(TopologyError::OutOfRange {
                arg: "num_experts",
                value: num_experts as u64,
                min: 1,
                max: 0x7fff * world_size as u64,
                rule: "low-latency metadata packs the local expert in 15 bits",
            });
        }
        let fp8_capable = RowFormat::fp8_capable(hidden);
        let mut plan = Self {
            world_size,
            max_tokens_per_rank,
            ll_max_tokens_per_rank,
            hidden,
            top_k,
            num_experts,
            fp8_capable,
            row,
            forwarding: None,
            per_parity: [[Region { offset: 0, len: 0 }; 15]; 2],
            shared: [Region { offset: 0, len: 0 }; 10],
            total_bytes: 0,
        };
        plan.place_regions()?;
        Ok(plan)
    }

    /// This plan with rail forwarding over `tiers` (the world's nodes) through rings of shape
    /// `ring` (docs/internode.md, "The fused op"): a dispatch sends a token for ranks of
    /// another node once, into a ring of the rank there with its local index, which stores it
    /// into its node's receive rows.
    ///
    /// # Errors
    /// [`TopologyError::OutOfRange`] when `tiers` is not a split of this plan's world, for a
    /// world of one node, or more ring slots than
    /// [`MAX_RING_SLOTS`](crate::MAX_RING_SLOTS); [`TopologyError::Overflow`].
    pub fn with_forwarding(mut self, tiers: Tiers, ring: RingShape) -> Result<Self> {
        if tiers.world_size() != self.world_size {
            return Err(TopologyError::OutOfRange {
                arg: "tiers",
                value: tiers.world_size() as u64,
                min: self.world_size as u64,
                max: self.world_size as u64,
                rule: "nodes * local_ranks must be the plan's world size",
            });
        }
        if tiers.nodes() < 2 {
            return Err(TopologyError::OutOfRange {
                arg: "tiers",
                value: tiers.nodes() as u64,
                min: 2,
                max: self.world_size as u64,
                rule: "forwarding needs two nodes or more",
            });
        }
        if ring.slots() > crate::MAX_RING_SLOTS {
            return Err(TopologyError::OutOfRange {
                arg: "slots",
                value: ring.slots() as u64,
                min: 1,
                max: crate::MAX_RING_SLOTS as u64,
                rule: "the kernels keep at most this many slots per ring",
            });
        }
        self.forwarding = Some((tiers, ring));
        self.place_regions()?;
        Ok(self)
    }

    /// The forwarding this plan has ([`Self::with_forwarding`]).
    pub fn forwarding(&self) -> Option<(Tiers, RingShape)> {
        self.forwarding
    }

    /// Bytes of one ring entry (0 without forwarding).
    pub fn ring_entry_bytes(&self) -> u64 {
        self.forwarding.map_or(0, |(t, _)| {
            crate::ring_entry_bytes(t.local_ranks(), self.hidden, self.top_k)
        })
    }

    fn place_regions(&mut self) -> Result<()> {
        let plan = self;
        let mut cursor = 0u64;
        let mut place = |len: u64| -> Result<Region> {
            let offset = align_up(cursor)?;
            let end = offset.checked_add(len).ok_or(TopologyError::Overflow {
                what: "buffer plan",
            })?;
            cursor = end;
            Ok(Region { offset, len })
        };
        for p in Parity::ALL {
            for (i, kind) in RegionKind::PER_PARITY.into_iter().enumerate() {
                plan.per_parity[p.index()][i] = place(plan.region_len(kind)?)?;
            }
        }
        for (i, kind) in RegionKind::SHARED.into_iter().enumerate() {
            plan.shared[i] = place(plan.region_len(kind)?)?;
        }
        plan.total_bytes = align_up(cursor)?;
        Ok(())
    }

    fn region_len(&self, kind: RegionKind) -> Result<u64> {
        let rows = self.recv_rows();
        let world = self.world_size as u64;
        let (a, b) = match kind {
            RegionKind::DispatchX => (rows, self.x_row_bytes()),
            RegionKind::DispatchScales => (rows, self.scales_row_bytes()),
            RegionKind::DispatchTopkIdx => (rows, self.topk_idx_row_bytes()),
            RegionKind::DispatchTopkWeights => (rows, self.topk_weights_row_bytes()),
            RegionKind::DispatchSrcIdx => (rows, self.src_idx_row_bytes()),
            RegionKind::CombineX => (rows, self.combine_x_row_bytes()),
            RegionKind::CombineWeights => (rows, self.combine_weights_row_bytes()),
            RegionKind::CountMatrix => (world, world.checked_mul(8).ok_or(OVERFLOW)?),
            RegionKind::ExpertCounts => (world, (self.experts_per_rank() as u64) * 8),
            RegionKind::DoneCounters | RegionKind::BarrierCounters => (world, 8),
            RegionKind::Stats => (1, STATS_BYTES),
            RegionKind::CombineFlags => (world, self.combine_chunks() * 8),
            RegionKind::LlDispatchX => (self.ll_recv_rows(), self.x_row_bytes()),
            RegionKind::LlDispatchScales => (self.ll_recv_rows(), self.scales_row_bytes()),
            RegionKind::LlMeta => (self.ll_recv_rows(), (self.top_k as u64 + 1) * 4),
            RegionKind::LlCounts => (
                if self.ll_max_tokens_per_rank > 0 {
                    world
                } else {
                    0
                },
                (1 + self.experts_per_rank() as u64) * 8,
            ),
            RegionKind::LlCombineX => (
                (self.ll_max_tokens_per_rank as u64) * self.top_k as u64,
                self.combine_x_row_bytes(),
            ),
            RegionKind::LlSendFp8 => (
                self.ll_max_tokens_per_rank as u64,
                if self.fp8_capable {
                    self.hidden as u64 + self.scales_row_bytes()
                } else {
                    0
                },
            ),
            RegionKind::LlSendMeta => (self.ll_recv_rows(), (self.top_k as u64 + 1) * 4),
            RegionKind::NodeCounts => (self.forward_nodes(), 8),
            RegionKind::RingEntries => (
                self.forward_nodes() * self.ring_positions(),
                self.ring_entry_bytes(),
            ),
            RegionKind::RingLanded | RegionKind::RingFreed => (
                self.forward_nodes() * self.forwarding.map_or(0, |(_, r)| r.slots() as u64),
                8,
            ),
            RegionKind::RingState => (self.forward_nodes() * 5, 8),
        };
        a.checked_mul(b).ok_or(OVERFLOW)
    }

    /// Nodes of the forwarding (0 without).
    fn forward_nodes(&self) -> u64 {
        self.forwarding.map_or(0, |(t, _)| t.nodes() as u64)
    }

    /// Entries per ring (`slots * chunk_rows`; 0 without forwarding).
    fn ring_positions(&self) -> u64 {
        self.forwarding
            .map_or(0, |(_, r)| r.slots() as u64 * r.chunk_rows() as u64)
    }

    /// The region of `kind` for `parity` (`parity` is ignored for shared regions).
    pub fn region(&self, kind: RegionKind, parity: Parity) -> Region {
        if let Some(i) = RegionKind::PER_PARITY.iter().position(|k| *k == kind) {
            self.per_parity[parity.index()][i]
        } else {
            let i = RegionKind::SHARED
                .iter()
                .position(|k| *k == kind)
                .unwrap_or(0);
            self.shared[i]
        }
    }

    /// Every region of the plan (per-parity ones twice), in layout order.
    pub fn regions(&self) -> Vec<(RegionKind, Option<Parity>, Region)> {
        let mut out =
            Vec::with_capacity(2 * RegionKind::PER_PARITY.len() + RegionKind::SHARED.len());
        for p in Parity::ALL {
            for (i, kind) in RegionKind::PER_PARITY.into_iter().enumerate() {
                out.push((kind, Some(p), self.per_parity[p.index()][i]));
            }
        }
        for (i, kind) in RegionKind::SHARED.into_iter().enumerate() {
            out.push((kind, None, self.shared[i]));
        }
        out
    }

    /// Bytes to allocate (a multiple of [`REGION_ALIGN`], covering every region).
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Whether fp8 dispatch fits this plan (`hidden % 128 == 0`).
    pub fn fp8_capable(&self) -> bool {
        self.fp8_capable
    }
    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }
    /// Token bound per source rank.
    pub fn max_tokens_per_rank(&self) -> usize {
        self.max_tokens_per_rank
    }
    /// Channels per token.
    pub fn hidden(&self) -> usize {
        self.hidden
    }
    /// Experts per token.
    pub fn top_k(&self) -> usize {
        self.top_k
    }
    /// Total experts.
    pub fn num_experts(&self) -> usize {
        self.num_experts
    }
    /// Experts per rank.
    pub fn experts_per_rank(&self) -> usize {
        self.num_experts / self.world_size
    }
    /// Rows of every receive region (`world_size * max_tokens_per_rank`); source `s` owns
    /// rows `s * max_tokens_per_rank ..`.
    pub fn recv_rows(&self) -> u64 {
        self.world_size as u64 * self.max_tokens_per_rank as u64
    }
    /// Low-latency token bound per source rank (0: no low-latency regions).
    pub fn ll_max_tokens_per_rank(&self) -> usize {
        self.ll_max_tokens_per_rank
    }
    /// Rows of every low-latency receive region (`world_size * ll_max_tokens_per_rank`).
    pub fn ll_recv_rows(&self) -> u64 {
        self.world_size as u64 * self.ll_max_tokens_per_rank as u64
    }
    /// Row stride of [`RegionKind::DispatchX`]: `hidden * 2`.
    pub fn x_row_bytes(&self) -> u64 {
        self.row.pitch() as u64
    }
    /// Row stride of [`RegionKind::DispatchScales`]: `hidden / 128 * 4`, or 0 when not
    /// fp8-capable.
    pub fn scales_row_bytes(&self) -> u64 {
        RowFormat::new(self.hidden, RowDtype::Fp8).map_or(0, |f| f.scale_bytes() as u64)
    }
    /// Row stride of [`RegionKind::DispatchTopkIdx`]: `top_k * 8`.
    pub fn topk_idx_row_bytes(&self) -> u64 {
        self.top_k as u64 * 8
    }
    /// Row stride of [`RegionKind::DispatchTopkWeights`]: `top_k * 4`.
    pub fn topk_weights_row_bytes(&self) -> u64 {
        self.top_k as u64 * 4
    }
    /// Row stride of [`RegionKind::DispatchSrcIdx`]: 4.
    pub fn src_idx_row_bytes(&self) -> u64 {
        4
    }
    /// Combine chunks per rank: `ceil(max_tokens_per_rank / COMBINE_CHUNK_TOKENS)`.
    pub fn combine_chunks(&self) -> u64 {
        (self.max_tokens_per_rank as u64).div_ceil(COMBINE_CHUNK_TOKENS)
    }
    /// Row stride of [`RegionKind::CombineX`]: `hidden * 2`.
    pub fn combine_x_row_bytes(&self) -> u64 {
        self.row.x_bytes() as u64
    }
    /// The format of the BF16 rows the receive regions are sized for.
    pub fn row(&self) -> RowFormat {
        self.row
    }
    /// Row stride of [`RegionKind::CombineWeights`]: `top_k * 4`.
    pub fn combine_weights_row_bytes(&self) -> u64 {
        self.top_k as u64 * 4
    }
}

const OVERFLOW: TopologyError = TopologyError::Overflow {
    what: "buffer plan",
};

fn align_up(v: u64) -> Result<u64> {
    v.checked_next_multiple_of(REGION_ALIGN).ok_or(OVERFLOW)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn check_invariants(p: &BufferPlan) {
        let regions = p.regions();
        assert_eq!(regions.len(), 40);
        for (k, _, r) in &regions {
            assert_eq!(r.offset % REGION_ALIGN, 0, "{k:?}");
            assert!(r.end() <= p.total_bytes(), "{k:?}");
        }
        let mut sorted: Vec<_> = regions.iter().map(|(_, _, r)| *r).collect();
        sorted.sort_by_key(|r| r.offset);
        for w in sorted.windows(2) {
            assert!(w[0].end() <= w[1].offset, "{:?} overlaps {:?}", w[0], w[1]);
        }
        let sum: u64 = regions.iter().map(|(_, _, r)| r.len).sum();
        assert!(p.total_bytes() >= sum);
        assert!(p.total_bytes() < sum + 41 * REGION_ALIGN);
        assert_eq!(p.total_bytes() % REGION_ALIGN, 0);
    }

    #[test]
    fn forwarding_regions_and_their_errors() {
        let flat = BufferPlan::new(4, 4096, 7168, 8, 256).unwrap();
        for k in [
            RegionKind::NodeCounts,
            RegionKind::RingEntries,
            RegionKind::RingLanded,
            RegionKind::RingFreed,
            RegionKind::RingState,
        ] {
            assert_eq!(flat.region(k, Parity::Odd).len, 0, "{k:?}");
        }
        assert_eq!(flat.ring_entry_bytes(), 0);
        let tiers = Tiers::new(2, 2).unwrap();
        let p = flat
            .clone()
            .with_forwarding(tiers, RingShape::new(2, 16).unwrap())
            .unwrap();
        check_invariants(&p);
        // header 3 i32 -> 16, row 14336, 56 scales -> 224, 8 ids, 8 weights -> 14672.
        assert_eq!(p.ring_entry_bytes(), 16 + 14_336 + 224 + 64 + 32);
        assert_eq!(crate::ring_entry_bytes(2, 7168, 8), p.ring_entry_bytes());
        let e = Parity::Even;
        assert_eq!(p.region(RegionKind::NodeCounts, e).len, 2 * 8);
        assert_eq!(
            p.region(RegionKind::RingEntries, e).len,
            2 * 32 * p.ring_entry_bytes()
        );
        assert_eq!(p.region(RegionKind::RingLanded, e).len, 2 * 2 * 8);
        assert_eq!(p.region(RegionKind::RingFreed, e).len, 2 * 2 * 8);
        assert_eq!(p.region(RegionKind::RingState, e).len, 5 * 2 * 8);
        // The receive regions keep their sizes.
        for k in RegionKind::PER_PARITY {
            if k != RegionKind::NodeCounts {
                assert_eq!(
                    p.region(k, Parity::Odd).len,
                    flat.region(k, Parity::Odd).len
                );
            }
        }
        assert_eq!(
            p.forwarding(),
            Some((tiers, RingShape::new(2, 16).unwrap()))
        );
        let err = |r: Result<BufferPlan>| r.unwrap_err().to_string();
        let e1 = err(flat
            .clone()
            .with_forwarding(Tiers::new(1, 4).unwrap(), RingShape::new(2, 1).unwrap()));
        assert!(e1.contains("tiers") && e1.contains("two nodes"), "{e1}");
        let e2 = err(flat
            .clone()
            .with_forwarding(Tiers::new(2, 3).unwrap(), RingShape::new(2, 1).unwrap()));
        assert!(e2.contains("tiers") && e2.contains("world size"), "{e2}");
        let e3 =
            err(flat.with_forwarding(tiers, RingShape::new(crate::MAX_RING_SLOTS + 1, 1).unwrap()));
        assert!(e3.contains("slots"), "{e3}");
    }

    #[test]
    fn deepseek_v3_two_ranks() {
        let p = BufferPlan::new(2, 4096, 7168, 8, 256).unwrap();
        check_invariants(&p);
        assert!(p.fp8_capable());
        let e = Parity::Even;
        assert_eq!(p.region(RegionKind::DispatchX, e).len, 117_440_512);
        assert_eq!(p.region(RegionKind::DispatchScales, e).len, 1_835_008);
        assert_eq!(p.region(RegionKind::DispatchTopkIdx, e).len, 524_288);
        assert_eq!(p.region(RegionKind::DispatchTopkWeights, e).len, 262_144);
        assert_eq!(p.region(RegionKind::DispatchSrcIdx, e).len, 32_768);
        assert_eq!(p.region(RegionKind::CombineX, e).len, 117_440_512);
        assert_eq!(p.region(RegionKind::CombineWeights, e).len, 262_144);
        assert_eq!(p.region(RegionKind::CountMatrix, e).len, 32);
        assert_eq!(p.region(RegionKind::ExpertCounts, e).len, 2 * 128 * 8);
        assert_eq!(p.region(RegionKind::DoneCounters, e).len, 16);
        assert_eq!(p.region(RegionKind::BarrierCounters, e).len, 16);
        assert_eq!(p.region(RegionKind::Stats, e).len, STATS_BYTES);
        assert_eq!(p.region(RegionKind::CombineFlags, e).len, 2 * 4096 * 8);
        println!("DeepSeek-V3, world 2: {} bytes", p.total_bytes());
        assert_eq!(p.total_bytes(), 475_669_504);
    }

    #[test]
    fn strides() {
        let p = BufferPlan::new(4, 16, 256, 3, 8).unwrap();
        assert_eq!(p.recv_rows(), 64);
        assert_eq!(p.x_row_bytes(), 512);
        assert_eq!(p.scales_row_bytes(), 8);
        assert_eq!(p.topk_idx_row_bytes(), 24);
        assert_eq!(p.topk_weights_row_bytes(), 12);
        assert_eq!(p.src_idx_row_bytes(), 4);
        assert_eq!(p.combine_x_row_bytes(), 512);
        assert_eq!(p.combine_weights_row_bytes(), 12);
        assert_eq!(p.experts_per_rank(), 2);
        assert_eq!(
            (
                p.world_size(),
                p.max_tokens_per_rank(),
                p.hidden(),
                p.top_k(),
                p.num_experts()
            ),
            (4, 16, 256, 3, 8)
        );
        assert_eq!(p.region(RegionKind::DispatchX, Parity::Odd).len, 64 * 512);
        assert_eq!(
            p.region(RegionKind::CountMatrix, Parity::Odd).len,
            4 * 4 * 8
        );
    }

    #[test]
    fn bf16_only_hidden_has_empty_scales() {
        let p = BufferPlan::new(2, 8, 200, 2, 4).unwrap();
        assert!(!p.fp8_capable());
        assert_eq!(p.scales_row_bytes(), 0);
        assert_eq!(p.region(RegionKind::DispatchScales, Parity::Even).len, 0);
        check_invariants(&p);
    }

    #[test]
    fn parity_copies_and_layout_order() {
        let p = BufferPlan::new(3, 10, 128, 2, 6).unwrap();
        let off = |k, parity| p.region(k, parity).offset;
        for kind in RegionKind::PER_PARITY {
            assert!(kind.is_per_parity());
        }
        // Parities differ for per-op regions and agree for shared ones.
        assert_ne!(
            off(RegionKind::DispatchX, Parity::Even),
            off(RegionKind::DispatchX, Parity::Odd)
        );
        assert_eq!(
            off(RegionKind::Stats, Parity::Even),
            off(RegionKind::Stats, Parity::Odd)
        );
        // Layout order: parity 0 first, then parity 1, then shared.
        assert!(
            off(RegionKind::ExpertCounts, Parity::Even) < off(RegionKind::DispatchX, Parity::Odd)
        );
        assert!(
            off(RegionKind::ExpertCounts, Parity::Odd)
                < off(RegionKind::DoneCounters, Parity::Even)
        );
        // Same arguments, same plan (symmetric allocation).
        assert_eq!(p, BufferPlan::new(3, 10, 128, 2, 6).unwrap());
    }

    #[test]
    fn parity() {
        assert_eq!(Parity::of_epoch(0), Parity::Even);
        assert_eq!(Parity::of_epoch(7), Parity::Odd);
        assert_eq!(Parity::Even.other(), Parity::Odd);
        assert_eq!(Parity::Odd.other(), Parity::Even);
        assert_eq!(Parity::try_from(1).unwrap(), Parity::Odd);
        assert_eq!(Parity::try_from(0).unwrap().index(), 0);
        assert!(matches!(
            Parity::try_from(2),
            Err(TopologyError::IndexOutOfRange { arg: "parity", .. })
        ));
    }

    #[test]
    fn errors() {
        let arg = |r: Result<BufferPlan>| match r {
            Err(TopologyError::Zero { arg })
            | Err(TopologyError::NotMultiple { arg, .. })
            | Err(TopologyError::OutOfRange { arg, .. }) => arg,
            Err(TopologyError::Overflow { what }) => what,
            other => panic!("unexpected {other:?}"),
        };
        assert_eq!(arg(BufferPlan::new(0, 1, 8, 1, 1)), "world_size");
        assert_eq!(arg(BufferPlan::new(1, 0, 8, 1, 1)), "max_tokens_per_rank");
        assert_eq!(arg(BufferPlan::new(1, 1, 0, 1, 1)), "hidden");
        assert_eq!(arg(BufferPlan::new(1, 1, 8, 0, 1)), "top_k");
        assert_eq!(arg(BufferPlan::new(1, 1, 8, 1, 0)), "num_experts");
        assert_eq!(arg(BufferPlan::new(1, 1, 12, 1, 1)), "hidden");
        assert_eq!(arg(BufferPlan::new(4, 1, 8, 1, 6)), "num_experts");
        assert_eq!(arg(BufferPlan::new(2, 1, 8, 5, 4)), "top_k");
        assert_eq!(
            arg(BufferPlan::new(1, i32::MAX as usize + 1, 8, 1, 1)),
            "max_tokens_per_rank"
        );
        assert_eq!(
            arg(BufferPlan::new(1 << 20, 1 << 30, 1 << 40, 1, 1 << 20)),
            "buffer plan"
        );
    }

    proptest! {
        #[test]
        fn invariants(
            world in 1usize..9,
            max_tokens in 1usize..300,
            hidden8 in 1usize..200,
            top_k in 1usize..9,
            epr in 1usize..9,
            ll in 0usize..300,
        ) {
            let num_experts = world * epr;
            let top_k = top_k.min(num_experts);
            let hidden = hidden8 * 8;
            let p = BufferPlan::with_low_latency(world, max_tokens, hidden, top_k, num_experts, ll)
                .unwrap();
            let ll_rows = (world * ll) as u64;
            check_invariants(&p);
            prop_assert_eq!(p.fp8_capable(), hidden % 128 == 0);
            for parity in Parity::ALL {
                for kind in RegionKind::PER_PARITY {
                    let r = p.region(kind, parity);
                    let expected = match kind {
                        RegionKind::DispatchX => p.recv_rows() * p.x_row_bytes(),
                        RegionKind::DispatchScales => p.recv_rows() * p.scales_row_bytes(),
                        RegionKind::DispatchTopkIdx => p.recv_rows() * p.topk_idx_row_bytes(),
                        RegionKind::DispatchTopkWeights => {
                            p.recv_rows() * p.topk_weights_row_bytes()
                        }
                        RegionKind::DispatchSrcIdx => p.recv_rows() * 4,
                        RegionKind::CombineX => p.recv_rows() * p.combine_x_row_bytes(),
                        RegionKind::CombineWeights => {
                            p.recv_rows() * p.combine_weights_row_bytes()
                        }
                        RegionKind::CountMatrix => (world * world * 8) as u64,
                        RegionKind::ExpertCounts => (world * epr * 8) as u64,
                        RegionKind::LlDispatchX => ll_rows * p.x_row_bytes(),
                        RegionKind::LlDispatchScales => ll_rows * p.scales_row_bytes(),
                        RegionKind::LlMeta => ll_rows * (top_k as u64 + 1) * 4,
                        RegionKind::LlCounts => {
                            if ll > 0 { (world * (1 + epr) * 8) as u64 } else { 0 }
                        }
                        RegionKind::LlCombineX => (ll * top_k) as u64 * p.combine_x_row_bytes(),
                        // No forwarding planned here.
                        RegionKind::NodeCounts => 0,
                        _ => unreachable!(),
                    };
                    prop_assert_eq!(r.len, expected);
                }
            }
            prop_assert_eq!(
                p.region(RegionKind::LlSendMeta, Parity::Even).len,
                ll_rows * (top_k as u64 + 1) * 4
            );
        }
    }
}
