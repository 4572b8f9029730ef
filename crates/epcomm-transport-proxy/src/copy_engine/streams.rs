//! A lane's copies on its streams: one `cuMemcpyAsync` per copy, and a batch dealt over the
//! lane's stream and its side streams between a fork and a join event (the parent module's
//! "Copy streams"; the deal itself is [`super::merge::stripes`]).

use cudarc::driver::DriverError;
use cudarc::driver::sys;
use epcomm_proxy::OpFailure;
use epcomm_transport::TransportError;

use super::merge::Pending;
use super::{CopyEngineExecutor, MAX_COPY_STREAMS};

impl CopyEngineExecutor {
    /// Spreads each batch's large independent copies over `n` streams per peer (clamped to
    /// `1..=`[`MAX_COPY_STREAMS`]; default 1): see the `copy_engine` module docs, "Copy
    /// streams". Makes the side streams and their events now (making either while a kernel
    /// runs can wait for it); call before the first operation, once.
    ///
    /// # Errors
    /// The driver's error creating a stream or an event.
    pub fn set_copy_streams(&mut self, n: usize) -> Result<(), TransportError> {
        let n = n.clamp(1, MAX_COPY_STREAMS);
        let driver = |context: &str| {
            let context = context.to_string();
            move |source| TransportError::Driver { context, source }
        };
        let flags = Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
        for lane in self.lanes.iter_mut().filter(|l| l.stream.is_some()) {
            while lane.sides.len() + 1 < n {
                let stream = self
                    .ctx
                    .new_stream()
                    .map_err(driver("creating a copy-engine side stream"))?;
                let join = self
                    .ctx
                    .new_event(flags)
                    .map_err(driver("creating a copy-engine join event"))?;
                lane.sides.push((stream, join));
            }
            if n > 1 && lane.fork.is_none() {
                lane.fork = Some(
                    self.ctx
                        .new_event(flags)
                        .map_err(driver("creating a copy-engine fork event"))?,
                );
            }
        }
        Ok(())
    }

    /// Copy `k` of lane `i`'s batch, on `stream` (one `cuMemcpyAsync`).
    pub(super) fn copy(&self, i: usize, k: usize, stream: sys::CUstream) -> Result<(), OpFailure> {
        let Pending {
            dst,
            src,
            bytes,
            op,
            ..
        } = self.lanes[i].batch[k];
        self.watch
            .call("cuMemcpyAsync", || {
                // SAFETY: the destination lies in the peer's mapped buffer (bounds-checked by
                // the decoder), the source is a device address the producing kernel named in
                // this process (kept valid until the operation completes) or bytes of the
                // lane's pinned arena or counting table (kept until the event after this
                // batch completes).
                unsafe { sys::cuMemcpyAsync(dst, src, bytes, stream) }
            })
            .result()
            .map_err(Self::driver(op, i as u32, "cuMemcpyAsync"))
    }

    /// Lane `i`'s batch over its streams ([`merge::stripes`]): the side streams wait for the
    /// fork event recorded on the lane's stream (everything before this batch), the `lead`
    /// copies go out on their streams (0: the lane's), the lane's stream waits for each used
    /// side stream's join event, then takes the `rest` in order.
    pub(super) fn striped_copies(
        &self,
        i: usize,
        lead: &[(usize, usize)],
        rest: &[usize],
    ) -> Result<(), OpFailure> {
        let lane = &self.lanes[i];
        let first = lane.batch[0].op;
        let main = self.stream(i, first)?;
        let fork = lane.fork.as_ref().ok_or_else(|| {
            Self::driver(first, i as u32, "a side stream without its fork event")(DriverError(
                sys::CUresult::CUDA_ERROR_NOT_INITIALIZED,
            ))
        })?;
        let used: Vec<usize> = (1..=lane.sides.len())
            .filter(|&s| lead.iter().any(|&(_, t)| t == s))
            .collect();
        self.watch
            .call("cuEventRecord", || fork.record(main))
            .map_err(Self::driver(first, i as u32, "cuEventRecord (fork)"))?;
        for &s in &used {
            let side = &lane.sides[s - 1].0;
            self.watch
                .call("cuStreamWaitEvent", || side.wait(fork))
                .map_err(Self::driver(first, i as u32, "cuStreamWaitEvent (fork)"))?;
        }
        for &(k, s) in lead {
            let stream = if s == 0 { main } else { &lane.sides[s - 1].0 };
            self.copy(i, k, stream.cu_stream())?;
        }
        for &s in &used {
            let (side, join) = &lane.sides[s - 1];
            self.watch
                .call("cuEventRecord", || join.record(side))
                .map_err(Self::driver(first, i as u32, "cuEventRecord (join)"))?;
            self.watch
                .call("cuStreamWaitEvent", || main.wait(join))
                .map_err(Self::driver(first, i as u32, "cuStreamWaitEvent (join)"))?;
        }
        for &k in rest {
            self.copy(i, k, main.cu_stream())?;
        }
        Ok(())
    }
}
