//! The release check: a loaded library must be one of the NVSHMEM releases epcomm supports
//! ([`SUPPORTED_RELEASES`], by major.minor; the patch release may differ).
//!
//! The bindings were generated from [`EXPECTED_VERSION`] (3.4.5). The host functions they bind
//! kept their names, prototypes, struct layouts and constants through 3.7 (3.7's
//! `nvshmemx_init_attr_t` is a second version of the same 144 bytes: a field taken from padding,
//! read only when the struct says it is version 2, which these bindings never write); so one set
//! serves every supported release. The device code does not: a kernel image is device-linked
//! against one release's `libnvshmem_device`, and the host refuses an image of a newer minor
//! release, so each supported release has its own image (`epcomm_kernels::Image::nvshmem_for`).

use std::fmt;
use std::os::raw::c_int;
use std::path::Path;

use super::LoadError;
use crate::sys;

/// The release the bindings were generated from.
pub const EXPECTED_VERSION: Version = Version {
    major: sys::NVSHMEM_VENDOR_MAJOR_VERSION,
    minor: sys::NVSHMEM_VENDOR_MINOR_VERSION,
    patch: sys::NVSHMEM_VENDOR_PATCH_VERSION,
};

/// The releases (major, minor) a loaded library may be: the ones PyTorch wheels bring into a
/// process (3.4 with torch 2.10 to 2.14, 3.7 with torch 2.15), each with its own kernel image.
pub const SUPPORTED_RELEASES: [(u32, u32); 2] = [(3, 4), (3, 7)];

/// An NVSHMEM release number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version {
    /// Major release.
    pub major: u32,
    /// Minor release.
    pub minor: u32,
    /// Patch release.
    pub patch: u32,
}

impl Version {
    /// Builds a version from the three `int`s `nvshmemx_vendor_get_version_info` writes.
    ///
    /// # Errors
    /// [`LoadError::BadVersion`] when any part is negative (the library wrote garbage).
    pub fn from_c(major: c_int, minor: c_int, patch: c_int) -> Result<Version, LoadError> {
        match (
            u32::try_from(major),
            u32::try_from(minor),
            u32::try_from(patch),
        ) {
            (Ok(major), Ok(minor), Ok(patch)) => Ok(Version {
                major,
                minor,
                patch,
            }),
            _ => Err(LoadError::BadVersion {
                major,
                minor,
                patch,
            }),
        }
    }

    /// Whether `self` is the same major and minor release as `other`.
    pub fn is_compatible_with(self, other: Version) -> bool {
        self.major == other.major && self.minor == other.minor
    }

    /// `(major, minor)`: the release class that picks a kernel image.
    pub fn release(self) -> (u32, u32) {
        (self.major, self.minor)
    }

    /// Whether it is one of [`SUPPORTED_RELEASES`].
    pub fn is_supported(self) -> bool {
        SUPPORTED_RELEASES.contains(&self.release())
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// For each supported release: the pip package release to install and the PyTorch wheels that
/// bring it (for messages).
pub const RELEASE_PINS: [((u32, u32), &str, &str); 2] = [
    ((3, 4), "3.4.5", "torch 2.10 to 2.14"),
    ((3, 7), "3.7.2", "torch 2.15"),
];

/// The supported releases as `3.4.x, 3.7.x` (for messages).
pub fn supported_list() -> String {
    SUPPORTED_RELEASES
        .iter()
        .map(|(major, minor)| format!("{major}.{minor}.x"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Checks a loaded library's release against [`SUPPORTED_RELEASES`].
///
/// # Errors
/// [`LoadError::UnsupportedRelease`] naming the file, its release and the supported ones.
pub fn check_version(path: &Path, found: Version) -> Result<(), LoadError> {
    if found.is_supported() {
        Ok(())
    } else {
        Err(LoadError::UnsupportedRelease {
            path: path.to_path_buf(),
            found,
        })
    }
}

/// How to install each supported release: `nvidia-nvshmem-cu13==3.4.5 (what torch 2.10 to
/// 2.14 bring)`, joined with `or`.
pub fn install_hint() -> String {
    RELEASE_PINS
        .iter()
        .map(|(_, pip, torch)| {
            format!("python3 -m pip install nvidia-nvshmem-cu13=={pip} (what {torch} bring)")
        })
        .collect::<Vec<_>>()
        .join(", or ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unsupported_release_is_named_with_the_supported_ones() {
        let path = Path::new("/lib/libnvshmem_host.so.3");
        for (major, minor, patch) in [(3, 3, 9), (3, 5, 21), (3, 6, 5), (3, 8, 0), (4, 4, 5)] {
            let found = Version::from_c(major, minor, patch).unwrap();
            let msg = check_version(path, found).unwrap_err().to_string();
            assert!(msg.contains(&format!("NVSHMEM {found}")), "{msg}");
            assert!(msg.contains(&supported_list()), "{msg}");
            assert!(msg.contains("/lib/libnvshmem_host.so.3"), "{msg}");
            assert!(msg.contains("nvidia-nvshmem-cu13==3.4.5"), "{msg}");
        }
        for (major, minor, patch) in [(3, 4, 0), (3, 4, 5), (3, 4, 99), (3, 7, 0), (3, 7, 2)] {
            let found = Version::from_c(major, minor, patch).unwrap();
            assert!(check_version(path, found).is_ok(), "{found}");
            assert!(found.is_supported());
        }
        assert_eq!(EXPECTED_VERSION.release(), SUPPORTED_RELEASES[0]);
        let pinned: Vec<_> = RELEASE_PINS.iter().map(|p| p.0).collect();
        assert_eq!(pinned, SUPPORTED_RELEASES, "one pin per supported release");
    }

    #[test]
    fn negative_version_parts_are_rejected() {
        let err = Version::from_c(3, -1, 5).unwrap_err();
        assert!(matches!(
            err,
            LoadError::BadVersion {
                major: 3,
                minor: -1,
                patch: 5
            }
        ));
        assert_eq!(Version::from_c(3, 4, 5).unwrap().to_string(), "3.4.5");
    }
}
