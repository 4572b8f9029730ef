//! Deterministic workloads: DeepEP's benchmark inputs and a few routing variations.
//!
//! All generators use `rand::rngs::StdRng` seeded with `seed_from_u64(seed)`; the same
//! seed (and the same locked `rand` version) gives the same bits on every machine.

use half::bf16;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use crate::dispatch::{RankInput, XData};
use crate::{RefError, Result};

/// One rank's DeepEP-style inputs.
#[derive(Debug, Clone, PartialEq)]
pub struct Workload {
    /// `[num_tokens][hidden]` bf16, standard normal values.
    pub x: Vec<bf16>,
    /// `[num_tokens][top_k]`: the top-k experts by score, highest score first.
    pub topk_idx: Vec<i64>,
    /// `[num_tokens][top_k]`: standard normal values (DeepEP's `topk_weights_pure_rand`).
    pub topk_weights: Vec<f32>,
    /// Tokens.
    pub num_tokens: usize,
    /// Channels per token.
    pub hidden: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Total experts.
    pub num_experts: usize,
}

impl Workload {
    /// `(x, topk_idx, topk_weights)`.
    pub fn into_parts(self) -> (Vec<bf16>, Vec<i64>, Vec<f32>) {
        (self.x, self.topk_idx, self.topk_weights)
    }

    /// A bf16 [`RankInput`] of this workload.
    pub fn to_rank_input(&self) -> RankInput {
        RankInput {
            x: XData::Bf16(self.x.clone()),
            ..self.to_rank_input_without_x()
        }
    }

    /// An fp8 [`RankInput`] of this workload (x quantized per 128 channels).
    ///
    /// # Errors
    /// `hidden % 128 == 0`.
    pub fn to_rank_input_fp8(&self) -> Result<RankInput> {
        Ok(RankInput {
            x: XData::fp8_from_bf16(&self.x, self.hidden)?,
            ..self.to_rank_input_without_x()
        })
    }

    fn to_rank_input_without_x(&self) -> RankInput {
        RankInput {
            x: XData::Bf16(Vec::new()),
            topk_idx: self.topk_idx.clone(),
            topk_weights: self.topk_weights.clone(),
            num_tokens: self.num_tokens,
            hidden: self.hidden,
            top_k: self.top_k,
        }
    }
}

/// `n` standard-normal f32 values (Box–Muller on `rng`'s uniform f64s).
pub fn randn_f32(rng: &mut StdRng, n: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(n + 1);
    while out.len() < n {
        // u1 in (0, 1] so ln(u1) is finite.
        let u1 = 1.0 - rng.random::<f64>();
        let u2 = rng.random::<f64>();
        let r = (-2.0 * u1.ln()).sqrt();
        let theta = std::f64::consts::TAU * u2;
        out.push((r * theta.cos()) as f32);
        out.push((r * theta.sin()) as f32);
    }
    out.truncate(n);
    out
}

/// DeepEP's benchmark inputs for one rank (`tests/test_intranode.py`):
/// `x = randn(T, H)` as bf16; `scores = |randn(T, E)| + 1`; `topk_idx = topk(scores, K)`
/// (ordered by descending score, ties to the lower expert id — DeepEP uses
/// `sorted=False`, which only permutes the k slots); `topk_weights = randn(T, K)`.
/// Deterministic per `seed`; use a different seed per rank.
///
/// # Errors
/// `hidden`, `top_k`, `num_experts` > 0; `top_k <= num_experts`.
pub fn gen_deepep_workload(
    num_tokens: usize,
    hidden: usize,
    top_k: usize,
    num_experts: usize,
    seed: u64,
) -> Result<Workload> {
    RefError::nonzero(&[
        ("hidden", hidden),
        ("top_k", top_k),
        ("num_experts", num_experts),
    ])?;
    RefError::at_most(
        "top_k",
        top_k,
        num_experts,
        "a token picks distinct experts",
    )?;
    let mut rng = StdRng::seed_from_u64(seed);
    let x = randn_f32(&mut rng, num_tokens * hidden)
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    let mut topk_idx = Vec::with_capacity(num_tokens * top_k);
    let mut order: Vec<usize> = Vec::with_capacity(num_experts);
    for _ in 0..num_tokens {
        let scores: Vec<f32> = randn_f32(&mut rng, num_experts)
            .into_iter()
            .map(|v| v.abs() + 1.0)
            .collect();
        order.clear();
        order.extend(0..num_experts);
        let by_score = |a: &usize, b: &usize| scores[*b].total_cmp(&scores[*a]).then(a.cmp(b));
        if top_k < num_experts {
            order.select_nth_unstable_by(top_k - 1, by_score);
        }
        order[..top_k].sort_unstable_by(by_score);
        topk_idx.extend(order[..top_k].iter().map(|&e| e as i64));
    }
    let topk_weights = randn_f32(&mut rng, num_tokens * top_k);
    Ok(Workload {
        x,
        topk_idx,
        topk_weights,
        num_tokens,
        hidden,
        top_k,
        num_experts,
    })
}

/// DeepEP workloads for a whole world: rank `r` gets
/// `gen_deepep_workload(num_tokens, hidden, top_k, num_experts, seed + r)`, as a bf16
/// [`RankInput`].
///
/// # Errors
/// As [`gen_deepep_workload`], and `world_size > 0`.
pub fn gen_deepep_world(
    world_size: usize,
    num_tokens: usize,
    hidden: usize,
    top_k: usize,
    num_experts: usize,
    seed: u64,
) -> Result<Vec<RankInput>> {
    RefError::nonzero(&[("world_size", world_size)])?;
    (0..world_size as u64)
        .map(|r| {
            gen_deepep_workload(num_tokens, hidden, top_k, num_experts, seed.wrapping_add(r))
                .map(|w| w.to_rank_input())
        })
        .collect()
}

/// Sets each entry of `topk_idx` to `-1` with probability `prob` (DeepEP's low-latency
/// test masks random slots this way). Returns how many entries are `-1` afterwards.
///
/// # Errors
/// `prob` in `[0, 1]`.
pub fn mask_topk(topk_idx: &mut [i64], prob: f64, seed: u64) -> Result<usize> {
    if !(0.0..=1.0).contains(&prob) {
        return Err(RefError::OutOfRange {
            arg: "prob",
            value: prob,
            min: 0.0,
            max: 1.0,
        });
    }
    let mut rng = StdRng::seed_from_u64(seed);
    for e in topk_idx.iter_mut() {
        if rng.random::<f64>() < prob {
            *e = -1;
        }
    }
    Ok(topk_idx.iter().filter(|e| **e == -1).count())
}

/// Skewed routing: every token picks `top_k` distinct experts, all on rank `hot_rank`
/// (uniformly among its experts). Returns `[num_tokens][top_k]`.
///
/// # Errors
/// `top_k`, `num_experts`, `world_size` > 0; `num_experts % world_size == 0`;
/// `hot_rank < world_size`; `top_k <= num_experts / world_size`.
pub fn skewed_topk(
    num_tokens: usize,
    top_k: usize,
    num_experts: usize,
    world_size: usize,
    hot_rank: usize,
    seed: u64,
) -> Result<Vec<i64>> {
    RefError::nonzero(&[
        ("top_k", top_k),
        ("num_experts", num_experts),
        ("world_size", world_size),
    ])?;
    RefError::multiple_check("num_experts", num_experts, "world_size", world_size)?;
    let epr = num_experts / world_size;
    RefError::at_most("hot_rank", hot_rank, world_size - 1, "a rank index")?;
    RefError::at_most("top_k", top_k, epr, "distinct experts of one rank")?;
    let mut rng = StdRng::seed_from_u64(seed);
    let base = hot_rank * epr;
    let mut pool: Vec<usize> = (0..epr).collect();
    let mut out = Vec::with_capacity(num_tokens * top_k);
    for _ in 0..num_tokens {
        // Partial Fisher–Yates: the first top_k of a random permutation.
        for k in 0..top_k {
            let j = rng.random_range(k..epr);
            pool.swap(k, j);
            out.push((base + pool[k]) as i64);
        }
    }
    Ok(out)
}

/// `len` bf16 values that are integers in `[-max_abs, max_abs]` (exact in bf16 for
/// `max_abs <= 256`), for tests whose sums must be exact.
pub fn small_int_bf16(len: usize, max_abs: u8, seed: u64) -> Vec<bf16> {
    let mut rng = StdRng::seed_from_u64(seed);
    let m = i32::from(max_abs);
    (0..len)
        .map(|_| bf16::from_f32(rng.random_range(-m..=m) as f32))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout;

    #[test]
    fn deterministic_and_shaped() {
        let a = gen_deepep_workload(64, 256, 8, 32, 7).unwrap();
        let b = gen_deepep_workload(64, 256, 8, 32, 7).unwrap();
        let c = gen_deepep_workload(64, 256, 8, 32, 8).unwrap();
        assert_eq!(a, b);
        assert_ne!(a.x, c.x);
        assert_eq!(a.x.len(), 64 * 256);
        assert_eq!(a.topk_idx.len(), 64 * 8);
        assert_eq!(a.topk_weights.len(), 64 * 8);
        for row in a.topk_idx.chunks(8) {
            let mut r = row.to_vec();
            r.sort();
            r.dedup();
            assert_eq!(r.len(), 8, "experts distinct");
            assert!(row.iter().all(|e| (0..32).contains(e)));
        }
        // Inputs are valid for the reference ops.
        a.to_rank_input().validate().unwrap();
        a.to_rank_input_fp8().unwrap().validate().unwrap();
        layout(&a.topk_idx, 64, 8, 32, 4, 2).unwrap();
        let (x, idx, w) = a.clone().into_parts();
        assert_eq!((x, idx, w), (a.x, a.topk_idx, a.topk_weights));
    }

    #[test]
    fn topk_is_top_by_score() {
        // With top_k == num_experts every expert appears; with the generator's stream
        // recomputed, the picked experts have the highest scores.
        let w = gen_deepep_workload(3, 8, 4, 16, 1).unwrap();
        let mut rng = StdRng::seed_from_u64(1);
        let _x = randn_f32(&mut rng, 3 * 8);
        for t in 0..3 {
            let scores: Vec<f32> = randn_f32(&mut rng, 16)
                .iter()
                .map(|v| v.abs() + 1.0)
                .collect();
            let picked = &w.topk_idx[t * 4..(t + 1) * 4];
            let min_picked = picked
                .iter()
                .map(|&e| scores[e as usize])
                .fold(f32::INFINITY, f32::min);
            for (e, score) in scores.iter().enumerate() {
                if !picked.contains(&(e as i64)) {
                    assert!(*score <= min_picked);
                }
            }
            for pair in picked.windows(2) {
                assert!(scores[pair[0] as usize] >= scores[pair[1] as usize]);
            }
        }
        let all = gen_deepep_workload(2, 8, 16, 16, 3).unwrap();
        let mut r = all.topk_idx[..16].to_vec();
        r.sort();
        assert_eq!(r, (0..16).collect::<Vec<i64>>());
    }

    #[test]
    fn randn_moments() {
        let mut rng = StdRng::seed_from_u64(42);
        let v = randn_f32(&mut rng, 20001);
        assert_eq!(v.len(), 20001);
        let mean = v.iter().map(|x| *x as f64).sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|x| (*x as f64 - mean).powi(2)).sum::<f64>() / v.len() as f64;
        assert!(mean.abs() < 0.05, "{mean}");
        assert!((var - 1.0).abs() < 0.05, "{var}");
    }

    #[test]
    fn world_generation() {
        let w = gen_deepep_world(3, 5, 128, 2, 6, 10).unwrap();
        assert_eq!(w.len(), 3);
        assert_eq!(
            w[2],
            gen_deepep_workload(5, 128, 2, 6, 12)
                .unwrap()
                .to_rank_input()
        );
        assert_eq!(
            gen_deepep_world(0, 5, 128, 2, 6, 10),
            Err(RefError::Zero { arg: "world_size" })
        );
    }

    #[test]
    fn masking() {
        let mut idx = vec![3i64; 10_000];
        let n = mask_topk(&mut idx, 0.25, 5).unwrap();
        assert!((2000..3000).contains(&n), "{n}");
        assert_eq!(mask_topk(&mut idx.clone(), 0.0, 5).unwrap(), n);
        assert_eq!(mask_topk(&mut idx, 1.0, 5).unwrap(), 10_000);
        assert!(matches!(
            mask_topk(&mut idx, 1.5, 5),
            Err(RefError::OutOfRange { arg: "prob", .. })
        ));
        assert!(mask_topk(&mut idx, f64::NAN, 5).is_err());
    }

    #[test]
    fn skewed() {
        let idx = skewed_topk(100, 4, 32, 4, 2, 9).unwrap();
        assert_eq!(idx.len(), 400);
        for row in idx.chunks(4) {
            assert!(row.iter().all(|e| (16..24).contains(e)));
            let mut r = row.to_vec();
            r.sort();
            r.dedup();
            assert_eq!(r.len(), 4);
        }
        let l = layout(&idx, 100, 4, 32, 4, 1).unwrap();
        assert_eq!(l.tokens_per_rank, vec![0, 0, 100, 0]);
        assert!(matches!(
            skewed_topk(1, 9, 32, 4, 0, 0),
            Err(RefError::TooLarge { arg: "top_k", .. })
        ));
        assert!(matches!(
            skewed_topk(1, 1, 32, 4, 4, 0),
            Err(RefError::TooLarge {
                arg: "hot_rank",
                ..
            })
        ));
        assert!(matches!(
            skewed_topk(1, 1, 30, 4, 0, 0),
            Err(RefError::NotMultiple { .. })
        ));
    }

    #[test]
    fn small_ints() {
        let v = small_int_bf16(1000, 4, 1);
        assert!(v.iter().all(|x| {
            let f = x.to_f32();
            f.fract() == 0.0 && f.abs() <= 4.0
        }));
        assert!(v.iter().any(|x| x.to_f32() == -4.0));
        assert_eq!(v, small_int_bf16(1000, 4, 1));
    }

    #[test]
    fn generator_errors() {
        assert!(matches!(
            gen_deepep_workload(1, 8, 9, 8, 0),
            Err(RefError::TooLarge { arg: "top_k", .. })
        ));
        assert!(matches!(
            gen_deepep_workload(1, 0, 1, 8, 0),
            Err(RefError::Zero { arg: "hidden" })
        ));
        assert!(matches!(
            gen_deepep_workload(1, 100, 1, 8, 0)
                .unwrap()
                .to_rank_input_fp8(),
            Err(RefError::Row(_))
        ));
    }
}
