//! Transport selection for epcomm: one [`TransportSpec`], parsed from a short string, builds any
//! backend compiled into this crate and hands it over as an `Arc<dyn DynTransport>`, so the
//! frontend (`epcomm::Buffer`) and its callers (CLI, benches, tests, bindings) never name a
//! backend crate and keep no registry of transport names of their own.
//!
//! Every backend crate exports one [`Backend`] entry (see `epcomm_transport::registry`);
//! [`REGISTRY`] lists the entries, one line and one cargo feature per backend, and a spec is
//! a pointer to an entry plus the options that entry parsed. A backend outside this crate's
//! list is used through its entry directly: [`TransportSpec::of`]`(&MY_BACKEND)`, then
//! [`Backend::parse_options`] for its options, and `build` as for any other.
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
    Backend, BackendOptions, Bootstrap, Capabilities, DynTransport, ExecutorLimits, KernelFamily,
    Limits, LocatedLibrary, OptionSchema, REGISTRY_VERSION, Route, RuntimeLibrary, Schedule,
    TransportError, VirtualNodes, WorldLayout,
};

/// One line of the backend list: a backend this crate knows by name and cargo feature, with its
/// entry when that feature is on.
#[derive(Clone, Copy, Debug)]
pub struct Registration {
    /// The name specs use (the entry's [`Backend::name`]).
    pub name: &'static str,
    /// The cargo feature of this crate that compiles the backend in.
    pub feature: &'static str,
    /// The backend crate's entry; `None` when the feature is off in this build.
    pub backend: Option<&'static Backend>,
}

/// A [`Registration`] whose entry is compiled in only with the feature: one line per backend.
macro_rules! register {
    ($feature:literal, $name:literal, $entry:path) => {
        Registration {
            name: $name,
            feature: $feature,
            backend: {
                #[cfg(feature = $feature)]
                let entry = Some(&$entry);
                #[cfg(not(feature = $feature))]
                let entry = None;
                entry
            },
        }
    };
}

/// Every backend this crate knows, in the order tools list them. Adding a backend: its crate
/// exports a [`Backend`], this crate gains a feature and one line here.
pub const REGISTRY: [Registration; 4] = [
    register!("ipc", "ipc", epcomm_transport_ipc::BACKEND),
    register!("nvshmem", "nvshmem", epcomm_transport_nvshmem::BACKEND),
    register!("proxy", "proxy-ce", epcomm_transport_proxy::BACKEND),
    register!(
        "verbs",
        "proxy-verbs",
        epcomm_transport_proxy::verbs::BACKEND
    ),
];

/// The entries compiled into this build, in [`REGISTRY`] order.
pub fn backends() -> impl Iterator<Item = &'static Backend> {
    REGISTRY.iter().filter_map(|r| r.backend)
}

/// The spec forms of every backend compiled in, for help texts (`ipc`, `nvshmem:vnodes=N`).
pub fn forms() -> Vec<&'static str> {
    backends().flat_map(|b| b.forms.iter().copied()).collect()
}

/// Which backend to build, with its options: parsed from `name[:key=value,...]` against the
/// backends compiled in (see the crate docs for the forms).
#[derive(Clone, Copy, Debug)]
pub struct TransportSpec {
    backend: &'static Backend,
    options: BackendOptions,
}

impl PartialEq for TransportSpec {
    fn eq(&self, other: &Self) -> bool {
        self.backend.name == other.backend.name && self.options == other.options
    }
}

impl Eq for TransportSpec {}

impl std::hash::Hash for TransportSpec {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.backend.name.hash(state);
        self.options.hash(state);
    }
}

impl TransportSpec {
    /// The spec of `backend` with its default options: also how a backend that is not in
    /// [`REGISTRY`] (a crate of your own exporting a [`Backend`]) is used.
    pub fn of(backend: &'static Backend) -> Self {
        Self {
            backend,
            options: backend.options.defaults(),
        }
    }

    /// The backend's entry.
    pub fn entry(&self) -> &'static Backend {
        self.backend
    }

    /// The backend's short name (`"ipc"`, `"nvshmem"`), without options.
    pub fn backend(&self) -> &'static str {
        self.backend.name
    }

    /// The options the spec carries.
    pub fn options(&self) -> BackendOptions {
        self.options
    }

    /// The logical nodes per host, for backends that take the option (`None` for the others).
    pub fn virtual_nodes(&self) -> Option<VirtualNodes> {
        match self.backend.options {
            OptionSchema::None => None,
            OptionSchema::VirtualNodes { .. } => Some(self.options.virtual_nodes),
        }
    }

    /// This spec with `options` (parsed by its entry: [`Backend::parse_options`]).
    pub fn with_options(self, options: BackendOptions) -> Self {
        Self { options, ..self }
    }

    /// This spec with `virtual_nodes` logical nodes per host.
    ///
    /// # Errors
    /// [`TransportError::InvalidArgument`] naming `transport` when the backend takes no such
    /// option.
    pub fn with_virtual_nodes(self, virtual_nodes: VirtualNodes) -> Result<Self, TransportError> {
        if self.virtual_nodes().is_none() {
            return Err(TransportError::InvalidArgument {
                argument: "transport",
                rule: format!("{} takes no virtual nodes option", self.backend.name),
            });
        }
        Ok(Self {
            options: BackendOptions { virtual_nodes },
            ..self
        })
    }

    /// True when the backend loads a library at run time that the machine may lack
    /// ([`Backend::runtime_library`]: NVSHMEM's host library).
    pub fn needs_runtime_library(&self) -> bool {
        self.backend.runtime_library.is_some()
    }

    /// The library the backend loads at run time, if any ([`Backend::runtime_library`]), to
    /// look for before any rank starts ([`RuntimeLibrary::locate`]).
    pub fn runtime_library(&self) -> Option<RuntimeLibrary> {
        self.backend.runtime_library
    }

    /// True when the backend needs an RDMA device with an active port, and libibverbs
    /// (`proxy-verbs`): [`Self::preflight`] checks both.
    pub fn needs_rdma_device(&self) -> bool {
        self.backend.needs_rdma_device
    }

    /// What [`Self::build`] checks before it touches the GPU, on every rank of `bootstrap`
    /// (collective; no GPU needed): for `proxy-verbs`, its options from the environment, the
    /// layout, and libibverbs and the RDMA device. The other backends have no such step; their
    /// checks need the GPU and run in `build`.
    ///
    /// # Errors
    /// The backend's: for `proxy-verbs`, [`TransportError::Unavailable`] (`what`:
    /// `"proxy-verbs"`) on a machine without libibverbs or without an RDMA device with an
    /// active port, or when another rank is such a machine; [`TransportError::InvalidArgument`]
    /// for a bad option or layout.
    pub fn preflight(&self, bootstrap: &Bootstrap) -> Result<(), TransportError> {
        (self.backend.preflight)(self.options, bootstrap)
    }

    /// [`Self::preflight`]'s machine check on this process alone (not collective; no GPU, no
    /// bootstrap needed): what a tool runs before it starts any rank.
    ///
    /// # Errors
    /// As [`Self::preflight`], for this machine only.
    pub fn probe_here(&self) -> Result<(), TransportError> {
        (self.backend.probe)(self.options)
    }

    /// What the backend supports (no GPU needed).
    pub fn capabilities(&self) -> Capabilities {
        self.backend.capabilities
    }

    /// What bounds the backend (no GPU needed).
    pub fn limits(&self) -> Limits {
        self.backend.limits
    }

    /// The world layout a transport of this spec sees for `world_size` ranks, `local_world_size`
    /// per host, seen from `rank` (no GPU needed): what `Transport::world` returns once built,
    /// by the backend's own rule.
    ///
    /// # Errors
    /// The backend's: [`TransportError::InvalidArgument`] naming `world` when a one-host backend
    /// is asked to span hosts, or the options' field when the virtual node count does not
    /// divide the GPUs per host.
    pub fn world_layout(
        &self,
        world_size: usize,
        rank: usize,
        local_world_size: usize,
    ) -> Result<WorldLayout, TransportError> {
        (self.backend.world_layout)(self.options, world_size, rank, local_world_size)
    }

    /// Builds the transport of this rank over `bootstrap` (collective: every rank builds the
    /// same spec). NVSHMEM is loaded and initialised here.
    ///
    /// # Errors
    /// As the backend's constructor.
    pub fn build(
        &self,
        ctx: Arc<CudaContext>,
        bootstrap: Arc<Bootstrap>,
    ) -> Result<Arc<dyn DynTransport>, TransportError> {
        (self.backend.build)(self.options, ctx, bootstrap)
    }
}

impl FromStr for TransportSpec {
    type Err = TransportError;

    /// # Errors
    /// [`TransportError::InvalidArgument`] naming `transport`: an unknown name (listing the
    /// forms this build takes), a backend whose feature is off in this build (naming the
    /// feature), an entry of another table version, or an option outside the backend's rule.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = |rule: String| TransportError::InvalidArgument {
            argument: "transport",
            rule,
        };
        let (name, options) = s.split_once(':').unwrap_or((s, ""));
        if let Some(backend) = backends().find(|b| b.answers_to(name)) {
            backend.check_version()?;
            return Ok(Self {
                backend,
                options: backend.parse_options(options)?,
            });
        }
        if let Some(off) = REGISTRY.iter().find(|r| r.name == name) {
            return Err(bad(format!(
                "{name} is not compiled into this build (enable the `{}` feature of \
                 epcomm-backends)",
                off.feature
            )));
        }
        Err(bad(format!(
            "unknown transport {name:?}: must be one of {}",
            forms().join(", ")
        )))
    }
}

impl fmt::Display for TransportSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.backend.spec_text(self.options))
    }
}

/// The variables a job on one host needs that the environment does not set yet: what a
/// local launcher adds to its ranks' environment, `local_ranks` ranks on the host with
/// `ranks_per_gpu` of them sharing each GPU (1 when every rank has its own): every compiled-in
/// backend's [`Backend::single_host_env`], the first value of a variable kept (NVSHMEM's: no
/// RDMA NIC, multicast off; the CPU proxies': hardware queues, `CUDA_DEVICE_MAX_CONNECTIONS`,
/// see `epcomm_transport_proxy::single_host_env`).
pub fn single_host_env_defaults(
    ranks_per_gpu: usize,
    local_ranks: usize,
) -> Vec<(&'static str, String)> {
    let mut all: Vec<(&'static str, String)> = Vec::new();
    for backend in backends() {
        for (key, value) in (backend.single_host_env)(ranks_per_gpu, local_ranks) {
            if !all.iter().any(|(k, _)| *k == key) && std::env::var_os(key).is_none() {
                all.push((key, value));
            }
        }
    }
    all
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
    fn every_entry_answers_to_its_line_and_its_forms_parse_back() {
        assert_eq!(
            backends().count(),
            REGISTRY.len(),
            "default features: all four"
        );
        for line in REGISTRY {
            let entry = line.backend.expect("compiled in");
            assert_eq!(entry.name, line.name);
            entry.check_version().unwrap();
            for form in entry.forms {
                let text = form.replace('N', "2");
                let spec: TransportSpec = text.parse().unwrap();
                assert_eq!(spec.entry().name, entry.name, "{form}");
            }
            let bare = TransportSpec::of(entry);
            assert_eq!(bare.to_string(), entry.name);
            assert_eq!(bare, entry.name.parse().unwrap());
        }
        assert_eq!(forms().len(), 8);
    }

    /// A backend outside the list: its entry is used directly.
    #[test]
    fn a_backend_of_your_own_is_used_through_its_entry() {
        static MINE: Backend = Backend {
            name: "mine",
            aliases: &[],
            forms: &["mine", "mine:vnodes=N"],
            options: OptionSchema::VirtualNodes {
                default: VirtualNodes::Count(1),
            },
            ..epcomm_transport_nvshmem::BACKEND
        };
        let spec = TransportSpec::of(&MINE).with_options(MINE.parse_options("vnodes=2").unwrap());
        assert_eq!(spec.to_string(), "mine:vnodes=2");
        assert_eq!(spec.world_layout(4, 3, 4).unwrap().nvlink_domain(), 2..4);
        // Not in the list: a spec string does not name it.
        let e = "mine".parse::<TransportSpec>().unwrap_err().to_string();
        assert!(e.contains("unknown transport"), "{e}");
    }

    #[test]
    fn single_host_env_names_each_variable_once() {
        let env = single_host_env_defaults(2, 2);
        for (i, (key, _)) in env.iter().enumerate() {
            assert!(!env[..i].iter().any(|(k, _)| k == key), "{key} twice");
        }
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
            assert_eq!(spec.entry().version, REGISTRY_VERSION);
        }
        assert_eq!(
            "nvlink-ipc".parse::<TransportSpec>().unwrap(),
            "ipc".parse::<TransportSpec>().unwrap()
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
        let executor = spec
            .limits()
            .executor
            .expect("the proxy reports its executor");
        assert_eq!(executor.moves_by, "copy engines");
        assert!(executor.ring_slots <= executor.max_ring_slots);
        assert!(!spec.limits().spans_hosts);
        let caps = spec.capabilities();
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
        assert_eq!(spec.virtual_nodes(), Some(VirtualNodes::OnePerGpu));
        assert_eq!(
            "proxy-verbs:vnodes=max"
                .parse::<TransportSpec>()
                .unwrap()
                .to_string(),
            "proxy-verbs"
        );
        assert_eq!(spec.backend(), "proxy-verbs");
        assert!(spec.needs_rdma_device() && !spec.needs_runtime_library());
        assert!(spec.limits().spans_hosts);
        assert!(
            !"proxy-ce"
                .parse::<TransportSpec>()
                .unwrap()
                .needs_rdma_device()
        );
        let caps = spec.capabilities();
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
        let ipc: TransportSpec = "ipc".parse().unwrap();
        assert_eq!(ipc.capabilities().routes, &[Route::Store]);
        assert_eq!(ipc.virtual_nodes(), None);
        assert!(ipc.with_virtual_nodes(VirtualNodes::Count(2)).is_err());
        assert_eq!(ipc.world_layout(4, 2, 4).unwrap().nvlink_domain(), 0..4);
        let err = ipc.world_layout(4, 2, 2).unwrap_err().to_string();
        assert!(err.contains("one host"), "{err}");

        let every: TransportSpec = "nvshmem:vnodes=max".parse().unwrap();
        assert!(every.capabilities().routes.contains(&Route::PutSignal));
        assert_eq!(every.world_layout(4, 2, 4).unwrap().nvlink_domain(), 2..3);
        let three: TransportSpec = "nvshmem:vnodes=3".parse().unwrap();
        let err = three.world_layout(4, 0, 4).unwrap_err().to_string();
        assert!(
            err.contains("vnodes=3 must divide the 4 GPUs per host"),
            "{err}"
        );
    }
}
