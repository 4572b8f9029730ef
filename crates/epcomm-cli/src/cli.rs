//! Command-line definitions (clap). Rules that clap cannot express are checked in
//! [`crate::validate`], before anything is spawned.

use std::path::PathBuf;

use std::str::FromStr;

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Args, Parser, Subcommand, ValueEnum};
use epcomm::{BufferConfig, CombineStaging, RoutePolicy, Schedule};
use epcomm_backends::{TransportError, TransportSpec};
use epcomm_topology::RingShape;

#[derive(Parser, Debug)]
#[command(
    name = "epcomm",
    version,
    about = "Expert-parallel dispatch/combine over NVLink and NVSHMEM",
    after_help = "Exit codes: 0 success; 1 a run failed; 2 invalid flags (nothing was started); \
                  3 no usable GPU environment (no CUDA driver, no GPU, missing library); \
                  4 `doctor --require`: a required transport is not usable. See docs/cli.md."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Verified dispatch + combine benchmark on the local GPUs (DeepEP's workload and metric).
    Bench(BenchArgs),
    /// Checks this machine: GPUs, driver, P2P/NVLink, NVSHMEM, NCCL, RDMA, environment, and
    /// says which transports are usable (and how to fix the others).
    Doctor(DoctorArgs),
    /// Prints the world layout (nodes x local ranks) a transport sees and the route plan a
    /// Buffer would use: for every peer of one rank, its tier and route. Pure computation: needs
    /// no GPU when --world is given.
    Topo(TopoArgs),
    /// Draws a saved SM sweep (`epcomm bench --sweep-sms ... --json > run.json`) as an SVG
    /// chart: one line per op against the SMs, both axes logarithmic. Needs no GPU.
    Plot(PlotArgs),
}

/// A library type named on the command line by its lower-case name: the library's list of
/// values and their names are the only source of the accepted words.
pub trait Named:
    Copy + Send + Sync + 'static + FromStr<Err: std::error::Error + Send + Sync + 'static>
{
    /// Every value, in documentation order.
    const ALL: &'static [Self];
    /// The name as typed.
    fn name(self) -> &'static str;
}

macro_rules! named {
    ($($ty:ty),*) => {$(
        impl Named for $ty {
            const ALL: &'static [Self] = &<$ty>::ALL;
            fn name(self) -> &'static str {
                <$ty>::name(self)
            }
        }
    )*};
}

named!(Schedule, RoutePolicy, CombineStaging);

/// A clap value parser accepting the names of `T` (listed in `--help` and in errors), parsed by
/// `T`'s `FromStr`.
pub fn by_name<T: Named>() -> impl TypedValueParser<Value = T> {
    PossibleValuesParser::new(T::ALL.iter().map(|v| v.name())).try_map(|s| s.parse::<T>())
}

/// Parses `--rail-ring`: `SLOTS,CHUNK`, both whole numbers above 0.
pub fn parse_rail_ring(s: &str) -> Result<RingShape, String> {
    let (slots, chunk) = s
        .split_once(',')
        .ok_or_else(|| "must be SLOTS,CHUNK (e.g. 2,64)".to_string())?;
    let slots = count::<usize>(slots).map_err(|e| format!("SLOTS {e}"))?;
    let chunk = count::<usize>(chunk).map_err(|e| format!("CHUNK {e}"))?;
    RingShape::new(slots, chunk).map_err(|e| e.to_string())
}

/// Parses `--transport` and `--require` values with [`TransportSpec::from_str`]; the error is
/// the library's rule (clap names the flag and the value).
pub fn parse_transport(s: &str) -> Result<TransportSpec, String> {
    s.parse().map_err(|e| match e {
        TransportError::InvalidArgument { rule, .. } => rule,
        other => other.to_string(),
    })
}

fn transport_help() -> String {
    format!(
        "Transport spec: {} (N logical nodes per host; `max`: one per GPU)",
        epcomm_backends::forms().join(", ")
    )
}

/// The old `--barrier` names, kept as a hidden, deprecated alias of `--schedule` and
/// `--routes` so that recorded commands still run.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BarrierArg {
    /// `--schedule epoch`.
    Epoch,
    /// `--schedule global`.
    Global,
    /// `--schedule epoch --routes put-signal`.
    PeerSignal,
}

impl BarrierArg {
    /// The name as typed on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Epoch => "epoch",
            Self::Global => "global",
            Self::PeerSignal => "peer-signal",
        }
    }

    /// The library's schedule and route policy.
    pub fn schedule_and_routes(self) -> (Schedule, RoutePolicy) {
        match self {
            Self::Epoch => (Schedule::Epoch, RoutePolicy::Auto),
            Self::Global => (Schedule::Global, RoutePolicy::Auto),
            Self::PeerSignal => (Schedule::Epoch, RoutePolicy::PutSignal),
        }
    }
}

/// How a `Buffer` is built: transport, schedule and route policy (shared by `bench` and
/// `topo`). [`crate::validate::TransportChoice::from_flags`] resolves the deprecated aliases.
#[derive(Args, Debug, Clone)]
pub struct TransportFlags {
    #[arg(long, value_name = "SPEC", value_parser = parse_transport,
          default_value = "ipc", help = transport_help())]
    pub transport: TransportSpec,
    /// How ranks agree that buffers may be reused: epoch (no barrier) or global (all-rank
    /// barriers, DeepEP V1's schedule).
    #[arg(long, value_parser = by_name::<Schedule>(), default_value_t = Schedule::default())]
    pub schedule: Schedule,
    /// Route policy: auto (stores inside the NVLink domain, put/signal beyond it) or put-signal
    /// (every peer by put/signal).
    #[arg(long, value_parser = by_name::<RoutePolicy>(), default_value_t = RoutePolicy::default())]
    pub routes: RoutePolicy,
    /// Deprecated: `--transport nvshmem --virtual-nodes N` is `--transport nvshmem:vnodes=N`.
    #[arg(long, value_name = "N", hide = true)]
    pub virtual_nodes: Option<usize>,
    /// Deprecated: epoch, global or peer-signal (= --schedule epoch --routes put-signal).
    #[arg(long, value_enum, hide = true, conflicts_with_all = ["schedule", "routes"])]
    pub barrier: Option<BarrierArg>,
}

impl TransportFlags {
    /// The schedule and route policy asked for (through `--barrier` when it is given).
    pub fn schedule_and_routes(&self) -> (Schedule, RoutePolicy) {
        self.barrier.map_or(
            (self.schedule, self.routes),
            BarrierArg::schedule_and_routes,
        )
    }

    /// The flag that chose the schedule, as typed.
    pub fn schedule_flag(&self) -> &'static str {
        if self.barrier.is_some() {
            "--barrier"
        } else {
            "--schedule"
        }
    }

    /// The flag that chose the route policy, as typed.
    pub fn routes_flag(&self) -> &'static str {
        if self.barrier.is_some() {
            "--barrier"
        } else {
            "--routes"
        }
    }

    /// What to say about deprecated flags that were used.
    pub fn deprecations(&self) -> Vec<String> {
        let barrier = self.barrier.map(|b| {
            let (schedule, routes) = b.schedule_and_routes();
            format!(
                "--barrier {} is deprecated: use --schedule {schedule} --routes {routes}",
                b.name()
            )
        });
        let vnodes = self
            .virtual_nodes
            .map(|n| format!("--virtual-nodes is deprecated: use --transport nvshmem:vnodes={n}"));
        barrier.into_iter().chain(vnodes).collect()
    }

    /// The flag that chose the virtual nodes, as typed.
    pub fn vnodes_flag(&self) -> &'static str {
        if self.virtual_nodes.is_some() {
            "--virtual-nodes"
        } else {
            "--transport"
        }
    }
}

#[derive(Args, Debug, Clone)]
// `--tokens -1` is reported as a bad value of --tokens, not as an unknown flag `-1`.
#[command(allow_negative_numbers = true)]
pub struct BenchArgs {
    /// Ranks to use, one process each; default: every local GPU. Above the GPU count ranks
    /// share GPUs round-robin (the times then include that sharing).
    #[arg(long, value_parser = count::<usize>)]
    pub world: Option<usize>,
    /// Tokens per rank [default: 4096; with --low-latency 128, a decode batch].
    #[arg(long, value_parser = count::<usize>)]
    pub tokens: Option<usize>,
    /// Hidden size (a multiple of 8; FP8 dispatch is timed only when it is a multiple of 128).
    #[arg(long, default_value_t = 7168, value_parser = count::<usize>)]
    pub hidden: usize,
    /// Experts per token.
    #[arg(long, default_value_t = 8, value_parser = count::<usize>)]
    pub top_k: usize,
    /// Experts in total (a multiple of the world size).
    #[arg(long, default_value_t = 256, value_parser = count::<usize>)]
    pub experts: usize,
    /// SMs (blocks) per op.
    #[arg(long, default_value_t = BufferConfig::DEFAULT_NUM_SMS, value_parser = count::<u32>)]
    pub sms: u32,
    /// SMs (blocks) of the low-latency ops; 0: every SM a rank may use (the GPU's, divided
    /// among the ranks sharing it under MPS). With --low-latency.
    #[arg(long, default_value_t = 0, value_parser = count::<u32>, requires = "low_latency")]
    pub ll_sms: u32,
    #[command(flatten)]
    pub comm: TransportFlags,
    /// How combine moves y to the token owners: auto, push (the kernel's SMs push every row)
    /// or copy-engine (the copy engine stages y over the receive rows; the owners pull).
    #[arg(long, value_name = "WAY", value_parser = by_name::<CombineStaging>(),
          default_value_t = CombineStaging::Auto)]
    pub combine_staging: CombineStaging,
    /// Rail forwarding of the normal dispatch (experimental), `SLOTS,CHUNK`: on a transport of
    /// several (logical) nodes, a token for ranks of another node crosses once, to the rank
    /// there with the sender's local index, through a ring of SLOTS slots of CHUNK tokens, and
    /// that rank stores it for its node's ranks (same outputs as without).
    #[arg(long, value_name = "SLOTS,CHUNK", value_parser = parse_rail_ring,
          conflicts_with = "hierarchical")]
    pub rail_ring: Option<RingShape>,
    /// With --rail-ring: dispatch blocks that forward each other node's entries (the rest
    /// send); 0 takes half the grid, split among the other nodes, at most SLOTS.
    #[arg(long, value_name = "N", default_value_t = 0, requires = "rail_ring")]
    pub rail_forward_sms: u32,
    /// Timed calls per op.
    #[arg(long, default_value_t = 50, value_parser = count::<usize>)]
    pub iters: usize,
    /// Untimed calls per op first.
    #[arg(long, default_value_t = 5, value_parser = count::<usize>)]
    pub warmup: usize,
    /// Skew demo: delay this rank's GPU stream before each of five extra dispatches and report
    /// whom every rank names as late.
    #[arg(long, value_parser = count::<usize>)]
    pub delay_rank: Option<usize>,
    /// Skew demo delay in microseconds (default 200; needs --delay-rank).
    #[arg(long, value_parser = count::<u64>)]
    pub delay_us: Option<u64>,
    /// Also verify and time the low-latency ops (dispatch BF16 and FP8, combine, and their send
    /// and receive phases apart) with --tokens tokens per rank (decode sizes: at most what the
    /// kernels' routing bitmaps hold, 992 with 256 experts on up to 8 ranks; checked before
    /// anything starts).
    #[arg(long)]
    pub low_latency: bool,
    /// Leave L2 warm between timed calls instead of flushing it (256 MiB written) before each:
    /// what a profiler's kernel times of calls in a row see (DeepEP's tests). The default
    /// flush is the stricter measure: an op fetches its code, routing and rows from DRAM, as
    /// after a model's layer has run.
    #[arg(long, conflicts_with = "hierarchical")]
    pub warm_l2: bool,
    /// Time the internode path instead of the flat one: a HierarchicalBuffer (rail dispatch
    /// over one rank per node, then node dispatch of what arrived; combine in reverse) on a
    /// transport with more than one logical node, e.g. nvshmem:vnodes=2. Reports rail
    /// ("RDMA"), NVLink and flat GB/s per op and the notify latency at 128 tokens per rank.
    #[arg(long)]
    pub hierarchical: bool,
    /// Comma-separated SM counts to sweep (every op), instead of --sms.
    #[arg(
        long,
        value_name = "SMS,SMS,...",
        value_delimiter = ',',
        conflicts_with = "sms"
    )]
    pub sweep_sms: Option<Vec<u32>>,
    /// With --sweep-sms: write an SVG plot of GB/s against SMs (log axes) to this file.
    #[arg(long, value_name = "PATH", requires = "sweep_sms")]
    pub plot: Option<PathBuf>,
    /// Print the results as JSON on stdout (instead of the table).
    #[arg(long, conflicts_with = "csv")]
    pub json: bool,
    /// Print the results as CSV on stdout (instead of the table).
    #[arg(long)]
    pub csv: bool,
}

/// Parses a count flag (`--tokens`, `--world`, ...): a whole number, 0 or more. The error
/// is the rule in words (clap names the flag and the value), not the integer parser's
/// ("invalid digit found in string").
pub fn count<T: TryFrom<u64>>(s: &str) -> Result<T, String> {
    let t = s.trim();
    if t.strip_prefix('-')
        .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
    {
        return Err("must be a whole number, 0 or more (got a negative one)".into());
    }
    if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
        return Err("must be a whole number, 0 or more".into());
    }
    let max = |bits: u32| format!("must be at most {}", u64::MAX >> (64 - bits));
    let n: u64 = t.parse().map_err(|_| max(64))?;
    T::try_from(n).map_err(|_| max(8 * size_of::<T>() as u32))
}

impl BenchArgs {
    /// Tokens per rank when `--tokens` is not given (DeepEP's normal-mode benchmark size).
    pub const DEFAULT_TOKENS: usize = 4096;
    /// Tokens per rank when `--tokens` is not given under `--low-latency` (DeepEP's decode
    /// benchmark size).
    pub const DEFAULT_LL_TOKENS: usize = 128;

    /// Tokens per rank in effect: `--tokens`, else [`Self::DEFAULT_LL_TOKENS`] under
    /// `--low-latency`, else [`Self::DEFAULT_TOKENS`].
    pub fn tokens(&self) -> usize {
        self.tokens.unwrap_or(if self.low_latency {
            Self::DEFAULT_LL_TOKENS
        } else {
            Self::DEFAULT_TOKENS
        })
    }
}

/// What goes to stdout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputFormat {
    /// Human-readable table.
    Table,
    /// One JSON document.
    Json,
    /// CSV with a header row.
    Csv,
}

impl BenchArgs {
    /// The stdout format picked by --json / --csv (clap makes them exclusive).
    pub fn format(&self) -> OutputFormat {
        match (self.json, self.csv) {
            (true, _) => OutputFormat::Json,
            (_, true) => OutputFormat::Csv,
            _ => OutputFormat::Table,
        }
    }
}

#[derive(Args, Debug, Clone)]
pub struct DoctorArgs {
    /// Print the report as JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// Exit with code 4 unless this transport spec (e.g. `nvshmem:vnodes=2`) is usable here
    /// (repeatable).
    #[arg(long, value_name = "SPEC", value_parser = parse_transport)]
    pub require: Vec<TransportSpec>,
}

#[derive(Args, Debug, Clone)]
#[command(allow_negative_numbers = true)]
pub struct TopoArgs {
    /// Ranks in the world; default: the local GPU count (needs the CUDA driver).
    #[arg(long)]
    pub world: Option<usize>,
    /// GPUs per physical host; default: --world (one host).
    #[arg(long)]
    pub gpus_per_node: Option<usize>,
    /// The rank whose peers are listed.
    #[arg(long, default_value_t = 0)]
    pub rank: usize,
    #[command(flatten)]
    pub comm: TransportFlags,
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// `epcomm <argv...>`, parsed; panics (test helper) when clap refuses it.
    pub(crate) fn parse(argv: &[&str]) -> Command {
        let full = ["epcomm"].iter().chain(argv).copied();
        match Cli::try_parse_from(full) {
            Ok(cli) => cli.command,
            Err(e) => panic!("{argv:?}: {e}"),
        }
    }

    /// `--sms` defaults to the library's default SM count.
    #[test]
    fn bench_sms_defaults_to_the_library_default() {
        let Command::Bench(args) = parse(&["bench"]) else {
            panic!("not a bench command")
        };
        assert_eq!(args.sms, BufferConfig::DEFAULT_NUM_SMS);
        assert_eq!(BufferConfig::new(1, 8, 1, 1).num_sms, args.sms);
    }

    /// `--warm-l2` is a bench flag that the two-tier bench refuses (its timer always flushes).
    #[test]
    fn warm_l2_is_for_the_flat_bench() {
        let Command::Bench(args) = parse(&["bench", "--low-latency", "--warm-l2"]) else {
            panic!("not a bench command")
        };
        assert!(args.warm_l2 && args.low_latency);
        let Command::Bench(args) = parse(&["bench"]) else {
            panic!("not a bench command")
        };
        assert!(!args.warm_l2);
        let both = Cli::try_parse_from(["epcomm", "bench", "--warm-l2", "--hierarchical"]);
        assert!(both.is_err_and(|e| e.kind() == clap::error::ErrorKind::ArgumentConflict));
    }

    /// `--rail-ring SLOTS,CHUNK` becomes the ring shape; malformed values are named.
    #[test]
    fn rail_ring_parses_slots_and_chunk() {
        let Command::Bench(args) = parse(&["bench", "--rail-ring", "2,64"]) else {
            panic!("not a bench command")
        };
        let ring = args.rail_ring.unwrap();
        assert_eq!((ring.slots(), ring.chunk_rows()), (2, 64));
        for bad in ["2", "0,4", "2,x", "3,-1"] {
            let e = Cli::try_parse_from(["epcomm", "bench", "--rail-ring", bad])
                .err()
                .unwrap_or_else(|| panic!("{bad} accepted"))
                .to_string();
            assert!(e.contains("--rail-ring"), "{e}");
        }
        let both = Cli::try_parse_from(["epcomm", "bench", "--rail-ring", "2,4", "--hierarchical"]);
        assert!(both.is_err_and(|e| e.kind() == clap::error::ErrorKind::ArgumentConflict));
    }

    /// Python's `epcomm.DEFAULT_NUM_SMS` (a literal in python/epcomm/config.py: the native
    /// module does not export the Rust constant) is the library's default SM count.
    #[test]
    fn python_default_num_sms_is_the_library_default() {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../python/epcomm/config.py");
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        let values: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("DEFAULT_NUM_SMS = "))
            .collect();
        let [value] = values[..] else {
            panic!(
                "{}: expected one `DEFAULT_NUM_SMS = <n>` line, found {values:?}",
                path.display()
            )
        };
        assert_eq!(
            value.trim().parse::<u32>().ok(),
            Some(BufferConfig::DEFAULT_NUM_SMS),
            "{}: DEFAULT_NUM_SMS = {value} differs from epcomm::BufferConfig::DEFAULT_NUM_SMS",
            path.display()
        );
    }
}

/// `epcomm plot`.
#[derive(Args, Debug)]
pub struct PlotArgs {
    /// A document written by `epcomm bench --json` (schema epcomm-bench/2). Only each
    /// result's `op`, `sms`, `time_us` (and `gbps` for `--metric gbps`) and the config's
    /// `world`, `transport`, `schedule`, `tokens`, `hidden` are read.
    pub input: PathBuf,
    /// The chart to write [default: INPUT's file name with the extension .svg, in the
    /// current directory].
    #[arg(long, short, value_name = "PATH")]
    pub out: Option<PathBuf>,
    /// What the vertical axis shows: `us` (rank 0's median time per op) or `gbps`
    /// (DeepEP's metric).
    #[arg(long, value_enum, default_value = "us")]
    pub metric: Metric,
}

/// What the vertical axis of `epcomm plot`'s chart shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Metric {
    /// Rank 0's median time per op, microseconds.
    Us,
    /// DeepEP's metric on rank 0, GB/s.
    Gbps,
}
