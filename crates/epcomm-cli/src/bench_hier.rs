//! `epcomm bench --hierarchical`: a worker's part of the internode bench.
//!
//! Every rank builds a [`HierarchicalBuffer`] over the transport's logical nodes, verifies a
//! BF16 (and, when the hidden size allows, an FP8) round of dispatch, combine, cached dispatch
//! and combine against the CPU reference bit for bit, then times the hierarchical ops the way
//! the flat bench times its own (CUDA events on the buffer's stream around each call, L2
//! flushed before it, every rank running the same calls in lockstep). Then the notify latency:
//! a second buffer for [`NOTIFY_TOKENS`] tokens per rank, verified too, its BF16 dispatch
//! timed, and each tier's counts-ready time read from the stats blocks. After each two-tier
//! buffer, a flat [`Buffer`] over the same ranks, transport, SMs and tokens is verified and
//! times the same ops, so that every row carries the flat op's time from the same run. The
//! rows each tier carries come from the CPU reference's routing ([`hier_rows`]); a rank whose
//! device receive count differs from it stops the run. Rank 0 hands a [`HierReport`] to the
//! launcher.

use epcomm::{Buffer, ExpertParallel, HierarchicalBuffer};
use epcomm_bootstrap::Bootstrap;
use epcomm_check::hier_bench::{HierOp, HierRows, hier_rows, rows_written_ratio};
use epcomm_check::inputs::{DeviceInputs, HostInputs, Shape, device_inputs, host_inputs};
use epcomm_check::timing::{TierNotify, Timer, notify_stats};
use epcomm_check::verify::RoundOptions;
use epcomm_topology::Tiers;

use crate::cli::BenchArgs;
use crate::hier_results::{
    HIER_SCHEMA, HierConfig, HierReport, HierRow, NOTIFY_TOKENS, NotifyReport, TierNotifyReport,
    make_hier_row,
};
use crate::results::Report;
use crate::worker::{
    Progress, Res, WorkerRun, announce_workload, bench_config, every_rank, hand_off, run_config,
    time_everywhere, verify_rounds,
};

/// The seed of the flat bench's workload.
const SEED: u64 = 2025;

/// A failure of the internode bench that is not a library's.
#[derive(Debug, thiserror::Error)]
pub enum HierBenchError {
    /// The device's receive count differs from the reference's routing.
    #[error(
        "rank {rank}: the hierarchical dispatch of {tokens} tokens/rank received {device} rows, \
         the reference routes {reference} to it"
    )]
    RecvMismatch {
        /// The rank.
        rank: usize,
        /// Tokens per rank.
        tokens: usize,
        /// Rows the device reported.
        device: usize,
        /// Rows the reference routes to the rank.
        reference: u64,
    },
    /// The reference gave no rows for a rank of the world.
    #[error("the reference's rows per tier have no entry for rank {0}")]
    NoRows(usize),
}

/// One buffer's worth of the bench: its inputs, every rank's rows per tier.
struct Workload {
    inputs: HostInputs,
    rows: Vec<HierRows>,
}

impl Workload {
    fn new(args: &BenchArgs, world: usize, tokens: usize, tiers: Tiers) -> Res<Self> {
        let shape = Shape::uniform(world, tokens, args.hidden, args.top_k, args.experts, SEED);
        let inputs = host_inputs(&shape)?;
        let idx: Vec<&[i64]> = inputs.bf16.iter().map(|i| i.topk_idx.as_slice()).collect();
        let rows = hier_rows(&idx, args.top_k, args.experts, tiers)?;
        Ok(Self { inputs, rows })
    }

    fn rows(&self, rank: usize) -> Result<&HierRows, HierBenchError> {
        self.rows.get(rank).ok_or(HierBenchError::NoRows(rank))
    }
}

/// Stops the run when the device's receive count is not the reference's.
fn check_recv(rank: usize, tokens: usize, device: usize, rows: &HierRows) -> Res {
    if device as u64 == rows.recv {
        return Ok(());
    }
    Err(HierBenchError::RecvMismatch {
        rank,
        tokens,
        device,
        reference: rows.recv,
    }
    .into())
}

/// The verification rounds (BF16, and FP8 when `fp8`): dispatch, combine, cached dispatch
/// and combine; no in-place combine (a flat buffer's) and no layout check (the rail tier's
/// layout is the flat one's, checked by the flat bench).
fn verify(buf: &mut HierarchicalBuffer, w: &Workload, dev: &DeviceInputs, fp8: bool) -> Res {
    let base = RoundOptions {
        in_place: false,
        check_layout: false,
        ..RoundOptions::default()
    };
    verify_rounds(buf, &w.inputs, dev, base, fp8)
}

/// Every rank's value of an optional time (`None` travels as NaN).
fn every_rank_opt(boot: &Bootstrap, tag: &str, v: Option<f64>) -> Res<Vec<Option<f64>>> {
    Ok(every_rank(boot, tag, v.unwrap_or(f64::NAN))?
        .into_iter()
        .map(|v| v.is_finite().then_some(v))
        .collect())
}

/// Runs the internode bench on this rank (collective).
///
/// # Errors
/// Any failure of the buffers, the verification, the timing or the results.
pub(crate) fn run_hier_bench(run: &WorkerRun<'_>) -> Res {
    let (args, plan, boot, ctx) = (run.args, run.plan, run.boot, run.ctx);
    let (rank, world) = (boot.rank(), boot.world_size());
    let choice = &plan.transport;
    let progress = Progress::new(rank, 0, false);
    let sms = args.sms;

    announce_workload(&progress, "[1/6]", args);
    let mut buf = HierarchicalBuffer::new(
        ctx.clone(),
        run.transport.clone(),
        bench_config(args, args.tokens(), sms, choice),
    )?;
    let tiers = buf.tiers();
    let work = Workload::new(args, world, args.tokens(), tiers)?;
    let dev = device_inputs(buf.stream(), &work.inputs, rank)?;
    progress.say(format_args!(
        "[2/6] verifying hierarchical dispatch + combine + cached dispatch + combine (BF16{}) \
         against the CPU reference on {} node(s) x {} local rank(s)",
        if plan.fp8 { ", FP8" } else { "" },
        tiers.nodes(),
        tiers.local_ranks()
    ));
    verify(&mut buf, &work, &dev, plan.fp8)?;
    progress.say("      verified: every output matches the reference bit for bit");
    progress.say(format_args!(
        "[3/6] timing with {sms} SMs per tier, {} schedule, {} routes ({} warm-up + {} timed \
         calls per op, L2 flushed between calls)",
        choice.schedule, choice.routes, args.warmup, args.iters
    ));
    let mut timer = Timer::new(&mut buf, &dev)?;
    check_recv(rank, args.tokens(), timer.num_recv, work.rows(rank)?)?;
    let ops: Vec<HierOp> = HierOp::ALL
        .into_iter()
        .filter(|op| plan.fp8 || !op.is_fp8())
        .collect();
    let mut results = Vec::new();
    for &op in &ops {
        let tag = format!("hier-bench-{}", op.id());
        let times = time_everywhere(&mut timer, &mut buf, &dev, op.flat(), args, boot, &tag)?;
        results.push(make_hier_row(
            op,
            args.tokens(),
            sms,
            times,
            work.rows(0)?,
            args.hidden,
        )?);
    }
    drop(timer);
    drop(dev);
    drop(buf);

    progress.say(format_args!(
        "[4/6] the same ops on a flat buffer over the same ranks, transport and {sms} SMs \
         (verified first)"
    ));
    let flat = time_flat(run, &work, args.tokens(), &ops)?;
    let results = results
        .into_iter()
        .zip(&flat)
        .map(|(row, times)| row.with_flat(times))
        .collect::<Result<Vec<_>, _>>()?;

    progress.say(format_args!(
        "[5/6] notify latency: hierarchical dispatch of {NOTIFY_TOKENS} tokens/rank (verified \
         first), then each tier's counts-ready time from the stats blocks"
    ));
    let notify = notify(run, tiers)?;
    progress.say("[6/6] done");

    if rank == 0 {
        let report = HierReport {
            schema: HIER_SCHEMA.into(),
            config: HierConfig {
                run: run_config(args, plan, world, vec![sms], ctx, run.gpus)?,
                nodes: tiers.nodes(),
                local_ranks: tiers.local_ranks(),
                rows_written_ratio: rows_written_ratio(&work.rows),
            },
            results,
            notify,
        };
        report.check()?;
        hand_off(&serde_json::to_string(&report)?, || report.table())?;
    }
    Ok(())
}

/// Verifies a flat [`Buffer`] for `tokens` per rank over the same ranks, transport and SMs on
/// the same workload, then times the flat op of each of `ops` as the bench times the two-tier
/// ones; every rank's medians per op, in `ops`' order (collective).
fn time_flat(
    run: &WorkerRun<'_>,
    work: &Workload,
    tokens: usize,
    ops: &[HierOp],
) -> Res<Vec<Vec<f64>>> {
    let (args, plan, boot) = (run.args, run.plan, run.boot);
    let mut buf = Buffer::new(
        run.ctx.clone(),
        run.transport.clone(),
        bench_config(args, tokens, args.sms, &plan.transport),
    )?;
    let dev = device_inputs(buf.stream(), &work.inputs, boot.rank())?;
    verify_rounds(
        &mut buf,
        &work.inputs,
        &dev,
        RoundOptions::default(),
        plan.fp8,
    )?;
    let mut timer = Timer::new(&mut buf, &dev)?;
    ops.iter()
        .map(|op| {
            let tag = format!("hier-bench-flat-{}", op.id());
            time_everywhere(&mut timer, &mut buf, &dev, op.flat(), args, boot, &tag)
        })
        .collect()
}

/// The notify measurement on a buffer for [`NOTIFY_TOKENS`] tokens per rank (collective).
fn notify(run: &WorkerRun<'_>, tiers: Tiers) -> Res<NotifyReport> {
    let (args, boot, plan) = (run.args, run.boot, run.plan);
    let rank = boot.rank();
    let mut buf = HierarchicalBuffer::new(
        run.ctx.clone(),
        run.transport.clone(),
        bench_config(args, NOTIFY_TOKENS, args.sms, &plan.transport),
    )?;
    let work = Workload::new(args, boot.world_size(), NOTIFY_TOKENS, tiers)?;
    let dev = device_inputs(buf.stream(), &work.inputs, rank)?;
    verify(&mut buf, &work, &dev, false)?;
    let mut timer = Timer::new(&mut buf, &dev)?;
    check_recv(rank, NOTIFY_TOKENS, timer.num_recv, work.rows(rank)?)?;
    let op = HierOp::DispatchBf16;
    let times = time_everywhere(
        &mut timer,
        &mut buf,
        &dev,
        op.flat(),
        args,
        boot,
        "hier-notify-dispatch",
    )?;
    let host_issue_us = every_rank(boot, "hier-notify-issue", timer.issue_us())?;
    let dispatch: HierRow = make_hier_row(
        op,
        NOTIFY_TOKENS,
        args.sms,
        times,
        work.rows(0)?,
        args.hidden,
    )?;
    let tiers = notify_stats(&mut buf, &timer, &dev, args.iters)?;
    drop(timer);
    drop(dev);
    drop(buf);
    let flat = time_flat(run, &work, NOTIFY_TOKENS, &[op])?;
    let dispatch = dispatch.with_flat(flat.first().map_or(&[][..], Vec::as_slice))?;
    let tier = |name: &str| -> Res<TierNotify> {
        Ok(*tiers
            .iter()
            .find(|t| t.tier == name)
            .ok_or_else(|| format!("the two-tier dispatch reported no {name} tier statistics"))?)
    };
    let (rail, node) = (tier("rail")?, tier("node")?);
    let gather = |tier: &str, t: TierNotify| -> Res<TierNotifyReport> {
        Ok(TierNotifyReport {
            counts_ready_us: every_rank_opt(
                boot,
                &format!("hier-notify-{tier}-ready"),
                t.counts_ready_us,
            )?,
            kernel_us: every_rank(boot, &format!("hier-notify-{tier}-kernel"), t.kernel_us)?,
        })
    };
    Ok(NotifyReport {
        dispatch,
        rail: gather("rail", rail)?,
        node: gather("node", node)?,
        host_issue_us,
    })
}
