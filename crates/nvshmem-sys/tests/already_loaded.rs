//! Step 0 of the search: a copy of `libnvshmem_host.so.3` this process already loaded (as
//! PyTorch does) is the one used, whatever the variables name. Its own process (a test binary
//! of its own), since loading the library is for the process's life. Skips, saying why, when
//! the workspace's pinned toolchain has no library.

use std::path::PathBuf;

use nvshmem_sys::loader::{self, Library, LibrarySearch, Origin, SitePackages};

#[test]
fn a_copy_already_loaded_comes_before_every_variable() {
    // Nothing in this process loaded NVSHMEM yet: step 0 finds nothing and loads nothing.
    assert!(Library::loaded().expect("no copy to check").is_none());
    assert!(Library::loaded().expect("still none").is_none());
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../target/cuda-toolchain/nvidia/nvshmem/lib");
    if !dir.join(loader::LIBRARY_NAME).is_file() {
        eprintln!(
            "skipping: no NVSHMEM host library in {} (cargo xtask build-kernels installs it)",
            dir.display()
        );
        return;
    }
    // What a framework does: load it from a file of its own.
    let first = Library::open(&dir.join(loader::LIBRARY_NAME)).expect("the pinned library");
    let loaded = Library::loaded()
        .expect("a supported release")
        .expect("the copy just loaded is found by soname");
    assert_eq!(loaded.version(), first.version());
    // The default search with variables pointing elsewhere still takes that copy.
    let search = LibrarySearch {
        explicit: Some(PathBuf::from("/nonexistent/explicit")),
        nvshmem_home: Some(PathBuf::from("/nonexistent/home")),
        system_loader: true,
        ld_library_path: Vec::new(),
        site_packages: SitePackages::Skip,
        workspace_toolchain: None,
    };
    let found = loader::load(&search).expect("the loaded copy");
    assert_eq!(found.path(), PathBuf::from(loader::LIBRARY_NAME));
    assert_eq!(found.version(), first.version());
    // Without the system loader's steps (a search pinned to given places) step 0 is skipped.
    let err = loader::load(&LibrarySearch::only(
        Some(PathBuf::from("/nonexistent/explicit")),
        None,
    ))
    .unwrap_err()
    .to_string();
    assert!(err.contains("/nonexistent/explicit"), "{err}");
    assert!(!err.contains(&Origin::Loaded.to_string()), "{err}");
}
