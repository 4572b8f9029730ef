//! The host/device ABI of epcomm's kernels, the floor every layer above the device shares: the
//! argument blocks the kernels take by value, the failure record and sequence state they write,
//! the stats words, op names and every number both sides use (a Rust mirror of
//! `kernels/common/abi.cuh`), and the [`KernelFamily`] a transport asks the frontend to load.
//!
//! The header is the single source: `cargo xtask codegen` generates the items of this crate
//! (`abi_generated.rs`) from it, and CI's `cargo xtask codegen --check` fails when the checked-in
//! file is stale. Layouts are checked twice: at compile time (the `bytemuck::Pod` derives refuse
//! padding) and against the device's own `sizeof`/`offsetof` and constant values when a module
//! loads (the ABI probe, [`EXPECTED_PROBE`], run by `epcomm-kernels`).
//!
//! Transports and the CPU proxy depend on this crate, never on the kernel images.

use std::mem::{offset_of, size_of};

include!("abi_generated.rs");

// SAFETY: plain-old-data `repr(C)` structs of integers (Pod, so without padding), passed by
// value as kernel parameters; their layout is checked against the device's at module load.
unsafe impl cudarc::driver::DeviceRepr for OpArgs {}
// SAFETY: as above.
unsafe impl cudarc::driver::DeviceRepr for LayoutArgs {}

/// The module global of a [`KernelFamily::CpuProxy`] image that holds its [`ProxyChannel`]
/// (`kernels/common/net_proxy.cuh`), written by the transport once per buffer.
pub const PROXY_CHANNEL_GLOBAL: &std::ffi::CStr = c"epcomm_proxy_channel";

/// The ABI facts the device reports from `epcomm_abi_probe`, in its output order (what the
/// host expects; a module whose probe differs is refused).
pub const EXPECTED_PROBE: &[(&str, u64)] = &ABI_PROBE;

/// Which kernel image a transport's device runtime works with (a backend declares it in its
/// capabilities; the frontend loads that image: `epcomm_kernels::Image::of`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelFamily {
    /// `intranode.fatbin` (`StoreNet`): plain stores and system-scope atomics through peer
    /// mappings (NVLink P2P / CUDA IPC); the store route only.
    NvlinkStore,
    /// `intranode_nvshmem.cubin` (`NvshmemNet`): device-linked with `libnvshmem_device`; stores
    /// through mappings and NVSHMEM put/signal for the peers whose route bit is set. The loaded
    /// module must be bound to NVSHMEM (`nvshmemx_cumodule_init`) before the first launch.
    NvshmemDevice,
    /// `intranode_proxy.fatbin` (`ProxyNet`): stores through mappings, and descriptors in a CPU
    /// proxy's ring for the peers whose route bit is set. The loaded module's proxy channel
    /// ([`ProxyChannel`]) must be written before the first launch.
    CpuProxy,
}

impl KernelFamily {
    /// Whether a loaded module of this family must be bound to a device channel of the
    /// transport's memory before its first launch (the CPU proxy's ring: `CpuProxy`); a
    /// memory of such a backend that binds none is refused by the frontend.
    pub fn needs_device_channel(self) -> bool {
        matches!(self, Self::CpuProxy)
    }

    /// Whether this family's dispatch sends a token's scales, top-k ids and top-k weights to a
    /// put/signal peer as whole rows read from the caller's arrays (its Net policy's
    /// `kMetadataRows`: `ProxyNet`), which makes those arrays put sources like `x`. `NvshmemNet`
    /// sends them element by element as values (`nvshmem_<type>_p`), reading no caller memory
    /// on the transport's side; `StoreNet` has no put/signal peer.
    pub fn puts_metadata_rows(self) -> bool {
        match self {
            Self::NvlinkStore | Self::NvshmemDevice => false,
            Self::CpuProxy => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_are_the_documented_ones() {
        assert_eq!(size_of::<OpArgs>(), 58 * 8 + 22 * 4);
        assert_eq!(offset_of!(OpArgs, ll_max_tokens), 384);
        assert_eq!(offset_of!(OpArgs, num_tokens), 392);
        assert_eq!(offset_of!(OpArgs, pe_base), 424);
        assert_eq!(offset_of!(OpArgs, global_barriers), 444);
        assert_eq!(offset_of!(OpArgs, off_ll_send_meta), 448);
        assert_eq!(offset_of!(OpArgs, ll_self_row), 456);
        assert_eq!(offset_of!(OpArgs, ll_cumulative_stats), 464);
        assert_eq!(offset_of!(OpArgs, token_node_slot), 472);
        assert_eq!(offset_of!(OpArgs, off_node_counts), 520);
        assert_eq!(offset_of!(OpArgs, gpus_per_node), 528);
        assert_eq!(offset_of!(OpArgs, fwd_blocks), 544);
        assert_eq!(size_of::<LayoutArgs>(), 10 * 8 + 8 * 4);
        assert_eq!(offset_of!(LayoutArgs, in_rank), 56);
        assert_eq!(offset_of!(LayoutArgs, expert_counts), 64);
        assert_eq!(offset_of!(LayoutArgs, num_tokens), 72);
        assert_eq!(offset_of!(LayoutArgs, pe_base), 96);
        assert_eq!(offset_of!(LayoutArgs, token_node_slot), 104);
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

    /// `puts_metadata_rows` mirrors each policy's `kMetadataRows` in `kernels/common/`
    /// (checked where the CUDA sources are: in the repository, not in a packaged crate).
    #[test]
    fn metadata_rows_mirror_the_net_policies() {
        let common = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../kernels/common");
        for (family, file) in [
            (KernelFamily::NvlinkStore, "net.cuh"),
            (KernelFamily::NvshmemDevice, "net_nvshmem.cuh"),
            (KernelFamily::CpuProxy, "net_proxy.cuh"),
        ] {
            let Ok(src) = std::fs::read_to_string(common.join(file)) else {
                eprintln!("skipped: no {file} (not built from the repository)");
                return;
            };
            let line = format!(
                "static constexpr bool kMetadataRows = {};",
                family.puts_metadata_rows()
            );
            assert!(src.contains(&line), "{file} lacks `{line}`");
        }
    }
}
