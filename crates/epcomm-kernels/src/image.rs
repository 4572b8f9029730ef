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
    /// The intranode image device-linked with NVSHMEM (`intranode_nvshmem.cubin`).
    pub const INTRANODE_NVSHMEM: Image = Image {
        index: index_of("intranode_nvshmem"),
    };
    /// The intranode image whose proxied peers are reached through the CPU proxy's descriptor
    /// ring (`intranode_proxy.fatbin`).
    pub const INTRANODE_PROXY: Image = Image {
        index: index_of("intranode_proxy"),
    };

    /// The image a transport of `family` works with.
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
        }
        assert_eq!(Image::INTRANODE.artifact(), "intranode.fatbin");
        assert_eq!(Image::INTRANODE_NVSHMEM.build(), ImageBuild::NvshmemCubin);
        assert_eq!(Image::named("nope"), None);
    }
}
