//! Pure topology math for epcomm (no GPU, no I/O).
//!
//! * [`WorldLayout`] — world size, rank, nodes, NVLink domains, RDMA ranks, and *virtual
//!   nodes* (one host's GPUs split into several logical nodes so internode code paths run on
//!   a single machine).
//! * [`ExpertPlacement`] — which rank holds which expert (`E % world == 0`, contiguous blocks).
//! * [`CommConfig`] — SM count / chunking knobs, their validation, and a bandwidth model
//!   ([`CommConfig::suggest`]) that picks the fewest SMs that saturate the link.
//! * [`BufferPlan`] — the byte layout of the symmetric buffer used by the intranode kernels.
//!
//! Every constructor validates its inputs and returns a typed [`TopologyError`] naming the
//! argument and the rule it broke; nothing here panics on bad input.
//!
//! # Example
//!
//! ```
//! use epcomm_topology::{ExpertPlacement, TopologyError, WorldLayout};
//!
//! // 16 ranks, 8 GPUs per node, seen from rank 11.
//! let world = WorldLayout::new(16, 11, 8)?;
//! assert_eq!((world.node(), world.local_rank()), (1, 3));
//! assert_eq!(world.nvlink_domain(), 8..16);
//! // The RDMA peer in node 0: the rank there with the same local rank.
//! assert_eq!(world.peer_in_node(0)?, 3);
//!
//! // 256 experts over those 16 ranks: 16 per rank, in contiguous blocks.
//! let experts = ExpertPlacement::new(256, 16)?;
//! assert_eq!(experts.rank_of(200)?, 12);
//! assert_eq!(experts.experts_of(11)?, 176..192);
//!
//! // Bad input is a typed error naming the argument, not a panic.
//! let err = WorldLayout::new(12, 0, 8).unwrap_err();
//! assert_eq!(err.to_string(), "`world_size` (12) must be a multiple of `gpus_per_node` (8)");
//! # Ok::<(), TopologyError>(())
//! ```

mod buffer;
mod config;
mod error;
mod experts;
mod world;

pub use buffer::{
    BufferPlan, Parity, REGION_ALIGN, Region, RegionKind, RegionOffsets, STATS_BYTES,
};
pub use config::{
    CommConfig, DEFAULT_SM_CAP, DEFAULT_THREADS_PER_BLOCK, MAX_CHUNK_TOKENS, TARGET_CHUNK_BYTES,
};
pub use error::TopologyError;
pub use experts::ExpertPlacement;
pub use world::WorldLayout;

/// Result alias of this crate.
pub type Result<T, E = TopologyError> = std::result::Result<T, E>;
