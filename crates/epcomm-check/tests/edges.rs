//! GPU tests of the edges: graph replays read the current rows, nothing succeeds behind a
//! failure, configurations must agree, failures reach every rank fast, bad pointers and stale
//! handles are refused. One process per rank (`tests/common`).

use std::time::{Duration, Instant};

use cudarc::driver::{CudaSlice, DevicePtr};
use epcomm::{
    Buffer, BufferConfig, CombineInput, CombineOutput, DispatchInput, Error, RecvMode, XInput,
};
use epcomm_check::inputs::{Shape, device_inputs, host_inputs, upload};
use epcomm_check::verify::{RoundOptions, verified_round};
use epcomm_reference::bf16;

mod common;
use common::{MakeTransport, Worker, gpu_test, log, small_cfg_with};

/// A copy of the first `rows` rows at `ptr` (device address) as bf16.
fn rows_at(buf: &Buffer, ptr: u64, rows: usize, hidden: usize) -> Vec<bf16> {
    let mut host = vec![bf16::ZERO; rows * hidden];
    if host.is_empty() {
        return host;
    }
    buf.stream().synchronize().unwrap();
    // SAFETY: `ptr` addresses at least `rows * hidden` bf16 values of live device memory (a
    // test buffer sized for the capacity); the host vector holds as many.
    unsafe { cudarc::driver::sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), ptr, host.len() * 2) }
        .result()
        .unwrap();
    host
}

// ---------------------------------------------------------------------------------------------
// CUDA graphs: a consumer captured with the pointer a dispatch returned must read the rows of
// the current replay, for graphs with an odd and an even number of dispatches, also when
// host-issued dispatches come between replays.

fn run_graph_rows(w: &Worker, mk: MakeTransport<'_>) {
    let (rank, world) = (w.boot.rank(), w.boot.world_size());
    let (hidden, top_k, experts, tokens) = (256, 4, 8 * world, 96);
    let dims = (hidden, top_k, experts, tokens);
    let mut buf = common::graph_buffer(w, mk, dims, Duration::from_secs(20));
    let stream = buf.stream().clone();
    let cap = world * tokens;
    // Four routings, their received rows and combine outputs (reference).
    let variants = common::reference_cases(&stream, dims, rank, world, 4, 900, 3);
    let mut io = common::GraphIo::new(&stream, dims, cap);
    // What the captured consumers saw through the returned pointers.
    let seen: Vec<CudaSlice<bf16>> = (0..2)
        .map(|_| stream.alloc_zeros::<bf16>(cap * hidden).unwrap())
        .collect();
    let seen_ptr: Vec<u64> = seen.iter().map(|s| s.device_ptr(&stream).0).collect();
    let layout = buf.alloc_layout(tokens).unwrap();
    let handle = buf.alloc_handle(&layout).unwrap();
    // A consumer kernel: copies the received rows from the returned pointer (stream-ordered).
    let consume = |b: &Buffer, from: u64, to: u64| -> epcomm::Result<()> {
        // SAFETY: `from` is a receive view of `b` (cap rows of hidden bf16), `to` a test
        // buffer of cap rows; the copy is ordered on the buffer's stream.
        unsafe {
            cudarc::driver::sys::cuMemcpyDtoDAsync_v2(
                to,
                from,
                cap * hidden * 2,
                b.stream().cu_stream(),
            )
        }
        .result()
        .map_err(|source| Error::Driver {
            context: "consumer copy",
            source,
        })
    };
    for dispatches in [1usize, 2] {
        let graph = buf
            .capture(|b| {
                b.layout_into(&io.idx, &layout)?;
                for (i, to) in seen_ptr.iter().enumerate().take(dispatches) {
                    let from = if i == 0 {
                        let input = DispatchInput {
                            x: XInput::Bf16(&io.x),
                            topk_idx: &io.idx,
                            topk_weights: None,
                        };
                        b.dispatch_into(&input, &handle)?.recv_x_ptr()
                    } else {
                        b.cached_dispatch(&XInput::Bf16(&io.x), &handle)?
                            .recv_x_ptr()
                    };
                    consume(b, from, *to)?;
                }
                b.combine(
                    &CombineInput::new(&io.y),
                    &handle,
                    CombineOutput::new(&mut io.out),
                )
            })
            .expect("capture");
        let replays = 12;
        for i in 0..replays {
            let case = &variants[i % variants.len()];
            let (want_rows, want_out) = (&case.rows, &case.combined);
            io.load(&stream, case);
            buf.replay(&graph).unwrap();
            buf.synchronize()
                .unwrap_or_else(|e| panic!("{dispatches} dispatch(es), replay {i}: {e}"));
            for (j, p) in seen_ptr.iter().enumerate().take(dispatches) {
                let got = rows_at(&buf, *p, want_rows.len() / hidden, hidden);
                assert!(
                    &got == want_rows,
                    "graph with {dispatches} dispatch(es), replay {i}: the captured consumer \
                     of dispatch {j} read rows that are not this replay's"
                );
            }
            let got = stream.clone_dtoh(&io.out).unwrap();
            assert!(
                &got == want_out,
                "graph with {dispatches} dispatch(es), replay {i}: combine output differs"
            );
            // Host-issued dispatches between replays shift the device's region parity.
            if i % 3 == 1 {
                let shape = Shape::uniform(world, 50, hidden, top_k, experts, 40 + i as u64);
                let h = host_inputs(&shape).unwrap();
                let dd = device_inputs(&stream, &h, rank).unwrap();
                let opts = RoundOptions {
                    cached: false,
                    in_place: false,
                    ..RoundOptions::default()
                };
                verified_round(&mut buf, &h, &dd, opts).expect("round between replays");
            }
        }
        log(
            rank,
            format_args!("graph with {dispatches} dispatch(es): {replays} replays, rows verified"),
        );
    }
    buf.destroy().unwrap();
}

gpu_test!(graph_consumers_read_the_current_replay, run_graph_rows);

// ---------------------------------------------------------------------------------------------
// Ops queued behind a failure: rank 0 times out waiting for a late rank and has a cached
// dispatch queued behind it; the late rank resumes afterwards. No op may return Ok on any rank;
// a new Buffer then works.

fn negated(v: &[bf16]) -> Vec<bf16> {
    v.iter().map(|x| -*x).collect()
}

fn run_queued_after_failure(w: &Worker, mk: MakeTransport<'_>) {
    let (rank, world) = (w.boot.rank(), w.boot.world_size());
    let late = world - 1;
    let mut cfg = small_cfg_with(world, Duration::from_millis(300));
    let mut buf = Buffer::new(w.ctx.clone(), mk(), cfg.clone()).unwrap();
    let shape = Shape::uniform(world, 40, 128, 2, 4 * world, 21);
    let h = host_inputs(&shape).unwrap();
    let d = device_inputs(buf.stream(), &h, rank).unwrap();
    let layout = buf.layout(&d.topk_idx, 40).unwrap();
    let input = d.dispatch_input(false, false);
    w.boot.barrier("queued-warmup").unwrap();
    let h1 = buf
        .dispatch(&input, &layout, RecvMode::WorstCase)
        .unwrap()
        .into_handle();
    buf.synchronize().expect("first dispatch");
    let epcomm_reference::XData::Bf16(x) = &h.bf16[rank].x else {
        unreachable!()
    };
    let x2 = upload(buf.stream(), &negated(x)).unwrap();
    let h2 = buf.alloc_handle(&layout).unwrap();
    w.boot.barrier("queued-start").unwrap();
    if rank == late {
        buf.inject_delay(Duration::from_millis(1500)).unwrap();
    }
    let t0 = Instant::now();
    let recv = buf.dispatch_into(&input, &h2).map(|d| d.recv_x_ptr());
    if rank != late {
        // Queued behind the dispatch that is about to time out.
        buf.cached_dispatch(&XInput::Bf16(&x2), &h1)
            .map(|_| ())
            .expect("queueing a cached dispatch");
    }
    let r = recv.and_then(|p| buf.synchronize().map(|_| p));
    let waited = t0.elapsed();
    match (&r, rank == late) {
        (Err(e), _) => log(rank, format_args!("rank {rank}: {e} after {waited:?}")),
        (Ok(p), true) => {
            let want = epcomm_reference::dispatch(&h.bf16, 4 * world).unwrap();
            let n = want[rank].num_recv_tokens;
            let got = rows_at(&buf, *p, n, 128);
            let ok = got == want[rank].recv_x.to_bf16(128).unwrap();
            panic!(
                "the late rank's dispatch returned Ok after rank 0 failed (rows {})",
                if ok { "right" } else { "WRONG" }
            );
        }
        (Ok(_), false) => panic!("rank {rank} should have timed out waiting for rank {late}"),
    }
    if rank != late {
        // Its own timeout on the late rank, or (from three ranks on) another rank's, learned
        // first: both name the late rank.
        assert!(
            matches!(r, Err(Error::Timeout { peer, .. }) if peer as usize == late)
                || matches!(r, Err(Error::PeerFailed { late: Some(l), cause: "a timeout", .. }) if world > 2 && l == late),
            "{r:?}"
        );
    } else {
        // The late rank learns that another rank gave up waiting for it, before it writes
        // anything.
        assert!(
            matches!(r, Err(Error::PeerFailed { origin, late: Some(l), .. }) if origin != late && l == late),
            "{r:?}"
        );
    }
    // Everything after the failure is refused on every rank.
    assert!(buf.layout(&d.topk_idx, 40).is_err());
    buf.destroy().unwrap();
    // A new Buffer on every rank: nothing of the old ops leaks into it.
    cfg.timeout = Duration::from_secs(20);
    let mut buf = Buffer::new(w.ctx.clone(), mk(), cfg).unwrap();
    let d = device_inputs(buf.stream(), &h, rank).unwrap();
    for _ in 0..3 {
        verified_round(&mut buf, &h, &d, RoundOptions::default()).expect("round on a new Buffer");
    }
    buf.destroy().unwrap();
    log(
        rank,
        "queued ops behind a failure: errors on every rank; a new Buffer works",
    );
}

gpu_test!(nothing_succeeds_behind_a_failure, run_queued_after_failure);

// ---------------------------------------------------------------------------------------------
// Fail fast: an invalid expert id on rank 0 reaches the other ranks within milliseconds, not
// after their (long) timeout.

fn run_fail_fast(w: &Worker, mk: MakeTransport<'_>) {
    let (rank, world) = (w.boot.rank(), w.boot.world_size());
    let cfg = small_cfg_with(world, Duration::from_secs(30));
    let mut buf = Buffer::new(w.ctx.clone(), mk(), cfg).unwrap();
    let shape = Shape::uniform(world, 40, 128, 2, 4 * world, 5);
    let h = host_inputs(&shape).unwrap();
    let mut idx = h.bf16[rank].topk_idx.clone();
    if rank == 0 {
        idx[3 * 2 + 1] = (4 * world + 5) as i64;
    }
    let d = device_inputs(buf.stream(), &h, rank).unwrap();
    let idx = upload(buf.stream(), &idx).unwrap();
    w.boot.barrier("fail-fast").unwrap();
    let t0 = Instant::now();
    let r = buf.layout(&idx, 40).and_then(|layout| {
        let input = DispatchInput {
            x: XInput::Bf16(&d.x),
            topk_idx: &idx,
            topk_weights: None,
        };
        buf.dispatch(&input, &layout, RecvMode::WorstCase)
            .map(|_| ())
    });
    let r = r.and_then(|_| buf.synchronize());
    let waited = t0.elapsed();
    if rank == 0 {
        assert!(
            matches!(r, Err(Error::InvalidExpert { token: 3, .. })),
            "{r:?}"
        );
    } else {
        let e = r.expect_err("a peer of a failed rank must fail");
        assert!(
            matches!(
                e,
                Error::PeerFailed {
                    origin: 0,
                    cause: "an invalid expert id",
                    late: None,
                    ..
                }
            ),
            "the error names rank 0 and the cause: {e}"
        );
        assert!(
            waited < Duration::from_secs(3),
            "rank {rank} learned of rank 0's failure after {waited:?} (timeout 30 s): {e}"
        );
        log(rank, format_args!("rank {rank}: {e} after {waited:?}"));
    }
    buf.destroy().unwrap();
}

gpu_test!(peers_learn_a_failure_fast, run_fail_fast);

// ---------------------------------------------------------------------------------------------
// In-place combine weights: only a dispatch that carried weights wrote them.

fn run_in_place_weights(w: &Worker, mk: MakeTransport<'_>) {
    let rank = w.boot.rank();
    let (mut buf, h, d) = common::small_setup(w, mk, Duration::from_secs(20), 40, 8);
    let layout = buf.layout(&d.topk_idx, 40).unwrap();
    let mut out = buf.stream().alloc_zeros::<bf16>(40 * 128).unwrap();
    let mut out_w = buf.stream().alloc_zeros::<f32>(40 * 2).unwrap();
    // A dispatch without weights, then in place with out_weights.
    let input = d.dispatch_input(false, false);
    let handle = buf
        .dispatch(&input, &layout, RecvMode::HostSync)
        .unwrap()
        .into_handle();
    // Out weights after a dispatch without weights.
    let r = buf.combine_in_place(&handle, &mut out, Some(&mut out_w));
    common::assert_invalid(r, "out_weights");
    buf.combine_in_place(&handle, &mut out, None).unwrap();
    // A weighted dispatch, then a cached one (no weights travel), then in place with weights.
    let input = DispatchInput {
        topk_weights: Some(&d.topk_weights),
        ..input
    };
    let handle = buf
        .dispatch(&input, &layout, RecvMode::HostSync)
        .unwrap()
        .into_handle();
    buf.cached_dispatch(&XInput::Bf16(&d.x), &handle).unwrap();
    // Out weights after a cached dispatch.
    let r = buf.combine_in_place(&handle, &mut out, Some(&mut out_w));
    common::assert_invalid(r, "out_weights");
    buf.combine_in_place(&handle, &mut out, None).unwrap();
    // The weighted path still works.
    common::verify_and_destroy(buf, &h, &d);
    log(
        rank,
        "in-place weights: refused unless the latest dispatch carried them",
    );
}

gpu_test!(
    in_place_weights_need_a_weighted_dispatch,
    run_in_place_weights
);

// ---------------------------------------------------------------------------------------------
// Ranks that disagree on the configuration: every rank gets an error naming the field.

fn run_config_mismatch(w: &Worker, mk: MakeTransport<'_>) {
    let (rank, world) = (w.boot.rank(), w.boot.world_size());
    let base = small_cfg_with(world, Duration::from_secs(20));
    let other = |f: &dyn Fn(&mut BufferConfig)| {
        let mut c = base.clone();
        if rank == world - 1 {
            f(&mut c);
        }
        c
    };
    let cases: Vec<(&str, BufferConfig)> = vec![
        ("num_sms", other(&|c| c.num_sms += 4)),
        ("top_k", other(&|c| c.top_k = 1)),
    ];
    for (field, cfg) in cases {
        let r = Buffer::new(w.ctx.clone(), mk(), cfg);
        match r {
            Err(Error::ConfigMismatch { field: f, values }) => {
                assert_eq!(f, field, "{values}");
                assert!(values.contains(&format!("rank {}", world - 1)), "{values}");
            }
            Err(e) => panic!("{field}: expected ConfigMismatch, got {e}"),
            Ok(_) => panic!("rank {rank}: a Buffer whose {field} differs across ranks was built"),
        }
        log(
            rank,
            format_args!("{field} mismatch: refused on every rank"),
        );
    }
    // Agreeing ranks still build and run.
    let mut buf = Buffer::new(w.ctx.clone(), mk(), base).unwrap();
    let shape = Shape::uniform(world, 30, 128, 2, 4 * world, 2);
    let h = host_inputs(&shape).unwrap();
    let d = device_inputs(buf.stream(), &h, rank).unwrap();
    verified_round(&mut buf, &h, &d, RoundOptions::default()).unwrap();
    buf.destroy().unwrap();
}

gpu_test!(mismatched_configs_fail_on_every_rank, run_config_mismatch);

// ---------------------------------------------------------------------------------------------
// Input checks before launch: misaligned caller pointers, a handle whose layout was recomputed.

fn run_input_checks(w: &Worker, mk: MakeTransport<'_>) {
    let (rank, world) = (w.boot.rank(), w.boot.world_size());
    let (mut buf, h, d) = common::small_setup(w, mk, Duration::from_secs(20), 40, 3);
    let layout = buf.layout(&d.topk_idx, 40).unwrap();
    // x one element off a 16-byte boundary, with the right length.
    let wide = buf.stream().alloc_zeros::<bf16>(40 * 128 + 1).unwrap();
    let shifted = wide.slice(1..);
    let input = DispatchInput {
        x: XInput::Bf16(&shifted),
        topk_idx: &d.topk_idx,
        topk_weights: None,
    };
    common::assert_invalid(buf.dispatch(&input, &layout, RecvMode::HostSync), "x");
    // A handle, then its layout recomputed for another routing: the handle is stale.
    let input = d.dispatch_input(false, false);
    let handle = buf
        .dispatch(&input, &layout, RecvMode::HostSync)
        .unwrap()
        .into_handle();
    assert_eq!(
        handle.capacity(),
        world * 64,
        "a HostSync handle's capacity"
    );
    let other = host_inputs(&Shape::uniform(world, 40, 128, 2, 4 * world, 4)).unwrap();
    let other_idx = upload(buf.stream(), &other.bf16[rank].topk_idx).unwrap();
    buf.layout_into(&other_idx, &layout).unwrap();
    common::assert_invalid(buf.cached_dispatch(&XInput::Bf16(&d.x), &handle), "handle");
    let y = buf.stream().alloc_zeros::<bf16>(world * 64 * 128).unwrap();
    let mut out = buf.stream().alloc_zeros::<bf16>(40 * 128).unwrap();
    common::assert_invalid(
        buf.combine(
            &CombineInput::new(&y),
            &handle,
            CombineOutput::new(&mut out),
        ),
        "handle",
    );
    common::verify_and_destroy(buf, &h, &d);
    log(
        rank,
        "input checks: misaligned x and stale handles refused before launch",
    );
}

gpu_test!(bad_pointers_and_stale_handles_are_refused, run_input_checks);
