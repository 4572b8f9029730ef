//! The CPU oracle of epcomm's semantics. Every GPU test (and `bench --check`) compares the
//! device results with these functions.
//!
//! Conventions (shared with the GPU ops):
//! * `world` ranks; `num_experts % world == 0`; expert `e` lives on rank `e / (E / world)`
//!   and is local expert `e % (E / world)` there.
//! * `topk_idx` is row-major `[T][K]` i64; `-1` means "no expert"; anything else must be in
//!   `[0, E)`.
//! * [`layout`] counts tokens per rank / node / expert and gives every (token, rank) pair
//!   its slot.
//! * [`dispatch`] sends each token once to every rank holding one of its experts; a rank
//!   receives rows ordered by source rank, then source token index.
//! * [`combine`] sums, for every token, the rows of the ranks it went to, in increasing rank
//!   order, in f32, rounded to bf16 once. [`combine_weighted_ll`] is the low-latency
//!   variant (weighted sum of per-expert outputs); [`ll_dispatch`] gives the rows every rank
//!   receives in a low-latency dispatch, per local expert.
//! * [`hierarchical_combine`] is combine along the internode path (partials per node summed
//!   on the rail peer, crossing the rail as f32 or bf16, then summed in node order);
//!   [`rail_traffic`] counts the rows each tier carries. Dispatch's output is the same on
//!   either path. [`rail_model::summarize`] turns those rows into rail bytes and lower-bound
//!   times at a given NIC bandwidth.
//! * [`quantize_fp8_e4m3_per128`] is DeepEP's per-token, per-128-channel fp8 cast.
//! * [`gen_deepep_workload`] reproduces DeepEP's benchmark inputs, deterministically per seed.
//!
//! # Example
//!
//! Two ranks, four experts (rank 0 holds 0 and 1, rank 1 holds 2 and 3), top-2, 2 channels:
//!
//! ```
//! use epcomm_reference::{RankInput, RefError, XData, bf16, combine, dispatch};
//!
//! let rows = |v: &[f32]| v.iter().copied().map(bf16::from_f32).collect::<Vec<_>>();
//! let inputs = [
//!     // Rank 0: token 0 goes to experts 0 and 3 (both ranks), token 1 to expert 1 only.
//!     RankInput::new(
//!         XData::Bf16(rows(&[1.0, 2.0, 3.0, 4.0])),
//!         vec![0, 3, 1, -1],
//!         vec![0.5, 0.5, 1.0, 0.0],
//!         2,
//!         2,
//!     )?,
//!     // Rank 1: token 0 goes to expert 2.
//!     RankInput::new(XData::Bf16(rows(&[5.0, 6.0])), vec![2, -1], vec![1.0, 0.0], 2, 2)?,
//! ];
//! let received = dispatch(&inputs, 4)?;
//! assert_eq!(received[0].num_recv_tokens, 2);
//! // Rank 1 receives rows ordered by source rank, then source token index.
//! assert_eq!(received[1].recv_src_rank, [0, 1]);
//! assert_eq!(received[1].recv_x, XData::Bf16(rows(&[1.0, 2.0, 5.0, 6.0])));
//!
//! // Identity "experts": every rank sends its received rows straight back.
//! let ys = received
//!     .iter()
//!     .map(|r| r.recv_x.to_bf16(r.hidden))
//!     .collect::<Result<Vec<_>, _>>()?;
//! let combined = combine(&ys, None, &received, &[2, 1])?;
//! // Token 0 of rank 0 went to both ranks, so it comes back twice, summed.
//! assert_eq!(combined[0].x, rows(&[2.0, 4.0, 3.0, 4.0]));
//! assert_eq!(combined[1].x, rows(&[5.0, 6.0]));
//! # Ok::<(), RefError>(())
//! ```

mod combine;
mod dispatch;
mod error;
mod fp8;
mod hierarchical;
mod layout;
mod low_latency;
pub mod rail_model;
mod workload;

pub use combine::{CombineOutput, combine, combine_weighted_ll};
pub use dispatch::{RankInput, RankOutput, XData, dispatch};
pub use error::RefError;
pub use fp8::{
    FP8_AMAX_FLOOR, FP8_E4M3_MAX, FP8_GROUP, dequantize_fp8_e4m3_per128, quantize_fp8_e4m3_per128,
    quantize_fp8_e4m3_per128_ue8m0,
};
pub use hierarchical::{
    RailTraffic, across_rail, hierarchical_combine, hierarchical_combine_staged, rail_traffic,
    two_node_example_routing,
};
pub use layout::{Layout, layout};
pub use low_latency::{LlEntry, LlReceived, ll_dispatch};
pub use workload::{
    Workload, gen_deepep_workload, gen_deepep_world, mask_topk, randn_f32, skewed_topk,
    small_int_bf16,
};

/// Re-exports of the topology types used in the API.
pub use epcomm_topology::{RailPrecision, Tiers};

/// Re-exports of the element types used in the API.
pub use float8::F8E4M3;
pub use half::bf16;

/// Result alias of this crate.
pub type Result<T, E = RefError> = std::result::Result<T, E>;
