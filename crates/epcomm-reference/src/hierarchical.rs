//! The hierarchical (internode) path: combine's order and precision when partial sums cross
//! the rail, and the rows each tier carries.
//!
//! Ranks are `(node, local rank)` with `rank = node * L + local` ([`Tiers`]). Dispatch sends a
//! token once per other node over the rail to its *rail peer* there (the rank with the
//! source's local rank), which forwards it over NVLink to the ranks of its node that hold one
//! of the token's experts (itself included); the source's own node gets it directly. The rows
//! every rank ends up with are exactly the flat [`dispatch`](crate::dispatch)'s, so there is
//! no separate hierarchical dispatch oracle; [`rail_traffic`] counts what each tier carries.
//! Combine goes back the same way and sums in a different order from the flat
//! [`combine`](crate::combine): [`hierarchical_combine`].

use epcomm_topology::{RailPrecision, Tiers};
use half::bf16;

use crate::combine::{CombineOutput, add_row, check_combine_shapes, row_sources};
use crate::dispatch::RankOutput;
use crate::layout::layout;
use crate::{RefError, Result};

/// Combines every rank's expert outputs back to their source tokens the hierarchical way.
///
/// Inputs, output and shape rules are [`combine`](crate::combine)'s; only the order of the
/// additions and the rail's rounding differ. For source rank `s` in node `n_s` and token `t`:
///
/// 1. `partial(n) = Σ_r f32(y_r[row of (s, t) in r])` over the ranks `r` of node `n` that
///    received the token, **in increasing local rank**, in f32 starting from `0.0` (for
///    `n != n_s` the rail peer of `s` in `n` sums it; for `n_s`, the source itself);
/// 2. a partial of another node crosses the rail as `rail` says: [`RailPrecision::F32`]
///    keeps it, [`RailPrecision::Bf16`] rounds it to bf16 (and back to f32). The own node's
///    partial never crosses the rail and is never rounded;
/// 3. `out[t] = Σ_n partial(n)` over the nodes holding a contribution, **in increasing node
///    order**, in f32 starting from `0.0`, then rounded to bf16 once. Tokens sent nowhere give
///    zeros.
///
/// Weights, if given, are summed in the same order in f32 and never rounded (they cross the
/// rail as f32 under either precision).
///
/// With one node, or with one rank per node and no NaN in `ys`, every partial is the flat
/// sum of its node or a single row, and the result equals [`combine`](crate::combine)'s bit
/// for bit under either precision.
///
/// # Errors
/// As [`combine`](crate::combine); [`RefError::TiersMismatch`] when
/// `tiers.world_size() != dispatch_outputs.len()`.
pub fn hierarchical_combine(
    ys: &[Vec<bf16>],
    weights: Option<&[Vec<f32>]>,
    dispatch_outputs: &[RankOutput],
    num_tokens: &[usize],
    tiers: Tiers,
    rail: RailPrecision,
) -> Result<Vec<CombineOutput>> {
    combine_by_node(
        ys,
        weights,
        dispatch_outputs,
        num_tokens,
        tiers,
        rail,
        false,
    )
}

/// [`hierarchical_combine`] where the source's **own node's partial is rounded too**, like
/// every other node's, per `rail`: what a two-stage combine does when its node stage writes
/// every partial (the own node's included) as a bf16 row and its rail stage sums those rows.
/// This is epcomm's `HierarchicalBuffer::combine` with [`RailPrecision::Bf16`].
///
/// # Errors
/// As [`hierarchical_combine`].
pub fn hierarchical_combine_staged(
    ys: &[Vec<bf16>],
    weights: Option<&[Vec<f32>]>,
    dispatch_outputs: &[RankOutput],
    num_tokens: &[usize],
    tiers: Tiers,
    rail: RailPrecision,
) -> Result<Vec<CombineOutput>> {
    combine_by_node(ys, weights, dispatch_outputs, num_tokens, tiers, rail, true)
}

/// Both orders above; `round_own`: the own node's partial crosses `rail` too.
fn combine_by_node(
    ys: &[Vec<bf16>],
    weights: Option<&[Vec<f32>]>,
    dispatch_outputs: &[RankOutput],
    num_tokens: &[usize],
    tiers: Tiers,
    rail: RailPrecision,
    round_own: bool,
) -> Result<Vec<CombineOutput>> {
    let (hidden, top_k) = check_combine_shapes(ys, weights, dispatch_outputs, num_tokens)?;
    check_tiers(tiers, dispatch_outputs.len())?;
    let sources = row_sources(dispatch_outputs, num_tokens)?;
    let local = tiers.local_ranks();

    // partials[s][n]: node n's partial sums of source s's tokens.
    let mut partials: Vec<Vec<NodePartials>> = num_tokens
        .iter()
        .map(|&t| {
            (0..tiers.nodes())
                .map(|_| NodePartials::zeros(t, hidden, weights.map(|_| top_k)))
                .collect()
        })
        .collect();
    // Ranks are node-major, so visiting them in increasing order adds each node's rows in
    // increasing local rank.
    for (r, rows) in sources.iter().enumerate() {
        let node = r / local;
        for (row, &(s, t)) in rows.iter().enumerate() {
            let p = &mut partials[s][node];
            p.present[t] = true;
            add_row(
                &mut p.x[t * hidden..(t + 1) * hidden],
                &ys[r][row * hidden..(row + 1) * hidden],
            );
            if let (Some(pw), Some(w)) = (p.weights.as_mut(), weights) {
                let dst = &mut pw[t * top_k..(t + 1) * top_k];
                for (d, v) in dst.iter_mut().zip(&w[r][row * top_k..(row + 1) * top_k]) {
                    *d += *v;
                }
            }
        }
    }

    Ok(partials
        .into_iter()
        .enumerate()
        .map(|(s, nodes)| {
            let own = s / local;
            let mut x = vec![0.0f32; num_tokens[s] * hidden];
            let mut w = weights.map(|_| vec![0.0f32; num_tokens[s] * top_k]);
            for (n, p) in nodes.iter().enumerate() {
                let precision = if n == own && !round_own {
                    RailPrecision::F32
                } else {
                    rail
                };
                for t in (0..num_tokens[s]).filter(|&t| p.present[t]) {
                    let dst = &mut x[t * hidden..(t + 1) * hidden];
                    for (d, v) in dst.iter_mut().zip(&p.x[t * hidden..(t + 1) * hidden]) {
                        *d += across_rail(*v, precision);
                    }
                    if let (Some(w), Some(pw)) = (w.as_mut(), p.weights.as_ref()) {
                        let dst = &mut w[t * top_k..(t + 1) * top_k];
                        for (d, v) in dst.iter_mut().zip(&pw[t * top_k..(t + 1) * top_k]) {
                            *d += *v;
                        }
                    }
                }
            }
            CombineOutput {
                x: x.into_iter().map(bf16::from_f32).collect(),
                weights: w,
            }
        })
        .collect())
}

/// A partial as the receiving side of the rail reads it.
pub fn across_rail(partial: f32, precision: RailPrecision) -> f32 {
    match precision {
        RailPrecision::F32 => partial,
        RailPrecision::Bf16 => bf16::from_f32(partial).to_f32(),
    }
}

/// One node's partial sums of one source's tokens.
struct NodePartials {
    /// `[T][hidden]`.
    x: Vec<f32>,
    /// `[T][top_k]`, when weights are combined.
    weights: Option<Vec<f32>>,
    /// `[T]`: whether a rank of the node received the token.
    present: Vec<bool>,
}

impl NodePartials {
    fn zeros(num_tokens: usize, hidden: usize, top_k: Option<usize>) -> Self {
        Self {
            x: vec![0.0; num_tokens * hidden],
            weights: top_k.map(|k| vec![0.0; num_tokens * k]),
            present: vec![false; num_tokens],
        }
    }
}

/// The rows one rank moves on each tier in one hierarchical dispatch and combine.
///
/// Dispatch: a token of source `(n_s, l_s)` crosses the rail once per other node `n` holding
/// one of its experts, to `(n, l_s)`, which forwards it to those of `n`'s ranks. Combine moves
/// the same rows backwards: NVLink contributions to the rail peer (as many as it forwarded and
/// kept), one partial per rail-received token back over the rail, and own-node rows straight
/// to the source.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct RailTraffic {
    /// Dispatch: rows this rank sends over the rail (one per (token, other node it goes to)).
    pub dispatch_rail_sent: u64,
    /// Dispatch: rows this rank receives over the rail (from the ranks of other nodes with its
    /// local rank).
    pub dispatch_rail_received: u64,
    /// Dispatch: rail-received rows this rank forwards over NVLink, one per (row, other rank
    /// of its node holding one of the token's experts).
    pub dispatch_forwarded: u64,
    /// Dispatch: rail-received rows this rank keeps (it holds one of the token's experts): a
    /// copy inside its own memory, no NVLink.
    pub dispatch_forward_kept: u64,
    /// Dispatch: rows this rank sends straight over NVLink to the other ranks of its own node.
    pub dispatch_direct_nvlink: u64,
    /// Combine: partials this rank sends back over the rail (one per row it received over the
    /// rail in dispatch).
    pub combine_rail_sent: u64,
    /// Combine: partials this rank receives over the rail (one per (token, other node with a
    /// contribution); equal to `dispatch_rail_sent`).
    pub combine_rail_received: u64,
}

/// What every rank moves on each tier for one routing; `topk_idx[r]` is rank `r`'s
/// `[T_r][top_k]` routing (`-1` = no expert), as in [`dispatch`](crate::dispatch).
///
/// These are the row counts a benchmark turns into rail ("RDMA") and NVLink bytes; each stays
/// within the worst cases of `epcomm_topology`'s
/// [`rail_recv_rows`](epcomm_topology::rail_recv_rows),
/// [`forward_rows`](epcomm_topology::forward_rows) and
/// [`combine_rail_partial_rows`](epcomm_topology::combine_rail_partial_rows).
///
/// # Errors
/// `topk_idx` non-empty, `top_k > 0`; [`RefError::TiersMismatch`] when
/// `tiers.world_size() != topk_idx.len()`; every rank's routing valid for
/// [`layout`](crate::layout) (length a multiple of `top_k`, ids `-1` or in
/// `[0, num_experts)`, `num_experts % world == 0`), wrapped in [`RefError::InRank`].
pub fn rail_traffic<I: AsRef<[i64]>>(
    topk_idx: &[I],
    top_k: usize,
    num_experts: usize,
    tiers: Tiers,
) -> Result<Vec<RailTraffic>> {
    let world = topk_idx.len();
    RefError::nonzero(&[("topk_idx.len()", world), ("top_k", top_k)])?;
    check_tiers(tiers, world)?;
    let local = tiers.local_ranks();
    let mut out = vec![RailTraffic::default(); world];
    for (s, idx) in topk_idx.iter().enumerate() {
        let idx = idx.as_ref();
        let routing = RefError::multiple_check("topk_idx.len()", idx.len(), "top_k", top_k)
            .and_then(|()| layout(idx, idx.len() / top_k, top_k, num_experts, world, local))
            .map_err(|e| e.in_rank(s))?;
        let (own, local_rank) = (s / local, s % local);
        for t in 0..routing.num_tokens {
            for node in 0..tiers.nodes() {
                // The ranks of `node` the token goes to.
                let targets: Vec<usize> = (node * local..(node + 1) * local)
                    .filter(|&r| routing.in_rank(t, r))
                    .collect();
                if node == own {
                    let others = targets.iter().filter(|&&r| r != s).count();
                    out[s].dispatch_direct_nvlink += others as u64;
                    continue;
                }
                if targets.is_empty() {
                    continue;
                }
                let peer = node * local + local_rank;
                let kept = u64::from(targets.contains(&peer));
                out[s].dispatch_rail_sent += 1;
                out[s].combine_rail_received += 1;
                out[peer].dispatch_rail_received += 1;
                out[peer].combine_rail_sent += 1;
                out[peer].dispatch_forward_kept += kept;
                out[peer].dispatch_forwarded += targets.len() as u64 - kept;
            }
        }
    }
    Ok(out)
}

fn check_tiers(tiers: Tiers, world_size: usize) -> Result<()> {
    if tiers.world_size() != world_size {
        return Err(RefError::TiersMismatch {
            nodes: tiers.nodes(),
            local_ranks: tiers.local_ranks(),
            world_size,
        });
    }
    Ok(())
}

/// A routing small enough to follow by hand, which the rail-traffic tests of this crate and of
/// its users work through: 2 nodes × 2 local ranks, one expert per rank (expert `e` on rank
/// `e`), top-3, `-1` for an unused slot. Rank 0: token 0 → ranks 0, 2, 3; token 1 → rank 1;
/// token 2 → ranks 0, 2, 3. Rank 3: token 0 → ranks 0, 1, 3. Ranks 1 and 2: no tokens.
pub fn two_node_example_routing() -> Vec<Vec<i64>> {
    vec![
        vec![0, 2, 3, 1, -1, -1, 0, 2, 3],
        vec![],
        vec![],
        vec![0, 1, 3],
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{RankInput, XData, combine, dispatch};

    const H: usize = 8;

    fn routing() -> Vec<Vec<i64>> {
        two_node_example_routing()
    }

    fn dispatched() -> Vec<RankOutput> {
        let inputs: Vec<RankInput> = routing()
            .into_iter()
            .map(|idx| {
                let t = idx.len() / 3;
                let w = (0..idx.len()).map(|i| 0.5 + i as f32).collect();
                RankInput::new(XData::Bf16(vec![bf16::ONE; t * H]), idx, w, H, 3).unwrap()
            })
            .collect();
        dispatch(&inputs, 4).unwrap()
    }

    /// Rank `r`'s rows, each filled with `value(r, source, token)`.
    fn ys(out: &[RankOutput], value: impl Fn(usize, usize, usize) -> f32) -> Vec<Vec<bf16>> {
        out.iter()
            .enumerate()
            .map(|(r, o)| {
                (0..o.num_recv_tokens)
                    .flat_map(|row| {
                        let v = value(
                            r,
                            o.recv_src_rank[row] as usize,
                            o.recv_src_idx[row] as usize,
                        );
                        [bf16::from_f32(v); H]
                    })
                    .collect()
            })
            .collect()
    }

    fn tiers(nodes: usize, local: usize) -> Tiers {
        Tiers::new(nodes, local).unwrap()
    }

    fn first(c: &[CombineOutput], s: usize, t: usize) -> f32 {
        c[s].x[t * H].to_f32()
    }

    #[test]
    fn remote_partials_are_rounded_only_on_a_bf16_rail() {
        let out = dispatched();
        let eps = 2f32.powi(-8);
        // Source 0, token 0: rank 0 gives 2^-8 (own node), ranks 2 and 3 give 1 and 2^-8
        // (node 1, one partial 1 + 2^-8, a bf16 tie).
        let y = ys(&out, |r, _, _| if r == 2 { 1.0 } else { eps });
        let num_tokens = [3, 0, 0, 1];
        let f32_rail =
            hierarchical_combine(&y, None, &out, &num_tokens, tiers(2, 2), RailPrecision::F32)
                .unwrap();
        let bf16_rail = hierarchical_combine(
            &y,
            None,
            &out,
            &num_tokens,
            tiers(2, 2),
            RailPrecision::Bf16,
        )
        .unwrap();
        // F32: 2^-8 + (1 + 2^-8) = 1 + 2^-7, representable.
        assert_eq!(first(&f32_rail, 0, 0), 1.0 + 2.0 * eps);
        // Bf16: the partial 1 + 2^-8 rounds to 1 (ties to even); 2^-8 + 1 rounds to 1 again.
        assert_eq!(first(&bf16_rail, 0, 0), 1.0);
        // Source 3's own node (1) holds one row; node 0's partial 2^-8 + 2^-8 is exact.
        assert_eq!(first(&f32_rail, 3, 0), 3.0 * eps);
        assert_eq!(first(&bf16_rail, 3, 0), 3.0 * eps);
        // A token that stays in its node: rank 1's row only.
        assert_eq!(first(&bf16_rail, 0, 1), eps);
    }

    #[test]
    fn staged_rounds_the_own_nodes_partial_too() {
        // 2 nodes x 2 ranks, one expert per rank; rank 0's one token goes to ranks 0, 1 (its
        // own node) and 2.
        let inputs: Vec<RankInput> = [vec![0i64, 1, 2], vec![], vec![], vec![]]
            .into_iter()
            .map(|idx| {
                let t = idx.len() / 3;
                let w = vec![1.0; idx.len()];
                RankInput::new(XData::Bf16(vec![bf16::ONE; t * H]), idx, w, H, 3).unwrap()
            })
            .collect();
        let out = dispatch(&inputs, 4).unwrap();
        let eps = 2f32.powi(-8);
        let y = ys(&out, |r, _, _| if r == 0 { 1.0 } else { eps });
        let num_tokens = [1, 0, 0, 0];
        let t = tiers(2, 2);
        let run = |staged: bool, rail| {
            let f = if staged {
                hierarchical_combine_staged
            } else {
                hierarchical_combine
            };
            first(&f(&y, None, &out, &num_tokens, t, rail).unwrap(), 0, 0)
        };
        // Classic: the own partial 1 + 2^-8 stays f32; + node 1's 2^-8 = 1 + 2^-7, a bf16.
        assert_eq!(run(false, RailPrecision::Bf16), 1.0 + 2.0 * eps);
        // Staged: the own partial rounds first (a tie, to 1); 1 + 2^-8 rounds to 1 again.
        assert_eq!(run(true, RailPrecision::Bf16), 1.0);
        // On an f32 rail nothing is rounded before the end: both agree.
        assert_eq!(
            run(true, RailPrecision::F32),
            run(false, RailPrecision::F32)
        );
        // One node: the own partial rounded once is the flat sum rounded once.
        let flat = combine(&y, None, &out, &num_tokens).unwrap();
        let one = hierarchical_combine_staged(
            &y,
            None,
            &out,
            &num_tokens,
            tiers(1, 4),
            RailPrecision::Bf16,
        )
        .unwrap();
        assert_eq!(one, flat);
    }

    #[test]
    fn partials_reassociate_the_flat_sum() {
        let out = dispatched();
        // Source 0, token 2: rank 0 gives -2^25, ranks 2 and 3 give 2^25 and 1.
        let big = 2f32.powi(25);
        let y = ys(&out, |r, _, _| match r {
            0 => -big,
            2 => big,
            _ => 1.0,
        });
        let num_tokens = [3, 0, 0, 1];
        let flat = combine(&y, None, &out, &num_tokens).unwrap();
        // Flat: (-2^25 + 2^25) + 1 = 1.
        assert_eq!(first(&flat, 0, 2), 1.0);
        for rail in RailPrecision::ALL {
            let h = hierarchical_combine(&y, None, &out, &num_tokens, tiers(2, 2), rail).unwrap();
            // Hierarchical: -2^25 + (2^25 + 1), and 2^25 + 1 rounds to 2^25 in f32.
            assert_eq!(first(&h, 0, 2), 0.0);
        }
    }

    #[test]
    fn one_node_or_one_rank_per_node_is_the_flat_combine() {
        let out = dispatched();
        let big = 2f32.powi(25);
        let y = ys(&out, |r, s, t| {
            [-big, 1.0, big, 2f32.powi(-8)][(r + s + t) % 4]
        });
        let w: Vec<Vec<f32>> = out.iter().map(|o| o.recv_topk_weights.clone()).collect();
        let num_tokens = [3, 0, 0, 1];
        let flat = combine(&y, Some(&w), &out, &num_tokens).unwrap();
        for t in [tiers(1, 4), tiers(4, 1)] {
            for rail in RailPrecision::ALL {
                let h = hierarchical_combine(&y, Some(&w), &out, &num_tokens, t, rail).unwrap();
                assert_eq!(h, flat, "{t:?} {rail:?}");
            }
        }
    }

    #[test]
    fn weights_cross_the_rail_in_f32() {
        let out = dispatched();
        let y = ys(&out, |_, _, _| 0.0);
        let fine = 1.0 + 2f32.powi(-10);
        // Rank 2's row of (0, 0) carries a weight bf16 cannot hold.
        let w: Vec<Vec<f32>> = out
            .iter()
            .enumerate()
            .map(|(r, o)| vec![if r == 2 { fine } else { 0.0 }; o.num_recv_tokens * 3])
            .collect();
        let c = hierarchical_combine(
            &y,
            Some(&w),
            &out,
            &[3, 0, 0, 1],
            tiers(2, 2),
            RailPrecision::Bf16,
        )
        .unwrap();
        assert_eq!(c[0].weights.as_ref().unwrap()[..3], [fine; 3]);
    }

    #[test]
    fn traffic_by_hand() {
        let traffic = rail_traffic(&routing(), 3, 4, tiers(2, 2)).unwrap();
        let t = |sent, recv, fwd, kept, direct| RailTraffic {
            dispatch_rail_sent: sent,
            dispatch_rail_received: recv,
            dispatch_forwarded: fwd,
            dispatch_forward_kept: kept,
            dispatch_direct_nvlink: direct,
            combine_rail_sent: recv,
            combine_rail_received: sent,
        };
        // Rank 0 sends tokens 0 and 2 to node 1 (rail peer 2) and token 1 to rank 1; rank 2
        // forwards both to rank 3 and keeps both. Rank 3 sends token 0 to node 0 (rail peer
        // 1), which forwards it to rank 0 and keeps it.
        assert_eq!(
            traffic,
            [
                t(2, 0, 0, 0, 1),
                t(0, 1, 1, 1, 0),
                t(0, 2, 2, 2, 0),
                t(1, 0, 0, 0, 0)
            ]
        );
        // One node: no rail; rank 0 reaches ranks 1, 2, 3 directly, rank 3 ranks 0 and 1.
        let flat = rail_traffic(&routing(), 3, 4, tiers(1, 4)).unwrap();
        let direct: Vec<u64> = flat.iter().map(|t| t.dispatch_direct_nvlink).collect();
        assert_eq!(direct, [5, 0, 0, 2]);
        assert!(
            flat.iter()
                .all(|t| t.dispatch_rail_sent == 0 && t.dispatch_rail_received == 0)
        );
    }

    #[test]
    fn errors() {
        let out = dispatched();
        let y = ys(&out, |_, _, _| 1.0);
        let mismatch = RefError::TiersMismatch {
            nodes: 3,
            local_ranks: 2,
            world_size: 4,
        };
        assert_eq!(
            hierarchical_combine(
                &y,
                None,
                &out,
                &[3, 0, 0, 1],
                tiers(3, 2),
                RailPrecision::F32
            ),
            Err(mismatch.clone())
        );
        assert!(mismatch.to_string().contains("nodes * local_ranks"));
        assert!(matches!(
            hierarchical_combine(
                &y[..3],
                None,
                &out,
                &[3, 0, 0, 1],
                tiers(2, 2),
                RailPrecision::F32
            ),
            Err(RefError::Length { arg: "ys", .. })
        ));
        assert!(matches!(
            hierarchical_combine(
                &y,
                None,
                &out,
                &[0, 0, 0, 1],
                tiers(2, 2),
                RailPrecision::F32
            ),
            Err(RefError::BadRow {
                rank: 0,
                row: 0,
                ..
            })
        ));
        assert_eq!(rail_traffic(&routing(), 3, 4, tiers(3, 2)), Err(mismatch));
        assert_eq!(
            rail_traffic::<Vec<i64>>(&[], 3, 4, tiers(1, 1)),
            Err(RefError::Zero {
                arg: "topk_idx.len()"
            })
        );
        assert_eq!(
            rail_traffic(&routing(), 0, 4, tiers(2, 2)),
            Err(RefError::Zero { arg: "top_k" })
        );
        let mut bad = routing();
        bad[3][1] = 4;
        assert!(matches!(
            rail_traffic(&bad, 3, 4, tiers(2, 2)),
            Err(RefError::InRank { rank: 3, .. })
        ));
        bad[3].pop();
        match rail_traffic(&bad, 3, 4, tiers(2, 2)) {
            Err(RefError::InRank { rank: 3, source }) => {
                assert!(matches!(*source, RefError::NotMultiple { .. }))
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            rail_traffic(&routing(), 3, 6, tiers(2, 2)),
            Err(RefError::InRank { rank: 0, .. })
        ));
    }

    #[test]
    fn across_rail_rounds_only_bf16() {
        let v = 1.0 + 2f32.powi(-9);
        assert_eq!(across_rail(v, RailPrecision::F32), v);
        assert_eq!(across_rail(v, RailPrecision::Bf16), 1.0);
    }
}
