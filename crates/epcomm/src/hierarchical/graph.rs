//! CUDA-graph capture and replay of hierarchical ops ([`HierGraph`]).
//!
//! Both tiers run on one stream, so one stream capture records both. As for a single buffer
//! (`Buffer::capture`), kernels read their sequence numbers on the device and only the host's
//! receive-region parity needs care: every hierarchical dispatch advances both tiers' dispatch
//! counts by one, so a graph holding a dispatch is recorded twice, once per parity a replay can
//! start at, and a replay checks that both tiers are at the parities a recording was made for.
//!
//! As for [`crate::EpGraph`], the graph owns the routing state its recordings address (both
//! tiers' layouts and handles): each tier collects what its recorded ops use, and the graph
//! takes both lists.

use cudarc::driver::{CudaGraph, sys};

use super::HierarchicalBuffer;
use crate::buffer::{KeepAlive, Sequence};
use crate::error::DriverContext;
use crate::{Error, Result};

/// A captured sequence of hierarchical ops ([`HierarchicalBuffer::capture`]).
pub struct HierGraph {
    recordings: Vec<CudaGraph>,
    /// `(rail parity, node parity)` each recording was made for.
    parities: Vec<(u64, u64)>,
    /// Ops the graph holds on the rail and the node tier.
    delta: (Sequence, Sequence),
    buffer_ids: (u64, u64),
    /// What the recordings address on the rail and the node tier; declared after
    /// `recordings`, so dropped after them.
    _keep_alive: (KeepAlive, KeepAlive),
}

impl std::fmt::Debug for HierGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HierGraph")
            .field("rail_ops", &self.delta.0.op)
            .field("node_ops", &self.delta.1.op)
            .field("recordings", &self.recordings.len())
            .finish()
    }
}

impl HierarchicalBuffer {
    /// Records the ops `ops` issues into a CUDA graph instead of running them: use only
    /// allocation-free, host-wait-free calls inside ([`Self::dispatch_into`],
    /// [`Self::cached_dispatch`], [`Self::combine`], and your own kernels on
    /// [`Self::stream`]). Every rank must capture (and later replay) the same ops. When the
    /// ops hold a dispatch, `ops` runs **twice** (one recording per receive-region parity), so
    /// pointers a dispatch returns inside are right on every replay; it must issue the same
    /// ops both times.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming `capture` when the two recordings differ or nothing
    /// was captured; driver errors.
    pub fn capture<F>(&mut self, ops: F) -> Result<HierGraph>
    where
        F: FnMut(&mut Self) -> Result<()>,
    {
        self.rail.ensure_ready()?;
        self.node.ensure_ready()?;
        self.rail.take_keep_alive();
        self.node.take_keep_alive();
        let graph = self.capture_recordings(ops);
        let keep = (self.rail.take_keep_alive(), self.node.take_keep_alive());
        graph.map(|g| HierGraph {
            _keep_alive: keep,
            ..g
        })
    }

    /// [`Self::capture`]'s recordings (the tiers' keep-alive lists fill meanwhile).
    fn capture_recordings<F>(&mut self, mut ops: F) -> Result<HierGraph>
    where
        F: FnMut(&mut Self) -> Result<()>,
    {
        let start = (self.rail.sequence(), self.node.sequence());
        let (first, delta) = self.record(&mut ops, start)?;
        let parity = |s: (Sequence, Sequence)| (s.0.dispatch % 2, s.1.dispatch % 2);
        let mut recordings = vec![first];
        let mut parities = vec![parity(start)];
        if delta.0.dispatch > 0 || delta.1.dispatch > 0 {
            let shift = |s: Sequence| Sequence {
                dispatch: s.dispatch + 1,
                ..s
            };
            let shifted = (shift(start.0), shift(start.1));
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
            parities.push(parity(shifted));
        }
        Ok(HierGraph {
            recordings,
            parities,
            delta,
            buffer_ids: (self.rail.id(), self.node.id()),
            _keep_alive: (Vec::new(), Vec::new()),
        })
    }

    /// One recording with both tiers' host mirrors at `at`; returns the graph and the ops it
    /// holds per tier. Nothing ran on the device, so the mirrors go back to where they were.
    fn record<F>(
        &mut self,
        ops: &mut F,
        at: (Sequence, Sequence),
    ) -> Result<(CudaGraph, (Sequence, Sequence))>
    where
        F: FnMut(&mut Self) -> Result<()>,
    {
        let real = (self.rail.sequence(), self.node.sequence());
        let stream = self.rail.stream().clone();
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .context("beginning a graph capture")?;
        self.rail.set_sequence(at.0);
        self.node.set_sequence(at.1);
        self.rail.begin_recording();
        self.node.begin_recording();
        let captured = ops(self);
        let graph = stream
            .end_capture(
                sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
            )
            .context("ending a graph capture");
        self.rail.end_recording();
        self.node.end_recording();
        let delta = (
            self.rail.sequence().minus(&at.0),
            self.node.sequence().minus(&at.1),
        );
        self.rail.set_sequence(real.0);
        self.node.set_sequence(real.1);
        captured?;
        let graph = graph?.ok_or(Error::InvalidArgument {
            argument: "capture",
            rule: "captured no work".into(),
        })?;
        Ok((graph, delta))
    }

    /// Replays a graph from [`Self::capture`] (stream-ordered, no host wait): the recording
    /// made for both tiers' current receive-region parities.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming `graph` when another buffer captured it, or when the
    /// tiers' parities match no recording (ops were issued on one tier alone in between);
    /// driver errors.
    pub fn replay(&mut self, graph: &HierGraph) -> Result<()> {
        self.rail.ensure_ready()?;
        self.node.ensure_ready()?;
        if graph.buffer_ids != (self.rail.id(), self.node.id()) {
            return Err(Error::InvalidArgument {
                argument: "graph",
                rule: "was captured on another HierarchicalBuffer".into(),
            });
        }
        let now = (
            self.rail.sequence().dispatch % 2,
            self.node.sequence().dispatch % 2,
        );
        let Some(i) = graph.parities.iter().position(|&p| p == now) else {
            return Err(Error::InvalidArgument {
                argument: "graph",
                rule: format!(
                    "was recorded for tier parities {:?}, and the tiers are at {now:?}: a \
                     dispatch ran on one tier alone since the capture",
                    graph.parities
                ),
            });
        };
        graph.recordings[i].launch().context("launching a graph")?;
        self.rail.mark_launch();
        self.node.mark_launch();
        let (mut rail, mut node) = (self.rail.sequence(), self.node.sequence());
        rail.add(&graph.delta.0);
        node.add(&graph.delta.1);
        self.rail.set_sequence(rail);
        self.node.set_sequence(node);
        Ok(())
    }
}
