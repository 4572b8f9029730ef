//! [`LoadError`] and its report of the search: every place looked at, in order, with why it was
//! not used ([`Searched`]), and how to point at the library.

use std::fmt;
use std::os::raw::c_int;
use std::path::PathBuf;

use super::version::{install_hint, supported_list};
use super::{
    ENV_EPCOMM_NVSHMEM_LIB, ENV_LD_LIBRARY_PATH, ENV_NVSHMEM_HOME, EXPECTED_VERSION, LIBRARY_NAME,
    Origin, PYTHON, Version,
};

/// Everything loading the library can fail with.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// No place of the search has the library.
    #[error(
        "{library} (the NVSHMEM host library, release {}) was not found. Searched, in order:\n{}\n{}",
        supported_list(),
        bullets(searched),
        how_to_point()
    )]
    NotFound {
        /// The soname looked for.
        library: String,
        /// Every place looked at, in search order, with why it was not used.
        searched: Vec<Searched>,
    },
    /// A candidate file exists but `dlopen` refused it.
    #[error("dlopen({}) failed: {}", path.display(), dl_message(source))]
    Open {
        /// The file.
        path: PathBuf,
        /// The loader's error.
        source: libloading::Error,
    },
    /// The library lacks a symbol the bindings need (not an NVSHMEM 3 host library?).
    #[error(
        "{} lacks a symbol the NVSHMEM {EXPECTED_VERSION} bindings need: {}",
        path.display(),
        dl_message(source)
    )]
    MissingSymbol {
        /// The file.
        path: PathBuf,
        /// The loader's error (names the symbol).
        source: libloading::Error,
    },
    /// The library is a release epcomm has no kernel image for.
    #[error(
        "{} is NVSHMEM {found}; epcomm supports NVSHMEM {} (each with kernels of its own): \
         install one ({}) and point at it",
        path.display(),
        supported_list(),
        install_hint()
    )]
    UnsupportedRelease {
        /// The file.
        path: PathBuf,
        /// What `nvshmemx_vendor_get_version_info` reported.
        found: Version,
    },
    /// `nvshmemx_vendor_get_version_info` wrote a negative number.
    #[error("nvshmemx_vendor_get_version_info reported a negative version {major}.{minor}.{patch}")]
    BadVersion {
        /// Major part as reported.
        major: c_int,
        /// Minor part as reported.
        minor: c_int,
        /// Patch part as reported.
        patch: c_int,
    },
}

/// The dynamic loader's own message (`dlerror`), which libloading keeps as the error's source.
pub(super) fn dl_message(e: &libloading::Error) -> String {
    match std::error::Error::source(e) {
        Some(inner) => inner.to_string(),
        None => e.to_string(),
    }
}

fn bullets(searched: &[Searched]) -> String {
    searched
        .iter()
        .map(|s| format!("  - {s}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The end of [`LoadError::NotFound`]'s message: the ways to point at the library.
fn how_to_point() -> String {
    format!(
        "Point at the library with one of:\n  \
         - {ENV_EPCOMM_NVSHMEM_LIB}=<the directory holding {LIBRARY_NAME}> (or the file itself)\n  \
         - {ENV_NVSHMEM_HOME}=<the NVSHMEM install prefix, whose lib/ holds it>\n  \
         - {ENV_LD_LIBRARY_PATH}=<the directory holding it>:${ENV_LD_LIBRARY_PATH}, or register \
         that directory with ldconfig\n\
         or install it where {PYTHON} finds it: {PYTHON} -m pip install \
         nvidia-nvshmem-cu13=={EXPECTED_VERSION} (`cargo xtask build-kernels` also installs it, \
         into the workspace's target/cuda-toolchain)"
    )
}

/// One line of [`LoadError::NotFound`]: a place looked at and why it was not used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Searched {
    /// The step.
    pub origin: Origin,
    /// The file (or bare soname) tried; `None` when the step had nothing to try (a variable not
    /// set, `python3` not answering).
    pub path: Option<PathBuf>,
    /// Why it was not used: `no such file`, the dynamic loader's error, `not set`, ….
    pub outcome: String,
}

impl fmt::Display for Searched {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.path {
            Some(path) => write!(f, "{}: {} ({})", self.origin, path.display(), self.outcome),
            None => write!(f, "{}: {}", self.origin, self.outcome),
        }
    }
}
