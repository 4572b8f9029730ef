//! The raw C interface bound from `libibverbs.so.1` (rdma-core's `infiniband/verbs.h`): only
//! the device-list calls. Every function is `unsafe` to call; [`super::Verbs`] is the safe
//! layer.

use std::os::raw::{c_char, c_int};

/// `struct ibv_device`: opaque here (only pointers to it are handled).
#[repr(C)]
#[derive(Debug)]
pub struct IbvDevice {
    _opaque: [u8; 0],
}

/// `struct ibv_device **ibv_get_device_list(int *num_devices)`: a `NULL`-terminated array of
/// `*num_devices` devices, or `NULL` with `errno` set.
pub type GetDeviceList = unsafe extern "C" fn(num_devices: *mut c_int) -> *mut *mut IbvDevice;
/// `void ibv_free_device_list(struct ibv_device **list)`.
pub type FreeDeviceList = unsafe extern "C" fn(list: *mut *mut IbvDevice);
/// `const char *ibv_get_device_name(struct ibv_device *device)`.
pub type GetDeviceName = unsafe extern "C" fn(device: *mut IbvDevice) -> *const c_char;
/// `__be64 ibv_get_device_guid(struct ibv_device *device)`: the GUID in network byte order.
pub type GetDeviceGuid = unsafe extern "C" fn(device: *mut IbvDevice) -> u64;

/// Symbol names, NUL-terminated for `dlsym`.
pub const SYM_GET_DEVICE_LIST: &[u8] = b"ibv_get_device_list\0";
/// See [`SYM_GET_DEVICE_LIST`].
pub const SYM_FREE_DEVICE_LIST: &[u8] = b"ibv_free_device_list\0";
/// See [`SYM_GET_DEVICE_LIST`].
pub const SYM_GET_DEVICE_NAME: &[u8] = b"ibv_get_device_name\0";
/// See [`SYM_GET_DEVICE_LIST`].
pub const SYM_GET_DEVICE_GUID: &[u8] = b"ibv_get_device_guid\0";
