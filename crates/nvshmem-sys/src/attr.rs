//! Rust equivalents of the header-only initialiser macros, and the unique id as bytes.
//!
//! NVSHMEM versions its ABI structs: the first `int` of each is `(1 << 16) + sizeof(struct)`
//! (`NVSHMEMX_UNIQUEID_INITIALIZER`, `NVSHMEMX_INIT_ATTR_INITIALIZER` and
//! `nvshmemx_init_init_attr_ver_only` in `device_host/nvshmem_types.h`). The library rejects
//! structs whose version it does not know, so these must be set exactly as the macros do.

use std::mem::size_of;
use std::os::raw::c_int;

use crate::sys;

/// Size in bytes of `nvshmemx_uniqueid_t` (header: `static_assert(... == 128)`); the unique id is
/// shipped between ranks as exactly this many bytes.
pub const UNIQUEID_BYTES: usize = size_of::<sys::nvshmemx_uniqueid_t>();

/// Size in bytes of `nvshmemx_init_attr_t` (header: `static_assert(... == 144)`).
pub const INIT_ATTR_BYTES: usize = size_of::<sys::nvshmemx_init_attr_t>();

const _: () = assert!(UNIQUEID_BYTES == 128);
const _: () = assert!(INIT_ATTR_BYTES == 144);
const _: () = assert!(size_of::<sys::nvshmemx_init_args_t>() == 128);
const _: () = assert!(size_of::<sys::nvshmemx_uniqueid_args_t>() == 24);

/// `(1 << 16) + size`: the version word of a v1 NVSHMEM struct of `size` bytes.
const fn version_word(size: usize) -> c_int {
    // Every struct versioned this way is at most a few hundred bytes; checked by the asserts above.
    (1 << 16) + size as c_int
}

/// `NVSHMEMX_UNIQUEID_INITIALIZER`: version set, payload zeroed.
pub fn uniqueid_initializer() -> sys::nvshmemx_uniqueid_t {
    sys::nvshmemx_uniqueid_t {
        version: version_word(size_of::<sys::nvshmemx_uniqueid_t>()),
        ..Default::default()
    }
}

/// `NVSHMEMX_INIT_ATTR_INITIALIZER`: every version word set, `mpi_comm` and the unique-id
/// pointer null, `myrank`/`nranks` `UNIQUEID_ARGS_INVALID`, padding zeroed.
pub fn init_attr_initializer() -> sys::nvshmemx_init_attr_t {
    let uid_args = sys::nvshmemx_uniqueid_args_t {
        version: version_word(size_of::<sys::nvshmemx_uniqueid_args_t>()),
        id: std::ptr::null_mut(),
        myrank: sys::UNIQUEID_ARGS_INVALID,
        nranks: sys::UNIQUEID_ARGS_INVALID,
    };
    let args = sys::nvshmemx_init_args_t {
        version: version_word(size_of::<sys::nvshmemx_init_args_t>()),
        uid_args,
        ..Default::default()
    };
    sys::nvshmemx_init_attr_t {
        version: version_word(size_of::<sys::nvshmemx_init_attr_t>()),
        mpi_comm: std::ptr::null_mut(),
        args,
    }
}

/// The unique id as the bytes to ship to the other ranks (its in-memory representation).
pub fn uniqueid_to_bytes(id: &sys::nvshmemx_uniqueid_t) -> Vec<u8> {
    let mut out = Vec::with_capacity(UNIQUEID_BYTES);
    out.extend_from_slice(&id.version.to_ne_bytes());
    out.extend(id.internal.iter().map(|&c| c as u8));
    out
}

/// Why bytes received from another rank are not a unique id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UniqueIdError {
    /// The slice is not exactly [`UNIQUEID_BYTES`] long.
    #[error("unique id must be exactly {expected} bytes, got {found}")]
    Length {
        /// [`UNIQUEID_BYTES`].
        expected: usize,
        /// The length received.
        found: usize,
    },
    /// The version word is not the one this build of the bindings writes.
    #[error(
        "unique id version word is {found:#x}, expected {expected:#x} (v1, 128 bytes): \
         the bytes are not an NVSHMEM 3.4 unique id"
    )]
    Version {
        /// `(1 << 16) + 128`.
        expected: c_int,
        /// What the bytes hold.
        found: c_int,
    },
}

/// Rebuilds a unique id from bytes made by [`uniqueid_to_bytes`] (on a machine of the same
/// endianness).
///
/// # Errors
/// [`UniqueIdError::Length`] unless `bytes.len() == UNIQUEID_BYTES`;
/// [`UniqueIdError::Version`] unless the version word is `(1 << 16) + 128`.
pub fn uniqueid_from_bytes(bytes: &[u8]) -> Result<sys::nvshmemx_uniqueid_t, UniqueIdError> {
    if bytes.len() != UNIQUEID_BYTES {
        return Err(UniqueIdError::Length {
            expected: UNIQUEID_BYTES,
            found: bytes.len(),
        });
    }
    let (head, tail) = bytes.split_at(size_of::<c_int>());
    let mut word = [0u8; size_of::<c_int>()];
    word.copy_from_slice(head);
    let version = c_int::from_ne_bytes(word);
    let expected = version_word(UNIQUEID_BYTES);
    if version != expected {
        return Err(UniqueIdError::Version {
            expected,
            found: version,
        });
    }
    let mut id = sys::nvshmemx_uniqueid_t {
        version,
        ..Default::default()
    };
    for (dst, &src) in id.internal.iter_mut().zip(tail) {
        *dst = src as std::os::raw::c_char;
    }
    Ok(id)
}

#[cfg(test)]
mod tests {
    use std::mem::{align_of, offset_of};

    use super::*;

    #[test]
    fn struct_layouts_match_the_3_4_5_headers() {
        // Values from bootstrap_device_host/nvshmem_uniqueid.h and device_host/nvshmem_types.h.
        assert_eq!(sys::UNIQUEID_PADDING, 124);
        assert_eq!(sys::INIT_ARGS_PADDING, 96);
        assert_eq!(size_of::<sys::nvshmemx_uniqueid_t>(), 128);
        assert_eq!(offset_of!(sys::nvshmemx_uniqueid_t, internal), 4);
        assert_eq!(size_of::<sys::nvshmemx_uniqueid_args_t>(), 24);
        assert_eq!(offset_of!(sys::nvshmemx_uniqueid_args_t, id), 8);
        assert_eq!(offset_of!(sys::nvshmemx_uniqueid_args_t, myrank), 16);
        assert_eq!(offset_of!(sys::nvshmemx_uniqueid_args_t, nranks), 20);
        assert_eq!(size_of::<sys::nvshmemx_init_args_t>(), 128);
        assert_eq!(offset_of!(sys::nvshmemx_init_args_t, uid_args), 8);
        assert_eq!(offset_of!(sys::nvshmemx_init_args_t, content), 32);
        assert_eq!(size_of::<sys::nvshmemx_init_attr_t>(), 144);
        assert_eq!(align_of::<sys::nvshmemx_init_attr_t>(), 8);
        assert_eq!(offset_of!(sys::nvshmemx_init_attr_t, mpi_comm), 8);
        assert_eq!(offset_of!(sys::nvshmemx_init_attr_t, args), 16);
    }

    #[test]
    fn header_constants_are_the_3_4_5_values() {
        assert_eq!(sys::NVSHMEMX_INIT_WITH_UNIQUEID, 1 << 3);
        assert_eq!(sys::NVSHMEM_TEAM_WORLD, 0);
        assert_eq!(sys::NVSHMEMX_TEAM_NODE, 2);
        assert_eq!(sys::NVSHMEM_STATUS_IS_INITIALIZED, 2);
        assert_eq!(
            (
                sys::NVSHMEM_VENDOR_MAJOR_VERSION,
                sys::NVSHMEM_VENDOR_MINOR_VERSION,
                sys::NVSHMEM_VENDOR_PATCH_VERSION
            ),
            (3, 4, 5)
        );
    }

    #[test]
    fn initialisers_set_the_version_words_like_the_macros() {
        assert_eq!(uniqueid_initializer().version, 65536 + 128);
        assert!(uniqueid_initializer().internal.iter().all(|&c| c == 0));
        let a = init_attr_initializer();
        assert_eq!(a.version, 65536 + 144);
        assert!(a.mpi_comm.is_null());
        assert_eq!(a.args.version, 65536 + 128);
        assert_eq!(a.args.uid_args.version, 65536 + 24);
        assert!(a.args.uid_args.id.is_null());
        assert_eq!(a.args.uid_args.myrank, -1);
        assert_eq!(a.args.uid_args.nranks, -1);
        assert!(a.args.content.iter().all(|&c| c == 0));
    }

    #[test]
    fn uniqueid_round_trips_through_bytes() {
        let mut id = uniqueid_initializer();
        for (i, c) in id.internal.iter_mut().enumerate() {
            *c = (i as u8).wrapping_mul(7) as std::os::raw::c_char;
        }
        let bytes = uniqueid_to_bytes(&id);
        assert_eq!(bytes.len(), UNIQUEID_BYTES);
        let back = uniqueid_from_bytes(&bytes).expect("valid");
        assert_eq!(back.version, id.version);
        assert_eq!(back.internal, id.internal);
    }

    #[test]
    fn bad_uniqueid_bytes_are_rejected_with_the_rule_broken() {
        let e = uniqueid_from_bytes(&[0; 127]).unwrap_err();
        assert_eq!(
            e,
            UniqueIdError::Length {
                expected: 128,
                found: 127
            }
        );
        assert!(e.to_string().contains("exactly 128 bytes, got 127"));
        let e = uniqueid_from_bytes(&[0; 128]).unwrap_err();
        assert_eq!(
            e,
            UniqueIdError::Version {
                expected: 65536 + 128,
                found: 0
            }
        );
    }
}
