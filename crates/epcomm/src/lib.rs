//! epcomm: expert-parallel (MoE) communication on NVIDIA GPUs.
//!
//! One [`Buffer`] per process (per GPU) owns a transport, a symmetric buffer and a stream, and
//! exposes the MoE all-to-all:
//!
//! * [`Buffer::layout`] — routing statistics of `topk_idx` on the GPU ([`Layout`]);
//! * [`Buffer::dispatch`] — every token to each rank that holds one of its experts
//!   ([`Dispatched`]: received rows, local top-k ids and weights, a [`Handle`]);
//! * [`Buffer::cached_dispatch`] — the same routing again, without the count exchange;
//! * [`Buffer::combine`] — the reverse path, summing each token's contributions (fp32, rank
//!   order, deterministic).
//!
//! Every op is stream-ordered on [`Buffer::stream`]; none reads device memory from the host
//! unless the caller picks [`RecvMode::HostSync`]. Every device wait is bounded: a stalled peer
//! yields [`Error::Timeout`] naming the op, the wait and the peer, and marks the buffer failed.
//!
//! Received rows are **not copied**: peers write them straight into this rank's symmetric
//! buffer, in their final order (by source rank, then source token index), and [`Dispatched`]
//! views that memory. The view borrows the `Buffer`, so no new op can start on the host while it
//! is alive; on the device, the rows stay valid until this rank's stream starts its next
//! dispatch (make it wait for your expert kernels with [`Buffer::wait_event`]).
//!
//! Ops can also be captured into a CUDA graph and replayed ([`Buffer::capture`]): kernels read
//! their sequence numbers from device memory, never from their arguments.
//!
//! # Examples
//!
//! A [`BufferConfig`] can be checked without a GPU; every rank must use the same one:
//!
//! ```
//! use epcomm::{BufferConfig, Error, RoutePolicy, Schedule};
//!
//! // 4096 tokens per rank at most, hidden 7168, top-8 of 256 experts.
//! let cfg = BufferConfig::new(4096, 7168, 8, 256);
//! assert_eq!((cfg.schedule, cfg.routes), (Schedule::Epoch, RoutePolicy::Auto));
//! cfg.validate()?;
//!
//! // A hidden size that is not a multiple of 8 is rejected, naming the field.
//! let bad = BufferConfig { hidden: 7001, ..cfg };
//! assert!(matches!(bad.validate(), Err(Error::InvalidArgument { argument: "hidden", .. })));
//! # Ok::<(), Error>(())
//! ```
//!
//! One rank of a job (one process per GPU, launched by torchrun or the like); the transport
//! comes from a spec string through `epcomm-backends`, so this crate never names a backend:
//!
//! ```no_run
//! use std::sync::Arc;
//!
//! use cudarc::driver::CudaContext;
//! use epcomm::{Buffer, BufferConfig, CombineInput, CombineOutput, DispatchInput, RecvMode, XInput};
//! use epcomm_backends::TransportSpec;
//! use epcomm_bootstrap::{Bootstrap, BootstrapConfig};
//! use half::bf16;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let (num_tokens, hidden, top_k, num_experts) = (128, 7168, 8, 256);
//! // Rendezvous with the other ranks (MASTER_ADDR, RANK, WORLD_SIZE, ... from the launcher).
//! let boot = Arc::new(Bootstrap::connect(BootstrapConfig::from_env()?)?);
//! let ctx = CudaContext::new(boot.local_rank())?;
//! let transport = "ipc".parse::<TransportSpec>()?.build(ctx.clone(), boot)?;
//! let mut buf = Buffer::new(ctx, transport, BufferConfig::new(4096, hidden, top_k, num_experts))?;
//!
//! // This rank's tokens and routing, on the device.
//! let stream = buf.stream().clone();
//! let x = stream.alloc_zeros::<bf16>(num_tokens * hidden)?;
//! let topk_idx = stream.clone_htod(&vec![0_i64; num_tokens * top_k])?;
//! let topk_weights = stream.clone_htod(&vec![1.0_f32 / top_k as f32; num_tokens * top_k])?;
//!
//! let layout = buf.layout(&topk_idx, num_tokens)?;
//! let input = DispatchInput {
//!     x: XInput::Bf16(&x),
//!     topk_idx: &topk_idx,
//!     topk_weights: Some(&topk_weights),
//! };
//! let dispatched = buf.dispatch(&input, &layout, RecvMode::HostSync)?;
//! let rows = dispatched.num_recv().expect("HostSync reports the count");
//! // ... the experts read the received rows at dispatched.recv_x_ptr() and write `y` ...
//! let handle = dispatched.into_handle();
//! let y = stream.alloc_zeros::<bf16>(rows.max(1) * hidden)?;
//! let mut out = stream.alloc_zeros::<bf16>(num_tokens * hidden)?;
//! buf.combine(&CombineInput::new(&y), &handle, CombineOutput::new(&mut out))?;
//! buf.synchronize()?;
//! # Ok(())
//! # }
//! ```

mod agreement;
mod buffer;
mod config;
mod ep;
mod error;
mod handle;
mod hierarchical;
mod layout;
pub mod rules;
mod stats;
mod view;

pub use buffer::{
    Buffer, CombineInput, CombineOutput, CountedRows, DeviceBytes, DispatchInput, EpGraph,
    LlDispatchInput, LlFormat, LlPending, LlRecv, LlScalesLayout, RecvArray, XInput,
};
pub use config::{BufferConfig, CombineStaging, RecvMode};
pub use ep::{ExpertParallel, TierStats, Tiering};
pub use epcomm_topology::{
    PeerRoute, RankGroup, Route, RoutePlan, RoutePolicy, Schedule, Tier, Tiers,
};
pub use epcomm_transport::{DynTransport, Transport};
pub use error::{Error, WaitKind};
pub use handle::{Dispatched, Handle, RecvDtype};
pub use hierarchical::{HierStats, HierarchicalBuffer};
pub use layout::{HostLayout, Layout};
pub use stats::OpStats;

/// Results of epcomm operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;
