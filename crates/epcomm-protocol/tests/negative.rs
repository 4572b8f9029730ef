//! Deterministic schedules that break the deliberately unsound `EpochWithoutParity` variant,
//! and pass on the real `Epoch` strategy: proof that the model can fail.
#![cfg(not(loom))]

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::Pause;
use epcomm_protocol::config::route_count;
use epcomm_protocol::model::Region;
use epcomm_protocol::{
    ModelConfig, OpKind, Step, StepHook, Strategy, Violation, run_model, sequential_reference,
};

fn run(strategy: Strategy, tokens: usize, ops: &[OpKind], pause: &Pause) -> Result<(), Violation> {
    let cfg = ModelConfig::new(2, tokens, 1, strategy, ops.to_vec()).unwrap();
    let result = run_model(&cfg, pause);
    assert!(
        !pause.gave_up.load(Ordering::SeqCst),
        "{strategy:?}: the forced schedule was not reached"
    );
    match result {
        Ok(reports) => {
            assert_eq!(reports, sequential_reference(&cfg));
            Ok(())
        }
        Err(f) => Err(f.violations[0].clone()),
    }
}

/// Rank 1 is delayed between [E6] and [E7] of dispatch 1 while rank 0 starts dispatch 2 and
/// writes its counts: with one count region, rank 1 then reads a count tagged with epoch 2.
#[test]
fn single_count_region_reads_next_epoch_count() {
    use OpKind::*;
    let ops = [Dispatch, Dispatch, Combine];
    let pause = || Pause::new(1, (0, Step::E7), 0, (1, Step::E2));
    run(Strategy::Epoch, 2, &ops, &pause()).expect("parity regions keep the counts apart");
    let v = run(Strategy::EpochWithoutParity, 2, &ops, &pause()).unwrap_err();
    match v {
        Violation::CountTag {
            rank: 1,
            op: 0,
            step: Step::E7,
            expected: 1,
            found: 2,
            ..
        } => {}
        other => panic!("expected a stale count at [E7], got {other}"),
    }
}

/// Rank 1 still holds the output of dispatch 1 when rank 0 runs the cached dispatch 2: with one
/// receive region, rank 1 sees rows of epoch 2 (at its [R] recheck, or already at [E7] when
/// rank 0 overtakes it before the pause point).
#[test]
fn single_recv_region_overwrites_live_output() {
    use OpKind::*;
    let tokens = 4;
    assert!(
        route_count(1, tokens, 0, 1) > 0,
        "rank 0 must send to rank 1 for this schedule"
    );
    let ops = [Dispatch, CachedDispatch, Combine];
    let pause = || Pause::new(1, (1, Step::Recheck), 0, (1, Step::E6));
    run(Strategy::Epoch, tokens, &ops, &pause()).expect("parity regions keep the rows apart");
    let v = run(Strategy::EpochWithoutParity, tokens, &ops, &pause()).unwrap_err();
    match v {
        Violation::Data {
            rank: 1,
            step: Step::Recheck | Step::E7,
            region: Region::Recv,
            found,
            ..
        } => assert_eq!(found >> 32, 2, "overwritten by dispatch 2"),
        other => panic!("expected an overwritten recv slot, got {other}"),
    }
}

/// Rank 1 reduces combine 1 late while rank 0 already writes combine 2's contributions.
#[test]
fn single_comb_region_overwrites_unreduced_contributions() {
    use OpKind::*;
    let tokens = 4;
    assert!(
        (0..tokens).any(|t| epcomm_protocol::config::routes_to(1, 1, t, 0)),
        "rank 1 must own a token routed to rank 0 for this schedule"
    );
    let ops = [Dispatch, Combine, Combine];
    let pause = || Pause::new(1, (1, Step::C4), 0, (2, Step::C3));
    run(Strategy::Epoch, tokens, &ops, &pause()).expect("parity regions keep combines apart");
    let v = run(Strategy::EpochWithoutParity, tokens, &ops, &pause()).unwrap_err();
    match v {
        Violation::Data {
            rank: 1,
            op: 1,
            step: Step::C4,
            region: Region::Comb,
            ..
        } => {}
        other => panic!("expected an overwritten comb slot, got {other}"),
    }
}

/// A rank that never shows up makes its peer's bounded wait expire, naming op, wait and peer.
#[test]
fn bounded_wait_names_op_wait_and_peer() {
    struct Stall;
    impl StepHook for Stall {
        fn at(&self, rank: usize, op: usize, _kind: OpKind, step: Step) {
            if (rank, op, step) == (1, 1, Step::E1) {
                std::thread::sleep(Duration::from_millis(400));
            }
        }
    }
    use OpKind::*;
    let cfg = ModelConfig::new(2, 2, 1, Strategy::Epoch, vec![Dispatch, Dispatch])
        .unwrap()
        .with_wait_timeout(Duration::from_millis(50))
        .unwrap();
    let failure = run_model(&cfg, &Stall).unwrap_err();
    match &failure.violations[0] {
        Violation::Timeout {
            rank: 0,
            op: 1,
            step: Step::E2,
            peer: 1,
            expected: 2,
            seen: 0,
            ..
        } => {}
        other => panic!("expected rank 0 to time out in [E2] on peer 1, got {other}"),
    }
    let text = failure.violations[0].to_string();
    assert!(
        text.contains("op 1") && text.contains("[E2]") && text.contains("peer 1"),
        "{text}"
    );
}
