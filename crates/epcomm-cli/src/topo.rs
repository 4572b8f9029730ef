//! `epcomm topo`: the world layout a transport sees and the route plan a `Buffer` would use.
//!
//! Nothing is derived here: the layout is `TransportSpec::world_layout` and the plan
//! `RoutePlan::new` over the backend's supported routes ([`TransportChoice::plan`]), the same
//! calls a `Buffer` makes; this module only checks the flags and prints what they return.

use std::fmt::Write as _;

use epcomm_topology::{RankGroup, Route, RoutePlan, Tiers, WorldLayout};

use crate::cli::TopoArgs;
use crate::validate::{FlagError, FlagErrors, TransportChoice, world_rule};

/// The library's argument names of a physical layout, by `epcomm topo`'s flags.
const LAYOUT_FLAGS: &[(&str, &str)] = &[
    ("world_size", "--world"),
    ("gpus_per_node", "--gpus-per-node"),
    ("rank", "--rank"),
];

/// What `epcomm topo` prints: the transport and the route plan of one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topo {
    /// Transport, schedule and route policy.
    pub choice: TransportChoice,
    /// The plan (its world included).
    pub plan: RoutePlan,
}

/// The checked flags of `epcomm topo`, planned; `local_gpus` stands in for --world.
///
/// # Errors
/// Each broken rule, naming its flag.
pub fn plan_from_args(args: &TopoArgs, local_gpus: Option<usize>) -> Result<Topo, FlagErrors> {
    let Some(world) = args.world.or(local_gpus) else {
        return Err(FlagErrors(vec![FlagError::Invalid {
            flag: "--world",
            why: "no GPU to count here; give the world size, e.g. --world 8".into(),
        }]));
    };
    let gpus_per_node = args.gpus_per_node.unwrap_or(world);
    // The kernels' limit, then the physical layout by the library's rules.
    let layout = world_rule(world, "").map_or_else(
        || {
            WorldLayout::new(world, args.rank, gpus_per_node)
                .map_err(|e| FlagError::from_topology(&e, LAYOUT_FLAGS))
        },
        Err,
    );
    let choice = TransportChoice::from_flags(&args.comm);
    match (layout, choice) {
        (Ok(_), Ok(choice)) => {
            let plan = choice
                .plan(&args.comm, world, args.rank, gpus_per_node)
                .map_err(|e| FlagErrors(vec![e]))?;
            Ok(Topo { choice, plan })
        }
        (layout, choice) => Err(FlagErrors(
            [layout.err(), choice.err()].into_iter().flatten().collect(),
        )),
    }
}

fn names<T: Copy>(list: &[T], name: impl Fn(T) -> &'static str) -> String {
    list.iter().map(|&v| name(v)).collect::<Vec<_>>().join(", ")
}

/// The report of `epcomm topo`.
///
/// # Errors
/// Only when the layout is inconsistent (not for a plan from [`plan_from_args`]).
pub fn render(topo: &Topo) -> Result<String, epcomm_topology::TopologyError> {
    let (choice, plan) = (&topo.choice, &topo.plan);
    let layout = plan.world();
    let mut s = String::new();
    // `write!` to a String cannot fail.
    let _ = writeln!(
        s,
        "transport {}: schedules {}; routes {}",
        choice.spec,
        names(choice.caps.schedules, |v| v.name()),
        names(choice.caps.routes, Route::name),
    );
    let _ = writeln!(
        s,
        "world: {} rank(s) = {} node(s) x {} local rank(s){}",
        layout.world_size(),
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
        "\nroute plan of rank {} (node {}, local rank {}), routes {}, schedule {}:",
        layout.rank(),
        layout.node(),
        layout.local_rank(),
        plan.policy(),
        choice.schedule,
    );
    for line in plan.to_string().lines() {
        let _ = writeln!(s, "  {line}");
    }
    let _ = writeln!(
        s,
        "  put-signal mask: {:#x}\n\nstore: the kernels write through a mapping of the peer's \
         memory (NVLink); put-signal: the transport's put, then a signal the peer waits on.\n\
         Computed by the library from the layout, as a Buffer computes it (assuming P2P works \
         inside each node; `epcomm doctor` checks that).",
        plan.put_signal_mask()
    );
    if layout.num_nodes() > 1 {
        let tiers = Tiers::from(layout);
        let group = |g: RankGroup| {
            let list: Vec<String> = g.members().map(|r| r.to_string()).collect();
            format!(
                "ranks {} (this rank is member {})",
                list.join(" "),
                g.rank()
            )
        };
        let _ = writeln!(
            s,
            "\nhierarchical path (HierarchicalBuffer) of rank {}:\n  rail tier (one rank per \
             node, the transport's put/signal): {}\n  node tier (this node, stores): {}",
            layout.rank(),
            group(RankGroup::rail(&tiers, layout.rank())?),
            group(RankGroup::node(&tiers, layout.rank())?),
        );
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::Command;
    use crate::cli::tests::parse;

    fn topo(extra: &[&str]) -> TopoArgs {
        match parse(&[&["topo"], extra].concat()) {
            Command::Topo(a) => a,
            other => panic!("not topo: {other:?}"),
        }
    }

    #[test]
    fn the_virtual_nodes_alias_plans_like_the_spec() {
        // (The printed plan of two hosts is checked on the binary, in tests/cli.rs.)
        let spec = plan_from_args(
            &topo(&["--world", "4", "--transport", "nvshmem:vnodes=2"]),
            None,
        )
        .unwrap();
        let alias = plan_from_args(
            &topo(&[
                "--world",
                "4",
                "--transport",
                "nvshmem",
                "--virtual-nodes",
                "2",
            ]),
            None,
        )
        .unwrap();
        assert_eq!(spec, alias);
        assert_eq!(spec.plan.put_signal_mask(), 0b1100);
        let text = render(&spec).unwrap();
        assert!(text.contains("split into 2 virtual nodes"), "{text}");
        assert!(text.contains("node  1 (host 0): ranks 2 3"), "{text}");
        // Rank 0 of 2 nodes x 2: rail tier ranks 0 and 2, node tier ranks 0 and 1.
        assert!(
            text.contains("rail tier (one rank per node, the transport's put/signal): ranks 0 2 (this rank is member 0)"),
            "{text}"
        );
        assert!(
            text.contains("node tier (this node, stores): ranks 0 1 (this rank is member 0)"),
            "{text}"
        );
        // One node: no hierarchical section.
        let one = plan_from_args(&topo(&["--world", "4"]), None).unwrap();
        assert!(!render(&one).unwrap().contains("hierarchical path"));
    }

    #[test]
    fn flags_are_named() {
        for (argv, flag) in [
            (&["--world", "0"][..], "--world"),
            (&["--world", "65"], "--world"),
            (&["--world", "4", "--gpus-per-node", "3"], "--world"),
            (&["--world", "4", "--gpus-per-node", "0"], "--gpus-per-node"),
            (&["--world", "4", "--rank", "4"], "--rank"),
            (
                &["--world", "4", "--transport", "nvshmem:vnodes=3"],
                "--transport",
            ),
            (
                &[
                    "--world",
                    "4",
                    "--transport",
                    "nvshmem",
                    "--virtual-nodes",
                    "3",
                ],
                "--virtual-nodes",
            ),
            (&["--world", "4", "--virtual-nodes", "2"], "--virtual-nodes"),
            (&["--world", "4", "--gpus-per-node", "2"], "--transport"),
            (&["--world", "4", "--routes", "put-signal"], "--routes"),
            (&["--world", "4", "--barrier", "peer-signal"], "--barrier"),
        ] {
            let err = plan_from_args(&topo(argv), None).unwrap_err();
            assert!(err.about(flag).is_some(), "{argv:?} {flag}: {err}");
            assert!(err.to_string().contains(flag), "{err}");
        }
        let err =
            plan_from_args(&topo(&["--world", "4", "--gpus-per-node", "3"]), None).unwrap_err();
        assert!(err.to_string().contains("--gpus-per-node"), "{err}");
        let err = plan_from_args(&topo(&[]), None).unwrap_err();
        assert!(err.to_string().contains("--world"), "{err}");
        let t = plan_from_args(&topo(&[]), Some(8)).unwrap();
        assert_eq!(t.plan.world().world_size(), 8);
    }
}
