//! The failure path of the hierarchical internode ops on std threads: injected failures (a
//! crash: the rank's wait times out, it publishes the abort word) at every rank, op and step of
//! internode dispatch / cached dispatch / combine sequences on the shapes 2x1, 1x2 and 2x2,
//! judged by `check_outcome_internode` (through `run_model`); stalled ranks (no abort word)
//! whose dependents' bounded waits expire naming the peer they wait for; and a mutation of
//! the failure path (a forwarder that ignores the abort word) that the model catches.
#![cfg(not(loom))]

mod common;

use std::time::Duration;

use common::{Jitter, Rng};
use epcomm_protocol::config::route_count;
use epcomm_protocol::{
    Failure, ModelConfig, Mutation, NoHook, OpError, OpKind, OpResult, RailRing, Schedule, Step,
    StepHook, Violation, failure_fires, run_model,
};

use OpKind::{InternodeCachedDispatch as Icd, InternodeCombine as Ic, InternodeDispatch as Id};

const SHAPES: [(usize, usize); 3] = [(2, 1), (1, 2), (2, 2)];

fn internode(
    nodes: usize,
    local: usize,
    tokens: usize,
    schedule: Schedule,
    ops: &[OpKind],
) -> ModelConfig {
    ModelConfig::new(nodes * local, tokens, 1, schedule, ops.to_vec())
        .unwrap()
        .with_nodes(nodes)
        .unwrap()
        .with_wait_timeout(Duration::from_secs(3))
        .unwrap()
}

/// The failures of `cfg` that fire: every rank, op and valid step.
fn failures(cfg: &ModelConfig) -> Vec<ModelConfig> {
    let mut out = Vec::new();
    for rank in 0..cfg.world() {
        for (op, &kind) in cfg.ops().iter().enumerate() {
            for at in Step::ALL {
                if !Failure::step_is_valid(cfg.schedule(), kind, at) {
                    continue;
                }
                let c = cfg.clone().with_failure(Failure { rank, op, at }).unwrap();
                if failure_fires(&c) {
                    out.push(c);
                }
            }
        }
    }
    out
}

/// Every op of a peer that ended in an error names the failing rank first.
fn gave_up_on(result: &OpResult, failed: usize) -> bool {
    matches!(result, Err(OpError::Aborted { by, .. } | OpError::Refused { by }) if *by == failed)
}

/// Runs every failure that fires in each of `configs` (no delays) and checks what the rule
/// does not: the failing op times out where configured, and every peer's first error names
/// the failing rank. Requires more than `min_runs` runs, some peer op completed at or after the
/// failing op (one that does not depend on it) and some peer that gave up.
fn crash_everywhere(configs: impl IntoIterator<Item = ModelConfig>, min_runs: usize) {
    let (mut runs, mut completed_after, mut gave_up) = (0, 0, 0);
    for cfg in configs.into_iter().flat_map(|c| failures(&c)) {
        let f = cfg.failure().unwrap();
        let reports = run_model(&cfg, &NoHook).unwrap_or_else(|e| panic!("{cfg:?}: {e}"));
        assert_eq!(
            reports[f.rank].outputs[f.op],
            Err(OpError::TimedOut { step: f.at })
        );
        for r in reports.iter().filter(|r| r.rank != f.rank) {
            completed_after += r.outputs[f.op..].iter().filter(|o| o.is_ok()).count();
            if let Some(first) = r.outputs.iter().find(|o| o.is_err()) {
                assert!(gave_up_on(first, f.rank), "{cfg:?}: {first:?}");
                gave_up += 1;
            }
        }
        runs += 1;
    }
    eprintln!(
        "{runs} runs, {completed_after} peer ops completed at or after the failing op, {gave_up} peers gave up"
    );
    assert!(runs > min_runs, "{runs} runs");
    assert!(
        completed_after > 0 && gave_up > 0,
        "{completed_after} {gave_up}"
    );
}

/// Every failure that fires, at every rank, op and step of three internode sequences, on each
/// shape and schedule: the run ends (no hang), the failing op times out, and the outcome obeys
/// the internode rule. Some peers complete ops at or after the failing one (those that do not
/// depend on it), some end in errors naming the failing rank. The fourth sequence mixes in
/// intranode ops, which the rule treats as waiting for every rank.
#[test]
fn crash_anywhere_ends_dependent_ops_in_errors() {
    let sequences: [&[OpKind]; 4] = [
        &[Id, Icd, Ic, Icd],
        &[Id, Ic, Id, Ic],
        &[Id, Icd, Icd, Ic, Ic],
        // Mixed with the intranode ops (which wait for every rank's done signals).
        &[Id, OpKind::Dispatch, Icd, OpKind::Combine, Ic],
    ];
    let configs = Schedule::ALL.into_iter().flat_map(|schedule| {
        SHAPES.into_iter().flat_map(move |(nodes, local)| {
            sequences
                .into_iter()
                .map(move |ops| internode(nodes, local, 3, schedule, ops))
        })
    });
    crash_everywhere(configs, 300);
}

/// The same with chunked forwarding (rings of one and two slots of one row, one slot of two
/// rows; up to five tokens so that an op sends more chunks than a ring holds), failures before and after the ring's steps, on
/// the shapes with a rail: a sender whose next slot waits for a failed forwarder's credit, and
/// a forwarder whose chunks never come, end in errors naming the failing rank; ops that do not
/// depend on it may complete.
#[test]
fn crash_anywhere_with_the_ring() {
    let sequences: [&[OpKind]; 3] = [&[Id, Icd, Ic, Icd], &[Id, Ic, Id, Ic], &[Id, Icd, Icd]];
    let mut configs = Vec::new();
    for schedule in Schedule::ALL {
        for (nodes, local) in [(2, 1), (2, 2)] {
            for ops in sequences {
                for (tokens, slots, chunk_rows) in [(3, 1, 1), (5, 2, 1), (5, 1, 2)] {
                    configs.push(
                        internode(nodes, local, tokens, schedule, ops)
                            .with_rail_ring(RailRing { slots, chunk_rows })
                            .unwrap(),
                    );
                }
            }
        }
    }
    crash_everywhere(configs, 200);
}

/// Random failures under random delays (internode dispatch, cached dispatch and combine; every
/// other run with chunked forwarding).
#[test]
fn crash_under_random_delays() {
    let seed = 0xFA11_1A7E;
    let mut rng = Rng(seed);
    let mut run = 0u64;
    while run < 100 {
        let (nodes, local) = SHAPES[rng.below(3) as usize];
        let mut ops = vec![Id];
        for _ in 0..2 + rng.below(4) {
            ops.push([Id, Icd, Ic][rng.below(3) as usize]);
        }
        let schedule = if rng.below(4) == 0 {
            Schedule::Global
        } else {
            Schedule::Epoch
        };
        let tokens = 1 + rng.below(3) as usize;
        let mut cfg = internode(nodes, local, tokens, schedule, &ops);
        // Every other run forwards through a ring of one or two slots.
        if run % 2 == 1 {
            let ring = RailRing {
                slots: 1 + rng.below(2) as usize,
                chunk_rows: 1 + rng.below(2) as usize,
            };
            cfg = cfg.with_rail_ring(ring).unwrap();
        }
        let all = failures(&cfg);
        let cfg = all[rng.below(all.len() as u64) as usize].clone();
        let jitter = Jitter::new(seed ^ run.wrapping_mul(0x2545_F491_4F6C_DD1D));
        run_model(&cfg, &jitter).unwrap_or_else(|e| panic!("run {run}, {cfg:?}: {e}"));
        run += 1;
    }
}

/// Sleeps rank `rank` before `(op, step)` (a stalled rank: no failure, no abort word).
struct Stall {
    rank: usize,
    op: usize,
    step: Step,
}

impl StepHook for Stall {
    fn at(&self, rank: usize, op: usize, _kind: OpKind, step: Step) {
        if (rank, op, step) == (self.rank, self.op, self.step) {
            std::thread::sleep(Duration::from_millis(400));
        }
    }
}

/// `tokens` such that `src`'s tokens go to `dst` under the first layout.
fn tokens_routing(src: usize, dst: usize) -> usize {
    (1..16)
        .find(|&t| route_count(1, t, src, dst) > 0)
        .expect("some token routes")
}

fn stalled(cfg: &ModelConfig, stall: Stall) -> Vec<Violation> {
    let cfg = cfg
        .clone()
        .with_wait_timeout(Duration::from_millis(50))
        .unwrap();
    let failure = run_model(&cfg, &stall).expect_err("a stalled rank makes a wait expire");
    failure
        .violations
        .into_iter()
        .filter(|v| !v.is_secondary())
        .collect()
}

/// 2x1: rank 1 (node 1) stalls before it signals its rail rows `[I7]`: its rail peer, the
/// forwarder rank 0, times out in `[I8]` naming rank 1.
#[test]
fn stalled_rail_peer_times_out_the_forwarder() {
    let cfg = internode(2, 1, tokens_routing(1, 0), Schedule::Epoch, &[Id, Icd]);
    let violations = stalled(
        &cfg,
        Stall {
            rank: 1,
            op: 0,
            step: Step::I7,
        },
    );
    match &violations[..] {
        [
            Violation::Timeout {
                rank: 0,
                op: 0,
                step: Step::I8,
                peer: 1,
                ..
            },
        ] => {}
        other => panic!("expected the forwarder to time out in [I8] on peer 1, got {other:?}"),
    }
}

/// 2x1 with a ring of one slot (chunked forwarding), three tokens: each rank sends the other
/// two chunks. Rank 1 stalls before it forwards rank 0's first chunk `[I9c]`: rank 0, whose
/// second chunk needs that slot, times out in `[I6c]` naming rank 1, the credit it saw (0)
/// and the one it needs (1).
#[test]
fn stalled_forwarder_times_out_its_ring_sender() {
    let crossing = |src: usize, dst: usize| route_count(1, 3, src, dst);
    assert!(
        crossing(0, 1) == 2 && crossing(1, 0) == 2,
        "the routing oracle changed: pick another layout for this schedule"
    );
    let cfg = internode(2, 1, 3, Schedule::Epoch, &[Id])
        .with_rail_ring(RailRing {
            slots: 1,
            chunk_rows: 1,
        })
        .unwrap();
    let violations = stalled(
        &cfg,
        Stall {
            rank: 1,
            op: 0,
            step: Step::I9c,
        },
    );
    match &violations[..] {
        [
            Violation::Timeout {
                rank: 0,
                op: 0,
                step: Step::I6c,
                peer: 1,
                expected: 1,
                seen: 0,
                ..
            },
        ] => {}
        other => panic!("expected the sender to time out in [I6c] on peer 1, got {other:?}"),
    }
}

/// 2x1, internode combine: the forwarder rank 0 stalls before it signals its partials `[J7]`:
/// the source, rank 1 (node 1), times out in `[J8]` naming rank 0.
#[test]
fn stalled_forwarder_times_out_the_source_in_combine() {
    let cfg = internode(2, 1, tokens_routing(1, 0), Schedule::Epoch, &[Id, Ic]);
    let violations = stalled(
        &cfg,
        Stall {
            rank: 0,
            op: 1,
            step: Step::J7,
        },
    );
    match &violations[..] {
        [
            Violation::Timeout {
                rank: 1,
                op: 1,
                step: Step::J8,
                peer: 0,
                ..
            },
        ] => {}
        other => panic!("expected the source to time out in [J8] on peer 0, got {other:?}"),
    }
}

/// 2x2: rank 0 stalls before `[I7]` of a cached dispatch: every wait that expires names the
/// peer it waits for — rank 0 itself (its forwarder rank 2 in `[I8]`, its node peer rank 1
/// in `[I11]`) or, for rank 3, whose rows from rank 0 come through rank 2, the forwarder.
#[test]
fn stalled_source_in_two_by_two_names_the_awaited_peer() {
    let cfg = internode(2, 2, 3, Schedule::Epoch, &[Id, Icd]);
    let violations = stalled(
        &cfg,
        Stall {
            rank: 0,
            op: 1,
            step: Step::I7,
        },
    );
    assert!(!violations.is_empty());
    for v in &violations {
        match v {
            Violation::Timeout {
                rank: 2,
                op: 1,
                step: Step::I8,
                peer: 0,
                ..
            }
            | Violation::Timeout {
                rank: 1,
                op: 1,
                step: Step::I11,
                peer: 0,
                ..
            }
            | Violation::Timeout {
                rank: 3,
                op: 1,
                step: Step::I11,
                peer: 2,
                ..
            } => {}
            other => panic!("unexpected violation {other}"),
        }
        let text = v.to_string();
        assert!(text.contains("op 1") && text.contains("peer"), "{text}");
    }
}

/// A forwarder that ignores the abort word: rank 1 (node 1) fails before it signals its rail
/// rows `[I7]`. Unmutated, the forwarder rank 0 gives up in `[I8]` on the abort word, naming
/// rank 1; with `InterForwarderIgnoresAbort` it keeps waiting until its bounded wait expires.
#[test]
fn forwarder_ignoring_the_abort_word_is_caught() {
    let cfg = internode(2, 1, tokens_routing(1, 0), Schedule::Epoch, &[Id, Icd, Ic])
        .with_wait_timeout(Duration::from_millis(200))
        .unwrap()
        .with_failure(Failure {
            rank: 1,
            op: 0,
            at: Step::I7,
        })
        .unwrap();
    let reports = run_model(&cfg, &NoHook).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        reports[0].outputs[0],
        Err(OpError::Aborted {
            step: Step::I8,
            peer: 1,
            by: 1
        })
    );
    assert!(
        reports[0].outputs[1..]
            .iter()
            .all(|o| matches!(o, Err(OpError::Refused { .. })))
    );
    let failure = run_model(
        &cfg.with_mutation(Mutation::InterForwarderIgnoresAbort),
        &NoHook,
    )
    .expect_err("the mutated forwarder hangs until its wait expires");
    match &failure.violations[0] {
        Violation::Timeout {
            rank: 0,
            op: 0,
            step: Step::I8,
            peer: 1,
            ..
        } => {}
        other => panic!("expected the forwarder to time out in [I8] on peer 1, got {other}"),
    }
}
