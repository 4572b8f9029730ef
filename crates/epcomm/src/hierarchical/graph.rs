//! CUDA-graph capture and replay of two-tier ops: the same [`crate::EpGraph`] as a flat
//! buffer's (`ExpertParallel::capture` / `replay` of [`HierarchicalBuffer`]).
//!
//! Both tiers run on one stream, so one stream capture records both. Every two-tier dispatch
//! advances both tiers' dispatch counts by one, so a graph holding a dispatch is recorded twice,
//! once per parity a replay can start at, and a replay checks that both tiers are at the
//! parities a recording was made for (`buffer/graph.rs` does the work for any tiers).

use super::HierarchicalBuffer;
use crate::Buffer;
use crate::buffer::graph::Tiers;

impl Tiers for HierarchicalBuffer {
    fn tiers_mut(&mut self) -> Vec<&mut Buffer> {
        vec![&mut self.rail, &mut self.node]
    }
}
