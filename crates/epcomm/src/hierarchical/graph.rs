//! CUDA-graph capture and replay of two-tier ops: the same [`EpGraph`] as a flat buffer's.
//!
//! Both tiers run on one stream, so one stream capture records both. Every two-tier dispatch
//! advances both tiers' dispatch counts by one, so a graph holding a dispatch is recorded twice,
//! once per parity a replay can start at, and a replay checks that both tiers are at the
//! parities a recording was made for (`buffer/graph.rs` does the work for any tiers).

use super::HierarchicalBuffer;
use crate::buffer::graph::{self, Tiers};
use crate::{Buffer, EpGraph, Result};

impl Tiers for HierarchicalBuffer {
    fn tiers_mut(&mut self) -> Vec<&mut Buffer> {
        vec![&mut self.rail, &mut self.node]
    }
}

impl HierarchicalBuffer {
    /// Records the ops `ops` issues into a CUDA graph instead of running them: use only
    /// allocation-free, host-wait-free calls inside ([`Self::layout_into`],
    /// [`Self::dispatch_into`], [`Self::cached_dispatch`], [`Self::combine`], and your own
    /// kernels on [`Self::stream`]). Every rank must capture (and later replay) the same ops.
    /// When the ops hold a dispatch, `ops` runs **twice** (one recording per receive-region
    /// parity), so pointers a dispatch returns inside are right on every replay; it must issue
    /// the same ops both times.
    ///
    /// # Errors
    /// As [`Buffer::capture`].
    pub fn capture<F>(&mut self, ops: F) -> Result<EpGraph>
    where
        F: FnMut(&mut Self) -> Result<()>,
    {
        graph::capture(self, ops)
    }

    /// Replays a graph from [`Self::capture`] (stream-ordered, no host wait): the recording
    /// made for both tiers' current receive-region parities.
    ///
    /// # Errors
    /// [`crate::Error::InvalidArgument`] naming `graph` when another buffer captured it, or
    /// when the tiers' parities match no recording (ops were issued on one tier alone in
    /// between); driver errors.
    pub fn replay(&mut self, graph: &EpGraph) -> Result<()> {
        graph::replay(self, graph)
    }
}
