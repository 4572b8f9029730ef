//! Buffer configuration and receive-count modes.

use std::time::Duration;

use epcomm_topology::{RoutePolicy, Schedule};

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
    /// How ranks agree that memory may be reused (must be one the transport supports).
    pub schedule: Schedule,
    /// Which route reaches a peer where more than one would (the transport must support every
    /// route the plan needs).
    pub routes: RoutePolicy,
    /// Bound of every device wait.
    pub timeout: Duration,
}

impl BufferConfig {
    /// A config with 24 SMs, the Epoch schedule, automatic routes and a 100 s timeout.
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
            num_sms: 24,
            schedule: Schedule::Epoch,
            routes: RoutePolicy::Auto,
            timeout: Duration::from_secs(100),
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
}
