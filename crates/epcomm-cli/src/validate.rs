//! Checks of `epcomm bench`'s flags, run by the launcher before any worker is spawned.
//!
//! Every error names the flag as the user typed it (`--tokens`, not `max_tokens_per_rank`).
//! The rules mirror what the library checks later, on the GPU, in the workers
//! (`BufferConfig::validate` and `Buffer::with_transport` in crates/epcomm, `BufferPlan::new`
//! in crates/epcomm-topology, the transports' barrier lists, `Buffer::inject_delay`), so that a
//! bad flag fails in milliseconds with one clear message instead of once per rank.

use std::collections::BTreeSet;
use std::fmt;
use std::path::Path;

use crate::cli::{BenchArgs, TransportArg};
use crate::gpu::GpuInfo;

/// Largest world the kernels support (their shared-memory tables are this large).
pub const MAX_WORLD: usize = epcomm_kernels::abi::MAX_WORLD;
/// Most timed (or warm-up) calls per op.
pub const MAX_ITERS: usize = 10_000;
/// Longest skew-demo delay (`Buffer::inject_delay` takes at most 10 s).
pub const MAX_DELAY_US: u64 = 10_000_000;
/// Skew-demo delay when --delay-us is not given.
pub const DEFAULT_DELAY_US: u64 = 200;
/// Received rows are indexed with 32-bit integers on the device.
const MAX_ROWS: u64 = i32::MAX as u64;

/// One broken rule, naming the flag as typed on the command line.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FlagError {
    /// Below the smallest allowed value.
    #[error("{flag} {value}: must be at least {min}")]
    TooSmall {
        /// The flag, e.g. `--iters`.
        flag: &'static str,
        /// The value given.
        value: u64,
        /// Smallest allowed value.
        min: u64,
    },
    /// Above the largest allowed value.
    #[error("{flag} {value}: must be at most {max} ({why})")]
    TooLarge {
        /// The flag.
        flag: &'static str,
        /// The value given (or the default in effect).
        value: u64,
        /// Largest allowed value.
        max: u64,
        /// Why.
        why: String,
    },
    /// Not a multiple of what it must be a multiple of.
    #[error("{flag} {value}: must be a multiple of {divisor} ({why})")]
    NotMultiple {
        /// The flag.
        flag: &'static str,
        /// The value given.
        value: u64,
        /// The divisor.
        divisor: u64,
        /// Why.
        why: String,
    },
    /// A value this combination of flags cannot use.
    #[error("{flag} {value}: {why}")]
    Unsupported {
        /// The flag.
        flag: &'static str,
        /// The value given.
        value: String,
        /// Why, and what to use instead.
        why: String,
    },
    /// Anything else about one flag.
    #[error("{flag}: {why}")]
    Invalid {
        /// The flag.
        flag: &'static str,
        /// What is wrong.
        why: String,
    },
}

impl FlagError {
    /// The flag the error is about, as typed (`--tokens`).
    pub fn flag(&self) -> &'static str {
        match self {
            Self::TooSmall { flag, .. }
            | Self::TooLarge { flag, .. }
            | Self::NotMultiple { flag, .. }
            | Self::Unsupported { flag, .. }
            | Self::Invalid { flag, .. } => flag,
        }
    }
}

/// Every broken rule found (at least one).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlagErrors(pub Vec<FlagError>);

impl fmt::Display for FlagErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for FlagErrors {}

impl FlagErrors {
    /// The error about `flag`, if any.
    pub fn about(&self, flag: &str) -> Option<&FlagError> {
        self.0.iter().find(|e| e.flag() == flag)
    }
}

/// What is known about the machine (nothing, before the driver is asked).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Machine {
    /// Visible GPUs, when the driver was asked.
    pub gpus: Option<Vec<GpuInfo>>,
    /// Host memory in bytes, when known.
    pub host_memory_bytes: Option<u64>,
}

impl Machine {
    /// This host's memory from `/proc/meminfo` (`MemTotal`), plus the given GPUs.
    pub fn with_gpus(gpus: Vec<GpuInfo>) -> Self {
        Self {
            gpus: Some(gpus),
            host_memory_bytes: std::fs::read_to_string("/proc/meminfo")
                .ok()
                .and_then(|s| parse_mem_total(&s)),
        }
    }
}

/// `MemTotal:  131899704 kB` → bytes.
pub fn parse_mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let mut it = line.split_whitespace().skip(1);
    let v: u64 = it.next()?.parse().ok()?;
    match it.next() {
        Some("kB") | None => v.checked_mul(1024),
        Some(_) => None,
    }
}

/// The validated run: what the workers do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BenchPlan {
    /// Ranks, when known (from --world or the GPU count).
    pub world: Option<usize>,
    /// SM counts to time, in order (one entry without --sweep-sms).
    pub sweep: Vec<u32>,
    /// Whether this is a sweep.
    pub is_sweep: bool,
    /// Skew demo: (late rank, delay in microseconds).
    pub delay: Option<(usize, u64)>,
    /// Whether FP8 dispatch is verified and timed (hidden % 128 == 0).
    pub fp8: bool,
    /// Things worth telling the user (stderr).
    pub notes: Vec<String>,
}

fn gib(bytes: u128) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// Estimated GPU memory one rank needs: the symmetric buffer (`BufferPlan`), the inputs, the
/// timing buffers (L2 flush, combine input and output) and 512 MiB for the context and
/// kernels. `None` when the sizes overflow.
pub fn device_bytes_estimate(
    world: usize,
    tokens: usize,
    hidden: usize,
    top_k: usize,
    experts: usize,
) -> Option<u128> {
    let plan = epcomm_topology::BufferPlan::new(world, tokens, hidden, top_k, experts).ok()?;
    let (w, t, h, k) = (world as u128, tokens as u128, hidden as u128, top_k as u128);
    let inputs = t * (h * 3 + h / 128 * 4 + k * 12);
    let timing = epcomm_check::timing::FLUSH_BYTES as u128 + w * t * h * 2 + t * h * 2;
    Some(u128::from(plan.total_bytes()) + inputs + timing + (512 << 20))
}

/// Estimated host memory of the whole run: every worker generates every rank's inputs (and
/// the reference) on the host, about `world * tokens * hidden * 4` bytes each.
pub fn host_bytes_estimate(world: usize, tokens: usize, hidden: usize) -> u128 {
    let w = world as u128;
    w * w * tokens as u128 * hidden as u128 * 4
}

/// Checks every flag of `epcomm bench`. `world_hint` is the world when --world is not given
/// (the GPU count, or the bootstrap's world in a worker); `machine` what is known of the
/// device (limits that need it are skipped when it is unknown).
///
/// # Errors
/// Every rule broken, each naming its flag.
pub fn validate_bench(
    args: &BenchArgs,
    world_hint: Option<usize>,
    machine: &Machine,
) -> Result<BenchPlan, FlagErrors> {
    let mut errs = Vec::new();
    let mut notes = Vec::new();
    let gpus = machine.gpus.as_deref();

    // --world
    let mut world = args.world.or(world_hint);
    if let Some(w) = world {
        let why_default = if args.world.is_none() {
            " (the default: every visible GPU)"
        } else {
            ""
        };
        let bad = if w == 0 {
            Some(FlagError::TooSmall {
                flag: "--world",
                value: 0,
                min: 1,
            })
        } else if w > MAX_WORLD {
            Some(FlagError::TooLarge {
                flag: "--world",
                value: w as u64,
                max: MAX_WORLD as u64,
                why: format!("the kernels support at most {MAX_WORLD} ranks{why_default}"),
            })
        } else {
            match gpus {
                Some(g) if w > g.len() => Some(FlagError::TooLarge {
                    flag: "--world",
                    value: w as u64,
                    max: g.len() as u64,
                    why: format!(
                        "this machine has {} GPU(s) visible; one rank runs per GPU",
                        g.len()
                    ),
                }),
                _ => None,
            }
        };
        if let Some(e) = bad {
            errs.push(e);
            world = None;
        }
    }
    let used: Option<&[GpuInfo]> = match (gpus, world) {
        (Some(g), Some(w)) => g.get(..w),
        _ => None,
    };
    let min_sms = used.and_then(|g| g.iter().map(|g| g.sms).min());
    let min_mem = used.and_then(|g| g.iter().map(|g| g.memory_bytes).min());

    // --iters, --warmup
    if args.iters == 0 {
        errs.push(FlagError::TooSmall {
            flag: "--iters",
            value: 0,
            min: 1,
        });
    }
    for (flag, v) in [("--iters", args.iters), ("--warmup", args.warmup)] {
        if v > MAX_ITERS {
            errs.push(FlagError::TooLarge {
                flag,
                value: v as u64,
                max: MAX_ITERS as u64,
                why: "calls per op".into(),
            });
        }
    }

    // --tokens
    let mut tokens_ok = true;
    if args.tokens == 0 {
        errs.push(FlagError::TooSmall {
            flag: "--tokens",
            value: 0,
            min: 1,
        });
        tokens_ok = false;
    } else if let Some(w) = world {
        let max = MAX_ROWS / w as u64;
        if args.tokens as u64 > max {
            errs.push(FlagError::TooLarge {
                flag: "--tokens",
                value: args.tokens as u64,
                max,
                why: format!(
                    "a rank receives up to --tokens x --world ({w}) rows, indexed with 32-bit \
                     integers on the GPU"
                ),
            });
            tokens_ok = false;
        }
    }

    // --hidden
    let mut hidden_ok = false;
    let h = args.hidden;
    if h == 0 {
        errs.push(FlagError::TooSmall {
            flag: "--hidden",
            value: 0,
            min: 8,
        });
    } else if !h.is_multiple_of(8) {
        errs.push(FlagError::NotMultiple {
            flag: "--hidden",
            value: h as u64,
            divisor: 8,
            why: "rows move as 16-byte vectors of 8 bf16 values".into(),
        });
    } else if h as u64 * 2 > i32::MAX as u64 {
        errs.push(FlagError::TooLarge {
            flag: "--hidden",
            value: h as u64,
            max: i32::MAX as u64 / 2,
            why: "row bytes are 32-bit integers on the GPU".into(),
        });
    } else {
        hidden_ok = true;
    }
    let fp8 = hidden_ok && h.is_multiple_of(128);
    if hidden_ok && !fp8 {
        notes.push(format!(
            "--hidden {h} is not a multiple of 128: FP8 dispatch (one scale per 128 values) is \
             neither verified nor timed"
        ));
    }

    // --experts, --top-k
    let mut experts_ok = true;
    if args.experts == 0 {
        errs.push(FlagError::TooSmall {
            flag: "--experts",
            value: 0,
            min: 1,
        });
        experts_ok = false;
    } else if args.experts > i32::MAX as usize {
        errs.push(FlagError::TooLarge {
            flag: "--experts",
            value: args.experts as u64,
            max: i32::MAX as u64,
            why: "expert ids are 32-bit integers on the GPU".into(),
        });
        experts_ok = false;
    } else if let Some(w) = world
        && !args.experts.is_multiple_of(w)
    {
        errs.push(FlagError::NotMultiple {
            flag: "--experts",
            value: args.experts as u64,
            divisor: w as u64,
            why: format!("experts are split evenly over the --world {w} ranks"),
        });
        experts_ok = false;
    }
    let mut top_k_ok = true;
    if args.top_k == 0 {
        errs.push(FlagError::TooSmall {
            flag: "--top-k",
            value: 0,
            min: 1,
        });
        top_k_ok = false;
    } else if args.experts > 0 && args.top_k > args.experts {
        errs.push(FlagError::TooLarge {
            flag: "--top-k",
            value: args.top_k as u64,
            max: args.experts as u64,
            why: format!(
                "a token picks distinct experts among --experts {}",
                args.experts
            ),
        });
        top_k_ok = false;
    }

    // --sms / --sweep-sms
    let sms_rule = |flag: &'static str, v: u32, errs: &mut Vec<FlagError>| {
        if v == 0 {
            errs.push(FlagError::TooSmall {
                flag,
                value: 0,
                min: 1,
            });
        } else if let Some(max) = min_sms
            && v > max
        {
            errs.push(FlagError::TooLarge {
                flag,
                value: u64::from(v),
                max: u64::from(max),
                why: format!("the GPU has {max} SMs"),
            });
        }
    };
    let (sweep, is_sweep) = match &args.sweep_sms {
        None => {
            sms_rule("--sms", args.sms, &mut errs);
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
                sms_rule("--sweep-sms", v, &mut errs);
                if !seen.insert(v) {
                    errs.push(FlagError::Invalid {
                        flag: "--sweep-sms",
                        why: format!("{v} is listed twice"),
                    });
                }
            }
            (list.clone(), true)
        }
    };

    // --transport, --virtual-nodes, --barrier
    let vn = args.virtual_nodes;
    if vn == 0 {
        errs.push(FlagError::TooSmall {
            flag: "--virtual-nodes",
            value: 0,
            min: 1,
        });
    } else if vn != 1 && args.transport == TransportArg::Ipc {
        errs.push(FlagError::Unsupported {
            flag: "--virtual-nodes",
            value: vn.to_string(),
            why: "--transport ipc reaches peers by stores only; traffic between (virtual) \
                  nodes needs --transport nvshmem"
                .into(),
        });
    } else if let Some(w) = world
        && !w.is_multiple_of(vn)
    {
        errs.push(FlagError::Unsupported {
            flag: "--virtual-nodes",
            value: vn.to_string(),
            why: format!("must divide --world {w} (every virtual node gets as many GPUs)"),
        });
    }
    if !args.transport.barriers().contains(&args.barrier) {
        let names: Vec<&str> = args.transport.barriers().iter().map(|b| b.name()).collect();
        errs.push(FlagError::Unsupported {
            flag: "--barrier",
            value: args.barrier.name().into(),
            why: format!(
                "--transport {} supports {}; peer-signal needs --transport nvshmem",
                args.transport.name(),
                names.join(", ")
            ),
        });
    }

    // --delay-rank, --delay-us
    let delay_us = args.delay_us.unwrap_or(DEFAULT_DELAY_US);
    if delay_us > MAX_DELAY_US {
        errs.push(FlagError::TooLarge {
            flag: "--delay-us",
            value: delay_us,
            max: MAX_DELAY_US,
            why: "the injected GPU delay is at most 10 s".into(),
        });
    }
    if args.delay_us.is_some() && args.delay_rank.is_none() {
        errs.push(FlagError::Invalid {
            flag: "--delay-us",
            why: "needs --delay-rank".into(),
        });
    }
    if let (Some(r), Some(w)) = (args.delay_rank, world)
        && r >= w
    {
        errs.push(FlagError::TooLarge {
            flag: "--delay-rank",
            value: r as u64,
            max: w as u64 - 1,
            why: format!("ranks are 0..{w} with --world {w}"),
        });
    }

    // Memory, when everything it depends on is valid and the machine is known.
    if let Some(w) = world
        && tokens_ok
        && hidden_ok
        && experts_ok
        && top_k_ok
    {
        match device_bytes_estimate(w, args.tokens, h, args.top_k, args.experts) {
            None => errs.push(FlagError::Invalid {
                flag: "--tokens",
                why: format!(
                    "--tokens {} with --hidden {h} and --world {w}: buffer sizes overflow",
                    args.tokens
                ),
            }),
            Some(need) => {
                if let Some(have) = min_mem
                    && need > u128::from(have)
                {
                    errs.push(FlagError::Invalid {
                        flag: "--tokens",
                        why: format!(
                            "--tokens {} with --hidden {h} and --world {w} needs about {} of GPU \
                             memory per rank; the smallest GPU has {}",
                            args.tokens,
                            gib(need),
                            gib(u128::from(have))
                        ),
                    });
                }
            }
        }
        let host = host_bytes_estimate(w, args.tokens, h);
        if let Some(have) = machine.host_memory_bytes
            && host > u128::from(have)
        {
            errs.push(FlagError::Invalid {
                flag: "--tokens",
                why: format!(
                    "--tokens {} with --hidden {h} and --world {w} needs about {} of host \
                     memory (every worker generates every rank's inputs); this host has {}",
                    args.tokens,
                    gib(host),
                    gib(u128::from(have))
                ),
            });
        }
    }

    // --plot
    if let Some(p) = &args.plot
        && let Some(e) = plot_path_error(p)
    {
        errs.push(e);
    }

    if errs.is_empty() {
        Ok(BenchPlan {
            world,
            sweep,
            is_sweep,
            delay: args.delay_rank.map(|r| (r, delay_us)),
            fp8,
            notes,
        })
    } else {
        Err(FlagErrors(errs))
    }
}

fn plot_path_error(p: &Path) -> Option<FlagError> {
    if p.as_os_str().is_empty() {
        return Some(FlagError::Invalid {
            flag: "--plot",
            why: "empty path".into(),
        });
    }
    if p.is_dir() {
        return Some(FlagError::Invalid {
            flag: "--plot",
            why: format!("{} is a directory; give a file name", p.display()),
        });
    }
    let dir = match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        return Some(FlagError::Invalid {
            flag: "--plot",
            why: format!("directory {} does not exist", dir.display()),
        });
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{BarrierArg, Cli, Command};
    use clap::Parser;

    fn args(extra: &[&str]) -> BenchArgs {
        let mut argv = vec!["epcomm", "bench"];
        argv.extend_from_slice(extra);
        match Cli::try_parse_from(argv) {
            Ok(Cli {
                command: Command::Bench(a),
            }) => a,
            other => panic!("parse failed: {other:?}"),
        }
    }

    fn gpus(n: usize, sms: u32, mem_gib: u64) -> Vec<GpuInfo> {
        (0..n)
            .map(|i| GpuInfo {
                ordinal: i,
                name: "test GPU".into(),
                sms,
                memory_bytes: mem_gib << 30,
                compute_capability: (9, 0),
                pci_bus_id: None,
            })
            .collect()
    }

    /// Validates `extra` (no machine facts) and returns the error about `flag`.
    fn error_about(extra: &[&str], flag: &str) -> FlagError {
        let err =
            validate_bench(&args(extra), None, &Machine::default()).expect_err("expected an error");
        let e = err
            .about(flag)
            .unwrap_or_else(|| panic!("no error about {flag}: {err}"))
            .clone();
        assert!(e.to_string().contains(flag), "{e}");
        assert!(err.to_string().contains(flag), "{err}");
        e
    }

    #[test]
    fn defaults_are_valid() {
        let plan = validate_bench(&args(&["--world", "8"]), None, &Machine::default()).unwrap();
        assert_eq!(plan.world, Some(8));
        assert_eq!(plan.sweep, vec![24]);
        assert!(plan.fp8 && !plan.is_sweep && plan.delay.is_none());
        // Without --world nor a machine, world-dependent rules wait for the GPU count.
        let plan = validate_bench(&args(&[]), None, &Machine::default()).unwrap();
        assert_eq!(plan.world, None);
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
        validate_bench(&args(&["--warmup", "0"]), None, &Machine::default()).unwrap();
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
    fn tokens_over_gpu_memory() {
        let m = Machine {
            gpus: Some(gpus(8, 132, 1)),
            host_memory_bytes: None,
        };
        let err = validate_bench(&args(&["--world", "8"]), None, &m).unwrap_err();
        let e = err.about("--tokens").expect("memory error");
        assert!(e.to_string().contains("GPU memory"), "{e}");
        let m = Machine {
            gpus: Some(gpus(8, 132, 141)),
            host_memory_bytes: Some(1 << 30),
        };
        let err = validate_bench(&args(&["--world", "8"]), None, &m).unwrap_err();
        assert!(err.to_string().contains("host memory"), "{err}");
    }

    #[test]
    fn top_k_over_experts() {
        let e = error_about(&["--top-k", "9", "--experts", "8"], "--top-k");
        assert!(e.to_string().contains("--experts 8"), "{e}");
        error_about(&["--top-k", "0"], "--top-k");
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
    fn hidden_multiple_of_eight_fp8_needs_128() {
        let e = error_about(&["--hidden", "100"], "--hidden");
        assert!(
            matches!(e, FlagError::NotMultiple { divisor: 8, .. }),
            "{e}"
        );
        error_about(&["--hidden", "0"], "--hidden");
        let plan = validate_bench(&args(&["--hidden", "136"]), None, &Machine::default()).unwrap();
        assert!(!plan.fp8);
        assert!(plan.notes.iter().any(|n| n.contains("--hidden 136")));
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
    fn world_zero_over_max_and_over_gpus() {
        error_about(&["--world", "0"], "--world");
        error_about(&["--world", "65"], "--world");
        let m = Machine {
            gpus: Some(gpus(2, 132, 141)),
            host_memory_bytes: None,
        };
        let err = validate_bench(&args(&["--world", "4"]), None, &m).unwrap_err();
        let e = err.about("--world").expect("world error");
        assert!(e.to_string().contains("2 GPU(s)"), "{e}");
    }

    #[test]
    fn virtual_nodes_need_nvshmem_and_must_divide_world() {
        let e = error_about(&["--virtual-nodes", "2"], "--virtual-nodes");
        assert!(e.to_string().contains("nvshmem"), "{e}");
        error_about(&["--virtual-nodes", "0"], "--virtual-nodes");
        error_about(
            &[
                "--transport",
                "nvshmem",
                "--world",
                "4",
                "--virtual-nodes",
                "3",
            ],
            "--virtual-nodes",
        );
        validate_bench(
            &args(&[
                "--transport",
                "nvshmem",
                "--world",
                "4",
                "--virtual-nodes",
                "2",
            ]),
            None,
            &Machine::default(),
        )
        .unwrap();
    }

    #[test]
    fn peer_signal_needs_nvshmem() {
        let e = error_about(&["--barrier", "peer-signal"], "--barrier");
        assert!(e.to_string().contains("--transport nvshmem"), "{e}");
        let a = args(&["--barrier", "peer-signal", "--transport", "nvshmem"]);
        assert_eq!(a.barrier, BarrierArg::PeerSignal);
        validate_bench(&a, None, &Machine::default()).unwrap();
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
        let plan = validate_bench(
            &args(&["--world", "2", "--delay-rank", "1"]),
            None,
            &Machine::default(),
        )
        .unwrap();
        assert_eq!(plan.delay, Some((1, DEFAULT_DELAY_US)));
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
        let plan =
            validate_bench(&args(&["--sweep-sms", "32,16"]), None, &Machine::default()).unwrap();
        assert_eq!(plan.sweep, vec![32, 16]);
        assert!(plan.is_sweep);
    }

    #[test]
    fn plot_directory_must_exist() {
        let e = error_about(
            &[
                "--sweep-sms",
                "16",
                "--plot",
                "/nonexistent-dir-epcomm/x.svg",
            ],
            "--plot",
        );
        assert!(e.to_string().contains("does not exist"), "{e}");
        error_about(&["--sweep-sms", "16", "--plot", "/"], "--plot");
    }

    #[test]
    fn clap_rules_name_the_flags() {
        for (argv, flag) in [
            (vec!["--transport", "tcp"], "--transport"),
            (vec!["--barrier", "fast"], "--barrier"),
            (vec!["--sweep-sms", "16,x"], "--sweep-sms"),
            (vec!["--plot", "a.svg"], "--sweep-sms"),
            (vec!["--json", "--csv"], "--csv"),
            (vec!["--sms", "8", "--sweep-sms", "16"], "--sweep-sms"),
            (vec!["--tokens", "-1"], "--tokens"),
        ] {
            let mut full = vec!["epcomm", "bench"];
            full.extend(argv.iter().copied());
            let err = Cli::try_parse_from(&full).expect_err("clap should reject");
            assert!(err.to_string().contains(flag), "{argv:?}: {err}");
            assert_eq!(err.exit_code(), 2);
        }
    }

    #[test]
    fn every_error_is_reported_at_once() {
        let err = validate_bench(
            &args(&["--iters", "0", "--sms", "0", "--hidden", "12"]),
            None,
            &Machine::default(),
        )
        .unwrap_err();
        for flag in ["--iters", "--sms", "--hidden"] {
            assert!(err.about(flag).is_some(), "{err}");
        }
        assert_eq!(err.to_string().lines().count(), 3);
    }

    #[test]
    fn meminfo_parses() {
        assert_eq!(
            parse_mem_total("MemFree: 1 kB\nMemTotal:  2048 kB\n"),
            Some(2 << 20)
        );
        assert_eq!(parse_mem_total("nothing"), None);
    }
}
