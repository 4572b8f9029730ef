//! [`Borrowed`]: caller device memory given as a raw address and a length (a tensor of the
//! Python side), presented to the frontend as cudarc's [`DevicePtr`]/[`DevicePtrMut`].
//!
//! Contract: the memory is owned elsewhere (by a framework's allocator); whoever constructs a
//! `Borrowed` keeps it alive, and orders its other uses, until the stream work that reads or
//! writes it has finished. No cudarc events are recorded: the Python package orders the
//! framework's streams against the buffer's stream with its own events.

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop, sys};

/// A device address and an element count, as given across the language boundary.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct RawArray {
    /// Device address of the first element (0 when the array is empty).
    pub ptr: u64,
    /// Number of elements.
    pub len: usize,
}

impl RawArray {
    /// An array of `len` elements at `ptr`.
    pub fn new(ptr: u64, len: usize) -> Self {
        Self { ptr, len }
    }
}

/// `len` elements of `T` at device address `ptr`, borrowed from memory this crate does not own.
#[derive(Debug)]
pub struct Borrowed<T> {
    ptr: u64,
    len: usize,
    stream: Arc<CudaStream>,
    _elem: PhantomData<T>,
}

impl<T> Borrowed<T> {
    /// Wraps `array` for work on `stream`.
    ///
    /// # Safety
    /// Unless `array.len == 0`, `array.ptr` must address `array.len` elements of `T` of live
    /// device memory in `stream`'s context, and that memory must stay allocated (and not be
    /// written by anyone else while the frontend reads it) until the work queued on `stream`
    /// with it has finished.
    pub unsafe fn new(array: RawArray, stream: &Arc<CudaStream>) -> Self {
        Self {
            ptr: if array.len == 0 { 0 } else { array.ptr },
            len: array.len,
            stream: stream.clone(),
            _elem: PhantomData,
        }
    }

    /// The device address (0 for an empty array).
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl<T> DeviceSlice<T> for Borrowed<T> {
    fn len(&self) -> usize {
        self.len
    }

    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtr<T> for Borrowed<T> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

impl<T> DevicePtrMut<T> for Borrowed<T> {
    fn device_ptr_mut<'a>(
        &'a mut self,
        _stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}
