//! Transport selection for epcomm: one [`TransportSpec`], parsed from a short string, builds any
//! backend compiled into this crate and hands it over as an `Arc<dyn DynTransport>`, so the
//! frontend (`epcomm::Buffer`) and its callers (CLI, benches, tests, bindings) never name a
//! backend crate and keep no registry of transport names of their own.
//!
//! | spec | backend | what it reaches peers by |
//! |---|---|---|
//! | `ipc` | CUDA IPC (feature `ipc`) | stores through NVLink mappings; every rank on one host |
//! | `nvshmem` | NVSHMEM (feature `nvshmem`) | stores inside the node, put/signal to other nodes |
//! | `nvshmem:vnodes=N` | NVSHMEM | each host's GPUs split into `N` logical nodes: put/signal between them |
//! | `nvshmem:vnodes=max` | NVSHMEM | one logical node per GPU: every peer by put/signal |
//! | `proxy-ce` | CPU proxy + copy engines (feature `proxy`) | every peer's bytes by the copy engines, driven by a proxy thread; every rank on one host |
//! | `proxy-ce:vnodes=N` | CPU proxy + copy engines | stores inside each of `N` logical nodes, the copy engines between them |
//! | `proxy-verbs` | CPU proxy + RDMA verbs (feature `verbs`) | every peer's bytes by RDMA WRITEs through the NIC, driven by a proxy thread; ranks may span hosts |
//! | `proxy-verbs:vnodes=N` | CPU proxy + RDMA verbs | stores inside each of `N` logical nodes of a host, the NIC between them and to other hosts |
//!
//! # Example
//!
//! Parsing and planning need no GPU:
//!
//! ```
//! use epcomm_backends::TransportSpec;
//!
//! let spec: TransportSpec = "nvshmem:vnodes=2".parse()?;
//! assert_eq!(spec.to_string(), "nvshmem:vnodes=2");
//! // 4 ranks on one host, seen from rank 1: two logical nodes of two GPUs.
//! let world = spec.world_layout(4, 1, 4)?;
//! assert_eq!(world.nvlink_domain(), 0..2);
//! assert!("carrier-pigeon".parse::<TransportSpec>().is_err());
//! # Ok::<(), epcomm_backends::TransportError>(())
//! ```
//!
//! Building one needs a GPU and the other ranks of the job:
//!
//! ```no_run
//! use std::sync::Arc;
//!
//! use cudarc::driver::CudaContext;
//! use epcomm_backends::TransportSpec;
//! use epcomm_bootstrap::{Bootstrap, BootstrapConfig};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let boot = Arc::new(Bootstrap::connect(BootstrapConfig::from_env()?)?);
//! let ctx = CudaContext::new(boot.local_rank())?;
//! let transport = "ipc".parse::<TransportSpec>()?.build(ctx, boot)?;
//! println!("{}", transport.capabilities().name);
//! // Handed to the frontend: `epcomm::Buffer::new(ctx, transport, cfg)`.
//! # Ok(())
//! # }
//! ```

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use cudarc::driver::CudaContext;
pub use epcomm_transport::{
    Bootstrap, Capabilities, DynTransport, KernelFamily, Route, Schedule, TransportError,
    WorldLayout,
};

/// How many logical nodes each host's GPUs are split into (NVSHMEM and the CPU proxies).
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

/// Which backend to build, with its options: parsed from `ipc`, `nvshmem`,
/// `nvshmem:vnodes=N`, `nvshmem:vnodes=max`, `proxy-ce[:vnodes=N]` or
/// `proxy-verbs[:vnodes=N]` (see the crate docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TransportSpec {
    /// CUDA IPC over one NVLink domain.
    Ipc,
    /// NVSHMEM, optionally with virtual nodes.
    Nvshmem {
        /// Logical nodes per host.
        virtual_nodes: VirtualNodes,
    },
    /// The CPU proxy with the copy-engine executor (every rank on one host).
    ProxyCe {
        /// Logical nodes per host: peers in other logical nodes go through the proxy.
        virtual_nodes: VirtualNodes,
    },
    /// The CPU proxy with the RDMA verbs executor (needs libibverbs and an RDMA device).
    ProxyVerbs {
        /// Logical nodes per host: peers in other logical nodes (and on other hosts) go through
        /// the proxy and the NIC.
        virtual_nodes: VirtualNodes,
    },
}

impl TransportSpec {
    /// The forms a spec can take, for help texts.
    pub const FORMS: [&'static str; 8] = [
        "ipc",
        "nvshmem",
        "nvshmem:vnodes=N",
        "nvshmem:vnodes=max",
        "proxy-ce",
        "proxy-ce:vnodes=N",
        "proxy-verbs",
        "proxy-verbs:vnodes=N",
    ];

    /// The backend's short name (`"ipc"`, `"nvshmem"`), without options.
    pub fn backend(&self) -> &'static str {
        match self {
            Self::Ipc => "ipc",
            Self::Nvshmem { .. } => "nvshmem",
            Self::ProxyCe { .. } => "proxy-ce",
            Self::ProxyVerbs { .. } => "proxy-verbs",
        }
    }

    /// The cargo feature that compiles this backend in.
    pub fn feature(&self) -> &'static str {
        match self {
            Self::ProxyCe { .. } => "proxy",
            Self::ProxyVerbs { .. } => "verbs",
            _ => self.backend(),
        }
    }

    /// Whether this build carries the backend.
    pub fn is_compiled(&self) -> bool {
        match self {
            Self::Ipc => cfg!(feature = "ipc"),
            Self::Nvshmem { .. } => cfg!(feature = "nvshmem"),
            Self::ProxyCe { .. } => cfg!(feature = "proxy"),
            Self::ProxyVerbs { .. } => cfg!(feature = "verbs"),
        }
    }

    /// True when the backend loads a library at run time that the machine may lack (NVSHMEM).
    pub fn needs_runtime_library(&self) -> bool {
        matches!(self, Self::Nvshmem { .. })
    }

    /// True when the backend needs an RDMA device with an active port, and libibverbs
    /// (`proxy-verbs`): [`Self::preflight`] checks both.
    pub fn needs_rdma_device(&self) -> bool {
        matches!(self, Self::ProxyVerbs { .. })
    }

    /// What [`Self::build`] checks before it touches the GPU, on every rank of `bootstrap`
    /// (collective for `proxy-verbs`; no GPU needed): for `proxy-verbs`, its options from the
    /// environment, the layout, and libibverbs and the RDMA device
    /// (`epcomm_transport_proxy::verbs::VerbsTransport::preflight`). The other backends have no
    /// such step; their checks need the GPU and run in `build`.
    ///
    /// # Errors
    /// [`TransportError::Unavailable`] (`what`: `"proxy-verbs"`) on a machine without
    /// libibverbs or without an RDMA device with an active port, or when another rank is
    /// such a machine; [`TransportError::InvalidArgument`] for a bad option or layout, or naming
    /// `transport` when the backend is not compiled into this build.
    pub fn preflight(&self, bootstrap: &Bootstrap) -> Result<(), TransportError> {
        match *self {
            #[cfg(feature = "verbs")]
            Self::ProxyVerbs { virtual_nodes } => {
                self.verbs_preflight(virtual_nodes, bootstrap).map(|_| ())
            }
            _ if !self.is_compiled() => Err(self.not_compiled()),
            _ => {
                let _ = bootstrap;
                Ok(())
            }
        }
    }

    /// [`Self::preflight`]'s machine check on this process alone (not collective; no GPU, no
    /// bootstrap needed): for `proxy-verbs`, its options from the environment, libibverbs and
    /// an RDMA device with an active port (`epcomm_transport_proxy::verbs::probe_rdma`);
    /// nothing for the other backends. What a tool runs before it starts any rank.
    ///
    /// # Errors
    /// As [`Self::preflight`], for this machine only.
    pub fn probe_here(&self) -> Result<(), TransportError> {
        match *self {
            #[cfg(feature = "verbs")]
            Self::ProxyVerbs { .. } => {
                let options = epcomm_transport_proxy::verbs::VerbsOptions::from_env(1)?;
                options.validate()?;
                epcomm_transport_proxy::verbs::probe_rdma(&options).map(|_| ())
            }
            _ if !self.is_compiled() => Err(self.not_compiled()),
            _ => Ok(()),
        }
    }

    /// `proxy-verbs`' options from the environment with `virtual_nodes`, checked on every rank.
    #[cfg(feature = "verbs")]
    fn verbs_preflight(
        &self,
        virtual_nodes: VirtualNodes,
        bootstrap: &Bootstrap,
    ) -> Result<epcomm_transport_proxy::verbs::Preflight, TransportError> {
        let local = bootstrap.local_world_size();
        let mut options = epcomm_transport_proxy::verbs::VerbsOptions::from_env(local)?;
        options.proxy.virtual_nodes = virtual_nodes.per_host(local);
        epcomm_transport_proxy::verbs::VerbsTransport::preflight(bootstrap, options)
    }

    /// What the backend supports (no GPU needed).
    ///
    /// # Errors
    /// [`TransportError::InvalidArgument`] naming `transport` when the backend is not compiled
    /// into this build.
    pub fn capabilities(&self) -> Result<Capabilities, TransportError> {
        match self {
            #[cfg(feature = "ipc")]
            Self::Ipc => Ok(epcomm_transport_ipc::CAPABILITIES),
            #[cfg(feature = "nvshmem")]
            Self::Nvshmem { .. } => Ok(epcomm_transport_nvshmem::CAPABILITIES),
            #[cfg(feature = "proxy")]
            Self::ProxyCe { .. } => Ok(epcomm_transport_proxy::CAPABILITIES),
            #[cfg(feature = "verbs")]
            Self::ProxyVerbs { .. } => Ok(epcomm_transport_proxy::verbs::CAPABILITIES),
            #[allow(unreachable_patterns)]
            _ => Err(self.not_compiled()),
        }
    }

    /// The world layout a transport of this spec sees for `world_size` ranks, `local_world_size`
    /// per host, seen from `rank` (no GPU needed): what `Transport::world` returns once built,
    /// by the backend's own rule (`IpcTransport::world_layout`, `NvshmemTransport::world_layout`).
    ///
    /// # Errors
    /// The backend's: [`TransportError::InvalidArgument`] naming `world` when CUDA IPC is asked
    /// to span hosts, or `NvshmemOptions::virtual_nodes` when the virtual node count does not
    /// divide the GPUs per host; [`TransportError::InvalidArgument`] naming `transport` when
    /// the backend is not compiled into this build.
    pub fn world_layout(
        &self,
        world_size: usize,
        rank: usize,
        local_world_size: usize,
    ) -> Result<WorldLayout, TransportError> {
        match *self {
            #[cfg(feature = "ipc")]
            Self::Ipc => {
                epcomm_transport_ipc::IpcTransport::world_layout(world_size, rank, local_world_size)
            }
            #[cfg(feature = "nvshmem")]
            Self::Nvshmem { virtual_nodes } => {
                epcomm_transport_nvshmem::NvshmemTransport::world_layout(
                    world_size,
                    rank,
                    local_world_size,
                    epcomm_transport_nvshmem::NvshmemOptions {
                        virtual_nodes: virtual_nodes.per_host(local_world_size),
                    },
                )
            }
            #[cfg(feature = "proxy")]
            Self::ProxyCe { virtual_nodes } => {
                epcomm_transport_proxy::ProxyTransport::world_layout(
                    world_size,
                    rank,
                    local_world_size,
                    virtual_nodes.per_host(local_world_size),
                )
            }
            #[cfg(feature = "verbs")]
            Self::ProxyVerbs { virtual_nodes } => {
                epcomm_transport_proxy::verbs::VerbsTransport::world_layout(
                    world_size,
                    rank,
                    local_world_size,
                    virtual_nodes.per_host(local_world_size),
                )
            }
            #[allow(unreachable_patterns)]
            _ => {
                let _ = (world_size, rank, local_world_size);
                Err(self.not_compiled())
            }
        }
    }

    /// Builds the transport of this rank over `bootstrap` (collective: every rank builds the
    /// same spec). NVSHMEM is loaded and initialised here.
    ///
    /// # Errors
    /// As the backend's constructor; [`TransportError::InvalidArgument`] naming `transport` when
    /// the backend is not compiled into this build.
    pub fn build(
        &self,
        ctx: Arc<CudaContext>,
        bootstrap: Arc<Bootstrap>,
    ) -> Result<Arc<dyn DynTransport>, TransportError> {
        match *self {
            #[cfg(feature = "ipc")]
            Self::Ipc => Ok(Arc::new(epcomm_transport_ipc::IpcTransport::new(
                ctx, bootstrap,
            )?)),
            #[cfg(feature = "nvshmem")]
            Self::Nvshmem { virtual_nodes } => {
                let options = epcomm_transport_nvshmem::NvshmemOptions {
                    virtual_nodes: virtual_nodes.per_host(bootstrap.local_world_size()),
                };
                Ok(Arc::new(
                    epcomm_transport_nvshmem::NvshmemTransport::with_options(
                        ctx, bootstrap, options,
                    )?,
                ))
            }
            #[cfg(feature = "proxy")]
            Self::ProxyCe { virtual_nodes } => {
                let local = bootstrap.local_world_size();
                let mut options = epcomm_transport_proxy::ProxyOptions::from_env(local)?;
                options.virtual_nodes = virtual_nodes.per_host(local);
                Ok(Arc::new(epcomm_transport_proxy::ProxyTransport::new(
                    ctx, bootstrap, options,
                )?))
            }
            #[cfg(feature = "verbs")]
            Self::ProxyVerbs { virtual_nodes } => {
                // The same checks `preflight` makes, first: a machine without an RDMA device
                // fails here, on every rank, before anything is allocated.
                let checked = self.verbs_preflight(virtual_nodes, &bootstrap)?;
                Ok(Arc::new(
                    epcomm_transport_proxy::verbs::VerbsTransport::with_preflight(
                        ctx, bootstrap, checked,
                    )?,
                ))
            }
            #[allow(unreachable_patterns)]
            _ => {
                let _ = (ctx, bootstrap);
                Err(self.not_compiled())
            }
        }
    }

    fn not_compiled(&self) -> TransportError {
        TransportError::InvalidArgument {
            argument: "transport",
            rule: format!(
                "{self} is not compiled into this build (enable the `{}` feature of \
                 epcomm-backends)",
                self.feature()
            ),
        }
    }
}

impl FromStr for TransportSpec {
    type Err = TransportError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = |rule: String| TransportError::InvalidArgument {
            argument: "transport",
            rule,
        };
        let (backend, options) = s.split_once(':').unwrap_or((s, ""));
        match backend {
            "ipc" | "nvlink-ipc" if options.is_empty() => Ok(Self::Ipc),
            "ipc" | "nvlink-ipc" => Err(bad(format!("ipc takes no options (got {options:?})"))),
            "nvshmem" | "proxy-ce" | "proxy-verbs" => {
                let mut virtual_nodes = if backend == "nvshmem" {
                    VirtualNodes::Count(1)
                } else {
                    VirtualNodes::OnePerGpu
                };
                for option in options.split(',').filter(|o| !o.is_empty()) {
                    virtual_nodes = match option.split_once('=') {
                        Some(("vnodes", "max")) => VirtualNodes::OnePerGpu,
                        Some(("vnodes", n)) => match n.parse::<usize>() {
                            Ok(n) if n > 0 => VirtualNodes::Count(n),
                            _ => {
                                return Err(bad(format!(
                                    "vnodes must be a positive number or `max` (got {n:?})"
                                )));
                            }
                        },
                        _ => {
                            return Err(bad(format!(
                                "unknown {backend} option {option:?} (known: vnodes=N, vnodes=max)"
                            )));
                        }
                    };
                }
                Ok(match backend {
                    "nvshmem" => Self::Nvshmem { virtual_nodes },
                    "proxy-ce" => Self::ProxyCe { virtual_nodes },
                    _ => Self::ProxyVerbs { virtual_nodes },
                })
            }
            other => Err(bad(format!(
                "unknown transport {other:?}: must be one of {}",
                Self::FORMS.join(", ")
            ))),
        }
    }
}

impl fmt::Display for TransportSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Ipc => f.write_str("ipc"),
            Self::Nvshmem {
                virtual_nodes: VirtualNodes::Count(1),
            } => f.write_str("nvshmem"),
            Self::Nvshmem {
                virtual_nodes: VirtualNodes::Count(n),
            } => write!(f, "nvshmem:vnodes={n}"),
            Self::Nvshmem {
                virtual_nodes: VirtualNodes::OnePerGpu,
            } => f.write_str("nvshmem:vnodes=max"),
            Self::ProxyCe {
                virtual_nodes: VirtualNodes::OnePerGpu,
            } => f.write_str("proxy-ce"),
            Self::ProxyCe {
                virtual_nodes: VirtualNodes::Count(n),
            } => write!(f, "proxy-ce:vnodes={n}"),
            Self::ProxyVerbs {
                virtual_nodes: VirtualNodes::OnePerGpu,
            } => f.write_str("proxy-verbs"),
            Self::ProxyVerbs {
                virtual_nodes: VirtualNodes::Count(n),
            } => write!(f, "proxy-verbs:vnodes={n}"),
        }
    }
}

/// The variables a job on one host needs that the environment does not set yet: what a
/// local launcher adds to its ranks' environment, `local_ranks` ranks on the host with
/// `ranks_per_gpu` of them sharing each GPU (1 when every rank has its own). NVSHMEM's (no RDMA NIC, multicast off) when that backend is
/// compiled in, and the copy-engine proxy's hardware queues
/// (`CUDA_DEVICE_MAX_CONNECTIONS`, see `epcomm_transport_proxy::single_host_env`) when the
/// proxy backend is.
pub fn single_host_env_defaults(
    ranks_per_gpu: usize,
    local_ranks: usize,
) -> Vec<(&'static str, String)> {
    #[cfg(not(feature = "proxy"))]
    let _ = (ranks_per_gpu, local_ranks);
    let mut all: Vec<(&'static str, String)> = Vec::new();
    #[cfg(feature = "nvshmem")]
    all.extend(
        epcomm_transport_nvshmem::SINGLE_HOST_ENV
            .iter()
            .map(|&(k, v)| (k, v.to_string())),
    );
    #[cfg(feature = "proxy")]
    all.extend(epcomm_transport_proxy::single_host_env(
        ranks_per_gpu,
        local_ranks,
    ));
    all.into_iter()
        .filter(|(key, _)| std::env::var_os(key).is_none())
        .collect()
}

/// The most hardware queues (`CUDA_DEVICE_MAX_CONNECTIONS` summed over the ranks of one GPU)
/// seen to work under MPS: eight ranks asking 9 each ran, sixteen asking 17 each failed to
/// create their contexts (the local launchers stay within it, see
/// `epcomm_transport_proxy::single_host_env`).
const MPS_QUEUES_KNOWN_GOOD: usize = 72;

/// What to tell a user whose CUDA context failed with `CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED`
/// (`ranks_per_gpu` ranks sharing its GPU under MPS): the MPS server's pool of hardware queues
/// is spent, so every rank must ask for fewer (`CUDA_DEVICE_MAX_CONNECTIONS`, the value named),
/// or fewer ranks must share the GPU. `None` for any other error.
pub fn context_error_hint(
    error: &cudarc::driver::DriverError,
    ranks_per_gpu: usize,
) -> Option<String> {
    if error.0 != cudarc::driver::sys::CUresult::CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED {
        return None;
    }
    let n = ranks_per_gpu.max(1);
    let each = (MPS_QUEUES_KNOWN_GOOD / n).clamp(1, 32);
    let now = std::env::var("CUDA_DEVICE_MAX_CONNECTIONS")
        .map_or_else(|_| "not set".to_string(), |v| format!("{v:?}"));
    Some(format!(
        "the MPS server has no hardware queues left for {n} rank(s) on this GPU \
         (CUDA_DEVICE_MAX_CONNECTIONS is {now} here): set CUDA_DEVICE_MAX_CONNECTIONS={each} \
         (at most {MPS_QUEUES_KNOWN_GOOD} / {n}) in every rank's environment before CUDA \
         starts, or run fewer ranks per GPU"
    ))
}

/// Sets [`single_host_env_defaults`] (`ranks_per_gpu` and `local_ranks` as there) in this
/// process's environment.
///
/// # Safety
/// No other thread may exist (it writes the environment, see [`std::env::set_var`]): call it
/// first thing in `main`.
pub unsafe fn apply_single_host_env_defaults(ranks_per_gpu: usize, local_ranks: usize) {
    for (key, value) in single_host_env_defaults(ranks_per_gpu, local_ranks) {
        // SAFETY: the caller guarantees that this process has no other thread yet.
        unsafe { std::env::set_var(key, value) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exhausted_mps_pool_names_the_connections_to_ask_for() {
        use cudarc::driver::{DriverError, sys::CUresult};
        let full = DriverError(CUresult::CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED);
        let hint = context_error_hint(&full, 16).expect("a hint");
        assert!(
            hint.contains("CUDA_DEVICE_MAX_CONNECTIONS=4") && hint.contains("16 rank(s)"),
            "{hint}"
        );
        assert!(
            context_error_hint(&full, 1)
                .unwrap()
                .contains("CUDA_DEVICE_MAX_CONNECTIONS=32")
        );
        let other = DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        assert_eq!(context_error_hint(&other, 16), None);
    }

    #[test]
    fn specs_round_trip() {
        for text in [
            "ipc",
            "nvshmem",
            "nvshmem:vnodes=2",
            "nvshmem:vnodes=max",
            "proxy-ce",
            "proxy-ce:vnodes=2",
            "proxy-verbs",
            "proxy-verbs:vnodes=2",
        ] {
            let spec: TransportSpec = text.parse().unwrap();
            assert_eq!(spec.to_string(), text);
            assert!(spec.is_compiled());
        }
        assert_eq!(
            "nvlink-ipc".parse::<TransportSpec>().unwrap(),
            TransportSpec::Ipc
        );
        assert_eq!(
            "nvshmem:vnodes=1"
                .parse::<TransportSpec>()
                .unwrap()
                .to_string(),
            "nvshmem"
        );
        assert_eq!(
            "proxy-ce:vnodes=max"
                .parse::<TransportSpec>()
                .unwrap()
                .to_string(),
            "proxy-ce"
        );
    }

    #[test]
    fn proxy_layouts_put_other_logical_nodes_behind_the_proxy() {
        let spec: TransportSpec = "proxy-ce".parse().unwrap();
        assert_eq!(spec.feature(), "proxy");
        let caps = spec.capabilities().unwrap();
        assert_eq!(caps.kernel_family, KernelFamily::CpuProxy);
        // Two ranks on one host, one logical node each: the peer is in another node.
        let w = spec.world_layout(2, 1, 2).unwrap();
        assert_eq!(w.nvlink_domain(), 1..2);
        // Four ranks, two logical nodes.
        let w = "proxy-ce:vnodes=2"
            .parse::<TransportSpec>()
            .unwrap()
            .world_layout(4, 3, 4)
            .unwrap();
        assert_eq!(w.nvlink_domain(), 2..4);
        // Across hosts it is refused, naming the rule.
        let err = spec.world_layout(4, 0, 2).unwrap_err().to_string();
        assert!(err.contains("one host"), "{err}");
        let err = "proxy-ce:vnodes=3"
            .parse::<TransportSpec>()
            .unwrap()
            .world_layout(4, 0, 4)
            .unwrap_err()
            .to_string();
        assert!(err.contains("vnodes=3"), "{err}");
    }

    #[test]
    fn proxy_verbs_specs_parse_and_lay_out_across_hosts() {
        let spec: TransportSpec = "proxy-verbs".parse().unwrap();
        assert_eq!(
            spec,
            TransportSpec::ProxyVerbs {
                virtual_nodes: VirtualNodes::OnePerGpu
            }
        );
        assert_eq!(
            "proxy-verbs:vnodes=max"
                .parse::<TransportSpec>()
                .unwrap()
                .to_string(),
            "proxy-verbs"
        );
        assert_eq!(spec.backend(), "proxy-verbs");
        assert_eq!(spec.feature(), "verbs");
        assert!(spec.needs_rdma_device() && !spec.needs_runtime_library());
        assert!(
            !TransportSpec::ProxyCe {
                virtual_nodes: VirtualNodes::OnePerGpu
            }
            .needs_rdma_device()
        );
        let caps = spec.capabilities().unwrap();
        assert_eq!(caps.name, "proxy-verbs");
        assert_eq!(caps.kernel_family, KernelFamily::CpuProxy);
        assert_eq!(caps.routes, &[Route::Store, Route::PutSignal]);
        // Unlike proxy-ce, ranks may span hosts: two hosts of four GPUs, rank 5.
        assert_eq!(spec.world_layout(8, 5, 4).unwrap().nvlink_domain(), 5..6);
        let two: TransportSpec = "proxy-verbs:vnodes=2".parse().unwrap();
        assert_eq!(two.world_layout(8, 5, 4).unwrap().nvlink_domain(), 4..6);
        let err = "proxy-verbs:vnodes=3"
            .parse::<TransportSpec>()
            .unwrap()
            .world_layout(8, 0, 4)
            .unwrap_err()
            .to_string();
        assert!(err.contains("vnodes=3"), "{err}");
        let err = "proxy-verbs:qps=2"
            .parse::<TransportSpec>()
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown proxy-verbs option"), "{err}");
    }

    /// Bootstraps of `world` ranks over 127.0.0.1, one thread each, running `f`.
    fn on_ranks<T: Send + 'static>(
        world: usize,
        f: impl Fn(epcomm_bootstrap::Bootstrap) -> T + Send + Sync + Clone + 'static,
    ) -> Vec<T> {
        epcomm_bootstrap::launch::on_threads(world, std::time::Duration::from_secs(20), f)
            .expect("a free port")
            .into_iter()
            .map(|r| r.expect("bootstrap"))
            .collect()
    }

    /// The same check on this process alone (what a bench runs before it starts any rank).
    #[test]
    fn probe_here_without_an_rdma_device_is_unavailable() {
        assert!(
            "proxy-ce"
                .parse::<TransportSpec>()
                .unwrap()
                .probe_here()
                .is_ok()
        );
        match "proxy-verbs".parse::<TransportSpec>().unwrap().probe_here() {
            Ok(()) => eprintln!("SKIP: an RDMA device with an active port is present"),
            Err(e) => assert!(
                matches!(
                    e,
                    TransportError::Unavailable {
                        what: "proxy-verbs",
                        ..
                    }
                ),
                "{e}"
            ),
        }
    }

    /// What `build` runs before it needs a GPU, on two ranks: on a machine without an RDMA
    /// device (or without libibverbs) every rank gets `Unavailable` for `proxy-verbs`, none
    /// waits for the other; the backends without such a step pass.
    #[test]
    fn proxy_verbs_without_an_rdma_device_is_unavailable() {
        let out = on_ranks(2, |b| {
            let verbs = "proxy-verbs"
                .parse::<TransportSpec>()
                .unwrap()
                .preflight(&b);
            let ce = "proxy-ce".parse::<TransportSpec>().unwrap().preflight(&b);
            (verbs, ce)
        });
        let kernel_lists_devices =
            std::fs::read_dir("/sys/class/infiniband").is_ok_and(|mut d| d.next().is_some());
        for (rank, (verbs, ce)) in out.into_iter().enumerate() {
            ce.expect("proxy-ce has no machine check before the GPU");
            match verbs {
                Ok(()) => eprintln!(
                    "SKIP (rank {rank}): an RDMA device with an active port is present; the \
                     no-device path cannot be checked on this machine"
                ),
                Err(TransportError::Unavailable { what, why }) => {
                    assert_eq!(what, "proxy-verbs");
                    if !kernel_lists_devices {
                        assert!(
                            why.starts_with("no RDMA device: ") || why.contains("libibverbs.so.1"),
                            "{why}"
                        );
                    }
                    eprintln!("rank {rank}: proxy-verbs is unavailable on this machine: {why}");
                }
                Err(other) => panic!("rank {rank}: expected Unavailable, got {other}"),
            }
        }
    }

    #[test]
    fn bad_specs_say_what_is_valid() {
        for (text, needle) in [
            ("tcp", "must be one of ipc, nvshmem"),
            ("ipc:vnodes=2", "ipc takes no options"),
            ("nvshmem:vnodes=0", "positive number or `max`"),
            ("nvshmem:pes=2", "unknown nvshmem option"),
            ("proxy-verbs:vnodes=x", "positive number or `max`"),
        ] {
            let err = text.parse::<TransportSpec>().unwrap_err().to_string();
            assert!(
                err.contains("transport") && err.contains(needle),
                "{text}: {err}"
            );
        }
    }

    #[test]
    fn layouts_and_capabilities_without_a_gpu() {
        let ipc = TransportSpec::Ipc;
        assert_eq!(ipc.capabilities().unwrap().routes, &[Route::Store]);
        assert_eq!(ipc.world_layout(4, 2, 4).unwrap().nvlink_domain(), 0..4);
        let err = ipc.world_layout(4, 2, 2).unwrap_err().to_string();
        assert!(err.contains("one host"), "{err}");

        let every: TransportSpec = "nvshmem:vnodes=max".parse().unwrap();
        assert!(
            every
                .capabilities()
                .unwrap()
                .routes
                .contains(&Route::PutSignal)
        );
        assert_eq!(every.world_layout(4, 2, 4).unwrap().nvlink_domain(), 2..3);
        let three: TransportSpec = "nvshmem:vnodes=3".parse().unwrap();
        let err = three.world_layout(4, 0, 4).unwrap_err().to_string();
        assert!(
            err.contains("vnodes=3 must divide the 4 GPUs per host"),
            "{err}"
        );
    }
}
