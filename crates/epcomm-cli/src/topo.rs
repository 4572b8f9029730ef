//! `epcomm topo`: the world layout and, per peer, its tier and the route a `Buffer` would use.
//!
//! **The routing here is re-derived, not called.** The library decides routes in
//! `peer_routes` (crates/epcomm/src/buffer.rs), a private function over the addresses a
//! transport's symmetric memory hands out. This CLI may not change that crate, so [`route`]
//! mirrors its rules as a pure function of [`WorldLayout`], using what each transport maps:
//!
//! * `IpcTransport` maps every peer (it requires every rank on one host), kernel family
//!   `NvlinkStore`: every peer by stores; a peer without a mapping is an error;
//! * `NvshmemTransport::alloc_symmetric` maps exactly the peers of this rank's *logical* node
//!   (`WorldLayout::nvlink_domain`), kernel family `NvshmemDevice`: a peer is reached by
//!   put/signal when it has no mapping or when the barrier is PeerSignal, by stores otherwise;
//! * the rank itself is always written through its own base address.
//!
//! If `peer_routes` or the transports' mappings change, change [`route`] with them (its tests
//! restate the cases of `peer_routes_pick_stores_or_put_signal_per_peer`).

use std::fmt::Write as _;

use epcomm_topology::WorldLayout;

use crate::cli::{BarrierArg, TopoArgs, TransportArg};
use crate::validate::{FlagError, FlagErrors, MAX_WORLD};

/// Where a peer sits relative to the rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    /// The rank itself.
    SameGpu,
    /// Same logical node: the NVLink domain the kernels store into.
    NvlinkDomain,
    /// Another logical node on the same physical host (virtual nodes).
    OtherVirtualNode,
    /// Another physical host.
    OtherNode,
}

impl Tier {
    /// Display name.
    pub fn name(self) -> &'static str {
        match self {
            Self::SameGpu => "same GPU",
            Self::NvlinkDomain => "NVLink domain",
            Self::OtherVirtualNode => "other node (virtual, same host)",
            Self::OtherNode => "other node",
        }
    }
}

/// How a Buffer moves bytes to a peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// The rank's own buffer.
    Local,
    /// Stores (and system-scope atomics) through a peer mapping.
    Store,
    /// NVSHMEM put, then a signal delivered after the data.
    PutSignal,
    /// The transport cannot be used for this world / barrier; the reason.
    Unsupported(&'static str),
}

impl Route {
    /// Display name (the reason of `Unsupported` is printed below the table).
    pub fn name(self) -> &'static str {
        match self {
            Self::Local => "local",
            Self::Store => "store",
            Self::PutSignal => "put/signal",
            Self::Unsupported(_) => "n/a",
        }
    }
}

/// The tier of `peer` as seen from `layout`'s rank.
///
/// # Errors
/// `peer` out of range.
pub fn tier(layout: &WorldLayout, peer: usize) -> Result<Tier, epcomm_topology::TopologyError> {
    Ok(if peer == layout.rank() {
        Tier::SameGpu
    } else if layout.same_node(peer)? {
        Tier::NvlinkDomain
    } else if layout.nvlink_reachable(peer)? {
        Tier::OtherVirtualNode
    } else {
        Tier::OtherNode
    })
}

/// The route a Buffer on `layout`'s rank would use to reach `peer` (see the module docs: a
/// mirror of `peer_routes`).
///
/// # Errors
/// `peer` out of range.
pub fn route(
    layout: &WorldLayout,
    transport: TransportArg,
    barrier: BarrierArg,
    peer: usize,
) -> Result<Route, epcomm_topology::TopologyError> {
    let mapped_in_logical_node = layout.same_node(peer)?;
    if !transport.barriers().contains(&barrier) {
        return Ok(Route::Unsupported("peer-signal needs nvshmem"));
    }
    match transport {
        TransportArg::Ipc => {
            if layout.is_virtual() {
                Ok(Route::Unsupported("virtual nodes need nvshmem"))
            } else if layout.num_hosts() > 1 {
                // IpcTransport::new: local_world_size must equal world_size.
                Ok(Route::Unsupported("ipc needs every rank on one host"))
            } else if peer == layout.rank() {
                Ok(Route::Local)
            } else {
                Ok(Route::Store)
            }
        }
        TransportArg::Nvshmem => {
            if peer == layout.rank() {
                Ok(Route::Local)
            } else if !mapped_in_logical_node || barrier == BarrierArg::PeerSignal {
                Ok(Route::PutSignal)
            } else {
                Ok(Route::Store)
            }
        }
    }
}

/// The validated layout of `epcomm topo`'s flags; `local_gpus` stands in for --world.
///
/// # Errors
/// Each broken rule, naming its flag.
pub fn layout_from_args(
    args: &TopoArgs,
    local_gpus: Option<usize>,
) -> Result<WorldLayout, FlagErrors> {
    let mut errs = Vec::new();
    let Some(world) = args.world.or(local_gpus) else {
        return Err(FlagErrors(vec![FlagError::Invalid {
            flag: "--world",
            why: "no GPU to count here; give the world size, e.g. --world 8".into(),
        }]));
    };
    if world == 0 {
        errs.push(FlagError::TooSmall {
            flag: "--world",
            value: 0,
            min: 1,
        });
    } else if world > MAX_WORLD {
        errs.push(FlagError::TooLarge {
            flag: "--world",
            value: world as u64,
            max: MAX_WORLD as u64,
            why: format!("the kernels support at most {MAX_WORLD} ranks"),
        });
    }
    let gpn = args.gpus_per_node.unwrap_or(world);
    if gpn == 0 {
        errs.push(FlagError::TooSmall {
            flag: "--gpus-per-node",
            value: 0,
            min: 1,
        });
    } else if world > 0 && !world.is_multiple_of(gpn) {
        errs.push(FlagError::Unsupported {
            flag: "--gpus-per-node",
            value: gpn.to_string(),
            why: format!("must divide --world {world} (every host has as many GPUs)"),
        });
    }
    let vn = args.virtual_nodes;
    if vn == 0 {
        errs.push(FlagError::TooSmall {
            flag: "--virtual-nodes",
            value: 0,
            min: 1,
        });
    } else if gpn > 0 && !gpn.is_multiple_of(vn) {
        errs.push(FlagError::Unsupported {
            flag: "--virtual-nodes",
            value: vn.to_string(),
            why: format!("must divide --gpus-per-node {gpn}"),
        });
    }
    if world > 0 && args.rank >= world {
        errs.push(FlagError::TooLarge {
            flag: "--rank",
            value: args.rank as u64,
            max: world as u64 - 1,
            why: format!("ranks are 0..{world}"),
        });
    }
    if !errs.is_empty() {
        return Err(FlagErrors(errs));
    }
    WorldLayout::with_virtual_nodes(world, args.rank, gpn, vn).map_err(|e| {
        FlagErrors(vec![FlagError::Invalid {
            flag: "--world",
            why: e.to_string(),
        }])
    })
}

/// The report of `epcomm topo`.
///
/// # Errors
/// Only when the layout is inconsistent (not for a layout from [`layout_from_args`]).
pub fn render(
    layout: &WorldLayout,
    barrier: BarrierArg,
) -> Result<String, epcomm_topology::TopologyError> {
    let mut s = String::new();
    let w = layout.world_size();
    // `write!` to a String cannot fail.
    let _ = writeln!(
        s,
        "world: {w} rank(s) = {} node(s) x {} local rank(s){}",
        layout.num_nodes(),
        layout.gpus_per_node(),
        if layout.is_virtual() {
            format!(
                " ({} host(s) of {} GPUs, each split into {} virtual nodes)",
                layout.num_hosts(),
                layout.physical_gpus_per_node(),
                layout.virtual_nodes_per_host()
            )
        } else {
            format!(" ({} host(s))", layout.num_hosts())
        }
    );
    for node in 0..layout.num_nodes() {
        let ranks = layout.ranks_in_node(node)?;
        let host = ranks.start / layout.physical_gpus_per_node();
        let list: Vec<String> = ranks.map(|r| r.to_string()).collect();
        let _ = writeln!(
            s,
            "  node {node:>2} (host {host}): ranks {}",
            list.join(" ")
        );
    }
    let _ = writeln!(
        s,
        "\npeers of rank {} (node {}, local rank {}), {} barrier:",
        layout.rank(),
        layout.node(),
        layout.local_rank(),
        barrier.name()
    );
    let _ = writeln!(
        s,
        "  {:>4} {:>4} {:>5}  {:<31} {:<12} nvshmem",
        "peer", "node", "local", "tier", "ipc"
    );
    let mut unsupported: Vec<(TransportArg, &'static str)> = Vec::new();
    for peer in 0..w {
        let ipc = route(layout, TransportArg::Ipc, barrier, peer)?;
        let nvshmem = route(layout, TransportArg::Nvshmem, barrier, peer)?;
        for (t, r) in [(TransportArg::Ipc, ipc), (TransportArg::Nvshmem, nvshmem)] {
            if let Route::Unsupported(why) = r
                && !unsupported.contains(&(t, why))
            {
                unsupported.push((t, why));
            }
        }
        let _ = writeln!(
            s,
            "  {:>4} {:>4} {:>5}  {:<31} {:<12} {}",
            peer,
            layout.node_of(peer)?,
            layout.local_rank_of(peer)?,
            tier(layout, peer)?.name(),
            ipc.name(),
            nvshmem.name(),
        );
    }
    for (t, why) in unsupported {
        let _ = writeln!(s, "  n/a for {}: {why}", t.name());
    }
    let _ = writeln!(
        s,
        "\nstore: the kernels write through a peer mapping (NVLink); put/signal: NVSHMEM put, then a \
         signal the peer waits on.\nRoutes are derived from the layout the way a Buffer derives \
         them (assuming P2P works inside each node; `epcomm doctor` checks that)."
    );
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use BarrierArg::*;
    use TransportArg::*;

    fn topo(world: usize, gpn: Option<usize>, vn: usize, rank: usize) -> TopoArgs {
        TopoArgs {
            world: Some(world),
            gpus_per_node: gpn,
            virtual_nodes: vn,
            rank,
            barrier: Epoch,
        }
    }

    #[test]
    fn mirrors_peer_routes() {
        // One host of 3 GPUs, everything mapped (peer_routes' `all_mapped`).
        let l = WorldLayout::new(3, 1, 3).unwrap();
        let r = |t, b, p| route(&l, t, b, p).unwrap();
        assert_eq!(r(Ipc, Epoch, 0), Route::Store);
        assert_eq!(r(Ipc, Epoch, 1), Route::Local);
        assert_eq!(r(Nvshmem, Global, 2), Route::Store);
        // PeerSignal: every peer but me through put/signal.
        assert_eq!(r(Nvshmem, PeerSignal, 0), Route::PutSignal);
        assert_eq!(r(Nvshmem, PeerSignal, 1), Route::Local);
        assert!(matches!(r(Ipc, PeerSignal, 0), Route::Unsupported(_)));
        // Another (virtual) node: unmapped peers are put/signal; stores cannot reach them.
        let split = WorldLayout::with_virtual_nodes(4, 1, 4, 2).unwrap();
        assert_eq!(route(&split, Nvshmem, Epoch, 0).unwrap(), Route::Store);
        assert_eq!(route(&split, Nvshmem, Epoch, 3).unwrap(), Route::PutSignal);
        assert!(matches!(
            route(&split, Ipc, Epoch, 3).unwrap(),
            Route::Unsupported(_)
        ));
        assert_eq!(tier(&split, 3).unwrap(), Tier::OtherVirtualNode);
        assert!(route(&l, Ipc, Epoch, 3).is_err());
    }

    #[test]
    fn two_hosts() {
        let l = layout_from_args(&topo(4, Some(2), 1, 0), None).unwrap();
        assert_eq!(
            (0..4).map(|p| tier(&l, p).unwrap()).collect::<Vec<_>>(),
            vec![
                Tier::SameGpu,
                Tier::NvlinkDomain,
                Tier::OtherNode,
                Tier::OtherNode
            ]
        );
        assert_eq!(
            (0..4)
                .map(|p| route(&l, Nvshmem, Epoch, p).unwrap())
                .collect::<Vec<_>>(),
            vec![
                Route::Local,
                Route::Store,
                Route::PutSignal,
                Route::PutSignal
            ]
        );
        assert!(matches!(
            route(&l, Ipc, Epoch, 1).unwrap(),
            Route::Unsupported(_)
        ));
        let text = render(&l, Epoch).unwrap();
        assert!(text.contains("2 node(s) x 2 local rank(s)"), "{text}");
        assert!(text.contains("node  1 (host 1): ranks 2 3"), "{text}");
    }

    #[test]
    fn flags_are_named() {
        for (args, flag) in [
            (topo(0, None, 1, 0), "--world"),
            (topo(65, None, 1, 0), "--world"),
            (topo(4, Some(3), 1, 0), "--gpus-per-node"),
            (topo(4, Some(0), 1, 0), "--gpus-per-node"),
            (topo(4, Some(4), 3, 0), "--virtual-nodes"),
            (topo(4, Some(4), 0, 0), "--virtual-nodes"),
            (topo(4, None, 1, 4), "--rank"),
        ] {
            let err = layout_from_args(&args, None).unwrap_err();
            assert!(err.about(flag).is_some(), "{flag}: {err}");
            assert!(err.to_string().contains(flag), "{err}");
        }
        let none = TopoArgs {
            world: None,
            ..topo(1, None, 1, 0)
        };
        let err = layout_from_args(&none, None).unwrap_err();
        assert!(err.to_string().contains("--world"), "{err}");
        assert_eq!(layout_from_args(&none, Some(8)).unwrap().world_size(), 8);
    }
}
