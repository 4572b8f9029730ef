//! Device, port and GID selection.
//!
//! * [`DeviceSelector::Name`] opens that device; [`DeviceSelector::FirstActive`] opens the
//!   devices in libibverbs' order and takes the first with an active port and a usable GID
//!   (moving on from a device that cannot be opened or has none);
//!   [`DeviceSelector::NearestTo`] does the same in order of PCI distance from a GPU
//!   ([`epcomm_topology::pci`]: the device behind the GPU's own PCIe switch first), which gives each
//!   GPU of a multi-NIC host its own NIC.
//! * The port is the one asked for (it must be active) or the device's first active port
//!   (ports are numbered from 1; the search stops at the first port `ibv_query_port`
//!   refuses, at most [`MAX_PORTS`]).
//! * [`GidSelector::Index`] uses that GID index; [`GidSelector::RoceV2`] (the default) takes,
//!   on an Ethernet port, the first non-zero GID whose type
//!   (`/sys/class/infiniband/<dev>/ports/<port>/gid_attrs/types/<index>`) is `RoCE v2`,
//!   preferring IPv4-mapped ones (`::ffff:a.b.c.d`, routable between subnets by address
//!   family like NCCL's default); on an InfiniBand port it is index 0 and paths use the LID.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use super::resources::Context;
use super::sys::{self, IbvPortAttr};
use super::{Verbs, VerbsError};
use epcomm_topology::pci;

/// Ports tried per device.
pub const MAX_PORTS: u8 = 16;

/// Which device to open.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum DeviceSelector {
    /// The first device (libibverbs' order) with an active port.
    #[default]
    FirstActive,
    /// The device of this name (`mlx5_0`, `rxe0`).
    Name(String),
    /// The device with an active port nearest (fewest PCI hops) to the PCI function of this
    /// bus id (a GPU's: `0000:1b:00.0`); equally near devices, and devices whose place in the
    /// PCI tree is unknown (after the others), in libibverbs' order.
    NearestTo(String),
}

/// Which GID of the port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GidSelector {
    /// The first RoCE v2 GID (IPv4-mapped preferred); index 0 on InfiniBand.
    #[default]
    RoceV2,
    /// This index.
    Index(u8),
}

impl fmt::Display for GidSelector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GidSelector::RoceV2 => f.write_str("RoceV2"),
            GidSelector::Index(i) => write!(f, "Index({i})"),
        }
    }
}

/// The device, port and GID chosen.
#[derive(Debug)]
pub struct Selected {
    /// The open device.
    pub context: Arc<Context>,
    /// The port.
    pub port: u8,
    /// Its attributes.
    pub port_attr: IbvPortAttr,
    /// The GID index.
    pub gid_index: u8,
    /// The GID (network order).
    pub gid: [u8; 16],
    /// Whether paths route by GID (Ethernet link layer, or a GID index asked for on
    /// InfiniBand).
    pub global: bool,
}

/// One GID table entry as seen for selection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GidEntry {
    /// Its index.
    pub index: u8,
    /// Its type from sysfs (`RoCE v2`, `IB/RoCE v1`), if readable.
    pub kind: Option<String>,
    /// The GID.
    pub gid: [u8; 16],
}

/// Whether `gid` is IPv4-mapped (`::ffff:a.b.c.d`).
pub fn is_ipv4_mapped(gid: &[u8; 16]) -> bool {
    gid[..10].iter().all(|&b| b == 0) && gid[10] == 0xff && gid[11] == 0xff
}

/// The RoCE v2 choice among `entries` (see the [module docs](self)).
pub fn choose_roce_v2(entries: &[GidEntry]) -> Option<u8> {
    let v2 = |e: &&GidEntry| {
        e.kind.as_deref().map(str::trim) == Some("RoCE v2") && e.gid.iter().any(|&b| b != 0)
    };
    entries
        .iter()
        .filter(v2)
        .find(|e| is_ipv4_mapped(&e.gid))
        .or_else(|| entries.iter().find(v2))
        .map(|e| e.index)
}

/// Opens the device and finds the port and GID.
///
/// # Errors
/// [`VerbsError::NoDevice`], [`VerbsError::DeviceNotFound`], [`VerbsError::NoActivePort`],
/// [`VerbsError::PortNotActive`], [`VerbsError::NoGid`], [`VerbsError::Call`].
pub fn select(
    verbs: &Arc<Verbs>,
    device: &DeviceSelector,
    port: Option<u8>,
    gid: GidSelector,
) -> Result<Selected, VerbsError> {
    let mut tried = Vec::new();
    let names: Vec<String> = match device {
        DeviceSelector::Name(name) => vec![name.clone()],
        DeviceSelector::FirstActive => verbs.devices()?.into_iter().map(|d| d.name).collect(),
        DeviceSelector::NearestTo(bus_id) => {
            let sysfs = Path::new(pci::SYSFS);
            let gpu = pci::function_path(sysfs, bus_id);
            if gpu.is_none() {
                tried.push(format!(
                    "(PCI function {bus_id} not found under {}/bus/pci/devices: devices in \
                     libibverbs' order)",
                    pci::SYSFS
                ));
            }
            let devices = verbs
                .devices()?
                .into_iter()
                .map(|d| {
                    let path = pci::rdma_device_path(sysfs, &d.name);
                    (d.name, path)
                })
                .collect();
            pci::nearest_first(gpu.as_deref(), devices)
                .into_iter()
                .map(|(name, _)| name)
                .collect()
        }
    };
    // Automatic choices move on from a device that cannot be opened or has no usable GID; a
    // device named by the caller is that device or an error.
    let automatic = !matches!(device, DeviceSelector::Name(_));
    let mut deferred: Option<VerbsError> = None;
    for name in &names {
        let context = match Context::open(verbs, name) {
            Ok(c) => Arc::new(c),
            Err(e) if automatic => {
                tried.push(format!("{name}: {e}"));
                continue;
            }
            Err(e) => return Err(e),
        };
        let found = match port {
            Some(p) => {
                let attr = context.query_port(p)?;
                if attr.state != sys::IBV_PORT_ACTIVE {
                    return Err(VerbsError::PortNotActive {
                        device: name.clone(),
                        port: p,
                        state: attr.state,
                    });
                }
                Some((p, attr))
            }
            None => first_active_port(&context, &mut tried),
        };
        if let Some((p, attr)) = found {
            match finish(context, p, attr, gid) {
                Ok(selected) => return Ok(selected),
                Err(e) if automatic => {
                    tried.push(format!("{name}:{p}: {e}"));
                    deferred.get_or_insert(e);
                }
                Err(e) => return Err(e),
            }
        }
    }
    // The first active device that failed (the nearest, in NearestTo's order), else no port.
    Err(deferred.unwrap_or(VerbsError::NoActivePort { tried }))
}

fn first_active_port(context: &Context, tried: &mut Vec<String>) -> Option<(u8, IbvPortAttr)> {
    for p in 1..=MAX_PORTS {
        let Ok(attr) = context.query_port(p) else {
            if p == 1 {
                tried.push(format!(
                    "{}: no port answers ibv_query_port",
                    context.name()
                ));
            }
            break;
        };
        if attr.state == sys::IBV_PORT_ACTIVE {
            return Some((p, attr));
        }
        tried.push(format!("{}:{} (state {})", context.name(), p, attr.state));
    }
    None
}

fn finish(
    context: Arc<Context>,
    port: u8,
    port_attr: IbvPortAttr,
    selector: GidSelector,
) -> Result<Selected, VerbsError> {
    let ethernet = port_attr.link_layer == sys::IBV_LINK_LAYER_ETHERNET;
    let (gid_index, global) = match selector {
        GidSelector::Index(i) => (i, true),
        GidSelector::RoceV2 if !ethernet => (0, false),
        GidSelector::RoceV2 => {
            let len = u8::try_from(port_attr.gid_tbl_len.clamp(0, 255)).unwrap_or(u8::MAX);
            let types = Path::new("/sys/class/infiniband")
                .join(context.name())
                .join("ports")
                .join(port.to_string())
                .join("gid_attrs/types");
            let entries: Vec<GidEntry> = (0..len)
                .filter_map(|index| {
                    let gid = context.query_gid(port, index).ok()?;
                    let kind = std::fs::read_to_string(types.join(index.to_string())).ok();
                    Some(GidEntry { index, kind, gid })
                })
                .collect();
            let index = choose_roce_v2(&entries).ok_or_else(|| VerbsError::NoGid {
                device: context.name().to_string(),
                port,
                selector: selector.to_string(),
                reason: format!(
                    "none of {} entries is a non-zero RoCE v2 GID (types read from {}); pass \
                     GidSelector::Index",
                    entries.len(),
                    types.display()
                ),
            })?;
            (index, true)
        }
    };
    let gid = context.query_gid(port, gid_index)?;
    if global && gid.iter().all(|&b| b == 0) {
        return Err(VerbsError::NoGid {
            device: context.name().to_string(),
            port,
            selector: selector.to_string(),
            reason: format!("GID index {gid_index} is empty"),
        });
    }
    Ok(Selected {
        context,
        port,
        port_attr,
        gid_index,
        gid,
        global: global || ethernet,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(index: u8, kind: Option<&str>, gid: [u8; 16]) -> GidEntry {
        GidEntry {
            index,
            kind: kind.map(str::to_string),
            gid,
        }
    }

    const LINK_LOCAL: [u8; 16] = [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8];
    const V4: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 1];

    #[test]
    fn roce_v2_prefers_ipv4_mapped_then_any_v2() {
        let table = [
            entry(0, Some("IB/RoCE v1\n"), LINK_LOCAL),
            entry(1, Some("RoCE v2\n"), LINK_LOCAL),
            entry(2, Some("IB/RoCE v1\n"), V4),
            entry(3, Some("RoCE v2\n"), V4),
        ];
        assert_eq!(choose_roce_v2(&table), Some(3));
        assert_eq!(choose_roce_v2(&table[..3]), Some(1));
        assert_eq!(choose_roce_v2(&table[..1]), None);
        // Zero GIDs and unreadable types never match.
        let empty = [entry(0, Some("RoCE v2"), [0; 16]), entry(1, None, V4)];
        assert_eq!(choose_roce_v2(&empty), None);
        assert!(is_ipv4_mapped(&V4));
        assert!(!is_ipv4_mapped(&LINK_LOCAL));
    }

    #[test]
    fn selectors_print_as_written() {
        assert_eq!(GidSelector::default().to_string(), "RoceV2");
        assert_eq!(GidSelector::Index(3).to_string(), "Index(3)");
        assert_eq!(DeviceSelector::default(), DeviceSelector::FirstActive);
    }
}
