//! The model on std threads with random delays at every step: every run must finish without a
//! violation and match the sequential reference.
#![cfg(not(loom))]

mod common;

use common::{Jitter, Rng};
use epcomm_protocol::{
    Failure, ModelConfig, Mutation, NoHook, OpError, OpKind, Schedule, Step, run_model,
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

/// A random configuration: 2..=4 ranks, `1..=max_tokens` tokens, 1..=2 blocks, and
/// `min_ops..min_ops + spread_ops` random ops starting with a dispatch.
fn random_config(
    rng: &mut Rng,
    schedule: Schedule,
    max_tokens: u64,
    min_ops: usize,
    spread_ops: u64,
) -> ModelConfig {
    let world = 2 + rng.below(3) as usize;
    let tokens = 1 + rng.below(max_tokens) as usize;
    let blocks = 1 + rng.below(2) as usize;
    let len = min_ops + rng.below(spread_ops) as usize;
    let ops = random_ops(rng, len);
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

/// A random rank fails at a random step of a random op: every run must end with every rank's
/// later ops in an error (no hang, no completed op with wrong data), as `run_model` checks.
fn stress_failures(schedule: Schedule, runs: u64, seed: u64) {
    let mut rng = Rng(seed);
    for run in 0..runs {
        let cfg = random_config(&mut rng, schedule, 3, 2, 5);
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
        ops.push([Combine, Dispatch, CachedDispatch, Combine, Combine][i % 5]);
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
            vec![Dispatch, Combine, CachedDispatch, Combine],
        )
        .unwrap();
        assert_eq!(
            run_model(&cfg, &NoHook).unwrap(),
            sequential_reference(&cfg)
        );
    }
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
