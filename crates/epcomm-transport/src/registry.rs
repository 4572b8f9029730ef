//! The backend table: what one backend crate exports so that a spec string (`nvshmem:vnodes=2`)
//! can name it, tools can describe it and check a machine for it, and the frontend can build it,
//! without any crate above naming the backend.
//!
//! A backend crate exports one `const` [`Backend`] per transport it implements (its name, the
//! options it reads, its [`Capabilities`] and [`Limits`], and four functions: world layout,
//! probe, preflight, build). `epcomm-backends` lists the entries of the backends compiled in
//! (one line and one cargo feature per backend) and parses specs against that list. The table
//! is versioned like a plugin ABI: an entry built against another [`REGISTRY_VERSION`] is
//! refused when the list is read (`Backend::check_version`).
//!
//! Contract of every entry's functions: `world_layout` and `probe` need no GPU and no other
//! rank; `preflight` is collective over the bootstrap (every rank calls it with the same
//! options) and touches no GPU; `build` is collective and returns the transport the frontend
//! holds. `options` are always ones this entry's [`Backend::parse_options`] produced.

use std::fmt::{self, Write as _};
use std::sync::Arc;

use cudarc::driver::CudaContext;

use crate::{Bootstrap, Capabilities, DynTransport, TransportError, WorldLayout};

/// The version of the [`Backend`] table layout; bumped whenever a field or a function's
/// contract changes.
pub const REGISTRY_VERSION: u32 = 2;

/// How many logical nodes each host's GPUs are split into.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum VirtualNodes {
    /// This many per host (1 = no split).
    Count(usize),
    /// One per GPU: every peer is in another logical node.
    OnePerGpu,
}

impl VirtualNodes {
    /// The count for hosts of `gpus_per_host` GPUs.
    pub fn per_host(self, gpus_per_host: usize) -> usize {
        match self {
            Self::Count(n) => n,
            Self::OnePerGpu => gpus_per_host,
        }
    }
}

impl fmt::Display for VirtualNodes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Count(n) => write!(f, "{n}"),
            Self::OnePerGpu => f.write_str("max"),
        }
    }
}

/// The options a spec carries after the backend's name. Backends that take none see the
/// schema's default.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BackendOptions {
    /// Logical nodes per host (`vnodes=N`, `vnodes=max`).
    pub virtual_nodes: VirtualNodes,
}

/// Which options a backend reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptionSchema {
    /// None: the spec is the bare name.
    None,
    /// `vnodes=N` or `vnodes=max`, `default` when absent.
    VirtualNodes {
        /// The split when the spec names none.
        default: VirtualNodes,
    },
}

impl OptionSchema {
    /// The options of a spec without any.
    pub const fn defaults(self) -> BackendOptions {
        match self {
            Self::None => BackendOptions {
                virtual_nodes: VirtualNodes::Count(1),
            },
            Self::VirtualNodes { default } => BackendOptions {
                virtual_nodes: default,
            },
        }
    }
}

/// What bounds a backend's use, reported with its entry (no GPU needed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Whether the ranks may span hosts (`false`: every rank on one host).
    pub spans_hosts: bool,
    /// The CPU executor that moves the bytes of put/signal routes, when the backend has one.
    pub executor: Option<ExecutorLimits>,
}

/// The bounds of a backend's CPU executor (the proxy thread and its ring).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExecutorLimits {
    /// What moves the bytes (`"copy engines"`, `"RDMA writes"`).
    pub moves_by: &'static str,
    /// Ring slots by default (descriptors the kernels may write ahead of the executor).
    pub ring_slots: u64,
    /// The largest ring a run may ask for.
    pub max_ring_slots: u64,
    /// Transfers outstanding by default before the executor stops taking descriptors.
    pub max_in_flight: usize,
    /// The environment variables that tune it.
    pub env: &'static [&'static str],
}

/// Builds the transport of this rank (collective).
pub type BuildFn = fn(
    BackendOptions,
    Arc<CudaContext>,
    Arc<Bootstrap>,
) -> Result<Arc<dyn DynTransport>, TransportError>;

/// A shared library a backend loads at run time ([`Backend::runtime_library`]).
#[derive(Clone, Copy, Debug)]
pub struct RuntimeLibrary {
    /// Its soname (`"libnvshmem_host.so.3"`).
    pub name: &'static str,
    /// Finds and loads it as the backend will (no GPU needed): the file and its version, or
    /// [`TransportError::Unavailable`] naming every place that was tried.
    pub locate: fn() -> Result<LocatedLibrary, TransportError>,
}

/// Where [`RuntimeLibrary::locate`] found a library.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocatedLibrary {
    /// The file it was loaded from, as the dynamic loader was given it (a bare soname when
    /// the system's search found it).
    pub path: String,
    /// The version it reports.
    pub version: String,
    /// Where it is looked for, in order, and how to choose a file.
    pub search: String,
}

/// One backend's entry in the table (see the module docs for the functions' contract).
#[derive(Clone, Copy, Debug)]
pub struct Backend {
    /// [`REGISTRY_VERSION`] at the time the entry was written.
    pub version: u32,
    /// The name a spec starts with (`"ipc"`).
    pub name: &'static str,
    /// Other names accepted for it.
    pub aliases: &'static [&'static str],
    /// The spec forms, for help texts (`"nvshmem:vnodes=N"`).
    pub forms: &'static [&'static str],
    /// The options it reads.
    pub options: OptionSchema,
    /// What it supports.
    pub capabilities: Capabilities,
    /// What bounds it.
    pub limits: Limits,
    /// The shared library it loads when built, which a machine may lack (NVSHMEM's host
    /// library): a tool looks for it before it starts any rank ([`RuntimeLibrary::locate`]).
    pub runtime_library: Option<RuntimeLibrary>,
    /// Whether it needs an RDMA device with an active port (and libibverbs).
    pub needs_rdma_device: bool,
    /// The world layout a transport of these options sees for `(world_size, rank,
    /// local_world_size)` (no GPU needed).
    pub world_layout:
        fn(BackendOptions, usize, usize, usize) -> Result<WorldLayout, TransportError>,
    /// This machine's check, before any rank starts (no GPU, no bootstrap).
    pub probe: fn(BackendOptions) -> Result<(), TransportError>,
    /// The collective check before `build` touches the GPU.
    pub preflight: fn(BackendOptions, &Bootstrap) -> Result<(), TransportError>,
    /// Builds the transport.
    pub build: BuildFn,
    /// Environment defaults for every rank on one host, `ranks_per_gpu` sharing each GPU and
    /// `local_ranks` in all: what a launcher sets before CUDA starts, unless the user did.
    pub single_host_env: fn(usize, usize) -> Vec<(&'static str, String)>,
}

impl Backend {
    /// A `probe` or `preflight` for backends with nothing to check before the GPU.
    pub fn nothing_to_probe(_: BackendOptions) -> Result<(), TransportError> {
        Ok(())
    }

    /// A `preflight` for backends with nothing to check before the GPU.
    pub fn nothing_to_preflight(_: BackendOptions, _: &Bootstrap) -> Result<(), TransportError> {
        Ok(())
    }

    /// A `single_host_env` for backends that need none.
    pub fn no_env(_: usize, _: usize) -> Vec<(&'static str, String)> {
        Vec::new()
    }

    /// Whether `name` names this backend (its name or an alias).
    pub fn answers_to(&self, name: &str) -> bool {
        self.name == name || self.aliases.contains(&name)
    }

    /// `Ok` when the entry was written against this crate's [`REGISTRY_VERSION`].
    ///
    /// # Errors
    /// [`TransportError::Unavailable`] naming the backend and both versions.
    pub fn check_version(&self) -> Result<(), TransportError> {
        if self.version == REGISTRY_VERSION {
            return Ok(());
        }
        Err(TransportError::Unavailable {
            what: "transport backend",
            why: format!(
                "backend {} was built for backend table version {}, this build reads version \
                 {REGISTRY_VERSION}",
                self.name, self.version
            ),
        })
    }

    /// The options in `text` (what follows `name:` in a spec, comma-separated `key=value`).
    ///
    /// # Errors
    /// [`TransportError::InvalidArgument`] naming `transport`: an option this backend does not
    /// read, or a value outside its rule.
    pub fn parse_options(&self, text: &str) -> Result<BackendOptions, TransportError> {
        let bad = |rule: String| TransportError::InvalidArgument {
            argument: "transport",
            rule,
        };
        let mut options = self.options.defaults();
        for option in text.split(',').filter(|o| !o.is_empty()) {
            match (self.options, option.split_once('=')) {
                (OptionSchema::None, _) => {
                    return Err(bad(format!(
                        "{} takes no options (got {text:?})",
                        self.name
                    )));
                }
                (OptionSchema::VirtualNodes { .. }, Some(("vnodes", "max"))) => {
                    options.virtual_nodes = VirtualNodes::OnePerGpu;
                }
                (OptionSchema::VirtualNodes { .. }, Some(("vnodes", n))) => {
                    options.virtual_nodes = match n.parse::<usize>() {
                        Ok(n) if n > 0 => VirtualNodes::Count(n),
                        _ => {
                            return Err(bad(format!(
                                "vnodes must be a positive number or `max` (got {n:?})"
                            )));
                        }
                    };
                }
                (OptionSchema::VirtualNodes { .. }, _) => {
                    return Err(bad(format!(
                        "unknown {} option {option:?} (known: vnodes=N, vnodes=max)",
                        self.name
                    )));
                }
            }
        }
        Ok(options)
    }

    /// The spec text of `options`: the name, then every option that differs from the
    /// schema's default (what [`Self::parse_options`] reads back to the same options).
    pub fn spec_text(&self, options: BackendOptions) -> String {
        let mut text = self.name.to_string();
        if options != self.options.defaults() {
            // `write!` to a String cannot fail.
            let _ = write!(text, ":vnodes={}", options.virtual_nodes);
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{KernelFamily, Route, Schedule};

    fn fail_build(
        _: BackendOptions,
        _: Arc<CudaContext>,
        _: Arc<Bootstrap>,
    ) -> Result<Arc<dyn DynTransport>, TransportError> {
        Err(TransportError::Unavailable {
            what: "test",
            why: "never built".into(),
        })
    }

    const SPLIT: Backend = Backend {
        version: REGISTRY_VERSION,
        name: "split",
        aliases: &["split-alias"],
        forms: &["split", "split:vnodes=N"],
        options: OptionSchema::VirtualNodes {
            default: VirtualNodes::OnePerGpu,
        },
        capabilities: Capabilities {
            name: "split",
            kernel_family: KernelFamily::NvlinkStore,
            schedules: &Schedule::ALL,
            routes: &[Route::Store],
        },
        limits: Limits {
            spans_hosts: false,
            executor: None,
        },
        runtime_library: None,
        needs_rdma_device: false,
        world_layout: |o, w, r, l| {
            Ok(WorldLayout::with_virtual_nodes(
                w,
                r,
                l,
                o.virtual_nodes.per_host(l),
            )?)
        },
        probe: Backend::nothing_to_probe,
        preflight: Backend::nothing_to_preflight,
        build: fail_build,
        single_host_env: Backend::no_env,
    };

    #[test]
    fn options_parse_and_print_back() {
        let two = SPLIT.parse_options("vnodes=2").unwrap();
        assert_eq!(two.virtual_nodes, VirtualNodes::Count(2));
        assert_eq!(SPLIT.spec_text(two), "split:vnodes=2");
        // The default is left out of the text.
        let max = SPLIT.parse_options("vnodes=max").unwrap();
        assert_eq!(SPLIT.spec_text(max), "split");
        assert_eq!(SPLIT.parse_options("").unwrap(), max);
        let layout = (SPLIT.world_layout)(two, 4, 1, 4).unwrap();
        assert_eq!(layout.nvlink_domain(), 0..2);
    }

    #[test]
    fn bad_options_name_the_rule() {
        for (text, needle) in [
            ("vnodes=0", "positive number"),
            ("vnodes=x", "positive number"),
            ("lanes=2", "unknown split option"),
        ] {
            let e = SPLIT.parse_options(text).unwrap_err().to_string();
            assert!(e.contains("transport") && e.contains(needle), "{text}: {e}");
        }
        let bare = Backend {
            options: OptionSchema::None,
            ..SPLIT
        };
        let e = bare.parse_options("vnodes=2").unwrap_err().to_string();
        assert!(e.contains("takes no options"), "{e}");
        assert!(bare.answers_to("split-alias") && !bare.answers_to("spl"));
    }

    #[test]
    fn another_table_version_is_refused() {
        assert!(SPLIT.check_version().is_ok());
        let old = Backend {
            version: REGISTRY_VERSION + 1,
            ..SPLIT
        };
        let e = old.check_version().unwrap_err().to_string();
        assert!(e.contains("split") && e.contains("version"), "{e}");
    }
}
