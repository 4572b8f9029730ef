//! Expert placement: which rank holds which expert.

use std::ops::Range;

use crate::{Result, TopologyError};

/// Contiguous placement of `num_experts` experts over `world_size` ranks: rank `r` holds
/// experts `r * epr .. (r + 1) * epr` where `epr = num_experts / world_size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ExpertPlacement {
    num_experts: usize,
    world_size: usize,
}

impl ExpertPlacement {
    /// # Errors
    /// `num_experts > 0`, `world_size > 0`, `num_experts % world_size == 0`.
    pub fn new(num_experts: usize, world_size: usize) -> Result<Self> {
        TopologyError::zero_check("num_experts", num_experts)?;
        TopologyError::zero_check("world_size", world_size)?;
        TopologyError::multiple_check("num_experts", num_experts, "world_size", world_size)?;
        Ok(Self {
            num_experts,
            world_size,
        })
    }

    /// Total number of experts.
    pub fn num_experts(&self) -> usize {
        self.num_experts
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Experts per rank (`E / world`).
    pub fn experts_per_rank(&self) -> usize {
        self.num_experts / self.world_size
    }

    /// The rank holding global expert `expert`.
    ///
    /// # Errors
    /// `expert < num_experts`.
    pub fn rank_of(&self, expert: usize) -> Result<usize> {
        TopologyError::index_check("expert", expert, "num_experts", self.num_experts)?;
        Ok(expert / self.experts_per_rank())
    }

    /// The index of global expert `expert` among its rank's experts.
    ///
    /// # Errors
    /// `expert < num_experts`.
    pub fn local_index(&self, expert: usize) -> Result<usize> {
        TopologyError::index_check("expert", expert, "num_experts", self.num_experts)?;
        Ok(expert % self.experts_per_rank())
    }

    /// The global id of local expert `local` on `rank`.
    ///
    /// # Errors
    /// `rank < world_size`, `local < experts_per_rank()`.
    pub fn global_expert(&self, rank: usize, local: usize) -> Result<usize> {
        TopologyError::index_check("rank", rank, "world_size", self.world_size)?;
        TopologyError::index_check("local", local, "experts_per_rank", self.experts_per_rank())?;
        Ok(rank * self.experts_per_rank() + local)
    }

    /// The global experts held by `rank`.
    ///
    /// # Errors
    /// `rank < world_size`.
    pub fn experts_of(&self, rank: usize) -> Result<Range<usize>> {
        TopologyError::index_check("rank", rank, "world_size", self.world_size)?;
        let epr = self.experts_per_rank();
        Ok(rank * epr..(rank + 1) * epr)
    }

    /// Experts held by one node of `gpus_per_node` ranks.
    ///
    /// # Errors
    /// `gpus_per_node > 0` and `world_size % gpus_per_node == 0`.
    pub fn experts_per_node(&self, gpus_per_node: usize) -> Result<usize> {
        TopologyError::zero_check("gpus_per_node", gpus_per_node)?;
        TopologyError::multiple_check(
            "world_size",
            self.world_size,
            "gpus_per_node",
            gpus_per_node,
        )?;
        Ok(self.experts_per_rank() * gpus_per_node)
    }

    /// The node (of `gpus_per_node` ranks) holding global expert `expert`.
    ///
    /// # Errors
    /// As [`rank_of`](Self::rank_of) and [`experts_per_node`](Self::experts_per_node).
    pub fn node_of(&self, expert: usize, gpus_per_node: usize) -> Result<usize> {
        let per_node = self.experts_per_node(gpus_per_node)?;
        TopologyError::index_check("expert", expert, "num_experts", self.num_experts)?;
        Ok(expert / per_node)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn deepseek_shape() {
        let p = ExpertPlacement::new(256, 8).unwrap();
        assert_eq!(p.experts_per_rank(), 32);
        assert_eq!(p.rank_of(0).unwrap(), 0);
        assert_eq!(p.rank_of(31).unwrap(), 0);
        assert_eq!(p.rank_of(32).unwrap(), 1);
        assert_eq!(p.rank_of(255).unwrap(), 7);
        assert_eq!(p.local_index(33).unwrap(), 1);
        assert_eq!(p.global_expert(7, 31).unwrap(), 255);
        assert_eq!(p.experts_of(2).unwrap(), 64..96);
        assert_eq!(p.experts_per_node(4).unwrap(), 128);
        assert_eq!(p.node_of(130, 4).unwrap(), 1);
        assert_eq!(p.num_experts(), 256);
        assert_eq!(p.world_size(), 8);
    }

    #[test]
    fn errors() {
        assert_eq!(
            ExpertPlacement::new(0, 2),
            Err(TopologyError::Zero { arg: "num_experts" })
        );
        assert_eq!(
            ExpertPlacement::new(4, 0),
            Err(TopologyError::Zero { arg: "world_size" })
        );
        assert!(matches!(
            ExpertPlacement::new(10, 4),
            Err(TopologyError::NotMultiple {
                arg: "num_experts",
                divisor_arg: "world_size",
                ..
            })
        ));
        let p = ExpertPlacement::new(8, 2).unwrap();
        assert!(matches!(
            p.rank_of(8),
            Err(TopologyError::IndexOutOfRange { arg: "expert", .. })
        ));
        assert!(p.local_index(8).is_err());
        assert!(matches!(
            p.global_expert(2, 0),
            Err(TopologyError::IndexOutOfRange { arg: "rank", .. })
        ));
        assert!(matches!(
            p.global_expert(0, 4),
            Err(TopologyError::IndexOutOfRange { arg: "local", .. })
        ));
        assert!(p.experts_of(2).is_err());
        assert!(p.experts_per_node(0).is_err());
        assert!(p.experts_per_node(3).is_err());
        assert!(p.node_of(8, 1).is_err());
    }

    proptest! {
        #[test]
        fn roundtrip(world in 1usize..16, epr in 1usize..16, e_seed in any::<usize>()) {
            let p = ExpertPlacement::new(world * epr, world).unwrap();
            let e = e_seed % (world * epr);
            let r = p.rank_of(e).unwrap();
            let l = p.local_index(e).unwrap();
            prop_assert!(r < world);
            prop_assert!(l < epr);
            prop_assert_eq!(p.global_expert(r, l).unwrap(), e);
            prop_assert!(p.experts_of(r).unwrap().contains(&e));
        }
    }
}
