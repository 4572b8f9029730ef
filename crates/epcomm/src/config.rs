//! Buffer configuration and receive-count modes.

use std::time::Duration;

use epcomm_topology::{RingShape, RoutePolicy, Schedule};

use crate::{Error, Result};

/// How the host learns the number of received rows of a dispatch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecvMode {
    /// The host waits (bounded) for the exact count, which the kernel publishes to mapped host
    /// memory as soon as the counts are exchanged, while the data is still moving.
    HostSync,
    /// Nothing is read by the host; outputs are sized for the worst case
    /// (`max_tokens_per_rank * world`) and combine takes the true count from device memory.
    /// The whole dispatch + combine can be captured in a CUDA graph.
    WorstCase,
    /// Like `WorstCase`, with the caller's bound on received rows: a dispatch that would receive
    /// more fails on the device with [`Error::Overflow`] and writes nothing out of bounds.
    Bounded(usize),
}

/// How [`crate::Buffer::combine`] gets the expert output `y` to the ranks that own its tokens.
///
/// Both ways give the same bits (each token's contributions are summed in fp32, rank order).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CombineStaging {
    /// Push, unless the caller gives the receive rows up ([`crate::CombineInput::consuming`]):
    /// then [`Self::CopyEngine`] when it applies, every peer is reached by loads and stores
    /// (mapped memory), the handle's dispatch was HostSync (so only the rows peers read are
    /// copied) and the kernels run on at most [`Self::AUTO_MAX_SMS`] SMs. A plain
    /// [`crate::Buffer::combine`] never writes the dispatch's outputs under `Auto`. Every rank
    /// must decide alike: the decision depends on the call, the config, the transport's routes,
    /// the handle, graph recording and the receive mode, so every rank must call the same
    /// combine after a dispatch in the same receive mode (ranks that decide differently fail
    /// the op with a typed error naming the mismatch).
    #[default]
    Auto,
    /// The combine kernel's SMs push every received row of `y` into the combine region of the
    /// rank that owns its token; that rank then sums what arrived.
    Push,
    /// Before the kernel, the copy engine copies `y` (and `y_weights`) over the receive rows of
    /// this rank's latest dispatch (BF16 or FP8; the region is sized for BF16 rows), then the
    /// kernel pulls every contribution from the peers' receive regions, as
    /// [`crate::Buffer::combine_in_place`] does. The push leaves the SMs, and the rows cross the
    /// link once, as reads. Applies when `handle` is the latest dispatch's and that dispatch was
    /// issued like the combine (both run, or both recorded in the same graph recording, since the
    /// copy's destination is the receive region of that dispatch's parity); a combine where it
    /// does not apply fails naming `combine_staging`. The receive rows of the latest dispatch
    /// are overwritten, by [`crate::Buffer::combine`] too: choosing this way says the caller
    /// never reads a dispatch's outputs after its combine.
    CopyEngine,
}

impl CombineStaging {
    /// The most SMs at which [`Self::Auto`] stages. The copy costs this GPU's memory time, the
    /// push it replaces costs SM time, which gets cheaper with every SM. With two ranks on one
    /// H200 under MPS (docs/benchmarks.md, "Combine staging"), after a HostSync dispatch
    /// staging was 22–38 % faster at 4–8 SMs, 0–26 % at 24, 9–13 % at 32 and even at 64.
    /// Copying every row (what [`Self::CopyEngine`] does after other receive modes, up to the
    /// capacity) was faster only up to 16 SMs there, which is why `Auto` leaves those alone.
    pub const AUTO_MAX_SMS: u32 = 32;

    /// Every way, in documentation order.
    pub const ALL: [Self; 3] = [Self::Auto, Self::Push, Self::CopyEngine];

    /// The name the CLI and the environment use: `auto`, `push` or `copy-engine`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Push => "push",
            Self::CopyEngine => "copy-engine",
        }
    }
}

impl std::fmt::Display for CombineStaging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for CombineStaging {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|w| w.name() == s)
            .ok_or_else(|| Error::InvalidArgument {
                argument: "combine_staging",
                rule: format!(
                    "must be one of {} (got {s:?})",
                    Self::ALL.map(Self::name).join(", ")
                ),
            })
    }
}

/// Configuration of a [`crate::Buffer`]; every rank must pass the same values.
#[derive(Clone, Debug, PartialEq)]
pub struct BufferConfig {
    /// Most tokens any rank passes to one dispatch.
    pub max_tokens_per_rank: usize,
    /// Elements per token row (multiple of 8; of 128 for FP8).
    pub hidden: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Experts in total (a multiple of the world size).
    pub num_experts: usize,
    /// Most tokens any rank passes to one low-latency dispatch; 0 (the default) plans no
    /// low-latency memory, and the low-latency ops refuse to run.
    pub ll_max_tokens_per_rank: usize,
    /// Blocks (one per SM) of the dispatch and combine kernels.
    pub num_sms: u32,
    /// Blocks (one per SM) of the low-latency kernels; 0 (the default): every SM this rank may
    /// use, the same on every rank (the GPU's SMs, divided among the ranks that share it under
    /// MPS, and no more blocks than fit at once; `num_sms` on a CPU-proxy transport, whose
    /// copies may need SMs beside the waiting kernels). A low-latency op is bound by latency,
    /// not by bytes: more SMs spread a small batch wider, and its kernels hold them only for
    /// the op.
    pub ll_num_sms: u32,
    /// How ranks agree that memory may be reused (must be one the transport supports).
    pub schedule: Schedule,
    /// Which route reaches a peer where more than one would (the transport must support every
    /// route the plan needs).
    pub routes: RoutePolicy,
    /// How combine moves `y` to the token owners.
    pub combine_staging: CombineStaging,
    /// Bound of every device wait.
    pub timeout: Duration,
    /// Rank masking for the low-latency ops (DeepEP's shrink mode): a peer whose wait expires
    /// in a low-latency op is masked instead of failing the op, and every later low-latency op
    /// skips masked ranks (sends them no rows, waits for nothing from them, and counts their
    /// tokens' and experts' contributions as absent). The mask is read and set with
    /// [`crate::Buffer::ll_masked_ranks`], [`crate::Buffer::ll_set_masked`] and
    /// [`crate::Buffer::ll_clear_mask`]. Off (the default): a late peer fails the op, naming it.
    pub ll_masking: bool,
    /// Rail forwarding of the normal dispatch (docs/internode.md, "Rail forwarding in the flat
    /// dispatch"): over a world of several nodes (the transport's ranks per node), a token
    /// bound for ranks of another node crosses once, to the rank there with this rank's local
    /// index, through a ring of this shape, and that rank stores it into the receive rows of
    /// its node's ranks. The output is the flat dispatch's, bit for bit. `None` (the default):
    /// every rank gets its rows from the source. A forwarding block works on one slot's chunk
    /// at a time, so a ring of fewer slots than [`Self::rail_forward_sms`] leaves blocks idle
    /// (the default number of forwarding blocks is at most the slots).
    /// Experimental: a defect that gave a wrong row (an op ending inside a chunk) is fixed in
    /// the kernel but the fix has not yet run on a GPU (docs/internode.md).
    pub rail_ring: Option<RingShape>,
    /// With [`Self::rail_ring`]: blocks of the dispatch's grid (of [`Self::num_sms`]) that
    /// forward the entries of each other node; the rest send. 0 (the default): half the grid,
    /// split among the other nodes, but no more than the ring's slots
    /// ([`crate::rules::forward_blocks`]). Ignored without forwarding.
    pub rail_forward_sms: u32,
}

impl BufferConfig {
    /// The default [`Self::num_sms`]: blocks (one per SM) of the dispatch and combine kernels
    /// when the caller does not say (the `epcomm` CLI's `--sms` and Python's
    /// `epcomm.DEFAULT_NUM_SMS` default to it too).
    pub const DEFAULT_NUM_SMS: u32 = 24;

    /// A config with [`Self::DEFAULT_NUM_SMS`] SMs (every SM this rank may use for the
    /// low-latency ops), the Epoch schedule, automatic routes, automatic combine staging, a
    /// 100 s timeout and no rank masking.
    pub fn new(
        max_tokens_per_rank: usize,
        hidden: usize,
        top_k: usize,
        num_experts: usize,
    ) -> Self {
        Self {
            max_tokens_per_rank,
            hidden,
            top_k,
            num_experts,
            ll_max_tokens_per_rank: 0,
            num_sms: Self::DEFAULT_NUM_SMS,
            ll_num_sms: 0,
            schedule: Schedule::Epoch,
            routes: RoutePolicy::Auto,
            combine_staging: CombineStaging::Auto,
            timeout: Duration::from_secs(100),
            ll_masking: false,
            rail_ring: None,
            rail_forward_sms: 0,
        }
    }

    /// Checks the values that do not depend on the device or the world.
    pub fn validate(&self) -> Result<()> {
        let bad = |argument, rule: String| Err(Error::InvalidArgument { argument, rule });
        if self.max_tokens_per_rank == 0 {
            return bad("max_tokens_per_rank", "must be > 0".into());
        }
        if self.hidden == 0 || !self.hidden.is_multiple_of(8) {
            return bad(
                "hidden",
                format!("must be a positive multiple of 8 (got {})", self.hidden),
            );
        }
        if self.top_k == 0 || self.top_k > self.num_experts {
            return bad(
                "top_k",
                format!("must be in 1..={} (got {})", self.num_experts, self.top_k),
            );
        }
        if self.ll_max_tokens_per_rank > 0xffff {
            return bad(
                "ll_max_tokens_per_rank",
                format!(
                    "must be at most 65535 (got {})",
                    self.ll_max_tokens_per_rank
                ),
            );
        }
        if self.num_sms == 0 {
            return bad("num_sms", "must be > 0".into());
        }
        if self.timeout.is_zero() {
            return bad("timeout", "must be > 0".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_each_bad_field_by_name() {
        let ok = BufferConfig::new(128, 256, 4, 16);
        ok.validate().unwrap();
        for (cfg, name) in [
            (
                BufferConfig {
                    max_tokens_per_rank: 0,
                    ..ok.clone()
                },
                "max_tokens_per_rank",
            ),
            (
                BufferConfig {
                    hidden: 100,
                    ..ok.clone()
                },
                "hidden",
            ),
            (
                BufferConfig {
                    top_k: 17,
                    ..ok.clone()
                },
                "top_k",
            ),
            (
                BufferConfig {
                    num_sms: 0,
                    ..ok.clone()
                },
                "num_sms",
            ),
            (
                BufferConfig {
                    ll_max_tokens_per_rank: 65536,
                    ..ok.clone()
                },
                "ll_max_tokens_per_rank",
            ),
            (
                BufferConfig {
                    timeout: Duration::ZERO,
                    ..ok.clone()
                },
                "timeout",
            ),
        ] {
            let err = cfg.validate().unwrap_err().to_string();
            assert!(err.contains(name), "{err}");
        }
    }

    #[test]
    fn combine_staging_names_round_trip_and_a_bad_one_is_named() {
        for s in CombineStaging::ALL {
            assert_eq!(s.name().parse::<CombineStaging>().unwrap(), s);
        }
        let err = "ce".parse::<CombineStaging>().unwrap_err().to_string();
        assert!(
            err.contains("combine_staging") && err.contains("copy-engine"),
            "{err}"
        );
    }
}
