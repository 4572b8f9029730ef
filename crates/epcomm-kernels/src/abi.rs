//! Rust mirror of `kernels/include/epcomm/abi.cuh`: the argument blocks the kernels take by
//! value and the failure record they write. Layouts are checked twice: at compile time here
//! (`offset_of!`) and against the device's own `sizeof`/`offsetof` when a module loads.

use std::mem::{offset_of, size_of};

/// Largest world size the intranode kernels support (shared-memory tables are this large).
pub const MAX_WORLD: usize = 64;

/// Failure codes written by kernels into [`ErrorRecord::code`].
pub mod code {
    /// No failure.
    pub const OK: u32 = 0;
    /// A bounded wait expired.
    pub const TIMEOUT: u32 = 1;
    /// The receive count exceeds the capacity (buffer or `Bounded(n)`).
    pub const OVERFLOW: u32 = 2;
    /// A top-k id outside `[-1, num_experts)`.
    pub const INVALID_EXPERT: u32 = 3;
    /// A peer failed first: `peer` = origin rank, `expected` = its code, `seen` = its op
    /// sequence number (low 32 bits).
    pub const PEER_FAILED: u32 = 4;
}

/// Which operation a kernel was running ([`ErrorRecord::op`], stats kind).
pub mod op {
    /// The layout kernel.
    pub const LAYOUT: u32 = 1;
    /// Dispatch with count exchange.
    pub const DISPATCH: u32 = 2;
    /// Dispatch reusing a handle's routing.
    pub const CACHED_DISPATCH: u32 = 3;
    /// Combine.
    pub const COMBINE: u32 = 4;
}

/// Which wait expired ([`ErrorRecord::wait_id`]); labels refer to docs/protocol.md.
pub mod wait {
    /// Not a wait (overflow, invalid input).
    pub const NONE: u32 = 0;
    /// \[E2] a peer's count row for this epoch.
    pub const COUNT_ROW: u32 = 1;
    /// \[E2] a peer's per-expert counts for this epoch.
    pub const EXPERT_COUNTS: u32 = 2;
    /// \[E6] a peer's dispatch data landing.
    pub const DISPATCH_DONE: u32 = 3;
    /// \[C3] a peer's combine contributions landing.
    pub const COMBINE_DONE: u32 = 4;
    /// \[G*] a Global-strategy barrier.
    pub const BARRIER: u32 = 5;
    /// The op's prologue: a peer's failure was known before the op started.
    pub const OP_START: u32 = 6;
}

/// Byte offset, inside the stats region, of the in-place combine's `[world]` ready words.
pub const STATS_READY_OFFSET: u64 = 3072;
/// Byte offset, inside the stats region, of the abort word failing peers write.
pub const STATS_ABORT_OFFSET: u64 = 3584;

/// Version of the kernel protocol and argument blocks; ranks compare it when a `Buffer` is
/// built. Bump it with any change of `abi.cuh` or of the kernels' cross-rank protocol.
pub const ABI_VERSION: u64 = 3;

/// Bits of [`OpArgs::flags`].
pub mod flags {
    /// Cached dispatch: no count exchange; offsets come from the handle.
    pub const CACHED: u32 = 1 << 0;
    /// FP8 dispatch: scales travel with x.
    pub const HAS_SCALES: u32 = 1 << 1;
    /// Top-k weights travel (dispatch) or are reduced (combine).
    pub const HAS_WEIGHTS: u32 = 1 << 2;
    /// Top-k ids travel (dispatch).
    pub const HAS_TOPK: u32 = 1 << 3;
    /// Combine pulls y from every rank's latest dispatch receive region.
    pub const IN_PLACE: u32 = 1 << 4;
}

/// Failure record written by the first failing device thread into host-mapped memory.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct ErrorRecord {
    /// One of [`code`].
    pub code: u32,
    /// One of [`op`].
    pub op: u32,
    /// One of [`wait`].
    pub wait_id: u32,
    /// The peer waited for (timeout), destination (overflow) or token index (invalid input).
    pub peer: i32,
    /// Block that failed.
    pub block: u32,
    /// Rank that failed.
    pub rank: u32,
    /// Op sequence number.
    pub epoch: u64,
    /// Value waited for / capacity / number of experts.
    pub expected: u64,
    /// Value last seen / requested / offending id.
    pub seen: u64,
    /// Time spent waiting.
    pub waited_ns: u64,
}

/// Arguments of `epcomm_dispatch` and `epcomm_combine` (see abi.cuh for every field).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
#[allow(missing_docs)]
pub struct OpArgs {
    pub x: u64,
    pub x_scales: u64,
    pub topk_idx: u64,
    pub topk_weights: u64,
    pub out: u64,
    pub out_weights: u64,
    pub token_slot: u64,
    pub layout_counts: u64,
    pub layout_status: u64,
    pub send_offsets: u64,
    pub recv_prefix: u64,
    pub recv_src_idx: u64,
    pub recv_expert_counts: u64,
    pub peer_bases: u64,
    pub off_x: u64,
    pub off_scales: u64,
    pub off_topk_idx: u64,
    pub off_topk_w: u64,
    pub off_src_idx: u64,
    pub off_comb_x: u64,
    pub off_comb_w: u64,
    pub off_comb_flags: u64,
    pub off_counts: u64,
    pub off_expert_counts: u64,
    pub off_done: u64,
    pub off_barrier: u64,
    pub off_stats: u64,
    pub err_claim: u64,
    pub err_record: u64,
    pub host_counts: u64,
    pub timeout_ns: u64,
    pub seq_state: u64,
    pub parity_stride: u64,
    pub remote_mask: u64,
    /// This rank's abort word (stats region + [`STATS_ABORT_OFFSET`]): peers that failed write
    /// it; every op's prologue and every wait read it.
    pub abort_word: u64,
    pub num_tokens: i32,
    pub hidden: i32,
    pub row_bytes: i32,
    pub num_scales: i32,
    pub top_k: i32,
    pub num_experts: i32,
    pub world: i32,
    pub rank: i32,
    pub max_tokens: i32,
    pub max_recv_rows: i32,
    pub flags: u32,
    pub global_barriers: u32,
}

/// Op sequence numbers kept on the device (see abi.cuh); identical on every rank.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct SeqState {
    /// Ops so far.
    pub op: u64,
    /// Count exchanges so far.
    pub notify: u64,
    /// Dispatches so far (cached included).
    pub dispatch: u64,
    /// Combines so far.
    pub combine: u64,
    /// Value of every done counter after the last op.
    pub done: u64,
    /// Value of every barrier counter after the last op.
    pub barriers: u64,
    /// Blocks of the running op that finished (0 between ops).
    pub exits: u32,
    /// Padding.
    pub pad: u32,
}

/// Arguments of `epcomm_layout`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
#[allow(missing_docs)]
pub struct LayoutArgs {
    pub topk_idx: u64,
    pub counts: u64,
    pub token_slot: u64,
    pub status: u64,
    pub err_record: u64,
    pub err_claim: u64,
    pub num_tokens: i32,
    pub top_k: i32,
    pub num_experts: i32,
    pub world: i32,
    pub gpus_per_node: i32,
    pub rank: i32,
}

// SAFETY: plain-old-data `repr(C)` structs of integers, passed by value as kernel parameters;
// their layout is checked against the device's below and at module load.
unsafe impl cudarc::driver::DeviceRepr for OpArgs {}
// SAFETY: as above.
unsafe impl cudarc::driver::DeviceRepr for LayoutArgs {}

/// The layout facts the device reports from `epcomm_abi_probe`, in its output order.
pub(crate) const EXPECTED_PROBE: [(&str, u64); 8] = [
    ("sizeof(OpArgs)", size_of::<OpArgs>() as u64),
    (
        "offsetof(OpArgs, num_tokens)",
        offset_of!(OpArgs, num_tokens) as u64,
    ),
    (
        "offsetof(OpArgs, global_barriers)",
        offset_of!(OpArgs, global_barriers) as u64,
    ),
    ("sizeof(LayoutArgs)", size_of::<LayoutArgs>() as u64),
    (
        "offsetof(LayoutArgs, num_tokens)",
        offset_of!(LayoutArgs, num_tokens) as u64,
    ),
    ("sizeof(ErrorRecord)", size_of::<ErrorRecord>() as u64),
    (
        "offsetof(ErrorRecord, epoch)",
        offset_of!(ErrorRecord, epoch) as u64,
    ),
    ("sizeof(SeqState)", size_of::<SeqState>() as u64),
];

const _: () = {
    assert!(size_of::<OpArgs>() == 35 * 8 + 12 * 4);
    assert!(size_of::<SeqState>() == 56);
    assert!(size_of::<LayoutArgs>() == 6 * 8 + 6 * 4);
    assert!(size_of::<ErrorRecord>() == 56);
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_match_the_cuda_header() {
        assert_eq!(offset_of!(OpArgs, num_tokens), 280);
        assert_eq!(offset_of!(OpArgs, global_barriers), 324);
        assert_eq!(offset_of!(LayoutArgs, num_tokens), 48);
        assert_eq!(offset_of!(ErrorRecord, epoch), 24);
    }

    #[test]
    fn header_declares_the_same_fields() {
        // Every Rust field name must appear in abi.cuh, in the same order.
        let header = include_str!("../../../kernels/include/epcomm/abi.cuh");
        let op_args = &header[header.find("struct OpArgs").expect("OpArgs in header")..];
        let mut pos = 0;
        for name in [
            "x;",
            "x_scales",
            "topk_idx",
            "topk_weights",
            "out;",
            "out_weights",
            "token_slot",
            "layout_counts",
            "layout_status",
            "send_offsets",
            "recv_prefix",
            "recv_src_idx",
            "recv_expert_counts",
            "peer_bases",
            "off_x",
            "off_comb_x",
            "off_comb_flags",
            "off_counts",
            "off_expert_counts",
            "off_done",
            "off_barrier",
            "off_stats",
            "err_claim",
            "err_record",
            "host_counts",
            "timeout_ns",
            "seq_state",
            "parity_stride",
            "remote_mask",
            "abort_word",
            "num_tokens",
            "hidden",
            "row_bytes",
            "num_scales",
            "top_k",
            "num_experts",
            "world",
            "rank",
            "max_tokens",
            "max_recv_rows",
            "flags",
            "global_barriers",
        ] {
            let found = op_args[pos..]
                .find(name)
                .unwrap_or_else(|| panic!("{name} out of order"));
            pos += found + name.len();
        }
    }
}
