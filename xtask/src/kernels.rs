//! `cargo xtask build-kernels`: compiles every image of the image manifest
//! (`kernels/images.txt`) into a fatbin or an NVSHMEM device-linked cubin, incrementally,
//! recording what was built in `manifest.json`.
//!
//! An artifact is rebuilt only when the SHA-256 of its inputs changes: its entry source, every
//! other file under `kernels/` except `.cu` entries and the image manifest (the headers), the
//! compiler and linker flags, the nvcc version and, for NVSHMEM images, the content of
//! `libnvshmem_device.a`.
//!
//! * [`images`]: the image manifest, `kernels/images.txt` (parsing and its rules).
//! * [`inputs`]: the headers every entry may include, and the inputs hash.
//! * [`manifest`]: the build record `manifest.json`, and staleness against it.
//! * [`nvcc`]: the nvcc/nvlink command lines, and compiling in parallel.
//! * [`build`](mod@build): the driver behind `build-kernels` and `--check`.

mod build;
mod images;
mod inputs;
mod manifest;
mod nvcc;

use std::path::{Path, PathBuf};

pub use build::{BuildOptions, build};
pub use images::{IMAGES_FILE, ImagesError, KernelSource, parse_images, read_images};
pub use manifest::MANIFEST_NAME;

/// Where things are: the workspace, the kernel output directory and the pip toolchain root.
#[derive(Debug, Clone)]
pub struct Paths {
    /// Workspace root (holds `kernels/`).
    pub workspace: PathBuf,
    /// Output directory for artifacts and the manifest.
    pub out_dir: PathBuf,
    /// Root of the pinned pip toolchain.
    pub pip_root: PathBuf,
}

impl Paths {
    /// The paths of this checkout: the workspace is the parent of xtask's manifest directory,
    /// the output is `$EPCOMM_KERNEL_DIR` (relative values are taken from the workspace root)
    /// or `<workspace>/target/kernels`.
    pub fn from_env() -> Paths {
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."));
        let out_dir = match std::env::var_os("EPCOMM_KERNEL_DIR").filter(|v| !v.is_empty()) {
            Some(dir) => workspace.join(dir),
            None => workspace.join("target/kernels"),
        };
        let pip_root = workspace.join("target/cuda-toolchain");
        Paths {
            workspace,
            out_dir,
            pip_root,
        }
    }

    fn kernels_dir(&self) -> PathBuf {
        self.workspace.join("kernels")
    }
}
