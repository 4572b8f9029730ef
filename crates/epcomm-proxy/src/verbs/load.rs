//! [`Verbs`]: the opened library with its device-list calls, and [`Verbs::devices`].

use std::ffi::CStr;
use std::fmt;
use std::os::raw::c_int;
use std::path::{Path, PathBuf};

use super::sys;
use super::{DeviceError, LibrarySearch, LoadError, Origin, Searched};

/// `libibverbs.so.1`, opened, with the calls of [`sys`] resolved.
pub struct Verbs {
    get_device_list: sys::GetDeviceList,
    free_device_list: sys::FreeDeviceList,
    get_device_name: sys::GetDeviceName,
    get_device_guid: sys::GetDeviceGuid,
    /// The calls of one RC queue pair (`resources.rs`).
    pub(super) qp: QpCalls,
    path: PathBuf,
    /// Keeps the code behind the function pointers mapped; declared last, dropped last.
    _library: libloading::Library,
}

impl fmt::Debug for Verbs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Verbs")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// The calls the wrappers of `resources.rs` make (see [`sys`] for each prototype).
#[derive(Clone, Copy)]
pub(super) struct QpCalls {
    pub(super) open_device: sys::OpenDevice,
    pub(super) close_device: sys::CloseDevice,
    pub(super) query_port: sys::QueryPort,
    pub(super) query_gid: sys::QueryGid,
    pub(super) alloc_pd: sys::AllocPd,
    pub(super) dealloc_pd: sys::DeallocPd,
    pub(super) reg_mr: sys::RegMr,
    /// Absent before rdma-core 34.
    pub(super) reg_dmabuf_mr: Option<sys::RegDmabufMr>,
    pub(super) dereg_mr: sys::DeregMr,
    pub(super) create_cq: sys::CreateCq,
    pub(super) destroy_cq: sys::DestroyCq,
    pub(super) create_qp: sys::CreateQp,
    pub(super) modify_qp: sys::ModifyQp,
    pub(super) destroy_qp: sys::DestroyQp,
    pub(super) wc_status_str: sys::WcStatusStr,
}

impl QpCalls {
    /// Resolves every call of [`QpCalls`] in `library`.
    ///
    /// # Safety
    /// `library` must be rdma-core's `libibverbs.so.1` (the prototypes of [`sys`]).
    unsafe fn resolve(library: &libloading::Library, path: &Path) -> Result<QpCalls, LoadError> {
        // SAFETY: each type in `sys` is the prototype of the symbol of the same name in
        // rdma-core's `infiniband/verbs.h` (for `ibv_query_port`, the exported compatible
        // symbol; see the `sys` docs), which the caller guarantees `library` is.
        unsafe {
            Ok(QpCalls {
                open_device: resolve(library, path, sys::SYM_OPEN_DEVICE)?,
                close_device: resolve(library, path, sys::SYM_CLOSE_DEVICE)?,
                query_port: resolve(library, path, sys::SYM_QUERY_PORT)?,
                query_gid: resolve(library, path, sys::SYM_QUERY_GID)?,
                alloc_pd: resolve(library, path, sys::SYM_ALLOC_PD)?,
                dealloc_pd: resolve(library, path, sys::SYM_DEALLOC_PD)?,
                reg_mr: resolve(library, path, sys::SYM_REG_MR)?,
                reg_dmabuf_mr: resolve(library, path, sys::SYM_REG_DMABUF_MR).ok(),
                dereg_mr: resolve(library, path, sys::SYM_DEREG_MR)?,
                create_cq: resolve(library, path, sys::SYM_CREATE_CQ)?,
                destroy_cq: resolve(library, path, sys::SYM_DESTROY_CQ)?,
                create_qp: resolve(library, path, sys::SYM_CREATE_QP)?,
                modify_qp: resolve(library, path, sys::SYM_MODIFY_QP)?,
                destroy_qp: resolve(library, path, sys::SYM_DESTROY_QP)?,
                wc_status_str: resolve(library, path, sys::SYM_WC_STATUS_STR)?,
            })
        }
    }
}

/// One RDMA device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Its name (`mlx5_0`, `rxe0`).
    pub name: String,
    /// Its GUID, in host byte order.
    pub guid: u64,
}

/// Resolves `symbol` in `library` as a value of type `T` (a function pointer type of [`sys`]).
///
/// # Safety
/// `T` must be the type of the C symbol `symbol`.
unsafe fn resolve<T: Copy>(
    library: &libloading::Library,
    path: &Path,
    symbol: &'static [u8],
) -> Result<T, LoadError> {
    // SAFETY: the caller guarantees `T` matches the symbol's C type.
    let found = unsafe { library.get::<T>(symbol) };
    found
        .map(|s| *s)
        .map_err(|source| LoadError::MissingSymbol {
            path: path.to_path_buf(),
            symbol: std::str::from_utf8(&symbol[..symbol.len() - 1]).unwrap_or("?"),
            source,
        })
}

impl Verbs {
    /// Opens the library at `path` (a file, or the bare soname for the loader's search) and
    /// resolves the calls of [`sys`].
    ///
    /// # Errors
    /// [`LoadError::Open`], [`LoadError::MissingSymbol`].
    pub fn open(path: &Path) -> Result<Verbs, LoadError> {
        // SAFETY: loading runs libibverbs' initialisers, which only set up its own state (the
        // provider scan happens on the first `ibv_get_device_list`).
        let library = unsafe { libloading::Library::new(path.as_os_str()) }.map_err(|source| {
            LoadError::Open {
                path: path.to_path_buf(),
                source,
            }
        })?;
        // SAFETY: each type in `sys` is the prototype of the symbol of the same name in
        // rdma-core's `infiniband/verbs.h` (stable ABI of `libibverbs.so.1`).
        let (get_device_list, free_device_list, get_device_name, get_device_guid) = unsafe {
            (
                resolve::<sys::GetDeviceList>(&library, path, sys::SYM_GET_DEVICE_LIST)?,
                resolve::<sys::FreeDeviceList>(&library, path, sys::SYM_FREE_DEVICE_LIST)?,
                resolve::<sys::GetDeviceName>(&library, path, sys::SYM_GET_DEVICE_NAME)?,
                resolve::<sys::GetDeviceGuid>(&library, path, sys::SYM_GET_DEVICE_GUID)?,
            )
        };
        // SAFETY: as above: `library` is libibverbs, the prototypes are those of `sys`.
        let qp = unsafe { QpCalls::resolve(&library, path)? };
        Ok(Verbs {
            qp,
            get_device_list,
            free_device_list,
            get_device_name,
            get_device_guid,
            path: path.to_path_buf(),
            _library: library,
        })
    }

    /// Tries the places of `search` in order and opens the first library found.
    ///
    /// # Errors
    /// [`LoadError::NotFound`] listing every place tried; the errors of [`Verbs::open`] for
    /// the first file that exists.
    pub fn load(search: &LibrarySearch) -> Result<Verbs, LoadError> {
        let mut searched = Vec::new();
        for c in search.candidates() {
            let outcome = if c.origin == Origin::SystemLoader {
                match Verbs::open(&c.path) {
                    Err(LoadError::Open { source, .. }) => source.to_string(),
                    other => return other,
                }
            } else if c.path.is_file() {
                return Verbs::open(&c.path);
            } else if c.path.exists() {
                "not a file".to_string()
            } else {
                "no such file".to_string()
            };
            searched.push(Searched {
                origin: c.origin,
                path: c.path,
                outcome,
            });
        }
        Err(LoadError::NotFound { searched })
    }

    /// [`Verbs::load`] with [`LibrarySearch::from_env`].
    ///
    /// # Errors
    /// As [`Verbs::load`].
    pub fn load_default() -> Result<Verbs, LoadError> {
        Verbs::load(&LibrarySearch::from_env())
    }

    /// Where the library was loaded from (the bare soname when the dynamic loader found it).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the library has `ibv_reg_dmabuf_mr` (rdma-core 34 and newer): memory can be
    /// registered from a dma-buf ([`HeapMemory::DmaBuf`](super::HeapMemory)).
    pub fn supports_dmabuf(&self) -> bool {
        self.qp.reg_dmabuf_mr.is_some()
    }

    /// The RDMA devices, in libibverbs' order.
    ///
    /// # Errors
    /// [`DeviceError::NoDevice`] when there is none (the kernel's verbs interface is absent, or
    /// no provider claims a device); [`DeviceError::ListFailed`] for any other failure of
    /// `ibv_get_device_list`; [`DeviceError::Unnamed`].
    pub fn devices(&self) -> Result<Vec<DeviceInfo>, DeviceError> {
        self.with_device_list(|devices| devices.iter().map(|(d, _)| d.clone()).collect())
    }

    /// Calls `f` with the devices (at least one) and their `struct ibv_device` pointers, which
    /// stay valid only during `f` (devices to use must be opened inside it; an open context
    /// outlives the list).
    ///
    /// # Errors
    /// As [`Verbs::devices`].
    pub(super) fn with_device_list<R>(
        &self,
        f: impl FnOnce(&[(DeviceInfo, *mut sys::IbvDevice)]) -> R,
    ) -> Result<R, DeviceError> {
        let mut count: c_int = 0;
        // SAFETY: `count` is a live local the call writes; the result is checked for NULL.
        let list = unsafe { (self.get_device_list)(&mut count) };
        if list.is_null() {
            let source = std::io::Error::last_os_error();
            return Err(if source.raw_os_error() == Some(libc::ENOSYS) {
                DeviceError::NoDevice {
                    library: self.path.clone(),
                    reason: "the kernel's RDMA verbs interface is absent \
                             (/sys/class/infiniband_verbs; ENOSYS)"
                        .to_string(),
                }
            } else {
                DeviceError::ListFailed {
                    library: self.path.clone(),
                    source,
                }
            });
        }
        let result = self.read_list(list, usize::try_from(count).unwrap_or(0));
        let result = match result {
            Ok(devices) if devices.is_empty() => Err(DeviceError::NoDevice {
                library: self.path.clone(),
                reason: "ibv_get_device_list found none (no provider claims a device)".to_string(),
            }),
            Ok(devices) => Ok(f(&devices)),
            Err(e) => Err(e),
        };
        // SAFETY: `list` came from `ibv_get_device_list` and is freed once, after the last
        // use of its entries (names were copied; `f` has returned).
        unsafe { (self.free_device_list)(list) };
        result
    }

    /// The `count` entries of a device list.
    fn read_list(
        &self,
        list: *mut *mut sys::IbvDevice,
        count: usize,
    ) -> Result<Vec<(DeviceInfo, *mut sys::IbvDevice)>, DeviceError> {
        let mut out = Vec::with_capacity(count);
        for index in 0..count {
            // SAFETY: the list holds `count` device pointers followed by NULL.
            let device = unsafe { *list.add(index) };
            if device.is_null() {
                break;
            }
            // SAFETY: `device` is an entry of a live list; the name it returns lives as long
            // as the list and is copied before the list is freed.
            let name = unsafe { (self.get_device_name)(device) };
            if name.is_null() {
                return Err(DeviceError::Unnamed {
                    library: self.path.clone(),
                    index,
                });
            }
            // SAFETY: non-NULL, NUL-terminated C string owned by the device (see above).
            let name = unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned();
            // SAFETY: `device` is an entry of a live list.
            let guid = u64::from_be(unsafe { (self.get_device_guid)(device) });
            out.push((DeviceInfo { name, guid }, device));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::LIBRARY_NAME;

    /// A fresh, empty directory under the system's temporary directory.
    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("epcomm-proxy-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        dir
    }

    #[test]
    fn missing_library_lists_every_place_searched() {
        let dir = scratch("missing");
        let err = Verbs::load(&LibrarySearch::only(&dir)).expect_err("nothing there");
        let LoadError::NotFound { searched } = &err else {
            panic!("expected NotFound, got {err}");
        };
        assert_eq!(
            searched,
            &vec![Searched {
                origin: Origin::Explicit,
                path: dir.join(LIBRARY_NAME),
                outcome: "no such file".to_string(),
            }]
        );
        let msg = err.to_string();
        assert!(
            msg.contains(&dir.join(LIBRARY_NAME).display().to_string()),
            "{msg}"
        );
        assert!(msg.contains("EPCOMM_IBVERBS_LIB"), "{msg}");
        assert!(msg.contains("apt-get install libibverbs1"), "{msg}");
        // A directory where the file should be.
        std::fs::create_dir_all(dir.join(LIBRARY_NAME)).expect("dir");
        let err = Verbs::load(&LibrarySearch::only(&dir)).expect_err("not a file");
        assert!(err.to_string().contains("(not a file)"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_file_that_is_not_a_library_stops_the_search_naming_it() {
        let dir = scratch("garbage");
        let file = dir.join(LIBRARY_NAME);
        std::fs::write(&file, b"not an ELF object").expect("write");
        let search = LibrarySearch {
            explicit: Some(dir.clone()),
            system_loader: true,
        };
        match Verbs::load(&search) {
            Err(LoadError::Open { path, .. }) => assert_eq!(path, file),
            other => panic!("expected Open, got {other:?}"),
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The system's libibverbs, when installed: on a machine without RDMA hardware the device
    /// list is the typed "no RDMA device" error; where libibverbs is not installed, the search
    /// reports the system loader's refusal.
    #[test]
    fn system_library_reports_devices_or_no_device() {
        let search = LibrarySearch {
            explicit: None,
            system_loader: true,
        };
        match Verbs::load(&search) {
            Err(LoadError::NotFound { searched }) => {
                assert_eq!(searched.len(), 1);
                assert_eq!(searched[0].origin, Origin::SystemLoader);
                eprintln!("libibverbs not installed: {}", searched[0].outcome);
            }
            Err(other) => panic!("unexpected load error: {other}"),
            Ok(verbs) => match verbs.devices() {
                Ok(devices) => {
                    assert!(!devices.is_empty());
                    assert!(devices.iter().all(|d| !d.name.is_empty()));
                    eprintln!("RDMA devices: {devices:?}");
                }
                Err(DeviceError::NoDevice { library, reason }) => {
                    assert_eq!(library, PathBuf::from(LIBRARY_NAME));
                    let msg = DeviceError::NoDevice {
                        library,
                        reason: reason.clone(),
                    }
                    .to_string();
                    assert!(msg.starts_with("no RDMA device: "), "{msg}");
                    eprintln!("{msg}");
                }
                Err(other) => panic!("unexpected device error: {other}"),
            },
        }
    }
}
