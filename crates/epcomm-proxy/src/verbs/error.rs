//! [`LoadError`] (finding and opening the library) and [`DeviceError`] (listing devices).

use std::fmt;
use std::path::PathBuf;

use super::{ENV_EPCOMM_IBVERBS_LIB, LIBRARY_NAME, Origin};

/// One place looked at, and why it was not used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Searched {
    /// The step.
    pub origin: Origin,
    /// The file (or soname) tried.
    pub path: PathBuf,
    /// Why it was not used: `no such file`, the dynamic loader's error, ….
    pub outcome: String,
}

impl fmt::Display for Searched {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} ({})",
            self.origin,
            self.path.display(),
            self.outcome
        )
    }
}

fn bullets(searched: &[Searched]) -> String {
    if searched.is_empty() {
        return "  (no place to look: the search was empty)".to_string();
    }
    searched
        .iter()
        .map(|s| format!("  - {s}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Finding or opening `libibverbs.so.1` failed.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// No place of the search has the library.
    #[error(
        "{library} (rdma-core's verbs library) was not found. Searched, in order:\n{}\n\
         Install it (Debian/Ubuntu: apt-get install libibverbs1 ibverbs-providers; Fedora: \
         dnf install libibverbs) or point {ENV_EPCOMM_IBVERBS_LIB} at the file or its directory",
        bullets(searched),
        library = LIBRARY_NAME
    )]
    NotFound {
        /// Every place looked at, in order.
        searched: Vec<Searched>,
    },
    /// A file exists but `dlopen` refused it.
    #[error("dlopen({}) failed: {source}", path.display())]
    Open {
        /// The file.
        path: PathBuf,
        /// The loader's error.
        source: libloading::Error,
    },
    /// The library lacks a symbol bound here.
    #[error("{} lacks {symbol}: {source}", path.display())]
    MissingSymbol {
        /// The file.
        path: PathBuf,
        /// The symbol.
        symbol: &'static str,
        /// The loader's error.
        source: libloading::Error,
    },
}

/// Listing the RDMA devices failed.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// No RDMA device exists on this machine.
    #[error("no RDMA device: {reason} (libibverbs: {})", library.display())]
    NoDevice {
        /// The library asked.
        library: PathBuf,
        /// What it said.
        reason: String,
    },
    /// `ibv_get_device_list` failed otherwise.
    #[error("ibv_get_device_list failed (libibverbs: {}): {source}", library.display())]
    ListFailed {
        /// The library asked.
        library: PathBuf,
        /// `errno`.
        source: std::io::Error,
    },
    /// A device has no name (`ibv_get_device_name` returned `NULL`).
    #[error("RDMA device {index} has no name (libibverbs: {})", library.display())]
    Unnamed {
        /// The library asked.
        library: PathBuf,
        /// Its index in the list.
        index: usize,
    },
}
