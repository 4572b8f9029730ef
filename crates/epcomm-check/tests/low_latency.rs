//! GPU tests of the low-latency ops (`Buffer::ll_dispatch`, `Buffer::ll_combine`): every shape
//! bit-exact against the CPU reference (`epcomm_reference::ll_dispatch`, the fp8 casts,
//! `combine_weighted_ll`), several calls in a row, the send/receive split with work between
//! the phases, CUDA-graph replays with new data each time, and a late rank named by a timeout.
//! One process per rank (`tests/common`).

use std::time::{Duration, Instant};

use cudarc::driver::DevicePtr;
use epcomm::{Buffer, BufferConfig, Error, LlDispatchInput, LlFormat, LlScalesLayout, WaitKind};
use epcomm_check::inputs::{Shape, host_inputs};
use epcomm_check::ll::{LlIo, bf16_rows, verify_ll_round, verify_ll_stats};
use epcomm_reference::{RankInput, bf16, combine_weighted_ll};

mod common;
use common::{MakeTransport, Worker, apply_test_config, gpu_test, log};

/// Most tokens per rank of the suite's buffers.
const MAX_TOKENS: usize = 256;

/// A buffer for low-latency ops of this shape (the normal-mode regions kept minimal).
fn ll_buffer(
    w: &Worker,
    mk: MakeTransport<'_>,
    hidden: usize,
    top_k: usize,
    experts: usize,
    timeout: Duration,
) -> Buffer {
    let mut cfg = BufferConfig::new(1, hidden, top_k, experts);
    cfg.ll_max_tokens_per_rank = MAX_TOKENS;
    cfg.timeout = timeout;
    apply_test_config(&mut cfg);
    Buffer::new(w.ctx.clone(), mk(), cfg).expect("Buffer::new")
}

/// Formats of the rounds of a shape: both dtypes (FP8 with and without rounded scales) where
/// the hidden size allows.
fn formats(hidden: usize) -> Vec<LlFormat> {
    if hidden.is_multiple_of(128) {
        vec![
            LlFormat::Bf16,
            LlFormat::Fp8 { round_scale: false },
            LlFormat::Fp8 { round_scale: true },
        ]
    } else {
        vec![LlFormat::Bf16, LlFormat::Bf16]
    }
}

// ---------------------------------------------------------------------------------------------
// The suite: every shape, every format, several calls in a row on one buffer per dimension set.

fn run_ll_suite(w: &Worker, mk: MakeTransport<'_>) {
    let (rank, world) = (w.boot.rank(), w.boot.world_size());
    // (hidden, top_k, experts per rank, cases: (tokens per rank, -1 probability, skew target)).
    type Case = (Vec<usize>, f64, Option<usize>);
    let full = |t: usize| vec![t; world];
    let ragged = |a: usize, b: usize| {
        (0..world)
            .map(|r| if r % 2 == 0 { a } else { b })
            .collect::<Vec<_>>()
    };
    let dims: Vec<(usize, usize, usize, Vec<Case>)> = vec![
        (
            7168,
            8,
            256 / world.min(256),
            vec![
                (full(128), 0.0, None),
                (ragged(0, 1), 0.0, None),
                (ragged(7, 256), 0.1, None),
                (full(64), 0.2, Some(0)),
            ],
        ),
        (
            2048,
            9,
            144,
            vec![
                (ragged(1, 7), 0.0, None),
                (ragged(256, 0), 0.3, None),
                (full(33), 0.0, Some(world - 1)),
            ],
        ),
        (
            128,
            1,
            2,
            vec![(ragged(5, 3), 0.0, None), (full(256), 0.5, None)],
        ),
        (
            200,
            3,
            3,
            vec![(ragged(10, 20), 0.1, None), (full(1), 0.0, None)],
        ),
        // The other top-k values, across hidden sizes.
        (2048, 2, 4, vec![(ragged(17, 40), 0.0, None)]),
        (3072, 4, 16, vec![(ragged(128, 9), 0.1, Some(0))]),
        (4096, 5, 8, vec![(full(31), 0.2, None)]),
        (5120, 6, 12, vec![(ragged(2, 64), 0.0, None)]),
        (6144, 7, 32, vec![(full(50), 0.05, None)]),
    ];
    let mut rounds = 0;
    for (hidden, top_k, epr, cases) in dims {
        let experts = epr * world;
        let mut buf = ll_buffer(w, mk, hidden, top_k, experts, Duration::from_secs(30));
        let mut recv = buf.alloc_ll_recv().unwrap();
        let stream = buf.stream().clone();
        for (ci, (tokens, mask_prob, skew_to)) in cases.into_iter().enumerate() {
            let shape = Shape {
                tokens: tokens.clone(),
                hidden,
                top_k,
                experts,
                mask_prob,
                skew_to,
                seed: 1000 + ci as u64 * 17 + hidden as u64,
            };
            let inputs = host_inputs(&shape).unwrap().bf16;
            let cap = recv.capacity();
            let io = LlIo::new(&stream, &inputs, rank, experts, cap).unwrap();
            let mut out = io.out;
            let mut stats = io.stats;
            let mut added = vec![0i64; recv.num_local_experts()];
            // Every other case writes FP8 scales per expert column-major (DeepEP's layout).
            let layout = if ci % 2 == 1 {
                LlScalesLayout::ColumnMajor
            } else {
                LlScalesLayout::RowMajor
            };
            recv.set_scales_layout(layout);
            for format in formats(hidden) {
                let what = format!(
                    "hidden {hidden} top-{top_k} of {experts}, tokens {tokens:?}, -1 p={mask_prob}, skew {skew_to:?}, {format:?}, scales {layout:?}"
                );
                // Every round adds to the same cumulative stats.
                let input = LlDispatchInput {
                    x: &io.x,
                    topk_idx: &io.idx,
                    num_tokens: io.num_tokens,
                    cumulative_stats: Some(&mut stats),
                };
                buf.ll_dispatch(input, format, &mut recv)
                    .unwrap_or_else(|e| panic!("{what}: dispatch: {e}"));
                buf.ll_combine(&io.y, &io.idx, &io.w, &recv, &mut out)
                    .unwrap_or_else(|e| panic!("{what}: combine: {e}"));
                buf.synchronize().unwrap_or_else(|e| panic!("{what}: {e}"));
                verify_ll_round(&buf, &inputs, &recv, &out, format, &what)
                    .unwrap_or_else(|e| panic!("{e}"));
                for (a, c) in added.iter_mut().zip(recv.count_to_host().unwrap()) {
                    *a += i64::from(c);
                }
                verify_ll_stats(&stream, &stats, &added, rank, &what)
                    .unwrap_or_else(|e| panic!("{e}"));
                rounds += 1;
            }
        }
        buf.destroy().unwrap();
    }
    log(
        rank,
        format_args!("low-latency suite: {rounds} rounds bit-exact"),
    );
}

gpu_test!(ll_suite_matches_reference, run_ll_suite);

// ---------------------------------------------------------------------------------------------
// Hooks: the send phase returns, work runs on the stream and the host, then the receive phase;
// no other op may start while a receive is pending.

fn run_ll_hooks(w: &Worker, mk: MakeTransport<'_>) {
    let (rank, world) = (w.boot.rank(), w.boot.world_size());
    let (hidden, top_k, experts) = (2048, 4, 8 * world);
    let mut buf = ll_buffer(w, mk, hidden, top_k, experts, Duration::from_secs(30));
    let mut recv = buf.alloc_ll_recv().unwrap();
    let stream = buf.stream().clone();
    let scratch = stream.alloc_zeros::<u8>(64 << 20).unwrap();
    let (scratch_ptr, _g) = scratch.device_ptr(&stream);
    for round in 0..4 {
        let shape = Shape::uniform(
            world,
            48 + round * 20,
            hidden,
            top_k,
            experts,
            77 + round as u64,
        );
        let inputs = host_inputs(&shape).unwrap().bf16;
        let io = LlIo::new(&stream, &inputs, rank, experts, recv.capacity()).unwrap();
        let mut out = io.out;
        let mut stats = io.stats;
        let format = if round % 2 == 0 {
            LlFormat::Bf16
        } else {
            LlFormat::Fp8 { round_scale: false }
        };
        let input = LlDispatchInput {
            x: &io.x,
            topk_idx: &io.idx,
            num_tokens: shape.tokens[rank],
            // Added to by the receive phase, after the work between the phases.
            cumulative_stats: Some(&mut stats),
        };
        let pending = buf.ll_dispatch_send(input, format, &mut recv).unwrap();
        // Work between the phases: a 64 MiB memset on the comm stream and a host pause.
        // SAFETY: scratch is a live 64 MiB device allocation; the memset is stream-ordered.
        unsafe {
            cudarc::driver::sys::cuMemsetD8Async(
                scratch_ptr,
                round as u8,
                64 << 20,
                stream.cu_stream(),
            )
        }
        .result()
        .unwrap();
        std::thread::sleep(Duration::from_millis(5));
        buf.ll_receive(pending).unwrap();
        let pending = buf
            .ll_combine_send(&io.y, &io.idx, &io.w, &recv, &mut out)
            .unwrap();
        // Another op while a receive is pending is refused, and changes nothing (only
        // `inject_delay`, which touches nothing but the stream, is allowed between phases).
        let refused = buf.layout(&io.idx, shape.tokens[rank]).map(|_| ());
        assert!(
            matches!(
                &refused,
                Err(Error::InvalidArgument {
                    argument: "LlPending",
                    ..
                })
            ),
            "{refused:?}"
        );
        buf.ll_receive(pending).unwrap();
        buf.synchronize().unwrap();
        verify_ll_round(
            &buf,
            &inputs,
            &recv,
            &out,
            format,
            &format!("hook round {round}"),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let added: Vec<i64> = recv
            .count_to_host()
            .unwrap()
            .into_iter()
            .map(i64::from)
            .collect();
        verify_ll_stats(
            &stream,
            &stats,
            &added,
            rank,
            &format!("hook round {round}"),
        )
        .unwrap_or_else(|e| panic!("{e}"));
    }
    log(
        rank,
        "low-latency hooks: 4 rounds with work between the phases, bit-exact",
    );
    buf.destroy().unwrap();
}

gpu_test!(ll_hooks_split_send_and_receive, run_ll_hooks);

// ---------------------------------------------------------------------------------------------
// CUDA graphs: dispatch, an identity "expert" (a copy of the received rows into y) and combine,
// captured once and replayed 1000 times with new inputs before every replay.

fn run_ll_graph(w: &Worker, mk: MakeTransport<'_>) {
    let (rank, world) = (w.boot.rank(), w.boot.world_size());
    let (hidden, top_k, experts, tokens) = (256, 4, 4 * world, 40);
    // SAFETY: the test uses one stream for everything, so no cross-stream ordering is lost
    // (cudarc's events, recorded outside the capture, would otherwise land in it).
    unsafe { w.ctx.disable_event_tracking() };
    let mut buf = ll_buffer(w, mk, hidden, top_k, experts, Duration::from_secs(30));
    let mut recv = buf.alloc_ll_recv().unwrap();
    let stream = buf.stream().clone();
    let variants: Vec<Vec<RankInput>> = (0..6)
        .map(|v| {
            let mut shape = Shape::uniform(world, tokens, hidden, top_k, experts, 300 + v);
            shape.mask_prob = if v % 2 == 0 { 0.0 } else { 0.25 };
            host_inputs(&shape).unwrap().bf16
        })
        .collect();
    let mut x = stream.alloc_zeros::<bf16>(tokens * hidden).unwrap();
    let mut idx = stream.alloc_zeros::<i64>(tokens * top_k).unwrap();
    let mut wts = stream.alloc_zeros::<f32>(tokens * top_k).unwrap();
    let cap = recv.capacity();
    let mut y = stream
        .alloc_zeros::<bf16>(recv.num_local_experts() * cap * hidden)
        .unwrap();
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
                    cap * recv.num_local_experts() * hidden * 2,
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
    let replays = 1000;
    let t0 = Instant::now();
    for i in 0..replays {
        let inputs = &variants[i % variants.len()];
        let me = &inputs[rank];
        stream.memcpy_htod(bf16_rows(me).unwrap(), &mut x).unwrap();
        stream.memcpy_htod(&me.topk_idx, &mut idx).unwrap();
        stream.memcpy_htod(&me.topk_weights, &mut wts).unwrap();
        buf.replay(&graph).unwrap();
        let got = stream.clone_dtoh(&out).unwrap();
        // Identity experts: every valid (t, k) returns this rank's own row t.
        let rows = bf16_rows(me).unwrap();
        let mut expert_out = vec![bf16::ZERO; tokens * top_k * hidden];
        for t in 0..tokens {
            for k in 0..top_k {
                let o = (t * top_k + k) * hidden;
                expert_out[o..o + hidden].copy_from_slice(&rows[t * hidden..(t + 1) * hidden]);
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
        assert!(got == want, "replay {i}: combine output differs");
    }
    buf.synchronize().unwrap();
    log(
        rank,
        format_args!(
            "low-latency graph: {replays} replays with new inputs, bit-exact ({:?})",
            t0.elapsed()
        ),
    );
    buf.destroy().unwrap();
}

gpu_test!(ll_graph_replays_new_data, run_ll_graph);

// ---------------------------------------------------------------------------------------------
// A late rank: the others time out naming it, the late rank learns of the failure.

fn run_ll_late_rank(w: &Worker, mk: MakeTransport<'_>) {
    let (rank, world) = (w.boot.rank(), w.boot.world_size());
    let late = world - 1;
    let (hidden, top_k, experts) = (256, 2, 4 * world);
    let mut buf = ll_buffer(w, mk, hidden, top_k, experts, Duration::from_millis(300));
    let mut recv = buf.alloc_ll_recv().unwrap();
    let stream = buf.stream().clone();
    let shape = Shape::uniform(world, 16, hidden, top_k, experts, 5);
    let inputs = host_inputs(&shape).unwrap().bf16;
    let io = LlIo::new(&stream, &inputs, rank, experts, recv.capacity()).unwrap();
    let input = || LlDispatchInput {
        x: &io.x,
        topk_idx: &io.idx,
        num_tokens: 16,
        cumulative_stats: None,
    };
    buf.ll_dispatch(input(), LlFormat::Bf16, &mut recv).unwrap();
    buf.synchronize().expect("warm-up dispatch");
    w.boot.barrier("ll-late-start").unwrap();
    if rank == late {
        buf.inject_delay(Duration::from_millis(1500)).unwrap();
    }
    let r = buf
        .ll_dispatch(input(), LlFormat::Bf16, &mut recv)
        .and_then(|_| buf.synchronize());
    if rank == late {
        // It learns that another rank timed out waiting for it.
        assert!(
            matches!(&r, Err(Error::PeerFailed { late: Some(l), cause: "a timeout", .. }) if *l == late),
            "the late rank: {r:?}"
        );
    } else {
        // Every other rank waits for the late one. With three or more ranks, one of them may
        // learn of another's timeout before its own wait expires: it then stops with
        // PeerFailed naming that rank and its timeout as the origin, and the late rank as the
        // one the origin waited for.
        let own_timeout = matches!(&r, Err(Error::Timeout { peer, wait: WaitKind::LlDispatchData | WaitKind::Barrier, .. })
                    if *peer as usize == late);
        let peer_timeout = matches!(&r, Err(Error::PeerFailed { origin, late: Some(l), cause: "a timeout", .. })
                    if *origin != late && *origin != rank && *l == late);
        assert!(own_timeout || (world > 2 && peer_timeout), "{r:?}");
    }
    log(rank, format_args!("late rank {late}: {}", r.unwrap_err()));
    // Nothing runs on a failed buffer.
    assert!(matches!(
        buf.ll_dispatch(input(), LlFormat::Bf16, &mut recv),
        Err(Error::Failed(_))
    ));
    drop(buf);
    w.boot.barrier("ll-late-end").unwrap();
}

gpu_test!(ll_late_rank_is_named, run_ll_late_rank);

// ---------------------------------------------------------------------------------------------
// Rank masking (`BufferConfig::ll_masking`): ranks stop mid-decode and the others keep decoding.
// The last rank stops before a dispatch, the one before it (worlds of 4 or more) between a
// dispatch and its combine; they stay alive (their memory mapped) but issue nothing more. Every
// other rank masks each at its first wait for it, and from then on skips it at once; every round
// is bit-exact against the reference without the stopped ranks' tokens and with their experts'
// entries as -1.

/// `inputs` as the survivors see them: the tokens of `silent` ranks gone, and every entry whose
/// expert lives on a rank of `dead` set to -1 (it contributes nothing to a combine).
fn survivors_view(
    inputs: &[RankInput],
    experts: usize,
    silent: &[usize],
    dead: &[usize],
) -> Vec<RankInput> {
    let epr = experts / inputs.len();
    inputs
        .iter()
        .enumerate()
        .map(|(r, inp)| {
            let mut v = inp.clone();
            if silent.contains(&r) {
                v.x = epcomm_reference::XData::Bf16(Vec::new());
                v.topk_idx.clear();
                v.topk_weights.clear();
                v.num_tokens = 0;
            }
            for e in &mut v.topk_idx {
                if *e >= 0 && dead.contains(&(*e as usize / epr)) {
                    *e = -1;
                }
            }
            v
        })
        .collect()
}

fn run_ll_masking(w: &Worker, mk: MakeTransport<'_>) {
    let (rank, world) = (w.boot.rank(), w.boot.world_size());
    let (hidden, top_k, experts) = (1024, 4, 4 * world);
    let timeout = Duration::from_millis(300);
    let mut cfg = BufferConfig::new(1, hidden, top_k, experts);
    cfg.ll_max_tokens_per_rank = MAX_TOKENS;
    cfg.timeout = timeout;
    cfg.ll_masking = true;
    apply_test_config(&mut cfg);
    let mut buf = Buffer::new(w.ctx.clone(), mk(), cfg).expect("Buffer::new");
    let mut recv = buf.alloc_ll_recv().unwrap();
    let stream = buf.stream().clone();
    // Stops before round 1's dispatch; stops before round 2's combine (world >= 4).
    let before_dispatch = world - 1;
    let before_combine = (world >= 4).then(|| world - 2);
    let mut status = stream.alloc_zeros::<i32>(world).unwrap();
    for round in 0..5usize {
        let shape = Shape::uniform(
            world,
            40 + 7 * round,
            hidden,
            top_k,
            experts,
            900 + round as u64,
        );
        let inputs = host_inputs(&shape).unwrap().bf16;
        let io = LlIo::new(&stream, &inputs, rank, experts, recv.capacity()).unwrap();
        let mut out = io.out;
        let format = if round % 2 == 0 {
            LlFormat::Bf16
        } else {
            LlFormat::Fp8 {
                round_scale: round == 3,
            }
        };
        let input = LlDispatchInput {
            x: &io.x,
            topk_idx: &io.idx,
            num_tokens: shape.tokens[rank],
            cumulative_stats: None,
        };
        if round >= 1 && rank == before_dispatch {
            break;
        }
        if round >= 2 && Some(rank) == before_combine {
            if round == 2 {
                buf.ll_dispatch(input, format, &mut recv).unwrap();
                buf.synchronize().unwrap();
            }
            break;
        }
        let t0 = Instant::now();
        if round == 4 {
            // The hook path: both phases skip the masked ranks too.
            let p = buf.ll_dispatch_send(input, format, &mut recv).unwrap();
            buf.ll_receive(p).unwrap();
            let p = buf
                .ll_combine_send(&io.y, &io.idx, &io.w, &recv, &mut out)
                .unwrap();
            buf.ll_receive(p).unwrap();
        } else {
            buf.ll_dispatch(input, format, &mut recv).unwrap();
            buf.ll_combine(&io.y, &io.idx, &io.w, &recv, &mut out)
                .unwrap();
        }
        buf.synchronize()
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        let took = t0.elapsed();
        // Who is gone by this round, as every survivor sees it.
        let mut silent = vec![];
        let mut dead = vec![];
        if round >= 1 {
            silent.push(before_dispatch);
            dead.push(before_dispatch);
        }
        if let Some(c) = before_combine.filter(|_| round >= 2) {
            dead.push(c);
            if round >= 3 {
                silent.push(c);
            }
        }
        let view = survivors_view(&inputs, experts, &silent, &dead);
        verify_ll_round(
            &buf,
            &view,
            &recv,
            &out,
            format,
            &format!("masking round {round}"),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let mut masked = buf.ll_masked_ranks().unwrap();
        masked.sort_unstable();
        dead.sort_unstable();
        assert_eq!(masked, dead, "round {round}: the mask");
        buf.ll_mask_into(&mut status).unwrap();
        let on_device = stream.clone_dtoh(&status).unwrap();
        let want: Vec<i32> = (0..world).map(|r| i32::from(dead.contains(&r))).collect();
        assert_eq!(
            on_device, want,
            "round {round}: the mask copied on the stream"
        );
        // A round that meets a newly stopped rank waits out the timeout once; later rounds skip
        // the masked ranks without waiting.
        let newly = round == 1 || (round == 2 && before_combine.is_some());
        if !newly {
            assert!(
                took < timeout,
                "round {round} took {took:?}: a masked rank was waited for"
            );
        }
        log(
            rank,
            format_args!("masking round {round}: bit-exact without ranks {dead:?} ({took:?})"),
        );
    }
    // Bad mask calls are typed errors that change nothing.
    if rank != before_dispatch && Some(rank) != before_combine {
        assert!(matches!(
            buf.ll_set_masked(rank, true),
            Err(Error::InvalidArgument {
                argument: "rank",
                ..
            })
        ));
        assert!(matches!(
            buf.ll_set_masked(world, true),
            Err(Error::InvalidArgument {
                argument: "rank",
                ..
            })
        ));
    }
    w.boot.barrier("ll-masking-end").unwrap();
    drop(buf);
    w.boot.barrier("ll-masking-dropped").unwrap();
}

gpu_test!(ll_masking_survivors_keep_decoding, run_ll_masking);

// Masking set and cleared by the caller: a rank masked by hand is skipped (its tokens and its
// experts' entries absent) while it keeps running; cleared, every round is whole again.
fn run_ll_mask_by_hand(w: &Worker, mk: MakeTransport<'_>) {
    let (rank, world) = (w.boot.rank(), w.boot.world_size());
    let (hidden, top_k, experts) = (512, 3, 2 * world);
    let mut cfg = BufferConfig::new(1, hidden, top_k, experts);
    cfg.ll_max_tokens_per_rank = MAX_TOKENS;
    cfg.timeout = Duration::from_secs(20);
    cfg.ll_masking = true;
    apply_test_config(&mut cfg);
    let mut buf = Buffer::new(w.ctx.clone(), mk(), cfg).expect("Buffer::new");
    let mut recv = buf.alloc_ll_recv().unwrap();
    let stream = buf.stream().clone();
    let hidden_rank = 0;
    for round in 0..3usize {
        let shape = Shape::uniform(world, 33, hidden, top_k, experts, 40 + round as u64);
        let inputs = host_inputs(&shape).unwrap().bf16;
        let io = LlIo::new(&stream, &inputs, rank, experts, recv.capacity()).unwrap();
        let mut out = io.out;
        // Round 1: every other rank masks rank 0, and rank 0 masks every other rank.
        if round == 1 {
            for r in 0..world {
                if r != rank && (rank == hidden_rank || r == hidden_rank) {
                    buf.ll_set_masked(r, true).unwrap();
                }
            }
        }
        if round == 2 {
            buf.ll_clear_mask().unwrap();
        }
        let input = LlDispatchInput {
            x: &io.x,
            topk_idx: &io.idx,
            num_tokens: 33,
            cumulative_stats: None,
        };
        buf.ll_dispatch(input, LlFormat::Bf16, &mut recv).unwrap();
        buf.ll_combine(&io.y, &io.idx, &io.w, &recv, &mut out)
            .unwrap();
        buf.synchronize().unwrap();
        let view = if round == 1 {
            // Rank 0 and the others see each other as gone.
            let gone: Vec<usize> = (0..world)
                .filter(|&r| r != rank && (rank == hidden_rank || r == hidden_rank))
                .collect();
            survivors_view(&inputs, experts, &gone, &gone)
        } else {
            inputs.clone()
        };
        verify_ll_round(
            &buf,
            &view,
            &recv,
            &out,
            LlFormat::Bf16,
            &format!("by hand {round}"),
        )
        .unwrap_or_else(|e| panic!("{e}"));
    }
    log(rank, "masking by hand: masked, then cleared, bit-exact");
    buf.destroy().unwrap();
}

gpu_test!(ll_mask_by_hand_and_cleared, run_ll_mask_by_hand);
