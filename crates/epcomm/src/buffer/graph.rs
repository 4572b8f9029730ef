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
use crate::Handle;
use crate::error::DriverContext;
use crate::{Error, Result};

/// A captured sequence of ops ([`Buffer::capture`] or [`crate::ExpertParallel::capture`]),
/// replayed with the same buffer's `replay`.
///
/// Receive rows alternate between two regions by dispatch parity, so a graph holding a
/// dispatch is recorded twice, once per parity it can start at: `recordings[i]` is right when
/// every tier's dispatch count is `parities[i]` modulo 2 at the replay's start (one recording
/// serves every parity when the graph holds no dispatch). A flat buffer has one tier; a
/// two-tier buffer has two on one stream, and one stream capture records both.
///
/// The graph owns the device state its recordings write and read (layouts, handles,
/// low-latency receive arrays): dropping those after the capture is safe, the replays keep
/// using the graph's references.
pub struct EpGraph {
    recordings: Vec<CudaGraph>,
    /// Per recording, the dispatch parity of every tier it was made for.
    parities: Vec<Vec<u64>>,
    /// Ops the graph holds, per tier.
    delta: Vec<Sequence>,
    /// The tiers' buffers, in order.
    buffer_ids: Vec<u64>,
    /// What the recordings address, per tier; declared after `recordings`, so dropped after
    /// them.
    _keep_alive: Vec<KeepAlive>,
}

impl EpGraph {
    /// Whether the graph holds a dispatch (then it has one recording per parity).
    fn holds_dispatch(&self) -> bool {
        self.delta.iter().any(|d| d.dispatch > 0)
    }
}

/// A buffer made of tiers ([`Buffer`]s) that run on one stream: what capture and replay
/// work on. A flat buffer is its own one tier. Public in a crate-private module: it seals
/// [`crate::ExpertParallel`] (only this crate's buffers have tiers).
pub trait Tiers {
    /// The tiers, in a fixed order.
    fn tiers_mut(&mut self) -> Vec<&mut Buffer>;
    /// The tier that received this rank's rows in `handle`'s dispatch, and its handle there.
    fn receiving_tier(&mut self, handle: &Handle) -> Result<(&mut Buffer, Handle)>;
}

impl Tiers for Buffer {
    fn tiers_mut(&mut self) -> Vec<&mut Buffer> {
        vec![self]
    }
    fn receiving_tier(&mut self, handle: &Handle) -> Result<(&mut Buffer, Handle)> {
        Ok((self, handle.clone()))
    }
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
            .field("ops", &self.delta.iter().map(|d| d.op).collect::<Vec<_>>())
            .field(
                "dispatches",
                &self.delta.iter().map(|d| d.dispatch).collect::<Vec<_>>(),
            )
            .field("recordings", &self.recordings.len())
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
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming `capture` when the two recordings differ, nothing was
    /// captured, or a low-latency receive phase was left outside; driver errors.
    pub fn capture<F>(&mut self, ops: F) -> Result<EpGraph>
    where
        F: FnMut(&mut Self) -> Result<()>,
    {
        capture(self, ops)
    }

    /// Replays a graph from [`Self::capture`] (stream-ordered, no host wait): the recording
    /// made for the current receive-region parity.
    ///
    /// # Errors
    /// As [`crate::ExpertParallel::replay`] (a graph captured on another buffer, or tier parities that match no recording, name `graph`).
    pub fn replay(&mut self, graph: &EpGraph) -> Result<()> {
        replay(self, graph)
    }
}

/// [`Buffer::capture`] for any buffer of tiers: every tier's keep-alive list is collected
/// into the graph.
pub(crate) fn capture<T, F>(buf: &mut T, ops: F) -> Result<EpGraph>
where
    T: Tiers,
    F: FnMut(&mut T) -> Result<()>,
{
    for tier in buf.tiers_mut() {
        tier.check_ready()?;
        tier.take_keep_alive();
    }
    let graph = capture_recordings(buf, ops);
    let keep = buf
        .tiers_mut()
        .into_iter()
        .map(Buffer::take_keep_alive)
        .collect();
    graph.map(|g| EpGraph {
        _keep_alive: keep,
        ..g
    })
}

/// [`capture`]'s recordings (the keep-alive lists fill meanwhile).
fn capture_recordings<T, F>(buf: &mut T, mut ops: F) -> Result<EpGraph>
where
    T: Tiers,
    F: FnMut(&mut T) -> Result<()>,
{
    let start: Vec<Sequence> = buf.tiers_mut().iter().map(|t| t.seq).collect();
    let parity = |s: &[Sequence]| s.iter().map(|s| s.dispatch % 2).collect::<Vec<_>>();
    let (first, delta) = record(buf, &mut ops, &start)?;
    let mut graph = EpGraph {
        recordings: vec![first],
        parities: vec![parity(&start)],
        delta,
        buffer_ids: buf.tiers_mut().iter().map(|t| t.id).collect(),
        _keep_alive: Vec::new(),
    };
    if graph.holds_dispatch() {
        let shifted: Vec<Sequence> = start
            .iter()
            .map(|s| Sequence {
                dispatch: s.dispatch + 1,
                ..*s
            })
            .collect();
        let (other, other_delta) = record(buf, &mut ops, &shifted)?;
        if other_delta != graph.delta {
            return Err(Error::InvalidArgument {
                argument: "capture",
                rule: format!(
                    "ops issued {other_delta:?} on the second recording and {:?} on the \
                     first; they must issue the same ops every time",
                    graph.delta
                ),
            });
        }
        graph.recordings.push(other);
        graph.parities.push(parity(&shifted));
    }
    Ok(graph)
}

/// One recording of `ops` with the tiers' host mirrors at `at`; returns the graph and the ops
/// it holds per tier. The device ran nothing, so the mirrors go back to where they were.
fn record<T, F>(buf: &mut T, ops: &mut F, at: &[Sequence]) -> Result<(CudaGraph, Vec<Sequence>)>
where
    T: Tiers,
    F: FnMut(&mut T) -> Result<()>,
{
    let (real, stream): (Vec<Sequence>, _) = {
        let tiers = buf.tiers_mut();
        let stream = tiers[0].launcher.stream.clone();
        (tiers.iter().map(|t| t.seq).collect(), stream)
    };
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .context("beginning a graph capture")?;
    for (tier, at) in buf.tiers_mut().into_iter().zip(at) {
        tier.seq = *at;
        tier.begin_recording();
    }
    let captured = ops(buf);
    let graph = stream
        .end_capture(sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)
        .context("ending a graph capture");
    let mut delta = Vec::with_capacity(at.len());
    let mut pending = None;
    for ((tier, at), real) in buf.tiers_mut().into_iter().zip(at).zip(real) {
        tier.end_recording();
        delta.push(tier.seq.minus(at));
        tier.seq = real;
        // Nothing ran on the device: a receive left pending inside is not pending now, also
        // when the closure failed.
        pending = pending.or(tier.ll.pending.take());
    }
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

/// [`Buffer::replay`] for any buffer of tiers.
pub(crate) fn replay<T: Tiers>(buf: &mut T, graph: &EpGraph) -> Result<()> {
    let mut tiers = buf.tiers_mut();
    for tier in tiers.iter_mut() {
        tier.check_ready()?;
    }
    let ids: Vec<u64> = tiers.iter().map(|t| t.id).collect();
    if ids != graph.buffer_ids {
        return Err(Error::InvalidArgument {
            argument: "graph",
            rule: "was captured on another buffer".into(),
        });
    }
    let now: Vec<u64> = tiers.iter().map(|t| t.seq.dispatch % 2).collect();
    let i = if graph.holds_dispatch() {
        graph.parities.iter().position(|p| *p == now)
    } else {
        Some(0)
    };
    let Some(i) = i else {
        return Err(Error::InvalidArgument {
            argument: "graph",
            rule: format!(
                "was recorded for tier parities {:?}, and the tiers are at {now:?}: a dispatch \
                 ran on one tier alone since the capture",
                graph.parities
            ),
        });
    };
    graph.recordings[i].launch().context("launching a graph")?;
    for (tier, delta) in tiers.iter_mut().zip(&graph.delta) {
        tier.mark_launch();
        tier.seq.add(delta);
    }
    Ok(())
}
