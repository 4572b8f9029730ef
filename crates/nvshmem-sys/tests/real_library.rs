//! Loads the real `libnvshmem_host.so.3` when one is available (the workspace's pinned pip
//! toolchain, `$EPCOMM_NVSHMEM_LIB`, `$NVSHMEM_HOME`, pip installs, the loader path) and checks
//! what works without a GPU. Skips, saying why, when no library is found.

use std::path::PathBuf;
use std::sync::Arc;

use nvshmem_sys::loader::{self, LibrarySearch, LoadError};
use nvshmem_sys::{Error, Library, Nvshmem, UNIQUEID_BYTES, UniqueIdError, sys};

fn workspace_lib_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/cuda-toolchain/nvidia/nvshmem/lib")
}

/// The library, or `None` (with a message) when this machine has none.
fn library() -> Option<Arc<Library>> {
    let pinned = workspace_lib_dir();
    let result = if pinned.join(loader::LIBRARY_NAME).is_file() {
        loader::load(&LibrarySearch::only(Some(pinned), None))
    } else {
        loader::load_default()
    };
    match result {
        Ok(lib) => Some(Arc::new(lib)),
        Err(e @ LoadError::NotFound { .. }) => {
            eprintln!("skipping: no NVSHMEM host library on this machine: {e}");
            None
        }
        Err(e) => panic!("an NVSHMEM host library exists but does not load: {e}"),
    }
}

#[test]
fn loads_and_reports_the_pinned_release() {
    let Some(lib) = library() else { return };
    assert_eq!(lib.version(), loader::EXPECTED_VERSION, "{lib:?}");
    assert_eq!(lib.version().to_string(), "3.4.5");
    // nvshmem_info_get_version is the OpenSHMEM spec version, not the release.
    assert_eq!(
        lib.spec_version(),
        (
            sys::NVSHMEM_MAJOR_VERSION as i32,
            sys::NVSHMEM_MINOR_VERSION as i32
        )
    );
    assert_eq!(
        nvshmem_sys::result::init_status(lib.api()),
        sys::NVSHMEM_STATUS_NOT_INITIALIZED as i32
    );
}

#[test]
fn rank0_makes_a_versioned_unique_id_without_a_gpu() {
    let Some(lib) = library() else { return };
    let bytes = match Nvshmem::get_uniqueid(&lib) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("skipping: nvshmemx_get_uniqueid failed on this machine: {e}");
            return;
        }
    };
    assert_eq!(bytes.len(), UNIQUEID_BYTES);
    let id = nvshmem_sys::attr::uniqueid_from_bytes(&bytes).expect("round-trips");
    assert_eq!(id.version, (1 << 16) + 128);
    assert!(
        id.internal.iter().any(|&c| c != 0),
        "the id carries bootstrap data"
    );
}

#[test]
fn init_rejects_bad_arguments_before_calling_nvshmem() {
    let Some(lib) = library() else { return };
    let uid = vec![0u8; UNIQUEID_BYTES];
    let e = Nvshmem::init_with_uniqueid(lib.clone(), 2, 2, &uid).unwrap_err();
    assert!(matches!(e, Error::InvalidRank { rank: 2, world: 2 }), "{e}");
    let e = Nvshmem::init_with_uniqueid(lib.clone(), 0, 0, &uid).unwrap_err();
    assert!(matches!(e, Error::InvalidWorld { world: 0, .. }), "{e}");
    let e = Nvshmem::init_with_uniqueid(lib.clone(), 0, usize::MAX, &uid).unwrap_err();
    assert!(matches!(e, Error::InvalidWorld { .. }), "{e}");
    let e = Nvshmem::init_with_uniqueid(lib.clone(), 0, 1, &uid[..5]).unwrap_err();
    assert!(
        matches!(e, Error::UniqueId(UniqueIdError::Length { found: 5, .. })),
        "{e}"
    );
    // Right length, wrong version word: not an NVSHMEM 3.4 id.
    let e = Nvshmem::init_with_uniqueid(lib, 0, 1, &uid).unwrap_err();
    assert!(
        matches!(e, Error::UniqueId(UniqueIdError::Version { .. })),
        "{e}"
    );
}
