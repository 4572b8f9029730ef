//! The release check: a loaded library must be the NVSHMEM major.minor the bindings were
//! generated from ([`EXPECTED_VERSION`]); the patch release may differ.

use std::fmt;
use std::os::raw::c_int;
use std::path::Path;

use super::LoadError;
use crate::sys;

/// The release the bindings were generated from; a loaded library must match its major.minor.
pub const EXPECTED_VERSION: Version = Version {
    major: sys::NVSHMEM_VENDOR_MAJOR_VERSION,
    minor: sys::NVSHMEM_VENDOR_MINOR_VERSION,
    patch: sys::NVSHMEM_VENDOR_PATCH_VERSION,
};

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

    /// Whether `self` is ABI-compatible with the bindings: the same major and minor release.
    pub fn is_compatible_with(self, expected: Version) -> bool {
        self.major == expected.major && self.minor == expected.minor
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// Checks a loaded library's release against [`EXPECTED_VERSION`].
///
/// # Errors
/// [`LoadError::VersionMismatch`] naming both versions unless major and minor agree.
pub fn check_version(path: &Path, found: Version) -> Result<(), LoadError> {
    if found.is_compatible_with(EXPECTED_VERSION) {
        Ok(())
    } else {
        Err(LoadError::VersionMismatch {
            path: path.to_path_buf(),
            found,
            expected: EXPECTED_VERSION,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_mismatch_names_both_versions() {
        let path = Path::new("/lib/libnvshmem_host.so.3");
        let found = Version::from_c(3, 3, 9).unwrap();
        let err = check_version(path, found).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("NVSHMEM 3.3.9"), "{msg}");
        assert!(
            msg.contains("NVSHMEM 3.4.5") && msg.contains("3.4.x"),
            "{msg}"
        );
        assert!(msg.contains("/lib/libnvshmem_host.so.3"), "{msg}");
        assert!(check_version(path, Version::from_c(3, 4, 0).unwrap()).is_ok());
        assert!(check_version(path, Version::from_c(3, 4, 99).unwrap()).is_ok());
        assert!(check_version(path, Version::from_c(4, 4, 5).unwrap()).is_err());
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
