//! Checks of `epcomm bench`'s flags, run by the launcher before any worker is spawned.
//!
//! Every error names the flag as the user typed it (`--tokens`, not `max_tokens_per_rank`).
//! Transport, schedule and routes are checked by the library itself, without a GPU: the spec's
//! `capabilities()`, its `world_layout(...)` and `RoutePlan::new` ([`TransportChoice`]); row
//! sizes by `RowFormat`, buffer sizes by `BufferPlan`. What remains here are the CLI's own
//! limits (kernel table sizes, 32-bit indices, the machine's GPUs and memory), so that a bad
//! flag fails in milliseconds with one clear message instead of once per rank.

use std::collections::BTreeSet;
use std::fmt;
use std::path::Path;

use epcomm_backends::{Capabilities, TransportError, TransportSpec, VirtualNodes};
use epcomm_topology::{
    RoutePlan, RoutePolicy, RowDtype, RowFormat, Schedule, TopologyError, WorldLayout,
};

use crate::cli::{BenchArgs, TransportFlags};
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

    /// `value < min`: the error, else `None`.
    pub fn at_least(flag: &'static str, value: u64, min: u64) -> Option<Self> {
        (value < min).then_some(Self::TooSmall { flag, value, min })
    }

    /// `value > max`: the error (with why), else `None`.
    pub fn at_most(
        flag: &'static str,
        value: u64,
        max: u64,
        why: impl Into<String>,
    ) -> Option<Self> {
        (value > max).then(|| Self::TooLarge {
            flag,
            value,
            max,
            why: why.into(),
        })
    }

    /// `value` not a multiple of `divisor` (> 0): the error, else `None`.
    pub fn multiple_of(
        flag: &'static str,
        value: u64,
        divisor: u64,
        why: impl Into<String>,
    ) -> Option<Self> {
        (!value.is_multiple_of(divisor)).then(|| Self::NotMultiple {
            flag,
            value,
            divisor,
            why: why.into(),
        })
    }

    /// A library rule broken by an argument, as the error of that argument's flag: `flags`
    /// maps the library's argument names to flags (the first one stands in for an argument it
    /// does not list).
    pub fn from_topology(e: &TopologyError, flags: &[(&str, &'static str)]) -> Self {
        let flag_of = |arg: &str| flags.iter().find(|(a, _)| *a == arg).map(|(_, f)| *f);
        let named = |arg: &'static str| flag_of(arg).unwrap_or(arg);
        let flag = topology_arg(e)
            .and_then(flag_of)
            .or_else(|| flags.first().map(|(_, f)| *f))
            .unwrap_or("--");
        match *e {
            TopologyError::Zero { .. } => Self::TooSmall {
                flag,
                value: 0,
                min: 1,
            },
            TopologyError::NotMultiple {
                value,
                divisor_arg,
                divisor,
                ..
            } => Self::NotMultiple {
                flag,
                value,
                divisor,
                // `8 (bf16 16-byte vectors)` -> `bf16 16-byte vectors`; an argument by its flag.
                why: divisor_arg
                    .strip_prefix(&divisor.to_string())
                    .map(|r| r.trim().trim_start_matches('(').trim_end_matches(')'))
                    .filter(|r| !r.is_empty())
                    .map_or_else(|| named(divisor_arg).to_string(), str::to_string),
            },
            TopologyError::IndexOutOfRange {
                value,
                bound_name,
                bound,
                ..
            } => Self::TooLarge {
                flag,
                value,
                max: bound.saturating_sub(1),
                why: format!("< {} {bound}", named(bound_name)),
            },
            TopologyError::OutOfRange {
                value,
                min,
                max,
                rule,
                ..
            } => Self::at_least(flag, value, min)
                .or_else(|| Self::at_most(flag, value, max, rule))
                .unwrap_or_else(|| Self::Invalid {
                    flag,
                    why: e.to_string(),
                }),
            _ => Self::Invalid {
                flag,
                why: e.to_string(),
            },
        }
    }
}

/// The argument a topology error is about.
fn topology_arg(e: &TopologyError) -> Option<&'static str> {
    match *e {
        TopologyError::Zero { arg }
        | TopologyError::NotMultiple { arg, .. }
        | TopologyError::IndexOutOfRange { arg, .. }
        | TopologyError::OutOfRange { arg, .. }
        | TopologyError::NotPositiveFinite { arg, .. } => Some(arg),
        _ => None,
    }
}

/// Pushes the first error of `checks` (each `None` when its rule holds); true when there was
/// none.
fn first_error(
    errs: &mut Vec<FlagError>,
    checks: impl IntoIterator<Item = Option<FlagError>>,
) -> bool {
    match checks.into_iter().flatten().next() {
        Some(e) => {
            errs.push(e);
            false
        }
        None => true,
    }
}

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
        let caps = spec.capabilities().map_err(|e| FlagError::Unsupported {
            flag: "--transport",
            value: spec.to_string(),
            why: rule_of(e),
        })?;
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
        match spec {
            TransportSpec::Nvshmem {
                virtual_nodes: VirtualNodes::Count(1),
            } => Ok(TransportSpec::Nvshmem {
                virtual_nodes: VirtualNodes::Count(n),
            }),
            _ if n == 1 => Ok(spec),
            _ => Err(FlagError::Unsupported {
                flag: "--virtual-nodes",
                value: n.to_string(),
                why: format!(
                    "virtual nodes are an option of nvshmem, not of --transport {spec}; use                      --transport nvshmem:vnodes={n}"
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
                    argument: "transport",
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
    /// Whether FP8 dispatch is verified and timed (`RowFormat` admits FP8 rows).
    pub fp8: bool,
    /// The transport, schedule and route policy.
    pub transport: TransportChoice,
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
    let mut notes = args.comm.deprecations();
    let gpus = machine.gpus.as_deref();

    // --world
    let mut world = args.world.or(world_hint);
    if let Some(w) = world {
        let default = if args.world.is_none() {
            " (the default: every visible GPU)"
        } else {
            ""
        };
        let ok = first_error(
            &mut errs,
            [
                world_rule(w, default),
                gpus.and_then(|g| {
                    FlagError::at_most(
                        "--world",
                        w as u64,
                        g.len() as u64,
                        format!(
                            "this machine has {} GPU(s) visible; one rank runs per GPU",
                            g.len()
                        ),
                    )
                }),
            ],
        );
        if !ok {
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
    first_error(
        &mut errs,
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
        &mut errs,
        [FlagError::at_most(
            "--warmup",
            args.warmup as u64,
            MAX_ITERS as u64,
            "calls per op",
        )],
    );

    // --tokens
    let tokens_ok = first_error(
        &mut errs,
        [
            FlagError::at_least("--tokens", args.tokens as u64, 1),
            world.and_then(|w| {
                FlagError::at_most(
                    "--tokens",
                    args.tokens as u64,
                    MAX_ROWS / w as u64,
                    format!(
                        "a rank receives up to --tokens x --world ({w}) rows, indexed with 32-bit \
                         integers on the GPU"
                    ),
                )
            }),
        ],
    );

    // --hidden: the library's row rules, then 32-bit row bytes on the GPU.
    let h = args.hidden;
    let hidden_ok = match RowFormat::new(h, RowDtype::Bf16) {
        Err(e) => {
            errs.push(FlagError::from_topology(&e, HIDDEN));
            false
        }
        Ok(row) => first_error(
            &mut errs,
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

    // --experts, --top-k
    let experts_ok = first_error(
        &mut errs,
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
    );
    let top_k_ok = first_error(
        &mut errs,
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
    );

    // --sms / --sweep-sms
    let sms_rule = |flag: &'static str, v: u32, errs: &mut Vec<FlagError>| {
        first_error(
            errs,
            [
                FlagError::at_least(flag, u64::from(v), 1),
                min_sms.and_then(|max| {
                    FlagError::at_most(
                        flag,
                        u64::from(v),
                        u64::from(max),
                        format!("the GPU has {max} SMs"),
                    )
                }),
            ],
        );
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

    // --transport, --schedule, --routes (and their aliases): the library decides, for every
    // rank of a local launch (one host).
    let transport = TransportChoice::from_flags(&args.comm).and_then(|t| {
        if let Some(w) = world {
            (0..w).try_for_each(|rank| t.plan(&args.comm, w, rank, w).map(drop))?;
        }
        Ok(t)
    });
    let transport = match transport {
        Ok(t) => Some(t),
        Err(e) => {
            errs.push(e);
            None
        }
    };

    // --delay-rank, --delay-us
    let delay_us = args.delay_us.unwrap_or(DEFAULT_DELAY_US);
    first_error(
        &mut errs,
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
            &mut errs,
            [FlagError::at_most(
                "--delay-rank",
                r as u64,
                w as u64 - 1,
                format!("ranks are 0..{w} with --world {w}"),
            )],
        );
    }

    // Memory, when everything it depends on is valid and the machine is known.
    if let Some(w) = world
        && tokens_ok
        && hidden_ok
        && experts_ok
        && top_k_ok
    {
        errs.extend(memory_errors(args, w, min_mem, machine.host_memory_bytes));
    }

    // --plot
    if let Some(p) = &args.plot
        && let Some(e) = plot_path_error(p)
    {
        errs.push(e);
    }

    match transport {
        Some(transport) if errs.is_empty() => Ok(BenchPlan {
            world,
            sweep,
            is_sweep,
            delay: args.delay_rank.map(|r| (r, delay_us)),
            fp8,
            transport,
            notes,
        }),
        _ => Err(FlagErrors(errs)),
    }
}

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

/// The memory the run needs against what the GPUs (`gpu_memory`: the smallest) and the host
/// have; all reported on `--tokens`.
fn memory_errors(
    args: &BenchArgs,
    w: usize,
    gpu_memory: Option<u64>,
    host_memory: Option<u64>,
) -> Vec<FlagError> {
    let (t, h) = (args.tokens, args.hidden);
    let what = format!("--tokens {t} with --hidden {h} and --world {w}");
    let too_much = |need: u128, have: Option<u64>, whose: &str| {
        have.filter(|&have| need > u128::from(have))
            .map(|have| FlagError::Invalid {
                flag: "--tokens",
                why: format!(
                    "{what} needs about {} of {whose} {}",
                    gib(need),
                    gib(u128::from(have))
                ),
            })
    };
    let device = match device_bytes_estimate(w, t, h, args.top_k, args.experts) {
        None => Some(FlagError::Invalid {
            flag: "--tokens",
            why: format!("{what}: buffer sizes overflow"),
        }),
        Some(need) => too_much(
            need,
            gpu_memory,
            "GPU memory per rank; the smallest GPU has",
        ),
    };
    let host = too_much(
        host_bytes_estimate(w, t, h),
        host_memory,
        "host memory (every worker generates every rank's inputs); this host has",
    );
    device.into_iter().chain(host).collect()
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
    use crate::cli::tests::parse;
    use crate::cli::{BarrierArg, Cli, Command};
    use clap::Parser;

    fn args(extra: &[&str]) -> BenchArgs {
        match parse(&[&["bench"], extra].concat()) {
            Command::Bench(a) => a,
            other => panic!("not bench: {other:?}"),
        }
    }

    /// Validates `extra` with no machine facts; it must pass.
    fn valid(extra: &[&str]) -> BenchPlan {
        validate_bench(&args(extra), None, &Machine::default()).unwrap()
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
        let plan = valid(&["--world", "8"]);
        assert_eq!(plan.world, Some(8));
        assert_eq!(plan.sweep, vec![24]);
        assert!(plan.fp8 && !plan.is_sweep && plan.delay.is_none());
        // Without --world nor a machine, world-dependent rules wait for the GPU count.
        let plan = valid(&[]);
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
        let plan = valid(&["--hidden", "136"]);
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
            (vec!["--transport", "nvshmem:vnodes=0"], "--transport"),
            (vec!["--schedule", "peer-signal"], "--schedule"),
            (vec!["--routes", "store"], "--routes"),
            (vec!["--barrier", "fast"], "--barrier"),
            (
                vec!["--barrier", "global", "--schedule", "epoch"],
                "--schedule",
            ),
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
