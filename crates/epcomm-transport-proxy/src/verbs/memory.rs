//! [`VerbsMemory`]: one buffer's symmetric memory, its peer mappings and registrations.

use super::*;

/// The CUDA-IPC mappings of the peers in this rank's logical node.
#[derive(Debug)]
pub(super) struct Mapped {
    pub(super) ctx: Arc<CudaContext>,
    /// This rank's own buffer (never closed here).
    pub(super) local_base: u64,
    /// Per rank: its buffer's address in this process (0: not mapped).
    pub(super) bases: Vec<u64>,
    pub(super) opened: Vec<u64>,
}

impl Mapped {
    pub(super) fn open(
        &mut self,
        peer: usize,
        handle: sys::CUipcMemHandle,
    ) -> Result<u64, TransportError> {
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
    pub(super) core: ProxyCore,
    pub(super) sources: SourceCache,
    pub(super) mapped: Mapped,
    pub(super) _dmabuf: Option<OwnedFd>,
    pub(super) len: usize,
    pub(super) local: DeviceBuffer,
}

impl VerbsMemory {
    /// The proxy's report once it has stopped (after teardown): its counts, or the error it
    /// stopped on.
    pub fn report(&self) -> Option<Result<epcomm_proxy::ProxyReport, String>> {
        self.core.report()
    }

    /// The caller allocations registered as put sources so far, as `(start, bytes)`.
    pub fn registered_sources(&self) -> Vec<(u64, u64)> {
        self.sources.registrar.registry.regions()
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

    unsafe fn bind_device_channel(
        &self,
        module: cudarc::driver::sys::CUmodule,
        stream: &cudarc::driver::CudaStream,
    ) -> Result<bool, TransportError> {
        // SAFETY: the caller upholds the trait's contract, which is the core's.
        unsafe { self.core.bind_channel(module, stream) }.map(|()| true)
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
