//! The kernel images this crate knows: one per line of the image manifest
//! (`kernels/images.txt`), each embedded at build time when its artifact was there.

use crate::abi::KernelFamily;
use crate::{KERNEL_DIR_ENV, KernelError};

include!("images_generated.rs");

mod embedded {
    include!(concat!(env!("OUT_DIR"), "/embedded.rs"));
}

/// How an image is built (docs/build.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ImageBuild {
    /// `nvcc --fatbin`: sm_90a SASS and compute_90 PTX.
    Fatbin,
    /// `nvcc -rdc=true -cubin`, device-linked with `libnvshmem_device`: load it only where the
    /// NVSHMEM runtime is initialised, then register it with `nvshmemx_cumodule_init`.
    NvshmemCubin,
}

/// One kernel image: a line of the image manifest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Image {
    index: usize,
}

/// Every kernel image, in manifest order (for diagnostics such as `epcomm doctor`).
pub fn images() -> impl ExactSizeIterator<Item = Image> {
    (0..IMAGE_TABLE.len()).map(|index| Image { index })
}

/// Index of the image called `name` in the table; a compile-time error in a `const` context
/// when there is none.
const fn index_of(name: &str) -> usize {
    let mut i = 0;
    while i < IMAGE_TABLE.len() {
        let candidate = IMAGE_TABLE[i].0.as_bytes();
        let wanted = name.as_bytes();
        if candidate.len() == wanted.len() {
            let mut j = 0;
            while j < wanted.len() && candidate[j] == wanted[j] {
                j += 1;
            }
            if j == wanted.len() {
                return i;
            }
        }
        i += 1;
    }
    panic!("no such image in kernels/images.txt")
}

impl Image {
    /// The intranode image with stores through peer mappings only (`intranode.fatbin`).
    pub const INTRANODE: Image = Image {
        index: index_of("intranode"),
    };
    /// The intranode image device-linked with NVSHMEM 3.4 (`intranode_nvshmem.cubin`): the
    /// NVSHMEM family's image when no release is asked for ([`Image::of`]).
    pub const INTRANODE_NVSHMEM: Image = Image {
        index: index_of("intranode_nvshmem"),
    };
    /// The intranode image whose proxied peers are reached through the CPU proxy's descriptor
    /// ring (`intranode_proxy.fatbin`).
    pub const INTRANODE_PROXY: Image = Image {
        index: index_of("intranode_proxy"),
    };

    /// The image a transport of `family` works with whose device runtime is `device_library`
    /// (NVSHMEM's `(major, minor)` for [`KernelFamily::NvshmemDevice`], from the transport's
    /// loaded host library; `None`: the family's default image, [`Image::of`]).
    ///
    /// # Errors
    /// [`KernelError::NoNvshmemImage`] when no NVSHMEM image was built against that release.
    pub fn for_runtime(
        family: KernelFamily,
        device_library: Option<(u32, u32)>,
    ) -> Result<Image, KernelError> {
        match (family, device_library) {
            (KernelFamily::NvshmemDevice, Some(release)) => Self::nvshmem_for(release),
            _ => Ok(Self::of(family)),
        }
    }

    /// The NVSHMEM image device-linked against release `(major, minor)` (any patch): the host
    /// library refuses an image of a newer minor release, and an older one lacks its device
    /// state's newer fields, so only the same minor release is taken.
    ///
    /// # Errors
    /// [`KernelError::NoNvshmemImage`] naming the release and the images there are.
    pub fn nvshmem_for(release: (u32, u32)) -> Result<Image, KernelError> {
        images()
            .find(|i| {
                i.nvshmem_release()
                    .is_some_and(|(a, b, _)| (a, b) == release)
            })
            .ok_or_else(|| KernelError::NoNvshmemImage {
                release,
                available: images()
                    .filter_map(|i| i.nvshmem_release())
                    .map(|(a, b, c)| format!("{a}.{b}.{c}"))
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }

    /// The image a transport of `family` works with (for NVSHMEM, the 3.4 image; see
    /// [`Image::for_runtime`]).
    pub fn of(family: KernelFamily) -> Image {
        match family {
            KernelFamily::NvlinkStore => Self::INTRANODE,
            KernelFamily::NvshmemDevice => Self::INTRANODE_NVSHMEM,
            KernelFamily::CpuProxy => Self::INTRANODE_PROXY,
        }
    }

    /// The image called `name` in the manifest, if any.
    pub fn named(name: &str) -> Option<Image> {
        images().find(|i| i.name() == name)
    }

    /// Its name in the manifest, e.g. `intranode`.
    pub fn name(self) -> &'static str {
        IMAGE_TABLE[self.index].0
    }

    /// Its artifact's file name, e.g. `intranode.fatbin`.
    pub fn artifact(self) -> &'static str {
        IMAGE_TABLE[self.index].1
    }

    /// How it is built.
    pub fn build(self) -> ImageBuild {
        match IMAGE_TABLE[self.index].2 {
            "fatbin" => ImageBuild::Fatbin,
            _ => ImageBuild::NvshmemCubin,
        }
    }

    /// The NVSHMEM release `(major, minor, patch)` it is device-linked against (`None` for an
    /// image without NVSHMEM).
    pub fn nvshmem_release(self) -> Option<(u32, u32, u32)> {
        let mut parts = IMAGE_TABLE[self.index].4.split('.').map(str::parse::<u32>);
        match (parts.next(), parts.next(), parts.next(), parts.next()) {
            (Some(Ok(a)), Some(Ok(b)), Some(Ok(c)), None) => Some((a, b, c)),
            _ => None,
        }
    }

    /// Its entry source in the repository, e.g. `kernels/intranode/store.cu`.
    pub fn source(self) -> &'static str {
        IMAGE_TABLE[self.index].3
    }

    /// True when the artifact was embedded when this crate was compiled.
    pub fn is_embedded(self) -> bool {
        embedded::EMBEDDED[self.index].is_some()
    }

    /// Where the build script looked for the artifact.
    pub fn build_path(self) -> &'static str {
        embedded::BUILD_PATHS[self.index]
    }

    /// The embedded bytes, else the artifact read from `$EPCOMM_KERNEL_DIR` (read once per
    /// process and kept).
    pub fn bytes(self) -> Result<&'static [u8], KernelError> {
        crate::image_or_file(
            embedded::EMBEDDED[self.index],
            self.artifact(),
            self.build_path(),
            std::env::var_os(KERNEL_DIR_ENV),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_consistent() {
        assert_eq!(images().len(), IMAGE_TABLE.len());
        for image in images() {
            assert_eq!(Image::named(image.name()), Some(image));
            let extension = match image.build() {
                ImageBuild::Fatbin => ".fatbin",
                ImageBuild::NvshmemCubin => ".cubin",
            };
            assert!(image.artifact().ends_with(extension), "{image:?}");
            assert!(["fatbin", "nvshmem_cubin"].contains(&IMAGE_TABLE[image.index].2));
            assert!(image.source().starts_with("kernels/") && image.source().ends_with(".cu"));
            assert!(image.build_path().ends_with(image.artifact()));
            // An NVSHMEM image names its release; no other image does.
            assert_eq!(
                image.nvshmem_release().is_some(),
                image.build() == ImageBuild::NvshmemCubin,
                "{image:?}"
            );
        }
        assert_eq!(Image::INTRANODE.artifact(), "intranode.fatbin");
        assert_eq!(Image::INTRANODE_NVSHMEM.build(), ImageBuild::NvshmemCubin);
        assert_eq!(Image::named("nope"), None);
    }

    #[test]
    fn the_nvshmem_image_is_picked_by_the_runtime_release() {
        use KernelFamily::{CpuProxy, NvlinkStore, NvshmemDevice};
        assert_eq!(Image::INTRANODE_NVSHMEM.nvshmem_release(), Some((3, 4, 5)));
        for (release, name) in [
            ((3, 4), "intranode_nvshmem"),
            ((3, 7), "intranode_nvshmem_3_7"),
        ] {
            let image = Image::for_runtime(NvshmemDevice, Some(release)).unwrap();
            assert_eq!(image.name(), name);
            let (a, b, _) = image.nvshmem_release().unwrap();
            assert_eq!((a, b), release);
        }
        assert_eq!(
            Image::for_runtime(NvshmemDevice, None).unwrap(),
            Image::INTRANODE_NVSHMEM
        );
        // Other families ignore a release.
        assert_eq!(
            Image::for_runtime(NvlinkStore, Some((3, 7))).unwrap(),
            Image::INTRANODE
        );
        assert_eq!(
            Image::for_runtime(CpuProxy, None).unwrap(),
            Image::INTRANODE_PROXY
        );
        for release in [(3, 3), (3, 5), (3, 6), (3, 8), (4, 4)] {
            let e = Image::for_runtime(NvshmemDevice, Some(release)).unwrap_err();
            let msg = e.to_string();
            assert!(matches!(e, KernelError::NoNvshmemImage { .. }), "{e:?}");
            assert!(
                msg.contains(&format!("NVSHMEM {}.{}", release.0, release.1)),
                "{msg}"
            );
            assert!(msg.contains("3.4.5, 3.7.2"), "{msg}");
        }
    }
}
