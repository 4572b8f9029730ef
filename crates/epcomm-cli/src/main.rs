//! `epcomm`: the main job — a verified dispatch + combine benchmark on all local GPUs.
//!
//! `epcomm bench` starts one worker process per GPU (this same binary with `EPCOMM_WORKER=1`),
//! checks one BF16 and one FP8 round against the CPU reference, then times every op with CUDA
//! events (L2 flushed between calls) and prints DeepEP's metric.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use cudarc::driver::{CudaContext, sys};
use epcomm::{
    BarrierStrategy, Buffer, BufferConfig, DispatchInput, IpcTransport, RecvMode, Transport, XInput,
};
use epcomm_bootstrap::{Bootstrap, BootstrapConfig};
use epcomm_check::inputs::{Shape, device_inputs, host_inputs};
use epcomm_check::procs::{gpu_count, is_worker, run_workers};
use epcomm_check::timing::{BenchOp, Timer, median};
use epcomm_check::verify::{RoundOptions, verified_round};
use epcomm_transport_nvshmem::{NvshmemOptions, NvshmemTransport};

#[derive(Parser, Debug)]
#[command(
    name = "epcomm",
    version,
    about = "Expert-parallel dispatch/combine over NVLink"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Verified dispatch + combine benchmark on the local GPUs (DeepEP's workload and metric).
    Bench(BenchArgs),
}

#[derive(Args, Debug, Clone)]
struct BenchArgs {
    /// Ranks (GPUs) to use; default: every local GPU.
    #[arg(long)]
    world: Option<usize>,
    /// Tokens per rank.
    #[arg(long, default_value_t = 4096)]
    tokens: usize,
    /// Hidden size.
    #[arg(long, default_value_t = 7168)]
    hidden: usize,
    /// Experts per token.
    #[arg(long, default_value_t = 8)]
    top_k: usize,
    /// Experts in total.
    #[arg(long, default_value_t = 256)]
    experts: usize,
    /// SMs (blocks) per op.
    #[arg(long, default_value_t = 24)]
    sms: u32,
    /// Transport: ipc (CUDA IPC over NVLink) or nvshmem (NVSHMEM symmetric heap).
    #[arg(long, default_value = "ipc")]
    transport: String,
    /// Barrier strategy: epoch, global, or peer-signal (nvshmem only).
    #[arg(long, default_value = "epoch")]
    barrier: String,
    /// nvshmem only: split this host's GPUs into this many virtual nodes; traffic between them
    /// goes through NVSHMEM put/signal as between hosts.
    #[arg(long, default_value_t = 1)]
    virtual_nodes: usize,
    /// Timed calls per op.
    #[arg(long, default_value_t = 50)]
    iters: usize,
    /// Untimed calls per op first.
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Skew demo: delay this rank's GPU stream before each of five extra dispatches...
    #[arg(long)]
    delay_rank: Option<usize>,
    /// ...by this many microseconds, and report who each rank names as late.
    #[arg(long, default_value_t = 200)]
    delay_us: u64,
    /// Comma-separated SM counts to sweep (BF16 dispatch and combine), instead of one config.
    #[arg(long)]
    sweep_sms: Option<String>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let Command::Bench(args) = cli.command;
    let result = if is_worker() {
        bench_worker(&args)
    } else {
        bench_launcher(&args)
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("epcomm: {e}");
            ExitCode::FAILURE
        }
    }
}

type Res<T = ()> = Result<T, Box<dyn std::error::Error>>;

fn bench_launcher(args: &BenchArgs) -> Res {
    let gpus = gpu_count()?;
    let world = args.world.unwrap_or(gpus);
    if world == 0 || world > gpus {
        return Err(format!("--world {world}: this machine has {gpus} GPU(s)").into());
    }
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    eprintln!(
        "epcomm bench: {world} rank(s), one process per GPU, {} transport",
        args.transport
    );
    // Local launch = one host: NVSHMEM needs no remote transport; multicast stays off.
    let mut env = vec![("NVSHMEM_DISABLE_NVLS", "1".to_string())];
    for (key, value) in [
        ("NVSHMEM_REMOTE_TRANSPORT", "none"),
        ("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo"),
    ] {
        if std::env::var_os(key).is_none() {
            env.push((key, value.to_string()));
        }
    }
    run_workers(world, &argv, &env, Duration::from_secs(1800))?;
    Ok(())
}

fn say(rank: usize, msg: impl std::fmt::Display) {
    if rank == 0 {
        eprintln!("{msg}");
    }
}

fn bench_worker(args: &BenchArgs) -> Res {
    let boot = Arc::new(Bootstrap::connect(BootstrapConfig::from_env()?)?);
    let ctx = CudaContext::new(boot.local_rank())?;
    match args.transport.as_str() {
        "ipc" if args.virtual_nodes != 1 => {
            Err("--virtual-nodes: only the nvshmem transport can reach other nodes".into())
        }
        "ipc" => run_bench(args, &boot, &ctx, &|| {
            Ok(IpcTransport::new(ctx.clone(), boot.clone())?)
        }),
        "nvshmem" => {
            let options = NvshmemOptions {
                virtual_nodes: args.virtual_nodes,
            };
            let t = NvshmemTransport::with_options(ctx.clone(), boot.clone(), options)?;
            run_bench(args, &boot, &ctx, &|| Ok(t.clone()))
        }
        other => Err(format!("--transport {other}: expected ipc or nvshmem").into()),
    }
}

fn run_bench<T: Transport>(
    args: &BenchArgs,
    boot: &Arc<Bootstrap>,
    ctx: &Arc<CudaContext>,
    make: &dyn Fn() -> Res<T>,
) -> Res {
    let (rank, world) = (boot.rank(), boot.world_size());
    let sms_total =
        ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
    let barrier: BarrierStrategy = args.barrier.parse()?;
    let sweep: Vec<u32> = match &args.sweep_sms {
        Some(s) => s
            .split(',')
            .map(|v| v.trim().parse())
            .collect::<Result<_, _>>()?,
        None => vec![args.sms],
    };
    let shape = Shape::uniform(
        world,
        args.tokens,
        args.hidden,
        args.top_k,
        args.experts,
        2025,
    );
    say(
        rank,
        format_args!(
            "[1/4] generating DeepEP workload: {} tokens/rank, hidden {}, top-{} of {} experts",
            args.tokens, args.hidden, args.top_k, args.experts
        ),
    );
    let inputs = host_inputs(&shape)?;
    let mut rows = Vec::new();
    for (i, &sms) in sweep.iter().enumerate() {
        let mut cfg = BufferConfig::new(args.tokens, args.hidden, args.top_k, args.experts);
        cfg.num_sms = sms;
        cfg.barrier = barrier;
        let mut buf = Buffer::with_transport(make()?, ctx.clone(), cfg)?;
        let dev = device_inputs(buf.stream(), &inputs, rank)?;
        if i == 0 {
            say(
                rank,
                "[2/4] verifying BF16 and FP8 dispatch + cached dispatch + combine against the CPU reference",
            );
            verified_round(&mut buf, &inputs, &dev, RoundOptions::default())?;
            if shape.fp8_capable() {
                verified_round(
                    &mut buf,
                    &inputs,
                    &dev,
                    RoundOptions {
                        fp8: true,
                        check_layout: false,
                        ..RoundOptions::default()
                    },
                )?;
            }
            say(
                rank,
                "      verified: every output matches the reference bit for bit",
            );
        }
        say(
            rank,
            format_args!(
                "[3/4] timing with {sms} SMs, {} barrier ({} warm-up + {} timed calls per op, L2 flushed between calls)",
                barrier.name(),
                args.warmup,
                args.iters
            ),
        );
        let mut timer = Timer::new(&mut buf, &dev)?;
        for op in BenchOp::ALL {
            if op == BenchOp::DispatchFp8 && !shape.fp8_capable() {
                continue;
            }
            if args.sweep_sms.is_some()
                && !matches!(
                    op,
                    BenchOp::DispatchBf16 | BenchOp::Combine | BenchOp::CombineInPlace
                )
            {
                continue;
            }
            timer.time(&mut buf, &dev, op, args.warmup)?;
            let t = median(&timer.time(&mut buf, &dev, op, args.iters)?);
            let all = boot.all_gather(&format!("bench-{sms}-{}", op.name()), &t.to_le_bytes())?;
            let times: Vec<f64> = all
                .iter()
                .map(|b| f64::from_le_bytes(b[..8].try_into().unwrap_or([0; 8])))
                .collect();
            let gbps = op.metric_bytes(timer.num_recv, args.hidden) / (t * 1e-6) / 1e9;
            rows.push((op, sms, t, gbps, times));
        }
        if let (Some(late), 0) = (args.delay_rank, i) {
            skew_demo(&mut buf, &dev, boot, late, args.delay_us)?;
        }
        buf.destroy()?;
    }
    say(
        rank,
        format_args!(
            "[4/4] results (rank 0; {world} x GPU, {sms_total} SMs each; DeepEP metric: received bytes incl. self / time)"
        ),
    );
    say(
        rank,
        format_args!(
            "{:<22} {:>5} {:>10} {:>10} {:>24}",
            "op", "SMs", "us", "GB/s", "us per rank"
        ),
    );
    for (op, sms, t, gbps, times) in rows {
        let per: Vec<String> = times.iter().map(|v| format!("{v:.1}")).collect();
        say(
            rank,
            format_args!(
                "{:<22} {:>5} {:>10.1} {:>10.1} {:>24}",
                op.name(),
                sms,
                t,
                gbps,
                per.join(" / ")
            ),
        );
    }
    Ok(())
}

/// Delays `late`'s stream before each of a few dispatches and reports whom every rank names.
fn skew_demo<T: Transport>(
    buf: &mut Buffer<T>,
    dev: &epcomm_check::inputs::DeviceInputs,
    boot: &Bootstrap,
    late: usize,
    delay_us: u64,
) -> Res {
    let rank = boot.rank();
    let layout = buf.layout(&dev.topk_idx, dev.num_tokens)?;
    buf.synchronize()?;
    let mut named = Vec::new();
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
        named.push(stats.late_rank());
        if i == 4 {
            let all = boot.all_gather("skew-report", stats.to_string().as_bytes())?;
            say(
                rank,
                format_args!(
                    "skew demo: rank {late} delayed by {delay_us} us before each dispatch"
                ),
            );
            for (r, s) in all.iter().enumerate() {
                say(
                    rank,
                    format_args!("  rank {r} says: {}", String::from_utf8_lossy(s).trim_end()),
                );
            }
        }
    }
    let all = boot.all_gather(
        "skew-named",
        &named.iter().map(|&r| r as u8).collect::<Vec<_>>(),
    )?;
    say(
        rank,
        format_args!("  late rank named by each rank over 5 dispatches: {all:?}"),
    );
    Ok(())
}
