//! The low-latency (decode) op family: dispatch into fixed expert-major slots and the weighted
//! combine back, with no count round trip and no host read, each op split into a send phase and
//! a receive phase ([`LlPending`], the "hook").
//!
//! Memory contract: a dispatch's send phase writes this rank's tokens into every destination's
//! low-latency receive region (LL parity), its receive phase packs what arrived into the
//! caller's [`LlRecv`] (device memory the buffer allocated, reused across calls and graph
//! replays). A combine's send phase reads `y` and the `LlRecv` routing and writes into every
//! source's combine region; its receive phase reads `topk_idx`/`topk_weights` and writes `out`.
//! Between the two phases of an op the caller may queue any work of its own on any stream, but
//! no other epcomm op on this buffer; every caller array an op names must stay alive until its
//! receive phase ran (the [`LlPending`] borrows them).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use epcomm_kernels::Op;
use epcomm_kernels::abi::OpArgs;
use epcomm_topology::{RowDtype, RowFormat};

use crate::Result;
#[cfg(doc)]
use crate::buffer::Buffer;
use crate::error::DriverContext;

/// Element type of a low-latency dispatch's received rows. The input is always bf16; FP8
/// casts it on the device (e4m3, one f32 scale per 128 channels, DeepEP's cast).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LlFormat {
    /// Rows arrive as sent.
    Bf16,
    /// Rows arrive as e4m3 with per-128-channel scales.
    Fp8 {
        /// Scales rounded up to powers of two (UE8M0-representable), as for Blackwell-style
        /// scaled GEMMs; the values are cast with the rounded scale.
        round_scale: bool,
    },
}

impl LlFormat {
    fn dtype(self) -> RowDtype {
        match self {
            Self::Bf16 => RowDtype::Bf16,
            Self::Fp8 { .. } => RowDtype::Fp8,
        }
    }
}

/// How an [`LlRecv`] stores the FP8 scales of each local expert's rows
/// (`cap = world * ll_max_tokens_per_rank` rows per local expert, `S = hidden / 128`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LlScalesLayout {
    /// `[local_expert][cap][S]`: a row's scales together.
    #[default]
    RowMajor,
    /// `[local_expert][S][cap]`: each local expert's `[cap][S]` matrix column-major (DeepEP's
    /// layout, which scaled-GEMM kernels read), written so by the dispatch itself.
    ColumnMajor,
}

impl LlScalesLayout {
    /// Index of scale `s` of row `i` of local expert `l` in an array of this layout.
    pub fn index(self, l: usize, i: usize, s: usize, cap: usize, num_scales: usize) -> usize {
        match self {
            Self::RowMajor => (l * cap + i) * num_scales + s,
            Self::ColumnMajor => (l * num_scales + s) * cap + i,
        }
    }
}

/// Inputs of a low-latency dispatch.
pub struct LlDispatchInput<'a> {
    /// `[num_tokens][hidden]` bf16 rows.
    pub x: &'a dyn DevicePtr<half::bf16>,
    /// `[num_tokens][top_k]` expert ids (-1 = none; a token names each expert at most once).
    pub topk_idx: &'a dyn DevicePtr<i64>,
    /// Tokens of this rank (at most `BufferConfig::ll_max_tokens_per_rank`; 0 is allowed).
    pub num_tokens: usize,
    /// `[num_local_experts]` i32 the receive phase adds this dispatch's rows per local expert
    /// to (DeepEP's `cumulative_local_expert_recv_stats`; a masked source adds nothing); `None`:
    /// no such array. The kernel adds in stream order: nothing else may write it meanwhile.
    pub cumulative_stats: Option<&'a mut (dyn DevicePtrMut<i32> + 'static)>,
}

impl std::fmt::Debug for LlDispatchInput<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlDispatchInput")
            .field("x", &self.x.len())
            .field("topk_idx", &self.topk_idx.len())
            .field("num_tokens", &self.num_tokens)
            .field(
                "cumulative_stats",
                &self.cumulative_stats.as_ref().map(|s| s.len()),
            )
            .finish()
    }
}

/// What a low-latency dispatch received, expert-major, and the routing its combine uses.
/// Allocated once by [`Buffer::alloc_ll_recv`] (sized for the buffer's capacity) and filled by
/// every [`Buffer::ll_dispatch`] into it.
///
/// Layout (`cap = world * ll_max_tokens_per_rank` rows per local expert): rows
/// `[local_expert][cap][row_bytes]` (bf16, or e4m3 bytes), scales `[local_expert][cap][hidden
/// / 128]` f32 (FP8), and per local expert `l` the first `count[l]` rows are valid, ordered by
/// source rank, then source token index. `src_info[l][i]` is the source token index of row `i`,
/// `layout_range[l][r]` = `(first row, rows)` received from rank `r`.
///
/// A CUDA graph that captured an op with it shares its arrays ([`Buffer::capture`]): dropping
/// the `LlRecv` after the capture leaves them allocated for the graph's replays.
#[derive(Debug)]
pub struct LlRecv {
    arrays: Arc<LlArrays>,
    buffer_id: u64,
    experts: usize,
    capacity: usize,
    /// The format of the received rows of the latest dispatch into it (the buffer's BF16 rows
    /// before the first).
    row: RowFormat,
    /// Format and this rank's token count of the latest dispatch into it.
    dispatched: Option<(LlFormat, usize)>,
    /// How the next FP8 dispatches into it store their scales.
    scales_layout: LlScalesLayout,
}

/// The device arrays of an [`LlRecv`], shared with the graphs that recorded an op on them.
/// Allocated, written and read on the buffer's stream only (a graph replays there too), and
/// reached by callers only through raw addresses or stream-ordered copies, so the kernels name
/// them by the addresses taken once at allocation ([`LlAddrs`]): an op adds no per-array
/// stream waits or event records (cudarc's event tracking), which would otherwise lie on the
/// GPU's path between two ops.
#[derive(Debug)]
struct LlArrays {
    addrs: LlAddrs,
    x: CudaSlice<u8>,
    scales: CudaSlice<f32>,
    count: CudaSlice<i32>,
    src_info: CudaSlice<i32>,
    layout_range: CudaSlice<i64>,
    route: CudaSlice<i32>,
    /// `[ll_max_tokens_per_rank][top_k]`: the packed row of each of this rank's own entries
    /// whose expert is local (a one-kernel combine reduces those straight from `y`).
    self_row: CudaSlice<i32>,
}

/// Device addresses of an [`LlArrays`]' arrays (valid while it lives).
#[derive(Clone, Copy, Debug, Default)]
struct LlAddrs {
    x: u64,
    scales: u64,
    count: u64,
    src_info: u64,
    layout_range: u64,
    route: u64,
    self_row: u64,
}

impl LlAddrs {
    /// The arrays' addresses, each read once through its guard on `stream`, the stream that
    /// allocated them and that every op on them uses.
    fn of(a: &LlArrays, stream: &CudaStream) -> Self {
        Self {
            x: a.x.device_ptr(stream).0,
            scales: a.scales.device_ptr(stream).0,
            count: a.count.device_ptr(stream).0,
            src_info: a.src_info.device_ptr(stream).0,
            layout_range: a.layout_range.device_ptr(stream).0,
            route: a.route.device_ptr(stream).0,
            self_row: a.self_row.device_ptr(stream).0,
        }
    }

    /// `args` with the routing the dispatch writes and the combine reads: the per-expert
    /// counts, source info, layout ranges, routes and own-entry rows.
    fn with_routing(&self, args: OpArgs) -> OpArgs {
        OpArgs {
            ll_recv_count: self.count,
            ll_src_info: self.src_info,
            ll_layout_range: self.layout_range,
            ll_route: self.route,
            ll_self_row: self.self_row,
            ..args
        }
    }
}

impl LlRecv {
    /// Local experts (`num_experts / world`).
    pub fn num_local_experts(&self) -> usize {
        self.experts
    }
    /// Rows per local expert (`world * ll_max_tokens_per_rank`).
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// Format of the latest dispatch into it (None before the first).
    pub fn format(&self) -> Option<LlFormat> {
        self.dispatched.map(|(f, _)| f)
    }
    /// This rank's token count in the latest dispatch (what its combine reduces).
    pub fn num_tokens(&self) -> Option<usize> {
        self.dispatched.map(|(_, t)| t)
    }
    /// Bytes per received row of the latest dispatch (`hidden * 2` bf16, `hidden` fp8: its
    /// [`RowFormat::x_bytes`]; bf16 before the first dispatch).
    pub fn row_bytes(&self) -> usize {
        self.row.x_bytes()
    }
    /// Device address of the rows (`[local_expert][capacity][row_bytes]`).
    pub fn x_ptr(&self) -> u64 {
        self.arrays.addrs.x
    }
    /// How FP8 dispatches into it store their scales from now on (default
    /// [`LlScalesLayout::RowMajor`]). A CUDA graph replays the layout it captured.
    pub fn set_scales_layout(&mut self, layout: LlScalesLayout) {
        self.scales_layout = layout;
    }
    /// The scales layout of the next FP8 dispatch into it ([`Self::set_scales_layout`]).
    pub fn scales_layout(&self) -> LlScalesLayout {
        self.scales_layout
    }
    /// Device address of the scales (`hidden / 128` f32 per row, in [`Self::scales_layout`]).
    pub fn scales_ptr(&self) -> u64 {
        self.arrays.addrs.scales
    }
    /// Device address of the per-expert counts (`[local_expert]` i32).
    pub fn count_ptr(&self) -> u64 {
        self.arrays.addrs.count
    }
    /// Device address of the source token index per row (`[local_expert][capacity]` i32).
    pub fn src_info_ptr(&self) -> u64 {
        self.arrays.addrs.src_info
    }
    /// Device address of the `(first row << 32) | rows` ranges (`[local_expert][world]` i64).
    pub fn layout_range_ptr(&self) -> u64 {
        self.arrays.addrs.layout_range
    }
    /// Rows received per local expert (waits for the stream).
    pub fn count_to_host(&self) -> Result<Vec<i32>> {
        self.arrays
            .count
            .stream()
            .clone_dtoh(&self.arrays.count)
            .context("reading low-latency counts")
    }
    /// All row bytes (`[local_expert][capacity][row_bytes]`; rows past a count are stale).
    pub fn x_bytes_to_host(&self) -> Result<Vec<u8>> {
        let a = &self.arrays;
        let mut v =
            a.x.stream()
                .clone_dtoh(&a.x)
                .context("reading low-latency rows")?;
        v.truncate(self.experts * self.capacity * self.row_bytes());
        Ok(v)
    }
    /// All scales (`hidden / 128` per row, in [`Self::scales_layout`] as it was when the
    /// latest dispatch ran, see [`LlScalesLayout::index`]; FP8 only).
    pub fn scales_to_host(&self) -> Result<Vec<f32>> {
        self.arrays
            .scales
            .stream()
            .clone_dtoh(&self.arrays.scales)
            .context("reading low-latency scales")
    }
    /// Source token index per row (`[local_expert][capacity]`).
    pub fn src_info_to_host(&self) -> Result<Vec<i32>> {
        self.arrays
            .src_info
            .stream()
            .clone_dtoh(&self.arrays.src_info)
            .context("reading low-latency source indices")
    }
    /// `(first row, rows)` per local expert and source rank (`[local_expert][world]`).
    pub fn layout_range_to_host(&self) -> Result<Vec<(i32, i32)>> {
        let a = &self.arrays;
        let v = a
            .layout_range
            .stream()
            .clone_dtoh(&a.layout_range)
            .context("reading low-latency ranges")?;
        Ok(v.into_iter()
            .map(|r| ((r >> 32) as i32, r as i32))
            .collect())
    }
}

/// The receive phase of a low-latency op whose send phase was issued: pass it to
/// [`Buffer::ll_receive`] (the "hook") after your overlapping work. It borrows every caller
/// array of the op, so none can be freed or reused before the receive phase is issued.
#[must_use = "the receive phase runs only when the LlPending goes to Buffer::ll_receive"]
pub struct LlPending<'a> {
    op: Op,
    kind: u32,
    args: OpArgs,
    buffer_id: u64,
    /// The send phase's op number: [`Buffer::ll_receive`] takes only the latest send's.
    op_seq: u64,
    /// Set when this value is dropped without going to [`Buffer::ll_receive`]: the buffer
    /// then refuses further ops as failed (its peers wait for a receive that never comes).
    abandoned: Arc<AtomicBool>,
    /// False once the receive phase was issued (or the value was detached into another).
    armed: bool,
    /// A split combine's arrays its receive phase reads and writes: their stream events are
    /// taken again around the receive kernel, so other streams are ordered after it.
    combine: Option<CombineArrays<'a>>,
    /// A split dispatch's cumulative stats, which its receive phase adds to: their stream
    /// event is taken again around the receive kernel.
    stats: Option<&'a mut (dyn DevicePtrMut<i32> + 'static)>,
}

/// The caller arrays a combine's receive phase touches.
struct CombineArrays<'a> {
    topk_idx: &'a dyn DevicePtr<i64>,
    topk_weights: &'a dyn DevicePtr<f32>,
    out: &'a mut dyn DevicePtrMut<half::bf16>,
}

/// A buffer's low-latency state.
#[derive(Debug)]
pub(in crate::buffer) struct LowLatencyState {
    /// The low-latency op whose receive phase has not been launched yet.
    pub(in crate::buffer) pending: Option<PendingReceive>,
    /// u32 words of dynamic shared memory of the low-latency kernels.
    pub(in crate::buffer) smem_words: usize,
    /// Blocks of every low-latency kernel (`ll_num_sms`, or every SM this rank may use).
    pub(in crate::buffer) blocks: u32,
}

/// The low-latency op whose receive phase is outstanding on a [`Buffer`].
#[derive(Debug)]
pub(in crate::buffer) struct PendingReceive {
    /// "dispatch" or "combine".
    pub(in crate::buffer) op: &'static str,
    /// The send phase's op number.
    pub(in crate::buffer) op_seq: u64,
    /// Set by a dropped [`LlPending`].
    pub(in crate::buffer) abandoned: Arc<AtomicBool>,
}

impl LlPending<'_> {
    /// The same pending receive, no longer tied to the borrows of the op's arrays: for callers
    /// across a language boundary that keep the arrays alive themselves (a Python binding
    /// holding the tensors until its hook runs).
    ///
    /// # Safety
    /// Every array the op named (its inputs, `y`, `out`, a dispatch's cumulative stats, the
    /// [`LlRecv`]) must stay allocated, unmoved and untouched by other work until the receive
    /// phase this pending value issues ([`Buffer::ll_receive`]) has finished on the stream;
    /// work on other streams that reads `out` or the stats (or writes `topk_idx`,
    /// `topk_weights`) must be ordered after it by the caller (no cudarc events are recorded
    /// for them).
    pub unsafe fn detach(mut self) -> LlPending<'static> {
        self.armed = false;
        LlPending {
            op: self.op,
            kind: self.kind,
            args: self.args,
            buffer_id: self.buffer_id,
            op_seq: self.op_seq,
            abandoned: self.abandoned.clone(),
            armed: true,
            combine: None,
            stats: None,
        }
    }
}

impl Drop for LlPending<'_> {
    /// Dropped without [`Buffer::ll_receive`]: tells the buffer, which then fails instead of
    /// waiting for a receive that can no longer be issued.
    fn drop(&mut self) {
        if self.armed {
            self.abandoned.store(true, Ordering::Relaxed);
        }
    }
}

impl std::fmt::Debug for LlPending<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlPending").field("op", &self.op).finish()
    }
}

mod ops;

#[cfg(test)]
mod tests {
    use super::*;

    use crate::BufferConfig;

    /// The byte sizes above come from `RowFormat` (the buffer plan's BF16 row, or the
    /// dispatch's format); each equals the `hidden * 2` / `hidden` byte math it replaced.
    #[test]
    fn row_format_sizes_equal_the_old_byte_math() {
        let fp8 = LlFormat::Fp8 { round_scale: false };
        for hidden in (8..=16384).step_by(8).chain([18432, 65536]) {
            // What `self.place.plan.row()` is: the plan `Buffer::new` allocates.
            let bf16 = crate::rules::plan(&BufferConfig::new(1, hidden, 1, 1), 1)
                .unwrap()
                .row();
            assert_eq!((bf16.hidden(), bf16.dtype()), (hidden, RowDtype::Bf16));
            // LlRecv::row_bytes: BF16 before a dispatch and after a BF16 one, FP8 after an FP8
            // one (which only FP8-capable hidden sizes admit).
            assert_eq!(bf16.x_bytes(), hidden * 2, "{hidden}");
            let bf16_dispatch = RowFormat::new(hidden, LlFormat::Bf16.dtype()).unwrap();
            assert_eq!(bf16_dispatch.x_bytes(), hidden * 2, "{hidden}");
            match RowFormat::new(hidden, fp8.dtype()) {
                Ok(row) => assert_eq!(row.x_bytes(), hidden, "{hidden}"),
                Err(_) => assert!(!hidden.is_multiple_of(128), "{hidden}"),
            }
            // The receive arrays' rows, the caller's `x`, `y` and `out`.
            for n in [0usize, 1, 7, 128, 4096, 3 * 8 * 1024] {
                assert_eq!(n * bf16.pitch(), n * hidden * 2, "{hidden} x {n}");
                assert_eq!(n * bf16.x_bytes(), n * hidden * 2, "{hidden} x {n}");
                assert_eq!(n * bf16.value_bytes(), n * 2, "{hidden} x {n}");
            }
        }
    }
}
