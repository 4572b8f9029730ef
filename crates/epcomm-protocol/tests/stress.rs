//! The model on std threads with random delays at every step: every run must finish without a
//! violation and match the sequential reference.
#![cfg(not(loom))]

mod common;

use common::{Jitter, Rng};
use epcomm_protocol::{
    Failure, ModelConfig, NoHook, OpError, OpKind, Step, Strategy, run_model, sequential_reference,
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

fn stress(strategy: Strategy, runs: u64, seed: u64) {
    let mut rng = Rng(seed);
    for run in 0..runs {
        let world = 2 + rng.below(3) as usize;
        let tokens = 1 + rng.below(4) as usize;
        let blocks = 1 + rng.below(2) as usize;
        let len = 3 + rng.below(6) as usize;
        let ops = random_ops(&mut rng, len);
        let cfg = ModelConfig::new(world, tokens, blocks, strategy, ops).unwrap();
        let got = run_model(
            &cfg,
            &Jitter::new(seed ^ run.wrapping_mul(0x2545_F491_4F6C_DD1D)),
        )
        .unwrap_or_else(|f| panic!("run {run}, {cfg:?}: {f}"));
        assert_eq!(got, sequential_reference(&cfg), "run {run}, {cfg:?}");
    }
}

#[test]
fn epoch_survives_random_delays() {
    stress(Strategy::Epoch, 120, 0x1234_5678);
}

#[test]
fn global_survives_random_delays() {
    stress(Strategy::Global, 60, 0x8765_4321);
}

/// A random rank fails at a random step of a random op: every run must end with every rank's
/// later ops in an error (no hang, no completed op with wrong data), as `run_model` checks.
fn stress_failures(strategy: Strategy, runs: u64, seed: u64) {
    let mut rng = Rng(seed);
    for run in 0..runs {
        let world = 2 + rng.below(3) as usize;
        let tokens = 1 + rng.below(3) as usize;
        let blocks = 1 + rng.below(2) as usize;
        let len = 2 + rng.below(5) as usize;
        let ops = random_ops(&mut rng, len);
        let op = rng.below(len as u64) as usize;
        let steps: Vec<Step> = Step::ALL
            .into_iter()
            .filter(|&s| Failure::step_is_valid(strategy, ops[op], s))
            .collect();
        let at = steps[rng.below(steps.len() as u64) as usize];
        let rank = rng.below(world as u64) as usize;
        let cfg = ModelConfig::new(world, tokens, blocks, strategy, ops)
            .unwrap()
            .with_failure(Failure { rank, op, at })
            .unwrap();
        let reports = run_model(
            &cfg,
            &Jitter::new(seed ^ run.wrapping_mul(0x2545_F491_4F6C_DD1D)),
        )
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
    stress_failures(Strategy::Epoch, 80, 0xFA11);
}

#[test]
fn global_failures_end_in_errors() {
    stress_failures(Strategy::Global, 40, 0xFA12);
}

#[test]
fn long_mixed_sequence_without_delays() {
    use OpKind::*;
    let mut ops = vec![Dispatch];
    for i in 0..200 {
        ops.push([Combine, Dispatch, CachedDispatch, Combine, Combine][i % 5]);
    }
    for strategy in [Strategy::Epoch, Strategy::Global] {
        let cfg = ModelConfig::new(4, 8, 2, strategy, ops.clone()).unwrap();
        let got = run_model(&cfg, &NoHook).unwrap_or_else(|f| panic!("{strategy:?}: {f}"));
        assert_eq!(got, sequential_reference(&cfg));
    }
}

#[test]
fn single_rank_world_works() {
    use OpKind::*;
    for strategy in [Strategy::Epoch, Strategy::Global] {
        let cfg = ModelConfig::new(
            1,
            3,
            1,
            strategy,
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
/// unsound single-region variant fails (in practice in almost every run; one is required).
#[test]
fn jitter_catches_the_unsound_variant() {
    let mut rng = Rng(0xBAD);
    let mut failures = 0;
    for run in 0..40u64 {
        let ops = random_ops(&mut rng, 6);
        let world = 2 + rng.below(3) as usize;
        let tokens = 1 + rng.below(4) as usize;
        let cfg = ModelConfig::new(world, tokens, 1, Strategy::EpochWithoutParity, ops).unwrap();
        if run_model(&cfg, &Jitter::new(run)).is_err() {
            failures += 1;
        }
    }
    assert!(failures > 0, "no run of the unsound variant failed");
}
