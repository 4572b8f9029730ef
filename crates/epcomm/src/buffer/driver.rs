//! The frontend's raw CUDA driver calls (the few cudarc has no wrapper for), each behind a
//! function that states its contract: every `sys::cu*` call of this crate is made here.

use cudarc::driver::{CudaStream, DriverError, sys};

/// Whether `stream` has finished all the work queued on it so far (`cuStreamQuery`):
/// `Ok(true)` idle, `Ok(false)` still running, or the driver's error (e.g. a failed context).
pub(crate) fn stream_idle(stream: &CudaStream) -> Result<bool, DriverError> {
    // SAFETY: querying a live stream (the borrow keeps it alive) has no preconditions.
    match unsafe { sys::cuStreamQuery(stream.cu_stream()) } {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        e => Err(DriverError(e)),
    }
}

/// The GPU (device ordinal) whose memory holds address `ptr`, or what the driver answered
/// when it does not know the address.
pub(crate) fn device_of(ptr: u64) -> Result<i32, sys::CUresult> {
    let mut device: i32 = -1;
    // SAFETY: the out-pointer is a live i32, which is what the DEVICE_ORDINAL attribute
    // writes; the query only reads the driver's table of allocations, for any address.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&mut device as *mut i32).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr,
        )
    };
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(device)
    } else {
        Err(r)
    }
}

/// Copies `bytes` bytes from device address `src` to device address `dst`, in `stream`'s
/// order.
///
/// # Safety
/// `src .. src + bytes` and `dst .. dst + bytes` are device memory reachable from `stream`'s
/// context that stay allocated until the copy has run (the caller keeps them alive, or orders
/// their release after this stream's work), nothing else writes them meanwhile unordered
/// with the stream, and they do not overlap.
pub(crate) unsafe fn copy_async(
    dst: u64,
    src: u64,
    bytes: usize,
    stream: &CudaStream,
) -> Result<(), DriverError> {
    // SAFETY: the caller's contract is the call's.
    unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream.cu_stream()) }.result()
}

/// Sets `count` 32-bit words from device address `dst` on to `value`, in `stream`'s order.
///
/// # Safety
/// `dst .. dst + 4 * count` is device memory of `stream`'s context, 4-byte aligned, that stays
/// allocated until the write has run, and no one else writes it meanwhile unordered with the
/// stream.
pub(crate) unsafe fn fill_u32_async(
    dst: u64,
    value: u32,
    count: usize,
    stream: &CudaStream,
) -> Result<(), DriverError> {
    // SAFETY: the caller's contract is the call's.
    unsafe { sys::cuMemsetD32Async(dst, value, count, stream.cu_stream()) }.result()
}
