//! CPU-proxy transport groundwork: GPU kernels (later) write compact descriptors into a ring in
//! host-mapped memory; one proxy thread per GPU drains it in order, hands the work to an
//! executor and publishes completions the GPU polls with bounded waits.
//!
//! One idea per module:
//!
//! * [`descriptor`] — the 32-byte `#[repr(C)]` record (transfer, signal), its bits, and
//!   validated encoding/decoding;
//! * [`ring`] — the single-producer/single-consumer protocol over a memory region:
//!   sequence-tagged slots, head/tail words, back-pressure, completions, status;
//! * [`coalesce`] — merging contiguous transfers to the same peer;
//! * [`completion`] — the prefix count of complete descriptors;
//! * [`executor`] — the role that moves the bytes ([`Executor`]) and its contract;
//! * [`host`] — an executor over symmetric buffers in host memory;
//! * [`proxy`] — the proxy loop, its thread, flow control, shutdown and errors;
//! * `verbs` (feature `verbs`) — RDMA device enumeration through `libibverbs.so.1` opened at
//!   run time.
//!
//! Under `RUSTFLAGS="--cfg loom"` only the descriptor, ring and coalescing modules are built,
//! on loom's atomics (`tests/loom.rs`).
//!
//! # Example
//!
//! A proxy for rank 0 of two, moving bytes between host buffers:
//!
//! ```
//! use std::time::Duration;
//! use epcomm_proxy::{
//!     Descriptor, HostExecutor, HostHeap, Limits, Proxy, ProxyConfig, RingMemory, Signal,
//!     SignalOp, Transfer, ring,
//! };
//!
//! let limits = Limits { world: 2, heap_bytes: 4096 };
//! let heap = HostHeap::new(2, 4096);
//! heap.write(0, 0, b"hello")?;
//! let (mut producer, consumer) = ring::split(RingMemory::allocate(8)?);
//! let proxy = Proxy::spawn(consumer, HostExecutor::new(heap.clone(), 0, 16), ProxyConfig::new(limits))?;
//! let t = Descriptor::Transfer(Transfer { peer: 1, src_offset: 0, dst_offset: 64, bytes: 5 });
//! let s = Descriptor::Signal(Signal { peer: 1, offset: 8, value: 1, op: SignalOp::Add });
//! producer.push(&t, &limits, Duration::from_secs(5))?;
//! producer.push(&s, &limits, Duration::from_secs(5))?;
//! producer.wait_completed(2, Duration::from_secs(5))?;
//! assert_eq!(heap.read(1, 64, 5)?, b"hello");
//! assert_eq!(heap.word(1, 8)?, 1);
//! let report = proxy.shutdown()?;
//! assert_eq!(report.descriptors, 2);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod coalesce;
pub mod descriptor;
pub mod ring;
mod sync;
mod wait;

#[cfg(not(loom))]
pub mod completion;
#[cfg(not(loom))]
pub mod executor;
#[cfg(not(loom))]
pub mod host;
#[cfg(not(loom))]
pub mod proxy;
#[cfg(all(feature = "verbs", not(loom)))]
pub mod verbs;

pub use coalesce::{Coalescer, Op};
pub use descriptor::{
    Descriptor, DescriptorError, Field, Limits, RawDescriptor, Signal, SignalOp, Transfer,
};
pub use ring::{Consumer, Producer, RingError, RingMemory};

#[cfg(not(loom))]
pub use completion::Completions;
#[cfg(not(loom))]
pub use executor::{Executor, OpFailure, OpId, Submit};
#[cfg(not(loom))]
pub use host::{HostError, HostExecutor, HostHeap};
#[cfg(not(loom))]
pub use proxy::{Proxy, ProxyConfig, ProxyError, ProxyReport, run};
