//! What a Python `Buffer` is built from, as plain values ([`BufferOptions`]), turned into the
//! frontend's [`BufferConfig`], the transport spec and the buffer plan (the frontend's own,
//! [`epcomm::rules::plan`]: the binding computes no plan of its own). Nothing here needs a GPU:
//! every rule that can be checked before the rendezvous is checked here, with the error naming
//! the argument.

use std::time::Duration;

use epcomm::BufferConfig;
use epcomm_backends::TransportSpec;
use epcomm_topology::{BufferPlan, RoutePolicy, Schedule};

use crate::error::{BindError, Result};

/// The symmetric buffer plan of a config on `world` ranks: the library's own
/// [`epcomm::rules::plan`], whose plan `Buffer::new` allocates (re-exported, so that the
/// binding has no plan of its own).
pub use epcomm::rules::plan;

/// The arguments of a Python `Buffer` (every rank passes the same values).
#[derive(Clone, Debug, PartialEq)]
pub struct BufferOptions {
    /// Most tokens a rank passes to one dispatch.
    pub max_tokens_per_rank: usize,
    /// Elements per token row.
    pub hidden: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Experts in total.
    pub num_experts: usize,
    /// Blocks of the dispatch and combine kernels.
    pub num_sms: u32,
    /// Transport spec (`ipc`, `nvshmem`, `nvshmem:vnodes=N|max`, `proxy-ce`, `proxy-verbs`, each
    /// with `:vnodes=N|max` too, where compiled in).
    pub transport: String,
    /// Schedule name (`epoch`, `global`).
    pub schedule: String,
    /// Route policy name (`auto`, `put-signal`).
    pub routes: String,
    /// Bound of every device wait, seconds.
    pub timeout_s: f64,
    /// Most tokens a rank passes to one low-latency dispatch (the frontend's
    /// `ll_max_tokens_per_rank`; 0: no low-latency memory).
    pub ll_max_tokens_per_rank: usize,
    /// Rank masking for the low-latency ops (the frontend's `ll_masking`).
    pub ll_masking: bool,
    /// Two tiers (`epcomm::HierarchicalBuffer`: rail between the transport's nodes, then
    /// NVLink inside each) instead of one flat all-to-all.
    pub two_tier: bool,
}

/// Checks a duration given in seconds: finite and > 0.
pub fn seconds(argument: &'static str, value: f64) -> Result<Duration> {
    match Duration::try_from_secs_f64(value) {
        Ok(d) if !d.is_zero() => Ok(d),
        _ => Err(BindError::InvalidArgument {
            argument,
            rule: format!("must be a finite number of seconds > 0 (got {value})"),
        }),
    }
}

impl BufferOptions {
    /// The transport spec, parsed.
    pub fn spec(&self) -> Result<TransportSpec> {
        Ok(self.transport.trim().parse()?)
    }

    /// The frontend's configuration, validated (the device-dependent rules, such as the SM
    /// count, are checked by `Buffer::new`).
    pub fn config(&self) -> Result<BufferConfig> {
        let mut cfg = BufferConfig::new(
            self.max_tokens_per_rank,
            self.hidden,
            self.top_k,
            self.num_experts,
        );
        cfg.num_sms = self.num_sms;
        cfg.schedule = self.schedule.trim().parse::<Schedule>()?;
        cfg.routes = self.routes.trim().parse::<RoutePolicy>()?;
        cfg.timeout = seconds("timeout", self.timeout_s)?;
        cfg.ll_max_tokens_per_rank = self.ll_max_tokens_per_rank;
        cfg.ll_masking = self.ll_masking;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Everything, for a world of `world_size` ranks, `local_world_size` per host, seen from
    /// `rank`: the config, the spec (its world layout checked) and the buffer plan.
    pub fn resolve(
        &self,
        world_size: usize,
        rank: usize,
        local_world_size: usize,
    ) -> Result<(BufferConfig, TransportSpec, BufferPlan)> {
        let cfg = self.config()?;
        let spec = self.spec()?;
        spec.capabilities().check_schedule(cfg.schedule)?;
        let layout = spec.world_layout(world_size, rank, local_world_size)?;
        if self.two_tier {
            if cfg.ll_max_tokens_per_rank > 0 {
                return Err(BindError::InvalidArgument {
                    argument: "num_max_dispatch_tokens_per_rank",
                    rule: "must be 0 with two_tier=True: the low-latency ops run on a flat Buffer"
                        .into(),
                });
            }
            let nodes = epcomm_topology::Tiers::from(&layout).nodes();
            if nodes < 2 {
                return Err(BindError::InvalidArgument {
                    argument: "two_tier",
                    rule: format!(
                        "needs ranks on several nodes, and transport {spec} puts all \
                         {world_size} ranks in one: run on several hosts, or split this one \
                         with a spec such as proxy-ce:vnodes=2"
                    ),
                });
            }
        }
        let plan = plan(&cfg, world_size)?;
        Ok((cfg, spec, plan))
    }
}

/// Bytes of symmetric memory per rank that the low-latency regions of `cfg` add (0 when
/// `cfg.ll_max_tokens_per_rank == 0`): the plan's total minus the plan of the same config
/// without low-latency memory, both [`epcomm::rules::plan`]'s.
pub fn low_latency_bytes(cfg: &BufferConfig, world_size: usize) -> Result<u64> {
    let with = plan(cfg, world_size)?.total_bytes();
    let normal_only = BufferConfig {
        ll_max_tokens_per_rank: 0,
        ..cfg.clone()
    };
    let without = plan(&normal_only, world_size)?.total_bytes();
    Ok(with.saturating_sub(without))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> BufferOptions {
        BufferOptions {
            max_tokens_per_rank: 4096,
            hidden: 7168,
            top_k: 8,
            num_experts: 256,
            num_sms: 24,
            transport: "ipc".into(),
            schedule: "epoch".into(),
            routes: "auto".into(),
            timeout_s: 100.0,
            ll_max_tokens_per_rank: 0,
            ll_masking: false,
            two_tier: false,
        }
    }

    #[test]
    fn a_good_set_resolves_to_the_frontends_types() {
        let (cfg, spec, plan) = opts().resolve(2, 0, 2).unwrap();
        assert_eq!(cfg.timeout, Duration::from_secs(100));
        assert_eq!(
            (cfg.schedule, cfg.routes),
            (Schedule::Epoch, RoutePolicy::Auto)
        );
        assert_eq!(spec.backend(), "ipc");
        assert_eq!(plan.recv_rows(), 2 * 4096);
        let global = BufferOptions {
            schedule: "global".into(),
            transport: "nvshmem:vnodes=max".into(),
            routes: "put-signal".into(),
            ..opts()
        };
        let (cfg, spec, _) = global.resolve(2, 1, 2).unwrap();
        assert_eq!(cfg.schedule, Schedule::Global);
        assert_eq!(spec.to_string(), "nvshmem:vnodes=max");
    }

    #[test]
    fn two_tier_needs_several_nodes_and_no_low_latency_memory() {
        let two = |transport: &str, ll: usize| BufferOptions {
            transport: transport.into(),
            ll_max_tokens_per_rank: ll,
            two_tier: true,
            ..opts()
        };
        assert!(two("nvshmem:vnodes=2", 0).resolve(4, 0, 4).is_ok());
        let arg = |r: Result<(BufferConfig, TransportSpec, BufferPlan)>| match r {
            Err(BindError::InvalidArgument { argument, rule }) => (argument, rule),
            other => panic!("{other:?}"),
        };
        // One host, no logical nodes: one node.
        let (argument, rule) = arg(two("ipc", 0).resolve(4, 0, 4));
        assert_eq!(argument, "two_tier");
        assert!(rule.contains("vnodes=2"), "{rule}");
        // The same world over two hosts has two nodes.
        assert!(two("nvshmem", 0).resolve(4, 0, 2).is_ok());
        let (argument, _) = arg(two("nvshmem:vnodes=2", 128).resolve(4, 0, 4));
        assert_eq!(argument, "num_max_dispatch_tokens_per_rank");
    }

    #[test]
    fn low_latency_memory_is_planned_only_when_asked_for() {
        let (cfg, _, plain) = opts().resolve(2, 0, 2).unwrap();
        assert_eq!(low_latency_bytes(&cfg, 2).unwrap(), 0);
        let ll = BufferOptions {
            ll_max_tokens_per_rank: 128,
            ..opts()
        };
        let (cfg, _, with) = ll.resolve(2, 0, 2).unwrap();
        assert_eq!(cfg.ll_max_tokens_per_rank, 128);
        let extra = low_latency_bytes(&cfg, 2).unwrap();
        assert!(extra > 0);
        assert_eq!(with.total_bytes(), plain.total_bytes() + extra);
        // Per parity at least the receive rows (world * M rows of hidden * 2 bytes) and the
        // combine rows (M * top_k rows of hidden * 2 bytes).
        assert!(extra >= 2 * (2 * 128 + 128 * 8) * 7168 * 2, "{extra}");
    }

    #[test]
    fn the_reported_sizes_are_the_ones_buffer_new_allocates() {
        // Over a grid of shapes, with and without low-latency memory: the plan the binding
        // reports (resolve: Buffer.symmetric_bytes/capacity; low_latency_bytes) is the plan
        // of the library's own rules::check, which Buffer::new runs and allocates.
        let mut n = 0;
        for world in [1usize, 2, 4, 8] {
            for hidden in [128usize, 2056, 7168] {
                for (top_k, num_experts) in [(1usize, 8usize), (6, 64), (8, 256)] {
                    for tokens in [1usize, 128, 4096] {
                        for ll in [0usize, 1, 128] {
                            let o = BufferOptions {
                                max_tokens_per_rank: tokens,
                                hidden,
                                top_k,
                                num_experts,
                                ll_max_tokens_per_rank: ll,
                                ..opts()
                            };
                            let at = format!("{o:?} x {world}");
                            let (cfg, spec, reported) = o.resolve(world, 0, world).expect(&at);
                            let layout = spec.world_layout(world, 0, world).unwrap();
                            let caps = spec.capabilities();
                            let library = |ll| {
                                let cfg = BufferConfig {
                                    ll_max_tokens_per_rank: ll,
                                    ..cfg.clone()
                                };
                                epcomm::rules::check(&cfg, world, &layout, &caps)
                                    .expect(&at)
                                    .plan
                            };
                            let allocated = library(ll);
                            assert_eq!(reported, allocated, "{at}");
                            assert_eq!(plan(&cfg, world).unwrap(), allocated, "{at}");
                            assert_eq!(reported.recv_rows(), (world * tokens) as u64, "{at}");
                            assert_eq!(
                                low_latency_bytes(&cfg, world).unwrap(),
                                allocated.total_bytes() - library(0).total_bytes(),
                                "{at}"
                            );
                            n += 1;
                        }
                    }
                }
            }
        }
        assert_eq!(n, 4 * 3 * 3 * 3 * 3);
    }

    #[test]
    fn each_bad_value_names_its_argument() {
        let cases: Vec<(BufferOptions, &str)> = vec![
            (
                BufferOptions {
                    hidden: 100,
                    ..opts()
                },
                "hidden",
            ),
            (
                BufferOptions {
                    timeout_s: f64::NAN,
                    ..opts()
                },
                "timeout",
            ),
            (
                BufferOptions {
                    timeout_s: 0.0,
                    ..opts()
                },
                "timeout",
            ),
            (
                BufferOptions {
                    schedule: "lazy".into(),
                    ..opts()
                },
                "schedule",
            ),
            (
                BufferOptions {
                    routes: "carrier".into(),
                    ..opts()
                },
                "route",
            ),
            (
                BufferOptions {
                    transport: "tcp".into(),
                    ..opts()
                },
                "transport",
            ),
            (
                BufferOptions {
                    num_sms: 0,
                    ..opts()
                },
                "num_sms",
            ),
            (
                BufferOptions {
                    max_tokens_per_rank: 0,
                    ..opts()
                },
                "max_tokens_per_rank",
            ),
            (
                BufferOptions {
                    ll_max_tokens_per_rank: 65536,
                    ..opts()
                },
                "ll_max_tokens_per_rank",
            ),
        ];
        for (o, argument) in cases {
            let e = o.resolve(2, 0, 2).unwrap_err();
            let msg = e.to_string();
            assert!(msg.contains(argument), "{argument}: {msg}");
            assert_eq!(e.info().class, "InvalidArgumentError", "{msg}");
        }
        // Experts must split evenly over the ranks; CUDA IPC cannot span hosts.
        let e = opts().resolve(3, 0, 3).unwrap_err().to_string();
        assert!(e.contains("num_experts"), "{e}");
        let e = opts().resolve(4, 0, 2).unwrap_err().to_string();
        assert!(e.contains("world"), "{e}");
    }
}
