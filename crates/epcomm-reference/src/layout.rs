//! Routing statistics of one rank's `topk_idx`.

use crate::{RefError, Result};

/// The routing of one rank's tokens (what DeepEP's `get_dispatch_layout` returns, plus the
/// slots the fixed-slot kernels write to).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// Tokens of this rank (`T`).
    pub num_tokens: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Ranks per node.
    pub gpus_per_node: usize,
    /// Tokens sent to each rank (a token counted once per rank), `[world]`.
    pub tokens_per_rank: Vec<u32>,
    /// Tokens sent to each node (a token counted once per node), `[world / gpus_per_node]`.
    pub tokens_per_node: Vec<u32>,
    /// Top-k entries naming each expert, `[E]` (a token naming the same expert in two
    /// slots counts twice, as in DeepEP; `torch.topk` never produces that).
    pub tokens_per_expert: Vec<u32>,
    /// Whether token `t` goes to rank `r`, row-major `[T][world]`.
    pub is_token_in_rank: Vec<bool>,
    /// `[T][world]`: the number of earlier tokens (index < t) of this rank going to rank
    /// `r` — the row the token occupies among this source's rows at `r` — or `-1` when the
    /// token does not go to `r`.
    pub token_slot: Vec<i32>,
}

impl Layout {
    /// Number of nodes.
    pub fn num_nodes(&self) -> usize {
        self.world_size / self.gpus_per_node
    }

    /// Whether token `t` goes to rank `r` (false when out of range).
    pub fn in_rank(&self, t: usize, r: usize) -> bool {
        r < self.world_size
            && self
                .is_token_in_rank
                .get(t * self.world_size + r)
                .copied()
                .unwrap_or(false)
    }

    /// The slot of token `t` among this source's rows at rank `r`, if it goes there.
    pub fn slot(&self, t: usize, r: usize) -> Option<usize> {
        if r >= self.world_size {
            return None;
        }
        let s = *self.token_slot.get(t * self.world_size + r)?;
        usize::try_from(s).ok()
    }
}

/// Computes the [`Layout`] of one rank's routing.
///
/// `topk_idx` is `[num_tokens][top_k]`; `-1` = no expert.
///
/// # Errors
/// `top_k`, `num_experts`, `world_size`, `gpus_per_node` > 0;
/// `world_size % gpus_per_node == 0`; `num_experts % world_size == 0`;
/// `topk_idx.len() == num_tokens * top_k`; `num_tokens <= i32::MAX`; every entry `-1` or in
/// `[0, num_experts)` ([`RefError::ExpertOutOfRange`] names token and k).
pub fn layout(
    topk_idx: &[i64],
    num_tokens: usize,
    top_k: usize,
    num_experts: usize,
    world_size: usize,
    gpus_per_node: usize,
) -> Result<Layout> {
    RefError::nonzero(&[
        ("top_k", top_k),
        ("num_experts", num_experts),
        ("world_size", world_size),
        ("gpus_per_node", gpus_per_node),
    ])?;
    RefError::multiple_check("world_size", world_size, "gpus_per_node", gpus_per_node)?;
    RefError::multiple_check("num_experts", num_experts, "world_size", world_size)?;
    RefError::at_most(
        "num_tokens",
        num_tokens,
        i32::MAX as usize,
        "token slots are i32",
    )?;
    let expected = RefError::product("num_tokens * top_k", num_tokens, top_k)?;
    RefError::len_check("topk_idx", topk_idx.len(), expected, "num_tokens * top_k")?;
    check_experts(topk_idx, top_k, num_experts)?;

    let epr = num_experts / world_size;
    let num_nodes = world_size / gpus_per_node;
    let mut out = Layout {
        num_tokens,
        world_size,
        gpus_per_node,
        tokens_per_rank: vec![0; world_size],
        tokens_per_node: vec![0; num_nodes],
        tokens_per_expert: vec![0; num_experts],
        is_token_in_rank: vec![false; num_tokens * world_size],
        token_slot: vec![-1; num_tokens * world_size],
    };
    let mut in_node = vec![false; num_nodes];
    for (t, row) in topk_idx.chunks_exact(top_k).enumerate() {
        in_node.fill(false);
        for &e in row {
            // Entries were checked: -1 or in [0, E).
            let Ok(e) = usize::try_from(e) else { continue };
            out.tokens_per_expert[e] += 1;
            let r = e / epr;
            let cell = t * world_size + r;
            if !out.is_token_in_rank[cell] {
                out.is_token_in_rank[cell] = true;
                out.token_slot[cell] = out.tokens_per_rank[r] as i32;
                out.tokens_per_rank[r] += 1;
                in_node[r / gpus_per_node] = true;
            }
        }
        for (n, hit) in in_node.iter().enumerate() {
            if *hit {
                out.tokens_per_node[n] += 1;
            }
        }
    }
    Ok(out)
}

/// Every entry `-1` or in `[0, num_experts)`.
pub(crate) fn check_experts(topk_idx: &[i64], top_k: usize, num_experts: usize) -> Result<()> {
    for (i, &e) in topk_idx.iter().enumerate() {
        if e != -1 && !(0..num_experts as i64).contains(&e) {
            return Err(RefError::ExpertOutOfRange {
                token: i / top_k,
                k: i % top_k,
                expert: e,
                num_experts,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn small_example() {
        // 4 ranks in 2 nodes of 2, 8 experts (2 per rank), top-2.
        let idx = [
            0, 1, // token 0: both on rank 0 -> rank 0 once
            2, 7, // token 1: ranks 1, 3 (nodes 0, 1)
            -1, 5, // token 2: rank 2
            -1, -1, // token 3: nowhere
            4, 3, // token 4: ranks 2, 1
        ];
        let l = layout(&idx, 5, 2, 8, 4, 2).unwrap();
        assert_eq!(l.tokens_per_rank, vec![1, 2, 2, 1]);
        assert_eq!(l.tokens_per_node, vec![3, 3]);
        assert_eq!(l.tokens_per_expert, vec![1, 1, 1, 1, 1, 1, 0, 1]);
        assert_eq!(l.num_nodes(), 2);
        let row = |t: usize| l.is_token_in_rank[t * 4..t * 4 + 4].to_vec();
        assert_eq!(row(0), vec![true, false, false, false]);
        assert_eq!(row(1), vec![false, true, false, true]);
        assert_eq!(row(3), vec![false; 4]);
        assert_eq!(&l.token_slot[4 * 4..5 * 4], &[-1, 1, 1, -1]);
        assert_eq!(&l.token_slot[2 * 4..3 * 4], &[-1, -1, 0, -1]);
        assert_eq!(l.slot(4, 1), Some(1));
        assert_eq!(l.slot(3, 1), None);
        assert_eq!(l.slot(0, 9), None);
        assert!(l.in_rank(1, 3));
        assert!(!l.in_rank(1, 2));
        assert!(!l.in_rank(99, 0));
    }

    #[test]
    fn errors_name_token_and_k() {
        let e = layout(&[0, 1, 2, 8], 2, 2, 8, 2, 1).unwrap_err();
        assert_eq!(
            e,
            RefError::ExpertOutOfRange {
                token: 1,
                k: 1,
                expert: 8,
                num_experts: 8
            }
        );
        assert!(e.to_string().contains("topk_idx[1][1] = 8"));
        assert!(matches!(
            layout(&[-2], 1, 1, 8, 2, 1),
            Err(RefError::ExpertOutOfRange { expert: -2, .. })
        ));
        assert!(matches!(
            layout(&[0, 1, 2], 2, 2, 8, 2, 1),
            Err(RefError::Length {
                arg: "topk_idx",
                ..
            })
        ));
        assert!(matches!(
            layout(&[0], 1, 1, 6, 4, 1),
            Err(RefError::NotMultiple {
                arg: "num_experts",
                ..
            })
        ));
        assert!(matches!(
            layout(&[0], 1, 1, 8, 4, 3),
            Err(RefError::NotMultiple {
                arg: "world_size",
                ..
            })
        ));
        assert_eq!(
            layout(&[], 0, 0, 8, 4, 1),
            Err(RefError::Zero { arg: "top_k" })
        );
        assert_eq!(
            layout(&[], 0, 1, 0, 4, 1),
            Err(RefError::Zero { arg: "num_experts" })
        );
        assert_eq!(
            layout(&[], 0, 1, 8, 0, 1),
            Err(RefError::Zero { arg: "world_size" })
        );
        assert_eq!(
            layout(&[], 0, 1, 8, 4, 0),
            Err(RefError::Zero {
                arg: "gpus_per_node"
            })
        );
    }

    #[test]
    fn empty_batch() {
        let l = layout(&[], 0, 4, 8, 2, 2).unwrap();
        assert_eq!(l.tokens_per_rank, vec![0, 0]);
        assert!(l.is_token_in_rank.is_empty());
    }

    proptest! {
        #[test]
        fn invariants(
            world_pow in 0u32..4,
            nodes_pow in 0u32..3,
            epr in 1usize..5,
            top_k in 1usize..6,
            raw in proptest::collection::vec(-1i64..64, 0..120),
        ) {
            let world = 1usize << world_pow;
            let gpn = world >> nodes_pow.min(world_pow);
            let e = world * epr;
            let num_tokens = raw.len() / top_k;
            let idx: Vec<i64> = raw[..num_tokens * top_k]
                .iter()
                .map(|&v| if v < 0 { -1 } else { v % e as i64 })
                .collect();
            let l = layout(&idx, num_tokens, top_k, e, world, gpn).unwrap();
            let in_rank_total = l.is_token_in_rank.iter().filter(|b| **b).count();
            prop_assert_eq!(l.tokens_per_rank.iter().sum::<u32>() as usize, in_rank_total);
            let valid = idx.iter().filter(|v| **v >= 0).count();
            prop_assert_eq!(l.tokens_per_expert.iter().sum::<u32>() as usize, valid);
            // Per-node count <= sum of its ranks' counts; >= max of them.
            for n in 0..l.num_nodes() {
                let ranks = &l.tokens_per_rank[n * gpn..(n + 1) * gpn];
                prop_assert!(l.tokens_per_node[n] <= ranks.iter().sum::<u32>());
                prop_assert!(l.tokens_per_node[n] >= *ranks.iter().max().unwrap());
            }
            // Slots of each rank are exactly 0..tokens_per_rank[r] in token order.
            for r in 0..world {
                let mut slots = Vec::new();
                for t in 0..num_tokens {
                    let s = l.token_slot[t * world + r];
                    prop_assert_eq!(s >= 0, l.is_token_in_rank[t * world + r]);
                    if s >= 0 {
                        slots.push(s);
                    }
                }
                let expect: Vec<i32> = (0..l.tokens_per_rank[r] as i32).collect();
                prop_assert_eq!(slots, expect);
            }
        }
    }
}
