//! Ranks, nodes, NVLink domains and RDMA ranks.

use std::ops::Range;

use crate::{Result, TopologyError};

/// Where one rank sits in the world.
///
/// Ranks are numbered node-major: node `n` holds ranks
/// `n * gpus_per_node .. (n + 1) * gpus_per_node`, and a rank's *local rank* is its index
/// inside its node. A *node* is the unit the kernels treat as one NVLink domain; traffic
/// between nodes takes the RDMA leg (one hop to the GPU with the same local rank in the
/// destination node, whose index is the node index — the *RDMA rank*).
///
/// **Virtual nodes.** [`WorldLayout::with_virtual_nodes`] splits each physical host's GPUs
/// into several logical nodes (down to one GPU per node) so that the internode code paths
/// can run on a single machine. Then two ranks may be in different *logical* nodes
/// ([`same_node`](Self::same_node) is false) yet still be *physically* NVLink-reachable
/// ([`nvlink_reachable`](Self::nvlink_reachable) is true). Code that decides *which
/// protocol* to use must look at the logical node; code that decides *how to move bytes*
/// (e.g. whether a peer pointer can be mapped) may look at the physical host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WorldLayout {
    world_size: usize,
    rank: usize,
    /// Logical node size.
    gpus_per_node: usize,
    /// GPUs of one physical host (== `gpus_per_node` unless virtual).
    physical_gpus_per_node: usize,
}

impl WorldLayout {
    /// A layout of `world_size` ranks, `gpus_per_node` per node (any positive number), seen
    /// from `rank`.
    ///
    /// # Errors
    /// `world_size`, `gpus_per_node` must be > 0; `world_size % gpus_per_node == 0`;
    /// `rank < world_size`.
    pub fn new(world_size: usize, rank: usize, gpus_per_node: usize) -> Result<Self> {
        TopologyError::zero_check("world_size", world_size)?;
        TopologyError::zero_check("gpus_per_node", gpus_per_node)?;
        TopologyError::multiple_check("world_size", world_size, "gpus_per_node", gpus_per_node)?;
        TopologyError::index_check("rank", rank, "world_size", world_size)?;
        Ok(Self {
            world_size,
            rank,
            gpus_per_node,
            physical_gpus_per_node: gpus_per_node,
        })
    }

    /// A layout where each physical host of `physical_gpus_per_node` GPUs is split into
    /// `virtual_nodes_per_host` logical nodes of `physical_gpus_per_node /
    /// virtual_nodes_per_host` GPUs each (1 GPU per node is allowed).
    /// `virtual_nodes_per_host == 1` gives the same layout as [`WorldLayout::new`].
    ///
    /// # Errors
    /// All arguments but `rank` must be > 0; `world_size % physical_gpus_per_node == 0`;
    /// `physical_gpus_per_node % virtual_nodes_per_host == 0`; `rank < world_size`.
    pub fn with_virtual_nodes(
        world_size: usize,
        rank: usize,
        physical_gpus_per_node: usize,
        virtual_nodes_per_host: usize,
    ) -> Result<Self> {
        TopologyError::zero_check("virtual_nodes_per_host", virtual_nodes_per_host)?;
        let mut layout =
            Self::new(world_size, rank, physical_gpus_per_node).map_err(|e| match e {
                TopologyError::Zero {
                    arg: "gpus_per_node",
                } => TopologyError::Zero {
                    arg: "physical_gpus_per_node",
                },
                TopologyError::NotMultiple {
                    arg,
                    value,
                    divisor,
                    ..
                } => TopologyError::NotMultiple {
                    arg,
                    value,
                    divisor_arg: "physical_gpus_per_node",
                    divisor,
                },
                other => other,
            })?;
        TopologyError::multiple_check(
            "physical_gpus_per_node",
            physical_gpus_per_node,
            "virtual_nodes_per_host",
            virtual_nodes_per_host,
        )?;
        layout.gpus_per_node = physical_gpus_per_node / virtual_nodes_per_host;
        Ok(layout)
    }

    /// The same world seen from another rank.
    ///
    /// # Errors
    /// `rank < world_size`.
    pub fn for_rank(&self, rank: usize) -> Result<Self> {
        TopologyError::index_check("rank", rank, "world_size", self.world_size)?;
        Ok(Self { rank, ..*self })
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks per (logical) node.
    pub fn gpus_per_node(&self) -> usize {
        self.gpus_per_node
    }

    /// GPUs per physical host (equals [`gpus_per_node`](Self::gpus_per_node) unless virtual).
    pub fn physical_gpus_per_node(&self) -> usize {
        self.physical_gpus_per_node
    }

    /// Logical nodes per physical host (1 unless virtual).
    pub fn virtual_nodes_per_host(&self) -> usize {
        self.physical_gpus_per_node / self.gpus_per_node
    }

    /// Whether physical hosts are split into several logical nodes.
    pub fn is_virtual(&self) -> bool {
        self.physical_gpus_per_node != self.gpus_per_node
    }

    /// Index of this rank's (logical) node.
    pub fn node(&self) -> usize {
        self.rank / self.gpus_per_node
    }

    /// Index of this rank inside its node.
    pub fn local_rank(&self) -> usize {
        self.rank % self.gpus_per_node
    }

    /// Number of (logical) nodes.
    pub fn num_nodes(&self) -> usize {
        self.world_size / self.gpus_per_node
    }

    /// This rank's RDMA rank: the index of its node among the ranks that share its local
    /// rank (equal to [`node`](Self::node)).
    pub fn rdma_rank(&self) -> usize {
        self.node()
    }

    /// Number of RDMA ranks (equal to [`num_nodes`](Self::num_nodes)).
    pub fn num_rdma_ranks(&self) -> usize {
        self.num_nodes()
    }

    /// Ranks of logical node `node`.
    ///
    /// # Errors
    /// `node < num_nodes()`.
    pub fn ranks_in_node(&self, node: usize) -> Result<Range<usize>> {
        TopologyError::index_check("node", node, "num_nodes", self.num_nodes())?;
        Ok(node * self.gpus_per_node..(node + 1) * self.gpus_per_node)
    }

    /// The ranks of this rank's logical node: the peers the kernels reach with the
    /// intranode (NVLink) protocol.
    pub fn nvlink_domain(&self) -> Range<usize> {
        let n = self.node();
        n * self.gpus_per_node..(n + 1) * self.gpus_per_node
    }

    /// The logical node of `rank`.
    ///
    /// # Errors
    /// `rank < world_size`.
    pub fn node_of(&self, rank: usize) -> Result<usize> {
        TopologyError::index_check("rank", rank, "world_size", self.world_size)?;
        Ok(rank / self.gpus_per_node)
    }

    /// The local rank of `rank` inside its logical node.
    ///
    /// # Errors
    /// `rank < world_size`.
    pub fn local_rank_of(&self, rank: usize) -> Result<usize> {
        TopologyError::index_check("rank", rank, "world_size", self.world_size)?;
        Ok(rank % self.gpus_per_node)
    }

    /// The rank in node `node` with the same local rank as this one (this rank itself when
    /// `node == self.node()`): the RDMA peer a token for `node` is sent to.
    ///
    /// # Errors
    /// `node < num_nodes()`.
    pub fn peer_in_node(&self, node: usize) -> Result<usize> {
        TopologyError::index_check("node", node, "num_nodes", self.num_nodes())?;
        Ok(node * self.gpus_per_node + self.local_rank())
    }

    /// The RDMA peers of this rank: for every node, the rank with the same local rank
    /// (including this rank itself), in node order.
    pub fn rdma_peers(&self) -> impl Iterator<Item = usize> + '_ {
        let local = self.local_rank();
        (0..self.num_nodes()).map(move |n| n * self.gpus_per_node + local)
    }

    /// Whether `peer` is in this rank's logical node.
    ///
    /// # Errors
    /// `peer < world_size`.
    pub fn same_node(&self, peer: usize) -> Result<bool> {
        Ok(self.node_of(peer)? == self.node())
    }

    /// Index of this rank's physical host.
    pub fn host(&self) -> usize {
        self.rank / self.physical_gpus_per_node
    }

    /// Number of physical hosts.
    pub fn num_hosts(&self) -> usize {
        self.world_size / self.physical_gpus_per_node
    }

    /// The ranks on this rank's physical host: the peers that are physically reachable over
    /// NVLink (a superset of [`nvlink_domain`](Self::nvlink_domain) when virtual).
    pub fn physical_nvlink_domain(&self) -> Range<usize> {
        let h = self.host();
        h * self.physical_gpus_per_node..(h + 1) * self.physical_gpus_per_node
    }

    /// Whether `peer` is on this rank's physical host (so a peer pointer could be mapped),
    /// regardless of logical node boundaries.
    ///
    /// # Errors
    /// `peer < world_size`.
    pub fn nvlink_reachable(&self, peer: usize) -> Result<bool> {
        TopologyError::index_check("peer", peer, "world_size", self.world_size)?;
        Ok(peer / self.physical_gpus_per_node == self.host())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn basic_two_nodes_of_eight() {
        let w = WorldLayout::new(16, 11, 8).unwrap();
        assert_eq!(w.node(), 1);
        assert_eq!(w.local_rank(), 3);
        assert_eq!(w.num_nodes(), 2);
        assert_eq!(w.rdma_rank(), 1);
        assert_eq!(w.num_rdma_ranks(), 2);
        assert_eq!(w.nvlink_domain(), 8..16);
        assert_eq!(w.ranks_in_node(0).unwrap(), 0..8);
        assert_eq!(w.peer_in_node(0).unwrap(), 3);
        assert_eq!(w.peer_in_node(1).unwrap(), 11);
        assert_eq!(w.rdma_peers().collect::<Vec<_>>(), vec![3, 11]);
        assert!(!w.is_virtual());
        assert_eq!(w.virtual_nodes_per_host(), 1);
        assert_eq!(w.physical_nvlink_domain(), 8..16);
        assert!(w.same_node(8).unwrap());
        assert!(!w.same_node(7).unwrap());
        assert!(w.nvlink_reachable(15).unwrap());
        assert!(!w.nvlink_reachable(0).unwrap());
        assert_eq!(w.node_of(7).unwrap(), 0);
        assert_eq!(w.local_rank_of(9).unwrap(), 1);
        assert_eq!(w.host(), 1);
        assert_eq!(w.num_hosts(), 2);
    }

    #[test]
    fn non_power_of_two_node_size() {
        let w = WorldLayout::new(12, 7, 3).unwrap();
        assert_eq!((w.node(), w.local_rank(), w.num_nodes()), (2, 1, 4));
        assert_eq!(w.nvlink_domain(), 6..9);
        assert_eq!(w.rdma_peers().collect::<Vec<_>>(), vec![1, 4, 7, 10]);
    }

    #[test]
    fn single_rank() {
        let w = WorldLayout::new(1, 0, 1).unwrap();
        assert_eq!((w.node(), w.local_rank(), w.num_nodes()), (0, 0, 1));
        assert_eq!(w.nvlink_domain(), 0..1);
    }

    #[test]
    fn errors_name_argument() {
        assert_eq!(
            WorldLayout::new(0, 0, 1),
            Err(TopologyError::Zero { arg: "world_size" })
        );
        assert_eq!(
            WorldLayout::new(8, 0, 0),
            Err(TopologyError::Zero {
                arg: "gpus_per_node"
            })
        );
        assert!(matches!(
            WorldLayout::new(12, 0, 8),
            Err(TopologyError::NotMultiple {
                arg: "world_size",
                divisor_arg: "gpus_per_node",
                ..
            })
        ));
        assert!(matches!(
            WorldLayout::new(8, 8, 8),
            Err(TopologyError::IndexOutOfRange { arg: "rank", .. })
        ));
        let w = WorldLayout::new(8, 0, 4).unwrap();
        assert!(w.ranks_in_node(2).is_err());
        assert!(w.peer_in_node(2).is_err());
        assert!(w.node_of(8).is_err());
        assert!(w.local_rank_of(8).is_err());
        assert!(w.same_node(8).is_err());
        assert!(w.nvlink_reachable(8).is_err());
        assert!(w.for_rank(8).is_err());
    }

    #[test]
    fn virtual_one_gpu_per_node() {
        // Two physical GPUs split into two 1-GPU nodes: every peer is "internode" but still
        // physically NVLink-reachable.
        let w = WorldLayout::with_virtual_nodes(2, 1, 2, 2).unwrap();
        assert!(w.is_virtual());
        assert_eq!(w.gpus_per_node(), 1);
        assert_eq!(w.physical_gpus_per_node(), 2);
        assert_eq!(w.virtual_nodes_per_host(), 2);
        assert_eq!((w.node(), w.local_rank(), w.num_nodes()), (1, 0, 2));
        assert_eq!(w.rdma_rank(), 1);
        assert_eq!(w.nvlink_domain(), 1..2);
        assert_eq!(w.physical_nvlink_domain(), 0..2);
        assert!(!w.same_node(0).unwrap());
        assert!(w.nvlink_reachable(0).unwrap());
        assert_eq!(w.peer_in_node(0).unwrap(), 0);
        assert_eq!(w.host(), 0);
        assert_eq!(w.num_hosts(), 1);
    }

    #[test]
    fn virtual_two_hosts_split_in_four() {
        let w = WorldLayout::with_virtual_nodes(16, 13, 8, 4).unwrap();
        assert_eq!(w.gpus_per_node(), 2);
        assert_eq!(w.num_nodes(), 8);
        assert_eq!(w.node(), 6);
        assert_eq!(w.local_rank(), 1);
        assert_eq!(w.nvlink_domain(), 12..14);
        assert_eq!(w.physical_nvlink_domain(), 8..16);
        assert!(w.nvlink_reachable(8).unwrap());
        assert!(!w.same_node(8).unwrap());
        assert!(!w.nvlink_reachable(7).unwrap());
        let same = WorldLayout::with_virtual_nodes(16, 13, 8, 1).unwrap();
        assert_eq!(same, WorldLayout::new(16, 13, 8).unwrap());
        assert!(!same.is_virtual());
    }

    #[test]
    fn virtual_errors() {
        assert_eq!(
            WorldLayout::with_virtual_nodes(8, 0, 8, 0),
            Err(TopologyError::Zero {
                arg: "virtual_nodes_per_host"
            })
        );
        assert_eq!(
            WorldLayout::with_virtual_nodes(8, 0, 0, 1),
            Err(TopologyError::Zero {
                arg: "physical_gpus_per_node"
            })
        );
        assert!(matches!(
            WorldLayout::with_virtual_nodes(8, 0, 8, 3),
            Err(TopologyError::NotMultiple {
                arg: "physical_gpus_per_node",
                divisor_arg: "virtual_nodes_per_host",
                ..
            })
        ));
        assert!(matches!(
            WorldLayout::with_virtual_nodes(12, 0, 8, 2),
            Err(TopologyError::NotMultiple {
                arg: "world_size",
                divisor_arg: "physical_gpus_per_node",
                ..
            })
        ));
    }

    #[test]
    fn for_rank_keeps_shape() {
        let w = WorldLayout::with_virtual_nodes(4, 0, 4, 2).unwrap();
        let o = w.for_rank(3).unwrap();
        assert_eq!(o.rank(), 3);
        assert_eq!(o.gpus_per_node(), 2);
        assert_eq!(o.node(), 1);
        assert!(o.is_virtual());
    }
}
