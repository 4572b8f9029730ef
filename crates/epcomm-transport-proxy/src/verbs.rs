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

use std::os::fd::{FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::{CudaContext, sys};
use epcomm_kernels::abi::ProxyChannel;
use epcomm_proxy::verbs::{
    DeviceSelector, GidSelector, HeapMemory, LibrarySearch, PreparedVerbs, SourceKey,
    SourceRegistry, Verbs, VerbsConfig, VerbsError, select,
};
use epcomm_transport::{
    Bootstrap, Capabilities, DeviceBuffer, DeviceRuntime, KernelFamily, Route, Schedule,
    SymmetricHeap, SymmetricMemory, Transport, TransportError, WorldLayout,
};

use crate::core::{ProxyCore, RingParts};
use crate::{ProxyOptions, parse_choice};

/// The transport's name (spec `proxy-verbs`).
pub const NAME: &str = "proxy-verbs";

/// The capabilities of [`VerbsTransport`].
pub const CAPABILITIES: Capabilities = Capabilities {
    name: NAME,
    kernel_family: KernelFamily::CpuProxy,
    schedules: &Schedule::ALL,
    routes: &[Route::Store, Route::PutSignal],
};

/// Alignment of the symmetric buffer's size: `cuMemAlloc` hands out 2 MiB pages, so the
/// buffer starts and ends on a host page, as a dma-buf export needs.
const HEAP_ALIGN: usize = 2 << 20;

const IPC_HANDLE_BYTES: usize = 64;

/// How GPU memory (the symmetric buffer, and caller arrays the kernels put from) is registered
/// with the NIC.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum GpuRegistration {
    /// [`GpuRegistration::DmaBuf`] where the CUDA driver and libibverbs support it, else
    /// [`GpuRegistration::PeerMemory`].
    #[default]
    Auto,
    /// A dma-buf of the range (`cuMemGetHandleForAddressRange`, then `ibv_reg_dmabuf_mr`):
    /// needs `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED` (driver and kernel) and rdma-core 34 or
    /// newer.
    DmaBuf,
    /// The address range (`ibv_reg_mr`): needs the `nvidia-peermem` kernel module.
    PeerMemory,
}

impl GpuRegistration {
    /// The spellings of `EPCOMM_VERBS_REGISTRATION`, in variant order.
    pub const NAMES: [&'static str; 3] = ["auto", "dmabuf", "peermem"];

    /// Its spelling.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => Self::NAMES[0],
            Self::DmaBuf => Self::NAMES[1],
            Self::PeerMemory => Self::NAMES[2],
        }
    }
}

/// How the `proxy-verbs` transport is set up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerbsOptions {
    /// The ring and proxy thread, as for `proxy-ce` (`virtual_nodes`, `ring_slots`,
    /// `max_in_flight`, the two bounds, `cpu`, `trace`). `mirror_progress` and `batch_copies`
    /// are copy-engine settings and are not used here.
    pub proxy: ProxyOptions,
    /// How GPU memory is registered with the NIC.
    pub registration: GpuRegistration,
    /// Which RDMA device (default: the first with an active port).
    pub device: DeviceSelector,
    /// Which port (`None`: the device's first active one).
    pub port: Option<u8>,
    /// Which GID (default: the first RoCE v2 GID; index 0 on InfiniBand).
    pub gid: GidSelector,
    /// Work requests in flight per peer; a full send queue makes the proxy wait.
    pub send_queue_depth: u32,
    /// Where libibverbs is looked for (`EPCOMM_IBVERBS_LIB`, then the system's loader).
    pub library: LibrarySearch,
}

impl VerbsOptions {
    /// Defaults for `local_world_size` ranks per host: [`ProxyOptions::one_node_per_rank`]
    /// (every peer through the NIC), [`GpuRegistration::Auto`], the first active device and
    /// port, the RoCE v2 GID, 256 work requests per send queue.
    pub fn one_node_per_rank(local_world_size: usize) -> Self {
        Self {
            proxy: ProxyOptions::one_node_per_rank(local_world_size),
            registration: GpuRegistration::Auto,
            device: DeviceSelector::FirstActive,
            port: None,
            gid: GidSelector::RoceV2,
            send_queue_depth: 256,
            library: LibrarySearch::from_env(),
        }
    }

    /// [`Self::one_node_per_rank`] with [`ProxyOptions::from_env`]'s variables and
    /// `EPCOMM_VERBS_DEVICE` (a device name), `EPCOMM_VERBS_PORT` (1..=255),
    /// `EPCOMM_VERBS_GID_INDEX` (0..=255), `EPCOMM_VERBS_REGISTRATION`
    /// (`auto`, `dmabuf`, `peermem`) when set.
    ///
    /// # Errors
    /// [`TransportError::InvalidArgument`] naming the variable whose value breaks its rule.
    pub fn from_env(local_world_size: usize) -> Result<Self, TransportError> {
        let mut options = Self::from_lookup(local_world_size, |k| std::env::var(k).ok())?;
        options.proxy = ProxyOptions::from_env(local_world_size)?;
        Ok(options)
    }

    /// [`Self::one_node_per_rank`] with the `EPCOMM_VERBS_*` variables read through
    /// `lookup` (the proxy's own variables are [`ProxyOptions::from_env`]'s).
    ///
    /// # Errors
    /// As [`Self::from_env`].
    pub fn from_lookup(
        local_world_size: usize,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, TransportError> {
        let mut options = Self::one_node_per_rank(local_world_size);
        let number = |name: &'static str, min: u8| -> Result<Option<u8>, TransportError> {
            match lookup(name) {
                None => Ok(None),
                Some(v) => match v.trim().parse::<u8>() {
                    Ok(n) if n >= min => Ok(Some(n)),
                    _ => Err(TransportError::InvalidArgument {
                        argument: name,
                        rule: format!("must be an integer in {min}..=255 (got {v:?})"),
                    }),
                },
            }
        };
        if let Some(name) = lookup("EPCOMM_VERBS_DEVICE") {
            let name = name.trim();
            if name.is_empty() {
                return Err(TransportError::InvalidArgument {
                    argument: "EPCOMM_VERBS_DEVICE",
                    rule: "must name an RDMA device (`mlx5_0`, `rxe0`) when set".into(),
                });
            }
            options.device = DeviceSelector::Name(name.to_string());
        }
        options.port = number("EPCOMM_VERBS_PORT", 1)?;
        if let Some(i) = number("EPCOMM_VERBS_GID_INDEX", 0)? {
            options.gid = GidSelector::Index(i);
        }
        if let Some(v) = lookup("EPCOMM_VERBS_REGISTRATION") {
            let i = parse_choice("EPCOMM_VERBS_REGISTRATION", &v, &GpuRegistration::NAMES)?;
            options.registration = match i {
                Some(1) => GpuRegistration::DmaBuf,
                Some(2) => GpuRegistration::PeerMemory,
                _ => GpuRegistration::Auto,
            };
        }
        Ok(options)
    }

    /// Checks every rule (no GPU, no device needed).
    ///
    /// # Errors
    /// [`ProxyOptions::validate`]'s; [`TransportError::InvalidArgument`] naming
    /// `VerbsOptions::send_queue_depth` unless it is above zero, or `VerbsOptions::port`
    /// when it is 0 (ports are numbered from 1).
    pub fn validate(&self) -> Result<(), TransportError> {
        self.proxy.validate()?;
        if self.send_queue_depth == 0 {
            return Err(TransportError::InvalidArgument {
                argument: "VerbsOptions::send_queue_depth",
                rule: "must be > 0".into(),
            });
        }
        if self.port == Some(0) {
            return Err(TransportError::InvalidArgument {
                argument: "VerbsOptions::port",
                rule: "ports are numbered from 1".into(),
            });
        }
        Ok(())
    }
}

/// What [`probe_rdma`] found: the device, port and GID the transport will use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaProbe {
    /// Where libibverbs was loaded from.
    pub library: PathBuf,
    /// The device (`mlx5_0`, `rxe0`).
    pub device: String,
    /// Its active port.
    pub port: u8,
    /// The GID index.
    pub gid_index: u8,
    /// `"Ethernet"` (RoCE) or `"InfiniBand"`.
    pub link_layer: &'static str,
    /// Whether libibverbs can register dma-bufs (`ibv_reg_dmabuf_mr`).
    pub dmabuf: bool,
}

/// The first thing the transport does, on this rank alone and without a GPU: loads
/// libibverbs and selects the device, port and GID `options` ask for (the device is opened
/// and closed again).
///
/// # Errors
/// [`TransportError::Unavailable`] (`what`: `"proxy-verbs"`) when libibverbs is not found, when
/// the machine has no RDMA device (`no RDMA device: …`), no active port or no usable GID, or a
/// verbs call fails; [`TransportError::InvalidArgument`] naming `VerbsOptions::device` when
/// the device asked for does not exist.
pub fn probe_rdma(options: &VerbsOptions) -> Result<RdmaProbe, TransportError> {
    let verbs = Arc::new(Verbs::load(&options.library).map_err(|e| unavailable(e.to_string()))?);
    let selected = select::select(&verbs, &options.device, options.port, options.gid).map_err(
        |e| match e {
            VerbsError::DeviceNotFound { .. } => TransportError::InvalidArgument {
                argument: "VerbsOptions::device",
                rule: e.to_string(),
            },
            other => unavailable(other.to_string()),
        },
    )?;
    Ok(RdmaProbe {
        library: verbs.path().to_path_buf(),
        device: selected.context.name().to_string(),
        port: selected.port,
        gid_index: selected.gid_index,
        // enum ibv_link_layer: 2 is Ethernet; 1 (and 0, unspecified) InfiniBand.
        link_layer: if selected.port_attr.link_layer == 2 {
            "Ethernet"
        } else {
            "InfiniBand"
        },
        dmabuf: verbs.supports_dmabuf(),
    })
}

fn unavailable(why: String) -> TransportError {
    TransportError::Unavailable { what: NAME, why }
}

/// An error known by its text only: what a peer reported instead of its part of a collective
/// step, or a failed driver call's description.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ErrorText(pub String);

/// Every rank's outcome of a local step, agreed over the bootstrap (`tag`): this rank's value
/// when every rank succeeded; this rank's own error when it failed; else `on_peer(rank,
/// message)` for the first rank that failed. Every rank takes part even after a local
/// failure, so none waits for a rank that gave up.
fn agree<T>(
    bootstrap: &Bootstrap,
    tag: &str,
    local: Result<(T, Vec<u8>), TransportError>,
    on_peer: impl FnOnce(usize, String) -> TransportError,
) -> Result<(T, Vec<Vec<u8>>), TransportError> {
    let msg = match &local {
        Ok((_, payload)) => [&[0u8][..], payload].concat(),
        Err(e) => [&[1u8][..], e.to_string().as_bytes()].concat(),
    };
    let all = bootstrap
        .all_gather(tag, &msg)
        .map_err(|source| TransportError::Bootstrap {
            context: format!("agreeing on the outcome of {tag}"),
            source,
        })?;
    let (value, _) = local?;
    let mut payloads = Vec::with_capacity(all.len());
    for (peer, m) in all.into_iter().enumerate() {
        match m.split_first() {
            Some((0, rest)) => payloads.push(rest.to_vec()),
            Some((_, text)) => {
                return Err(on_peer(peer, String::from_utf8_lossy(text).into_owned()));
            }
            None => {
                return Err(TransportError::BadPeerData {
                    peer,
                    what: "outcome",
                    detail: format!("an empty message for {tag}"),
                });
            }
        }
    }
    Ok((value, payloads))
}

/// [`probe_rdma`] on every rank of `bootstrap`, agreed (collective): what
/// [`VerbsTransport::new`] does first, before it touches the GPU.
///
/// # Errors
/// This rank's [`probe_rdma`] error; else [`TransportError::Unavailable`] naming the first
/// rank whose probe failed, with its reason; [`TransportError::Bootstrap`].
pub fn check_rdma(
    bootstrap: &Bootstrap,
    options: &VerbsOptions,
) -> Result<RdmaProbe, TransportError> {
    let local = probe_rdma(options).map(|p| (p, Vec::new()));
    agree(bootstrap, "proxy-verbs-probe", local, |peer, why| {
        unavailable(format!("rank {peer}: {why}"))
    })
    .map(|(probe, _)| probe)
}

/// How this rank registers GPU memory (resolved from [`GpuRegistration::Auto`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Registration {
    DmaBuf,
    PeerMemory,
}

/// Whether the peer-memory module is loaded (`nvidia-peermem`, or the older `nv_peer_mem`).
fn peer_memory_loaded() -> bool {
    ["/sys/module/nvidia_peermem", "/sys/module/nv_peer_mem"]
        .iter()
        .any(|p| std::path::Path::new(p).exists())
}

/// Resolves `asked` on this GPU with this library.
fn resolve_registration(
    ctx: &CudaContext,
    probe: &RdmaProbe,
    asked: GpuRegistration,
) -> Result<Registration, TransportError> {
    let driver = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)
        .map_err(|source| TransportError::Driver {
            context: "querying CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED".into(),
            source,
        })?
        != 0;
    let gpu = ctx.ordinal();
    let no_driver = format!(
        "the CUDA driver cannot export GPU {gpu}'s memory as a dma-buf \
         (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 0)"
    );
    let no_library = format!(
        "{} lacks ibv_reg_dmabuf_mr (rdma-core 34 or newer has it)",
        probe.library.display()
    );
    let no_peermem = "the nvidia-peermem kernel module is not loaded \
                      (/sys/module/nvidia_peermem is absent; `modprobe nvidia-peermem`)";
    match asked {
        GpuRegistration::DmaBuf if !driver => Err(unavailable(format!(
            "registration dmabuf: {no_driver} (registration peermem registers by address, \
             with the nvidia-peermem module)"
        ))),
        GpuRegistration::DmaBuf if !probe.dmabuf => {
            Err(unavailable(format!("registration dmabuf: {no_library}")))
        }
        GpuRegistration::DmaBuf => Ok(Registration::DmaBuf),
        GpuRegistration::Auto if driver && probe.dmabuf => Ok(Registration::DmaBuf),
        GpuRegistration::PeerMemory | GpuRegistration::Auto if peer_memory_loaded() => {
            Ok(Registration::PeerMemory)
        }
        GpuRegistration::PeerMemory => {
            Err(unavailable(format!("registration peermem: {no_peermem}")))
        }
        GpuRegistration::Auto => {
            let dmabuf = if driver { no_library } else { no_driver };
            Err(unavailable(format!(
                "GPU memory cannot be registered with the NIC: no dma-buf ({dmabuf}) and no \
                 peer memory ({no_peermem})"
            )))
        }
    }
}

/// The host page size.
fn page_size() -> u64 {
    // SAFETY: sysconf only reads a configuration value; `_SC_PAGESIZE` is always valid.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(page).ok().filter(|&p| p > 0).unwrap_or(4096)
}

/// A dma-buf of `[start, start + bytes)` (page-aligned) of this context's memory.
fn export_dmabuf(ctx: &CudaContext, start: u64, bytes: u64) -> Result<OwnedFd, String> {
    ctx.bind_to_thread().map_err(|e| e.to_string())?;
    let len = usize::try_from(bytes).map_err(|_| format!("{bytes} bytes do not fit in usize"))?;
    let mut fd: std::ffi::c_int = -1;
    // SAFETY: `fd` is a live c_int, the handle type DMA_BUF_FD writes one file descriptor; the
    // range is device memory of this context (the caller's), no flags.
    let r = unsafe {
        sys::cuMemGetHandleForAddressRange(
            (&mut fd as *mut std::ffi::c_int).cast(),
            start,
            len,
            sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS || fd < 0 {
        return Err(format!(
            "cuMemGetHandleForAddressRange([{start:#x}, {:#x})) failed: {r:?}",
            start + bytes
        ));
    }
    // SAFETY: the driver returned a new file descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The CUDA allocation holding `addr`: its start, size and process-unique buffer id.
fn allocation_at(addr: u64) -> Result<(u64, u64, u64), String> {
    let mut start: u64 = 0;
    let mut size: u64 = 0;
    let mut id: u64 = 0;
    for (out, attribute) in [
        (
            &mut start,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        ),
        (
            &mut size,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        ),
        (
            &mut id,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_BUFFER_ID,
        ),
    ] {
        // SAFETY: each of these attributes writes one 64-bit value (a CUdeviceptr, a size_t,
        // an unsigned long long) into the live u64 it is given; the query only reads the
        // driver's table of allocations.
        let r = unsafe { sys::cuPointerGetAttribute((out as *mut u64).cast(), attribute, addr) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(format!(
                "cuPointerGetAttribute({attribute:?}) failed: {r:?}"
            ));
        }
    }
    if size == 0 || start > addr || addr - start >= size {
        return Err(format!(
            "the driver reported the range [{start:#x}, +{size}) for address {addr:#x}"
        ));
    }
    Ok((start, size, id))
}

/// Caller allocations registered as put sources, by range and buffer id. Registrations are
/// kept until the buffer is dropped or an allocation replaces them; with dma-bufs, the
/// registration of an allocation the caller freed keeps its dma-buf open until then.
#[derive(Debug)]
struct SourceCache {
    registry: SourceRegistry,
    registration: Registration,
    ctx: Arc<CudaContext>,
    entries: Mutex<Vec<CachedSource>>,
}

#[derive(Debug, Clone, Copy)]
struct CachedSource {
    start: u64,
    bytes: u64,
    buffer_id: u64,
    key: SourceKey,
}

impl SourceCache {
    /// Registers every allocation overlapping `[addr, addr + bytes)` that is not registered
    /// yet (or was freed and replaced since).
    fn prepare(&self, argument: &'static str, addr: u64, bytes: u64) -> Result<(), TransportError> {
        let end = addr
            .checked_add(bytes)
            .ok_or_else(|| TransportError::InvalidArgument {
                argument,
                rule: format!("[{addr:#x}, +{bytes}) wraps around the address space"),
            })?;
        // A dma-buf export covers whole host pages (cuMemAlloc ranges already do).
        let page = match self.registration {
            Registration::DmaBuf => page_size(),
            Registration::PeerMemory => 1,
        };
        let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        let mut cursor = addr;
        while cursor < end {
            let (start, size, buffer_id) =
                allocation_at(cursor).map_err(|why| TransportError::InvalidArgument {
                    argument,
                    rule: format!(
                        "the proxy-verbs transport puts from it, so it must be CUDA device \
                         memory it can register: address {cursor:#x}: {why}"
                    ),
                })?;
            let (lo, hi) = (start / page * page, (start + size).div_ceil(page) * page);
            cursor = start + size;
            let registered = entries
                .iter()
                .any(|e| e.start == lo && e.bytes == hi - lo && e.buffer_id == buffer_id);
            if registered {
                continue;
            }
            // A new allocation: what was registered where it lies belongs to allocations freed
            // since (live ones never overlap), and must not serve its addresses any longer.
            entries.retain(|e| {
                let stale = e.start < hi && lo < e.start + e.bytes;
                if stale {
                    self.registry.remove(e.key);
                }
                !stale
            });
            let key = self.register(argument, lo, hi - lo)?;
            entries.push(CachedSource {
                start: lo,
                bytes: hi - lo,
                buffer_id,
                key,
            });
        }
        Ok(())
    }

    fn register(
        &self,
        argument: &'static str,
        start: u64,
        bytes: u64,
    ) -> Result<SourceKey, TransportError> {
        let range = format!("[{start:#x}, {:#x})", start + bytes);
        match self.registration {
            Registration::DmaBuf => {
                let fd = export_dmabuf(&self.ctx, start, bytes).map_err(|why| {
                    TransportError::InvalidArgument {
                        argument,
                        rule: format!(
                            "the allocation holding it, {range}, cannot be exported as a dma-buf \
                             for the NIC ({why}); registration peermem registers by address"
                        ),
                    }
                })?;
                // SAFETY: the registry keeps the dma-buf open while the region is registered;
                // the exporter (the CUDA driver), not this process's mappings, decides what
                // its pages are, so freeing the allocation never leaves the NIC reading memory
                // this process reuses: a new allocation at the same address has a new buffer
                // id and gets a registration of its own. The region's rkey is never sent to a
                // peer: only this rank's NIC reads it (transfer sources).
                unsafe { self.registry.register_dmabuf(fd, 0, bytes, start) }
            }
            // SAFETY: the range is the caller's live CUDA allocation; when it is freed,
            // nvidia-peermem invalidates the registration (work requests from it then fail
            // instead of reading freed memory), and a new allocation at the same address has a
            // new buffer id and is registered anew. The rkey is never sent to a peer.
            Registration::PeerMemory => unsafe { self.registry.register(start, bytes) },
        }
        .map_err(|source| TransportError::Backend {
            backend: NAME,
            context: format!("registering {argument}'s allocation {range} with the NIC"),
            source: Box::new(source),
        })
    }
}

/// What [`VerbsTransport::preflight`] checked: the layout, the options and the probe.
#[derive(Clone, Debug)]
pub struct Preflight {
    world: WorldLayout,
    options: VerbsOptions,
    probe: RdmaProbe,
}

impl Preflight {
    /// What the probe found on this rank.
    pub fn probe(&self) -> &RdmaProbe {
        &self.probe
    }

    /// The world layout.
    pub fn world(&self) -> WorldLayout {
        self.world
    }
}

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
        let local = resolve_registration(&ctx, &probe, options.registration).map(|r| (r, vec![]));
        let (registration, _) = agree(&bootstrap, "proxy-verbs-registration", local, |p, why| {
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

    /// What the probe found on this rank.
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
        // As proxy-ce: the channel comes with the memory (`SymmetricMemory::proxy_channel`).
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
                registry,
                registration: self.registration,
                ctx: self.ctx.clone(),
                entries: Mutex::new(Vec::new()),
            },
            mapped,
            _dmabuf: dmabuf,
            len: bytes,
            local,
        })
    }
}

/// The CUDA-IPC mappings of the peers in this rank's logical node.
#[derive(Debug)]
struct Mapped {
    ctx: Arc<CudaContext>,
    /// This rank's own buffer (never closed here).
    local_base: u64,
    /// Per rank: its buffer's address in this process (0: not mapped).
    bases: Vec<u64>,
    opened: Vec<u64>,
}

impl Mapped {
    fn open(&mut self, peer: usize, handle: sys::CUipcMemHandle) -> Result<u64, TransportError> {
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `handle` was exported by a live peer process on this host; `ptr` is a valid
        // out-pointer.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                handle,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result()
        .map_err(driver(format!(
            "opening rank {peer}'s symmetric buffer (cuIpcOpenMemHandle)"
        )))?;
        self.opened.push(ptr);
        Ok(ptr)
    }

    fn close(&mut self) {
        let me = self.local_base;
        let _ = self.ctx.bind_to_thread();
        for ptr in self.opened.drain(..) {
            // SAFETY: `ptr` was returned by cuIpcOpenMemHandle and is closed exactly once
            // (drained from `opened`).
            let _ = unsafe { sys::cuIpcCloseMemHandle(ptr) };
        }
        for b in self.bases.iter_mut().filter(|b| **b != me) {
            *b = 0;
        }
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        self.close();
    }
}

/// A symmetric buffer registered with the NIC, with the proxy thread serving it.
///
/// Field order is drop order, after `Drop` stopped the proxy (which drops the executor, its
/// queue pairs and the buffer's registration): the ring and counters, the caller-memory
/// registrations, the peer mappings, the dma-buf, the buffer.
#[derive(Debug)]
pub struct VerbsMemory {
    core: ProxyCore,
    sources: SourceCache,
    mapped: Mapped,
    _dmabuf: Option<OwnedFd>,
    len: usize,
    local: DeviceBuffer,
}

impl VerbsMemory {
    /// The proxy's report once it has stopped (after teardown): its counts, or the error it
    /// stopped on.
    pub fn report(&self) -> Option<Result<epcomm_proxy::ProxyReport, String>> {
        self.core.report()
    }

    /// The caller allocations registered as put sources so far, as `(start, bytes)`.
    pub fn registered_sources(&self) -> Vec<(u64, u64)> {
        self.sources.registry.regions()
    }
}

impl SymmetricMemory for VerbsMemory {
    fn len(&self) -> usize {
        self.len
    }

    fn local_base(&self) -> u64 {
        self.local.ptr()
    }

    fn peer_base(&self, peer: usize) -> Option<u64> {
        self.mapped.bases.get(peer).copied().filter(|&b| b != 0)
    }

    fn release_peer_mappings(&mut self) {
        // No more RDMA WRITEs from this rank after this; stores stop with the mappings.
        self.core.stop();
        self.mapped.close();
    }

    fn proxy_channel(&self) -> Option<ProxyChannel> {
        Some(self.core.channel())
    }

    fn backend_failure(&self) -> Option<String> {
        self.core.failure()
    }

    fn prepare_put_source(
        &self,
        argument: &'static str,
        addr: u64,
        bytes: usize,
    ) -> Result<(), TransportError> {
        let base = self.local.ptr();
        let end = addr.saturating_add(bytes as u64);
        if bytes == 0 || (addr >= base && end <= base + self.len as u64) {
            // The symmetric buffer is registered already.
            return Ok(());
        }
        self.sources.prepare(argument, addr, bytes as u64)
    }
}

impl Drop for VerbsMemory {
    fn drop(&mut self) {
        // The proxy thread first (it drops the executor, its queue pairs and the buffer's
        // registration); the fields follow in order.
        self.core.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup(vars: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn variables_set_the_device_port_gid_and_registration() {
        let o = VerbsOptions::from_lookup(
            4,
            lookup(&[
                ("EPCOMM_VERBS_DEVICE", " mlx5_1 "),
                ("EPCOMM_VERBS_PORT", "2"),
                ("EPCOMM_VERBS_GID_INDEX", "3"),
                ("EPCOMM_VERBS_REGISTRATION", "peermem"),
            ]),
        )
        .unwrap();
        assert_eq!(o.device, DeviceSelector::Name("mlx5_1".into()));
        assert_eq!(o.port, Some(2));
        assert_eq!(o.gid, GidSelector::Index(3));
        assert_eq!(o.registration, GpuRegistration::PeerMemory);
        assert_eq!(o.proxy.virtual_nodes, 4);
        assert!(o.validate().is_ok());
        let d = VerbsOptions::from_lookup(2, lookup(&[])).unwrap();
        assert_eq!(d.registration, GpuRegistration::Auto);
        assert_eq!(d.device, DeviceSelector::FirstActive);
        assert_eq!((d.port, d.gid), (None, GidSelector::RoceV2));
    }

    #[test]
    fn bad_variables_and_options_are_named() {
        for (vars, name) in [
            (&[("EPCOMM_VERBS_PORT", "0")][..], "EPCOMM_VERBS_PORT"),
            (&[("EPCOMM_VERBS_PORT", "x")][..], "EPCOMM_VERBS_PORT"),
            (
                &[("EPCOMM_VERBS_GID_INDEX", "256")][..],
                "EPCOMM_VERBS_GID_INDEX",
            ),
            (&[("EPCOMM_VERBS_DEVICE", "  ")][..], "EPCOMM_VERBS_DEVICE"),
            (
                &[("EPCOMM_VERBS_REGISTRATION", "rdma")][..],
                "EPCOMM_VERBS_REGISTRATION",
            ),
        ] {
            let vars: &'static [(&'static str, &'static str)] = vars;
            match VerbsOptions::from_lookup(1, lookup(vars)) {
                Err(TransportError::InvalidArgument { argument, rule }) => {
                    assert_eq!(argument, name, "{rule}")
                }
                other => panic!("{name}: expected InvalidArgument, got {other:?}"),
            }
        }
        let ok = VerbsOptions::one_node_per_rank(2);
        let zero_depth = VerbsOptions {
            send_queue_depth: 0,
            ..ok.clone()
        };
        let err = zero_depth.validate().unwrap_err().to_string();
        assert!(err.contains("send_queue_depth"), "{err}");
        let port0 = VerbsOptions {
            port: Some(0),
            ..ok.clone()
        };
        assert!(port0.validate().unwrap_err().to_string().contains("port"));
        let bad_ring = VerbsOptions {
            proxy: ProxyOptions {
                ring_slots: 3,
                ..ok.proxy
            },
            ..ok
        };
        let err = bad_ring.validate().unwrap_err().to_string();
        assert!(err.contains("ring_slots"), "{err}");
    }

    #[test]
    fn layouts_span_hosts_and_split_them() {
        // Two hosts of four GPUs, two logical nodes each: rank 5's node is 4..6.
        let w = VerbsTransport::world_layout(8, 5, 4, 2).unwrap();
        assert_eq!(w.nvlink_domain(), 4..6);
        // One logical node per GPU.
        let w = VerbsTransport::world_layout(8, 5, 4, 4).unwrap();
        assert_eq!(w.nvlink_domain(), 5..6);
        let err = VerbsTransport::world_layout(8, 0, 4, 3)
            .unwrap_err()
            .to_string();
        assert!(err.contains("vnodes=3"), "{err}");
    }

    /// Whether the kernel exposes any RDMA device (`/sys/class/infiniband/<dev>`).
    fn kernel_lists_rdma_devices() -> bool {
        std::fs::read_dir("/sys/class/infiniband").is_ok_and(|mut d| d.next().is_some())
    }

    /// The constructor's first step on this machine: without libibverbs or without an RDMA
    /// device it is `Unavailable` naming the transport and the reason.
    #[test]
    fn probe_without_a_device_is_unavailable() {
        match probe_rdma(&VerbsOptions::one_node_per_rank(1)) {
            Ok(probe) => eprintln!(
                "SKIP: an RDMA device is present ({} port {}, {}): the no-device path cannot \
                 be checked here",
                probe.device, probe.port, probe.link_layer
            ),
            Err(TransportError::Unavailable { what, why }) => {
                assert_eq!(what, "proxy-verbs");
                if !kernel_lists_rdma_devices() {
                    assert!(
                        why.starts_with("no RDMA device: ") || why.contains("was not found"),
                        "{why}"
                    );
                }
                let msg = unavailable(why).to_string();
                assert!(
                    msg.starts_with("proxy-verbs is unavailable on this machine: "),
                    "{msg}"
                );
                eprintln!("{msg}");
            }
            Err(other) => panic!("expected Unavailable, got {other}"),
        }
    }

    /// Without libibverbs (here: a search of an empty directory only) the probe is
    /// `Unavailable`, listing where it looked.
    #[test]
    fn probe_without_libibverbs_is_unavailable() {
        let dir = std::env::temp_dir().join(format!("epcomm-no-ibverbs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        let options = VerbsOptions {
            library: LibrarySearch::only(&dir),
            ..VerbsOptions::one_node_per_rank(1)
        };
        match probe_rdma(&options) {
            Err(TransportError::Unavailable { what, why }) => {
                assert_eq!(what, "proxy-verbs");
                assert!(why.contains("libibverbs.so.1"), "{why}");
                assert!(why.contains(&dir.display().to_string()), "{why}");
            }
            other => panic!("expected Unavailable, got {other:?}"),
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Bootstraps of `world` ranks over 127.0.0.1, one thread each, running `f(bootstrap)`.
    fn on_ranks<T: Send + 'static>(
        world: usize,
        f: impl Fn(Bootstrap) -> T + Send + Sync + Clone + 'static,
    ) -> Vec<T> {
        let port = epcomm_bootstrap::launch::free_port().expect("a free port");
        let threads: Vec<_> = (0..world)
            .map(|rank| {
                let f = f.clone();
                std::thread::spawn(move || {
                    let cfg = epcomm_bootstrap::BootstrapConfig::single_host(
                        port,
                        rank,
                        world,
                        std::time::Duration::from_secs(20),
                    );
                    f(Bootstrap::connect(cfg).expect("bootstrap"))
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("rank thread"))
            .collect()
    }

    /// A rank whose local step failed still takes part in the agreement: the others get an
    /// error naming it instead of waiting for it, and it gets its own error.
    #[test]
    fn agreement_names_the_rank_that_failed() {
        let out = on_ranks(3, |b| {
            let local = if b.rank() == 1 {
                Err(unavailable("no RDMA device: (test)".into()))
            } else {
                Ok((b.rank(), vec![b.rank() as u8]))
            };
            agree(&b, "test-agree", local, |peer, why| {
                unavailable(format!("rank {peer}: {why}"))
            })
            .map_err(|e| e.to_string())
        });
        for (rank, r) in out.iter().enumerate() {
            let err = r.as_ref().expect_err("someone failed");
            if rank == 1 {
                assert_eq!(
                    err,
                    "proxy-verbs is unavailable on this machine: no RDMA device: (test)"
                );
            } else {
                assert!(
                    err.contains("rank 1: proxy-verbs is unavailable on this machine: no RDMA"),
                    "{err}"
                );
            }
        }
        // All succeed: every rank's payload comes back, in rank order.
        let out = on_ranks(2, |b| {
            let local = Ok((b.rank(), vec![10 + b.rank() as u8]));
            agree(&b, "test-agree-ok", local, |_, why| unavailable(why)).map_err(|e| e.to_string())
        });
        for (rank, r) in out.into_iter().enumerate() {
            let (value, payloads) = r.expect("every rank succeeded");
            assert_eq!(value, rank);
            assert_eq!(payloads, vec![vec![10], vec![11]]);
        }
    }

    /// The collective probe the constructor runs first, on two ranks of this machine: where
    /// neither has a device, both get `Unavailable` (no rank waits for the other).
    #[test]
    fn collective_probe_without_a_device_fails_on_every_rank() {
        let out = on_ranks(2, |b| check_rdma(&b, &VerbsOptions::one_node_per_rank(2)));
        match &out[..] {
            [Ok(p), Ok(_)] => eprintln!(
                "SKIP: an RDMA device is present ({}): the no-device path cannot be checked here",
                p.device
            ),
            results => {
                for r in results {
                    assert!(
                        matches!(
                            r,
                            Err(TransportError::Unavailable {
                                what: "proxy-verbs",
                                ..
                            })
                        ),
                        "{r:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn registration_names_round_trip() {
        for (i, r) in [
            GpuRegistration::Auto,
            GpuRegistration::DmaBuf,
            GpuRegistration::PeerMemory,
        ]
        .into_iter()
        .enumerate()
        {
            assert_eq!(r.name(), GpuRegistration::NAMES[i]);
        }
    }
}
