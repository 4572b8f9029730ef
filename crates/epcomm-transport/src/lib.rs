//! The transport layer of epcomm: what a backend must provide so that the kernels can move
//! tokens between ranks.
//!
//! A backend ([`Transport`]) gives every rank a **symmetric buffer** (same size and layout on
//! every rank), the addresses of its peers' buffers that this process can store to directly
//! (the NVLink domain), a host barrier, and the set of [`BarrierStrategy`]s its kernel variant
//! supports. The trait is statically dispatched (associated types, like `wgpu-hal`'s `Api`);
//! [`DynTransport`] is its object-safe mirror for code that picks a backend at run time.
//!
//! # Ordering contract
//! Kernels publish with *data stores, then a system-scope release operation* (a release add on a
//! peer's counter, or a release store of a tagged word) and consume with an acquire load of that
//! word before reading the data. A backend must guarantee that a peer address it hands out
//! preserves this order (NVLink P2P mappings do). Peers without such an address are reached
//! with the transport's own put and signal operations, which only a device-linked kernel
//! family can issue ([`KernelFamily::NvshmemDevice`]): the data, then a signal that NVSHMEM
//! delivers after it (docs/protocol.md, "Net policies").
//! Memory is reused only once every producer that can target it is known to be done
//! (docs/protocol.md).
//!
//! # Example
//!
//! Barrier strategies are chosen at run time, by name (no GPU needed):
//!
//! ```
//! use epcomm_transport::{BarrierStrategy, TransportError};
//!
//! let strategy: BarrierStrategy = "peer-signal".parse()?;
//! assert_eq!(strategy, BarrierStrategy::PeerSignal);
//! assert_eq!(strategy.name(), "peer-signal");
//! assert!("fastest".parse::<BarrierStrategy>().is_err());
//! # Ok::<(), TransportError>(())
//! ```

pub mod memory;

use std::fmt::Debug;

use async_trait::async_trait;

pub use memory::{DeviceBuffer, MappedHostBuffer};

/// How ranks agree that buffers may be reused; chosen per `Buffer`, at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BarrierStrategy {
    /// DeepEP-V1-equivalent schedule: all-rank barriers before the count exchange, after it,
    /// and after reading it. Baseline and fallback.
    Global,
    /// No barrier: epoch-tagged counts, monotonic completion counters, parity-alternating
    /// receive regions; each rank waits only for the data it receives.
    Epoch,
    /// Epoch with the landed-check done by the transport's signal operations.
    PeerSignal,
}

impl BarrierStrategy {
    /// Lower-case name, as used on command lines.
    pub fn name(self) -> &'static str {
        match self {
            Self::Global => "global",
            Self::Epoch => "epoch",
            Self::PeerSignal => "peer-signal",
        }
    }
}

impl std::str::FromStr for BarrierStrategy {
    type Err = TransportError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "global" => Ok(Self::Global),
            "epoch" => Ok(Self::Epoch),
            "peer-signal" => Ok(Self::PeerSignal),
            other => Err(TransportError::InvalidArgument {
                argument: "barrier strategy",
                rule: format!("must be one of global, epoch, peer-signal (got {other:?})"),
            }),
        }
    }
}

/// Which kernel variant a transport's device context works with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelFamily {
    /// Plain stores and system-scope atomics through peer mappings (NVLink P2P / CUDA IPC).
    /// Every peer must have a mapping ([`SymmetricMemory::peer_bases`] nonzero).
    NvlinkStore,
    /// Kernels device-linked with `libnvshmem_device`: mapped peers (nonzero
    /// [`SymmetricMemory::peer_bases`]) by stores, every other peer with NVSHMEM put/signal;
    /// under [`BarrierStrategy::PeerSignal`] every peer with put/signal. The loaded module must be
    /// bound with [`Transport::bind_module`] before the first launch.
    NvshmemDevice,
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
/// write (and atomically update) it through [`SymmetricMemory::peer_bases`] only as the protocol
/// allows; the host never reads it on the hot path.
pub trait SymmetricMemory: Send + Sync + Debug {
    /// Size in bytes (identical on every rank).
    fn len(&self) -> usize;
    /// True when zero-sized.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Device address of this rank's own buffer.
    fn local_base(&self) -> u64;
    /// Device address, valid in this process, of every rank's buffer (own included), indexed by
    /// rank; 0 for ranks this process cannot store to directly.
    fn peer_bases(&self) -> &[u64];

    /// Closes this rank's mappings of the peers' memory: called at teardown once this rank's
    /// ops are finished, before the barrier after which every rank frees its own allocation
    /// (so no rank frees memory a peer still maps). Default: nothing to close.
    fn release_peer_mappings(&mut self) {}

    /// True when freeing is collective (every rank must free together, e.g. NVSHMEM's
    /// `nvshmem_free`): with a peer gone, the frontend leaks the allocation instead of blocking.
    fn free_is_collective(&self) -> bool {
        false
    }
}

/// A communication backend (static dispatch).
#[async_trait]
pub trait Transport: Send + Sync + Debug {
    /// The backend's symmetric memory.
    type Memory: SymmetricMemory + 'static;

    /// Short backend name (`"nvlink-ipc"`, `"nvshmem"`).
    fn name(&self) -> &'static str;
    /// This process's rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// The kernel variant that can use this transport's memory.
    fn kernel_family(&self) -> KernelFamily;
    /// Barrier strategies this backend's kernel variant implements.
    fn barrier_strategies(&self) -> &'static [BarrierStrategy];
    /// Collectively allocates `bytes` of zeroed symmetric memory (every rank must call this with
    /// the same size, in the same order).
    async fn alloc_symmetric(&self, bytes: usize) -> Result<Self::Memory, TransportError>;
    /// Host-side barrier over all ranks, bounded by the bootstrap timeout.
    async fn host_barrier(&self, tag: &str) -> Result<(), TransportError>;
    /// Host-side all-gather of small byte strings (diagnostics, setup), indexed by rank.
    async fn host_all_gather(&self, tag: &str, data: &[u8])
    -> Result<Vec<Vec<u8>>, TransportError>;

    /// What [`Transport::bind_module`] returns: keeps a kernel module bound to the backend's
    /// device runtime until dropped (`()` for backends that need no binding).
    type ModuleBinding: Send + Sync + Debug + 'static;

    /// Binds a loaded kernel module of this backend's [`KernelFamily`] to its device runtime
    /// (NVSHMEM: `nvshmemx_cumodule_init`). Drop the binding before the module is unloaded.
    ///
    /// # Safety
    /// `module` is a live `CUmodule`, loaded in this transport's CUDA context from the image of
    /// [`Transport::kernel_family`], and stays loaded until the returned binding is dropped.
    unsafe fn bind_module(
        &self,
        module: cudarc::driver::sys::CUmodule,
    ) -> Result<Self::ModuleBinding, TransportError>;
}

/// Object-safe mirror of [`Transport`], implemented for every transport.
#[async_trait]
pub trait DynTransport: Send + Sync + Debug {
    /// See [`Transport::name`].
    fn name(&self) -> &'static str;
    /// See [`Transport::rank`].
    fn rank(&self) -> usize;
    /// See [`Transport::world_size`].
    fn world_size(&self) -> usize;
    /// See [`Transport::kernel_family`].
    fn kernel_family(&self) -> KernelFamily;
    /// See [`Transport::barrier_strategies`].
    fn barrier_strategies(&self) -> &'static [BarrierStrategy];
    /// See [`Transport::alloc_symmetric`].
    async fn alloc_symmetric_dyn(
        &self,
        bytes: usize,
    ) -> Result<Box<dyn SymmetricMemory>, TransportError>;
    /// See [`Transport::host_barrier`].
    async fn host_barrier_dyn(&self, tag: &str) -> Result<(), TransportError>;
    /// See [`Transport::host_all_gather`].
    async fn host_all_gather_dyn(
        &self,
        tag: &str,
        data: &[u8],
    ) -> Result<Vec<Vec<u8>>, TransportError>;
    /// See [`Transport::bind_module`].
    ///
    /// # Safety
    /// As for [`Transport::bind_module`].
    unsafe fn bind_module_dyn(
        &self,
        module: cudarc::driver::sys::CUmodule,
    ) -> Result<Box<dyn Debug + Send + Sync>, TransportError>;
}

#[async_trait]
impl<T: Transport> DynTransport for T {
    fn name(&self) -> &'static str {
        Transport::name(self)
    }
    fn rank(&self) -> usize {
        Transport::rank(self)
    }
    fn world_size(&self) -> usize {
        Transport::world_size(self)
    }
    fn kernel_family(&self) -> KernelFamily {
        Transport::kernel_family(self)
    }
    fn barrier_strategies(&self) -> &'static [BarrierStrategy] {
        Transport::barrier_strategies(self)
    }
    async fn alloc_symmetric_dyn(
        &self,
        bytes: usize,
    ) -> Result<Box<dyn SymmetricMemory>, TransportError> {
        Ok(Box::new(self.alloc_symmetric(bytes).await?))
    }
    async fn host_barrier_dyn(&self, tag: &str) -> Result<(), TransportError> {
        self.host_barrier(tag).await
    }
    async fn host_all_gather_dyn(
        &self,
        tag: &str,
        data: &[u8],
    ) -> Result<Vec<Vec<u8>>, TransportError> {
        self.host_all_gather(tag, data).await
    }
    unsafe fn bind_module_dyn(
        &self,
        module: cudarc::driver::sys::CUmodule,
    ) -> Result<Box<dyn Debug + Send + Sync>, TransportError> {
        // SAFETY: the caller upholds `bind_module`'s contract (same contract).
        Ok(Box::new(unsafe { self.bind_module(module) }?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strategy_names_round_trip() {
        for s in [
            BarrierStrategy::Global,
            BarrierStrategy::Epoch,
            BarrierStrategy::PeerSignal,
        ] {
            assert_eq!(s.name().parse::<BarrierStrategy>().unwrap(), s);
        }
        let err = "fast".parse::<BarrierStrategy>().unwrap_err();
        assert!(err.to_string().contains("barrier strategy"), "{err}");
    }
}
