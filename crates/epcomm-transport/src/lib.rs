//! The transport layer of epcomm: what a backend must provide so that the kernels can move
//! tokens between ranks, split into roles.
//!
//! * [`SymmetricHeap`] — collective allocation of a **symmetric buffer** (same size and layout
//!   on every rank), and [`SymmetricMemory`]: this rank's base address and, per peer, whether
//!   this process can store to it directly (a mapping) or only reach it through the backend's
//!   put/signal operations.
//! * [`DeviceRuntime`] — the kernel image a backend needs ([`KernelFamily`]) and the binding of a
//!   loaded module to the backend's device runtime (NVSHMEM's `nvshmemx_cumodule_init`).
//! * [`Transport`] — both roles plus [`Capabilities`] (schedules and routes the backend
//!   supports) and the [`WorldLayout`] it sees. Host collectives (all-gather, barrier) are not a
//!   backend's business: they come from the [`Bootstrap`] every transport is built on
//!   ([`Transport::bootstrap`]).
//!
//! * [`Backend`] ([`registry`]) — the table entry a backend crate exports so that a spec string
//!   names it and tools describe, check and build it without naming the crate (NCCL's plugin
//!   table, versioned by [`REGISTRY_VERSION`]).
//!
//! The traits are statically dispatched (associated types, like `wgpu-hal`'s `Api`);
//! [`DynTransport`] is the object-safe mirror the frontend holds, so it never names a backend.
//!
//! # Ordering contract
//! Kernels publish with *data stores, then a system-scope release operation* (a release add on a
//! peer's counter, or a release store of a tagged word) and consume with an acquire load of that
//! word before reading the data. A backend must guarantee that a peer address it hands out
//! preserves this order (NVLink P2P mappings do). Peers without such an address are reached
//! with the transport's own put and signal operations ([`Route::PutSignal`]), which only a
//! device-linked kernel family can issue ([`KernelFamily::NvshmemDevice`]): the data, then a
//! signal that the backend delivers after it (docs/protocol.md, "Net policies").
//! Memory is reused only once every producer that can target it is known to be done
//! (docs/protocol.md).
//!
//! # Example
//!
//! What a backend declares can be inspected without a GPU:
//!
//! ```
//! use epcomm_transport::{Capabilities, KernelFamily, Route, Schedule};
//!
//! let caps = Capabilities {
//!     name: "example",
//!     kernel_family: KernelFamily::NvlinkStore,
//!     schedules: &[Schedule::Global, Schedule::Epoch],
//!     routes: &[Route::Store],
//! };
//! assert!(caps.supports_schedule(Schedule::Epoch));
//! assert!(caps.check_schedule(Schedule::Global).is_ok());
//! assert!(!caps.routes.contains(&Route::PutSignal));
//! ```

pub mod memory;
pub mod registry;
pub mod sources;

use std::fmt::Debug;
use std::sync::Arc;

pub use epcomm_abi::KernelFamily;
pub use epcomm_bootstrap::Bootstrap;
pub use epcomm_topology::{Route, RoutePolicy, Schedule, TopologyError, WorldLayout};
pub use memory::{DeviceBuffer, MappedHostBuffer};
pub use registry::{
    Backend, BackendOptions, ExecutorLimits, Limits, LocatedLibrary, OptionSchema,
    REGISTRY_VERSION, RuntimeLibrary, VirtualNodes,
};

/// What a backend supports; a `Buffer` asking for anything else is a typed error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// Short backend name (`"nvlink-ipc"`, `"nvshmem"`).
    pub name: &'static str,
    /// The kernel image it needs.
    pub kernel_family: KernelFamily,
    /// Schedules its kernels implement.
    pub schedules: &'static [Schedule],
    /// Routes it can reach a peer by.
    pub routes: &'static [Route],
}

impl Capabilities {
    /// Whether `schedule` is supported.
    pub fn supports_schedule(&self, schedule: Schedule) -> bool {
        self.schedules.contains(&schedule)
    }

    /// `Ok` when `schedule` is supported, else an error naming the supported ones.
    pub fn check_schedule(&self, schedule: Schedule) -> Result<(), TransportError> {
        if self.supports_schedule(schedule) {
            return Ok(());
        }
        let names: Vec<_> = self.schedules.iter().map(|s| s.name()).collect();
        Err(TransportError::InvalidArgument {
            argument: "schedule",
            rule: format!(
                "transport {} supports {}, not {schedule}",
                self.name,
                names.join(", ")
            ),
        })
    }
}

/// Errors of transports.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// A CUDA driver call failed.
    #[error("CUDA driver error while {context}: {source}")]
    Driver {
        /// What was being done.
        context: String,
        /// The driver's error.
        #[source]
        source: cudarc::driver::DriverError,
    },
    /// The out-of-band rendezvous failed.
    #[error("bootstrap failed while {context}: {source}")]
    Bootstrap {
        /// What was being done.
        context: String,
        /// The bootstrap's error.
        #[source]
        source: epcomm_bootstrap::BootstrapError,
    },
    /// An argument broke a rule.
    #[error("invalid {argument}: {rule}")]
    InvalidArgument {
        /// The argument.
        argument: &'static str,
        /// The rule it broke.
        rule: String,
    },
    /// A peer sent something this rank cannot use.
    #[error("rank {peer} sent an unusable {what}: {detail}")]
    BadPeerData {
        /// The peer.
        peer: usize,
        /// What it sent.
        what: &'static str,
        /// Why it is unusable.
        detail: String,
    },
    /// A backend library failed (loading, initialisation, allocation).
    #[error("{backend}: {context}: {source}")]
    Backend {
        /// Which backend.
        backend: &'static str,
        /// What was being done.
        context: String,
        /// The backend's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The backend cannot run on this machine: something it needs besides the GPU is absent
    /// (an RDMA device, a runtime library), found before any collective allocation.
    #[error("{what} is unavailable on this machine: {why}")]
    Unavailable {
        /// Which backend (`"proxy-verbs"`).
        what: &'static str,
        /// What is missing, as the failing check reported it.
        why: String,
    },
    /// A topology rule was broken (world layout, route plan).
    #[error(transparent)]
    Topology(#[from] epcomm_topology::TopologyError),
    /// A memory access outside an allocation.
    #[error("{what}: range {offset}..{end} is outside the {len}-byte allocation")]
    OutOfBounds {
        /// Which access.
        what: &'static str,
        /// Start byte.
        offset: usize,
        /// End byte.
        end: usize,
        /// Allocation size.
        len: usize,
    },
}

pub(crate) trait DriverContext<T> {
    fn context(self, context: impl Into<String>) -> Result<T, TransportError>;
}

impl<T> DriverContext<T> for Result<T, cudarc::driver::DriverError> {
    fn context(self, context: impl Into<String>) -> Result<T, TransportError> {
        self.map_err(|source| TransportError::Driver {
            context: context.into(),
            source,
        })
    }
}

/// A buffer allocated collectively by every rank, with the same size everywhere.
///
/// Who may touch it: the owning rank's kernels read and write all of it; a peer's kernels may
/// write (and atomically update) it, through [`SymmetricMemory::peer_base`] or the backend's
/// put/signal, only as the protocol allows; the host never reads it on the hot path.
pub trait SymmetricMemory: Send + Sync + Debug {
    /// Size in bytes (identical on every rank).
    fn len(&self) -> usize;
    /// True when zero-sized.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Device address of this rank's own buffer.
    fn local_base(&self) -> u64;
    /// Device address, valid in this process, of `peer`'s buffer when this process can store
    /// to it directly ([`Route::Store`]; this rank's own buffer included); `None` for a peer
    /// reachable only by the backend's put/signal, or not at all.
    fn peer_base(&self, peer: usize) -> Option<u64>;

    /// Closes this rank's mappings of the peers' memory: called at teardown once this rank's
    /// ops are finished, before the barrier after which every rank frees its own allocation
    /// (so no rank frees memory a peer still maps). Default: nothing to close.
    fn release_peer_mappings(&mut self) {}

    /// Role: binds a loaded kernel module to this memory's device channel, what the module's
    /// kernels reach the backend's own machinery through (the CPU proxy: its ring, its counters
    /// and this rank's base, in the module global `epcomm_proxy_channel`,
    /// [`memory::write_module_global`]). The frontend calls it once per buffer, after the
    /// allocation and before the first launch, whatever the family; the default binds nothing
    /// (backends whose kernels need no channel, or bind through [`DeviceRuntime::bind_module`]).
    /// Returns whether a channel was bound: for a family that needs one
    /// ([`KernelFamily::needs_device_channel`]) the frontend refuses a memory that bound none.
    ///
    /// # Errors
    /// The driver's, or [`TransportError::InvalidArgument`] naming `module` when its global
    /// does not have the host's layout (an image of another ABI).
    ///
    /// # Safety
    /// `module` is a live `CUmodule` loaded in this memory's CUDA context from the image of the
    /// backend's [`KernelFamily`], and every launch of it that uses the channel happens while
    /// this memory is alive; `stream` belongs to that context.
    unsafe fn bind_device_channel(
        &self,
        module: cudarc::driver::sys::CUmodule,
        stream: &cudarc::driver::CudaStream,
    ) -> Result<bool, TransportError> {
        let _ = (module, stream);
        Ok(false)
    }

    /// Makes `[addr, addr + bytes)` of caller memory (an op's input, named `argument`) readable
    /// by the backend's put operations before a kernel that puts from it ([`Route::PutSignal`]
    /// transfers whose source is caller memory) is launched. Called by the frontend for every
    /// such input of every op while some peer is reached by put/signal: `x` of a dispatch and
    /// of a BF16 low-latency dispatch, `y` and `y_weights` of a combine, `y` of a low-latency
    /// combine, and, for a family that sends metadata as rows
    /// ([`KernelFamily::puts_metadata_rows`]), a dispatch's `scales`, `topk_idx` and
    /// `topk_weights`. It may be called again and again with the same memory and must then be
    /// cheap; the memory may also lie in the backend's own symmetric buffers (one tier's output
    /// handed to another tier). Default: nothing to do (backends whose puts read any device
    /// memory of this process).
    ///
    /// # Errors
    /// [`TransportError::InvalidArgument`] naming `argument` when the memory cannot be made
    /// readable (not device memory the backend can register); the backend's own errors.
    fn prepare_put_source(
        &self,
        argument: &'static str,
        addr: u64,
        bytes: usize,
    ) -> Result<(), TransportError> {
        let _ = (argument, addr, bytes);
        Ok(())
    }

    /// Why the backend's own machinery stopped, if it did (a proxy thread that failed): the
    /// frontend adds it to the error of a kernel that waited on that machinery. `None` while
    /// healthy, and for backends without such machinery (the default).
    fn backend_failure(&self) -> Option<String> {
        None
    }

    /// True when freeing is collective (every rank must free together, e.g. NVSHMEM's
    /// `nvshmem_free`): with a peer gone, the frontend leaks the allocation instead of blocking.
    fn free_is_collective(&self) -> bool {
        false
    }
}

/// Role: collective allocation of symmetric memory.
pub trait SymmetricHeap {
    /// The backend's symmetric memory.
    type Memory: SymmetricMemory + 'static;
    /// Collectively allocates `bytes` of zeroed symmetric memory. Every rank must call this
    /// with the same size, in the same order; it returns once every peer's memory that this
    /// rank maps is zeroed and mapped here.
    fn alloc_symmetric(&self, bytes: usize) -> Result<Self::Memory, TransportError>;

    /// [`Self::alloc_symmetric`] for a buffer whose ops reach only the world ranks `peers`
    /// (a buffer over a group of the world: its members). The memory is the same world-wide
    /// symmetric allocation (every rank calls it, in the same order, with the same size); a
    /// backend may leave out what it would set up for the other ranks (the CPU proxy: their
    /// copy streams). Default: [`Self::alloc_symmetric`].
    fn alloc_symmetric_for(
        &self,
        bytes: usize,
        peers: &[usize],
    ) -> Result<Self::Memory, TransportError> {
        let _ = peers;
        self.alloc_symmetric(bytes)
    }
}

/// Role: the device runtime a backend's kernels need.
pub trait DeviceRuntime {
    /// What [`DeviceRuntime::bind_module`] returns: keeps a kernel module bound to the
    /// backend's device runtime until dropped (`()` for backends that need no binding).
    type ModuleBinding: Send + Sync + Debug + 'static;

    /// Binds a loaded kernel module of this backend's [`KernelFamily`] (see
    /// [`Transport::capabilities`]) to its device runtime
    /// (NVSHMEM: `nvshmemx_cumodule_init`). Drop the binding before the module is unloaded.
    ///
    /// # Safety
    /// `module` is a live `CUmodule`, loaded in this transport's CUDA context from the image of
    /// [`Capabilities::kernel_family`], and stays loaded until the returned binding is dropped.
    unsafe fn bind_module(
        &self,
        module: cudarc::driver::sys::CUmodule,
    ) -> Result<Self::ModuleBinding, TransportError>;

    /// The `(major, minor)` release of the device library the kernel image must be linked
    /// against, when the runtime's host library decides it (NVSHMEM: the loaded host library's
    /// release; the frontend picks that release's image). `None`: the family's one image.
    fn device_library(&self) -> Option<(u32, u32)> {
        None
    }
}

/// A communication backend (static dispatch): both roles, what it supports, and where it runs.
pub trait Transport: SymmetricHeap + DeviceRuntime + Send + Sync + Debug {
    /// What the backend supports.
    fn capabilities(&self) -> Capabilities;
    /// The world as this backend sees it (logical nodes included).
    fn world(&self) -> WorldLayout;
    /// The bootstrap it was built on: the host collectives every rank shares.
    fn bootstrap(&self) -> &Arc<Bootstrap>;
}

/// Object-safe mirror of [`Transport`], implemented for every transport: what the frontend
/// holds.
pub trait DynTransport: Send + Sync + Debug {
    /// See [`Transport::capabilities`].
    fn capabilities(&self) -> Capabilities;
    /// See [`Transport::world`].
    fn world(&self) -> WorldLayout;
    /// See [`Transport::bootstrap`].
    fn bootstrap(&self) -> &Arc<Bootstrap>;
    /// See [`SymmetricHeap::alloc_symmetric`].
    fn alloc_symmetric_dyn(&self, bytes: usize)
    -> Result<Box<dyn SymmetricMemory>, TransportError>;
    /// See [`SymmetricHeap::alloc_symmetric_for`].
    fn alloc_symmetric_for_dyn(
        &self,
        bytes: usize,
        peers: &[usize],
    ) -> Result<Box<dyn SymmetricMemory>, TransportError>;
    /// See [`DeviceRuntime::bind_module`].
    ///
    /// # Safety
    /// As for [`DeviceRuntime::bind_module`].
    unsafe fn bind_module_dyn(
        &self,
        module: cudarc::driver::sys::CUmodule,
    ) -> Result<Box<dyn Debug + Send + Sync>, TransportError>;
    /// See [`DeviceRuntime::device_library`].
    fn device_library_dyn(&self) -> Option<(u32, u32)>;
}

impl<T: Transport> DynTransport for T {
    fn capabilities(&self) -> Capabilities {
        Transport::capabilities(self)
    }
    fn world(&self) -> WorldLayout {
        Transport::world(self)
    }
    fn bootstrap(&self) -> &Arc<Bootstrap> {
        Transport::bootstrap(self)
    }
    fn alloc_symmetric_dyn(
        &self,
        bytes: usize,
    ) -> Result<Box<dyn SymmetricMemory>, TransportError> {
        Ok(Box::new(self.alloc_symmetric(bytes)?))
    }
    fn alloc_symmetric_for_dyn(
        &self,
        bytes: usize,
        peers: &[usize],
    ) -> Result<Box<dyn SymmetricMemory>, TransportError> {
        Ok(Box::new(self.alloc_symmetric_for(bytes, peers)?))
    }
    unsafe fn bind_module_dyn(
        &self,
        module: cudarc::driver::sys::CUmodule,
    ) -> Result<Box<dyn Debug + Send + Sync>, TransportError> {
        // SAFETY: the caller upholds `bind_module`'s contract (same contract).
        Ok(Box::new(unsafe { self.bind_module(module) }?))
    }
    fn device_library_dyn(&self) -> Option<(u32, u32)> {
        self.device_library()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsupported_schedules_are_named() {
        let caps = Capabilities {
            name: "t",
            kernel_family: KernelFamily::NvlinkStore,
            schedules: &[Schedule::Epoch],
            routes: &[Route::Store],
        };
        let err = caps.check_schedule(Schedule::Global).unwrap_err();
        assert!(
            err.to_string().contains("supports epoch, not global"),
            "{err}"
        );
    }
}
