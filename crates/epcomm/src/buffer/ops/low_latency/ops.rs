//! The low-latency ops of [`Buffer`]: dispatch and combine, fused or split into a send phase
//! and a receive phase ([`LlPending`]), over the types of the parent module.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use cudarc::driver::{DevicePtr, DevicePtrMut};
use epcomm_kernels::Op;
use epcomm_kernels::abi::{self, OpArgs};
use epcomm_topology::{RowDtype, RowFormat};

use super::{
    CombineArrays, LlAddrs, LlArrays, LlDispatchInput, LlFormat, LlPending, LlRecv, LlScalesLayout,
    PendingReceive,
};
use crate::buffer::Buffer;
use crate::buffer::ops::staging::DeviceRange;
use crate::buffer::pointers::{ROW_ALIGN, check_device_ptr};
use crate::buffer::validate::exact_len;
use crate::error::DriverContext;
use crate::{Error, Result};

impl Buffer {
    /// The flags every low-latency op of this buffer carries: `fused` (one kernel, no hook)
    /// and rank masking ([`crate::BufferConfig::ll_masking`]).
    fn ll_flags(&self, fused: bool) -> u32 {
        let fused = if fused { abi::flags::FUSED } else { 0 };
        let masking = if self.cfg.ll_masking {
            abi::flags::MASKING
        } else {
            0
        };
        fused | masking
    }

    /// Fails unless the buffer has low-latency memory; returns `ll_max_tokens_per_rank`.
    fn ll_capacity(&self) -> Result<usize> {
        match self.cfg.ll_max_tokens_per_rank {
            0 => Err(Error::InvalidArgument {
                argument: "ll_max_tokens_per_rank",
                rule: "is 0 in this Buffer's config: set it to the most tokens a rank passes to \
                       a low-latency dispatch to use the low-latency ops"
                    .into(),
            }),
            m => Ok(m),
        }
    }

    /// Allocates the receive arrays of low-latency dispatches (see [`LlRecv`]).
    pub fn alloc_ll_recv(&mut self) -> Result<LlRecv> {
        let m = self.ll_capacity()?;
        let epr = self.cfg.num_experts / self.place.world;
        let cap = self.place.world * m;
        let rows = epr * cap;
        // The buffer's BF16 rows; the arrays hold rows of either format, so each row gets the
        // widest one's bytes (the pitch).
        let bf16 = self.place.plan.row();
        let scales = RowFormat::new(bf16.hidden(), RowDtype::Fp8).map_or(0, |f| f.num_scales());
        let s = &self.launcher.stream;
        let ctx = "allocating low-latency receive arrays";
        let mut arrays = LlArrays {
            addrs: LlAddrs::default(),
            x: s.alloc_zeros::<u8>((rows * bf16.pitch()).max(16))
                .context(ctx)?,
            scales: s.alloc_zeros::<f32>((rows * scales).max(1)).context(ctx)?,
            count: s.alloc_zeros::<i32>(epr.max(1)).context(ctx)?,
            src_info: s.alloc_zeros::<i32>(rows.max(1)).context(ctx)?,
            layout_range: s
                .alloc_zeros::<i64>((epr * self.place.world).max(1))
                .context(ctx)?,
            route: s.alloc_zeros::<i32>(rows.max(1)).context(ctx)?,
            self_row: s
                .alloc_zeros::<i32>((m * self.cfg.top_k).max(1))
                .context(ctx)?,
        };
        arrays.addrs = LlAddrs::of(&arrays, s);
        Ok(LlRecv {
            arrays: Arc::new(arrays),
            buffer_id: self.id,
            experts: epr,
            capacity: cap,
            row: bf16,
            dispatched: None,
            scales_layout: LlScalesLayout::RowMajor,
        })
    }

    /// Low-latency dispatch: sends every token once to each rank holding one of its experts
    /// and packs what this rank received into `recv`, expert-major. Collective; stream-ordered;
    /// no host wait; capturable in a CUDA graph.
    pub fn ll_dispatch(
        &mut self,
        input: LlDispatchInput<'_>,
        format: LlFormat,
        recv: &mut LlRecv,
    ) -> Result<()> {
        // One kernel: the send phase goes straight on with the receive phase.
        self.ll_dispatch_launch(input, format, recv, true).map(drop)
    }

    /// The send phase of [`Self::ll_dispatch`]: returns once the sends are issued; `recv` is
    /// filled when the returned [`LlPending`] has gone to [`Self::ll_receive`].
    pub fn ll_dispatch_send<'a>(
        &mut self,
        input: LlDispatchInput<'a>,
        format: LlFormat,
        recv: &'a mut LlRecv,
    ) -> Result<LlPending<'a>> {
        self.ll_dispatch_launch(input, format, recv, false)
    }

    /// Checks and launches a low-latency dispatch's send kernel; `fused`: the kernel also runs
    /// the receive phase (nothing is left pending).
    fn ll_dispatch_launch<'a>(
        &mut self,
        input: LlDispatchInput<'a>,
        format: LlFormat,
        recv: &'a mut LlRecv,
        fused: bool,
    ) -> Result<LlPending<'a>> {
        self.check_ready()?;
        let m = self.ll_capacity()?;
        self.check_owner(recv.buffer_id, "recv", "was allocated by another Buffer")?;
        let t = input.num_tokens;
        if t > m {
            return Err(Error::InvalidArgument {
                argument: "num_tokens",
                rule: format!("at most ll_max_tokens_per_rank = {m} (got {t})"),
            });
        }
        let (hidden, k) = (self.cfg.hidden, self.cfg.top_k);
        let row = RowFormat::new(hidden, format.dtype()).map_err(|e| Error::InvalidArgument {
            argument: "format",
            rule: e.to_string(),
        })?;
        // `x` is bf16 whatever the format (FP8 casts on the device).
        let x_row = self.place.plan.row();
        exact_len(
            "x",
            input.x.len(),
            "bf16 x must hold num_tokens * hidden",
            t * hidden,
            "values",
        )?;
        exact_len(
            "topk_idx",
            input.topk_idx.len(),
            "must hold num_tokens * top_k",
            t * k,
            "ids",
        )?;
        let epr = recv.experts;
        if let Some(stats) = &input.cumulative_stats {
            exact_len(
                "cumulative_stats",
                stats.len(),
                "must hold one count per local expert",
                epr,
                "counts",
            )?;
        }
        let s = self.launcher.stream.clone();
        let (x, _gx) = input.x.device_ptr(&s);
        let (idx, _gi) = input.topk_idx.device_ptr(&s);
        let ordinal = self.launcher.ctx.ordinal();
        check_device_ptr("x", x, t * x_row.x_bytes(), ROW_ALIGN, ordinal)?;
        check_device_ptr("topk_idx", idx, t * k * 8, 8, ordinal)?;
        let mut stats_array = input.cumulative_stats;
        let (stats, stats_guard) = match stats_array.as_deref_mut() {
            Some(array) => {
                let (p, g) = array.device_ptr_mut(&s);
                check_device_ptr("cumulative_stats", p, epr * 4, 4, ordinal)?;
                (p, Some(g))
            }
            None => (0, None),
        };
        // BF16 rows are put straight from `x`; FP8 rows (and every metadata row) from send rows
        // in the symmetric buffer.
        if format == LlFormat::Bf16 {
            self.prepare_put_source("x", x, t * x_row.x_bytes())?;
        }
        let mut flags = self.ll_flags(fused);
        if let LlFormat::Fp8 { round_scale } = format {
            flags |= abi::flags::HAS_SCALES;
            if round_scale {
                flags |= abi::flags::ROUND_SCALE;
            }
            if recv.scales_layout == LlScalesLayout::ColumnMajor {
                flags |= abi::flags::SCALES_COLUMN_MAJOR;
            }
        }
        // A recording replays into these arrays: the graph owns them.
        self.keep_alive(recv.arrays.clone());
        let a = recv.arrays.addrs;
        let args = a.with_routing(OpArgs {
            x,
            topk_idx: idx,
            num_tokens: t as i32,
            row_bytes: row.x_bytes() as i32,
            num_scales: row.num_scales() as i32,
            flags,
            ll_recv_x: a.x,
            ll_recv_scales: a.scales,
            ll_cumulative_stats: stats,
            ..self.next_op_args()
        });
        // SAFETY: x and topk_idx hold num_tokens rows, cumulative_stats one i32 per local
        // expert (checked above), and they stay borrowed by the pending op; the kernel writes
        // only the low-latency regions of the symmetric buffers, sized by the plan every rank
        // shares, and every rank launches it with ll_blocks blocks.
        unsafe { self.launch_ll(Op::LlDispatchSend, &s, &args) }?;
        recv.dispatched = Some((format, t));
        recv.row = row;
        // The fused kernel wrote the stats: their event is recorded now. A split dispatch's
        // receive phase writes them: `ll_receive` records it again after that kernel.
        drop(stats_guard);
        let stats_array = if fused { None } else { stats_array };
        Ok(self.launched(abi::op::LL_DISPATCH, args, fused, None, stats_array))
    }

    /// Book-keeping after a low-latency send kernel of `kind` was launched: the host sequence,
    /// the last op, and (unless `fused`) the outstanding receive and its [`LlPending`].
    fn launched<'a>(
        &mut self,
        kind: u32,
        args: OpArgs,
        fused: bool,
        combine: Option<CombineArrays<'a>>,
        stats: Option<&'a mut (dyn DevicePtrMut<i32> + 'static)>,
    ) -> LlPending<'a> {
        let (name, op, recv_kind) = if kind == abi::op::LL_DISPATCH {
            ("dispatch", Op::LlDispatchRecv, abi::op::LL_DISPATCH_RECV)
        } else {
            ("combine", Op::LlCombineRecv, abi::op::LL_COMBINE_RECV)
        };
        self.mark_launch();
        self.seq.advance(kind);
        self.health.last_op = Some(if kind == abi::op::LL_DISPATCH {
            "low-latency dispatch"
        } else {
            "low-latency combine"
        });
        let abandoned = Arc::new(AtomicBool::new(false));
        self.ll.pending = (!fused).then(|| PendingReceive {
            op: name,
            op_seq: self.seq.op,
            abandoned: abandoned.clone(),
        });
        LlPending {
            op,
            kind: recv_kind,
            args,
            buffer_id: self.id,
            op_seq: self.seq.op,
            abandoned,
            armed: !fused,
            combine,
            stats,
        }
    }

    /// Low-latency combine: sends every expert output row `y[l][i]` (`[local_expert][capacity]
    /// [hidden]` bf16, at the rows of `recv`) back to its token's rank, which reduces
    /// `out[t] = Σ_k topk_weights[t][k] · y_k` over the `k` with `topk_idx[t][k] != -1`, in
    /// increasing `k`, in f32, rounded to bf16 once. `topk_idx`/`topk_weights` are this rank's
    /// own, as passed to the dispatch `recv` came from; `out` is `[num_tokens][hidden]`.
    pub fn ll_combine(
        &mut self,
        y: &dyn DevicePtr<half::bf16>,
        topk_idx: &dyn DevicePtr<i64>,
        topk_weights: &dyn DevicePtr<f32>,
        recv: &LlRecv,
        out: &mut dyn DevicePtrMut<half::bf16>,
    ) -> Result<()> {
        // One kernel: the send phase goes straight on with the receive phase.
        self.ll_combine_launch(y, topk_idx, topk_weights, recv, out, true)
            .map(drop)
    }

    /// The send phase of [`Self::ll_combine`]; `out` is written once the returned
    /// [`LlPending`] has gone to [`Self::ll_receive`].
    pub fn ll_combine_send<'a>(
        &mut self,
        y: &'a dyn DevicePtr<half::bf16>,
        topk_idx: &'a dyn DevicePtr<i64>,
        topk_weights: &'a dyn DevicePtr<f32>,
        recv: &'a LlRecv,
        out: &'a mut dyn DevicePtrMut<half::bf16>,
    ) -> Result<LlPending<'a>> {
        self.ll_combine_launch(y, topk_idx, topk_weights, recv, out, false)
    }

    /// Checks and launches a low-latency combine's send kernel; `fused`: the kernel also runs
    /// the receive phase (nothing is left pending).
    fn ll_combine_launch<'a>(
        &mut self,
        y: &'a dyn DevicePtr<half::bf16>,
        topk_idx: &'a dyn DevicePtr<i64>,
        topk_weights: &'a dyn DevicePtr<f32>,
        recv: &'a LlRecv,
        out: &'a mut dyn DevicePtrMut<half::bf16>,
        fused: bool,
    ) -> Result<LlPending<'a>> {
        self.check_ready()?;
        self.ll_capacity()?;
        self.check_owner(recv.buffer_id, "recv", "was allocated by another Buffer")?;
        let Some((_, t)) = recv.dispatched else {
            return Err(Error::InvalidArgument {
                argument: "recv",
                rule: "no low-latency dispatch filled it yet".into(),
            });
        };
        let (hidden, k) = (self.cfg.hidden, self.cfg.top_k);
        exact_len(
            "y",
            y.len(),
            "must hold local_experts * capacity * hidden",
            recv.experts * recv.capacity * hidden,
            "values",
        )?;
        let per_token = "must hold num_tokens * top_k (num_tokens of the dispatch)";
        exact_len("topk_idx", topk_idx.len(), per_token, t * k, "ids")?;
        exact_len(
            "topk_weights",
            topk_weights.len(),
            per_token,
            t * k,
            "values",
        )?;
        exact_len(
            "out",
            out.len(),
            "must hold num_tokens * hidden (num_tokens of the dispatch)",
            t * hidden,
            "values",
        )?;
        // A recording replays reading these arrays: the graph owns them.
        self.keep_alive(recv.arrays.clone());
        // `y` and `out` are bf16 rows.
        let bf16 = self.place.plan.row();
        let s = self.launcher.stream.clone();
        let args = {
            let (yp, _gy) = y.device_ptr(&s);
            let (idx, _gi) = topk_idx.device_ptr(&s);
            let (w, _gw) = topk_weights.device_ptr(&s);
            let (o, _go) = out.device_ptr_mut(&s);
            let ordinal = self.launcher.ctx.ordinal();
            check_device_ptr("y", yp, y.len() * bf16.value_bytes(), ROW_ALIGN, ordinal)?;
            check_device_ptr("topk_idx", idx, t * k * 8, 8, ordinal)?;
            check_device_ptr("topk_weights", w, t * k * 4, 4, ordinal)?;
            check_device_ptr("out", o, t * bf16.x_bytes(), ROW_ALIGN, ordinal)?;
            // One kernel reads this rank's own rows from `y` while other warps write `out`.
            let (y_range, out_range) = (
                DeviceRange {
                    ptr: yp,
                    bytes: (y.len() * bf16.value_bytes()) as u64,
                },
                DeviceRange {
                    ptr: o,
                    bytes: (t * bf16.x_bytes()) as u64,
                },
            );
            if fused && y_range.bytes > 0 && out_range.bytes > 0 && y_range.overlaps(out_range) {
                return Err(Error::InvalidArgument {
                    argument: "out",
                    rule: format!(
                        "overlaps y ({o:#x}..{:#x} against {yp:#x}..{:#x}): ll_combine reads y \
                         while it writes out; pass out elsewhere, or use ll_combine_send and \
                         ll_receive",
                        o + out_range.bytes,
                        yp + y_range.bytes
                    ),
                });
            }
            // The send phase puts rows straight from `y`.
            self.prepare_put_source("y", yp, y.len() * bf16.value_bytes())?;
            let args = recv.arrays.addrs.with_routing(OpArgs {
                x: yp,
                topk_idx: idx,
                topk_weights: w,
                out: o,
                num_tokens: t as i32,
                flags: self.ll_flags(fused),
                ..self.next_op_args()
            });
            // SAFETY: y holds every packed row the counts of `recv` name (checked: its full
            // capacity), `recv`'s routing was written by its dispatch earlier on this stream,
            // and every destination row lies in the sources' combine regions ([token][k],
            // token below the source's dispatch count); every rank launches with ll_blocks
            // blocks. The guards record the arrays' events after this kernel.
            unsafe { self.launch_ll(Op::LlCombineSend, &s, &args) }?;
            args
        };
        let arrays = (!fused).then_some(CombineArrays {
            topk_idx,
            topk_weights,
            out,
        });
        Ok(self.launched(abi::op::LL_COMBINE, args, fused, arrays, None))
    }

    /// The receive phase (the hook) of a low-latency op whose send phase returned `pending`:
    /// queues the kernel that waits for the peers' rows and finishes the op. Stream-ordered;
    /// no host wait.
    pub fn ll_receive(&mut self, mut pending: LlPending<'_>) -> Result<()> {
        self.check()?;
        self.check_owner(pending.buffer_id, "pending", "was issued on another Buffer")?;
        if self.ll.pending.as_ref().map(|p| p.op_seq) != Some(pending.op_seq) {
            return Err(Error::InvalidArgument {
                argument: "pending",
                rule: "is not the receive phase of this Buffer's latest low-latency send phase \
                       (it was issued already, or its send phase was never run)"
                    .into(),
            });
        }
        let s = self.launcher.stream.clone();
        // A split combine's arrays, and a split dispatch's cumulative stats: their guards
        // record the stream events after the receive kernel (a dispatch's receive phase writes
        // nothing else but the LlRecv, which lives on this stream).
        let _guards = pending.combine.as_mut().map(|c| {
            (
                c.topk_idx.device_ptr(&s).1,
                c.topk_weights.device_ptr(&s).1,
                c.out.device_ptr_mut(&s).1,
            )
        });
        let _stats_guard = pending.stats.as_mut().map(|a| a.device_ptr_mut(&s).1);
        // SAFETY: the arguments are those of the send phase, whose caller arrays `pending`
        // still borrows; its send phase was the last op issued on this stream (checked above).
        unsafe { self.launch_ll(pending.op, &s, &pending.args) }?;
        pending.armed = false;
        self.mark_launch();
        self.seq.advance(pending.kind);
        self.ll.pending = None;
        Ok(())
    }
}

impl Buffer {
    /// Launches the low-latency kernel `op` on `s` with `args` and this buffer's low-latency
    /// blocks.
    ///
    /// # Safety
    /// As [`epcomm_kernels::OpModule::launch_op`]: `args` names memory the kernel may read and
    /// write for as long as it runs, and every rank launches the same op with the same blocks.
    unsafe fn launch_ll(
        &self,
        op: Op,
        s: &cudarc::driver::CudaStream,
        args: &OpArgs,
    ) -> std::result::Result<(), epcomm_kernels::KernelError> {
        // SAFETY: the caller's contract is the launch's.
        unsafe { self.launcher.kernels.launch_op(op, s, args, self.ll.blocks) }
    }
}
