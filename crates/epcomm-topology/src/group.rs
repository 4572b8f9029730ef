//! [`RankGroup`]: the ranks one buffer spans, as a strided subset of the world.
//!
//! A buffer over the whole world is the group `0, 1, ..., W - 1`. The hierarchical path runs
//! two buffers over groups of a [`Tiers`] world: the **rail group** of a rank (the ranks with
//! its local rank, one per node: `l, L + l, 2L + l, ...`) and its **node group** (the `L` ranks
//! of its node: `nL, nL + 1, ...`). Inside a group, kernels number the members `0..size` (the
//! *group rank*); the transport addresses member `i` as world rank [`RankGroup::member`]`(i)`.

use crate::{Result, Tiers, TopologyError};

/// `size` world ranks `base, base + stride, ..., base + (size - 1) * stride`, one of them this
/// rank (at index [`RankGroup::rank`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RankGroup {
    base: usize,
    stride: usize,
    size: usize,
    rank: usize,
}

impl RankGroup {
    /// The whole world of `world_size` ranks, seen from `rank`.
    ///
    /// # Errors
    /// [`TopologyError::Zero`] for `world_size`; `rank < world_size`.
    pub fn whole(world_size: usize, rank: usize) -> Result<Self> {
        TopologyError::zero_check("world_size", world_size)?;
        TopologyError::index_check("rank", rank, "world_size", world_size)?;
        Ok(Self {
            base: 0,
            stride: 1,
            size: world_size,
            rank,
        })
    }

    /// The rail group of world rank `rank`: the rank with its local rank in every node, in
    /// node order (its group rank is its node).
    ///
    /// # Errors
    /// `rank < tiers.world_size()`.
    pub fn rail(tiers: &Tiers, rank: usize) -> Result<Self> {
        Ok(Self {
            base: tiers.local_rank_of(rank)?,
            stride: tiers.local_ranks(),
            size: tiers.nodes(),
            rank: tiers.node_of(rank)?,
        })
    }

    /// The node group of world rank `rank`: the ranks of its node, in local-rank order (its
    /// group rank is its local rank).
    ///
    /// # Errors
    /// `rank < tiers.world_size()`.
    pub fn node(tiers: &Tiers, rank: usize) -> Result<Self> {
        Ok(Self {
            base: tiers.node_of(rank)? * tiers.local_ranks(),
            stride: 1,
            size: tiers.local_ranks(),
            rank: tiers.local_rank_of(rank)?,
        })
    }

    /// Members.
    pub fn size(&self) -> usize {
        self.size
    }

    /// This rank's index among the members (its group rank).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// World rank of member 0.
    pub fn pe_base(&self) -> usize {
        self.base
    }

    /// World-rank distance between consecutive members.
    pub fn pe_stride(&self) -> usize {
        self.stride
    }

    /// Whether the group is the whole world of `world_size` ranks in order.
    pub fn is_whole(&self, world_size: usize) -> bool {
        self.base == 0 && self.stride == 1 && self.size == world_size
    }

    /// World rank of member `i`.
    ///
    /// # Errors
    /// `i < size()`.
    pub fn member(&self, i: usize) -> Result<usize> {
        TopologyError::index_check("group rank", i, "group size", self.size)?;
        Ok(self.base + i * self.stride)
    }

    /// The members' world ranks, in group order.
    pub fn members(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.size).map(|i| self.base + i * self.stride)
    }

    /// The group rank of world rank `world_rank`, if it is a member.
    pub fn index_of(&self, world_rank: usize) -> Option<usize> {
        let d = world_rank.checked_sub(self.base)?;
        (d.is_multiple_of(self.stride) && d / self.stride < self.size).then(|| d / self.stride)
    }

    /// A world-rank name for group rank `i` in messages (`i` itself when out of range, so a
    /// corrupt record still prints).
    pub fn world_rank_or_self(&self, i: usize) -> usize {
        self.member(i).unwrap_or(i)
    }

    /// Checks that every member is below `world_size`.
    ///
    /// # Errors
    /// [`TopologyError::IndexOutOfRange`] naming the last member.
    pub fn check_within(&self, world_size: usize) -> Result<()> {
        let last = self.base + (self.size - 1) * self.stride;
        TopologyError::index_check("group member", last, "world_size", world_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rail_and_node_groups_partition_a_two_tier_world() {
        // 3 nodes of 4 ranks; rank 6 = (node 1, local rank 2).
        let t = Tiers::new(3, 4).unwrap();
        let rail = RankGroup::rail(&t, 6).unwrap();
        assert_eq!(rail.members().collect::<Vec<_>>(), vec![2, 6, 10]);
        assert_eq!((rail.rank(), rail.size()), (1, 3));
        assert_eq!(rail.member(rail.rank()).unwrap(), 6);
        let node = RankGroup::node(&t, 6).unwrap();
        assert_eq!(node.members().collect::<Vec<_>>(), vec![4, 5, 6, 7]);
        assert_eq!(node.rank(), 2);
        assert_eq!(node.member(node.rank()).unwrap(), 6);
        // Every rank's rail group and node group meet in exactly that rank.
        for r in 0..12 {
            let (rail, node) = (
                RankGroup::rail(&t, r).unwrap(),
                RankGroup::node(&t, r).unwrap(),
            );
            let common: Vec<usize> = rail
                .members()
                .filter(|m| node.index_of(*m).is_some())
                .collect();
            assert_eq!(common, vec![r]);
            assert_eq!(rail.index_of(r), Some(rail.rank()));
            assert_eq!(node.index_of(r), Some(node.rank()));
            rail.check_within(12).unwrap();
        }
    }

    #[test]
    fn index_of_rejects_non_members() {
        let t = Tiers::new(2, 4).unwrap();
        let rail = RankGroup::rail(&t, 1).unwrap(); // ranks 1, 5
        assert_eq!(rail.index_of(0), None);
        assert_eq!(rail.index_of(3), None);
        assert_eq!(rail.index_of(5), Some(1));
        assert_eq!(rail.index_of(9), None);
        assert!(rail.member(2).is_err());
        assert_eq!(rail.world_rank_or_self(7), 7);
    }

    #[test]
    fn the_whole_world_is_one_group() {
        let g = RankGroup::whole(4, 3).unwrap();
        assert!(g.is_whole(4));
        assert!(!g.is_whole(5));
        assert_eq!((g.pe_base(), g.pe_stride(), g.rank()), (0, 1, 3));
        assert!(RankGroup::whole(4, 4).is_err());
        assert!(RankGroup::whole(0, 0).is_err());
        let t = Tiers::new(1, 4).unwrap();
        // One node: the node group is the whole world, the rail group is the rank alone.
        assert!(RankGroup::node(&t, 2).unwrap().is_whole(4));
        assert_eq!(
            RankGroup::rail(&t, 2)
                .unwrap()
                .members()
                .collect::<Vec<_>>(),
            vec![2]
        );
    }
}
