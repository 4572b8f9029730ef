//! NVLink-domain transport: every rank allocates its symmetric buffer with `cuMemAlloc`, exports
//! it with `cuIpcGetMemHandle`, and opens every peer's handle with
//! `cuIpcOpenMemHandle(LAZY_ENABLE_PEER_ACCESS)`; the bootstrap all-gathers the handles. Kernels
//! then store to peers directly over NVLink.
//!
//! All ranks must be GPUs of one host (one NVLink domain). The raw-verbs backend reuses this for
//! its intranode part.
//!
//! Teardown: [`SymmetricMemory::release_peer_mappings`] closes the peer mappings; dropping
//! [`IpcMemory`] closes any that are left, then frees the local allocation. It never waits for
//! peers: the `epcomm` frontend releases the mappings, runs a host barrier, and only then drops,
//! so no rank frees memory a peer still maps.
//!
//! # Example
//!
//! Needs a GPU per rank and the other ranks of the job (so it is only compiled here):
//!
//! ```no_run
//! use std::sync::Arc;
//!
//! use cudarc::driver::CudaContext;
//! use epcomm_bootstrap::{Bootstrap, BootstrapConfig};
//! use epcomm_transport::Transport;
//! use epcomm_transport_ipc::IpcTransport;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let boot = Arc::new(Bootstrap::connect(BootstrapConfig::from_env()?)?);
//! let ctx = CudaContext::new(boot.local_rank())?;
//! // Every rank of the bootstrap must be on this host (checked).
//! let transport = IpcTransport::new(ctx, boot)?;
//! assert_eq!(transport.capabilities().name, "nvlink-ipc");
//! // Usually handed to the frontend: `epcomm::Buffer::new(ctx, Arc::new(transport), cfg)`.
//! # Ok(())
//! # }
//! ```

use std::sync::Arc;

use cudarc::driver::{CudaContext, sys};
use epcomm_transport::{
    Backend, Bootstrap, Capabilities, DeviceBuffer, DeviceRuntime, KernelFamily, Limits,
    OptionSchema, REGISTRY_VERSION, Route, Schedule, SymmetricHeap, SymmetricMemory, Transport,
    TransportError, WorldLayout,
};

const IPC_HANDLE_BYTES: usize = 64;

/// The CUDA-IPC transport of one process (one GPU).
#[derive(Debug)]
pub struct IpcTransport {
    ctx: Arc<CudaContext>,
    bootstrap: Arc<Bootstrap>,
    world: WorldLayout,
    allocations: std::sync::atomic::AtomicU64,
}

impl IpcTransport {
    /// The world this transport sees for `world_size` ranks, `local_world_size` per host,
    /// seen from `rank`: one NVLink domain holding every rank (no GPU needed).
    ///
    /// # Errors
    /// [`TransportError::InvalidArgument`] naming `world` unless every rank is on one host
    /// (`local_world_size == world_size`); topology errors for inconsistent sizes.
    pub fn world_layout(
        world_size: usize,
        rank: usize,
        local_world_size: usize,
    ) -> Result<WorldLayout, TransportError> {
        if local_world_size != world_size {
            return Err(TransportError::InvalidArgument {
                argument: "world",
                rule: format!(
                    "the CUDA-IPC transport needs every rank on one host (one NVLink domain), \
                     but there are {local_world_size} ranks per host and {world_size} in all"
                ),
            });
        }
        Ok(WorldLayout::new(world_size, rank, world_size)?)
    }

    /// Builds the transport over an initialised bootstrap. Every rank must be on this host
    /// (checked: [`Self::world_layout`]).
    pub fn new(ctx: Arc<CudaContext>, bootstrap: Arc<Bootstrap>) -> Result<Self, TransportError> {
        let world = Self::world_layout(
            bootstrap.world_size(),
            bootstrap.rank(),
            bootstrap.local_world_size(),
        )?;
        Ok(Self {
            ctx,
            bootstrap,
            world,
            allocations: 0.into(),
        })
    }

    /// The CUDA context this transport allocates in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The bootstrap this transport exchanges handles through.
    pub fn bootstrap(&self) -> &Arc<Bootstrap> {
        &self.bootstrap
    }
}

fn driver(
    context: impl Into<String>,
) -> impl FnOnce(cudarc::driver::DriverError) -> TransportError {
    let context = context.into();
    move |source| TransportError::Driver { context, source }
}

/// The capabilities of [`IpcTransport`].
pub const CAPABILITIES: Capabilities = Capabilities {
    name: "nvlink-ipc",
    kernel_family: KernelFamily::NvlinkStore,
    schedules: &Schedule::ALL,
    routes: &[Route::Store],
};

/// This backend's entry in the transport table (`ipc`, also `nvlink-ipc`; no options).
pub const BACKEND: Backend = Backend {
    version: REGISTRY_VERSION,
    name: "ipc",
    aliases: &["nvlink-ipc"],
    forms: &["ipc"],
    options: OptionSchema::None,
    capabilities: CAPABILITIES,
    limits: Limits {
        spans_hosts: false,
        executor: None,
    },
    runtime_library: None,
    needs_rdma_device: false,
    world_layout: |_, world_size, rank, local| IpcTransport::world_layout(world_size, rank, local),
    probe: Backend::nothing_to_probe,
    preflight: Backend::nothing_to_preflight,
    build: |_, ctx, bootstrap| Ok(Arc::new(IpcTransport::new(ctx, bootstrap)?)),
    single_host_env: Backend::no_env,
};

impl Transport for IpcTransport {
    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }

    fn world(&self) -> WorldLayout {
        self.world
    }

    fn bootstrap(&self) -> &Arc<Bootstrap> {
        &self.bootstrap
    }
}

impl DeviceRuntime for IpcTransport {
    type ModuleBinding = ();

    unsafe fn bind_module(
        &self,
        _module: cudarc::driver::sys::CUmodule,
    ) -> Result<(), TransportError> {
        // Store-family kernels use no device runtime: nothing to bind.
        Ok(())
    }
}

impl SymmetricHeap for IpcTransport {
    type Memory = IpcMemory;

    fn alloc_symmetric(&self, bytes: usize) -> Result<IpcMemory, TransportError> {
        let seq = self
            .allocations
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let local = DeviceBuffer::zeroed(&self.ctx, bytes)?;
        // Every rank must ask for the same size: exchange it with the handle and compare.
        let mut handle = sys::CUipcMemHandle {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        self.ctx
            .bind_to_thread()
            .map_err(driver("binding the CUDA context"))?;
        // SAFETY: `handle` is a valid out-pointer and `local.ptr()` a live cuMemAlloc allocation.
        unsafe { sys::cuIpcGetMemHandle(&mut handle, local.ptr()) }
            .result()
            .map_err(driver("exporting the symmetric buffer (cuIpcGetMemHandle)"))?;
        let mut msg = Vec::with_capacity(IPC_HANDLE_BYTES + 8);
        msg.extend_from_slice(&(bytes as u64).to_le_bytes());
        msg.extend(handle.reserved.iter().map(|&c| c as u8));
        let tag = format!("ipc-alloc-{seq}");
        let all =
            self.bootstrap
                .all_gather(&tag, &msg)
                .map_err(|source| TransportError::Bootstrap {
                    context: format!("exchanging IPC handles ({tag})"),
                    source,
                })?;
        let me = self.world.rank();
        let mut mem = IpcMemory {
            ctx: self.ctx.clone(),
            bases: vec![0; all.len()],
            opened: Vec::new(),
            local,
        };
        for (peer, data) in all.iter().enumerate() {
            if data.len() != IPC_HANDLE_BYTES + 8 {
                return Err(TransportError::BadPeerData {
                    peer,
                    what: "IPC handle",
                    detail: format!("{} bytes instead of {}", data.len(), IPC_HANDLE_BYTES + 8),
                });
            }
            let size = u64::from_le_bytes(data[..8].try_into().unwrap_or_default());
            if size != bytes as u64 {
                return Err(TransportError::BadPeerData {
                    peer,
                    what: "symmetric allocation size",
                    detail: format!("rank {peer} allocated {size} bytes, rank {me} {bytes}"),
                });
            }
            if peer == me {
                mem.bases[peer] = mem.local.ptr();
                continue;
            }
            let mut h = sys::CUipcMemHandle {
                reserved: [0; IPC_HANDLE_BYTES],
            };
            for (dst, src) in h.reserved.iter_mut().zip(&data[8..]) {
                *dst = *src as std::ffi::c_char;
            }
            let mut ptr: sys::CUdeviceptr = 0;
            // SAFETY: `h` is a handle exported by a live peer process; `ptr` a valid out-pointer.
            unsafe {
                sys::cuIpcOpenMemHandle_v2(
                    &mut ptr,
                    h,
                    sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                )
            }
            .result()
            .map_err(driver(format!(
                "opening rank {peer}'s symmetric buffer (cuIpcOpenMemHandle)"
            )))?;
            mem.opened.push(ptr);
            mem.bases[peer] = ptr;
        }
        Ok(mem)
    }
}

/// A symmetric buffer shared through CUDA IPC.
#[derive(Debug)]
pub struct IpcMemory {
    ctx: Arc<CudaContext>,
    bases: Vec<u64>,
    opened: Vec<sys::CUdeviceptr>,
    local: DeviceBuffer,
}

impl IpcMemory {
    /// The local allocation (for host-side reads in tests and diagnostics).
    pub fn local(&self) -> &DeviceBuffer {
        &self.local
    }
}

impl SymmetricMemory for IpcMemory {
    fn len(&self) -> usize {
        self.local.len()
    }

    fn local_base(&self) -> u64 {
        self.local.ptr()
    }

    fn peer_base(&self, peer: usize) -> Option<u64> {
        self.bases.get(peer).copied().filter(|&b| b != 0)
    }

    fn release_peer_mappings(&mut self) {
        self.close_peers();
    }
}

impl IpcMemory {
    fn close_peers(&mut self) {
        let _ = self.ctx.bind_to_thread();
        for ptr in self.opened.drain(..) {
            // SAFETY: `ptr` was returned by cuIpcOpenMemHandle and is closed exactly once
            // (drained from `opened`).
            let _ = unsafe { sys::cuIpcCloseMemHandle(ptr) };
        }
        let me = self.local.ptr();
        for b in self.bases.iter_mut().filter(|b| **b != me) {
            *b = 0;
        }
    }
}

impl Drop for IpcMemory {
    fn drop(&mut self) {
        self.close_peers();
        // `local` is freed by its own Drop after this.
    }
}
