//! NVSHMEM transport: the symmetric buffer lives on NVSHMEM's symmetric heap
//! (`nvshmem_calloc`), and peers inside the NVLink domain are reached through `nvshmem_ptr`
//! mappings, so the same store-based (`NvlinkStore`) kernels run on it unchanged.
//!
//! Setup (collective): rank 0 draws an NVSHMEM unique id, the bootstrap broadcasts it, every
//! rank initialises NVSHMEM with it (`nvshmemx_hostlib_init_attr`, through `nvshmem-sys`, which
//! dlopens `libnvshmem_host.so.3` — nothing links at build time). One runtime per process,
//! shared by every transport clone and allocation; finalised when the last one drops.
//!
//! Not yet: device-linked NVSHMEM kernels (`nvshmem_put_signal`, IBGDA) and therefore the
//! PeerSignal strategy and ranks outside the NVLink domain; such peers get no mapping
//! (`peer_bases()[r] == 0`), which the `epcomm` frontend rejects.
//!
//! On a host without an RDMA NIC set `NVSHMEM_REMOTE_TRANSPORT=none` and
//! `NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo`; keep `NVSHMEM_DISABLE_NVLS=1`.

use std::sync::Arc;

use async_trait::async_trait;
use cudarc::driver::CudaContext;
use epcomm_bootstrap::Bootstrap;
use epcomm_transport::{BarrierStrategy, KernelFamily, SymmetricMemory, Transport, TransportError};
use nvshmem_sys::{Nvshmem, OwnedSymmetricAlloc, SharedNvshmem};

fn backend(context: impl Into<String>) -> impl FnOnce(nvshmem_sys::Error) -> TransportError {
    let context = context.into();
    move |e| TransportError::Backend {
        backend: "nvshmem",
        context,
        source: Box::new(e),
    }
}

fn boot_err(context: &str) -> impl FnOnce(epcomm_bootstrap::BootstrapError) -> TransportError + '_ {
    move |source| TransportError::Bootstrap {
        context: context.to_string(),
        source,
    }
}

/// The NVSHMEM transport of one process (one GPU, one PE). Cheap to clone (shares the runtime).
#[derive(Clone, Debug)]
pub struct NvshmemTransport {
    ctx: Arc<CudaContext>,
    bootstrap: Arc<Bootstrap>,
    rt: SharedNvshmem,
}

impl NvshmemTransport {
    /// Loads NVSHMEM and initialises it over the bootstrap (collective). `ctx` is made current
    /// on this thread first (NVSHMEM binds to the current context).
    pub fn new(ctx: Arc<CudaContext>, bootstrap: Arc<Bootstrap>) -> Result<Self, TransportError> {
        let lib = nvshmem_sys::loader::load_default().map_err(|e| TransportError::Backend {
            backend: "nvshmem",
            context: "loading libnvshmem_host.so.3".into(),
            source: Box::new(e),
        })?;
        let (rank, world) = (bootstrap.rank(), bootstrap.world_size());
        let uid = if rank == 0 {
            Some(Nvshmem::get_uniqueid(&lib).map_err(backend("drawing a unique id"))?)
        } else {
            None
        };
        let uid = bootstrap
            .broadcast("epcomm-nvshmem-uid", 0, uid.as_deref())
            .map_err(boot_err("broadcasting the NVSHMEM unique id"))?;
        ctx.bind_to_thread()
            .map_err(|source| TransportError::Driver {
                context: "binding the CUDA context".into(),
                source,
            })?;
        let rt = Nvshmem::init_with_uniqueid(Arc::new(lib), rank, world, &uid)
            .map_err(backend(format!("initialising PE {rank} of {world}")))?;
        Ok(Self {
            ctx,
            bootstrap,
            rt: SharedNvshmem::new(rt),
        })
    }

    /// The shared NVSHMEM runtime.
    pub fn runtime(&self) -> &SharedNvshmem {
        &self.rt
    }
}

#[async_trait]
impl Transport for NvshmemTransport {
    type Memory = NvshmemMemory;

    fn name(&self) -> &'static str {
        "nvshmem"
    }

    fn rank(&self) -> usize {
        self.bootstrap.rank()
    }

    fn world_size(&self) -> usize {
        self.bootstrap.world_size()
    }

    fn kernel_family(&self) -> KernelFamily {
        KernelFamily::NvlinkStore
    }

    fn barrier_strategies(&self) -> &'static [BarrierStrategy] {
        &[BarrierStrategy::Global, BarrierStrategy::Epoch]
    }

    async fn alloc_symmetric(&self, bytes: usize) -> Result<NvshmemMemory, TransportError> {
        self.ctx
            .bind_to_thread()
            .map_err(|source| TransportError::Driver {
                context: "binding the CUDA context".into(),
                source,
            })?;
        let alloc = OwnedSymmetricAlloc::zeroed(&self.rt, bytes)
            .map_err(backend(format!("allocating {bytes} symmetric bytes")))?;
        let bases = (0..self.rt.n_pes())
            .map(|pe| alloc.peer_ptr(pe).unwrap_or(0))
            .collect();
        // nvshmem_calloc zeroes on the device; make sure that finished before peers may write.
        self.ctx
            .synchronize()
            .map_err(|source| TransportError::Driver {
                context: "waiting for the symmetric heap's zeroing".into(),
                source,
            })?;
        Ok(NvshmemMemory { bases, alloc })
    }

    async fn host_barrier(&self, tag: &str) -> Result<(), TransportError> {
        self.bootstrap.barrier(tag).map_err(boot_err(tag))
    }

    async fn host_all_gather(
        &self,
        tag: &str,
        data: &[u8],
    ) -> Result<Vec<Vec<u8>>, TransportError> {
        self.bootstrap.all_gather(tag, data).map_err(boot_err(tag))
    }
}

/// A symmetric buffer on the NVSHMEM heap.
#[derive(Debug)]
pub struct NvshmemMemory {
    bases: Vec<u64>,
    alloc: OwnedSymmetricAlloc,
}

impl SymmetricMemory for NvshmemMemory {
    fn len(&self) -> usize {
        self.alloc.len()
    }

    fn local_base(&self) -> u64 {
        self.alloc.ptr()
    }

    fn peer_bases(&self) -> &[u64] {
        &self.bases
    }
}
