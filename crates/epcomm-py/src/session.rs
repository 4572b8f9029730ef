//! [`Session`]: one rank's epcomm [`Buffer`] driven through raw device addresses, on the
//! device's primary CUDA context (the one PyTorch uses).
//!
//! What it adds to the frontend is bookkeeping the Python side needs and cannot get from a
//! `Dispatched` view that must not outlive the call: the rows a dispatch received (when the
//! host knows them) and the addresses of its receive arrays. Copies out of the receive
//! regions go through [`Session::copy_received`], which follows the device's own dispatch
//! parity (also in CUDA-graph replays): the Python side tracks no parity.
//!
//! Memory contract: every op is stream-ordered on the buffer's stream ([`Session::stream_handle`]);
//! caller arrays are [`Borrowed`] for the duration of that work (see [`Borrowed::new`]).
//!
//! Low-latency ops (when the options ask for low-latency memory): the session owns **two**
//! [`LlRecv`] sets and low-latency dispatches alternate between them, so a dispatch's outputs
//! stay valid until the second-next low-latency dispatch (DeepEP's rule: the next dispatch
//! writes the other set). [`Session::ll_dispatch`] and [`Session::ll_combine`] issue both
//! phases, or with `hook` only the send phase: the session then keeps the pending receive
//! phase (detached from the borrows of the caller's arrays, which the caller keeps alive) and
//! [`Session::ll_receive`] (the hook) issues it. Until then every other op is refused.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaStream};
use epcomm::{
    Buffer, CombineInput, CombineOutput, DeviceBytes, DispatchInput, Dispatched, ExpertParallel,
    Handle, HierarchicalBuffer, Layout, LlDispatchInput, LlFormat, LlPending, LlRecv,
    LlScalesLayout, OpStats, RecvArray, RecvMode, TierStats, XInput,
};
use epcomm_backends::TransportSpec;
use epcomm_bootstrap::{Bootstrap, BootstrapConfig};
use epcomm_topology::BufferPlan;

use crate::borrowed::{Borrowed, RawArray};
use crate::error::{BindError, Result};
use crate::fence::Fence;
use crate::options::BufferOptions;

/// How many rows a dispatch may receive and how the host learns the count.
#[derive(Clone, Debug)]
pub enum Rows {
    /// The host waits (bounded) for the exact count ([`RecvMode::HostSync`]).
    HostSync,
    /// At most this many rows, checked on the device; no host wait ([`RecvMode::Bounded`]).
    Bounded(usize),
    /// Into a handle from [`Session::alloc_handle`] (the buffer's capacity): no allocation and
    /// no host wait, so it can be recorded into a CUDA graph.
    Into(Handle),
}

/// Token rows of a dispatch: BF16 values, or e4m3 bytes with one f32 scale per 128 values.
#[derive(Clone, Copy, Debug)]
pub struct XArrays {
    /// `[T][hidden]` bf16 values, or e4m3 bytes when `scales` is given.
    pub x: RawArray,
    /// `[T][hidden / 128]` f32 scales: FP8 rows.
    pub scales: Option<RawArray>,
}

/// What a dispatch left: its routing, the count when the host knows it, and the addresses of
/// the received arrays at the parity this dispatch used.
#[derive(Clone, Debug)]
pub struct DispatchOut {
    /// The routing, for combine and cached dispatch.
    pub handle: Handle,
    /// Rows received (HostSync only).
    pub num_recv: Option<usize>,
    /// Rows per local expert (HostSync only).
    pub per_expert: Option<Vec<usize>>,
    /// Received rows.
    pub recv_x: u64,
    /// Received scales (FP8).
    pub recv_scales: Option<u64>,
    /// Received local top-k ids (not for a cached dispatch).
    pub recv_topk_idx: Option<u64>,
    /// Received top-k weights (when they travelled).
    pub recv_topk_weights: Option<u64>,
}

/// Where the receive arrays of one low-latency dispatch lie (one of the session's two
/// [`LlRecv`] sets), and which dispatch it was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlDispatchOut {
    /// 1-based number of this low-latency dispatch on the session (its handle's identity).
    pub seq: u64,
    /// 0 or 1: the receive set it wrote (`seq % 2` of the count before it).
    pub set: usize,
    /// `[local_experts][capacity][row_bytes]` rows (bf16, or e4m3 bytes).
    pub x: u64,
    /// `[local_experts][capacity][hidden / 128]` f32 scales (meaningful for FP8).
    pub scales: u64,
    /// `[local_experts]` i32 row counts.
    pub count: u64,
    /// `[local_experts][capacity]` i32 source token index per row.
    pub src_info: u64,
    /// `[local_experts][world]` i64 `(first row << 32) | rows` per source rank.
    pub layout_range: u64,
    /// Local experts.
    pub num_local_experts: usize,
    /// Rows per local expert (`world * ll_max_tokens_per_rank`).
    pub capacity: usize,
    /// Bytes per row (`hidden * 2` bf16, `hidden` FP8).
    pub row_bytes: usize,
}

/// Which low-latency op a pending receive phase belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LlOp {
    /// A dispatch.
    Dispatch,
    /// A combine.
    Combine,
}

impl LlOp {
    fn name(self) -> &'static str {
        match self {
            Self::Dispatch => "dispatch",
            Self::Combine => "combine",
        }
    }
}

/// A receive phase detached from its arrays' borrows ([`LlPending::detach`]), held by the
/// session (which the PyO3 layer shares across threads behind a mutex, so it must be `Send`).
#[derive(Debug)]
struct Detached(LlPending<'static>);

// SAFETY: `LlPending` is not `Send` only because a split combine's value may borrow the
// caller's arrays (`&dyn DevicePtr`) to take their stream events again. A detached value holds
// no borrow: `detach` erases the lifetime, so it cannot keep references to the arrays (they
// are the session method's locals) and drops them; what remains is the kernel arguments (plain
// addresses and counts), numbers and an `Arc<AtomicBool>`, all `Send`. `Detached` is only
// built from `detach`'s result (`Session::ll_dispatch`, `Session::ll_combine`).
unsafe impl Send for Detached {}

/// The low-latency state: two receive sets and the pending receive phase.
#[derive(Debug)]
struct LlState {
    recvs: [LlRecv; 2],
    /// Low-latency dispatches issued so far (the latest wrote set `(dispatches - 1) % 2`).
    dispatches: u64,
    /// Low-latency ops (dispatch or combine) issued so far: the identity of a hook.
    ops: u64,
    /// The op whose send phase ran and whose receive phase has not: `(op number, which,
    /// pending)`.
    pending: Option<(u64, LlOp, Detached)>,
}

/// One rank's buffer; see the module docs.
#[derive(Debug)]
pub struct Session {
    /// `None` once destroyed.
    buf: Option<Ep>,
    spec: TransportSpec,
    /// The flat buffer plan of the config (`epcomm::rules::plan`): the sizes reported after
    /// `destroy`.
    plan: BufferPlan,
    device: usize,
    stream: Arc<CudaStream>,
    /// Dispatches (cached or not) launched so far: the frontend's and the device's count, so
    /// its parity names the region the latest dispatch wrote.
    dispatches: u64,
    /// Low-latency receive sets (None: the options asked for no low-latency memory).
    ll: Option<LlState>,
    /// The stream order against a caller's stream ([`Self::ordered`]).
    fence: Fence,
}

impl Session {
    /// Joins the group and creates this rank's buffer on GPU `device` (collective; blocks
    /// until every rank has joined, bounded by the bootstrap timeout). `bootstrap: None` reads
    /// the launcher's variables (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, ...).
    pub fn new(
        device: usize,
        bootstrap: Option<BootstrapConfig>,
        options: &BufferOptions,
    ) -> Result<Self> {
        let boot_cfg = match bootstrap {
            Some(cfg) => cfg,
            None => BootstrapConfig::from_env()?,
        };
        boot_cfg.validate()?;
        let (cfg, spec, plan) = options.resolve(
            boot_cfg.world_size,
            boot_cfg.rank,
            boot_cfg.local_world_size,
        )?;
        // SAFETY: probing for the driver library has no preconditions (cudarc panics on the
        // first driver call without it, so this comes first).
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(BindError::NoDriver);
        }
        let ctx = CudaContext::new(device).map_err(|source| BindError::Driver {
            context: "retaining the GPU's primary context",
            source,
        })?;
        // SAFETY: cudarc's cross-stream event tracking is only needed for slices used on more
        // than one stream; every slice the frontend allocates (layouts, handles) is allocated,
        // used and freed on the buffer's one stream, and the Python side orders its own
        // streams against it with events. Without tracking no cudarc event lands in a CUDA
        // graph that records the buffer's stream.
        unsafe { ctx.disable_event_tracking() };
        let boot = Arc::new(Bootstrap::connect(boot_cfg)?);
        let transport = spec.build(ctx.clone(), boot)?;
        if options.two_tier {
            let buf = HierarchicalBuffer::new(ctx, transport, cfg)?;
            let stream = ExpertParallel::stream(&buf).clone();
            keep_for_the_process(&stream);
            let fence = Fence::new(&stream)?;
            return Ok(Self {
                buf: Some(Ep::TwoTier(Box::new(buf))),
                spec,
                plan,
                device,
                stream,
                dispatches: 0,
                ll: None,
                fence,
            });
        }
        let mut buf = Buffer::new(ctx, transport, cfg)?;
        // `plan` is `epcomm::rules::plan`'s, the function `Buffer::new` sizes the buffer by:
        // they can only disagree if `Buffer::new` stopped allocating that plan.
        if buf.symmetric_bytes() as u64 != plan.total_bytes() {
            return Err(BindError::Internal(format!(
                "the buffer holds {} bytes but epcomm::rules::plan says {}: Buffer::new no \
                 longer allocates the plan the binding reports",
                buf.symmetric_bytes(),
                plan.total_bytes()
            )));
        }
        let ll = if buf.config().ll_max_tokens_per_rank > 0 {
            Some(LlState {
                recvs: [buf.alloc_ll_recv()?, buf.alloc_ll_recv()?],
                dispatches: 0,
                ops: 0,
                pending: None,
            })
        } else {
            None
        };
        let stream = buf.stream().clone();
        keep_for_the_process(&stream);
        let fence = Fence::new(&stream)?;
        Ok(Self {
            buf: Some(Ep::Flat(Box::new(buf))),
            spec,
            plan,
            device,
            stream,
            dispatches: 0,
            ll,
            fence,
        })
    }

    /// Runs `op` (which queues work on the buffer's stream) in the stream order of `caller`, a
    /// framework's stream given by its raw `CUstream` handle: the buffer's stream first waits
    /// for the work queued on `caller` so far; then, with `join` and when `op` succeeded,
    /// `caller` waits for the buffer's stream. `None`: no ordering (the caller orders the
    /// streams itself). See [`Fence`].
    ///
    /// # Safety
    /// `caller` is a live stream of the buffer's context (0: its legacy default stream).
    pub unsafe fn ordered<T>(
        &mut self,
        caller: Option<u64>,
        join: bool,
        op: impl FnOnce(&mut Self) -> Result<T>,
    ) -> Result<T> {
        if let Some(c) = caller {
            // SAFETY: the caller's contract.
            unsafe { self.fence.after(c) }?;
        }
        let out = op(self)?;
        if let (Some(c), true) = (caller, join) {
            // SAFETY: the caller's contract.
            unsafe { self.fence.join(c) }?;
        }
        Ok(out)
    }

    /// `caller` waits for the work queued on the buffer's stream so far.
    ///
    /// # Safety
    /// As for [`Self::ordered`].
    pub unsafe fn join(&self, caller: u64) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.fence.join(caller) }
    }

    fn ep(&mut self) -> Result<&mut Ep> {
        self.buf.as_mut().ok_or(BindError::Destroyed)
    }

    fn ep_ref(&self) -> Result<&Ep> {
        self.buf.as_ref().ok_or(BindError::Destroyed)
    }

    /// The flat buffer, for `what` (an op only a flat buffer has).
    fn buf(&mut self, what: &str) -> Result<&mut Buffer> {
        self.ep()?.flat(what)
    }

    /// The buffer's stream (`CUstream`) as an integer, for the framework's external-stream
    /// wrapper.
    pub fn stream_handle(&self) -> u64 {
        self.stream.cu_stream() as u64
    }

    /// The GPU ordinal.
    pub fn device(&self) -> usize {
        self.device
    }

    /// This rank.
    pub fn rank(&self) -> Result<usize> {
        Ok(on_ep!(self.ep_ref()?, b => b.world_rank()))
    }

    /// Number of ranks.
    pub fn world_size(&self) -> Result<usize> {
        Ok(on_ep!(self.ep_ref()?, b => b.world_size()))
    }

    /// The configuration.
    pub fn config(&self) -> Result<&epcomm::BufferConfig> {
        Ok(on_ep!(self.ep_ref()?, b => b.config()))
    }

    /// Whether the buffer runs two tiers (rail, then node).
    pub fn is_two_tier(&self) -> bool {
        matches!(self.buf, Some(Ep::TwoTier(_)))
    }

    /// The transport spec.
    pub fn spec(&self) -> TransportSpec {
        self.spec
    }

    /// Rows a dispatch can receive at most (flat: `max_tokens_per_rank * world`).
    pub fn capacity(&self) -> usize {
        match &self.buf {
            Some(ep) => on_ep!(ep, b => b.capacity()),
            None => self.plan.recv_rows() as usize,
        }
    }

    /// Bytes of symmetric memory per rank (every tier's).
    pub fn symmetric_bytes(&self) -> usize {
        match &self.buf {
            Some(ep) => on_ep!(ep, b => b.symmetric_bytes()),
            None => self.plan.total_bytes() as usize,
        }
    }

    /// `(peer, tier, route)` for every rank, as names.
    pub fn route_plan(&self) -> Result<Vec<(usize, String, String)>> {
        let Ep::Flat(buf) = self.ep_ref()? else {
            return Err(two_tier_refusal("route_plan"));
        };
        Ok(buf
            .route_plan()
            .peers()
            .iter()
            .enumerate()
            .map(|(peer, p)| (peer, p.tier.name().to_string(), p.route.name().to_string()))
            .collect())
    }

    /// Whether an earlier failure made the buffer unusable.
    pub fn is_failed(&self) -> bool {
        self.buf
            .as_ref()
            .is_none_or(|ep| on_ep!(ep, b => b.is_failed()))
    }

    /// Dispatches launched so far.
    pub fn dispatches(&self) -> u64 {
        self.dispatches
    }

    /// Allocates a layout for `num_tokens` tokens ([`Buffer::alloc_layout`]).
    pub fn alloc_layout(&mut self, num_tokens: usize) -> Result<Layout> {
        Ok(on_ep!(self.ep()?, b => b.alloc_layout(num_tokens))?)
    }

    /// Computes `layout` from `topk_idx` (`[T][top_k]` i64) ([`Buffer::layout_into`]).
    ///
    /// # Safety
    /// `topk_idx` as for [`Borrowed::new`] on the buffer's stream.
    pub unsafe fn layout_into(&mut self, topk_idx: RawArray, layout: &Layout) -> Result<()> {
        // SAFETY: the caller's contract.
        let idx = unsafe { Borrowed::<i64>::new(topk_idx, &self.stream) };
        Ok(on_ep!(self.ep()?, b => b.layout_into(&idx, layout))?)
    }

    /// Computes `layout` from a routing given by ranks: `in_rank` (`[T][world]` bytes) and
    /// `tokens_per_expert` (`[E]` i32) ([`Buffer::layout_from_ranks_into`]).
    ///
    /// # Safety
    /// Both arrays as for [`Borrowed::new`] on the buffer's stream.
    pub unsafe fn layout_from_ranks_into(
        &mut self,
        in_rank: RawArray,
        tokens_per_expert: RawArray,
        layout: &Layout,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        let flags = unsafe { Borrowed::<u8>::new(in_rank, &self.stream) };
        // SAFETY: as above.
        let counts = unsafe { Borrowed::<i32>::new(tokens_per_expert, &self.stream) };
        Ok(self
            .buf("a routing given by ranks (is_token_in_rank)")?
            .layout_from_ranks_into(&flags, &counts, layout)?)
    }

    /// Allocates a capacity-sized handle for [`Rows::Into`] ([`Buffer::alloc_handle`]).
    pub fn alloc_handle(&mut self, layout: &Layout) -> Result<Handle> {
        Ok(on_ep!(self.ep()?, b => b.alloc_handle(layout))?)
    }

    /// Dispatches `x` along `layout` with `topk_idx` (the array the layout was computed
    /// from) and optional weights; without `topk_idx`, rows only ([`Buffer::dispatch_rows`],
    /// for a layout given by ranks: weights must then be absent).
    ///
    /// # Safety
    /// Every array as for [`Borrowed::new`] on the buffer's stream.
    pub unsafe fn dispatch(
        &mut self,
        x: XArrays,
        topk_idx: Option<RawArray>,
        topk_weights: Option<RawArray>,
        layout: &Layout,
        rows: Rows,
    ) -> Result<DispatchOut> {
        let s = self.stream.clone();
        // SAFETY: the caller's contract, for each array.
        let xb = unsafe { XBorrow::new(x, &s) };
        let Some(topk_idx) = topk_idx else {
            let buf = self.buf("a dispatch without topk_idx (rows only)")?;
            if topk_weights.is_some() {
                return Err(epcomm::Error::InvalidArgument {
                    argument: "topk_weights",
                    rule: "a dispatch without topk_idx sends no weights (pass None)".into(),
                }
                .into());
            }
            let x = xb.input();
            let seen = match rows {
                Rows::HostSync => Seen::of(&buf.dispatch_rows(&x, layout, RecvMode::HostSync)?),
                Rows::Bounded(n) => {
                    Seen::of(&buf.dispatch_rows(&x, layout, RecvMode::Bounded(n))?)
                }
                Rows::Into(h) => Seen::of(&buf.dispatch_rows_into(&x, &h)?),
            };
            return self.launched(seen);
        };
        // SAFETY: as above.
        let idx = unsafe { Borrowed::<i64>::new(topk_idx, &s) };
        // SAFETY: as above.
        let w = topk_weights.map(|w| unsafe { Borrowed::<f32>::new(w, &s) });
        let input = DispatchInput {
            x: xb.input(),
            topk_idx: &idx,
            topk_weights: w.as_ref().map(|w| w as _),
        };
        let seen = on_ep!(self.ep()?, buf => match rows {
            Rows::HostSync => Seen::of(&buf.dispatch(&input, layout, RecvMode::HostSync)?),
            Rows::Bounded(n) => Seen::of(&buf.dispatch(&input, layout, RecvMode::Bounded(n))?),
            Rows::Into(h) => Seen::of(&buf.dispatch_into(&input, &h)?),
        });
        self.launched(seen)
    }

    /// Sends new rows along `handle`'s routing ([`Buffer::cached_dispatch`]).
    ///
    /// # Safety
    /// Every array as for [`Borrowed::new`] on the buffer's stream.
    pub unsafe fn cached_dispatch(&mut self, x: XArrays, handle: &Handle) -> Result<DispatchOut> {
        let s = self.stream.clone();
        // SAFETY: the caller's contract.
        let xb = unsafe { XBorrow::new(x, &s) };
        let seen = on_ep!(self.ep()?, buf => Seen::of(&buf.cached_dispatch(&xb.input(), handle)?));
        self.launched(seen)
    }

    /// Counts a launched dispatch.
    fn launched(&mut self, seen: Seen) -> Result<DispatchOut> {
        self.dispatches += 1;
        Ok(DispatchOut {
            handle: seen.handle,
            num_recv: seen.num_recv,
            per_expert: seen.per_expert,
            recv_x: seen.recv_x,
            recv_scales: seen.recv_scales,
            recv_topk_idx: seen.recv_topk_idx,
            recv_topk_weights: seen.recv_topk_weights,
        })
    }

    /// Copies `array` of the rows the latest dispatch received (its handle: `h`) into `dst`,
    /// as many rows as the device counted, from the region copy the device's own dispatch
    /// count names ([`Buffer::copy_received`]): right at either parity,
    /// also replayed from a CUDA graph; the Python side tracks no parity.
    ///
    /// # Safety
    /// `dst` must be live device memory until the copy ran on the buffer's stream.
    pub unsafe fn copy_received(
        &mut self,
        h: &Handle,
        array: RecvArray,
        dst: DeviceBytes,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        Ok(on_ep!(self.ep()?, b => unsafe { b.copy_received(h, array, dst) })?)
    }

    /// Sums every rank's rows of `y` back to this rank's tokens ([`Buffer::combine`]);
    /// `consuming`: the caller no longer reads the dispatch's receive rows
    /// ([`CombineInput::consuming`]).
    ///
    /// # Safety
    /// Every array as for [`Borrowed::new`] on the buffer's stream.
    pub unsafe fn combine(
        &mut self,
        handle: &Handle,
        y: RawArray,
        y_weights: Option<RawArray>,
        out: RawArray,
        out_weights: Option<RawArray>,
        consuming: bool,
    ) -> Result<()> {
        let s = self.stream.clone();
        // SAFETY: the caller's contract, for each array.
        let y = unsafe { Borrowed::<half::bf16>::new(y, &s) };
        // SAFETY: as above.
        let yw = y_weights.map(|w| unsafe { Borrowed::<f32>::new(w, &s) });
        // SAFETY: as above.
        let mut out = unsafe { Borrowed::<half::bf16>::new(out, &s) };
        // SAFETY: as above.
        let mut ow = out_weights.map(|w| unsafe { Borrowed::<f32>::new(w, &s) });
        let input = CombineInput {
            y: &y,
            y_weights: yw.as_ref().map(|w| w as _),
            consume_recv: consuming,
        };
        let output = CombineOutput {
            out: &mut out,
            out_weights: ow.as_mut().map(|w| w as _),
        };
        Ok(on_ep!(self.ep()?, buf => buf.combine(&input, handle, output))?)
    }

    /// Combine pulling every rank's latest receive rows ([`Buffer::combine_in_place`]).
    ///
    /// # Safety
    /// `out`, `out_weights` as for [`Borrowed::new`] on the buffer's stream.
    pub unsafe fn combine_in_place(
        &mut self,
        handle: &Handle,
        out: RawArray,
        out_weights: Option<RawArray>,
    ) -> Result<()> {
        let s = self.stream.clone();
        // SAFETY: the caller's contract.
        let mut out = unsafe { Borrowed::<half::bf16>::new(out, &s) };
        // SAFETY: as above.
        let mut ow = out_weights.map(|w| unsafe { Borrowed::<f32>::new(w, &s) });
        Ok(self.buf("combine_in_place")?.combine_in_place(
            handle,
            &mut out,
            ow.as_mut().map(|w| w as _),
        )?)
    }

    /// The low-latency state, or an error naming `num_max_dispatch_tokens_per_rank` when the
    /// session has no low-latency memory.
    fn ll_state(&mut self) -> Result<(&mut Buffer, &mut LlState)> {
        let buf = self
            .buf
            .as_mut()
            .ok_or(BindError::Destroyed)?
            .flat("the low-latency ops")?;
        let ll = self.ll.as_mut().ok_or_else(|| BindError::InvalidArgument {
            argument: "num_max_dispatch_tokens_per_rank",
            rule: "is 0 for this Buffer, so it has no low-latency memory: create the Buffer with \
                   num_max_dispatch_tokens_per_rank > 0 to use the low-latency ops"
                .into(),
        })?;
        Ok((buf, ll))
    }

    /// Fails while a low-latency op's receive phase is pending (its hook not called).
    fn ll_idle(ll: &LlState, what: &str) -> Result<()> {
        match &ll.pending {
            Some((n, op, _)) => Err(BindError::InvalidArgument {
                argument: "hook",
                rule: format!(
                    "low-latency {} #{n} was sent with return_recv_hook=True and its hook has not \
                     been called: call it before the next {what}",
                    op.name()
                ),
            }),
            None => Ok(()),
        }
    }

    /// Whether the session has low-latency memory, and the op number of a pending receive.
    pub fn ll_status(&self) -> (bool, Option<u64>) {
        match &self.ll {
            None => (false, None),
            Some(ll) => (true, ll.pending.as_ref().map(|(n, _, _)| *n)),
        }
    }

    /// A low-latency dispatch of `num_tokens` bf16 rows `x` (`[T][hidden]`) routed by
    /// `topk_idx` (`[T][top_k]` i64) into the next of the two receive sets. `hook`: only the
    /// send phase is issued, and the receive phase stays pending until [`Self::ll_receive`]
    /// with the returned op number; otherwise both phases are issued (the frontend's one
    /// fused kernel) and no op number is returned. `scales`: how the receive set stores the
    /// FP8 scales (see [`LlScalesLayout`]). `stats` (`[local_experts]` i32): the receive phase
    /// adds the rows per local expert to it.
    ///
    /// # Safety
    /// `x`, `topk_idx` and `stats` as for [`Borrowed::new`] on the buffer's stream; with `hook`
    /// they must stay allocated (and `x`, `topk_idx` unwritten, `stats` untouched) until the
    /// receive phase issued by [`Self::ll_receive`] (or the destroy that drops it) has
    /// finished on the stream.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn ll_dispatch(
        &mut self,
        x: RawArray,
        topk_idx: RawArray,
        num_tokens: usize,
        format: LlFormat,
        scales: LlScalesLayout,
        stats: Option<RawArray>,
        hook: bool,
    ) -> Result<(Option<u64>, LlDispatchOut)> {
        let s = self.stream.clone();
        let (buf, ll) = self.ll_state()?;
        Self::ll_idle(ll, "low-latency op")?;
        // SAFETY: the caller's contract.
        let xb = unsafe { Borrowed::<half::bf16>::new(x, &s) };
        // SAFETY: as above.
        let idx = unsafe { Borrowed::<i64>::new(topk_idx, &s) };
        // SAFETY: as above.
        let mut stats = stats.map(|a| unsafe { Borrowed::<i32>::new(a, &s) });
        let input = LlDispatchInput {
            x: &xb,
            topk_idx: &idx,
            num_tokens,
            cumulative_stats: stats
                .as_mut()
                .map(|b| b as &mut dyn cudarc::driver::DevicePtrMut<i32>),
        };
        let set = (ll.dispatches % 2) as usize;
        let recv = &mut ll.recvs[set];
        recv.set_scales_layout(scales);
        let n = if hook {
            let pending = buf.ll_dispatch_send(input, format, recv)?;
            // SAFETY: the pending receive names `x`, `topk_idx` (kept alive by the caller until
            // the receive phase ran: this function's contract; the Python side holds the
            // tensors until the hook ran) and the receive set `set`, which the session owns and
            // does not reuse before the receive phase: every other op is refused while it is
            // pending, and the next dispatch writes the other set.
            let pending = Detached(unsafe { pending.detach() });
            ll.ops += 1;
            ll.pending = Some((ll.ops, LlOp::Dispatch, pending));
            Some(ll.ops)
        } else {
            buf.ll_dispatch(input, format, recv)?;
            ll.ops += 1;
            None
        };
        ll.dispatches += 1;
        let r = &ll.recvs[set];
        let out = LlDispatchOut {
            seq: ll.dispatches,
            set,
            x: r.x_ptr(),
            scales: r.scales_ptr(),
            count: r.count_ptr(),
            src_info: r.src_info_ptr(),
            layout_range: r.layout_range_ptr(),
            num_local_experts: r.num_local_experts(),
            capacity: r.capacity(),
            row_bytes: r.row_bytes(),
        };
        Ok((n, out))
    }

    /// A low-latency combine of the expert outputs `y` (`[local_experts][capacity][hidden]`
    /// bf16) of low-latency dispatch `seq` (its [`LlDispatchOut::seq`]), reduced with this
    /// rank's `topk_idx`/`topk_weights` of that dispatch into `out` (`[T][hidden]` bf16).
    /// `hook`: only the send phase is issued and the receive phase (which writes `out`) stays
    /// pending until [`Self::ll_receive`] with the returned op number; otherwise both phases
    /// are issued (one fused kernel) and no op number is returned.
    ///
    /// # Errors
    /// [`BindError::InvalidArgument`] naming `handle` when `seq` is not a dispatch of this
    /// session or its receive set was written again since (a dispatch's outputs last until
    /// the second-next low-latency dispatch).
    ///
    /// # Safety
    /// Every array as for [`Borrowed::new`] on the buffer's stream; with `hook` kept allocated
    /// (and `out` unread by others) until the receive phase has finished on the stream.
    pub unsafe fn ll_combine(
        &mut self,
        seq: u64,
        y: RawArray,
        topk_idx: RawArray,
        topk_weights: RawArray,
        out: RawArray,
        hook: bool,
    ) -> Result<Option<u64>> {
        let s = self.stream.clone();
        let (buf, ll) = self.ll_state()?;
        Self::ll_idle(ll, "low-latency op")?;
        if seq == 0 || seq > ll.dispatches || seq + 1 < ll.dispatches {
            return Err(BindError::InvalidArgument {
                argument: "handle",
                rule: format!(
                    "belongs to low-latency dispatch #{seq}, and {} low-latency dispatches ran on \
                     this Buffer: a dispatch's receive arrays (and handle) stay valid until the \
                     second-next low-latency dispatch",
                    ll.dispatches
                ),
            });
        }
        let set = ((seq - 1) % 2) as usize;
        // SAFETY: the caller's contract, for each array.
        let yb = unsafe { Borrowed::<half::bf16>::new(y, &s) };
        // SAFETY: as above.
        let idx = unsafe { Borrowed::<i64>::new(topk_idx, &s) };
        // SAFETY: as above.
        let w = unsafe { Borrowed::<f32>::new(topk_weights, &s) };
        // SAFETY: as above.
        let mut o = unsafe { Borrowed::<half::bf16>::new(out, &s) };
        let recv = &ll.recvs[set];
        if !hook {
            buf.ll_combine(&yb, &idx, &w, recv, &mut o)?;
            ll.ops += 1;
            return Ok(None);
        }
        let pending = buf.ll_combine_send(&yb, &idx, &w, recv, &mut o)?;
        // SAFETY: the pending receive names `y`, `topk_idx`, `topk_weights`, `out` (kept alive
        // by the caller until the receive phase ran: this function's contract; the Python side
        // holds the tensors until the hook ran) and receive set `set`, which the session owns
        // and no dispatch writes before the receive phase (every op is refused meanwhile).
        // Other streams that read `out` are ordered after the receive phase by the caller (no
        // cudarc events: the session turned event tracking off; the Python hook makes the
        // current stream wait for the comm stream after it).
        let pending = Detached(unsafe { pending.detach() });
        ll.ops += 1;
        ll.pending = Some((ll.ops, LlOp::Combine, pending));
        Ok(Some(ll.ops))
    }

    /// The hook: issues the receive phase of low-latency op `op` (the number its send phase
    /// returned). Stream-ordered; no host wait.
    ///
    /// # Errors
    /// [`BindError::InvalidArgument`] naming `hook` when that op's receive phase is not the
    /// pending one (already issued, or another op's).
    pub fn ll_receive(&mut self, op: u64) -> Result<()> {
        let (buf, ll) = self.ll_state()?;
        match ll.pending.take() {
            Some((n, _, pending)) if n == op => Ok(buf.ll_receive(pending.0)?),
            other => {
                let now = match &other {
                    Some((n, which, _)) => {
                        format!("the pending one is low-latency {} #{n}", which.name())
                    }
                    None => "no receive phase is pending".into(),
                };
                ll.pending = other;
                Err(BindError::InvalidArgument {
                    argument: "hook",
                    rule: format!(
                        "the hook of low-latency op #{op} can be called once, right after its \
                         send phase and before any other op; {now}"
                    ),
                })
            }
        }
    }

    /// Masks or unmasks peer `rank` for the low-latency ops issued next
    /// ([`epcomm::Buffer::ll_set_masked`]).
    pub fn ll_set_masked(&mut self, rank: usize, masked: bool) -> Result<()> {
        Ok(self.buf("rank masking")?.ll_set_masked(rank, masked)?)
    }

    /// Unmasks every rank ([`epcomm::Buffer::ll_clear_mask`]).
    pub fn ll_clear_mask(&mut self) -> Result<()> {
        Ok(self.buf("rank masking")?.ll_clear_mask()?)
    }

    /// Copies the mask (`[world]` i32) into `status`, stream-ordered
    /// ([`epcomm::Buffer::ll_mask_into`]).
    ///
    /// # Safety
    /// `status` as for [`Borrowed::new`] on the buffer's stream.
    pub unsafe fn ll_mask_into(&mut self, status: RawArray) -> Result<()> {
        // SAFETY: the caller's contract.
        let mut status = unsafe { Borrowed::<i32>::new(status, &self.stream) };
        Ok(self.buf("rank masking")?.ll_mask_into(&mut status)?)
    }

    /// The masked ranks after the issued ops ([`epcomm::Buffer::ll_masked_ranks`]).
    pub fn ll_masked_ranks(&mut self) -> Result<Vec<usize>> {
        Ok(self.buf("rank masking")?.ll_masked_ranks()?)
    }

    /// Waits for every issued op and reports a device failure.
    pub fn synchronize(&mut self) -> Result<()> {
        Ok(on_ep!(self.ep()?, b => b.synchronize())?)
    }

    /// Who waited for whom in the last op (collective).
    pub fn last_op_stats(&mut self) -> Result<Option<OpStats>> {
        Ok(match self.ep()? {
            Ep::Flat(b) => b.last_op_stats()?,
            // The tier whose wait was longest: its stats name world ranks.
            Ep::TwoTier(b) => b.last_op_stats()?.map(|s| {
                let (_, tier, _) = s.late();
                if tier == "rail" { s.rail } else { s.node }
            }),
        })
    }

    /// Delays the ops issued next on this rank's stream (diagnostics).
    pub fn inject_delay(&mut self, delay: Duration) -> Result<()> {
        match self.ep()? {
            Ep::Flat(b) => b.inject_delay(delay)?,
            // Before the first stage.
            Ep::TwoTier(b) => b.rail().inject_delay(delay)?,
        }
        Ok(())
    }

    /// Frees the buffer after every rank stopped using it (collective); later calls fail
    /// with [`BindError::Destroyed`]. Destroying twice is a no-op.
    pub fn destroy(&mut self) -> Result<()> {
        if let Some(ll) = self.ll.as_mut() {
            // A receive phase never issued is dropped: nothing of it was launched. (Dropping it
            // marks the buffer failed, which no longer matters: it is torn down next.)
            ll.pending = None;
        }
        match self.buf.take() {
            Some(ep) => Ok(on_ep!(ep, b => b.destroy())?),
            None => Ok(()),
        }
    }
}

/// The buffer of a session: flat, or two-tier (rail, then node).
#[derive(Debug)]
enum Ep {
    Flat(Box<Buffer>),
    TwoTier(Box<HierarchicalBuffer>),
}

/// `$body` with `$b` bound to the session's buffer of either tiering (the calls resolve to the
/// same-named [`ExpertParallel`] methods).
macro_rules! on_ep {
    ($ep:expr, $b:ident => $body:expr) => {
        match $ep {
            Ep::Flat($b) => $body,
            Ep::TwoTier($b) => $body,
        }
    };
}
use on_ep;

impl Ep {
    /// The flat buffer, for `what` (an op only a flat buffer has).
    fn flat(&mut self, what: &str) -> Result<&mut Buffer> {
        match self {
            Self::Flat(b) => Ok(&mut **b),
            Self::TwoTier(_) => Err(two_tier_refusal(what)),
        }
    }
}

/// The error of an op a two-tier buffer does not have.
fn two_tier_refusal(what: &str) -> BindError {
    BindError::InvalidArgument {
        argument: "two_tier",
        rule: format!(
            "{what} runs on a flat Buffer (two_tier=False); this one is two-tier, which \
             dispatches by topk_idx and combines"
        ),
    }
}

/// What a `Dispatched` view told, copied out before the view (which borrows the buffer) ends.
struct Seen {
    handle: Handle,
    num_recv: Option<usize>,
    per_expert: Option<Vec<usize>>,
    recv_x: u64,
    recv_scales: Option<u64>,
    recv_topk_idx: Option<u64>,
    recv_topk_weights: Option<u64>,
}

impl Seen {
    fn of(d: &Dispatched<'_>) -> Self {
        Self {
            handle: d.handle().clone(),
            num_recv: d.num_recv(),
            per_expert: d.num_recv_per_local_expert().map(<[usize]>::to_vec),
            recv_x: d.recv_x_ptr(),
            recv_scales: d.recv_scales_ptr(),
            recv_topk_idx: d.recv_topk_idx_ptr(),
            recv_topk_weights: d.recv_topk_weights_ptr(),
        }
    }
}

/// The borrowed arrays of a dispatch's `x`.
enum XBorrow {
    Bf16(Borrowed<half::bf16>),
    Fp8(Borrowed<u8>, Borrowed<f32>),
}

impl XBorrow {
    /// Borrows `x`: FP8 exactly when scales are given (also for zero tokens, so that every
    /// rank launches the same op).
    ///
    /// # Safety
    /// As [`Borrowed::new`] for each array.
    unsafe fn new(x: XArrays, s: &Arc<CudaStream>) -> Self {
        // SAFETY: the caller's contract.
        unsafe {
            match x.scales {
                None => Self::Bf16(Borrowed::new(x.x, s)),
                Some(scales) => Self::Fp8(Borrowed::new(x.x, s), Borrowed::new(scales, s)),
            }
        }
    }

    fn input(&self) -> XInput<'_> {
        match self {
            Self::Bf16(x) => XInput::Bf16(x),
            Self::Fp8(x, scales) => XInput::Fp8 { x, scales },
        }
    }
}

/// Every session's stream, kept until the process exits: PyTorch tensors that an op recorded on
/// the stream (`record_stream`) may outlive their `Buffer`, and the caching allocator records an
/// event on that stream when it frees them, which must then still be a live stream of a live
/// context (as DeepEP's own comm stream is). One stream per `Buffer` created.
fn keep_for_the_process(stream: &Arc<CudaStream>) {
    static KEPT: std::sync::Mutex<Vec<Arc<CudaStream>>> = std::sync::Mutex::new(Vec::new());
    KEPT.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .push(stream.clone());
}
