//! Distance between PCI functions in the host's PCI tree, read from sysfs: which RDMA device is
//! closest to a GPU (path arithmetic; sysfs is only read, under a root given by the caller, so
//! the tests use a tree of their own, and the host's own).
//!
//! sysfs names every PCI function by its place in the tree:
//! `/sys/bus/pci/devices/<bus id>` and `/sys/class/infiniband/<device>/device` are links to
//! `/sys/devices/pci<domain>:<bus>/<bridge>/.../<function>`. Nearness is decided by the
//! **deepest common ancestor** first: two functions behind one PCIe switch share more of the
//! path than two that meet only at the root complex, which share more than two on different
//! root complexes (nothing in common), like `nvidia-smi topo -m`'s PIX / PXB / PHB / SYS.
//! Between functions meeting at the same depth, fewer **hops** (the links from each up to that
//! ancestor, added) is nearer.

use std::path::{Path, PathBuf};

/// The sysfs root the transport reads.
pub const SYSFS: &str = "/sys";

/// `id` (`0000:1b:00.0`, `00000000:1B:00.0`, as the CUDA driver or NVML print it) in sysfs'
/// form: lower-case hex, a 4-digit domain (more digits when the domain needs them), 2-digit bus
/// and device, 1-digit function. `None` when it is not a PCI bus id.
pub fn normalize_bus_id(id: &str) -> Option<String> {
    let (rest, function) = id.trim().rsplit_once('.')?;
    let mut parts = rest.split(':');
    let (domain, bus, device) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    let hex = |s: &str, max_digits: usize| -> Option<u32> {
        if s.is_empty() || s.len() > max_digits {
            return None;
        }
        u32::from_str_radix(s, 16).ok()
    };
    let (domain, bus, device, function) = (
        hex(domain, 8)?,
        hex(bus, 2)?,
        hex(device, 2)?,
        hex(function, 1)?,
    );
    if device > 0x1f || function > 7 {
        return None;
    }
    Some(format!("{domain:04x}:{bus:02x}:{device:02x}.{function:x}"))
}

/// The components of `link`'s target below `<sysfs>/devices` (`["pci0000:00", "0000:00:01.0",
/// "0000:01:00.0"]`), or `None` when the link does not resolve there.
fn tree_path(sysfs: &Path, link: &Path) -> Option<Vec<String>> {
    let devices = sysfs.join("devices").canonicalize().ok()?;
    let target = link.canonicalize().ok()?;
    let below = target.strip_prefix(&devices).ok()?;
    let parts: Vec<String> = below
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    (!parts.is_empty()).then_some(parts)
}

/// Where PCI function `bus_id` (any form [`normalize_bus_id`] reads) sits in the tree.
pub fn function_path(sysfs: &Path, bus_id: &str) -> Option<Vec<String>> {
    let id = normalize_bus_id(bus_id)?;
    tree_path(sysfs, &sysfs.join("bus/pci/devices").join(id))
}

/// Where RDMA device `name`'s PCI function sits in the tree (`None` for a device without one,
/// such as Soft-RoCE's `rxe0`).
pub fn rdma_device_path(sysfs: &Path, name: &str) -> Option<Vec<String>> {
    tree_path(
        sysfs,
        &PathBuf::from(sysfs)
            .join("class/infiniband")
            .join(name)
            .join("device"),
    )
}

/// Links from `a` and from `b` up to their deepest common ancestor, added (see the
/// [module docs](self)).
pub fn hops(a: &[String], b: &[String]) -> usize {
    let common = common_depth(a, b);
    (a.len() - common) + (b.len() - common)
}

/// How many leading components `a` and `b` share: the depth of their deepest common ancestor
/// (0: different root complexes).
pub fn common_depth(a: &[String], b: &[String]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// `devices` (name, place in the tree) ordered nearest to `gpu` first (see the
/// [module docs](self): deepest common ancestor, then hops); devices equally near keep their
/// order, and devices whose place is unknown (or every device, when the GPU's place is
/// unknown) come after the others in their order. Each with its hops, if known.
pub fn nearest_first(
    gpu: Option<&[String]>,
    devices: Vec<(String, Option<Vec<String>>)>,
) -> Vec<(String, Option<usize>)> {
    let mut ranked: Vec<(String, Option<(usize, usize)>)> = devices
        .into_iter()
        .map(|(name, path)| {
            let d = gpu
                .zip(path.as_deref())
                .map(|(g, p)| (common_depth(g, p), hops(g, p)));
            (name, d)
        })
        .collect();
    // Stable: equal keys keep libibverbs' order; unknown places last.
    ranked.sort_by_key(|(_, d)| match d {
        Some((depth, hops)) => (0, std::cmp::Reverse(*depth), *hops),
        None => (1, std::cmp::Reverse(0), 0),
    });
    ranked
        .into_iter()
        .map(|(name, d)| (name, d.map(|(_, h)| h)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// A sysfs of two root complexes: a GPU and `mlx5_1` behind one switch under root 0,
    /// `mlx5_0` straight on root 0's other port, `mlx5_2` under root 1, and `rxe0` without a
    /// PCI function.
    fn fake_sysfs() -> PathBuf {
        let root = std::env::temp_dir().join(format!(
            "epcomm-pci-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&root);
        let functions = [
            (
                "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0",
                "gpu",
            ),
            (
                "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:04:00.0",
                "mlx5_1",
            ),
            ("pci0000:00/0000:00:02.0/0000:05:00.0", "mlx5_0"),
            ("pci0000:80/0000:80:01.0/0000:81:00.0", "mlx5_2"),
        ];
        for (path, name) in functions {
            let dir = root.join("devices").join(path);
            std::fs::create_dir_all(&dir).unwrap();
            let id = path.rsplit('/').next().unwrap();
            let bus = root.join("bus/pci/devices");
            std::fs::create_dir_all(&bus).unwrap();
            symlink(&dir, bus.join(id)).unwrap();
            if name != "gpu" {
                let ib = root.join("class/infiniband").join(name);
                std::fs::create_dir_all(&ib).unwrap();
                symlink(&dir, ib.join("device")).unwrap();
            }
        }
        std::fs::create_dir_all(root.join("class/infiniband/rxe0")).unwrap();
        root
    }

    #[test]
    fn bus_ids_are_read_in_every_printed_form() {
        for (printed, want) in [
            ("0000:1b:00.0", "0000:1b:00.0"),
            ("00000000:1B:00.0", "0000:1b:00.0"),
            (" 0001:C1:1f.7\n", "0001:c1:1f.7"),
            ("10000:00:00.0", "10000:00:00.0"),
        ] {
            assert_eq!(
                normalize_bus_id(printed).as_deref(),
                Some(want),
                "{printed:?}"
            );
        }
        for bad in [
            "",
            "1b:00.0",
            "0000:1b:00",
            "0000:1b:20.0",
            "0000:1b:00.8",
            "0000:xx:00.0",
        ] {
            assert_eq!(normalize_bus_id(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_device_behind_the_gpus_switch_is_nearest() {
        let sysfs = fake_sysfs();
        let gpu = function_path(&sysfs, "00000000:03:00.0").expect("the GPU is in the tree");
        assert_eq!(gpu.first().map(String::as_str), Some("pci0000:00"));
        let devices = ["mlx5_0", "mlx5_1", "mlx5_2", "rxe0", "absent"]
            .map(|n| (n.to_string(), rdma_device_path(&sysfs, n)));
        assert!(devices[3].1.is_none() && devices[4].1.is_none());
        let ranked = nearest_first(Some(&gpu), devices.to_vec());
        assert_eq!(
            ranked,
            vec![
                ("mlx5_1".to_string(), Some(4)), // up to 0000:01:00.0 and down: 2 + 2
                ("mlx5_0".to_string(), Some(6)), // up to pci0000:00 and down: 4 + 2
                ("mlx5_2".to_string(), Some(8)), // another root complex: 5 + 3
                ("rxe0".to_string(), None),
                ("absent".to_string(), None),
            ]
        );
        // The GPU's place unknown: libibverbs' order, distances unknown.
        let unranked = nearest_first(None, devices.to_vec());
        assert_eq!(
            unranked.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
            ["mlx5_0", "mlx5_1", "mlx5_2", "rxe0", "absent"]
        );
        assert!(unranked.iter().all(|(_, d)| d.is_none()));
        assert_eq!(function_path(&sysfs, "0000:99:00.0"), None);
        assert_eq!(function_path(&sysfs, "not a bus id"), None);
        let _ = std::fs::remove_dir_all(&sysfs);
    }

    /// The real sysfs of this machine (skipped, saying so, where it has no PCI bus).
    #[test]
    fn this_hosts_pci_functions_are_found_in_its_sysfs() {
        let sysfs = Path::new(SYSFS);
        let Ok(entries) = std::fs::read_dir(sysfs.join("bus/pci/devices")) else {
            eprintln!("SKIP: no {SYSFS}/bus/pci/devices on this machine");
            return;
        };
        let mut seen = 0;
        for entry in entries.flatten().take(16) {
            let id = entry.file_name().to_string_lossy().into_owned();
            let path = function_path(sysfs, &id).unwrap_or_else(|| panic!("{id} not placed"));
            assert_eq!(path.last(), Some(&id), "{path:?}");
            assert_eq!(hops(&path, &path), 0);
            seen += 1;
        }
        eprintln!("{seen} PCI function(s) placed in {SYSFS}/devices");
    }

    #[test]
    fn a_shared_ancestor_beats_fewer_hops() {
        let p = |s: &str| s.split('/').map(str::to_string).collect::<Vec<_>>();
        // The GPU 5 deep under root 0; one NIC 5 deep under another bridge of root 0 (8 hops),
        // one 2 deep under root 1 (7 hops, nothing shared): root 0's comes first.
        let gpu = p("r0/a/b/c/gpu");
        let devices = vec![
            ("other-root".to_string(), Some(p("r1/nic"))),
            ("same-root".to_string(), Some(p("r0/d/e/f/nic"))),
        ];
        assert_eq!(
            nearest_first(Some(&gpu), devices),
            [
                ("same-root".to_string(), Some(8)),
                ("other-root".to_string(), Some(7)),
            ]
        );
        assert_eq!(common_depth(&gpu, &p("r0/d")), 1);
    }

    #[test]
    fn hops_count_both_sides() {
        let p = |s: &str| s.split('/').map(str::to_string).collect::<Vec<_>>();
        assert_eq!(hops(&p("a/b/c"), &p("a/b/c")), 0);
        assert_eq!(hops(&p("a/b/c"), &p("a/b/d")), 2);
        assert_eq!(hops(&p("a/b"), &p("a/b/c/d")), 2);
        assert_eq!(hops(&p("a/b"), &p("x/y/z")), 5);
    }
}
