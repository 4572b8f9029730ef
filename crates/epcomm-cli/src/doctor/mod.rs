//! `epcomm doctor`: what this machine offers epcomm, and a verdict per transport.
//!
//! Sources: the CUDA driver API (through [`crate::gpu`]), the `nvshmem` backend's library search,
//! `dlopen` probes by soname for NCCL and libibverbs, `/sys/class/infiniband` for RDMA ports,
//! the environment, and `nvidia-smi topo -m` when that tool is on `PATH` (extra detail only;
//! nothing is decided from it).
//!
//! One idea per module: the [`report`]'s types (the JSON schema); the probes that fill them
//! ([`driver`]: GPUs, driver and peer access; [`kernels`]; [`libraries`]; [`rdma`];
//! [`environment`]); the [`verdict`]s drawn from the probes; and [rendering](mod@render) the report as
//! text or JSON. [`collect`] runs every probe.

mod driver;
mod environment;
mod kernels;
mod libraries;
mod rdma;
mod render;
mod report;
mod verdict;

use std::path::Path;

pub use render::{render, render_json};
pub use report::{DoctorReport, KernelImage};

use crate::gpu;
use report::DriverReport;

/// Runs every probe.
pub fn collect() -> DoctorReport {
    let facts = gpu::probe();
    let (driver, gpus) = DriverReport::from_facts(&facts);
    let links = driver::peer_links(&facts);
    let nvidia_smi_topo = driver::nvidia_smi_topo(&facts);
    let kernels = KernelImage::locate_all();
    let nvshmem = libraries::probe_nvshmem();
    let env = environment::relevant_env(environment::process_vars());
    let gpu_count = facts.as_ref().map_or(0, |f| f.gpus.len());
    let mut warnings = environment::env_warnings(&env, gpu_count);
    if let Ok(l) = &links {
        warnings.extend(driver::link_warnings(l));
    }
    // The RDMA check of `proxy-verbs` (libibverbs, a device with an active port).
    let rdma_check = "proxy-verbs"
        .parse::<epcomm_backends::TransportSpec>()
        .and_then(|spec| spec.probe_here())
        .map_err(|e| e.to_string());
    let verdicts = verdict::verdicts(&facts, &links, &kernels, &nvshmem, &rdma_check);
    let rdma = rdma::rdma_devices(Path::new("/sys/class/infiniband"));
    let nearest_rdma = rdma::nearest_per_gpu(
        Path::new(epcomm_topology::pci::SYSFS),
        facts
            .as_ref()
            .map(|f| f.gpus.as_slice())
            .unwrap_or_default(),
        &rdma,
    );
    DoctorReport {
        epcomm_version: env!("CARGO_PKG_VERSION").into(),
        driver,
        gpus,
        peer_links: links.as_ref().cloned().unwrap_or_default(),
        peer_error: links.err(),
        nvidia_smi_topo,
        kernels,
        nvshmem,
        nccl: libraries::probe_nccl(),
        ibverbs: libraries::probe_ibverbs(),
        rdma,
        nearest_rdma,
        env,
        warnings,
        verdicts,
    }
}

/// What the tests of the verdicts and of the rendering share.
#[cfg(test)]
mod fixtures {
    use super::report::LibraryReport;
    use super::*;
    use crate::gpu::{GpuInfo, NoDriver, PeerLink};

    pub(super) fn gpu(i: usize) -> GpuInfo {
        GpuInfo {
            ordinal: i,
            name: "GPU".into(),
            sms: 132,
            memory_bytes: 80 << 30,
            compute_capability: (9, 0),
            pci_bus_id: None,
            mps: false,
        }
    }

    pub(super) fn link(from: usize, to: usize, p2p: bool) -> PeerLink {
        PeerLink {
            from,
            to,
            can_access_peer: p2p,
            native_atomics: Some(p2p),
            performance_rank: Some(0),
        }
    }

    pub(super) fn lib(found: bool) -> LibraryReport {
        LibraryReport {
            library: "libnvshmem_host.so.3".into(),
            found,
            path: found.then(|| "/x/libnvshmem_host.so.3".into()),
            version: found.then(|| "3.4.5".into()),
            detail: (!found).then(|| "set EPCOMM_NVSHMEM_LIB".into()),
        }
    }

    pub(super) fn images(available: bool) -> Vec<KernelImage> {
        let dir = (!available).then(|| Path::new("/nonexistent-epcomm"));
        epcomm_kernels::images()
            .map(|i| KernelImage::locate(i.name(), i.artifact(), available, dir))
            .collect()
    }

    /// The report of a machine without a CUDA driver.
    pub(super) fn no_driver_report() -> DoctorReport {
        DoctorReport {
            epcomm_version: "0".into(),
            driver: DriverReport {
                present: false,
                cuda_version: None,
                error: Some(NoDriver::Missing.to_string()),
            },
            gpus: vec![],
            peer_links: vec![],
            peer_error: None,
            nvidia_smi_topo: None,
            kernels: images(true),
            nvshmem: lib(false),
            nccl: lib(false),
            ibverbs: lib(false),
            rdma: vec![],
            nearest_rdma: vec![],
            env: vec![],
            warnings: environment::env_warnings(&[], 0),
            verdicts: verdict::verdicts(
                &Err(NoDriver::Missing),
                &Ok(vec![]),
                &images(true),
                &lib(false),
                &Ok(()),
            ),
        }
    }
}
