//! The places to search for `libibverbs.so.1` and their order (see the [`super`] docs). Pure:
//! computing the candidates reads no file.

use std::ffi::{OsStr, OsString};
use std::fmt;
use std::path::{Path, PathBuf};

use super::{ENV_EPCOMM_IBVERBS_LIB, LIBRARY_NAME};

/// Which step of the search a place belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Origin {
    /// Step 1: `$EPCOMM_IBVERBS_LIB`.
    Explicit,
    /// Step 2: the bare soname, through the system's dynamic loader.
    SystemLoader,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Origin::Explicit => "$EPCOMM_IBVERBS_LIB",
            Origin::SystemLoader => {
                "system dynamic loader (LD_LIBRARY_PATH at process start, ld.so.cache, default \
                 directories)"
            }
        })
    }
}

/// One place to try.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// The step.
    pub origin: Origin,
    /// The file, or the bare soname for [`Origin::SystemLoader`].
    pub path: PathBuf,
}

/// The places to search; [`LibrarySearch::from_env`] for the default.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LibrarySearch {
    /// Step 1: the library file, or a directory holding it.
    pub explicit: Option<PathBuf>,
    /// Step 2: ask the system's dynamic loader for the soname.
    pub system_loader: bool,
}

impl LibrarySearch {
    /// The documented search for the given variables (`var(name)` is the value of `name`;
    /// empty counts as unset). Reads nothing else.
    pub fn from_vars(var: impl Fn(&str) -> Option<OsString>) -> LibrarySearch {
        LibrarySearch {
            explicit: var(ENV_EPCOMM_IBVERBS_LIB)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from),
            system_loader: true,
        }
    }

    /// [`LibrarySearch::from_vars`] over the process environment.
    pub fn from_env() -> LibrarySearch {
        LibrarySearch::from_vars(|name| std::env::var_os(name))
    }

    /// Only `path` (a file or a directory holding the library): what tests and callers with a
    /// known location use.
    pub fn only(path: impl Into<PathBuf>) -> LibrarySearch {
        LibrarySearch {
            explicit: Some(path.into()),
            system_loader: false,
        }
    }

    /// The places to try, in order.
    pub fn candidates(&self) -> Vec<Candidate> {
        let mut out = Vec::new();
        if let Some(value) = &self.explicit {
            out.push(Candidate {
                origin: Origin::Explicit,
                path: explicit_file(value),
            });
        }
        if self.system_loader {
            out.push(Candidate {
                origin: Origin::SystemLoader,
                path: PathBuf::from(LIBRARY_NAME),
            });
        }
        out
    }
}

/// The file a `$EPCOMM_IBVERBS_LIB` value means: itself when its last component starts with
/// `libibverbs.so`, else the library inside that directory.
fn explicit_file(value: &Path) -> PathBuf {
    let names_the_file = value
        .file_name()
        .and_then(OsStr::to_str)
        .is_some_and(|name| name.starts_with("libibverbs.so"));
    if names_the_file {
        value.to_path_buf()
    } else {
        value.join(LIBRARY_NAME)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_and_the_meaning_of_the_variable() {
        let search = LibrarySearch::from_vars(|name| {
            (name == ENV_EPCOMM_IBVERBS_LIB).then(|| OsString::from("/opt/rdma/lib"))
        });
        assert_eq!(
            search.candidates(),
            vec![
                Candidate {
                    origin: Origin::Explicit,
                    path: PathBuf::from("/opt/rdma/lib/libibverbs.so.1"),
                },
                Candidate {
                    origin: Origin::SystemLoader,
                    path: PathBuf::from(LIBRARY_NAME),
                },
            ]
        );
        let file = LibrarySearch::only("/x/libibverbs.so.1.14.44.0");
        assert_eq!(
            file.candidates(),
            vec![Candidate {
                origin: Origin::Explicit,
                path: PathBuf::from("/x/libibverbs.so.1.14.44.0"),
            }]
        );
        let unset = LibrarySearch::from_vars(|_| Some(OsString::new()));
        assert_eq!(unset.candidates().len(), 1);
        assert_eq!(unset.explicit, None);
    }
}
