//! The report's types: what `epcomm doctor` found, as the probes fill it in.
//!
//! Contract: their serde form is the JSON schema of `epcomm doctor --json` (field names and
//! order are the schema: change them only with the schema); the text rendering reads the same
//! fields. The probes that fill each type live beside this module, one per source.

use serde::{Deserialize, Serialize};

use epcomm_backends::TransportSpec;

use crate::gpu::{GpuInfo, PeerLink};

/// Everything `epcomm doctor` reports.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DoctorReport {
    /// epcomm's version.
    pub epcomm_version: String,
    /// The CUDA driver.
    pub driver: DriverReport,
    /// GPUs by ordinal.
    pub gpus: Vec<GpuInfo>,
    /// Peer access per ordered GPU pair.
    pub peer_links: Vec<PeerLink>,
    /// Why peer access could not be queried.
    pub peer_error: Option<String>,
    /// `nvidia-smi topo -m`, when the tool is present.
    pub nvidia_smi_topo: Option<String>,
    /// Every kernel image of the manifest: embedded, found, or missing.
    pub kernels: Vec<KernelImage>,
    /// The NVSHMEM host library.
    pub nvshmem: LibraryReport,
    /// NCCL.
    pub nccl: LibraryReport,
    /// libibverbs.
    pub ibverbs: LibraryReport,
    /// RDMA devices.
    pub rdma: Vec<RdmaDevice>,
    /// Per GPU, the RDMA device with an active port nearest it in the PCI tree (what
    /// `proxy-verbs` takes for that GPU unless `EPCOMM_VERBS_DEVICE` names one, when that
    /// device has a usable GID).
    #[serde(default)]
    pub nearest_rdma: Vec<NearestRdma>,
    /// Relevant environment variables, sorted.
    pub env: Vec<(String, String)>,
    /// Warnings about the environment.
    pub warnings: Vec<String>,
    /// One verdict per transport.
    pub verdicts: Vec<Verdict>,
}

impl DoctorReport {
    /// `Ok` when `spec` can run here: its backend's verdict is usable and its layout fits the
    /// GPUs of this host (e.g. `vnodes=N` divides their count); else why not, as one line.
    ///
    /// # Errors
    /// The reason, prefixed with the spec.
    pub fn requirement(&self, spec: &TransportSpec) -> Result<(), String> {
        let verdict = self
            .verdicts
            .iter()
            .find(|v| v.transport == spec.backend())
            .ok_or_else(|| format!("{spec}: no verdict"))?;
        if !verdict.usable {
            return Err(format!("{spec}: {}", verdict.reason));
        }
        let n = self.gpus.len();
        spec.world_layout(n, 0, n)
            .map(drop)
            .map_err(|e| format!("{spec}: not usable on {n} GPU(s): {e}"))
    }
}

/// The driver section.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DriverReport {
    /// Whether the driver library loads.
    pub present: bool,
    /// CUDA version the driver supports (`13.0`), when it initialised.
    pub cuda_version: Option<String>,
    /// Why it cannot be used, when it cannot.
    pub error: Option<String>,
}

/// One kernel image of the manifest, and where it comes from here.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelImage {
    /// Its name in the manifest (`intranode`).
    pub name: String,
    /// The artifact's file name.
    pub artifact: String,
    /// Whether a Buffer can load it.
    pub available: bool,
    /// `embedded`, the file under `$EPCOMM_KERNEL_DIR`, or why it is missing.
    pub source: String,
}

/// A shared library probe.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LibraryReport {
    /// What was looked for (soname).
    pub library: String,
    /// Whether it loaded.
    pub found: bool,
    /// The file it was loaded from.
    pub path: Option<String>,
    /// Its version, when it tells.
    pub version: Option<String>,
    /// Where it was looked for / why it failed / how to point at it.
    pub detail: Option<String>,
}

/// One RDMA device under `/sys/class/infiniband`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RdmaDevice {
    /// Device name (e.g. `mlx5_0`).
    pub name: String,
    /// Firmware version.
    pub fw_ver: Option<String>,
    /// Ports.
    pub ports: Vec<RdmaPort>,
}

/// The RDMA device nearest one GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NearestRdma {
    /// The GPU's ordinal.
    pub gpu: usize,
    /// Its PCI bus id.
    pub pci_bus_id: String,
    /// The device.
    pub device: String,
    /// PCI hops between the two (`epcomm_topology::pci::hops`); `None` when the device's (or
    /// the GPU's) place in the PCI tree is unknown and the device was taken in enumeration order.
    pub hops: Option<usize>,
}

/// One port of an RDMA device.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RdmaPort {
    /// Port number.
    pub port: u32,
    /// `state` (e.g. `4: ACTIVE`).
    pub state: Option<String>,
    /// `phys_state` (e.g. `5: LinkUp`).
    pub phys_state: Option<String>,
    /// `link_layer` (`InfiniBand` or `Ethernet`).
    pub link_layer: Option<String>,
    /// `rate` (e.g. `400 Gb/sec (4X NDR)`).
    pub rate: Option<String>,
    /// Non-zero GIDs as `index: gid (type)`, at most [`MAX_GIDS`].
    pub gids: Vec<String>,
    /// Non-zero GIDs in all.
    pub gid_count: usize,
}

/// GIDs listed per port.
pub const MAX_GIDS: usize = 16;

/// A transport's verdict.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    /// The backend's spec (`ipc`, `nvshmem`).
    pub transport: String,
    /// Whether `epcomm bench --transport <it>` can run here.
    pub usable: bool,
    /// Why (or why not).
    pub reason: String,
    /// How to fix it, when not usable (or a caution when usable).
    pub fix: Option<String>,
    /// What bounds the backend, from its entry in the library's backend table (whether ranks
    /// may span hosts; its CPU executor's ring and in-flight bounds).
    #[serde(default)]
    pub limits: String,
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::no_driver_report;
    use super::super::verdict::backends;

    #[test]
    fn requirements_follow_the_verdicts() {
        let r = no_driver_report();
        for spec in backends() {
            let err = r.requirement(&spec).unwrap_err();
            assert!(err.contains("no CUDA driver"), "{err}");
        }
    }
}
