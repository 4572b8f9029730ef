//! `epcomm`: the command-line entry point of epcomm.
//!
//! * `epcomm doctor` — what this machine offers (GPUs, driver, P2P/NVLink, NVSHMEM, NCCL, RDMA,
//!   environment) and which transports are usable;
//! * `epcomm topo` — the world layout and route plan the library computes for a transport
//!   (pure computation);
//! * `epcomm bench` — the main job: a verified dispatch + combine benchmark, one process per
//!   GPU (see [`mod@bench`]); `--hierarchical` times the internode path instead
//!   ([`mod@bench_hier`]);
//! * `epcomm plot` — a saved sweep (`epcomm bench --json`) drawn as an SVG chart
//!   ([`mod@plot`]).
//!
//! Exit codes (docs/cli.md): [`EXIT_OK`], [`EXIT_RUN_FAILED`], [`EXIT_USAGE`],
//! [`EXIT_ENVIRONMENT`], [`EXIT_REQUIREMENT`].

mod bench;
mod bench_hier;
mod cli;
mod doctor;
mod gpu;
mod hier_results;
mod plot;
mod results;
mod topo;
mod validate;
mod worker;

use std::io::Write as _;
use std::process::ExitCode;

use clap::Parser;

use cli::{Cli, Command, DoctorArgs, PlotArgs, TopoArgs};
use validate::FlagErrors;

/// Success (for `doctor`: the report was printed, whatever the verdicts).
pub const EXIT_OK: u8 = 0;
/// A run failed after it started (a worker, the verification, writing the output).
pub const EXIT_RUN_FAILED: u8 = 1;
/// Invalid flags; nothing was started (clap's own usage errors use this code too).
pub const EXIT_USAGE: u8 = 2;
/// The machine cannot run it: no CUDA driver, no GPU, a missing library or kernel image.
pub const EXIT_ENVIRONMENT: u8 = 3;
/// `doctor --require SPEC`: that transport spec is not usable here.
pub const EXIT_REQUIREMENT: u8 = 4;

/// A failure of a subcommand, by exit code.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// Flags break a rule.
    #[error("{0}")]
    Usage(FlagErrors),
    /// The machine lacks something.
    #[error("{0}")]
    Environment(String),
    /// The run failed.
    #[error("{0}")]
    Run(Box<dyn std::error::Error>),
    /// `doctor --require` failed.
    #[error("{0}")]
    Requirement(String),
}

impl AppError {
    fn code(&self) -> u8 {
        match self {
            Self::Usage(_) => EXIT_USAGE,
            Self::Environment(_) => EXIT_ENVIRONMENT,
            Self::Run(_) => EXIT_RUN_FAILED,
            Self::Requirement(_) => EXIT_REQUIREMENT,
        }
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        // Prints help / version (exit 0) or the usage error naming the flag (exit 2).
        Err(e) => e.exit(),
    };
    let (name, result) = match &cli.command {
        Command::Bench(args) if epcomm_check::procs::is_worker() => {
            return match bench::worker(args) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("epcomm bench (worker): {e}");
                    ExitCode::from(EXIT_RUN_FAILED)
                }
            };
        }
        Command::Bench(args) => ("bench", bench::launch(args)),
        Command::Doctor(args) => ("doctor", run_doctor(args)),
        Command::Topo(args) => ("topo", run_topo(args)),
        Command::Plot(args) => ("plot", run_plot(args)),
    };
    match result {
        Ok(()) => ExitCode::from(EXIT_OK),
        Err(e) => {
            let kind = match &e {
                AppError::Usage(_) => "invalid flags",
                AppError::Environment(_) => "cannot run here",
                AppError::Run(_) => "failed",
                AppError::Requirement(_) => "requirement not met",
            };
            for line in e.to_string().lines() {
                eprintln!("epcomm {name}: {kind}: {line}");
            }
            if matches!(e, AppError::Usage(_)) {
                eprintln!("(nothing was started; see `epcomm {name} --help`)");
            }
            ExitCode::from(e.code())
        }
    }
}

fn print_stdout(text: &str) -> Result<(), AppError> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|e| AppError::Run(format!("writing the report: {e}").into()))
}

fn run_doctor(args: &DoctorArgs) -> Result<(), AppError> {
    let report = doctor::collect();
    let text = if args.json {
        doctor::render_json(&report).map_err(|e| AppError::Run(e.into()))?
    } else {
        doctor::render(&report)
    };
    print_stdout(&text)?;
    let unmet: Vec<String> = args
        .require
        .iter()
        .filter_map(|spec| report.requirement(spec).err())
        .collect();
    if unmet.is_empty() {
        Ok(())
    } else {
        Err(AppError::Requirement(unmet.join("\n")))
    }
}

fn run_topo(args: &TopoArgs) -> Result<(), AppError> {
    let local = match args.world {
        Some(_) => None,
        None => match gpu::probe() {
            Ok(f) => Some(f.gpus.len()),
            Err(e) => {
                return Err(AppError::Environment(format!(
                    "--world not given and the local GPUs cannot be counted ({e}); give the \
                     world size, e.g. --world 8"
                )));
            }
        },
    };
    for note in args.comm.deprecations() {
        eprintln!("epcomm topo: note: {note}");
    }
    let topo = topo::plan_from_args(args, local).map_err(AppError::Usage)?;
    let text = topo::render(&topo).map_err(|e| AppError::Run(e.into()))?;
    print_stdout(&text)
}

fn run_plot(args: &PlotArgs) -> Result<(), AppError> {
    // By default the chart goes to the current directory, not next to a document that may
    // sit in a checkout's data directory.
    let out = args.out.clone().unwrap_or_else(|| {
        let name = args.input.with_extension("svg");
        name.file_name()
            .map_or(name.clone(), std::path::PathBuf::from)
    });
    plot::Sweep::of_saved(&args.input, args.metric)
        .and_then(|sweep| sweep.write(&out))
        .map_err(|e| AppError::Run(e.into()))?;
    eprintln!("epcomm plot: wrote {}", out.display());
    Ok(())
}
