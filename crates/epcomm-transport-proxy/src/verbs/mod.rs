//! The `proxy-verbs` transport: the proxy image and ring of `proxy-ce`, executed on
//! [`VerbsExecutor`](epcomm_proxy::verbs::VerbsExecutor) (RDMA WRITEs on one RC queue pair
//! per peer, libibverbs opened at run time) instead of the copy engines.
//!
//! * **Peers.** Peers in this rank's logical node ([`ProxyOptions::virtual_nodes`]; always on
//!   this host) are reached by stores through CUDA-IPC mappings, as with `proxy-ce`; every
//!   other peer (other logical nodes, other hosts) through the proxy and the NIC. Unlike
//!   `proxy-ce`, ranks may span hosts.
//! * **Symmetric buffer.** `cuMemAlloc` memory (rounded up to 2 MiB), registered with the NIC
//!   as [`GpuRegistration`] says: a dma-buf exported with `cuMemGetHandleForAddressRange`
//!   (`ibv_reg_dmabuf_mr`, no `nvidia-peermem` needed), or the address range (`ibv_reg_mr`,
//!   which needs the `nvidia-peermem` module). [`GpuRegistration::Auto`] takes the dma-buf where
//!   both the driver (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`) and libibverbs
//!   (`ibv_reg_dmabuf_mr`) support it, else the address range.
//! * **Connection.** One all-gather per buffer carries every rank's size, CUDA-IPC handle and
//!   queue pair endpoints ([`epcomm_proxy::verbs::RankEndpoints`]); each queue pair is then
//!   moved to RTS, and a second all-gather agrees that every rank got there.
//! * **Sources in caller memory.** The kernels put rows straight from the caller's arrays
//!   (`x` of a dispatch, `y` and its weights of a combine: `put_warp` in
//!   `kernels/common/net_proxy.cuh`), so the NIC must be able to read them. The frontend
//!   hands each such array to [`SymmetricMemory::prepare_put_source`] before it launches the
//!   op; this transport registers the whole CUDA allocation holding it (found with
//!   `cuPointerGetAttribute`), the same way as the symmetric buffer, through the executor's
//!   [`SourceRegistry`], and keeps the registration for the next ops. An allocation freed and
//!   replaced at the same address is recognised by its buffer id
//!   (`CU_POINTER_ATTRIBUTE_BUFFER_ID`) and registered again. Memory the driver does not
//!   know, or cannot export, is a typed error naming the argument, before anything is launched.
//! * **No device.** [`probe_rdma`] (loading libibverbs, selecting device, port and GID) runs
//!   first, on every rank, and the ranks agree on the outcome before anything is allocated:
//!   a machine without libibverbs or without an RDMA device gets
//!   [`TransportError::Unavailable`], and so do the other ranks (naming the rank), instead of
//!   waiting for it.
//!
//! What is not done: a host-staged mode for NICs without GPUDirect (a bounce buffer in host
//! memory), a progress mirror in device memory (the kernels read the ring's host words, every
//! 16th poll), and registering memory mapped with the virtual memory API (`cuMemMap`) when
//! one allocation range is not exportable as a whole.

mod memory;
mod options;
mod probe;
mod registration;
#[cfg(test)]
mod tests;

use std::os::fd::{FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::{CudaContext, sys};
use epcomm_proxy::verbs::{
    DeviceSelector, GidSelector, HeapMemory, LibrarySearch, PreparedVerbs, SourceKey,
    SourceRegistry, Verbs, VerbsConfig, VerbsError, select,
};
use epcomm_transport::sources::{self, Allocation};
use epcomm_transport::{
    Backend, BackendOptions, Bootstrap, Capabilities, DeviceBuffer, DeviceRuntime, KernelFamily,
    Limits, OptionSchema, REGISTRY_VERSION, Route, Schedule, SymmetricHeap, SymmetricMemory,
    Transport, TransportError, VirtualNodes, WorldLayout,
};

use crate::core::{ProxyCore, RingParts};
use crate::{ProxyOptions, parse_choice};

use memory::Mapped;
pub use memory::VerbsMemory;
pub use options::{GpuRegistration, VerbsOptions};
pub use probe::{ErrorText, Preflight, RdmaProbe, check_rdma, probe_rdma};
use probe::{agree, unavailable};
use registration::{
    Registration, SourceCache, VerbsSources, export_dmabuf, page_size, resolve_registration,
};

/// The transport's name (spec `proxy-verbs`).
pub const NAME: &str = "proxy-verbs";

/// The capabilities of [`VerbsTransport`].
pub const CAPABILITIES: Capabilities = Capabilities {
    name: NAME,
    kernel_family: KernelFamily::CpuProxy,
    schedules: &Schedule::ALL,
    routes: &[Route::Store, Route::PutSignal],
};

/// This backend's entry in the transport table: `proxy-verbs` (every peer through the NIC),
/// `proxy-verbs:vnodes=N` (stores inside each of `N` logical nodes per host). Its probe and
/// preflight check libibverbs and an RDMA device with an active port.
pub const BACKEND: Backend = Backend {
    version: REGISTRY_VERSION,
    name: NAME,
    aliases: &[],
    forms: &["proxy-verbs", "proxy-verbs:vnodes=N"],
    options: OptionSchema::VirtualNodes {
        default: VirtualNodes::OnePerGpu,
    },
    capabilities: CAPABILITIES,
    limits: Limits {
        spans_hosts: true,
        executor: Some(crate::executor_limits("RDMA writes", VERBS_ENV)),
    },
    // libibverbs is checked by the probe and the preflight (`needs_rdma_device`).
    runtime_library: None,
    needs_rdma_device: true,
    world_layout: |options, world_size, rank, local| {
        VerbsTransport::world_layout(
            world_size,
            rank,
            local,
            options.virtual_nodes.per_host(local),
        )
    },
    probe: |_| {
        let options = VerbsOptions::from_env(1)?;
        options.validate()?;
        probe_rdma(&options).map(|_| ())
    },
    preflight: |options, bootstrap| spec_preflight(options, bootstrap).map(|_| ()),
    build: |options, ctx, bootstrap| {
        // The same checks `preflight` makes, first: a machine without an RDMA device fails
        // here, on every rank, before anything is allocated.
        let checked = spec_preflight(options, &bootstrap)?;
        Ok(Arc::new(VerbsTransport::with_preflight(
            ctx, bootstrap, checked,
        )?))
    },
    single_host_env: |ranks_per_gpu, local_ranks| {
        crate::single_host_env(ranks_per_gpu, local_ranks).into()
    },
};

/// The environment variables the `proxy-verbs` transport reads ([`VerbsOptions::from_env`]:
/// the proxy's, then its own; and where libibverbs is looked for).
pub const VERBS_ENV: &[&str] = &[
    "EPCOMM_PROXY_RING_SLOTS",
    "EPCOMM_PROXY_MAX_IN_FLIGHT",
    "EPCOMM_PROXY_MIRROR",
    "EPCOMM_PROXY_BATCH",
    "EPCOMM_PROXY_COPY_DEPTH",
    "EPCOMM_PROXY_COPY_STREAMS",
    "EPCOMM_PROXY_COPY_LINGER_US",
    "EPCOMM_PROXY_QUERY_US",
    "EPCOMM_PROXY_TRACE",
    "EPCOMM_VERBS_DEVICE",
    "EPCOMM_VERBS_PORT",
    "EPCOMM_VERBS_GID_INDEX",
    "EPCOMM_VERBS_REGISTRATION",
    "EPCOMM_IBVERBS_LIB",
];

/// The options from the environment with the spec's split, checked on every rank.
fn spec_preflight(
    options: BackendOptions,
    bootstrap: &Bootstrap,
) -> Result<Preflight, TransportError> {
    let local = bootstrap.local_world_size();
    let mut verbs = VerbsOptions::from_env(local)?;
    verbs.proxy.virtual_nodes = options.virtual_nodes.per_host(local);
    VerbsTransport::preflight(bootstrap, verbs)
}

/// Alignment of the symmetric buffer's size: `cuMemAlloc` hands out 2 MiB pages, so the
/// buffer starts and ends on a host page, as a dma-buf export needs.
const HEAP_ALIGN: usize = 2 << 20;

const IPC_HANDLE_BYTES: usize = 64;

/// The `proxy-verbs` transport of one process (one GPU); see the [module docs](self).
#[derive(Debug)]
pub struct VerbsTransport {
    ctx: Arc<CudaContext>,
    bootstrap: Arc<Bootstrap>,
    world: WorldLayout,
    options: VerbsOptions,
    probe: RdmaProbe,
    registration: Registration,
    allocations: AtomicU64,
}

impl VerbsTransport {
    /// The world for `world_size` ranks, `local_world_size` per host, seen from `rank`, each
    /// host split into `virtual_nodes` logical nodes (no GPU needed). Ranks may span hosts.
    ///
    /// # Errors
    /// [`TransportError::InvalidArgument`] naming `ProxyOptions::virtual_nodes` unless it
    /// divides the ranks per host; topology errors for inconsistent sizes.
    pub fn world_layout(
        world_size: usize,
        rank: usize,
        local_world_size: usize,
        virtual_nodes: usize,
    ) -> Result<WorldLayout, TransportError> {
        WorldLayout::new(world_size, rank, local_world_size)?;
        crate::split_hosts(world_size, rank, local_world_size, virtual_nodes)
    }

    /// [`Self::preflight`], then [`Self::with_preflight`] (collective: every rank of
    /// `bootstrap` calls it).
    ///
    /// # Errors
    /// As the two.
    pub fn new(
        ctx: Arc<CudaContext>,
        bootstrap: Arc<Bootstrap>,
        options: VerbsOptions,
    ) -> Result<Self, TransportError> {
        let checked = Self::preflight(&bootstrap, options)?;
        Self::with_preflight(ctx, bootstrap, checked)
    }

    /// What the constructor checks before it touches the GPU (collective, no GPU needed): the
    /// layout and the options, then [`check_rdma`] (libibverbs and the device, probed on
    /// every rank and agreed).
    ///
    /// # Errors
    /// As [`Self::world_layout`], [`VerbsOptions::validate`] and [`check_rdma`]
    /// ([`TransportError::Unavailable`] on a machine without libibverbs or an RDMA device).
    pub fn preflight(
        bootstrap: &Bootstrap,
        options: VerbsOptions,
    ) -> Result<Preflight, TransportError> {
        let world = Self::world_layout(
            bootstrap.world_size(),
            bootstrap.rank(),
            bootstrap.local_world_size(),
            options.proxy.virtual_nodes,
        )?;
        options.validate()?;
        let probe = check_rdma(bootstrap, &options)?;
        Ok(Preflight {
            world,
            options,
            probe,
        })
    }

    /// Builds the transport after [`Self::preflight`] (collective): each rank resolves its
    /// [`GpuRegistration`] on its GPU and the ranks agree.
    ///
    /// # Errors
    /// [`TransportError::Unavailable`] when GPU memory cannot be registered as asked (on this
    /// rank, or naming the rank where it cannot); [`TransportError::Driver`].
    pub fn with_preflight(
        ctx: Arc<CudaContext>,
        bootstrap: Arc<Bootstrap>,
        checked: Preflight,
    ) -> Result<Self, TransportError> {
        let Preflight {
            world,
            options,
            probe,
        } = checked;
        let local = nearest_probe(&ctx, &options, probe).and_then(|probe| {
            resolve_registration(&ctx, &probe, options.registration)
                .map(|registration| ((registration, probe), vec![]))
        });
        let ((registration, probe), _) =
            agree(&bootstrap, "proxy-verbs-registration", local, |p, why| {
                unavailable(format!("rank {p}: {why}"))
            })?;
        Ok(Self {
            ctx,
            bootstrap,
            world,
            options,
            probe,
            registration,
            allocations: AtomicU64::new(0),
        })
    }

    /// What the probe found on this rank (the device the transport uses).
    pub fn probe(&self) -> &RdmaProbe {
        &self.probe
    }

    /// How this rank registers GPU memory: `"dmabuf"` or `"peermem"`.
    pub fn registration(&self) -> &'static str {
        match self.registration {
            Registration::DmaBuf => GpuRegistration::DmaBuf.name(),
            Registration::PeerMemory => GpuRegistration::PeerMemory.name(),
        }
    }

    /// This rank's part of an allocation: the memory, its IPC handle, its dma-buf (if
    /// registered so) and the queue pairs in INIT.
    fn prepare_local(&self, bytes: usize) -> Result<LocalPart, TransportError> {
        let rounded = bytes.div_ceil(HEAP_ALIGN).max(1) * HEAP_ALIGN;
        let local = DeviceBuffer::zeroed(&self.ctx, rounded)?;
        let base = local.ptr();
        self.ctx
            .bind_to_thread()
            .map_err(driver("binding the CUDA context"))?;
        let mut handle = sys::CUipcMemHandle {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        // SAFETY: `handle` is a valid out-pointer and `base` a live cuMemAlloc allocation.
        unsafe { sys::cuIpcGetMemHandle(&mut handle, base) }
            .result()
            .map_err(driver("exporting the symmetric buffer (cuIpcGetMemHandle)"))?;
        let (heap, dmabuf) = match self.registration {
            Registration::DmaBuf => {
                let page = page_size();
                if base % page != 0 {
                    return Err(TransportError::Backend {
                        backend: NAME,
                        context: "exporting the symmetric buffer as a dma-buf".into(),
                        source: Box::new(ErrorText(format!(
                            "cuMemAlloc returned {base:#x}, not aligned to the {page}-byte host \
                             page"
                        ))),
                    });
                }
                let fd = export_dmabuf(&self.ctx, base, rounded as u64).map_err(|why| {
                    TransportError::Backend {
                        backend: NAME,
                        context: "exporting the symmetric buffer as a dma-buf".into(),
                        source: Box::new(ErrorText(why)),
                    }
                })?;
                use std::os::fd::AsRawFd;
                let heap = HeapMemory::DmaBuf {
                    fd: fd.as_raw_fd(),
                    offset: 0,
                    bytes: bytes as u64,
                    iova: base,
                };
                (heap, Some(fd))
            }
            Registration::PeerMemory => (
                HeapMemory::Address {
                    addr: base,
                    bytes: bytes as u64,
                },
                None,
            ),
        };
        let mut config = VerbsConfig::new(
            self.world.rank() as u32,
            self.world.world_size() as u32,
            heap,
        );
        config.library = self.options.library.clone();
        config.device = DeviceSelector::Name(self.probe.device.clone());
        config.port = Some(self.probe.port);
        config.gid = self.options.gid;
        config.send_queue_depth = self.options.send_queue_depth;
        // SAFETY: `local` (and the dma-buf `dmabuf`) outlive the executor: `VerbsMemory` stops
        // the proxy thread, which drops the executor, before it drops either; peers write it
        // only as the protocol allows.
        let prepared = unsafe { PreparedVerbs::prepare(config) }.map_err(|source| {
            TransportError::Backend {
                backend: NAME,
                context: format!(
                    "registering the {bytes}-byte symmetric buffer ({}) and creating queue pairs \
                     on {}",
                    self.registration_name(),
                    self.probe.device
                ),
                source: Box::new(source),
            }
        })?;
        let mut message = Vec::with_capacity(8 + IPC_HANDLE_BYTES + 64);
        message.extend_from_slice(&(bytes as u64).to_le_bytes());
        message.extend(handle.reserved.iter().map(|&c| c as u8));
        message.extend_from_slice(&prepared.endpoint_bytes());
        Ok(LocalPart {
            prepared,
            dmabuf,
            local,
            message,
        })
    }

    fn registration_name(&self) -> &'static str {
        match self.registration {
            Registration::DmaBuf => "dma-buf",
            Registration::PeerMemory => "by address, through nvidia-peermem",
        }
    }
}

fn driver(
    context: impl Into<String>,
) -> impl FnOnce(cudarc::driver::DriverError) -> TransportError {
    let context = context.into();
    move |source| TransportError::Driver { context, source }
}

/// One rank's part of an allocation before the exchange. Field order is drop order: the
/// queue pairs and the buffer's registration, then the dma-buf, then the buffer.
struct LocalPart {
    prepared: PreparedVerbs,
    dmabuf: Option<OwnedFd>,
    local: DeviceBuffer,
    message: Vec<u8>,
}

/// `probe`, or, when `options` leave the device to the transport
/// ([`VerbsOptions::nearest_to_gpu`] with [`DeviceSelector::FirstActive`]), the probe of the
/// active device nearest `ctx`'s GPU in the PCI tree.
///
/// # Errors
/// [`TransportError::Driver`] when the GPU's PCI address cannot be read; [`probe_rdma`]'s.
fn nearest_probe(
    ctx: &CudaContext,
    options: &VerbsOptions,
    probe: RdmaProbe,
) -> Result<RdmaProbe, TransportError> {
    if !(options.nearest_to_gpu && options.device == DeviceSelector::FirstActive) {
        return Ok(probe);
    }
    let mut near = options.clone();
    near.device = DeviceSelector::NearestTo(gpu_bus_id(ctx)?);
    probe_rdma(&near)
}

/// `ctx`'s GPU's PCI address as the driver prints it (`0000:1B:00.0`; a virtual function's
/// own function number included).
fn gpu_bus_id(ctx: &CudaContext) -> Result<String, TransportError> {
    let mut buf = [0 as std::ffi::c_char; 32];
    // SAFETY: `buf` holds `buf.len()` bytes, which the driver fills with a NUL-terminated string
    // of at most that length; `ctx.cu_device()` is a valid device of an initialised driver.
    let res = unsafe {
        cudarc::driver::sys::cuDeviceGetPCIBusId(
            buf.as_mut_ptr(),
            buf.len() as std::ffi::c_int,
            ctx.cu_device(),
        )
    };
    res.result().map_err(|source| TransportError::Driver {
        context: format!("cuDeviceGetPCIBusId of GPU {}", ctx.ordinal()),
        source,
    })?;
    let bytes: Vec<u8> = buf.iter().map(|&c| c as u8).collect();
    let id = std::ffi::CStr::from_bytes_until_nul(&bytes).map_err(|_| TransportError::Backend {
        backend: NAME,
        context: format!("cuDeviceGetPCIBusId of GPU {}", ctx.ordinal()),
        source: Box::new(ErrorText(
            "the driver's answer is not NUL-terminated".into(),
        )),
    })?;
    Ok(id.to_string_lossy().into_owned())
}

impl Transport for VerbsTransport {
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

impl DeviceRuntime for VerbsTransport {
    type ModuleBinding = ();

    unsafe fn bind_module(
        &self,
        _module: cudarc::driver::sys::CUmodule,
    ) -> Result<(), TransportError> {
        // As proxy-ce: the channel comes with the memory (`SymmetricMemory::bind_device_channel`).
        Ok(())
    }
}

impl SymmetricHeap for VerbsTransport {
    type Memory = VerbsMemory;

    fn alloc_symmetric(&self, bytes: usize) -> Result<VerbsMemory, TransportError> {
        let seq = self.allocations.fetch_add(1, Ordering::Relaxed);
        let local = self.prepare_local(bytes).map(|part| {
            let message = part.message.clone();
            (part, message)
        });
        let tag = format!("proxy-verbs-alloc-{seq}");
        let (part, messages) = agree(&self.bootstrap, &tag, local, |peer, why| {
            TransportError::Backend {
                backend: NAME,
                context: format!("rank {peer} could not prepare its {bytes}-byte symmetric buffer"),
                source: Box::new(ErrorText(why)),
            }
        })?;
        let built = self
            .finish(part, &messages, bytes)
            .map(|memory| (memory, Vec::new()));
        // Every rank connected before any kernel may put: agree once more.
        let tag = format!("proxy-verbs-connected-{seq}");
        let (memory, _) = agree(&self.bootstrap, &tag, built, |peer, why| {
            TransportError::Backend {
                backend: NAME,
                context: format!("rank {peer} could not connect its {bytes}-byte symmetric buffer"),
                source: Box::new(ErrorText(why)),
            }
        })?;
        Ok(memory)
    }
}

impl VerbsTransport {
    /// This rank's part of an allocation once every rank's record is here: maps the peers of
    /// this logical node, connects the queue pairs and starts the proxy.
    ///
    /// Drop order on failure: the executor (or the prepared queue pairs) is declared after
    /// `part`, so it is dropped, and the buffer's registration with it, before the buffer.
    fn finish(
        &self,
        part: LocalPart,
        messages: &[Vec<u8>],
        bytes: usize,
    ) -> Result<VerbsMemory, TransportError> {
        let world = self.world.world_size();
        let me = self.world.rank();
        let domain = self.world.nvlink_domain();
        let local_base = part.local.ptr();
        let mut mapped = Mapped {
            ctx: self.ctx.clone(),
            local_base,
            bases: vec![0; world],
            opened: Vec::new(),
        };
        let mut records = Vec::with_capacity(world);
        for (peer, data) in messages.iter().enumerate() {
            if data.len() < 8 + IPC_HANDLE_BYTES {
                return Err(TransportError::BadPeerData {
                    peer,
                    what: "symmetric buffer record",
                    detail: format!("{} bytes, fewer than {}", data.len(), 8 + IPC_HANDLE_BYTES),
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
            records.push(data[8 + IPC_HANDLE_BYTES..].to_vec());
            if peer == me {
                mapped.bases[peer] = local_base;
            } else if domain.contains(&peer) {
                let mut h = sys::CUipcMemHandle {
                    reserved: [0; IPC_HANDLE_BYTES],
                };
                for (dst, src) in h.reserved.iter_mut().zip(&data[8..8 + IPC_HANDLE_BYTES]) {
                    *dst = *src as std::ffi::c_char;
                }
                mapped.bases[peer] = mapped.open(peer, h)?;
            }
        }
        let LocalPart {
            prepared,
            dmabuf,
            local,
            message: _,
        } = part;
        let executor = prepared
            .connect(&records)
            .map_err(|source| TransportError::Backend {
                backend: NAME,
                context: "connecting the queue pairs".into(),
                source: Box::new(source),
            })?;
        let registry = executor.source_registry();
        let core = RingParts::new(&self.ctx, &self.options.proxy, NAME)?.spawn(
            executor,
            &self.options.proxy,
            world,
            bytes,
            local_base,
            None,
        )?;
        Ok(VerbsMemory {
            core,
            sources: SourceCache {
                registrar: VerbsSources {
                    registry,
                    registration: self.registration,
                    ctx: self.ctx.clone(),
                },
                cache: Mutex::new(sources::SourceCache::new()),
            },
            mapped,
            _dmabuf: dmabuf,
            len: bytes,
            local,
        })
    }
}
