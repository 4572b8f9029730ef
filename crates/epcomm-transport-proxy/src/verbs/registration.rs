//! How GPU memory reaches the NIC: the registration method ([`Registration`]), dma-buf export,
//! and the cache of caller allocations the kernels put from.

use super::*;

/// How this rank registers GPU memory (resolved from [`GpuRegistration::Auto`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Registration {
    DmaBuf,
    PeerMemory,
}

/// Whether the peer-memory module is loaded (`nvidia-peermem`, or the older `nv_peer_mem`).
pub(super) fn peer_memory_loaded() -> bool {
    ["/sys/module/nvidia_peermem", "/sys/module/nv_peer_mem"]
        .iter()
        .any(|p| std::path::Path::new(p).exists())
}

/// Resolves `asked` on this GPU with this library.
pub(super) fn resolve_registration(
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
pub(super) fn page_size() -> u64 {
    // SAFETY: sysconf only reads a configuration value; `_SC_PAGESIZE` is always valid.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(page).ok().filter(|&p| p > 0).unwrap_or(4096)
}

/// A dma-buf of `[start, start + bytes)` (page-aligned) of this context's memory.
pub(super) fn export_dmabuf(ctx: &CudaContext, start: u64, bytes: u64) -> Result<OwnedFd, String> {
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

/// Caller allocations registered as put sources, by range and buffer id
/// ([`epcomm_transport::sources::SourceCache`]). Registrations are kept until the buffer is
/// dropped or an allocation replaces them; with dma-bufs, the registration of an allocation the
/// caller freed keeps its dma-buf open until then.
#[derive(Debug)]
pub(super) struct SourceCache {
    pub(super) registrar: VerbsSources,
    pub(super) cache: Mutex<sources::SourceCache<SourceKey>>,
}

impl SourceCache {
    /// Registers every allocation overlapping `[addr, addr + bytes)` that is not registered
    /// yet (or was freed and replaced since).
    pub(super) fn prepare(
        &self,
        argument: &'static str,
        addr: u64,
        bytes: u64,
    ) -> Result<(), TransportError> {
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        // One memory, one user: the registry's regions go with the executor.
        cache.prepare(&self.registrar, 0, argument, addr, bytes)?;
        Ok(())
    }
}

/// How this transport registers caller memory with the NIC: through the executor's
/// [`SourceRegistry`], as [`Registration`] says.
#[derive(Debug)]
pub(super) struct VerbsSources {
    pub(super) registry: SourceRegistry,
    pub(super) registration: Registration,
    pub(super) ctx: Arc<CudaContext>,
}

impl sources::SourceRegistrar for VerbsSources {
    type Registration = SourceKey;

    fn who(&self) -> &str {
        "the proxy-verbs transport"
    }

    fn locate(&self, addr: u64) -> Result<Allocation, String> {
        let allocation = Allocation::at(addr)?;
        // A dma-buf export covers whole host pages (cuMemAlloc ranges already do).
        Ok(match self.registration {
            Registration::DmaBuf => allocation.page_aligned(page_size()),
            Registration::PeerMemory => allocation,
        })
    }

    fn register(
        &self,
        argument: &'static str,
        allocation: &Allocation,
    ) -> Result<SourceKey, TransportError> {
        let (start, bytes, range) = (allocation.start, allocation.bytes, allocation.to_string());
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

    fn unregister(&self, key: SourceKey) {
        self.registry.remove(key);
    }
}
