//! The places to search and their order (steps 1 to 6 of the module docs of
//! [`crate::loader`]). Pure: computing the candidates reads no file and runs nothing.

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::fmt;
use std::path::{Path, PathBuf};

use super::{
    ENV_EPCOMM_NVSHMEM_LIB, ENV_LD_LIBRARY_PATH, ENV_NVSHMEM_HOME, LIBRARY_NAME, PYTHON,
    PYTHON_TIMEOUT, Searched, SitePackages, WHEEL_LIB_DIR,
};

/// Which step of the search order a place belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Origin {
    /// Step 0: the copy already loaded into this process (by PyTorch, say), found by soname
    /// without loading anything.
    Loaded,
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
            Origin::Loaded => "already loaded in this process",
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

/// The places to search (see the [`crate::loader`] docs); [`LibrarySearch::from_env`] for the
/// default.
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
pub(super) enum Step {
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

impl LibrarySearch {
    /// The documented search (see the [`crate::loader`] docs) for the given variables:
    /// `var(name)` is the value of environment variable `name` (`EPCOMM_NVSHMEM_LIB`,
    /// `NVSHMEM_HOME`, `LD_LIBRARY_PATH`); empty values count as unset. Reads nothing else and
    /// runs nothing: step 5 is [`SitePackages::Ask`] `python3`.
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
    /// (e.g. [`parse_site_packages`](super::parse_site_packages) of `python3`'s answer;
    /// `self.site_packages` is not consulted). A path that comes up twice is tried once, at its
    /// first place. Pure: reads nothing and runs nothing.
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
    pub(super) fn head(&self) -> Vec<Step> {
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
    pub(super) fn tail(&self) -> Vec<Step> {
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
pub(super) fn site_steps(site_packages: &[PathBuf]) -> Vec<Step> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loader::parse_site_packages;

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
}
