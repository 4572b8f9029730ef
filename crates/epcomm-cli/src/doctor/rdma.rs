//! RDMA devices: every device and port under `/sys/class/infiniband`, as sysfs describes
//! them.
//!
//! Contract: read-only and infallible; a missing directory or file is an empty list or a
//! `None`, and all-zero GIDs are left out.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use epcomm_topology::pci;

use super::report::{MAX_GIDS, NearestRdma, RdmaDevice, RdmaPort};
use crate::gpu::GpuInfo;

/// The trimmed contents of a sysfs file; `None` when unreadable or empty.
fn read_trim(p: &Path) -> Option<String> {
    std::fs::read_to_string(p)
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// The entries of `dir` (name, path), numeric names in numeric order; empty when absent.
fn sorted_entries(dir: &Path) -> Vec<(String, PathBuf)> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut v: Vec<(String, PathBuf)> = rd
        .filter_map(Result::ok)
        .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
        .collect();
    // Numeric names in numeric order, the rest by name.
    v.sort_by(|a, b| match (a.0.parse::<u64>(), b.0.parse::<u64>()) {
        (Ok(x), Ok(y)) => x.cmp(&y),
        _ => a.0.cmp(&b.0),
    });
    v
}

/// The RDMA devices under `root` (normally `/sys/class/infiniband`); empty when absent.
pub fn rdma_devices(root: &Path) -> Vec<RdmaDevice> {
    sorted_entries(root)
        .into_iter()
        .map(|(name, dev)| {
            let ports = sorted_entries(&dev.join("ports"))
                .into_iter()
                .filter_map(|(p, dir)| {
                    let port = p.parse().ok()?;
                    let mut gids = Vec::new();
                    let mut gid_count = 0;
                    for (i, gid_path) in sorted_entries(&dir.join("gids")) {
                        let Some(gid) = read_trim(&gid_path) else {
                            continue;
                        };
                        if gid.chars().all(|c| c == '0' || c == ':') {
                            continue;
                        }
                        gid_count += 1;
                        if gids.len() < MAX_GIDS {
                            let kind = read_trim(&dir.join("gid_attrs/types").join(&i));
                            let netdev = read_trim(&dir.join("gid_attrs/ndevs").join(&i));
                            let mut s = format!("{i}: {gid}");
                            if let Some(k) = kind {
                                let _ = write!(s, " ({k})");
                            }
                            if let Some(n) = netdev {
                                let _ = write!(s, " on {n}");
                            }
                            gids.push(s);
                        }
                    }
                    Some(RdmaPort {
                        port,
                        state: read_trim(&dir.join("state")),
                        phys_state: read_trim(&dir.join("phys_state")),
                        link_layer: read_trim(&dir.join("link_layer")),
                        rate: read_trim(&dir.join("rate")),
                        gids,
                        gid_count,
                    })
                })
                .collect();
            RdmaDevice {
                fw_ver: read_trim(&dev.join("fw_ver")),
                name,
                ports,
            }
        })
        .collect()
}

/// Per GPU with a PCI bus id, the device of `devices` with an active port (state `4: ACTIVE`)
/// nearest it in the PCI tree under `sysfs` (`epcomm_topology::pci::nearest_first`; ties, and
/// devices without a place in the tree, in `devices`' order, which is sysfs' and may differ
/// from libibverbs'): what `proxy-verbs` takes for a rank on that GPU when that device also has
/// a usable GID. Empty without such a device.
pub fn nearest_per_gpu(sysfs: &Path, gpus: &[GpuInfo], devices: &[RdmaDevice]) -> Vec<NearestRdma> {
    let active: Vec<(String, Option<Vec<String>>)> = devices
        .iter()
        .filter(|d| {
            d.ports
                .iter()
                .any(|p| p.state.as_deref().is_some_and(|s| s.trim() == "4: ACTIVE"))
        })
        .map(|d| (d.name.clone(), pci::rdma_device_path(sysfs, &d.name)))
        .collect();
    if active.is_empty() {
        return Vec::new();
    }
    gpus.iter()
        .filter_map(|g| {
            let bus = g.pci_bus_id.as_deref()?;
            let gpu_path = pci::function_path(sysfs, bus);
            let (device, hops) = pci::nearest_first(gpu_path.as_deref(), active.clone())
                .into_iter()
                .next()?;
            Some(NearestRdma {
                gpu: g.ordinal,
                pci_bus_id: pci::normalize_bus_id(bus).unwrap_or_else(|| bus.to_string()),
                device,
                hops,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rdma_from_a_fake_sysfs() {
        let root = std::env::temp_dir().join(format!("epcomm-cli-ib-{}", std::process::id()));
        let port = root.join("mlx5_0/ports/1");
        for d in ["gids", "gid_attrs/types", "gid_attrs/ndevs"] {
            std::fs::create_dir_all(port.join(d)).unwrap();
        }
        let w = |p: &str, v: &str| std::fs::write(port.join(p), v).unwrap();
        std::fs::write(root.join("mlx5_0/fw_ver"), "28.39.1002\n").unwrap();
        w("state", "4: ACTIVE\n");
        w("phys_state", "5: LinkUp\n");
        w("link_layer", "Ethernet\n");
        w("rate", "400 Gb/sec (4X NDR)\n");
        w("gids/0", "fe80:0000:0000:0000:0a00:00ff:fe00:0001\n");
        w("gids/1", "0000:0000:0000:0000:0000:0000:0000:0000\n");
        w("gid_attrs/types/0", "RoCE v2\n");
        w("gid_attrs/ndevs/0", "eth0\n");
        let devs = rdma_devices(&root);
        assert_eq!(devs.len(), 1);
        let d = &devs[0];
        assert_eq!(d.name, "mlx5_0");
        assert_eq!(d.fw_ver.as_deref(), Some("28.39.1002"));
        let p = &d.ports[0];
        assert_eq!(p.port, 1);
        assert_eq!(p.state.as_deref(), Some("4: ACTIVE"));
        assert_eq!(p.gid_count, 1);
        assert_eq!(
            p.gids,
            ["0: fe80:0000:0000:0000:0a00:00ff:fe00:0001 (RoCE v2) on eth0"]
        );
        assert!(rdma_devices(&root.join("absent")).is_empty());
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn each_gpu_gets_the_active_device_behind_its_own_switch() {
        use std::os::unix::fs::symlink;
        let sysfs = std::env::temp_dir().join(format!("epcomm-cli-pci-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&sysfs);
        // Two switches under one root complex, a GPU and a NIC behind each; a third NIC, down,
        // behind GPU 1's switch.
        let functions = [
            ("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0", None),
            (
                "pci0000:00/0000:00:01.0/0000:01:00.0/0000:03:00.0",
                Some("mlx5_0"),
            ),
            ("pci0000:00/0000:00:02.0/0000:11:00.0/0000:12:00.0", None),
            (
                "pci0000:00/0000:00:02.0/0000:11:00.0/0000:13:00.0",
                Some("mlx5_1"),
            ),
            (
                "pci0000:00/0000:00:02.0/0000:11:00.0/0000:14:00.0",
                Some("mlx5_2"),
            ),
        ];
        for (path, nic) in functions {
            let dir = sysfs.join("devices").join(path);
            std::fs::create_dir_all(&dir).unwrap();
            let bus = sysfs.join("bus/pci/devices");
            std::fs::create_dir_all(&bus).unwrap();
            symlink(&dir, bus.join(path.rsplit('/').next().unwrap())).unwrap();
            if let Some(name) = nic {
                let ib = sysfs.join("class/infiniband").join(name);
                std::fs::create_dir_all(&ib).unwrap();
                symlink(&dir, ib.join("device")).unwrap();
            }
        }
        let port = |state: &str| RdmaPort {
            port: 1,
            state: Some(state.into()),
            ..Default::default()
        };
        let device = |name: &str, state: &str| RdmaDevice {
            name: name.into(),
            fw_ver: None,
            ports: vec![port(state)],
        };
        // Enumeration order puts the far device first; mlx5_2 is nearer GPU 1 but down.
        let devices = [
            device("mlx5_2", "5: ACTIVE_DEFER"),
            device("mlx5_1", "4: ACTIVE"),
            device("mlx5_0", "4: ACTIVE"),
        ];
        let gpu = |ordinal: usize, bus: Option<&str>| {
            let mut g = crate::doctor::fixtures::gpu(ordinal);
            g.pci_bus_id = bus.map(str::to_string);
            g
        };
        let gpus = [
            gpu(0, Some("00000000:02:00.0")),
            gpu(1, Some("0000:12:00.0")),
            gpu(2, None),
        ];
        let nearest = nearest_per_gpu(&sysfs, &gpus, &devices);
        let got: Vec<(usize, &str, &str, Option<usize>)> = nearest
            .iter()
            .map(|n| (n.gpu, n.pci_bus_id.as_str(), n.device.as_str(), n.hops))
            .collect();
        assert_eq!(
            got,
            [
                (0, "0000:02:00.0", "mlx5_0", Some(2)),
                (1, "0000:12:00.0", "mlx5_1", Some(2)),
            ]
        );
        assert!(
            nearest_per_gpu(&sysfs, &gpus, &devices[..1]).is_empty(),
            "none active"
        );
        let _ = std::fs::remove_dir_all(&sysfs);
    }
}
