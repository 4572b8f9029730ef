//! Helpers shared by the GPU test executables (`gpu.rs`, `edges.rs`).
//!
//! Each multi-process test re-executes its own binary as the workers (`--exact <test>` with
//! `EPCOMM_WORKER=1`), one process per rank. Ranks map to GPUs round-robin, so
//! `EPCOMM_TEST_WORLD=2` on a one-GPU machine runs two ranks on that GPU (correctness only;
//! speed and skew need one GPU per rank).
//!
//! Nothing here passes silently:
//! * with `EPCOMM_GPU_TESTS=1` (set by `run-gpu-tests.sh`), a missing driver, fewer ranks than
//!   a test needs, or an NVSHMEM library that fails to load is a test **failure**;
//! * without it (CI, a laptop) the GPU tests skip, and one `SKIP` line per executable goes to
//!   the terminal directly (cargo hides the output of passing tests);
//! * every GPU test that really ran appends `<test> <configuration>` to the file named by
//!   `EPCOMM_GPU_TESTS_RAN_FILE`, and the runner fails when that file stays empty.
#![allow(dead_code)]

use std::io::Write;
use std::sync::{Arc, Once};
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use epcomm::{BufferConfig, CombineStaging, DynTransport, RoutePolicy, Schedule};
use epcomm_backends::TransportSpec;
use epcomm_bootstrap::{Bootstrap, BootstrapConfig};
use epcomm_check::inputs::{DeviceInputs, Shape, device_inputs, host_inputs, upload};
use epcomm_check::procs::{gpu_count, run_workers};
use epcomm_reference::bf16;

/// True when GPU tests must run (a skip is then a failure).
pub fn gpu_tests_required() -> bool {
    std::env::var("EPCOMM_GPU_TESTS").is_ok_and(|v| v == "1")
}

/// Skips `test` (one visible line per executable), or fails it when GPU tests are required.
pub fn skip(test: &str, why: &str) {
    if gpu_tests_required() {
        panic!("{test}: EPCOMM_GPU_TESTS=1 but {why}");
    }
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // Straight to the terminal: the test harness captures eprintln! of passing tests.
        let _ = writeln!(
            std::io::stderr(),
            "SKIP GPU tests of this executable: {why} (EPCOMM_GPU_TESTS=1 makes this a failure)"
        );
    });
}

/// Records that `test` really ran in `config` (for the runner's "no GPU test ran" check).
pub fn record_ran(test: &str, config: &str) {
    let Some(path) = std::env::var_os("EPCOMM_GPU_TESTS_RAN_FILE") else {
        return;
    };
    let line = format!("{test} {config}\n");
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(line.as_bytes()));
    if let Err(e) = written {
        panic!("{test}: cannot record the run in {path:?}: {e}");
    }
}

/// GPUs for a single-process test, or None (skipped).
pub fn gpus(test: &str) -> Option<usize> {
    match gpu_count() {
        Ok(n) => Some(n),
        Err(why) => {
            skip(test, &why);
            None
        }
    }
}

/// Number of ranks for a multi-process test (`EPCOMM_TEST_WORLD`, default one per GPU), or
/// None when it cannot run here (skipped, or a failure under `EPCOMM_GPU_TESTS=1`).
pub fn world(test: &str, min: usize) -> Option<usize> {
    let n = gpus(test)?;
    let w = std::env::var("EPCOMM_TEST_WORLD")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(n);
    if w < min {
        skip(
            test,
            &format!(
                "it needs {min} ranks and this machine has {n} GPU(s); set \
                 EPCOMM_TEST_WORLD={min} to run {min} ranks on fewer GPUs"
            ),
        );
        return None;
    }
    Some(w)
}

/// True when the ranks run at the same time: every rank has a GPU of its own, or ranks that
/// share a GPU run under MPS (without it they take turns, and the skew tests cannot hold
/// one rank back by a controlled amount).
pub fn ranks_run_concurrently(world: usize) -> bool {
    gpu_count().is_ok_and(|n| n >= world) || epcomm_check::procs::under_mps()
}

pub fn launch(test: &str, world: usize, env: &[(&str, String)]) {
    let args = [test, "--exact", "--nocapture", "--test-threads=1"];
    if let Err(e) = run_workers(world, &args, env, Duration::from_secs(900)) {
        panic!("{test}: {e}");
    }
    let config: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    record_ran(test, &format!("world={world} {}", config.join(" ")));
}

pub struct Worker {
    pub boot: Arc<Bootstrap>,
    pub ctx: Arc<CudaContext>,
}

/// A worker's bootstrap and the CUDA context of its GPU (rank `local_rank % GPUs`).
pub fn worker() -> Worker {
    let cfg = BootstrapConfig::from_env().expect("worker env");
    let boot = Arc::new(Bootstrap::connect(cfg).expect("bootstrap"));
    let gpus = gpu_count().expect("a GPU for the worker");
    let ctx = CudaContext::new(boot.local_rank() % gpus).unwrap_or_else(|e| {
        // Ranks sharing a GPU (round-robin), for the hint when MPS ran out of queues.
        let sharing = boot.local_world_size().div_ceil(gpus.max(1));
        match epcomm_backends::context_error_hint(&e, sharing) {
            Some(hint) => panic!("CUDA context: {e}: {hint}"),
            None => panic!("CUDA context: {e}"),
        }
    });
    Worker { boot, ctx }
}

/// Makes (or shares) the transport a test's buffers are built on.
pub type MakeTransport<'a> = &'a dyn Fn() -> Arc<dyn DynTransport>;

/// One configuration a multi-process test runs under: a transport spec, a schedule, a route
/// policy and a combine staging, passed to the workers as
/// `EPCOMM_TEST_{TRANSPORT,SCHEDULE,ROUTES,COMBINE_STAGING}`.
#[derive(Clone, Copy, Debug)]
pub struct TestConfig {
    pub spec: TransportSpec,
    pub schedule: Schedule,
    pub routes: RoutePolicy,
    pub combine_staging: CombineStaging,
    /// Rail forwarding of the normal dispatch (`EPCOMM_TEST_RAIL_RING=<slots>,<chunk>`, for a
    /// transport of several (virtual) nodes): every buffer the test makes forwards.
    pub rail_ring: Option<epcomm_topology::RingShape>,
    /// Forwarding blocks per other node with `rail_ring` (`EPCOMM_TEST_RAIL_FORWARD_SMS`; 0 or
    /// unset: the library's choice).
    pub rail_forward_sms: u32,
}

/// `EPCOMM_TEST_RAIL_FORWARD_SMS`: a number, or unset (0).
fn rail_forward_sms_from_env() -> u32 {
    std::env::var("EPCOMM_TEST_RAIL_FORWARD_SMS")
        .ok()
        .filter(|v| !v.is_empty())
        .map_or(0, |v| {
            v.trim()
                .parse()
                .expect("EPCOMM_TEST_RAIL_FORWARD_SMS: a number")
        })
}

/// `EPCOMM_TEST_RAIL_RING`: `<slots>,<chunk>`, or unset.
fn rail_ring_from_env() -> Option<epcomm_topology::RingShape> {
    let v = std::env::var("EPCOMM_TEST_RAIL_RING")
        .ok()
        .filter(|v| !v.is_empty())?;
    let (slots, chunk) = v
        .split_once(',')
        .expect("EPCOMM_TEST_RAIL_RING: <slots>,<chunk>");
    let n = |s: &str| {
        s.trim()
            .parse::<usize>()
            .expect("EPCOMM_TEST_RAIL_RING: a number")
    };
    Some(epcomm_topology::RingShape::new(n(slots), n(chunk)).expect("EPCOMM_TEST_RAIL_RING"))
}

impl TestConfig {
    /// The configuration the launcher gave this worker.
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        Self {
            spec: var("EPCOMM_TEST_TRANSPORT")
                .unwrap_or_else(|| "ipc".into())
                .parse()
                .expect("EPCOMM_TEST_TRANSPORT"),
            schedule: var("EPCOMM_TEST_SCHEDULE").map_or(Schedule::Epoch, |s| {
                s.parse().expect("EPCOMM_TEST_SCHEDULE")
            }),
            routes: var("EPCOMM_TEST_ROUTES").map_or(RoutePolicy::Auto, |s| {
                s.parse().expect("EPCOMM_TEST_ROUTES")
            }),
            combine_staging: var("EPCOMM_TEST_COMBINE_STAGING").map_or(CombineStaging::Auto, |s| {
                s.parse().expect("EPCOMM_TEST_COMBINE_STAGING")
            }),
            rail_ring: rail_ring_from_env(),
            rail_forward_sms: rail_forward_sms_from_env(),
        }
    }

    /// Sets the schedule, routes and combine staging of this configuration on `cfg`, and caps
    /// `num_sms` where ranks share a GPU under MPS ([`shared_gpu_num_sms_limit`]).
    pub fn apply(&self, cfg: &mut BufferConfig) {
        (cfg.schedule, cfg.routes) = (self.schedule, self.routes);
        cfg.combine_staging = self.combine_staging;
        cfg.rail_ring = self.rail_ring;
        cfg.rail_forward_sms = self.rail_forward_sms;
        cfg.num_sms = cfg.num_sms.min(shared_gpu_num_sms_limit());
    }

    /// The workers' environment for this configuration (NVSHMEM's one-host defaults included).
    pub fn env(&self) -> Vec<(&'static str, String)> {
        let mut env = vec![
            ("EPCOMM_TEST_TRANSPORT", self.spec.to_string()),
            ("EPCOMM_TEST_SCHEDULE", self.schedule.to_string()),
            ("EPCOMM_TEST_ROUTES", self.routes.to_string()),
            (
                "EPCOMM_TEST_COMBINE_STAGING",
                self.combine_staging.name().to_string(),
            ),
        ];
        if let Some(r) = self.rail_ring {
            env.push((
                "EPCOMM_TEST_RAIL_RING",
                format!("{},{}", r.slots(), r.chunk_rows()),
            ));
        }
        if self.rail_forward_sms > 0 {
            env.push((
                "EPCOMM_TEST_RAIL_FORWARD_SMS",
                self.rail_forward_sms.to_string(),
            ));
        }
        // The library's one-host defaults come from `run_workers`.
        env
    }
}

impl std::fmt::Display for TestConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {} routes={} combine_staging={}{}",
            self.spec,
            self.schedule,
            self.routes,
            self.combine_staging.name(),
            self.rail_ring.map_or(String::new(), |r| format!(
                " rail_ring={}x{} rail_forward_sms={}",
                r.slots(),
                r.chunk_rows(),
                self.rail_forward_sms
            ))
        )
    }
}

/// The configurations a multi-process test runs under: CUDA IPC under both schedules;
/// NVSHMEM (when its host library loads) as one node and with every GPU its own virtual node
/// (all traffic between ranks by put/signal), under both schedules and with put/signal to every
/// peer. `EPCOMM_TEST_TRANSPORTS=proxy-ce` runs the CPU proxy with its copy engines instead
/// (opt-in, see docs/proxy.md), `EPCOMM_TEST_TRANSPORTS=proxy-verbs` the CPU proxy with RDMA
/// verbs (opt-in; needs an RDMA device, see docs/proxy-verbs.md). `EPCOMM_TEST_TRANSPORTS` (comma-separated specs), `EPCOMM_TEST_SCHEDULE` and
/// `EPCOMM_TEST_ROUTES` narrow it; under `EPCOMM_GPU_TESTS=1` an NVSHMEM library that fails to
/// load fails the test unless the list leaves NVSHMEM out.
pub fn configs(test: &str) -> Vec<TestConfig> {
    let only = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let keep = |k: &str, v: String| only(k).is_none_or(|o| o.split(',').any(|o| o.trim() == v));
    // The variable the schedule and route variables replaced would otherwise be ignored silently.
    if let Some(v) = only("EPCOMM_TEST_BARRIER") {
        panic!(
            "{test}: EPCOMM_TEST_BARRIER={v:?} is no longer read: narrow the runs with \
             EPCOMM_TEST_SCHEDULE (epoch, global) and EPCOMM_TEST_ROUTES (auto, put-signal)"
        );
    }
    // The default list, or exactly the specs EPCOMM_TEST_TRANSPORTS names (any valid spec).
    let specs: Vec<TransportSpec> = match only("EPCOMM_TEST_TRANSPORTS") {
        Some(list) => list
            .split(',')
            .map(|s| {
                s.trim()
                    .parse()
                    .expect("EPCOMM_TEST_TRANSPORTS: a valid spec")
            })
            .collect(),
        // The CPU proxy (`proxy-ce`) is opt-in until its soak and failure tests have run and
        // its rounds are fast enough for the default run (docs/proxy.md, "Status").
        None => ["ipc", "nvshmem", "nvshmem:vnodes=max"]
            .iter()
            .map(|s| s.parse().expect("a valid spec"))
            .collect(),
    };
    let mut usable = Vec::new();
    for spec in specs {
        // The backend's own check: NVSHMEM's library loads, an RDMA device is there.
        if let Err(e) = spec.probe_here() {
            if gpu_tests_required() {
                panic!("{test}: EPCOMM_GPU_TESTS=1 but {spec} cannot run here: {e}");
            }
            skip(test, &format!("{spec} is not usable here: {e}"));
            continue;
        }
        usable.push(spec);
    }
    if let Some(v) = only("EPCOMM_TEST_COMBINE_STAGING") {
        v.parse::<CombineStaging>()
            .unwrap_or_else(|e| panic!("{test}: EPCOMM_TEST_COMBINE_STAGING: {e}"));
    }
    let any_usable = !usable.is_empty();
    let mut out = Vec::new();
    for spec in usable {
        let caps = spec.capabilities();
        for schedule in Schedule::ALL {
            for routes in RoutePolicy::ALL {
                // Put/signal everywhere is one extra configuration (under Epoch), not a matrix.
                let put_signal_everywhere = routes == RoutePolicy::PutSignal;
                // (The proxy's default layout already reaches every peer through the proxy.)
                if put_signal_everywhere
                    && (schedule != Schedule::Epoch
                        || !caps.routes.contains(&epcomm::Route::PutSignal)
                        || caps.kernel_family == epcomm_kernels::KernelFamily::CpuProxy)
                {
                    continue;
                }
                let cfg = TestConfig {
                    spec,
                    schedule,
                    routes,
                    combine_staging: CombineStaging::Auto,
                    rail_ring: rail_ring_from_env(),
                    rail_forward_sms: rail_forward_sms_from_env(),
                };
                if !keep("EPCOMM_TEST_SCHEDULE", schedule.to_string())
                    || !keep("EPCOMM_TEST_ROUTES", routes.to_string())
                {
                    continue;
                }
                // Automatic staging stages or pushes by the SM count and the routes, so both ways run once more on their own, under Epoch: the copy-engine
                // staging on every transport, the push where automatic staging could stage
                // (every peer mapped: not the CPU proxy, not virtual nodes).
                let split = spec.backend() == "nvshmem"
                    && spec.virtual_nodes() != Some(epcomm_backends::VirtualNodes::Count(1));
                let mapped = caps.kernel_family != epcomm_kernels::KernelFamily::CpuProxy && !split;
                let extras = if schedule == Schedule::Epoch && !put_signal_everywhere {
                    let mut e = vec![CombineStaging::CopyEngine];
                    if mapped {
                        e.push(CombineStaging::Push);
                    }
                    e
                } else {
                    Vec::new()
                };
                let extra = extras.into_iter().map(|w| TestConfig {
                    combine_staging: w,
                    ..cfg
                });
                for c in std::iter::once(cfg).chain(extra) {
                    if keep(
                        "EPCOMM_TEST_COMBINE_STAGING",
                        c.combine_staging.name().to_string(),
                    ) {
                        out.push(c);
                    }
                }
            }
        }
    }
    // Filters that leave nothing would let the test pass without running.
    assert!(
        !out.is_empty() || !any_usable,
        "{test}: EPCOMM_TEST_SCHEDULE, EPCOMM_TEST_ROUTES and EPCOMM_TEST_COMBINE_STAGING leave no \
         configuration to run"
    );
    out
}

/// Runs `$run(&worker, &make_transport, args...)` on the transport the launcher chose: one
/// transport per worker, shared by every buffer the test builds.
macro_rules! on_transport {
    ($run:ident $(, $arg:expr)*) => {{
        let w = common::worker();
        let spec = common::TestConfig::from_env().spec;
        let t = spec.build(w.ctx.clone(), w.boot.clone()).expect("transport");
        $run(&w, &|| t.clone() $(, $arg)*)
    }};
}
pub(crate) use on_transport;

/// Launches `test` once per configuration of [`configs`].
pub fn launch_all(test: &str, n: usize) {
    for cfg in configs(test) {
        eprintln!("== {test}: {cfg}");
        launch(test, n, &cfg.env());
    }
}

pub fn log(rank: usize, msg: impl std::fmt::Display) {
    if rank == 0 {
        eprintln!("[rank 0] {msg}");
    }
}

/// A small buffer (64 tokens, hidden 128, top-2 of 4 experts per rank) under the strategy the
/// launcher chose, with `timeout`.
pub fn small_cfg_with(world: usize, timeout: Duration) -> BufferConfig {
    let mut cfg = BufferConfig::new(64, 128, 2, 4 * world);
    cfg.timeout = timeout;
    apply_test_config(&mut cfg);
    cfg
}

/// Sets the schedule and routes the launcher chose for this worker.
pub fn apply_test_config(cfg: &mut BufferConfig) {
    TestConfig::from_env().apply(cfg);
}

/// The most `num_sms` a worker's buffers may use: under MPS the ranks sharing a GPU run their
/// kernels side by side, and `Buffer::new` refuses grids that cannot all be resident together
/// (SMs / ranks per GPU); unlimited when every rank has its own GPU or without MPS (the ranks
/// take turns). The same on every rank (it counts the ranks of the busiest GPU), so the
/// ranks' configs still agree.
pub fn shared_gpu_num_sms_limit() -> u32 {
    use cudarc::driver::{result, sys};
    let world = std::env::var("WORLD_SIZE")
        .ok()
        .and_then(|v| v.parse::<usize>().ok());
    let (Some(world), Ok(gpus)) = (world, gpu_count()) else {
        return u32::MAX;
    };
    if world <= gpus || !epcomm_check::procs::under_mps() {
        return u32::MAX;
    }
    let per_gpu = world.div_ceil(gpus.max(1));
    let sms = result::device::get(0).and_then(|dev| {
        // SAFETY: `dev` is a device handle the initialised driver just returned.
        unsafe {
            result::device::get_attribute(
                dev,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
        }
    });
    match sms {
        Ok(sms) => (sms as usize / per_gpu).max(1) as u32,
        Err(_) => u32::MAX,
    }
}

/// A small buffer with a short timeout, for failure tests.
pub fn small_cfg(world: usize) -> BufferConfig {
    small_cfg_with(world, Duration::from_secs(2))
}

/// Declares `#[test] fn $name` that runs `$run(&worker, &make_transport)` in every worker and,
/// in the parent, launches it on every transport and strategy (needs 2 ranks).
#[allow(unused_macros)]
macro_rules! gpu_test {
    ($name:ident, $run:ident) => {
        #[test]
        fn $name() {
            if epcomm_check::procs::is_worker() {
                return common::on_transport!($run);
            }
            let Some(n) = common::world(stringify!($name), 2) else {
                return;
            };
            common::launch_all(stringify!($name), n);
        }
    };
}
#[allow(unused_imports)]
pub(crate) use gpu_test;

/// One routing with its reference: this rank's device inputs, its expert output `y` (its
/// received rows, unscaled, padded with zeros to `cap_rows`), the rows it receives and the
/// combine output it must get back (no weights).
pub struct Case {
    pub d: DeviceInputs,
    pub y: CudaSlice<bf16>,
    pub rows: Vec<bf16>,
    pub combined: Vec<bf16>,
}

/// Builds the [`Case`] of `shape` for `rank`.
pub fn reference_case(
    stream: &Arc<CudaStream>,
    shape: &Shape,
    rank: usize,
    cap_rows: usize,
) -> Case {
    let h = host_inputs(shape).unwrap();
    let r = epcomm_reference::dispatch(&h.bf16, shape.experts).unwrap();
    let ys: Vec<Vec<bf16>> = r
        .iter()
        .map(|o| o.recv_x.to_bf16(shape.hidden).unwrap())
        .collect();
    let want = epcomm_reference::combine(&ys, None, &r, &shape.tokens).unwrap();
    let mut y = ys[rank].clone();
    y.resize(cap_rows * shape.hidden, bf16::ZERO);
    Case {
        d: device_inputs(stream, &h, rank).unwrap(),
        y: upload(stream, &y).unwrap(),
        rows: ys[rank].clone(),
        combined: want[rank].x.clone(),
    }
}

/// `n` routings of `tokens` tokens on every rank (seeds `seed..seed + n`; even ones mask 10 % of
/// the ids, `skewed` sends everything to rank 0) with their references.
pub fn reference_cases(
    stream: &Arc<CudaStream>,
    dims: (usize, usize, usize, usize),
    rank: usize,
    world: usize,
    n: u64,
    seed: u64,
    skewed: u64,
) -> Vec<Case> {
    let (hidden, top_k, experts, tokens) = dims;
    (0..n)
        .map(|v| {
            let shape = Shape {
                tokens: vec![tokens; world],
                hidden,
                top_k,
                experts,
                mask_prob: if v % 2 == 0 { 0.1 } else { 0.0 },
                skew_to: (v == skewed).then_some(0),
                seed: seed + v,
            };
            reference_case(stream, &shape, rank, world * tokens)
        })
        .collect()
}

/// A buffer for a captured-graph test: `dims` = (hidden, top_k, experts, max tokens), the
/// launcher's schedule and routes, `timeout`. Turns off cudarc's cross-stream event tracking
/// (one stream does everything; its events would otherwise land in the capture).
pub fn graph_buffer(
    w: &Worker,
    mk: MakeTransport<'_>,
    dims: (usize, usize, usize, usize),
    timeout: Duration,
) -> epcomm::Buffer {
    // SAFETY: the test uses one stream for everything, so no cross-stream ordering is lost.
    unsafe { w.ctx.disable_event_tracking() };
    let (hidden, top_k, experts, tokens) = dims;
    let mut cfg = BufferConfig::new(tokens, hidden, top_k, experts);
    apply_test_config(&mut cfg);
    cfg.timeout = timeout;
    epcomm::Buffer::new(w.ctx.clone(), mk(), cfg).unwrap()
}

/// A small buffer (`small_cfg_with(world, timeout)`) and a uniform routing of `tokens` tokens
/// (hidden 128, top-2 of 4 experts per rank, `seed`), uploaded: host and device inputs.
pub fn small_setup(
    w: &Worker,
    mk: MakeTransport<'_>,
    timeout: Duration,
    tokens: usize,
    seed: u64,
) -> (
    epcomm::Buffer,
    epcomm_check::inputs::HostInputs,
    DeviceInputs,
) {
    let world = w.boot.world_size();
    let buf = epcomm::Buffer::new(w.ctx.clone(), mk(), small_cfg_with(world, timeout)).unwrap();
    let shape = Shape::uniform(world, tokens, 128, 2, 4 * world, seed);
    let h = host_inputs(&shape).unwrap();
    let d = device_inputs(buf.stream(), &h, w.boot.rank()).unwrap();
    (buf, h, d)
}

/// Asserts that `result` is `Error::InvalidArgument` naming `argument`.
#[track_caller]
pub fn assert_invalid<T: std::fmt::Debug>(result: epcomm::Result<T>, argument: &str) {
    match result {
        Err(epcomm::Error::InvalidArgument { argument: a, .. }) if a == argument => {}
        other => panic!("expected an invalid {argument}, got {other:?}"),
    }
}

/// The device buffers a captured graph reads and writes: this rank's tokens `x`, ids `idx`, its
/// expert output `y` (capacity rows) and the combine output `out`. Replays load a [`Case`]
/// into them.
pub struct GraphIo {
    pub x: CudaSlice<bf16>,
    pub idx: CudaSlice<i64>,
    pub y: CudaSlice<bf16>,
    pub out: CudaSlice<bf16>,
}

impl GraphIo {
    /// Zeroed buffers for `dims` = (hidden, top_k, experts, tokens) and `cap_rows` received rows.
    pub fn new(
        stream: &Arc<CudaStream>,
        dims: (usize, usize, usize, usize),
        cap_rows: usize,
    ) -> Self {
        let (hidden, top_k, _, tokens) = dims;
        Self {
            x: stream.alloc_zeros(tokens * hidden).unwrap(),
            idx: stream.alloc_zeros(tokens * top_k).unwrap(),
            y: stream.alloc_zeros(cap_rows * hidden).unwrap(),
            out: stream.alloc_zeros(tokens * hidden).unwrap(),
        }
    }

    /// Copies `case`'s tokens, ids and expert output in (stream-ordered).
    pub fn load(&mut self, stream: &Arc<CudaStream>, case: &Case) {
        stream.memcpy_dtod(&case.d.x, &mut self.x).unwrap();
        stream.memcpy_dtod(&case.d.topk_idx, &mut self.idx).unwrap();
        stream.memcpy_dtod(&case.y, &mut self.y).unwrap();
    }
}

/// Waits for `buf`'s ops, checks that a verified round still passes on it, and destroys it.
pub fn verify_and_destroy(
    mut buf: epcomm::Buffer,
    h: &epcomm_check::inputs::HostInputs,
    d: &DeviceInputs,
) {
    use epcomm_check::verify::{RoundOptions, verified_round};
    buf.synchronize().unwrap();
    verified_round(&mut buf, h, d, RoundOptions::default()).unwrap();
    buf.destroy().unwrap();
}

/// One case of the dispatch/combine suite: tokens per rank, the `-1` probability, the skew
/// target, and what the round exercises.
pub type SuiteCase = (
    Vec<usize>,
    f64,
    Option<usize>,
    epcomm_check::verify::RoundOptions,
);

/// Which buffer a suite's groups are for.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum SuiteTiering {
    /// One [`epcomm::Buffer`]: every round also runs the in-place combine.
    Flat,
    /// A [`epcomm::HierarchicalBuffer`]: no in-place combine (a flat buffer's), and at most
    /// [`TWO_TIER_MAX_TOKENS`] tokens per rank (its node tier is sized for the worst case, and
    /// the tests run several ranks on one GPU).
    TwoTier,
}

/// The largest batch per rank of the two-tier suite (every group's tokens are capped to it).
pub const TWO_TIER_MAX_TOKENS: usize = 1024;

/// The dispatch/combine suite, one list for both tierings: hidden 7168/128/2056/512/256,
/// top-k 1..9, 0/1/odd token counts, `-1` entries, skew to the first and the last rank (for
/// rank 0 another node under two tiers), BF16 and FP8, with and without weights, and every
/// receive mode. `world` ranks; for [`SuiteTiering::TwoTier`] each group's batch is capped at
/// [`TWO_TIER_MAX_TOKENS`] (token counts and bounds with it) and rounds skip the in-place
/// combine.
pub fn suite_groups(world: usize, tiering: SuiteTiering) -> Vec<SuiteGroup> {
    use epcomm::RecvMode;
    use epcomm_check::verify::RoundOptions;
    let per = |f: &dyn Fn(usize) -> usize| (0..world).map(f).collect::<Vec<_>>();
    let hs = RoundOptions {
        in_place: tiering == SuiteTiering::Flat,
        ..RoundOptions::default()
    };
    let fp8 = RoundOptions { fp8: true, ..hs };
    let wc = RoundOptions {
        mode: RecvMode::WorstCase,
        check_layout: false,
        ..hs
    };
    let groups = vec![
        SuiteGroup {
            hidden: 7168,
            top_k: 8,
            experts_per_rank: 256 / world.min(256),
            max_tokens: 4096,
            cases: vec![
                (per(&|_| 4096), 0.0, None, hs),
                (per(&|_| 4096), 0.0, None, fp8),
                (per(&|r| if r == 0 { 1 } else { 0 }), 0.0, None, hs),
                (per(&|r| 777 + 100 * r), 0.1, None, wc),
                (per(&|_| 0), 0.0, None, hs),
            ],
        },
        SuiteGroup {
            hidden: 128,
            top_k: 1,
            experts_per_rank: 1,
            max_tokens: 64,
            cases: vec![
                (per(&|_| 0), 0.0, None, hs),
                (per(&|_| 1), 0.0, None, fp8),
                (per(&|r| 3 + 14 * r), 0.3, None, hs),
                (
                    per(&|_| 64),
                    0.0,
                    None,
                    RoundOptions {
                        weights: false,
                        ..fp8
                    },
                ),
            ],
        },
        // Small rows going to several ranks of a node (with rail forwarding, one entry stored
        // for more than one rank), in runs of calls on one buffer.
        SuiteGroup {
            hidden: 128,
            top_k: 2,
            experts_per_rank: 4,
            max_tokens: 64,
            cases: vec![
                (per(&|_| 40), 0.0, None, hs),
                (per(&|r| 64 - r), 0.0, None, hs),
                (per(&|r| 17 + r), 0.1, None, wc),
            ],
        },
        SuiteGroup {
            hidden: 2056,
            top_k: 9,
            experts_per_rank: 144,
            max_tokens: 512,
            cases: vec![
                (per(&|r| 333 + r), 0.2, None, hs),
                (per(&|r| 511 - r), 0.0, None, wc),
            ],
        },
        SuiteGroup {
            hidden: 512,
            top_k: 4,
            experts_per_rank: 8,
            max_tokens: 1024,
            cases: vec![
                (per(&|r| 1000 + 7 * r), 0.0, Some(0), hs),
                (
                    per(&|r| 1000 - 3 * r),
                    0.0,
                    Some(world - 1),
                    RoundOptions {
                        mode: RecvMode::Bounded(1024 * world),
                        ..fp8
                    },
                ),
            ],
        },
        SuiteGroup {
            hidden: 256,
            top_k: 3,
            experts_per_rank: 3,
            max_tokens: 16384,
            cases: vec![
                (per(&|_| 16384), 0.05, None, hs),
                (per(&|_| 16384), 0.0, None, RoundOptions { fp8: true, ..wc }),
            ],
        },
        // The Python package's two-tier test shape (python/tests/gpu_cases.py `two_tier`):
        // small batches, one token on one rank without weights (its cached dispatch returned a
        // wrong row over the CPU proxy's two tiers there), skew without weights.
        SuiteGroup {
            hidden: 256,
            top_k: 4,
            experts_per_rank: 4,
            max_tokens: 96,
            cases: vec![
                (per(&|_| 96), 0.0, None, hs),
                (per(&|r| 17 + 5 * r), 0.2, None, hs),
                (
                    per(&|r| if r == 0 { 1 } else { 0 }),
                    0.0,
                    None,
                    RoundOptions {
                        weights: false,
                        ..hs
                    },
                ),
                (
                    per(&|r| 90 - r),
                    0.05,
                    Some(world - 1),
                    RoundOptions {
                        weights: false,
                        ..fp8
                    },
                ),
            ],
        },
    ];
    match tiering {
        SuiteTiering::Flat => groups,
        SuiteTiering::TwoTier => groups.into_iter().map(cap_tokens).collect(),
    }
}

/// `g` with at most [`TWO_TIER_MAX_TOKENS`] tokens per rank: the batch, every case's counts
/// and every bound on the received rows (the rows a rank can receive shrink with the batch).
fn cap_tokens(mut g: SuiteGroup) -> SuiteGroup {
    use epcomm::RecvMode;
    let cap = g.max_tokens.min(TWO_TIER_MAX_TOKENS);
    let scale = |n: usize| n * cap / g.max_tokens;
    for (tokens, _, _, opts) in &mut g.cases {
        for t in tokens.iter_mut() {
            *t = (*t).min(cap);
        }
        if let RecvMode::Bounded(n) = opts.mode {
            opts.mode = RecvMode::Bounded(scale(n));
        }
    }
    g.max_tokens = cap;
    g
}

/// `groups` numbered, narrowed by the environment: `EPCOMM_TEST_SMALL=1` keeps the small ones
/// (for compute-sanitizer runs), `EPCOMM_TEST_GROUPS=i,j` those numbers (to rerun one).
pub fn selected(groups: Vec<SuiteGroup>) -> Vec<(usize, SuiteGroup)> {
    let small = std::env::var_os("EPCOMM_TEST_SMALL").is_some();
    let only: Option<Vec<usize>> = std::env::var("EPCOMM_TEST_GROUPS")
        .ok()
        .map(|v| v.split(',').filter_map(|g| g.trim().parse().ok()).collect());
    groups
        .into_iter()
        .enumerate()
        .filter(|(gi, g)| {
            !(small && g.hidden * g.max_tokens > 1 << 20)
                && only.as_ref().is_none_or(|o| o.contains(gi))
        })
        .collect()
}

/// One group of the dispatch/combine suite: a buffer shape and the cases run on it.
pub struct SuiteGroup {
    pub hidden: usize,
    pub top_k: usize,
    pub experts_per_rank: usize,
    pub max_tokens: usize,
    pub cases: Vec<SuiteCase>,
}

/// Runs the suite's `groups` on buffers `make` builds from each group's config (flat or
/// two-tier, any [`epcomm::ExpertParallel`]): every case one verified round
/// ([`epcomm_check::verify::verified_round`]); after each group, every tier's barrier counters
/// (`barriers`): all zero under the Epoch schedule, all moved under Global. `label` names the
/// buffer in messages.
pub fn run_suite_groups<E: epcomm::ExpertParallel>(
    w: &Worker,
    test: &TestConfig,
    groups: Vec<(usize, SuiteGroup)>,
    label: &str,
    make: impl Fn(BufferConfig) -> E,
    barriers: impl Fn(&mut E) -> Vec<(&'static str, Vec<u64>)>,
) {
    use epcomm_check::verify::{RoundOptions, verified_round};
    let (rank, world) = (w.boot.rank(), w.boot.world_size());
    for (gi, g) in groups {
        let experts = g.experts_per_rank * world;
        let mut cfg = BufferConfig::new(g.max_tokens, g.hidden, g.top_k, experts);
        test.apply(&mut cfg);
        cfg.timeout = Duration::from_secs(20);
        let mut buf = make(cfg);
        for (ci, (tokens, mask, skew, opts)) in g.cases.into_iter().enumerate() {
            let shape = Shape {
                tokens: tokens.clone(),
                hidden: g.hidden,
                top_k: g.top_k,
                experts,
                mask_prob: mask,
                skew_to: skew,
                seed: (gi * 100 + ci) as u64,
            };
            let opts = RoundOptions {
                fp8: opts.fp8 && shape.fp8_capable(),
                ..opts
            };
            let inputs = host_inputs(&shape).expect("inputs");
            let dev = device_inputs(buf.stream(), &inputs, rank).expect("upload");
            let t0 = std::time::Instant::now();
            verified_round(&mut buf, &inputs, &dev, opts).unwrap_or_else(|e| {
                panic!("{test} {label} group {gi} case {ci} ({shape:?}, {opts:?}): {e}")
            });
            log(
                rank,
                format_args!(
                    "{test} {label} H={} K={} E={experts} tokens={tokens:?} mask={mask} \
                     skew={skew:?} {opts:?}: ok ({:?})",
                    g.hidden,
                    g.top_k,
                    t0.elapsed()
                ),
            );
        }
        // Zero global barriers under Epoch in every tier: the counters never moved.
        for (tier, counters) in barriers(&mut buf) {
            match test.schedule {
                Schedule::Global => {
                    assert!(counters.iter().all(|&b| b > 0), "{tier}: {counters:?}")
                }
                _ => assert!(
                    counters.iter().all(|&b| b == 0),
                    "Epoch issued {tier} barriers: {counters:?}"
                ),
            }
            log(
                rank,
                format_args!(
                    "{test}: {tier} barrier arrivals per peer after group {gi}: {counters:?}"
                ),
            );
        }
        buf.destroy().expect("destroy");
    }
}
