//! Property tests across layout, dispatch and combine.

use epcomm_reference::{
    RankInput, XData, bf16, combine, dequantize_fp8_e4m3_per128, dispatch, layout,
    quantize_fp8_e4m3_per128, small_int_bf16,
};
use proptest::prelude::*;

/// A random small world: (inputs, num_experts).
fn world_strategy() -> impl Strategy<Value = (Vec<RankInput>, usize)> {
    (1usize..5, 1usize..4, 1usize..5, 1usize..4, any::<u64>()).prop_flat_map(
        |(world, epr, top_k, hidden8, seed)| {
            let e = world * epr;
            let hidden = hidden8 * 8;
            let rank = proptest::collection::vec(-1i64..(e as i64), 0..(12 * top_k)).prop_map(
                move |mut idx| {
                    idx.truncate(idx.len() / top_k * top_k);
                    idx
                },
            );
            proptest::collection::vec(rank, world).prop_map(move |idxs| {
                let inputs = idxs
                    .into_iter()
                    .enumerate()
                    .map(|(r, idx)| {
                        let t = idx.len() / top_k;
                        let x = small_int_bf16(t * hidden, 8, seed.wrapping_add(r as u64));
                        let w = (0..idx.len()).map(|i| (i % 7) as f32 * 0.5 - 1.0).collect();
                        RankInput::new(XData::Bf16(x), idx, w, hidden, top_k).unwrap()
                    })
                    .collect();
                (inputs, e)
            })
        },
    )
}

fn distinct_ranks(row: &[i64], epr: usize) -> usize {
    let mut ranks: Vec<usize> = row
        .iter()
        .filter(|e| **e >= 0)
        .map(|e| *e as usize / epr)
        .collect();
    ranks.sort_unstable();
    ranks.dedup();
    ranks.len()
}

proptest! {
    #[test]
    fn combine_of_dispatch_multiplies_by_rank_count((inputs, e) in world_strategy()) {
        let world = inputs.len();
        let epr = e / world;
        let (hidden, top_k) = (inputs[0].hidden, inputs[0].top_k);
        let out = dispatch(&inputs, e).unwrap();
        let ys: Vec<Vec<bf16>> = out.iter().map(|o| o.recv_x.to_bf16(hidden).unwrap()).collect();
        let ws: Vec<Vec<f32>> = out.iter().map(|o| o.recv_topk_weights.clone()).collect();
        let num_tokens: Vec<usize> = inputs.iter().map(|i| i.num_tokens).collect();
        let combined = combine(&ys, Some(&ws), &out, &num_tokens).unwrap();
        for (s, input) in inputs.iter().enumerate() {
            let XData::Bf16(x) = &input.x else { unreachable!() };
            let c = &combined[s];
            prop_assert_eq!(c.x.len(), input.num_tokens * hidden);
            let cw = c.weights.as_ref().unwrap();
            for t in 0..input.num_tokens {
                let row = &input.topk_idx[t * top_k..(t + 1) * top_k];
                let n = distinct_ranks(row, epr) as f32;
                for h in 0..hidden {
                    prop_assert_eq!(
                        c.x[t * hidden + h].to_f32(),
                        x[t * hidden + h].to_f32() * n,
                        "rank {} token {} channel {}", s, t, h
                    );
                }
                // Each k's weight is non-zero only at the rank holding its expert.
                for k in 0..top_k {
                    let expect = if row[k] >= 0 { input.topk_weights[t * top_k + k] } else { 0.0 };
                    prop_assert_eq!(cw[t * top_k + k], expect);
                }
            }
        }
    }

    #[test]
    fn counts_agree_with_layout((inputs, e) in world_strategy()) {
        let world = inputs.len();
        let top_k = inputs[0].top_k;
        let out = dispatch(&inputs, e).unwrap();
        let layouts: Vec<_> = inputs
            .iter()
            .map(|i| layout(&i.topk_idx, i.num_tokens, top_k, e, world, 1).unwrap())
            .collect();
        for l in &layouts {
            prop_assert_eq!(
                l.tokens_per_rank.iter().sum::<u32>() as usize,
                l.is_token_in_rank.iter().filter(|b| **b).count()
            );
        }
        let epr = e / world;
        for (r, o) in out.iter().enumerate() {
            // Rows received == sum over sources of tokens_per_rank[r].
            let expect: u32 = layouts.iter().map(|l| l.tokens_per_rank[r]).sum();
            prop_assert_eq!(o.num_recv_tokens, expect as usize);
            prop_assert_eq!(o.recv_src_rank.len(), o.num_recv_tokens);
            prop_assert_eq!(o.recv_topk_idx.len(), o.num_recv_tokens * top_k);
            prop_assert_eq!(o.rank_prefix.len(), world + 1);
            prop_assert_eq!(*o.rank_prefix.last().unwrap() as usize, o.num_recv_tokens);
            for s in 0..world {
                prop_assert_eq!(o.rows_from(s).len(), layouts[s].tokens_per_rank[r] as usize);
                // The slot from the layout addresses the row.
                for t in 0..inputs[s].num_tokens {
                    let row = o.row_of(s, t);
                    prop_assert_eq!(row.is_some(), layouts[s].in_rank(t, r));
                    if let Some(row) = row {
                        prop_assert_eq!(row, o.rank_prefix[s] as usize + layouts[s].slot(t, r).unwrap());
                    }
                }
            }
            // Per-local-expert counts match the sources' per-expert counts.
            for le in 0..epr {
                let expect: u32 = layouts.iter().map(|l| l.tokens_per_expert[r * epr + le]).sum();
                prop_assert_eq!(o.num_recv_per_local_expert[le], expect);
            }
        }
    }

    #[test]
    fn fp8_dispatch_moves_quantized_rows_unchanged(
        tokens in 0usize..10,
        seed in any::<u64>(),
        idx_seed in proptest::collection::vec(-1i64..4, 20),
    ) {
        let hidden = 256;
        let x = small_int_bf16(tokens * hidden, 100, seed);
        let (data, scales) = quantize_fp8_e4m3_per128(&x, hidden).unwrap();
        let idx: Vec<i64> = idx_seed[..tokens * 2].to_vec();
        let input = RankInput::new(
            XData::Fp8 { data: data.clone(), scales: scales.clone() },
            idx.clone(),
            vec![1.0; tokens * 2],
            hidden,
            2,
        )
        .unwrap();
        let empty = RankInput::new(
            XData::Fp8 { data: vec![], scales: vec![] }, vec![], vec![], hidden, 2,
        )
        .unwrap();
        let out = dispatch(&[input, empty], 4).unwrap();
        let src = dequantize_fp8_e4m3_per128(&data, &scales, hidden).unwrap();
        for o in &out {
            let got = o.recv_x.to_f32(hidden).unwrap();
            for (row, &t) in o.recv_src_idx.iter().enumerate() {
                let t = t as usize;
                prop_assert_eq!(
                    &got[row * hidden..(row + 1) * hidden],
                    &src[t * hidden..(t + 1) * hidden]
                );
            }
        }
    }
}
