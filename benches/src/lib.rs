//! Multi-process criterion driver shared by the per-transport benches in `benches/`.
//!
//! Criterion runs in rank 0 (the process `cargo bench` starts); rank 0 starts one follower
//! process per other rank: one rank per GPU by default, `EPCOMM_BENCH_WORLD` ranks when set
//! (above the GPU count they share GPUs round-robin: rank `r` on GPU `r % GPUs`, and the times
//! include that sharing). For every sample criterion asks for, rank 0 broadcasts the op and the
//! iteration count over the bootstrap, and every rank runs exactly that many calls, so all
//! ranks stay in step. Each call is timed with CUDA events (L2 flushed before it, outside the
//! timed span), as DeepEP's benchmark does; throughput is DeepEP's metric.

use std::sync::Arc;
use std::time::Duration;

use criterion::{Criterion, Throughput};
use cudarc::driver::CudaContext;
use epcomm::{Buffer, BufferConfig};
use epcomm_backends::TransportSpec;
use epcomm_bootstrap::launch::{LaunchedGroup, LocalLaunch, free_port};
use epcomm_bootstrap::{Bootstrap, BootstrapConfig};
use epcomm_check::inputs::{DeviceInputs, Shape, device_inputs, host_inputs};
use epcomm_check::procs::{WORKER_ENV, gpu_count, is_worker};
use epcomm_check::timing::{BenchOp, LineUp, Timer};
use epcomm_check::verify::{RoundOptions, verified_round};

pub mod internode;

pub use internode::run_hierarchical;

/// Errors of the driver.
pub type Res<T = ()> = Result<T, Box<dyn std::error::Error>>;

/// `EPCOMM_BENCH_SCHEDULE` (epoch, global) and `EPCOMM_BENCH_ROUTES` (auto, put-signal), parsed
/// like the CLI's flags; defaults: epoch, auto. `EPCOMM_BENCH_BARRIER`, which they replaced, is
/// refused (it would otherwise be ignored silently).
fn schedule_and_routes() -> Res<(epcomm::Schedule, epcomm::RoutePolicy)> {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    if let Some(value) = var("EPCOMM_BENCH_BARRIER") {
        return Err(internode::InternodeError::BadVariable {
            var: "EPCOMM_BENCH_BARRIER",
            value,
            rule: "no longer read: set EPCOMM_BENCH_SCHEDULE (epoch, global) and \
                   EPCOMM_BENCH_ROUTES (auto, put-signal) instead"
                .into(),
        }
        .into());
    }
    let schedule = var("EPCOMM_BENCH_SCHEDULE").map_or(Ok(Default::default()), |s| s.parse())?;
    let routes = var("EPCOMM_BENCH_ROUTES").map_or(Ok(Default::default()), |s| s.parse())?;
    Ok((schedule, routes))
}

/// The DeepEP normal-mode workload, overridable with `EPCOMM_BENCH_TOKENS` / `EPCOMM_BENCH_SMS`.
///
/// # Errors
/// [`internode::InternodeError::BadVariable`] naming the variable when a value set is not a
/// positive integer (SMs: at most `u32::MAX`).
fn workload() -> Result<(usize, usize, usize, usize, u32), internode::InternodeError> {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let tokens = positive("EPCOMM_BENCH_TOKENS", var("EPCOMM_BENCH_TOKENS"), 4096)?;
    let sms = positive("EPCOMM_BENCH_SMS", var("EPCOMM_BENCH_SMS"), 24)?;
    let sms = u32::try_from(sms).map_err(|_| internode::InternodeError::BadVariable {
        var: "EPCOMM_BENCH_SMS",
        value: sms.to_string(),
        rule: "must fit in 32 bits".into(),
    })?;
    Ok((tokens, 7168, 8, 256, sms))
}

/// `value` of `var` as a positive integer, `default` when unset.
fn positive(
    var: &'static str,
    value: Option<String>,
    default: usize,
) -> Result<usize, internode::InternodeError> {
    match value {
        None => Ok(default),
        Some(v) => v.trim().parse::<usize>().ok().filter(|&n| n > 0).ok_or(
            internode::InternodeError::BadVariable {
                var,
                value: v,
                rule: "must be a positive integer".into(),
            },
        ),
    }
}

/// A step message: the op's index in its list (`u8::MAX`: stop) and the calls.
fn encode_step(op: u8, iters: u64) -> Vec<u8> {
    let mut msg = vec![op];
    msg.extend_from_slice(&iters.to_le_bytes());
    msg
}

/// The op of `ops` (`None`: stop) and the calls of a step message.
///
/// # Errors
/// A message of the wrong length or naming no op of `ops`.
fn decode_step<T: Copy>(msg: &[u8], ops: &[T]) -> Res<(Option<T>, usize)> {
    let (&op, rest) = msg.split_first().ok_or("empty step message")?;
    let iters = u64::from_le_bytes(rest.try_into()?);
    if op == u8::MAX {
        return Ok((None, 0));
    }
    let found = ops.get(usize::from(op)).copied().ok_or_else(|| {
        format!(
            "step message names op {op}, not one of the {} ops",
            ops.len()
        )
    })?;
    Ok((Some(found), usize::try_from(iters)?))
}

/// Rank 0's side of one criterion sample: tells every rank (`tag`) to run op `op` `iters`
/// times, runs them here with `time` (per-call times in us) and returns their sum. Panics on
/// failure: criterion's sampling closure cannot return an error.
fn timed_step(
    boot: &Bootstrap,
    tag: &str,
    op: usize,
    iters: u64,
    time: impl FnOnce(usize) -> Res<Vec<f64>>,
) -> Duration {
    let run = || -> Res<Vec<f64>> {
        let index = u8::try_from(op)?;
        boot.broadcast(tag, 0, Some(&encode_step(index, iters)))?;
        time(usize::try_from(iters)?)
    };
    match run() {
        Ok(t) => Duration::from_secs_f64(t.iter().sum::<f64>() * 1e-6),
        Err(e) => panic!("benchmark step failed: {e}"),
    }
}

/// Rank 0 (the process `cargo bench` started) starts ranks `1..world` as follower processes
/// of this executable and connects; a follower connects from its environment. Returns the
/// followers (rank 0 waits for them at the end) and the bootstrap.
fn start_ranks(world: usize) -> Res<(Option<LaunchedGroup>, Arc<Bootstrap>)> {
    if is_worker() {
        return Ok((None, connect(world, 0, 0)?));
    }
    let port = free_port()?;
    let followers = if world > 1 {
        Some(
            LocalLaunch::new(std::env::current_exe()?, Vec::<String>::new())
                .world_size(world)
                .ranks(1..world)
                .master_port(port)
                .env(WORKER_ENV, "1")
                .spawn()?,
        )
    } else {
        None
    };
    Ok((followers, connect(world, 0, port)?))
}

fn connect(world: usize, rank: usize, port: u16) -> Res<Arc<Bootstrap>> {
    let cfg = if is_worker() {
        BootstrapConfig::from_env()?
    } else {
        BootstrapConfig {
            master_addr: "127.0.0.1".into(),
            master_port: port,
            rank,
            world_size: world,
            local_rank: rank,
            local_world_size: world,
            timeout: Duration::from_secs(300),
        }
    };
    Ok(Arc::new(Bootstrap::connect(cfg)?))
}

/// Runs the benchmark on the transport `spec` builds (named by the spec in benchmark ids).
pub fn run(spec: TransportSpec) -> Res {
    let transport = spec.to_string();
    let gpus = match gpu_count() {
        Ok(n) => n,
        Err(why) => {
            eprintln!("SKIP {transport} bench: {why}");
            return Ok(());
        }
    };
    let world =
        internode::world_from(std::env::var(internode::WORLD_ENV).ok().as_deref(), gpus, 1)?;
    let (followers, boot) = start_ranks(world)?;
    let rank = boot.rank();
    let ctx = CudaContext::new(boot.local_rank() % gpus)?;
    let (tokens, hidden, top_k, experts, sms) = workload()?;
    let mut cfg = BufferConfig::new(tokens, hidden, top_k, experts);
    cfg.num_sms = sms;
    (cfg.schedule, cfg.routes) = schedule_and_routes()?;
    // `EPCOMM_BENCH_COMBINE_STAGING` (auto, push, copy-engine); default auto.
    if let Some(v) = std::env::var("EPCOMM_BENCH_COMBINE_STAGING")
        .ok()
        .filter(|v| !v.is_empty())
    {
        cfg.combine_staging = v.parse()?;
    }
    let (schedule, routes) = (cfg.schedule, cfg.routes);
    let mut buf = Buffer::new(ctx.clone(), spec.build(ctx, boot.clone())?, cfg)?;
    let inputs = host_inputs(&Shape::uniform(world, tokens, hidden, top_k, experts, 2025))?;
    let dev = device_inputs(buf.stream(), &inputs, rank)?;
    verified_round(&mut buf, &inputs, &dev, RoundOptions::default())?;
    let timer = Timer::new(&mut buf, &dev)?;
    if world > gpus && rank == 0 {
        let how = if epcomm_check::procs::under_mps() {
            "under MPS (concurrent; traffic between ranks of one GPU stays in its memory)"
        } else {
            "without MPS (the ranks of a GPU take turns on it)"
        };
        eprintln!("note: {world} ranks share {gpus} GPU(s) {how}");
    }
    let ops: Vec<Timed> = BenchOp::ALL
        .into_iter()
        .map(|op| Timed {
            name: op.name(),
            op,
            bytes: op.metric_bytes(timer.num_recv, hidden) as u64,
        })
        .collect();
    let group = format!("{transport}/ep{world}/{sms}sms/{schedule}/{routes}");
    drive(buf, timer, &dev, &boot, followers, &group, &ops)
}

/// One op a criterion group times: its benchmark name, what the timer runs, the bytes its
/// throughput counts.
pub(crate) struct Timed {
    pub(crate) name: &'static str,
    pub(crate) op: BenchOp,
    pub(crate) bytes: u64,
}

/// Times `ops` on `buf` (flat or two-tier) in lockstep: rank 0 runs criterion's group `group`
/// and tells every rank each sample's op and calls; a follower runs what it is told until the
/// stop message. Then the buffer is torn down and rank 0 waits for its followers.
pub(crate) fn drive<E: LineUp>(
    mut buf: E,
    mut timer: Timer,
    dev: &DeviceInputs,
    boot: &Bootstrap,
    followers: Option<LaunchedGroup>,
    group: &str,
    ops: &[Timed],
) -> Res {
    let tag = "bench-step";
    if boot.rank() != 0 {
        loop {
            let msg = boot.broadcast(tag, 0, None)?;
            let (i, iters) = decode_step(&msg, &(0..ops.len()).collect::<Vec<_>>())?;
            let Some(i) = i else { break };
            timer.time(&mut buf, dev, ops[i].op, iters)?;
        }
        drop(timer);
        buf.destroy()?;
        return Ok(());
    }
    let mut c = Criterion::default()
        .configure_from_args()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    let mut g = c.benchmark_group(group);
    for (i, op) in ops.iter().enumerate() {
        g.throughput(Throughput::Bytes(op.bytes));
        g.bench_function(op.name, |b| {
            b.iter_custom(|iters| {
                timed_step(boot, tag, i, iters, |n| {
                    Ok(timer.time(&mut buf, dev, op.op, n)?)
                })
            })
        });
    }
    g.finish();
    boot.broadcast(tag, 0, Some(&encode_step(u8::MAX, 0)))?;
    drop(timer);
    buf.destroy()?;
    if let Some(mut f) = followers {
        f.wait(Duration::from_secs(60))?;
    }
    c.final_summary();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workload_variables_are_positive_integers() {
        assert_eq!(positive("V", None, 7), Ok(7));
        assert_eq!(positive("V", Some("12".into()), 7), Ok(12));
        for bad in ["0", "-3", "many", "1.5"] {
            let e = positive("EPCOMM_BENCH_SMS", Some(bad.into()), 24).unwrap_err();
            assert!(e.to_string().contains("EPCOMM_BENCH_SMS"), "{e}");
        }
    }
}
