//! GPU tests of soundness at the API's edges: a captured graph keeps the routing state it
//! replays against (a dropped `Handle`, `Layout` or `LlRecv` must not be written through),
//! ranks that oversubscribe a shared GPU are refused at `Buffer::new` on every rank at once,
//! and a failure is reported without waiting for caller work queued on the comm stream. One
//! process per rank (`tests/common`); every test runs on CUDA IPC (what it checks does not
//! depend on the transport).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use epcomm::{
    Buffer, BufferConfig, CombineInput, CombineOutput, DispatchInput, Error, LlDispatchInput,
    LlFormat, XInput,
};
use epcomm_check::inputs::{Shape, host_inputs};
use epcomm_check::ll::bf16_rows;
use epcomm_reference::{bf16, combine_weighted_ll};

mod common;
use common::{MakeTransport, Worker, apply_test_config, log};

/// Declares `#[test] fn $name` that runs `$run(&worker, &make_transport)` in every worker and,
/// in the parent, launches it once over CUDA IPC with at least `$min` ranks.
macro_rules! ipc_test {
    ($name:ident, $run:ident, $min:expr) => {
        #[test]
        fn $name() {
            if epcomm_check::procs::is_worker() {
                return common::on_transport!($run);
            }
            let Some(n) = common::world(stringify!($name), $min) else {
                return;
            };
            common::launch(
                stringify!($name),
                n,
                &[("EPCOMM_TEST_TRANSPORT", "ipc".to_string())],
            );
        }
    };
}

/// The value every sentinel word holds.
const SENTINEL: i32 = 0x7fff_ffff;

/// Device i32 arrays of the given lengths, each filled with [`SENTINEL`], allocated on `stream`
/// in this order (the order the freed arrays were allocated in, so a stream-ordered pool hands
/// their addresses out again).
fn sentinels(stream: &std::sync::Arc<CudaStream>, lens: &[usize]) -> Vec<CudaSlice<i32>> {
    lens.iter()
        .map(|&n| stream.clone_htod(&vec![SENTINEL; n.max(1)]).unwrap())
        .collect()
}

/// Panics naming every sentinel array (by `names`) a replay wrote into.
fn assert_untouched(stream: &std::sync::Arc<CudaStream>, s: &[CudaSlice<i32>], names: &[&str]) {
    let mut hit = Vec::new();
    for (a, name) in s.iter().zip(names) {
        let host = stream.clone_dtoh(a).unwrap();
        let changed = host.iter().filter(|&&v| v != SENTINEL).count();
        if changed > 0 {
            hit.push(format!("{name}: {changed} of {} words", host.len()));
        }
    }
    assert!(
        hit.is_empty(),
        "{} of {} arrays allocated after the routing state was dropped were overwritten by the \
         replays (the graph replayed into freed memory): {}",
        hit.len(),
        s.len(),
        hit.join("; ")
    );
}

// ---------------------------------------------------------------------------------------------
// A normal-mode graph (layout, dispatch, combine) whose Handle and Layout are dropped after the
// capture: the replays must neither write into memory allocated afterwards nor give wrong
// results.

fn run_graph_keeps_routing(w: &Worker, mk: MakeTransport<'_>) {
    let (rank, world) = (w.boot.rank(), w.boot.world_size());
    let (hidden, top_k, experts, tokens) = (256, 4, 8 * world, 96);
    let dims = (hidden, top_k, experts, tokens);
    let mut buf = common::graph_buffer(w, mk, dims, Duration::from_secs(20));
    let stream = buf.stream().clone();
    let cap = world * tokens;
    let case = common::reference_cases(&stream, dims, rank, world, 1, 700, 99)
        .pop()
        .unwrap();
    let mut io = common::GraphIo::new(&stream, dims, cap);
    io.load(&stream, &case);
    let layout = buf.alloc_layout(tokens).unwrap();
    let handle = buf.alloc_handle(&layout).unwrap();
    let max_rows = handle.capacity();
    let graph = buf
        .capture(|b| {
            b.layout_into(&io.idx, &layout)?;
            let input = DispatchInput {
                x: XInput::Bf16(&io.x),
                topk_idx: &io.idx,
                topk_weights: None,
            };
            b.dispatch_into(&input, &handle)?;
            b.combine(
                &CombineInput::new(&io.y),
                &handle,
                CombineOutput::new(&mut io.out),
            )
        })
        .expect("capture");
    drop(handle);
    drop(layout);
    stream.synchronize().unwrap();
    // The layout's arrays (counts: world + experts + 1 node, token slots, status) and the
    // handle's (send offsets, receive prefix, source indices, expert counts), as i32.
    let epr = experts / world;
    let lens = [
        world + experts + 1,
        tokens * world,
        1,
        world,
        world + 1,
        max_rows,
        epr,
    ];
    let names = [
        "layout counts",
        "layout token_slot",
        "layout status",
        "handle send_offsets",
        "handle recv_prefix",
        "handle recv_src_idx",
        "handle recv_expert_counts",
    ];
    let guard = sentinels(&stream, &lens);
    w.boot.barrier("soundness-normal-replay").unwrap();
    for i in 0..3 {
        buf.replay(&graph)
            .unwrap_or_else(|e| panic!("replay {i}: {e}"));
        buf.synchronize()
            .unwrap_or_else(|e| panic!("replay {i} after the handle and layout were dropped: {e}"));
    }
    assert_untouched(&stream, &guard, &names);
    let got = stream.clone_dtoh(&io.out).unwrap();
    assert!(
        got == case.combined,
        "the combine output of the replays differs from the reference"
    );
    log(
        rank,
        "normal graph: handle and layout dropped after capture; 3 replays left 7 later \
         allocations alone and combined right",
    );
    drop(graph);
    buf.destroy().unwrap();
}

ipc_test!(
    graph_keeps_dropped_handle_and_layout_alive,
    run_graph_keeps_routing,
    2
);

// ---------------------------------------------------------------------------------------------
// A low-latency graph (dispatch, an identity expert reading the LlRecv rows, combine) whose
// LlRecv is dropped after the capture.

fn run_ll_graph_keeps_recv(w: &Worker, mk: MakeTransport<'_>) {
    let (rank, world) = (w.boot.rank(), w.boot.world_size());
    let (hidden, top_k, experts, tokens) = (256, 4, 4 * world, 40);
    // SAFETY: the test uses one stream for everything, so no cross-stream ordering is lost
    // (cudarc's events, recorded outside the capture, would otherwise land in it).
    unsafe { w.ctx.disable_event_tracking() };
    let mut cfg = BufferConfig::new(1, hidden, top_k, experts);
    cfg.ll_max_tokens_per_rank = 64;
    cfg.timeout = Duration::from_secs(20);
    apply_test_config(&mut cfg);
    let mut buf = Buffer::new(w.ctx.clone(), mk(), cfg).expect("Buffer::new");
    let mut recv = buf.alloc_ll_recv().unwrap();
    let stream = buf.stream().clone();
    let shape = Shape::uniform(world, tokens, hidden, top_k, experts, 910);
    let inputs = host_inputs(&shape).unwrap().bf16;
    let me = &inputs[rank];
    let x = stream.clone_htod(bf16_rows(me).unwrap()).unwrap();
    let idx = stream.clone_htod(&me.topk_idx).unwrap();
    let wts = stream.clone_htod(&me.topk_weights).unwrap();
    let (epr, cap) = (recv.num_local_experts(), recv.capacity());
    let mut y = stream.alloc_zeros::<bf16>(epr * cap * hidden).unwrap();
    let mut out = stream.alloc_zeros::<bf16>(tokens * hidden).unwrap();
    let y_ptr = y.device_ptr(&stream).0;
    let graph = {
        let (x, idx, wts) = (&x, &idx, &wts);
        let (y_ref, out_ref, recv) = (&mut y, &mut out, &mut recv);
        buf.capture(move |b| {
            let input = LlDispatchInput {
                x,
                topk_idx: idx,
                num_tokens: tokens,
                cumulative_stats: None,
            };
            b.ll_dispatch(input, LlFormat::Bf16, recv)?;
            // The identity expert: y = the received rows.
            // SAFETY: both hold local_experts * capacity * hidden bf16 values; stream-ordered.
            unsafe {
                cudarc::driver::sys::cuMemcpyDtoDAsync_v2(
                    y_ptr,
                    recv.x_ptr(),
                    cap * epr * hidden * 2,
                    b.stream().cu_stream(),
                )
            }
            .result()
            .map_err(|source| Error::Driver {
                context: "identity expert",
                source,
            })?;
            b.ll_combine(&*y_ref, idx, wts, recv, &mut *out_ref)
        })
        .expect("capture")
    };
    drop(recv);
    stream.synchronize().unwrap();
    // The LlRecv's arrays as i32 words: rows (bf16), scales (f32, 2 per 128 channels), counts,
    // source indices, ranges (i64), routes.
    let rows = epr * cap;
    let lens = [
        rows * hidden / 2,
        rows * (hidden / 128),
        epr,
        rows,
        2 * epr * world,
        rows,
    ];
    let names = [
        "recv x",
        "recv scales",
        "recv count",
        "recv src_info",
        "recv layout_range",
        "recv route",
    ];
    let guard = sentinels(&stream, &lens);
    w.boot.barrier("soundness-ll-replay").unwrap();
    for i in 0..3 {
        buf.replay(&graph)
            .unwrap_or_else(|e| panic!("replay {i}: {e}"));
        buf.synchronize()
            .unwrap_or_else(|e| panic!("replay {i} after the LlRecv was dropped: {e}"));
    }
    assert_untouched(&stream, &guard, &names);
    // Identity experts: every valid (t, k) returns this rank's own row t.
    let rows_in = bf16_rows(me).unwrap();
    let mut expert_out = vec![bf16::ZERO; tokens * top_k * hidden];
    for t in 0..tokens {
        for k in 0..top_k {
            let o = (t * top_k + k) * hidden;
            expert_out[o..o + hidden].copy_from_slice(&rows_in[t * hidden..(t + 1) * hidden]);
        }
    }
    let want = combine_weighted_ll(
        &expert_out,
        &me.topk_idx,
        &me.topk_weights,
        tokens,
        top_k,
        hidden,
    )
    .unwrap();
    let got = stream.clone_dtoh(&out).unwrap();
    assert!(
        got == want,
        "the low-latency combine output of the replays differs"
    );
    log(
        rank,
        "low-latency graph: LlRecv dropped after capture; 3 replays left 6 later allocations \
         alone and combined right",
    );
    drop(graph);
    buf.destroy().unwrap();
}

ipc_test!(
    ll_graph_keeps_dropped_recv_alive,
    run_ll_graph_keeps_recv,
    2
);

// ---------------------------------------------------------------------------------------------
// Ranks sharing one GPU under MPS whose grids cannot all be resident: Buffer::new refuses on
// every rank, at once, naming num_sms and the largest value that fits.

/// Ranks of a `world`-rank test on the GPU of `rank` (the harness maps rank r to GPU
/// r % GPUs), and the GPU count.
fn ranks_on_my_gpu(rank: usize, world: usize) -> usize {
    let gpus = epcomm_check::procs::gpu_count().unwrap_or(1).max(1);
    (0..world).filter(|r| r % gpus == rank % gpus).count()
}

fn run_shared_gpu_refused(w: &Worker, mk: MakeTransport<'_>) {
    let (rank, world) = (w.boot.rank(), w.boot.world_size());
    let n = ranks_on_my_gpu(rank, world);
    let sms = w
        .ctx
        .attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )
        .unwrap() as usize;
    // The smallest value that oversubscribes: n * num_sms > sms.
    let num_sms = sms / n + 1;
    let largest = sms / n;
    // A value that fits works (and loads what a first Buffer loads, outside the timing below).
    let mut ok = BufferConfig::new(64, 128, 2, 4 * world);
    ok.num_sms = largest.clamp(1, 24) as u32;
    let buf = Buffer::new(w.ctx.clone(), mk(), ok).expect("a num_sms that fits");
    buf.destroy().unwrap();
    let mut cfg = BufferConfig::new(64, 128, 2, 4 * world);
    cfg.num_sms = num_sms as u32;
    cfg.timeout = Duration::from_secs(10);
    let transport = mk();
    w.boot.barrier("soundness-shared-gpu").unwrap();
    let t0 = Instant::now();
    let r = Buffer::new(w.ctx.clone(), transport, cfg);
    let took = t0.elapsed();
    match &r {
        Err(Error::InvalidArgument { argument, rule }) if *argument == "num_sms" => {
            assert!(
                rule.contains(&format!("at most {largest}")) && rule.contains("MPS"),
                "rank {rank}: the refusal must name the largest num_sms that fits ({largest}): \
                 {rule}"
            );
        }
        Err(e) => panic!("rank {rank}: expected num_sms refused, got {e} after {took:?}"),
        Ok(_) => panic!(
            "rank {rank}: {n} ranks x num_sms {num_sms} on one {sms}-SM GPU under MPS were \
             accepted; their ops can only time out"
        ),
    }
    assert!(
        took < Duration::from_secs(1),
        "rank {rank}: the refusal took {took:?} (at most 1 s)"
    );
    log(
        rank,
        format_args!(
            "{n} ranks x num_sms {num_sms} on a {sms}-SM GPU under MPS: refused on every rank in \
             {took:?}"
        ),
    );
}

#[test]
fn oversubscribed_shared_gpu_is_refused_on_every_rank() {
    let name = "oversubscribed_shared_gpu_is_refused_on_every_rank";
    if epcomm_check::procs::is_worker() {
        return common::on_transport!(run_shared_gpu_refused);
    }
    let Some(n) = common::world(name, 2) else {
        return;
    };
    let gpus = epcomm_check::procs::gpu_count().unwrap_or(1);
    if n <= gpus || !epcomm_check::procs::under_mps() {
        // Not a failure: what it checks needs ranks sharing a GPU under MPS.
        eprintln!(
            "SKIP {name}: needs ranks sharing a GPU under MPS (EPCOMM_TEST_WORLD={n}, {gpus} \
             GPU(s), MPS {})",
            if epcomm_check::procs::under_mps() {
                "on"
            } else {
                "off"
            }
        );
        return;
    }
    common::launch(name, n, &[("EPCOMM_TEST_TRANSPORT", "ipc".to_string())]);
}

// ---------------------------------------------------------------------------------------------
// A failure is reported without waiting for caller work queued on the comm stream after the
// failed op: rank 0 times out (2 s) waiting for a late rank, and before it learns of it, its
// stream waits for a caller's event that completes only after 30 s.

/// Set to release [`hold`].
static RELEASE: AtomicBool = AtomicBool::new(false);

/// A host function on a caller's stream: returns once [`RELEASE`] is set, or after 30 s.
unsafe extern "C" fn hold(_: *mut std::ffi::c_void) {
    let t0 = Instant::now();
    while !RELEASE.load(Ordering::Acquire) && t0.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn run_failure_skips_caller_work(w: &Worker, mk: MakeTransport<'_>) {
    let (rank, world) = (w.boot.rank(), w.boot.world_size());
    let late = world - 1;
    let (mut buf, _h, d) = common::small_setup(w, mk, Duration::from_secs(2), 40, 31);
    let layout = buf.layout(&d.topk_idx, 40).unwrap();
    let input = d.dispatch_input(false, false);
    let handle = buf.alloc_handle(&layout).unwrap();
    buf.synchronize().unwrap();
    w.boot.barrier("soundness-h3-start").unwrap();
    if rank == late {
        buf.inject_delay(Duration::from_secs(5)).unwrap();
    }
    let issued = buf.dispatch_into(&input, &handle).map(|_| ());
    if rank == late {
        // Learns of rank 0's failure when its delayed kernel starts.
        let r = issued.and_then(|_| buf.synchronize());
        assert!(r.is_err(), "the late rank's dispatch returned Ok");
        w.boot.barrier("soundness-h3-end").unwrap();
        drop(buf);
        return;
    }
    issued.expect("issuing the dispatch");
    // Caller work queued on the comm stream after the dispatch: a wait for an event of another
    // stream that completes only when RELEASE is set (or after 30 s).
    let other = w.ctx.new_stream().unwrap();
    // SAFETY: `hold` has the host-function signature, takes no data and makes no CUDA call.
    unsafe {
        cudarc::driver::sys::cuLaunchHostFunc(other.cu_stream(), Some(hold), std::ptr::null_mut())
    }
    .result()
    .unwrap();
    let blocked = other.record_event(None).unwrap();
    buf.wait_event(&blocked).unwrap();
    // The dispatch times out after 2 s; its record reaches mapped memory then.
    std::thread::sleep(Duration::from_secs(3));
    let t0 = Instant::now();
    let r = buf.check();
    let took = t0.elapsed();
    RELEASE.store(true, Ordering::Release);
    match r {
        Err(Error::Timeout { peer, .. }) if peer as usize == late => {}
        other => panic!("rank {rank}: expected a timeout naming rank {late}, got {other:?}"),
    }
    assert!(
        took < Duration::from_secs(4),
        "rank {rank}: check() took {took:?}: it waited for caller work queued after the failed \
         dispatch"
    );
    log(
        rank,
        format_args!("failure reported in {took:?} with caller work blocking the stream"),
    );
    w.boot.barrier("soundness-h3-end").unwrap();
    other.synchronize().unwrap();
    drop(buf);
}

ipc_test!(
    failure_report_skips_caller_work,
    run_failure_skips_caller_work,
    2
);
