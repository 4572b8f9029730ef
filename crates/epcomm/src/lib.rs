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

mod agreement;
mod buffer;
mod config;
mod error;
mod handle;
mod layout;
mod pointers;
mod stats;

pub use buffer::{Buffer, DispatchInput, EpGraph, XInput};
pub use config::{BufferConfig, RecvMode};
pub use epcomm_transport::{BarrierStrategy, Transport};
pub use epcomm_transport_ipc::IpcTransport;
pub use error::{Error, WaitKind};
pub use handle::{Dispatched, Handle, RecvDtype};
pub use layout::{HostLayout, Layout};
pub use stats::OpStats;

/// Results of epcomm operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;
