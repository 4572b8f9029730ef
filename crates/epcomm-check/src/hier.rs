//! The two-tier oracle ([`epcomm::HierarchicalBuffer`]; [`crate::verify::verified_round`] runs
//! a round on any buffer).
//!
//! The rows, local top-k ids and weights a rank receives are the flat
//! [`epcomm_reference::dispatch`]'s, in the two-stage order (by forwarding local rank `l`, then
//! source node `m`, then source token: the rows of source rank `m * L + l`); combine is
//! [`epcomm_reference::hierarchical_combine_staged`] with a bf16 rail.

use epcomm_reference::{XData, bf16};
use epcomm_topology::{RailPrecision, Tiers};

use crate::inputs::HostInputs;
use crate::order::permute;
pub use crate::order::two_stage_order;
use crate::verify::{CombineInputs, combine_inputs};
use crate::{CheckError, Result};

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
