//! One verified hierarchical round ([`epcomm::HierarchicalBuffer`]): dispatch, combine, cached
//! dispatch, combine again, every output compared with the CPU reference.
//!
//! Oracles: the rows, local top-k ids and weights a rank receives are the flat
//! [`epcomm_reference::dispatch`]'s, in the two-stage order (by forwarding local rank `l`, then
//! source node `m`, then source token: the rows of source rank `m * L + l`); combine is
//! [`epcomm_reference::hierarchical_combine_staged`] with a bf16 rail.

use epcomm::{DispatchInput, HierDispatched, HierarchicalBuffer, RecvMode};
use epcomm_reference::{RankOutput, XData, bf16};
use epcomm_topology::{RailPrecision, Tiers};

use crate::inputs::{DeviceInputs, HostInputs, upload};
use crate::verify::{
    CombineInputs, RoundOptions, bits, check_combined, combine_inputs, first_diff,
};
use crate::{CheckError, Result};

/// The flat rows of `want` in two-stage order: row `i` of the hierarchical output is flat row
/// `order[i]`.
pub fn two_stage_order(want: &RankOutput, tiers: Tiers) -> Vec<usize> {
    let l = tiers.local_ranks();
    let mut order: Vec<usize> = (0..want.num_recv_tokens).collect();
    // Stable: rows of one source keep their token order.
    order.sort_by_key(|&i| {
        let r = want.recv_src_rank[i] as usize;
        (r % l, r / l)
    });
    order
}

/// `rows` (`width` values each) in `order`.
fn permute<T: Copy>(rows: &[T], width: usize, order: &[usize]) -> Vec<T> {
    order
        .iter()
        .flat_map(|&i| rows[i * width..(i + 1) * width].iter().copied())
        .collect()
}

/// Runs one verified round on this rank of `buf`'s world (collective).
pub fn verified_hier_round(
    buf: &mut HierarchicalBuffer,
    inputs: &HostInputs,
    dev: &DeviceInputs,
    opts: RoundOptions,
) -> Result<()> {
    let tiers = buf.tiers();
    let cfg = buf.rail().config().clone();
    let rank = {
        let rail = buf.rail();
        rail.group()
            .member(rail.rank())
            .map_err(|e| CheckError::Other(e.to_string()))?
    };
    let ins = if opts.fp8 { &inputs.fp8 } else { &inputs.bf16 };
    let reference = epcomm_reference::dispatch(ins, cfg.num_experts)?;
    let want = &reference[rank];
    let order = two_stage_order(want, tiers);
    let t = dev.num_tokens;
    let input = DispatchInput {
        x: dev.x_input(opts.fp8),
        topk_idx: &dev.topk_idx,
        topk_weights: opts.weights.then_some(&dev.topk_weights as _),
    };
    let handle = {
        let d = buf.dispatch(&input, t, opts.mode)?;
        check_rows(&d, want, &order, rank, opts, true)?;
        d.handle
    };
    buf.synchronize()?;
    if opts.mode == RecvMode::HostSync && handle.node().num_recv() != Some(want.num_recv_tokens) {
        return Err(CheckError::Mismatch {
            what: "num_recv".into(),
            rank,
            detail: format!(
                "{:?} instead of {}",
                handle.node().num_recv(),
                want.num_recv_tokens
            ),
        });
    }
    let per_expert: Vec<i32> = want
        .num_recv_per_local_expert
        .iter()
        .map(|&v| v as i32)
        .collect();
    first_diff(
        "handle.num_recv_per_local_expert",
        rank,
        &handle.node().num_recv_per_local_expert()?,
        &per_expert,
    )?;

    let CombineInputs { ys, ws, tokens } = combine_inputs(&reference, ins)?;
    let want_c = epcomm_reference::hierarchical_combine_staged(
        &ys,
        opts.weights.then_some(ws.as_slice()),
        &reference,
        &tokens,
        tiers,
        RailPrecision::Bf16,
    )?;
    let stream = buf.stream().clone();
    let rows_alloc = handle.node().num_recv().unwrap_or(handle.node().capacity());
    let mut y_host = permute(&ys[rank], cfg.hidden, &order);
    y_host.resize(rows_alloc * cfg.hidden, bf16::ZERO);
    let y = upload(&stream, &y_host)?;
    let mut yw_host = permute(&ws[rank], cfg.top_k, &order);
    yw_host.resize(rows_alloc * cfg.top_k, 0.0);
    let yw = upload(&stream, &yw_host)?;
    let rounds = if opts.cached { 2 } else { 1 };
    for round in 0..rounds {
        if round == 1 {
            let d = buf.cached_dispatch(&dev.x_input(opts.fp8), &handle)?;
            check_rows(&d, want, &order, rank, opts, false)?;
        }
        let mut out = upload(&stream, &vec![bf16::from_f32(-7.0); t * cfg.hidden])?;
        let mut out_w = upload(&stream, &vec![-7.0f32; t * cfg.top_k])?;
        // The first combine gives the node stage's rows up (it may stage over them), a cached
        // dispatch refills them, and the second leaves them: both ways every round.
        match (opts.weights, round == 0) {
            (true, true) => {
                buf.combine_consuming(&y, Some(&yw), &handle, &mut out, Some(&mut out_w))?
            }
            (true, false) => buf.combine(&y, Some(&yw), &handle, &mut out, Some(&mut out_w))?,
            (false, true) => buf.combine_consuming(&y, None, &handle, &mut out, None)?,
            (false, false) => buf.combine(&y, None, &handle, &mut out, None)?,
        }
        buf.synchronize()?;
        let what = format!("hierarchical combine #{round} x");
        check_combined(&what, rank, &stream, t, &out, &out_w, &want_c[rank])?;
    }
    Ok(())
}

/// The node stage's rows against the flat reference in two-stage order.
fn check_rows(
    d: &HierDispatched<'_>,
    want: &RankOutput,
    order: &[usize],
    rank: usize,
    opts: RoundOptions,
    full: bool,
) -> Result<()> {
    let rows = &d.rows;
    let what = if full {
        "hierarchical dispatch"
    } else {
        "hierarchical cached dispatch"
    };
    let h = want.hidden;
    match &want.recv_x {
        XData::Bf16(x) => {
            let bytes: Vec<u8> = permute(x, h, order)
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect();
            first_diff(
                &format!("{what} recv_x"),
                rank,
                &rows.recv_x_bytes_to_host()?,
                &bytes,
            )?;
        }
        XData::Fp8 { data, scales } => {
            let bytes: Vec<u8> = permute(data, h, order)
                .iter()
                .map(|v| v.to_bits())
                .collect();
            first_diff(
                &format!("{what} recv_x (fp8)"),
                rank,
                &rows.recv_x_bytes_to_host()?,
                &bytes,
            )?;
            first_diff(
                &format!("{what} recv_scales"),
                rank,
                &bits(&rows.recv_scales_to_host()?),
                &bits(&permute(scales, h / 128, order)),
            )?;
        }
    }
    if full {
        let k = want.top_k;
        first_diff(
            &format!("{what} recv_topk_idx"),
            rank,
            &rows.recv_topk_idx_to_host()?,
            &permute(&want.recv_topk_idx, k, order),
        )?;
        if opts.weights {
            first_diff(
                &format!("{what} recv_topk_weights"),
                rank,
                &bits(&rows.recv_topk_weights_to_host()?),
                &bits(&permute(&want.recv_topk_weights, k, order)),
            )?;
        }
    }
    Ok(())
}

/// One routing of a hierarchical replay or soak: this rank's inputs, its expert output in the
/// two-stage row order (padded with zeros to `cap_rows` rows) and the combine output it must
/// get back (bf16 rail, no weights).
#[derive(Clone, Debug)]
pub struct HierCase {
    /// `[T][hidden]` bf16 rows.
    pub x: Vec<bf16>,
    /// `[T][top_k]` expert ids.
    pub topk_idx: Vec<i64>,
    /// `[cap_rows][hidden]` expert output, two-stage order.
    pub y: Vec<bf16>,
    /// `[T][hidden]` expected combine output.
    pub combined: Vec<bf16>,
}

/// The [`HierCase`] of `inputs` (every rank's) for `rank` of a `tiers` world.
pub fn hier_case(
    inputs: &HostInputs,
    tiers: Tiers,
    num_experts: usize,
    rank: usize,
    cap_rows: usize,
) -> Result<HierCase> {
    let ins = &inputs.bf16;
    let reference = epcomm_reference::dispatch(ins, num_experts)?;
    let CombineInputs { ys, tokens, .. } = combine_inputs(&reference, ins)?;
    let combined = epcomm_reference::hierarchical_combine_staged(
        &ys,
        None,
        &reference,
        &tokens,
        tiers,
        RailPrecision::Bf16,
    )?;
    let want = &reference[rank];
    let hidden = want.hidden;
    let mut y = permute(&ys[rank], hidden, &two_stage_order(want, tiers));
    if y.len() > cap_rows * hidden {
        return Err(CheckError::Other(format!(
            "rank {rank} receives {} rows, more than the {cap_rows} the test sized",
            y.len() / hidden
        )));
    }
    y.resize(cap_rows * hidden, bf16::ZERO);
    let x = match &ins[rank].x {
        XData::Bf16(x) => x.clone(),
        XData::Fp8 { .. } => return Err(CheckError::Other("hier_case takes bf16 inputs".into())),
    };
    Ok(HierCase {
        x,
        topk_idx: ins[rank].topk_idx.clone(),
        y,
        combined: combined[rank].x.clone(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_stage_order_groups_by_local_rank_then_node() {
        // 2 nodes x 2: sources 0 (0,0), 1 (0,1), 2 (1,0), 3 (1,1); flat order by source.
        let want = RankOutput {
            recv_x: XData::Bf16(vec![]),
            recv_topk_idx: vec![],
            recv_topk_weights: vec![],
            recv_src_rank: vec![0, 0, 1, 2, 3, 3],
            recv_src_idx: vec![4, 9, 0, 1, 2, 5],
            num_recv_tokens: 6,
            num_recv_per_local_expert: vec![],
            rank_prefix: vec![0, 2, 3, 4, 6],
            hidden: 1,
            top_k: 1,
        };
        let order = two_stage_order(&want, Tiers::new(2, 2).unwrap());
        // Local rank 0 (sources 0 then 2), then local rank 1 (sources 1 then 3).
        assert_eq!(order, vec![0, 1, 3, 2, 4, 5]);
        assert_eq!(
            permute(&[10, 11, 12, 13, 14, 15], 1, &order),
            vec![10, 11, 13, 12, 14, 15]
        );
        // One rank per node: the flat order.
        assert_eq!(
            two_stage_order(&want, Tiers::new(4, 1).unwrap()),
            (0..6).collect::<Vec<_>>()
        );
    }
}
