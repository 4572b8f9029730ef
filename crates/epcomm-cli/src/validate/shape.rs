//! Shape and capacity rules: one function per flag group of `epcomm bench` (`--world`,
//! `--iters`/`--warmup`, `--tokens`, `--hidden`, `--experts`, `--top-k`, `--sms`/`--sweep-sms`,
//! `--delay-rank`/`--delay-us`).
//!
//! Contract: each function pushes at most one error per flag (the first rule it breaks, in the
//! order written), and returns whether the flag is usable by the rules that depend on it. Rules
//! that need the world or the GPUs skip while those are unknown. The kernels' limits are here:
//! table sizes ([`MAX_WORLD`]) and 32-bit indices on the GPU; row sizes are `RowFormat`'s.

use std::collections::BTreeSet;

use epcomm_topology::{RowDtype, RowFormat};

use super::FlagError;
use super::errors::first_error;
use crate::cli::BenchArgs;
use crate::gpu::GpuInfo;

/// Largest world the kernels support (their shared-memory tables are this large).
pub const MAX_WORLD: usize = epcomm_kernels::abi::MAX_WORLD;
/// Most timed (or warm-up) calls per op.
pub const MAX_ITERS: usize = 10_000;
/// Longest skew-demo delay (`Buffer::inject_delay` takes at most 10 s).
pub const MAX_DELAY_US: u64 = 10_000_000;
/// Skew-demo delay when --delay-us is not given.
pub const DEFAULT_DELAY_US: u64 = 200;
/// `RowFormat`'s argument, by its flag.
const HIDDEN: &[(&str, &str)] = &[("hidden", "--hidden")];
/// Received rows are indexed with 32-bit integers on the device.
const MAX_ROWS: u64 = i32::MAX as u64;

/// The rule every `--world` obeys (also `epcomm topo`'s): 1 ..= [`MAX_WORLD`].
pub fn world_rule(world: usize, why_suffix: &str) -> Option<FlagError> {
    FlagError::at_least("--world", world as u64, 1).or_else(|| {
        FlagError::at_most(
            "--world",
            world as u64,
            MAX_WORLD as u64,
            format!("the kernels support at most {MAX_WORLD} ranks{why_suffix}"),
        )
    })
}

/// `--world`, or `world_hint` in its place: [`world_rule`]; above the visible GPU count (when
/// `gpus` are known) ranks share GPUs round-robin, and a note in `notes` says so. The world
/// the other rules use: `None` when unknown or broken.
pub(super) fn world(
    args: &BenchArgs,
    world_hint: Option<usize>,
    gpus: Option<&[GpuInfo]>,
    errs: &mut Vec<FlagError>,
    notes: &mut Vec<String>,
) -> Option<usize> {
    let w = args.world.or(world_hint)?;
    let default = if args.world.is_none() {
        " (the default: every visible GPU)"
    } else {
        ""
    };
    first_error(errs, [world_rule(w, default)]).then(|| {
        if let Some(n) = gpus.map(<[GpuInfo]>::len).filter(|&n| n > 0 && w > n) {
            notes.push(format!(
                "--world {w} on {n} GPU(s): ranks share GPUs round-robin (rank r on GPU r % {n}); \
                 the times include that sharing, not the speed of one GPU per rank (without \
                 MPS the ranks of a GPU take turns on it; under MPS they run concurrently)"
            ));
        }
        w
    })
}

/// `--iters` (1 ..= [`MAX_ITERS`]) and `--warmup` (0 ..= [`MAX_ITERS`]).
pub(super) fn iters(args: &BenchArgs, errs: &mut Vec<FlagError>) {
    first_error(
        errs,
        [
            FlagError::at_least("--iters", args.iters as u64, 1),
            FlagError::at_most(
                "--iters",
                args.iters as u64,
                MAX_ITERS as u64,
                "calls per op",
            ),
        ],
    );
    first_error(
        errs,
        [FlagError::at_most(
            "--warmup",
            args.warmup as u64,
            MAX_ITERS as u64,
            "calls per op",
        )],
    );
}

/// `--tokens`: at least 1, and `tokens x world` received rows fit 32-bit indices. True when
/// valid.
pub(super) fn tokens(args: &BenchArgs, world: Option<usize>, errs: &mut Vec<FlagError>) -> bool {
    first_error(
        errs,
        [
            FlagError::at_least("--tokens", args.tokens() as u64, 1),
            world.and_then(|w| {
                FlagError::at_most(
                    "--tokens",
                    args.tokens() as u64,
                    MAX_ROWS / w as u64,
                    format!(
                        "a rank receives up to --tokens x --world ({w}) rows, indexed with 32-bit \
                         integers on the GPU"
                    ),
                )
            }),
        ],
    )
}

/// `--tokens` under `--low-latency` (skipped without it, or while `--experts` is broken): at
/// most the library's limit for this shape ([`epcomm::rules::ll_max_tokens_limit`]: the
/// routing bitmaps must fit in the kernels' shared memory). While the world is unknown, the
/// limit of one rank (the largest of any world) is checked; the exact one once it is known.
pub(super) fn low_latency_tokens(
    args: &BenchArgs,
    world: Option<usize>,
    experts_ok: bool,
    errs: &mut Vec<FlagError>,
) {
    if !args.low_latency || !experts_ok {
        return;
    }
    let (e, t) = (args.experts, args.tokens());
    let limit = epcomm::rules::ll_max_tokens_limit(e, world.unwrap_or(1));
    let ranks = world.map_or_else(|| "any --world".into(), |w| format!("--world {w}"));
    let bytes = epcomm_kernels::LL_MAX_SMEM_BYTES;
    first_error(
        errs,
        [FlagError::at_most(
            "--tokens",
            t as u64,
            limit as u64,
            format!(
                "the most for --low-latency with --experts {e} on {ranks}: the routing bitmaps, \
                 (experts + ranks) x ceil(tokens / 32) words, must fit in {bytes} bytes of \
                 shared memory; low-latency ops are for decode batches"
            ),
        )],
    );
}

/// `--hidden`: the library's row rules, then 32-bit row bytes on the GPU. Returns (valid,
/// FP8 too); a valid `--hidden` that FP8 rows refuse adds a note instead of an error.
pub(super) fn hidden(
    args: &BenchArgs,
    errs: &mut Vec<FlagError>,
    notes: &mut Vec<String>,
) -> (bool, bool) {
    let h = args.hidden;
    let hidden_ok = match RowFormat::new(h, RowDtype::Bf16) {
        Err(e) => {
            errs.push(FlagError::from_topology(&e, HIDDEN));
            false
        }
        Ok(row) => first_error(
            errs,
            [FlagError::at_most(
                "--hidden",
                row.x_bytes() as u64,
                i32::MAX as u64,
                "row bytes are 32-bit integers on the GPU",
            )],
        ),
    };
    let fp8 = match RowFormat::new(h, RowDtype::Fp8) {
        Ok(_) => hidden_ok,
        Err(e) => {
            if hidden_ok {
                notes.push(format!(
                    "{}: FP8 dispatch is neither verified nor timed",
                    FlagError::from_topology(&e, HIDDEN)
                ));
            }
            false
        }
    };
    (hidden_ok, fp8)
}

/// `--experts`: 1 ..= `i32::MAX`, split evenly over the world. True when valid.
pub(super) fn experts(args: &BenchArgs, world: Option<usize>, errs: &mut Vec<FlagError>) -> bool {
    first_error(
        errs,
        [
            FlagError::at_least("--experts", args.experts as u64, 1),
            FlagError::at_most(
                "--experts",
                args.experts as u64,
                i32::MAX as u64,
                "expert ids are 32-bit integers on the GPU",
            ),
            world.and_then(|w| {
                FlagError::multiple_of(
                    "--experts",
                    args.experts as u64,
                    w as u64,
                    format!("experts are split evenly over the --world {w} ranks"),
                )
            }),
        ],
    )
}

/// `--top-k`: 1 ..= `--experts` (distinct experts per token). True when valid.
pub(super) fn top_k(args: &BenchArgs, errs: &mut Vec<FlagError>) -> bool {
    first_error(
        errs,
        [
            FlagError::at_least("--top-k", args.top_k as u64, 1),
            (args.experts > 0)
                .then(|| {
                    FlagError::at_most(
                        "--top-k",
                        args.top_k as u64,
                        args.experts as u64,
                        format!(
                            "a token picks distinct experts among --experts {}",
                            args.experts
                        ),
                    )
                })
                .flatten(),
        ],
    )
}

/// The most SMs one op may use, with the reason: the smallest used GPU's SM count, or under
/// MPS, where the ranks sharing a GPU run at the same time, that count divided among them (an
/// op's blocks wait for its peers' blocks, so every rank's blocks must be resident together;
/// without MPS the ranks take turns and each has the whole GPU in its turn).
pub(super) fn sm_limit(
    machine: &super::Machine,
    world: Option<usize>,
    min_sms: Option<u32>,
) -> Option<(u32, String)> {
    let max = min_sms?;
    let gpus = machine.gpus.as_deref().filter(|g| !g.is_empty());
    let shared = match (gpus, world) {
        (Some(g), Some(w)) if w > g.len() && g.iter().any(|g| g.mps) => w.div_ceil(g.len()),
        _ => 1,
    };
    Some(if shared > 1 {
        let each = max / shared as u32;
        (
            each,
            format!(
                "under MPS the {shared} ranks sharing a GPU run at the same time, so their \
                 blocks must fit on its {max} SMs together ({each} each)"
            ),
        )
    } else {
        (max, format!("the GPU has {max} SMs"))
    })
}

/// `--sms`, or every value of `--sweep-sms` (listed once each): 1 ..= the limit
/// ([`sm_limit`], when known). Returns the SM counts to time, in order, and whether this is a
/// sweep.
pub(super) fn sms(
    args: &BenchArgs,
    limit: Option<(u32, String)>,
    errs: &mut Vec<FlagError>,
) -> (Vec<u32>, bool) {
    let sms_rule = |flag: &'static str, v: u32, errs: &mut Vec<FlagError>| {
        first_error(
            errs,
            [
                FlagError::at_least(flag, u64::from(v), 1),
                limit.as_ref().and_then(|(max, why)| {
                    FlagError::at_most(flag, u64::from(v), u64::from(*max), why.clone())
                }),
            ],
        );
    };
    match &args.sweep_sms {
        None => {
            sms_rule("--sms", args.sms, errs);
            (vec![args.sms], false)
        }
        Some(list) => {
            if list.is_empty() {
                errs.push(FlagError::Invalid {
                    flag: "--sweep-sms",
                    why: "give at least one SM count, e.g. --sweep-sms 16,24,32".into(),
                });
            }
            let mut seen = BTreeSet::new();
            for &v in list {
                sms_rule("--sweep-sms", v, errs);
                if !seen.insert(v) {
                    errs.push(FlagError::Invalid {
                        flag: "--sweep-sms",
                        why: format!("{v} is listed twice"),
                    });
                }
            }
            (list.clone(), true)
        }
    }
}

/// `--delay-us` (at most [`MAX_DELAY_US`], only with `--delay-rank`) and `--delay-rank` (a
/// rank of the world, when known). Returns the delay in effect ([`DEFAULT_DELAY_US`] unless
/// given).
pub(super) fn delay(args: &BenchArgs, world: Option<usize>, errs: &mut Vec<FlagError>) -> u64 {
    let delay_us = args.delay_us.unwrap_or(DEFAULT_DELAY_US);
    first_error(
        errs,
        [FlagError::at_most(
            "--delay-us",
            delay_us,
            MAX_DELAY_US,
            "the injected GPU delay is at most 10 s",
        )],
    );
    if args.delay_us.is_some() && args.delay_rank.is_none() {
        errs.push(FlagError::Invalid {
            flag: "--delay-us",
            why: "needs --delay-rank".into(),
        });
    }
    if let (Some(r), Some(w)) = (args.delay_rank, world) {
        first_error(
            errs,
            [FlagError::at_most(
                "--delay-rank",
                r as u64,
                w as u64 - 1,
                format!("ranks are 0..{w} with --world {w}"),
            )],
        );
    }
    delay_us
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{args, error_about, gpus, valid};
    use super::super::{Machine, validate_bench};
    use super::*;

    #[test]
    fn world_zero_over_max_and_shared_gpus() {
        error_about(&["--world", "0"], "--world");
        error_about(&["--world", "65"], "--world");
        let m = Machine {
            gpus: Some(gpus(2, 132, 141)),
            host_memory_bytes: None,
        };
        // Four ranks on two GPUs: round-robin, with a note that says so.
        let plan = validate_bench(&args(&["--world", "4"]), None, &m).unwrap();
        assert_eq!(plan.world, Some(4));
        assert!(
            plan.notes.iter().any(|n| n.contains("on 2 GPU(s)")),
            "{:?}",
            plan.notes
        );
    }

    #[test]
    fn ranks_sharing_a_gpu_under_mps_split_its_sms() {
        let mut one = gpus(1, 132, 141);
        let plain = Machine {
            gpus: Some(one.clone()),
            host_memory_bytes: None,
        };
        one[0].mps = true;
        let mps = Machine {
            gpus: Some(one),
            host_memory_bytes: None,
        };
        let a = |sms: &str| args(&["--world", "2", "--sms", sms, "--tokens", "128"]);
        // Taking turns, each rank has the whole GPU in its turn.
        assert!(validate_bench(&a("100"), None, &plain).is_ok());
        // Under MPS both ranks' blocks must be resident together: 66 each at most.
        let err = validate_bench(&a("100"), None, &mps).unwrap_err();
        let e = err.about("--sms").expect("sms error");
        assert!(e.to_string().contains("under MPS"), "{e}");
        assert!(validate_bench(&a("66"), None, &mps).is_ok());
        // One rank per GPU: MPS changes nothing.
        let b = args(&["--world", "1", "--sms", "100", "--tokens", "128"]);
        assert!(validate_bench(&b, None, &mps).is_ok());
    }

    #[test]
    fn iters_zero_and_too_many() {
        assert!(matches!(
            error_about(&["--iters", "0"], "--iters"),
            FlagError::TooSmall { value: 0, .. }
        ));
        error_about(&["--iters", "10001"], "--iters");
    }

    #[test]
    fn warmup_too_many() {
        error_about(&["--warmup", "10001"], "--warmup");
        valid(&["--warmup", "0"]);
    }

    #[test]
    fn tokens_zero_and_over_the_row_limit() {
        error_about(&["--tokens", "0"], "--tokens");
        let e = error_about(&["--world", "2", "--tokens", "1073741824"], "--tokens");
        assert!(
            matches!(
                e,
                FlagError::TooLarge {
                    max: 1073741823,
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn low_latency_tokens_fit_the_routing_bitmaps() {
        // The default under --low-latency is a decode batch, and it passes.
        let plan = valid(&["--low-latency", "--world", "2"]);
        assert_eq!(plan.world, Some(2));
        assert_eq!(args(&["--low-latency"]).tokens(), 128);
        assert_eq!(args(&[]).tokens(), 4096);
        // Past the limit of this shape: one error naming --tokens and the maximum, with or
        // without a world.
        for extra in [
            &["--tokens", "4096"][..],
            &["--tokens", "993", "--world", "8"],
        ] {
            let e = error_about(&[&["--low-latency"], extra].concat(), "--tokens");
            assert!(
                matches!(e, FlagError::TooLarge { max: 992, .. }),
                "{extra:?}: {e}"
            );
        }
        valid(&["--low-latency", "--tokens", "992", "--world", "8"]);
        // Larger worlds leave fewer tokens: (256 + 64) x 25 words fit, not 26.
        let e = error_about(
            &["--low-latency", "--tokens", "992", "--world", "64"],
            "--tokens",
        );
        assert!(matches!(e, FlagError::TooLarge { max: 800, .. }), "{e}");
        // Without --low-latency 4096 tokens are fine.
        valid(&["--tokens", "4096", "--world", "2"]);
    }

    #[test]
    fn hidden_multiple_of_eight_fp8_needs_128() {
        let e = error_about(&["--hidden", "100"], "--hidden");
        assert!(
            matches!(e, FlagError::NotMultiple { divisor: 8, .. }),
            "{e}"
        );
        error_about(&["--hidden", "0"], "--hidden");
        let plan = valid(&["--hidden", "136"]);
        assert!(!plan.fp8);
        assert!(plan.notes.iter().any(|n| n.contains("--hidden 136")));
    }

    #[test]
    fn experts_not_a_multiple_of_world() {
        let e = error_about(&["--world", "3", "--experts", "256"], "--experts");
        assert!(
            matches!(e, FlagError::NotMultiple { divisor: 3, .. }),
            "{e}"
        );
        error_about(&["--experts", "0"], "--experts");
        // The GPU count stands in for --world.
        let err =
            validate_bench(&args(&["--experts", "256"]), Some(3), &Machine::default()).unwrap_err();
        assert!(err.about("--experts").is_some(), "{err}");
    }

    #[test]
    fn top_k_over_experts() {
        let e = error_about(&["--top-k", "9", "--experts", "8"], "--top-k");
        assert!(e.to_string().contains("--experts 8"), "{e}");
        error_about(&["--top-k", "0"], "--top-k");
    }

    #[test]
    fn sms_zero_and_over_the_device() {
        error_about(&["--sms", "0"], "--sms");
        let m = Machine {
            gpus: Some(gpus(2, 132, 141)),
            host_memory_bytes: None,
        };
        let err = validate_bench(&args(&["--world", "2", "--sms", "200"]), None, &m).unwrap_err();
        let e = err.about("--sms").expect("sms error");
        assert!(e.to_string().contains("132 SMs"), "{e}");
    }

    #[test]
    fn sweep_values_zero_duplicate_and_over_the_device() {
        error_about(&["--sweep-sms", "16,0,32"], "--sweep-sms");
        let e = error_about(&["--sweep-sms", "16,16"], "--sweep-sms");
        assert!(e.to_string().contains("twice"), "{e}");
        let m = Machine {
            gpus: Some(gpus(1, 132, 141)),
            host_memory_bytes: None,
        };
        let err = validate_bench(&args(&["--world", "1", "--sweep-sms", "24,264"]), None, &m)
            .unwrap_err();
        assert!(err.about("--sweep-sms").is_some(), "{err}");
        let plan = valid(&["--sweep-sms", "32,16"]);
        assert_eq!(plan.sweep, vec![32, 16]);
        assert!(plan.is_sweep);
    }

    #[test]
    fn delay_rank_beyond_world() {
        let e = error_about(&["--world", "2", "--delay-rank", "2"], "--delay-rank");
        assert!(matches!(e, FlagError::TooLarge { max: 1, .. }), "{e}");
        error_about(
            &[
                "--world",
                "2",
                "--delay-rank",
                "1",
                "--delay-us",
                "10000001",
            ],
            "--delay-us",
        );
        let plan = valid(&["--world", "2", "--delay-rank", "1"]);
        assert_eq!(plan.delay, Some((1, DEFAULT_DELAY_US)));
    }
}
