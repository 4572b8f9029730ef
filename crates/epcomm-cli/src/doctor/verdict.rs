//! Verdicts: whether `epcomm bench --transport <backend>` can run here, one per backend, with
//! why and how to fix it.
//!
//! Contract: pure functions of the probes' results; what a backend requires follows from the
//! library's description of it (`TransportSpec::capabilities`), not from a list kept here.

use epcomm_backends::{Route, TransportSpec};

use super::report::{KernelImage, LibraryReport, Verdict};
use crate::gpu::{DriverFacts, NoDriver, PeerLink};

/// One spec per compiled-in backend, with its default options, from the library's backend
/// table (`epcomm_backends::backends`).
pub fn backends() -> Vec<TransportSpec> {
    epcomm_backends::backends().map(TransportSpec::of).collect()
}

/// The verdicts, one per backend ([`backends`]), from the probes' results (pure), then one
/// per backend of the library's list that this build does not carry (not usable, naming the
/// feature). `rdma`: the RDMA check of the backends that need a device
/// (`TransportSpec::probe_here`), its error as text.
pub fn verdicts(
    facts: &Result<DriverFacts, NoDriver>,
    links: &Result<Vec<PeerLink>, String>,
    kernels: &[KernelImage],
    nvshmem: &LibraryReport,
    rdma: &Result<(), String>,
) -> Vec<Verdict> {
    backends()
        .into_iter()
        .map(|spec| {
            let (usable, reason, fix) = match verdict(&spec, facts, links, kernels, nvshmem, rdma) {
                Ok((reason, note)) => (true, format!("usable: {reason}"), note),
                Err((reason, fix)) => (false, format!("not usable: {reason}"), Some(fix)),
            };
            Verdict {
                transport: spec.to_string(),
                usable,
                reason,
                fix,
                limits: limits_text(&spec),
            }
        })
        .chain(
            epcomm_backends::REGISTRY
                .iter()
                .filter(|line| line.backend.is_none())
                .map(|line| Verdict {
                    transport: line.name.to_string(),
                    usable: false,
                    reason: "not usable: not compiled into this build".to_string(),
                    fix: Some(format!(
                        "rebuild with the `{}` feature of epcomm-backends",
                        line.feature
                    )),
                    limits: String::new(),
                }),
        )
        .collect()
}

/// What bounds `spec`'s backend, in words, from its entry (`TransportSpec::limits`).
pub fn limits_text(spec: &TransportSpec) -> String {
    let limits = spec.limits();
    let mut text = if limits.spans_hosts {
        "ranks may span hosts".to_string()
    } else {
        "every rank on one host".to_string()
    };
    if let Some(e) = limits.executor {
        text.push_str(&format!(
            "; CPU executor moving bytes by {}: {} ring slots by default (at most {}), {} \
             transfers in flight ({})",
            e.moves_by,
            e.ring_slots,
            e.max_ring_slots,
            e.max_in_flight,
            e.env.join(", ")
        ));
    }
    text
}

/// `Ok((why, note))` when `spec` can run here, else `Err((why not, fix))`. What is required
/// follows from the library's description of the backend: compiled in, the kernel image of
/// its kernel family, its run-time library, an RDMA device where it needs one, and, for a
/// backend that reaches peers by stores only, P2P between every pair of GPUs.
fn verdict(
    spec: &TransportSpec,
    facts: &Result<DriverFacts, NoDriver>,
    links: &Result<Vec<PeerLink>, String>,
    kernels: &[KernelImage],
    nvshmem: &LibraryReport,
    rdma: &Result<(), String>,
) -> Result<(String, Option<String>), (String, String)> {
    let caps = spec.capabilities();
    let facts = facts.as_ref().map_err(|e| (e.short(), driver_fix(e)))?;
    if spec.needs_rdma_device()
        && let Err(why) = rdma
    {
        return Err((
            why.clone(),
            format!(
                "{spec} needs libibverbs (Debian/Ubuntu: libibverbs1 ibverbs-providers) and an \
                 RDMA device with an active port: a NIC with its driver, or Soft-RoCE over an \
                 Ethernet interface (`rdma link add rxe0 type rxe netdev <if>`); \
                 EPCOMM_VERBS_DEVICE picks the device"
            ),
        ));
    }
    if spec.needs_runtime_library() && !nvshmem.found {
        return Err((
            "the NVSHMEM host library does not load".into(),
            nvshmem
                .detail
                .clone()
                .unwrap_or_else(|| "set EPCOMM_NVSHMEM_LIB to the library's directory".into()),
        ));
    }
    let image = KernelImage::of_family(kernels, caps.kernel_family).ok_or_else(|| {
        (
            format!("no kernel image for {:?} in this build", caps.kernel_family),
            "rebuild epcomm with the kernels (`cargo xtask build-kernels`)".to_string(),
        )
    })?;
    if !image.available {
        return Err((
            format!("no kernel image {} ({})", image.artifact, image.source),
            image.fix(),
        ));
    }
    let n = facts.gpus.len();
    if spec.needs_runtime_library() {
        return Ok((
            format!(
                "NVSHMEM {} from {}",
                nvshmem.version.as_deref().unwrap_or("?"),
                nvshmem.path.as_deref().unwrap_or("?")
            ),
            None,
        ));
    }
    if caps.routes.contains(&Route::PutSignal) || n == 1 {
        return Ok((format!("{n} GPU(s)"), None));
    }
    // Stores only: every pair of GPUs must map each other.
    let l = links.as_ref().map_err(|e| {
        (
            format!("peer access could not be queried ({e})"),
            "check the driver with `nvidia-smi`".to_string(),
        )
    })?;
    let missing: Vec<String> = l
        .iter()
        .filter(|p| !p.can_access_peer)
        .map(|p| format!("{}->{}", p.from, p.to))
        .collect();
    if !missing.is_empty() {
        return Err((
            format!("no P2P access between GPUs {}", missing.join(", ")),
            format!(
                "{spec} needs P2P (NVLink) between every pair of GPUs it uses: pick GPUs that \
                 have it with CUDA_VISIBLE_DEVICES and --world, or check the NVLink / PCIe \
                 (IOMMU, ACS) setup"
            ),
        ));
    }
    let nvlink = l.iter().filter(|p| p.kind() == "NVLink").count();
    Ok((
        format!(
            "{n} GPUs, P2P between every pair (native atomics, i.e. NVLink, on {nvlink} of {} \
             directed pairs)",
            l.len()
        ),
        (nvlink < l.len()).then(|| {
            "some pairs lack native peer atomics (PCIe, not NVLink); the kernels' peer atomics \
             expect NVLink"
                .to_string()
        }),
    ))
}

/// How to fix a driver that cannot be used.
fn driver_fix(e: &NoDriver) -> String {
    match e {
        NoDriver::Missing => {
            "install the NVIDIA driver (libcuda.so.1 must be loadable); in a container, start it \
             with the GPU runtime enabled"
        }
        NoDriver::Init(_) => {
            "check that the driver loads (`nvidia-smi`) and that the kernel module matches the \
             user-space driver"
        }
        NoDriver::NoDevice => {
            "check CUDA_VISIBLE_DEVICES (unset it to see every GPU) and the GPUs' state"
        }
    }
    .into()
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{gpu, images, lib, link};
    use super::*;

    #[test]
    fn no_driver_means_nothing_is_usable() {
        let v = verdicts(
            &Err(NoDriver::Missing),
            &Ok(vec![]),
            &images(true),
            &lib(true),
            &Ok(()),
        );
        assert_eq!(v.len(), 4);
        for v in v {
            assert!(!v.usable);
            assert_eq!(v.reason, "not usable: no CUDA driver");
            assert!(v.fix.is_some());
        }
    }

    #[test]
    fn limits_come_from_the_backend_table() {
        let text = |s: &str| limits_text(&s.parse().unwrap());
        assert_eq!(text("ipc"), "every rank on one host");
        assert_eq!(text("nvshmem"), "ranks may span hosts");
        let ce = text("proxy-ce");
        assert!(
            ce.starts_with("every rank on one host; CPU executor moving bytes by copy engines")
                && ce.contains("65536 ring slots by default (at most 16777216)")
                && ce.contains("EPCOMM_PROXY_RING_SLOTS"),
            "{ce}"
        );
        assert!(text("proxy-verbs").contains("by RDMA writes"));
    }

    #[test]
    fn proxy_verbs_needs_an_rdma_device() {
        let facts = Ok(DriverFacts {
            version: 13000,
            gpus: vec![gpu(0), gpu(1)],
        });
        let links = Ok(vec![link(0, 1, true), link(1, 0, true)]);
        let no_device = Err("proxy-verbs is unavailable on this machine: no RDMA device".into());
        let v = verdicts(&facts, &links, &images(true), &lib(true), &no_device);
        let verbs = v
            .iter()
            .find(|v| v.transport == "proxy-verbs")
            .expect("listed");
        assert!(!verbs.usable);
        assert!(verbs.reason.contains("no RDMA device"), "{}", verbs.reason);
        assert!(
            verbs.fix.as_deref().unwrap().contains("rdma link add"),
            "{verbs:?}"
        );
        // The other backends do not depend on it.
        assert!(
            v.iter()
                .filter(|v| v.transport != "proxy-verbs")
                .all(|v| v.usable),
            "{v:?}"
        );
        let v = verdicts(&facts, &links, &images(true), &lib(true), &Ok(()));
        assert!(v.iter().all(|v| v.usable), "{v:?}");
    }

    #[test]
    fn ipc_needs_p2p_between_every_pair() {
        let facts = Ok(DriverFacts {
            version: 13000,
            gpus: vec![gpu(0), gpu(1)],
        });
        let ok = vec![link(0, 1, true), link(1, 0, true)];
        let v = verdicts(&facts, &Ok(ok), &images(true), &lib(false), &Ok(()));
        assert!(v[0].usable, "{v:?}");
        assert!(!v[1].usable);
        assert!(v[1].fix.as_deref().unwrap().contains("EPCOMM_NVSHMEM_LIB"));
        let bad = vec![link(0, 1, true), link(1, 0, false)];
        let v = verdicts(&facts, &Ok(bad), &images(true), &lib(true), &Ok(()));
        assert!(!v[0].usable);
        assert!(v[0].reason.contains("1->0"), "{}", v[0].reason);
        assert!(v[1].usable);
        let single = Ok(DriverFacts {
            version: 13000,
            gpus: vec![gpu(0)],
        });
        assert!(verdicts(&single, &Ok(vec![]), &images(true), &lib(true), &Ok(()))[0].usable);
        let v = verdicts(&single, &Ok(vec![]), &images(false), &lib(true), &Ok(()));
        assert!(
            v.iter()
                .all(|v| !v.usable && v.fix.as_deref().unwrap().contains("xtask"))
        );
        assert!(
            v[0].reason.contains("/nonexistent-epcomm/intranode.fatbin"),
            "{v:?}"
        );
        let k = KernelImage::locate("a", "a.bin", false, None);
        assert!(
            !k.available && k.source.contains("EPCOMM_KERNEL_DIR"),
            "{k:?}"
        );
        assert!(k.fix().contains("EPCOMM_KERNEL_DIR"));
    }
}
