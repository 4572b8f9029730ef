//! `epcomm bench`'s results: what rank 0 measures, handed to the launcher as JSON, and the
//! three ways the launcher prints them on stdout (table, JSON, CSV).
//!
//! The JSON document is [`BenchReport`] (schema [`SCHEMA`]); docs/cli.md describes it.

use std::fmt::Write as _;

use epcomm_check::timing::BenchOp;
use serde::{Deserialize, Serialize};

use crate::cli::OutputFormat;

/// Value of [`BenchReport::schema`]; bumped on incompatible changes.
pub const SCHEMA: &str = "epcomm-bench/2";

/// The run's configuration, as it ran.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BenchConfig {
    /// Ranks (one process each; one GPU each unless `gpus` is smaller).
    pub world: usize,
    /// The transport spec (`ipc`, `nvshmem`, `nvshmem:vnodes=2`, ...).
    pub transport: String,
    /// The schedule (`epoch`, `global`).
    pub schedule: String,
    /// The route policy (`auto`, `put-signal`).
    pub routes: String,
    /// Tokens per rank.
    pub tokens: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Experts in total.
    pub experts: usize,
    /// SM counts timed, in order.
    pub sms: Vec<u32>,
    /// Timed calls per op (the median is reported).
    pub iters: usize,
    /// Untimed calls per op first.
    pub warmup: usize,
    /// Whether FP8 dispatch was verified and timed.
    pub fp8: bool,
    /// SMs of rank 0's GPU.
    pub gpu_sms: u32,
    /// Name of rank 0's GPU.
    pub gpu_name: String,
    /// GPUs the ranks ran on (fewer than `world` when ranks shared GPUs round-robin; 0 in
    /// documents from before this field: read as `world`).
    #[serde(default)]
    pub gpus: usize,
    /// Whether rank 0's CUDA context ran under MPS (`CU_DEVICE_ATTRIBUTE_MPS_ENABLED`): ranks
    /// sharing a GPU then run concurrently instead of taking turns.
    #[serde(default)]
    pub mps: bool,
    /// How combine moved y (`auto`, `push`, `copy-engine`; empty in documents from before this
    /// field: read as `push`).
    #[serde(default)]
    pub combine_staging: String,
    /// Whether L2 was left warm between timed calls (`--warm-l2`); false: flushed before each
    /// (and in documents from before this field).
    #[serde(default)]
    pub warm_l2: bool,
    /// `--rail-ring` as `SLOTS,CHUNK` (rail forwarding of the dispatch); empty: none (and in
    /// documents from before this field).
    #[serde(default)]
    pub rail_ring: String,
    /// `--rail-forward-sms` (0: the library's choice; and in documents from before this field).
    #[serde(default)]
    pub rail_forward_sms: u32,
}

impl BenchConfig {
    /// How L2 stood at each timed call, for the table's header.
    pub fn l2_note(&self) -> &'static str {
        if self.warm_l2 {
            "L2 left warm between calls"
        } else {
            "L2 flushed between calls"
        }
    }

    /// What sharing GPUs did to the times, when ranks shared them: without MPS they take turns
    /// on the GPU (every op then waits for the other ranks' time slices), under MPS they run
    /// concurrently, but their traffic stays in the GPU's memory and they compete for its SMs.
    pub fn sharing_note(&self) -> Option<String> {
        (self.gpus != 0 && self.gpus < self.world).then(|| {
            let note = self.sharing_how();
            if self.copies_on_sms() {
                format!(
                    "{note}; the CPU proxy's copies between ranks of one GPU do not run in the \
                     copy engines either: the driver runs each as a kernel on the SMs, about 5 us \
                     apiece, so these times measure that"
                )
            } else {
                note
            }
        })
    }

    /// Whether the transport's proxy moves bytes with copies (its executor's
    /// [`ExecutorLimits::moves_by`](epcomm_backends::ExecutorLimits::moves_by)), which between
    /// ranks of one GPU the driver runs on the SMs.
    fn copies_on_sms(&self) -> bool {
        self.transport
            .parse::<epcomm_backends::TransportSpec>()
            .ok()
            .and_then(|spec| spec.limits().executor)
            .is_some_and(|e| e.moves_by == "copy engines")
    }

    /// How ranks sharing GPUs ran (see [`Self::sharing_note`]).
    fn sharing_how(&self) -> String {
        if self.mps {
            format!(
                "note: {} ranks shared {} GPU(s) under MPS: they ran concurrently, but \
                     traffic between ranks of one GPU stays in its memory (no NVLink) and they \
                     share its SMs and memory bandwidth",
                self.world, self.gpus
            )
        } else {
            format!(
                "note: {} ranks shared {} GPU(s) without MPS: they took turns on the GPU, \
                     so these times measure that sharing, not the path (start the MPS daemon, \
                     `nvidia-cuda-mps-control -d`, to run them concurrently)",
                self.world, self.gpus
            )
        }
    }

    /// `<transport> transport, <schedule> schedule, <routes> routes, combine staging <way>`.
    pub fn describe(&self) -> String {
        let staging = if self.combine_staging.is_empty() {
            "push"
        } else {
            &self.combine_staging
        };
        let ring = if self.rail_ring.is_empty() {
            String::new()
        } else {
            let blocks = if self.rail_forward_sms == 0 {
                "forwarding blocks: half the grid, at most the slots".to_string()
            } else {
                format!("{} forwarding blocks per other node", self.rail_forward_sms)
            };
            format!(
                ", rail forwarding through rings of {} (slots,chunk), {blocks}",
                self.rail_ring
            )
        };
        format!(
            "{} transport, {} schedule, {} routes, combine staging {staging}{ring}",
            self.transport, self.schedule, self.routes
        )
    }
}

/// One timed op at one SM count.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ResultRow {
    /// Op id: `dispatch_bf16`, `dispatch_fp8`, `cached_dispatch_bf16`, `combine_bf16`,
    /// `combine_bf16_in_place`.
    pub op: String,
    /// SMs (blocks) used.
    pub sms: u32,
    /// Median time on rank 0, microseconds.
    pub time_us: f64,
    /// DeepEP's metric on rank 0: received bytes (self included) / time, GB/s (1e9 bytes/s).
    pub gbps: f64,
    /// Rows rank 0 received.
    pub recv_rows: usize,
    /// Median time of every rank, microseconds, indexed by rank.
    pub rank_time_us: Vec<f64>,
}

/// The skew demo's outcome.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SkewReport {
    /// The rank that was delayed.
    pub delayed_rank: usize,
    /// The delay before each dispatch, microseconds.
    pub delay_us: u64,
    /// Each rank's statistics of the last dispatch, as it printed them.
    pub statements: Vec<String>,
    /// The late rank each rank named in each of the five dispatches, indexed by rank.
    pub named: Vec<Vec<usize>>,
}

/// The whole result document.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BenchReport {
    /// [`SCHEMA`].
    pub schema: String,
    /// The configuration.
    pub config: BenchConfig,
    /// One row per op and SM count.
    pub results: Vec<ResultRow>,
    /// Present with --delay-rank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skew: Option<SkewReport>,
}

/// A result that cannot be reported (never printed as NaN or infinity).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ResultError {
    /// A time was not a positive finite number.
    #[error("{op} at {sms} SMs: rank {rank} measured an unusable time ({value} us)")]
    BadTime {
        /// The op.
        op: String,
        /// SMs.
        sms: u32,
        /// Which rank.
        rank: usize,
        /// What it measured.
        value: f64,
    },
    /// The document is not what the launcher expects.
    #[error("results: {0}")]
    Malformed(String),
}

/// The stable id of an op (JSON / CSV).
pub fn op_id(op: BenchOp) -> &'static str {
    match op {
        BenchOp::DispatchBf16 => "dispatch_bf16",
        BenchOp::DispatchFp8 => "dispatch_fp8",
        BenchOp::CachedDispatchBf16 => "cached_dispatch_bf16",
        BenchOp::Combine => "combine_bf16",
        BenchOp::CombineInPlace => "combine_bf16_in_place",
        BenchOp::LlDispatchBf16 => "ll_dispatch_bf16",
        BenchOp::LlDispatchFp8 => "ll_dispatch_fp8",
        BenchOp::LlCombine => "ll_combine_bf16",
        BenchOp::LlDispatchFp8Send => "ll_dispatch_fp8_send",
        BenchOp::LlDispatchFp8Recv => "ll_dispatch_fp8_recv",
        BenchOp::LlCombineSend => "ll_combine_bf16_send",
        BenchOp::LlCombineRecv => "ll_combine_bf16_recv",
    }
}

/// The display name of an op id (the id itself when unknown).
pub fn op_display(id: &str) -> &str {
    BenchOp::ALL
        .into_iter()
        .chain(BenchOp::LOW_LATENCY)
        .find(|&op| op_id(op) == id)
        .map_or(id, |op| op.name())
}

/// A time or rate a report may carry: positive and finite (no NaN is ever reported).
pub(crate) fn usable(t: f64) -> bool {
    t.is_finite() && t > 0.0
}

/// A report's schema is `expected` and it has result rows.
///
/// # Errors
/// [`ResultError::Malformed`] saying which.
pub(crate) fn check_shape(schema: &str, expected: &str, rows: usize) -> Result<(), ResultError> {
    if schema != expected {
        return Err(ResultError::Malformed(format!(
            "schema {schema:?}, expected {expected:?}"
        )));
    }
    if rows == 0 {
        return Err(ResultError::Malformed("no result rows".into()));
    }
    Ok(())
}

/// A bench report of either tiering ([`BenchReport`], [`crate::hier_results::HierReport`]):
/// rank 0 checks it before handing it to the launcher, which checks it again after parsing and
/// prints it in the format asked for.
pub trait Report: Serialize {
    /// Fails on any number that is not usable or a shape that does not add up.
    ///
    /// # Errors
    /// The first [`ResultError`] found.
    fn check(&self) -> Result<(), ResultError>;

    /// The human table.
    fn table(&self) -> String;

    /// CSV: one line per row, the configuration repeated on every line.
    fn csv(&self) -> String;

    /// The text for stdout in `format`.
    ///
    /// # Errors
    /// Only if JSON serialisation fails.
    fn render(&self, format: OutputFormat) -> Result<String, serde_json::Error> {
        Ok(match format {
            OutputFormat::Table => self.table(),
            OutputFormat::Json => {
                let mut s = serde_json::to_string_pretty(self)?;
                s.push('\n');
                s
            }
            OutputFormat::Csv => self.csv(),
        })
    }
}

/// A row's time: rank 0's of `times` (every rank's median, in rank order), once every rank's is
/// usable (positive and finite).
///
/// # Errors
/// [`ResultError::BadTime`] naming op `op`, `sms` and the first rank whose time is not usable
/// (rank 0 with NaN when there is none at all).
pub fn row_time(op: &str, sms: u32, times: &[f64]) -> Result<f64, ResultError> {
    let bad = |rank, value| ResultError::BadTime {
        op: op.into(),
        sms,
        rank,
        value,
    };
    if let Some((rank, &value)) = times.iter().enumerate().find(|(_, t)| !usable(**t)) {
        return Err(bad(rank, value));
    }
    times.first().copied().ok_or_else(|| bad(0, f64::NAN))
}

/// Checks a parsed row's numbers: its time and every rank's usable, its rates finite and not
/// negative.
///
/// # Errors
/// [`ResultError::BadTime`] naming `op`, `sms` and the rank (0 for the row's own time or a
/// rate).
pub fn check_times(
    op: &str,
    sms: u32,
    time_us: f64,
    rates: &[f64],
    rank_time_us: &[f64],
) -> Result<(), ResultError> {
    let bad = |rank, value| ResultError::BadTime {
        op: op.into(),
        sms,
        rank,
        value,
    };
    if !usable(time_us) || !rates.iter().all(|v| v.is_finite() && *v >= 0.0) {
        return Err(bad(0, time_us));
    }
    match rank_time_us.iter().enumerate().find(|(_, t)| !usable(**t)) {
        Some((rank, &v)) => Err(bad(rank, v)),
        None => Ok(()),
    }
}

/// Builds a row from rank 0's view: `times[r]` is rank r's median (rank 0's is the row's
/// time), `recv_rows` rank 0's received rows.
///
/// # Errors
/// [`ResultError::BadTime`] when a time is not positive and finite (no NaN is ever reported).
pub fn make_row(
    op: BenchOp,
    sms: u32,
    times: Vec<f64>,
    recv_rows: usize,
    hidden: usize,
) -> Result<ResultRow, ResultError> {
    let t = row_time(op_id(op), sms, &times)?;
    let gbps = op.metric_bytes(recv_rows, hidden) / (t * 1e-6) / 1e9;
    if !gbps.is_finite() {
        return Err(ResultError::BadTime {
            op: op_id(op).into(),
            sms,
            rank: 0,
            value: t,
        });
    }
    Ok(ResultRow {
        op: op_id(op).into(),
        sms,
        time_us: t,
        gbps,
        recv_rows,
        rank_time_us: times,
    })
}

impl Report for BenchReport {
    /// Checks what came back from the workers: schema and finite numbers.
    ///
    /// # Errors
    /// [`ResultError`] naming the first problem.
    fn check(&self) -> Result<(), ResultError> {
        check_shape(&self.schema, SCHEMA, self.results.len())?;
        for r in &self.results {
            check_times(&r.op, r.sms, r.time_us, &[r.gbps], &r.rank_time_us)?;
        }
        Ok(())
    }

    /// CSV: one line per row, the config repeated on every line.
    fn csv(&self) -> String {
        let c = &self.config;
        let mut s = String::from(
            "op,sms,time_us,gbps,recv_rows,world,transport,schedule,routes,tokens,hidden,top_k,\
             experts,iters,warmup\n",
        );
        for r in &self.results {
            let _ = writeln!(
                s,
                "{},{},{:.3},{:.3},{},{},{},{},{},{},{},{},{},{},{}",
                r.op,
                r.sms,
                r.time_us,
                r.gbps,
                r.recv_rows,
                c.world,
                c.transport,
                c.schedule,
                c.routes,
                c.tokens,
                c.hidden,
                c.top_k,
                c.experts,
                c.iters,
                c.warmup
            );
        }
        s
    }

    /// The human-readable table (and the skew demo's outcome, when present).
    fn table(&self) -> String {
        let c = &self.config;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "epcomm bench: {} x {} ({} SMs each), {}",
            c.world,
            c.gpu_name,
            c.gpu_sms,
            c.describe()
        );
        let _ = writeln!(
            s,
            "{} tokens/rank, hidden {}, top-{} of {} experts; median of {} calls after {} \
             warm-up, {}",
            c.tokens,
            c.hidden,
            c.top_k,
            c.experts,
            c.iters,
            c.warmup,
            c.l2_note()
        );
        if let Some(note) = c.sharing_note() {
            let _ = writeln!(s, "{note}");
        }
        let _ = writeln!(
            s,
            "GB/s: DeepEP's metric on rank 0 (received bytes incl. self / time)"
        );
        let _ = writeln!(
            s,
            "{:<22} {:>5} {:>10} {:>10} {:>24}",
            "op", "SMs", "us", "GB/s", "us per rank"
        );
        for r in &self.results {
            let per: Vec<String> = r.rank_time_us.iter().map(|v| format!("{v:.1}")).collect();
            let _ = writeln!(
                s,
                "{:<22} {:>5} {:>10.1} {:>10.1} {:>24}",
                op_display(&r.op),
                r.sms,
                r.time_us,
                r.gbps,
                per.join(" / ")
            );
        }
        if let Some(k) = &self.skew {
            let _ = writeln!(
                s,
                "\nskew demo: rank {} delayed by {} us before each of 5 dispatches",
                k.delayed_rank, k.delay_us
            );
            for (r, st) in k.statements.iter().enumerate() {
                let _ = writeln!(s, "  rank {r} says: {}", st.trim_end());
            }
            let _ = writeln!(s, "  late rank named by each rank: {:?}", k.named);
        }
        s
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The configuration of a synthetic 2-rank run at `sms` SMs on `gpus` GPUs.
    pub(crate) fn synthetic_config(sms: Vec<u32>, gpus: usize) -> BenchConfig {
        BenchConfig {
            world: 2,
            transport: "nvshmem:vnodes=2".into(),
            schedule: "epoch".into(),
            routes: "auto".into(),
            tokens: 4096,
            hidden: 7168,
            top_k: 8,
            experts: 256,
            sms,
            iters: 50,
            warmup: 5,
            fp8: true,
            gpu_sms: 132,
            gpu_name: "Synthetic GPU".into(),
            gpus,
            mps: false,
            combine_staging: "auto".into(),
            warm_l2: false,
            rail_ring: String::new(),
            rail_forward_sms: 0,
        }
    }

    /// A synthetic two-point sweep on 2 ranks.
    pub(crate) fn synthetic() -> BenchReport {
        let mut results = Vec::new();
        for (sms, t) in [(16u32, 300.0), (32, 200.0)] {
            for op in [BenchOp::DispatchBf16, BenchOp::Combine] {
                results.push(make_row(op, sms, vec![t, t + 5.0], 8160, 7168).unwrap());
            }
        }
        BenchReport {
            schema: SCHEMA.into(),
            config: synthetic_config(vec![16, 32], 2),
            results,
            skew: None,
        }
    }

    /// The configuration keys every report's JSON carries.
    pub(crate) const CONFIG_KEYS: [&str; 14] = [
        "world",
        "transport",
        "schedule",
        "routes",
        "tokens",
        "hidden",
        "top_k",
        "experts",
        "sms",
        "iters",
        "warmup",
        "fp8",
        "gpu_sms",
        "gpu_name",
    ];

    /// `r` checked, rendered as JSON and parsed back; its schema and the configuration keys
    /// (and `extra` ones) asserted.
    pub(crate) fn json_of<R: Report>(r: &R, schema: &str, extra: &[&str]) -> serde_json::Value {
        r.check().unwrap();
        let text = r.render(OutputFormat::Json).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["schema"], schema);
        for key in CONFIG_KEYS.iter().chain(extra) {
            assert!(!v["config"][key].is_null(), "config.{key} missing: {text}");
        }
        v
    }

    #[test]
    fn json_schema() {
        let r = synthetic();
        let v = json_of(&r, SCHEMA, &[]);
        let rows = v["results"].as_array().unwrap();
        assert_eq!(rows.len(), 4);
        for row in rows {
            assert!(row["op"].is_string());
            assert!(row["sms"].is_u64());
            assert!(row["time_us"].as_f64().unwrap() > 0.0);
            assert!(row["gbps"].as_f64().unwrap().is_finite());
            assert!(row["recv_rows"].is_u64());
            assert_eq!(row["rank_time_us"].as_array().unwrap().len(), 2);
        }
        assert_eq!(rows[0]["op"], "dispatch_bf16");
        assert!(v.get("skew").is_none());
        // Round trip.
        let back: BenchReport = serde_json::from_value(v.clone()).unwrap();
        assert_eq!(back, r);
    }

    #[test]
    fn metric_and_csv() {
        let r = synthetic();
        // 8160 rows * 7168 * 2 bytes in 300 us.
        let expect = 8160.0 * 7168.0 * 2.0 / 300e-6 / 1e9;
        assert!((r.results[0].gbps - expect).abs() < 1e-9);
        let csv = r.csv();
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines.len(), 5);
        assert!(lines[0].starts_with("op,sms,time_us,gbps,"));
        let header = lines[0].split(',').count();
        assert!(lines.iter().all(|l| l.split(',').count() == header));
        assert!(lines[1].starts_with("dispatch_bf16,16,300.000,"));
        assert!(!csv.contains("NaN") && !csv.contains("inf"));
        let table = r.table();
        assert!(table.contains("dispatch BF16") && table.contains("300.0 / 305.0"));
        assert!(
            table.contains("nvshmem:vnodes=2 transport, epoch schedule, auto routes"),
            "{table}"
        );
        assert!(
            lines[1].contains(",nvshmem:vnodes=2,epoch,auto,"),
            "{}",
            lines[1]
        );
    }

    #[test]
    fn the_table_says_how_l2_stood() {
        let mut r = synthetic();
        assert!(r.table().contains("L2 flushed between calls"));
        r.config.warm_l2 = true;
        let warm = r.table();
        assert!(
            warm.contains("L2 left warm between calls") && !warm.contains("flushed"),
            "{warm}"
        );
        let json = r.render(OutputFormat::Json).unwrap();
        let back: BenchReport = serde_json::from_str(&json).unwrap();
        assert!(back.config.warm_l2);
        // Documents from before the field were flushed.
        let mut v: serde_json::Value = serde_json::from_str(&json).unwrap();
        v["config"].as_object_mut().unwrap().remove("warm_l2");
        let old: BenchReport = serde_json::from_value(v).unwrap();
        assert!(!old.config.warm_l2);
    }

    #[test]
    fn shared_gpus_are_named_with_how_they_ran() {
        let mut r = synthetic();
        assert!(!r.table().contains("shared"), "one GPU per rank: no note");
        r.config.gpus = 1;
        let turns = r.table();
        assert!(
            turns.contains("2 ranks shared 1 GPU(s) without MPS") && turns.contains("took turns"),
            "{turns}"
        );
        r.config.mps = true;
        let mps = r.table();
        assert!(
            mps.contains("2 ranks shared 1 GPU(s) under MPS") && mps.contains("no NVLink"),
            "{mps}"
        );
        assert!(!mps.contains("CPU proxy"), "{mps}");
        // A copy-engine proxy's copies within one GPU are kernels on the SMs: said too.
        r.config.transport = "proxy-ce".into();
        let proxy = r.table();
        assert!(
            proxy.contains("no NVLink") && proxy.contains("kernel on the SMs"),
            "{proxy}"
        );
        // Documents from before the field read as one GPU per rank.
        let mut v: serde_json::Value =
            serde_json::from_str(&synthetic().render(OutputFormat::Json).unwrap()).unwrap();
        let config = v["config"].as_object_mut().unwrap();
        config.remove("gpus");
        config.remove("mps");
        let old: BenchReport = serde_json::from_value(v).unwrap();
        assert_eq!((old.config.gpus, old.config.mps), (0, false));
        assert!(old.config.sharing_note().is_none());
    }

    #[test]
    fn edge_times_are_errors_not_nan() {
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let e = make_row(BenchOp::Combine, 24, vec![100.0, bad], 10, 128).unwrap_err();
            assert!(matches!(e, ResultError::BadTime { rank: 1, .. }), "{e}");
        }
        assert!(make_row(BenchOp::Combine, 24, vec![], 10, 128).is_err());
        // No received rows: 0 GB/s, not NaN.
        assert_eq!(
            make_row(BenchOp::Combine, 24, vec![5.0], 0, 128)
                .unwrap()
                .gbps,
            0.0
        );
        let mut r = synthetic();
        r.results[1].rank_time_us[0] = f64::NAN;
        assert!(r.check().is_err());
        r.results.clear();
        assert!(r.check().is_err());
        let mut r = synthetic();
        r.schema = "other".into();
        assert!(r.check().is_err());
    }
}
