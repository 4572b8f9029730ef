//! Library probes: the NVSHMEM host library (through the `nvshmem` backend's
//! [`RuntimeLibrary::locate`](epcomm_backends::RuntimeLibrary::locate), as a `Buffer` loads
//! it), NCCL and libibverbs (`dlopen` by soname).
//!
//! Contract: a probe never fails; a library that does not load is a report with `found:
//! false` and, in `detail`, why and how to point at it. The path is the file the dynamic
//! loader mapped (from `/proc/self/maps`) when the loader does not say.

use std::path::Path;

use super::report::LibraryReport;

/// The file backing the first mapping whose file name starts with `stem` in a
/// `/proc/self/maps` text.
pub fn find_in_maps(maps: &str, stem: &str) -> Option<String> {
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| {
            Path::new(p)
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(stem))
        })
        .map(str::to_string)
}

/// The file this process mapped for the library `stem` (from `/proc/self/maps`).
fn loaded_path(stem: &str) -> Option<String> {
    std::fs::read_to_string("/proc/self/maps")
        .ok()
        .and_then(|m| find_in_maps(&m, stem))
}

/// `stem` of a soname: `libnccl.so.2` → `libnccl.so`.
fn stem(soname: &str) -> &str {
    soname
        .find(".so")
        .map_or(soname, |i| &soname[..i + ".so".len()])
}

/// The NVSHMEM host library, found as a `Buffer` finds it (the `nvshmem` backend's search).
pub fn probe_nvshmem() -> LibraryReport {
    const NAME: &str = "libnvshmem_host.so.3";
    let not_found = |library: &str, why: String| LibraryReport {
        library: library.into(),
        found: false,
        path: None,
        version: None,
        detail: Some(why),
    };
    let library = match "nvshmem".parse::<epcomm_backends::TransportSpec>() {
        Ok(spec) => spec.runtime_library(),
        Err(e) => return not_found(NAME, e.to_string()),
    };
    let Some(library) = library else {
        return not_found(NAME, "the nvshmem backend names no runtime library".into());
    };
    match (library.locate)() {
        Ok(found) => {
            let mut path = found.path;
            if !path.contains('/') {
                path = loaded_path(stem(library.name)).unwrap_or(path);
            }
            LibraryReport {
                library: library.name.into(),
                found: true,
                path: Some(path),
                version: Some(found.version),
                detail: Some(found.search),
            }
        }
        Err(e) => not_found(library.name, e.to_string()),
    }
}

/// How [`probe_library`] asks a library its version.
#[derive(Clone, Copy, PartialEq, Eq)]
enum LibKind {
    /// `ncclGetVersion`.
    Nccl,
    /// It is not asked.
    Plain,
}

/// NCCL's `ncclGetVersion` code: `major * 10000 + minor * 100 + patch` since 2.9, before that
/// `major * 1000 + minor * 100 + patch`.
pub fn nccl_version(code: i32) -> String {
    if code >= 10000 {
        format!("{}.{}.{}", code / 10000, code % 10000 / 100, code % 100)
    } else {
        format!("{}.{}.{}", code / 1000, code % 1000 / 100, code % 100)
    }
}

/// `dlopen`s the first of `sonames` that loads (closed again right after); `kind` says how
/// to ask its version. Not found: why each soname failed, and how to point at it.
fn probe_library(sonames: &[&str], kind: LibKind) -> LibraryReport {
    use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
    let mut errors = Vec::new();
    for name in sonames {
        // SAFETY: dlopen runs the library's initialisers; NCCL's and libibverbs' only set up
        // internal state. RTLD_LOCAL keeps their symbols out of the global namespace.
        let lib = match unsafe { Library::open(Some(*name), RTLD_NOW | RTLD_LOCAL) } {
            Ok(l) => l,
            Err(e) => {
                let why = std::error::Error::source(&e).map_or(e.to_string(), |s| s.to_string());
                errors.push(why);
                continue;
            }
        };
        let version = match kind {
            LibKind::Nccl => {
                // SAFETY: `ncclGetVersion` has this C signature in every NCCL 2.x release.
                let f = unsafe {
                    lib.get::<unsafe extern "C" fn(*mut std::ffi::c_int) -> std::ffi::c_int>(
                        b"ncclGetVersion\0",
                    )
                };
                f.ok().and_then(|f| {
                    let mut code = 0;
                    // SAFETY: writes one int through a pointer to a live local; needs no
                    // initialised communicator.
                    (unsafe { f(&mut code) } == 0).then(|| nccl_version(code))
                })
            }
            LibKind::Plain => None,
        };
        let path = loaded_path(stem(name)).or_else(|| Some(name.to_string()));
        drop(lib);
        return LibraryReport {
            library: sonames[0].into(),
            found: true,
            path,
            version,
            detail: None,
        };
    }
    LibraryReport {
        library: sonames[0].into(),
        found: false,
        path: None,
        version: None,
        detail: Some(format!(
            "not loadable ({}); if it is installed, add its directory to LD_LIBRARY_PATH",
            errors.join("; ")
        )),
    }
}

/// NCCL, with its version (`ncclGetVersion`).
pub fn probe_nccl() -> LibraryReport {
    probe_library(&["libnccl.so.2", "libnccl.so"], LibKind::Nccl)
}

/// libibverbs.
pub fn probe_ibverbs() -> LibraryReport {
    probe_library(&["libibverbs.so.1", "libibverbs.so"], LibKind::Plain)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_and_versions() {
        let maps = "7f00-7f01 r-xp 00000000 08:01 42 /usr/lib/x86_64-linux-gnu/libnccl.so.2.27.3\n\
                    7f02-7f03 r--p 00000000 00:00 0 [heap]\n";
        assert_eq!(
            find_in_maps(maps, "libnccl.so").as_deref(),
            Some("/usr/lib/x86_64-linux-gnu/libnccl.so.2.27.3")
        );
        assert_eq!(find_in_maps(maps, "libibverbs.so"), None);
        assert_eq!(stem("libnccl.so.2"), "libnccl.so");
        assert_eq!(nccl_version(22703), "2.27.3");
        assert_eq!(nccl_version(2804), "2.8.4");
    }
}
