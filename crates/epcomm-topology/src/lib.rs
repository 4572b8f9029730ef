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
