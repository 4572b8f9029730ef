//! The hierarchical (two-tier) path on GPUs: [`epcomm::HierarchicalBuffer`] against the CPU
//! reference, on virtual nodes (one host's ranks split into logical nodes, the rail between
//! them carried by the transport's put/signal route).
//!
//! Layouts: `EPCOMM_TEST_WORLD` ranks split into 2 logical nodes (`EPCOMM_TEST_TRANSPORTS`
//! picks the specs, default `nvshmem:vnodes=2`; any spec with a put/signal route works): 2 ranks
//! give 2 nodes × 1 (every token on the rail), 4 give 2 × 2 (rail, then NVLink forwarding).
//! Several ranks may share a GPU (one process each).

mod common;

use std::time::{Duration, Instant};

use epcomm::{
    BufferConfig, CombineInput, CombineOutput, DispatchInput, Error, ExpertParallel,
    HierarchicalBuffer, RecvMode, Schedule, TierStats, XInput,
};
use epcomm_backends::TransportSpec;
use epcomm_check::hier::{HierCase, hier_case};
use epcomm_check::inputs::{Shape, device_inputs, host_inputs, upload};
use epcomm_check::procs::is_worker;
use epcomm_check::verify::{RoundOptions, verified_round};
use epcomm_reference::bf16;

use common::{MakeTransport, SuiteTiering, TestConfig, Worker, launch, log, world};

fn run_hier(w: &Worker, mk: MakeTransport<'_>, test: TestConfig) {
    let world = w.boot.world_size();
    let groups = common::selected(common::suite_groups(world, SuiteTiering::TwoTier));
    common::run_suite_groups(
        w,
        &test,
        groups,
        "two-tier",
        |cfg| HierarchicalBuffer::new(w.ctx.clone(), mk(), cfg).expect("HierarchicalBuffer::new"),
        |buf| {
            vec![
                (
                    "rail",
                    buf.rail().barrier_counters().expect("rail barriers"),
                ),
                (
                    "node",
                    buf.node().barrier_counters().expect("node barriers"),
                ),
            ]
        },
    );
}

/// The specs to run: `EPCOMM_TEST_TRANSPORTS`, or NVSHMEM with two logical nodes.
fn specs() -> Vec<TransportSpec> {
    std::env::var("EPCOMM_TEST_TRANSPORTS")
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "nvshmem:vnodes=2".into())
        .split(',')
        .map(|s| {
            s.trim()
                .parse()
                .expect("EPCOMM_TEST_TRANSPORTS: a valid spec")
        })
        .collect()
}

#[test]
fn hierarchical_suite_matches_reference() {
    if is_worker() {
        return common::on_transport!(run_hier, TestConfig::from_env());
    }
    launch_hier("hierarchical_suite_matches_reference");
}

/// The launcher of a hierarchical test: every spec of [`specs`] under every schedule
/// `EPCOMM_TEST_SCHEDULE` keeps (both by default).
fn launch_hier(test: &str) {
    let Some(n) = world(test, 2) else {
        return;
    };
    let keep = |v: String| {
        std::env::var("EPCOMM_TEST_SCHEDULE")
            .ok()
            .filter(|o| !o.is_empty())
            .is_none_or(|o| o.split(',').any(|o| o.trim() == v))
    };
    for spec in specs() {
        for schedule in Schedule::ALL {
            if !keep(schedule.to_string()) {
                continue;
            }
            let cfg = TestConfig {
                spec,
                schedule,
                routes: epcomm::RoutePolicy::Auto,
                combine_staging: epcomm::CombineStaging::Auto,
                rail_ring: None,
                rail_forward_sms: 0,
            };
            eprintln!("== {test}: {cfg}");
            launch(test, n, &cfg.env());
        }
    }
}

/// A hierarchical buffer for the smaller tests: hidden 256, top-4 of 4 experts per rank, at
/// most `tokens` tokens per rank, the launcher's schedule, `timeout`.
fn small_hier(
    w: &Worker,
    mk: MakeTransport<'_>,
    tokens: usize,
    timeout: Duration,
) -> HierarchicalBuffer {
    let world = w.boot.world_size();
    let mut cfg = BufferConfig::new(tokens, 256, 4, 4 * world);
    common::apply_test_config(&mut cfg);
    cfg.timeout = timeout;
    HierarchicalBuffer::new(w.ctx.clone(), mk(), cfg).expect("HierarchicalBuffer::new")
}

// ---------------------------------------------------------------------------------------------
// CUDA graphs: both tiers' layouts, dispatches and combines captured once, replayed with a new
// routing and new rows each time.

fn run_hier_graph(w: &Worker, mk: MakeTransport<'_>) {
    let (rank, world) = (w.boot.rank(), w.boot.world_size());
    // SAFETY: the test uses one stream for everything (both tiers run on the buffer's), so no
    // cross-stream ordering is lost; a capture must not wait on events recorded before it.
    unsafe { w.ctx.disable_event_tracking() };
    let tokens = 96;
    let mut buf = small_hier(w, mk, tokens, Duration::from_secs(20));
    let tiers = buf.tiers();
    let stream = buf.stream().clone();
    let layout = buf.alloc_layout(tokens).expect("alloc_layout");
    let handle = buf.alloc_handle(&layout).expect("alloc_handle");
    let cap = handle.capacity();
    let variants: Vec<HierCase> = (0..6)
        .map(|v| {
            let shape = Shape::uniform(world, tokens, 256, 4, 4 * world, 700 + v);
            let h = host_inputs(&shape).unwrap();
            hier_case(&h, tiers, 4 * world, rank, cap).unwrap()
        })
        .collect();
    let mut x = upload(&stream, &variants[0].x).unwrap();
    let mut idx = upload(&stream, &variants[0].topk_idx).unwrap();
    let mut y = upload(&stream, &variants[0].y).unwrap();
    let mut out = stream.alloc_zeros::<bf16>(tokens * 256).unwrap();
    let graph = buf
        .capture(|b| {
            let input = DispatchInput {
                x: XInput::Bf16(&x),
                topk_idx: &idx,
                topk_weights: None,
            };
            b.layout_into(&idx, &layout)?;
            b.dispatch_into(&input, &handle)?;
            b.combine(
                &CombineInput::new(&y),
                &handle,
                CombineOutput::new(&mut out),
            )
        })
        .expect("capture");
    let replays = 60;
    for i in 0..replays {
        let case = &variants[i % variants.len()];
        stream.memcpy_htod(&case.x, &mut x).unwrap();
        stream.memcpy_htod(&case.topk_idx, &mut idx).unwrap();
        stream.memcpy_htod(&case.y, &mut y).unwrap();
        buf.replay(&graph).unwrap();
        buf.synchronize()
            .unwrap_or_else(|e| panic!("replay {i}: {e}"));
        let got = stream.clone_dtoh(&out).unwrap();
        assert!(
            got == case.combined,
            "replay {i} (variant {}): combine output differs from the reference",
            i % variants.len()
        );
    }
    // Host-issued ops still line up with the device sequences after the replays.
    let shape = Shape::uniform(world, 50, 256, 4, 4 * world, 9);
    let h = host_inputs(&shape).unwrap();
    let d = device_inputs(&stream, &h, rank).unwrap();
    verified_round(&mut buf, &h, &d, RoundOptions::default()).expect("round after replays");
    log(
        rank,
        format_args!("hierarchical graph {tiers:?}: {replays} replays (6 routings) verified"),
    );
}

#[test]
fn hierarchical_graph_replays_new_routings() {
    if is_worker() {
        return common::on_transport!(run_hier_graph);
    }
    launch_hier("hierarchical_graph_replays_new_routings");
}

// ---------------------------------------------------------------------------------------------
// Skew across tiers: the last rank (another node than rank 0's) is held before each dispatch;
// every rank that shares a tier with it names it, and says on which tier.

fn run_hier_skew(w: &Worker, mk: MakeTransport<'_>) {
    let (rank, world) = (w.boot.rank(), w.boot.world_size());
    let mut buf = small_hier(w, mk, 256, Duration::from_secs(20));
    let tiers = buf.tiers();
    let late = world - 1;
    let shares_tier = |r: usize| {
        let (n, l) = (r / tiers.local_ranks(), r % tiers.local_ranks());
        let (ln, ll) = (late / tiers.local_ranks(), late % tiers.local_ranks());
        n == ln || l == ll
    };
    let shape = Shape::uniform(world, 256, 256, 4, 4 * world, 3);
    let h = host_inputs(&shape).unwrap();
    let d = device_inputs(buf.stream(), &h, rank).unwrap();
    // Ranks share one GPU here (time-sliced): the hold must dwarf the slicing.
    let delay = Duration::from_millis(40);
    let layout = buf.layout(&d.topk_idx, 256).unwrap();
    for i in 0..4 {
        w.boot.barrier("hier-skew").unwrap();
        if rank == late {
            buf.rail().inject_delay(delay).unwrap();
        }
        let input = d.dispatch_input(false, false);
        drop(buf.dispatch(&input, &layout, RecvMode::WorstCase).unwrap());
        let st = buf.last_op_stats().unwrap().expect("stats after dispatch");
        let (named, tier, skew) = st.late();
        if shares_tier(rank) {
            assert_eq!(
                named, late,
                "dispatch {i}: rank {rank} names {named} on the {tier} tier ({st})"
            );
            assert!(skew >= delay / 2, "dispatch {i}: skew {skew:?} ({st})");
        }
        if i == 0 {
            log(rank, format_args!("hierarchical skew {tiers:?}: {st}"));
        }
    }
    log(
        rank,
        format_args!("hierarchical skew {tiers:?}: the held rank {late} named on every dispatch"),
    );
}

#[test]
fn hierarchical_skew_names_the_late_rank_and_tier() {
    if is_worker() {
        return common::on_transport!(run_hier_skew);
    }
    launch_hier("hierarchical_skew_names_the_late_rank_and_tier");
}

// ---------------------------------------------------------------------------------------------
// A stalled rank in another node: it stops issuing ops; every other rank's dispatch ends within
// its bound with an error; ranks sharing a tier with it get a Timeout naming it, the others a
// Timeout or PeerFailed naming a rank of the chain.

fn run_hier_stall(w: &Worker, mk: MakeTransport<'_>) {
    let (rank, world) = (w.boot.rank(), w.boot.world_size());
    let timeout = Duration::from_secs(2);
    let mut buf = small_hier(w, mk, 64, timeout);
    let tiers = buf.tiers();
    let shape = Shape::uniform(world, 64, 256, 4, 4 * world, 11);
    let h = host_inputs(&shape).unwrap();
    let d = device_inputs(buf.stream(), &h, rank).unwrap();
    verified_round(&mut buf, &h, &d, RoundOptions::default()).expect("round before the stall");
    let stalled = world - 1;
    let layout = buf.layout(&d.topk_idx, 64).unwrap();
    buf.synchronize().unwrap();
    w.boot.barrier("hier-stall").unwrap();
    if rank == stalled {
        // Alive but silent for longer than every peer's bound, then gone without a word.
        std::thread::sleep(timeout * 4);
        std::process::exit(0);
    }
    let t0 = Instant::now();
    let input = d.dispatch_input(false, false);
    let r = buf
        .dispatch(&input, &layout, RecvMode::WorstCase)
        .map(|_| ())
        .and_then(|_| buf.synchronize());
    let took = t0.elapsed();
    let (sn, sl) = (stalled / tiers.local_ranks(), stalled % tiers.local_ranks());
    let shares = rank / tiers.local_ranks() == sn || rank % tiers.local_ranks() == sl;
    match &r {
        Err(Error::Timeout { peer, .. }) if shares => assert_eq!(*peer as usize, stalled, "{r:?}"),
        Err(Error::Timeout { .. } | Error::PeerFailed { .. }) if !shares => {}
        _ => panic!("rank {rank}: {r:?}"),
    }
    assert!(took < timeout * 3, "rank {rank}: the failure took {took:?}");
    // A failed buffer refuses the next op on both tiers.
    let again = buf
        .dispatch(&input, &layout, RecvMode::WorstCase)
        .map(|_| ());
    assert!(
        again.is_err(),
        "rank {rank}: an op after the failure was accepted"
    );
    log(
        rank,
        format_args!("hierarchical stall {tiers:?}: {r:?} after {took:?}"),
    );
    std::process::exit(0);
}

#[test]
fn hierarchical_stalled_rank_is_named() {
    if is_worker() {
        return common::on_transport!(run_hier_stall);
    }
    launch_hier("hierarchical_stalled_rank_is_named");
}

// ---------------------------------------------------------------------------------------------
// Soak: 240 back-to-back hierarchical dispatch + combine rounds, a new routing and token count
// (0 to 64 per rank) each, issued in pipelined batches of 8 without waiting in between, every
// output checked.

fn run_hier_soak(w: &Worker, mk: MakeTransport<'_>) {
    let (rank, world) = (w.boot.rank(), w.boot.world_size());
    let max_tokens = 64;
    let mut buf = small_hier(w, mk, max_tokens, Duration::from_secs(20));
    let tiers = buf.tiers();
    let stream = buf.stream().clone();
    let (batches, per_batch) = (30, 8);
    for b in 0..batches {
        let mut pending = Vec::new();
        for j in 0..per_batch {
            let seed = (b * per_batch + j) as u64;
            let tokens: Vec<usize> = (0..world)
                .map(|r| ((seed as usize) * 7 + r * 13) % (max_tokens + 1))
                .collect();
            let shape = Shape {
                tokens: tokens.clone(),
                hidden: 256,
                top_k: 4,
                experts: 4 * world,
                mask_prob: 0.1,
                skew_to: None,
                seed: 9000 + seed,
            };
            let h = host_inputs(&shape).unwrap();
            let t = tokens[rank];
            let d = device_inputs(&stream, &h, rank).unwrap();
            let layout = buf.layout(&d.topk_idx, t).unwrap();
            let handle = d.worst_case_handle(&mut buf, &layout, false).unwrap();
            let case = hier_case(&h, tiers, 4 * world, rank, handle.capacity()).unwrap();
            let y = upload(&stream, &case.y).unwrap();
            let mut out = stream.alloc_zeros::<bf16>((t * 256).max(1)).unwrap();
            let mut out_view = out.slice_mut(..t * 256);
            buf.combine(
                &CombineInput::new(&y),
                &handle,
                CombineOutput::new(&mut out_view),
            )
            .unwrap();
            pending.push((seed, d, y, out, case, t));
        }
        buf.synchronize()
            .unwrap_or_else(|e| panic!("batch {b}: {e}"));
        for (seed, _d, _y, out, case, t) in pending {
            let got = stream.clone_dtoh(&out).unwrap();
            assert!(
                got[..t * 256] == case.combined[..],
                "round {seed}: combine output differs from the reference"
            );
        }
    }
    log(
        rank,
        format_args!(
            "hierarchical soak {tiers:?}: {} rounds verified",
            batches * per_batch
        ),
    );
}

#[test]
fn hierarchical_soak_matches_reference() {
    if is_worker() {
        return common::on_transport!(run_hier_soak);
    }
    launch_hier("hierarchical_soak_matches_reference");
}
