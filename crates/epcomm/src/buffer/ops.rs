//! Op families and the inputs they share.
//!
//! * `layout`: routing statistics of `topk_idx` ([`crate::Layout`]);
//! * `normal`: dispatch, cached dispatch and combine through the symmetric buffer (the
//!   throughput kernels);
//! * `low_latency`: decode-sized dispatch/combine into fixed expert-major slots, each split
//!   into a send and a receive phase;
//! * `masking`: the low-latency ops' rank mask (read, set, cleared in stream order);
//! * `copy_out`: the rows a dispatch received, copied into caller memory as many as the device
//!   counted.
//!
//! Contract common to every op: it is **collective** (every rank issues the same ops in the same
//! order, each with the same number of blocks), **stream-ordered** on [`crate::Buffer::stream`]
//! (inputs must be ready on that stream, outputs are ready for work queued after it), checks
//! the buffer's health and every argument before it launches anything (a refused op changes no
//! state), and advances the host sequence mirror only once its kernel is launched.

use cudarc::driver::DevicePtr;
use epcomm_topology::RowDtype;

mod copy_out;
mod layout;
mod low_latency;
mod masking;
mod normal;
mod staging;

pub use copy_out::{CountedRows, RecvArray};
pub(super) use low_latency::LowLatencyState;
pub use low_latency::{LlDispatchInput, LlFormat, LlPending, LlRecv, LlScalesLayout};
pub(super) use normal::LatestDispatch;

/// Token rows a dispatch sends.
#[derive(Clone, Copy)]
pub enum XInput<'a> {
    /// `[T][hidden]` bf16.
    Bf16(&'a dyn DevicePtr<half::bf16>),
    /// `[T][hidden]` e4m3 bytes and `[T][hidden / 128]` f32 scales.
    Fp8 {
        /// e4m3 values.
        x: &'a dyn DevicePtr<u8>,
        /// One scale per 128 channels.
        scales: &'a dyn DevicePtr<f32>,
    },
}

impl XInput<'_> {
    /// The element type of the rows.
    pub(super) fn dtype(&self) -> RowDtype {
        match self {
            Self::Bf16(_) => RowDtype::Bf16,
            Self::Fp8 { .. } => RowDtype::Fp8,
        }
    }

    /// Elements of `x` (bf16 values or e4m3 bytes).
    pub(super) fn len(&self) -> usize {
        match self {
            Self::Bf16(x) => x.len(),
            Self::Fp8 { x, .. } => x.len(),
        }
    }
}

impl std::fmt::Debug for XInput<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Bf16(x) => write!(f, "Bf16({} elements)", x.len()),
            Self::Fp8 { x, scales } => write!(f, "Fp8({} bytes, {} scales)", x.len(), scales.len()),
        }
    }
}

/// Inputs of a dispatch.
#[derive(Clone, Copy)]
pub struct DispatchInput<'a> {
    /// Token rows.
    pub x: XInput<'a>,
    /// `[T][top_k]` expert ids (-1 = none); the same array the layout was computed from.
    pub topk_idx: &'a dyn DevicePtr<i64>,
    /// `[T][top_k]` weights, forwarded with the rows.
    pub topk_weights: Option<&'a dyn DevicePtr<f32>>,
}

impl std::fmt::Debug for DispatchInput<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DispatchInput")
            .field("x", &self.x)
            .field("topk_idx", &self.topk_idx.len())
            .field("topk_weights", &self.topk_weights.map(|w| w.len()))
            .finish()
    }
}
