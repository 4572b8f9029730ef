//! Checks of caller pointers before a launch: the kernels move rows with 16-byte vector
//! loads and stores, and a misaligned or foreign address would fault on the device, which
//! leaves the CUDA context unusable (a sticky error) for the whole process.

use super::driver::device_of;
use epcomm_topology::RowFormat;

use crate::{Error, Result};

/// Alignment of row data (`x`, `y`, `out`): the kernels use 16-byte vectors.
pub(super) const ROW_ALIGN: u64 = RowFormat::ALIGN as u64;

/// Fails with [`Error::InvalidArgument`] naming `argument` unless `ptr` is `align`-aligned
/// device memory of device `ordinal`. Empty arrays (`bytes == 0`) are never dereferenced and
/// pass, and so do absent optional arrays (`ptr == 0`: the kernel reads nothing there).
pub(super) fn check_device_ptr(
    argument: &'static str,
    ptr: u64,
    bytes: usize,
    align: u64,
    ordinal: usize,
) -> Result<()> {
    if bytes == 0 || ptr == 0 {
        return Ok(());
    }
    if !ptr.is_multiple_of(align) {
        return Err(Error::InvalidArgument {
            argument,
            rule: format!(
                "must start on a {align}-byte boundary (address {ptr:#x} is {} bytes past one)",
                ptr % align
            ),
        });
    }
    let device = device_of(ptr).map_err(|r| Error::InvalidArgument {
        argument,
        rule: format!("address {ptr:#x} is not memory the CUDA driver knows ({r:?})"),
    })?;
    if device != ordinal as i32 {
        return Err(Error::InvalidArgument {
            argument,
            rule: format!(
                "lives on GPU {device}, but this Buffer runs on GPU {ordinal}: copy it first"
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn misaligned_addresses_are_refused_before_any_driver_call() {
        let e = check_device_ptr("x", 0x1000_0002, 64, ROW_ALIGN, 0).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument { argument: "x", rule } if rule.contains("16-byte") && rule.contains("2 bytes past")),
            "{e}"
        );
        // Empty arrays are never read.
        check_device_ptr("x", 0x3, 0, ROW_ALIGN, 0).unwrap();
    }
}
