//! Kernel images: which images of the kernels' manifest a `Buffer` can load here, and from
//! where.
//!
//! Contract: an image is available when it is embedded at build time or its artifact is a
//! file under `$EPCOMM_KERNEL_DIR`, which is where `epcomm-kernels` looks when it loads one.

use std::path::{Path, PathBuf};

use epcomm_backends::KernelFamily;

use super::report::KernelImage;

impl KernelImage {
    /// Embedded at build time, else read from `dir` (`$EPCOMM_KERNEL_DIR`) at run time, as
    /// `epcomm-kernels` does when it loads the image.
    pub fn locate(name: &str, artifact: &str, embedded: bool, dir: Option<&Path>) -> Self {
        let (available, source) = if embedded {
            (true, "embedded".to_string())
        } else {
            match dir.map(|d| d.join(artifact)) {
                Some(p) if p.is_file() => (true, p.display().to_string()),
                Some(p) => (
                    false,
                    format!("not embedded, and {} does not exist", p.display()),
                ),
                None => (
                    false,
                    format!(
                        "not embedded, and {} is not set",
                        epcomm_kernels::KERNEL_DIR_ENV
                    ),
                ),
            }
        };
        Self {
            name: name.into(),
            artifact: artifact.into(),
            available,
            source,
        }
    }

    /// Every image of the kernels' manifest (`epcomm_kernels::images`), completed by
    /// `$EPCOMM_KERNEL_DIR`.
    pub fn locate_all() -> Vec<Self> {
        let dir = std::env::var_os(epcomm_kernels::KERNEL_DIR_ENV)
            .filter(|d| !d.is_empty())
            .map(PathBuf::from);
        epcomm_kernels::images()
            .map(|i| Self::locate(i.name(), i.artifact(), i.is_embedded(), dir.as_deref()))
            .collect()
    }

    /// The image of `family` among `images`.
    pub fn of_family(images: &[Self], family: KernelFamily) -> Option<&Self> {
        let name = epcomm_kernels::Image::of(family).name();
        images.iter().find(|i| i.name == name)
    }

    /// How to make it available.
    pub fn fix(&self) -> String {
        format!(
            "build the kernels (`cargo xtask build-kernels`) and rebuild epcomm, or set {} to a \
             directory holding {}",
            epcomm_kernels::KERNEL_DIR_ENV,
            self.artifact
        )
    }
}

#[cfg(test)]
mod tests {
    /// The NVSHMEM loader accepts exactly the releases there are kernel images for: a release
    /// it loads always finds its image, and no image is built for a release it refuses.
    #[test]
    fn every_supported_nvshmem_release_has_its_image() {
        use nvshmem_sys::loader::SUPPORTED_RELEASES;
        for release in SUPPORTED_RELEASES {
            let image = epcomm_kernels::Image::nvshmem_for(release)
                .unwrap_or_else(|e| panic!("{release:?}: {e}"));
            assert!(image.artifact().ends_with(".cubin"), "{image:?}");
        }
        let built: Vec<(u32, u32)> = epcomm_kernels::images()
            .filter_map(|i| i.nvshmem_release())
            .map(|(a, b, _)| (a, b))
            .collect();
        assert_eq!(built, SUPPORTED_RELEASES);
    }
}
