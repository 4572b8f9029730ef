//! CUDA-event timing of epcomm ops with an L2 flush between calls, and DeepEP's metric.
//!
//! DeepEP's metric: bytes received per rank (the rows a rank sends to itself included) divided
//! by the op's time. BF16 dispatch and combine count `rows * hidden * 2`; FP8 dispatch counts
//! `rows * hidden * (1 + 4/128)` (one byte per value plus one f32 scale per 128 values).

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, sys};
use epcomm::{
    Buffer, CombineInput, CombineOutput, DispatchInput, ExpertParallel, Handle, HierarchicalBuffer,
    Layout, LlFormat, LlRecv, RecvMode, TierStats, Tiering, XInput,
};
use epcomm_reference::{RankInput, bf16};

use crate::Result;
use crate::inputs::{DeviceInputs, upload};
use crate::ll::{LlIo, verify_ll_round};

/// Bytes written to flush the 50 MB L2 of an H100/H200 (DeepEP flushes with 256 MB).
pub const FLUSH_BYTES: usize = 256 << 20;

/// An op to time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BenchOp {
    /// BF16 dispatch (count exchange included).
    DispatchBf16,
    /// FP8 dispatch.
    DispatchFp8,
    /// Cached BF16 dispatch.
    CachedDispatchBf16,
    /// BF16 combine.
    Combine,
    /// BF16 combine pulling y from the peers' receive regions (after a BF16 dispatch).
    CombineInPlace,
    /// Low-latency BF16 dispatch (send and receive phase back to back).
    LlDispatchBf16,
    /// Low-latency FP8 dispatch (cast on the device).
    LlDispatchFp8,
    /// Low-latency combine.
    LlCombine,
    /// The send phase of a low-latency FP8 dispatch alone.
    LlDispatchFp8Send,
    /// The receive phase of a low-latency FP8 dispatch, issued once every rank's send phase
    /// finished (what a hook costs after overlapping work).
    LlDispatchFp8Recv,
    /// The send phase of a low-latency combine alone.
    LlCombineSend,
    /// The receive phase of a low-latency combine, issued once every send phase finished.
    LlCombineRecv,
}

impl BenchOp {
    /// Every op, in report order.
    pub const ALL: [BenchOp; 5] = [
        Self::DispatchFp8,
        Self::DispatchBf16,
        Self::CachedDispatchBf16,
        Self::Combine,
        Self::CombineInPlace,
    ];

    /// The low-latency ops, in report order.
    pub const LOW_LATENCY: [BenchOp; 7] = [
        Self::LlDispatchFp8,
        Self::LlDispatchBf16,
        Self::LlCombine,
        Self::LlDispatchFp8Send,
        Self::LlDispatchFp8Recv,
        Self::LlCombineSend,
        Self::LlCombineRecv,
    ];

    /// Whether it is a low-latency op (timed by [`LlTimer`]).
    pub fn is_low_latency(self) -> bool {
        Self::LOW_LATENCY.contains(&self)
    }

    /// Display name.
    pub fn name(self) -> &'static str {
        match self {
            Self::DispatchBf16 => "dispatch BF16",
            Self::DispatchFp8 => "dispatch FP8",
            Self::CachedDispatchBf16 => "cached dispatch BF16",
            Self::Combine => "combine BF16",
            Self::CombineInPlace => "combine BF16 in place",
            Self::LlDispatchBf16 => "LL dispatch BF16",
            Self::LlDispatchFp8 => "LL dispatch FP8",
            Self::LlCombine => "LL combine BF16",
            Self::LlDispatchFp8Send => "LL dispatch FP8 send phase",
            Self::LlDispatchFp8Recv => "LL dispatch FP8 receive phase",
            Self::LlCombineSend => "LL combine send phase",
            Self::LlCombineRecv => "LL combine receive phase",
        }
    }

    /// Bytes by DeepEP's metric for `rows` received rows of `hidden` values (low-latency
    /// ops: one row per received (token, expert) pair, as DeepEP counts them).
    pub fn metric_bytes(self, rows: usize, hidden: usize) -> f64 {
        let bf16 = (rows * hidden * 2) as f64;
        match self {
            Self::DispatchFp8
            | Self::LlDispatchFp8
            | Self::LlDispatchFp8Send
            | Self::LlDispatchFp8Recv => bf16 * (1.0 + 4.0 / 128.0) / 2.0,
            _ => bf16,
        }
    }
}

/// Timing state of one rank of a buffer, flat or two-tier ([`ExpertParallel`]): a layout and a
/// handle for cached dispatch and combine, expert outputs, the flush buffer. Every op is timed
/// the same way on either tiering: the layout is computed once, outside the timed calls.
#[derive(Debug)]
pub struct Timer {
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    lining: Lining,
    layout: Layout,
    handle: Handle,
    y: CudaSlice<bf16>,
    out: CudaSlice<bf16>,
    /// Rows this rank receives.
    pub num_recv: usize,
    /// How long the host took to issue each call of the last [`Self::time`], microseconds.
    issue_us: Vec<f64>,
}

impl Timer {
    /// Prepares timing of `dev` on `buf` (runs one HostSync dispatch with weights to size
    /// combine's input). Collective.
    ///
    /// # Errors
    /// The dispatch's, an allocation's, or [`crate::CheckError::Other`] when the HostSync
    /// dispatch reported no receive count.
    pub fn new<E: ExpertParallel>(buf: &mut E, dev: &DeviceInputs) -> Result<Self> {
        let stream = buf.stream().clone();
        let ctx = buf.context().clone();
        let lining = Lining::new(&stream)?;
        let layout = buf.layout(&dev.topk_idx, dev.num_tokens)?;
        let input = dev.dispatch_input(false, true);
        let handle = buf
            .dispatch(&input, &layout, RecvMode::HostSync)?
            .into_handle();
        let num_recv = handle.num_recv().ok_or_else(|| {
            crate::CheckError::Other("a HostSync dispatch reported no receive count".into())
        })?;
        let hidden = buf.config().hidden;
        let y = upload(
            &stream,
            &vec![bf16::from_f32(0.5); num_recv.max(1) * hidden],
        )?;
        let out = upload(&stream, &vec![bf16::ZERO; dev.num_tokens.max(1) * hidden])?;
        let out = if dev.num_tokens == 0 {
            stream.null()?
        } else {
            out
        };
        buf.synchronize()?;
        Ok(Self {
            stream,
            ctx,
            lining,
            layout,
            handle,
            y,
            out,
            num_recv,
            issue_us: Vec::new(),
        })
    }

    /// What L2 holds when each timed call starts (default [`L2::Flushed`]).
    pub fn set_l2(&mut self, l2: L2) {
        self.lining.l2 = l2;
    }

    /// Runs `op` `iters` times (each call after an L2 flush, every rank lined up on the
    /// buffer's [`LineUp::lead`], as [`LlTimer`] does, see [`LINE_UP_SPIN`]; the spin is as
    /// many times that as the buffer has tiers, each tier's stage being issued by the host) and
    /// returns each call's time in microseconds (CUDA events around the op only). Collective.
    ///
    /// # Errors
    /// The op's or the driver's; [`crate::CheckError::Other`] for an op this timer does not
    /// run (a low-latency op, or the in-place combine on a two-tier buffer).
    pub fn time<E: LineUp>(
        &mut self,
        buf: &mut E,
        dev: &DeviceInputs,
        op: BenchOp,
        iters: usize,
    ) -> Result<Vec<f64>> {
        if op == BenchOp::CombineInPlace {
            // In-place combine reads the latest dispatch's rows: make this handle's the latest.
            buf.cached_dispatch(&XInput::Bf16(&dev.x), &self.handle)?;
        }
        let stages = match buf.tiering() {
            Tiering::Flat => 1,
            Tiering::TwoTier(_) => 2,
        };
        let mut events = Vec::with_capacity(iters);
        self.issue_us.clear();
        for _ in 0..iters {
            // Lined up like the low-latency ops, so that flat and two-tier ops and both modes
            // are timed the same way where ranks share a GPU.
            self.lining
                .line_up("normal", buf.lead(), LINE_UP_SPIN * stages)?;
            let (start, end) = started_events(&self.ctx, &self.stream)?;
            let issued = std::time::Instant::now();
            self.run(buf, dev, op)?;
            self.issue_us.push(issued.elapsed().as_secs_f64() * 1e6);
            end.record(&self.stream)?;
            events.push((start, end));
        }
        buf.synchronize()?;
        elapsed_us(&events)
    }

    /// The median time the host took to issue one call of the last [`Self::time`] (from the
    /// start event's record to the op's return), microseconds; NaN before any. Longer than
    /// the line-up spin, the events include host time.
    pub fn issue_us(&self) -> f64 {
        median(&self.issue_us)
    }

    fn run<E: ExpertParallel>(
        &mut self,
        buf: &mut E,
        dev: &DeviceInputs,
        op: BenchOp,
    ) -> Result<()> {
        match op {
            BenchOp::DispatchBf16 | BenchOp::DispatchFp8 => {
                let input = DispatchInput {
                    x: dev.x_input(op == BenchOp::DispatchFp8),
                    topk_idx: &dev.topk_idx,
                    topk_weights: Some(&dev.topk_weights),
                };
                buf.dispatch(&input, &self.layout, RecvMode::WorstCase)?;
            }
            BenchOp::CachedDispatchBf16 => {
                buf.cached_dispatch(&XInput::Bf16(&dev.x), &self.handle)?;
            }
            // The bench never reads the dispatch's rows again: the consuming combine, which
            // stages where `--combine-staging auto` finds it faster.
            BenchOp::Combine => buf.combine(
                &CombineInput::new(&self.y).consuming(),
                &self.handle,
                CombineOutput::new(&mut self.out),
            )?,
            BenchOp::CombineInPlace => buf
                .as_flat()
                .ok_or_else(|| {
                    crate::CheckError::Other("the in-place combine runs on a flat buffer".into())
                })?
                .combine_in_place(&self.handle, &mut self.out, None)?,
            other => {
                return Err(crate::CheckError::Other(format!(
                    "{} is timed by LlTimer",
                    other.name()
                )));
            }
        }
        Ok(())
    }
}

/// Timing of the low-latency ops of one rank: its inputs, the receive arrays, the flush buffer.
#[derive(Debug)]
pub struct LlTimer {
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    lining: Lining,
    recv: LlRecv,
    io: LlIo,
    /// Rows (token, expert pairs) this rank receives.
    pub num_recv: usize,
}

impl LlTimer {
    /// Prepares timing on `buf` (which needs `ll_max_tokens_per_rank`) with every rank's
    /// `inputs` (bf16); verifies a BF16 and, when `fp8`, an FP8 round against the reference
    /// first. Collective.
    pub fn new(buf: &mut Buffer, inputs: &[RankInput], fp8: bool) -> Result<Self> {
        let stream = buf.stream().clone();
        let ctx = buf.context().clone();
        let lining = Lining::new(&stream)?;
        let mut recv = buf.alloc_ll_recv()?;
        let experts = buf.config().num_experts;
        let mut io = LlIo::new(&stream, inputs, buf.rank(), experts, recv.capacity())?;
        let mut formats = vec![LlFormat::Bf16];
        if fp8 {
            formats.push(LlFormat::Fp8 { round_scale: false });
        }
        for format in formats {
            buf.ll_dispatch(io.input(), format, &mut recv)?;
            buf.ll_combine(&io.y, &io.idx, &io.w, &recv, &mut io.out)?;
            buf.synchronize()?;
            verify_ll_round(
                buf,
                inputs,
                &recv,
                &io.out,
                format,
                "low-latency bench round",
            )?;
        }
        let num_recv = recv.count_to_host()?.iter().map(|&c| c as usize).sum();
        Ok(Self {
            stream,
            ctx,
            lining,
            recv,
            io,
            num_recv,
        })
    }

    /// Runs `op` (a low-latency op) `iters` times, each after an L2 flush with every rank lined
    /// up (see [`LINE_UP_SPIN`]), and returns each call's time in microseconds. A
    /// phase op times its phase alone: the receive phase is issued after every rank's send
    /// phase finished (a host synchronize and barrier between). Collective.
    pub fn time(&mut self, buf: &mut Buffer, op: BenchOp, iters: usize) -> Result<Vec<f64>> {
        let mut times = Vec::with_capacity(iters);
        for i in 0..iters {
            let recv_phase = matches!(op, BenchOp::LlDispatchFp8Recv | BenchOp::LlCombineRecv);
            if !recv_phase {
                self.flush_and_line_up(buf)?;
            }
            let (start, end) = (timing_event(&self.ctx)?, timing_event(&self.ctx)?);
            let fp8 = LlFormat::Fp8 { round_scale: false };
            let io = &mut self.io;
            match op {
                BenchOp::LlDispatchBf16 | BenchOp::LlDispatchFp8 => {
                    let format = if op == BenchOp::LlDispatchFp8 {
                        fp8
                    } else {
                        LlFormat::Bf16
                    };
                    start.record(&self.stream)?;
                    buf.ll_dispatch(io.input(), format, &mut self.recv)?;
                    end.record(&self.stream)?;
                }
                BenchOp::LlCombine => {
                    start.record(&self.stream)?;
                    buf.ll_combine(&io.y, &io.idx, &io.w, &self.recv, &mut io.out)?;
                    end.record(&self.stream)?;
                }
                BenchOp::LlDispatchFp8Send
                | BenchOp::LlDispatchFp8Recv
                | BenchOp::LlCombineSend
                | BenchOp::LlCombineRecv => {
                    let send = matches!(op, BenchOp::LlDispatchFp8Send | BenchOp::LlCombineSend);
                    if send {
                        start.record(&self.stream)?;
                    }
                    let pending =
                        if matches!(op, BenchOp::LlDispatchFp8Send | BenchOp::LlDispatchFp8Recv) {
                            buf.ll_dispatch_send(io.input(), fp8, &mut self.recv)?
                        } else {
                            buf.ll_combine_send(&io.y, &io.idx, &io.w, &self.recv, &mut io.out)?
                        };
                    if send {
                        end.record(&self.stream)?;
                    }
                    self.stream.synchronize()?;
                    buf.transport()
                        .bootstrap()
                        .barrier(&format!("ll-bench-{i}"))?;
                    if !send {
                        // The receive phase after its own L2 flush, every rank lined up.
                        self.lining.line_up("ll", buf, LINE_UP_SPIN)?;
                        start.record(&self.stream)?;
                    }
                    buf.ll_receive(pending)?;
                    if !send {
                        end.record(&self.stream)?;
                    }
                }
                other => {
                    return Err(crate::CheckError::Other(format!(
                        "{} is timed by Timer",
                        other.name()
                    )));
                }
            }
            times.push((start, end));
        }
        buf.synchronize()?;
        times
            .iter()
            .map(|(s, e)| Ok(f64::from(s.elapsed_ms(e)?) * 1e3))
            .collect()
    }
}

/// How long the GPU spins once the ranks lined up before a timed low-latency call (each
/// rank's L2 flush finished, a host barrier): longer than the host takes to issue an op, so
/// the events time the GPU's work, not the host's.
pub const LINE_UP_SPIN: std::time::Duration = std::time::Duration::from_micros(50);

impl LlTimer {
    /// What L2 holds when each timed call (and each graph replay) starts (default
    /// [`L2::Flushed`]).
    pub fn set_l2(&mut self, l2: L2) {
        self.lining.l2 = l2;
    }

    /// Flushes L2 (unless [`L2::Warm`]), then lines every rank up before its op: the flush finished on every rank (a
    /// host synchronize and barrier), then a GPU spin of [`LINE_UP_SPIN`] keeps the stream busy
    /// while the host issues the op. Without it, ranks sharing a GPU start their op while a
    /// peer still flushes: a kernel that needs all of its SMs at once (every op launches
    /// cooperatively) waits until the peer's 256 MiB flush leaves them, and its events time
    /// that flush. Collective.
    fn flush_and_line_up(&mut self, buf: &mut Buffer) -> Result<()> {
        self.lining.line_up("ll", buf, LINE_UP_SPIN)
    }
}

/// What the L2 cache holds when a timed call starts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum L2 {
    /// Flushed before every call ([`FLUSH_BYTES`] written): the op fetches its code, routing
    /// and rows from DRAM, as after a model's layer has run. The default.
    #[default]
    Flushed,
    /// Left as the previous call (or warm-up) left it: what a profiler's kernel times of calls
    /// in a row see.
    Warm,
}

/// What a timer lines the ranks up with before a timed call: the L2 flush buffer on the
/// timer's stream, whether to flush, and the line-ups so far (they name each one's barrier).
#[derive(Debug)]
struct Lining {
    stream: Arc<CudaStream>,
    flush: CudaSlice<u8>,
    l2: L2,
    count: u64,
}

impl Lining {
    fn new(stream: &Arc<CudaStream>) -> Result<Self> {
        Ok(Self {
            stream: stream.clone(),
            flush: stream.alloc_zeros::<u8>(FLUSH_BYTES)?,
            l2: L2::Flushed,
            count: 0,
        })
    }

    /// Flushes L2 (unless [`L2::Warm`]), waits for the stream, meets every rank at a host
    /// barrier on `buf`'s bootstrap (tagged `tag`), then has the GPU spin for `spin` on `buf`'s
    /// stream (the timer's) while the host issues the timed call. Collective.
    fn line_up(&mut self, tag: &str, buf: &mut Buffer, spin: std::time::Duration) -> Result<()> {
        if self.l2 == L2::Flushed {
            self.stream.memset_zeros(&mut self.flush)?;
        }
        self.stream.synchronize()?;
        self.count += 1;
        buf.transport()
            .bootstrap()
            .barrier(&format!("{tag}-line-up-{}", self.count))?;
        buf.inject_delay(spin)?;
        Ok(())
    }
}

/// The flat buffer a timed call lines the ranks up on ([`Timer::time`]): its transport's
/// bootstrap spans the world, and its stream is the one the ops run on.
pub trait LineUp: ExpertParallel {
    /// That buffer.
    fn lead(&mut self) -> &mut Buffer;
}

impl LineUp for Buffer {
    /// The buffer itself.
    fn lead(&mut self) -> &mut Buffer {
        self
    }
}

impl LineUp for HierarchicalBuffer {
    /// The rail tier: both tiers run on one stream over the world's transport.
    fn lead(&mut self) -> &mut Buffer {
        self.rail()
    }
}

/// Where the time of a low-latency op goes, on the GPU's own clock (block 0 of the kernel):
/// medians over the calls of [`LlTimer::breakdown`], in microseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LlBreakdown {
    /// From the kernel's first instruction to its end (the event time less this is the launch
    /// and the events themselves).
    pub kernel_us: f64,
    /// From the kernel's start until this rank's sends were published.
    pub send_us: f64,
}

impl LlTimer {
    /// Runs the one-kernel op `op` ([`BenchOp::LlDispatchBf16`], [`BenchOp::LlDispatchFp8`] or
    /// [`BenchOp::LlCombine`]) `iters` times, each after an L2 flush and alone on the GPU, and
    /// reads the kernel's own timestamps after each ([`Buffer::last_op_stats`]). Collective.
    pub fn breakdown(
        &mut self,
        buf: &mut Buffer,
        op: BenchOp,
        iters: usize,
    ) -> Result<LlBreakdown> {
        let (mut kernel, mut send) = (Vec::new(), Vec::new());
        for _ in 0..iters {
            self.flush_and_line_up(buf)?;
            let io = &mut self.io;
            match op {
                BenchOp::LlDispatchBf16 => {
                    buf.ll_dispatch(io.input(), LlFormat::Bf16, &mut self.recv)?
                }
                BenchOp::LlDispatchFp8 => buf.ll_dispatch(
                    io.input(),
                    LlFormat::Fp8 { round_scale: false },
                    &mut self.recv,
                )?,
                BenchOp::LlCombine => {
                    buf.ll_combine(&io.y, &io.idx, &io.w, &self.recv, &mut io.out)?
                }
                other => {
                    return Err(crate::CheckError::Other(format!(
                        "{} has no one-kernel breakdown",
                        other.name()
                    )));
                }
            }
            let stats = buf
                .last_op_stats()?
                .ok_or_else(|| crate::CheckError::Other(format!("no stats after {}", op.name())))?;
            kernel.push(stats.total.as_secs_f64() * 1e6);
            send.push(stats.sending.as_secs_f64() * 1e6);
        }
        Ok(LlBreakdown {
            kernel_us: median(&kernel),
            send_us: median(&send),
        })
    }
}

impl LlTimer {
    /// The period of a decode step's communication replayed from a CUDA graph: an FP8
    /// low-latency dispatch and the combine of the same rows, captured once
    /// ([`Buffer::capture`]) and replayed `iters` times, each after an L2 flush with every rank
    /// lined up (see [`LINE_UP_SPIN`]), with events around the replay. Median
    /// microseconds. Collective.
    ///
    /// Turns off cudarc's per-allocation event tracking on the buffer's context for good (a
    /// capture must not record the tracking events): every array of the timer and the buffer
    /// lives on the buffer's one stream, so no cross-stream ordering is lost.
    pub fn graph_period(&mut self, buf: &mut Buffer, iters: usize) -> Result<f64> {
        // SAFETY: the timer's arrays, the flush buffer and the buffer's ops all use the buffer's
        // stream (see above), which orders them without the tracking events.
        unsafe { self.ctx.disable_event_tracking() };
        let fp8 = LlFormat::Fp8 { round_scale: false };
        let graph = {
            let (io, recv) = (&mut self.io, &mut self.recv);
            buf.capture(|b| {
                b.ll_dispatch(io.input(), fp8, recv)?;
                b.ll_combine(&io.y, &io.idx, &io.w, recv, &mut io.out)
            })?
        };
        for _ in 0..3 {
            buf.replay(&graph)?;
        }
        let mut events = Vec::with_capacity(iters);
        for _ in 0..iters {
            self.flush_and_line_up(buf)?;
            let (start, end) = started_events(&self.ctx, &self.stream)?;
            buf.replay(&graph)?;
            end.record(&self.stream)?;
            events.push((start, end));
        }
        buf.synchronize()?;
        Ok(median(&elapsed_us(&events)?))
    }
}

/// One tier's count exchange in a dispatch, on this rank's clock.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TierNotify {
    /// The tier (`"world"` flat; `"rail"`, `"node"` two-tier).
    pub tier: &'static str,
    /// Median time from the tier's dispatch kernel start until its counts were ready, us
    /// (`None` when a dispatch did not report it).
    pub counts_ready_us: Option<f64>,
    /// Median time of the tier's dispatch kernel, us.
    pub kernel_us: f64,
}

/// Runs `iters` BF16 dispatches along `timer`'s layout (WorstCase, like the timed ones) and
/// returns each tier's [`TierNotify`] from the stats blocks
/// ([`ExpertParallel::last_op_stats`] after each dispatch). Collective: every rank calls it
/// with the same `iters`.
///
/// # Errors
/// The ops', or [`crate::CheckError::Other`] when a dispatch reported no statistics.
pub fn notify_stats<E: ExpertParallel>(
    buf: &mut E,
    timer: &Timer,
    dev: &DeviceInputs,
    iters: usize,
) -> Result<Vec<TierNotify>> {
    let mut tiers: Vec<(&'static str, Vec<f64>, Vec<f64>, bool)> = Vec::new();
    for _ in 0..iters {
        let input = DispatchInput {
            x: dev.x_input(false),
            topk_idx: &dev.topk_idx,
            topk_weights: Some(&dev.topk_weights),
        };
        buf.dispatch(&input, &timer.layout, RecvMode::WorstCase)?;
        let stats = buf
            .last_op_stats()?
            .ok_or_else(|| crate::CheckError::Other("a dispatch reported no statistics".into()))?;
        for (i, (name, stats)) in stats.tiers().into_iter().enumerate() {
            if tiers.len() <= i {
                tiers.push((name, Vec::new(), Vec::new(), false));
            }
            let t = &mut tiers[i];
            t.2.push(stats.total.as_secs_f64() * 1e6);
            match stats.counts_ready {
                Some(d) => t.1.push(d.as_secs_f64() * 1e6),
                None => t.3 = true,
            }
        }
    }
    Ok(tiers
        .into_iter()
        .map(|(tier, ready, kernel, missing)| TierNotify {
            tier,
            counts_ready_us: (!missing && !ready.is_empty()).then(|| median(&ready)),
            kernel_us: median(&kernel),
        })
        .collect())
}

/// A new event with timing on (the default flags), for a (start, end) pair around an op.
fn timing_event(ctx: &Arc<CudaContext>) -> Result<CudaEvent> {
    Ok(ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?)
}

/// A (start, end) pair of timing events, the start recorded on `stream` now.
fn started_events(
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
) -> Result<(CudaEvent, CudaEvent)> {
    let (start, end) = (timing_event(ctx)?, timing_event(ctx)?);
    start.record(stream)?;
    Ok((start, end))
}

/// Microseconds between each (start, end) pair (the stream finished).
///
/// # Errors
/// The driver's.
pub(crate) fn elapsed_us(events: &[(CudaEvent, CudaEvent)]) -> Result<Vec<f64>> {
    events
        .iter()
        .map(|(s, e)| Ok(f64::from(s.elapsed_ms(e)?) * 1e3))
        .collect()
}

/// Median of `v` (NaN when empty).
pub fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_matches_deepep() {
        // FP8 counts one byte per value plus a 4-byte scale per 128 values.
        assert_eq!(BenchOp::DispatchBf16.metric_bytes(10, 128), 2560.0);
        assert_eq!(BenchOp::DispatchFp8.metric_bytes(10, 128), 1280.0 + 40.0);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
