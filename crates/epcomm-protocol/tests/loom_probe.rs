//! Exhaustive interleaving checks with loom (bounded preemptions).
//!
//! Run with `RUSTFLAGS="--cfg loom" cargo test -p epcomm-protocol --release --test loom`.
//! `LOOM_MAX_PREEMPTIONS` overrides the default bound (2); `EPCOMM_LOOM_BIG=1` adds the
//! three-rank and longer configurations (minutes, not for CI).
#![cfg(loom)]

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Instant;

use epcomm_protocol::{
    ModelConfig, NoHook, OpKind, Strategy, World, run_rank, sequential_reference,
};
use loom::sync::Arc;

fn builder(default_bound: usize) -> loom::model::Builder {
    let mut b = loom::model::Builder::new();
    let bound = std::env::var("LOOM_MAX_PREEMPTIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default_bound);
    b.preemption_bound = Some(bound);
    b.max_branches = 100_000;
    b
}

fn big() -> bool {
    std::env::var_os("EPCOMM_LOOM_BIG").is_some()
}

/// Explores `cfg` with loom: every rank is a loom thread (rank 0 the model's main thread);
/// any violation, deadlock, or result differing from the sequential reference fails.
fn explore(cfg: ModelConfig, bound: usize) {
    let name = format!("{cfg:?}");
    let start = Instant::now();
    let expected = sequential_reference(&cfg);
    builder(bound).check(move || {
        let world = Arc::new(World::new(&cfg));
        let handles: Vec<_> = (1..cfg.world())
            .map(|rank| {
                let world = world.clone();
                // Panic in the rank's own thread so loom stops this execution at once (a rank
                // that just returned would leave its peers spinning).
                loom::thread::spawn(move || {
                    run_rank(&world, rank, &NoHook)
                        .unwrap_or_else(|e| panic!("protocol violation: {e}"))
                })
            })
            .collect();
        let mut reports = vec![
            run_rank(&world, 0, &NoHook).unwrap_or_else(|e| panic!("protocol violation: {e}")),
        ];
        reports.extend(handles.into_iter().map(|h| h.join().unwrap()));
        for (rank, report) in reports.into_iter().enumerate() {
            assert_eq!(report, expected[rank], "rank {rank} result");
        }
    });
    eprintln!("loom: {name} explored in {:.1?}", start.elapsed());
}

fn cfg(
    world: usize,
    tokens: usize,
    blocks: usize,
    strategy: Strategy,
    ops: &[OpKind],
) -> ModelConfig {
    ModelConfig::new(world, tokens, blocks, strategy, ops.to_vec()).unwrap()
}

use OpKind::{CachedDispatch as CD, Combine as C, Dispatch as D};

#[test]
fn q1() {
    explore(cfg(3, 1, 1, Strategy::Epoch, &[D, C]), 1);
}
#[test]
fn q2() {
    explore(cfg(3, 1, 1, Strategy::Epoch, &[D, D]), 1);
}
#[test]
fn q3() {
    explore(cfg(3, 1, 1, Strategy::Epoch, &[D, C]), 2);
}
