//! Rendering the report: the human-readable text, and the JSON of `--json`.
//!
//! Contract: rendering decides nothing; the JSON is the report's serde form (its field names
//! are the schema), pretty-printed and ended by a newline.

use std::fmt::Write as _;

use super::report::{DoctorReport, LibraryReport};
use crate::gpu::PeerLink;

/// Bytes as GiB with one decimal.
fn gib(b: u64) -> String {
    format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
}

/// One library's line: where it was found (and its version), or why not, indented below.
fn lib_line(s: &mut String, what: &str, l: &LibraryReport) {
    if l.found {
        let _ = writeln!(
            s,
            "  {what:<9} found: {}{}",
            l.path.as_deref().unwrap_or(&l.library),
            l.version
                .as_deref()
                .map(|v| format!(" (version {v})"))
                .unwrap_or_default()
        );
    } else {
        let _ = writeln!(s, "  {what:<9} not found ({})", l.library);
        if let Some(d) = &l.detail {
            for line in d.lines() {
                let _ = writeln!(s, "            {line}");
            }
        }
    }
}

/// A section's title after a blank line, and `  none` under it when it lists nothing.
fn heading(s: &mut String, title: &str, none: bool) {
    let _ = writeln!(s, "\n{title}");
    if none {
        let _ = writeln!(s, "  none");
    }
}

/// The human-readable report.
pub fn render(r: &DoctorReport) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "epcomm doctor (epcomm {})", r.epcomm_version);
    let _ = writeln!(s, "\nCUDA driver");
    match (&r.driver.cuda_version, &r.driver.error) {
        (Some(v), _) => {
            let _ = writeln!(s, "  loaded; supports CUDA {v}");
        }
        (None, Some(e)) => {
            let _ = writeln!(s, "  {e}");
        }
        (None, None) => {
            let _ = writeln!(s, "  unknown");
        }
    }
    heading(&mut s, "GPUs", r.gpus.is_empty());
    for g in &r.gpus {
        let _ = writeln!(
            s,
            "  {}: {}, {} SMs, {}, compute capability {}.{}{}{}",
            g.ordinal,
            g.name,
            g.sms,
            gib(g.memory_bytes),
            g.compute_capability.0,
            g.compute_capability.1,
            g.pci_bus_id
                .as_deref()
                .map(|b| format!(", PCI {b}"))
                .unwrap_or_default(),
            if g.mps { ", MPS" } else { "" },
        );
    }
    if r.gpus.len() > 1 {
        let _ = writeln!(
            s,
            "\nPeer access (cuDeviceCanAccessPeer; NVLink = native peer atomics per \
             cuDeviceGetP2PAttribute)"
        );
        if let Some(e) = &r.peer_error {
            let _ = writeln!(s, "  could not be queried: {e}");
        }
        let n = r.gpus.len();
        let _ = write!(s, "  {:>6}", "");
        for j in 0..n {
            let _ = write!(s, " {:>9}", format!("GPU{j}"));
        }
        let _ = writeln!(s);
        for i in 0..n {
            let _ = write!(s, "  {:>6}", format!("GPU{i}"));
            for j in 0..n {
                let cell = if i == j {
                    "-"
                } else {
                    r.peer_links
                        .iter()
                        .find(|l| l.from == i && l.to == j)
                        .map_or("?", PeerLink::kind)
                };
                let _ = write!(s, " {cell:>9}");
            }
            let _ = writeln!(s);
        }
    }
    if let Some(t) = &r.nvidia_smi_topo {
        let _ = writeln!(s, "\nnvidia-smi topo -m");
        for line in t.lines() {
            let _ = writeln!(s, "  {line}");
        }
    }
    let _ = writeln!(s, "\nKernel images");
    for k in &r.kernels {
        let _ = writeln!(s, "  {:<18} {}: {}", k.name, k.artifact, k.source);
    }
    let _ = writeln!(s, "\nLibraries");
    lib_line(&mut s, "NVSHMEM", &r.nvshmem);
    lib_line(&mut s, "NCCL", &r.nccl);
    lib_line(&mut s, "ibverbs", &r.ibverbs);
    heading(
        &mut s,
        "RDMA devices (/sys/class/infiniband)",
        r.rdma.is_empty(),
    );
    for d in &r.rdma {
        let _ = writeln!(
            s,
            "  {}{}",
            d.name,
            d.fw_ver
                .as_deref()
                .map(|f| format!(" (firmware {f})"))
                .unwrap_or_default()
        );
        for p in &d.ports {
            let o = |v: &Option<String>| v.clone().unwrap_or_else(|| "?".into());
            let _ = writeln!(
                s,
                "    port {}: {}, {}, {}, {}",
                p.port,
                o(&p.state),
                o(&p.phys_state),
                o(&p.link_layer),
                o(&p.rate)
            );
            for g in &p.gids {
                let _ = writeln!(s, "      gid {g}");
            }
            if p.gid_count > p.gids.len() {
                let _ = writeln!(s, "      ... {} more", p.gid_count - p.gids.len());
            }
        }
    }
    for n in &r.nearest_rdma {
        let how = n.hops.map_or_else(
            || "PCI distance unknown".to_string(),
            |h| format!("{h} PCI hops"),
        );
        let _ = writeln!(
            s,
            "  nearest to GPU {} ({}): {} ({how})",
            n.gpu, n.pci_bus_id, n.device
        );
    }
    let _ = writeln!(s, "\nEnvironment");
    if r.env.is_empty() {
        let _ = writeln!(
            s,
            "  (no EPCOMM_*, NVSHMEM_*, NCCL_*, CUDA_* variables set)"
        );
    }
    for (k, v) in &r.env {
        let _ = writeln!(s, "  {k}={v}");
    }
    if !r.warnings.is_empty() {
        let _ = writeln!(s, "\nWarnings");
        for w in &r.warnings {
            let _ = writeln!(s, "  ! {w}");
        }
    }
    let _ = writeln!(s, "\nVerdicts");
    for v in &r.verdicts {
        let _ = writeln!(s, "  {:<8} {}", v.transport, v.reason);
        if !v.limits.is_empty() {
            let _ = writeln!(s, "  {:<8} limits: {}", "", v.limits);
        }
        if let Some(f) = &v.fix {
            let label = if v.usable { "note" } else { "fix" };
            let mut lines = f.lines();
            if let Some(first) = lines.next() {
                let _ = writeln!(s, "  {:<8} {label}: {first}", "");
            }
            for line in lines {
                let _ = writeln!(s, "  {:<8}   {line}", "");
            }
        }
    }
    s
}

/// The report as pretty-printed JSON, ended by a newline.
///
/// # Errors
/// When serde cannot serialise it.
pub fn render_json(r: &DoctorReport) -> serde_json::Result<String> {
    let mut s = serde_json::to_string_pretty(r)?;
    s.push('\n');
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::no_driver_report;
    use super::super::verdict::backends;
    use super::*;

    #[test]
    fn report_renders_without_a_driver() {
        let r = no_driver_report();
        let text = render(&r);
        assert!(text.contains("no CUDA driver"), "{text}");
        for spec in backends() {
            let line = format!("{:<8} not usable: no CUDA driver", spec.to_string());
            assert!(text.contains(&line), "{line}: {text}");
        }
        let json = render_json(&r).unwrap();
        assert!(json.ends_with("}\n"), "{json}");
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v["verdicts"][0]["usable"], false);
    }
}
