//! Dispatch: every token goes once to each rank that holds one of its experts.

use std::ops::Range;

use epcomm_topology::RowDtype;
use float8::F8E4M3;
use half::bf16;

use crate::fp8::{dequantize_fp8_e4m3_per128, fp8_row, quantize_fp8_e4m3_per128};
use crate::layout::{check_experts, layout};
use crate::{RefError, Result};

/// Token activations `[T][hidden]`.
#[derive(Debug, Clone, PartialEq)]
pub enum XData {
    /// bf16 rows.
    Bf16(Vec<bf16>),
    /// e4m3 rows with one f32 scale per 128 channels (`scales` is `[T][hidden / 128]`).
    Fp8 {
        /// `[T][hidden]` e4m3.
        data: Vec<F8E4M3>,
        /// `[T][hidden / 128]`.
        scales: Vec<f32>,
    },
}

impl XData {
    /// Quantizes bf16 rows to [`XData::Fp8`] (see [`quantize_fp8_e4m3_per128`]).
    ///
    /// # Errors
    /// As [`quantize_fp8_e4m3_per128`].
    pub fn fp8_from_bf16(x: &[bf16], hidden: usize) -> Result<Self> {
        let (data, scales) = quantize_fp8_e4m3_per128(x, hidden)?;
        Ok(XData::Fp8 { data, scales })
    }

    /// Whether this is [`XData::Fp8`].
    pub fn is_fp8(&self) -> bool {
        self.dtype() == RowDtype::Fp8
    }

    /// The row element type, as the buffer plans and kernels name it.
    pub fn dtype(&self) -> RowDtype {
        match self {
            XData::Bf16(_) => RowDtype::Bf16,
            XData::Fp8 { .. } => RowDtype::Fp8,
        }
    }

    /// `"bf16"` or `"fp8_e4m3"`.
    pub fn dtype_name(&self) -> &'static str {
        match self {
            XData::Bf16(_) => "bf16",
            XData::Fp8 { .. } => "fp8_e4m3",
        }
    }

    /// Number of elements of x (`T * hidden`).
    pub fn len(&self) -> usize {
        match self {
            XData::Bf16(v) => v.len(),
            XData::Fp8 { data, .. } => data.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Values as f32 (fp8 dequantized with its scales).
    ///
    /// # Errors
    /// Shape errors of [`dequantize_fp8_e4m3_per128`] (fp8 only).
    pub fn to_f32(&self, hidden: usize) -> Result<Vec<f32>> {
        match self {
            XData::Bf16(v) => Ok(v.iter().map(|x| x.to_f32()).collect()),
            XData::Fp8 { data, scales } => dequantize_fp8_e4m3_per128(data, scales, hidden),
        }
    }

    /// Values as bf16 (fp8 dequantized in f32, then rounded to bf16 once).
    ///
    /// # Errors
    /// As [`to_f32`](Self::to_f32).
    pub fn to_bf16(&self, hidden: usize) -> Result<Vec<bf16>> {
        match self {
            XData::Bf16(v) => Ok(v.clone()),
            XData::Fp8 { .. } => Ok(self
                .to_f32(hidden)?
                .into_iter()
                .map(bf16::from_f32)
                .collect()),
        }
    }

    /// Checks that this holds `num_tokens` rows of `hidden` (and, for fp8, the scales).
    ///
    /// # Errors
    /// [`RefError::Length`] naming `x` or `scales`; for fp8, [`RefError::Row`] when `hidden`
    /// is not a valid FP8 row (`hidden % 128 != 0`).
    pub fn check_shape(&self, num_tokens: usize, hidden: usize) -> Result<()> {
        let n = RefError::product("num_tokens * hidden", num_tokens, hidden)?;
        match self {
            XData::Bf16(v) => RefError::len_check("x", v.len(), n, "num_tokens * hidden"),
            XData::Fp8 { data, scales } => {
                let row = fp8_row(hidden)?;
                RefError::len_check("x", data.len(), n, "num_tokens * hidden")?;
                RefError::len_check(
                    "scales",
                    scales.len(),
                    num_tokens * row.num_scales(),
                    "num_tokens * hidden / 128",
                )
            }
        }
    }

    fn empty_like(&self) -> Self {
        match self {
            XData::Bf16(_) => XData::Bf16(Vec::new()),
            XData::Fp8 { .. } => XData::Fp8 {
                data: Vec::new(),
                scales: Vec::new(),
            },
        }
    }

    /// Appends row `t` of `src`, rows of `hidden` values and `scales_per_row` scales (same
    /// variant and a valid shape, checked by the caller with [`check_shape`](Self::check_shape)).
    fn push_row(&mut self, src: &XData, t: usize, hidden: usize, scales_per_row: usize) {
        match (self, src) {
            (XData::Bf16(dst), XData::Bf16(s)) => {
                dst.extend_from_slice(&s[t * hidden..(t + 1) * hidden]);
            }
            (
                XData::Fp8 { data, scales },
                XData::Fp8 {
                    data: sd,
                    scales: ss,
                },
            ) => {
                let g = scales_per_row;
                data.extend_from_slice(&sd[t * hidden..(t + 1) * hidden]);
                scales.extend_from_slice(&ss[t * g..(t + 1) * g]);
            }
            // Variants are checked equal before any row is pushed.
            _ => {}
        }
    }
}

/// One rank's input to [`dispatch`].
#[derive(Debug, Clone, PartialEq)]
pub struct RankInput {
    /// `[num_tokens][hidden]`.
    pub x: XData,
    /// `[num_tokens][top_k]`, `-1` = no expert.
    pub topk_idx: Vec<i64>,
    /// `[num_tokens][top_k]`.
    pub topk_weights: Vec<f32>,
    /// Tokens of this rank.
    pub num_tokens: usize,
    /// Channels per token.
    pub hidden: usize,
    /// Experts per token.
    pub top_k: usize,
}

impl RankInput {
    /// Builds an input, deriving `num_tokens` from `topk_idx.len() / top_k`, and validates
    /// its shape.
    ///
    /// # Errors
    /// As [`validate`](Self::validate), and `topk_idx.len() % top_k == 0`.
    pub fn new(
        x: XData,
        topk_idx: Vec<i64>,
        topk_weights: Vec<f32>,
        hidden: usize,
        top_k: usize,
    ) -> Result<Self> {
        RefError::nonzero(&[("top_k", top_k)])?;
        RefError::multiple_check("topk_idx.len()", topk_idx.len(), "top_k", top_k)?;
        let input = Self {
            num_tokens: topk_idx.len() / top_k,
            x,
            topk_idx,
            topk_weights,
            hidden,
            top_k,
        };
        input.validate()?;
        Ok(input)
    }

    /// Checks the shapes: `hidden > 0`, `top_k > 0`, x (and scales) match
    /// `num_tokens × hidden`, `topk_idx` and `topk_weights` have `num_tokens * top_k`
    /// entries. Expert ids are checked by [`dispatch`] (it knows `num_experts`).
    ///
    /// # Errors
    /// The first rule broken.
    pub fn validate(&self) -> Result<()> {
        RefError::nonzero(&[("hidden", self.hidden), ("top_k", self.top_k)])?;
        self.x.check_shape(self.num_tokens, self.hidden)?;
        let n = self.num_tokens * self.top_k;
        RefError::len_check("topk_idx", self.topk_idx.len(), n, "num_tokens * top_k")?;
        RefError::len_check(
            "topk_weights",
            self.topk_weights.len(),
            n,
            "num_tokens * top_k",
        )
    }
}

/// What one rank receives from [`dispatch`]. `R = num_recv_tokens`.
#[derive(Debug, Clone, PartialEq)]
pub struct RankOutput {
    /// `[R][hidden]`, same dtype as the inputs (fp8 rows keep their source scales).
    pub recv_x: XData,
    /// `[R][K]`: local expert id (`e - rank * experts_per_rank`) where the source's
    /// expert lives on this rank, `-1` elsewhere.
    pub recv_topk_idx: Vec<i64>,
    /// `[R][K]`: the source's weight where `recv_topk_idx` is local, `0.0` elsewhere.
    pub recv_topk_weights: Vec<f32>,
    /// `[R]`: source rank of each row (non-decreasing).
    pub recv_src_rank: Vec<u32>,
    /// `[R]`: source token index of each row (increasing within one source).
    pub recv_src_idx: Vec<u32>,
    /// `R`.
    pub num_recv_tokens: usize,
    /// `[experts_per_rank]`: rows' top-k entries naming each local expert.
    pub num_recv_per_local_expert: Vec<u32>,
    /// `[world + 1]`: rows received from sources `< s`; rows of source `s` are
    /// `rank_prefix[s]..rank_prefix[s + 1]`.
    pub rank_prefix: Vec<u32>,
    /// Channels per row.
    pub hidden: usize,
    /// Top-k width.
    pub top_k: usize,
}

impl RankOutput {
    /// Rows received from `src_rank` (empty when out of range).
    pub fn rows_from(&self, src_rank: usize) -> Range<usize> {
        match (
            self.rank_prefix.get(src_rank),
            self.rank_prefix.get(src_rank + 1),
        ) {
            (Some(&a), Some(&b)) => a as usize..b as usize,
            _ => 0..0,
        }
    }

    /// The row holding token `src_idx` of `src_rank`, if this rank received it.
    pub fn row_of(&self, src_rank: usize, src_idx: usize) -> Option<usize> {
        let rows = self.rows_from(src_rank);
        let ids = self.recv_src_idx.get(rows.clone())?;
        let pos = ids.binary_search(&u32::try_from(src_idx).ok()?).ok()?;
        Some(rows.start + pos)
    }
}

/// Dispatches every rank's tokens at once (`inputs[r]` is rank `r`'s input;
/// `world = inputs.len()`).
///
/// Rank `r` receives each token that names at least one of its experts exactly once, rows
/// ordered by source rank, then source token index. See [`RankOutput`] for the fields.
///
/// # Errors
/// `inputs` non-empty; `num_experts > 0` and `% world == 0`; every input valid
/// ([`RankInput::validate`]) and its ids `-1` or in `[0, E)` (wrapped in
/// [`RefError::InRank`]); `hidden`, `top_k` and the dtype equal on every rank
/// ([`RefError::Inconsistent`]); fewer than 2^32 tokens per rank.
pub fn dispatch(inputs: &[RankInput], num_experts: usize) -> Result<Vec<RankOutput>> {
    let world = inputs.len();
    RefError::nonzero(&[("inputs.len()", world), ("num_experts", num_experts)])?;
    RefError::multiple_check("num_experts", num_experts, "world_size", world)?;
    let first = &inputs[0];
    for (r, input) in inputs.iter().enumerate() {
        input.validate().map_err(|e| e.in_rank(r))?;
        RefError::at_most(
            "num_tokens",
            input.num_tokens,
            u32::MAX as usize,
            "source indices are u32",
        )
        .map_err(|e| e.in_rank(r))?;
        check_experts(&input.topk_idx, input.top_k, num_experts).map_err(|e| e.in_rank(r))?;
        let inconsistent = |arg, expected: String, actual: String| RefError::Inconsistent {
            arg,
            rank: r,
            expected,
            actual,
        };
        if input.hidden != first.hidden {
            return Err(inconsistent(
                "hidden",
                first.hidden.to_string(),
                input.hidden.to_string(),
            ));
        }
        if input.top_k != first.top_k {
            return Err(inconsistent(
                "top_k",
                first.top_k.to_string(),
                input.top_k.to_string(),
            ));
        }
        if input.x.is_fp8() != first.x.is_fp8() {
            return Err(inconsistent(
                "x dtype",
                first.x.dtype_name().into(),
                input.x.dtype_name().into(),
            ));
        }
    }
    let (hidden, top_k) = (first.hidden, first.top_k);
    // Every input passed check_shape, so an fp8 row format is valid here.
    let scales_per_row = match first.x.dtype() {
        RowDtype::Fp8 => fp8_row(hidden)?.num_scales(),
        RowDtype::Bf16 => 0,
    };
    let epr = num_experts / world;
    let layouts = inputs
        .iter()
        .enumerate()
        .map(|(r, i)| {
            layout(&i.topk_idx, i.num_tokens, top_k, num_experts, world, 1)
                .map_err(|e| e.in_rank(r))
        })
        .collect::<Result<Vec<_>>>()?;

    let mut outputs = Vec::with_capacity(world);
    for r in 0..world {
        let local = (r * epr) as i64..((r + 1) * epr) as i64;
        let total: usize = layouts.iter().map(|l| l.tokens_per_rank[r] as usize).sum();
        let mut out = RankOutput {
            recv_x: first.x.empty_like(),
            recv_topk_idx: Vec::with_capacity(total * top_k),
            recv_topk_weights: Vec::with_capacity(total * top_k),
            recv_src_rank: Vec::with_capacity(total),
            recv_src_idx: Vec::with_capacity(total),
            num_recv_tokens: total,
            num_recv_per_local_expert: vec![0; epr],
            rank_prefix: Vec::with_capacity(world + 1),
            hidden,
            top_k,
        };
        out.rank_prefix.push(0);
        for (s, (input, lay)) in inputs.iter().zip(&layouts).enumerate() {
            for t in 0..input.num_tokens {
                if !lay.is_token_in_rank[t * world + r] {
                    continue;
                }
                out.recv_x.push_row(&input.x, t, hidden, scales_per_row);
                let ids = &input.topk_idx[t * top_k..(t + 1) * top_k];
                let ws = &input.topk_weights[t * top_k..(t + 1) * top_k];
                for (&e, &w) in ids.iter().zip(ws) {
                    if local.contains(&e) {
                        let le = e - local.start;
                        out.recv_topk_idx.push(le);
                        out.recv_topk_weights.push(w);
                        out.num_recv_per_local_expert[le as usize] += 1;
                    } else {
                        out.recv_topk_idx.push(-1);
                        out.recv_topk_weights.push(0.0);
                    }
                }
                out.recv_src_rank.push(s as u32);
                out.recv_src_idx.push(t as u32);
            }
            out.rank_prefix.push(out.recv_src_rank.len() as u32);
        }
        outputs.push(out);
    }
    Ok(outputs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf(v: &[f32]) -> Vec<bf16> {
        v.iter().map(|x| bf16::from_f32(*x)).collect()
    }

    /// 2 ranks, 4 experts (2 per rank), hidden 8 (bf16), top-2.
    fn two_rank_inputs() -> Vec<RankInput> {
        let h = 8;
        let x0: Vec<f32> = (0..3 * h).map(|i| (i / h) as f32 + 1.0).collect(); // rows 1,2,3
        let x1: Vec<f32> = (0..2 * h).map(|i| -((i / h) as f32) - 1.0).collect(); // rows -1,-2
        vec![
            RankInput::new(
                XData::Bf16(bf(&x0)),
                vec![0, 1, 2, -1, 3, 0],
                vec![0.1, 0.2, 0.3, 0.4, 0.5, 0.6],
                h,
                2,
            )
            .unwrap(),
            RankInput::new(
                XData::Bf16(bf(&x1)),
                vec![-1, -1, 1, 3],
                vec![0.7, 0.8, 0.9, 1.0],
                h,
                2,
            )
            .unwrap(),
        ]
    }

    #[test]
    fn two_ranks_by_hand() {
        let out = dispatch(&two_rank_inputs(), 4).unwrap();
        // Rank 0 holds experts 0,1: gets (0,0), (0,2), (1,1).
        let o = &out[0];
        assert_eq!(o.num_recv_tokens, 3);
        assert_eq!(o.recv_src_rank, vec![0, 0, 1]);
        assert_eq!(o.recv_src_idx, vec![0, 2, 1]);
        assert_eq!(o.rank_prefix, vec![0, 2, 3]);
        assert_eq!(o.recv_topk_idx, vec![0, 1, -1, 0, 1, -1]);
        assert_eq!(o.recv_topk_weights, vec![0.1, 0.2, 0.0, 0.6, 0.9, 0.0]);
        assert_eq!(o.num_recv_per_local_expert, vec![2, 2]);
        let x = o.recv_x.to_f32(8).unwrap();
        assert_eq!(x[0], 1.0);
        assert_eq!(x[8], 3.0);
        assert_eq!(x[16], -2.0);
        assert_eq!(o.rows_from(1), 2..3);
        assert_eq!(o.row_of(0, 2), Some(1));
        assert_eq!(o.row_of(1, 0), None);
        assert_eq!(o.row_of(5, 0), None);
        // Rank 1 holds experts 2,3: gets (0,1), (0,2), (1,1).
        let o = &out[1];
        assert_eq!(o.recv_src_rank, vec![0, 0, 1]);
        assert_eq!(o.recv_src_idx, vec![1, 2, 1]);
        assert_eq!(o.recv_topk_idx, vec![0, -1, 1, -1, -1, 1]);
        assert_eq!(o.recv_topk_weights, vec![0.3, 0.0, 0.5, 0.0, 0.0, 1.0]);
        assert_eq!(o.num_recv_per_local_expert, vec![1, 2]);
    }

    #[test]
    fn fp8_rows_keep_scales() {
        let h = 128;
        let x: Vec<bf16> = (0..2 * h).map(|i| bf16::from_f32(i as f32)).collect();
        let fp8 = XData::fp8_from_bf16(&x, h).unwrap();
        let XData::Fp8 { scales, .. } = &fp8 else {
            unreachable!()
        };
        let second_scale = scales[1];
        let input = RankInput::new(fp8, vec![1, -1], vec![1.0, 0.0], h, 1).unwrap();
        let out = dispatch(&[input], 2).unwrap();
        assert_eq!(out[0].num_recv_tokens, 1);
        assert_eq!(out[0].recv_src_idx, vec![0]);
        let XData::Fp8 { data, scales } = &out[0].recv_x else {
            panic!("dtype changed")
        };
        assert_eq!(data.len(), 128);
        assert_eq!(scales.len(), 1);
        assert_ne!(scales[0], second_scale);
        assert_eq!(out[0].recv_x.dtype_name(), "fp8_e4m3");
        assert_eq!(out[0].recv_x.to_bf16(h).unwrap().len(), 128);
    }

    #[test]
    fn errors() {
        let good = two_rank_inputs();
        assert_eq!(
            dispatch(&[], 4),
            Err(RefError::Zero {
                arg: "inputs.len()"
            })
        );
        assert!(matches!(
            dispatch(&good, 3),
            Err(RefError::NotMultiple { .. })
        ));
        let mut bad = good.clone();
        bad[1].topk_idx[3] = 4;
        match dispatch(&bad, 4) {
            Err(RefError::InRank { rank: 1, source }) => assert_eq!(
                *source,
                RefError::ExpertOutOfRange {
                    token: 1,
                    k: 1,
                    expert: 4,
                    num_experts: 4
                }
            ),
            other => panic!("{other:?}"),
        }
        let mut bad = good.clone();
        bad[1].topk_weights.pop();
        assert!(matches!(
            dispatch(&bad, 4),
            Err(RefError::InRank { rank: 1, .. })
        ));
        let mut bad = good.clone();
        bad[1].hidden = 16;
        bad[1].x = XData::Bf16(vec![bf16::ZERO; 32]);
        assert!(matches!(
            dispatch(&bad, 4),
            Err(RefError::Inconsistent {
                arg: "hidden",
                rank: 1,
                ..
            })
        ));
        let mut bad = good.clone();
        bad[1].top_k = 1;
        bad[1].num_tokens = 4;
        bad[1].x = XData::Bf16(vec![bf16::ZERO; 32]);
        assert!(matches!(
            dispatch(&bad, 4),
            Err(RefError::Inconsistent { arg: "top_k", .. })
        ));
        assert!(matches!(
            RankInput::new(XData::Bf16(vec![]), vec![0, 1, 2], vec![], 8, 2),
            Err(RefError::NotMultiple { .. })
        ));
        assert!(matches!(
            RankInput::new(XData::Bf16(vec![bf16::ZERO; 3]), vec![0], vec![1.0], 8, 1),
            Err(RefError::Length { arg: "x", .. })
        ));
        let fp8 = XData::Fp8 {
            data: vec![F8E4M3::from_f32(0.0); 128],
            scales: vec![],
        };
        assert!(matches!(
            RankInput::new(fp8, vec![0], vec![1.0], 128, 1),
            Err(RefError::Length { arg: "scales", .. })
        ));
        let fp8 = XData::fp8_from_bf16(&vec![bf16::ONE; 8 * 128], 128).unwrap();
        let mut mixed = good;
        mixed[1] = RankInput::new(fp8, vec![0; 16], vec![0.0; 16], 128, 2).unwrap();
        mixed[0].hidden = 128;
        mixed[0].x = XData::Bf16(vec![bf16::ZERO; 3 * 128]);
        assert!(matches!(
            dispatch(&mixed, 4),
            Err(RefError::Inconsistent { arg: "x dtype", .. })
        ));
    }
}
