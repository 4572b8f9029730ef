//! Rank masking of the low-latency ops on std threads: a rank stops (it stops calling ops, or
//! stops in the middle of one, and publishes nothing more, no abort word either) and the
//! survivors' waits for it expire after a short timeout. With masking the survivors' LL ops
//! mask it and keep completing, bit-exact against the reference without it
//! (`survivor_reference`); without masking, or in a normal op, the expiry fails the op and
//! every later op of every survivor ends in an error, without a hang. Masking changes nothing
//! when no rank stops, nor the rule of an injected failure (a crash with an abort word). Two
//! mutations of the receive phases (a masked source's counts kept, a masked expert's entry
//! reduced) are caught.
#![cfg(not(loom))]

mod common;

use std::time::{Duration, Instant};

use common::{Jitter, Rng};
use epcomm_protocol::config::ll_routes_to;
use epcomm_protocol::model::Region;
use epcomm_protocol::{
    Failure, ModelConfig, Mutation, NoHook, OpError, OpKind, OpResult, OutcomeViolation,
    RankReport, Schedule, Step, StepHook, StoppedRank, Violation, check_outcome, run_model,
    sequential_reference, survivor_reference,
};

use OpKind::{Dispatch as D, LlCombine as LC, LlDispatch as LD};

/// The bound of every wait in these runs: a wait for the stopped rank expires after it, once
/// per survivor (a masked rank is not waited for again).
const TIMEOUT: Duration = Duration::from_millis(100);

fn config(
    world: usize,
    tokens: usize,
    blocks: usize,
    schedule: Schedule,
    ops: &[OpKind],
    masking: bool,
) -> ModelConfig {
    ModelConfig::new(world, tokens, blocks, schedule, ops.to_vec())
        .unwrap()
        .with_wait_timeout(TIMEOUT)
        .unwrap()
        .with_ll_masking(masking)
}

fn stopping(cfg: &ModelConfig, rank: usize, op: usize, at: Step) -> ModelConfig {
    cfg.clone()
        .with_stopped_rank(StoppedRank { rank, op, at })
        .unwrap()
}

/// Every stop point of rank `rank` in op `op`: before the op (`[F1]`) and before each step the
/// op executes.
fn stop_points(cfg: &ModelConfig, rank: usize, op: usize) -> Vec<ModelConfig> {
    Step::ALL
        .into_iter()
        .filter(|&at| StoppedRank::step_is_valid(cfg.schedule(), cfg.ops()[op], at))
        .map(|at| stopping(cfg, rank, op, at))
        .collect()
}

/// Runs `cfg` (which stops a rank) and checks, beyond `run_model`'s own stop rule, that every
/// survivor completed every op (the sequence is all low-latency ops, masking on) equal to the
/// survivors' reference. Returns how many of those ops differ from the full reference (the
/// ones the stop changed).
fn survivors_complete(cfg: &ModelConfig) -> usize {
    let reports = run_model(cfg, &NoHook).unwrap_or_else(|f| panic!("{cfg:?}: {f}"));
    let s = cfg.stopped_rank().unwrap();
    let (masked, full) = (survivor_reference(cfg), sequential_reference(cfg));
    let mut changed = 0;
    for r in reports.iter().filter(|r| r.rank != s.rank) {
        for (op, out) in r.outputs.iter().enumerate() {
            assert!(out.is_ok(), "{cfg:?}: rank {} op {op}: {out:?}", r.rank);
            assert_eq!(*out, masked[r.rank].outputs[op], "{cfg:?}: rank {}", r.rank);
            changed += usize::from(*out != full[r.rank].outputs[op]);
        }
    }
    assert_eq!(
        reports[s.rank].outputs[s.op],
        Err(OpError::Stopped { step: s.at })
    );
    changed
}

/// The fewest tokens per rank with which every rank sends rows to every other rank in each of
/// the first three LL dispatches (so that a stop changes what the survivors get).
fn all_pairs_tokens() -> usize {
    (1..=16)
        .find(|&tokens| {
            (1..=3).all(|l| {
                (0..3).all(|s| {
                    (0..3).all(|d| s == d || (0..tokens).any(|t| ll_routes_to(l, s, t, d)))
                })
            })
        })
        .expect("the LL routing connects every pair with at most 16 tokens")
}

/// Three ranks, [`all_pairs_tokens`] tokens each, three LL dispatch / combine pairs.
fn three_ranks(schedule: Schedule, blocks: usize, masking: bool) -> ModelConfig {
    let tokens = all_pairs_tokens();
    config(
        3,
        tokens,
        blocks,
        schedule,
        &[LD, LC, LD, LC, LD, LC],
        masking,
    )
}

/// Rank 1 stops before each op of an LL sequence, and at every step of an LL dispatch (op 2):
/// both survivors keep completing every later op, bit-exact against the reference without
/// rank 1's tokens. Under both schedules, with one and two sender blocks.
#[test]
fn survivors_complete_after_a_stop_at_a_dispatch() {
    let mut changed = 0;
    for schedule in Schedule::ALL {
        for blocks in [1, 2] {
            let cfg = three_ranks(schedule, blocks, true);
            let mut runs: Vec<ModelConfig> = [0, 2, 4]
                .into_iter()
                .map(|op| stopping(&cfg, 1, op, Step::F1))
                .collect();
            if blocks == 2 {
                runs.extend(stop_points(&cfg, 1, 2));
            }
            for run in runs {
                changed += survivors_complete(&run);
            }
        }
    }
    assert!(
        changed > 0,
        "no survivor output changed: the stops were not seen"
    );
}

/// Rank 2 stops between an LL dispatch and its combine (before each LL combine), and at every
/// step of an LL combine (op 3): the survivors' combines add nothing for the entries whose
/// expert is on rank 2, and every later op completes without it.
#[test]
fn survivors_complete_after_a_stop_at_a_combine() {
    let mut changed = 0;
    for schedule in Schedule::ALL {
        for blocks in [1, 2] {
            let cfg = three_ranks(schedule, blocks, true);
            let mut runs: Vec<ModelConfig> = [1, 3, 5]
                .into_iter()
                .map(|op| stopping(&cfg, 2, op, Step::F1))
                .collect();
            if blocks == 2 {
                runs.extend(stop_points(&cfg, 2, 3));
            }
            for run in runs {
                changed += survivors_complete(&run);
            }
        }
    }
    assert!(
        changed > 0,
        "no survivor output changed: the stops were not seen"
    );
}

/// Four ranks, normal ops interleaved with LL ops before the stop (the LL combine after a
/// normal combine returns the rows of the LL dispatch before it): the LL ops after the stop
/// complete without the stopped rank; the ops before it are unaffected.
#[test]
fn four_ranks_with_normal_ops_before_the_stop() {
    let ops = [D, LD, OpKind::Combine, LC, LD, LC];
    for schedule in Schedule::ALL {
        for (rank, op) in [(3, 3), (0, 4), (2, 5)] {
            let cfg = config(4, 2, 1, schedule, &ops, true);
            survivors_complete(&stopping(&cfg, rank, op, Step::F1));
        }
    }
}

/// A masked rank is not waited for again: after the op that met the stop (one timeout),
/// seven more LL ops run at once, so the whole run takes far less than a timeout per op.
#[test]
fn a_masked_rank_is_waited_for_once() {
    let mut ops = vec![LD];
    for _ in 0..4 {
        ops.extend([LC, LD]);
    }
    let cfg = stopping(
        &config(3, 2, 1, Schedule::Epoch, &ops, true),
        1,
        1,
        Step::F1,
    );
    let start = Instant::now();
    survivors_complete(&cfg);
    let took = start.elapsed();
    assert!(
        took < TIMEOUT * 4,
        "{took:?} for {} ops after the stop: masked waits must not wait out the timeout",
        ops.len() - 1
    );
}

/// Random LL sequences under random delays, a random rank stopping at a random point (before
/// an op, or at a step of one): the run obeys the stop rule (`run_model`) and the survivors
/// complete every op.
#[test]
fn stops_under_random_delays() {
    let seed = 0x5709_0001;
    let mut rng = Rng(seed);
    for run in 0..24u64 {
        let schedule = Schedule::ALL[rng.below(2) as usize];
        let world = 2 + rng.below(3) as usize;
        let mut ops = vec![LD];
        while ops.len() < 3 + rng.below(4) as usize {
            ops.push(if rng.below(2) == 0 { LD } else { LC });
        }
        let cfg = config(
            world,
            1 + rng.below(3) as usize,
            1 + rng.below(2) as usize,
            schedule,
            &ops,
            true,
        );
        let (rank, op) = (
            rng.below(world as u64) as usize,
            rng.below(ops.len() as u64) as usize,
        );
        let points = stop_points(&cfg, rank, op);
        let cfg = points[rng.below(points.len() as u64) as usize].clone();
        let jitter = Jitter::new(seed ^ run.wrapping_mul(0x2545_F491_4F6C_DD1D));
        let reports =
            run_model(&cfg, &jitter).unwrap_or_else(|f| panic!("run {run}, {cfg:?}: {f}"));
        for r in reports.iter().filter(|r| r.rank != rank) {
            assert!(
                r.outputs.iter().all(Result::is_ok),
                "run {run}, {cfg:?}: {r:?}"
            );
        }
    }
}

/// With masking on and no rank stopping, LL ops mixed with normal ops under random delays are
/// exactly the sequential reference: masking changes nothing while every rank answers.
#[test]
fn masking_without_a_stop_changes_nothing() {
    let seed = 0x5709_0002;
    let mut rng = Rng(seed);
    for run in 0..40u64 {
        let schedule = Schedule::ALL[rng.below(2) as usize];
        let mut ops = vec![D, LD];
        while ops.len() < 4 + rng.below(4) as usize {
            ops.push([D, LD, LC, OpKind::Combine, OpKind::CachedDispatch][rng.below(5) as usize]);
        }
        let world = 2 + rng.below(3) as usize;
        let cfg = ModelConfig::new(
            world,
            1 + rng.below(4) as usize,
            1 + rng.below(2) as usize,
            schedule,
            ops,
        )
        .unwrap()
        .with_ll_masking(true);
        let jitter = Jitter::new(seed ^ run);
        let got = run_model(&cfg, &jitter).unwrap_or_else(|f| panic!("run {run}, {cfg:?}: {f}"));
        assert_eq!(got, sequential_reference(&cfg), "run {run}");
    }
}

// ---- without masking, and the ops that never mask: errors, no hang ------------------------

/// The survivors' results when their waits for the stopped rank `stopped` cannot be masked:
/// they complete every op before `cut`, and their first error, in op `cut - 1` or `cut`, is a
/// wait that expired on `stopped` or gives up on a survivor whose did; every later op is
/// refused. At least one survivor's wait expired.
fn assert_survivors_fail_at(reports: &[RankReport], stopped: usize, cut: usize) {
    let expired: Vec<usize> = reports
        .iter()
        .filter(|r| {
            r.outputs
                .iter()
                .any(|o| matches!(o, Err(OpError::Expired { peer, .. }) if *peer == stopped))
        })
        .map(|r| r.rank)
        .collect();
    assert!(
        !expired.is_empty(),
        "no survivor's wait expired: {reports:?}"
    );
    for r in reports.iter().filter(|r| r.rank != stopped) {
        let first = r.outputs.iter().position(Result::is_err).unwrap();
        assert!(
            first + 1 >= cut && first <= cut,
            "rank {}: {:?}",
            r.rank,
            r.outputs
        );
        let gave_up = |o: &OpResult| match o {
            Err(OpError::Expired { peer, .. }) => *peer == stopped,
            Err(OpError::Aborted { by, .. } | OpError::Refused { by }) => expired.contains(by),
            _ => false,
        };
        assert!(
            gave_up(&r.outputs[first]),
            "rank {}: {:?}",
            r.rank,
            r.outputs
        );
        assert!(
            r.outputs[first + 1..]
                .iter()
                .all(|o| matches!(o, Err(OpError::Refused { .. }))),
            "rank {}: {:?}",
            r.rank,
            r.outputs
        );
    }
}

/// Masking off: a rank that stops (before an LL dispatch, before an LL combine, or in the
/// middle of one) fails the op on every survivor (their waits expire on it, the first one
/// publishes the abort word) and every later op, as a crash does; nothing completes without
/// it and nothing hangs. A stop after the rank's last signal of an op lets the survivors
/// complete that op only.
#[test]
fn without_masking_a_stop_fails_every_later_op() {
    for schedule in Schedule::ALL {
        let cfg = three_ranks(schedule, 1, false);
        let mut runs: Vec<ModelConfig> = (0..3).map(|op| stopping(&cfg, 1, op, Step::F1)).collect();
        runs.extend(
            [Step::L3, Step::L4, Step::L5, Step::L9]
                .into_iter()
                .filter(|&at| StoppedRank::step_is_valid(schedule, cfg.ops()[3], at))
                .map(|at| stopping(&cfg, 2, 3, at)),
        );
        for run in runs {
            let reports = run_model(&run, &NoHook).unwrap_or_else(|f| panic!("{run:?}: {f}"));
            let s = run.stopped_rank().unwrap();
            let cut = if s.after_done() { s.op + 1 } else { s.op };
            assert_survivors_fail_at(&reports, s.rank, cut);
        }
    }
}

/// With masking on, the normal ops still do not mask: the LL ops after the stop complete
/// without the stopped rank, the first normal op fails on every survivor (its waits expire),
/// and every op after it, LL ones included, is refused.
#[test]
fn normal_ops_do_not_mask() {
    let ops = [LD, LC, LD, D, LD, LC];
    for schedule in Schedule::ALL {
        let cfg = stopping(&config(3, 3, 1, schedule, &ops, true), 0, 1, Step::F1);
        let reports = run_model(&cfg, &NoHook).unwrap_or_else(|f| panic!("{cfg:?}: {f}"));
        let reference = survivor_reference(&cfg);
        for r in &reports[1..] {
            // op 2 may see the abort word of a survivor that already failed op 3.
            assert_eq!(r.outputs[1], reference[r.rank].outputs[1]);
        }
        assert_survivors_fail_at(&reports, 0, 3);
    }
}

/// An injected failure (a crash: its wait times out, it publishes the abort word) ends every
/// later op in an error with masking on exactly as without: masking masks only ranks whose
/// waits expire, and a crashed rank's abort word ends the peers' waits first. Every failure
/// point of an LL sequence, on two and three ranks, under both schedules.
#[test]
fn masking_keeps_the_crash_rule() {
    for schedule in Schedule::ALL {
        for world in [2, 3] {
            let cfg = ModelConfig::new(world, 2, 1, schedule, vec![LD, LC, LD, LC]).unwrap();
            for op in 0..cfg.ops().len() {
                for at in Step::ALL {
                    if !Failure::step_is_valid(schedule, cfg.ops()[op], at) {
                        continue;
                    }
                    let failure = Failure {
                        rank: world - 1,
                        op,
                        at,
                    };
                    for masking in [false, true] {
                        let run = cfg
                            .clone()
                            .with_ll_masking(masking)
                            .with_failure(failure)
                            .unwrap();
                        let reports =
                            run_model(&run, &NoHook).unwrap_or_else(|f| panic!("{run:?}: {f}"));
                        assert_eq!(
                            reports[failure.rank].outputs[op],
                            Err(OpError::TimedOut { step: at })
                        );
                        for r in &reports {
                            assert!(
                                r.outputs[op + 1..].iter().all(Result::is_err),
                                "{run:?}: {r:?}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// The premise of masking, in the model: only a rank that stopped is masked. A live rank that
/// stalls past the timeout (while another rank stopped) is reported as a timeout, not masked.
#[test]
fn a_stalled_live_rank_is_a_timeout_not_a_mask() {
    struct Stall;
    impl StepHook for Stall {
        fn at(&self, rank: usize, op: usize, _kind: OpKind, step: Step) {
            if (rank, op, step) == (1, 2, Step::L4) {
                std::thread::sleep(TIMEOUT * 3);
            }
        }
    }
    let cfg = stopping(&three_ranks(Schedule::Epoch, 1, true), 2, 1, Step::F1);
    let failure = run_model(&cfg, &Stall).expect_err("rank 1 stalls past the timeout");
    match &failure.violations[0] {
        Violation::Timeout {
            rank: 0,
            op: 2,
            step: Step::L5,
            peer: 1,
            ..
        } => {}
        other => panic!("expected rank 0 to time out on rank 1 in [L5] of op 2, got {other}"),
    }
}

// ---- mutations of the masked receive phases --------------------------------------------------

/// Rank 2 stops before its done signal `[L4]` of LL dispatch 1, after storing its counts and
/// rows; rank 0 receives a row of it. The survivors mask rank 2 in `[L5]`, so they must count
/// no rows from it; a receive phase that keeps the masked source's count word (tagged with
/// this op) packs its rows, which the reference without rank 2 does not have (or reads a row
/// that its missing done signal never published).
#[test]
fn keeping_a_masked_sources_counts_is_caught() {
    assert!(
        (0..all_pairs_tokens()).any(|t| ll_routes_to(1, 2, t, 0)),
        "the LL routing changed: rank 2 must send rank 0 a row in LL dispatch 1"
    );
    let cfg = stopping(&three_ranks(Schedule::Epoch, 1, true), 2, 0, Step::L4);
    survivors_complete(&cfg);
    let failure = run_model(&cfg.with_mutation(Mutation::LlMaskedCountsKept), &NoHook)
        .expect_err("the mutated receive phase packs the masked source's rows");
    match &failure.violations[0] {
        Violation::Outcome(OutcomeViolation::Output { op: 0, rank, .. }) if *rank != 2 => {}
        Violation::Data {
            op: 0,
            step: Step::L7,
            region: Region::LlX,
            ..
        } => {}
        other => panic!("expected rank 2's rows in a survivor's LL dispatch, got {other}"),
    }
}

/// Rank 2 stops before the LL combine, so it returns no combine rows; rank 0 sent it a token
/// in the LL dispatch before. The survivors skip the entries whose expert is on rank 2; a
/// reduction that adds them reads a combine row rank 2 never wrote.
#[test]
fn reducing_a_masked_entry_is_caught() {
    assert!(
        (0..all_pairs_tokens()).any(|t| ll_routes_to(1, 0, t, 2)),
        "the LL routing changed: rank 0 must send rank 2 a row in LL dispatch 1"
    );
    let cfg = stopping(&three_ranks(Schedule::Epoch, 1, true), 2, 1, Step::F1);
    survivors_complete(&cfg);
    let failure = run_model(
        &cfg.with_mutation(Mutation::LlMaskedEntriesReduced),
        &NoHook,
    )
    .expect_err("the mutated reduction reads a row the masked rank never wrote");
    match &failure.violations[0] {
        Violation::Data {
            op: 1,
            step: Step::L9,
            region: Region::LlComb,
            found: 0,
            slot,
            ..
        } => assert_eq!(
            slot % 3,
            2,
            "the entry of rank 2 (slot = token * world + k)"
        ),
        other => panic!("expected an unwritten combine row of rank 2 at [L9], got {other}"),
    }
}

/// The outcome rule itself catches survivors that complete with the full reference after a
/// stop: `check_outcome` rejects the reference with rank 1's rows for an op where it is masked.
#[test]
fn the_full_reference_is_not_a_survivor_outcome() {
    let cfg = stopping(&three_ranks(Schedule::Epoch, 1, true), 1, 2, Step::F1);
    let mut reports = sequential_reference(&cfg);
    reports[1].outputs = (0..cfg.ops().len())
        .map(|op| {
            if op < 2 {
                reports[1].outputs[op].clone()
            } else {
                Err(OpError::Stopped { step: Step::F1 })
            }
        })
        .collect();
    assert!(matches!(
        check_outcome(&cfg, &reports),
        Err(OutcomeViolation::Output { op: 2, .. })
    ));
}
