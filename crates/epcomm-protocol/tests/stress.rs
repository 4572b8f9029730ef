//! The model on std threads with random delays at every step: every run must finish without a
//! violation and match the sequential reference.
#![cfg(not(loom))]

mod common;

use common::{Jitter, Rng};
use epcomm_protocol::{
    Failure, ModelConfig, Mutation, NoHook, OpError, OpKind, RailRing, Schedule, Step, run_model,
    sequential_reference,
};

fn random_ops(rng: &mut Rng, len: usize) -> Vec<OpKind> {
    let mut ops = vec![OpKind::Dispatch];
    while ops.len() < len {
        ops.push(match rng.below(3) {
            0 => OpKind::Dispatch,
            1 => OpKind::CachedDispatch,
            _ => OpKind::Combine,
        });
    }
    ops
}

/// Random ops of every kind, low-latency ones included (an LL combine only after some LL
/// dispatch); starts with a dispatch or an LL dispatch.
fn random_mixed_ops(rng: &mut Rng, len: usize) -> Vec<OpKind> {
    let mut ops = vec![if rng.below(2) == 0 {
        OpKind::Dispatch
    } else {
        OpKind::LlDispatch
    }];
    while ops.len() < len {
        let seen_dispatch = ops.contains(&OpKind::Dispatch);
        let seen_ll = ops.contains(&OpKind::LlDispatch);
        ops.push(match rng.below(5) {
            0 => OpKind::Dispatch,
            1 if seen_dispatch => OpKind::CachedDispatch,
            2 if seen_dispatch => OpKind::Combine,
            3 if seen_ll => OpKind::LlCombine,
            _ => OpKind::LlDispatch,
        });
    }
    ops
}

/// A random configuration: 2..=4 ranks, `1..=max_tokens` tokens, 1..=2 blocks, and
/// `min_ops..min_ops + spread_ops` random ops starting with a dispatch.
fn random_config(
    rng: &mut Rng,
    schedule: Schedule,
    max_tokens: u64,
    min_ops: usize,
    spread_ops: u64,
) -> ModelConfig {
    random_config_of(rng, schedule, max_tokens, min_ops, spread_ops, random_ops)
}

/// [`random_config`] with the op sequence drawn by `ops_of`.
fn random_config_of(
    rng: &mut Rng,
    schedule: Schedule,
    max_tokens: u64,
    min_ops: usize,
    spread_ops: u64,
    ops_of: fn(&mut Rng, usize) -> Vec<OpKind>,
) -> ModelConfig {
    let world = 2 + rng.below(3) as usize;
    let tokens = 1 + rng.below(max_tokens) as usize;
    let blocks = 1 + rng.below(2) as usize;
    let len = min_ops + rng.below(spread_ops) as usize;
    let ops = ops_of(rng, len);
    ModelConfig::new(world, tokens, blocks, schedule, ops).unwrap()
}

/// Delays of run `run` of a stress test seeded with `seed`.
fn jitter(seed: u64, run: u64) -> Jitter {
    Jitter::new(seed ^ run.wrapping_mul(0x2545_F491_4F6C_DD1D))
}

fn stress(cfg_of: impl Fn(&mut Rng) -> ModelConfig, runs: u64, seed: u64) {
    let mut rng = Rng(seed);
    for run in 0..runs {
        let cfg = cfg_of(&mut rng);
        let got = run_model(&cfg, &jitter(seed, run))
            .unwrap_or_else(|f| panic!("run {run}, {cfg:?}: {f}"));
        assert_eq!(got, sequential_reference(&cfg), "run {run}, {cfg:?}");
    }
}

#[test]
fn epoch_survives_random_delays() {
    stress(
        |rng| random_config(rng, Schedule::Epoch, 4, 3, 6),
        120,
        0x1234_5678,
    );
}

#[test]
fn global_survives_random_delays() {
    stress(
        |rng| random_config(rng, Schedule::Global, 4, 3, 6),
        60,
        0x8765_4321,
    );
}

/// Global's `[G1]` barrier alone protects single regions (DeepEP's design): without the parity
/// regions the Global schedule still never reads a stale count or an overwritten row.
#[test]
fn global_survives_random_delays_with_single_regions() {
    let single = |rng: &mut Rng| {
        random_config(rng, Schedule::Global, 4, 3, 6).with_mutation(Mutation::SingleRegion)
    };
    stress(single, 60, 0x5151_0001);
}

/// Low-latency ops mixed with the normal ones, under both schedules.
#[test]
fn low_latency_mixes_survive_random_delays() {
    for (schedule, seed) in [
        (Schedule::Epoch, 0x1100_0001),
        (Schedule::Global, 0x1100_0002),
    ] {
        stress(
            |rng| random_config_of(rng, schedule, 4, 3, 6, random_mixed_ops),
            60,
            seed,
        );
    }
}

/// Global's `[G1]` barrier alone protects single LL regions too.
#[test]
fn global_survives_random_delays_with_single_ll_regions() {
    let single = |rng: &mut Rng| {
        random_config_of(rng, Schedule::Global, 4, 3, 6, random_mixed_ops)
            .with_mutation(Mutation::LlSingleRegion)
    };
    stress(single, 40, 0x5151_0011);
}

/// A random rank fails at a random step of a random op: every run must end with every rank's
/// later ops in an error (no hang, no completed op with wrong data), as `run_model` checks.
/// Half of the runs mix in low-latency ops.
fn stress_failures(schedule: Schedule, runs: u64, seed: u64) {
    let mut rng = Rng(seed);
    for run in 0..runs {
        let ops_of = if run % 2 == 0 {
            random_ops
        } else {
            random_mixed_ops
        };
        let cfg = random_config_of(&mut rng, schedule, 3, 2, 5, ops_of);
        let op = rng.below(cfg.ops().len() as u64) as usize;
        let steps: Vec<Step> = Step::ALL
            .into_iter()
            .filter(|&s| Failure::step_is_valid(schedule, cfg.ops()[op], s))
            .collect();
        let at = steps[rng.below(steps.len() as u64) as usize];
        let rank = rng.below(cfg.world() as u64) as usize;
        let cfg = cfg.with_failure(Failure { rank, op, at }).unwrap();
        let reports = run_model(&cfg, &jitter(seed, run))
            .unwrap_or_else(|f| panic!("run {run}, {cfg:?}: {f}"));
        assert_eq!(
            reports[rank].outputs[op],
            Err(OpError::TimedOut { step: at }),
            "run {run}"
        );
    }
}

#[test]
fn epoch_failures_end_in_errors() {
    stress_failures(Schedule::Epoch, 80, 0xFA11);
}

#[test]
fn global_failures_end_in_errors() {
    stress_failures(Schedule::Global, 40, 0xFA12);
}

#[test]
fn long_mixed_sequence_without_delays() {
    use OpKind::*;
    let mut ops = vec![Dispatch];
    for i in 0..200 {
        ops.push(
            [
                Combine,
                Dispatch,
                LlDispatch,
                CachedDispatch,
                LlCombine,
                Combine,
                LlDispatch,
                Combine,
            ][i % 8],
        );
    }
    for schedule in Schedule::ALL {
        let cfg = ModelConfig::new(4, 8, 2, schedule, ops.clone()).unwrap();
        let got = run_model(&cfg, &NoHook).unwrap_or_else(|f| panic!("{schedule}: {f}"));
        assert_eq!(got, sequential_reference(&cfg));
    }
}

#[test]
fn single_rank_world_works() {
    use OpKind::*;
    for schedule in Schedule::ALL {
        let cfg = ModelConfig::new(
            1,
            3,
            1,
            schedule,
            vec![
                Dispatch,
                Combine,
                LlDispatch,
                CachedDispatch,
                LlCombine,
                Combine,
            ],
        )
        .unwrap();
        assert_eq!(
            run_model(&cfg, &NoHook).unwrap(),
            sequential_reference(&cfg)
        );
    }
}

/// The stress harness is strong enough to matter for the LL ops too: with single LL regions the
/// Epoch schedule fails (one failing run is required).
#[test]
fn jitter_catches_single_ll_regions() {
    let mut rng = Rng(0x0BAD_0011);
    let mut failures = 0;
    for run in 0..40u64 {
        let ops = random_mixed_ops(&mut rng, 6);
        let world = 2 + rng.below(3) as usize;
        let tokens = 1 + rng.below(4) as usize;
        let cfg = ModelConfig::new(world, tokens, 1, Schedule::Epoch, ops)
            .unwrap()
            .with_mutation(Mutation::LlSingleRegion);
        if run_model(&cfg, &Jitter::new(run)).is_err() {
            failures += 1;
        }
    }
    assert!(failures > 0, "no run with single LL regions failed");
}

/// The stress harness is strong enough to matter: with the same delays, the deliberately
/// unsound Epoch schedule with single regions fails (in practice in almost every run; one is
/// required).
#[test]
fn jitter_catches_the_unsound_variant() {
    let mut rng = Rng(0xBAD);
    let mut failures = 0;
    for run in 0..40u64 {
        let ops = random_ops(&mut rng, 6);
        let world = 2 + rng.below(3) as usize;
        let tokens = 1 + rng.below(4) as usize;
        let cfg = ModelConfig::new(world, tokens, 1, Schedule::Epoch, ops)
            .unwrap()
            .with_mutation(Mutation::SingleRegion);
        if run_model(&cfg, &Jitter::new(run)).is_err() {
            failures += 1;
        }
    }
    assert!(failures > 0, "no run of the unsound variant failed");
}

/// The `(nodes, local ranks)` shapes the internode tests run.
const INTERNODE_SHAPES: [(usize, usize); 5] = [(1, 2), (2, 1), (2, 2), (3, 2), (2, 3)];

/// Random internode op sequences (starting with an internode dispatch), mixed with the other
/// families when `mixed`.
fn random_internode_ops(rng: &mut Rng, len: usize, mixed: bool) -> Vec<OpKind> {
    let mut ops = vec![OpKind::InternodeDispatch];
    while ops.len() < len {
        let seen_dispatch = ops.contains(&OpKind::Dispatch);
        ops.push(match rng.below(if mixed { 7 } else { 3 }) {
            0 => OpKind::InternodeDispatch,
            1 | 2 => OpKind::InternodeCachedDispatch,
            3 => OpKind::Dispatch,
            4 if seen_dispatch => OpKind::Combine,
            5 if seen_dispatch => OpKind::CachedDispatch,
            _ => OpKind::LlDispatch,
        });
    }
    ops
}

fn internode_config(rng: &mut Rng, schedule: Schedule, mixed: bool) -> ModelConfig {
    let (nodes, local) = INTERNODE_SHAPES[rng.below(INTERNODE_SHAPES.len() as u64) as usize];
    let tokens = 1 + rng.below(4) as usize;
    let blocks = 1 + rng.below(2) as usize;
    let len = 3 + rng.below(6) as usize;
    let ops = random_internode_ops(rng, len, mixed);
    ModelConfig::new(nodes * local, tokens, blocks, schedule, ops)
        .unwrap()
        .with_nodes(nodes)
        .unwrap()
}

/// The hierarchical internode dispatch (cached or not) under random delays, on every shape:
/// each rank's receive set equals the flat dispatch's (the sequential reference).
#[test]
fn internode_survives_random_delays() {
    for (schedule, seed, runs) in [
        (Schedule::Epoch, 0x1A7E_0001, 120),
        (Schedule::Global, 0x1A7E_0002, 30),
    ] {
        stress(|rng| internode_config(rng, schedule, false), runs, seed);
    }
}

/// Internode dispatches mixed with the intranode and low-latency ops.
#[test]
fn internode_mixes_survive_random_delays() {
    stress(
        |rng| internode_config(rng, Schedule::Epoch, true),
        60,
        0x1A7E_0003,
    );
}

/// Every shape, a long sequence without delays: the credits and parities cycle many times.
#[test]
fn internode_long_sequence_without_delays() {
    use OpKind::*;
    let mut ops = vec![InternodeDispatch];
    for i in 0..60 {
        ops.push(
            [
                InternodeCachedDispatch,
                InternodeCachedDispatch,
                InternodeDispatch,
                InternodeCachedDispatch,
                InternodeDispatch,
            ][i % 5],
        );
    }
    for (nodes, local) in INTERNODE_SHAPES {
        let cfg = ModelConfig::new(nodes * local, 4, 1, Schedule::Epoch, ops.clone())
            .unwrap()
            .with_nodes(nodes)
            .unwrap();
        let got = run_model(&cfg, &NoHook).unwrap_or_else(|f| panic!("{nodes}x{local}: {f}"));
        assert_eq!(got, sequential_reference(&cfg));
    }
}

// ---- the hierarchical internode combine (model only) ---------------------------------------

/// The shapes the internode combine tests run: one node (NVLink only), two nodes of one rank
/// (the forwarder is the only contributor of its node), two and three nodes of two ranks.
const INTERNODE_COMBINE_SHAPES: [(usize, usize); 4] = [(1, 2), (2, 1), (2, 2), (3, 2)];

/// Random sequences of internode dispatches (cached or not) and internode combines, starting
/// with a dispatch; `mixed` adds the intranode ops.
fn random_internode_combine_ops(rng: &mut Rng, len: usize, mixed: bool) -> Vec<OpKind> {
    let mut ops = vec![OpKind::InternodeDispatch];
    while ops.len() < len {
        let seen_dispatch = ops.contains(&OpKind::Dispatch);
        ops.push(match rng.below(if mixed { 7 } else { 5 }) {
            0 => OpKind::InternodeDispatch,
            1 => OpKind::InternodeCachedDispatch,
            2..=4 => OpKind::InternodeCombine,
            5 if seen_dispatch => OpKind::Combine,
            _ => OpKind::Dispatch,
        });
    }
    ops
}

fn internode_combine_config(rng: &mut Rng, schedule: Schedule, mixed: bool) -> ModelConfig {
    let shapes = INTERNODE_COMBINE_SHAPES;
    let (nodes, local) = shapes[rng.below(shapes.len() as u64) as usize];
    let tokens = 1 + rng.below(4) as usize;
    let len = 3 + rng.below(6) as usize;
    let ops = random_internode_combine_ops(rng, len, mixed);
    ModelConfig::new(nodes * local, tokens, 1, schedule, ops)
        .unwrap()
        .with_nodes(nodes)
        .unwrap()
}

/// Internode dispatches and combines under random delays, on every shape: each combined token
/// equals the flat combine's reduction over exactly its contributors (the sequential
/// reference), with one partial per other node.
#[test]
fn internode_combine_survives_random_delays() {
    for (schedule, mixed, seed, runs) in [
        (Schedule::Epoch, false, 0x1A7E_C001, 300),
        (Schedule::Epoch, true, 0x1A7E_C002, 100),
        (Schedule::Global, false, 0x1A7E_C003, 50),
    ] {
        stress(
            |rng| internode_combine_config(rng, schedule, mixed),
            runs,
            seed,
        );
    }
}

/// Every shape, a long sequence without delays: dispatch, combine, cached dispatch, combine,
/// ..., with back-to-back combines, so the combine credits and parities cycle many times.
#[test]
fn internode_combine_long_sequence_without_delays() {
    use OpKind::*;
    let mut ops = vec![InternodeDispatch];
    for i in 0..60 {
        ops.push(
            [
                InternodeCombine,
                InternodeCachedDispatch,
                InternodeCombine,
                InternodeCombine,
                InternodeDispatch,
                InternodeCombine,
            ][i % 6],
        );
    }
    for (nodes, local) in INTERNODE_COMBINE_SHAPES {
        let cfg = ModelConfig::new(nodes * local, 4, 1, Schedule::Epoch, ops.clone())
            .unwrap()
            .with_nodes(nodes)
            .unwrap();
        let got = run_model(&cfg, &NoHook).unwrap_or_else(|f| panic!("{nodes}x{local}: {f}"));
        assert_eq!(got, sequential_reference(&cfg));
    }
}

// ---- chunked forwarding of the internode dispatch (model only) -----------------------------

/// A random internode configuration (dispatches, cached dispatches and combines; `mixed` adds
/// the intranode ops) whose dispatches forward through rings of 1 to 3 slots of 1 to 3 rows,
/// with up to six tokens per rank so that an op sends several times as many chunks as a ring
/// holds, and partial last chunks.
fn ring_config(rng: &mut Rng, schedule: Schedule, mixed: bool) -> ModelConfig {
    let (nodes, local) = INTERNODE_SHAPES[rng.below(INTERNODE_SHAPES.len() as u64) as usize];
    let tokens = 1 + rng.below(6) as usize;
    let len = 3 + rng.below(6) as usize;
    let ops = random_internode_combine_ops(rng, len, mixed);
    let ring = RailRing {
        slots: 1 + rng.below(3) as usize,
        chunk_rows: 1 + rng.below(3) as usize,
    };
    ModelConfig::new(nodes * local, tokens, 1, schedule, ops)
        .unwrap()
        .with_nodes(nodes)
        .unwrap()
        .with_rail_ring(ring)
        .unwrap()
}

/// Chunked forwarding under random delays, on every shape: every rank's receive set and every
/// combine equal the sequential reference, as with the per-op rail region.
#[test]
fn internode_ring_survives_random_delays() {
    for (schedule, mixed, seed, runs) in [
        (Schedule::Epoch, false, 0x1A7E_5001, 200),
        (Schedule::Epoch, true, 0x1A7E_5002, 60),
        (Schedule::Global, false, 0x1A7E_5003, 40),
    ] {
        stress(|rng| ring_config(rng, schedule, mixed), runs, seed);
    }
}

/// Every shape and ring size, a long sequence without delays: the chunk counts run far past
/// the ring's size and across cached dispatches and combines.
#[test]
fn internode_ring_long_sequence_without_delays() {
    use OpKind::*;
    let mut ops = vec![InternodeDispatch];
    for i in 0..60 {
        ops.push(
            [
                InternodeCachedDispatch,
                InternodeCombine,
                InternodeDispatch,
                InternodeCachedDispatch,
                InternodeDispatch,
            ][i % 5],
        );
    }
    for (nodes, local) in INTERNODE_SHAPES {
        for (slots, chunk_rows) in [(1, 1), (2, 1), (3, 1), (1, 2), (2, 3)] {
            let cfg = ModelConfig::new(nodes * local, 5, 1, Schedule::Epoch, ops.clone())
                .unwrap()
                .with_nodes(nodes)
                .unwrap()
                .with_rail_ring(RailRing { slots, chunk_rows })
                .unwrap();
            let got = run_model(&cfg, &NoHook)
                .unwrap_or_else(|f| panic!("{nodes}x{local}, {slots} x {chunk_rows} rows: {f}"));
            assert_eq!(got, sequential_reference(&cfg));
        }
    }
}

/// The harness catches each ring mutation under the same delays (one failing run of 40 is
/// required for each; loom finds each in every run, tests/loom.rs).
#[test]
fn jitter_catches_ring_mutations() {
    for mutation in [
        Mutation::RingSkipCredit,
        Mutation::RingSkipChunkWait,
        Mutation::RingCreditAhead,
        Mutation::PartialRingSkipChunkWait,
    ] {
        let mut rng = Rng(0x0BAD_0A11);
        let mut failures = 0;
        for run in 0..40u64 {
            let cfg = ring_config(&mut rng, Schedule::Epoch, false).with_mutation(mutation);
            if run_model(&cfg, &Jitter::new(run)).is_err() {
                failures += 1;
            }
        }
        eprintln!("{mutation:?}: {failures}/40");
        assert!(failures > 0, "no run with {mutation:?} failed");
    }
}
