//! Schedules, routes, tiers and the per-`Buffer` route plan.
//!
//! Two separate questions decide how an op talks to a peer:
//!
//! * the **schedule** ([`Schedule`]) says how ranks agree that memory may be reused — by
//!   all-rank barriers ([`Schedule::Global`], DeepEP V1's way) or by epoch-tagged words and
//!   monotonic counters alone ([`Schedule::Epoch`]);
//! * the **route** ([`Route`]) says how bytes and signals reach one peer — plain stores through a
//!   mapping of its memory ([`Route::Store`]), or the transport's put and signal operations
//!   ([`Route::PutSignal`]).
//!
//! A [`RoutePlan`] is computed once per `Buffer` from the [`WorldLayout`] (logical nodes
//! included) and what the backend supports: for every peer its [`Tier`] and its [`Route`]. The
//! kernels receive it as one bit per peer (set: put/signal).

use std::fmt;

use crate::{Result, TopologyError, WorldLayout};

/// How ranks agree that buffers may be reused; chosen per `Buffer`, at run time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Schedule {
    /// DeepEP-V1-equivalent schedule: all-rank barriers before the count exchange, after it and
    /// after reading it (one per cached dispatch and per combine). Baseline and fallback.
    Global,
    /// No barrier: epoch-tagged counts, monotonic completion counters and parity-alternating
    /// receive regions; each rank waits only for the data it receives.
    #[default]
    Epoch,
}

impl Schedule {
    /// Every schedule, in documentation order.
    pub const ALL: [Schedule; 2] = [Schedule::Global, Schedule::Epoch];

    /// Lower-case name, as used on command lines and in fingerprints.
    pub fn name(self) -> &'static str {
        match self {
            Self::Global => "global",
            Self::Epoch => "epoch",
        }
    }
}

/// How bytes and signals reach one peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Route {
    /// Stores and system-scope atomics through a mapping of the peer's memory (NVLink P2P, or
    /// this rank's own memory). Ordered by a release operation after the data.
    Store,
    /// The transport's put, then a signal it delivers after the data (NVSHMEM's put with
    /// signal; a CPU proxy's transfer, then its signal).
    PutSignal,
}

impl Route {
    /// Every route, in documentation order.
    pub const ALL: [Route; 2] = [Route::Store, Route::PutSignal];

    /// Lower-case name, as used on command lines.
    pub fn name(self) -> &'static str {
        match self {
            Self::Store => "store",
            Self::PutSignal => "put-signal",
        }
    }
}

/// Which routes a `Buffer` prefers where more than one would work; chosen per `Buffer`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum RoutePolicy {
    /// Stores inside the NVLink domain (the logical node), put/signal to every other node.
    #[default]
    Auto,
    /// Put/signal to every peer, stores only to this rank's own memory: the path a transport
    /// whose remote writes are not ordered with a plain release would take, tested on any
    /// machine.
    PutSignal,
}

impl RoutePolicy {
    /// Every policy, in documentation order.
    pub const ALL: [RoutePolicy; 2] = [RoutePolicy::Auto, RoutePolicy::PutSignal];

    /// Lower-case name, as used on command lines and in fingerprints.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::PutSignal => "put-signal",
        }
    }
}

macro_rules! parse_by_name {
    ($ty:ty, $what:literal) => {
        impl std::str::FromStr for $ty {
            type Err = TopologyError;
            fn from_str(s: &str) -> Result<Self> {
                <$ty>::ALL
                    .into_iter()
                    .find(|v| v.name() == s)
                    .ok_or_else(|| TopologyError::UnknownName {
                        what: $what,
                        got: s.to_string(),
                        valid: <$ty>::ALL.iter().map(|v| v.name()).collect(),
                    })
            }
        }

        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}

parse_by_name!(Schedule, "schedule");
parse_by_name!(Route, "route");
parse_by_name!(RoutePolicy, "route policy");

/// Where a peer sits relative to this rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tier {
    /// This rank itself: its own memory.
    ThisRank,
    /// The same logical node: the NVLink domain.
    NvlinkDomain,
    /// Another logical node on the same physical host ([`WorldLayout::with_virtual_nodes`]):
    /// treated as another node, though the GPUs could map each other.
    OtherVirtualNode,
    /// Another physical host.
    OtherNode,
}

impl Tier {
    /// Display name.
    pub fn name(self) -> &'static str {
        match self {
            Self::ThisRank => "this rank",
            Self::NvlinkDomain => "NVLink domain",
            Self::OtherVirtualNode => "other node (virtual, same host)",
            Self::OtherNode => "other node",
        }
    }

    /// The tier of `peer` as seen by `world`'s rank.
    ///
    /// # Errors
    /// `peer < world_size`.
    pub fn of(world: &WorldLayout, peer: usize) -> Result<Self> {
        Ok(if peer == world.rank() {
            Self::ThisRank
        } else if world.same_node(peer)? {
            Self::NvlinkDomain
        } else if world.nvlink_reachable(peer)? {
            Self::OtherVirtualNode
        } else {
            Self::OtherNode
        })
    }
}

/// One peer's entry of a [`RoutePlan`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PeerRoute {
    /// The peer's rank.
    pub peer: usize,
    /// Where it sits.
    pub tier: Tier,
    /// How this rank reaches it.
    pub route: Route,
}

/// For every rank of the world, how this rank reaches it; computed once per `Buffer`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RoutePlan {
    world: WorldLayout,
    policy: RoutePolicy,
    peers: Vec<PeerRoute>,
}

impl RoutePlan {
    /// Plans the routes of `world`'s rank for a backend that supports `supported` routes.
    ///
    /// Rules: this rank's own memory is always reached by [`Route::Store`]; a peer in the
    /// NVLink domain by [`Route::Store`] under [`RoutePolicy::Auto`] and by
    /// [`Route::PutSignal`] under [`RoutePolicy::PutSignal`]; a peer in another (logical or
    /// physical) node always by [`Route::PutSignal`].
    ///
    /// # Errors
    /// [`TopologyError::Unreachable`] naming the first peer whose route the backend does not
    /// support, with its tier.
    pub fn new(world: &WorldLayout, supported: &[Route], policy: RoutePolicy) -> Result<Self> {
        let peers = (0..world.world_size())
            .map(|peer| {
                let tier = Tier::of(world, peer)?;
                let route = match (tier, policy) {
                    (Tier::ThisRank, _) | (Tier::NvlinkDomain, RoutePolicy::Auto) => Route::Store,
                    _ => Route::PutSignal,
                };
                if tier != Tier::ThisRank && !supported.contains(&route) {
                    return Err(TopologyError::Unreachable {
                        peer,
                        tier: tier.name(),
                        route: route.name(),
                        supported: supported.iter().map(|r| r.name()).collect(),
                    });
                }
                Ok(PeerRoute { peer, tier, route })
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            world: *world,
            policy,
            peers,
        })
    }

    /// The world the plan was made for.
    pub fn world(&self) -> &WorldLayout {
        &self.world
    }

    /// The policy the plan follows.
    pub fn policy(&self) -> RoutePolicy {
        self.policy
    }

    /// Every rank's entry, indexed by rank (this rank included).
    pub fn peers(&self) -> &[PeerRoute] {
        &self.peers
    }

    /// The route to `peer` (`None` when `peer` is not a rank of the world).
    pub fn route(&self, peer: usize) -> Option<Route> {
        self.peers.get(peer).map(|p| p.route)
    }

    /// Bit `d` set: rank `d` is reached by [`Route::PutSignal`] (the kernels' `remote_mask`).
    /// The world is at most 64 ranks wide where this is used (checked by the frontend).
    pub fn put_signal_mask(&self) -> u64 {
        self.peers
            .iter()
            .filter(|p| p.route == Route::PutSignal && p.peer < 64)
            .fold(0, |mask, p| mask | 1 << p.peer)
    }

    /// True when some peer is reached by [`Route::PutSignal`].
    pub fn uses_put_signal(&self) -> bool {
        self.peers.iter().any(|p| p.route == Route::PutSignal)
    }
}

impl fmt::Display for RoutePlan {
    /// One line per rank: `rank  tier  route`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{:>5}  {:<32} route", "peer", "tier")?;
        for p in &self.peers {
            writeln!(f, "{:>5}  {:<32} {}", p.peer, p.tier.name(), p.route.name())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOTH: &[Route] = &[Route::Store, Route::PutSignal];

    fn routes(plan: &RoutePlan) -> Vec<Route> {
        plan.peers().iter().map(|p| p.route).collect()
    }

    #[test]
    fn names_round_trip_and_unknown_names_list_the_valid_ones() {
        for s in Schedule::ALL {
            assert_eq!(s.name().parse::<Schedule>().unwrap(), s);
        }
        for r in Route::ALL {
            assert_eq!(r.name().parse::<Route>().unwrap(), r);
        }
        for p in RoutePolicy::ALL {
            assert_eq!(p.to_string().parse::<RoutePolicy>().unwrap(), p);
        }
        let err = "peer-signal".parse::<Schedule>().unwrap_err().to_string();
        assert!(
            err.contains("schedule") && err.contains("global, epoch"),
            "{err}"
        );
    }

    #[test]
    fn one_node_stores_everywhere_unless_put_signal_is_asked_for() {
        let w = WorldLayout::new(4, 1, 4).unwrap();
        let auto = RoutePlan::new(&w, &[Route::Store], RoutePolicy::Auto).unwrap();
        assert_eq!(routes(&auto), vec![Route::Store; 4]);
        assert_eq!(auto.put_signal_mask(), 0);
        assert_eq!(auto.peers()[1].tier, Tier::ThisRank);
        assert_eq!(auto.peers()[0].tier, Tier::NvlinkDomain);

        let ps = RoutePlan::new(&w, BOTH, RoutePolicy::PutSignal).unwrap();
        assert_eq!(ps.put_signal_mask(), 0b1101);
        assert_eq!(ps.route(1), Some(Route::Store));
        assert_eq!(ps.route(4), None);

        let err = RoutePlan::new(&w, &[Route::Store], RoutePolicy::PutSignal).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("rank 0") && msg.contains("put-signal"),
            "{msg}"
        );
    }

    #[test]
    fn other_nodes_take_put_signal_and_need_a_backend_that_has_it() {
        // 4 GPUs of one host split into 2 virtual nodes of 2; rank 1 sees 0 in its node.
        let w = WorldLayout::with_virtual_nodes(4, 1, 4, 2).unwrap();
        let plan = RoutePlan::new(&w, BOTH, RoutePolicy::Auto).unwrap();
        assert_eq!(plan.put_signal_mask(), 0b1100);
        assert_eq!(plan.peers()[2].tier, Tier::OtherVirtualNode);
        assert!(plan.uses_put_signal());
        // Two physical hosts of 2.
        let hosts = WorldLayout::new(4, 1, 2).unwrap();
        let plan = RoutePlan::new(&hosts, BOTH, RoutePolicy::Auto).unwrap();
        assert_eq!(plan.peers()[3].tier, Tier::OtherNode);
        let err = RoutePlan::new(&hosts, &[Route::Store], RoutePolicy::Auto).unwrap_err();
        assert!(err.to_string().contains("rank 2 (other node)"), "{err}");
        assert!(plan.to_string().contains("other node"));
    }
}
