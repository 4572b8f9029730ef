//! The format of one token row: bytes, FP8 scales, pitch and alignment for a hidden size and an
//! element type, computed in one place for validation, buffer plans, kernel arguments and the
//! reference.

use crate::{Result, TopologyError};

/// The element type of a token row as it travels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RowDtype {
    /// `hidden` bf16 values.
    Bf16,
    /// `hidden` FP8 (e4m3) values plus one f32 scale per [`RowFormat::FP8_BLOCK`] values.
    Fp8,
}

impl RowDtype {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Bf16 => "bf16",
            Self::Fp8 => "fp8",
        }
    }
}

/// The format of one token row of `hidden` values of one [`RowDtype`].
///
/// Rules: `hidden > 0` and `hidden % 8 == 0` (rows move in 16-byte vectors: 8 bf16 values);
/// FP8 rows also need `hidden % 128 == 0` (one scale per 128 values). Rows in a region are
/// [`pitch`](Self::pitch) bytes apart and start [`ALIGN`](Self::ALIGN)-aligned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RowFormat {
    hidden: usize,
    dtype: RowDtype,
}

impl RowFormat {
    /// Bytes of one vector access; row starts and caller pointers must be aligned to it.
    pub const ALIGN: usize = 16;
    /// Values per FP8 scale.
    pub const FP8_BLOCK: usize = 128;
    /// Bytes of one FP8 scale (f32).
    pub const SCALE_BYTES: usize = 4;

    /// The format of `hidden`-wide rows of `dtype`.
    ///
    /// # Errors
    /// [`TopologyError::Zero`] or [`TopologyError::NotMultiple`] naming `hidden` when a rule
    /// above is broken.
    pub fn new(hidden: usize, dtype: RowDtype) -> Result<Self> {
        TopologyError::zero_check("hidden", hidden)?;
        TopologyError::multiple_check("hidden", hidden, "8 (bf16 16-byte vectors)", 8)?;
        if dtype == RowDtype::Fp8 {
            TopologyError::multiple_check(
                "hidden",
                hidden,
                "128 (one FP8 scale per 128 values)",
                Self::FP8_BLOCK,
            )?;
        }
        Ok(Self { hidden, dtype })
    }

    /// Whether `hidden` admits FP8 rows.
    pub fn fp8_capable(hidden: usize) -> bool {
        Self::new(hidden, RowDtype::Fp8).is_ok()
    }

    /// Values per row.
    pub fn hidden(&self) -> usize {
        self.hidden
    }

    /// The element type.
    pub fn dtype(&self) -> RowDtype {
        self.dtype
    }

    /// Bytes of one value.
    pub fn value_bytes(&self) -> usize {
        match self.dtype {
            RowDtype::Bf16 => 2,
            RowDtype::Fp8 => 1,
        }
    }

    /// Bytes of the values of one row (scales not included).
    pub fn x_bytes(&self) -> usize {
        self.hidden * self.value_bytes()
    }

    /// FP8 scales per row (0 for BF16).
    pub fn num_scales(&self) -> usize {
        match self.dtype {
            RowDtype::Bf16 => 0,
            RowDtype::Fp8 => self.hidden / Self::FP8_BLOCK,
        }
    }

    /// Bytes of the scales of one row (0 for BF16).
    pub fn scale_bytes(&self) -> usize {
        self.num_scales() * Self::SCALE_BYTES
    }

    /// Distance between two rows in a receive region: the widest format of this hidden size
    /// (BF16), so one region holds either type.
    pub fn pitch(&self) -> usize {
        self.hidden * 2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_of_both_types() {
        let bf16 = RowFormat::new(7168, RowDtype::Bf16).unwrap();
        assert_eq!(
            (bf16.x_bytes(), bf16.num_scales(), bf16.scale_bytes()),
            (14336, 0, 0)
        );
        let fp8 = RowFormat::new(7168, RowDtype::Fp8).unwrap();
        assert_eq!(
            (fp8.x_bytes(), fp8.num_scales(), fp8.scale_bytes()),
            (7168, 56, 224)
        );
        assert_eq!(fp8.pitch(), bf16.pitch());
        assert!(RowFormat::fp8_capable(256));
        assert!(!RowFormat::fp8_capable(264));
    }

    #[test]
    fn rules_name_hidden() {
        for (hidden, dtype, rule) in [
            (0, RowDtype::Bf16, "> 0"),
            (12, RowDtype::Bf16, "16-byte"),
            (264, RowDtype::Fp8, "FP8 scale"),
        ] {
            let err = RowFormat::new(hidden, dtype).unwrap_err().to_string();
            assert!(err.contains("hidden") && err.contains(rule), "{err}");
        }
    }
}
