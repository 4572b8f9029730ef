//! What the bench workers (flat and hierarchical) share: where rank 0's results go, the error
//! type, rank 0's progress messages and the all-gather of each rank's median.

use std::io::IsTerminal as _;

use cudarc::driver::{CudaContext, sys};
use epcomm_bootstrap::Bootstrap;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::cli::BenchArgs;
use crate::results::BenchConfig;
use crate::validate::BenchPlan;

/// Environment variable (set by the launcher for its workers) naming the file rank 0 writes
/// its results to.
pub const RESULTS_ENV: &str = "EPCOMM_CLI_RESULTS";

/// A worker's result.
pub(crate) type Res<T = ()> = Result<T, Box<dyn std::error::Error>>;

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
