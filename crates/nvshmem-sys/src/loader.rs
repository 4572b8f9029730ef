//! Finding and `dlopen`ing `libnvshmem_host.so.3`, and checking its release.
//!
//! [`load_default`] looks in these places, in this order. The first file that exists is opened
//! (if it then fails to load, that error is returned and the search stops); a place without the
//! file is skipped:
//!
//! 1. `$EPCOMM_NVSHMEM_LIB`: the directory holding the library, or the library file itself (a
//!    last path component that starts with `libnvshmem_host.so` names the file);
//! 2. `$NVSHMEM_HOME/lib`: an NVSHMEM install prefix;
//! 3. the bare soname `libnvshmem_host.so.3`, through the system's dynamic loader, which honours
//!    `LD_LIBRARY_PATH` (as it was when the process started), `ld.so.cache` (`ldconfig`) and
//!    the default library directories;
//! 4. every `$LD_LIBRARY_PATH` entry, read now: the error then names each of them, and a value
//!    set after the process started counts too;
//! 5. `<dir>/nvidia/nvshmem/lib`, for every `<dir>` that `python3` (found on `PATH`) reports as
//!    a site-packages directory: `site.getsitepackages()` and `site.getusersitepackages()`,
//!    which is where `python3 -m pip install nvidia-nvshmem-cu13==3.4.5` puts the library (the
//!    active virtual environment's directories when one is active). `python3` is only asked
//!    when steps 1–4 found nothing, and gets [`PYTHON_TIMEOUT`] to answer; a missing, failing
//!    or slow `python3` only skips this step;
//! 6. the pinned CUDA toolchain that `cargo xtask build-kernels` installs into the workspace
//!    this crate was compiled in (`<workspace>/target/cuda-toolchain/nvidia/nvshmem/lib`; only
//!    when the crate was built from the workspace's `crates/nvshmem-sys`).
//!
//! Empty variables count as unset. The search is computed by [`LibrarySearch::from_vars`] and
//! [`LibrarySearch::candidates`], which read nothing themselves, so the order is testable
//! without NVSHMEM. When nothing is found, [`LoadError::NotFound`] lists every place tried, in
//! order, with why each was not used, and says how to point at the library.
//!
//! The library is opened with `RTLD_NOW | RTLD_GLOBAL`: the bootstrap and transport plugins
//! NVSHMEM itself `dlopen`s resolve host-library symbols globally.

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::fmt;
use std::io::Read;
use std::os::raw::c_int;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::sys;

/// The soname looked for.
pub const LIBRARY_NAME: &str = "libnvshmem_host.so.3";

/// The release the bindings were generated from; a loaded library must match its major.minor.
pub const EXPECTED_VERSION: Version = Version {
    major: sys::NVSHMEM_VENDOR_MAJOR_VERSION,
    minor: sys::NVSHMEM_VENDOR_MINOR_VERSION,
    patch: sys::NVSHMEM_VENDOR_PATCH_VERSION,
};

/// Environment variable (step 1): directory holding the library, or the library file.
pub const ENV_EPCOMM_NVSHMEM_LIB: &str = "EPCOMM_NVSHMEM_LIB";
/// Environment variable (step 2): NVSHMEM install prefix (the library is in its `lib/`).
pub const ENV_NVSHMEM_HOME: &str = "NVSHMEM_HOME";
/// Environment variable (steps 3 and 4): the dynamic loader's extra directories.
pub const ENV_LD_LIBRARY_PATH: &str = "LD_LIBRARY_PATH";
/// The Python interpreter asked for its site-packages directories (step 5).
pub const PYTHON: &str = "python3";
/// How long `python3` may take to print its site-packages directories.
pub const PYTHON_TIMEOUT: Duration = Duration::from_secs(3);
/// The code run as `python3 -c`: prints one site-packages directory per line.
pub const PYTHON_SITE_QUERY: &str =
    "import site, sys; print('\\n'.join(site.getsitepackages() + [site.getusersitepackages()]))";
/// Where pip's `nvidia-nvshmem-cu13` wheel puts the library, relative to a site-packages
/// directory (and to the root of the workspace's pinned toolchain).
pub const WHEEL_LIB_DIR: &str = "nvidia/nvshmem/lib";

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
    /// No place of the search has the library.
    #[error(
        "{library} (the NVSHMEM {}.{} host library) was not found. Searched, in order:\n{}\n{}",
        EXPECTED_VERSION.major,
        EXPECTED_VERSION.minor,
        bullets(searched),
        how_to_point()
    )]
    NotFound {
        /// The soname looked for.
        library: String,
        /// Every place looked at, in search order, with why it was not used.
        searched: Vec<Searched>,
    },
    /// A candidate file exists but `dlopen` refused it.
    #[error("dlopen({}) failed: {}", path.display(), dl_message(source))]
    Open {
        /// The file.
        path: PathBuf,
        /// The loader's error.
        source: libloading::Error,
    },
    /// The library lacks a symbol the bindings need (not NVSHMEM 3.4's host library?).
    #[error(
        "{} lacks a symbol the NVSHMEM {EXPECTED_VERSION} bindings need: {}",
        path.display(),
        dl_message(source)
    )]
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

/// The dynamic loader's own message (`dlerror`), which libloading keeps as the error's source.
fn dl_message(e: &libloading::Error) -> String {
    match std::error::Error::source(e) {
        Some(inner) => inner.to_string(),
        None => e.to_string(),
    }
}

fn bullets(searched: &[Searched]) -> String {
    searched
        .iter()
        .map(|s| format!("  - {s}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The end of [`LoadError::NotFound`]'s message: the ways to point at the library.
fn how_to_point() -> String {
    format!(
        "Point at the library with one of:\n  \
         - {ENV_EPCOMM_NVSHMEM_LIB}=<the directory holding {LIBRARY_NAME}> (or the file itself)\n  \
         - {ENV_NVSHMEM_HOME}=<the NVSHMEM install prefix, whose lib/ holds it>\n  \
         - {ENV_LD_LIBRARY_PATH}=<the directory holding it>:${ENV_LD_LIBRARY_PATH}, or register \
         that directory with ldconfig\n\
         or install it where {PYTHON} finds it: {PYTHON} -m pip install \
         nvidia-nvshmem-cu13=={EXPECTED_VERSION} (`cargo xtask build-kernels` also installs it, \
         into the workspace's target/cuda-toolchain)"
    )
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

/// Which step of the search order a place belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Origin {
    /// Step 1: `$EPCOMM_NVSHMEM_LIB`.
    Explicit,
    /// Step 2: `$NVSHMEM_HOME/lib`.
    NvshmemHome,
    /// Step 3: the bare soname, through the system's dynamic loader.
    SystemLoader,
    /// Step 4: an entry of `$LD_LIBRARY_PATH`.
    LdLibraryPath,
    /// Step 5: a site-packages directory of `python3`.
    PythonSitePackages,
    /// Step 6: the pinned CUDA toolchain of the workspace the crate was compiled in.
    WorkspaceToolchain,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Origin::Explicit => "$EPCOMM_NVSHMEM_LIB",
            Origin::NvshmemHome => "$NVSHMEM_HOME/lib",
            Origin::SystemLoader => {
                "system dynamic loader (LD_LIBRARY_PATH at process start, ld.so.cache, default \
                 directories)"
            }
            Origin::LdLibraryPath => "$LD_LIBRARY_PATH entry",
            Origin::PythonSitePackages => "python3 site-packages",
            Origin::WorkspaceToolchain => "workspace CUDA toolchain (cargo xtask build-kernels)",
        })
    }
}

/// One place to try: a file, or (for [`Origin::SystemLoader`]) the bare soname.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// The step it comes from.
    pub origin: Origin,
    /// The file to open, or the bare soname [`LIBRARY_NAME`] for the dynamic loader's search.
    pub path: PathBuf,
}

/// One line of [`LoadError::NotFound`]: a place looked at and why it was not used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Searched {
    /// The step.
    pub origin: Origin,
    /// The file (or bare soname) tried; `None` when the step had nothing to try (a variable not
    /// set, `python3` not answering).
    pub path: Option<PathBuf>,
    /// Why it was not used: `no such file`, the dynamic loader's error, `not set`, ….
    pub outcome: String,
}

impl fmt::Display for Searched {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.path {
            Some(path) => write!(f, "{}: {} ({})", self.origin, path.display(), self.outcome),
            None => write!(f, "{}: {}", self.origin, self.outcome),
        }
    }
}

/// Where step 5 gets its site-packages directories from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SitePackages {
    /// Run `python -c` [`PYTHON_SITE_QUERY`], waiting at most `timeout`; only done when the
    /// earlier steps found nothing.
    Ask {
        /// The interpreter, looked up on `PATH` unless it has a `/`.
        python: OsString,
        /// How long it may take.
        timeout: Duration,
    },
    /// These directories (for callers and tests that know them).
    Known(Vec<PathBuf>),
    /// Skip step 5.
    Skip,
}

/// The places to search (see the module docs); [`LibrarySearch::from_env`] for the default.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LibrarySearch {
    /// Step 1, `$EPCOMM_NVSHMEM_LIB`: a directory holding the library, or the file.
    pub explicit: Option<PathBuf>,
    /// Step 2, `$NVSHMEM_HOME`: an install prefix.
    pub nvshmem_home: Option<PathBuf>,
    /// Step 3: try the bare soname through the system's dynamic loader.
    pub system_loader: bool,
    /// Step 4: the `$LD_LIBRARY_PATH` entries (empty entries left out).
    pub ld_library_path: Vec<PathBuf>,
    /// Step 5: the site-packages directories, or how to get them.
    pub site_packages: SitePackages,
    /// Step 6: the directory of the workspace's pinned toolchain holding the library.
    pub workspace_toolchain: Option<PathBuf>,
}

/// One entry of a step: a place to try, or a note on why the step has nothing to try.
enum Step {
    Try(Candidate),
    Note(Searched),
}

/// The library file a `$EPCOMM_NVSHMEM_LIB` value means: the value itself when its last
/// component starts with `libnvshmem_host.so`, else the library inside that directory.
fn explicit_file(value: &Path) -> PathBuf {
    let names_the_file = value
        .file_name()
        .and_then(OsStr::to_str)
        .is_some_and(|name| name.starts_with("libnvshmem_host.so"));
    if names_the_file {
        value.to_path_buf()
    } else {
        value.join(LIBRARY_NAME)
    }
}

/// `<workspace>/target/cuda-toolchain/nvidia/nvshmem/lib` when this crate was compiled from a
/// workspace's `crates/nvshmem-sys` (as `cargo xtask` lays it out), else `None`.
pub fn workspace_toolchain_lib() -> Option<PathBuf> {
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let crates = manifest_dir.parent()?;
    if crates.file_name()? != "crates" {
        return None;
    }
    Some(
        crates
            .parent()?
            .join("target/cuda-toolchain")
            .join(WHEEL_LIB_DIR),
    )
}

/// The site-packages directories in `python3 -c` [`PYTHON_SITE_QUERY`]'s output: one per
/// non-blank line.
pub fn parse_site_packages(output: &str) -> Vec<PathBuf> {
    output
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .map(PathBuf::from)
        .collect()
}

/// Asks `python` for its site-packages directories (`python -c` [`PYTHON_SITE_QUERY`]),
/// waiting at most `timeout`.
///
/// # Errors
/// Why there is no answer: the interpreter could not be started, did not finish in time (it is
/// then killed), exited unsuccessfully, or printed something that is not UTF-8.
pub fn python_site_packages(python: &OsStr, timeout: Duration) -> Result<Vec<PathBuf>, String> {
    let mut cmd = Command::new(python);
    cmd.arg("-c").arg(PYTHON_SITE_QUERY);
    run_with_timeout(cmd, timeout).map(|out| parse_site_packages(&out))
}

/// Runs `cmd` (stdin and stderr to /dev/null) and returns its standard output, killing it when
/// it takes longer than `timeout`.
fn run_with_timeout(mut cmd: Command, timeout: Duration) -> Result<String, String> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut child = cmd.spawn().map_err(|e| e.to_string())?;
    let Some(mut stdout) = child.stdout.take() else {
        let _ = child.kill();
        let _ = child.wait();
        return Err("no standard output".to_string());
    };
    // A thread drains the pipe, so neither a full pipe nor a process that leaves a child
    // holding it open can block the caller beyond `timeout`.
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        let read = stdout.read_to_end(&mut bytes).map(|_| bytes);
        let _ = tx.send(read);
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("no answer within {} ms", timeout.as_millis()));
            }
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(e.to_string());
            }
        }
    };
    if !status.success() {
        return Err(format!("exited with {status}"));
    }
    let left = deadline.saturating_duration_since(Instant::now());
    match rx.recv_timeout(left.max(Duration::from_millis(100))) {
        Ok(Ok(bytes)) => String::from_utf8(bytes).map_err(|_| "printed non-UTF-8 output".into()),
        Ok(Err(e)) => Err(format!("reading its output: {e}")),
        Err(_) => Err("its output did not end".to_string()),
    }
}

impl LibrarySearch {
    /// The documented search (see the module docs) for the given variables: `var(name)` is
    /// the value of environment variable `name` (`EPCOMM_NVSHMEM_LIB`, `NVSHMEM_HOME`,
    /// `LD_LIBRARY_PATH`); empty values count as unset. Reads nothing else and runs nothing:
    /// step 5 is [`SitePackages::Ask`] `python3`.
    pub fn from_vars(var: impl Fn(&str) -> Option<OsString>) -> LibrarySearch {
        let path = |name: &str| var(name).filter(|v| !v.is_empty()).map(PathBuf::from);
        let ld_library_path = var(ENV_LD_LIBRARY_PATH)
            .map(|v| {
                std::env::split_paths(&v)
                    .filter(|p| !p.as_os_str().is_empty())
                    .collect()
            })
            .unwrap_or_default();
        LibrarySearch {
            explicit: path(ENV_EPCOMM_NVSHMEM_LIB),
            nvshmem_home: path(ENV_NVSHMEM_HOME),
            system_loader: true,
            ld_library_path,
            site_packages: SitePackages::Ask {
                python: PYTHON.into(),
                timeout: PYTHON_TIMEOUT,
            },
            workspace_toolchain: workspace_toolchain_lib(),
        }
    }

    /// [`LibrarySearch::from_vars`] with the process environment.
    pub fn from_env() -> LibrarySearch {
        LibrarySearch::from_vars(|name| std::env::var_os(name))
    }

    /// Only the given places (steps 1 and 2): what tests and callers with a known location use.
    pub fn only(explicit: Option<PathBuf>, nvshmem_home: Option<PathBuf>) -> LibrarySearch {
        LibrarySearch {
            explicit,
            nvshmem_home,
            system_loader: false,
            ld_library_path: Vec::new(),
            site_packages: SitePackages::Skip,
            workspace_toolchain: None,
        }
    }

    /// Every place to try, in search order, given the site-packages directories of step 5
    /// (e.g. [`parse_site_packages`] of `python3`'s answer; `self.site_packages` is not
    /// consulted). A path that comes up twice is tried once, at its first place. Pure: reads
    /// nothing and runs nothing.
    pub fn candidates(&self, site_packages: &[PathBuf]) -> Vec<Candidate> {
        let mut seen = HashSet::new();
        [self.head(), site_steps(site_packages), self.tail()]
            .into_iter()
            .flatten()
            .filter_map(|step| match step {
                Step::Try(c) => seen.insert(c.path.clone()).then_some(c),
                Step::Note(_) => None,
            })
            .collect()
    }

    /// Steps 1 to 4.
    fn head(&self) -> Vec<Step> {
        let mut out = Vec::new();
        let not_set = |origin| {
            Step::Note(Searched {
                origin,
                path: None,
                outcome: "not set".to_string(),
            })
        };
        out.push(match &self.explicit {
            Some(value) => Step::Try(Candidate {
                origin: Origin::Explicit,
                path: explicit_file(value),
            }),
            None => not_set(Origin::Explicit),
        });
        out.push(match &self.nvshmem_home {
            Some(home) => Step::Try(Candidate {
                origin: Origin::NvshmemHome,
                path: home.join("lib").join(LIBRARY_NAME),
            }),
            None => not_set(Origin::NvshmemHome),
        });
        if self.system_loader {
            out.push(Step::Try(Candidate {
                origin: Origin::SystemLoader,
                path: PathBuf::from(LIBRARY_NAME),
            }));
        }
        out.extend(self.ld_library_path.iter().map(|dir| {
            Step::Try(Candidate {
                origin: Origin::LdLibraryPath,
                path: dir.join(LIBRARY_NAME),
            })
        }));
        out
    }

    /// Step 6.
    fn tail(&self) -> Vec<Step> {
        self.workspace_toolchain
            .iter()
            .map(|dir| {
                Step::Try(Candidate {
                    origin: Origin::WorkspaceToolchain,
                    path: dir.join(LIBRARY_NAME),
                })
            })
            .collect()
    }
}

/// Step 5 for the given site-packages directories.
fn site_steps(site_packages: &[PathBuf]) -> Vec<Step> {
    site_packages
        .iter()
        .map(|dir| {
            Step::Try(Candidate {
                origin: Origin::PythonSitePackages,
                path: dir.join(WHEEL_LIB_DIR).join(LIBRARY_NAME),
            })
        })
        .collect()
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

/// Searches the places of `search` in order (see the module docs) and opens the first library
/// found. `python3` is run (step 5, [`SitePackages::Ask`]) only when steps 1 to 4 found nothing.
///
/// # Errors
/// [`LoadError::NotFound`] listing every place searched when nothing is found; the errors of
/// [`Library::open`] for the first candidate that exists.
pub fn load(search: &LibrarySearch) -> Result<Library, LoadError> {
    let mut seen = HashSet::new();
    let mut searched = Vec::new();
    if let Some(lib) = try_steps(search.head(), &mut seen, &mut searched)? {
        return Ok(lib);
    }
    let site = match &search.site_packages {
        SitePackages::Ask { python, timeout } => match python_site_packages(python, *timeout) {
            Ok(dirs) => {
                if dirs.is_empty() {
                    searched.push(Searched {
                        origin: Origin::PythonSitePackages,
                        path: None,
                        outcome: format!("{} reported none", python.to_string_lossy()),
                    });
                }
                dirs
            }
            Err(why) => {
                searched.push(Searched {
                    origin: Origin::PythonSitePackages,
                    path: None,
                    outcome: format!("could not ask {}: {why}", python.to_string_lossy()),
                });
                Vec::new()
            }
        },
        SitePackages::Known(dirs) => dirs.clone(),
        SitePackages::Skip => Vec::new(),
    };
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

/// [`load`] with [`LibrarySearch::from_env`]: the search order of the module docs.
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

    /// A `var` lookup over fixed pairs.
    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| OsString::from(v))
        }
    }

    fn lib(dir: &str) -> PathBuf {
        Path::new(dir).join(LIBRARY_NAME)
    }

    fn listed(c: &[Candidate]) -> Vec<(Origin, PathBuf)> {
        c.iter().map(|c| (c.origin, c.path.clone())).collect()
    }

    #[test]
    fn candidate_order_with_every_variable_set() {
        let search = LibrarySearch::from_vars(vars(&[
            ("EPCOMM_NVSHMEM_LIB", "/explicit"),
            ("NVSHMEM_HOME", "/home-prefix"),
            ("LD_LIBRARY_PATH", "/ld/a::/ld/b:/home-prefix/lib"),
            ("VIRTUAL_ENV", "/not/consulted"),
        ]));
        assert_eq!(
            search.site_packages,
            SitePackages::Ask {
                python: "python3".into(),
                timeout: PYTHON_TIMEOUT
            }
        );
        let site = parse_site_packages(
            "/venv/lib/python3.12/site-packages\n\n/root/.local/lib/python3.12/site-packages\n",
        );
        let mut want = vec![
            (Origin::Explicit, lib("/explicit")),
            (Origin::NvshmemHome, lib("/home-prefix/lib")),
            (Origin::SystemLoader, PathBuf::from(LIBRARY_NAME)),
            (Origin::LdLibraryPath, lib("/ld/a")),
            (Origin::LdLibraryPath, lib("/ld/b")),
            // "/home-prefix/lib" again: already tried as $NVSHMEM_HOME/lib.
            (
                Origin::PythonSitePackages,
                lib("/venv/lib/python3.12/site-packages/nvidia/nvshmem/lib"),
            ),
            (
                Origin::PythonSitePackages,
                lib("/root/.local/lib/python3.12/site-packages/nvidia/nvshmem/lib"),
            ),
        ];
        if let Some(ws) = workspace_toolchain_lib() {
            want.push((Origin::WorkspaceToolchain, ws.join(LIBRARY_NAME)));
        }
        assert_eq!(listed(&search.candidates(&site)), want);
    }

    #[test]
    fn unset_and_empty_variables_leave_the_loader_python_and_workspace() {
        for env in [
            vars(&[]),
            vars(&[
                ("EPCOMM_NVSHMEM_LIB", ""),
                ("NVSHMEM_HOME", ""),
                ("LD_LIBRARY_PATH", ""),
            ]),
        ] {
            let search = LibrarySearch::from_vars(env);
            assert_eq!(search.explicit, None);
            assert_eq!(search.nvshmem_home, None);
            assert!(search.ld_library_path.is_empty());
            let mut want = vec![
                (Origin::SystemLoader, PathBuf::from(LIBRARY_NAME)),
                (
                    Origin::PythonSitePackages,
                    lib("/usr/lib/python3/dist-packages/nvidia/nvshmem/lib"),
                ),
            ];
            if let Some(ws) = workspace_toolchain_lib() {
                want.push((Origin::WorkspaceToolchain, ws.join(LIBRARY_NAME)));
            }
            let site = [PathBuf::from("/usr/lib/python3/dist-packages")];
            assert_eq!(listed(&search.candidates(&site)), want);
            // No python answer: step 5 adds nothing.
            want.remove(1);
            assert_eq!(listed(&search.candidates(&[])), want);
        }
    }

    #[test]
    fn no_fixed_directory_is_searched() {
        // Everything searched comes from a variable, python3's answer, the soname or the
        // workspace the crate was compiled in: nothing machine-specific.
        let c = LibrarySearch::from_vars(vars(&[])).candidates(&[]);
        for cand in &c {
            match cand.origin {
                Origin::SystemLoader => assert_eq!(cand.path, Path::new(LIBRARY_NAME)),
                Origin::WorkspaceToolchain => {
                    let root = Path::new(env!("CARGO_MANIFEST_DIR")).ancestors().nth(2);
                    assert!(cand.path.starts_with(root.unwrap()), "{cand:?}");
                }
                other => panic!("unexpected {other:?} without variables: {cand:?}"),
            }
        }
    }

    #[test]
    fn workspace_toolchain_is_this_workspaces_target() {
        // This crate is compiled from <workspace>/crates/nvshmem-sys.
        let ws = workspace_toolchain_lib().expect("built inside the workspace");
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .unwrap()
            .parent()
            .unwrap();
        assert_eq!(ws, root.join("target/cuda-toolchain/nvidia/nvshmem/lib"));
    }

    #[test]
    fn explicit_may_name_the_file_itself() {
        let c = LibrarySearch::only(Some(lib("/x/y")), None).candidates(&[]);
        assert_eq!(c[0].path, lib("/x/y"));
        let c = LibrarySearch::only(Some("/x/y/libnvshmem_host.so".into()), None).candidates(&[]);
        assert_eq!(c[0].path, PathBuf::from("/x/y/libnvshmem_host.so"));
        let c = LibrarySearch::only(Some("/x/y".into()), None).candidates(&[]);
        assert_eq!(c[0].path, lib("/x/y"));
        assert_eq!(c.len(), 1);
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
        assert_eq!(tried, listed(&candidates));
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

    #[test]
    fn site_packages_output_is_one_directory_per_line() {
        assert_eq!(
            parse_site_packages("/a/site-packages\r\n  \n/b/dist-packages\n"),
            [
                PathBuf::from("/a/site-packages"),
                PathBuf::from("/b/dist-packages")
            ]
        );
        assert!(parse_site_packages("").is_empty());
    }

    fn sh(script: &str) -> Command {
        let mut cmd = Command::new("sh");
        cmd.arg("-c").arg(script);
        cmd
    }

    #[test]
    fn asking_a_program_is_bounded_and_failures_are_reported() {
        let out = run_with_timeout(sh("printf '/a\\n/b\\n'"), Duration::from_secs(5)).unwrap();
        assert_eq!(
            parse_site_packages(&out),
            [Path::new("/a"), Path::new("/b")]
        );
        let err = run_with_timeout(sh("exit 3"), Duration::from_secs(5)).unwrap_err();
        assert!(err.contains("exited"), "{err}");
        let start = Instant::now();
        let err = run_with_timeout(sh("exec sleep 5"), Duration::from_millis(200)).unwrap_err();
        assert!(err.contains("no answer within 200 ms"), "{err}");
        assert!(start.elapsed() < Duration::from_secs(10));
        let err =
            python_site_packages(OsStr::new("/nonexistent/python3"), PYTHON_TIMEOUT).unwrap_err();
        assert!(!err.is_empty());
    }

    #[test]
    fn python3_answers_with_absolute_directories_when_present() {
        match python_site_packages(OsStr::new(PYTHON), Duration::from_secs(20)) {
            Ok(dirs) => {
                assert!(!dirs.is_empty());
                assert!(dirs.iter().all(|d| d.is_absolute()), "{dirs:?}");
            }
            Err(why) => eprintln!("python3 not usable here ({why}); nothing to check"),
        }
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
}
