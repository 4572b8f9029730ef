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
//! # Who touches what
//! * The ring: the kernels (producers, many threads) and the proxy thread (consumer), through
//!   the ring protocol only (docs/proxy.md).
//! * The counters (device memory): the kernels only.
//! * Peers' buffers: the kernels (store route) and this rank's proxy thread (proxy route), as
//!   the protocol allows; the proxy thread is stopped before the mappings are closed.
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
mod fifo;
mod trace;
mod watch;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::CudaContext;
use epcomm_kernels::abi::{self, ProxyChannel};
use epcomm_proxy::{Limits, Proxy, ProxyConfig, ProxyError, ProxyReport, RingMemory, ring};
use epcomm_transport::{
    Bootstrap, Capabilities, DeviceBuffer, DeviceRuntime, KernelFamily, MappedHostBuffer, Route,
    Schedule, SymmetricHeap, SymmetricMemory, Transport, TransportError, WorldLayout,
};
use epcomm_transport_ipc::{IpcMemory, IpcTransport};

pub use copy_engine::{CopyEngineError, CopyEngineExecutor};
pub use watch::CallWatch;

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
};

/// The capabilities of [`ProxyTransport`].
pub const CAPABILITIES: Capabilities = Capabilities {
    name: "proxy-ce",
    kernel_family: KernelFamily::CpuProxy,
    schedules: &Schedule::ALL,
    routes: &[Route::Store, Route::PutSignal],
};

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
    /// Hand copies to the driver in batches ([`CopyEngineExecutor::set_batch_copies`]); off,
    /// one `cuMemcpyAsync` per copy.
    pub batch_copies: bool,
    /// Diagnostics on stderr: 0 none, 1 the proxy's report when a buffer's proxy stops, 2 also
    /// a live trace of the ring several times a second (docs/proxy.md, "Diagnostics").
    pub trace: u8,
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
    pub fn one_node_per_rank(local_world_size: usize) -> Self {
        Self {
            virtual_nodes: local_world_size.max(1),
            ring_slots: 1 << 16,
            max_in_flight: 1 << 14,
            op_timeout: Duration::from_secs(10),
            slot_timeout: Duration::from_secs(10),
            cpu: None,
            mirror_progress: true,
            batch_copies: true,
            trace: 0,
        }
    }

    /// [`Self::one_node_per_rank`], with `EPCOMM_PROXY_RING_SLOTS` and
    /// `EPCOMM_PROXY_MAX_IN_FLIGHT` overriding the two sizes when set,
    /// `EPCOMM_PROXY_MIRROR=0` turning the progress mirror off, `EPCOMM_PROXY_BATCH=0` the
    /// batched copies, and `EPCOMM_PROXY_TRACE=1|2` the diagnostics on.
    ///
    /// # Errors
    /// [`TransportError::InvalidArgument`] naming the variable when its value is not a
    /// positive integer (the switches: not `0` or `1`; `EPCOMM_PROXY_TRACE`: not 0, 1 or 2).
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
        if let Some(level) = env_choice("EPCOMM_PROXY_TRACE", &["0", "1", "2"])? {
            options.trace = level;
        }
        Ok(options)
    }

    /// Checks every rule (no GPU needed).
    ///
    /// # Errors
    /// [`TransportError::InvalidArgument`] naming the field: `ring_slots` a power of two in
    /// `2..=2^24`, `max_in_flight` and both bounds above zero, `virtual_nodes` above zero.
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
        if self.trace > 2 {
            return bad(
                "ProxyOptions::trace",
                format!("must be 0, 1 or 2 (got {})", self.trace),
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
        WorldLayout::with_virtual_nodes(world_size, rank, local_world_size, virtual_nodes).map_err(
            |e| TransportError::InvalidArgument {
                argument: "ProxyOptions::virtual_nodes",
                rule: format!(
                    "vnodes={virtual_nodes} must divide the {local_world_size} ranks per host \
                     ({e})"
                ),
            },
        )
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
        // (`SymmetricMemory::proxy_channel`).
        Ok(())
    }
}

impl SymmetricHeap for ProxyTransport {
    type Memory = ProxyMemory;

    fn alloc_symmetric(&self, bytes: usize) -> Result<ProxyMemory, TransportError> {
        let ipc = self.ipc.alloc_symmetric(bytes)?;
        let ctx = self.ipc.context();
        let world = self.world.world_size();
        let me = self.world.rank();
        let domain = self.world.nvlink_domain();
        let mapped: Vec<u64> = (0..world).map(|p| ipc.peer_base(p).unwrap_or(0)).collect();
        // The executor reaches every proxied peer through its IPC mapping.
        let proxied: Vec<u64> = (0..world)
            .map(|p| if domain.contains(&p) { 0 } else { mapped[p] })
            .collect();
        let slots = self.options.ring_slots;
        let region = ring::region_bytes(slots).map_err(backend("sizing the ring"))?;
        let ring_host = MappedHostBuffer::zeroed(ctx, region)?;
        // SAFETY: `ring_host` is `region` bytes of pinned, page-aligned host memory owned by
        // the returned `ProxyMemory`, which stops the proxy (the only host user) before it
        // drops `ring_host`; the device touches it only through the ring protocol.
        let ring = unsafe { RingMemory::from_raw(ring_host.host_ptr(), ring_host.len(), slots) }
            .map_err(backend("laying out the ring"))?;
        let (_, consumer) = ring::split(ring);
        let counters = DeviceBuffer::zeroed(ctx, abi::PROXY_COUNTER_WORDS as usize * 8)?;
        let mut executor = CopyEngineExecutor::new(
            ctx.clone(),
            ipc.local_base(),
            &proxied,
            self.options.max_in_flight,
        )?;
        executor.set_batch_copies(self.options.batch_copies);
        if self.options.mirror_progress {
            executor.mirror_progress(
                counters.ptr() + abi::PROXY_COUNTER_TAKEN * 8,
                counters.ptr() + abi::PROXY_COUNTER_COMPLETED * 8,
            )?;
        }
        let watch = executor.watch();
        let tracer = (self.options.trace >= 2)
            .then(|| trace::Tracer::start(ring_host.host_ptr() as usize, slots, &watch))
            .flatten();
        let mut config = ProxyConfig::new(Limits {
            world: world as u32,
            heap_bytes: bytes as u64,
        });
        // Small take rounds: completions are polled and published between them.
        config.max_pending = self.options.max_in_flight.min(1024);
        config.op_timeout = self.options.op_timeout;
        config.cpu = self.options.cpu;
        let proxy = Proxy::spawn(consumer, executor, config).map_err(backend("starting"))?;
        let channel = ProxyChannel {
            ring: ring_host.device_ptr(),
            counters: counters.ptr(),
            capacity: slots,
            local_base: ipc.local_base(),
            timeout_ns: u64::try_from(self.options.slot_timeout.as_nanos()).unwrap_or(u64::MAX),
        };
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
            channel,
            watch,
            proxy: Mutex::new(Some(proxy)),
            last_report: Mutex::new(None),
            tracer: Mutex::new(tracer),
            trace: self.options.trace,
            _counters: counters,
            _ring_host: ring_host,
            ipc,
        })
    }
}

fn backend<E: std::error::Error + Send + Sync + 'static>(
    what: &'static str,
) -> impl FnOnce(E) -> TransportError {
    move |e| TransportError::Backend {
        backend: "proxy-ce",
        context: what.to_string(),
        source: Box::new(e),
    }
}

/// A symmetric buffer shared through CUDA IPC, with the proxy thread serving it.
///
/// Field order is drop order: the proxy is stopped explicitly first (see `Drop`), then the
/// counters, the ring and the IPC memory go.
#[derive(Debug)]
pub struct ProxyMemory {
    store_bases: Vec<u64>,
    channel: ProxyChannel,
    watch: Arc<CallWatch>,
    proxy: Mutex<Option<Proxy>>,
    tracer: Mutex<Option<trace::Tracer>>,
    /// `ProxyOptions::trace`.
    trace: u8,
    last_report: Mutex<Option<Result<ProxyReport, String>>>,
    _counters: DeviceBuffer,
    _ring_host: MappedHostBuffer,
    ipc: IpcMemory,
}

impl ProxyMemory {
    /// Stops the proxy thread (what the kernels published is executed first) and keeps its
    /// report; idempotent.
    fn stop_proxy(&self) {
        if let Some(tracer) = self.tracer.lock().ok().and_then(|mut t| t.take()) {
            tracer.stop();
        }
        let proxy = self.proxy.lock().ok().and_then(|mut p| p.take());
        if let Some(proxy) = proxy {
            let report = proxy.shutdown().map_err(|e: ProxyError| e.to_string());
            if self.trace >= 1 {
                eprintln!(
                    "epcomm proxy-ce: buffer of {} bytes stopped: {report:?}; {}",
                    self.ipc.len(),
                    self.driver_calls()
                );
            }
            if let Ok(mut slot) = self.last_report.lock() {
                *slot = Some(report);
            }
        }
    }

    /// What the proxy's driver calls cost so far: the call in progress, the longest call, and
    /// per call its count and total time.
    fn driver_calls(&self) -> String {
        let mut out = String::new();
        match self.watch.in_flight() {
            (0, _) => out += "nothing in the copy engines; ",
            (n, Some(age)) => {
                out += &format!("{n} operations in the copy engines, the oldest for {age:?}; ")
            }
            (n, None) => out += &format!("{n} operations in the copy engines; "),
        }
        if let Some((call, waited)) = self.watch.in_call() {
            out += &format!("its thread has been inside {call} for {waited:?}; ");
        }
        if let Some((call, took)) = self.watch.longest() {
            out += &format!("its longest driver call was {call} ({took:?})");
        }
        for (call, n, total) in self.watch.totals() {
            out += &format!("; {n} x {call} in {total:?}");
        }
        out
    }

    /// The proxy's report once it has stopped (after teardown): its counts, or the error it
    /// stopped on.
    pub fn report(&self) -> Option<Result<ProxyReport, String>> {
        self.last_report.lock().ok().and_then(|r| r.clone())
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
        self.stop_proxy();
        self.ipc.release_peer_mappings();
    }

    fn proxy_channel(&self) -> Option<ProxyChannel> {
        Some(self.channel)
    }

    fn backend_failure(&self) -> Option<String> {
        let finished = self
            .proxy
            .lock()
            .ok()
            .is_some_and(|p| p.as_ref().is_some_and(Proxy::is_finished));
        if finished {
            self.stop_proxy();
        }
        let word = |offset: usize| self._ring_host.load_u64(offset / 8).unwrap_or(0);
        let ring = format!(
            "the proxy had taken {} descriptors and completed {}; {}",
            word(ring::OFFSET_TAIL),
            word(ring::OFFSET_COMPLETED),
            self.driver_calls()
        );
        match self.report() {
            Some(Err(e)) => Some(format!("the proxy thread stopped: {e} ({ring})")),
            Some(Ok(_)) if finished => Some(format!("the proxy thread stopped ({ring})")),
            _ => Some(format!("the proxy thread is running; {ring}")),
        }
    }
}

impl Drop for ProxyMemory {
    fn drop(&mut self) {
        self.stop_proxy();
    }
}

#[cfg(test)]
mod tests {
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
    fn options_name_the_broken_rule() {
        let ok = ProxyOptions::one_node_per_rank(2);
        assert!(ok.validate().is_ok());
        let cases: [(ProxyOptions, &str); 6] = [
            (ProxyOptions { trace: 3, ..ok }, "trace"),
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
        ];
        for (options, field) in cases {
            let err = options.validate().unwrap_err().to_string();
            assert!(err.contains(field), "{field}: {err}");
        }
    }
}
