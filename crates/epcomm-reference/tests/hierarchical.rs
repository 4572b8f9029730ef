//! Property tests of the hierarchical (rail + NVLink forwarding) reference against the flat
//! one, an independent sum in the documented order, and the topology's worst-case sizes.

use std::collections::BTreeSet;

use epcomm_reference::{
    CombineOutput, RailPrecision, RailTraffic, RankInput, RankOutput, Tiers, XData, bf16, combine,
    dispatch, hierarchical_combine, rail_traffic,
};
use epcomm_topology::{combine_rail_partial_rows, forward_rows, rail_recv_rows};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

/// A routed world: every rank's input, the expert count and the tiers.
#[derive(Debug)]
struct Case {
    inputs: Vec<RankInput>,
    num_experts: usize,
    tiers: Tiers,
    seed: u64,
}

impl Case {
    fn world(&self) -> usize {
        self.inputs.len()
    }
    fn hidden(&self) -> usize {
        self.inputs[0].hidden
    }
    fn num_tokens(&self) -> Vec<usize> {
        self.inputs.iter().map(|i| i.num_tokens).collect()
    }
}

/// Nodes and local ranks in 1..=4, up to 288 experts, top-k 1..=9, 0..=6 tokens per rank,
/// `-1` entries; in one case out of three every token goes to one node's experts only.
fn case_strategy() -> impl Strategy<Value = Case> {
    (
        1usize..=4,
        1usize..=4,
        1usize..=9,
        1usize..=40,
        any::<u64>(),
    )
        .prop_flat_map(|(nodes, local, top_k, hidden, seed)| {
            let world = nodes * local;
            (1usize..=288 / world, 0usize..3, 0..nodes).prop_flat_map(
                move |(epr, mode, hot_node)| {
                    let e = world * epr;
                    // Experts of `hot_node` when every token goes to one node.
                    let span = if mode == 0 {
                        hot_node * local * epr..(hot_node + 1) * local * epr
                    } else {
                        0..e
                    };
                    let entry = prop_oneof![
                        1 => Just(-1i64),
                        4 => span.start as i64..span.end as i64,
                    ];
                    let rank = (0usize..=6).prop_flat_map(move |t| {
                        proptest::collection::vec(entry.clone(), t * top_k)
                    });
                    proptest::collection::vec(rank, world).prop_map(move |idxs| Case {
                        inputs: idxs
                            .into_iter()
                            .map(|idx| {
                                let t = idx.len() / top_k;
                                let x = XData::Bf16(vec![bf16::ONE; t * hidden]);
                                let w = vec![1.0; idx.len()];
                                RankInput::new(x, idx, w, hidden, top_k).unwrap()
                            })
                            .collect(),
                        num_experts: e,
                        tiers: Tiers::new(nodes, local).unwrap(),
                        seed,
                    })
                },
            )
        })
}

/// Expert outputs of varied magnitude (so that the order of additions matters) and f32
/// weights bf16 cannot hold, one row per received row.
fn outputs(out: &[RankOutput], seed: u64) -> (Vec<Vec<bf16>>, Vec<Vec<f32>>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut value = |exp: i32| {
        let m = rng.random_range(-255i32..=255) as f32;
        m * 2f32.powi(rng.random_range(-exp..=exp))
    };
    let ys = out
        .iter()
        .map(|o| {
            (0..o.num_recv_tokens * o.hidden)
                .map(|_| bf16::from_f32(value(12)))
                .collect()
        })
        .collect();
    let ws = out
        .iter()
        .map(|o| {
            (0..o.num_recv_tokens * o.top_k)
                .map(|_| value(4) * (1.0 + f32::EPSILON))
                .collect()
        })
        .collect();
    (ys, ws)
}

/// The documented order, computed by pulling each token's rows with `row_of`: per node in
/// increasing node order, the node's rows in increasing local rank summed from 0.0 in f32
/// (remote partials rounded through bf16 when `round_remote`), the partials summed from 0.0.
fn expected(
    case: &Case,
    out: &[RankOutput],
    ys: &[Vec<bf16>],
    ws: &[Vec<f32>],
    round_remote: bool,
) -> Vec<CombineOutput> {
    let (hidden, top_k) = (case.hidden(), case.inputs[0].top_k);
    let local = case.tiers.local_ranks();
    (0..case.world())
        .map(|s| {
            let mut x = Vec::new();
            let mut w = Vec::new();
            for t in 0..case.inputs[s].num_tokens {
                let mut acc = vec![0.0f32; hidden];
                let mut wacc = vec![0.0f32; top_k];
                for n in 0..case.tiers.nodes() {
                    let mut partial = vec![0.0f32; hidden];
                    let mut wpartial = vec![0.0f32; top_k];
                    let mut any = false;
                    for r in n * local..(n + 1) * local {
                        let Some(row) = out[r].row_of(s, t) else {
                            continue;
                        };
                        any = true;
                        for (p, y) in partial.iter_mut().zip(&ys[r][row * hidden..]) {
                            *p += y.to_f32();
                        }
                        for (p, v) in wpartial.iter_mut().zip(&ws[r][row * top_k..]) {
                            *p += v;
                        }
                    }
                    if !any {
                        continue;
                    }
                    let remote = n != s / local;
                    for (a, p) in acc.iter_mut().zip(&partial) {
                        *a += if remote && round_remote {
                            bf16::from_f32(*p).to_f32()
                        } else {
                            *p
                        };
                    }
                    for (a, p) in wacc.iter_mut().zip(&wpartial) {
                        *a += p;
                    }
                }
                x.extend(acc.into_iter().map(bf16::from_f32));
                w.extend(wacc);
            }
            CombineOutput {
                x,
                weights: Some(w),
            }
        })
        .collect()
}

/// Traffic counted from the dispatch outputs: every received row of a source in another
/// node came through the rail peer `(receiver's node, source's local rank)`.
fn brute_force_traffic(case: &Case, out: &[RankOutput]) -> Vec<RailTraffic> {
    let local = case.tiers.local_ranks();
    let mut traffic = vec![RailTraffic::default(); case.world()];
    let mut rail_rows = BTreeSet::new();
    for (r, o) in out.iter().enumerate() {
        for row in 0..o.num_recv_tokens {
            let (s, t) = (o.recv_src_rank[row] as usize, o.recv_src_idx[row] as usize);
            if s / local == r / local {
                if s != r {
                    traffic[s].dispatch_direct_nvlink += 1;
                }
                continue;
            }
            let peer = (r / local) * local + s % local;
            if r == peer {
                traffic[peer].dispatch_forward_kept += 1;
            } else {
                traffic[peer].dispatch_forwarded += 1;
            }
            rail_rows.insert((s, t, peer));
        }
    }
    for (s, _, peer) in rail_rows {
        traffic[s].dispatch_rail_sent += 1;
        traffic[s].combine_rail_received += 1;
        traffic[peer].dispatch_rail_received += 1;
        traffic[peer].combine_rail_sent += 1;
    }
    traffic
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn one_node_or_one_rank_per_node_equals_flat(case in case_strategy()) {
        let out = dispatch(&case.inputs, case.num_experts).unwrap();
        let (ys, ws) = outputs(&out, case.seed);
        let num_tokens = case.num_tokens();
        let flat = combine(&ys, Some(&ws), &out, &num_tokens).unwrap();
        let flat_x = combine(&ys, None, &out, &num_tokens).unwrap();
        let world = case.world();
        for tiers in [Tiers::new(1, world).unwrap(), Tiers::new(world, 1).unwrap()] {
            for rail in RailPrecision::ALL {
                let h = hierarchical_combine(&ys, Some(&ws), &out, &num_tokens, tiers, rail)
                    .unwrap();
                prop_assert_eq!(&h, &flat, "{:?} {:?}", tiers, rail);
                let h = hierarchical_combine(&ys, None, &out, &num_tokens, tiers, rail).unwrap();
                prop_assert_eq!(&h, &flat_x, "{:?} {:?}", tiers, rail);
            }
        }
    }

    #[test]
    fn both_rails_follow_the_documented_order(case in case_strategy()) {
        let out = dispatch(&case.inputs, case.num_experts).unwrap();
        let (ys, ws) = outputs(&out, case.seed);
        let num_tokens = case.num_tokens();
        let f32_rail = hierarchical_combine(
            &ys, Some(&ws), &out, &num_tokens, case.tiers, RailPrecision::F32,
        )
        .unwrap();
        let bf16_rail = hierarchical_combine(
            &ys, Some(&ws), &out, &num_tokens, case.tiers, RailPrecision::Bf16,
        )
        .unwrap();
        prop_assert_eq!(&f32_rail, &expected(&case, &out, &ys, &ws, false));
        prop_assert_eq!(&bf16_rail, &expected(&case, &out, &ys, &ws, true));
        // The rail's precision never touches the weights.
        for (a, b) in f32_rail.iter().zip(&bf16_rail) {
            prop_assert_eq!(&a.weights, &b.weights);
        }
    }

    #[test]
    fn traffic_matches_a_brute_force_count_within_the_worst_case(case in case_strategy()) {
        let out = dispatch(&case.inputs, case.num_experts).unwrap();
        let idx: Vec<&[i64]> = case.inputs.iter().map(|i| &i.topk_idx[..]).collect();
        let traffic = rail_traffic(&idx, case.inputs[0].top_k, case.num_experts, case.tiers)
            .unwrap();
        prop_assert_eq!(&traffic, &brute_force_traffic(&case, &out));

        let max_tokens = case.inputs.iter().map(|i| i.num_tokens).max().unwrap_or(0);
        let rail = rail_recv_rows(case.tiers, max_tokens).unwrap();
        let forward = forward_rows(case.tiers, max_tokens).unwrap();
        let partials = combine_rail_partial_rows(case.tiers, max_tokens).unwrap();
        let local = case.tiers.local_ranks();
        for (r, t) in traffic.iter().enumerate() {
            prop_assert!(t.dispatch_rail_sent <= rail && t.dispatch_rail_received <= rail);
            prop_assert!(t.dispatch_forwarded + t.dispatch_forward_kept <= forward);
            prop_assert!(t.combine_rail_sent <= partials && t.combine_rail_received <= partials);
            prop_assert_eq!(t.combine_rail_sent, t.dispatch_rail_received);
            prop_assert_eq!(t.combine_rail_received, t.dispatch_rail_sent);
            // Rows a rank receives through forwarding: those of other nodes' sources.
            let node = r / local;
            let forwarded_in = out[r].recv_src_rank.iter().filter(|&&s| s as usize / local != node);
            prop_assert!(forwarded_in.count() as u64 <= forward);
        }
        // Every rail row is forwarded or kept at least once.
        let rail_in: u64 = traffic.iter().map(|t| t.dispatch_rail_received).sum();
        let placed: u64 = traffic.iter().map(|t| t.dispatch_forwarded + t.dispatch_forward_kept).sum();
        prop_assert!(placed >= rail_in);
    }
}

#[test]
fn worst_case_is_reached_when_every_token_goes_everywhere() {
    // 3 nodes of 2, one expert per rank, every token of every rank to every expert.
    let (nodes, local, tokens) = (3, 2, 5);
    let world = nodes * local;
    let tiers = Tiers::new(nodes, local).unwrap();
    let idx: Vec<Vec<i64>> = (0..world)
        .map(|_| (0..tokens).flat_map(|_| 0..world as i64).collect())
        .collect();
    let traffic = rail_traffic(&idx, world, world, tiers).unwrap();
    let rail = rail_recv_rows(tiers, tokens).unwrap();
    let forward = forward_rows(tiers, tokens).unwrap();
    for t in &traffic {
        assert_eq!(t.dispatch_rail_sent, rail);
        assert_eq!(t.dispatch_rail_received, rail);
        assert_eq!(t.dispatch_forwarded + t.dispatch_forward_kept, forward);
        assert_eq!(
            t.combine_rail_received,
            combine_rail_partial_rows(tiers, tokens).unwrap()
        );
        assert_eq!(t.dispatch_direct_nvlink, ((local - 1) * tokens) as u64);
    }
}
