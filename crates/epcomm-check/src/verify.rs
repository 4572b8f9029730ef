//! One verified round: layout, dispatch, combine, cached dispatch, combine again — every output
//! compared with the CPU reference of the whole exchange.

use std::fmt::Debug;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtrMut};
use epcomm::{
    CombineInput, DeviceBytes, DispatchInput, ExpertParallel, RecvArray, RecvMode, Tiering,
};
use epcomm_reference::{CombineOutput, RankInput, RankOutput, XData, bf16};
use epcomm_topology::RailPrecision;

use crate::order::{permute, two_stage_order};

use crate::inputs::{BF16_SIGN, DeviceInputs, FP8_SIGN, HostInputs, upload};
use crate::{CheckError, Result};

/// What a round exercises.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RoundOptions {
    /// FP8 dispatch instead of bf16.
    pub fp8: bool,
    /// How the host learns the receive count.
    pub mode: RecvMode,
    /// Also run a cached dispatch and a second combine.
    pub cached: bool,
    /// Forward and reduce top-k weights.
    pub weights: bool,
    /// Also compare the layout with the reference.
    pub check_layout: bool,
    /// Also run a BF16 dispatch followed by an in-place combine (y written over the receive
    /// rows); ignored for FP8.
    pub in_place: bool,
}

impl Default for RoundOptions {
    fn default() -> Self {
        Self {
            fp8: false,
            mode: RecvMode::HostSync,
            cached: true,
            weights: true,
            check_layout: true,
            in_place: true,
        }
    }
}

pub(crate) fn first_diff<T: PartialEq + Debug>(
    what: &str,
    rank: usize,
    got: &[T],
    want: &[T],
) -> Result<()> {
    if got.len() != want.len() {
        return Err(CheckError::Mismatch {
            what: what.into(),
            rank,
            detail: format!("length {} instead of {}", got.len(), want.len()),
        });
    }
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        let bad = (0..got.len()).filter(|&i| got[i] != want[i]).count();
        return Err(CheckError::Mismatch {
            what: what.into(),
            rank,
            detail: format!(
                "{bad} of {} differ; first at {i}: got {:?}, want {:?}",
                got.len(),
                got[i],
                want[i]
            ),
        });
    }
    Ok(())
}

/// [`first_diff`] for arrays of rows of `row_bytes` bytes (received rows): when they differ,
/// the error also says how many rows differ, the first few, and what each of those holds
/// instead: zeros, or the bytes of another row of `want` (a row sent to the wrong place), or
/// neither.
pub(crate) fn row_diff(
    what: &str,
    rank: usize,
    got: &[u8],
    want: &[u8],
    row_bytes: usize,
) -> Result<()> {
    let Err(CheckError::Mismatch { detail, .. }) = first_diff(what, rank, got, want) else {
        return Ok(());
    };
    let err = |detail: String| {
        Err(CheckError::Mismatch {
            what: what.into(),
            rank,
            detail,
        })
    };
    if row_bytes == 0 || got.len() != want.len() || !got.len().is_multiple_of(row_bytes) {
        return err(detail);
    }
    let g: Vec<&[u8]> = got.chunks_exact(row_bytes).collect();
    let w: Vec<&[u8]> = want.chunks_exact(row_bytes).collect();
    let bad: Vec<usize> = (0..g.len()).filter(|&i| g[i] != w[i]).collect();
    let shown: Vec<String> = bad
        .iter()
        .take(4)
        .map(|&i| {
            let holds = if g[i].iter().all(|&b| b == 0) {
                "zeros".to_string()
            } else if let Some(j) = w.iter().position(|r| *r == g[i]) {
                format!("want's row {j}")
            } else {
                "no row of want".to_string()
            };
            format!("row {i} holds {holds}")
        })
        .collect();
    err(format!(
        "{detail}; {} of {} rows differ: {}",
        bad.len(),
        g.len(),
        shown.join(", ")
    ))
}

pub(crate) fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

/// The expert output each rank feeds to combine: its received rows as bf16, scaled by a
/// per-rank factor so that the sum tells contributions apart.
pub(crate) fn expert_output(out: &RankOutput, rank: usize) -> Result<Vec<bf16>> {
    let scale = 1.0 + rank as f32 * 0.5;
    Ok(out
        .recv_x
        .to_bf16(out.hidden)?
        .iter()
        .map(|v| bf16::from_f32(v.to_f32() * scale))
        .collect())
}

/// What every rank feeds to combine in a verified round, known to every rank: the expert
/// outputs `ys[r]` ([`expert_output`]) and weights `ws[r]` of each rank's received rows (flat
/// order), and each rank's token count.
pub(crate) struct CombineInputs {
    pub(crate) ys: Vec<Vec<bf16>>,
    pub(crate) ws: Vec<Vec<f32>>,
    pub(crate) tokens: Vec<usize>,
}

/// [`CombineInputs`] of the dispatch `reference` of `ins`.
pub(crate) fn combine_inputs(reference: &[RankOutput], ins: &[RankInput]) -> Result<CombineInputs> {
    Ok(CombineInputs {
        ys: reference
            .iter()
            .enumerate()
            .map(|(r, o)| expert_output(o, r))
            .collect::<Result<_>>()?,
        ws: reference
            .iter()
            .map(|o| o.recv_topk_weights.clone())
            .collect(),
        tokens: ins.iter().map(|i| i.num_tokens).collect(),
    })
}

/// Runs one verified round on this rank of `buf` (flat or two-tier). Every rank must call it
/// with the same arguments (collective).
///
/// The oracle follows the buffer's [`Tiering`]: the rows a rank receives are the flat
/// reference's, in the buffer's order (flat: by source rank; two-tier:
/// [`crate::order::two_stage_order`]); combine is [`epcomm_reference::combine`] flat and
/// [`epcomm_reference::hierarchical_combine_staged`] (bf16 rail) two-tier. The layout and the
/// handle's source-side arrays are compared on a flat buffer (a two-tier layout is the rail
/// tier's, its handle's sources the forwarders), the in-place combine run on a flat one.
pub fn verified_round<E: ExpertParallel>(
    buf: &mut E,
    inputs: &HostInputs,
    dev: &DeviceInputs,
    opts: RoundOptions,
) -> Result<()> {
    let rank = buf.world_rank();
    let world = buf.world_size();
    let tiering = buf.tiering();
    let cfg = buf.config().clone();
    let ins = if opts.fp8 { &inputs.fp8 } else { &inputs.bf16 };
    let reference = epcomm_reference::dispatch(ins, cfg.num_experts)?;
    let want = &reference[rank];
    let order = match tiering {
        Tiering::Flat => (0..want.num_recv_tokens).collect(),
        Tiering::TwoTier(tiers) => two_stage_order(want, tiers),
    };
    let t = dev.num_tokens;

    let layout = buf.layout(&dev.topk_idx, t)?;
    if opts.check_layout && tiering == Tiering::Flat {
        check_layout(&layout, &ins[rank].topk_idx, t, &cfg, rank, world)?;
    }
    let input = DispatchInput {
        x: dev.x_input(opts.fp8),
        topk_idx: &dev.topk_idx,
        topk_weights: opts.weights.then_some(&dev.topk_weights as _),
    };
    let handle = {
        let d = buf.dispatch(&input, &layout, opts.mode)?;
        check_dispatched("dispatch", &d, want, &order, rank, opts, true)?;
        d.into_handle()
    };
    // The parity-following counted copy-out gives the same rows.
    let copied = copy_received_x(buf, &handle, want.num_recv_tokens, opts.fp8)?;
    // A failure recorded by the dispatch kernel explains any mismatch below: report it first.
    buf.synchronize()?;
    // One row more than arrived was offered: it stays zero.
    let mut want_copy = recv_x_bytes(want, &order);
    want_copy.resize(copied.1, 0);
    first_diff(
        "copy_received recv_x",
        rank,
        &copied.to_host(buf.stream())?,
        &want_copy,
    )?;
    let as_i32 = |v: &[u32]| v.iter().map(|&v| v as i32).collect::<Vec<i32>>();
    first_diff(
        "handle.num_recv_per_local_expert",
        rank,
        &handle.num_recv_per_local_expert()?,
        &as_i32(&want.num_recv_per_local_expert),
    )?;
    if tiering == Tiering::Flat {
        for (what, got, want) in [
            (
                "handle.recv_prefix",
                handle.recv_prefix_to_host()?,
                as_i32(&want.rank_prefix),
            ),
            (
                "handle.recv_src_idx",
                handle.recv_src_idx_to_host()?,
                as_i32(&want.recv_src_idx),
            ),
        ] {
            first_diff(what, rank, &got, &want)?;
        }
    }

    // Combine: every rank's expert output is known to every rank (deterministic).
    let CombineInputs { ys, ws, tokens } = combine_inputs(&reference, ins)?;
    let weights = opts.weights.then_some(ws.as_slice());
    let want_c = match tiering {
        Tiering::Flat => epcomm_reference::combine(&ys, weights, &reference, &tokens)?,
        Tiering::TwoTier(tiers) => epcomm_reference::hierarchical_combine_staged(
            &ys,
            weights,
            &reference,
            &tokens,
            tiers,
            RailPrecision::Bf16,
        )?,
    };
    let stream = buf.stream().clone();
    let rows_alloc = handle.num_recv().unwrap_or(handle.capacity());
    let mut y_host = permute(&ys[rank], cfg.hidden, &order);
    y_host.resize(rows_alloc * cfg.hidden, bf16::ZERO);
    let y = upload(&stream, &y_host)?;
    let mut yw_host = permute(&ws[rank], cfg.top_k, &order);
    yw_host.resize(rows_alloc * cfg.top_k, 0.0);
    let yw = upload(&stream, &yw_host)?;
    let rounds = if opts.cached { 2 } else { 1 };
    let in_place = opts.in_place && !opts.fp8 && buf.as_flat().is_some();
    for round in 0..rounds + usize::from(in_place) {
        let mut out = upload(&stream, &vec![bf16::from_f32(-7.0); t * cfg.hidden])?;
        let mut out_w = upload(&stream, &vec![-7.0f32; t * cfg.top_k])?;
        if round == rounds {
            let flat = buf
                .as_flat()
                .ok_or_else(|| CheckError::Other("in-place combine needs a flat buffer".into()))?;
            // In place: a fresh BF16 dispatch, y written over its receive rows, then pulled.
            let h2 = {
                let d = flat.dispatch(&input, &layout, opts.mode)?;
                if want.num_recv_tokens > 0 {
                    d.copy_into_recv_x(&y.slice(..want.num_recv_tokens * cfg.hidden))?;
                }
                d.into_handle()
            };
            if opts.weights {
                flat.combine_in_place(&h2, &mut out, Some(&mut out_w))?;
            } else {
                flat.combine_in_place(&h2, &mut out, None)?;
            }
        } else {
            if round == 1 {
                // Other rows (-x) along the same routing: rows a dispatch left in place
                // cannot pass for them.
                let d = buf.cached_dispatch(&dev.x_neg_input(opts.fp8), &handle)?;
                check_dispatched("cached dispatch", &d, want, &order, rank, opts, false)?;
            }
            // The first combine gives the rows up (it may stage over them), a cached dispatch
            // refills them, and the second leaves them (it pushes unless the config says
            // copy-engine): both ways every round.
            let mut input = CombineInput::new(&y);
            let mut output = epcomm::CombineOutput::new(&mut out);
            if opts.weights {
                input = input.with_weights(&yw);
                output = output.with_weights(&mut out_w);
            }
            if round == 0 {
                input = input.consuming();
            }
            buf.combine(&input, &handle, output)?;
        }
        buf.synchronize()?;
        let what = format!(
            "{}combine #{round}{} x",
            if tiering == Tiering::Flat {
                ""
            } else {
                "two-tier "
            },
            if round == rounds { " (in place)" } else { "" }
        );
        check_combined(&what, rank, &stream, t, &out, &out_w, &want_c[rank])?;
    }

    // The allocation-free path (what a CUDA graph records): a layout and a handle allocated
    // up front, the layout recomputed in place, a dispatch into the handle, the rows copied out
    // by the device count, and a combine along it.
    let layout = buf.alloc_layout(t)?;
    let handle = buf.alloc_handle(&layout)?;
    buf.layout_into(&dev.topk_idx, &layout)?;
    {
        let d = buf.dispatch_into(&input, &handle)?;
        check_dispatched(
            "dispatch_into",
            &d,
            want,
            &order,
            rank,
            RoundOptions {
                mode: RecvMode::WorstCase,
                ..opts
            },
            true,
        )?;
    }
    let copied = copy_received_x(buf, &handle, want.num_recv_tokens, opts.fp8)?;
    let cap = handle.capacity();
    let mut y_cap = permute(&ys[rank], cfg.hidden, &order);
    y_cap.resize(cap.max(1) * cfg.hidden, bf16::ZERO);
    let y_cap = upload(&stream, &y_cap)?;
    let mut yw_cap = permute(&ws[rank], cfg.top_k, &order);
    yw_cap.resize(cap.max(1) * cfg.top_k, 0.0);
    let yw_cap = upload(&stream, &yw_cap)?;
    let mut out = upload(&stream, &vec![bf16::from_f32(-7.0); t * cfg.hidden])?;
    let mut out_w = upload(&stream, &vec![-7.0f32; t * cfg.top_k])?;
    let (mut input, mut output) = (
        CombineInput::new(&y_cap),
        epcomm::CombineOutput::new(&mut out),
    );
    if opts.weights {
        input = input.with_weights(&yw_cap);
        output = output.with_weights(&mut out_w);
    }
    buf.combine(&input, &handle, output)?;
    buf.synchronize()?;
    let mut want_copy = recv_x_bytes(want, &order);
    want_copy.resize(copied.1, 0);
    first_diff(
        "dispatch_into copy_received recv_x",
        rank,
        &copied.to_host(buf.stream())?,
        &want_copy,
    )?;
    check_combined(
        "combine after dispatch_into x",
        rank,
        &stream,
        t,
        &out,
        &out_w,
        &want_c[rank],
    )?;
    Ok(())
}

/// A flat layout against the reference's.
fn check_layout(
    layout: &epcomm::Layout,
    topk_idx: &[i64],
    t: usize,
    cfg: &epcomm::BufferConfig,
    rank: usize,
    world: usize,
) -> Result<()> {
    let got = layout.to_host()?;
    // The nodes the layout counts for: one, or a rail-forwarding buffer's (each node's
    // tokens and slots are what the forwarders use).
    let nodes = got.tokens_per_node.len().max(1);
    if !world.is_multiple_of(nodes) {
        return Err(CheckError::Mismatch {
            what: "layout.tokens_per_node".into(),
            rank,
            detail: format!("{nodes} nodes do not divide {world} ranks"),
        });
    }
    let want = epcomm_reference::layout(
        topk_idx,
        t,
        cfg.top_k,
        cfg.num_experts,
        world,
        world / nodes,
    )?;
    first_diff(
        "layout.tokens_per_rank",
        rank,
        &got.tokens_per_rank,
        &want.tokens_per_rank,
    )?;
    first_diff(
        "layout.tokens_per_expert",
        rank,
        &got.tokens_per_expert,
        &want.tokens_per_expert,
    )?;
    first_diff(
        "layout.tokens_per_node",
        rank,
        &got.tokens_per_node,
        &want.tokens_per_node,
    )?;
    first_diff("layout.token_slot", rank, &got.token_slot, &want.token_slot)
}

/// A combine's outputs (`t` tokens; the stream is synchronized) against the reference, bit for
/// bit: `out`, and `out_w` when the reference combined weights.
pub(crate) fn check_combined(
    what: &str,
    rank: usize,
    stream: &Arc<CudaStream>,
    t: usize,
    out: &CudaSlice<bf16>,
    out_w: &CudaSlice<f32>,
    want: &CombineOutput,
) -> Result<()> {
    let got = if t == 0 {
        Vec::new()
    } else {
        stream.clone_dtoh(out)?
    };
    let to_bits = |v: &[bf16]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    first_diff(what, rank, &to_bits(&got), &to_bits(&want.x))?;
    if let Some(w) = &want.weights {
        let got_w = if t == 0 {
            Vec::new()
        } else {
            stream.clone_dtoh(out_w)?
        };
        first_diff(&format!("{what} weights"), rank, &bits(&got_w), &bits(w))?;
    }
    Ok(())
}

/// The device array the copy-out filled and its bytes, read after the stream is synchronized.
struct Copied(CudaSlice<u8>, usize);

impl Copied {
    fn to_host(&self, stream: &Arc<CudaStream>) -> Result<Vec<u8>> {
        Ok(stream.clone_dtoh(&self.0)?)
    }
}

/// [`ExpertParallel::copy_received`] of the latest dispatch's rows into a fresh device array one
/// row larger than `rows` (the copy must stop at the device's count).
fn copy_received_x<E: ExpertParallel>(
    buf: &mut E,
    handle: &epcomm::Handle,
    rows: usize,
    fp8: bool,
) -> Result<Copied> {
    let hidden = buf.config().hidden;
    let row_bytes = if fp8 { hidden } else { hidden * 2 };
    let stream = buf.stream().clone();
    let bytes = (rows + 1) * row_bytes;
    let mut dst = stream.alloc_zeros::<u8>(bytes)?;
    let ptr = {
        let (p, _sync) = dst.device_ptr_mut(&stream);
        p
    };
    // SAFETY: `dst` is `bytes` bytes of device memory on the buffer's stream, returned to the
    // caller, which reads it only after synchronizing the stream.
    unsafe { buf.copy_received(handle, RecvArray::X, DeviceBytes { ptr, len: bytes }) }?;
    Ok(Copied(dst, bytes))
}

/// The reference's received rows as bytes (bf16 little-endian or e4m3), in `order`.
fn recv_x_bytes(want: &RankOutput, order: &[usize]) -> Vec<u8> {
    let h = want.hidden;
    match &want.recv_x {
        XData::Bf16(x) => permute(x, h, order)
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        XData::Fp8 { data, .. } => permute(data, h, order)
            .iter()
            .map(|v| v.to_bits())
            .collect(),
    }
}

/// A dispatch's rows against the reference's, in `order` (row `i` is the reference's row
/// `order[i]`).
fn check_dispatched(
    what: &str,
    d: &epcomm::Dispatched<'_>,
    want: &RankOutput,
    order: &[usize],
    rank: usize,
    opts: RoundOptions,
    full: bool,
) -> Result<()> {
    if opts.mode == RecvMode::HostSync && full {
        if d.num_recv() != Some(want.num_recv_tokens) {
            return Err(CheckError::Mismatch {
                what: "num_recv".into(),
                rank,
                detail: format!("{:?} instead of {}", d.num_recv(), want.num_recv_tokens),
            });
        }
        let e: Vec<usize> = want
            .num_recv_per_local_expert
            .iter()
            .map(|&v| v as usize)
            .collect();
        first_diff(
            "num_recv_per_local_expert (host)",
            rank,
            d.num_recv_per_local_expert().unwrap_or(&[]),
            &e,
        )?;
    }
    // A cached dispatch sends -x (`DeviceInputs::x_neg_input`): the same rows, signs flipped.
    let (bf16_sign, fp8_sign) = if full { (0, 0) } else { (BF16_SIGN, FP8_SIGN) };
    let h = want.hidden;
    let (label, want_bytes): (&str, Vec<u8>) = match &want.recv_x {
        XData::Bf16(x) => (
            "recv_x",
            permute(x, h, order)
                .iter()
                .flat_map(|v| (v.to_bits() ^ bf16_sign).to_le_bytes())
                .collect(),
        ),
        XData::Fp8 { data, .. } => (
            "recv_x (fp8)",
            permute(data, h, order)
                .iter()
                .map(|v| v.to_bits() ^ fp8_sign)
                .collect(),
        ),
    };
    let row_bytes = want_bytes.len().checked_div(order.len()).unwrap_or(0);
    row_diff(
        &format!("{what} {label}"),
        rank,
        &d.recv_x_bytes_to_host()?,
        &want_bytes,
        row_bytes,
    )?;
    if let XData::Fp8 { scales, .. } = &want.recv_x {
        first_diff(
            &format!("{what} recv_scales"),
            rank,
            &bits(&d.recv_scales_to_host()?),
            &bits(&permute(scales, h / 128, order)),
        )?;
    }
    if full {
        let k = want.top_k;
        first_diff(
            &format!("{what} recv_topk_idx"),
            rank,
            &d.recv_topk_idx_to_host()?,
            &permute(&want.recv_topk_idx, k, order),
        )?;
        if opts.weights {
            first_diff(
                &format!("{what} recv_topk_weights"),
                rank,
                &bits(&d.recv_topk_weights_to_host()?),
                &bits(&permute(&want.recv_topk_weights, k, order)),
            )?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn detail(r: Result<()>) -> String {
        match r {
            Err(CheckError::Mismatch { detail, .. }) => detail,
            other => panic!("expected a mismatch, got {other:?}"),
        }
    }

    #[test]
    fn row_diff_says_what_a_wrong_row_holds() {
        // Four rows of 4 bytes.
        let want: Vec<u8> = (1..=16).collect();
        assert!(row_diff("x", 0, &want, &want, 4).is_ok());
        // Row 2 holds row 0's bytes, row 3 zeros.
        let mut got = want.clone();
        got.copy_within(0..4, 8);
        got[12..16].fill(0);
        let d = detail(row_diff("x", 1, &got, &want, 4));
        assert!(d.starts_with("8 of 16 differ; first at 8"), "{d}");
        assert!(
            d.ends_with("2 of 4 rows differ: row 2 holds want's row 0, row 3 holds zeros"),
            "{d}"
        );
        // A row like no other.
        let mut odd = want.clone();
        odd[5] = 99;
        let d = detail(row_diff("x", 0, &odd, &want, 4));
        assert!(d.ends_with("row 1 holds no row of want"), "{d}");
        // Lengths that do not split into rows: the plain report.
        let d = detail(row_diff("x", 0, &got[..15], &want[..15], 4));
        assert!(!d.contains("rows differ"), "{d}");
    }
}
