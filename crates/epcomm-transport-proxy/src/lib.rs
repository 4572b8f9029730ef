//! The CPU-proxy transport of epcomm, with the copy-engine executor.
//!
//! Kernels of the proxy image ([`KernelFamily::CpuProxy`], `ProxyNet` in
//! `kernels/common/net_proxy.cuh`) reach the peers whose route is [`Route::PutSignal`] by writing
//! 32-byte descriptors (transfer, inline write, signal) into a ring in host-mapped memory. One
//! proxy thread per buffer ([`epcomm_proxy::Proxy`]) takes them in ring order and executes them
//! on a [`CopyEngineExecutor`]: `cuMemcpyAsync` and stream memory operations on one stream per
//! peer, between CUDA-IPC-mapped buffers. The bytes move on the copy engines, not on SMs; the
//! kernel's SMs only write descriptors and wait for completions.
//!
//! Peers in this rank's logical node are reached by stores through their mapping, as with the
//! IPC transport; [`ProxyOptions::virtual_nodes`] decides the split (the default, one logical
//! node per GPU, sends every peer's bytes through the copy engines).
//!
//! With the feature `verbs`, the module `verbs` adds the `proxy-verbs` transport: the same
//! ring, proxy thread and kernels, executed with RDMA WRITEs (`epcomm_proxy::verbs`), so
//! ranks may span hosts.
//!
//! # Who touches what
//! * The ring: the kernels (producers, many threads) and the proxy thread (consumer), through
//!   the ring protocol only (docs/proxy.md).
//! * The counters (device memory): the kernels only.
//! * Peers' buffers: the kernels (store route) and this rank's proxy thread (proxy route), as
//!   the protocol allows; the proxy thread is stopped before the mappings are closed.
//!
//! # The caller's part: no blocking copy while an op is in flight
//!
//! The proxy thread issues its copies through the process's CUDA driver. While another thread
//! of the process is inside a synchronous copy that waits for an op of this transport (a
//! `cuMemcpyDtoH` into pageable memory, or a copy on a stream ordered after the op), the proxy's
//! next copy call waits for that copy, so the op, and the copy, stop until the op's timeout
//! (measured: docs/proxy.md, "a blocking copy in another thread stalls the proxy"). Finish the
//! op first: synchronize the buffer, or poll an event recorded after it. The Python package does
//! this for its synchronous ops.
//!
//! # Example
//!
//! What it declares needs no GPU:
//!
//! ```
//! use epcomm_transport::{KernelFamily, Route};
//!
//! let caps = epcomm_transport_proxy::CAPABILITIES;
//! assert_eq!(caps.kernel_family, KernelFamily::CpuProxy);
//! assert!(caps.routes.contains(&Route::PutSignal));
//! ```

mod copy_engine;
mod core;
mod fifo;
mod trace;
#[cfg(feature = "verbs")]
pub mod verbs;
mod watch;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use cudarc::driver::CudaContext;
use epcomm_abi as abi;
use epcomm_proxy::{ProxyReport, ring};
use epcomm_transport::{
    Backend, BackendOptions, Bootstrap, Capabilities, DeviceRuntime, ExecutorLimits, KernelFamily,
    Limits, OptionSchema, REGISTRY_VERSION, Route, Schedule, SymmetricHeap, SymmetricMemory,
    Transport, TransportError, VirtualNodes, WorldLayout,
};

use crate::core::{ProxyCore, RingParts};
use epcomm_transport_ipc::{IpcMemory, IpcTransport};

pub use copy_engine::{
    CopyEngineError, CopyEngineExecutor, DEFAULT_QUEUE_DEPTH, MAX_COPY_STREAMS, MAX_LINGER,
    MAX_QUERY_INTERVAL, MAX_QUEUE_DEPTH, STRIPE_MIN_BYTES,
};
pub use watch::{CallWatch, CopyKinds, Moment, TIMELINE_CAPACITY};

// The kernel side (abi.cuh) and the proxy crate must agree on the ring layout.
const _: () = {
    assert!(abi::RING_HEADER_BYTES as usize == ring::HEADER_BYTES);
    assert!(abi::RING_SLOT_BYTES as usize == ring::SLOT_BYTES);
    assert!(abi::RING_TAIL_OFFSET as usize == ring::OFFSET_TAIL);
    assert!(abi::RING_COMPLETED_OFFSET as usize == ring::OFFSET_COMPLETED);
    assert!(abi::RING_STATUS_OFFSET as usize == ring::OFFSET_STATUS);
    assert!(abi::PROXY_KIND_TRANSFER == epcomm_proxy::descriptor::KIND_TRANSFER as u64);
    assert!(abi::PROXY_KIND_SIGNAL == epcomm_proxy::descriptor::KIND_SIGNAL as u64);
    assert!(abi::PROXY_KIND_WRITE == epcomm_proxy::descriptor::KIND_WRITE as u64);
    assert!(
        abi::PROXY_FLAG_SRC_ADDRESS == epcomm_proxy::descriptor::TRANSFER_FLAG_SRC_ADDRESS as u64
    );
    assert!(abi::PROXY_FLAG_SIGNAL_ADD == epcomm_proxy::descriptor::SIGNAL_FLAG_ADD as u64);
    assert!(abi::PROXY_FLAG_WRITE_SEQUENCE == epcomm_proxy::descriptor::WRITE_FLAG_SEQUENCE as u64);
};

/// The capabilities of [`ProxyTransport`].
pub const CAPABILITIES: Capabilities = Capabilities {
    name: "proxy-ce",
    kernel_family: KernelFamily::CpuProxy,
    schedules: &Schedule::ALL,
    routes: &[Route::Store, Route::PutSignal],
};

/// The environment variables [`ProxyOptions::from_env`] reads.
pub const PROXY_ENV: &[&str] = &[
    "EPCOMM_PROXY_RING_SLOTS",
    "EPCOMM_PROXY_MAX_IN_FLIGHT",
    "EPCOMM_PROXY_MIRROR",
    "EPCOMM_PROXY_BATCH",
    "EPCOMM_PROXY_COPY_DEPTH",
    "EPCOMM_PROXY_COPY_STREAMS",
    "EPCOMM_PROXY_COPY_LINGER_US",
    "EPCOMM_PROXY_QUERY_US",
    "EPCOMM_PROXY_TRACE",
];

/// The proxy's executor bounds, by default, with `moves_by` saying what moves the bytes and
/// `env` the variables that tune it.
pub(crate) const fn executor_limits(
    moves_by: &'static str,
    env: &'static [&'static str],
) -> ExecutorLimits {
    let defaults = ProxyOptions::one_node_per_rank(1);
    ExecutorLimits {
        moves_by,
        ring_slots: defaults.ring_slots,
        max_ring_slots: ring::MAX_CAPACITY,
        max_in_flight: defaults.max_in_flight,
        env,
    }
}

/// This backend's entry in the transport table: `proxy-ce` (every peer through the copy
/// engines), `proxy-ce:vnodes=N` (stores inside each of `N` logical nodes per host).
pub const BACKEND: Backend = Backend {
    version: REGISTRY_VERSION,
    name: "proxy-ce",
    aliases: &[],
    forms: &["proxy-ce", "proxy-ce:vnodes=N"],
    options: OptionSchema::VirtualNodes {
        default: VirtualNodes::OnePerGpu,
    },
    capabilities: CAPABILITIES,
    limits: Limits {
        spans_hosts: false,
        executor: Some(executor_limits("copy engines", PROXY_ENV)),
    },
    runtime_library: None,
    needs_rdma_device: false,
    world_layout: |options, world_size, rank, local| {
        ProxyTransport::world_layout(
            world_size,
            rank,
            local,
            options.virtual_nodes.per_host(local),
        )
    },
    probe: Backend::nothing_to_probe,
    preflight: Backend::nothing_to_preflight,
    build: build_copy_engine,
    single_host_env: |ranks_per_gpu, local_ranks| {
        single_host_env(ranks_per_gpu, local_ranks).into()
    },
};

/// [`BACKEND`]'s build: the options from the environment, the spec's split.
fn build_copy_engine(
    options: BackendOptions,
    ctx: Arc<CudaContext>,
    bootstrap: Arc<Bootstrap>,
) -> Result<Arc<dyn epcomm_transport::DynTransport>, TransportError> {
    let local = bootstrap.local_world_size();
    let mut proxy = ProxyOptions::from_env(local)?;
    proxy.virtual_nodes = options.virtual_nodes.per_host(local);
    Ok(Arc::new(ProxyTransport::new(ctx, bootstrap, proxy)?))
}

/// How the proxy transport is set up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProxyOptions {
    /// Logical nodes each host's GPUs are split into: peers in this rank's logical node are
    /// reached by stores, every other peer through the proxy. Must divide the ranks per host.
    pub virtual_nodes: usize,
    /// Ring slots (a power of two): descriptors the kernels may write ahead of the proxy.
    pub ring_slots: u64,
    /// Operations outstanding in the copy engines before the proxy stops taking descriptors.
    pub max_in_flight: usize,
    /// Longest one operation may stay in the copy engines before the proxy fails.
    pub op_timeout: Duration,
    /// Longest a kernel waits for a free ring slot before it fails the op.
    pub slot_timeout: Duration,
    /// CPU to pin the proxy thread to (`None`: left to the OS).
    pub cpu: Option<usize>,
    /// Mirror the ring's progress into device memory for the kernels to poll
    /// ([`CopyEngineExecutor::mirror_progress`]); off, kernels read the ring's host words.
    pub mirror_progress: bool,
    /// Hand copies to the driver in batches ([`CopyEngineExecutor::set_batch_copies`]); off
    /// (the default), one `cuMemcpyAsync` per copy. **Off by default because batches lost
    /// copies**: a 16 384-token dispatch (hidden 256, top-3, two ranks on one GPU) received
    /// zero rows where data was due with batches, and passed bit for bit with one call per
    /// copy (docs/proxy.md, "Status"). For diagnosis only until that is understood.
    pub batch_copies: bool,
    /// Batches of copies each peer's stream may hold in the copy engines before the proxy
    /// keeps new copies back to merge them ([`CopyEngineExecutor::set_queue_depth`]), in
    /// `1..=`[`MAX_QUEUE_DEPTH`]; default [`DEFAULT_QUEUE_DEPTH`]. [`MAX_QUEUE_DEPTH`] hands
    /// copies over at almost every poll (as before the depth existed, unless 64 batches run).
    pub copy_queue_depth: usize,
    /// Streams per peer that a batch's large independent copies are spread over, so several
    /// copy engines move one peer's bytes ([`CopyEngineExecutor::set_copy_streams`]), in
    /// `1..=`[`MAX_COPY_STREAMS`]; default 1. Each takes a hardware queue
    /// (`CUDA_DEVICE_MAX_CONNECTIONS`, [`check_copy_stream_queues`]).
    pub copy_streams: usize,
    /// How long each peer's lane keeps its first pending copy before handing copies to the
    /// driver, so the runs other warps post meanwhile merge with it
    /// ([`CopyEngineExecutor::set_linger`]); at most [`MAX_LINGER`], default zero (hand over
    /// at the first poll).
    pub copy_linger: Duration,
    /// While descriptors keep arriving, how often at most the copy-engine executor looks for
    /// completed copies ([`CopyEngineExecutor::set_query_interval`]); at most
    /// [`MAX_QUERY_INTERVAL`], default zero (at every poll). A poll after which nothing new
    /// arrived always looks.
    pub copy_query_interval: Duration,
    /// Diagnostics on stderr: 0 none, 1 the proxy's report when a buffer's proxy stops, 2 also
    /// a live trace of the ring several times a second, 3 the report and the copy-engine
    /// executor's timeline (every round that took work, hand-over and completion) written to
    /// a file in the temporary directory, named in the report (docs/proxy.md, "Diagnostics").
    pub trace: u8,
}

/// The world of both proxy transports: each host's ranks split into `virtual_nodes` logical
/// nodes (stores inside one, the proxy between them).
///
/// # Errors
/// [`TransportError::InvalidArgument`] naming `ProxyOptions::virtual_nodes` unless it divides
/// the ranks per host.
fn split_hosts(
    world_size: usize,
    rank: usize,
    local_world_size: usize,
    virtual_nodes: usize,
) -> Result<WorldLayout, TransportError> {
    WorldLayout::with_virtual_nodes(world_size, rank, local_world_size, virtual_nodes).map_err(
        |e| TransportError::InvalidArgument {
            argument: "ProxyOptions::virtual_nodes",
            rule: format!(
                "vnodes={virtual_nodes} must divide the {local_world_size} ranks per host ({e})"
            ),
        },
    )
}

/// The value of the environment variable `name` among `allowed` (trimmed), `None` when unset.
///
/// # Errors
/// [`TransportError::InvalidArgument`] naming the variable when it is set to anything else.
fn env_choice(name: &'static str, allowed: &[&str]) -> Result<Option<u8>, TransportError> {
    match std::env::var(name) {
        Err(_) => Ok(None),
        Ok(v) => parse_choice(name, &v, allowed),
    }
}

/// `value` of `name` as a whole number of microseconds (zero allowed).
///
/// # Errors
/// [`TransportError::InvalidArgument`] naming the variable when it is not one.
fn parse_micros(name: &'static str, value: &str) -> Result<Duration, TransportError> {
    value
        .trim()
        .parse::<u64>()
        .map(Duration::from_micros)
        .map_err(|_| TransportError::InvalidArgument {
            argument: name,
            rule: format!("must be a whole number of microseconds (got {value:?})"),
        })
}

/// `value` of `name` as its index in `allowed`.
fn parse_choice(
    name: &'static str,
    value: &str,
    allowed: &[&str],
) -> Result<Option<u8>, TransportError> {
    match allowed.iter().position(|a| *a == value.trim()) {
        Some(i) => Ok(Some(i as u8)),
        None => Err(TransportError::InvalidArgument {
            argument: name,
            rule: format!("must be one of {} (got {value:?})", allowed.join(", ")),
        }),
    }
}

impl ProxyOptions {
    /// Defaults for `local_world_size` ranks per host: one logical node per rank (every peer
    /// through the copy engines), 65536 ring slots, 16384 operations in flight, 10 s bounds.
    pub const fn one_node_per_rank(local_world_size: usize) -> Self {
        Self {
            virtual_nodes: if local_world_size > 1 {
                local_world_size
            } else {
                1
            },
            ring_slots: 1 << 16,
            max_in_flight: 1 << 14,
            op_timeout: Duration::from_secs(10),
            slot_timeout: Duration::from_secs(10),
            cpu: None,
            mirror_progress: true,
            batch_copies: false,
            copy_queue_depth: DEFAULT_QUEUE_DEPTH,
            copy_streams: 1,
            copy_linger: Duration::ZERO,
            copy_query_interval: Duration::ZERO,
            trace: 0,
        }
    }

    /// [`Self::one_node_per_rank`], with `EPCOMM_PROXY_RING_SLOTS` and
    /// `EPCOMM_PROXY_MAX_IN_FLIGHT` overriding the two sizes when set,
    /// `EPCOMM_PROXY_MIRROR=0` turning the progress mirror off, `EPCOMM_PROXY_BATCH=1` the
    /// batched copies on (a diagnostic: see [`Self::batch_copies`]), `EPCOMM_PROXY_COPY_DEPTH`
    /// setting [`Self::copy_queue_depth`], `EPCOMM_PROXY_COPY_STREAMS` [`Self::copy_streams`],
    /// `EPCOMM_PROXY_COPY_LINGER_US` [`Self::copy_linger`] in microseconds (0 allowed),
    /// `EPCOMM_PROXY_QUERY_US` [`Self::copy_query_interval`] likewise, and
    /// `EPCOMM_PROXY_TRACE=1|2|3` the diagnostics on.
    ///
    /// # Errors
    /// [`TransportError::InvalidArgument`] naming the variable when its value is not a
    /// positive integer (the switches: not `0` or `1`; `EPCOMM_PROXY_TRACE`: not 0 to 3).
    pub fn from_env(local_world_size: usize) -> Result<Self, TransportError> {
        let mut options = Self::one_node_per_rank(local_world_size);
        let var = |name: &'static str| -> Result<Option<u64>, TransportError> {
            match std::env::var(name) {
                Err(_) => Ok(None),
                Ok(v) => match v.trim().parse::<u64>() {
                    Ok(n) if n > 0 => Ok(Some(n)),
                    _ => Err(TransportError::InvalidArgument {
                        argument: name,
                        rule: format!("must be a positive integer (got {v:?})"),
                    }),
                },
            }
        };
        if let Some(n) = var("EPCOMM_PROXY_RING_SLOTS")? {
            options.ring_slots = n;
        }
        if let Some(n) = var("EPCOMM_PROXY_MAX_IN_FLIGHT")? {
            options.max_in_flight = usize::try_from(n).unwrap_or(usize::MAX);
        }
        if let Some(on) = env_choice("EPCOMM_PROXY_MIRROR", &["0", "1"])? {
            options.mirror_progress = on == 1;
        }
        if let Some(on) = env_choice("EPCOMM_PROXY_BATCH", &["0", "1"])? {
            options.batch_copies = on == 1;
        }
        if let Some(n) = var("EPCOMM_PROXY_COPY_DEPTH")? {
            options.copy_queue_depth = usize::try_from(n).unwrap_or(usize::MAX);
        }
        if let Some(n) = var("EPCOMM_PROXY_COPY_STREAMS")? {
            options.copy_streams = usize::try_from(n).unwrap_or(usize::MAX);
        }
        if let Ok(v) = std::env::var("EPCOMM_PROXY_COPY_LINGER_US") {
            options.copy_linger = parse_micros("EPCOMM_PROXY_COPY_LINGER_US", &v)?;
        }
        if let Ok(v) = std::env::var("EPCOMM_PROXY_QUERY_US") {
            options.copy_query_interval = parse_micros("EPCOMM_PROXY_QUERY_US", &v)?;
        }
        if let Some(level) = env_choice("EPCOMM_PROXY_TRACE", &["0", "1", "2", "3"])? {
            options.trace = level;
        }
        Ok(options)
    }

    /// Checks every rule (no GPU needed).
    ///
    /// # Errors
    /// [`TransportError::InvalidArgument`] naming the field: `ring_slots` a power of two in
    /// `2..=2^24`, `max_in_flight` and both bounds above zero, `virtual_nodes` above zero,
    /// `copy_queue_depth` in `1..=`[`MAX_QUEUE_DEPTH`], `copy_linger` at most [`MAX_LINGER`],
    /// `copy_query_interval` at most [`MAX_QUERY_INTERVAL`].
    pub fn validate(&self) -> Result<(), TransportError> {
        let bad = |argument, rule: String| Err(TransportError::InvalidArgument { argument, rule });
        if let Err(e) = ring::region_bytes(self.ring_slots) {
            return bad("ProxyOptions::ring_slots", e.to_string());
        }
        if self.max_in_flight == 0 {
            return bad("ProxyOptions::max_in_flight", "must be > 0".into());
        }
        if self.op_timeout.is_zero() {
            return bad("ProxyOptions::op_timeout", "must be > 0".into());
        }
        if self.slot_timeout.is_zero() {
            return bad("ProxyOptions::slot_timeout", "must be > 0".into());
        }
        if self.virtual_nodes == 0 {
            return bad("ProxyOptions::virtual_nodes", "must be > 0".into());
        }
        if !(1..=MAX_QUEUE_DEPTH).contains(&self.copy_queue_depth) {
            return bad(
                "ProxyOptions::copy_queue_depth",
                format!(
                    "must be in 1..={MAX_QUEUE_DEPTH} (got {})",
                    self.copy_queue_depth
                ),
            );
        }
        if !(1..=MAX_COPY_STREAMS).contains(&self.copy_streams) {
            return bad(
                "ProxyOptions::copy_streams",
                format!(
                    "must be in 1..={MAX_COPY_STREAMS} (got {})",
                    self.copy_streams
                ),
            );
        }
        if self.copy_linger > MAX_LINGER {
            return bad(
                "ProxyOptions::copy_linger",
                format!(
                    "must be at most {MAX_LINGER:?} (got {:?})",
                    self.copy_linger
                ),
            );
        }
        if self.copy_query_interval > MAX_QUERY_INTERVAL {
            return bad(
                "ProxyOptions::copy_query_interval",
                format!(
                    "must be at most {MAX_QUERY_INTERVAL:?} (got {:?})",
                    self.copy_query_interval
                ),
            );
        }
        if self.trace > 3 {
            return bad(
                "ProxyOptions::trace",
                format!("must be 0, 1, 2 or 3 (got {})", self.trace),
            );
        }
        Ok(())
    }
}

/// The CPU-proxy transport of one process (one GPU): symmetric buffers shared through CUDA IPC
/// (every rank on one host), proxied peers reached through the copy engines.
#[derive(Debug)]
pub struct ProxyTransport {
    ipc: IpcTransport,
    world: WorldLayout,
    options: ProxyOptions,
}

impl ProxyTransport {
    /// The world for `world_size` ranks, `local_world_size` per host, seen from `rank`, split
    /// into `virtual_nodes` logical nodes per host (no GPU needed).
    ///
    /// # Errors
    /// [`TransportError::InvalidArgument`] naming `world` unless every rank is on one host, or
    /// naming `ProxyOptions::virtual_nodes` unless it divides the ranks per host.
    pub fn world_layout(
        world_size: usize,
        rank: usize,
        local_world_size: usize,
        virtual_nodes: usize,
    ) -> Result<WorldLayout, TransportError> {
        IpcTransport::world_layout(world_size, rank, local_world_size)?;
        split_hosts(world_size, rank, local_world_size, virtual_nodes)
    }

    /// Builds the transport over an initialised bootstrap.
    ///
    /// # Errors
    /// As [`Self::world_layout`] and [`ProxyOptions::validate`].
    pub fn new(
        ctx: Arc<CudaContext>,
        bootstrap: Arc<Bootstrap>,
        options: ProxyOptions,
    ) -> Result<Self, TransportError> {
        let world = Self::world_layout(
            bootstrap.world_size(),
            bootstrap.rank(),
            bootstrap.local_world_size(),
            options.virtual_nodes,
        )?;
        options.validate()?;
        Ok(Self {
            ipc: IpcTransport::new(ctx, bootstrap)?,
            world,
            options,
        })
    }
}

/// Which ranks of a `world` a buffer of rank `me` copies to (one copy stream each): those among
/// `peers` (the ranks its ops reach) outside `me`'s NVLink domain, which stores reach.
fn copy_lanes(
    world: usize,
    me: usize,
    domain: &std::ops::Range<usize>,
    peers: &[usize],
) -> Vec<bool> {
    (0..world)
        .map(|p| p != me && !domain.contains(&p) && peers.contains(&p))
        .collect()
}

/// What a local launcher sets for the copy-engine proxy's ranks unless the environment does:
/// enough hardware queues for its streams ([`check_copy_stream_queues`]), with `local_ranks`
/// ranks on this host and `ranks_per_gpu` of them sharing each GPU.
///
/// 32 queues (the most the driver gives) while at most two ranks share a GPU. With more, 64
/// divided among them (16 for four ranks), but not fewer than one buffer's streams
/// (`local_ranks + 1`: a copy stream per other rank, the progress mirror's and the ops'), and
/// at most 32, as long as the ranks of a GPU then ask for at most [`MPS_POOL_KNOWN_GOOD`]
/// queues together. Under MPS the clients of a GPU draw their queues from one pool: four ranks
/// on one GPU asking 32 each failed to create their CUDA contexts
/// (`CUDA_ERROR_OUT_OF_MEMORY`), sixteen asking 17 each failed with
/// `CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED`, while four asking 16, two asking 32 and eight
/// asking 9 ran. Beyond that pool the context of every rank comes first: each gets its share
/// of 64 (at least 1), and a copy-engine proxy buffer that needs more queues is refused with
/// its own error ([`check_copy_stream_queues`]) instead of every context failing.
pub fn single_host_env(ranks_per_gpu: usize, local_ranks: usize) -> [(&'static str, String); 1] {
    let share = (64 / ranks_per_gpu.max(1)).clamp(1, MAX_QUEUES);
    let floor = local_ranks.saturating_add(1).min(MAX_QUEUES);
    let queues = if ranks_per_gpu <= 2 {
        MAX_QUEUES
    } else if floor.saturating_mul(ranks_per_gpu) <= MPS_POOL_KNOWN_GOOD {
        share.max(floor)
    } else {
        share
    };
    [("CUDA_DEVICE_MAX_CONNECTIONS", queues.to_string())]
}

/// The most hardware queues the ranks sharing one GPU under MPS were seen to get together
/// (eight ranks asking 9 each): [`single_host_env`] keeps their sum at most this whenever one
/// buffer's streams allow it.
pub const MPS_POOL_KNOWN_GOOD: usize = 72;

/// The most hardware queues the driver gives a process (`CUDA_DEVICE_MAX_CONNECTIONS`).
const MAX_QUEUES: usize = 32;

/// The streams of every live [`ProxyMemory`] of this process that need a hardware queue each
/// (its executor's lanes and progress mirror, and its ops' stream):
/// [`check_copy_stream_queues`].
static LIVE_COPY_STREAMS: AtomicUsize = AtomicUsize::new(0);

/// Counts a buffer's streams in [`LIVE_COPY_STREAMS`] until dropped.
#[derive(Debug)]
struct CopyStreams(usize);

impl CopyStreams {
    fn live() -> usize {
        LIVE_COPY_STREAMS.load(Ordering::Relaxed)
    }

    fn count(n: usize) -> Self {
        LIVE_COPY_STREAMS.fetch_add(n, Ordering::Relaxed);
        Self(n)
    }
}

impl Drop for CopyStreams {
    fn drop(&mut self) {
        LIVE_COPY_STREAMS.fetch_sub(self.0, Ordering::Relaxed);
    }
}

/// Hardware queues (`CUDA_DEVICE_MAX_CONNECTIONS`) a process gets when the variable is not set
/// and it does not run under MPS.
const DEFAULT_QUEUES: usize = 8;

/// Refuses copy-engine executors whose streams could share a hardware queue with a kernel
/// that waits for them.
///
/// The driver maps a process's streams onto a fixed number of hardware queues
/// (`CUDA_DEVICE_MAX_CONNECTIONS`, 8 by default, at most 32; under MPS the clients of a server
/// share one pool and the default per client is smaller). Work on one queue runs in order, so
/// a copy whose stream shares the queue of the stream running an epcomm kernel waits for that
/// kernel to end, while the kernel waits for the copy: both stop until the op's timeout.
/// Measured with two ranks on one GPU: under MPS with the default the first ops stalled;
/// without MPS and `CUDA_DEVICE_MAX_CONNECTIONS=1` the first op stalled; under MPS with 32
/// every test passed. `streams`: the streams of this process's proxy buffers that must each
/// have a queue (per buffer its copy streams, one per proxied peer and one progress mirror,
/// and the stream its ops run on); under MPS the variable must be set. Necessary, not
/// sufficient: other streams of the process take queues too, so set it to 32 where the GPU
/// allows (the launchers of this workspace do, [`single_host_env`]). The count is per
/// process, not per GPU.
///
/// # Errors
/// [`TransportError::InvalidArgument`] naming `CUDA_DEVICE_MAX_CONNECTIONS`, with the number
/// of queues needed.
pub fn check_copy_stream_queues(
    streams: usize,
    connections: Option<&str>,
    under_mps: bool,
) -> Result<(), TransportError> {
    if streams == 0 {
        return Ok(());
    }
    let fail = |why: String| TransportError::InvalidArgument {
        argument: "CUDA_DEVICE_MAX_CONNECTIONS",
        rule: format!(
            "{why}: the copy-engine proxy buffers of this process need {streams} hardware \
             queues (their copy streams and the streams their kernels run on), or a copy can \
             queue behind the kernel that waits for it and both stop; set \
             CUDA_DEVICE_MAX_CONNECTIONS to at least {streams} (at most 32) in the environment \
             before CUDA starts (under MPS the ranks sharing a GPU draw their queues from one \
             pool: docs/troubleshooting.md)"
        ),
    };
    let queues = match connections.map(str::trim) {
        None | Some("") if under_mps => {
            return Err(fail(
                "not set, and this process runs under MPS, where the default is smaller than \
                 a process's own"
                    .into(),
            ));
        }
        None | Some("") => DEFAULT_QUEUES,
        Some(v) => v
            .parse::<usize>()
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| fail(format!("{v:?} is not a positive number")))?,
    };
    if streams > queues.min(32) {
        return Err(fail(format!("{queues} hardware queue(s) are too few")));
    }
    Ok(())
}

impl Transport for ProxyTransport {
    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }

    fn world(&self) -> WorldLayout {
        self.world
    }

    fn bootstrap(&self) -> &Arc<Bootstrap> {
        self.ipc.bootstrap()
    }
}

impl DeviceRuntime for ProxyTransport {
    type ModuleBinding = ();

    unsafe fn bind_module(
        &self,
        _module: cudarc::driver::sys::CUmodule,
    ) -> Result<(), TransportError> {
        // The proxy image needs no device runtime; its channel comes with the memory
        // (`SymmetricMemory::bind_device_channel`).
        Ok(())
    }
}

impl ProxyTransport {
    /// Counts the streams a new buffer adds (its copy streams and its ops' stream; none
    /// without proxied peers) and checks that the process's total fits in the hardware queues
    /// ([`check_copy_stream_queues`]). Collective, like the allocation it precedes: every rank
    /// learns every rank's verdict, so a refusal on one rank is an error on all of them, not a
    /// wait in the allocation's exchange.
    fn count_copy_streams(&self, lanes: usize) -> Result<CopyStreams, TransportError> {
        let added = if lanes == 0 {
            0
        } else {
            lanes * self.options.copy_streams + usize::from(self.options.mirror_progress) + 1
        };
        let mps = self
            .ipc
            .context()
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MPS_ENABLED)
            .is_ok_and(|v| v != 0);
        // Counted first, so that buffers made at the same time see each other.
        let counted = CopyStreams::count(added);
        let verdict = if added == 0 {
            Ok(())
        } else {
            check_copy_stream_queues(
                CopyStreams::live(),
                std::env::var("CUDA_DEVICE_MAX_CONNECTIONS").ok().as_deref(),
                mps,
            )
        };
        let refused = [u8::from(verdict.is_err())];
        let all = self
            .ipc
            .bootstrap()
            .all_gather("proxy-ce-queues", &refused)
            .map_err(|source| TransportError::Bootstrap {
                context: "agreeing that every rank's copy streams fit in its hardware queues"
                    .into(),
                source,
            })?;
        verdict?;
        if let Some(rank) = all.iter().position(|v| v.first() != Some(&0)) {
            return Err(TransportError::InvalidArgument {
                argument: "CUDA_DEVICE_MAX_CONNECTIONS",
                rule: format!(
                    "rank {rank} refused its copy-engine proxy buffer: its copy streams do not \
                     fit in its hardware queues (its error says how many it needs); set \
                     CUDA_DEVICE_MAX_CONNECTIONS=32 for every rank"
                ),
            });
        }
        Ok(counted)
    }
}

impl SymmetricHeap for ProxyTransport {
    type Memory = ProxyMemory;

    fn alloc_symmetric(&self, bytes: usize) -> Result<ProxyMemory, TransportError> {
        let all: Vec<usize> = (0..self.world.world_size()).collect();
        self.alloc_symmetric_for(bytes, &all)
    }

    /// Copy streams only for the proxied ranks among `peers` (a two-tier buffer's node tier,
    /// whose peers are all reached by stores, gets none).
    fn alloc_symmetric_for(
        &self,
        bytes: usize,
        peers: &[usize],
    ) -> Result<ProxyMemory, TransportError> {
        let ctx = self.ipc.context();
        let world = self.world.world_size();
        let me = self.world.rank();
        let domain = self.world.nvlink_domain();
        let lanes = copy_lanes(world, me, &domain, peers);
        let counted = self.count_copy_streams(lanes.iter().filter(|&&l| l).count())?;
        let ipc = self.ipc.alloc_symmetric(bytes)?;
        let mapped: Vec<u64> = (0..world).map(|p| ipc.peer_base(p).unwrap_or(0)).collect();
        // The executor reaches every proxied peer through its IPC mapping.
        let proxied: Vec<u64> = (0..world)
            .map(|p| if lanes[p] { mapped[p] } else { 0 })
            .collect();
        let parts = RingParts::new(ctx, &self.options, CAPABILITIES.name)?;
        let mut executor = CopyEngineExecutor::new(
            ctx.clone(),
            ipc.local_base(),
            &proxied,
            self.options.max_in_flight,
        )?;
        executor.set_batch_copies(self.options.batch_copies);
        executor.set_queue_depth(self.options.copy_queue_depth);
        executor.set_copy_streams(self.options.copy_streams)?;
        executor.set_linger(self.options.copy_linger);
        executor.set_query_interval(self.options.copy_query_interval);
        if self.options.mirror_progress {
            executor.mirror_progress(
                parts.counter(abi::PROXY_COUNTER_TAKEN),
                parts.counter(abi::PROXY_COUNTER_COMPLETED),
            )?;
        }
        let watch = executor.watch();
        let core = parts.spawn(
            executor,
            &self.options,
            world,
            bytes,
            ipc.local_base(),
            Some(watch),
        )?;
        Ok(ProxyMemory {
            store_bases: (0..world)
                .map(|p| {
                    if p == me || domain.contains(&p) {
                        mapped[p]
                    } else {
                        0
                    }
                })
                .collect(),
            core,
            ipc,
            _streams: counted,
        })
    }
}

/// A symmetric buffer shared through CUDA IPC, with the proxy thread serving it.
///
/// Field order is drop order: the proxy is stopped explicitly first (see `Drop`), then the
/// ring and counters (`core`) and the IPC memory go.
#[derive(Debug)]
pub struct ProxyMemory {
    store_bases: Vec<u64>,
    core: ProxyCore,
    ipc: IpcMemory,
    _streams: CopyStreams,
}

impl ProxyMemory {
    /// The proxy's report once it has stopped (after teardown): its counts, or the error it
    /// stopped on.
    pub fn report(&self) -> Option<Result<ProxyReport, String>> {
        self.core.report()
    }
}

impl SymmetricMemory for ProxyMemory {
    fn len(&self) -> usize {
        self.ipc.len()
    }

    fn local_base(&self) -> u64 {
        self.ipc.local_base()
    }

    fn peer_base(&self, peer: usize) -> Option<u64> {
        self.store_bases.get(peer).copied().filter(|&b| b != 0)
    }

    fn release_peer_mappings(&mut self) {
        // The proxy writes through the mappings: stop it before they close.
        self.core.stop();
        self.ipc.release_peer_mappings();
    }

    unsafe fn bind_device_channel(
        &self,
        module: cudarc::driver::sys::CUmodule,
        stream: &cudarc::driver::CudaStream,
    ) -> Result<bool, TransportError> {
        // SAFETY: the caller upholds the trait's contract, which is the core's.
        unsafe { self.core.bind_channel(module, stream) }.map(|()| true)
    }

    fn backend_failure(&self) -> Option<String> {
        self.core.failure()
    }
}

impl Drop for ProxyMemory {
    fn drop(&mut self) {
        self.core.stop();
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_group_gets_copy_streams_for_its_proxied_members_only() {
        // 4 ranks as 2 logical nodes of 2, seen from rank 0 (domain 0..2).
        let all = [0, 1, 2, 3];
        let lanes = |peers: &[usize]| copy_lanes(4, 0, &(0..2), peers);
        // A flat buffer: every rank of the other node.
        assert_eq!(lanes(&all), [false, false, true, true]);
        // The rail tier (ranks 0 and 2): the other node's rank with the same local rank.
        assert_eq!(lanes(&[0, 2]), [false, false, true, false]);
        // The node tier (ranks 0 and 1): all reached by stores, no copy stream.
        assert_eq!(lanes(&[0, 1]), [false; 4]);
        // One node: nothing to copy to.
        assert_eq!(copy_lanes(4, 2, &(0..4), &all), [false; 4]);
    }

    #[test]
    fn launchers_divide_the_queues_among_ranks_sharing_a_gpu() {
        let queues = |n, local| single_host_env(n, local)[0].clone();
        assert_eq!(
            queues(1, 8),
            ("CUDA_DEVICE_MAX_CONNECTIONS", "32".to_string())
        );
        assert_eq!(queues(2, 4).1, "32");
        assert_eq!(queues(3, 3).1, "21");
        assert_eq!(queues(4, 4).1, "16");
        // Eight ranks on one GPU: 64 / 8 = 8 is fewer than one buffer's 9 streams.
        assert_eq!(queues(8, 8).1, "9");
        assert_eq!(queues(4, 16).1, "17");
        // Sixteen ranks asking 17 each exhaust an MPS server's pool: each gets 64 / 16.
        assert_eq!(queues(16, 16).1, "4");
        assert_eq!(queues(64, 64).1, "1");
        for n in 1..=128 {
            for local in n..=n + 64 {
                let q: usize = queues(n, local).1.parse().unwrap();
                assert!((1..=32).contains(&q), "{n} ranks per GPU: {q}");
                let floor = (local + 1).min(32);
                // Enough for one buffer's streams whenever the pool allows that many.
                assert!(
                    q >= floor || floor * n > MPS_POOL_KNOWN_GOOD,
                    "{n}/{local}: {q}"
                );
                // The ranks of a GPU stay within the pool seen to work.
                assert!(
                    n <= 2 || q * n <= MPS_POOL_KNOWN_GOOD || q == 1,
                    "{n}/{local}: {q}"
                );
            }
        }
    }

    #[test]
    fn copy_streams_must_fit_in_the_hardware_queues() {
        // Without MPS: 8 queues by default.
        assert!(check_copy_stream_queues(8, None, false).is_ok());
        let e = check_copy_stream_queues(9, None, false).unwrap_err();
        let text = e.to_string();
        assert!(text.contains("CUDA_DEVICE_MAX_CONNECTIONS"), "{text}");
        assert!(text.contains("need 9 hardware"), "{text}");
        assert!(check_copy_stream_queues(9, Some("32"), false).is_ok());
        // The driver caps the queues at 32.
        assert!(check_copy_stream_queues(32, Some("64"), false).is_ok());
        assert!(check_copy_stream_queues(33, Some("64"), false).is_err());
        assert!(check_copy_stream_queues(3, Some("2"), false).is_err());
        // Under MPS the variable must be set.
        let e = check_copy_stream_queues(2, None, true).unwrap_err();
        assert!(e.to_string().contains("MPS"), "{e}");
        assert!(check_copy_stream_queues(2, Some(" "), true).is_err());
        assert!(check_copy_stream_queues(3, Some("32"), true).is_ok());
        // Malformed values are named.
        let e = check_copy_stream_queues(2, Some("many"), false).unwrap_err();
        assert!(e.to_string().contains("\"many\""), "{e}");
        assert!(check_copy_stream_queues(2, Some("0"), false).is_err());
        // Without streams nothing waits on a copy.
        assert!(check_copy_stream_queues(0, Some("1"), true).is_ok());
    }
    use super::*;

    #[test]
    fn a_switch_outside_its_values_names_the_variable() {
        assert_eq!(parse_choice("X", " 1 ", &["0", "1"]).ok(), Some(Some(1)));
        let err = parse_choice("EPCOMM_PROXY_BATCH", "yes", &["0", "1"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("EPCOMM_PROXY_BATCH") && err.contains("yes"),
            "{err}"
        );
    }

    #[test]
    fn linger_is_read_in_microseconds() {
        assert_eq!(
            parse_micros("EPCOMM_PROXY_COPY_LINGER_US", " 20 ").unwrap(),
            Duration::from_micros(20)
        );
        assert_eq!(
            parse_micros("EPCOMM_PROXY_COPY_LINGER_US", "0").unwrap(),
            Duration::ZERO
        );
        let err = parse_micros("EPCOMM_PROXY_COPY_LINGER_US", "5us")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("EPCOMM_PROXY_COPY_LINGER_US") && err.contains("5us"),
            "{err}"
        );
    }

    #[test]
    fn options_name_the_broken_rule() {
        let ok = ProxyOptions::one_node_per_rank(2);
        assert!(ok.validate().is_ok());
        let cases: [(ProxyOptions, &str); 12] = [
            (ProxyOptions { trace: 4, ..ok }, "trace"),
            (
                ProxyOptions {
                    ring_slots: 1000,
                    ..ok
                },
                "ring_slots",
            ),
            (
                ProxyOptions {
                    max_in_flight: 0,
                    ..ok
                },
                "max_in_flight",
            ),
            (
                ProxyOptions {
                    op_timeout: Duration::ZERO,
                    ..ok
                },
                "op_timeout",
            ),
            (
                ProxyOptions {
                    slot_timeout: Duration::ZERO,
                    ..ok
                },
                "slot_timeout",
            ),
            (
                ProxyOptions {
                    virtual_nodes: 0,
                    ..ok
                },
                "virtual_nodes",
            ),
            (
                ProxyOptions {
                    copy_queue_depth: 0,
                    ..ok
                },
                "copy_queue_depth",
            ),
            (
                ProxyOptions {
                    copy_queue_depth: MAX_QUEUE_DEPTH + 1,
                    ..ok
                },
                "copy_queue_depth",
            ),
            (
                ProxyOptions {
                    copy_streams: 0,
                    ..ok
                },
                "copy_streams",
            ),
            (
                ProxyOptions {
                    copy_streams: MAX_COPY_STREAMS + 1,
                    ..ok
                },
                "copy_streams",
            ),
            (
                ProxyOptions {
                    copy_linger: MAX_LINGER + Duration::from_nanos(1),
                    ..ok
                },
                "copy_linger",
            ),
            (
                ProxyOptions {
                    copy_query_interval: MAX_QUERY_INTERVAL + Duration::from_nanos(1),
                    ..ok
                },
                "copy_query_interval",
            ),
        ];
        let longest = ProxyOptions {
            copy_linger: MAX_LINGER,
            ..ok
        };
        assert!(longest.validate().is_ok());
        for (options, field) in cases {
            let err = options.validate().unwrap_err().to_string();
            assert!(err.contains(field), "{field}: {err}");
        }
    }
}
