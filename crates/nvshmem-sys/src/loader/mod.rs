//! Finding and `dlopen`ing `libnvshmem_host.so.3`, and checking its release.
//!
//! [`load_default`] looks in these places, in this order. The first file that exists is opened
//! (if it then fails to load, that error is returned and the search stops); a place without the
//! file is skipped:
//!
//! 0. the copy this process already loaded, by soname (`RTLD_NOLOAD`): in a process where
//!    PyTorch brought its NVSHMEM, that copy, whatever the variables below say (two copies of
//!    NVSHMEM cannot run in one process);
//! 1. `$EPCOMM_NVSHMEM_LIB`: the directory holding the library, or the library file itself (a
//!    last path component that starts with `libnvshmem_host.so` names the file);
//! 2. `$NVSHMEM_HOME/lib`: an NVSHMEM install prefix;
//! 3. the bare soname `libnvshmem_host.so.3`, through the system's dynamic loader, which honours
//!    `LD_LIBRARY_PATH` (as it was when the process started), `ld.so.cache` (`ldconfig`) and
//!    the default library directories;
//! 4. every `$LD_LIBRARY_PATH` entry, read now: the error then names each of them, and a value
//!    set after the process started counts too;
//! 5. `<dir>/nvidia/nvshmem/lib`, for every `<dir>` that `python3` (found on `PATH`) reports as
//!    a site-packages directory: `site.getsitepackages()` and `site.getusersitepackages()`,
//!    which is where `python3 -m pip install nvidia-nvshmem-cu13==3.4.5` puts the library (the
//!    active virtual environment's directories when one is active). `python3` is only asked
//!    when steps 1–4 found nothing, and gets [`PYTHON_TIMEOUT`] to answer; a missing, failing
//!    or slow `python3` only skips this step;
//! 6. the pinned CUDA toolchain that `cargo xtask build-kernels` installs into the workspace
//!    this crate was compiled in (`<workspace>/target/cuda-toolchain/nvidia/nvshmem/lib`; only
//!    when the crate was built from the workspace's `crates/nvshmem-sys`).
//!
//! A library found must be a supported release ([`SUPPORTED_RELEASES`]: 3.4 and 3.7, each with
//! a kernel image of its own); another is refused naming it ([`LoadError::UnsupportedRelease`]).
//!
//! Empty variables count as unset. The search is computed by [`LibrarySearch::from_vars`] and
//! [`LibrarySearch::candidates`], which read nothing themselves, so the order is testable
//! without NVSHMEM. When nothing is found, [`LoadError::NotFound`] lists every place tried, in
//! order, with why each was not used, and says how to point at the library.
//!
//! The library is opened with `RTLD_NOW | RTLD_GLOBAL`: the bootstrap and transport plugins
//! NVSHMEM itself `dlopen`s resolve host-library symbols globally.
//!
//! The pieces, one file each: `search.rs` (the places and their order, pure), `python.rs`
//! (asking `python3` for step 5), `version.rs` (the release check), `error.rs` ([`LoadError`]
//! and its report of the search) and `load.rs` ([`Library`], [`load`], [`load_default`]).

mod error;
mod load;
mod python;
mod search;
mod version;

pub use error::{LoadError, Searched};
pub use load::{Library, load, load_default};
pub use python::{
    PYTHON, PYTHON_SITE_QUERY, PYTHON_TIMEOUT, SitePackages, parse_site_packages,
    python_site_packages,
};
pub use search::{Candidate, LibrarySearch, Origin, workspace_toolchain_lib};
pub use version::{EXPECTED_VERSION, SUPPORTED_RELEASES, Version, check_version, supported_list};

/// The soname looked for.
pub const LIBRARY_NAME: &str = "libnvshmem_host.so.3";

/// Environment variable (step 1): directory holding the library, or the library file.
pub const ENV_EPCOMM_NVSHMEM_LIB: &str = "EPCOMM_NVSHMEM_LIB";
/// Environment variable (step 2): NVSHMEM install prefix (the library is in its `lib/`).
pub const ENV_NVSHMEM_HOME: &str = "NVSHMEM_HOME";
/// Environment variable (steps 3 and 4): the dynamic loader's extra directories.
pub const ENV_LD_LIBRARY_PATH: &str = "LD_LIBRARY_PATH";
/// Where pip's `nvidia-nvshmem-cu13` wheel puts the library, relative to a site-packages
/// directory (and to the root of the workspace's pinned toolchain).
pub const WHEEL_LIB_DIR: &str = "nvidia/nvshmem/lib";
