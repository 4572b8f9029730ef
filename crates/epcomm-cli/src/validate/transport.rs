//! Transport choice and route-plan checks: `--transport`, `--schedule`, `--routes` and their
//! deprecated aliases (`--virtual-nodes`, `--barrier`).
//!
//! Contract: the library decides, without a GPU: the spec's `capabilities()`, its
//! `world_layout(...)` and `RoutePlan::new`. This module only resolves the aliases and names,
//! in each error, the flag that chose what broke the library's rule.

use epcomm_backends::{Capabilities, TransportError, TransportSpec, VirtualNodes};
use epcomm_topology::{RoutePlan, RoutePolicy, Schedule, WorldLayout};

use super::FlagError;
use crate::cli::TransportFlags;

/// The rule of a transport error, without the `invalid <argument>:` prefix.
fn rule_of(e: TransportError) -> String {
    match e {
        TransportError::InvalidArgument { rule, .. } => rule,
        other => other.to_string(),
    }
}

/// The transport, schedule and route policy that the flags ask for, checked against what the
/// spec's backend supports ([`TransportSpec::capabilities`]: no GPU needed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransportChoice {
    /// The spec (`--virtual-nodes` folded in).
    pub spec: TransportSpec,
    /// What its backend supports.
    pub caps: Capabilities,
    /// The schedule.
    pub schedule: Schedule,
    /// The route policy.
    pub routes: RoutePolicy,
}

impl TransportChoice {
    /// Resolves the deprecated aliases (`--virtual-nodes`, `--barrier`) and checks that the
    /// backend is compiled in and implements the schedule.
    ///
    /// # Errors
    /// Each broken rule, naming the flag as typed.
    pub fn from_flags(flags: &TransportFlags) -> Result<Self, FlagError> {
        let spec = Self::spec_of(flags)?;
        let caps = spec.capabilities();
        let (schedule, routes) = flags.schedule_and_routes();
        caps.check_schedule(schedule)
            .map_err(|e| FlagError::Unsupported {
                flag: flags.schedule_flag(),
                value: flags
                    .barrier
                    .map_or_else(|| schedule.to_string(), |b| b.name().into()),
                why: format!("with --transport {spec}: {}", rule_of(e)),
            })?;
        Ok(Self {
            spec,
            caps,
            schedule,
            routes,
        })
    }

    /// `--transport`, with `--virtual-nodes N` folded into an `nvshmem` spec.
    fn spec_of(flags: &TransportFlags) -> Result<TransportSpec, FlagError> {
        let (spec, Some(n)) = (flags.transport, flags.virtual_nodes) else {
            return Ok(flags.transport);
        };
        if let Some(e) = FlagError::at_least("--virtual-nodes", n as u64, 1) {
            return Err(e);
        }
        match spec.virtual_nodes() {
            Some(VirtualNodes::Count(1)) if spec.backend() == "nvshmem" => spec
                .with_virtual_nodes(VirtualNodes::Count(n))
                .map_err(|e| FlagError::Unsupported {
                    flag: "--virtual-nodes",
                    value: n.to_string(),
                    why: rule_of(e),
                }),
            _ if n == 1 => Ok(spec),
            _ => Err(FlagError::Unsupported {
                flag: "--virtual-nodes",
                value: n.to_string(),
                why: format!(
                    "virtual nodes are an option of nvshmem, not of --transport {spec}; use \
                     --transport nvshmem:vnodes={n}"
                ),
            }),
        }
    }

    /// The world layout this transport sees for `world` ranks, `local` per host, from `rank`,
    /// and the route plan a `Buffer` on that rank would use: what the library computes.
    ///
    /// # Errors
    /// The library's rule, naming the flag that chose what broke it.
    pub fn plan(
        &self,
        flags: &TransportFlags,
        world: usize,
        rank: usize,
        local: usize,
    ) -> Result<RoutePlan, FlagError> {
        let spec = self.spec;
        let layout: WorldLayout = spec.world_layout(world, rank, local).map_err(|e| {
            let flag = match &e {
                TransportError::InvalidArgument {
                    argument: "NvshmemOptions::virtual_nodes",
                    ..
                } => flags.vnodes_flag(),
                _ => "--transport",
            };
            FlagError::Unsupported {
                flag,
                value: flags
                    .virtual_nodes
                    .map_or_else(|| spec.to_string(), |n| n.to_string()),
                why: rule_of(e),
            }
        })?;
        RoutePlan::new(&layout, self.caps.routes, self.routes).map_err(|e| {
            let (flag, value) = match self.routes {
                RoutePolicy::Auto => ("--transport", spec.to_string()),
                _ => (
                    flags.routes_flag(),
                    flags
                        .barrier
                        .map_or_else(|| self.routes.to_string(), |b| b.name().into()),
                ),
            };
            FlagError::Unsupported {
                flag,
                value,
                why: format!("with --transport {spec}: {e}"),
            }
        })
    }

    /// The choice for a local launch (one host) of `world` ranks, `None` while the world is
    /// unknown: [`Self::from_flags`], then [`Self::plan`] for every rank, so that a layout or
    /// route rule any rank would break fails here, once.
    ///
    /// # Errors
    /// The first broken rule, naming the flag as typed.
    pub fn for_local_launch(
        flags: &TransportFlags,
        world: Option<usize>,
    ) -> Result<Self, FlagError> {
        let t = Self::from_flags(flags)?;
        if let Some(w) = world {
            (0..w).try_for_each(|rank| t.plan(flags, w, rank, w).map(drop))?;
        }
        Ok(t)
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{args, error_about, valid};
    use super::super::{Machine, validate_bench};
    use super::*;
    use crate::cli::BarrierArg;

    #[test]
    fn transport_specs_and_the_virtual_nodes_alias() {
        let ok = |extra: &[&str]| valid(extra).transport;
        let spec = ok(&["--transport", "nvshmem:vnodes=2", "--world", "4"]);
        assert_eq!(spec.spec.to_string(), "nvshmem:vnodes=2");
        let alias = ok(&[
            "--transport",
            "nvshmem",
            "--virtual-nodes",
            "2",
            "--world",
            "4",
        ]);
        assert_eq!(alias, spec);
        assert_eq!(ok(&["--virtual-nodes", "1"]).spec.to_string(), "ipc");
        // The library's layout rule, named by the flag that was typed.
        let e = error_about(
            &["--transport", "nvshmem:vnodes=3", "--world", "4"],
            "--transport",
        );
        assert!(e.to_string().contains("vnodes=3 must divide"), "{e}");
        error_about(
            &[
                "--transport",
                "nvshmem",
                "--virtual-nodes",
                "3",
                "--world",
                "4",
            ],
            "--virtual-nodes",
        );
        let e = error_about(&["--virtual-nodes", "2"], "--virtual-nodes");
        assert!(e.to_string().contains("nvshmem:vnodes=2"), "{e}");
        error_about(&["--virtual-nodes", "0"], "--virtual-nodes");
        error_about(
            &["--transport", "nvshmem:vnodes=2", "--virtual-nodes", "2"],
            "--virtual-nodes",
        );
    }

    #[test]
    fn routes_are_planned_by_the_library() {
        // ipc supports stores only: put-signal to a peer is refused by RoutePlan::new.
        let e = error_about(&["--routes", "put-signal", "--world", "2"], "--routes");
        assert!(e.to_string().contains("put-signal"), "{e}");
        // One rank has no peer to put to.
        valid(&["--routes", "put-signal", "--world", "1"]);
        let plan = valid(&[
            "--routes",
            "put-signal",
            "--transport",
            "nvshmem",
            "--world",
            "2",
        ]);
        assert_eq!(
            (plan.transport.schedule, plan.transport.routes),
            (Schedule::Epoch, RoutePolicy::PutSignal)
        );
        let plan = valid(&["--schedule", "global"]);
        assert_eq!(plan.transport.schedule, Schedule::Global);
    }

    #[test]
    fn the_barrier_alias_maps_to_schedule_and_routes() {
        let e = error_about(&["--barrier", "peer-signal", "--world", "2"], "--barrier");
        assert!(e.to_string().contains("--transport ipc"), "{e}");
        let a = args(&["--barrier", "peer-signal", "--transport", "nvshmem"]);
        assert_eq!(a.comm.barrier, Some(BarrierArg::PeerSignal));
        let plan = validate_bench(&a, Some(2), &Machine::default()).unwrap();
        assert_eq!(
            (plan.transport.schedule, plan.transport.routes),
            (Schedule::Epoch, RoutePolicy::PutSignal)
        );
        assert!(plan.notes.iter().any(|n| n.contains("--routes put-signal")));
        let a = args(&["--barrier", "global"]);
        assert_eq!(
            a.comm.schedule_and_routes(),
            (Schedule::Global, RoutePolicy::Auto)
        );
    }
}
