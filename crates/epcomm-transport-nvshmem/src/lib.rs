//! NVSHMEM transport: the symmetric buffer lives on NVSHMEM's symmetric heap
//! (`nvshmem_calloc`); its kernels (the `NvshmemDevice` family, device-linked with
//! `libnvshmem_device` and bound with `nvshmemx_cumodule_init`) reach peers inside the NVLink
//! domain through `nvshmem_ptr` mappings and every other peer with NVSHMEM put/signal.
//!
//! Setup (collective): rank 0 draws an NVSHMEM unique id, the bootstrap broadcasts it, every
//! rank initialises NVSHMEM with it (`nvshmemx_hostlib_init_attr`, through `nvshmem-sys`, which
//! dlopens `libnvshmem_host.so.3` — nothing links at build time). One runtime per process,
//! shared by every transport clone and allocation; finalised when the last one drops.
//!
//! Schedules: Global and Epoch. Routes: stores through `nvshmem_ptr` mappings and put/signal
//! (every peer outside the logical node; every peer under `RoutePolicy::PutSignal`).
//!
//! **Put sources**: the kernels put rows straight from caller arrays, which NVSHMEM's network
//! transports read only when registered; [`SymmetricMemory::prepare_put_source`] registers the
//! CUDA allocation holding each one with `nvshmemx_buffer_register`, once, also without a
//! network transport (docs/nvshmem.md, "Put sources: caller memory registered with NVSHMEM").
//!
//! **Virtual nodes** ([`NvshmemOptions::virtual_nodes`]): the GPUs of one host are split into
//! logical nodes and only peers in the same logical node get a mapping, so traffic between
//! logical nodes goes through NVSHMEM put/signal exactly as it would between hosts. This is how
//! the inter-node path is tested on one machine.
//!
//! On a host without an RDMA NIC set `NVSHMEM_REMOTE_TRANSPORT=none` and
//! `NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo`; keep `NVSHMEM_DISABLE_NVLS=1` ([`SINGLE_HOST_ENV`]).
//!
//! # Example
//!
//! Needs NVSHMEM 3.4, a GPU per rank and the other ranks of the job (so it is only compiled
//! here):
//!
//! ```no_run
//! use std::sync::Arc;
//!
//! use cudarc::driver::CudaContext;
//! use epcomm_bootstrap::{Bootstrap, BootstrapConfig};
//! use epcomm_transport::Transport;
//! use epcomm_transport_nvshmem::{NvshmemOptions, NvshmemTransport};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let boot = Arc::new(Bootstrap::connect(BootstrapConfig::from_env()?)?);
//! let ctx = CudaContext::new(boot.local_rank())?;
//! // Each host's GPUs split into 2 logical nodes: half the peers are reached by put/signal.
//! let options = NvshmemOptions { virtual_nodes: 2 };
//! let transport = NvshmemTransport::with_options(ctx, boot, options)?;
//! println!("rank {} of {}", transport.world().rank(), transport.world().world_size());
//! // Usually handed to the frontend: `epcomm::Buffer::new(ctx, Arc::new(transport), cfg)`.
//! # Ok(())
//! # }
//! ```

mod sources;

use std::sync::Arc;

use cudarc::driver::CudaContext;
use epcomm_transport::{
    Backend, BackendOptions, Bootstrap, Capabilities, DeviceRuntime, KernelFamily, Limits,
    LocatedLibrary, OptionSchema, REGISTRY_VERSION, Route, RuntimeLibrary, Schedule, SymmetricHeap,
    SymmetricMemory, Transport, TransportError, VirtualNodes, WorldLayout,
};
use nvshmem_sys::{ModuleRegistration, Nvshmem, SharedNvshmem, SymmetricAlloc, Version};

use crate::sources::PutSources;

fn backend(context: impl Into<String>) -> impl FnOnce(nvshmem_sys::Error) -> TransportError {
    let context = context.into();
    move |e| TransportError::Backend {
        backend: "nvshmem",
        context,
        source: Box::new(e),
    }
}

/// Makes `ctx` current on this thread (NVSHMEM's host calls act on the current context).
fn bind_context(ctx: &CudaContext) -> Result<(), TransportError> {
    ctx.bind_to_thread()
        .map_err(|source| TransportError::Driver {
            context: "binding the CUDA context".into(),
            source,
        })
}

fn boot_err(context: &str) -> impl FnOnce(epcomm_bootstrap::BootstrapError) -> TransportError + '_ {
    move |source| TransportError::Bootstrap {
        context: context.to_string(),
        source,
    }
}

/// A release as the bytes every rank gathers (three little-endian u32).
fn release_bytes(v: Version) -> Vec<u8> {
    [v.major, v.minor, v.patch]
        .iter()
        .flat_map(|p| p.to_le_bytes())
        .collect()
}

/// `Ok` when every rank's release (`gathered`, in rank order, as [`release_bytes`]) has
/// `mine`'s major.minor.
///
/// # Errors
/// [`TransportError::InvalidArgument`] naming `NVSHMEM release`, the first rank that differs,
/// both releases and the fix.
fn same_release(mine: Version, gathered: &[Vec<u8>]) -> Result<(), TransportError> {
    let word = |b: &[u8], i: usize| {
        b.get(4 * i..4 * i + 4)
            .and_then(|w| w.try_into().ok())
            .map(u32::from_le_bytes)
    };
    for (rank, b) in gathered.iter().enumerate() {
        let theirs = match (word(b, 0), word(b, 1), word(b, 2)) {
            (Some(major), Some(minor), Some(patch)) => Version {
                major,
                minor,
                patch,
            },
            _ => {
                return Err(TransportError::InvalidArgument {
                    argument: "NVSHMEM release",
                    rule: format!("rank {rank} sent {} bytes for its release, not 12", b.len()),
                });
            }
        };
        if !theirs.is_compatible_with(mine) {
            return Err(TransportError::InvalidArgument {
                argument: "NVSHMEM release",
                rule: format!(
                    "every rank must load the same NVSHMEM release: this rank loaded {mine}, \
                     rank {rank} loaded {theirs} (point every rank at one install, e.g. the \
                     same EPCOMM_NVSHMEM_LIB, or the same torch wheel)"
                ),
            });
        }
    }
    Ok(())
}

/// NVSHMEM environment for a job on one host, which needs no RDMA NIC: no remote transport,
/// the unique-id bootstrap on the loopback interface, NVLink multicast off. Launchers set each
/// one in their ranks' environment unless the user already did (NVSHMEM reads them at init).
pub const SINGLE_HOST_ENV: [(&str, &str); 3] = [
    ("NVSHMEM_REMOTE_TRANSPORT", "none"),
    ("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
];

/// Options of [`NvshmemTransport::with_options`]; every rank must pass the same values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NvshmemOptions {
    /// Logical nodes each host's GPUs are split into (1 = none). Peers in another logical node
    /// get no mapping and are reached with NVSHMEM put/signal.
    pub virtual_nodes: usize,
}

impl Default for NvshmemOptions {
    fn default() -> Self {
        Self { virtual_nodes: 1 }
    }
}

/// The NVSHMEM transport of one process (one GPU, one PE). Cheap to clone (shares the runtime
/// and the registrations of caller memory).
#[derive(Clone, Debug)]
pub struct NvshmemTransport {
    ctx: Arc<CudaContext>,
    bootstrap: Arc<Bootstrap>,
    rt: SharedNvshmem,
    world: WorldLayout,
    /// Caller memory registered as put sources, shared with every memory allocated here.
    sources: Arc<PutSources>,
}

impl NvshmemTransport {
    /// The world this transport sees for `world_size` ranks, `local_world_size` per host, seen
    /// from `rank`, with `options` (no GPU needed): each host's GPUs split into
    /// `options.virtual_nodes` logical nodes.
    ///
    /// # Errors
    /// [`TransportError::InvalidArgument`] naming `NvshmemOptions::virtual_nodes` unless it is
    /// positive and divides the GPUs per host, or the sizes are inconsistent.
    pub fn world_layout(
        world_size: usize,
        rank: usize,
        local_world_size: usize,
        options: NvshmemOptions,
    ) -> Result<WorldLayout, TransportError> {
        let n = options.virtual_nodes;
        WorldLayout::with_virtual_nodes(world_size, rank, local_world_size, n).map_err(|e| {
            let rule = match e {
                epcomm_transport::TopologyError::NotMultiple {
                    arg: "physical_gpus_per_node",
                    ..
                } => format!("vnodes={n} must divide the {local_world_size} GPUs per host"),
                other => other.to_string(),
            };
            TransportError::InvalidArgument {
                argument: "NvshmemOptions::virtual_nodes",
                rule,
            }
        })
    }

    /// [`NvshmemTransport::with_options`] with the default options (no virtual nodes).
    pub fn new(ctx: Arc<CudaContext>, bootstrap: Arc<Bootstrap>) -> Result<Self, TransportError> {
        Self::with_options(ctx, bootstrap, NvshmemOptions::default())
    }

    /// Loads NVSHMEM and initialises it over the bootstrap (collective). `ctx` is made current
    /// on this thread first (NVSHMEM binds to the current context).
    ///
    /// # Errors
    /// [`TransportError::InvalidArgument`] naming `virtual_nodes` unless it divides the GPUs
    /// per host; [`TransportError::Backend`] when NVSHMEM cannot be loaded (naming every place
    /// searched) or initialised.
    pub fn with_options(
        ctx: Arc<CudaContext>,
        bootstrap: Arc<Bootstrap>,
        options: NvshmemOptions,
    ) -> Result<Self, TransportError> {
        let layout = Self::world_layout(
            bootstrap.world_size(),
            bootstrap.rank(),
            bootstrap.local_world_size(),
            options,
        )?;
        let lib = nvshmem_sys::loader::load_default().map_err(|e| TransportError::Backend {
            backend: "nvshmem",
            context: "loading libnvshmem_host.so.3".into(),
            source: Box::new(e),
        })?;
        let (rank, world) = (bootstrap.rank(), bootstrap.world_size());
        // Every rank the same release: NVSHMEM's unique id and state are release-internal, and
        // each release runs kernels of its own.
        let mine = lib.version();
        let releases = bootstrap
            .all_gather("epcomm-nvshmem-release", &release_bytes(mine))
            .map_err(boot_err("gathering every rank's NVSHMEM release"))?;
        same_release(mine, &releases)?;
        let uid = if rank == 0 {
            Some(Nvshmem::get_uniqueid(&lib).map_err(backend("drawing a unique id"))?)
        } else {
            None
        };
        let uid = bootstrap
            .broadcast("epcomm-nvshmem-uid", 0, uid.as_deref())
            .map_err(boot_err("broadcasting the NVSHMEM unique id"))?;
        bind_context(&ctx)?;
        let rt = Nvshmem::init_with_uniqueid(Arc::new(lib), rank, world, &uid)
            .map_err(backend(format!("initialising PE {rank} of {world}")))?;
        let rt = SharedNvshmem::new(rt);
        Ok(Self {
            sources: Arc::new(PutSources::new(rt.clone(), ctx.clone())),
            ctx,
            bootstrap,
            rt,
            world: layout,
        })
    }

    /// The shared NVSHMEM runtime.
    pub fn runtime(&self) -> &SharedNvshmem {
        &self.rt
    }

    /// The caller allocations registered with NVSHMEM as put sources
    /// ([`SymmetricMemory::prepare_put_source`]) and still held by some memory of this
    /// transport, as `(start, bytes)`, in the order they were registered.
    pub fn registered_put_sources(&self) -> Vec<(u64, u64)> {
        self.sources
            .registered()
            .iter()
            .map(|a| (a.start, a.bytes))
            .collect()
    }
}

/// The capabilities of [`NvshmemTransport`].
pub const CAPABILITIES: Capabilities = Capabilities {
    name: "nvshmem",
    kernel_family: KernelFamily::NvshmemDevice,
    schedules: &Schedule::ALL,
    routes: &Route::ALL,
};

/// This backend's entry in the transport table: `nvshmem`, `nvshmem:vnodes=N`,
/// `nvshmem:vnodes=max` (no split by default).
pub const BACKEND: Backend = Backend {
    version: REGISTRY_VERSION,
    name: "nvshmem",
    aliases: &[],
    forms: &["nvshmem", "nvshmem:vnodes=N", "nvshmem:vnodes=max"],
    options: OptionSchema::VirtualNodes {
        default: VirtualNodes::Count(1),
    },
    capabilities: CAPABILITIES,
    limits: Limits {
        spans_hosts: true,
        executor: None,
    },
    runtime_library: Some(RuntimeLibrary {
        name: nvshmem_sys::loader::LIBRARY_NAME,
        locate: locate_library,
    }),
    needs_rdma_device: false,
    world_layout: |options, world_size, rank, local| {
        NvshmemTransport::world_layout(world_size, rank, local, options_of(options, local))
    },
    probe: probe_library,
    preflight: Backend::nothing_to_preflight,
    build: |options, ctx, bootstrap| {
        let options = options_of(options, bootstrap.local_world_size());
        Ok(Arc::new(NvshmemTransport::with_options(
            ctx, bootstrap, options,
        )?))
    },
    single_host_env: |_, _| {
        SINGLE_HOST_ENV
            .iter()
            .map(|&(key, value)| (key, value.to_string()))
            .collect()
    },
};

/// This machine's check: the NVSHMEM host library loads (the loader's search, cached for the
/// process: what `build` uses later).
///
/// # Errors
/// [`TransportError::Unavailable`] with every place the loader tried.
fn probe_library(_: BackendOptions) -> Result<(), TransportError> {
    nvshmem_sys::loader::load_default()
        .map(drop)
        .map_err(|e| TransportError::Unavailable {
            what: "nvshmem",
            why: e.to_string(),
        })
}

/// Where the NVSHMEM host library is found (the loader's search, cached for the process: what
/// `build` uses later) and its version ([`RuntimeLibrary::locate`]).
///
/// # Errors
/// [`TransportError::Unavailable`] with every place the loader tried.
fn locate_library() -> Result<LocatedLibrary, TransportError> {
    use nvshmem_sys::loader;
    let lib = loader::load_default().map_err(|e| TransportError::Unavailable {
        what: "nvshmem",
        why: e.to_string(),
    })?;
    Ok(LocatedLibrary {
        path: lib.path().display().to_string(),
        version: lib.version().to_string(),
        search: format!(
            "searched, in order: ${env} (directory or file), $NVSHMEM_HOME/lib, the system \
             dynamic loader (LD_LIBRARY_PATH at process start, ld.so.cache, default \
             directories), each $LD_LIBRARY_PATH entry, python3's site-packages \
             (nvidia/nvshmem/lib), the workspace's CUDA toolchain; set {env} to the directory \
             holding {name} to choose one",
            env = loader::ENV_EPCOMM_NVSHMEM_LIB,
            name = loader::LIBRARY_NAME
        ),
    })
}

/// The transport's options from a spec's, for hosts of `local` GPUs.
fn options_of(options: BackendOptions, local: usize) -> NvshmemOptions {
    NvshmemOptions {
        virtual_nodes: options.virtual_nodes.per_host(local),
    }
}

impl Transport for NvshmemTransport {
    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }

    fn world(&self) -> WorldLayout {
        self.world
    }

    fn bootstrap(&self) -> &Arc<Bootstrap> {
        &self.bootstrap
    }
}

impl SymmetricHeap for NvshmemTransport {
    type Memory = NvshmemMemory;

    fn alloc_symmetric(&self, bytes: usize) -> Result<NvshmemMemory, TransportError> {
        bind_context(&self.ctx)?;
        let alloc = SymmetricAlloc::zeroed(&self.rt, bytes)
            .map_err(backend(format!("allocating {bytes} symmetric bytes")))?;
        // Peers outside my (logical) node get no mapping: the kernels put/signal to them.
        let domain = self.world.nvlink_domain();
        let bases = (0..self.rt.n_pes())
            .map(|pe| match domain.contains(&(pe as usize)) {
                true => alloc.peer_ptr(pe).unwrap_or(0),
                false => 0,
            })
            .collect();
        // nvshmem_calloc zeroes on the device; make sure that finished before peers may write.
        self.ctx
            .synchronize()
            .map_err(|source| TransportError::Driver {
                context: "waiting for the symmetric heap's zeroing".into(),
                source,
            })?;
        Ok(NvshmemMemory {
            user: self.sources.new_user(),
            sources: self.sources.clone(),
            bases,
            alloc,
        })
    }
}

impl DeviceRuntime for NvshmemTransport {
    type ModuleBinding = ModuleRegistration;

    unsafe fn bind_module(
        &self,
        module: cudarc::driver::sys::CUmodule,
    ) -> Result<ModuleRegistration, TransportError> {
        bind_context(&self.ctx)?;
        // SAFETY: the caller guarantees the module is live, of the NvshmemDevice family (linked
        // against the libnvshmem_device of `device_library`'s release, the checked host
        // library's) and outlives the registration.
        unsafe { ModuleRegistration::new(&self.rt, module.cast()) }.map_err(backend(
            "registering the kernel module (nvshmemx_cumodule_init)",
        ))
    }

    /// The loaded host library's release: its kernels must be device-linked against it.
    fn device_library(&self) -> Option<(u32, u32)> {
        Some(self.rt.with(|rt| rt.library().version().release()))
    }
}

/// A symmetric buffer on the NVSHMEM heap. Dropping it unregisters the caller memory it
/// registered as put sources that no other memory of the transport uses, then frees the buffer
/// (collectively).
#[derive(Debug)]
pub struct NvshmemMemory {
    /// This memory's number among the users of `sources`.
    user: u64,
    sources: Arc<PutSources>,
    bases: Vec<u64>,
    alloc: SymmetricAlloc,
}

impl NvshmemMemory {
    /// Whether `[addr, addr + bytes)` lies inside this buffer.
    fn holds(&self, addr: u64, bytes: usize) -> bool {
        let base = self.alloc.ptr();
        addr >= base
            && addr
                .checked_add(bytes as u64)
                .is_some_and(|end| end <= base + self.alloc.len() as u64)
    }
}

impl SymmetricMemory for NvshmemMemory {
    fn len(&self) -> usize {
        self.alloc.len()
    }

    fn local_base(&self) -> u64 {
        self.alloc.ptr()
    }

    fn peer_base(&self, peer: usize) -> Option<u64> {
        self.bases.get(peer).copied().filter(|&b| b != 0)
    }

    /// Registers the CUDA allocation holding the caller's array with NVSHMEM
    /// (`nvshmemx_buffer_register`), once: NVSHMEM's network transports put only from
    /// symmetric or registered memory. Memory in the symmetric heap needs nothing. See the
    /// crate docs.
    fn prepare_put_source(
        &self,
        argument: &'static str,
        addr: u64,
        bytes: usize,
    ) -> Result<(), TransportError> {
        if bytes == 0 || self.holds(addr, bytes) {
            return Ok(());
        }
        self.sources.prepare(self.user, argument, addr, bytes)
    }

    fn free_is_collective(&self) -> bool {
        true // nvshmem_free is a collective over every PE
    }
}

impl Drop for NvshmemMemory {
    fn drop(&mut self) {
        // Before the buffer is freed (the fields drop after this): this memory's ops are over.
        self.sources.release(self.user);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_runtime_library_is_where_the_loader_finds_it() {
        let library = BACKEND
            .runtime_library
            .expect("nvshmem loads a runtime library");
        assert_eq!(library.name, nvshmem_sys::loader::LIBRARY_NAME);
        match ((library.locate)(), nvshmem_sys::loader::load_default()) {
            (Ok(found), Ok(lib)) => {
                // The loader keeps the process's first load: a later call may name the file by
                // its soname alone (the system loader then finds the mapped one).
                assert!(
                    found.path.ends_with(nvshmem_sys::loader::LIBRARY_NAME),
                    "{found:?}"
                );
                assert_eq!(found.version, lib.version().to_string());
                assert!(
                    found
                        .search
                        .contains(nvshmem_sys::loader::ENV_EPCOMM_NVSHMEM_LIB)
                );
            }
            (Err(TransportError::Unavailable { what, why }), Err(e)) => {
                assert_eq!(what, "nvshmem");
                assert_eq!(why, e.to_string());
            }
            (located, loader) => panic!(
                "locate ({located:?}) disagrees with the loader ({:?})",
                loader.map(drop)
            ),
        }
    }

    #[test]
    fn the_probe_is_the_loaders_verdict() {
        let options = BackendOptions {
            virtual_nodes: VirtualNodes::Count(1),
        };
        match (
            (BACKEND.probe)(options),
            nvshmem_sys::loader::load_default(),
        ) {
            (Ok(()), Ok(_)) => {}
            (Err(TransportError::Unavailable { what, why }), Err(e)) => {
                assert_eq!(what, "nvshmem");
                assert_eq!(why, e.to_string());
            }
            (probe, loader) => panic!(
                "the probe ({probe:?}) disagrees with the loader ({:?})",
                loader.map(drop)
            ),
        }
    }

    fn v(major: u32, minor: u32, patch: u32) -> Version {
        Version {
            major,
            minor,
            patch,
        }
    }

    #[test]
    fn every_rank_must_load_the_same_release() {
        let mine = v(3, 4, 5);
        let same = vec![release_bytes(v(3, 4, 5)), release_bytes(v(3, 4, 0))];
        assert!(
            same_release(mine, &same).is_ok(),
            "patch releases may differ"
        );
        let other = vec![release_bytes(mine), release_bytes(v(3, 7, 2))];
        let msg = same_release(mine, &other).unwrap_err().to_string();
        assert!(msg.contains("NVSHMEM release"), "{msg}");
        assert!(msg.contains("rank 1 loaded 3.7.2"), "{msg}");
        assert!(msg.contains("this rank loaded 3.4.5"), "{msg}");
        let short = vec![release_bytes(mine), vec![3, 0, 0, 0]];
        let msg = same_release(mine, &short).unwrap_err().to_string();
        assert!(msg.contains("rank 1 sent 4 bytes"), "{msg}");
    }
}
