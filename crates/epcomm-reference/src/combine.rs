//! Combine: the reverse of dispatch, summing each token's contributions.

use half::bf16;

use crate::dispatch::RankOutput;
use crate::layout::check_experts;
use crate::{RefError, Result};

/// One source rank's combined tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct CombineOutput {
    /// `[T][hidden]` bf16.
    pub x: Vec<bf16>,
    /// `[T][top_k]` summed weights, when weights were combined.
    pub weights: Option<Vec<f32>>,
}

/// Combines every rank's expert outputs back to their source tokens.
///
/// `ys[r]` is rank `r`'s `[R_r][hidden]` bf16 output, rows in the order of
/// `dispatch_outputs[r]` (the [`dispatch`](crate::dispatch) result); `weights`, if given,
/// is `[R_r][top_k]` per rank. `num_tokens[s]` is source rank `s`'s token count.
///
/// For source rank `s` and token `t`: `out[t] = Σ_r y_r[row of (s, t) in r]` over the ranks
/// that received the token, **in increasing r**, accumulated in f32 starting from `0.0` and
/// rounded to bf16 once; tokens sent nowhere give zeros. `weights[t][k] = Σ_r
/// weights_r[row][k]` in f32 (same order).
///
/// # Errors
/// `dispatch_outputs` non-empty and `ys`, `num_tokens`, `weights` of the same length;
/// every `ys[r]` of `R_r * hidden` and `weights[r]` of `R_r * top_k` elements
/// ([`RefError::InRank`]); `hidden`/`top_k` equal across outputs; every row's source rank
/// and index in range and no (source, token) twice in one rank ([`RefError::BadRow`]).
pub fn combine(
    ys: &[Vec<bf16>],
    weights: Option<&[Vec<f32>]>,
    dispatch_outputs: &[RankOutput],
    num_tokens: &[usize],
) -> Result<Vec<CombineOutput>> {
    let (hidden, top_k) = check_combine_shapes(ys, weights, dispatch_outputs, num_tokens)?;
    let sources = row_sources(dispatch_outputs, num_tokens)?;
    let mut acc: Vec<Vec<f32>> = num_tokens.iter().map(|&t| vec![0.0; t * hidden]).collect();
    let mut wacc: Option<Vec<Vec<f32>>> =
        weights.map(|_| num_tokens.iter().map(|&t| vec![0.0; t * top_k]).collect());
    for (r, rows) in sources.iter().enumerate() {
        for (row, &(s, t)) in rows.iter().enumerate() {
            add_row(
                &mut acc[s][t * hidden..(t + 1) * hidden],
                &ys[r][row * hidden..(row + 1) * hidden],
            );
            if let (Some(wacc), Some(w)) = (wacc.as_mut(), weights) {
                let dst = &mut wacc[s][t * top_k..(t + 1) * top_k];
                for (d, v) in dst.iter_mut().zip(&w[r][row * top_k..(row + 1) * top_k]) {
                    *d += *v;
                }
            }
        }
    }
    let mut wacc = wacc.map(|v| v.into_iter());
    Ok(acc
        .into_iter()
        .map(|x| CombineOutput {
            x: x.into_iter().map(bf16::from_f32).collect(),
            weights: wacc.as_mut().and_then(|it| it.next()),
        })
        .collect())
}

/// `dst[i] += f32(row[i])`.
pub(crate) fn add_row(dst: &mut [f32], row: &[bf16]) {
    for (d, y) in dst.iter_mut().zip(row) {
        *d += y.to_f32();
    }
}

/// The shape rules of [`combine`] (see its errors) on everything but the rows' sources;
/// returns `(hidden, top_k)`.
pub(crate) fn check_combine_shapes(
    ys: &[Vec<bf16>],
    weights: Option<&[Vec<f32>]>,
    dispatch_outputs: &[RankOutput],
    num_tokens: &[usize],
) -> Result<(usize, usize)> {
    let world = dispatch_outputs.len();
    RefError::nonzero(&[("dispatch_outputs.len()", world)])?;
    RefError::len_check("ys", ys.len(), world, "one per rank")?;
    RefError::len_check("num_tokens", num_tokens.len(), world, "one per rank")?;
    if let Some(w) = weights {
        RefError::len_check("weights", w.len(), world, "one per rank")?;
    }
    let (hidden, top_k) = (dispatch_outputs[0].hidden, dispatch_outputs[0].top_k);
    for (r, out) in dispatch_outputs.iter().enumerate() {
        for (arg, expected, actual) in [("hidden", hidden, out.hidden), ("top_k", top_k, out.top_k)]
        {
            if expected != actual {
                return Err(RefError::Inconsistent {
                    arg,
                    rank: r,
                    expected: expected.to_string(),
                    actual: actual.to_string(),
                });
            }
        }
        let rows = out.num_recv_tokens;
        let check = || -> Result<()> {
            RefError::len_check("recv_src_rank", out.recv_src_rank.len(), rows, "R")?;
            RefError::len_check("recv_src_idx", out.recv_src_idx.len(), rows, "R")?;
            RefError::len_check("ys", ys[r].len(), rows * hidden, "R * hidden")?;
            if let Some(w) = weights {
                RefError::len_check("weights", w[r].len(), rows * top_k, "R * top_k")?;
            }
            Ok(())
        };
        check().map_err(|e| e.in_rank(r))?;
    }
    Ok((hidden, top_k))
}

/// For every rank `r` and row of `dispatch_outputs[r]` (shapes already checked by
/// [`check_combine_shapes`]), the row's `(source rank, source token)`.
///
/// # Errors
/// [`RefError::BadRow`]: a source rank or token index out of range, or one (source, token)
/// twice in one rank.
pub(crate) fn row_sources(
    dispatch_outputs: &[RankOutput],
    num_tokens: &[usize],
) -> Result<Vec<Vec<(usize, usize)>>> {
    let world = dispatch_outputs.len();
    let mut seen: Vec<Vec<bool>> = num_tokens.iter().map(|&t| vec![false; t]).collect();
    let mut out = Vec::with_capacity(world);
    for (r, o) in dispatch_outputs.iter().enumerate() {
        seen.iter_mut().for_each(|v| v.fill(false));
        let mut rows = Vec::with_capacity(o.num_recv_tokens);
        for row in 0..o.num_recv_tokens {
            let s = o.recv_src_rank[row] as usize;
            let t = o.recv_src_idx[row] as usize;
            let bad = |rule| RefError::BadRow { rank: r, row, rule };
            if s >= world {
                return Err(bad("recv_src_rank >= world_size"));
            }
            if t >= num_tokens[s] {
                return Err(bad("recv_src_idx >= num_tokens[recv_src_rank]"));
            }
            if std::mem::replace(&mut seen[s][t], true) {
                return Err(bad("(source rank, token) received twice by one rank"));
            }
            rows.push((s, t));
        }
        out.push(rows);
    }
    Ok(out)
}

/// Low-latency combine of one source rank: `out[t] = Σ_k w[t][k] · y[t][k]` over the `k`
/// with `topk_idx[t][k] != -1`, in increasing `k`, in f32 (`w * f32(y)` added to an
/// accumulator starting at `0.0`), rounded to bf16 once.
///
/// `expert_out` is `[T][top_k][hidden]`: the output of expert `topk_idx[t][k]` for token
/// `t` (its contents are ignored where `topk_idx` is `-1`). Gathering it from the
/// per-expert receive layout is the caller's job.
///
/// # Errors
/// `top_k`, `hidden` > 0; `topk_idx`, `topk_weights` of `num_tokens * top_k` and
/// `expert_out` of `num_tokens * top_k * hidden` elements; ids `-1` or `>= 0` (the expert
/// count is not known here, so only negative ids other than -1 are rejected).
pub fn combine_weighted_ll(
    expert_out: &[bf16],
    topk_idx: &[i64],
    topk_weights: &[f32],
    num_tokens: usize,
    top_k: usize,
    hidden: usize,
) -> Result<Vec<bf16>> {
    RefError::nonzero(&[("top_k", top_k), ("hidden", hidden)])?;
    let n = num_tokens * top_k;
    RefError::len_check("topk_idx", topk_idx.len(), n, "num_tokens * top_k")?;
    RefError::len_check("topk_weights", topk_weights.len(), n, "num_tokens * top_k")?;
    RefError::len_check(
        "expert_out",
        expert_out.len(),
        n * hidden,
        "num_tokens * top_k * hidden",
    )?;
    check_experts(topk_idx, top_k, usize::MAX >> 1)?;
    let mut out = Vec::with_capacity(num_tokens * hidden);
    let mut acc = vec![0.0f32; hidden];
    for t in 0..num_tokens {
        acc.fill(0.0);
        for k in 0..top_k {
            let i = t * top_k + k;
            if topk_idx[i] == -1 {
                continue;
            }
            let w = topk_weights[i];
            for (a, y) in acc
                .iter_mut()
                .zip(&expert_out[i * hidden..(i + 1) * hidden])
            {
                *a += w * y.to_f32();
            }
        }
        out.extend(acc.iter().map(|v| bf16::from_f32(*v)));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{RankInput, XData, dispatch};

    fn bf(v: &[f32]) -> Vec<bf16> {
        v.iter().map(|x| bf16::from_f32(*x)).collect()
    }

    #[test]
    fn sums_in_rank_order_and_zero_for_unsent() {
        // 2 ranks, 2 experts, hidden 8. Token 0 -> both ranks; token 1 -> nowhere;
        // token 2 -> rank 1.
        let h = 8;
        let x: Vec<f32> = (0..3 * h).map(|i| (i / h + 1) as f32).collect();
        let input = RankInput::new(
            XData::Bf16(bf(&x)),
            vec![0, 1, -1, -1, 1, -1],
            vec![0.5, 0.25, 9.0, 9.0, 2.0, 9.0],
            h,
            2,
        )
        .unwrap();
        let empty = RankInput::new(XData::Bf16(vec![]), vec![], vec![], h, 2).unwrap();
        let out = dispatch(&[input, empty], 2).unwrap();
        let ys: Vec<Vec<bf16>> = out.iter().map(|o| o.recv_x.to_bf16(h).unwrap()).collect();
        let ws: Vec<Vec<f32>> = out.iter().map(|o| o.recv_topk_weights.clone()).collect();
        let c = combine(&ys, Some(&ws), &out, &[3, 0]).unwrap();
        assert_eq!(c.len(), 2);
        assert!(c[1].x.is_empty());
        let x0 = &c[0].x;
        assert!(x0[..h].iter().all(|v| v.to_f32() == 2.0));
        assert!(x0[h..2 * h].iter().all(|v| v.to_f32() == 0.0));
        assert!(x0[2 * h..].iter().all(|v| v.to_f32() == 3.0));
        assert_eq!(
            c[0].weights.as_deref(),
            Some(&[0.5, 0.25, 0.0, 0.0, 2.0, 0.0][..])
        );
        let c = combine(&ys, None, &out, &[3, 0]).unwrap();
        assert!(c[0].weights.is_none());
    }

    #[test]
    fn rounds_once_at_the_end() {
        // 1 + 2^-8 + 2^-8 in f32 is 1 + 2^-7 (representable in bf16); rounding to bf16
        // after each step would round 1 + 2^-8 to even (1.0) twice.
        let h = 8;
        let input = RankInput::new(
            XData::Bf16(vec![bf16::ZERO; h]),
            vec![0, 1, 2],
            vec![1.0; 3],
            h,
            3,
        )
        .unwrap();
        let e = || RankInput::new(XData::Bf16(vec![]), vec![], vec![], h, 3).unwrap();
        let out = dispatch(&[input, e(), e()], 3).unwrap();
        let vals = [1.0f32, 2f32.powi(-8), 2f32.powi(-8)];
        let ys: Vec<Vec<bf16>> = vals.iter().map(|v| vec![bf16::from_f32(*v); h]).collect();
        let c = combine(&ys, None, &out, &[1, 0, 0]).unwrap();
        assert_eq!(c[0].x[0].to_f32(), 1.0 + 2f32.powi(-7));
    }

    #[test]
    fn errors() {
        let h = 8;
        let input =
            RankInput::new(XData::Bf16(vec![bf16::ONE; h]), vec![0], vec![1.0], h, 1).unwrap();
        let out = dispatch(std::slice::from_ref(&input), 1).unwrap();
        let ys = vec![vec![bf16::ONE; h]];
        assert!(combine(&ys, None, &out, &[1]).is_ok());
        assert!(matches!(
            combine(&ys, None, &[], &[1]),
            Err(RefError::Zero { .. })
        ));
        assert!(matches!(
            combine(&[], None, &out, &[1]),
            Err(RefError::Length { arg: "ys", .. })
        ));
        assert!(matches!(
            combine(&ys, None, &out, &[]),
            Err(RefError::Length {
                arg: "num_tokens",
                ..
            })
        ));
        assert!(matches!(
            combine(&ys, Some(&[]), &out, &[1]),
            Err(RefError::Length { arg: "weights", .. })
        ));
        assert!(matches!(
            combine(&ys, Some(&[vec![]]), &out, &[1]),
            Err(RefError::InRank { rank: 0, .. })
        ));
        assert!(matches!(
            combine(&[vec![bf16::ONE; 3]], None, &out, &[1]),
            Err(RefError::InRank { rank: 0, .. })
        ));
        assert!(matches!(
            combine(&ys, None, &out, &[0]),
            Err(RefError::BadRow {
                rank: 0,
                row: 0,
                ..
            })
        ));
        let mut bad = out.clone();
        bad[0].recv_src_rank[0] = 3;
        assert!(matches!(
            combine(&ys, None, &bad, &[1]),
            Err(RefError::BadRow { .. })
        ));
        let mut dup = out[0].clone();
        dup.num_recv_tokens = 2;
        dup.recv_src_rank = vec![0, 0];
        dup.recv_src_idx = vec![0, 0];
        assert!(matches!(
            combine(&[vec![bf16::ONE; 2 * h]], None, &[dup], &[1]),
            Err(RefError::BadRow { row: 1, .. })
        ));
        let mut other = out[0].clone();
        other.hidden = 16;
        assert!(matches!(
            combine(
                &[ys[0].clone(), ys[0].clone()],
                None,
                &[out[0].clone(), other],
                &[1, 1]
            ),
            Err(RefError::Inconsistent { arg: "hidden", .. })
        ));
    }

    #[test]
    fn weighted_ll() {
        let h = 2;
        // token 0: k0 (w 0.5, y 2) + k1 masked + k2 (w 2, y -1) = -1
        // token 1: all masked = 0
        let y = bf(&[
            2.0, 2.0, 100.0, 100.0, -1.0, -1.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0,
        ]);
        let out = combine_weighted_ll(
            &y,
            &[3, -1, 7, -1, -1, -1],
            &[0.5, 9.0, 2.0, 1.0, 1.0, 1.0],
            2,
            3,
            h,
        )
        .unwrap();
        assert_eq!(out, bf(&[-1.0, -1.0, 0.0, 0.0]));
        assert!(matches!(
            combine_weighted_ll(&y, &[3, -2, 7, -1, -1, -1], &[0.0; 6], 2, 3, h),
            Err(RefError::ExpertOutOfRange { token: 0, k: 1, .. })
        ));
        assert!(matches!(
            combine_weighted_ll(&y[..4], &[3, -1, 7, -1, -1, -1], &[0.0; 6], 2, 3, h),
            Err(RefError::Length {
                arg: "expert_out",
                ..
            })
        ));
        assert!(matches!(
            combine_weighted_ll(&y, &[3; 6], &[0.0; 5], 2, 3, h),
            Err(RefError::Length {
                arg: "topk_weights",
                ..
            })
        ));
        assert!(matches!(
            combine_weighted_ll(&y, &[], &[], 2, 0, h),
            Err(RefError::Zero { arg: "top_k" })
        ));
    }
}
