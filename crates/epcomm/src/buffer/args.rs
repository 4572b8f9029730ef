//! Kernel argument blocks ([`OpArgs`], [`LayoutArgs`]) from the plan, the config and the
//! inputs.
//!
//! What goes in: the symmetric-buffer offsets of the **even** parity copy of every region (the
//! kernels add `parity_stride` themselves), the shapes, the flags, and the addresses of the
//! failure and sequencing blocks. What never goes in: per-op values (sequence numbers,
//! parities, expected counter values): the kernels read those from the device `SeqState`, so a
//! captured graph replays correctly. Caller addresses are filled in by the op right before its
//! launch, while it holds the guards that keep them valid.

use epcomm_kernels::abi::{self, LayoutArgs, OpArgs};
use epcomm_topology::{BufferPlan, Parity, RegionKind, RowDtype, RowFormat, Schedule};

use super::Buffer;

/// Offset of the even-parity copy of region `kind`.
fn region(plan: &BufferPlan, kind: RegionKind) -> u64 {
    plan.region(kind, Parity::Even).offset
}

/// Flags of a dispatch (`cached`: along a handle, no count exchange; `weights`: top-k weights
/// travel, never on a cached dispatch).
pub(super) fn dispatch_flags(cached: bool, ids: bool, weights: bool, dtype: RowDtype) -> u32 {
    let kind = if cached {
        abi::flags::CACHED
    } else if ids {
        abi::flags::HAS_TOPK
    } else {
        0
    };
    let weights = if !cached && weights {
        abi::flags::HAS_WEIGHTS
    } else {
        0
    };
    let scales = if dtype == RowDtype::Fp8 {
        abi::flags::HAS_SCALES
    } else {
        0
    };
    kind | weights | scales
}

/// Flags of a combine (`in_place`: pull y from the peers' receive regions; `weights`: top-k
/// weights are reduced too).
pub(super) fn combine_flags(in_place: bool, weights: bool) -> u32 {
    let in_place = if in_place { abi::flags::IN_PLACE } else { 0 };
    let weights = if weights { abi::flags::HAS_WEIGHTS } else { 0 };
    in_place | weights
}

/// What every bounded wait of a kernel needs ([`Buffer::wait_bounds`]).
struct WaitBounds {
    /// The error claim word (device): the first failing wait takes it.
    err_claim: u64,
    /// The error record (host-mapped) the claiming wait fills.
    err_record: u64,
    /// How long a wait may last, in nanoseconds.
    timeout_ns: u64,
}

impl Buffer {
    /// What every bounded wait needs: where a failure is claimed and recorded, and the timeout.
    fn wait_bounds(&self) -> WaitBounds {
        WaitBounds {
            err_claim: self.health.err_claim.ptr(),
            err_record: self.health.err_record.device_ptr(),
            timeout_ns: self.cfg.timeout.as_nanos().min(u64::MAX as u128) as u64,
        }
    }

    /// The arguments of the layout kernel for `num_tokens` tokens, given the addresses of
    /// `topk_idx` and of the layout's three arrays.
    pub(super) fn layout_args(
        &self,
        num_tokens: usize,
        topk_idx: u64,
        counts: u64,
        token_slot: u64,
        status: u64,
    ) -> LayoutArgs {
        let WaitBounds {
            err_claim,
            err_record,
            ..
        } = self.wait_bounds();
        LayoutArgs {
            topk_idx,
            counts,
            token_slot,
            status,
            err_record,
            err_claim,
            num_tokens_ptr: 0,
            in_rank: 0,
            expert_counts: 0,
            num_tokens: num_tokens as i32,
            top_k: self.cfg.top_k as i32,
            num_experts: self.cfg.num_experts as i32,
            world: self.place.world as i32,
            // One node (the per-node counts are the whole world's), or the forwarding's nodes.
            gpus_per_node: self.gpus_per_node() as i32,
            rank: self.place.rank as i32,
            // Failure records name world ranks on a tier's buffer too.
            pe_base: self.place.group.pe_base() as i32,
            pe_stride: self.place.group.pe_stride() as i32,
            token_node_slot: 0,
        }
    }

    /// Ranks per node as the kernels see them: the forwarding's, or the whole buffer.
    pub(super) fn gpus_per_node(&self) -> usize {
        self.place
            .plan
            .forwarding()
            .map_or(self.place.world, |(t, _)| t.local_ranks())
    }

    /// The fields every dispatch/combine launch shares. Per-op values (sequence numbers,
    /// parities, expected counter values) are not here: the kernels read them from the device
    /// `SeqState`, so a captured graph replays correctly. The host mirror advances only once
    /// the kernel is launched (a check that fails before the launch leaves it in step).
    pub(super) fn next_op_args(&self) -> OpArgs {
        let plan = &self.place.plan;
        let stats = region(plan, RegionKind::Stats);
        let WaitBounds {
            err_claim,
            err_record,
            timeout_ns,
        } = self.wait_bounds();
        OpArgs {
            peer_bases: self.memory.peer_bases.ptr(),
            off_done: region(plan, RegionKind::DoneCounters),
            off_barrier: region(plan, RegionKind::BarrierCounters),
            off_comb_flags: region(plan, RegionKind::CombineFlags),
            off_stats: stats,
            err_claim,
            err_record,
            host_counts: self.memory.host_counts.device_ptr(),
            timeout_ns,
            seq_state: self.memory.seq_state.ptr(),
            parity_stride: self.place.parity_stride,
            hidden: self.cfg.hidden as i32,
            top_k: self.cfg.top_k as i32,
            num_experts: self.cfg.num_experts as i32,
            world: self.place.world as i32,
            rank: self.place.rank as i32,
            pe_base: self.place.group.pe_base() as i32,
            pe_stride: self.place.group.pe_stride() as i32,
            max_tokens: self.cfg.max_tokens_per_rank as i32,
            global_barriers: u32::from(self.cfg.schedule == Schedule::Global),
            remote_mask: self.place.remote_mask,
            abort_word: self.memory.mem.local_base() + stats + abi::STATS_ABORT_OFFSET,
            off_ll_x: region(plan, RegionKind::LlDispatchX),
            off_ll_scales: region(plan, RegionKind::LlDispatchScales),
            off_ll_meta: region(plan, RegionKind::LlMeta),
            off_ll_counts: region(plan, RegionKind::LlCounts),
            off_ll_comb: region(plan, RegionKind::LlCombineX),
            off_ll_send_fp8: region(plan, RegionKind::LlSendFp8),
            off_ll_send_meta: region(plan, RegionKind::LlSendMeta),
            ll_max_tokens: self.cfg.ll_max_tokens_per_rank as i32,
            ll_smem_words: self.ll.smem_words as i32,
            off_ring: region(plan, RegionKind::RingEntries),
            off_ring_landed: region(plan, RegionKind::RingLanded),
            off_ring_freed: region(plan, RegionKind::RingFreed),
            off_ring_state: region(plan, RegionKind::RingState),
            off_node_counts: region(plan, RegionKind::NodeCounts),
            gpus_per_node: self.gpus_per_node() as i32,
            ring_slots: plan.forwarding().map_or(0, |(_, r)| r.slots() as i32),
            ring_chunk: plan.forwarding().map_or(0, |(_, r)| r.chunk_rows() as i32),
            ring_entry_bytes: plan.ring_entry_bytes() as i32,
            fwd_blocks: plan.forwarding().map_or(0, |(t, r)| {
                crate::rules::forward_blocks(
                    self.cfg.num_sms,
                    t.nodes(),
                    self.cfg.rail_forward_sms,
                    r.slots(),
                ) as i32
            }),
            ..OpArgs::default()
        }
    }

    /// A dispatch of `num_tokens` rows of `row` into at most `max_recv_rows` rows, with
    /// `flags` ([`dispatch_flags`]); caller and handle addresses still 0.
    pub(super) fn dispatch_args(
        &self,
        num_tokens: usize,
        row: RowFormat,
        max_recv_rows: usize,
        flags: u32,
    ) -> OpArgs {
        let plan = &self.place.plan;
        OpArgs {
            off_x: region(plan, RegionKind::DispatchX),
            off_scales: region(plan, RegionKind::DispatchScales),
            off_topk_idx: region(plan, RegionKind::DispatchTopkIdx),
            off_topk_w: region(plan, RegionKind::DispatchTopkWeights),
            off_src_idx: region(plan, RegionKind::DispatchSrcIdx),
            off_counts: region(plan, RegionKind::CountMatrix),
            off_expert_counts: region(plan, RegionKind::ExpertCounts),
            num_tokens: num_tokens as i32,
            num_scales: row.num_scales() as i32,
            row_bytes: row.x_bytes() as i32,
            max_recv_rows: max_recv_rows as i32,
            flags: flags
                | if plan.forwarding().is_some() {
                    abi::flags::FORWARD
                } else {
                    0
                },
            ..self.next_op_args()
        }
    }

    /// A combine of `num_tokens` tokens along a handle of at most `max_recv_rows` rows, with
    /// `flags` ([`combine_flags`]); caller and handle addresses still 0.
    pub(super) fn combine_args(
        &self,
        num_tokens: usize,
        max_recv_rows: usize,
        flags: u32,
    ) -> OpArgs {
        let plan = &self.place.plan;
        OpArgs {
            off_comb_x: region(plan, RegionKind::CombineX),
            off_comb_w: region(plan, RegionKind::CombineWeights),
            off_x: region(plan, RegionKind::DispatchX),
            off_topk_w: region(plan, RegionKind::DispatchTopkWeights),
            num_tokens: num_tokens as i32,
            max_recv_rows: max_recv_rows as i32,
            flags,
            ..self.next_op_args()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use abi::flags::{CACHED, HAS_SCALES, HAS_TOPK, HAS_WEIGHTS, IN_PLACE};

    #[test]
    fn dispatch_flags_by_kind_weights_and_type() {
        use RowDtype::{Bf16, Fp8};
        for (cached, ids, weights, dtype, want) in [
            (false, true, false, Bf16, HAS_TOPK),
            (false, true, true, Bf16, HAS_TOPK | HAS_WEIGHTS),
            (false, true, true, Fp8, HAS_TOPK | HAS_WEIGHTS | HAS_SCALES),
            (false, true, false, Fp8, HAS_TOPK | HAS_SCALES),
            // Rows only (a layout given by ranks): no ids travel.
            (false, false, false, Bf16, 0),
            (false, false, false, Fp8, HAS_SCALES),
            // A cached dispatch never sends ids or weights, even when asked.
            (true, true, true, Bf16, CACHED),
            (true, false, false, Fp8, CACHED | HAS_SCALES),
        ] {
            assert_eq!(
                dispatch_flags(cached, ids, weights, dtype),
                want,
                "{cached} {ids} {weights} {dtype:?}"
            );
        }
    }

    #[test]
    fn combine_flags_by_mode_and_weights() {
        assert_eq!(combine_flags(false, false), 0);
        assert_eq!(combine_flags(false, true), HAS_WEIGHTS);
        assert_eq!(combine_flags(true, false), IN_PLACE);
        assert_eq!(combine_flags(true, true), IN_PLACE | HAS_WEIGHTS);
    }
}
