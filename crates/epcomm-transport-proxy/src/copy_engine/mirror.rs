//! The copy-engine executor's progress mirror: the ring's `tail` and `completed` written into
//! device words with a stream of its own, for the kernels to poll (docs/proxy.md, "Progress
//! words").

use std::sync::Arc;

use cudarc::driver::sys;
use cudarc::driver::{CudaStream, DriverError};
use epcomm_proxy::{OpFailure, OpId};
use epcomm_transport::TransportError;

use super::CopyEngineExecutor;

/// The device words the ring's progress is mirrored into, the stream that writes them, and the
/// values last written.
pub(super) struct Mirror {
    stream: Arc<CudaStream>,
    taken_word: u64,
    completed_word: u64,
    last: (u64, u64),
}

impl CopyEngineExecutor {
    /// Also writes the ring's progress — descriptors taken (`tail`) and complete — into the
    /// device words at `taken_word` and `completed_word` (8 bytes each, zeroed, in this
    /// context's device memory), with `cuStreamWriteValue64` on a stream of its own, whenever
    /// they change. The producing kernel then polls device memory instead of reading the
    /// ring's host words across the bus. Where the driver refuses stream writes the mirror
    /// switches itself off (the host words stay authoritative).
    ///
    /// # Errors
    /// The driver's error creating the stream.
    pub fn mirror_progress(
        &mut self,
        taken_word: u64,
        completed_word: u64,
    ) -> Result<(), TransportError> {
        let stream = self
            .ctx
            .new_stream()
            .map_err(|source| TransportError::Driver {
                context: "creating the proxy's progress stream".into(),
                source,
            })?;
        self.mirror = Some(Mirror {
            stream,
            taken_word,
            completed_word,
            last: (0, 0),
        });
        Ok(())
    }

    /// The executor's [`epcomm_proxy::Executor::progress`]: writes the values that changed.
    pub(super) fn write_mirror(
        &mut self,
        taken: u64,
        completed: u64,
        op_hint: OpId,
    ) -> Result<(), OpFailure> {
        let Some(m) = &self.mirror else {
            return Ok(());
        };
        if m.last == (taken, completed) {
            return Ok(());
        }
        self.bind(op_hint, 0)?;
        let Some(m) = &mut self.mirror else {
            return Ok(());
        };
        for (word, value, old) in [
            (m.taken_word, taken, m.last.0),
            (m.completed_word, completed, m.last.1),
        ] {
            if value == old {
                continue;
            }
            let stream = m.stream.cu_stream();
            // SAFETY: `word` is an 8-byte device word of this context (the caller of
            // `mirror_progress` owns it and keeps it until the executor is dropped); the stream
            // belongs to this executor's context.
            let res = self.watch.call("cuStreamWriteValue64", || {
                // SAFETY: as stated above this call.
                unsafe {
                    sys::cuStreamWriteValue64_v2(
                        stream,
                        word,
                        value,
                        sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32,
                    )
                }
            });
            match res {
                sys::CUresult::CUDA_SUCCESS => {}
                sys::CUresult::CUDA_ERROR_NOT_SUPPORTED
                | sys::CUresult::CUDA_ERROR_INVALID_VALUE => {
                    // No stream writes here: the producer keeps reading the host words.
                    self.mirror = None;
                    return Ok(());
                }
                err => {
                    return Err(Self::driver(
                        op_hint,
                        0,
                        "cuStreamWriteValue64 (progress mirror)",
                    )(DriverError(err)));
                }
            }
        }
        m.last = (taken, completed);
        Ok(())
    }
}
