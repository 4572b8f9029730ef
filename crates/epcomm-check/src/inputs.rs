//! Deterministic workloads, on the host for every rank and on the device for this rank.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use epcomm_reference::{RankInput, XData, bf16, gen_deepep_workload, mask_topk, skewed_topk};

use crate::Result;

/// A test or benchmark shape.
#[derive(Clone, Debug, PartialEq)]
pub struct Shape {
    /// Tokens of each rank (len = world); may differ per rank, may be 0.
    pub tokens: Vec<usize>,
    /// Elements per row.
    pub hidden: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Experts in total.
    pub experts: usize,
    /// Probability that a top-k entry is replaced by -1.
    pub mask_prob: f64,
    /// Route every token only to this rank's experts.
    pub skew_to: Option<usize>,
    /// Seed (rank r uses seed + r).
    pub seed: u64,
}

impl Shape {
    /// DeepEP's workload with `tokens` on every one of `world` ranks.
    pub fn uniform(
        world: usize,
        tokens: usize,
        hidden: usize,
        top_k: usize,
        experts: usize,
        seed: u64,
    ) -> Self {
        Self {
            tokens: vec![tokens; world],
            hidden,
            top_k,
            experts,
            mask_prob: 0.0,
            skew_to: None,
            seed,
        }
    }

    /// Whether FP8 (hidden % 128 == 0) is possible.
    pub fn fp8_capable(&self) -> bool {
        self.hidden.is_multiple_of(128)
    }
}

/// Every rank's inputs, bf16 and (when possible) FP8.
#[derive(Clone, Debug)]
pub struct HostInputs {
    /// bf16 inputs per rank.
    pub bf16: Vec<RankInput>,
    /// FP8 inputs per rank (same top-k), empty when hidden % 128 != 0.
    pub fp8: Vec<RankInput>,
}

/// Generates every rank's inputs for `shape`.
pub fn host_inputs(shape: &Shape) -> Result<HostInputs> {
    let world = shape.tokens.len();
    let mut bf16 = Vec::with_capacity(world);
    let mut fp8 = Vec::new();
    for (r, &t) in shape.tokens.iter().enumerate() {
        let seed = shape.seed.wrapping_add(r as u64 * 7919);
        let mut w = gen_deepep_workload(t, shape.hidden, shape.top_k, shape.experts, seed)?;
        if let Some(hot) = shape.skew_to {
            w.topk_idx = skewed_topk(t, shape.top_k, shape.experts, world, hot, seed ^ 0x5eed)?;
        }
        if shape.mask_prob > 0.0 {
            mask_topk(&mut w.topk_idx, shape.mask_prob, seed ^ 0xbad)?;
        }
        if shape.fp8_capable() {
            fp8.push(w.to_rank_input_fp8()?);
        }
        bf16.push(w.to_rank_input());
    }
    Ok(HostInputs { bf16, fp8 })
}

/// This rank's inputs on the device.
#[derive(Debug)]
pub struct DeviceInputs {
    /// Tokens.
    pub num_tokens: usize,
    /// bf16 rows.
    pub x: CudaSlice<bf16>,
    /// FP8 rows (e4m3 bytes), empty when not FP8-capable.
    pub x_fp8: CudaSlice<u8>,
    /// FP8 scales.
    pub scales: CudaSlice<f32>,
    /// `x` with every element's sign flipped (`-x`, bit for bit): rows a cached dispatch sends,
    /// so that rows of an earlier dispatch left in place cannot pass for them.
    pub x_neg: CudaSlice<bf16>,
    /// `x_fp8` with every element's sign flipped (the same scales).
    pub x_fp8_neg: CudaSlice<u8>,
    /// Top-k ids.
    pub topk_idx: CudaSlice<i64>,
    /// Top-k weights.
    pub topk_weights: CudaSlice<f32>,
}

impl DeviceInputs {
    /// A dispatch input of these tokens: FP8 or BF16 rows, with or without the top-k weights.
    pub fn dispatch_input(&self, fp8: bool, weights: bool) -> epcomm::DispatchInput<'_> {
        epcomm::DispatchInput {
            x: self.x_input(fp8),
            topk_idx: &self.topk_idx,
            topk_weights: weights.then_some(&self.topk_weights as _),
        }
    }

    /// Dispatches these tokens (BF16, weights as `weights` says) along `layout` into the
    /// worst-case receive rows of `buf` (flat or two-tier) and keeps only the routing: the
    /// handle a test then combines or dispatches along. Collective, as the dispatch.
    pub fn worst_case_handle<E: epcomm::ExpertParallel>(
        &self,
        buf: &mut E,
        layout: &epcomm::Layout,
        weights: bool,
    ) -> epcomm::Result<epcomm::Handle> {
        let input = self.dispatch_input(false, weights);
        Ok(buf
            .dispatch(&input, layout, epcomm::RecvMode::WorstCase)?
            .into_handle())
    }

    /// The token rows as a dispatch input: FP8 (with scales) or BF16.
    pub fn x_input(&self, fp8: bool) -> epcomm::XInput<'_> {
        self.rows(fp8, false)
    }

    /// [`Self::x_input`] with every element's sign flipped ([`Self::x_neg`]).
    pub fn x_neg_input(&self, fp8: bool) -> epcomm::XInput<'_> {
        self.rows(fp8, true)
    }

    fn rows(&self, fp8: bool, neg: bool) -> epcomm::XInput<'_> {
        match (fp8, neg) {
            (true, neg) => epcomm::XInput::Fp8 {
                x: if neg { &self.x_fp8_neg } else { &self.x_fp8 },
                scales: &self.scales,
            },
            (false, false) => epcomm::XInput::Bf16(&self.x),
            (false, true) => epcomm::XInput::Bf16(&self.x_neg),
        }
    }
}

/// The sign bit of a bf16 element.
pub const BF16_SIGN: u16 = 0x8000;
/// The sign bit of an e4m3 element.
pub const FP8_SIGN: u8 = 0x80;

/// Copies `data` to a new device slice (a null slice when empty).
pub fn upload<T: cudarc::driver::DeviceRepr + Copy>(
    stream: &Arc<CudaStream>,
    data: &[T],
) -> Result<CudaSlice<T>> {
    if data.is_empty() {
        return Ok(stream.null()?);
    }
    Ok(stream.clone_htod(data)?)
}

/// Uploads rank `rank`'s inputs.
pub fn device_inputs(
    stream: &Arc<CudaStream>,
    inputs: &HostInputs,
    rank: usize,
) -> Result<DeviceInputs> {
    let b = &inputs.bf16[rank];
    let XData::Bf16(x) = &b.x else {
        return Err(crate::CheckError::Other("bf16 input expected".into()));
    };
    let (x_fp8, x_fp8_neg, scales) = match inputs.fp8.get(rank).map(|i| &i.x) {
        Some(XData::Fp8 { data, scales }) => {
            let bytes: Vec<u8> = data.iter().map(|v| v.to_bits()).collect();
            let neg: Vec<u8> = bytes.iter().map(|&b| b ^ FP8_SIGN).collect();
            (
                upload(stream, &bytes)?,
                upload(stream, &neg)?,
                upload(stream, scales)?,
            )
        }
        _ => (stream.null()?, stream.null()?, stream.null()?),
    };
    let x_neg: Vec<bf16> = x
        .iter()
        .map(|v| bf16::from_bits(v.to_bits() ^ BF16_SIGN))
        .collect();
    Ok(DeviceInputs {
        num_tokens: b.num_tokens,
        x: upload(stream, x)?,
        x_fp8,
        scales,
        x_neg: upload(stream, &x_neg)?,
        x_fp8_neg,
        topk_idx: upload(stream, &b.topk_idx)?,
        topk_weights: upload(stream, &b.topk_weights)?,
    })
}
