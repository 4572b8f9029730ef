//! GPU test: a combine leaves the dispatch's outputs as they are. With the default config
//! (automatic staging, 24 SMs, every peer mapped on `ipc`) and a HostSync dispatch, the received
//! rows and weights read after a plain `combine` are still the ones the dispatch delivered. One
//! process per rank (`tests/common`).

use std::time::Duration;

use epcomm::{Buffer, CombineInput, CombineOutput, CombineStaging, RecvMode};
use epcomm_check::inputs::{Shape, device_inputs, host_inputs};
use epcomm_reference::bf16;

mod common;
use common::{MakeTransport, Worker, gpu_test, log};

/// A host copy of `n` values of `T` at device address `ptr` (the stream is synchronized first).
fn read_back<T: Copy + Default>(buf: &Buffer, ptr: u64, n: usize) -> Vec<T> {
    let mut host = vec![T::default(); n];
    if n == 0 {
        return host;
    }
    buf.stream().synchronize().unwrap();
    // SAFETY: `ptr` addresses at least `n` values of `T` in this rank's receive region (the
    // dispatch's own views named that many), which the live Buffer keeps mapped; the host
    // vector holds as many.
    unsafe {
        cudarc::driver::sys::cuMemcpyDtoH_v2(
            host.as_mut_ptr().cast(),
            ptr,
            n * std::mem::size_of::<T>(),
        )
    }
    .result()
    .unwrap();
    host
}

fn run_outputs_kept(w: &Worker, mk: MakeTransport<'_>) {
    let (rank, world) = (w.boot.rank(), w.boot.world_size());
    let (tokens, hidden, top_k) = (40, 128, 2);
    let mut cfg = common::small_cfg_with(world, Duration::from_secs(20));
    // The default way, whatever the test matrix chose: the rule is about the default.
    cfg.combine_staging = CombineStaging::Auto;
    let mut buf = Buffer::new(w.ctx.clone(), mk(), cfg).unwrap();
    let shape = Shape::uniform(world, tokens, hidden, top_k, 4 * world, 21);
    let h = host_inputs(&shape).unwrap();
    let d = device_inputs(buf.stream(), &h, rank).unwrap();
    let layout = buf.layout(&d.topk_idx, tokens).unwrap();
    let input = d.dispatch_input(false, true);
    for round in 0..3 {
        let (x_before, w_before, x_ptr, w_ptr, rows, handle) = {
            let disp = buf.dispatch(&input, &layout, RecvMode::HostSync).unwrap();
            let rows = disp.num_recv().unwrap();
            (
                disp.recv_x_bf16_to_host().unwrap(),
                disp.recv_topk_weights_to_host().unwrap(),
                disp.recv_x_ptr(),
                disp.recv_topk_weights_ptr().unwrap(),
                rows,
                disp.into_handle(),
            )
        };
        assert!(rows > 0, "rank {rank}: the routing must send rows here");
        // Expert outputs unlike the received rows.
        let y = buf
            .stream()
            .clone_htod(&vec![bf16::from_f32(1.5 + round as f32); rows * hidden])
            .unwrap();
        let yw = buf
            .stream()
            .clone_htod(&vec![0.25f32; rows * top_k])
            .unwrap();
        let mut out = buf.stream().alloc_zeros::<bf16>(tokens * hidden).unwrap();
        let mut out_w = buf.stream().alloc_zeros::<f32>(tokens * top_k).unwrap();
        buf.combine(
            &CombineInput::new(&y).with_weights(&yw),
            &handle,
            CombineOutput::new(&mut out).with_weights(&mut out_w),
        )
        .unwrap();
        buf.synchronize().unwrap();
        let x_after: Vec<bf16> = read_back(&buf, x_ptr, rows * hidden);
        let w_after: Vec<f32> = read_back(&buf, w_ptr, rows * top_k);
        let changed_rows = (0..rows)
            .filter(|&r| {
                x_after[r * hidden..(r + 1) * hidden] != x_before[r * hidden..(r + 1) * hidden]
            })
            .count();
        assert_eq!(
            changed_rows, 0,
            "rank {rank} round {round}: combine rewrote {changed_rows} of {rows} received rows"
        );
        let w_bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            w_bits(&w_after),
            w_bits(&w_before),
            "rank {rank} round {round}: combine rewrote the received top-k weights"
        );
    }
    common::verify_and_destroy(buf, &h, &d);
    log(rank, "combine left the dispatch outputs as they were");
}

gpu_test!(combine_leaves_the_dispatch_outputs, run_outputs_kept);
