//! Low-latency rounds checked against the reference: this rank's inputs and expert outputs
//! on the device ([`LlIo`]), and the check of what `Buffer::ll_dispatch` packed and
//! `Buffer::ll_combine` reduced ([`verify_ll_round`]).
//!
//! The experts' outputs are [`y_value`]: small integers (exact in bf16) that depend on the
//! owner rank, the local expert and the packed row, so a row that comes back to the wrong
//! token, slot or rank changes the combined result.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use epcomm::{Buffer, LlFormat, LlRecv};
use epcomm_reference::{
    RankInput, XData, bf16, combine_weighted_ll, ll_dispatch, quantize_fp8_e4m3_per128,
    quantize_fp8_e4m3_per128_ue8m0,
};

use crate::inputs::upload;
use crate::{CheckError, Result};

/// The expert output for packed row `i` of local expert `l` on rank `r`, channel `c`.
pub fn y_value(r: usize, l: usize, i: usize, c: usize) -> bf16 {
    bf16::from_f32(((r * 131 + l * 31 + i * 7 + c) % 15) as f32 - 7.0)
}

/// The bf16 rows of an input.
///
/// # Errors
/// [`CheckError::Other`] for FP8 inputs (low-latency dispatch takes bf16 and casts itself).
pub fn bf16_rows(input: &RankInput) -> Result<&[bf16]> {
    match &input.x {
        XData::Bf16(x) => Ok(x),
        XData::Fp8 { .. } => Err(CheckError::Other(
            "low-latency rounds take bf16 inputs".into(),
        )),
    }
}

/// The bytes (and FP8 scales) every source's token rows arrive as.
fn source_rows(
    inputs: &[RankInput],
    hidden: usize,
    format: LlFormat,
) -> Result<Vec<(Vec<u8>, Vec<f32>)>> {
    inputs
        .iter()
        .map(|i| {
            let x = bf16_rows(i)?;
            Ok(match format {
                LlFormat::Bf16 => (x.iter().flat_map(|v| v.to_le_bytes()).collect(), vec![]),
                LlFormat::Fp8 { round_scale } => {
                    let (q, s) = if round_scale {
                        quantize_fp8_e4m3_per128_ue8m0(x, hidden)?
                    } else {
                        quantize_fp8_e4m3_per128(x, hidden)?
                    };
                    (q.iter().map(|v| v.to_bits()).collect(), s)
                }
            })
        })
        .collect()
}

/// This rank's device arrays of one low-latency round.
#[derive(Debug)]
pub struct LlIo {
    /// Tokens of this rank.
    pub num_tokens: usize,
    /// `[T][hidden]` bf16.
    pub x: CudaSlice<bf16>,
    /// `[T][top_k]` ids.
    pub idx: CudaSlice<i64>,
    /// `[T][top_k]` weights.
    pub w: CudaSlice<f32>,
    /// Expert outputs at this rank's packed rows, `[local_experts][capacity][hidden]`.
    pub y: CudaSlice<bf16>,
    /// `[T][hidden]` combine output.
    pub out: CudaSlice<bf16>,
    /// `[local_experts]` cumulative receive stats, starting at [`Self::STATS_BASE`]` + l` (so a
    /// kernel that overwrites instead of adding is caught).
    pub stats: CudaSlice<i32>,
}

impl LlIo {
    /// Uploads rank `buf.rank()`'s inputs of `inputs` and the expert outputs of the rows it
    /// will receive (`capacity` rows per local expert).
    ///
    /// # Errors
    /// Reference or driver failures.
    pub fn new(
        stream: &Arc<CudaStream>,
        inputs: &[RankInput],
        rank: usize,
        num_experts: usize,
        capacity: usize,
    ) -> Result<Self> {
        let world = inputs.len();
        let me = &inputs[rank];
        let (hidden, top_k) = (me.hidden, me.top_k);
        let topk: Vec<Vec<i64>> = inputs.iter().map(|i| i.topk_idx.clone()).collect();
        let routing = ll_dispatch(&topk, top_k, num_experts)?;
        let epr = num_experts / world;
        let mut y = vec![bf16::ZERO; epr * capacity * hidden];
        for (l, entries) in routing[rank].experts.iter().enumerate() {
            for i in 0..entries.len() {
                let row = &mut y[(l * capacity + i) * hidden..(l * capacity + i + 1) * hidden];
                for (c, v) in row.iter_mut().enumerate() {
                    *v = y_value(rank, l, i, c);
                }
            }
        }
        let t = me.num_tokens;
        let base: Vec<i32> = (0..epr as i32).map(|l| Self::STATS_BASE + l).collect();
        Ok(Self {
            stats: upload(stream, &base)?,
            num_tokens: t,
            x: upload(stream, bf16_rows(me)?)?,
            idx: upload(stream, &me.topk_idx)?,
            w: upload(stream, &me.topk_weights)?,
            y: upload(stream, &y)?,
            out: if t == 0 {
                stream.null()?
            } else {
                stream.alloc_zeros::<bf16>(t * hidden)?
            },
        })
    }

    /// What [`Self::stats`] holds for local expert `l` before any dispatch: `STATS_BASE + l`.
    pub const STATS_BASE: i32 = 1000;

    /// The dispatch input of these arrays (no cumulative stats).
    pub fn input(&self) -> epcomm::LlDispatchInput<'_> {
        epcomm::LlDispatchInput {
            x: &self.x,
            topk_idx: &self.idx,
            num_tokens: self.num_tokens,
            cumulative_stats: None,
        }
    }
}

/// Checks cumulative receive stats `stats` (an [`LlIo::stats`]) against
/// `LlIo::STATS_BASE + l` plus `added[l]`, the rows of every dispatch that added to it, summed
/// on the host.
///
/// # Errors
/// [`CheckError::Mismatch`] naming `what` and `rank`; driver failures.
pub fn verify_ll_stats(
    stream: &Arc<CudaStream>,
    stats: &CudaSlice<i32>,
    added: &[i64],
    rank: usize,
    what: &str,
) -> Result<()> {
    let got = stream.clone_dtoh(stats)?;
    stream.synchronize()?;
    let want: Vec<i64> = added
        .iter()
        .enumerate()
        .map(|(l, &a)| i64::from(LlIo::STATS_BASE) + l as i64 + a)
        .collect();
    let got: Vec<i64> = got.iter().map(|&v| i64::from(v)).collect();
    if got != want {
        return Err(mismatch(
            format!("{what}: cumulative receive stats"),
            rank,
            format!("{got:?} != {want:?}"),
        ));
    }
    Ok(())
}

fn mismatch(what: String, rank: usize, detail: impl Into<String>) -> CheckError {
    CheckError::Mismatch {
        what,
        rank,
        detail: detail.into(),
    }
}

/// Checks what a low-latency dispatch left in `recv` (counts, ranges, source indices, rows,
/// FP8 scales) and what the combine after it wrote to `out`, for this rank, against the
/// reference (`what` names the round in errors). Waits for the stream.
///
/// # Errors
/// [`CheckError::Mismatch`] at the first difference; reference or driver failures.
pub fn verify_ll_round(
    buf: &Buffer,
    inputs: &[RankInput],
    recv: &LlRecv,
    out: &CudaSlice<bf16>,
    format: LlFormat,
    what: &str,
) -> Result<()> {
    let (rank, world) = (buf.rank(), buf.world_size());
    let cfg = buf.config();
    let (hidden, top_k, experts) = (cfg.hidden, cfg.top_k, cfg.num_experts);
    let topk: Vec<Vec<i64>> = inputs.iter().map(|i| i.topk_idx.clone()).collect();
    let routing = ll_dispatch(&topk, top_k, experts)?;
    let mine = &routing[rank];
    let cap = recv.capacity();
    let what = |part: &str| format!("{what}: {part}");
    let count = recv.count_to_host()?;
    let want: Vec<i32> = mine.experts.iter().map(|e| e.len() as i32).collect();
    if count != want {
        return Err(mismatch(
            what("rows per local expert"),
            rank,
            format!("{count:?} != {want:?}"),
        ));
    }
    let ranges = recv.layout_range_to_host()?;
    for (l, per_src) in mine.layout_range.iter().enumerate() {
        for (r, &(f, n)) in per_src.iter().enumerate() {
            if ranges[l * world + r] != (f as i32, n as i32) {
                return Err(mismatch(
                    what("layout range"),
                    rank,
                    format!(
                        "expert {l} source {r}: {:?} != {:?}",
                        ranges[l * world + r],
                        (f, n)
                    ),
                ));
            }
        }
    }
    let src_info = recv.src_info_to_host()?;
    let rows = recv.x_bytes_to_host()?;
    let row_bytes = recv.row_bytes();
    let sources = source_rows(inputs, hidden, format)?;
    let scales = match format {
        LlFormat::Fp8 { .. } => Some(recv.scales_to_host()?),
        LlFormat::Bf16 => None,
    };
    let (ns, layout) = (hidden / 128, recv.scales_layout());
    for (l, entries) in mine.experts.iter().enumerate() {
        for (i, e) in entries.iter().enumerate() {
            let at = l * cap + i;
            let at_row = format!(
                "expert {l} row {i} (rank {} token {})",
                e.src_rank, e.src_token
            );
            if src_info[at] as usize != e.src_token {
                return Err(mismatch(what("source index"), rank, at_row));
            }
            let (bytes, sc) = &sources[e.src_rank];
            let t = e.src_token;
            if rows[at * row_bytes..(at + 1) * row_bytes]
                != bytes[t * row_bytes..(t + 1) * row_bytes]
            {
                return Err(mismatch(what("row"), rank, at_row));
            }
            if let Some(got) = &scales
                && (0..ns).any(|s| got[layout.index(l, i, s, cap, ns)] != sc[t * ns + s])
            {
                return Err(mismatch(
                    what(&format!("FP8 scales ({layout:?})")),
                    rank,
                    at_row,
                ));
            }
        }
    }
    // Combine: each of my (token, k) comes back as y_value at its packed row on its owner.
    let me = &inputs[rank];
    let t = me.num_tokens;
    let mut at: HashMap<(usize, usize), (usize, usize, usize)> = HashMap::new();
    for (r, got) in routing.iter().enumerate() {
        for (l, entries) in got.experts.iter().enumerate() {
            for (i, e) in entries.iter().enumerate() {
                if e.src_rank == rank {
                    at.insert((e.src_token, e.k), (r, l, i));
                }
            }
        }
    }
    let mut expert_out = vec![bf16::ZERO; t * top_k * hidden];
    for (&(tok, k), &(r, l, i)) in &at {
        let o = (tok * top_k + k) * hidden;
        for (c, v) in expert_out[o..o + hidden].iter_mut().enumerate() {
            *v = y_value(r, l, i, c);
        }
    }
    let want = combine_weighted_ll(
        &expert_out,
        &me.topk_idx,
        &me.topk_weights,
        t,
        top_k,
        hidden,
    )?;
    let got = if t == 0 {
        vec![]
    } else {
        buf.stream().clone_dtoh(out)?
    };
    if let Some(i) = got
        .iter()
        .zip(&want)
        .position(|(a, b)| a.to_bits() != b.to_bits())
    {
        return Err(mismatch(
            what("combine output"),
            rank,
            format!(
                "token {} channel {}: {} != {}",
                i / hidden,
                i % hidden,
                got[i],
                want[i]
            ),
        ));
    }
    if got.len() != want.len() {
        return Err(mismatch(what("combine output"), rank, "length"));
    }
    Ok(())
}
