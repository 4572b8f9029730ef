//! Command-line definitions (clap). Rules that clap cannot express are checked in
//! [`crate::validate`], before anything is spawned.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use epcomm::{RoutePolicy, Schedule};
use epcomm_backends::{TransportSpec, VirtualNodes};

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
    /// Prints the world layout (nodes x local ranks) and, for every peer of one rank, its tier
    /// and the route a Buffer would use for each transport. Pure computation: needs no GPU when
    /// --world is given.
    Topo(TopoArgs),
}

/// A transport, as named on the command line.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TransportArg {
    /// CUDA IPC over NVLink: every rank on one host, peers reached by stores.
    Ipc,
    /// NVSHMEM symmetric heap: stores inside the NVLink domain, put/signal beyond it.
    Nvshmem,
}

impl TransportArg {
    /// Every transport, in report order.
    pub const ALL: [TransportArg; 2] = [Self::Ipc, Self::Nvshmem];

    /// The name as typed on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Ipc => "ipc",
            Self::Nvshmem => "nvshmem",
        }
    }

    /// Barrier strategies the transport's kernels implement (mirrors
    /// `Transport::barrier_strategies` of `IpcTransport` and `NvshmemTransport`).
    pub fn barriers(self) -> &'static [BarrierArg] {
        match self {
            Self::Ipc => &[BarrierArg::Epoch, BarrierArg::Global],
            Self::Nvshmem => &[
                BarrierArg::Epoch,
                BarrierArg::Global,
                BarrierArg::PeerSignal,
            ],
        }
    }
}

/// A barrier strategy, as named on the command line.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BarrierArg {
    /// No barrier: epoch-tagged counts, each rank waits only for the data it receives.
    Epoch,
    /// All-rank barriers around the count exchange (DeepEP V1 schedule).
    Global,
    /// Epoch with every peer reached by NVSHMEM put/signal (nvshmem only).
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

#[derive(Args, Debug, Clone)]
// `--tokens -1` is reported as a bad value of --tokens, not as an unknown flag `-1`.
#[command(allow_negative_numbers = true)]
pub struct BenchArgs {
    /// Ranks (GPUs) to use; default: every local GPU.
    #[arg(long)]
    pub world: Option<usize>,
    /// Tokens per rank.
    #[arg(long, default_value_t = 4096)]
    pub tokens: usize,
    /// Hidden size (a multiple of 8; FP8 dispatch is timed only when it is a multiple of 128).
    #[arg(long, default_value_t = 7168)]
    pub hidden: usize,
    /// Experts per token.
    #[arg(long, default_value_t = 8)]
    pub top_k: usize,
    /// Experts in total (a multiple of the world size).
    #[arg(long, default_value_t = 256)]
    pub experts: usize,
    /// SMs (blocks) per op.
    #[arg(long, default_value_t = 24)]
    pub sms: u32,
    /// Transport.
    #[arg(long, value_enum, default_value_t = TransportArg::Ipc)]
    pub transport: TransportArg,
    /// Barrier strategy (peer-signal needs --transport nvshmem).
    #[arg(long, value_enum, default_value_t = BarrierArg::Epoch)]
    pub barrier: BarrierArg,
    /// nvshmem only: split this host's GPUs into this many virtual nodes; traffic between them
    /// goes through NVSHMEM put/signal as between hosts.
    #[arg(long, default_value_t = 1)]
    pub virtual_nodes: usize,
    /// Timed calls per op.
    #[arg(long, default_value_t = 50)]
    pub iters: usize,
    /// Untimed calls per op first.
    #[arg(long, default_value_t = 5)]
    pub warmup: usize,
    /// Skew demo: delay this rank's GPU stream before each of five extra dispatches and report
    /// whom every rank names as late.
    #[arg(long)]
    pub delay_rank: Option<usize>,
    /// Skew demo delay in microseconds (default 200; needs --delay-rank).
    #[arg(long)]
    pub delay_us: Option<u64>,
    /// Comma-separated SM counts to sweep (BF16 dispatch and combine), instead of --sms.
    #[arg(
        long,
        value_name = "SMS,SMS,...",
        value_delimiter = ',',
        conflicts_with = "sms"
    )]
    pub sweep_sms: Option<Vec<u32>>,
    /// With --sweep-sms: write an SVG plot of GB/s against SMs to this file.
    #[arg(long, value_name = "PATH", requires = "sweep_sms")]
    pub plot: Option<PathBuf>,
    /// Print the results as JSON on stdout (instead of the table).
    #[arg(long, conflicts_with = "csv")]
    pub json: bool,
    /// Print the results as CSV on stdout (instead of the table).
    #[arg(long)]
    pub csv: bool,
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
    /// The transport the workers build.
    pub fn transport_spec(&self) -> TransportSpec {
        match self.transport {
            TransportArg::Ipc => TransportSpec::Ipc,
            TransportArg::Nvshmem => TransportSpec::Nvshmem {
                virtual_nodes: VirtualNodes::Count(self.virtual_nodes),
            },
        }
    }

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
    /// Exit with code 4 unless this transport is usable (repeatable).
    #[arg(long, value_enum, value_name = "TRANSPORT")]
    pub require: Vec<TransportArg>,
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
    /// Split each host's GPUs into this many virtual nodes (nvshmem only).
    #[arg(long, default_value_t = 1)]
    pub virtual_nodes: usize,
    /// The rank whose peers are listed.
    #[arg(long, default_value_t = 0)]
    pub rank: usize,
    /// Barrier strategy the routes are computed for (peer-signal sends every peer through
    /// put/signal).
    #[arg(long, value_enum, default_value_t = BarrierArg::Epoch)]
    pub barrier: BarrierArg,
}
