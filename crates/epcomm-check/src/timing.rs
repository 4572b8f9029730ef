//! CUDA-event timing of epcomm ops with an L2 flush between calls, and DeepEP's metric.
//!
//! DeepEP's metric: bytes received per rank (the rows a rank sends to itself included) divided
//! by the op's time. BF16 dispatch and combine count `rows * hidden * 2`; FP8 dispatch counts
//! `rows * hidden * (1 + 4/128)` (one byte per value plus one f32 scale per 128 values).

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, sys};
use epcomm::{Buffer, DispatchInput, Handle, Layout, RecvMode, XInput};
use epcomm_reference::bf16;

use crate::Result;
use crate::inputs::{DeviceInputs, upload};

/// Bytes written to flush the 50 MB L2 of an H100/H200 (DeepEP flushes with 256 MB).
pub const FLUSH_BYTES: usize = 256 << 20;

/// An op to time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BenchOp {
    /// BF16 dispatch (count exchange included).
    DispatchBf16,
    /// FP8 dispatch.
    DispatchFp8,
    /// Cached BF16 dispatch.
    CachedDispatchBf16,
    /// BF16 combine.
    Combine,
    /// BF16 combine pulling y from the peers' receive regions (after a BF16 dispatch).
    CombineInPlace,
}

impl BenchOp {
    /// Every op, in report order.
    pub const ALL: [BenchOp; 5] = [
        Self::DispatchFp8,
        Self::DispatchBf16,
        Self::CachedDispatchBf16,
        Self::Combine,
        Self::CombineInPlace,
    ];

    /// Display name.
    pub fn name(self) -> &'static str {
        match self {
            Self::DispatchBf16 => "dispatch BF16",
            Self::DispatchFp8 => "dispatch FP8",
            Self::CachedDispatchBf16 => "cached dispatch BF16",
            Self::Combine => "combine BF16",
            Self::CombineInPlace => "combine BF16 in place",
        }
    }

    /// Bytes by DeepEP's metric for `rows` received rows of `hidden` values.
    pub fn metric_bytes(self, rows: usize, hidden: usize) -> f64 {
        let bf16 = (rows * hidden * 2) as f64;
        match self {
            Self::DispatchFp8 => bf16 * (1.0 + 4.0 / 128.0) / 2.0,
            _ => bf16,
        }
    }
}

/// Timing state of one rank: inputs, a layout and handle for combine, the flush buffer.
#[derive(Debug)]
pub struct Timer {
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    flush: CudaSlice<u8>,
    layout: Layout,
    handle: Handle,
    y: CudaSlice<bf16>,
    out: CudaSlice<bf16>,
    /// Rows this rank receives.
    pub num_recv: usize,
}

impl Timer {
    /// Prepares timing of `dev` on `buf` (runs one HostSync dispatch to size combine's input).
    pub fn new(buf: &mut Buffer, dev: &DeviceInputs) -> Result<Self> {
        let stream = buf.stream().clone();
        let ctx = buf.context().clone();
        let flush = stream.alloc_zeros::<u8>(FLUSH_BYTES)?;
        let layout = buf.layout(&dev.topk_idx, dev.num_tokens)?;
        let input = dev.dispatch_input(false, true);
        let handle = buf
            .dispatch(&input, &layout, RecvMode::HostSync)?
            .into_handle();
        let num_recv = handle.num_recv().unwrap_or(0);
        let hidden = buf.config().hidden;
        let y = upload(
            &stream,
            &vec![bf16::from_f32(0.5); num_recv.max(1) * hidden],
        )?;
        let out = upload(&stream, &vec![bf16::ZERO; dev.num_tokens.max(1) * hidden])?;
        let out = if dev.num_tokens == 0 {
            stream.null()?
        } else {
            out
        };
        buf.synchronize()?;
        Ok(Self {
            stream,
            ctx,
            flush,
            layout,
            handle,
            y,
            out,
            num_recv,
        })
    }

    /// Runs `op` `iters` times (each call after an L2 flush) and returns each call's time in
    /// microseconds (CUDA events around the op only). Collective.
    pub fn time(
        &mut self,
        buf: &mut Buffer,
        dev: &DeviceInputs,
        op: BenchOp,
        iters: usize,
    ) -> Result<Vec<f64>> {
        if op == BenchOp::CombineInPlace {
            // In-place combine reads the latest dispatch's rows: make this handle's the latest.
            buf.cached_dispatch(&XInput::Bf16(&dev.x), &self.handle)?;
        }
        let mut events = Vec::with_capacity(iters);
        for _ in 0..iters {
            self.stream.memset_zeros(&mut self.flush)?;
            let start = self
                .ctx
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
            let end = self
                .ctx
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
            start.record(&self.stream)?;
            self.run(buf, dev, op)?;
            end.record(&self.stream)?;
            events.push((start, end));
        }
        buf.synchronize()?;
        events
            .iter()
            .map(|(s, e)| Ok(f64::from(s.elapsed_ms(e)?) * 1e3))
            .collect()
    }

    fn run(&mut self, buf: &mut Buffer, dev: &DeviceInputs, op: BenchOp) -> Result<()> {
        match op {
            BenchOp::DispatchBf16 | BenchOp::DispatchFp8 => {
                let input = DispatchInput {
                    x: dev.x_input(op == BenchOp::DispatchFp8),
                    topk_idx: &dev.topk_idx,
                    topk_weights: Some(&dev.topk_weights),
                };
                buf.dispatch(&input, &self.layout, RecvMode::WorstCase)?;
            }
            BenchOp::CachedDispatchBf16 => {
                buf.cached_dispatch(&XInput::Bf16(&dev.x), &self.handle)?;
            }
            BenchOp::Combine => buf.combine(&self.y, None, &self.handle, &mut self.out, None)?,
            BenchOp::CombineInPlace => buf.combine_in_place(&self.handle, &mut self.out, None)?,
        }
        Ok(())
    }
}

/// Median of `v` (NaN when empty).
pub fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_matches_deepep() {
        // FP8 counts one byte per value plus a 4-byte scale per 128 values.
        assert_eq!(BenchOp::DispatchBf16.metric_bytes(10, 128), 2560.0);
        assert_eq!(BenchOp::DispatchFp8.metric_bytes(10, 128), 1280.0 + 40.0);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
