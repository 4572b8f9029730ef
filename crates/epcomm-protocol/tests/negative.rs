//! Deterministic schedules that break the deliberately unsound single-region variant
//! (`Mutation::SingleRegion`) or another mutated protocol, and pass on the real protocol: proof that the model can fail. Also the
//! failure path on std threads.
#![cfg(not(loom))]

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::Pause;
use epcomm_protocol::config::{
    combine_word, data_word, inter_combine_word, route_count, routes_to,
};
use epcomm_protocol::model::Region;
use epcomm_protocol::{
    Failure, ModelConfig, Mutation, NoHook, OpError, OpKind, OpResult, Schedule, Step, StepHook,
    Violation, run_model, sequential_reference,
};

/// Two ranks, one block, the Epoch schedule.
fn epoch(tokens: usize, ops: &[OpKind]) -> ModelConfig {
    ModelConfig::new(2, tokens, 1, Schedule::Epoch, ops.to_vec()).unwrap()
}

/// Runs `cfg` under `pause()`, which must pass, then `cfg` with `mutation` under `pause()`,
/// which must fail; returns the mutated run's first violation. `reachable` says whether the
/// protocol itself reaches the forced schedule (when it cannot, the pause gives up quickly).
fn caught_only_when_mutated(
    cfg: &ModelConfig,
    mutation: Mutation,
    pause: impl Fn() -> Pause,
    reachable: bool,
) -> Violation {
    let unmutated = if reachable {
        pause()
    } else {
        pause().giving_up_after(Duration::from_millis(300))
    };
    run_cfg(cfg, &unmutated, reachable)
        .unwrap_or_else(|v| panic!("{cfg:?} must pass unmutated: {v}"));
    run_cfg(&cfg.clone().with_mutation(mutation), &pause(), true)
        .expect_err("the mutated protocol must fail under the forced schedule")
}

/// Like [`caught_only_when_mutated`] for a schedule the protocol cannot reach, when the
/// mutated run may also fail elsewhere first (another rank hits the same bug and the run ends
/// before the forced schedule is reached): returns the mutated run's first violation without
/// requiring the forced schedule.
fn caught_when_mutated_anywhere(
    cfg: &ModelConfig,
    mutation: Mutation,
    pause: impl Fn() -> Pause,
) -> Violation {
    let unmutated = pause().giving_up_after(Duration::from_millis(300));
    run_cfg(cfg, &unmutated, false).unwrap_or_else(|v| panic!("{cfg:?} must pass unmutated: {v}"));
    let forced = pause().giving_up_after(Duration::from_secs(1));
    let failure = run_model(&cfg.clone().with_mutation(mutation), &forced)
        .expect_err("the mutated protocol must fail under the forced schedule");
    failure.violations[0].clone()
}

/// Runs `cfg` under `pause`; `reachable` says whether the forced schedule must be reached.
fn run_cfg(cfg: &ModelConfig, pause: &Pause, reachable: bool) -> Result<(), Violation> {
    let result = run_model(cfg, pause);
    assert_eq!(
        !pause.gave_up.load(Ordering::SeqCst),
        reachable,
        "{cfg:?}: the forced schedule was {}reached",
        if reachable { "not " } else { "" }
    );
    match result {
        Ok(reports) => {
            assert_eq!(reports, sequential_reference(cfg));
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
    let pause = || Pause::new(1, (0, Step::E7), 0, (1, Step::E2));
    let cfg = epoch(2, &[Dispatch, Dispatch, Combine]);
    match caught_only_when_mutated(&cfg, Mutation::SingleRegion, pause, true) {
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
    let pause = || Pause::new(1, (1, Step::Recheck), 0, (1, Step::E6));
    let cfg = epoch(tokens, &[Dispatch, CachedDispatch, Combine]);
    match caught_only_when_mutated(&cfg, Mutation::SingleRegion, pause, true) {
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

/// Layout 1 with one token per rank: rank 0's token goes to rank 1 only, so rank 1 returns a
/// contribution into rank 0's combine region; rank 1's token stays on rank 1, so rank 1 waits for
/// no flag of rank 0: only `[C5]` keeps it from running combines ahead of rank 0.
fn rank_1_holds_no_token_for_rank_0() {
    assert!(
        routes_to(1, 0, 0, 1) && !routes_to(1, 1, 0, 0),
        "the routing oracle changed: pick another layout for this schedule"
    );
}

/// Rank 0 reduces combine 1 late. Without `[C5]` rank 1 runs combines 2 and 3 meanwhile and
/// overwrites the contribution rank 0 has not reduced yet (combine 3 reuses combine 1's parity).
/// With `[C5]` rank 1 is held in combine 1 until rank 0 signals, after its reduction, so the
/// schedule cannot happen.
#[test]
fn without_final_wait_a_combine_overwrites_unreduced_contributions() {
    use OpKind::*;
    rank_1_holds_no_token_for_rank_0();
    let cfg = epoch(1, &[Dispatch, Combine, Combine, Combine]);
    // [C5] holds rank 1 until rank 0 reduced: unmutated, the schedule cannot happen.
    let pause = || Pause::new(0, (1, Step::C4), 1, (3, Step::C4));
    match caught_only_when_mutated(&cfg, Mutation::SkipFinalWait, pause, false) {
        Violation::Data {
            rank: 0,
            op: 1,
            step: Step::C4,
            region: Region::Comb,
            parity: 1,
            expected,
            found,
            ..
        } => {
            let row = data_word(1, 0, 0);
            assert_eq!(expected, combine_word(1, 1, row));
            assert_eq!(found, combine_word(3, 1, row), "overwritten by combine 3");
        }
        // The same bug seen one step earlier: when rank 0 is slower still (a loaded machine),
        // rank 1, two ops ahead, has overwritten the intent slot rank 0 checks after its last
        // wait of an earlier op ([A2]: two slots hold only while no rank is two ops ahead).
        Violation::Intent {
            rank: 0,
            peer: 1,
            expected,
            seen,
            ..
        } => assert_eq!(
            seen >> 32,
            (expected >> 32) + 2,
            "rank 1's intent of two ops later in rank 0's slot"
        ),
        other => panic!("expected an overwritten comb slot, got {other}"),
    }
}

/// Without `[E6]` a cached dispatch reads its rows before they land (rank 0 is held before its
/// data while rank 1 reads).
#[test]
fn without_cached_done_wait_rows_are_read_before_they_land() {
    use OpKind::*;
    rank_1_holds_no_token_for_rank_0();
    let cfg = epoch(1, &[Dispatch, CachedDispatch]);
    // [E6] holds rank 1 until rank 0's rows landed: unmutated, the schedule cannot happen.
    let pause = || Pause::new(0, (1, Step::E4), 1, (1, Step::E7));
    match caught_only_when_mutated(&cfg, Mutation::SkipCachedDoneWait, pause, false) {
        Violation::Data {
            rank: 1,
            op: 1,
            step: Step::E7,
            region: Region::Recv,
            found: 0,
            ..
        } => {}
        other => panic!("expected a missing row at [E7], got {other}"),
    }
}

/// `result` is a peer's op that gave up on rank `failed`: in a wait (the abort word) or at its
/// prologue `[F1]`.
fn assert_gave_up_on(result: &OpResult, failed: usize) {
    assert!(
        matches!(
            result,
            Err(OpError::Aborted { by, .. } | OpError::Refused { by }) if *by == failed
        ),
        "expected an op that gave up on rank {failed}, got {result:?}"
    );
}

/// A failure before the done signal: the failing rank and its peer end every later op in an
/// error (the peer cannot complete the failing op either), and nothing hangs.
#[test]
fn failure_before_done_ends_every_later_op_in_error() {
    use OpKind::*;
    let cfg = epoch(2, &[Dispatch, Combine, CachedDispatch, Combine])
        .with_failure(Failure {
            rank: 1,
            op: 1,
            at: Step::C2,
        })
        .unwrap();
    let reports = run_model(&cfg, &NoHook).unwrap_or_else(|f| panic!("{f}"));
    let reference = sequential_reference(&cfg);
    assert_eq!(reports[1].outputs[0], reference[1].outputs[0]);
    assert_eq!(
        reports[1].outputs[1],
        Err(OpError::TimedOut { step: Step::C2 })
    );
    // Rank 0 may see the abort word before rank 1's last done signal of op 0 and give up there.
    assert!(
        reports[0].outputs[0] == reference[0].outputs[0]
            || matches!(reports[0].outputs[0], Err(OpError::Aborted { by: 1, .. })),
        "{:?}",
        reports[0].outputs[0]
    );
    assert_gave_up_on(&reports[0].outputs[1], 1);
    for report in &reports {
        let later = &report.outputs[2..];
        assert!(
            later
                .iter()
                .all(|r| matches!(r, Err(OpError::Refused { .. }))),
            "rank {}: {later:?}",
            report.rank
        );
    }
}

/// A failure in the final wait, after the done signal: the peer may complete that op (it got
/// every row) but not the next one.
#[test]
fn failure_after_done_lets_the_peer_finish_that_op_only() {
    use OpKind::*;
    let cfg = epoch(2, &[Dispatch, CachedDispatch, Combine])
        .with_failure(Failure {
            rank: 0,
            op: 1,
            at: Step::E6,
        })
        .unwrap();
    // Rank 0 reaches its failure only once rank 1 has completed op 1 and started op 2.
    let pause = Pause::new(0, (1, Step::E6), 1, (2, Step::F1));
    let reports = run_model(&cfg, &pause).unwrap_or_else(|f| panic!("{f}"));
    assert!(!pause.gave_up.load(Ordering::SeqCst));
    let reference = sequential_reference(&cfg);
    assert_eq!(reports[1].outputs[..2], reference[1].outputs[..2]);
    assert_gave_up_on(&reports[1].outputs[2], 0);
    assert_eq!(
        reports[0].outputs[1],
        Err(OpError::TimedOut { step: Step::E6 })
    );
    assert_eq!(reports[0].outputs[2], Err(OpError::Refused { by: 0 }));
}

/// Without the prologue check the failed rank runs its next op and writes into its peer: first
/// its intent word (`[A1]`, the op's first write).
#[test]
fn without_prologue_check_a_failed_rank_writes_again() {
    use OpKind::*;
    rank_1_holds_no_token_for_rank_0();
    let cfg = epoch(1, &[Dispatch, CachedDispatch])
        .with_failure(Failure {
            rank: 0,
            op: 0,
            at: Step::E5,
        })
        .unwrap();
    let reports = run_model(&cfg, &NoHook).unwrap_or_else(|f| panic!("{f}"));
    assert_eq!(reports[0].outputs[1], Err(OpError::Refused { by: 0 }));
    let failure = run_model(&cfg.with_mutation(Mutation::SkipPrologueCheck), &NoHook).unwrap_err();
    match &failure.violations[0] {
        Violation::WriteAfterFailure {
            rank: 0,
            op: 1,
            step: Step::A1,
            ..
        } => {}
        other => panic!("expected rank 0 to write at [A1] of op 1, got {other}"),
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
    let cfg = epoch(2, &[Dispatch, Dispatch])
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

/// Rank 1 is held before `[L6]` of LL dispatch 1 (it has sent, so rank 0 can finish) while rank
/// 0 runs LL dispatch 2's send phase: with one LL region rank 1 then reads dispatch 2's count
/// word as its own; with two parities dispatch 2 writes the other region.
#[test]
fn single_ll_region_reads_next_ll_count() {
    use OpKind::*;
    let pause = || Pause::new(1, (0, Step::L6), 0, (1, Step::L3));
    let cfg = epoch(2, &[LlDispatch, LlDispatch]);
    match caught_only_when_mutated(&cfg, Mutation::LlSingleRegion, pause, true) {
        Violation::LlCountTag {
            rank: 1,
            op: 0,
            step: Step::L6,
            parity: 0,
            expected: 1,
            found: 2,
            ..
        } => {}
        other => panic!("expected dispatch 2's count at [L6] of dispatch 1, got {other}"),
    }
}

/// Without `[L5]` the receive phase reads a count word its sender has not stored yet (rank 0 is
/// held before `[L2]` while rank 1 reads). With `[L5]` rank 1 waits for rank 0's done signal,
/// so the schedule cannot happen.
#[test]
fn without_ll_done_wait_counts_are_read_before_they_land() {
    use OpKind::*;
    let cfg = epoch(1, &[LlDispatch]);
    let pause = || Pause::new(0, (0, Step::L2), 1, (0, Step::L6));
    match caught_only_when_mutated(&cfg, Mutation::LlSkipDoneWait, pause, false) {
        Violation::LlCountTag {
            rank: 1,
            op: 0,
            step: Step::L6,
            src: 0,
            expected: 1,
            found: 0,
            ..
        } => {}
        other => panic!("expected an unwritten count at [L6], got {other}"),
    }
}

/// A failure in an LL send phase before its done signal ends every later op of both ranks in
/// an error; the peer cannot complete the op (its `[L5]` gives up on the abort word).
#[test]
fn ll_failure_before_done_ends_every_later_op_in_error() {
    use OpKind::*;
    let cfg = epoch(2, &[LlDispatch, LlCombine, LlDispatch, Dispatch])
        .with_failure(Failure {
            rank: 0,
            op: 1,
            at: Step::L8,
        })
        .unwrap();
    let reports = run_model(&cfg, &NoHook).unwrap_or_else(|f| panic!("{f}"));
    assert_eq!(
        reports[0].outputs[1],
        Err(OpError::TimedOut { step: Step::L8 })
    );
    assert_gave_up_on(&reports[1].outputs[1], 0);
    for report in &reports {
        assert!(
            report.outputs[2..]
                .iter()
                .all(|r| matches!(r, Err(OpError::Refused { .. }))),
            "rank {}: {:?}",
            report.rank,
            report.outputs
        );
    }
}

// ---- the hierarchical internode dispatch (model only) -------------------------------------

/// `nodes x local` ranks, one token each, one block, the Epoch schedule.
fn internode(nodes: usize, local: usize, ops: &[OpKind]) -> ModelConfig {
    ModelConfig::new(nodes * local, 1, 1, Schedule::Epoch, ops.to_vec())
        .unwrap()
        .with_nodes(nodes)
        .unwrap()
}

/// Two nodes of one rank: rank 1 is held before it writes its rail counts `[I2]` while rank 0
/// reaches `[I4]`. Unmutated, rank 0's `[I4]` waits for the tag (and rank 1 goes on); without
/// that wait the forwarder takes a never-written rail count word (tag 0) as current.
#[test]
fn forwarder_without_rail_count_wait_uses_an_unwritten_count() {
    use OpKind::*;
    let cfg = internode(2, 1, &[InternodeDispatch]);
    let pause = || Pause::new(1, (0, Step::I2), 0, (0, Step::I4));
    match caught_only_when_mutated(&cfg, Mutation::InterSkipRailCountWait, pause, true) {
        Violation::InterCountTag {
            rank: 0,
            op: 0,
            step: Step::I4,
            word: "rail_count",
            src: 1,
            expected: 1,
            found: 0,
            ..
        } => {}
        other => panic!("expected an unwritten rail count at [I4], got {other}"),
    }
}

/// Two nodes of two ranks: rank 0's token goes to rank 3 (node 1), forwarded by its rail peer,
/// rank 2. Rank 2 is held before it forwards `[I9]`; unmutated, rank 3's `[I11]` waits for
/// rank 2's done signal for source 0, so it cannot reach `[I12]`; without that wait rank 3
/// (or another rank, whose forwarded rows may be late as well) reads a forwarded row, from a
/// source of the other node, before it lands.
#[test]
fn receiver_without_forward_done_wait_reads_before_the_forwarder() {
    use OpKind::*;
    assert!(
        routes_to(1, 0, 0, 3),
        "the routing oracle changed: pick another layout for this schedule"
    );
    let cfg = internode(2, 2, &[InternodeDispatch, InternodeCachedDispatch]);
    let pause = || Pause::new(2, (0, Step::I9), 3, (0, Step::I12));
    match caught_when_mutated_anywhere(&cfg, Mutation::InterSkipForwardDoneWait, pause) {
        Violation::Data {
            rank,
            op: 0,
            step: Step::I12,
            region: Region::XRecv,
            slot,
            found: 0,
            ..
        } => assert_ne!(
            slot / 2,
            rank / 2,
            "one token: slot = source, two ranks a node"
        ),
        other => panic!("expected a forwarded row read before it landed, got {other}"),
    }
}

/// One node of two ranks, cached dispatches: rank 0's token goes to rank 1, rank 1 sends
/// nothing to rank 0, so rank 0 waits on nobody but the credits. Rank 1 is held at the start
/// of op 1 with the output of op 0 (internode op 1, parity 1) still live; unmutated, rank 0's
/// op 2 (internode op 3, parity 1 again) waits at `[I5]` for rank 1's credit of op 1, so it
/// cannot reach `[I7]`; without the credit wait it overwrites rank 1's output of op 0 (found at
/// rank 1's `[R]`, or already at its `[I12]` when rank 0 overtakes it before the pause point).
#[test]
fn writer_without_credit_overwrites_a_live_output() {
    use OpKind::*;
    rank_1_holds_no_token_for_rank_0();
    let cfg = internode(
        1,
        2,
        &[
            InternodeDispatch,
            InternodeCachedDispatch,
            InternodeCachedDispatch,
        ],
    );
    let pause = || Pause::new(1, (1, Step::Recheck), 0, (2, Step::I7));
    match caught_only_when_mutated(&cfg, Mutation::InterSkipCredit, pause, false) {
        Violation::Data {
            rank: 1,
            op: 0 | 1,
            step: Step::Recheck | Step::I12,
            region: Region::XRecv,
            parity: 1,
            expected,
            found,
            ..
        } => {
            assert_eq!(expected, data_word(1, 0, 0));
            assert_eq!(found, data_word(3, 0, 0), "overwritten by internode op 3");
        }
        other => panic!("expected an overwritten live output, got {other}"),
    }
}

// ---- the hierarchical internode combine (model only) ---------------------------------------

/// Two nodes of two ranks: rank 0's token goes to rank 3 (node 1), so rank 3 returns its
/// contribution to the forwarder, rank 2 (`cfwd`). Rank 3 is held before it writes its
/// contributions `[J3]` until rank 2 reduces `[J6]`; unmutated, rank 2's `[J5]` waits for rank
/// 3's done signal, so it cannot reach `[J6]`; without that wait the forwarder builds its
/// partial from a contribution that has not landed. (Layout 1 has other forwarded
/// contributions, rank 1's to rank 0 and rank 0's to rank 1: a mutated forwarder of node 0
/// may read one of those first, and the run then ends before rank 2 gets there; either way
/// the first violation is a partial built from a contribution that has not landed.)
#[test]
fn forwarder_without_local_wait_sends_an_incomplete_partial() {
    use OpKind::*;
    assert!(
        routes_to(1, 0, 0, 3),
        "the routing oracle changed: pick another layout for this schedule"
    );
    let cfg = internode(2, 2, &[InternodeDispatch, InternodeCombine]);
    let pause = || Pause::new(3, (1, Step::J3), 2, (1, Step::J6));
    match caught_when_mutated_anywhere(&cfg, Mutation::InterCombineSkipLocalWait, pause) {
        Violation::Data {
            op: 1,
            step: Step::J6,
            region: Region::CFwd,
            found: 0,
            ..
        } => {}
        other => panic!("expected a partial built before its contributions, got {other}"),
    }
}

/// Two nodes of one rank: rank 0's token goes to rank 1, its rail peer, which returns the
/// token's partial over the rail. Rank 1 is held before it reduces `[J6]` until rank 0 reads
/// its partials `[J9]`; unmutated, rank 0's `[J8]` waits for rank 1's `cpdone`, so it cannot
/// reach `[J9]`; without that wait the source reads a partial that has not landed.
#[test]
fn source_without_partial_wait_reads_before_the_partial_lands() {
    use OpKind::*;
    rank_1_holds_no_token_for_rank_0();
    let cfg = internode(2, 1, &[InternodeDispatch, InternodeCombine]);
    let pause = || Pause::new(1, (1, Step::J6), 0, (1, Step::J9));
    match caught_only_when_mutated(&cfg, Mutation::InterCombineSkipPartialWait, pause, false) {
        Violation::Data {
            rank: 0,
            op: 1,
            step: Step::J9,
            region: Region::CPart,
            slot: 1,
            found: 0,
            ..
        } => {}
        other => panic!("expected a partial read before it landed, got {other}"),
    }
}

/// One node of two ranks, back-to-back combines: rank 0's token goes to rank 1, rank 1's stays
/// local, so rank 1 waits on nobody in a combine but the credits. Rank 0 is held before it
/// reduces combine 1 `[J9]` until rank 1 has written combine 3's contributions (the same
/// parity); unmutated, rank 1's `[J2]` of combine 3 waits for rank 0's credit of combine 2,
/// so it cannot get there; without the credit wait rank 0 reduces combine 3's contribution.
#[test]
fn combine_without_credit_overwrites_an_unreduced_contribution() {
    use OpKind::*;
    rank_1_holds_no_token_for_rank_0();
    let ops = [
        InternodeDispatch,
        InternodeCombine,
        InternodeCombine,
        InternodeCombine,
    ];
    let cfg = internode(1, 2, &ops);
    let pause = || Pause::new(0, (1, Step::J9), 1, (3, Step::J4));
    match caught_only_when_mutated(&cfg, Mutation::InterCombineSkipCredit, pause, false) {
        Violation::Data {
            rank: 0,
            op: 1,
            step: Step::J9,
            region: Region::CDirect,
            parity: 1,
            expected,
            found,
            ..
        } => {
            let row = data_word(1, 0, 0);
            assert_eq!(expected, inter_combine_word(1, 1, row));
            assert_eq!(
                found,
                inter_combine_word(3, 1, row),
                "overwritten by combine 3"
            );
        }
        other => panic!("expected an overwritten contribution, got {other}"),
    }
}
