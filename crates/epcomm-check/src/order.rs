//! Row orders of the oracles: a buffer's received rows are the flat reference's in an order of
//! its tiering (flat: by source rank; two-tier: [`two_stage_order`]).

use epcomm_reference::RankOutput;
use epcomm_topology::Tiers;

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

#[cfg(test)]
mod tests {
    use epcomm_reference::XData;

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
