//! DeepEP's benchmark workload for one rank, exactly as `epcomm bench` generates it
//! (`epcomm_check::inputs::host_inputs` of `Shape::uniform(.., seed)`: rank `r` uses seed
//! `seed + r * 7919`), as little-endian bytes the Python side turns into tensors. The Python
//! benchmark therefore times the same rows and the same routing as the Rust one.

use epcomm_reference::{XData, gen_deepep_workload};

use crate::error::Result;

/// One rank's inputs as raw little-endian bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkloadBytes {
    /// `[tokens][hidden]` bf16.
    pub x: Vec<u8>,
    /// `[tokens][top_k]` i64 expert ids.
    pub topk_idx: Vec<u8>,
    /// `[tokens][top_k]` f32 weights.
    pub topk_weights: Vec<u8>,
    /// `[tokens][hidden]` e4m3 (empty unless `hidden % 128 == 0`).
    pub x_fp8: Vec<u8>,
    /// `[tokens][hidden / 128]` f32 scales (empty unless `hidden % 128 == 0`).
    pub scales: Vec<u8>,
}

/// The seed rank `rank` of a run seeded with `seed` uses (as `epcomm_check::inputs`).
pub fn rank_seed(seed: u64, rank: usize) -> u64 {
    seed.wrapping_add(rank as u64 * 7919)
}

/// Rank `rank`'s workload: `tokens` tokens, hidden `hidden`, top-`top_k` of `experts`.
pub fn deepep_workload(
    tokens: usize,
    hidden: usize,
    top_k: usize,
    experts: usize,
    seed: u64,
    rank: usize,
) -> Result<WorkloadBytes> {
    let w = gen_deepep_workload(tokens, hidden, top_k, experts, rank_seed(seed, rank))?;
    let (x_fp8, scales) = if hidden.is_multiple_of(128) {
        match w.to_rank_input_fp8()?.x {
            XData::Fp8 { data, scales } => (
                data.iter().map(|v| v.to_bits()).collect(),
                scales.iter().flat_map(|s| s.to_le_bytes()).collect(),
            ),
            XData::Bf16(_) => (Vec::new(), Vec::new()),
        }
    } else {
        (Vec::new(), Vec::new())
    };
    Ok(WorkloadBytes {
        x: w.x.iter().flat_map(|v| v.to_le_bytes()).collect(),
        topk_idx: w.topk_idx.iter().flat_map(|v| v.to_le_bytes()).collect(),
        topk_weights: w
            .topk_weights
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        x_fp8,
        scales,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_the_reference_workload() {
        let b = deepep_workload(5, 256, 4, 16, 2025, 1).unwrap();
        let w = gen_deepep_workload(5, 256, 4, 16, 2025 + 7919).unwrap();
        assert_eq!(b.x.len(), 5 * 256 * 2);
        assert_eq!(&b.x[..2], &w.x[0].to_le_bytes());
        assert_eq!(b.topk_idx.len(), 5 * 4 * 8);
        assert_eq!(&b.topk_idx[8..16], &w.topk_idx[1].to_le_bytes());
        assert_eq!(b.topk_weights.len(), 5 * 4 * 4);
        assert_eq!((b.x_fp8.len(), b.scales.len()), (5 * 256, 5 * 2 * 4));
        let none = deepep_workload(3, 8, 1, 2, 7, 0).unwrap();
        assert!(none.x_fp8.is_empty() && none.scales.is_empty());
        assert!(
            deepep_workload(1, 8, 3, 2, 7, 0).is_err(),
            "top_k > experts"
        );
    }
}
