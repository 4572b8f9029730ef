//! The native layer of the `epcomm` Python package (`python/`): epcomm's dispatch and combine
//! driven through raw device addresses, shapes and the buffer's CUDA stream, so that it knows
//! nothing of PyTorch. The pure-Python package on top allocates the outputs with torch, orders
//! torch's streams against the buffer's with events and returns tensors.
//!
//! Layers, each in its own module:
//!
//! | module | what |
//! |---|---|
//! | `borrowed` | [`Borrowed`]: a caller's `(address, length)` as cudarc's `DevicePtr` |
//! | `options` | [`BufferOptions`]: the Python arguments, checked, as the frontend's config and plan |
//! | `fence` | [`Fence`]: the buffer's stream ordered after, and joined back into, a caller's stream |
//! | `session` | [`Session`]: one rank's `Buffer` on the device's primary context (the one torch uses) |
//! | `workload` | DeepEP's benchmark workload as `epcomm bench` generates it, as bytes |
//! | `error` | [`BindError`] and the Python exception each becomes ([`ErrorInfo`]) |
//! | `python` | the PyO3 module `epcomm._native` (feature `python`, on in the wheel build) |
//!
//! Everything but `python` is plain Rust, tested by `cargo test` without Python; the `python`
//! feature is off in the workspace build, so no test executable links libpython.
//!
//! # Example
//!
//! The options a Python `Buffer` is made from resolve without a GPU:
//!
//! ```
//! use epcomm_py::BufferOptions;
//!
//! let options = BufferOptions {
//!     max_tokens_per_rank: 4096,
//!     hidden: 7168,
//!     top_k: 8,
//!     num_experts: 256,
//!     num_sms: 24,
//!     transport: "ipc".into(),
//!     schedule: "epoch".into(),
//!     routes: "auto".into(),
//!     timeout_s: 100.0,
//!     ll_max_tokens_per_rank: 0,
//!     ll_masking: false,
//!     two_tier: false,
//! };
//! // Two ranks on one host, seen from rank 0.
//! let (cfg, spec, plan) = options.resolve(2, 0, 2)?;
//! assert_eq!((cfg.hidden, spec.to_string()), (7168, "ipc".to_string()));
//! assert_eq!(plan.recv_rows(), 2 * 4096);
//! # Ok::<(), epcomm_py::BindError>(())
//! ```

mod borrowed;
mod error;
mod fence;
mod options;
mod session;
mod workload;

#[cfg(feature = "python")]
mod python;

pub use borrowed::{Borrowed, RawArray};
pub use error::{Attr, BindError, ErrorInfo, Result};
pub use fence::Fence;
pub use options::{BufferOptions, low_latency_bytes, plan, seconds};
pub use session::{DispatchOut, LlDispatchOut, LlOp, Rows, Session, XArrays};
pub use workload::{WorkloadBytes, deepep_workload, rank_seed};
