//! epcomm's CUDA kernels: the fatbins built from `kernels/` by `cargo xtask build-kernels`,
//! embedded at compile time, loaded lazily into a CUDA context, and launched through cudarc.
//!
//! Layers: [`abi`] mirrors the argument blocks of `kernels/include/epcomm/abi.cuh`;
//! [`IntranodeKernels`] owns the loaded module and launches layout / dispatch / combine.
//! Launching is `unsafe`: the argument blocks carry raw device addresses whose validity the
//! caller (the `epcomm` frontend's `Buffer`) guarantees.

pub mod abi;
mod intranode;

pub use intranode::{IntranodeKernels, KernelVariant};

mod embedded {
    include!(concat!(env!("OUT_DIR"), "/embedded.rs"));
}

/// Errors of loading or launching kernels.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// The artifact was not present when this crate was compiled.
    #[error(
        "kernel artifact `{artifact}` was not embedded (looked for {path} at build time); \
         run `cargo xtask build-kernels`, then rebuild"
    )]
    Missing {
        /// Artifact file name.
        artifact: &'static str,
        /// Where the build looked.
        path: &'static str,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver error while {context}: {source}")]
    Driver {
        /// What was being done.
        context: &'static str,
        /// The driver's error.
        #[source]
        source: cudarc::driver::DriverError,
    },
    /// The device's view of an argument block differs from the host's.
    #[error("kernel ABI mismatch for {field}: host says {host}, device says {device}")]
    AbiMismatch {
        /// Which size or offset.
        field: &'static str,
        /// Host value.
        host: u64,
        /// Device value.
        device: u64,
    },
}

pub(crate) trait DriverContext<T> {
    fn context(self, context: &'static str) -> Result<T, KernelError>;
}

impl<T> DriverContext<T> for Result<T, cudarc::driver::DriverError> {
    fn context(self, context: &'static str) -> Result<T, KernelError> {
        self.map_err(|source| KernelError::Driver { context, source })
    }
}

/// True when the intranode store-variant fatbin was embedded at build time.
pub fn intranode_embedded() -> bool {
    embedded::INTRANODE.is_some()
}

/// True when the NVSHMEM variant (device-linked cubin) was embedded at build time.
pub fn intranode_nvshmem_embedded() -> bool {
    embedded::INTRANODE_NVSHMEM.is_some()
}
