//! CUDA-graph capture and replay of ops ([`EpGraph`]).
//!
//! Kernels read their sequence numbers from the device `SeqState`, never from their arguments,
//! so a recording replays correctly any number of times. Only the host needs care: the
//! receive-region parity a dispatch's returned pointers name depends on the dispatch count when
//! the replay starts, so a graph holding a dispatch is recorded once per parity, and a replay
//! advances the host mirror by what the graph holds.
//!
//! Memory contract: a recording bakes in the device addresses of the routing state its ops
//! use (a [`crate::Layout`]'s and a [`crate::Handle`]'s arrays, an [`super::LlRecv`]), which
//! the caller may drop right after the capture. While a recording is made, every op hands the
//! shared state it addresses to [`Buffer::keep_alive`], and the graph owns what the recording
//! collected: that memory is freed only after the graph is dropped (stream-ordered on the
//! buffer's stream, after every replay launched on it).

use std::any::Any;
use std::sync::Arc;

use cudarc::driver::{CudaGraph, sys};

use super::{Buffer, Sequence};
use crate::error::DriverContext;
use crate::{Error, Result};

/// A captured sequence of ops ([`Buffer::capture`]), replayed with [`Buffer::replay`].
///
/// Receive rows alternate between two regions by dispatch parity, so a graph holding a
/// dispatch is recorded twice, once per parity it can start at: `recordings[by_parity[p]]` is
/// the recording whose returned receive pointers are right when the device's dispatch count is
/// `p` modulo 2 at the replay's start (one recording serves both when the graph holds no
/// dispatch).
///
/// The graph owns the device state its recordings write and read (layouts, handles,
/// low-latency receive arrays): dropping those after the capture is safe, the replays keep
/// using the graph's references.
pub struct EpGraph {
    recordings: Vec<CudaGraph>,
    by_parity: [usize; 2],
    delta: Sequence,
    buffer_id: u64,
    /// What the recordings address; declared after `recordings`, so dropped after them.
    _keep_alive: KeepAlive,
}

/// Device state a recording addresses, owned by the graph made of it.
pub(crate) type KeepAlive = Vec<Arc<dyn Any + Send + Sync>>;

/// A buffer's CUDA-graph recording state.
#[derive(Debug, Default)]
pub(crate) struct CaptureState {
    /// `Buffer::capture` (or a hierarchical buffer's) is recording.
    pub(crate) recording: bool,
    /// What the ops recorded since the capture began address: handed to the graph made of the
    /// recordings.
    pub(crate) graph_keep: KeepAlive,
    /// A dispatch was captured outside `Buffer::capture`: the host no longer knows the
    /// dispatch parity, so combines never stage (`ops/staging.rs`).
    pub(crate) foreign_capture: bool,
}

impl std::fmt::Debug for EpGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EpGraph")
            .field("ops", &self.delta.op)
            .field("dispatches", &self.delta.dispatch)
            .finish()
    }
}

impl Buffer {
    /// While a recording is made ([`Self::begin_recording`]): keeps `state` (device memory the
    /// op being recorded addresses) alive for as long as the graph made of the recording.
    /// Outside a recording: nothing (a launched op is stream-ordered before any free).
    pub(crate) fn keep_alive(&mut self, state: Arc<dyn Any + Send + Sync>) {
        if !self.capture.recording {
            return;
        }
        // A handful of entries per graph: a linear scan keeps each object once.
        if !self
            .capture
            .graph_keep
            .iter()
            .any(|k| Arc::ptr_eq(k, &state))
        {
            self.capture.graph_keep.push(state);
        }
    }

    /// Takes what the recordings made since the last call keep alive (for the graph made of
    /// them; also called to drop what a failed capture collected).
    pub(crate) fn take_keep_alive(&mut self) -> KeepAlive {
        std::mem::take(&mut self.capture.graph_keep)
    }

    /// Records the ops `ops` issues on this buffer's stream into a CUDA graph instead of running
    /// them. Inside, use only allocation-free, host-wait-free calls: [`Self::layout_into`],
    /// [`Self::dispatch_into`], [`Self::cached_dispatch`], [`Self::combine`],
    /// [`Self::combine_in_place`], the low-latency ops ([`Self::ll_dispatch`],
    /// [`Self::ll_combine`], and their send phases with [`Self::ll_receive`] inside the same
    /// capture), and your own kernels on this stream. Every rank must capture
    /// (and later replay) the same ops.
    ///
    /// When the ops hold a dispatch, `ops` runs **twice**: receive rows alternate between two
    /// regions, and each recording is made for one of the two parities a replay can start at.
    /// Pointers a dispatch returns inside `ops` (e.g. [`crate::Dispatched::recv_x_ptr`] handed
    /// to an expert kernel captured in the same graph) are therefore right on every replay,
    /// whatever ran between replays. `ops` must issue the same epcomm ops both times.
    pub fn capture<F>(&mut self, ops: F) -> Result<EpGraph>
    where
        F: FnMut(&mut Self) -> Result<()>,
    {
        self.ensure_ready()?;
        self.take_keep_alive();
        let graph = self.capture_recordings(ops);
        let keep = self.take_keep_alive();
        graph.map(|g| EpGraph {
            _keep_alive: keep,
            ..g
        })
    }

    /// [`Self::capture`]'s recordings (the keep-alive list is filled by the ops meanwhile).
    fn capture_recordings<F>(&mut self, mut ops: F) -> Result<EpGraph>
    where
        F: FnMut(&mut Self) -> Result<()>,
    {
        let start = self.seq;
        let (first, delta) = self.record(&mut ops, start)?;
        let p = (start.dispatch % 2) as usize;
        let mut recordings = vec![first];
        let mut by_parity = [0, 0];
        if delta.dispatch > 0 {
            let shifted = Sequence {
                dispatch: start.dispatch + 1,
                ..start
            };
            let (other, other_delta) = self.record(&mut ops, shifted)?;
            if other_delta != delta {
                return Err(Error::InvalidArgument {
                    argument: "capture",
                    rule: format!(
                        "ops issued {other_delta:?} on the second recording and {delta:?} on the \
                         first; they must issue the same ops every time"
                    ),
                });
            }
            recordings.push(other);
            by_parity[1 - p] = 1;
        }
        Ok(EpGraph {
            recordings,
            by_parity,
            delta,
            buffer_id: self.id,
            _keep_alive: Vec::new(),
        })
    }

    /// One recording of `ops` with the host mirror at `at`; returns the graph and the ops it
    /// holds. The device ran nothing, so the mirror goes back to where it was.
    fn record<F>(&mut self, ops: &mut F, at: Sequence) -> Result<(CudaGraph, Sequence)>
    where
        F: FnMut(&mut Self) -> Result<()>,
    {
        let real = self.seq;
        self.launcher
            .stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .context("beginning a graph capture")?;
        self.seq = at;
        self.begin_recording();
        let captured = ops(self);
        let graph = self
            .launcher
            .stream
            .end_capture(
                sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
            )
            .context("ending a graph capture");
        self.end_recording();
        let delta = self.seq.minus(&at);
        self.seq = real;
        // Nothing ran on the device: a receive left pending inside is not pending now, also
        // when the closure failed.
        let pending = self.ll.pending.take();
        captured?;
        if let Some(p) = pending {
            return Err(Error::InvalidArgument {
                argument: "capture",
                rule: format!(
                    "the receive phase of a low-latency {} was not captured: call \
                     Buffer::ll_receive inside the same capture",
                    p.op
                ),
            });
        }
        let graph = graph?.ok_or(Error::InvalidArgument {
            argument: "capture",
            rule: "captured no work".into(),
        })?;
        Ok((graph, delta))
    }

    /// Replays a graph from [`Self::capture`] (stream-ordered, no host wait): the recording
    /// made for the current receive-region parity.
    pub fn replay(&mut self, graph: &EpGraph) -> Result<()> {
        self.ensure_ready()?;
        self.check_owner(graph.buffer_id, "graph", "was captured on another Buffer")?;
        let p = (self.seq.dispatch % 2) as usize;
        graph.recordings[graph.by_parity[p]]
            .launch()
            .context("launching a graph")?;
        self.mark_launch();
        self.seq.add(&graph.delta);
        Ok(())
    }
}
