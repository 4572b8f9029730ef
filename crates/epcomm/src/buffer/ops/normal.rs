//! The normal (throughput) op family: dispatch, dispatch into a preallocated handle, cached
//! dispatch, combine and in-place combine, through the symmetric buffer.
//!
//! Memory contract: a dispatch writes this rank's rows straight into their final rows of every
//! destination's receive region (current dispatch parity) and fills the handle's arrays; the
//! rows stay valid until this rank's stream starts its next dispatch, or a combine staged over
//! them (`staging`: an explicit copy-engine config, or a consuming combine). A combine reads `y` (or, in place, every rank's latest receive rows),
//! writes `out`/`out_weights`, and reads the handle its dispatch wrote earlier on this stream.
//! The host reads nothing of it, except the receive counts (and the rows a rank sent itself)
//! a HostSync dispatch publishes to mapped memory.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use cudarc::driver::{DevicePtr, DevicePtrMut};
use epcomm_kernels::{Op, abi};
use epcomm_topology::{Parity, RegionKind, RowDtype, RowFormat};

use super::staging::{DeviceRange, Issued, RecvRows};
use super::{CombineInput, CombineOutput, DispatchInput, XInput};
use crate::buffer::Buffer;
use crate::buffer::args::{combine_flags, dispatch_flags};
use crate::buffer::health::note_launch;
use crate::error::DriverContext;
use crate::handle::{Dispatched, Handle, HandleInner};
use crate::layout::Layout;
use crate::{Error, RecvMode, Result};

/// The latest (cached) dispatch, for in-place combine.
#[derive(Debug)]
pub(in crate::buffer) struct LatestDispatch {
    pub(in crate::buffer) handle: Weak<HandleInner>,
    pub(in crate::buffer) dtype: RowDtype,
    /// Top-k weights travelled (a non-cached dispatch with `topk_weights`).
    pub(in crate::buffer) weights: bool,
    /// Whether it ran or was recorded into a graph (combine staging depends on it).
    pub(in crate::buffer) issued: Issued,
}

/// What a combine reduces: `y` (and its weights) in caller memory, or in place.
#[derive(Clone, Copy, Debug)]
struct CombineSources {
    y: u64,
    y_weights: u64,
    in_place: bool,
}

impl Buffer {
    /// Allocates a handle for [`Self::dispatch_into`] sized for the buffer's capacity.
    pub fn alloc_handle(&mut self, layout: &Layout) -> Result<Handle> {
        self.own_layout(&layout.inner)?;
        let max_rows = self.place.plan.recv_rows() as usize;
        self.new_handle(layout, max_rows, None)
    }

    /// Allocates the device arrays of a handle for at most `max_rows` received rows.
    fn new_handle(
        &self,
        layout: &Layout,
        max_rows: usize,
        num_recv: Option<usize>,
    ) -> Result<Handle> {
        let (world, epr) = (self.place.world, self.cfg.num_experts / self.place.world);
        let send_offsets =
            // SAFETY: the dispatch kernel writes every element before anything reads it (rows
            // beyond the received count are never read; same for the three arrays below).
            unsafe { self.launcher.stream.alloc::<i32>(world) }.context("allocating the handle")?;
        // SAFETY: as above.
        let recv_prefix = unsafe { self.launcher.stream.alloc::<i32>(world + 1) }
            .context("allocating the handle")?;
        // SAFETY: as above.
        let recv_src_idx = unsafe { self.launcher.stream.alloc::<i32>(max_rows.max(1)) }
            .context("allocating the handle")?;
        // SAFETY: as above.
        let recv_expert_counts = unsafe { self.launcher.stream.alloc::<i32>(epr.max(1)) }
            .context("allocating the handle")?;
        let recv_node_counts = match self.place.plan.forwarding() {
            // SAFETY: as above (the dispatch's forwarding blocks write every element).
            Some((t, _)) => Some(
                unsafe { self.launcher.stream.alloc::<i32>(t.nodes()) }
                    .context("allocating the handle")?,
            ),
            None => None,
        };
        Ok(Handle::flat(Arc::new(HandleInner {
            layout: layout.inner.clone(),
            send_offsets,
            recv_prefix,
            recv_src_idx,
            recv_expert_counts,
            recv_node_counts,
            num_recv,
            own_rows: None,
            max_rows,
            buffer_id: self.id,
            routing: AtomicU64::new(HandleInner::NOT_DISPATCHED),
        })))
    }

    /// Sends every token to each rank holding one of its experts. Collective: every rank calls
    /// dispatch (or cached dispatch / combine) in the same order.
    pub fn dispatch(
        &mut self,
        input: &DispatchInput<'_>,
        layout: &Layout,
        mode: RecvMode,
    ) -> Result<Dispatched<'_>> {
        self.check_ready()?;
        let l = self.own_layout(&layout.inner)?;
        self.check_dispatch_input(input, l.num_tokens)?;
        self.dispatch_with(
            &input.x,
            Some(input.topk_idx),
            input.topk_weights,
            layout,
            mode,
        )
    }

    /// Sends every token's row to the ranks `layout` names, without top-k ids or weights
    /// (DeepEP's dispatch without `topk_idx`): for a layout from
    /// [`Self::layout_from_ranks_into`], or any other. The receivers' per-expert counts are the
    /// layout's; [`Dispatched`] has no received ids or weights. Collective, like [`Self::dispatch`]
    /// (every rank sends ids, or none).
    pub fn dispatch_rows(
        &mut self,
        x: &XInput<'_>,
        layout: &Layout,
        mode: RecvMode,
    ) -> Result<Dispatched<'_>> {
        self.check_ready()?;
        self.own_layout(&layout.inner)?;
        self.dispatch_with(x, None, None, layout, mode)
    }

    /// [`Self::dispatch`] / [`Self::dispatch_rows`] after the input checks.
    fn dispatch_with(
        &mut self,
        x: &XInput<'_>,
        topk_idx: Option<&dyn DevicePtr<i64>>,
        topk_weights: Option<&dyn DevicePtr<f32>>,
        layout: &Layout,
        mode: RecvMode,
    ) -> Result<Dispatched<'_>> {
        let l = self.own_layout(&layout.inner)?;
        let row = self.check_x(x, l.num_tokens)?;
        let max_rows = self.recv_capacity(mode)?;
        let handle = self.new_handle(layout, max_rows, None)?;
        self.launch_dispatch(x, Routing::Fresh(topk_idx), topk_weights, &handle)?;
        let (handle, per_expert) = if mode == RecvMode::HostSync {
            let epr = self.cfg.num_experts / self.place.world;
            let counts = self.wait_host_counts(self.seq.notify, epr)?;
            let mut inner = Arc::try_unwrap(handle.inner)
                .map_err(|_| Error::Failed("handle shared during dispatch".into()))?;
            inner.num_recv = Some(counts.rows);
            inner.own_rows = Some(counts.own_rows);
            let e = counts.per_expert;
            let handle = Handle::flat(Arc::new(inner));
            if let Some(latest) = &mut self.latest_dispatch {
                latest.handle = Arc::downgrade(&handle.inner);
            }
            (handle, Some(e))
        } else {
            (handle, None)
        };
        Ok(self.dispatched(
            handle,
            row,
            topk_idx.is_some(),
            topk_weights.is_some(),
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
        self.check_ready()?;
        let h = self.own_handle(handle)?;
        self.check_dispatch_input(input, h.layout.num_tokens)?;
        self.dispatch_into_with(&input.x, Some(input.topk_idx), input.topk_weights, handle)
    }

    /// [`Self::dispatch_rows`] into a handle from [`Self::alloc_handle`] (no top-k ids or
    /// weights; WorstCase sizes, no allocation, no host wait).
    pub fn dispatch_rows_into(
        &mut self,
        x: &XInput<'_>,
        handle: &Handle,
    ) -> Result<Dispatched<'_>> {
        self.check_ready()?;
        self.own_handle(handle)?;
        self.dispatch_into_with(x, None, None, handle)
    }

    fn dispatch_into_with(
        &mut self,
        x: &XInput<'_>,
        topk_idx: Option<&dyn DevicePtr<i64>>,
        topk_weights: Option<&dyn DevicePtr<f32>>,
        handle: &Handle,
    ) -> Result<Dispatched<'_>> {
        let h = self.own_handle(handle)?;
        let row = self.check_x(x, h.layout.num_tokens)?;
        self.launch_dispatch(x, Routing::Fresh(topk_idx), topk_weights, handle)?;
        Ok(self.dispatched(
            handle.clone(),
            row,
            topk_idx.is_some(),
            topk_weights.is_some(),
            None,
        ))
    }

    /// Sends new rows along the routing of an earlier dispatch: no count exchange, no host wait.
    pub fn cached_dispatch(&mut self, x: &XInput<'_>, handle: &Handle) -> Result<Dispatched<'_>> {
        let h = self.routed_handle(handle)?;
        let row = self.check_x(x, h.layout.num_tokens)?;
        self.launch_dispatch(x, Routing::Cached, None, handle)?;
        Ok(self.dispatched(handle.clone(), row, false, false, None))
    }

    /// Launches a dispatch (fresh along the handle's layout, or cached along its routing).
    fn launch_dispatch(
        &mut self,
        x: &XInput<'_>,
        routing: Routing<'_>,
        topk_weights: Option<&dyn DevicePtr<f32>>,
        handle: &Handle,
    ) -> Result<()> {
        let (cached, topk_idx) = match routing {
            Routing::Cached => (true, None),
            Routing::Fresh(ids) => (false, ids),
        };
        let issued = self.issued_now()?;
        // A recording replays into the handle's (and its layout's) arrays: the graph owns them.
        self.keep_alive(handle.inner.clone());
        let h = &handle.inner;
        let l = &h.layout;
        if l.generation.load(Ordering::Relaxed) == 0 {
            return Err(Error::InvalidArgument {
                argument: "layout",
                rule: "was allocated but never computed: call layout_into first".into(),
            });
        }
        let row = self.check_x(x, l.num_tokens)?;
        let blocks = self.cfg.num_sms;
        let kind = if cached {
            abi::op::CACHED_DISPATCH
        } else {
            abi::op::DISPATCH
        };
        let weights = !cached && topk_weights.is_some();
        let flags = dispatch_flags(
            cached,
            topk_idx.is_some(),
            topk_weights.is_some(),
            row.dtype(),
        );
        let mut a = self.dispatch_args(l.num_tokens, row, h.max_rows, flags);
        let s = &self.launcher.stream;
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
        let node_slot = l.token_node_slot.as_ref().map(|n| n.device_ptr(s));
        let node_counts = h.recv_node_counts.as_ref().map(|n| n.device_ptr(s));
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
        a.token_node_slot = node_slot.as_ref().map_or(0, |p| p.0);
        a.recv_node_counts = node_counts.as_ref().map_or(0, |p| p.0);
        a.num_tokens_ptr = l.device_tokens.as_ref().map_or(0, |d| d.ptr);
        self.check_dispatch_ptrs(&a, l.num_tokens)?;
        // SAFETY: inputs were length-checked against the layout's token count; the handle's
        // arrays hold world, world + 1, max_rows and experts_per_rank elements (with forwarding
        // also nodes, and the layout's T * nodes node slots; the kernel never
        // writes more rows than max_rows: it fails with Overflow first); the symmetric buffer
        // follows the same plan on every rank, and every rank launches this op with `blocks`
        // blocks (the completion counters count blocks). A cached dispatch only reads the
        // handle, written by its dispatch earlier on this stream.
        unsafe { self.launcher.kernels.launch_op(Op::Dispatch, s, &a, blocks) }?;
        note_launch(&self.health.last_launch, s, self.capture.recording);
        self.seq.advance(kind);
        self.health.last_op = Some(if cached {
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
            dtype: row.dtype(),
            weights,
            issued,
        });
        Ok(())
    }

    /// The views of the last dispatch's receive region (parity from the host mirror).
    fn dispatched(
        &self,
        handle: Handle,
        row: RowFormat,
        topk: bool,
        weights: bool,
        per_expert: Option<Vec<usize>>,
    ) -> Dispatched<'_> {
        let parity = Parity::of_epoch(self.seq.dispatch);
        let base = self.memory.mem.local_base();
        let r = |k| base + self.place.plan.region(k, parity).offset;
        Dispatched {
            stream: &self.launcher.stream,
            launch_mark: (!self.capture.recording).then_some(&*self.health.last_launch),
            handle,
            row,
            top_k: self.cfg.top_k,
            recv_x: r(RegionKind::DispatchX),
            recv_scales: r(RegionKind::DispatchScales),
            recv_topk_idx: topk.then(|| r(RegionKind::DispatchTopkIdx)),
            recv_topk_weights: weights.then(|| r(RegionKind::DispatchTopkWeights)),
            num_recv_per_local_expert: per_expert,
        }
    }

    /// Sends expert outputs back and sums each token's contributions (fp32, rank order) into
    /// `output.out` (`[T][hidden]` bf16). `input.y` holds one row per received row, in the
    /// dispatch's order; `input.y_weights` (`[rows][top_k]`) are summed into
    /// `output.out_weights` (`[T][top_k]`) the same way.
    ///
    /// The dispatch's outputs (`recv_x`, its scales, `recv_topk_weights`) stay as they are,
    /// unless the config asks for [`crate::CombineStaging::CopyEngine`], which copies `y` over
    /// them, or the input is [`CombineInput::consuming`]: then, with the default
    /// [`crate::CombineStaging::Auto`], where every peer is mapped, the handle's dispatch was
    /// HostSync and the kernels run on at most [`crate::CombineStaging::AUTO_MAX_SMS`] SMs, the
    /// copy engine copies `y` (and `y_weights`) over the latest dispatch's receive rows and the
    /// owners pull it, which leaves the push off the SMs; after it, `recv_x` and
    /// `recv_topk_weights` of that dispatch hold unspecified rows (today: parts of `y`). Every
    /// rank must pass the same `consume_recv` (each decides from the same facts, and a rank that
    /// stages and one that pushes cannot meet). `y` may be those receive rows themselves.
    pub fn combine(
        &mut self,
        input: &CombineInput<'_>,
        handle: &Handle,
        output: CombineOutput<'_>,
    ) -> Result<()> {
        let rows = if input.consume_recv {
            RecvRows::Consume
        } else {
            RecvRows::Keep
        };
        let CombineInput { y, y_weights, .. } = *input;
        let CombineOutput { out, out_weights } = output;
        let h = self.routed_handle(handle)?;
        self.check_combine_y(
            h,
            y.len(),
            y_weights.map(|w| w.len()),
            out_weights.is_some(),
        )?;
        // Every argument is checked before a staging copy may overwrite the receive rows.
        self.check_combine_out(
            h.layout.num_tokens,
            out.len(),
            out_weights.as_ref().map(|o| o.len()),
        )?;
        let s = self.launcher.stream.clone();
        let (y_ptr, _gy) = y.device_ptr(&s);
        let yw = y_weights.map(|w| w.device_ptr(&s));
        let staged = self.stage_combine_y(
            h,
            DeviceRange {
                ptr: y_ptr,
                bytes: (y.len() * 2) as u64,
            },
            yw.as_ref().zip(y_weights).map(|(p, w)| DeviceRange {
                ptr: p.0,
                bytes: (w.len() * 4) as u64,
            }),
            rows,
        )?;
        let inputs = match staged {
            // y now lies over this rank's latest receive rows (its own rows perhaps only in y):
            // pulled from there, as in place.
            Some(own) => CombineSources {
                y: own.y,
                y_weights: own.y_weights,
                in_place: true,
            },
            None => CombineSources {
                y: y_ptr,
                y_weights: yw.as_ref().map_or(0, |p| p.0),
                in_place: false,
            },
        };
        // SAFETY: y holds at least the received rows (checked against the host count or the
        // capacity the dispatch enforced on the device), y_weights as many weight rows; staged,
        // the rows read are the receive regions the staging copies (and every peer's) filled.
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
        let h = self.routed_handle(handle)?;
        self.check_in_place(h, out_weights.is_some())?;
        let inputs = CombineSources {
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
        inputs: CombineSources,
        out: &mut dyn DevicePtrMut<half::bf16>,
        out_weights: Option<&mut dyn DevicePtrMut<f32>>,
    ) -> Result<()> {
        // A recording replays reading the handle's (and its layout's) arrays: the graph owns
        // them.
        self.keep_alive(handle.inner.clone());
        let h = &handle.inner;
        let t = h.layout.num_tokens;
        self.check_combine_out(t, out.len(), out_weights.as_ref().map(|o| o.len()))?;
        let blocks = self.cfg.num_sms;
        let flags = combine_flags(inputs.in_place, out_weights.is_some());
        let mut a = self.combine_args(t, h.max_rows, flags);
        let s = &self.launcher.stream;
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
        a.num_tokens_ptr = h.layout.device_tokens.as_ref().map_or(0, |d| d.ptr);
        self.check_combine_ptrs(&a, h.rows_bound(), t)?;
        // SAFETY: out/out_weights hold T rows (checked above); y per the caller's contract; the
        // handle's arrays were written by its dispatch earlier on this stream.
        unsafe { self.launcher.kernels.launch_op(Op::Combine, s, &a, blocks) }?;
        note_launch(&self.health.last_launch, s, self.capture.recording);
        self.seq.advance(abi::op::COMBINE);
        self.health.last_op = Some("combine");
        Ok(())
    }
}

/// How a dispatch launch routes its rows.
enum Routing<'a> {
    /// Along the handle's layout (a new count exchange), with the top-k ids when given.
    Fresh(Option<&'a dyn DevicePtr<i64>>),
    /// Along the routing an earlier dispatch wrote into the handle (no count exchange).
    Cached,
}
