//! [`DeviceView`]: a region of device memory this crate owns elsewhere (a buffer's receive
//! region), presented as cudarc's [`DevicePtr`] so one op's output can be the next op's input.
//! [`DeviceArray`]: owned device memory a transport may put from, as [`DevicePtr`] and
//! [`DevicePtrMut`].
//!
//! Contract: whoever constructs a view keeps the memory allocated and orders its uses (ops on
//! one stream): no events are recorded.

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop, sys,
};
use epcomm_transport::{DeviceBuffer, TransportError};

/// `len` elements of `T` at device address `ptr`.
#[derive(Debug)]
pub(crate) struct DeviceView<T> {
    ptr: u64,
    len: usize,
    stream: Arc<CudaStream>,
    _elem: PhantomData<T>,
}

impl<T> DeviceView<T> {
    /// A view of `len` elements at `ptr`, for work on `stream`.
    ///
    /// # Safety
    /// `ptr` must address `len` elements of `T` of live device memory in `stream`'s context,
    /// allocated until the work queued on `stream` that uses the view has finished.
    pub(crate) unsafe fn new(ptr: u64, len: usize, stream: &Arc<CudaStream>) -> Self {
        Self {
            ptr,
            len,
            stream: stream.clone(),
            _elem: PhantomData,
        }
    }
}

impl<T> DeviceSlice<T> for DeviceView<T> {
    fn len(&self) -> usize {
        self.len
    }

    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtr<T> for DeviceView<T> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

/// `len` zeroed elements of `T` owned by this crate, allocated with `cuMemAlloc`, for an
/// intermediate array one op writes and the next op's kernels put from (a hierarchical
/// combine's partials). cudarc's own allocations come from the stream-ordered pool
/// (`cuMemAllocAsync`) where the GPU has one, which the driver does not make GPUDirect RDMA
/// capable: a NIC could not read them, so a network transport could not register them as put
/// sources. Used on one stream only (no events are recorded).
#[derive(Debug)]
pub(crate) struct DeviceArray<T> {
    buf: DeviceBuffer,
    len: usize,
    stream: Arc<CudaStream>,
    _elem: PhantomData<T>,
}

impl<T> DeviceArray<T> {
    /// `len` zeroed elements (at least one byte is allocated) for work on `stream`.
    pub(crate) fn zeroed(
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        len: usize,
    ) -> Result<Self, TransportError> {
        let bytes =
            len.checked_mul(size_of::<T>())
                .ok_or_else(|| TransportError::InvalidArgument {
                    argument: "len",
                    rule: format!("{len} elements of {} bytes overflow usize", size_of::<T>()),
                })?;
        Ok(Self {
            buf: DeviceBuffer::zeroed(ctx, bytes)?,
            len,
            stream: stream.clone(),
            _elem: PhantomData,
        })
    }
}

impl<T> DeviceSlice<T> for DeviceArray<T> {
    fn len(&self) -> usize {
        self.len
    }

    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtr<T> for DeviceArray<T> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.buf.ptr(), SyncOnDrop::Record(None))
    }
}

impl<T> DevicePtrMut<T> for DeviceArray<T> {
    fn device_ptr_mut<'a>(
        &'a mut self,
        _stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.buf.ptr(), SyncOnDrop::Record(None))
    }
}
