//! Finding and `dlopen`ing `libnvshmem_host.so.3`, and checking its release.
//!
//! Search order ([`LibrarySearch::candidates`]), first existing file wins:
//!
//! 1. `$EPCOMM_NVSHMEM_LIB` — a directory holding the library, or the library file itself
//!    (e.g. the workspace's `target/cuda-toolchain/nvidia/nvshmem/lib`);
//! 2. `$NVSHMEM_HOME/lib`;
//! 3. pip installs: `$VIRTUAL_ENV/lib/python3*/site-packages`,
//!    `/opt/torch/.venv/lib/python3*/site-packages`, `/usr/local/lib/python3*/dist-packages`,
//!    `/usr/local/lib/python3*/site-packages`, `/usr/lib/python3/dist-packages` — each joined with
//!    `nvidia/nvshmem/lib` (newest `python3.N` first);
//! 4. the plain soname, resolved by the dynamic loader (`LD_LIBRARY_PATH`, `ld.so.cache`).
//!
//! The library is opened with `RTLD_NOW | RTLD_GLOBAL`: the bootstrap and transport plugins
//! NVSHMEM itself `dlopen`s resolve host-library symbols globally.

use std::ffi::{OsStr, OsString};
use std::fmt;
use std::os::raw::c_int;
use std::path::{Path, PathBuf};

use crate::sys;

/// The soname looked for.
pub const LIBRARY_NAME: &str = "libnvshmem_host.so.3";

/// The release the bindings were generated from; a loaded library must match its major.minor.
pub const EXPECTED_VERSION: Version = Version {
    major: sys::NVSHMEM_VENDOR_MAJOR_VERSION,
    minor: sys::NVSHMEM_VENDOR_MINOR_VERSION,
    patch: sys::NVSHMEM_VENDOR_PATCH_VERSION,
};

/// Environment variable: directory holding the library, or the library file.
pub const ENV_EPCOMM_NVSHMEM_LIB: &str = "EPCOMM_NVSHMEM_LIB";
/// Environment variable: NVSHMEM install prefix (the library is in its `lib/`).
pub const ENV_NVSHMEM_HOME: &str = "NVSHMEM_HOME";

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

/// Everything loading the library can fail with.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// No candidate file exists and the dynamic loader cannot find the soname either.
    #[error(
        "{library} not found. Searched, in order:\n{}\nSet {ENV_EPCOMM_NVSHMEM_LIB} to the directory \
         holding it (or to the file), or {ENV_NVSHMEM_HOME} to the NVSHMEM install prefix",
        bullets(searched)
    )]
    NotFound {
        /// The soname looked for.
        library: String,
        /// Every place looked at, in order; the last is the bare soname when the dynamic
        /// loader's own search was tried.
        searched: Vec<PathBuf>,
    },
    /// A candidate file exists but `dlopen` refused it.
    #[error("dlopen({}) failed: {source}", path.display())]
    Open {
        /// The file.
        path: PathBuf,
        /// The loader's error.
        source: libloading::Error,
    },
    /// The library lacks a symbol the bindings need (not NVSHMEM 3.4's host library?).
    #[error("{} lacks a symbol the NVSHMEM {EXPECTED_VERSION} bindings need: {source}", path.display())]
    MissingSymbol {
        /// The file.
        path: PathBuf,
        /// The loader's error (names the symbol).
        source: libloading::Error,
    },
    /// The library is another release than the bindings were generated from.
    #[error(
        "{} is NVSHMEM {found}, but these bindings were generated from NVSHMEM {expected} \
         and need {}.{}.x",
        path.display(),
        expected.major,
        expected.minor
    )]
    VersionMismatch {
        /// The file.
        path: PathBuf,
        /// What `nvshmemx_vendor_get_version_info` reported.
        found: Version,
        /// [`EXPECTED_VERSION`].
        expected: Version,
    },
    /// `nvshmemx_vendor_get_version_info` wrote a negative number.
    #[error("nvshmemx_vendor_get_version_info reported a negative version {major}.{minor}.{patch}")]
    BadVersion {
        /// Major part as reported.
        major: c_int,
        /// Minor part as reported.
        minor: c_int,
        /// Patch part as reported.
        patch: c_int,
    },
}

fn bullets(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| format!("  - {}", p.display()))
        .collect::<Vec<_>>()
        .join("\n")
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

/// Where a candidate came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// The file to try (for a pattern that matched nothing: the pattern, with `python3*`).
    pub path: PathBuf,
    /// Whether `path` is a concrete file path (false: an unmatched pattern, never opened).
    pub concrete: bool,
}

/// The places to search; [`LibrarySearch::from_env`] for the documented defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LibrarySearch {
    /// `$EPCOMM_NVSHMEM_LIB`: a directory holding the library, or the file.
    pub explicit: Option<PathBuf>,
    /// `$NVSHMEM_HOME`: an install prefix.
    pub nvshmem_home: Option<PathBuf>,
    /// Python `lib` directories and the packages folder inside each `python3*` under them,
    /// e.g. (`/opt/torch/.venv/lib`, `site-packages`).
    pub python_lib_dirs: Vec<(PathBuf, String)>,
    /// Plain directories holding pip's `nvidia/` (no `python3*` level).
    pub package_dirs: Vec<PathBuf>,
    /// Finally try the bare soname through the dynamic loader's search path.
    pub use_loader_path: bool,
}

fn non_empty(v: Option<OsString>) -> Option<PathBuf> {
    v.filter(|s| !s.is_empty()).map(PathBuf::from)
}

impl LibrarySearch {
    /// The documented search (see the module docs), reading `EPCOMM_NVSHMEM_LIB`,
    /// `NVSHMEM_HOME` and `VIRTUAL_ENV` from the environment (empty values are ignored).
    pub fn from_env() -> LibrarySearch {
        let mut python_lib_dirs = Vec::new();
        if let Some(venv) = non_empty(std::env::var_os("VIRTUAL_ENV")) {
            python_lib_dirs.push((venv.join("lib"), "site-packages".to_string()));
        }
        python_lib_dirs.push((
            PathBuf::from("/opt/torch/.venv/lib"),
            "site-packages".into(),
        ));
        python_lib_dirs.push((PathBuf::from("/usr/local/lib"), "dist-packages".into()));
        python_lib_dirs.push((PathBuf::from("/usr/local/lib"), "site-packages".into()));
        LibrarySearch {
            explicit: non_empty(std::env::var_os(ENV_EPCOMM_NVSHMEM_LIB)),
            nvshmem_home: non_empty(std::env::var_os(ENV_NVSHMEM_HOME)),
            python_lib_dirs,
            package_dirs: vec![PathBuf::from("/usr/lib/python3/dist-packages")],
            use_loader_path: true,
        }
    }

    /// Only the given places, no loader path: what tests and callers with a known location use.
    pub fn only(explicit: Option<PathBuf>, nvshmem_home: Option<PathBuf>) -> LibrarySearch {
        LibrarySearch {
            explicit,
            nvshmem_home,
            python_lib_dirs: Vec::new(),
            package_dirs: Vec::new(),
            use_loader_path: false,
        }
    }

    /// The file candidates, in search order (the loader-path soname is not included).
    pub fn candidates(&self) -> Vec<Candidate> {
        let mut out = Vec::new();
        let concrete = |path: PathBuf| Candidate {
            path,
            concrete: true,
        };
        if let Some(p) = &self.explicit {
            if p.is_dir() || p.file_name() != Some(OsStr::new(LIBRARY_NAME)) {
                out.push(concrete(p.join(LIBRARY_NAME)));
            } else {
                out.push(concrete(p.clone()));
            }
        }
        if let Some(home) = &self.nvshmem_home {
            out.push(concrete(home.join("lib").join(LIBRARY_NAME)));
        }
        let tail = Path::new("nvidia/nvshmem/lib").join(LIBRARY_NAME);
        for (lib_dir, packages) in &self.python_lib_dirs {
            let pythons = python_dirs(lib_dir);
            if pythons.is_empty() {
                out.push(Candidate {
                    path: lib_dir.join("python3*").join(packages).join(&tail),
                    concrete: false,
                });
            }
            for py in pythons {
                out.push(concrete(py.join(packages).join(&tail)));
            }
        }
        for dir in &self.package_dirs {
            out.push(concrete(dir.join(&tail)));
        }
        out
    }
}

/// The `python3*` directories directly under `lib_dir`, newest (`python3.N`, largest N) first.
fn python_dirs(lib_dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(lib_dir) else {
        return Vec::new();
    };
    let mut found: Vec<(u32, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name();
            let rest = name.to_str()?.strip_prefix("python3")?;
            let minor = match rest.strip_prefix('.') {
                Some(m) => m.parse().ok()?,
                None if rest.is_empty() => 0,
                None => return None,
            };
            e.path().is_dir().then(|| (minor, e.path()))
        })
        .collect();
    found.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
    found.into_iter().map(|(_, p)| p).collect()
}

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
    /// [`LoadError::VersionMismatch`].
    pub fn open(path: &Path) -> Result<Library, LoadError> {
        use libloading::os::unix::{RTLD_GLOBAL, RTLD_NOW};
        // SAFETY: loading runs the library's initialisers; libnvshmem_host's only register
        // internal state and need no GPU. The flags are valid dlopen flags.
        let raw = unsafe {
            libloading::os::unix::Library::open(Some(path.as_os_str()), RTLD_NOW | RTLD_GLOBAL)
        }
        .map_err(|source| LoadError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        // SAFETY: the symbols are looked up by the names of the NVSHMEM 3.4.5 declarations they
        // were generated from; the version check below rejects other releases before any call
        // whose signature could differ.
        let api = unsafe { sys::NvshmemHost::from_library(raw) }.map_err(|source| {
            LoadError::MissingSymbol {
                path: path.to_path_buf(),
                source,
            }
        })?;
        let (mut major, mut minor, mut patch) = (-1, -1, -1);
        // SAFETY: writes three ints through pointers to live locals; reports compile-time
        // constants, so it is callable before initialisation (checked against 3.4.5).
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

/// Searches the places of `search` in order and opens the first library found.
///
/// # Errors
/// [`LoadError::NotFound`] listing every place searched when nothing is found; the errors of
/// [`Library::open`] for the first candidate that exists.
pub fn load(search: &LibrarySearch) -> Result<Library, LoadError> {
    let mut searched = Vec::new();
    for c in search.candidates() {
        if c.concrete && c.path.is_file() {
            return Library::open(&c.path);
        }
        searched.push(c.path);
    }
    if search.use_loader_path {
        let soname = PathBuf::from(LIBRARY_NAME);
        match Library::open(&soname) {
            Err(LoadError::Open { .. }) => searched.push(soname),
            other => return other,
        }
    }
    Err(LoadError::NotFound {
        library: LIBRARY_NAME.to_string(),
        searched,
    })
}

/// [`load`] with [`LibrarySearch::from_env`].
///
/// # Errors
/// As [`load`].
pub fn load_default() -> Result<Library, LoadError> {
    load(&LibrarySearch::from_env())
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn not_found_lists_every_place_searched_in_order() {
        let dir = temp_dir("notfound");
        let search = LibrarySearch {
            explicit: Some(dir.join("explicit")),
            nvshmem_home: Some(dir.join("home")),
            python_lib_dirs: vec![(dir.join("venv/lib"), "site-packages".into())],
            package_dirs: vec![dir.join("dist")],
            use_loader_path: false,
        };
        std::fs::create_dir_all(dir.join("venv/lib/python3.12")).unwrap();
        std::fs::create_dir_all(dir.join("venv/lib/python3.9")).unwrap();
        std::fs::create_dir_all(dir.join("venv/lib/pythonista")).unwrap();
        let err = load(&search).unwrap_err();
        let LoadError::NotFound { library, searched } = &err else {
            panic!("expected NotFound, got {err:?}");
        };
        assert_eq!(library, LIBRARY_NAME);
        let tail = Path::new("site-packages/nvidia/nvshmem/lib").join(LIBRARY_NAME);
        assert_eq!(
            searched,
            &vec![
                dir.join("explicit").join(LIBRARY_NAME),
                dir.join("home/lib").join(LIBRARY_NAME),
                dir.join("venv/lib/python3.12").join(&tail),
                dir.join("venv/lib/python3.9").join(&tail),
                dir.join("dist/nvidia/nvshmem/lib").join(LIBRARY_NAME),
            ]
        );
        let msg = err.to_string();
        for p in searched {
            assert!(msg.contains(&p.display().to_string()), "{msg}");
        }
        assert!(msg.contains(ENV_EPCOMM_NVSHMEM_LIB) && msg.contains(ENV_NVSHMEM_HOME));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn unmatched_python_pattern_is_listed_as_the_pattern() {
        let dir = temp_dir("pattern");
        let search = LibrarySearch {
            python_lib_dirs: vec![(dir.join("nothing"), "dist-packages".into())],
            ..LibrarySearch::only(None, None)
        };
        let c = search.candidates();
        assert_eq!(c.len(), 1);
        assert!(!c[0].concrete);
        assert_eq!(
            c[0].path,
            dir.join("nothing/python3*/dist-packages/nvidia/nvshmem/lib")
                .join(LIBRARY_NAME)
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn explicit_may_name_the_file_itself() {
        let file = PathBuf::from("/x/y").join(LIBRARY_NAME);
        let c = LibrarySearch::only(Some(file.clone()), None).candidates();
        assert_eq!(c[0].path, file);
        let c = LibrarySearch::only(Some("/x/y".into()), None).candidates();
        assert_eq!(c[0].path, PathBuf::from("/x/y").join(LIBRARY_NAME));
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
        assert!(err.to_string().contains("dlopen("));
        let _ = std::fs::remove_dir_all(&dir);
    }

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

    #[test]
    fn python_dirs_sort_newest_first_and_skip_non_python() {
        let dir = temp_dir("pydirs");
        for d in [
            "python3.10",
            "python3.9",
            "python3",
            "python2.7",
            "python3.x",
        ] {
            std::fs::create_dir_all(dir.join(d)).unwrap();
        }
        std::fs::write(dir.join("python3.13"), b"a file").unwrap();
        let names: Vec<_> = python_dirs(&dir)
            .into_iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["python3.10", "python3.9", "python3"]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
