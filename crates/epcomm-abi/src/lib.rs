//! Rust mirror of `kernels/common/abi.cuh`: the argument blocks the kernels take by value, the
//! failure record and sequence state they write, and every number the two sides share.
//!
//! The header is the single source: `cargo xtask codegen` generates the items of this module
//! (`abi_generated.rs`) from it, and CI's `cargo xtask codegen --check` fails when the checked-in
//! file is stale. Layouts are checked twice: at compile time (the `bytemuck::Pod` derives refuse
//! padding) and against the device's own `sizeof`/`offsetof` and constant values when a module
//! loads (the ABI probe, [`crate::IntranodeKernels::load`]).

use std::mem::{offset_of, size_of};

include!("abi_generated.rs");

// SAFETY: plain-old-data `repr(C)` structs of integers (Pod, so without padding), passed by
// value as kernel parameters; their layout is checked against the device's at module load.
unsafe impl cudarc::driver::DeviceRepr for OpArgs {}
// SAFETY: as above.
unsafe impl cudarc::driver::DeviceRepr for LayoutArgs {}

/// The ABI facts the device reports from `epcomm_abi_probe`, in its output order.
pub(crate) const EXPECTED_PROBE: &[(&str, u64)] = &ABI_PROBE;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_are_the_documented_ones() {
        assert_eq!(size_of::<OpArgs>(), 49 * 8 + 16 * 4);
        assert_eq!(offset_of!(OpArgs, ll_max_tokens), 384);
        assert_eq!(offset_of!(OpArgs, num_tokens), 392);
        assert_eq!(offset_of!(OpArgs, pe_base), 424);
        assert_eq!(offset_of!(OpArgs, global_barriers), 444);
        assert_eq!(offset_of!(OpArgs, off_ll_meta_stage), 448);
        assert_eq!(size_of::<LayoutArgs>(), 7 * 8 + 8 * 4);
        assert_eq!(offset_of!(LayoutArgs, num_tokens), 56);
        assert_eq!(offset_of!(LayoutArgs, pe_base), 80);
        assert_eq!(size_of::<ErrorRecord>(), 56);
        assert_eq!(offset_of!(ErrorRecord, epoch), 24);
        assert_eq!(size_of::<SeqState>(), 72);
    }

    #[test]
    fn probe_names_are_unique_and_cover_every_struct() {
        let mut names: Vec<&str> = EXPECTED_PROBE.iter().map(|(n, _)| *n).collect();
        for s in ["OpArgs", "LayoutArgs", "ErrorRecord", "SeqState"] {
            assert!(names.contains(&format!("sizeof({s})").as_str()), "{s}");
        }
        assert!(names.contains(&"kAbiVersion") && names.contains(&"kStatsAbortOffset"));
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), EXPECTED_PROBE.len());
    }
}
