//! The CPU side of the proxy transport: GPU kernels write compact descriptors into a ring in
//! host-mapped memory; one proxy thread per GPU drains it in order, hands the work to an
//! executor and publishes completions the GPU polls with bounded waits.
//!
//! One idea per module:
//!
//! * [`descriptor`] — the 32-byte `#[repr(C)]` record (transfer, signal, write), its bits,
//!   validated encoding/decoding, and the ordering contract;
//! * [`ring`] — the protocol over a memory region between producers (one host thread, or many
//!   GPU threads claiming positions from a device counter) and one consumer:
//!   sequence-tagged slots, tail word, back-pressure, completions, status;
//! * [`coalesce`] — merging contiguous transfers to the same peer (writes pass through);
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
//!     SignalOp, Source, Transfer, Write, WriteWidth, ring,
//! };
//!
//! let limits = Limits { world: 2, heap_bytes: 4096 };
//! let heap = HostHeap::new(2, 4096);
//! heap.write(0, 0, b"hello")?;
//! let (mut producer, consumer) = ring::split(RingMemory::allocate(8)?);
//! let proxy = Proxy::spawn(consumer, HostExecutor::new(heap.clone(), 0, 16), ProxyConfig::new(limits))?;
//! let t = Descriptor::Transfer(Transfer { peer: 1, src: Source::Heap(0), dst_offset: 64, bytes: 5 });
//! let w = Descriptor::Write(Write::one(1, 72, 7, WriteWidth::Four));
//! let s = Descriptor::Signal(Signal::word(1, 8, 1, SignalOp::Add));
//! for d in [t, w, s] {
//!     producer.push(&d, &limits, Duration::from_secs(5))?;
//! }
//! producer.wait_completed(3, Duration::from_secs(5))?;
//! assert_eq!(heap.read(1, 64, 5)?, b"hello");
//! assert_eq!(heap.read(1, 72, 4)?, 7u32.to_le_bytes());
//! assert_eq!(heap.word(1, 8)?, 1);
//! let report = proxy.shutdown()?;
//! assert_eq!((report.descriptors, report.writes), (3, 1));
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
    Descriptor, DescriptorError, Field, Limits, RawDescriptor, Signal, SignalOp, Source, Transfer,
    Write, WriteWidth,
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
