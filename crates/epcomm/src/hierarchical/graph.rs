//! CUDA-graph capture and replay of two-tier ops: the same [`crate::EpGraph`] as a flat
//! buffer's (`ExpertParallel::capture` / `replay` of [`HierarchicalBuffer`]).
//!
//! Both tiers run on one stream, so one stream capture records both. Every two-tier dispatch
//! advances both tiers' dispatch counts by one, so a graph holding a dispatch is recorded twice,
//! once per parity a replay can start at, and a replay checks that both tiers are at the
//! parities a recording was made for (`buffer/graph.rs` does the work for any tiers).

use super::HierarchicalBuffer;
use crate::buffer::graph::Tiers;
use crate::{Buffer, Handle, Result};

impl Tiers for HierarchicalBuffer {
    fn tiers_mut(&mut self) -> Vec<&mut Buffer> {
        vec![&mut self.rail, &mut self.node]
    }
    /// The node tier: it received this rank's rows.
    fn receiving_tier(&mut self, handle: &Handle) -> Result<(&mut Buffer, Handle)> {
        let (_, node) = super::tiers_of(handle)?;
        Ok((&mut self.node, node))
    }
}
