//! GPU tests of op agreement: ranks that issue different ops at the same point, or the same op
//! with arguments every rank must share (top-k weights, BF16 against FP8, the combine's mode),
//! must fail on **every** rank within a second, with an error that names what differs, instead
//! of finishing with rows they never received or waiting out the op timeout
//! (docs/protocol.md, "Op agreement"). One process per rank (`tests/common`).
//!
//! The checks use only the error's text (not its variant), so that the same file also shows
//! what a build without op agreement does: `Ok` on every rank, or a timeout.

use std::time::{Duration, Instant};

use cudarc::driver::CudaSlice;
use epcomm::{
    Buffer, BufferConfig, CombineInput, CombineOutput, CombineStaging, LlFormat, RecvMode, Result,
};
use epcomm_check::inputs::{DeviceInputs, HostInputs, Shape, device_inputs, host_inputs};
use epcomm_check::ll::LlIo;
use epcomm_reference::bf16;

mod common;
use common::{MakeTransport, Worker, apply_test_config, gpu_test, log, small_cfg_with};

/// The op timeout of these tests: far above [`FAST`], so a rank that only learns of the
/// mismatch by timing out fails the test.
const TIMEOUT: Duration = Duration::from_secs(15);

/// How soon every rank must have its error, from the barrier before the mismatched op.
const FAST: Duration = Duration::from_millis(1500);

/// Tokens per rank.
const TOKENS: usize = 40;

/// A small buffer (hidden 128, top-2 of 4 experts per rank) whose combine pushes (the same
/// on every rank), and this rank's inputs.
fn setup(
    w: &Worker,
    mk: MakeTransport<'_>,
    staging: CombineStaging,
) -> (Buffer, HostInputs, DeviceInputs) {
    let (rank, world) = (w.boot.rank(), w.boot.world_size());
    let mut cfg = small_cfg_with(world, TIMEOUT);
    cfg.combine_staging = staging;
    let buf = Buffer::new(w.ctx.clone(), mk(), cfg).expect("Buffer::new");
    let shape = Shape::uniform(world, TOKENS, 128, 2, 4 * world, 31);
    let h = host_inputs(&shape).unwrap();
    let d = device_inputs(buf.stream(), &h, rank).unwrap();
    (buf, h, d)
}

/// The combine's device arrays: `y` and its weights for the buffer's receive capacity, the
/// outputs for [`TOKENS`] tokens.
struct CombineIo {
    y: CudaSlice<bf16>,
    y_w: CudaSlice<f32>,
    out: CudaSlice<bf16>,
    out_w: CudaSlice<f32>,
}

impl CombineIo {
    fn new(buf: &Buffer, world: usize) -> Self {
        let s = buf.stream();
        let cap = world * 64; // small_cfg_with: 64 tokens per rank
        Self {
            y: s.alloc_zeros::<bf16>(cap * 128).unwrap(),
            y_w: s.alloc_zeros::<f32>(cap * 2).unwrap(),
            out: s.alloc_zeros::<bf16>(TOKENS * 128).unwrap(),
            out_w: s.alloc_zeros::<f32>(TOKENS * 2).unwrap(),
        }
    }

    /// A combine along `handle`, with the weights or without.
    fn combine(&mut self, buf: &mut Buffer, handle: &epcomm::Handle, weights: bool) -> Result<()> {
        if weights {
            buf.combine(
                &CombineInput::new(&self.y).with_weights(&self.y_w),
                handle,
                CombineOutput::new(&mut self.out).with_weights(&mut self.out_w),
            )
        } else {
            buf.combine(
                &CombineInput::new(&self.y),
                handle,
                CombineOutput::new(&mut self.out),
            )
        }
    }
}

/// Runs `op` (the mismatched op, then a synchronize) from a barrier and asserts that this rank
/// got an error within [`FAST`] whose text names the field: one of `fields`.
fn expect_mismatch(
    w: &Worker,
    buf: &mut Buffer,
    what: &str,
    fields: &[&str],
    op: impl FnOnce(&mut Buffer) -> Result<()>,
) {
    let rank = w.boot.rank();
    w.boot.barrier(what).unwrap();
    let t0 = Instant::now();
    let r = op(buf).and_then(|()| buf.synchronize());
    let waited = t0.elapsed();
    let e = match r {
        Err(e) => e.to_string(),
        Ok(()) => panic!("{what}: rank {rank} finished Ok after {waited:?}"),
    };
    assert!(
        waited < FAST,
        "{what}: rank {rank} got its error after {waited:?} (op timeout {TIMEOUT:?}): {e}"
    );
    assert!(
        fields.iter().any(|f| e.contains(f)),
        "{what}: rank {rank}'s error does not name {fields:?}: {e}"
    );
    log(
        rank,
        format_args!("{what}: rank {rank} after {waited:?}: {e}"),
    );
}

/// Drops a failed buffer on every rank together.
fn finish(w: &Worker, buf: Buffer, what: &str) {
    drop(buf);
    w.boot.barrier(&format!("{what}-end")).unwrap();
}

// ---------------------------------------------------------------------------------------------
// (a) A combine with weights on rank 0 only: rank 0 would sum weights nobody sent (an earlier
// combine's), both ranks would return Ok.

fn run_combine_weights_one_rank(w: &Worker, mk: MakeTransport<'_>) {
    let (rank, world) = (w.boot.rank(), w.boot.world_size());
    let (mut buf, _h, d) = setup(w, mk, CombineStaging::Push);
    let mut io = CombineIo::new(&buf, world);
    let layout = buf.layout(&d.topk_idx, TOKENS).unwrap();
    let handle = d.worst_case_handle(&mut buf, &layout, true).unwrap();
    // Two agreed combines with weights (both parities hold weights), then the mismatch.
    for _ in 0..2 {
        io.combine(&mut buf, &handle, true).unwrap();
    }
    buf.synchronize().expect("agreed combines");
    expect_mismatch(
        w,
        &mut buf,
        "combine weights on rank 0 only",
        &["weights"],
        |b| io.combine(b, &handle, rank == 0),
    );
    finish(w, buf, "combine-weights");
}

gpu_test!(
    combine_weights_on_one_rank_fail_fast,
    run_combine_weights_one_rank
);

// ---------------------------------------------------------------------------------------------
// (b) A dispatch with weights on rank 0 only: rows from rank 1 would keep the receivers' stale
// top-k weights.

fn run_dispatch_weights_one_rank(w: &Worker, mk: MakeTransport<'_>) {
    let rank = w.boot.rank();
    let (mut buf, _h, d) = setup(w, mk, CombineStaging::Push);
    let layout = buf.layout(&d.topk_idx, TOKENS).unwrap();
    buf.dispatch(&d.dispatch_input(false, true), &layout, RecvMode::WorstCase)
        .unwrap();
    buf.synchronize().expect("agreed dispatch");
    expect_mismatch(
        w,
        &mut buf,
        "dispatch weights on rank 0 only",
        &["weights"],
        |b| {
            b.dispatch(
                &d.dispatch_input(false, rank == 0),
                &layout,
                RecvMode::WorstCase,
            )
            .map(drop)
        },
    );
    finish(w, buf, "dispatch-weights");
}

gpu_test!(
    dispatch_weights_on_one_rank_fail_fast,
    run_dispatch_weights_one_rank
);

// ---------------------------------------------------------------------------------------------
// (c) BF16 on rank 0, FP8 on rank 1: rows would land at a stride the receiver does not read.

fn run_dispatch_dtype_mismatch(w: &Worker, mk: MakeTransport<'_>) {
    let rank = w.boot.rank();
    let (mut buf, _h, d) = setup(w, mk, CombineStaging::Push);
    let layout = buf.layout(&d.topk_idx, TOKENS).unwrap();
    buf.dispatch(
        &d.dispatch_input(false, false),
        &layout,
        RecvMode::WorstCase,
    )
    .unwrap();
    buf.synchronize().expect("agreed dispatch");
    expect_mismatch(w, &mut buf, "dispatch BF16 against FP8", &["dtype"], |b| {
        b.dispatch(
            &d.dispatch_input(rank != 0, false),
            &layout,
            RecvMode::WorstCase,
        )
        .map(drop)
    });
    finish(w, buf, "dispatch-dtype");
}

gpu_test!(
    dispatch_bf16_against_fp8_fails_fast,
    run_dispatch_dtype_mismatch
);

// ---------------------------------------------------------------------------------------------
// (d) Different ops: a cached dispatch on rank 0, a combine on the others (an application bug
// such as a skipped layer). Each op's completion counters would satisfy the other's waits.

fn run_op_kind_mismatch(w: &Worker, mk: MakeTransport<'_>) {
    let (rank, world) = (w.boot.rank(), w.boot.world_size());
    let (mut buf, _h, d) = setup(w, mk, CombineStaging::Push);
    let mut io = CombineIo::new(&buf, world);
    let layout = buf.layout(&d.topk_idx, TOKENS).unwrap();
    let handle = d.worst_case_handle(&mut buf, &layout, false).unwrap();
    io.combine(&mut buf, &handle, false).unwrap();
    buf.synchronize().expect("agreed dispatch and combine");
    expect_mismatch(
        w,
        &mut buf,
        "cached dispatch against combine",
        &["op kind"],
        |b| {
            if rank == 0 {
                b.cached_dispatch(&d.x_input(false), &handle).map(drop)
            } else {
                io.combine(b, &handle, false)
            }
        },
    );
    finish(w, buf, "op-kind");
}

gpu_test!(
    cached_dispatch_against_combine_fails_fast,
    run_op_kind_mismatch
);

// ---------------------------------------------------------------------------------------------
// (e) One rank pulls in place, the others push: each waits for a signal the other never sends
// (the in-place ready word, the pushed rows' flags). What ranks that stage their combine
// differently (receive modes, captures) run into.

fn run_in_place_against_push(w: &Worker, mk: MakeTransport<'_>) {
    let (rank, world) = (w.boot.rank(), w.boot.world_size());
    let (mut buf, _h, d) = setup(w, mk, CombineStaging::Push);
    let mut io = CombineIo::new(&buf, world);
    let layout = buf.layout(&d.topk_idx, TOKENS).unwrap();
    let handle = buf
        .dispatch(&d.dispatch_input(false, false), &layout, RecvMode::HostSync)
        .unwrap()
        .into_handle();
    buf.synchronize().expect("agreed dispatch");
    expect_mismatch(
        w,
        &mut buf,
        "in-place combine against push",
        &["combine mode"],
        |b| {
            if rank == 0 {
                b.combine_in_place(&handle, &mut io.out, None)
            } else {
                io.combine(b, &handle, false)
            }
        },
    );
    finish(w, buf, "in-place-push");
}

gpu_test!(
    in_place_combine_against_push_fails_fast,
    run_in_place_against_push
);

// (e') Rank 0 dispatches HostSync, the others with WorstCase, then every rank calls the same
// combine under the default staging. Every rank must be done within a second, alike: all Ok
// (every rank pushed) or all failing with an error naming the combine mode (a rank staged),
// never waiting out the timeout.

fn run_recv_modes_then_combine(w: &Worker, mk: MakeTransport<'_>) {
    let (rank, world) = (w.boot.rank(), w.boot.world_size());
    let (mut buf, _h, d) = setup(w, mk, CombineStaging::Auto);
    let mut io = CombineIo::new(&buf, world);
    let layout = buf.layout(&d.topk_idx, TOKENS).unwrap();
    let mode = if rank == 0 {
        RecvMode::HostSync
    } else {
        RecvMode::WorstCase
    };
    let handle = buf
        .dispatch(&d.dispatch_input(false, false), &layout, mode)
        .unwrap()
        .into_handle();
    buf.synchronize().expect("dispatch");
    w.boot.barrier("recv-modes").unwrap();
    let t0 = Instant::now();
    let r = io
        .combine(&mut buf, &handle, false)
        .and_then(|()| buf.synchronize());
    let waited = t0.elapsed();
    assert!(
        waited < FAST,
        "rank {rank}: combine after mixed receive modes returned after {waited:?} (op timeout \
         {TIMEOUT:?}): {r:?}"
    );
    let outcome = match &r {
        Ok(()) => "ok".to_string(),
        Err(e) => {
            let e = e.to_string();
            assert!(e.contains("combine mode"), "rank {rank}: {e}");
            "mismatch".to_string()
        }
    };
    // Every rank alike.
    let all = w
        .boot
        .all_gather("recv-modes-outcome", outcome.as_bytes())
        .unwrap();
    assert!(
        all.iter().all(|o| o[..] == *outcome.as_bytes()),
        "ranks ended differently: {:?}",
        all.iter()
            .map(|o| String::from_utf8_lossy(o).into_owned())
            .collect::<Vec<_>>()
    );
    log(
        rank,
        format_args!("mixed receive modes, then combine: {outcome} after {waited:?}"),
    );
    finish(w, buf, "recv-modes");
}

gpu_test!(
    mixed_recv_modes_then_combine_do_not_hang,
    run_recv_modes_then_combine
);

// ---------------------------------------------------------------------------------------------
// (f) A low-latency dispatch in BF16 on rank 0 and FP8 on the others.

fn run_ll_dtype_mismatch(w: &Worker, mk: MakeTransport<'_>) {
    let (rank, world) = (w.boot.rank(), w.boot.world_size());
    let (hidden, top_k, experts) = (256, 2, 4 * world);
    let mut cfg = BufferConfig::new(1, hidden, top_k, experts);
    cfg.ll_max_tokens_per_rank = 64;
    cfg.timeout = TIMEOUT;
    apply_test_config(&mut cfg);
    let mut buf = Buffer::new(w.ctx.clone(), mk(), cfg).expect("Buffer::new");
    let mut recv = buf.alloc_ll_recv().unwrap();
    let stream = buf.stream().clone();
    let shape = Shape::uniform(world, 16, hidden, top_k, experts, 5);
    let inputs = host_inputs(&shape).unwrap().bf16;
    let io = LlIo::new(&stream, &inputs, rank, experts, recv.capacity()).unwrap();
    buf.ll_dispatch(io.input(), LlFormat::Bf16, &mut recv)
        .unwrap();
    buf.synchronize().expect("agreed low-latency dispatch");
    let format = if rank == 0 {
        LlFormat::Bf16
    } else {
        LlFormat::Fp8 { round_scale: false }
    };
    expect_mismatch(
        w,
        &mut buf,
        "low-latency BF16 against FP8",
        &["dtype"],
        |b| b.ll_dispatch(io.input(), format, &mut recv),
    );
    finish(w, buf, "ll-dtype");
}

gpu_test!(
    ll_dispatch_bf16_against_fp8_fails_fast,
    run_ll_dtype_mismatch
);
