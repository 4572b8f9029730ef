//! Opening the library: [`Library::open`] (dlopen, symbols, release check) and the search
//! that tries each place in order ([`load`], [`load_default`]).

use std::collections::HashSet;
use std::fmt;
use std::os::raw::c_int;
use std::path::{Path, PathBuf};

use super::error::dl_message;
use super::search::{Step, site_steps};
use super::{LIBRARY_NAME, LibrarySearch, LoadError, Origin, Searched, Version, check_version};
use crate::sys;

/// A loaded `libnvshmem_host.so.3` whose release matched: the function table plus where it came
/// from. Opening it runs no NVSHMEM initialisation.
pub struct Library {
    api: sys::NvshmemHost,
    path: PathBuf,
    version: Version,
}

impl fmt::Debug for Library {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Library")
            .field("path", &self.path)
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

impl Library {
    /// The raw function table (every entry is `unsafe` to call; see [`crate::result`]).
    pub fn api(&self) -> &sys::NvshmemHost {
        &self.api
    }

    /// The file it was loaded from (the bare soname when the dynamic loader found it).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The NVSHMEM release, from `nvshmemx_vendor_get_version_info`.
    pub fn version(&self) -> Version {
        self.version
    }

    /// The OpenSHMEM specification version the library implements (`nvshmem_info_get_version`;
    /// 1.3 for NVSHMEM 3.4). Not the NVSHMEM release: see [`Library::version`].
    pub fn spec_version(&self) -> (c_int, c_int) {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: the function only writes two ints through the pointers, which point at live
        // locals; it needs no initialised runtime (it reports compile-time constants).
        unsafe { self.api.nvshmem_info_get_version(&mut major, &mut minor) };
        (major, minor)
    }

    /// Opens the library at `path` (a file, or a bare soname for the loader's search) with
    /// `RTLD_NOW | RTLD_GLOBAL`, resolves every bound symbol and checks the release.
    ///
    /// # Errors
    /// [`LoadError::Open`], [`LoadError::MissingSymbol`], [`LoadError::BadVersion`],
    /// [`LoadError::UnsupportedRelease`].
    pub fn open(path: &Path) -> Result<Library, LoadError> {
        Self::open_with(path, 0)
    }

    /// The copy of the library this process already loaded (step 0 of the search), found by
    /// soname with `RTLD_NOLOAD`: nothing is loaded, and a copy another library loaded
    /// privately (PyTorch maps its NVSHMEM with `RTLD_LOCAL`) is made global, as the plugins
    /// NVSHMEM `dlopen`s need. `Ok(None)` when no copy is loaded.
    ///
    /// # Errors
    /// As [`Library::open`], for a loaded copy that lacks a symbol or is an unsupported release
    /// (a second copy of another release cannot run beside it: NVSHMEM's state is per process).
    pub fn loaded() -> Result<Option<Library>, LoadError> {
        match Self::open_with(Path::new(LIBRARY_NAME), RTLD_NOLOAD) {
            Err(LoadError::Open { .. }) => Ok(None),
            other => other.map(Some),
        }
    }

    /// [`Library::open`] with `extra` dlopen flags.
    fn open_with(path: &Path, extra: c_int) -> Result<Library, LoadError> {
        use libloading::os::unix::{RTLD_GLOBAL, RTLD_NOW};
        // SAFETY: loading runs the library's initialisers; libnvshmem_host's only register
        // internal state and need no GPU (with RTLD_NOLOAD nothing is loaded at all). The flags
        // are valid dlopen flags.
        let raw = unsafe {
            libloading::os::unix::Library::open(
                Some(path.as_os_str()),
                RTLD_NOW | RTLD_GLOBAL | extra,
            )
        }
        .map_err(|source| LoadError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        // SAFETY: the symbols are looked up by the names of the NVSHMEM 3.4.5 declarations they
        // were generated from; the release check below rejects every release but the supported
        // ones (whose prototypes of these symbols are the same, see version.rs) before any call
        // whose signature could differ.
        let api = unsafe { sys::NvshmemHost::from_library(raw) }.map_err(|source| {
            LoadError::MissingSymbol {
                path: path.to_path_buf(),
                source,
            }
        })?;
        let (mut major, mut minor, mut patch) = (-1, -1, -1);
        // SAFETY: writes three ints through pointers to live locals; reports compile-time
        // constants, so it is callable before initialisation (checked against 3.4.5 and 3.7.2).
        unsafe { api.nvshmemx_vendor_get_version_info(&mut major, &mut minor, &mut patch) };
        let version = Version::from_c(major, minor, patch)?;
        check_version(path, version)?;
        Ok(Library {
            api,
            path: path.to_path_buf(),
            version,
        })
    }
}

/// glibc's `RTLD_NOLOAD` (the same value on every Linux architecture): find an object already
/// loaded, load nothing.
const RTLD_NOLOAD: c_int = 0x0004;

/// Tries `steps` in order, recording every place not used in `searched`.
///
/// `Ok(Some)` for the first library found, `Ok(None)` when none was, `Err` when a file exists
/// but does not load (or the dynamic loader found one that does not).
fn try_steps(
    steps: Vec<Step>,
    seen: &mut HashSet<PathBuf>,
    searched: &mut Vec<Searched>,
) -> Result<Option<Library>, LoadError> {
    for step in steps {
        let c = match step {
            Step::Note(note) => {
                searched.push(note);
                continue;
            }
            Step::Try(c) => c,
        };
        if !seen.insert(c.path.clone()) {
            continue;
        }
        let outcome = if c.origin == Origin::SystemLoader {
            match Library::open(&c.path) {
                Err(LoadError::Open { source, .. }) => dl_message(&source),
                other => return other.map(Some),
            }
        } else if c.path.is_file() {
            return Library::open(&c.path).map(Some);
        } else if c.path.exists() {
            "not a file".to_string()
        } else {
            "no such file".to_string()
        };
        searched.push(Searched {
            origin: c.origin,
            path: Some(c.path),
            outcome,
        });
    }
    Ok(None)
}

/// Searches the places of `search` in order (see the [`crate::loader`] docs) and opens the
/// first library found; with the system loader's step (the default search), a copy this
/// process already loaded comes first (step 0). `python3` is run (step 5,
/// [`SitePackages::Ask`](super::SitePackages::Ask)) only when steps 1 to 4 found nothing.
///
/// # Errors
/// [`LoadError::NotFound`] listing every place searched when nothing is found; the errors of
/// [`Library::open`] for the first candidate that exists.
pub fn load(search: &LibrarySearch) -> Result<Library, LoadError> {
    let mut seen = HashSet::new();
    let mut searched = Vec::new();
    if search.system_loader {
        if let Some(lib) = Library::loaded()? {
            return Ok(lib);
        }
        searched.push(Searched {
            origin: Origin::Loaded,
            path: Some(PathBuf::from(LIBRARY_NAME)),
            outcome: "not loaded".to_string(),
        });
    }
    if let Some(lib) = try_steps(search.head(), &mut seen, &mut searched)? {
        return Ok(lib);
    }
    let site = search.site_packages.resolve(&mut searched);
    if let Some(lib) = try_steps(site_steps(&site), &mut seen, &mut searched)? {
        return Ok(lib);
    }
    if let Some(lib) = try_steps(search.tail(), &mut seen, &mut searched)? {
        return Ok(lib);
    }
    Err(LoadError::NotFound {
        library: LIBRARY_NAME.to_string(),
        searched,
    })
}

/// [`load`] with [`LibrarySearch::from_env`]: the search order of the [`crate::loader`] docs.
///
/// # Errors
/// As [`load`].
pub fn load_default() -> Result<Library, LoadError> {
    load(&LibrarySearch::from_env())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loader::{
        ENV_EPCOMM_NVSHMEM_LIB, ENV_LD_LIBRARY_PATH, ENV_NVSHMEM_HOME, SitePackages, WHEEL_LIB_DIR,
    };
    use std::time::Duration;

    fn temp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "nvshmem-sys-loader-{tag}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create temp dir");
        dir
    }

    #[test]
    fn not_found_names_every_place_in_order_and_the_variables() {
        let dir = temp_dir("notfound");
        std::fs::create_dir_all(dir.join("ld-a").join(LIBRARY_NAME)).unwrap(); // a directory
        let search = LibrarySearch {
            explicit: Some(dir.join("explicit")),
            nvshmem_home: Some(dir.join("home")),
            // The soname is left out: a machine running this test may have NVSHMEM installed.
            system_loader: false,
            ld_library_path: vec![dir.join("ld-a"), dir.join("ld-b")],
            site_packages: SitePackages::Known(vec![dir.join("site"), dir.join("user-site")]),
            workspace_toolchain: Some(dir.join("ws/nvidia/nvshmem/lib")),
        };
        let candidates = search.candidates(&[dir.join("site"), dir.join("user-site")]);
        let err = load(&search).unwrap_err();
        let LoadError::NotFound { library, searched } = &err else {
            panic!("expected NotFound, got {err:?}");
        };
        assert_eq!(library, LIBRARY_NAME);
        let tried: Vec<_> = searched
            .iter()
            .map(|s| (s.origin, s.path.clone().expect("every step had a file")))
            .collect();
        let listed: Vec<_> = candidates
            .iter()
            .map(|c| (c.origin, c.path.clone()))
            .collect();
        assert_eq!(tried, listed);
        assert_eq!(
            tried.iter().map(|t| t.0).collect::<Vec<_>>(),
            [
                Origin::Explicit,
                Origin::NvshmemHome,
                Origin::LdLibraryPath,
                Origin::LdLibraryPath,
                Origin::PythonSitePackages,
                Origin::PythonSitePackages,
                Origin::WorkspaceToolchain,
            ]
        );
        assert_eq!(searched[2].outcome, "not a file");
        assert_eq!(searched[3].outcome, "no such file");
        let msg = err.to_string();
        let mut at = 0;
        for c in &candidates {
            let p = c.path.display().to_string();
            let found = msg[at..]
                .find(&p)
                .unwrap_or_else(|| panic!("{p} not in order: {msg}"));
            at += found + p.len();
        }
        for var in [
            ENV_EPCOMM_NVSHMEM_LIB,
            ENV_NVSHMEM_HOME,
            ENV_LD_LIBRARY_PATH,
        ] {
            assert!(msg.contains(&format!("{var}=")), "{var}: {msg}");
        }
        assert!(
            msg.contains("pip install nvidia-nvshmem-cu13==3.4.5"),
            "{msg}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn not_found_says_which_variables_were_unset_and_why_python_gave_nothing() {
        let search = LibrarySearch {
            site_packages: SitePackages::Ask {
                python: "/nonexistent/python3".into(),
                timeout: Duration::from_secs(2),
            },
            ..LibrarySearch::only(None, None)
        };
        let err = load(&search).unwrap_err();
        let LoadError::NotFound { searched, .. } = &err else {
            panic!("expected NotFound, got {err:?}");
        };
        assert_eq!(
            searched.iter().map(|s| s.origin).collect::<Vec<_>>(),
            [
                Origin::Explicit,
                Origin::NvshmemHome,
                Origin::PythonSitePackages
            ]
        );
        let msg = err.to_string();
        assert!(msg.contains("$EPCOMM_NVSHMEM_LIB: not set"), "{msg}");
        assert!(msg.contains("$NVSHMEM_HOME/lib: not set"), "{msg}");
        assert!(
            msg.contains("python3 site-packages: could not ask /nonexistent/python3"),
            "{msg}"
        );
    }

    #[test]
    fn the_system_loader_line_carries_the_loaders_error() {
        // Only meaningful where the soname does not resolve (no system-wide NVSHMEM).
        let search = LibrarySearch {
            system_loader: true,
            ..LibrarySearch::only(None, None)
        };
        match load(&search) {
            Err(LoadError::NotFound { searched, .. }) => {
                let line = searched
                    .iter()
                    .find(|s| s.origin == Origin::SystemLoader)
                    .expect("listed");
                assert_eq!(line.path.as_deref(), Some(Path::new(LIBRARY_NAME)));
                assert!(line.outcome.contains(LIBRARY_NAME), "{line}");
            }
            Ok(_) | Err(_) => eprintln!("the soname resolves here; nothing to check"),
        }
    }

    #[test]
    fn an_existing_file_that_is_not_a_library_is_an_open_error() {
        let dir = temp_dir("garbage");
        std::fs::write(dir.join(LIBRARY_NAME), b"not an ELF file").unwrap();
        let err = load(&LibrarySearch::only(Some(dir.clone()), None)).unwrap_err();
        assert!(
            matches!(&err, LoadError::Open { path, .. } if path == &dir.join(LIBRARY_NAME)),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(msg.contains("dlopen("), "{msg}");
        // The loader's own words, not just libloading's "dlopen failed".
        assert!(msg.contains("ELF") || msg.contains("too short"), "{msg}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_site_packages_library_is_found_and_opened() {
        let dir = temp_dir("site");
        let lib_dir = dir.join("site").join(WHEEL_LIB_DIR);
        std::fs::create_dir_all(&lib_dir).unwrap();
        std::fs::write(lib_dir.join(LIBRARY_NAME), b"not an ELF file").unwrap();
        let search = LibrarySearch {
            site_packages: SitePackages::Known(vec![dir.join("empty"), dir.join("site")]),
            ..LibrarySearch::only(None, None)
        };
        let err = load(&search).unwrap_err();
        assert!(
            matches!(&err, LoadError::Open { path, .. } if path == &lib_dir.join(LIBRARY_NAME)),
            "{err:?}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
