//! [`Buffer`]: one per process (per GPU); owns the transport, the symmetric buffer, the stream,
//! the loaded kernels and the op sequence numbers that every rank keeps in step.

use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, DevicePtr, DevicePtrMut, sys};
use epcomm_kernels::abi::{self, ErrorRecord, LayoutArgs, OpArgs};
use epcomm_kernels::{IntranodeKernels, KernelVariant};
use epcomm_topology::{BufferPlan, Parity, RegionKind, Route, RoutePlan, Schedule};
use epcomm_transport::memory::copy_dtoh;
use epcomm_transport::{
    DeviceBuffer, DynTransport, KernelFamily, MappedHostBuffer, SymmetricMemory,
};

use crate::agreement::Fingerprint;
use crate::error::DriverContext;
use crate::handle::{Dispatched, Handle, HandleInner, RecvDtype};
use crate::layout::{Layout, LayoutInner};
use crate::pointers::{ROW_ALIGN, check_device_ptr};
use crate::stats::{LocalStats, OpStats};
use crate::{BufferConfig, Error, RecvMode, Result};

static NEXT_BUFFER_ID: AtomicU64 = AtomicU64::new(1);

/// Token rows a dispatch sends.
#[derive(Clone, Copy)]
pub enum XInput<'a> {
    /// `[T][hidden]` bf16.
    Bf16(&'a dyn DevicePtr<half::bf16>),
    /// `[T][hidden]` e4m3 bytes and `[T][hidden / 128]` f32 scales.
    Fp8 {
        /// e4m3 values.
        x: &'a dyn DevicePtr<u8>,
        /// One scale per 128 channels.
        scales: &'a dyn DevicePtr<f32>,
    },
}

impl std::fmt::Debug for XInput<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Bf16(x) => write!(f, "Bf16({} elements)", x.len()),
            Self::Fp8 { x, scales } => write!(f, "Fp8({} bytes, {} scales)", x.len(), scales.len()),
        }
    }
}

/// Inputs of a dispatch.
#[derive(Clone, Copy)]
pub struct DispatchInput<'a> {
    /// Token rows.
    pub x: XInput<'a>,
    /// `[T][top_k]` expert ids (-1 = none); the same array the layout was computed from.
    pub topk_idx: &'a dyn DevicePtr<i64>,
    /// `[T][top_k]` weights, forwarded with the rows.
    pub topk_weights: Option<&'a dyn DevicePtr<f32>>,
}

impl std::fmt::Debug for DispatchInput<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DispatchInput")
            .field("x", &self.x)
            .field("topk_idx", &self.topk_idx.len())
            .field("topk_weights", &self.topk_weights.map(|w| w.len()))
            .finish()
    }
}

/// Host mirror of the device `SeqState` (identical on every rank because every rank issues the
/// same ops): the host needs the notify tag for HostSync waits and the dispatch parity for the
/// receive views. The kernels read the authoritative copy from device memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Sequence {
    op: u64,
    notify: u64,
    dispatch: u64,
    combine: u64,
}

impl Sequence {
    fn advance(&mut self, kind: u32) {
        self.op += 1;
        match kind {
            abi::op::DISPATCH => {
                self.notify += 1;
                self.dispatch += 1;
            }
            abi::op::CACHED_DISPATCH => self.dispatch += 1,
            _ => self.combine += 1,
        }
    }

    fn minus(&self, o: &Self) -> Self {
        Self {
            op: self.op - o.op,
            notify: self.notify - o.notify,
            dispatch: self.dispatch - o.dispatch,
            combine: self.combine - o.combine,
        }
    }

    fn add(&mut self, d: &Self) {
        self.op += d.op;
        self.notify += d.notify;
        self.dispatch += d.dispatch;
        self.combine += d.combine;
    }
}

/// What a combine reduces: `y` (and its weights) in caller memory, or in place.
#[derive(Clone, Copy, Debug)]
struct CombineInputs {
    y: u64,
    y_weights: u64,
    in_place: bool,
}

/// A captured sequence of ops ([`Buffer::capture`]), replayed with [`Buffer::replay`].
///
/// Receive rows alternate between two regions by dispatch parity, so a graph holding a
/// dispatch is recorded twice, once per parity it can start at: `recordings[by_parity[p]]` is
/// the recording whose returned receive pointers are right when the device's dispatch count is
/// `p` modulo 2 at the replay's start (one recording serves both when the graph holds no
/// dispatch).
pub struct EpGraph {
    recordings: Vec<cudarc::driver::CudaGraph>,
    by_parity: [usize; 2],
    delta: Sequence,
    buffer_id: u64,
}

impl std::fmt::Debug for EpGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EpGraph")
            .field("ops", &self.delta.op)
            .field("dispatches", &self.delta.dispatch)
            .finish()
    }
}

/// The latest (cached) dispatch, for in-place combine.
#[derive(Debug)]
struct LatestDispatch {
    handle: std::sync::Weak<HandleInner>,
    dtype: RecvDtype,
    /// Top-k weights travelled (a non-cached dispatch with `topk_weights`).
    weights: bool,
}

/// One rank's epcomm state: see the crate docs.
#[derive(Debug)]
pub struct Buffer {
    id: u64,
    cfg: BufferConfig,
    rank: usize,
    world: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// Declared before `kernels`: dropped (unbound) before the module unloads.
    _module_binding: Box<dyn std::fmt::Debug + Send + Sync>,
    kernels: IntranodeKernels,
    /// How every peer is reached (computed once, from the world layout and the transport).
    routes: RoutePlan,
    /// Bit d: rank d is reached with the transport's put/signal (`routes`' mask).
    remote_mask: u64,
    plan: BufferPlan,
    peer_bases: DeviceBuffer,
    err_claim: DeviceBuffer,
    err_record: MappedHostBuffer,
    host_counts: MappedHostBuffer,
    seq_state: DeviceBuffer,
    parity_stride: u64,
    seq: Sequence,
    /// Routing, element type and weights of the latest (cached) dispatch (in-place combine).
    latest_dispatch: Option<LatestDispatch>,
    last_op: Option<&'static str>,
    failed: Option<String>,
    /// Freed by [`Self::teardown`] (or leaked there when the free is collective and a peer is
    /// gone), never by the field's own drop.
    mem: ManuallyDrop<Box<dyn SymmetricMemory>>,
    torn_down: bool,
    transport: Arc<dyn DynTransport>,
}

impl Buffer {
    /// Creates this rank's buffer over `transport` (e.g. from `epcomm_backends::TransportSpec`;
    /// one transport can serve several buffers, one after another or side by side).
    /// Collective: every rank must call it with the same config and the same kind of transport
    /// (checked: [`Error::ConfigMismatch`]).
    pub fn new(
        ctx: Arc<CudaContext>,
        transport: Arc<dyn DynTransport>,
        cfg: BufferConfig,
    ) -> Result<Self> {
        cfg.validate()?;
        let layout = transport.world();
        let caps = transport.capabilities();
        let (world, rank) = (layout.world_size(), layout.rank());
        let invalid = |argument, rule: String| Err(Error::InvalidArgument { argument, rule });
        if world > abi::MAX_WORLD {
            return invalid(
                "world",
                format!(
                    "at most {} ranks per NVLink domain (got {world})",
                    abi::MAX_WORLD
                ),
            );
        }
        if !cfg.num_experts.is_multiple_of(world) {
            return invalid(
                "num_experts",
                format!(
                    "must be a multiple of the world size {world} (got {})",
                    cfg.num_experts
                ),
            );
        }
        caps.check_schedule(cfg.schedule)?;
        let routes = RoutePlan::new(&layout, caps.routes, cfg.routes)?;
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .context("reading the SM count")? as u32;
        if cfg.num_sms > sms {
            return invalid(
                "num_sms",
                format!("the device has {sms} SMs (asked for {})", cfg.num_sms),
            );
        }
        let plan = BufferPlan::new(
            world,
            cfg.max_tokens_per_rank,
            cfg.hidden,
            cfg.top_k,
            cfg.num_experts,
        )?;
        let stream = ctx.new_stream().context("creating the comm stream")?;
        let variant = match caps.kernel_family {
            KernelFamily::NvlinkStore => KernelVariant::Store,
            KernelFamily::NvshmemDevice => KernelVariant::Nvshmem,
        };
        let kernels = IntranodeKernels::load(&ctx, &stream, variant)?;
        // Waits across blocks and ranks need every block resident (kernels also launch
        // cooperatively, so a grid that cannot be co-resident fails instead of hanging).
        let fit = kernels.max_coresident_blocks(sms)?;
        if cfg.num_sms > fit {
            return invalid(
                "num_sms",
                format!(
                    "at most {fit} blocks of the dispatch/combine kernels fit on this GPU at once \
                     (asked for {})",
                    cfg.num_sms
                ),
            );
        }
        // Every rank must agree on everything that shapes the protocol, before any peer
        // memory is touched (docs/troubleshooting.md).
        let fingerprint = Fingerprint::new()
            .with("abi_version", abi::ABI_VERSION)
            .with("kernel image", format!("{:016x}", kernels.image_digest()))
            .with("transport", caps.name)
            .with("world", world)
            .with("num_sms", cfg.num_sms)
            .with("max_tokens_per_rank", cfg.max_tokens_per_rank)
            .with("hidden", cfg.hidden)
            .with("top_k", cfg.top_k)
            .with("num_experts", cfg.num_experts)
            .with("schedule", cfg.schedule.name())
            .with("routes", cfg.routes.name());
        let all = transport
            .bootstrap()
            .all_gather("epcomm-buffer-config", &fingerprint.encode())?;
        fingerprint.agree(&all)?;
        // SAFETY: the module was loaded in `ctx` from the image of the transport's family and
        // `kernels` keeps it loaded; the binding is declared before `kernels` in `Buffer`, so it
        // is dropped first.
        let module_binding = unsafe { transport.bind_module_dyn(kernels.cu_module()?) }?;
        let mem = transport.alloc_symmetric_dyn(plan.total_bytes() as usize)?;
        let bases = peer_bases(&routes, mem.as_ref())?;
        let remote_mask = routes.put_signal_mask();
        let peer_bases = DeviceBuffer::zeroed(&ctx, world * 8)?;
        peer_bases.write(&stream, 0, &bases)?;
        let err_claim = DeviceBuffer::zeroed(&ctx, 8)?;
        let err_record = MappedHostBuffer::zeroed(&ctx, size_of::<ErrorRecord>())?;
        let host_counts = MappedHostBuffer::zeroed(&ctx, (2 + cfg.num_experts / world) * 8)?;
        let seq_state = DeviceBuffer::zeroed(&ctx, size_of::<abi::SeqState>())?;
        // Kernels find a region's other parity copy at a fixed distance; check the plan agrees.
        let stride = |k| plan.region(k, Parity::Odd).offset - plan.region(k, Parity::Even).offset;
        let parity_stride = stride(RegionKind::DispatchX);
        if let Some(k) = RegionKind::PER_PARITY
            .iter()
            .find(|&&k| stride(k) != parity_stride)
        {
            return invalid(
                "buffer plan",
                format!("{k:?} parity copies are not {parity_stride} bytes apart"),
            );
        }
        let buffer = Self {
            id: NEXT_BUFFER_ID.fetch_add(1, Ordering::Relaxed),
            cfg,
            rank,
            world,
            ctx,
            stream,
            _module_binding: module_binding,
            kernels,
            routes,
            remote_mask,
            plan,
            peer_bases,
            err_claim,
            err_record,
            host_counts,
            seq_state,
            parity_stride,
            seq: Sequence::default(),
            latest_dispatch: None,
            last_op: None,
            failed: None,
            mem: ManuallyDrop::new(mem),
            torn_down: false,
            transport,
        };
        // Nobody may write into a peer's buffer before that peer has zeroed and mapped it.
        buffer
            .transport
            .bootstrap()
            .barrier("epcomm-buffer-ready")?;
        Ok(buffer)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// The CUDA context of this rank's GPU.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The configuration.
    pub fn config(&self) -> &BufferConfig {
        &self.cfg
    }

    /// The transport.
    pub fn transport(&self) -> &dyn DynTransport {
        self.transport.as_ref()
    }

    /// How this rank reaches every peer (tier and route per rank).
    pub fn route_plan(&self) -> &RoutePlan {
        &self.routes
    }

    /// The stream every op runs on. Make it wait for your producers ([`Self::wait_event`]) and
    /// make your consumers wait for it ([`Self::record_event`]).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Bytes of symmetric memory per rank.
    pub fn symmetric_bytes(&self) -> usize {
        self.mem.len()
    }

    /// Orders the next op after `event` (e.g. the end of the kernel producing `x`).
    pub fn wait_event(&self, event: &CudaEvent) -> Result<()> {
        self.stream
            .wait(event)
            .context("waiting on a caller's event")
    }

    /// Records an event after the ops issued so far (async mode: wait on it instead of the host).
    pub fn record_event(&self) -> Result<CudaEvent> {
        self.stream.record_event(None).context("recording an event")
    }

    /// Waits for every issued op and reports any device failure.
    pub fn synchronize(&mut self) -> Result<()> {
        self.stream
            .synchronize()
            .context("synchronizing the comm stream")?;
        self.check()
    }

    /// Reports a failure recorded by a kernel (cheap: one read of mapped host memory). After a
    /// failure the buffer refuses new ops: destroy it and create a new one.
    pub fn check(&mut self) -> Result<()> {
        if let Some(why) = &self.failed {
            return Err(Error::Failed(why.clone()));
        }
        if self.err_record.load_u64(0).unwrap_or(0) as u32 == abi::code::OK {
            return Ok(());
        }
        // The record is complete once the failing kernel has exited.
        let _ = self.stream.synchronize();
        let record: ErrorRecord = self.err_record.read_struct().unwrap_or_default();
        let err = Error::from_record(&record);
        self.failed = Some(err.to_string());
        Err(err)
    }

    /// True after a device failure.
    pub fn is_failed(&self) -> bool {
        self.failed.is_some()
    }

    /// Waits for the last op and returns who waited for whom in it. **Collective** (every rank
    /// must call it after the same op): the ranks all-gather their waits over the transport's
    /// host channel, since GPU clocks are not comparable across GPUs.
    pub fn last_op_stats(&mut self) -> Result<Option<OpStats>> {
        self.synchronize()?;
        if self.last_op.is_none() {
            return Ok(None);
        }
        let off = self.plan.region(RegionKind::Stats, Parity::Even).offset;
        // SAFETY: the stats region lies inside this rank's live symmetric buffer (plan offsets).
        let words = unsafe {
            copy_dtoh::<u64>(
                &self.stream,
                self.mem.local_base() + off,
                8 + 3 * self.world,
            )
        }?;
        let Some(local) = LocalStats::from_words(&words) else {
            return Ok(None);
        };
        let tag = format!("epcomm-stats-{}", local.op_seq);
        let all = self
            .transport
            .bootstrap()
            .all_gather(&tag, &local.encode())?;
        let mut waits = Vec::with_capacity(all.len());
        for (peer, bytes) in all.iter().enumerate() {
            let row = LocalStats::decode_waits(bytes, local.op_seq, self.world).ok_or_else(|| Error::InvalidArgument {
                argument: "last_op_stats",
                rule: format!("rank {peer} reported stats of another op (call it on every rank after the same op)"),
            })?;
            waits.push(row);
        }
        Ok(Some(OpStats {
            op: local.op,
            op_seq: local.op_seq,
            rank: self.rank,
            total: local.total,
            sending: local.sending,
            waits,
        }))
    }

    /// Diagnostics: delays the ops issued after this call by `delay` on this rank's stream (a
    /// GPU spin, so the delay is exact), to see skew attribution at work ([`OpStats`]).
    pub fn inject_delay(&mut self, delay: Duration) -> Result<()> {
        if delay > Duration::from_secs(10) {
            return Err(Error::InvalidArgument {
                argument: "delay",
                rule: format!("at most 10 s (got {delay:?})"),
            });
        }
        self.ensure_ready()?;
        self.kernels
            .launch_delay(&self.stream, delay.as_nanos() as u64)?;
        Ok(())
    }

    /// This rank's global-barrier counters (one per peer: barrier arrivals received). They stay
    /// 0 under the Epoch strategy, which issues no barrier; under Global each op adds
    /// `barriers * num_sms` per peer. Waits for issued ops.
    pub fn barrier_counters(&mut self) -> Result<Vec<u64>> {
        self.synchronize()?;
        let off = self
            .plan
            .region(RegionKind::BarrierCounters, Parity::Even)
            .offset;
        // SAFETY: the region lies inside this rank's live symmetric buffer (plan offsets).
        Ok(unsafe { copy_dtoh::<u64>(&self.stream, self.mem.local_base() + off, self.world) }?)
    }

    /// Frees the buffer after the peers stopped touching it, and reports what went wrong on
    /// the way (dropping does the same and prints a warning instead). **Collective**: every
    /// rank destroys (or drops) its buffer.
    ///
    /// Order: wait for this rank's ops (bounded: every device wait is), release this rank's
    /// mappings of the peers' memory, then a host barrier (bounded by the bootstrap timeout;
    /// a dead peer is detected sooner), and only then free this rank's memory, so no peer can
    /// write into memory that is already freed and perhaps reused.
    pub fn destroy(mut self) -> Result<()> {
        self.teardown()
    }

    fn teardown(&mut self) -> Result<()> {
        if self.torn_down {
            return Ok(());
        }
        self.torn_down = true;
        // A device failure was already reported by the op that hit it; destroying a failed
        // buffer is the way out, so only driver and transport errors surface here.
        let synced = self.synchronize();
        self.mem.release_peer_mappings();
        let barrier = self.transport.bootstrap().barrier("epcomm-buffer-unmapped");
        if barrier.is_err() && self.mem.free_is_collective() {
            // The free would wait for the missing peers forever: leak this allocation instead
            // (the process keeps running; the memory returns when it exits).
        } else {
            // SAFETY: `mem` is taken exactly once (guarded by `torn_down`) and never used after.
            unsafe { ManuallyDrop::drop(&mut self.mem) };
        }
        barrier?;
        match synced {
            Err(e @ (Error::Driver { .. } | Error::Transport(_) | Error::Kernel(_))) => Err(e),
            _ => Ok(()),
        }
    }

    fn ensure_ready(&mut self) -> Result<()> {
        self.check()
    }

    fn wait_ctx_base(&self) -> (u64, u64, u64) {
        (
            self.err_claim.ptr(),
            self.err_record.device_ptr(),
            self.cfg.timeout.as_nanos().min(u64::MAX as u128) as u64,
        )
    }

    /// Computes the routing of `topk_idx` (`[num_tokens][top_k]`, -1 = none) on the GPU.
    /// Invalid ids are reported by the next op ([`Error::InvalidExpert`]).
    pub fn layout(&mut self, topk_idx: &dyn DevicePtr<i64>, num_tokens: usize) -> Result<Layout> {
        self.ensure_ready()?;
        let layout = self.alloc_layout(num_tokens)?;
        self.layout_into(topk_idx, &layout)?;
        Ok(layout)
    }

    /// Allocates the device arrays of a layout for `num_tokens` tokens (for [`Self::layout_into`],
    /// e.g. before a CUDA-graph capture, which must not allocate).
    pub fn alloc_layout(&mut self, num_tokens: usize) -> Result<Layout> {
        self.check_tokens(num_tokens)?;
        let (world, e) = (self.world, self.cfg.num_experts);
        let nodes = 1; // one NVLink domain
        // SAFETY: every element is written by the layout kernel before anything reads it.
        let counts = unsafe { self.stream.alloc::<u32>(world + e + nodes) }
            .context("allocating layout counts")?;
        // SAFETY: as above.
        let token_slot = unsafe { self.stream.alloc::<i32>((num_tokens * world).max(1)) }
            .context("allocating token slots")?;
        // SAFETY: as above.
        let status = unsafe { self.stream.alloc::<u32>(1) }.context("allocating layout status")?;
        Ok(Layout {
            inner: Arc::new(LayoutInner {
                counts,
                token_slot,
                status,
                num_tokens,
                world,
                num_experts: e,
                nodes,
                buffer_id: self.id,
                generation: AtomicU64::new(0),
            }),
        })
    }

    /// Recomputes `layout` in place from `topk_idx` (same number of tokens). A handle that an
    /// earlier dispatch wrote with this layout is stale from here on: a cached dispatch or
    /// combine with it fails with [`Error::InvalidArgument`] until a dispatch writes it again.
    pub fn layout_into(&mut self, topk_idx: &dyn DevicePtr<i64>, layout: &Layout) -> Result<()> {
        self.ensure_ready()?;
        let l = self.own(&layout.inner)?;
        let (num_tokens, k) = (l.num_tokens, self.cfg.top_k);
        if topk_idx.len() != num_tokens * k {
            return Err(Error::InvalidArgument {
                argument: "topk_idx",
                rule: format!(
                    "must hold num_tokens * top_k = {} ids (holds {})",
                    num_tokens * k,
                    topk_idx.len()
                ),
            });
        }
        let (err_claim, err_record, _) = self.wait_ctx_base();
        let s = &self.stream;
        let (idx_ptr, _g0) = topk_idx.device_ptr(s);
        let (counts_ptr, _g1) = l.counts.device_ptr(s);
        let (slot_ptr, _g2) = l.token_slot.device_ptr(s);
        let (status_ptr, _g3) = l.status.device_ptr(s);
        let args = LayoutArgs {
            topk_idx: idx_ptr,
            counts: counts_ptr,
            token_slot: slot_ptr,
            status: status_ptr,
            err_record,
            err_claim,
            num_tokens: num_tokens as i32,
            top_k: k as i32,
            num_experts: self.cfg.num_experts as i32,
            world: self.world as i32,
            gpus_per_node: self.world as i32,
            rank: self.rank as i32,
        };
        // SAFETY: all addresses are live allocations of the sizes the kernel expects for this
        // shape (counts: world + E + nodes, token_slot: T * world, status: 1, topk_idx: T * K);
        // the layout's arrays are owned by `layout`, which outlives the launch (stream order).
        unsafe { self.kernels.launch_layout(s, &args) }?;
        l.generation.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Allocates a handle for [`Self::dispatch_into`] sized for the buffer's capacity.
    pub fn alloc_handle(&mut self, layout: &Layout) -> Result<Handle> {
        self.own(&layout.inner)?;
        let max_rows = self.plan.recv_rows() as usize;
        self.new_handle(layout, max_rows, None)
    }

    fn new_handle(
        &self,
        layout: &Layout,
        max_rows: usize,
        num_recv: Option<usize>,
    ) -> Result<Handle> {
        let (world, epr) = (self.world, self.cfg.num_experts / self.world);
        let send_offsets =
            // SAFETY: the dispatch kernel writes every element before anything reads it (rows
            // beyond the received count are never read; same for the three arrays below).
            unsafe { self.stream.alloc::<i32>(world) }.context("allocating the handle")?;
        // SAFETY: as above.
        let recv_prefix =
            unsafe { self.stream.alloc::<i32>(world + 1) }.context("allocating the handle")?;
        // SAFETY: as above.
        let recv_src_idx = unsafe { self.stream.alloc::<i32>(max_rows.max(1)) }
            .context("allocating the handle")?;
        // SAFETY: as above.
        let recv_expert_counts =
            unsafe { self.stream.alloc::<i32>(epr.max(1)) }.context("allocating the handle")?;
        Ok(Handle {
            inner: Arc::new(HandleInner {
                layout: layout.inner.clone(),
                send_offsets,
                recv_prefix,
                recv_src_idx,
                recv_expert_counts,
                num_recv,
                max_rows,
                buffer_id: self.id,
                routing: AtomicU64::new(HandleInner::NOT_DISPATCHED),
            }),
        })
    }

    fn check_tokens(&self, num_tokens: usize) -> Result<()> {
        if num_tokens > self.cfg.max_tokens_per_rank {
            return Err(Error::InvalidArgument {
                argument: "num_tokens",
                rule: format!(
                    "at most max_tokens_per_rank = {} (got {num_tokens})",
                    self.cfg.max_tokens_per_rank
                ),
            });
        }
        Ok(())
    }

    fn check_x(&self, x: &XInput<'_>, num_tokens: usize) -> Result<(RecvDtype, i32)> {
        let h = self.cfg.hidden;
        let bad = |argument, rule: String| Err(Error::InvalidArgument { argument, rule });
        match x {
            XInput::Bf16(x) => {
                if x.len() != num_tokens * h {
                    return bad(
                        "x",
                        format!(
                            "bf16 x must hold num_tokens * hidden = {} values (holds {})",
                            num_tokens * h,
                            x.len()
                        ),
                    );
                }
                Ok((RecvDtype::Bf16, 0))
            }
            XInput::Fp8 { x, scales } => {
                if !h.is_multiple_of(128) {
                    return bad(
                        "x",
                        format!("FP8 dispatch needs hidden % 128 == 0 (hidden = {h})"),
                    );
                }
                if x.len() != num_tokens * h {
                    return bad(
                        "x",
                        format!(
                            "fp8 x must hold num_tokens * hidden = {} bytes (holds {})",
                            num_tokens * h,
                            x.len()
                        ),
                    );
                }
                if scales.len() != num_tokens * (h / 128) {
                    return bad(
                        "scales",
                        format!(
                            "must hold num_tokens * hidden / 128 = {} values (holds {})",
                            num_tokens * (h / 128),
                            scales.len()
                        ),
                    );
                }
                Ok((RecvDtype::Fp8, (h / 128) as i32))
            }
        }
    }

    fn own<'l>(&self, layout: &'l LayoutInner) -> Result<&'l LayoutInner> {
        if layout.buffer_id != self.id {
            return Err(Error::InvalidArgument {
                argument: "layout/handle",
                rule: "was produced by another Buffer".into(),
            });
        }
        Ok(layout)
    }

    /// The fields every dispatch/combine launch shares. Per-op values (sequence numbers,
    /// parities, expected counter values) are not here: the kernels read them from the device
    /// `SeqState`, so a captured graph replays correctly. The host mirror advances only once
    /// the kernel is launched (a check that fails before the launch leaves it in step).
    fn base_args(&self) -> OpArgs {
        let plan = &self.plan;
        let stats = plan.region(RegionKind::Stats, Parity::Even).offset;
        let (err_claim, err_record, timeout_ns) = self.wait_ctx_base();
        OpArgs {
            peer_bases: self.peer_bases.ptr(),
            off_done: plan.region(RegionKind::DoneCounters, Parity::Even).offset,
            off_barrier: plan
                .region(RegionKind::BarrierCounters, Parity::Even)
                .offset,
            off_comb_flags: plan.region(RegionKind::CombineFlags, Parity::Even).offset,
            off_stats: stats,
            err_claim,
            err_record,
            host_counts: self.host_counts.device_ptr(),
            timeout_ns,
            seq_state: self.seq_state.ptr(),
            parity_stride: self.parity_stride,
            hidden: self.cfg.hidden as i32,
            top_k: self.cfg.top_k as i32,
            num_experts: self.cfg.num_experts as i32,
            world: self.world as i32,
            rank: self.rank as i32,
            max_tokens: self.cfg.max_tokens_per_rank as i32,
            global_barriers: u32::from(self.cfg.schedule == Schedule::Global),
            remote_mask: self.remote_mask,
            abort_word: self.mem.local_base() + stats + abi::STATS_ABORT_OFFSET,
            ..OpArgs::default()
        }
    }

    fn recv_capacity(&self, mode: RecvMode) -> Result<usize> {
        let cap = self.plan.recv_rows() as usize;
        match mode {
            RecvMode::Bounded(n) if n > cap => Err(Error::InvalidArgument {
                argument: "RecvMode::Bounded",
                rule: format!("at most the buffer's capacity of {cap} rows (got {n})"),
            }),
            RecvMode::Bounded(n) => Ok(n),
            _ => Ok(cap),
        }
    }

    fn check_dispatch_input(
        &self,
        input: &DispatchInput<'_>,
        t: usize,
    ) -> Result<(RecvDtype, i32)> {
        let (dtype, num_scales) = self.check_x(&input.x, t)?;
        let k = self.cfg.top_k;
        if input.topk_idx.len() != t * k {
            return Err(Error::InvalidArgument {
                argument: "topk_idx",
                rule: format!(
                    "must hold {} ids like the layout's (holds {})",
                    t * k,
                    input.topk_idx.len()
                ),
            });
        }
        if let Some(w) = input.topk_weights
            && w.len() != t * k
        {
            return Err(Error::InvalidArgument {
                argument: "topk_weights",
                rule: format!(
                    "must hold num_tokens * top_k = {} values (holds {})",
                    t * k,
                    w.len()
                ),
            });
        }
        Ok((dtype, num_scales))
    }

    /// Sends every token to each rank holding one of its experts. Collective: every rank calls
    /// dispatch (or cached dispatch / combine) in the same order.
    pub fn dispatch(
        &mut self,
        input: &DispatchInput<'_>,
        layout: &Layout,
        mode: RecvMode,
    ) -> Result<Dispatched<'_>> {
        self.ensure_ready()?;
        let l = self.own(&layout.inner)?;
        let (dtype, _) = self.check_dispatch_input(input, l.num_tokens)?;
        let max_rows = self.recv_capacity(mode)?;
        let handle = self.new_handle(layout, max_rows, None)?;
        self.launch_dispatch(&input.x, Some(input.topk_idx), input.topk_weights, &handle)?;
        let (handle, per_expert) = if mode == RecvMode::HostSync {
            let epr = self.cfg.num_experts / self.world;
            let (n, e) = self.wait_host_counts(self.seq.notify, epr)?;
            let mut inner = Arc::try_unwrap(handle.inner)
                .map_err(|_| Error::Failed("handle shared during dispatch".into()))?;
            inner.num_recv = Some(n);
            let handle = Handle {
                inner: Arc::new(inner),
            };
            if let Some(latest) = &mut self.latest_dispatch {
                latest.handle = Arc::downgrade(&handle.inner);
            }
            (handle, Some(e))
        } else {
            (handle, None)
        };
        Ok(self.dispatched(
            handle,
            dtype,
            true,
            input.topk_weights.is_some(),
            per_expert,
        ))
    }

    /// Dispatch into a handle from [`Self::alloc_handle`] (WorstCase sizes, no allocation, no
    /// host wait): what a CUDA-graph capture records.
    pub fn dispatch_into(
        &mut self,
        input: &DispatchInput<'_>,
        handle: &Handle,
    ) -> Result<Dispatched<'_>> {
        self.ensure_ready()?;
        let h = self.own_handle(handle)?;
        let (dtype, _) = self.check_dispatch_input(input, h.layout.num_tokens)?;
        self.launch_dispatch(&input.x, Some(input.topk_idx), input.topk_weights, handle)?;
        Ok(self.dispatched(
            handle.clone(),
            dtype,
            true,
            input.topk_weights.is_some(),
            None,
        ))
    }

    /// Sends new rows along the routing of an earlier dispatch: no count exchange, no host wait.
    pub fn cached_dispatch(&mut self, x: &XInput<'_>, handle: &Handle) -> Result<Dispatched<'_>> {
        self.ensure_ready()?;
        let h = self.own_handle(handle)?;
        h.check_routing()?;
        let (dtype, _) = self.check_x(x, h.layout.num_tokens)?;
        self.launch_dispatch(x, None, None, handle)?;
        Ok(self.dispatched(handle.clone(), dtype, false, false, None))
    }

    fn own_handle<'h>(&self, handle: &'h Handle) -> Result<&'h HandleInner> {
        if handle.inner.buffer_id != self.id {
            return Err(Error::InvalidArgument {
                argument: "handle",
                rule: "was produced by another Buffer".into(),
            });
        }
        Ok(&handle.inner)
    }

    /// Launches a dispatch; `topk_idx: None` makes it a cached dispatch along `handle`.
    fn launch_dispatch(
        &mut self,
        x: &XInput<'_>,
        topk_idx: Option<&dyn DevicePtr<i64>>,
        topk_weights: Option<&dyn DevicePtr<f32>>,
        handle: &Handle,
    ) -> Result<()> {
        let cached = topk_idx.is_none();
        let h = &handle.inner;
        let l = &h.layout;
        if l.generation.load(Ordering::Relaxed) == 0 {
            return Err(Error::InvalidArgument {
                argument: "layout",
                rule: "was allocated but never computed: call layout_into first".into(),
            });
        }
        let (dtype, num_scales) = self.check_x(x, l.num_tokens)?;
        let blocks = self.cfg.num_sms;
        let kind = if cached {
            abi::op::CACHED_DISPATCH
        } else {
            abi::op::DISPATCH
        };
        let mut a = self.base_args();
        let r = |k| self.plan.region(k, Parity::Even).offset;
        a.off_x = r(RegionKind::DispatchX);
        a.off_scales = r(RegionKind::DispatchScales);
        a.off_topk_idx = r(RegionKind::DispatchTopkIdx);
        a.off_topk_w = r(RegionKind::DispatchTopkWeights);
        a.off_src_idx = r(RegionKind::DispatchSrcIdx);
        a.off_counts = r(RegionKind::CountMatrix);
        a.off_expert_counts = r(RegionKind::ExpertCounts);
        a.num_tokens = l.num_tokens as i32;
        a.num_scales = num_scales;
        a.row_bytes = self.row_bytes(dtype);
        a.max_recv_rows = h.max_rows as i32;
        a.flags = if cached {
            abi::flags::CACHED
        } else {
            abi::flags::HAS_TOPK
        } | if !cached && topk_weights.is_some() {
            abi::flags::HAS_WEIGHTS
        } else {
            0
        } | if dtype == RecvDtype::Fp8 {
            abi::flags::HAS_SCALES
        } else {
            0
        };
        let s = &self.stream;
        let (x_ptr, _gx) = match x {
            XInput::Bf16(x) => x.device_ptr(s),
            XInput::Fp8 { x, .. } => x.device_ptr(s),
        };
        let sc = match x {
            XInput::Fp8 { scales, .. } => Some(scales.device_ptr(s)),
            XInput::Bf16(_) => None,
        };
        let idx = topk_idx.map(|i| i.device_ptr(s));
        let w = topk_weights.filter(|_| !cached).map(|w| w.device_ptr(s));
        let (slot_ptr, _g1) = l.token_slot.device_ptr(s);
        let (counts_ptr, _g2) = l.counts.device_ptr(s);
        let (status_ptr, _g3) = l.status.device_ptr(s);
        let (so, _g4) = h.send_offsets.device_ptr(s);
        let (rp, _g5) = h.recv_prefix.device_ptr(s);
        let (ri, _g6) = h.recv_src_idx.device_ptr(s);
        let (re, _g7) = h.recv_expert_counts.device_ptr(s);
        a.x = x_ptr;
        a.x_scales = sc.as_ref().map_or(0, |p| p.0);
        a.topk_idx = idx.as_ref().map_or(0, |p| p.0);
        a.topk_weights = w.as_ref().map_or(0, |p| p.0);
        a.token_slot = slot_ptr;
        a.layout_counts = counts_ptr;
        a.layout_status = status_ptr;
        a.send_offsets = so;
        a.recv_prefix = rp;
        a.recv_src_idx = ri;
        a.recv_expert_counts = re;
        let t = l.num_tokens;
        let dev = self.ctx.ordinal();
        check_device_ptr("x", a.x, t * a.row_bytes as usize, ROW_ALIGN, dev)?;
        check_device_ptr("scales", a.x_scales, t * num_scales as usize * 4, 4, dev)?;
        check_device_ptr("topk_idx", a.topk_idx, t * self.cfg.top_k * 8, 8, dev)?;
        check_device_ptr(
            "topk_weights",
            a.topk_weights,
            t * self.cfg.top_k * 4,
            4,
            dev,
        )?;
        // SAFETY: inputs were length-checked against the layout's token count; the handle's
        // arrays hold world, world + 1, max_rows and experts_per_rank elements (the kernel never
        // writes more rows than max_rows: it fails with Overflow first); the symmetric buffer
        // follows the same plan on every rank, and every rank launches this op with `blocks`
        // blocks (the completion counters count blocks). A cached dispatch only reads the
        // handle, written by its dispatch earlier on this stream.
        unsafe { self.kernels.launch_dispatch(s, &a, blocks) }?;
        self.seq.advance(kind);
        self.last_op = Some(if cached {
            "cached dispatch"
        } else {
            "dispatch"
        });
        if !cached {
            h.routing
                .store(l.generation.load(Ordering::Relaxed), Ordering::Relaxed);
        }
        self.latest_dispatch = Some(LatestDispatch {
            handle: Arc::downgrade(&handle.inner),
            dtype,
            weights: !cached && topk_weights.is_some(),
        });
        Ok(())
    }

    fn row_bytes(&self, dtype: RecvDtype) -> i32 {
        (match dtype {
            RecvDtype::Bf16 => self.cfg.hidden * 2,
            RecvDtype::Fp8 => self.cfg.hidden,
        }) as i32
    }

    /// The views of the last dispatch's receive region (parity from the host mirror).
    fn dispatched(
        &self,
        handle: Handle,
        dtype: RecvDtype,
        topk: bool,
        weights: bool,
        per_expert: Option<Vec<usize>>,
    ) -> Dispatched<'_> {
        let parity = Parity::of_epoch(self.seq.dispatch);
        let base = self.mem.local_base();
        let r = |k| base + self.plan.region(k, parity).offset;
        Dispatched {
            stream: &self.stream,
            handle,
            dtype,
            hidden: self.cfg.hidden,
            top_k: self.cfg.top_k,
            recv_x: r(RegionKind::DispatchX),
            recv_scales: r(RegionKind::DispatchScales),
            recv_topk_idx: topk.then(|| r(RegionKind::DispatchTopkIdx)),
            recv_topk_weights: weights.then(|| r(RegionKind::DispatchTopkWeights)),
            num_recv_per_local_expert: per_expert,
        }
    }

    /// HostSync: waits (bounded) for the counts the dispatch kernel publishes to mapped memory.
    fn wait_host_counts(&mut self, tag: u64, epr: usize) -> Result<(usize, Vec<usize>)> {
        let start = Instant::now();
        let limit = self.cfg.timeout + Duration::from_secs(1);
        loop {
            if self.host_counts.load_u64(0) == Some(tag) {
                let n = self.host_counts.load_u64(1).unwrap_or(0) as usize;
                let e = (0..epr)
                    .map(|i| self.host_counts.load_u64(2 + i).unwrap_or(0) as usize)
                    .collect();
                return Ok((n, e));
            }
            self.check()?;
            // SAFETY: querying a live stream has no preconditions.
            let idle = unsafe { sys::cuStreamQuery(self.stream.cu_stream()) }
                == sys::CUresult::CUDA_SUCCESS;
            if idle && self.host_counts.load_u64(0) != Some(tag) {
                self.check()?;
                return Err(Error::Failed(
                    "dispatch finished without publishing its receive count".into(),
                ));
            }
            if start.elapsed() > limit {
                let e = Error::Timeout {
                    op: "dispatch",
                    rank: self.rank,
                    wait: crate::WaitKind::HostRecvCount,
                    peer: -1,
                    op_seq: self.seq.op,
                    expected: tag,
                    seen: self.host_counts.load_u64(0).unwrap_or(0),
                    waited: start.elapsed(),
                };
                self.failed = Some(e.to_string());
                return Err(e);
            }
            std::hint::spin_loop();
        }
    }

    /// Sends expert outputs back and sums each token's contributions (fp32, rank order) into
    /// `out` (`[T][hidden]` bf16). `y` holds one row per received row, in the dispatch's order;
    /// `y_weights` (`[rows][top_k]`) are summed into `out_weights` (`[T][top_k]`) the same way.
    pub fn combine(
        &mut self,
        y: &dyn DevicePtr<half::bf16>,
        y_weights: Option<&dyn DevicePtr<f32>>,
        handle: &Handle,
        out: &mut dyn DevicePtrMut<half::bf16>,
        out_weights: Option<&mut dyn DevicePtrMut<f32>>,
    ) -> Result<()> {
        self.ensure_ready()?;
        let h = self.own_handle(handle)?;
        h.check_routing()?;
        let (hd, k) = (self.cfg.hidden, self.cfg.top_k);
        let rows = h.num_recv.unwrap_or(h.max_rows);
        if y.len() < rows * hd || !y.len().is_multiple_of(hd) {
            let what = if h.num_recv.is_some() {
                "received"
            } else {
                "capacity: WorstCase dispatch"
            };
            return Err(Error::InvalidArgument {
                argument: "y",
                rule: format!(
                    "must hold rows * hidden = {} values (holds {}); rows = {rows} ({what})",
                    rows * hd,
                    y.len()
                ),
            });
        }
        match (&y_weights, &out_weights) {
            (Some(w), Some(_)) if w.len() < rows * k => {
                return Err(Error::InvalidArgument {
                    argument: "y_weights",
                    rule: format!(
                        "must hold rows * top_k = {} values (holds {})",
                        rows * k,
                        w.len()
                    ),
                });
            }
            (Some(_), Some(_)) | (None, None) => {}
            _ => {
                return Err(Error::InvalidArgument {
                    argument: "y_weights/out_weights",
                    rule: "give both or neither".into(),
                });
            }
        }
        let s = self.stream.clone();
        let (y_ptr, _gy) = y.device_ptr(&s);
        let yw = y_weights.map(|w| w.device_ptr(&s));
        let inputs = CombineInputs {
            y: y_ptr,
            y_weights: yw.as_ref().map_or(0, |p| p.0),
            in_place: false,
        };
        // SAFETY: y holds at least the received rows (checked against the host count or the
        // capacity the dispatch enforced on the device), y_weights as many weight rows.
        unsafe { self.launch_combine(handle, inputs, out, out_weights) }
    }

    /// Combine without moving y: every rank has written its expert output `y` (`[rows][hidden]`
    /// bf16) over the receive rows of its **latest** BF16 dispatch (`Dispatched::recv_x_ptr`,
    /// or [`crate::Dispatched::copy_into_recv_x`]), and, if `out_weights` is given, its weights
    /// over the received top-k weights. Each rank then pulls its tokens' contributions straight
    /// from the peers' receive regions over NVLink and sums them in rank order (fp32): one
    /// pass, no intermediate copy. `handle` must be the latest dispatch's.
    pub fn combine_in_place(
        &mut self,
        handle: &Handle,
        out: &mut dyn DevicePtrMut<half::bf16>,
        out_weights: Option<&mut dyn DevicePtrMut<f32>>,
    ) -> Result<()> {
        self.ensure_ready()?;
        self.own_handle(handle)?.check_routing()?;
        match &self.latest_dispatch {
            Some(latest)
                if latest.dtype == RecvDtype::Bf16
                    && std::ptr::eq(latest.handle.as_ptr(), Arc::as_ptr(&handle.inner)) =>
            {
                if out_weights.is_some() && !latest.weights {
                    return Err(Error::InvalidArgument {
                        argument: "out_weights",
                        rule: "in-place combine sums the top-k weights the latest dispatch \
                               received, and that dispatch carried none (a cached dispatch, or \
                               one without topk_weights): pass None"
                            .into(),
                    });
                }
            }
            Some(LatestDispatch {
                dtype: RecvDtype::Fp8,
                ..
            }) => {
                return Err(Error::InvalidArgument { argument: "handle", rule: "in-place combine needs a BF16 latest dispatch (FP8 rows cannot hold bf16 y)".into() });
            }
            _ => {
                return Err(Error::InvalidArgument {
                    argument: "handle",
                    rule: "in-place combine needs the handle of this rank's latest dispatch".into(),
                });
            }
        }
        let inputs = CombineInputs {
            y: 0,
            y_weights: 0,
            in_place: true,
        };
        // SAFETY: in place, the rows read lie in the receive regions of the symmetric buffers
        // at the offsets the handle's dispatch (this rank's latest, checked above) wrote.
        unsafe { self.launch_combine(handle, inputs, out, out_weights) }
    }

    /// Checks the outputs and launches the combine kernel.
    ///
    /// # Safety
    /// `inputs.y`/`inputs.y_weights` (unless in place) must hold the handle's received rows.
    unsafe fn launch_combine(
        &mut self,
        handle: &Handle,
        inputs: CombineInputs,
        out: &mut dyn DevicePtrMut<half::bf16>,
        out_weights: Option<&mut dyn DevicePtrMut<f32>>,
    ) -> Result<()> {
        let h = &handle.inner;
        let (hd, k, t) = (self.cfg.hidden, self.cfg.top_k, h.layout.num_tokens);
        if out.len() != t * hd {
            return Err(Error::InvalidArgument {
                argument: "out",
                rule: format!(
                    "must hold num_tokens * hidden = {} values (holds {})",
                    t * hd,
                    out.len()
                ),
            });
        }
        if let Some(o) = &out_weights
            && o.len() != t * k
        {
            return Err(Error::InvalidArgument {
                argument: "out_weights",
                rule: format!(
                    "must hold num_tokens * top_k = {} values (holds {})",
                    t * k,
                    o.len()
                ),
            });
        }
        let blocks = self.cfg.num_sms;
        let mut a = self.base_args();
        let r = |k| self.plan.region(k, Parity::Even).offset;
        a.off_comb_x = r(RegionKind::CombineX);
        a.off_comb_w = r(RegionKind::CombineWeights);
        a.off_x = r(RegionKind::DispatchX);
        a.off_topk_w = r(RegionKind::DispatchTopkWeights);
        a.num_tokens = t as i32;
        a.max_recv_rows = h.max_rows as i32;
        let weights = out_weights.is_some();
        a.flags = if inputs.in_place {
            abi::flags::IN_PLACE
        } else {
            0
        } | if weights { abi::flags::HAS_WEIGHTS } else { 0 };
        let s = &self.stream;
        let (out_ptr, _go) = out.device_ptr_mut(s);
        let ow = out_weights.map(|w| w.device_ptr_mut(s));
        let (slot_ptr, _g1) = h.layout.token_slot.device_ptr(s);
        let (rp, _g2) = h.recv_prefix.device_ptr(s);
        let (ri, _g3) = h.recv_src_idx.device_ptr(s);
        let (so, _g4) = h.send_offsets.device_ptr(s);
        a.x = inputs.y;
        a.topk_weights = inputs.y_weights;
        a.out = out_ptr;
        a.out_weights = ow.as_ref().map_or(0, |p| p.0);
        a.token_slot = slot_ptr;
        a.recv_prefix = rp;
        a.recv_src_idx = ri;
        a.send_offsets = so;
        let dev = self.ctx.ordinal();
        let rows = h.num_recv.unwrap_or(h.max_rows);
        check_device_ptr("y", a.x, rows * hd * 2, ROW_ALIGN, dev)?;
        check_device_ptr("y_weights", a.topk_weights, rows * k * 4, 4, dev)?;
        check_device_ptr("out", a.out, t * hd * 2, ROW_ALIGN, dev)?;
        check_device_ptr("out_weights", a.out_weights, t * k * 4, 4, dev)?;
        // SAFETY: out/out_weights hold T rows (checked above); y per the caller's contract; the
        // handle's arrays were written by its dispatch earlier on this stream.
        unsafe { self.kernels.launch_combine(s, &a, blocks) }?;
        self.seq.advance(abi::op::COMBINE);
        self.last_op = Some("combine");
        Ok(())
    }

    /// Records the ops `ops` issues on this buffer's stream into a CUDA graph instead of running
    /// them. Inside, use only allocation-free, host-wait-free calls: [`Self::layout_into`],
    /// [`Self::dispatch_into`], [`Self::cached_dispatch`], [`Self::combine`],
    /// [`Self::combine_in_place`], and your own kernels on this stream. Every rank must capture
    /// (and later replay) the same ops.
    ///
    /// When the ops hold a dispatch, `ops` runs **twice**: receive rows alternate between two
    /// regions, and each recording is made for one of the two parities a replay can start at.
    /// Pointers a dispatch returns inside `ops` (e.g. [`Dispatched::recv_x_ptr`] handed to an
    /// expert kernel captured in the same graph) are therefore right on every replay, whatever
    /// ran between replays. `ops` must issue the same epcomm ops both times.
    pub fn capture<F>(&mut self, mut ops: F) -> Result<EpGraph>
    where
        F: FnMut(&mut Self) -> Result<()>,
    {
        self.ensure_ready()?;
        let start = self.seq;
        let (first, delta) = self.record(&mut ops, start)?;
        let p = (start.dispatch % 2) as usize;
        let mut recordings = vec![first];
        let mut by_parity = [0, 0];
        if delta.dispatch > 0 {
            let shifted = Sequence {
                dispatch: start.dispatch + 1,
                ..start
            };
            let (other, other_delta) = self.record(&mut ops, shifted)?;
            if other_delta != delta {
                return Err(Error::InvalidArgument {
                    argument: "capture",
                    rule: format!(
                        "ops issued {other_delta:?} on the second recording and {delta:?} on the \
                         first; they must issue the same ops every time"
                    ),
                });
            }
            recordings.push(other);
            by_parity[1 - p] = 1;
        }
        Ok(EpGraph {
            recordings,
            by_parity,
            delta,
            buffer_id: self.id,
        })
    }

    /// One recording of `ops` with the host mirror at `at`; returns the graph and the ops it
    /// holds. The device ran nothing, so the mirror goes back to where it was.
    fn record<F>(
        &mut self,
        ops: &mut F,
        at: Sequence,
    ) -> Result<(cudarc::driver::CudaGraph, Sequence)>
    where
        F: FnMut(&mut Self) -> Result<()>,
    {
        let real = self.seq;
        self.seq = at;
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .context("beginning a graph capture")?;
        let captured = ops(self);
        let graph = self
            .stream
            .end_capture(
                sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
            )
            .context("ending a graph capture");
        let delta = self.seq.minus(&at);
        self.seq = real;
        captured?;
        let graph = graph?.ok_or(Error::InvalidArgument {
            argument: "capture",
            rule: "captured no work".into(),
        })?;
        Ok((graph, delta))
    }

    /// Replays a graph from [`Self::capture`] (stream-ordered, no host wait): the recording
    /// made for the current receive-region parity.
    pub fn replay(&mut self, graph: &EpGraph) -> Result<()> {
        self.ensure_ready()?;
        if graph.buffer_id != self.id {
            return Err(Error::InvalidArgument {
                argument: "graph",
                rule: "was captured on another Buffer".into(),
            });
        }
        let p = (self.seq.dispatch % 2) as usize;
        graph.recordings[graph.by_parity[p]]
            .launch()
            .context("launching a graph")?;
        self.seq.add(&graph.delta);
        Ok(())
    }
}

impl Drop for Buffer {
    /// Same order as [`Buffer::destroy`]; problems become a warning on stderr.
    fn drop(&mut self) {
        if let Err(e) = self.teardown() {
            eprintln!(
                "epcomm: warning: rank {} dropped its Buffer without every peer: {e}",
                self.rank
            );
        }
    }
}

/// The address kernels use for every rank's buffer: the mapping for a peer reached by stores,
/// this rank's own symmetric address for a peer reached by put/signal (NVSHMEM translates it
/// per PE).
///
/// # Errors
/// [`Error::InvalidArgument`] naming `world` when the plan says stores but the transport did not
/// map the peer.
fn peer_bases(routes: &RoutePlan, mem: &dyn SymmetricMemory) -> Result<Vec<u64>> {
    let me = routes.world().rank();
    routes
        .peers()
        .iter()
        .map(|p| match p.route {
            _ if p.peer == me => Ok(mem.local_base()),
            Route::PutSignal => Ok(mem.local_base()),
            Route::Store => mem.peer_base(p.peer).ok_or_else(|| Error::InvalidArgument {
                argument: "world",
                rule: format!(
                    "rank {} ({}) is not mapped into rank {me}, so stores cannot reach it",
                    p.peer,
                    p.tier.name()
                ),
            }),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    use epcomm_topology::{RoutePolicy, WorldLayout};

    /// Addresses as a transport reports them (0: not mapped).
    #[derive(Debug)]
    struct Bases(Vec<u64>, u64);

    impl SymmetricMemory for Bases {
        fn len(&self) -> usize {
            1
        }
        fn local_base(&self) -> u64 {
            self.1
        }
        fn peer_base(&self, peer: usize) -> Option<u64> {
            self.0.get(peer).copied().filter(|&b| b != 0)
        }
    }

    #[test]
    fn peer_bases_follow_the_route_plan() {
        use Route::*;
        let one_node = WorldLayout::new(3, 1, 3).unwrap();
        let all_mapped = Bases(vec![0x10, 0x20, 0x30], 0x20);
        let auto = RoutePlan::new(&one_node, &[Store], RoutePolicy::Auto).unwrap();
        assert_eq!(
            peer_bases(&auto, &all_mapped).unwrap(),
            vec![0x10, 0x20, 0x30]
        );
        // Put/signal everywhere: every peer addressed by my own base.
        let ps = RoutePlan::new(&one_node, &Route::ALL, RoutePolicy::PutSignal).unwrap();
        assert_eq!(peer_bases(&ps, &all_mapped).unwrap(), vec![0x20; 3]);
        assert_eq!(ps.put_signal_mask(), 0b101);
        // Another (virtual) node: the unmapped peers are planned as put/signal.
        let split = WorldLayout::with_virtual_nodes(4, 1, 4, 2).unwrap();
        let mem = Bases(vec![0x10, 0x20, 0, 0], 0x20);
        let plan = RoutePlan::new(&split, &Route::ALL, RoutePolicy::Auto).unwrap();
        assert_eq!(
            peer_bases(&plan, &mem).unwrap(),
            vec![0x10, 0x20, 0x20, 0x20]
        );
        assert_eq!(plan.put_signal_mask(), 0b1100);
        // A peer planned for stores that the transport did not map is an error.
        let unmapped = Bases(vec![0, 0x20, 0x30], 0x20);
        let err = peer_bases(&auto, &unmapped).unwrap_err();
        assert!(
            err.to_string()
                .contains("rank 0 (NVLink domain) is not mapped"),
            "{err}"
        );
    }

    #[test]
    fn host_sequence_mirrors_the_device_rules() {
        let mut s = Sequence::default();
        s.advance(abi::op::DISPATCH);
        s.advance(abi::op::COMBINE);
        s.advance(abi::op::CACHED_DISPATCH);
        s.advance(abi::op::COMBINE);
        // Same increments as `prologue` in intranode.cu.
        assert_eq!(
            s,
            Sequence {
                op: 4,
                notify: 1,
                dispatch: 2,
                combine: 2
            }
        );
        let before = s;
        s.advance(abi::op::DISPATCH);
        s.advance(abi::op::COMBINE);
        let delta = s.minus(&before);
        assert_eq!(
            delta,
            Sequence {
                op: 2,
                notify: 1,
                dispatch: 1,
                combine: 1
            }
        );
        // A graph replay advances the mirror by what the capture contained.
        let mut replayed = s;
        replayed.add(&delta);
        assert_eq!(
            replayed,
            Sequence {
                op: 8,
                notify: 3,
                dispatch: 4,
                combine: 4
            }
        );
    }
}
