//! The two-tier oracle ([`epcomm::HierarchicalBuffer`]; [`crate::verify::verified_round`] runs
//! a round on any buffer).
//!
//! The rows, local top-k ids and weights a rank receives are the flat
//! [`epcomm_reference::dispatch`]'s, in the two-stage order (by forwarding local rank `l`, then
//! source node `m`, then source token: the rows of source rank `m * L + l`); combine is
//! [`epcomm_reference::hierarchical_combine_staged`] with a bf16 rail.

use epcomm_reference::{RankOutput, XData, bf16};
use epcomm_topology::{RailPrecision, Tiers};

use crate::inputs::HostInputs;
use crate::verify::{CombineInputs, combine_inputs};
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
pub(crate) fn permute<T: Copy>(rows: &[T], width: usize, order: &[usize]) -> Vec<T> {
    order
        .iter()
        .flat_map(|&i| rows[i * width..(i + 1) * width].iter().copied())
        .collect()
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
