//! Pure topology math for epcomm (no GPU; no I/O but [`pci`]'s reads of sysfs).
//!
//! * [`WorldLayout`] — world size, rank, nodes, NVLink domains, RDMA ranks, and *virtual
//!   nodes* (one host's GPUs split into several logical nodes so internode code paths run on
//!   a single machine).
//! * [`Schedule`], [`Route`], [`Tier`] and the per-`Buffer` [`RoutePlan`] — how ranks agree
//!   that memory may be reused, and how each peer is reached.
//! * [`RowFormat`] — bytes, FP8 scales and pitch of one token row.
//! * [`BufferPlan`] — the byte layout of the symmetric buffer used by the intranode kernels.
//! * [`RankGroup`] — the ranks one buffer spans (the whole world, or a tier's rail or node
//!   group).
//! * [`pci`] — where PCI functions sit in the host's PCI tree (sysfs) and how far apart they
//!   are: which RDMA device is nearest a GPU.
//! * [`Tiers`] — a world as nodes × local ranks, [`RailPrecision`], and the worst-case sizes
//!   of the hierarchical (rail + NVLink forwarding) buffers ([`rail_recv_rows`],
//!   [`forward_rows`], [`combine_rail_partial_rows`] and their byte sizes); [`RingShape`], the
//!   rail rings of the fused design and the chunk a memory budget allows.
//!
//! Every constructor validates its inputs and returns a typed [`TopologyError`] naming the
//! argument and the rule it broke; nothing here panics on bad input.
//!
//! # Example
//!
//! ```
//! use epcomm_topology::{Route, RoutePlan, RoutePolicy, TopologyError, WorldLayout};
//!
//! // 16 ranks, 8 GPUs per node, seen from rank 11.
//! let world = WorldLayout::new(16, 11, 8)?;
//! assert_eq!((world.node(), world.local_rank()), (1, 3));
//! assert_eq!(world.nvlink_domain(), 8..16);
//! // The RDMA peer in node 0: the rank there with the same local rank.
//! assert_eq!(world.peer_in_node(0)?, 3);
//!
//! // Stores inside the node, put/signal to the other node (for a backend that has both).
//! let plan = RoutePlan::new(&world, &[Route::Store, Route::PutSignal], RoutePolicy::Auto)?;
//! assert_eq!((plan.route(9), plan.route(3)), (Some(Route::Store), Some(Route::PutSignal)));
//! assert_eq!(plan.put_signal_mask(), 0x00ff);
//!
//! // Bad input is a typed error naming the argument, not a panic.
//! let err = WorldLayout::new(12, 0, 8).unwrap_err();
//! assert_eq!(err.to_string(), "`world_size` (12) must be a multiple of `gpus_per_node` (8)");
//! # Ok::<(), TopologyError>(())
//! ```

mod error;
mod group;
pub mod pci;
mod plan;
mod ring;
mod route;
mod row;
mod tiers;
mod world;

pub use error::TopologyError;
pub use group::RankGroup;
pub use plan::{BufferPlan, Parity, REGION_ALIGN, Region, RegionKind, STATS_BYTES};
pub use ring::{MAX_RING_SLOTS, RingShape, ring_entry_bytes};
pub use route::{PeerRoute, Route, RoutePlan, RoutePolicy, Schedule, Tier};
pub use row::{RowDtype, RowFormat};
pub use tiers::{
    RailPrecision, Tiers, combine_partial_row_bytes, combine_rail_partial_bytes,
    combine_rail_partial_rows, dispatch_row_bytes, forward_rows, rail_recv_bytes, rail_recv_rows,
};
pub use world::WorldLayout;

/// Result alias of this crate.
pub type Result<T, E = TopologyError> = std::result::Result<T, E>;
