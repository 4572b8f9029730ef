//! [`DeviceView`]: a region of device memory this crate owns elsewhere (a buffer's receive
//! region), presented as cudarc's [`DevicePtr`] so one op's output can be the next op's input.
//!
//! Contract: whoever constructs a view keeps the memory allocated and orders its uses (ops on
//! one stream): no events are recorded.

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DeviceSlice, SyncOnDrop, sys};

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
