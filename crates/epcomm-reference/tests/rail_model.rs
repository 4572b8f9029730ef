//! `rail_model::summarize` on a hand-checked routing.

use epcomm_reference::rail_model::{OpEstimate, RailLink, Spread, summarize};
use epcomm_reference::{RefError, Tiers, two_node_example_routing as routing};

const LINK: RailLink = RailLink {
    nic_gbps: 1.0,
    overhead_us: 2.0,
    nvlink_gbps: 4.0,
};

fn close(a: f64, b: f64) {
    assert!((a - b).abs() <= 1e-12 * b.abs().max(1.0), "{a} != {b}");
}

fn check(op: &OpEstimate, row: u64, sent_mean: f64, deepep_row: f64) {
    // Busiest direction: rank 0 sends 2 rows, rank 2 receives 2 (in combine: the reverse).
    assert_eq!(op.row_bytes, row);
    close(op.sent_mean, sent_mean);
    assert_eq!(op.busiest, 2 * row);
    // 1 GB/s = 1000 bytes per us, plus 2 us.
    let time = (2 * row) as f64 / 1000.0 + 2.0;
    close(op.time_us, time);
    // DeepEP rows: rank 0 has 2 + 1 + 2 (node, token) pairs, rank 3 has 2: mean 7 / 4.
    close(op.deepep_bytes_mean, 1.75 * deepep_row);
    close(op.deepep_gbps, 1.75 * deepep_row / (time * 1000.0));
    // Node stage: the busiest rank moves 2 rows over NVLink, at 4 GB/s = 4000 bytes per us.
    let (rail, node) = ((2 * row) as f64 / 1000.0, (2 * row) as f64 / 4000.0);
    let st = op.staged;
    close(st.rail_us, rail);
    close(st.node_us, node);
    close(st.sequential_us, rail + node + 2.0);
    close(st.overlapped_us, rail + 2.0);
    close(
        st.sequential_rail_gbps,
        sent_mean / ((rail + node + 2.0) * 1000.0),
    );
    close(st.overlapped_rail_gbps, sent_mean / ((rail + 2.0) * 1000.0));
}

#[test]
fn hand_checked_world() {
    let m = summarize(&routing(), 3, 4, 128, Tiers::new(2, 2).unwrap(), LINK).unwrap();
    assert_eq!((m.tokens, m.top_k), (4, 3));
    // Rank 0 sends tokens 0 and 2 to node 1 (peer rank 2), rank 3 sends its token to node 0
    // (peer rank 1). Rank 2 forwards both to rank 3 (and keeps them), rank 1 forwards one to
    // rank 0 (and keeps it).
    let s = |mean, max| Spread { mean, max };
    assert_eq!(m.rail_sent, s(0.75, 2));
    assert_eq!(m.rail_received, s(0.75, 2));
    assert_eq!(m.forwarded, s(0.75, 2));
    // Node stage: rank 0 also sends token 1 straight to rank 1 (its node), so 1, 1, 2, 0.
    assert_eq!(m.node_rows, s(1.0, 2));
    assert_eq!(m.combine_sent, s(0.75, 2));
    assert_eq!(m.deepep_rows, s(1.75, 5));
    // 3 rail rows; one transfer per remote rank would be 2 + 2 + 2 = 6.
    assert_eq!((m.rail_rows, m.per_rank_rail_rows), (3, 6));
    close(m.rows_per_slot(), 3.0 / 12.0);
    close(m.rows_per_rank_transfer(), 0.5);
    // Dispatch rows: x (256 B BF16 / 128 B FP8 + 4 B scale) + 3 ids * 8 + 3 weights * 4 + 4.
    check(&m.dispatch_bf16, 296, 0.75 * 296.0, 256.0);
    check(
        &m.dispatch_fp8,
        172,
        0.75 * 172.0,
        256.0 * (1.0 + 4.0 / 128.0) / 2.0,
    );
    // Combine partials: 128 values (2 or 4 B) + 3 f32 weights; DeepEP counts BF16 payload.
    check(&m.combine_bf16, 268, 0.75 * 268.0, 256.0);
    check(&m.combine_f32, 524, 0.75 * 524.0, 256.0);
}

#[test]
fn one_node_has_no_rail_traffic() {
    let m = summarize(&routing(), 3, 4, 128, Tiers::new(1, 4).unwrap(), LINK).unwrap();
    assert_eq!((m.rail_rows, m.per_rank_rail_rows), (0, 0));
    assert_eq!(m.dispatch_bf16.busiest, 0);
    close(m.dispatch_bf16.time_us, 2.0);
    // DeepEP still counts the own node: 3 + 1 tokens, mean 1.
    assert_eq!(m.deepep_rows, Spread { mean: 1.0, max: 3 });
}

#[test]
fn errors() {
    let t = Tiers::new(2, 2).unwrap();
    let bad = |link| summarize(&routing(), 3, 4, 128, t, link).unwrap_err();
    for nic_gbps in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let e = bad(RailLink { nic_gbps, ..LINK });
        assert!(
            matches!(
                e,
                RefError::OutOfRange {
                    arg: "nic_gbps",
                    ..
                }
            ),
            "{e:?}"
        );
    }
    for nvlink_gbps in [0.0, f64::NAN] {
        let e = bad(RailLink {
            nvlink_gbps,
            ..LINK
        });
        assert!(matches!(
            e,
            RefError::OutOfRange {
                arg: "nvlink_gbps",
                ..
            }
        ));
    }
    let e = bad(RailLink {
        overhead_us: -1.0,
        ..LINK
    });
    assert!(matches!(
        e,
        RefError::OutOfRange {
            arg: "overhead_us",
            ..
        }
    ));
    assert!(matches!(
        summarize(&routing(), 3, 4, 64, t, LINK),
        Err(RefError::Row(_))
    ));
    assert!(matches!(
        summarize(&routing(), 3, 4, 128, Tiers::new(1, 2).unwrap(), LINK),
        Err(RefError::TiersMismatch { .. })
    ));
    assert_eq!(Spread::of([]), Spread { mean: 0.0, max: 0 });
    assert_eq!(Spread::of([1, 4]).scaled(10), (25.0, 40));
}

#[test]
fn pipelined_by_hand() {
    let m = summarize(&routing(), 3, 4, 128, Tiers::new(2, 2).unwrap(), LINK).unwrap();
    let op = &m.dispatch_bf16;
    // Rail 2 rows * 296 B at 1000 B/us = 0.592 us, node 0.148 us, overhead 2 us.
    let (rail, node) = (0.592, 0.148);
    close(op.overhead_us(), 2.0);
    // One chunk: the stages one after the other (and the chunk's cost).
    let one = op.pipelined(1, 0.5).unwrap();
    close(one.time_us, rail + node + 0.5 + 2.0);
    close(one.rail_gbps, op.sent_mean / (one.time_us * 1e3));
    // Two rows in one chunk, two chunks in flight.
    assert_eq!(one.ring_bytes, 2 * 2 * 296);
    // Two chunks: the slower stage, half of the faster one, two chunk costs.
    let two = op.pipelined(2, 0.5).unwrap();
    close(two.time_us, rail + node / 2.0 + 1.0 + 2.0);
    assert_eq!(two.ring_bytes, 2 * 296);
    // Free chunks: more is better, down to the slower stage; the search keeps the fewest
    // chunks among equal times.
    let free = op.best_pipeline(0.0, 8).unwrap();
    assert_eq!(free.chunks, 8);
    close(free.time_us, rail + node / 8.0 + 2.0);
    // Costly chunks: one chunk (0.148 / 1 saved per extra chunk is less than 0.5).
    assert_eq!(op.best_pipeline(0.5, 8).unwrap().chunks, 1);
    // The optimum sits near sqrt(min stage / chunk cost): 0.148 / 0.004 = 37 -> about 6.
    assert_eq!(op.best_pipeline(0.004, 64).unwrap().chunks, 6);
}

#[test]
fn pipelined_errors() {
    let m = summarize(&routing(), 3, 4, 128, Tiers::new(2, 2).unwrap(), LINK).unwrap();
    let op = &m.dispatch_fp8;
    let arg = |e: RefError| match e {
        RefError::OutOfRange { arg, .. } => arg,
        e => panic!("{e:?}"),
    };
    assert_eq!(arg(op.pipelined(0, 1.0).unwrap_err()), "chunks");
    for bad in [-1.0, f64::NAN, f64::INFINITY] {
        assert_eq!(arg(op.pipelined(2, bad).unwrap_err()), "chunk_us");
        assert_eq!(arg(op.best_pipeline(bad, 4).unwrap_err()), "chunk_us");
    }
    assert_eq!(arg(op.best_pipeline(1.0, 0).unwrap_err()), "max_chunks");
}
