//! Owned CUDA allocations with raw addresses, for memory that kernels address directly:
//! device buffers and host-mapped (zero-copy) pinned buffers. Raw addresses are what the kernel
//! argument blocks carry; these types own them and free them on drop.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, sys};

use crate::{DriverContext, TransportError};

fn check(res: sys::CUresult) -> Result<(), cudarc::driver::DriverError> {
    res.result()
}

/// A zero-initialised device allocation owned by this process.
#[derive(Debug)]
pub struct DeviceBuffer {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl DeviceBuffer {
    /// Allocates `len` bytes (at least 1) on `ctx`'s device and zeroes them.
    pub fn zeroed(ctx: &Arc<CudaContext>, len: usize) -> Result<Self, TransportError> {
        ctx.bind_to_thread().context("binding the CUDA context")?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is a valid out-pointer; the size is nonzero.
        check(unsafe { sys::cuMemAlloc_v2(&mut ptr, len.max(1)) })
            .context(format!("allocating {len} bytes of device memory"))?;
        let buf = Self {
            ctx: ctx.clone(),
            ptr,
            len,
        };
        // SAFETY: `ptr` is a live allocation of at least `len` bytes.
        check(unsafe { sys::cuMemsetD8_v2(ptr, 0, len.max(1)) })
            .context("zeroing device memory")?;
        // cuMemset may return before the device finished; peers may write into this memory
        // as soon as setup completes, so the zeroing must be done by then.
        ctx.synchronize().context("waiting for the zeroing")?;
        Ok(buf)
    }

    /// Device address of the first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when zero-sized.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `count` values of `T` starting at byte `offset` to the host, ordered after the
    /// work already queued on `stream` (waits for it).
    pub fn read<T: bytemuck::Pod>(
        &self,
        stream: &CudaStream,
        offset: usize,
        count: usize,
    ) -> Result<Vec<T>, TransportError> {
        let bytes = count * size_of::<T>();
        self.bounds("read", offset, bytes)?;
        // SAFETY: the range was bounds-checked against this live allocation.
        unsafe { copy_dtoh(stream, self.ptr + offset as u64, count) }
    }

    /// Copies `data` into the buffer at byte `offset`, ordered on `stream`, and waits for it.
    pub fn write<T: bytemuck::Pod>(
        &self,
        stream: &CudaStream,
        offset: usize,
        data: &[T],
    ) -> Result<(), TransportError> {
        let bytes = std::mem::size_of_val(data);
        self.bounds("write", offset, bytes)?;
        // SAFETY: the range was bounds-checked against this live allocation.
        unsafe { copy_htod(stream, self.ptr + offset as u64, data) }
    }

    fn bounds(
        &self,
        what: &'static str,
        offset: usize,
        bytes: usize,
    ) -> Result<(), TransportError> {
        let end = offset.saturating_add(bytes);
        if end > self.len {
            return Err(TransportError::OutOfBounds {
                what,
                offset,
                end,
                len: self.len,
            });
        }
        Ok(())
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `ptr` came from cuMemAlloc and is freed exactly once.
        let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
    }
}

/// Copies `count` values from device address `src` to a new host vector, after the work queued
/// on `stream`.
///
/// # Safety
/// `src..src + count * size_of::<T>()` must be readable device memory of `stream`'s context.
pub unsafe fn copy_dtoh<T: bytemuck::Pod>(
    stream: &CudaStream,
    src: u64,
    count: usize,
) -> Result<Vec<T>, TransportError> {
    let mut out = vec![T::zeroed(); count];
    if count == 0 {
        return Ok(out);
    }
    stream
        .context()
        .bind_to_thread()
        .context("binding the CUDA context")?;
    let bytes = std::mem::size_of_val(out.as_slice());
    // SAFETY: `out` holds `bytes` writable bytes; the source range is valid per the contract.
    check(unsafe {
        sys::cuMemcpyDtoHAsync_v2(out.as_mut_ptr().cast(), src, bytes, stream.cu_stream())
    })
    .context("copying device memory to the host")?;
    stream
        .synchronize()
        .context("waiting for a device-to-host copy")?;
    Ok(out)
}

/// Copies `data` to device address `dst`, ordered on `stream`, and waits for it.
///
/// # Safety
/// `dst..dst + size_of_val(data)` must be writable device memory of `stream`'s context that no
/// running kernel accesses.
pub unsafe fn copy_htod<T: bytemuck::Pod>(
    stream: &CudaStream,
    dst: u64,
    data: &[T],
) -> Result<(), TransportError> {
    if data.is_empty() {
        return Ok(());
    }
    stream
        .context()
        .bind_to_thread()
        .context("binding the CUDA context")?;
    // SAFETY: `data` is readable for its length; the destination is valid per the contract.
    check(unsafe {
        sys::cuMemcpyHtoDAsync_v2(
            dst,
            data.as_ptr().cast(),
            std::mem::size_of_val(data),
            stream.cu_stream(),
        )
    })
    .context("copying host memory to the device")?;
    stream
        .synchronize()
        .context("waiting for a host-to-device copy")?;
    Ok(())
}

/// Pinned host memory mapped into the device's address space: kernels store to it, the host
/// reads it without a copy (and without a stream sync — reads are volatile).
#[derive(Debug)]
pub struct MappedHostBuffer {
    ctx: Arc<CudaContext>,
    host: *mut u8,
    dev: sys::CUdeviceptr,
    len: usize,
}

// SAFETY: the allocation is plain pinned memory; all host access goes through volatile (or
// atomic, `load_u64_acquire`) reads and writes of whole `u64`/`u32` words at bounds-checked
// offsets.
unsafe impl Send for MappedHostBuffer {}
// SAFETY: as above.
unsafe impl Sync for MappedHostBuffer {}

impl MappedHostBuffer {
    /// Allocates `len` bytes (rounded up to 8) of zeroed, device-mapped pinned memory.
    pub fn zeroed(ctx: &Arc<CudaContext>, len: usize) -> Result<Self, TransportError> {
        let len = len.max(8).next_multiple_of(8);
        ctx.bind_to_thread().context("binding the CUDA context")?;
        let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer; DEVICEMAP|PORTABLE are valid flags.
        check(unsafe {
            sys::cuMemHostAlloc(
                &mut host,
                len,
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        })
        .context(format!("allocating {len} bytes of mapped host memory"))?;
        // SAFETY: `host` points to `len` writable bytes just allocated.
        unsafe { std::ptr::write_bytes(host.cast::<u8>(), 0, len) };
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: `host` is a mapped pinned allocation; `dev` a valid out-pointer.
        let res = check(unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0) });
        let buf = Self {
            ctx: ctx.clone(),
            host: host.cast(),
            dev,
            len,
        };
        res.context("mapping host memory into the device")?;
        Ok(buf)
    }

    /// Host address of the allocation (page-aligned, `len` bytes, valid while `self` lives).
    /// Who may touch it is the owner's contract: the device accesses the same bytes.
    pub fn host_ptr(&self) -> *mut u8 {
        self.host
    }

    /// Device address kernels store to.
    pub fn device_ptr(&self) -> u64 {
        self.dev
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when zero-sized (never: at least 8 bytes are allocated).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Volatile read of the `index`-th u64 word, or None past the end.
    pub fn load_u64(&self, index: usize) -> Option<u64> {
        if (index + 1) * 8 > self.len {
            return None;
        }
        // SAFETY: in bounds and 8-aligned (pinned allocations are page-aligned).
        Some(unsafe { std::ptr::read_volatile(self.host.cast::<u64>().add(index)) })
    }

    /// Acquire read of the `index`-th u64 word, or None past the end: no later read of this
    /// memory by this thread (volatile or not) is satisfied before it, also on hosts whose loads
    /// may pass each other (aarch64). Read a word the device stores last (after a system fence)
    /// with it, then the words that word publishes: a plain volatile read gives no such order.
    pub fn load_u64_acquire(&self, index: usize) -> Option<u64> {
        if (index + 1) * 8 > self.len {
            return None;
        }
        // SAFETY: in bounds and 8-aligned (pinned allocations are page-aligned), valid for the
        // life of `self`; the host touches the word only through whole-word volatile or atomic
        // accesses, and the device's stores are whole words too.
        let word =
            unsafe { std::sync::atomic::AtomicU64::from_ptr(self.host.cast::<u64>().add(index)) };
        Some(word.load(std::sync::atomic::Ordering::Acquire))
    }

    /// Volatile write of the `index`-th u64 word; false past the end.
    pub fn store_u64(&self, index: usize, value: u64) -> bool {
        if (index + 1) * 8 > self.len {
            return false;
        }
        // SAFETY: in bounds and aligned; the device only writes this memory while a kernel that
        // the caller ordered against runs.
        unsafe { std::ptr::write_volatile(self.host.cast::<u64>().add(index), value) };
        true
    }

    /// Copies the bytes out as one `T` (volatile, byte by byte), or None if it does not fit.
    pub fn read_struct<T: bytemuck::Pod>(&self) -> Option<T> {
        if size_of::<T>() > self.len {
            return None;
        }
        let mut v = T::zeroed();
        let dst = bytemuck::bytes_of_mut(&mut v);
        for (i, b) in dst.iter_mut().enumerate() {
            // SAFETY: `i < size_of::<T>() <= len`.
            *b = unsafe { std::ptr::read_volatile(self.host.add(i)) };
        }
        Some(v)
    }

    /// Zeroes the whole buffer (volatile).
    pub fn clear(&self) {
        for i in 0..self.len {
            // SAFETY: `i < len`.
            unsafe { std::ptr::write_volatile(self.host.add(i), 0) };
        }
    }
}

impl Drop for MappedHostBuffer {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `host` came from cuMemHostAlloc and is freed exactly once.
        let _ = unsafe { sys::cuMemFreeHost(self.host.cast()) };
    }
}

/// Writes `bytes` into the module global `symbol` of `module`, stream-ordered on `stream`, and
/// waits for the copy: how a backend binds a loaded module to its device channel
/// ([`crate::SymmetricMemory::bind_device_channel`]).
///
/// # Errors
/// [`TransportError::Driver`] when the module has no such global (an image of another family)
/// or the copy fails; [`TransportError::InvalidArgument`] naming `module` when the global's
/// size is not `bytes.len()` (an image built from another ABI).
///
/// # Safety
/// `module` is a live `CUmodule` of `stream`'s context.
pub unsafe fn write_module_global(
    module: sys::CUmodule,
    symbol: &std::ffi::CStr,
    bytes: &[u8],
    stream: &CudaStream,
) -> Result<(), TransportError> {
    let name = symbol.to_string_lossy();
    let mut ptr: sys::CUdeviceptr = 0;
    let mut len: usize = 0;
    // SAFETY: `module` is live (the caller's contract); the name is a NUL-terminated C string
    // and both out-pointers are valid.
    unsafe { sys::cuModuleGetGlobal_v2(&mut ptr, &mut len, module, symbol.as_ptr()) }
        .result()
        .context(format!("looking up the module global {name}"))?;
    if len != bytes.len() {
        return Err(TransportError::InvalidArgument {
            argument: "module",
            rule: format!(
                "the global {name} is {len} bytes in the kernel image and {} on the host (an \
                 image of another ABI)",
                bytes.len()
            ),
        });
    }
    // SAFETY: `ptr` is the module global of exactly `bytes.len()` bytes (checked above), and
    // `bytes` lives until the synchronize below.
    unsafe { sys::cuMemcpyHtoDAsync_v2(ptr, bytes.as_ptr().cast(), len, stream.cu_stream()) }
        .result()
        .context(format!("writing the module global {name}"))?;
    stream
        .synchronize()
        .context(format!("writing the module global {name}"))
}
