//! DeepEP's fp8 cast: e4m3, one f32 scale per token per 128 channels.

use epcomm_topology::{RowDtype, RowFormat};
use float8::F8E4M3;
use half::bf16;

use crate::{RefError, Result};

/// Channels per scale group: [`RowFormat::FP8_BLOCK`], the rule the buffer plans and kernels
/// use.
pub const FP8_GROUP: usize = RowFormat::FP8_BLOCK;
/// Largest finite e4m3 value.
pub const FP8_E4M3_MAX: f32 = 448.0;
/// Lower clamp of a group's absolute maximum (as DeepEP's `per_token_cast_to_fp8`:
/// `amax.clamp(1e-4)`), so an all-zero group gets scale `1e-4 / 448` instead of 0 and
/// dequantizes to exact zeros.
pub const FP8_AMAX_FLOOR: f32 = 1e-4;

/// Quantizes `x` (`[T][hidden]` bf16) to e4m3 with one scale per 128-channel group:
/// `amax = max(max |x| over the group, FP8_AMAX_FLOOR)`, `scale = amax / 448`,
/// `q = e4m3(x * (448 / amax))` (round to nearest even, saturating at ±448).
/// Returns `(data [T][hidden], scales [T][hidden / 128])`; `x ≈ q * scale`.
///
/// Non-finite inputs give non-finite scales (no error; the GPU cast behaves the same way).
///
/// # Errors
/// `hidden` a valid FP8 row ([`RowFormat::new`]: `hidden > 0`, `hidden % 128 == 0`, as
/// [`RefError::Row`]), `x.len() % hidden == 0`.
pub fn quantize_fp8_e4m3_per128(x: &[bf16], hidden: usize) -> Result<(Vec<F8E4M3>, Vec<f32>)> {
    quantize_groups(x, hidden, |amax| (FP8_E4M3_MAX / amax, amax / FP8_E4M3_MAX))
}

/// Casts every 128-channel group of `x` with `(multiplier, scale) = cast(amax)`, where `amax`
/// is the group's largest magnitude clamped to [`FP8_AMAX_FLOOR`].
fn quantize_groups(
    x: &[bf16],
    hidden: usize,
    cast: impl Fn(f32) -> (f32, f32),
) -> Result<(Vec<F8E4M3>, Vec<f32>)> {
    let row = fp8_row(hidden)?;
    RefError::multiple_check("x.len()", x.len(), "hidden", hidden)?;
    let groups = x.len() / hidden * row.num_scales();
    let mut data = Vec::with_capacity(x.len());
    let mut scales = Vec::with_capacity(groups);
    for group in x.chunks_exact(FP8_GROUP) {
        let amax = group
            .iter()
            .map(|v| v.to_f32().abs())
            .fold(0.0f32, f32::max)
            .max(FP8_AMAX_FLOOR);
        let (mul, scale) = cast(amax);
        data.extend(group.iter().map(|v| F8E4M3::from_f32(v.to_f32() * mul)));
        scales.push(scale);
    }
    Ok((data, scales))
}

/// [`quantize_fp8_e4m3_per128`] with the scales rounded up to powers of two (UE8M0
/// scales): `scale = 2^ceil(log2(amax / 448))` (exact: the f32 `amax / 448` with its mantissa
/// cleared and the exponent raised when the mantissa was not zero), `q = e4m3(x * (1 / scale))`.
///
/// # Errors
/// As [`quantize_fp8_e4m3_per128`].
pub fn quantize_fp8_e4m3_per128_ue8m0(
    x: &[bf16],
    hidden: usize,
) -> Result<(Vec<F8E4M3>, Vec<f32>)> {
    quantize_groups(x, hidden, |amax| {
        let scale = pow2_ceil(amax / FP8_E4M3_MAX);
        (1.0 / scale, scale)
    })
}

/// The smallest power of two `>= x`, for a positive normal `x` (bit-exact, no `log2`).
fn pow2_ceil(x: f32) -> f32 {
    let b = x.to_bits();
    if b & 0x7f_ffff == 0 {
        x
    } else {
        f32::from_bits((b & 0xff80_0000) + 0x80_0000)
    }
}

/// Inverse of [`quantize_fp8_e4m3_per128`]: `x[t][c] = f32(data[t][c]) * scales[t][c / 128]`.
///
/// # Errors
/// `hidden` a valid FP8 row (as [`quantize_fp8_e4m3_per128`]), `data.len() % hidden == 0`,
/// `scales.len() == data.len() / 128`.
pub fn dequantize_fp8_e4m3_per128(
    data: &[F8E4M3],
    scales: &[f32],
    hidden: usize,
) -> Result<Vec<f32>> {
    let row = fp8_row(hidden)?;
    RefError::multiple_check("data.len()", data.len(), "hidden", hidden)?;
    RefError::len_check(
        "scales",
        scales.len(),
        data.len() / hidden * row.num_scales(),
        "data.len() / 128",
    )?;
    Ok(data
        .chunks_exact(FP8_GROUP)
        .zip(scales)
        .flat_map(|(g, &s)| g.iter().map(move |q| q.to_f32() * s))
        .collect())
}

/// The format of one FP8 row of `hidden` values (its scales per row).
pub(crate) fn fp8_row(hidden: usize) -> Result<RowFormat> {
    Ok(RowFormat::new(hidden, RowDtype::Fp8)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ue8m0_scales_are_powers_of_two_at_least_the_plain_scale() {
        let x: Vec<bf16> = (0..256)
            .map(|i| bf16::from_f32(i as f32 * 0.37 - 40.0))
            .collect();
        let (_, plain) = quantize_fp8_e4m3_per128(&x, 256).unwrap();
        let (q, pow2) = quantize_fp8_e4m3_per128_ue8m0(&x, 256).unwrap();
        for (p, s) in plain.iter().zip(&pow2) {
            assert_eq!(s.to_bits() & 0x7f_ffff, 0, "{s} is not a power of two");
            assert!(s >= p && *s < 2.0 * p, "{s} vs {p}");
        }
        // Dequantized values stay within one e4m3 step of the input.
        let back = dequantize_fp8_e4m3_per128(&q, &pow2, 256).unwrap();
        for (a, b) in x.iter().zip(back) {
            assert!(
                (a.to_f32() - b).abs() <= a.to_f32().abs() / 8.0 + pow2[0],
                "{a} {b}"
            );
        }
        assert_eq!(pow2_ceil(0.25), 0.25);
        assert_eq!(pow2_ceil(0.3), 0.5);
    }
    use epcomm_topology::TopologyError;
    use proptest::prelude::*;

    #[test]
    fn exact_values_roundtrip() {
        // amax 448 -> scale 1; small integers are exact in e4m3.
        let mut x = vec![bf16::ZERO; 256];
        x[0] = bf16::from_f32(448.0);
        x[1] = bf16::from_f32(-3.0);
        x[2] = bf16::from_f32(0.5);
        x[128] = bf16::from_f32(8.0); // second group: scale 8/448
        let (q, s) = quantize_fp8_e4m3_per128(&x, 128).unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(s[0], 1.0);
        assert_eq!(s[1], 8.0 / 448.0);
        let y = dequantize_fp8_e4m3_per128(&q, &s, 128).unwrap();
        assert_eq!(y[0], 448.0);
        assert_eq!(y[1], -3.0);
        assert_eq!(y[2], 0.5);
        assert!((y[128] - 8.0).abs() < 1e-5);
        assert_eq!(y[3], 0.0);
    }

    #[test]
    fn zero_group_uses_floor() {
        let x = vec![bf16::ZERO; 128];
        let (q, s) = quantize_fp8_e4m3_per128(&x, 128).unwrap();
        assert_eq!(s, vec![FP8_AMAX_FLOOR / FP8_E4M3_MAX]);
        assert!(q.iter().all(|v| v.to_f32() == 0.0));
    }

    #[test]
    fn errors() {
        let x = vec![bf16::ONE; 256];
        assert!(matches!(
            quantize_fp8_e4m3_per128(&x, 0),
            Err(RefError::Row(TopologyError::Zero { arg: "hidden" }))
        ));
        assert!(matches!(
            quantize_fp8_e4m3_per128(&x, 64),
            Err(RefError::Row(TopologyError::NotMultiple {
                arg: "hidden",
                ..
            }))
        ));
        assert!(matches!(
            quantize_fp8_e4m3_per128(&x[..200], 128),
            Err(RefError::NotMultiple { arg: "x.len()", .. })
        ));
        let (q, s) = quantize_fp8_e4m3_per128(&x, 128).unwrap();
        assert!(matches!(
            dequantize_fp8_e4m3_per128(&q, &s[..1], 128),
            Err(RefError::Length { arg: "scales", .. })
        ));
        assert!(matches!(
            dequantize_fp8_e4m3_per128(&q[..100], &s, 128),
            Err(RefError::NotMultiple {
                arg: "data.len()",
                ..
            })
        ));
    }

    proptest! {
        /// e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values; below the
        /// smallest normal (2^-6 in the scaled domain) the absolute error is <= half a
        /// subnormal step, 2^-10, times the scale.
        #[test]
        fn roundtrip_error_bound(
            vals in proptest::collection::vec(-1000.0f32..1000.0, 256),
            exp in -20i32..20,
        ) {
            let factor = 2f32.powi(exp);
            let x: Vec<bf16> = vals.iter().map(|v| bf16::from_f32(v * factor)).collect();
            let (q, s) = quantize_fp8_e4m3_per128(&x, 256).unwrap();
            let y = dequantize_fp8_e4m3_per128(&q, &s, 256).unwrap();
            for (i, (a, b)) in x.iter().zip(&y).enumerate() {
                let a = a.to_f32();
                let scale = s[i / 128];
                let bound = (a.abs() / 16.0).max(scale * 2f32.powi(-10)) * (1.0 + 1e-5);
                prop_assert!((a - b).abs() <= bound, "x={a} y={b} scale={scale}");
            }
            for (g, sc) in s.iter().enumerate() {
                let amax = x[g * 128..(g + 1) * 128]
                    .iter()
                    .map(|v| v.to_f32().abs())
                    .fold(0.0, f32::max)
                    .max(FP8_AMAX_FLOOR);
                prop_assert_eq!(*sc, amax / 448.0);
            }
        }
    }
}
