//! The device-free rules of a [`crate::Buffer`]: everything [`crate::Buffer::new`] checks
//! before it touches the GPU, as pure functions of the config, the world the transport sees
//! and what the transport supports. `Buffer::new` runs [`check`]; tools that have no GPU (the
//! Python `check_options`, the `epcomm` command's flag checks) run the same functions, so a
//! config they accept is one `Buffer::new` accepts on any device with enough SMs and memory.
//!
//! # Example
//!
//! ```
//! use epcomm::{BufferConfig, rules};
//! use epcomm_topology::{Route, RoutePolicy, WorldLayout};
//! use epcomm_transport::{Capabilities, KernelFamily, Schedule};
//!
//! // A store-only transport (like CUDA IPC) on one host of 2 GPUs.
//! let caps = Capabilities {
//!     name: "example",
//!     kernel_family: KernelFamily::NvlinkStore,
//!     schedules: &[Schedule::Global, Schedule::Epoch],
//!     routes: &[Route::Store],
//! };
//! let layout = WorldLayout::new(2, 0, 2).unwrap();
//! let mut cfg = BufferConfig::new(4096, 7168, 8, 256);
//! assert!(rules::broken_rules(&cfg, 2, &layout, &caps).is_empty());
//!
//! // The decode-sized low-latency limit of this shape, and a config past it.
//! assert_eq!(rules::ll_max_tokens_limit(256, 2), 992);
//! cfg.ll_max_tokens_per_rank = 4096;
//! cfg.routes = RoutePolicy::PutSignal;
//! let broken = rules::broken_rules(&cfg, 2, &layout, &caps);
//! assert_eq!(broken.len(), 2, "{broken:?}");
//! ```

use epcomm_kernels::abi;
use epcomm_topology::{BufferPlan, RoutePlan, WorldLayout};
use epcomm_transport::Capabilities;

use crate::{BufferConfig, Error, Result};

/// The most ranks one buffer spans (the kernels' tables are this large).
pub const MAX_WORLD: usize = abi::MAX_WORLD;

/// The most tokens per rank of a low-latency dispatch, whatever the shape
/// ([`BufferConfig::ll_max_tokens_per_rank`] is a 16-bit count on the device).
pub const LL_MAX_TOKENS: usize = 0xffff;

/// What [`check`] computed on the way: the route plan, the buffer plan and the low-latency
/// kernels' dynamic shared memory.
#[derive(Clone, Debug)]
pub struct Checked {
    /// The route to every peer of the transport's world.
    pub routes: RoutePlan,
    /// The symmetric buffer's layout ([`plan`]).
    pub plan: BufferPlan,
    /// Dynamic shared memory of the low-latency kernels, in u32 words ([`ll_smem_words`]).
    pub ll_smem_words: usize,
}

/// The most tokens per rank whose normal-mode symmetric memory fits `budget_bytes` per rank, for
/// `world` ranks of this shape (what DeepEP's byte budget `num_nvl_bytes` becomes here: epcomm
/// sizes its receive regions per token, so a budget is a per-rank token limit). Set it as
/// [`BufferConfig::max_tokens_per_rank`].
///
/// # Errors
/// [`Error::InvalidArgument`] naming `budget_bytes` (with the bytes one token per rank needs)
/// when not even one token fits, or the shape's own rule (naming `hidden`, `num_experts`, ...).
///
/// ```
/// use epcomm::rules::max_tokens_for_budget;
/// let m = max_tokens_for_budget(2_000_000_000, 8, 7168, 8, 256).unwrap();
/// assert!(m >= 4096);
/// assert!(max_tokens_for_budget(1000, 8, 7168, 8, 256).is_err());
/// ```
pub fn max_tokens_for_budget(
    budget_bytes: u64,
    world: usize,
    hidden: usize,
    top_k: usize,
    num_experts: usize,
) -> Result<usize> {
    let bytes = |m: usize| -> Result<u64> {
        Ok(BufferPlan::with_low_latency(world, m, hidden, top_k, num_experts, 0)?.total_bytes())
    };
    let one = bytes(1)?;
    if one > budget_bytes {
        return Err(Error::InvalidArgument {
            argument: "budget_bytes",
            rule: format!(
                "{budget_bytes} bytes per rank cannot hold one token per rank: {one} bytes are \
                 needed ({world} ranks, hidden {hidden}, top-k {top_k}, {num_experts} experts)"
            ),
        });
    }
    // Fits(m) is monotone in m: double, then bisect (a plan past the library's limits fails).
    let fits = |m: usize| bytes(m).is_ok_and(|b| b <= budget_bytes);
    let (mut lo, mut hi) = (1usize, 2usize);
    while hi < (1 << 40) && fits(hi) {
        lo = hi;
        hi *= 2;
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(lo)
}

/// Shared-memory words of the low-latency tables that do not grow with the token count: the
/// dispatch receive phase's first row per (local expert, source), `num_experts` (+ 1), and the
/// combine's per-expert prefix and this rank's own range per local expert, `3 * epr + 1`.
fn tables_words(num_experts: usize, world: usize) -> usize {
    let epr = num_experts / world.max(1);
    (num_experts.saturating_add(1)).max(epr.saturating_mul(3).saturating_add(1))
}

/// The most tokens per rank a low-latency dispatch of `num_experts` experts over `world` ranks
/// can take: the send phase's routing bitmaps, `(num_experts + world) * ceil(tokens / 32)`
/// words, must fit in [`epcomm_kernels::LL_MAX_SMEM_BYTES`] of shared memory (and the count
/// in [`LL_MAX_TOKENS`]). 0 when not even one token fits. For 256 experts on 2 to 8 ranks: 992.
pub fn ll_max_tokens_limit(num_experts: usize, world: usize) -> usize {
    let words = epcomm_kernels::LL_MAX_SMEM_BYTES / 4;
    // The receive phase's and the combine's tables must fit too.
    if tables_words(num_experts, world) > words {
        return 0;
    }
    let per_word_row = num_experts.saturating_add(world).max(1);
    ((words / per_word_row) * 32).min(LL_MAX_TOKENS)
}

/// Dynamic shared memory of the low-latency kernels, in u32 words: the send phase's routing
/// bitmaps (`(num_experts + world) * ceil(ll_max_tokens_per_rank / 32)`), the receive phase's
/// first row per (local expert, source) (`num_experts`), the combine's per-expert prefix and
/// this rank's own range per local expert (`3 * num_experts / world + 1`). 0
/// when `cfg.ll_max_tokens_per_rank` is 0 (no low-latency ops).
///
/// # Errors
/// [`Error::InvalidArgument`] naming `ll_max_tokens_per_rank` when the words exceed
/// [`epcomm_kernels::LL_MAX_SMEM_BYTES`]; the rule names [`ll_max_tokens_limit`].
pub fn ll_smem_words(cfg: &BufferConfig, world: usize) -> Result<usize> {
    let m = cfg.ll_max_tokens_per_rank;
    if m == 0 {
        return Ok(0);
    }
    let e = cfg.num_experts;
    let limit = epcomm_kernels::LL_MAX_SMEM_BYTES;
    let tables = tables_words(e, world);
    if tables.saturating_mul(4) > limit {
        return Err(Error::InvalidArgument {
            argument: "num_experts",
            rule: format!(
                "the low-latency kernels' per-expert tables of {e} experts on {world} ranks, {} \
                 bytes, must fit in {limit} bytes of shared memory (3 words per expert of a rank \
                 and one per expert of the world): at most {} experts per rank, {} in all; plan \
                 no low-latency memory (ll_max_tokens_per_rank = 0) or use more ranks",
                tables.saturating_mul(4),
                (limit / 4 - 1) / 3,
                limit / 4 - 1
            ),
        });
    }
    let words = (e.saturating_add(world))
        .saturating_mul(m.div_ceil(32))
        .max(tables);
    if words.saturating_mul(4) > limit {
        return Err(Error::InvalidArgument {
            argument: "ll_max_tokens_per_rank",
            rule: format!(
                "the low-latency routing bitmaps, (num_experts + world) * ceil({m} / 32) * 4 = {} \
                 bytes, must fit in {limit} bytes of shared memory: at most {} tokens with {e} \
                 experts on {world} ranks",
                words.saturating_mul(4),
                ll_max_tokens_limit(e, world)
            ),
        });
    }
    Ok(words)
}

/// The symmetric buffer plan of `cfg` over `world` ranks: the byte layout (regions, offsets,
/// [`BufferPlan::total_bytes`]) that [`crate::Buffer::new`] allocates on every rank of a
/// buffer over `world` ranks, the normal op family's regions and, when
/// `cfg.ll_max_tokens_per_rank > 0`, the low-latency ones. It is the plan [`check`] returns in
/// [`Checked::plan`] (`check` calls this function): the one place a [`BufferConfig`] becomes a
/// [`BufferPlan`], also for tools that report sizes without a GPU (the Python binding).
///
/// Contract: a pure function of `cfg.max_tokens_per_rank`, `hidden`, `top_k`, `num_experts`,
/// `ll_max_tokens_per_rank` and `world` (the same arguments give the same plan on every rank);
/// no other field of `cfg` and no device matters. [`check`] adds the rings of
/// [`BufferConfig::rail_ring`] ([`BufferPlan::with_forwarding`]), which need the world's node
/// split. It checks only what the plan itself needs
/// ([`BufferPlan::with_low_latency`]'s rules), not every rule of [`check`]: a config that
/// `check` refuses (the shared-memory limit of the low-latency kernels, more than
/// [`MAX_WORLD`] ranks, a route the transport lacks) may still have a plan.
///
/// # Errors
/// [`Error::Topology`] naming the argument whose plan rule is broken (`world_size` 0,
/// `hidden`, `num_experts` not a multiple of `world`, `top_k`, a token count past its bound),
/// or naming `buffer plan` when the sizes overflow `u64`.
///
/// ```
/// use epcomm::{BufferConfig, rules};
///
/// let mut cfg = BufferConfig::new(4096, 7168, 8, 256);
/// let normal = rules::plan(&cfg, 8).unwrap();
/// assert_eq!(normal.recv_rows(), 8 * 4096);
/// cfg.ll_max_tokens_per_rank = 128;
/// assert!(rules::plan(&cfg, 8).unwrap().total_bytes() > normal.total_bytes());
/// ```
pub fn plan(cfg: &BufferConfig, world: usize) -> Result<BufferPlan> {
    Ok(BufferPlan::with_low_latency(
        world,
        cfg.max_tokens_per_rank,
        cfg.hidden,
        cfg.top_k,
        cfg.num_experts,
        cfg.ll_max_tokens_per_rank,
    )?)
}

/// Every rule of a buffer of `cfg` over `world` ranks (the buffer's ranks: the whole world, or
/// one group of it) that `layout` (the world the transport sees) and `caps` (what it
/// supports) break, in the order [`check`] tests them; empty when the buffer can be created on
/// a device with enough SMs and memory. Each entry names its argument: a field of
/// [`BufferConfig`], `world`, `schedule` or `routes` (through the transport's or the topology's
/// error).
pub fn broken_rules(
    cfg: &BufferConfig,
    world: usize,
    layout: &WorldLayout,
    caps: &Capabilities,
) -> Vec<Error> {
    rules(cfg, world, layout, caps).1
}

/// [`broken_rules`], stopping at none: the plans when no rule is broken, else the first broken
/// rule. What [`crate::Buffer::new`] runs before it touches the GPU.
///
/// # Errors
/// The first entry of [`broken_rules`].
pub fn check(
    cfg: &BufferConfig,
    world: usize,
    layout: &WorldLayout,
    caps: &Capabilities,
) -> Result<Checked> {
    match rules(cfg, world, layout, caps) {
        (Some(checked), errors) if errors.is_empty() => Ok(checked),
        (_, errors) => Err(errors
            .into_iter()
            .next()
            .unwrap_or_else(|| Error::InvalidArgument {
                argument: "buffer plan",
                rule: "no plan and no broken rule".into(),
            })),
    }
}

/// The plans (when every rule that shapes them holds) and every broken rule.
fn rules(
    cfg: &BufferConfig,
    world: usize,
    layout: &WorldLayout,
    caps: &Capabilities,
) -> (Option<Checked>, Vec<Error>) {
    let mut errors = Vec::new();
    let config_ok = match cfg.validate() {
        Ok(()) => true,
        Err(e) => {
            errors.push(e);
            false
        }
    };
    let invalid = |argument, rule: String| Error::InvalidArgument { argument, rule };
    let mut world_ok = true;
    if world == 0 || world > MAX_WORLD {
        world_ok = false;
        errors.push(invalid(
            "world",
            format!("1 to {MAX_WORLD} ranks per buffer (got {world})"),
        ));
    } else if !cfg.num_experts.is_multiple_of(world) {
        world_ok = false;
        errors.push(invalid(
            "num_experts",
            format!(
                "must be a multiple of the world size {world} (got {})",
                cfg.num_experts
            ),
        ));
    }
    if let Err(e) = caps.check_schedule(cfg.schedule) {
        errors.push(e.into());
    }
    let routes = RoutePlan::new(layout, caps.routes, cfg.routes)
        .map_err(|e| errors.push(e.into()))
        .ok();
    let mut ll_words = None;
    if config_ok && world_ok {
        match ll_smem_words(cfg, world) {
            Ok(w) => ll_words = Some(w),
            Err(e) => errors.push(e),
        }
    }
    let forwarding = cfg
        .rail_ring
        .and_then(|ring| forwarding(cfg, world, layout, caps, routes.as_ref(), ring, &mut errors));
    let plan = (config_ok && world_ok && ll_words.is_some())
        .then(|| {
            self::plan(cfg, world)
                .and_then(|p| match forwarding {
                    Some((tiers, ring)) => Ok(p.with_forwarding(tiers, ring)?),
                    None => Ok(p),
                })
                .map_err(|e| errors.push(e))
                .ok()
        })
        .flatten();
    let plan = plan.filter(|_| cfg.rail_ring.is_none() || forwarding.is_some());
    let checked = match (routes, plan, ll_words) {
        (Some(routes), Some(plan), Some(ll_smem_words)) => Some(Checked {
            routes,
            plan,
            ll_smem_words,
        }),
        _ => None,
    };
    (checked, errors)
}

/// Forwarding blocks per source node of a dispatch of `num_sms` blocks over `nodes` nodes
/// through rings of `slots` slots (the grid's last `(nodes - 1)` times this many): `asked`
/// ([`BufferConfig::rail_forward_sms`]) when not 0, else half the grid split among the other
/// nodes but no more than `slots` (a block takes one slot's chunk at a time, so at most `slots`
/// chunks of a source are in flight and more blocks would wait idle), at least one block per
/// source node.
pub fn forward_blocks(num_sms: u32, nodes: usize, asked: u32, slots: usize) -> u32 {
    if asked > 0 {
        return asked;
    }
    let others = nodes.saturating_sub(1).max(1) as u32;
    let slots = u32::try_from(slots).unwrap_or(u32::MAX);
    (num_sms / (2 * others)).min(slots).max(1)
}

/// The rules of [`BufferConfig::rail_ring`]: the world's node split when they hold (pushing
/// every broken one into `errors`).
fn forwarding(
    cfg: &BufferConfig,
    world: usize,
    layout: &WorldLayout,
    caps: &Capabilities,
    routes: Option<&RoutePlan>,
    ring: epcomm_topology::RingShape,
    errors: &mut Vec<Error>,
) -> Option<(epcomm_topology::Tiers, epcomm_topology::RingShape)> {
    let invalid = |rule: String| Error::InvalidArgument {
        argument: "rail_ring",
        rule,
    };
    let before = errors.len();
    let l = layout.gpus_per_node();
    if world != layout.world_size() {
        errors.push(invalid(format!(
            "forwarding runs on a buffer over the whole world ({} ranks), not over a group of \
             {world}",
            layout.world_size()
        )));
    }
    if l == 0 || l >= world || !world.is_multiple_of(l) {
        errors.push(invalid(format!(
            "forwarding needs two nodes or more: {world} ranks of {l} per node"
        )));
    }
    if caps.kernel_family == epcomm_kernels::KernelFamily::CpuProxy {
        errors.push(invalid(format!(
            "not on {}: the CPU proxy's dispatch sends its peers' rows in runs of its own and \
             finishes their metadata on the receiver",
            caps.name
        )));
    }
    if ring.slots() > epcomm_topology::MAX_RING_SLOTS {
        errors.push(invalid(format!(
            "at most {} slots (got {})",
            epcomm_topology::MAX_RING_SLOTS,
            ring.slots()
        )));
    }
    if errors.len() > before {
        return None;
    }
    let nodes = world / l;
    if let Some(routes) = routes {
        let me = layout.rank();
        let node = (me / l) * l..(me / l + 1) * l;
        if let Some(d) = node
            .clone()
            .find(|&d| routes.put_signal_mask() & (1u64 << d) != 0)
        {
            errors.push(invalid(format!(
                "the ranks of a node must reach each other by stores (rank {d}, in this rank's \
                 node {node:?}, is reached by put/signal)"
            )));
        }
    }
    if (cfg.num_sms as usize) < nodes {
        errors.push(Error::InvalidArgument {
            argument: "num_sms",
            rule: format!(
                "forwarding over {nodes} nodes needs a sending block and one forwarding block \
                 per other node: at least {nodes} (got {})",
                cfg.num_sms
            ),
        });
    }
    let others = nodes as u64 - 1;
    if cfg.rail_forward_sms > 0
        && others * u64::from(cfg.rail_forward_sms) >= u64::from(cfg.num_sms)
    {
        errors.push(Error::InvalidArgument {
            argument: "rail_forward_sms",
            rule: format!(
                "{others} other node(s) times {} forwarding blocks leave no sending block of \
                 num_sms = {}: at most {}",
                cfg.rail_forward_sms,
                cfg.num_sms,
                u64::from(cfg.num_sms).saturating_sub(1) / others
            ),
        });
    }
    if errors.len() > before {
        return None;
    }
    epcomm_topology::Tiers::new(nodes, l)
        .map_err(|e| errors.push(e.into()))
        .ok()
        .map(|t| (t, ring))
}

#[cfg(test)]
mod tests {
    use super::*;

    use epcomm_kernels::KernelFamily;
    use epcomm_topology::{Route, RoutePolicy, Schedule};

    const STORES: Capabilities = Capabilities {
        name: "stores",
        kernel_family: KernelFamily::NvlinkStore,
        schedules: &[Schedule::Global, Schedule::Epoch],
        routes: &[Route::Store],
    };
    const BOTH: Capabilities = Capabilities {
        name: "both",
        kernel_family: KernelFamily::NvshmemDevice,
        schedules: &[Schedule::Global, Schedule::Epoch],
        routes: &Route::ALL,
    };

    fn arguments(errors: &[Error]) -> Vec<String> {
        errors
            .iter()
            .map(|e| match e {
                Error::InvalidArgument { argument, .. } => (*argument).to_string(),
                other => other.to_string(),
            })
            .collect()
    }

    #[test]
    fn rail_forwarding_rules_name_what_breaks_them() {
        use epcomm_topology::{RegionKind, RingShape};
        let ring = RingShape::new(2, 16).unwrap();
        let mut cfg = BufferConfig::new(64, 256, 4, 16);
        cfg.rail_ring = Some(ring);
        // Two nodes of two ranks, rank 1: its node's rank 0 by stores, the others by put/signal.
        let split = WorldLayout::new(4, 1, 2).unwrap();
        let checked = check(&cfg, 4, &split, &BOTH).unwrap();
        let (tiers, shape) = checked.plan.forwarding().unwrap();
        assert_eq!((tiers.nodes(), tiers.local_ranks(), shape), (2, 2, ring));
        let entries = checked
            .plan
            .region(RegionKind::RingEntries, epcomm_topology::Parity::Even);
        assert_eq!(entries.len, 2 * 32 * checked.plan.ring_entry_bytes());
        // Without the option nothing is planned for it.
        let flat = BufferConfig {
            rail_ring: None,
            ..cfg.clone()
        };
        assert!(
            check(&flat, 4, &split, &BOTH)
                .unwrap()
                .plan
                .forwarding()
                .is_none()
        );
        // One node: nothing to forward.
        let one = WorldLayout::new(4, 1, 4).unwrap();
        let e = check(&cfg, 4, &one, &BOTH).unwrap_err().to_string();
        assert!(e.contains("rail_ring") && e.contains("two nodes"), "{e}");
        // A group of the world (a tier of a two-tier buffer).
        let group = broken_rules(&cfg, 2, &split, &BOTH);
        assert!(group[0].to_string().contains("whole world"), "{group:?}");
        assert!(arguments(&group).iter().all(|a| a == "rail_ring"));
        // The CPU proxy's dispatch.
        let proxy = Capabilities {
            name: "proxy",
            kernel_family: KernelFamily::CpuProxy,
            ..BOTH
        };
        let e = check(&cfg, 4, &split, &proxy).unwrap_err().to_string();
        assert!(e.contains("rail_ring") && e.contains("proxy"), "{e}");
        // Too many slots; too few blocks for a sender and a forwarder per other node.
        let wide = BufferConfig {
            rail_ring: Some(RingShape::new(epcomm_topology::MAX_RING_SLOTS + 1, 1).unwrap()),
            ..cfg.clone()
        };
        assert_eq!(
            arguments(&broken_rules(&wide, 4, &split, &BOTH)),
            ["rail_ring"]
        );
        let few = BufferConfig {
            num_sms: 1,
            ..cfg.clone()
        };
        assert_eq!(
            arguments(&broken_rules(&few, 4, &split, &BOTH)),
            ["num_sms"]
        );
        // Forwarding blocks asked for: every block but one at most (one other node here).
        let greedy = BufferConfig {
            rail_forward_sms: cfg.num_sms,
            ..cfg.clone()
        };
        let e = broken_rules(&greedy, 4, &split, &BOTH);
        assert_eq!(arguments(&e), ["rail_forward_sms"]);
        assert!(
            e[0].to_string()
                .contains(&format!("at most {}", cfg.num_sms - 1)),
            "{e:?}"
        );
        let most = BufferConfig {
            rail_forward_sms: cfg.num_sms - 1,
            ..cfg.clone()
        };
        assert!(broken_rules(&most, 4, &split, &BOTH).is_empty());
        // Ranks of one node must reach each other by stores.
        let mut puts = cfg.clone();
        puts.routes = RoutePolicy::PutSignal;
        let e = check(&puts, 4, &split, &BOTH).unwrap_err().to_string();
        assert!(e.contains("rail_ring") && e.contains("stores"), "{e}");
    }

    #[test]
    fn forwarding_takes_half_the_grid_up_to_the_slots_and_a_block_per_source_node_at_least() {
        assert_eq!(forward_blocks(24, 2, 0, 64), 12);
        assert_eq!(forward_blocks(16, 2, 0, 8), 8);
        assert_eq!(forward_blocks(16, 4, 0, 8), 2);
        assert_eq!(forward_blocks(4, 8, 0, 8), 1);
        assert_eq!(forward_blocks(2, 2, 0, 8), 1);
        // No more than the ring's slots: more would wait idle.
        assert_eq!(forward_blocks(24, 2, 0, 8), 8);
        assert_eq!(forward_blocks(16, 2, 0, 2), 2);
        // Asked for: as asked (the rules bound it).
        assert_eq!(forward_blocks(16, 2, 6, 2), 6);
    }

    #[test]
    fn low_latency_bitmaps_must_fit_in_shared_memory() {
        let mut cfg = BufferConfig::new(64, 7168, 8, 256);
        assert_eq!(ll_smem_words(&cfg, 2).unwrap(), 0);
        cfg.ll_max_tokens_per_rank = 128;
        // (256 + 2) experts and ranks, 4 words of 32 tokens each.
        assert_eq!(ll_smem_words(&cfg, 2).unwrap(), 258 * 4);
        cfg.ll_max_tokens_per_rank = 992;
        assert_eq!(ll_smem_words(&cfg, 2).unwrap(), 258 * 31);
        cfg.ll_max_tokens_per_rank = 993;
        let e = ll_smem_words(&cfg, 2).unwrap_err().to_string();
        assert!(
            e.contains("ll_max_tokens_per_rank") && e.contains("at most 992 tokens"),
            "{e}"
        );
        // Small batches with few experts: the tables set the size, the combine's on one rank
        // (prefix and own range of 64 local experts), the receive phase's on two.
        let mut small = BufferConfig::new(8, 128, 1, 64);
        small.ll_max_tokens_per_rank = 1;
        assert_eq!(ll_smem_words(&small, 1).unwrap(), 3 * 64 + 1);
        assert_eq!(ll_smem_words(&small, 4).unwrap(), 68);
        assert_eq!(ll_smem_words(&small, 2).unwrap(), 3 * 32 + 1);
        // Too many experts for the tables, whatever the token count: the experts are named.
        let mut wide = BufferConfig::new(8, 128, 1, 4096);
        wide.ll_max_tokens_per_rank = 1;
        let e = ll_smem_words(&wide, 1).unwrap_err().to_string();
        assert!(
            e.contains("num_experts") && e.contains("at most 2730 experts per rank"),
            "{e}"
        );
        assert!(ll_smem_words(&wide, 2).is_ok());
    }

    #[test]
    fn the_low_latency_limit_is_the_largest_count_that_fits() {
        for (experts, world) in [(256, 2), (256, 8), (256, 64), (8, 1), (288, 3), (4096, 64)] {
            let limit = ll_max_tokens_limit(experts, world);
            let mut cfg = BufferConfig::new(limit.max(1), 128, 1, experts);
            cfg.ll_max_tokens_per_rank = limit;
            assert!(ll_smem_words(&cfg, world).is_ok(), "{experts} x {world}");
            if limit < LL_MAX_TOKENS {
                cfg.ll_max_tokens_per_rank = limit + 1;
                assert!(ll_smem_words(&cfg, world).is_err(), "{experts} x {world}");
            }
        }
        assert_eq!(ll_max_tokens_limit(256, 2), 992);
        assert_eq!(ll_max_tokens_limit(256, 64), 800);
        // Few experts: the 16-bit count is the limit.
        assert_eq!(ll_max_tokens_limit(2, 1), LL_MAX_TOKENS);
        // Too many experts for even the receive phase's table.
        assert_eq!(ll_max_tokens_limit(8192, 1), 0);
    }

    #[test]
    fn a_budget_becomes_the_largest_token_count_that_fits() {
        let plan = |m| {
            BufferPlan::with_low_latency(4, m, 7168, 8, 256, 0)
                .unwrap()
                .total_bytes()
        };
        for m in [1usize, 7, 128, 4096] {
            let budget = plan(m);
            assert_eq!(max_tokens_for_budget(budget, 4, 7168, 8, 256).unwrap(), m);
            assert_eq!(
                max_tokens_for_budget(budget + 1, 4, 7168, 8, 256).unwrap(),
                m
            );
            if m > 1 {
                assert_eq!(
                    max_tokens_for_budget(budget - 1, 4, 7168, 8, 256).unwrap(),
                    m - 1
                );
            }
        }
        let e = max_tokens_for_budget(plan(1) - 1, 4, 7168, 8, 256).unwrap_err();
        let text = e.to_string();
        assert!(
            matches!(
                e,
                Error::InvalidArgument {
                    argument: "budget_bytes",
                    ..
                }
            ) && text.contains(&plan(1).to_string()),
            "{text}"
        );
        // The shape's own rules name their argument.
        let e = max_tokens_for_budget(1 << 30, 4, 7168, 8, 255).unwrap_err();
        assert!(e.to_string().contains("num_experts"), "{e}");
    }

    #[test]
    fn a_good_config_passes_with_its_plans() {
        let layout = WorldLayout::new(8, 3, 8).unwrap();
        let mut cfg = BufferConfig::new(4096, 7168, 8, 256);
        cfg.ll_max_tokens_per_rank = 128;
        assert!(broken_rules(&cfg, 8, &layout, &STORES).is_empty());
        let c = check(&cfg, 8, &layout, &STORES).unwrap();
        assert_eq!(c.plan.recv_rows(), 8 * 4096);
        assert_eq!(c.ll_smem_words, 264 * 4);
        assert_eq!(c.routes.peers().len(), 8);
    }

    #[test]
    fn check_returns_the_plan_function_s_plan() {
        // What Buffer::new allocates (check's plan) is `plan`'s, which is the topology's plan
        // of the config's fields, over a grid of shapes with and without low-latency memory.
        let mut checked = 0;
        for world in [1usize, 2, 3, 4, 8] {
            let layout = WorldLayout::new(world, 0, world).unwrap();
            for hidden in [8usize, 200, 2048, 2056, 7168] {
                for (top_k, experts) in [(1usize, 24usize), (8, 48), (6, 96), (8, 288)] {
                    for tokens in [1usize, 7, 128, 4096] {
                        for ll in [0usize, 1, 64, 256] {
                            let mut cfg = BufferConfig::new(tokens, hidden, top_k, experts);
                            cfg.ll_max_tokens_per_rank = ll;
                            let direct = BufferPlan::with_low_latency(
                                world, tokens, hidden, top_k, experts, ll,
                            );
                            let p = plan(&cfg, world);
                            assert_eq!(p.as_ref().ok(), direct.as_ref().ok(), "{cfg:?} x {world}");
                            if let Ok(c) = check(&cfg, world, &layout, &STORES) {
                                assert_eq!(Some(&c.plan), p.as_ref().ok(), "{cfg:?}");
                                checked += 1;
                            }
                        }
                    }
                }
            }
        }
        assert!(checked > 1000, "{checked}");
        // The plan's own rules name their argument.
        let e = plan(&BufferConfig::new(8, 7168, 8, 256), 3).unwrap_err();
        assert!(
            matches!(&e, Error::Topology(_)) && e.to_string().contains("num_experts"),
            "{e}"
        );
    }

    #[test]
    fn every_broken_rule_is_named() {
        // A world past the kernels' tables.
        let big = WorldLayout::new(128, 0, 128).unwrap();
        let cfg = BufferConfig::new(128, 7168, 8, 256);
        let e = broken_rules(&cfg, 128, &big, &STORES);
        assert_eq!(arguments(&e), ["world"], "{e:?}");
        assert!(e[0].to_string().contains("1 to 64 ranks"), "{}", e[0]);
        assert!(check(&cfg, 128, &big, &STORES).is_err());
        // Put/signal on a store-only transport.
        let one = WorldLayout::new(2, 0, 2).unwrap();
        let ps = BufferConfig {
            routes: RoutePolicy::PutSignal,
            ..cfg.clone()
        };
        let e = broken_rules(&ps, 2, &one, &STORES);
        assert_eq!(e.len(), 1, "{e:?}");
        assert!(e[0].to_string().contains("put-signal"), "{}", e[0]);
        assert!(broken_rules(&ps, 2, &one, &BOTH).is_empty());
        // Decode tokens past the shared-memory bitmaps, experts not split evenly, and a bad
        // field: each one named, all at once.
        let ll = BufferConfig {
            ll_max_tokens_per_rank: 4096,
            ..ps.clone()
        };
        let e = broken_rules(&ll, 2, &one, &STORES);
        assert_eq!(arguments(&e)[1], "ll_max_tokens_per_rank", "{e:?}");
        assert_eq!(e.len(), 2, "{e:?}");
        let odd = WorldLayout::new(3, 0, 3).unwrap();
        let e = broken_rules(&ll, 3, &odd, &STORES);
        assert_eq!(arguments(&e)[0], "num_experts", "{e:?}");
        let bad = BufferConfig { hidden: 7, ..ll };
        let e = broken_rules(&bad, 2, &one, &STORES);
        assert_eq!(arguments(&e)[0], "hidden", "{e:?}");
        // check returns the first.
        let first = check(&bad, 2, &one, &STORES).unwrap_err().to_string();
        assert!(first.contains("hidden"), "{first}");
    }
}
