//! Counted copy-out: the rows a dispatch received, copied from a receive region into caller
//! memory, as many as the device says arrived.
//!
//! A dispatch whose host does not wait for the receive count (WorstCase, Bounded, or any
//! dispatch inside a CUDA graph) only knows a bound on its rows. Copying the outputs out of the
//! symmetric buffer up to that bound moves the whole capacity on every call; this copy reads the
//! count (and, for a graph replayed at either parity, the parity) on the device and moves only
//! what arrived.
//!
//! Memory contract: the copy is one kernel on the buffer's stream, so it starts after the
//! dispatch that filled the rows and the work that wrote the count and parity words, and work
//! queued after it sees `dst` written. It reads `min(count, max_rows)` rows of the region and
//! writes as many rows of `dst`; rows of `dst` past the count are left as they were.

use std::mem::offset_of;

use epcomm_kernels::abi;
use epcomm_topology::{Parity, RegionKind, RowDtype, RowFormat};

use crate::buffer::Buffer;
use crate::buffer::pointers::check_device_ptr;
use crate::{Error, Handle, Result};

/// One array of the rows a dispatch received ([`Buffer::copy_received`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecvArray {
    /// `[rows][hidden]` bf16 values, or e4m3 bytes (dense) after an FP8 dispatch.
    X,
    /// `[rows][hidden / 128]` f32 scales (after an FP8 dispatch).
    Scales,
    /// `[rows][top_k]` i64 local expert ids (after a non-cached dispatch with top-k ids).
    TopkIdx,
    /// `[rows][top_k]` f32 weights (after a non-cached dispatch with weights).
    TopkWeights,
}

impl RecvArray {
    fn region(self) -> RegionKind {
        match self {
            Self::X => RegionKind::DispatchX,
            Self::Scales => RegionKind::DispatchScales,
            Self::TopkIdx => RegionKind::DispatchTopkIdx,
            Self::TopkWeights => RegionKind::DispatchTopkWeights,
        }
    }
}

/// Caller-owned device memory, by address and length in bytes, that an op writes
/// ([`Buffer::copy_received`]). Nothing checks it can be written: the unsafe op that takes it
/// states what the caller promises.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceBytes {
    /// Device address.
    pub ptr: u64,
    /// Length in bytes.
    pub len: usize,
}

/// Where a counted copy reads: the two parity copies of one receive region of this buffer, the
/// device word that picks one, and the device count of rows to copy.
#[derive(Clone, Copy, Debug)]
pub struct CountedRows {
    /// Device address of the region at even and at odd dispatch parity.
    pub region: [u64; 2],
    /// Device address of an `i64` whose low bit picks the parity copy, or `None` for the even
    /// one (the caller passes the parity copy it wants as both addresses then).
    pub parity_word: Option<u64>,
    /// Device address of the `i32` count of received rows (e.g. the handle's
    /// `recv_prefix[world]`, [`crate::Handle::recv_prefix_ptr`] + 4 × world).
    pub count: u64,
    /// Bytes per row (a multiple of 4).
    pub row_bytes: usize,
}

impl Buffer {
    /// Copies the first `min(count, dst_bytes / row_bytes)` rows of `src` into `dst`
    /// (stream-ordered; no host wait). See the module's contract.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a row size that is not a positive multiple of 4, a region
    /// outside this buffer's symmetric memory, or a `dst` that is not device memory of this
    /// GPU; errors of the launch.
    ///
    /// # Safety
    /// `src.parity_word` (when given) and `src.count` must address live device memory of an
    /// `i64` and an `i32` that stay valid until the copy has run; `dst` must be `dst_bytes` bytes
    /// of device memory the caller owns until then, not overlapping the region.
    pub unsafe fn copy_counted_rows(
        &mut self,
        src: CountedRows,
        dst: u64,
        dst_bytes: usize,
    ) -> Result<()> {
        self.check_ready()?;
        if src.row_bytes == 0 || !src.row_bytes.is_multiple_of(4) {
            return Err(Error::InvalidArgument {
                argument: "row_bytes",
                rule: format!("must be a positive multiple of 4 (got {})", src.row_bytes),
            });
        }
        let max_rows = dst_bytes / src.row_bytes;
        if max_rows == 0 {
            return Ok(());
        }
        let base = self.memory.mem.local_base();
        let end = base + self.memory.mem.len() as u64;
        let span = (max_rows * src.row_bytes) as u64;
        for (p, at) in src.region.iter().zip(["even", "odd"]) {
            if *p < base || p.saturating_add(span) > end {
                return Err(Error::InvalidArgument {
                    argument: "region",
                    rule: format!(
                        "the {at} copy ({p:#x}, {span} bytes) must lie in this buffer's \
                         symmetric memory ({base:#x}..{end:#x})"
                    ),
                });
            }
        }
        let dev = self.launcher.ctx.ordinal();
        check_device_ptr("dst", dst, max_rows * src.row_bytes, 4, dev)?;
        // SAFETY: both parity copies lie in this rank's symmetric memory (checked above), `dst`
        // is device memory of this GPU holding max_rows rows (checked above; owned by the
        // caller per the contract), and the count and parity words are live per the contract.
        unsafe {
            self.launcher.kernels.launch_copy_counted_rows(
                &self.launcher.stream,
                epcomm_kernels::CopyCountedRows {
                    dst,
                    even: src.region[0],
                    odd: src.region[1],
                    parity: src.parity_word.unwrap_or(0),
                    count: src.count,
                    row_bytes: src.row_bytes as u64,
                    max_rows: max_rows as u64,
                },
            )
        }?;
        // It reads this rank's symmetric memory: teardown waits for it (`Buffer::wait_launched`).
        self.mark_launch();
        Ok(())
    }

    /// Copies `array` of the rows the **latest** dispatch (cached or not) received into `dst`
    /// (at most `dst.len / row bytes` rows), as many rows as the device counted for `handle`
    /// (that dispatch's handle), from the receive-region copy the device's own dispatch count
    /// names. No host wait, and right at either parity, also when the dispatch and the copy
    /// are replayed from a CUDA graph: the caller tracks no parity.
    /// Stream-ordered: issue it after the dispatch and before the next one. Rows of `dst` past
    /// the count are left as they were.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming `handle` (another buffer's, or not the latest
    /// dispatch's) or `array` (what the latest dispatch did not carry: scales of a BF16
    /// dispatch, weights of a dispatch without them), or `dst` (not device memory of this GPU, or misaligned); launch errors.
    ///
    /// # Safety
    /// `dst` must be device memory the caller owns until the copy has run on the buffer's
    /// stream.
    pub unsafe fn copy_received(
        &mut self,
        handle: &Handle,
        array: RecvArray,
        dst: DeviceBytes,
    ) -> Result<()> {
        let (dst, dst_bytes) = (dst.ptr, dst.len);
        let h = self.own_handle(handle)?;
        let latest = match &self.latest_dispatch {
            Some(l) if std::ptr::eq(l.handle.as_ptr(), h) => l,
            _ => {
                return Err(Error::InvalidArgument {
                    argument: "handle",
                    rule: "copy_received copies the rows of this buffer's latest dispatch: pass \
                           that dispatch's handle, before the next dispatch"
                        .into(),
                });
            }
        };
        let (hidden, top_k) = (self.cfg.hidden, self.cfg.top_k);
        let row_bytes = match (array, latest.dtype) {
            (RecvArray::X, dtype) => {
                let row = RowFormat::new(hidden, dtype).map_err(|e| Error::InvalidArgument {
                    argument: "array",
                    rule: e.to_string(),
                })?;
                row.x_bytes()
            }
            (RecvArray::Scales, RowDtype::Fp8) => hidden / RowFormat::FP8_BLOCK * 4,
            (RecvArray::Scales, RowDtype::Bf16) => {
                return Err(Error::InvalidArgument {
                    argument: "array",
                    rule: "the latest dispatch sent BF16 rows, which have no scales".into(),
                });
            }
            (RecvArray::TopkIdx, _) => top_k * 8,
            (RecvArray::TopkWeights, _) if latest.weights => top_k * 4,
            (RecvArray::TopkWeights, _) => {
                return Err(Error::InvalidArgument {
                    argument: "array",
                    rule:
                        "the latest dispatch carried no top-k weights (a cached dispatch, or one \
                           without topk_weights): there are none to copy"
                            .into(),
                });
            }
        };
        let base = self.memory.mem.local_base();
        let at = |p| base + self.place.plan.region(array.region(), p).offset;
        let src = CountedRows {
            region: [at(Parity::Even), at(Parity::Odd)],
            // A dispatch advances the device's dispatch count to its epoch, whose parity names
            // the region copy it wrote (`Parity::of_epoch`): the copy follows it.
            parity_word: Some(
                self.memory.seq_state.ptr() + offset_of!(abi::SeqState, dispatch) as u64,
            ),
            count: handle.recv_count_ptr(),
            row_bytes,
        };
        // SAFETY: the parity word is this buffer's SeqState and the count the handle's receive
        // prefix, both live while the buffer and the handle are (the handle is kept by
        // `keep_alive` when the copy is recorded into a graph); `dst` per the caller's contract.
        unsafe { self.copy_counted_rows(src, dst, dst_bytes) }?;
        self.keep_alive(handle.inner.clone());
        Ok(())
    }
}
