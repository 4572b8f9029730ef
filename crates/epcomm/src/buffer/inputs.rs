//! The inputs and outputs an op is given (rows to send, expert outputs to reduce, where the
//! reduction goes): caller memory borrowed for the call, checked by `validate` before any
//! launch.

use cudarc::driver::{DevicePtr, DevicePtrMut};
use epcomm_topology::RowDtype;

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

/// Inputs of a combine: the expert outputs, one `[hidden]` bf16 row of `y` per row this rank
/// received (in the dispatch's order), optionally one `[top_k]` f32 row of `y_weights` per
/// received row, summed the same way, and whether the caller still reads the dispatch's outputs.
#[derive(Clone, Copy)]
pub struct CombineInput<'a> {
    /// `[rows][hidden]` bf16 expert outputs.
    pub y: &'a dyn DevicePtr<half::bf16>,
    /// `[rows][top_k]` f32 weights to sum with them.
    pub y_weights: Option<&'a dyn DevicePtr<f32>>,
    /// The caller no longer reads the dispatch's outputs (`recv_x`, its scales,
    /// `recv_topk_weights`): the combine may stage `y` over them ([`crate::Buffer::combine`]).
    pub consume_recv: bool,
}

impl<'a> CombineInput<'a> {
    /// Rows without weights; the dispatch's outputs are kept.
    pub fn new(y: &'a dyn DevicePtr<half::bf16>) -> Self {
        Self {
            y,
            y_weights: None,
            consume_recv: false,
        }
    }

    /// The same input for a caller that no longer reads the dispatch's outputs
    /// ([`Self::consume_recv`]).
    pub fn consuming(self) -> Self {
        Self {
            consume_recv: true,
            ..self
        }
    }

    /// The same rows with weights.
    pub fn with_weights(self, y_weights: &'a dyn DevicePtr<f32>) -> Self {
        Self {
            y_weights: Some(y_weights),
            ..self
        }
    }
}

impl std::fmt::Debug for CombineInput<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CombineInput")
            .field("y", &self.y.len())
            .field("y_weights", &self.y_weights.map(|w| w.len()))
            .field("consume_recv", &self.consume_recv)
            .finish()
    }
}

/// Where a combine writes: `out` gets `[T][hidden]` bf16 (`T` = the handle's token count) and
/// `out_weights`, when given, `[T][top_k]` f32. The combine borrows them for its call; they are
/// ready for work queued after it on the buffer's stream.
pub struct CombineOutput<'a> {
    /// `[T][hidden]` bf16.
    pub out: &'a mut dyn DevicePtrMut<half::bf16>,
    /// `[T][top_k]` f32 (requires `y_weights`).
    pub out_weights: Option<&'a mut dyn DevicePtrMut<f32>>,
}

impl<'a> CombineOutput<'a> {
    /// Rows without weights.
    pub fn new(out: &'a mut dyn DevicePtrMut<half::bf16>) -> Self {
        Self {
            out,
            out_weights: None,
        }
    }

    /// The same rows with weights.
    pub fn with_weights(self, out_weights: &'a mut dyn DevicePtrMut<f32>) -> Self {
        Self {
            out_weights: Some(out_weights),
            ..self
        }
    }
}

impl std::fmt::Debug for CombineOutput<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CombineOutput")
            .field("out", &self.out.len())
            .field("out_weights", &self.out_weights.as_ref().map(|w| w.len()))
            .finish()
    }
}
