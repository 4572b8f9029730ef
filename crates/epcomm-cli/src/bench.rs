//! `epcomm bench`: the launcher checks every flag and the environment, then starts one worker
//! process per rank (this same binary with `EPCOMM_WORKER=1`; one per GPU unless `--world`
//! asks for more, then ranks share GPUs round-robin). The workers verify one BF16 and
//! one FP8 round against the CPU reference, then time every op with CUDA events (L2 flushed
//! between calls). Rank 0 hands its results to the launcher as JSON (a file named by
//! [`RESULTS_ENV`]); the launcher alone writes stdout (table, JSON or CSV) and the plot.
//! Workers write only to stderr: their stdout is pointed at stderr at start, so nothing a
//! library prints can corrupt the machine-readable output.

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaContext;
use epcomm::{Buffer, DispatchInput, RecvMode, XInput};
use epcomm_bootstrap::{Bootstrap, BootstrapConfig};
use epcomm_check::inputs::{Shape, device_inputs, host_inputs};
use epcomm_check::procs::{gpu_count, run_workers};
use epcomm_check::timing::{BenchOp, L2, LlTimer, Timer, median};
use epcomm_check::verify::RoundOptions;

use crate::cli::BenchArgs;
use crate::doctor::KernelImage;
use crate::hier_results::HierReport;
use crate::results::{BenchReport, Report, SCHEMA, SkewReport, make_row};
use crate::validate::{FlagErrors, Machine, TransportChoice, validate_bench};
use crate::worker::{
    Progress, RESULTS_ENV, Res, WorkerRun, announce_workload, bench_config, every_rank, hand_off,
    run_config, time_everywhere, verify_rounds,
};
use crate::{AppError, gpu};

/// How long the workers may run in all.
const WORKER_TIMEOUT: Duration = Duration::from_secs(1800);

/// Removes the results file however the launcher leaves.
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The launcher: checks, spawns, prints.
///
/// # Errors
/// [`AppError::Usage`] for flags (before anything is spawned), [`AppError::Environment`] when
/// the machine cannot run it, [`AppError::Run`] when a worker fails.
pub fn launch(args: &BenchArgs) -> Result<(), AppError> {
    // 1. Everything that needs no device.
    validate_bench(args, None, &Machine::default()).map_err(AppError::Usage)?;
    // 2. The device.
    let facts = gpu::probe().map_err(|e| AppError::Environment(e.to_string()))?;
    // 3. Everything again, with the device's limits.
    let machine = Machine::with_gpus(facts.gpus.clone());
    let plan = validate_bench(args, Some(facts.gpus.len()), &machine).map_err(AppError::Usage)?;
    let world = plan.world.unwrap_or(facts.gpus.len());
    // 4. What the transport needs.
    check_transport(&plan.transport)?;
    let argv: Vec<String> = std::env::args_os()
        .skip(1)
        .map(|a| a.into_string())
        .collect::<Result<_, _>>()
        .map_err(|a| {
            AppError::Usage(FlagErrors(vec![crate::validate::FlagError::Invalid {
                flag: "bench",
                why: format!("argument {a:?} is not UTF-8"),
            }]))
        })?;
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    for n in &plan.notes {
        eprintln!("epcomm bench: note: {n}");
    }
    let results = TempFile(std::env::temp_dir().join(format!(
        "epcomm-bench-{}-{}.json",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    )));
    // Local launch = one host: `run_workers` adds the library's defaults for one host (NVSHMEM
    // without a remote transport and without multicast, the copy-engine proxy's hardware
    // queues), where the environment does not set them.
    let env = vec![(RESULTS_ENV, results.0.display().to_string())];
    let gpus = facts.gpus.len();
    if world > gpus {
        eprintln!(
            "epcomm bench: launching {world} worker(s) on {gpus} GPU(s), ranks sharing GPUs \
             round-robin, {} transport",
            plan.transport.spec
        );
    } else {
        eprintln!(
            "epcomm bench: launching {world} worker(s), one process per GPU, {} transport",
            plan.transport.spec
        );
    }
    if let Some(t) = plan.tiers {
        eprintln!(
            "epcomm bench: hierarchical: {} logical node(s) x {} local rank(s)",
            t.nodes(),
            t.local_ranks()
        );
    }
    run_workers(world, &argv, &env, WORKER_TIMEOUT).map_err(|e| AppError::Run(e.into()))?;
    let text = std::fs::read_to_string(&results.0).map_err(|e| {
        AppError::Run(format!("rank 0 left no results in {}: {e}", results.0.display()).into())
    })?;
    if args.hierarchical {
        print_report::<HierReport>(&text, args)?;
        return Ok(());
    }
    let report = print_report::<BenchReport>(&text, args)?;
    if let Some(path) = &args.plot {
        crate::plot::Sweep::of_report(&report)
            .and_then(|sweep| sweep.write(path))
            .map_err(|e| AppError::Run(e.into()))?;
        eprintln!("epcomm bench: plot written to {}", path.display());
    }
    Ok(())
}

/// Parses rank 0's report (either tiering's), checks it and prints it in the format asked
/// for; returns it.
fn print_report<R>(text: &str, args: &BenchArgs) -> Result<R, AppError>
where
    R: Report + serde::de::DeserializeOwned,
{
    let report: R =
        serde_json::from_str(text).map_err(|e| AppError::Run(format!("results: {e}").into()))?;
    report.check().map_err(|e| AppError::Run(e.into()))?;
    let out = report
        .render(args.format())
        .map_err(|e| AppError::Run(e.into()))?;
    write_stdout(&out)?;
    Ok(report)
}

/// The results on stdout.
fn write_stdout(out: &str) -> Result<(), AppError> {
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_all(out.as_bytes())
        .and_then(|()| stdout.flush())
        .map_err(|e| AppError::Run(format!("writing the results: {e}").into()))
}

/// Checks that this build and machine have what the transport loads in the workers: the
/// kernel image of its kernel family and, when it needs one, its run-time library (NVSHMEM).
fn check_transport(t: &TransportChoice) -> Result<(), AppError> {
    let spec = t.spec;
    let images = KernelImage::locate_all();
    match KernelImage::of_family(&images, t.caps.kernel_family) {
        Some(image) if image.available => {}
        Some(image) => {
            return Err(AppError::Environment(format!(
                "--transport {spec}: no kernel image {} ({}); {}",
                image.artifact,
                image.source,
                image.fix()
            )));
        }
        None => {
            return Err(AppError::Environment(format!(
                "--transport {spec}: this build has no kernel image for it"
            )));
        }
    }
    // The backend's own check: NVSHMEM's library loads, an RDMA device is there.
    spec.probe_here()
        .map_err(|e| AppError::Environment(format!("--transport {spec}: {e}")))
}

/// Points this process's stdout at its stderr (workers never write results to stdout).
fn stdout_to_stderr() {
    let _ = std::io::stdout().flush();
    // SAFETY: dup2 on the process's own standard descriptors; no Rust object owns fd 1
    // exclusively (std's stdout handle writes to whatever fd 1 is).
    unsafe {
        libc::dup2(libc::STDERR_FILENO, libc::STDOUT_FILENO);
    }
}

/// A worker process (one rank): the flat bench, or with `--hierarchical` the internode one
/// ([`crate::bench_hier`]).
///
/// # Errors
/// Any failure of the bootstrap, the transport, the verification or the timing.
pub fn worker(args: &BenchArgs) -> Res {
    stdout_to_stderr();
    let boot = Arc::new(Bootstrap::connect(BootstrapConfig::from_env()?)?);
    let plan = validate_bench(args, Some(boot.world_size()), &Machine::default())?;
    // One rank per GPU; with a world above the GPU count ranks share GPUs, round-robin.
    let gpus = gpu_count()?;
    let ctx = CudaContext::new(boot.local_rank() % gpus).map_err(|e| {
        let sharing = boot.local_world_size().div_ceil(gpus.max(1));
        match epcomm_backends::context_error_hint(&e, sharing) {
            Some(hint) => format!("creating the CUDA context: {e}: {hint}").into(),
            None => Box::<dyn std::error::Error>::from(e),
        }
    })?;
    let transport = plan.transport.spec.build(ctx.clone(), boot.clone())?;
    let gpus_used = boot.world_size().min(gpus);
    let run = WorkerRun {
        args,
        plan: &plan,
        boot: &boot,
        ctx: &ctx,
        transport: &transport,
        gpus: gpus_used,
    };
    if args.hierarchical {
        return crate::bench_hier::run_hier_bench(&run);
    }
    run_bench(&run)
}

/// The flat bench on this rank (collective): every SM count of the sweep, the low-latency ops
/// with `--low-latency`, the skew demo with `--delay-us`.
fn run_bench(run: &WorkerRun<'_>) -> Res {
    let (args, plan, boot, ctx) = (run.args, run.plan, run.boot, run.ctx);
    let (rank, world) = (boot.rank(), boot.world_size());
    let (schedule, routes) = (plan.transport.schedule, plan.transport.routes);
    let shape = Shape::uniform(
        world,
        args.tokens(),
        args.hidden,
        args.top_k,
        args.experts,
        2025,
    );
    let ops: Vec<BenchOp> = BenchOp::ALL
        .into_iter()
        .filter(|&op| op != BenchOp::DispatchFp8 || plan.fp8)
        .collect();
    let progress = Progress::new(rank, (plan.sweep.len() * ops.len()) as u64, plan.is_sweep);
    announce_workload(&progress, "[1/4]", args);
    let inputs = host_inputs(&shape)?;
    let mut rows = Vec::new();
    let mut skew = None;
    for (i, &sms) in plan.sweep.iter().enumerate() {
        let mut cfg = bench_config(args, args.tokens(), sms, &plan.transport);
        if args.low_latency {
            cfg.ll_max_tokens_per_rank = args.tokens();
            cfg.ll_num_sms = args.ll_sms;
        }
        let mut buf = Buffer::new(ctx.clone(), run.transport.clone(), cfg)?;
        let dev = device_inputs(buf.stream(), &inputs, rank)?;
        if i == 0 {
            progress.say(
                "[2/4] verifying BF16 and FP8 dispatch + cached dispatch + combine against the CPU reference",
            );
            verify_rounds(&mut buf, &inputs, &dev, RoundOptions::default(), plan.fp8)?;
            progress.say("      verified: every output matches the reference bit for bit");
        }
        progress.say(format_args!(
            "[3/4] timing with {sms} SMs, {schedule} schedule, {routes} routes ({} warm-up + {} timed calls per op, {})",
            args.warmup,
            args.iters,
            if args.warm_l2 { "L2 left warm between calls" } else { "L2 flushed between calls" }
        ));
        let l2 = if args.warm_l2 { L2::Warm } else { L2::Flushed };
        let mut timer = Timer::new(&mut buf, &dev)?;
        timer.set_l2(l2);
        for &op in &ops {
            progress
                .bar
                .set_message(format!("{} at {sms} SMs", op.name()));
            let tag = format!("bench-{sms}-{}", op.name());
            let times = time_everywhere(&mut timer, &mut buf, &dev, op, args, boot, &tag)?;
            rows.push(make_row(op, sms, times, timer.num_recv, args.hidden)?);
            progress.bar.inc(1);
        }
        if args.low_latency {
            progress.say("      low-latency ops: verifying BF16 and FP8 rounds, then timing");
            let mut ll = LlTimer::new(&mut buf, &inputs.bf16, plan.fp8)?;
            ll.set_l2(l2);
            let ll_sms = buf.ll_num_blocks();
            for op in BenchOp::LOW_LATENCY {
                if !plan.fp8
                    && matches!(
                        op,
                        BenchOp::LlDispatchFp8
                            | BenchOp::LlDispatchFp8Send
                            | BenchOp::LlDispatchFp8Recv
                    )
                {
                    continue;
                }
                progress
                    .bar
                    .set_message(format!("{} at {ll_sms} SMs", op.name()));
                ll.time(&mut buf, op, args.warmup)?;
                let t = median(&ll.time(&mut buf, op, args.iters)?);
                let times = every_rank(boot, &format!("bench-{sms}-{}", op.name()), t)?;
                rows.push(make_row(op, ll_sms, times, ll.num_recv, args.hidden)?);
                if matches!(
                    op,
                    BenchOp::LlDispatchBf16 | BenchOp::LlDispatchFp8 | BenchOp::LlCombine
                ) {
                    let b = ll.breakdown(&mut buf, op, args.iters.clamp(1, 10))?;
                    progress.say(format_args!(
                        "      {} at {ll_sms} SMs on rank {rank}: {t:.1} us with events, {:.1} us \
                         in the kernel (GPU clock), of which {:.1} us until its sends were \
                         published",
                        op.name(),
                        b.kernel_us,
                        b.send_us
                    ));
                }
            }
            if plan.fp8 {
                let t = ll.graph_period(&mut buf, args.iters)?;
                let times = every_rank(boot, &format!("bench-{sms}-ll-graph"), t)?;
                let slowest = times.iter().copied().fold(f64::NAN, f64::max);
                progress.say(format_args!(
                    "      decode step from a CUDA graph (LL dispatch FP8 + LL combine, replayed, \
                     {} before each replay) at {ll_sms} SMs: {slowest:.1} us (slowest rank's \
                     median)",
                    if args.warm_l2 {
                        "L2 left warm"
                    } else {
                        "L2 flushed"
                    }
                ));
            }
        }
        if let (Some((late, delay_us)), 0) = (plan.delay, i) {
            skew = Some(skew_demo(&mut buf, &dev, boot, late, delay_us)?);
        }
        buf.destroy()?;
    }
    progress.bar.finish_and_clear();
    progress.say("[4/4] done");
    if rank == 0 {
        let report = BenchReport {
            schema: SCHEMA.into(),
            config: run_config(args, plan, world, plan.sweep.clone(), ctx, run.gpus)?,
            results: rows,
            skew,
        };
        report.check()?;
        hand_off(&serde_json::to_string(&report)?, || report.table())?;
    }
    Ok(())
}

/// Delays `late`'s stream before each of five dispatches and gathers whom every rank names.
fn skew_demo(
    buf: &mut Buffer,
    dev: &epcomm_check::inputs::DeviceInputs,
    boot: &Bootstrap,
    late: usize,
    delay_us: u64,
) -> Res<SkewReport> {
    let rank = boot.rank();
    let layout = buf.layout(&dev.topk_idx, dev.num_tokens)?;
    buf.synchronize()?;
    let mut named = Vec::new();
    let mut statements = Vec::new();
    for i in 0..5 {
        boot.barrier(&format!("skew-{i}"))?;
        if rank == late {
            buf.inject_delay(Duration::from_micros(delay_us))?;
        }
        let input = DispatchInput {
            x: XInput::Bf16(&dev.x),
            topk_idx: &dev.topk_idx,
            topk_weights: None,
        };
        buf.dispatch(&input, &layout, RecvMode::WorstCase)?;
        let stats = buf.last_op_stats()?.ok_or("no stats after a dispatch")?;
        named.push(u8::try_from(stats.late_rank()).unwrap_or(u8::MAX));
        if i == 4 {
            statements = boot
                .all_gather("skew-report", stats.to_string().as_bytes())?
                .iter()
                .map(|s| String::from_utf8_lossy(s).trim_end().to_string())
                .collect();
        }
    }
    let named = boot
        .all_gather("skew-named", &named)?
        .into_iter()
        .map(|v| v.into_iter().map(usize::from).collect())
        .collect();
    Ok(SkewReport {
        delayed_rank: late,
        delay_us,
        statements,
        named,
    })
}
