//! [`Fence`]: orders the session's stream against a caller's stream (a framework's current
//! stream, known only by its raw `CUstream` handle), with two events the session owns.
//!
//! An op of the Python package runs on the session's stream. Before it, that stream waits for
//! the work the caller queued on its own stream so far (the op's inputs were written there);
//! after it, for a synchronous op, the caller's stream waits for the session's (the outputs
//! are read there). Both are an event record and a stream wait, the same pair a framework's
//! `wait_stream` issues, so they behave the same inside a CUDA graph capture: a wait on an event
//! recorded on a capturing stream pulls the waiting stream into the capture, and the wait back
//! joins it again. Doing both here saves the framework's event objects on every op.
//!
//! An event can be recorded again as soon as a wait has been queued on it (the wait takes the
//! event's state at the time it is queued), so two events serve every op in turn.

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaStream, DriverError, result, sys};

use crate::error::{BindError, Result};

/// The two events of a session's stream ordering.
#[derive(Debug)]
pub struct Fence {
    stream: Arc<CudaStream>,
    /// Recorded on the caller's stream, waited for by the session's.
    inbound: CudaEvent,
    /// Recorded on the session's stream, waited for by the caller's.
    outbound: CudaEvent,
}

fn driver(context: &'static str) -> impl FnOnce(DriverError) -> BindError {
    move |source| BindError::Driver { context, source }
}

impl Fence {
    /// Two events (without timing) in the context of `stream`, the session's stream.
    pub fn new(stream: &Arc<CudaStream>) -> Result<Self> {
        let ctx = stream.context();
        let flags = Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
        Ok(Self {
            stream: stream.clone(),
            inbound: ctx
                .new_event(flags)
                .map_err(driver("creating the stream-order events"))?,
            outbound: ctx
                .new_event(flags)
                .map_err(driver("creating the stream-order events"))?,
        })
    }

    /// The session's stream waits for the work queued on `caller` so far.
    ///
    /// # Safety
    /// `caller` is a live stream of the session's context (0: its legacy default stream).
    pub unsafe fn after(&self, caller: u64) -> Result<()> {
        self.stream
            .context()
            .bind_to_thread()
            .map_err(driver("making the GPU's context current"))?;
        // SAFETY: a live event of this context and, by the caller's contract, a live stream of
        // the same context.
        unsafe { result::event::record(self.inbound.cu_event(), caller as sys::CUstream) }
            .map_err(driver(
                "recording the caller stream's event (cuEventRecord)",
            ))?;
        self.stream
            .wait(&self.inbound)
            .map_err(driver("ordering the buffer's stream after the caller's"))
    }

    /// `caller` waits for the work queued on the session's stream so far.
    ///
    /// # Safety
    /// As for [`Self::after`].
    pub unsafe fn join(&self, caller: u64) -> Result<()> {
        self.outbound.record(&self.stream).map_err(driver(
            "recording the buffer stream's event (cuEventRecord)",
        ))?;
        // SAFETY: by the caller's contract a live stream of the event's context.
        unsafe {
            result::stream::wait_event(
                caller as sys::CUstream,
                self.outbound.cu_event(),
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(driver(
            "ordering the caller's stream after the buffer's (cuStreamWaitEvent)",
        ))
    }
}
