//! Pipelined soak: thousands of ops issued without a host sync — changing token counts,
//! dispatch + combine, cached dispatch, in-place combine and graph replays interleaved, one
//! rank's stream delayed every few ops — with sampled outputs (received rows and combine
//! results) copied aside stream-ordered and verified against the reference at the end.
//! `EPCOMM_SOAK_OPS` sets the op count (default 10,000).

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaSlice, CudaStream, CudaViewMut, DevicePtr};
use epcomm::{CombineInput, CombineOutput, DispatchInput, RecvMode, XInput};
use epcomm_check::inputs::Shape;
use epcomm_reference::bf16;

mod common;
use common::{Case, MakeTransport, Worker, gpu_test, log};

/// A stream-ordered copy of `elems` bf16 values from device address `from` into `to`.
fn copy_aside(stream: &CudaStream, from: u64, to: &CudaSlice<bf16>, elems: usize) {
    if elems == 0 {
        return;
    }
    let (dst, _g) = to.device_ptr(stream);
    // SAFETY: `from` holds at least `elems` values (a receive view or an output of that size)
    // and `to` was allocated with at least as many; ordered on the buffer's stream.
    unsafe { cudarc::driver::sys::cuMemcpyDtoDAsync_v2(dst, from, elems * 2, stream.cu_stream()) }
        .result()
        .unwrap();
}

/// What a sample must hold once the stream drained.
struct Sample {
    what: String,
    got: CudaSlice<bf16>,
    want: Vec<bf16>,
}

/// Runs `op` with an output of `len` values: a fresh one recorded as a [`Sample`] when `check`
/// names what it must hold, else the shared `scratch`.
fn sampled(
    stream: &Arc<CudaStream>,
    scratch: &mut CudaSlice<bf16>,
    len: usize,
    check: Option<(String, &Vec<bf16>)>,
    samples: &mut Vec<Sample>,
    op: impl FnOnce(&mut CudaViewMut<'_, bf16>) -> epcomm::Result<()>,
) {
    match check {
        Some((what, want)) => {
            let mut got = stream.alloc_zeros::<bf16>(len.max(1)).unwrap();
            op(&mut got.slice_mut(..len)).unwrap();
            samples.push(Sample {
                what,
                got,
                want: want.clone(),
            });
        }
        None => op(&mut scratch.slice_mut(..len)).unwrap(),
    }
}

fn run_soak(w: &Worker, mk: MakeTransport<'_>) {
    let (rank, world) = (w.boot.rank(), w.boot.world_size());
    let (hidden, top_k, experts, max_tokens) = (256, 4, 8 * world, 200);
    let dims = (hidden, top_k, experts, max_tokens);
    let mut buf = common::graph_buffer(w, mk, dims, Duration::from_secs(30));
    let stream = buf.stream().clone();
    let cap = world * max_tokens;
    let ops_wanted: usize = std::env::var("EPCOMM_SOAK_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let cases: Vec<Case> = (0..8usize)
        .map(|i| {
            let shape = Shape {
                tokens: (0..world)
                    .map(|r| [0, 1, 7, 200, 133, 64, 199, 90][(i + 3 * r) % 8])
                    .collect(),
                hidden,
                top_k,
                experts,
                mask_prob: if i % 3 == 0 { 0.2 } else { 0.0 },
                skew_to: (i % 4 == 3).then_some(i % world),
                seed: 7000 + i as u64,
            };
            common::reference_case(&stream, &shape, rank, cap)
        })
        .collect();
    // The graph: layout + dispatch + a consumer copy of the received rows + combine, on fixed
    // buffers that each replay refills from one of the cases.
    let gcase = &cases[3];
    let g_tokens = gcase.d.num_tokens;
    let idx_g = stream.clone_dtod(&gcase.d.topk_idx).unwrap();
    let x_g = stream.clone_dtod(&gcase.d.x).unwrap();
    let mut out_g = stream.alloc_zeros::<bf16>(g_tokens * hidden).unwrap();
    let rows_g = stream.alloc_zeros::<bf16>(cap * hidden).unwrap();
    let rows_g_ptr = rows_g.device_ptr(&stream).0;
    let layout_g = buf.alloc_layout(g_tokens).unwrap();
    let handle_g = buf.alloc_handle(&layout_g).unwrap();
    let graph = buf
        .capture(|b| {
            b.layout_into(&idx_g, &layout_g)?;
            let input = DispatchInput {
                x: XInput::Bf16(&x_g),
                topk_idx: &idx_g,
                topk_weights: None,
            };
            let from = b.dispatch_into(&input, &handle_g)?.recv_x_ptr();
            copy_aside(b.stream(), from, &rows_g, cap * hidden);
            b.combine(
                &CombineInput::new(&gcase.y),
                &handle_g,
                CombineOutput::new(&mut out_g),
            )
        })
        .expect("capture");
    let out_g_ptr = out_g.device_ptr(&stream).0;

    let mut scratch = stream.alloc_zeros::<bf16>(max_tokens * hidden).unwrap();
    let mut samples: Vec<Sample> = Vec::new();
    let mut last: Option<(usize, epcomm::Handle)> = None;
    let mut ops = 0usize;
    let mut delays = 0usize;
    let t0 = Instant::now();
    let mut i = 0usize;
    w.boot.barrier("soak-start").unwrap();
    while ops < ops_wanted {
        // The same op sequence on every rank (it depends on i only).
        let k = (i * 5 + i / 8) % cases.len();
        let c = &cases[k];
        let t = c.d.num_tokens;
        let sample = i % 16 == 5;
        if i % 5 == 2 && rank == (i / 5) % world {
            buf.inject_delay(Duration::from_micros(50 + (i as u64 * 37) % 250))
                .unwrap();
            delays += 1;
        }
        match i % 4 {
            // Dispatch + combine (y from outside).
            0 | 1 => {
                let layout = buf.layout(&c.d.topk_idx, t).unwrap();
                let input = DispatchInput {
                    x: XInput::Bf16(&c.d.x),
                    topk_idx: &c.d.topk_idx,
                    topk_weights: None,
                };
                let (handle, from) = {
                    let d = buf.dispatch(&input, &layout, RecvMode::WorstCase).unwrap();
                    let p = d.recv_x_ptr();
                    (d.into_handle(), p)
                };
                if sample {
                    let got = stream.alloc_zeros::<bf16>(c.rows.len().max(1)).unwrap();
                    copy_aside(&stream, from, &got, c.rows.len());
                    samples.push(Sample {
                        what: format!("op {ops}: dispatch rows (case {k})"),
                        got,
                        want: c.rows.clone(),
                    });
                }
                let check = sample.then(|| (format!("op {ops}: combine (case {k})"), &c.combined));
                sampled(
                    &stream,
                    &mut scratch,
                    t * hidden,
                    check,
                    &mut samples,
                    |out| buf.combine(&CombineInput::new(&c.y), &handle, CombineOutput::new(out)),
                );
                ops += 3;
                last = Some((k, handle));
            }
            // Cached dispatch along the last routing, then an in-place combine of it.
            2 => {
                let Some((lk, handle)) = last.take() else {
                    unreachable!("i % 4 == 2 follows a dispatch")
                };
                let lc = &cases[lk];
                let lt = lc.d.num_tokens;
                {
                    let d = buf
                        .cached_dispatch(&XInput::Bf16(&lc.d.x), &handle)
                        .unwrap();
                    if sample {
                        let got = stream.alloc_zeros::<bf16>(lc.rows.len().max(1)).unwrap();
                        copy_aside(&stream, d.recv_x_ptr(), &got, lc.rows.len());
                        samples.push(Sample {
                            what: format!("op {ops}: cached dispatch rows (case {lk})"),
                            got,
                            want: lc.rows.clone(),
                        });
                    }
                    if !lc.rows.is_empty() {
                        d.copy_into_recv_x(&lc.y.slice(..lc.rows.len())).unwrap();
                    }
                }
                let what = format!("op {ops}: in-place combine (case {lk})");
                let check = sample.then_some((what, &lc.combined));
                sampled(
                    &stream,
                    &mut scratch,
                    lt * hidden,
                    check,
                    &mut samples,
                    |out| buf.combine_in_place(&handle, out, None),
                );
                ops += 2;
            }
            // A graph replay with this iteration's case when it has the graph's token count.
            _ => {
                buf.replay(&graph).unwrap();
                if sample {
                    let got = stream.alloc_zeros::<bf16>(g_tokens * hidden).unwrap();
                    copy_aside(&stream, out_g_ptr, &got, g_tokens * hidden);
                    samples.push(Sample {
                        what: format!("op {ops}: graph replay combine"),
                        got,
                        want: gcase.combined.clone(),
                    });
                    let rows = stream.alloc_zeros::<bf16>(gcase.rows.len().max(1)).unwrap();
                    copy_aside(&stream, rows_g_ptr, &rows, gcase.rows.len());
                    samples.push(Sample {
                        what: format!("op {ops}: graph replay rows"),
                        got: rows,
                        want: gcase.rows.clone(),
                    });
                }
                ops += 3;
            }
        }
        i += 1;
    }
    buf.synchronize().expect("pipelined soak");
    let issued = t0.elapsed();
    let mut checked = 0;
    for s in &samples {
        let mut got = stream.clone_dtoh(&s.got).unwrap();
        got.truncate(s.want.len());
        assert!(
            got == s.want,
            "rank {rank}: {} differs from the reference",
            s.what
        );
        checked += 1;
    }
    log(
        rank,
        format_args!(
            "soak: {ops} ops ({i} steps, this rank's stream delayed {delays} times) without a \
             host sync in {issued:?}; {checked} sampled outputs match the reference"
        ),
    );
    drop(graph);
    buf.destroy().unwrap();
}

gpu_test!(pipelined_soak_matches_reference, run_soak);
