//! epcomm's CUDA kernels: the fatbins built from `kernels/` by `cargo xtask build-kernels`,
//! embedded at compile time, loaded lazily into a CUDA context, and launched through cudarc.
//!
//! Layers: [`abi`] (the `epcomm-abi` crate, re-exported) mirrors the kernel ABI of
//! `kernels/common/abi.cuh` (generated from it by `cargo xtask codegen`); [`images`] lists the kernel images of `kernels/images.txt`;
//! [`OpModule`] owns one loaded kernel image (any family: every op's kernel of it) and
//! launches the layout, normal and low-latency dispatch / combine kernels.
//! Launching is `unsafe`: the argument blocks carry raw device addresses whose validity the
//! caller (the `epcomm` frontend's `Buffer`) guarantees.
//!
//! # Where the kernel images come from
//!
//! The build script embeds each image's artifact (`intranode.fatbin`, `intranode_nvshmem.cubin`)
//! from the first directory that applies: `$EPCOMM_KERNEL_DIR` when set; the crate's own `prebuilt/`
//! folder in a packaged copy (what a crates.io release ships, when it was built before
//! packaging); `<workspace>/target/kernels` in the workspace checkout. An artifact that was not
//! embedded is read from `$EPCOMM_KERNEL_DIR` ([`KERNEL_DIR_ENV`]) when it is first loaded;
//! without either, loading fails with [`KernelError::Missing`], which names the variable.
//! docs/build.md has the details.
//!
//! # Example
//!
//! Asking what this build carries needs no GPU:
//!
//! ```
//! for image in epcomm_kernels::images() {
//!     if image.is_embedded() {
//!         println!("{} ({}) is embedded", image.name(), image.artifact());
//!     } else {
//!         println!("{} is not embedded: {} must name a directory holding {}",
//!                  image.name(), epcomm_kernels::KERNEL_DIR_ENV, image.artifact());
//!     }
//! }
//! ```
//!
//! Loading and checking them needs one (the frontend does this for you):
//!
//! ```no_run
//! use cudarc::driver::CudaContext;
//! use epcomm_kernels::{OpModule, KernelFamily};
//!
//! let ctx = CudaContext::new(0)?;
//! let stream = ctx.new_stream()?;
//! // Loads the module and runs the ABI probe: host and device agree on every argument block.
//! let kernels = OpModule::load(&ctx, &stream, KernelFamily::NvlinkStore)?;
//! # let _ = kernels;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod image;
mod op_module;

pub use epcomm_abi as abi;
pub use epcomm_abi::KernelFamily;
pub use image::{Image, ImageBuild, images};
pub use op_module::{CopyCountedRows, LL_MAX_SMEM_BYTES, Op, OpModule};

/// Errors of loading or launching kernels.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// The artifact was not present when this crate was compiled, and `EPCOMM_KERNEL_DIR` is
    /// not set at run time.
    #[error(
        "kernel artifact `{artifact}` was not embedded (looked for {path} at build time) and \
         EPCOMM_KERNEL_DIR is not set; run `cargo xtask build-kernels` and rebuild, or set \
         EPCOMM_KERNEL_DIR to a directory holding `{artifact}`"
    )]
    Missing {
        /// Artifact file name.
        artifact: &'static str,
        /// Where the build looked.
        path: &'static str,
    },
    /// The artifact was not embedded, and reading it from `EPCOMM_KERNEL_DIR` at run time failed.
    #[error(
        "kernel artifact `{artifact}` was not embedded, and reading it from EPCOMM_KERNEL_DIR \
         ({}) failed: {source}",
        path.display()
    )]
    Read {
        /// Artifact file name.
        artifact: &'static str,
        /// The file that could not be read.
        path: std::path::PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// No NVSHMEM kernel image was built against the release the process's NVSHMEM host
    /// library is.
    #[error(
        "the NVSHMEM host library in this process is NVSHMEM {}.{}, and epcomm has NVSHMEM \
         kernels for {available} only (an image must be device-linked against the host's \
         release): load one of those releases, or use another transport",
        release.0,
        release.1
    )]
    NoNvshmemImage {
        /// The host library's `(major, minor)`.
        release: (u32, u32),
        /// The releases there are images for, e.g. `3.4.5, 3.7.2`.
        available: String,
    },
    /// The driver refused to load a kernel image.
    #[error("CUDA driver error while loading {artifact}: {source}")]
    Load {
        /// The image's artifact, e.g. `intranode.fatbin`.
        artifact: &'static str,
        /// The driver's error.
        #[source]
        source: cudarc::driver::DriverError,
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
    /// A launch was refused before reaching the driver.
    #[error("{what}: {reason}")]
    Launch {
        /// Which launch.
        what: &'static str,
        /// Why.
        reason: String,
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

/// The environment variable naming a directory of kernel artifacts. The build script embeds
/// from it when it is set at build time; an artifact that was not embedded is read from it at
/// run time, once per process.
pub const KERNEL_DIR_ENV: &str = "EPCOMM_KERNEL_DIR";

/// Artifacts read from `$EPCOMM_KERNEL_DIR` at run time, kept for the life of the process.
static RUNTIME_IMAGES: std::sync::Mutex<Vec<(&str, &[u8])>> = std::sync::Mutex::new(Vec::new());

/// The embedded image, else `artifact` read from `dir` (the first read is kept for the process).
pub(crate) fn image_or_file(
    embedded: Option<&'static [u8]>,
    artifact: &'static str,
    build_path: &'static str,
    dir: Option<std::ffi::OsString>,
) -> Result<&'static [u8], KernelError> {
    if let Some(image) = embedded {
        return Ok(image);
    }
    let mut loaded = RUNTIME_IMAGES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some((_, image)) = loaded.iter().find(|(name, _)| *name == artifact) {
        return Ok(image);
    }
    let dir = dir
        .filter(|dir| !dir.is_empty())
        .ok_or(KernelError::Missing {
            artifact,
            path: build_path,
        })?;
    let path = std::path::PathBuf::from(dir).join(artifact);
    let bytes = std::fs::read(&path).map_err(|source| KernelError::Read {
        artifact,
        path,
        source,
    })?;
    let image: &'static [u8] = Vec::leak(bytes);
    loaded.push((artifact, image));
    Ok(image)
}

/// True when the intranode store image ([`Image::INTRANODE`]) was embedded at build time.
pub fn intranode_embedded() -> bool {
    Image::INTRANODE.is_embedded()
}

/// True when the intranode NVSHMEM image ([`Image::INTRANODE_NVSHMEM`]) was embedded at build
/// time.
pub fn intranode_nvshmem_embedded() -> bool {
    Image::INTRANODE_NVSHMEM.is_embedded()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_image_wins() {
        let image = image_or_file(Some(b"embedded"), "t-embedded.bin", "build", None).unwrap();
        assert_eq!(image, b"embedded");
    }

    #[test]
    fn missing_names_the_variable() {
        let err = image_or_file(None, "t-missing.bin", "/nowhere/t-missing.bin", None).unwrap_err();
        assert!(matches!(err, KernelError::Missing { .. }), "{err:?}");
        assert!(err.to_string().contains("EPCOMM_KERNEL_DIR"), "{err}");
        let empty = image_or_file(None, "t-missing.bin", "build", Some("".into())).unwrap_err();
        assert!(matches!(empty, KernelError::Missing { .. }), "{empty:?}");
    }

    #[test]
    fn reads_the_directory_at_run_time_once() {
        let dir = std::env::temp_dir().join(format!("epcomm-kernels-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let unreadable =
            image_or_file(None, "t-runtime.bin", "build", Some(dir.clone().into())).unwrap_err();
        assert!(
            matches!(unreadable, KernelError::Read { .. }),
            "{unreadable:?}"
        );
        assert!(
            unreadable.to_string().contains("EPCOMM_KERNEL_DIR"),
            "{unreadable}"
        );
        std::fs::write(dir.join("t-runtime.bin"), b"first").unwrap();
        let image =
            image_or_file(None, "t-runtime.bin", "build", Some(dir.clone().into())).unwrap();
        assert_eq!(image, b"first");
        // Kept for the process: a changed file is not read again.
        std::fs::write(dir.join("t-runtime.bin"), b"second").unwrap();
        let again =
            image_or_file(None, "t-runtime.bin", "build", Some(dir.clone().into())).unwrap();
        assert_eq!(again, b"first");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
