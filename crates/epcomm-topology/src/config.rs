//! Kernel launch configuration and the bandwidth model that suggests one.

use crate::{Result, TopologyError};

/// Default upper bound on the SMs [`CommConfig::suggest`] hands to communication (the rest
/// stay with the model's compute kernels). Matches the SM budget of DeepEP's anchors.
pub const DEFAULT_SM_CAP: u32 = 24;

/// Default threads per block of the communication kernels.
pub const DEFAULT_THREADS_PER_BLOCK: u32 = 512;

/// Largest accepted [`CommConfig::chunk_tokens`]. A chunk is the unit after which a sender
/// publishes progress (one count/flag store); beyond a few thousand tokens a chunk is as
/// large as a whole rank's batch and pipelining is gone.
pub const MAX_CHUNK_TOKENS: u32 = 8192;

/// Bytes a chunk should carry in the bandwidth model: one progress publish (a release store
/// the receiver must observe, ~1–2 µs end to end) per ~128 KiB keeps publishing overhead
/// around 10% at ~12 GB/s of stores per SM.
pub const TARGET_CHUNK_BYTES: usize = 128 * 1024;

/// Launch knobs of the dispatch/combine kernels.
///
/// Every rank must use the same values (they size and address the shared buffers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CommConfig {
    /// Thread blocks (one per SM) the communication kernels launch.
    pub num_sms: u32,
    /// Tokens a block copies before publishing progress to the receiver.
    pub chunk_tokens: u32,
    /// Upper bound on tokens any rank passes to one op (sizes the receive slots).
    pub max_tokens_per_rank: usize,
    /// Threads per block (a multiple of the warp size).
    pub threads_per_block: u32,
}

impl CommConfig {
    /// Checks every field against the device.
    ///
    /// Rules: `device_sm_count > 0`; `1 <= num_sms <= device_sm_count` (no parity rule: the
    /// fixed-slot kernels do not pair SMs into sender/receiver channels);
    /// `1 <= chunk_tokens <= MAX_CHUNK_TOKENS`; `1 <= max_tokens_per_rank <= i32::MAX`
    /// (source token indices travel as `i32`); `threads_per_block` a multiple of 32 in
    /// `[32, 1024]`.
    ///
    /// # Errors
    /// The first rule broken, naming the field.
    pub fn validate(&self, device_sm_count: u32) -> Result<()> {
        TopologyError::zero_check("device_sm_count", device_sm_count as usize)?;
        range_check(
            "num_sms",
            self.num_sms.into(),
            1,
            device_sm_count.into(),
            "one block per SM, at most the device's SM count",
        )?;
        range_check(
            "chunk_tokens",
            self.chunk_tokens.into(),
            1,
            MAX_CHUNK_TOKENS.into(),
            "a chunk holds at least one token and at most MAX_CHUNK_TOKENS",
        )?;
        range_check(
            "max_tokens_per_rank",
            self.max_tokens_per_rank as u64,
            1,
            i32::MAX as u64,
            "source token indices are carried as i32",
        )?;
        range_check(
            "threads_per_block",
            self.threads_per_block.into(),
            32,
            1024,
            "CUDA block size limits",
        )?;
        TopologyError::multiple_check(
            "threads_per_block",
            self.threads_per_block as usize,
            "warp size",
            32,
        )?;
        Ok(())
    }

    /// Suggests a configuration from a simple bandwidth model.
    ///
    /// **Model.** Communication is store-bound on the sending SMs and link-bound on NVLink.
    /// One SM issuing stores to a peer sustains about `per_sm_store_gbps` (measured on
    /// H200: ~281 GB/s with 24 blocks of plain 16-byte stores, i.e. ~11.7 GB/s per SM), and
    /// the link drains `nvlink_gbps_per_direction`. More SMs than
    /// `ceil(nvlink_gbps_per_direction / per_sm_store_gbps)` cannot make the transfer faster,
    /// fewer leave the link idle, so the suggestion is that count, clamped to
    /// `[1, min(sm_cap, device_sm_count, tokens_per_rank)]` (a block without a token has
    /// nothing to do). Pass [`DEFAULT_SM_CAP`] as `sm_cap` to stay within DeepEP's budget.
    ///
    /// `chunk_tokens` is the number of tokens carrying about [`TARGET_CHUNK_BYTES`]
    /// (`ceil(TARGET_CHUNK_BYTES / hidden_bytes_per_token)`), but no more than one block's
    /// share of the batch (`ceil(tokens_per_rank / num_sms)`) so every block publishes at
    /// least once per op, and within `[1, MAX_CHUNK_TOKENS]`.
    ///
    /// `world_size` does not change the SM count (every rank drives its own link); it is
    /// validated so the configuration belongs to a real world. `max_tokens_per_rank` is
    /// `tokens_per_rank`; `threads_per_block` is [`DEFAULT_THREADS_PER_BLOCK`].
    ///
    /// The result always passes [`validate`](Self::validate) for `device_sm_count`.
    ///
    /// # Errors
    /// `world_size`, `hidden_bytes_per_token`, `tokens_per_rank`, `device_sm_count`,
    /// `sm_cap` must be > 0; both bandwidths finite and > 0; `tokens_per_rank <= i32::MAX`.
    pub fn suggest(
        world_size: usize,
        hidden_bytes_per_token: usize,
        tokens_per_rank: usize,
        device_sm_count: u32,
        nvlink_gbps_per_direction: f64,
        per_sm_store_gbps: f64,
        sm_cap: u32,
    ) -> Result<CommConfig> {
        TopologyError::zero_check("world_size", world_size)?;
        TopologyError::zero_check("hidden_bytes_per_token", hidden_bytes_per_token)?;
        TopologyError::zero_check("tokens_per_rank", tokens_per_rank)?;
        TopologyError::zero_check("device_sm_count", device_sm_count as usize)?;
        TopologyError::zero_check("sm_cap", sm_cap as usize)?;
        positive_finite("nvlink_gbps_per_direction", nvlink_gbps_per_direction)?;
        positive_finite("per_sm_store_gbps", per_sm_store_gbps)?;
        range_check(
            "tokens_per_rank",
            tokens_per_rank as u64,
            1,
            i32::MAX as u64,
            "source token indices are carried as i32",
        )?;

        let ratio = nvlink_gbps_per_direction / per_sm_store_gbps;
        // Values within 1e-9 of an integer count as that integer (float noise must not add
        // an SM). The ratio is finite and positive; clamp before converting.
        let needed = (ratio - 1e-9).ceil().clamp(1.0, f64::from(u32::MAX)) as u32;
        let tokens_bound = u32::try_from(tokens_per_rank).unwrap_or(u32::MAX);
        let num_sms = needed
            .min(sm_cap)
            .min(device_sm_count)
            .min(tokens_bound)
            .max(1);

        let by_bytes = TARGET_CHUNK_BYTES.div_ceil(hidden_bytes_per_token);
        let per_block = tokens_per_rank.div_ceil(num_sms as usize);
        let chunk = by_bytes.min(per_block).clamp(1, MAX_CHUNK_TOKENS as usize);

        Ok(CommConfig {
            num_sms,
            chunk_tokens: chunk as u32,
            max_tokens_per_rank: tokens_per_rank,
            threads_per_block: DEFAULT_THREADS_PER_BLOCK,
        })
    }
}

fn range_check(
    arg: &'static str,
    value: u64,
    min: u64,
    max: u64,
    rule: &'static str,
) -> Result<()> {
    if (min..=max).contains(&value) {
        Ok(())
    } else {
        Err(TopologyError::OutOfRange {
            arg,
            value,
            min,
            max,
            rule,
        })
    }
}

fn positive_finite(arg: &'static str, value: f64) -> Result<()> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(TopologyError::NotPositiveFinite { arg, value })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn good() -> CommConfig {
        CommConfig {
            num_sms: 24,
            chunk_tokens: 8,
            max_tokens_per_rank: 4096,
            threads_per_block: 512,
        }
    }

    #[test]
    fn validate_accepts_good_and_odd_sm_counts() {
        good().validate(132).unwrap();
        CommConfig {
            num_sms: 1,
            ..good()
        }
        .validate(132)
        .unwrap();
        CommConfig {
            num_sms: 23,
            ..good()
        }
        .validate(132)
        .unwrap();
        CommConfig {
            num_sms: 132,
            ..good()
        }
        .validate(132)
        .unwrap();
    }

    #[test]
    fn validate_rejects_each_rule() {
        let field = |c: CommConfig, sms: u32| match c.validate(sms) {
            Err(TopologyError::OutOfRange { arg, .. }) => arg,
            Err(TopologyError::Zero { arg }) => arg,
            Err(TopologyError::NotMultiple { arg, .. }) => arg,
            other => panic!("unexpected {other:?}"),
        };
        assert_eq!(field(good(), 0), "device_sm_count");
        assert_eq!(
            field(
                CommConfig {
                    num_sms: 0,
                    ..good()
                },
                132
            ),
            "num_sms"
        );
        assert_eq!(
            field(
                CommConfig {
                    num_sms: 133,
                    ..good()
                },
                132
            ),
            "num_sms"
        );
        assert_eq!(
            field(
                CommConfig {
                    chunk_tokens: 0,
                    ..good()
                },
                132
            ),
            "chunk_tokens"
        );
        assert_eq!(
            field(
                CommConfig {
                    chunk_tokens: MAX_CHUNK_TOKENS + 1,
                    ..good()
                },
                132
            ),
            "chunk_tokens"
        );
        assert_eq!(
            field(
                CommConfig {
                    max_tokens_per_rank: 0,
                    ..good()
                },
                132
            ),
            "max_tokens_per_rank"
        );
        assert_eq!(
            field(
                CommConfig {
                    max_tokens_per_rank: i32::MAX as usize + 1,
                    ..good()
                },
                132
            ),
            "max_tokens_per_rank"
        );
        assert_eq!(
            field(
                CommConfig {
                    threads_per_block: 16,
                    ..good()
                },
                132
            ),
            "threads_per_block"
        );
        assert_eq!(
            field(
                CommConfig {
                    threads_per_block: 2048,
                    ..good()
                },
                132
            ),
            "threads_per_block"
        );
        assert_eq!(
            field(
                CommConfig {
                    threads_per_block: 100,
                    ..good()
                },
                132
            ),
            "threads_per_block"
        );
        let msg = CommConfig {
            num_sms: 200,
            ..good()
        }
        .validate(132)
        .unwrap_err()
        .to_string();
        assert!(
            msg.contains("num_sms") && msg.contains("200") && msg.contains("132"),
            "{msg}"
        );
    }

    #[test]
    fn suggest_h200_deepseek_is_capped_at_24() {
        // 7168 bf16 channels, 4096 tokens, H200: 478 GB/s link, ~11.7 GB/s per SM.
        let c = CommConfig::suggest(2, 7168 * 2, 4096, 132, 478.0, 281.0 / 24.0, DEFAULT_SM_CAP)
            .unwrap();
        assert_eq!(c.num_sms, 24);
        // 128 KiB / 14336 B = 9.14 -> 10 tokens.
        assert_eq!(c.chunk_tokens, 10);
        assert_eq!(c.max_tokens_per_rank, 4096);
        assert_eq!(c.threads_per_block, DEFAULT_THREADS_PER_BLOCK);
        c.validate(132).unwrap();
        // With a larger cap the model's own answer shows: ceil(478 / 11.708) = 41.
        let c = CommConfig::suggest(2, 7168 * 2, 4096, 132, 478.0, 281.0 / 24.0, 64).unwrap();
        assert_eq!(c.num_sms, 41);
    }

    #[test]
    fn suggest_fewest_sms_covering_link() {
        let s = |link: f64, per_sm: f64| {
            CommConfig::suggest(8, 4096, 4096, 132, link, per_sm, 132)
                .unwrap()
                .num_sms
        };
        assert_eq!(s(100.0, 10.0), 10);
        assert_eq!(s(100.0, 9.9), 11);
        assert_eq!(s(100.0, 1000.0), 1);
        assert_eq!(s(160.0, 20.0), 8);
        // Never above the device.
        assert_eq!(s(1.0e6, 1.0), 132);
    }

    #[test]
    fn suggest_small_batches() {
        // 3 tokens: at most 3 blocks, each chunk one token.
        let c = CommConfig::suggest(2, 14336, 3, 132, 478.0, 10.0, 24).unwrap();
        assert_eq!(c.num_sms, 3);
        assert_eq!(c.chunk_tokens, 1);
        // Decode shape: 128 tokens, 24 blocks -> share 6 tokens, bytes say 10 -> 6.
        let c = CommConfig::suggest(2, 14336, 128, 132, 478.0, 10.0, 24).unwrap();
        assert_eq!(c.num_sms, 24);
        assert_eq!(c.chunk_tokens, 6);
        // Tiny tokens: bytes say 131072, capped at MAX_CHUNK_TOKENS or the block share.
        let c = CommConfig::suggest(1, 1, 1 << 20, 132, 10.0, 10.0, 24).unwrap();
        assert_eq!(c.num_sms, 1);
        assert_eq!(c.chunk_tokens, MAX_CHUNK_TOKENS);
    }

    #[test]
    fn suggest_errors() {
        let ok = |w, h, t, d, l, p, c| CommConfig::suggest(w, h, t, d, l, p, c);
        assert_eq!(
            ok(0, 1, 1, 1, 1.0, 1.0, 1),
            Err(TopologyError::Zero { arg: "world_size" })
        );
        assert_eq!(
            ok(1, 0, 1, 1, 1.0, 1.0, 1),
            Err(TopologyError::Zero {
                arg: "hidden_bytes_per_token"
            })
        );
        assert_eq!(
            ok(1, 1, 0, 1, 1.0, 1.0, 1),
            Err(TopologyError::Zero {
                arg: "tokens_per_rank"
            })
        );
        assert_eq!(
            ok(1, 1, 1, 0, 1.0, 1.0, 1),
            Err(TopologyError::Zero {
                arg: "device_sm_count"
            })
        );
        assert_eq!(
            ok(1, 1, 1, 1, 1.0, 1.0, 0),
            Err(TopologyError::Zero { arg: "sm_cap" })
        );
        assert!(matches!(
            ok(1, 1, 1, 1, f64::NAN, 1.0, 1),
            Err(TopologyError::NotPositiveFinite {
                arg: "nvlink_gbps_per_direction",
                ..
            })
        ));
        assert!(matches!(
            ok(1, 1, 1, 1, 1.0, -1.0, 1),
            Err(TopologyError::NotPositiveFinite {
                arg: "per_sm_store_gbps",
                ..
            })
        ));
        assert!(matches!(
            ok(1, 1, 1, 1, 1.0, f64::INFINITY, 1),
            Err(TopologyError::NotPositiveFinite { .. })
        ));
        assert!(matches!(
            ok(1, 1, i32::MAX as usize + 1, 1, 1.0, 1.0, 1),
            Err(TopologyError::OutOfRange {
                arg: "tokens_per_rank",
                ..
            })
        ));
    }

    proptest! {
        #[test]
        fn suggest_always_valid_and_minimal(
            world in 1usize..64,
            hidden_bytes in 1usize..100_000,
            tokens in 1usize..100_000,
            device in 1u32..200,
            link in 0.1f64..2000.0,
            per_sm in 0.1f64..100.0,
            cap in 1u32..200,
        ) {
            let c = CommConfig::suggest(world, hidden_bytes, tokens, device, link, per_sm, cap)
                .unwrap();
            c.validate(device).unwrap();
            prop_assert!(c.num_sms <= cap && c.num_sms <= device);
            prop_assert!(c.num_sms as usize <= tokens);
            // Minimal: one SM fewer would not cover the link (unless clamped to 1).
            if c.num_sms > 1 {
                prop_assert!(f64::from(c.num_sms - 1) * per_sm < link + 1e-6);
            }
            // Either the link is covered, or a cap bound it.
            let covered = f64::from(c.num_sms) * per_sm + 1e-6 >= link;
            prop_assert!(covered || c.num_sms == cap || c.num_sms == device
                || c.num_sms as usize == tokens);
            prop_assert!(c.chunk_tokens as usize <= tokens.div_ceil(c.num_sms as usize));
        }
    }
}
