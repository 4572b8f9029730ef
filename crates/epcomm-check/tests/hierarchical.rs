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

use epcomm::{BufferConfig, HierarchicalBuffer, RecvMode, Schedule};
use epcomm_backends::TransportSpec;
use epcomm_check::hier::verified_hier_round;
use epcomm_check::inputs::{Shape, device_inputs, host_inputs};
use epcomm_check::procs::is_worker;
use epcomm_check::verify::RoundOptions;

use common::{MakeTransport, TestConfig, Worker, launch, log, world};

/// (hidden, top_k, experts per rank, max tokens, cases: tokens per rank, -1 probability,
/// skew target, options).
type Case = (Vec<usize>, f64, Option<usize>, RoundOptions);

fn groups(world: usize) -> Vec<(usize, usize, usize, usize, Vec<Case>)> {
    let per = |f: &dyn Fn(usize) -> usize| (0..world).map(f).collect::<Vec<_>>();
    let hs = RoundOptions {
        in_place: false,
        ..RoundOptions::default()
    };
    let fp8 = RoundOptions { fp8: true, ..hs };
    let wc = RoundOptions {
        mode: RecvMode::WorstCase,
        ..hs
    };
    vec![
        (
            7168,
            8,
            256 / world,
            1024,
            vec![
                (per(&|_| 1024), 0.0, None, hs),
                (per(&|_| 1024), 0.0, None, fp8),
                (per(&|r| 777 - 100 * (r % 2)), 0.1, None, wc),
                (per(&|r| if r == 0 { 1 } else { 0 }), 0.0, None, hs),
                (per(&|_| 0), 0.0, None, hs),
            ],
        ),
        (
            128,
            1,
            1,
            64,
            vec![
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
        ),
        (
            2056,
            9,
            288 / world,
            256,
            vec![
                (per(&|r| 201 + r), 0.2, None, hs),
                (per(&|r| 255 - r), 0.0, None, wc),
            ],
        ),
        (
            512,
            4,
            8,
            512,
            vec![
                // Every token to the last rank (another node for rank 0).
                (per(&|r| 500 + 3 * r), 0.0, Some(world - 1), hs),
                (per(&|r| 400 - 7 * r), 0.05, Some(0), fp8),
            ],
        ),
    ]
}

fn run_hier(w: &Worker, mk: MakeTransport<'_>, test: TestConfig) {
    let (rank, world) = (w.boot.rank(), w.boot.world_size());
    for (gi, (hidden, top_k, epr, max_tokens, cases)) in groups(world).into_iter().enumerate() {
        let experts = epr * world;
        let mut cfg = BufferConfig::new(max_tokens, hidden, top_k, experts);
        (cfg.schedule, cfg.routes) = (test.schedule, test.routes);
        cfg.timeout = Duration::from_secs(20);
        let mut buf =
            HierarchicalBuffer::new(w.ctx.clone(), mk(), cfg).expect("HierarchicalBuffer::new");
        let tiers = buf.tiers();
        for (ci, (tokens, mask, skew, opts)) in cases.into_iter().enumerate() {
            let shape = Shape {
                tokens: tokens.clone(),
                hidden,
                top_k,
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
            let t0 = Instant::now();
            verified_hier_round(&mut buf, &inputs, &dev, opts).unwrap_or_else(|e| {
                panic!("{test} {tiers:?} group {gi} case {ci} ({shape:?}, {opts:?}): {e}")
            });
            log(
                rank,
                format_args!(
                    "{test} {tiers:?} H={hidden} K={top_k} E={experts} tokens={tokens:?} mask={mask} skew={skew:?} {opts:?}: ok ({:?})",
                    t0.elapsed()
                ),
            );
        }
        // Zero global barriers under Epoch in either tier: the counters never moved.
        for (tier, counters) in [
            (
                "rail",
                buf.rail().barrier_counters().expect("rail barriers"),
            ),
            (
                "node",
                buf.node().barrier_counters().expect("node barriers"),
            ),
        ] {
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
    }
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
    const TEST: &str = "hierarchical_suite_matches_reference";
    if is_worker() {
        return common::on_transport!(run_hier, TestConfig::from_env());
    }
    let Some(n) = world(TEST, 2) else {
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
            };
            eprintln!("== {TEST}: {cfg}");
            launch(TEST, n, &cfg.env());
        }
    }
}
