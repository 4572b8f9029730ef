//! The GPUs and the CUDA driver: the driver section of the report, peer access between GPUs,
//! and `nvidia-smi topo -m`.
//!
//! Contract: the driver is asked once ([`crate::gpu::probe`]); peer access and `nvidia-smi`
//! are asked only with more than one GPU, and `nvidia-smi` is extra detail: nothing is decided
//! from it.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::report::DriverReport;
use crate::gpu::{self, DriverFacts, GpuInfo, NoDriver, PeerLink};

impl DriverReport {
    /// The driver section and the GPUs, from what the driver answered.
    pub fn from_facts(facts: &Result<DriverFacts, NoDriver>) -> (Self, Vec<GpuInfo>) {
        match facts {
            Ok(f) => (
                Self {
                    present: true,
                    cuda_version: Some(f.version_string()),
                    error: None,
                },
                f.gpus.clone(),
            ),
            Err(e) => (
                Self {
                    present: !matches!(e, NoDriver::Missing),
                    cuda_version: None,
                    error: Some(e.to_string()),
                },
                Vec::new(),
            ),
        }
    }
}

/// Peer access per ordered pair of GPUs; empty with fewer than two GPUs or no driver.
///
/// # Errors
/// Why peer access could not be queried.
pub fn peer_links(facts: &Result<DriverFacts, NoDriver>) -> Result<Vec<PeerLink>, String> {
    match facts {
        Ok(f) if f.gpus.len() > 1 => gpu::peer_links(&f.gpus),
        _ => Ok(Vec::new()),
    }
}

/// Warnings about peer links: P2P without native atomics.
pub fn link_warnings(links: &[PeerLink]) -> Vec<String> {
    links
        .iter()
        .filter(|l| l.can_access_peer && l.native_atomics == Some(false))
        .map(|l| {
            format!(
                "GPU {} -> GPU {}: P2P without native atomics (PCIe, not NVLink)",
                l.from, l.to
            )
        })
        .collect()
}

/// `nvidia-smi topo -m`, when there is more than one GPU and the tool answers within 10 s.
pub fn nvidia_smi_topo(facts: &Result<DriverFacts, NoDriver>) -> Option<String> {
    match facts {
        Ok(f) if f.gpus.len() > 1 => run_nvidia_smi_topo(),
        _ => None,
    }
}

/// Runs `nvidia-smi topo -m`, killed after 10 s; `None` when it fails, times out or prints
/// nothing.
fn run_nvidia_smi_topo() -> Option<String> {
    let mut child = Command::new("nvidia-smi")
        .args(["topo", "-m"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let start = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => break,
            Ok(Some(_)) | Err(_) => return None,
            Ok(None) if start.elapsed() > Duration::from_secs(10) => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    let mut out = String::new();
    use std::io::Read as _;
    child.stdout.take()?.read_to_string(&mut out).ok()?;
    Some(out.trim_end().to_string()).filter(|s| !s.is_empty())
}
