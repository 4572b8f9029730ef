//! What the bench workers (flat and hierarchical) share: where rank 0's results go, the error
//! type, rank 0's progress messages, the buffer configuration, the verification rounds and
//! the timing of one op on every rank.

use std::io::IsTerminal as _;
use std::sync::Arc;

use cudarc::driver::{CudaContext, sys};
use epcomm::{BufferConfig, DynTransport, ExpertParallel};
use epcomm_bootstrap::Bootstrap;
use epcomm_check::inputs::{DeviceInputs, HostInputs};
use epcomm_check::timing::{BenchOp, LineUp, Timer, median};
use epcomm_check::verify::{RoundOptions, verified_round};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::cli::BenchArgs;
use crate::results::BenchConfig;
use crate::validate::{BenchPlan, TransportChoice};

/// Environment variable (set by the launcher for its workers) naming the file rank 0 writes
/// its results to.
pub const RESULTS_ENV: &str = "EPCOMM_CLI_RESULTS";

/// A worker's result.
pub(crate) type Res<T = ()> = Result<T, Box<dyn std::error::Error>>;

/// What a bench worker runs with: the flags and their plan, the rendezvous, this rank's CUDA
/// context and transport, and how many GPUs the world runs on.
pub(crate) struct WorkerRun<'a> {
    pub(crate) args: &'a BenchArgs,
    pub(crate) plan: &'a BenchPlan,
    pub(crate) boot: &'a Arc<Bootstrap>,
    pub(crate) ctx: &'a Arc<CudaContext>,
    pub(crate) transport: &'a Arc<dyn DynTransport>,
    pub(crate) gpus: usize,
}

/// The run's configuration as both reports give it: the flags, the plan's transport, the SM
/// counts timed, rank 0's GPU, and how the ranks shared `gpus` GPUs.
///
/// # Errors
/// The driver's, reading the GPU's SM count.
pub(crate) fn run_config(
    args: &BenchArgs,
    plan: &BenchPlan,
    world: usize,
    sms: Vec<u32>,
    ctx: &CudaContext,
    gpus: usize,
) -> Res<BenchConfig> {
    let gpu_sms =
        ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
    Ok(BenchConfig {
        world,
        transport: plan.transport.spec.to_string(),
        schedule: plan.transport.schedule.to_string(),
        routes: plan.transport.routes.to_string(),
        tokens: args.tokens(),
        hidden: args.hidden,
        top_k: args.top_k,
        experts: args.experts,
        sms,
        iters: args.iters,
        warmup: args.warmup,
        fp8: plan.fp8,
        gpu_sms: u32::try_from(gpu_sms).unwrap_or(0),
        gpu_name: ctx.name().unwrap_or_else(|_| "GPU".into()),
        gpus,
        mps: crate::gpu::under_mps(ctx),
        combine_staging: args.combine_staging.name().into(),
        warm_l2: args.warm_l2,
        rail_ring: args.rail_ring.map_or(String::new(), |r| {
            format!("{},{}", r.slots(), r.chunk_rows())
        }),
        rail_forward_sms: args.rail_forward_sms,
    })
}

/// Rank 0's results (`json`) to the file [`RESULTS_ENV`] names; started by hand (not by the
/// launcher), the table on stderr instead.
///
/// # Errors
/// Writing the file.
pub(crate) fn hand_off(json: &str, table: impl FnOnce() -> String) -> Res {
    match std::env::var_os(RESULTS_ENV) {
        Some(path) => std::fs::write(&path, json)?,
        None => eprint!("{}", table()),
    }
    Ok(())
}

/// Rank 0's messages on stderr, above the progress bar.
pub(crate) struct Progress {
    rank: usize,
    pub(crate) bar: ProgressBar,
}

impl Progress {
    pub(crate) fn new(rank: usize, steps: u64, sweep: bool) -> Self {
        let draw = rank == 0 && sweep && std::io::stderr().is_terminal();
        let bar = if draw {
            let bar = ProgressBar::with_draw_target(Some(steps), ProgressDrawTarget::stderr());
            if let Ok(style) =
                ProgressStyle::with_template("{spinner} [{bar:32}] {pos}/{len} {msg} ({elapsed})")
            {
                bar.set_style(style.progress_chars("=> "));
            }
            bar
        } else {
            ProgressBar::hidden()
        };
        Self { rank, bar }
    }

    pub(crate) fn say(&self, msg: impl std::fmt::Display) {
        if self.rank == 0 {
            self.bar.suspend(|| eprintln!("{msg}"));
        }
    }
}

/// Every rank's value of `t` (a median time), in rank order (NaN where a rank sent garbage).
pub(crate) fn every_rank(boot: &Bootstrap, tag: &str, t: f64) -> Res<Vec<f64>> {
    let all = boot.all_gather(tag, &t.to_le_bytes())?;
    Ok(all
        .iter()
        .map(|b| {
            b.get(..8)
                .and_then(|b| b.try_into().ok())
                .map_or(f64::NAN, f64::from_le_bytes)
        })
        .collect())
}

/// Rank 0's first message: the workload both benches generate. `step` is the worker's
/// "[1/N]" prefix.
pub(crate) fn announce_workload(progress: &Progress, step: &str, args: &BenchArgs) {
    progress.say(format_args!(
        "{step} generating DeepEP workload: {} tokens/rank, hidden {}, top-{} of {} experts",
        args.tokens(),
        args.hidden,
        args.top_k,
        args.experts
    ));
}

/// The buffer configuration both benches run: `tokens` per rank, the flags' shape, `sms`
/// SMs, the plan's schedule, routes and combine staging.
pub(crate) fn bench_config(
    args: &BenchArgs,
    tokens: usize,
    sms: u32,
    transport: &TransportChoice,
) -> BufferConfig {
    let mut cfg = BufferConfig::new(tokens, args.hidden, args.top_k, args.experts);
    cfg.num_sms = sms;
    (cfg.schedule, cfg.routes) = (transport.schedule, transport.routes);
    cfg.combine_staging = args.combine_staging;
    cfg.rail_ring = args.rail_ring;
    cfg.rail_forward_sms = args.rail_forward_sms;
    cfg
}

/// The verification rounds before any timing: `base` (BF16), then, when `fp8`, the same
/// round with FP8 rows (the layout is checked once, in the first).
///
/// # Errors
/// The first mismatch or failure.
pub(crate) fn verify_rounds<E: ExpertParallel>(
    buf: &mut E,
    inputs: &HostInputs,
    dev: &DeviceInputs,
    base: RoundOptions,
    fp8: bool,
) -> Res {
    verified_round(buf, inputs, dev, base)?;
    if fp8 {
        let fp8 = RoundOptions {
            fp8: true,
            check_layout: false,
            ..base
        };
        verified_round(buf, inputs, dev, fp8)?;
    }
    Ok(())
}

/// Times `op` (warm-up calls, then `args.iters` timed ones) and gathers every rank's median
/// under `tag` (collective: every rank times the same ops in the same order).
///
/// # Errors
/// The op's, the driver's or the bootstrap's.
pub(crate) fn time_everywhere<E: LineUp>(
    timer: &mut Timer,
    buf: &mut E,
    dev: &DeviceInputs,
    op: BenchOp,
    args: &BenchArgs,
    boot: &Bootstrap,
    tag: &str,
) -> Res<Vec<f64>> {
    timer.time(buf, dev, op, args.warmup)?;
    let t = median(&timer.time(buf, dev, op, args.iters)?);
    every_rank(boot, tag, t)
}
