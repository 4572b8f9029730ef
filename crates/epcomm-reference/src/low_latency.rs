//! Low-latency dispatch semantics: which rows every rank receives, per local expert, in which
//! order (the combine is [`crate::combine_weighted_ll`]).
//!
//! A rank receives one row per (token, k) whose expert it holds, packed per local expert in
//! the order (source rank, source token index); a token names each expert at most once.

use crate::layout::check_experts;
use crate::{RefError, Result};

/// Where one received row of a low-latency dispatch came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlEntry {
    /// The source rank.
    pub src_rank: usize,
    /// The token's index on its source rank.
    pub src_token: usize,
    /// The top-k slot of the token that named this expert.
    pub k: usize,
}

/// What one rank receives in a low-latency dispatch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LlReceived {
    /// Per local expert, its rows in packed order.
    pub experts: Vec<Vec<LlEntry>>,
    /// `[local expert][source rank]`: (first row, rows) of each source.
    pub layout_range: Vec<Vec<(usize, usize)>>,
}

/// The rows every rank receives when rank `r` dispatches tokens routed by `topk_idx[r]`
/// (`[T_r][top_k]`, `-1` = none).
///
/// # Errors
/// `top_k`, `num_experts` > 0; `num_experts % world == 0`; every `topk_idx[r]` a multiple of
/// `top_k` long with ids `-1` or in `[0, num_experts)`, no token naming an expert twice
/// ([`RefError::DuplicateExpert`]).
pub fn ll_dispatch(
    topk_idx: &[Vec<i64>],
    top_k: usize,
    num_experts: usize,
) -> Result<Vec<LlReceived>> {
    let world = topk_idx.len();
    RefError::nonzero(&[
        ("world", world),
        ("top_k", top_k),
        ("num_experts", num_experts),
    ])?;
    RefError::multiple_check("num_experts", num_experts, "world", world)?;
    let epr = num_experts / world;
    let mut out: Vec<LlReceived> = (0..world)
        .map(|_| LlReceived {
            experts: vec![Vec::new(); epr],
            layout_range: vec![vec![(0, 0); world]; epr],
        })
        .collect();
    for (src, idx) in topk_idx.iter().enumerate() {
        RefError::multiple_check("topk_idx.len()", idx.len(), "top_k", top_k)?;
        check_experts(idx, top_k, num_experts)?;
        for (t, row) in idx.chunks_exact(top_k).enumerate() {
            for (k, &e) in row.iter().enumerate() {
                if let Some(first) = row[..k].iter().position(|&p| p == e && e != -1) {
                    return Err(RefError::DuplicateExpert {
                        token: t,
                        expert: e,
                        first,
                        second: k,
                    });
                }
            }
        }
        // Per destination expert, in token order then k (a token names it once).
        for dst in out.iter_mut() {
            for (l, range) in dst.layout_range.iter_mut().enumerate() {
                range[src].0 = dst.experts[l].len();
            }
        }
        for (t, row) in idx.chunks_exact(top_k).enumerate() {
            for (k, &e) in row.iter().enumerate() {
                if e < 0 {
                    continue;
                }
                let e = e as usize;
                out[e / epr].experts[e % epr].push(LlEntry {
                    src_rank: src,
                    src_token: t,
                    k,
                });
            }
        }
        for dst in out.iter_mut() {
            for (l, range) in dst.layout_range.iter_mut().enumerate() {
                range[src].1 = dst.experts[l].len() - range[src].0;
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packs_by_source_then_token() {
        // 2 ranks, 4 experts (rank 0: 0,1; rank 1: 2,3), top-2.
        let r0 = vec![1, 2, -1, 1];
        let r1 = vec![1, 3, 0, -1];
        let got = ll_dispatch(&[r0, r1], 2, 4).unwrap();
        let e = |src_rank, src_token, k| LlEntry {
            src_rank,
            src_token,
            k,
        };
        assert_eq!(got[0].experts[1], [e(0, 0, 0), e(0, 1, 1), e(1, 0, 0)]);
        assert_eq!(got[0].experts[0], [e(1, 1, 0)]);
        assert_eq!(got[0].layout_range[1], [(0, 2), (2, 1)]);
        assert_eq!(got[1].experts[0], [e(0, 0, 1)]);
        assert_eq!(got[1].experts[1], [e(1, 0, 1)]);
        assert_eq!(got[1].layout_range[1], [(0, 0), (0, 1)]);
    }

    #[test]
    fn rejects_duplicates_and_bad_ids() {
        assert!(matches!(
            ll_dispatch(&[vec![3, 3]], 2, 4),
            Err(RefError::DuplicateExpert {
                token: 0,
                expert: 3,
                first: 0,
                second: 1
            })
        ));
        assert!(ll_dispatch(&[vec![-1, -1]], 2, 4).is_ok());
        assert!(ll_dispatch(&[vec![4, 0]], 2, 4).is_err());
    }
}
