//! What the CUDA driver says about this machine: driver version, GPUs, peer access.
//!
//! Every driver call goes through cudarc's dynamically loaded driver API, only after
//! [`cudarc::driver::sys::is_culib_present`] said the library loads (cudarc panics otherwise),
//! and inside [`guarded`], which turns a panic (e.g. a symbol an old driver lacks) into an
//! error instead of aborting the report.

use std::ffi::{CStr, c_char, c_int};

use cudarc::driver::{result, sys};
use serde::{Deserialize, Serialize};

/// Why the driver cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum NoDriver {
    /// `libcuda.so` does not load.
    #[error(
        "no CUDA driver: the driver library (libcuda.so.1) is not found by the dynamic loader \
         (install the NVIDIA driver; in a container, start it with the GPU runtime enabled)"
    )]
    Missing,
    /// The library loads but a call failed.
    #[error("the CUDA driver failed to initialise: {0}")]
    Init(String),
    /// It works but shows no device.
    #[error(
        "the CUDA driver reports no GPU (check CUDA_VISIBLE_DEVICES and that the GPUs are not \
         hidden from this process)"
    )]
    NoDevice,
}

impl NoDriver {
    /// Short form used in verdicts.
    pub fn short(&self) -> String {
        match self {
            Self::Missing => "no CUDA driver".into(),
            Self::Init(e) => format!("the CUDA driver failed to initialise ({e})"),
            Self::NoDevice => "no GPU visible to the CUDA driver".into(),
        }
    }
}

/// One GPU as the driver sees it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuInfo {
    /// Driver ordinal (after CUDA_VISIBLE_DEVICES).
    pub ordinal: usize,
    /// Marketing name.
    pub name: String,
    /// Streaming multiprocessors.
    pub sms: u32,
    /// Total memory in bytes.
    pub memory_bytes: u64,
    /// Compute capability (major, minor).
    pub compute_capability: (u32, u32),
    /// PCI bus id, when the driver tells it.
    pub pci_bus_id: Option<String>,
    /// Whether contexts on it are shared through MPS (`CU_DEVICE_ATTRIBUTE_MPS_ENABLED`):
    /// processes on it then run at the same time instead of taking turns.
    #[serde(default)]
    pub mps: bool,
}

/// Peer access from one GPU to another.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PeerLink {
    /// Source ordinal.
    pub from: usize,
    /// Destination ordinal.
    pub to: usize,
    /// `cuDeviceCanAccessPeer`.
    pub can_access_peer: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED`: native atomics over the link, which
    /// NVLink provides and PCIe peer access does not.
    pub native_atomics: Option<bool>,
    /// `CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK` (relative; lower is better).
    pub performance_rank: Option<i32>,
}

impl PeerLink {
    /// The link kind as far as the driver's attributes tell it.
    pub fn kind(&self) -> &'static str {
        match (self.can_access_peer, self.native_atomics) {
            (false, _) => "no P2P",
            (true, Some(true)) => "NVLink",
            (true, Some(false)) => "PCIe P2P",
            (true, None) => "P2P",
        }
    }
}

/// Everything the driver reported.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DriverFacts {
    /// `cuDriverGetVersion` (e.g. 13000 for CUDA 13.0).
    pub version: i32,
    /// The GPUs, by ordinal.
    pub gpus: Vec<GpuInfo>,
}

impl DriverFacts {
    /// The driver's CUDA version as `major.minor`.
    pub fn version_string(&self) -> String {
        cuda_version_string(self.version)
    }
}

/// `13000` → `13.0`, `12080` → `12.8`.
pub fn cuda_version_string(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// Runs `f`, turning a panic into an error (with the default panic message silenced).
pub fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    // The panic hook is process-global: one guarded section at a time.
    static HOOK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = HOOK.lock().unwrap_or_else(|e| e.into_inner());
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    std::panic::set_hook(hook);
    match out {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(format!("{what}: {msg}"))
        }
    }
}

/// Whether the driver library loads (no other driver call is made before this is true).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library by its usual names; no preconditions.
    unsafe { sys::is_culib_present() }
}

/// Queries the driver: version and every visible GPU.
///
/// # Errors
/// [`NoDriver`] when the library is missing, fails to initialise or shows no device.
pub fn probe() -> Result<DriverFacts, NoDriver> {
    if !driver_present() {
        return Err(NoDriver::Missing);
    }
    guarded("querying the CUDA driver", || {
        result::init().map_err(|e| e.to_string())?;
        let mut version: c_int = 0;
        // SAFETY: writes one int through a pointer to a live local.
        unsafe { sys::cuDriverGetVersion(&mut version) }
            .result()
            .map_err(|e| e.to_string())?;
        let count = result::device::get_count().map_err(|e| e.to_string())?;
        let mut gpus = Vec::new();
        for ordinal in 0..count.max(0) {
            gpus.push(gpu_info(ordinal).map_err(|e| format!("GPU {ordinal}: {e}"))?);
        }
        Ok(DriverFacts { version, gpus })
    })
    .map_err(NoDriver::Init)
    .and_then(|f| {
        if f.gpus.is_empty() {
            Err(NoDriver::NoDevice)
        } else {
            Ok(f)
        }
    })
}

fn attribute(dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> Result<i32, String> {
    // SAFETY: `dev` came from cuDeviceGet after cuInit; the attribute is a valid enum value.
    unsafe { result::device::get_attribute(dev, attr) }.map_err(|e| e.to_string())
}

fn gpu_info(ordinal: c_int) -> Result<GpuInfo, String> {
    use sys::CUdevice_attribute as A;
    let dev = result::device::get(ordinal).map_err(|e| e.to_string())?;
    let name = result::device::get_name(dev).map_err(|e| e.to_string())?;
    let sms = attribute(dev, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
    let major = attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attribute(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    let mps = attribute(dev, A::CU_DEVICE_ATTRIBUTE_MPS_ENABLED).is_ok_and(|v| v != 0);
    // SAFETY: `dev` is a valid device handle (cuDeviceGet after cuInit).
    let memory = unsafe { result::device::total_mem(dev) }.map_err(|e| e.to_string())?;
    let mut bus = [0 as c_char; 32];
    // SAFETY: the driver writes at most `len` bytes, NUL-terminated, into the live buffer.
    let pci_bus_id = unsafe { sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as c_int, dev) }
        .result()
        .ok()
        .and_then(|()| {
            // SAFETY: the buffer is NUL-terminated by the driver (and zero-initialised, so a
            // NUL exists within it either way).
            unsafe { CStr::from_ptr(bus.as_ptr()) }
                .to_str()
                .ok()
                .map(str::to_string)
        });
    Ok(GpuInfo {
        ordinal: ordinal as usize,
        name,
        sms: u32::try_from(sms).unwrap_or(0),
        memory_bytes: memory as u64,
        compute_capability: (
            u32::try_from(major).unwrap_or(0),
            u32::try_from(minor).unwrap_or(0),
        ),
        pci_bus_id,
        mps,
    })
}

/// Peer access between every ordered pair of GPUs.
///
/// # Errors
/// A message when the driver fails (or panics).
pub fn peer_links(gpus: &[GpuInfo]) -> Result<Vec<PeerLink>, String> {
    guarded("querying peer access", || {
        let mut out = Vec::new();
        for a in gpus {
            for b in gpus {
                if a.ordinal == b.ordinal {
                    continue;
                }
                out.push(peer_link(a.ordinal, b.ordinal)?);
            }
        }
        Ok(out)
    })
}

fn peer_link(from: usize, to: usize) -> Result<PeerLink, String> {
    let src = result::device::get(from as c_int).map_err(|e| e.to_string())?;
    let dst = result::device::get(to as c_int).map_err(|e| e.to_string())?;
    let mut can: c_int = 0;
    // SAFETY: both handles are valid devices; writes one int to a live local.
    unsafe { sys::cuDeviceCanAccessPeer(&mut can, src, dst) }
        .result()
        .map_err(|e| e.to_string())?;
    let p2p = |attr| {
        let mut v: c_int = 0;
        // SAFETY: valid devices and attribute; writes one int to a live local.
        unsafe { sys::cuDeviceGetP2PAttribute(&mut v, attr, src, dst) }
            .result()
            .ok()
            .map(|()| v)
    };
    use sys::CUdevice_P2PAttribute as P;
    Ok(PeerLink {
        from,
        to,
        can_access_peer: can != 0,
        native_atomics: p2p(P::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED).map(|v| v != 0),
        performance_rank: p2p(P::CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK),
    })
}

/// Whether this context runs under MPS (`CU_DEVICE_ATTRIBUTE_MPS_ENABLED`; false where the
/// driver does not know the attribute).
pub(crate) fn under_mps(ctx: &cudarc::driver::CudaContext) -> bool {
    ctx.attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MPS_ENABLED)
        .is_ok_and(|v| v != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_and_link_kinds() {
        assert_eq!(cuda_version_string(13000), "13.0");
        assert_eq!(cuda_version_string(12080), "12.8");
        let mut l = PeerLink {
            from: 0,
            to: 1,
            can_access_peer: true,
            native_atomics: Some(true),
            performance_rank: Some(0),
        };
        assert_eq!(l.kind(), "NVLink");
        l.native_atomics = Some(false);
        assert_eq!(l.kind(), "PCIe P2P");
        l.can_access_peer = false;
        assert_eq!(l.kind(), "no P2P");
    }

    #[test]
    fn guarded_turns_panics_into_errors() {
        let r: Result<(), String> = guarded("probing", || panic!("symbol missing"));
        assert_eq!(r.unwrap_err(), "probing: symbol missing");
        assert_eq!(guarded("x", || Ok(3)), Ok(3));
    }

    #[test]
    fn probe_never_panics() {
        // On a machine without a driver this is `Missing`; with one, facts or an error.
        match probe() {
            Ok(f) => assert!(!f.gpus.is_empty()),
            Err(e) => assert!(!e.to_string().is_empty()),
        }
    }
}
