//! `epcomm bench --hierarchical`'s results: what rank 0 measures on a
//! [`epcomm::HierarchicalBuffer`], handed to the launcher as JSON, and its table and CSV.
//!
//! The JSON document is [`HierReport`] (schema [`HIER_SCHEMA`]); docs/cli.md describes it. The
//! flat bench's document ([`crate::results::BenchReport`]) is unchanged.

use std::fmt::Write as _;

use epcomm_check::hier_bench::{HierOp, HierRows};
use serde::{Deserialize, Serialize};

use crate::results::{
    BenchConfig, Report, ResultError, check_shape, check_times, row_time, usable,
};

/// Value of [`HierReport::schema`]; bumped on incompatible changes.
pub const HIER_SCHEMA: &str = "epcomm-bench-hier/2";

/// Tokens per rank of the notify-latency measurement.
pub const NOTIFY_TOKENS: usize = 128;

/// The run's configuration: the flat bench's fields and the world's tiers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HierConfig {
    /// As the flat bench reports it (`sms` holds the one SM count timed).
    #[serde(flatten)]
    pub run: BenchConfig,
    /// Logical nodes.
    pub nodes: usize,
    /// Ranks per logical node.
    pub local_ranks: usize,
    /// The rows a two-tier op writes over the rows the flat op writes, all ranks together
    /// (`epcomm_check::hier_bench::rows_written_ratio`); `null` when no rank receives a row.
    /// Where the ranks share one GPU's memory, the floor of [`HierRow::vs_flat`] for an op
    /// bound by memory bandwidth.
    pub rows_written_ratio: Option<f64>,
}

/// One timed hierarchical op, from rank 0's view.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HierRow {
    /// Op id: `hier_dispatch_fp8`, `hier_dispatch_bf16`, `hier_cached_dispatch_bf16`,
    /// `hier_combine_bf16`.
    pub op: String,
    /// Tokens per rank.
    pub tokens: usize,
    /// SMs (blocks) per op of each tier.
    pub sms: u32,
    /// Median time on rank 0, microseconds.
    pub time_us: f64,
    /// Rail ("RDMA") bytes rank 0 sends / time, GB/s (1e9 bytes/s).
    pub rail_gbps: f64,
    /// NVLink bytes rank 0 sends to the other ranks of its node / time, GB/s.
    pub nvlink_gbps: f64,
    /// The flat metric: bytes rank 0 receives (self included) / time, GB/s.
    pub gbps: f64,
    /// Rows rank 0 sends over the rail (combine: partials sent back).
    pub rail_rows: u64,
    /// Rows rank 0 sends over NVLink to the other ranks of its node (combine: rows returned
    /// to their forwarders).
    pub nvlink_rows: u64,
    /// Rows rank 0 receives (self included).
    pub recv_rows: u64,
    /// Median time of every rank, microseconds, indexed by rank.
    pub rank_time_us: Vec<f64>,
    /// Rank 0's median time of the flat op moving the same rows (a flat `Buffer` over the
    /// same ranks, transport, SMs and tokens, timed in the same run), microseconds; `null`
    /// where the flat op was not timed (a report of schema 1 had no such field).
    pub flat_time_us: Option<f64>,
    /// [`Self::time_us`] over [`Self::flat_time_us`].
    pub vs_flat: Option<f64>,
}

/// One tier's count exchange in the notify measurement, every rank's median on its own clock.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TierNotifyReport {
    /// Time from the tier's dispatch kernel start until its counts were ready, us, indexed by
    /// rank (`null` where the kernel did not report it).
    pub counts_ready_us: Vec<Option<f64>>,
    /// The tier's dispatch kernel time, us, indexed by rank.
    pub kernel_us: Vec<f64>,
}

/// Notify latency: a hierarchical BF16 dispatch of [`NOTIFY_TOKENS`] tokens per rank (both
/// tiers' layouts and count exchanges included), and each tier's count exchange.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NotifyReport {
    /// The timed dispatch (op `hier_dispatch_bf16`, `tokens` 128).
    pub dispatch: HierRow,
    /// The rail tier.
    pub rail: TierNotifyReport,
    /// The node tier.
    pub node: TierNotifyReport,
    /// How long each rank's host took to issue the timed dispatch (median, microseconds,
    /// indexed by rank; `Timer::issue_us`): beyond the line-up spin, the events include it.
    pub host_issue_us: Vec<f64>,
}

/// The whole result document.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HierReport {
    /// [`HIER_SCHEMA`].
    pub schema: String,
    /// The configuration.
    pub config: HierConfig,
    /// One row per op at `config.tokens` tokens per rank.
    pub results: Vec<HierRow>,
    /// The notify latency at [`NOTIFY_TOKENS`] tokens per rank.
    pub notify: NotifyReport,
}

/// Builds a row from rank 0's view: `times[r]` is rank r's median (rank 0's is the row's
/// time), `rows` rank 0's rows per tier for `tokens` tokens per rank.
///
/// # Errors
/// [`ResultError::BadTime`] when a time is not positive and finite (no NaN is ever reported).
pub fn make_hier_row(
    op: HierOp,
    tokens: usize,
    sms: u32,
    times: Vec<f64>,
    rows: &HierRows,
    hidden: usize,
) -> Result<HierRow, ResultError> {
    let t = row_time(op.id(), sms, &times)?;
    let bad = |rank, value| ResultError::BadTime {
        op: op.id().into(),
        sms,
        rank,
        value,
    };
    let bytes = rows.bytes(op, hidden);
    let rate = |b: f64| b / (t * 1e-6) / 1e9;
    let (rail_gbps, nvlink_gbps, gbps) = (rate(bytes.rail), rate(bytes.nvlink), rate(bytes.flat));
    if ![rail_gbps, nvlink_gbps, gbps].iter().all(|v| v.is_finite()) {
        return Err(bad(0, t));
    }
    let (rail_rows, nvlink_rows, recv_rows) = rows.tier_rows(op);
    Ok(HierRow {
        op: op.id().into(),
        tokens,
        sms,
        time_us: t,
        rail_gbps,
        nvlink_gbps,
        gbps,
        rail_rows,
        nvlink_rows,
        recv_rows,
        rank_time_us: times,
        flat_time_us: None,
        vs_flat: None,
    })
}

impl HierRow {
    /// The row with the flat op's times in the same run (`flat[r]`: rank r's median; rank 0's
    /// is the one compared).
    ///
    /// # Errors
    /// [`ResultError::BadTime`] when a flat time is not positive and finite.
    pub fn with_flat(self, flat: &[f64]) -> Result<Self, ResultError> {
        let flat_op = HierOp::from_id(&self.op).map_or(self.op.as_str(), |op| op.flat().name());
        let t = row_time(flat_op, self.sms, flat)?;
        Ok(Self {
            flat_time_us: Some(t),
            vs_flat: Some(self.time_us / t),
            ..self
        })
    }

    fn check(&self) -> Result<(), ResultError> {
        if HierOp::from_id(&self.op).is_none() {
            return Err(ResultError::Malformed(format!("unknown op {:?}", self.op)));
        }
        if self.rank_time_us.is_empty() {
            return Err(ResultError::Malformed(format!(
                "{}: no per-rank times",
                self.op
            )));
        }
        let rates = [self.rail_gbps, self.nvlink_gbps, self.gbps];
        check_times(&self.op, self.sms, self.time_us, &rates, &self.rank_time_us)?;
        match (self.flat_time_us, self.vs_flat) {
            (None, None) => Ok(()),
            (Some(flat), Some(ratio)) if usable(flat) && usable(ratio) => Ok(()),
            (flat, ratio) => Err(ResultError::Malformed(format!(
                "{}: flat time {flat:?} and ratio {ratio:?} must both be positive numbers or \
                 both null",
                self.op
            ))),
        }
    }

    fn csv_fields(&self) -> String {
        let opt = |v: Option<f64>| v.map_or_else(String::new, |v| format!("{v:.3}"));
        format!(
            "{},{},{},{:.3},{},{},{:.3},{:.3},{:.3},{},{},{}",
            self.op,
            self.tokens,
            self.sms,
            self.time_us,
            opt(self.flat_time_us),
            opt(self.vs_flat),
            self.rail_gbps,
            self.nvlink_gbps,
            self.gbps,
            self.rail_rows,
            self.nvlink_rows,
            self.recv_rows
        )
    }
}

impl TierNotifyReport {
    fn check(&self, tier: &str, world: usize) -> Result<(), ResultError> {
        let malformed =
            |what: String| Err(ResultError::Malformed(format!("notify {tier}: {what}")));
        if self.counts_ready_us.len() != world || self.kernel_us.len() != world {
            return malformed(format!("{world} ranks expected"));
        }
        if let Some((r, v)) = self
            .kernel_us
            .iter()
            .enumerate()
            .find(|(_, t)| !usable(**t))
        {
            return malformed(format!(
                "rank {r} measured an unusable kernel time ({v} us)"
            ));
        }
        if let Some((r, v)) = self
            .counts_ready_us
            .iter()
            .enumerate()
            .find_map(|(r, v)| v.filter(|v| !(v.is_finite() && *v >= 0.0)).map(|v| (r, v)))
        {
            return malformed(format!(
                "rank {r} measured an unusable counts-ready time ({v} us)"
            ));
        }
        Ok(())
    }

    /// Rank 0's counts-ready time and kernel time, as text.
    fn rank0(&self) -> String {
        let kernel = self.kernel_us.first().copied().unwrap_or(f64::NAN);
        match self.counts_ready_us.first().copied().flatten() {
            Some(c) => format!("counts ready after {c:.1} us of a {kernel:.1} us kernel"),
            None => format!("counts-ready time not reported; {kernel:.1} us kernel"),
        }
    }

    fn per_rank(&self) -> String {
        self.counts_ready_us
            .iter()
            .map(|v| v.map_or_else(|| "-".to_string(), |v| format!("{v:.1}")))
            .collect::<Vec<_>>()
            .join(" / ")
    }

    fn csv_fields(&self) -> (String, String) {
        let ready = self
            .counts_ready_us
            .first()
            .copied()
            .flatten()
            .map_or_else(String::new, |v| format!("{v:.3}"));
        let kernel = self
            .kernel_us
            .first()
            .map_or_else(String::new, |v| format!("{v:.3}"));
        (ready, kernel)
    }
}

/// The CSV header (one row per op, then the notify row).
pub const HIER_CSV_HEADER: &str = "op,tokens,sms,time_us,flat_time_us,vs_flat,rail_gbps,\
     nvlink_gbps,gbps,rail_rows,nvlink_rows,recv_rows,rail_counts_ready_us,node_counts_ready_us,\
     rail_kernel_us,node_kernel_us,world,nodes,local_ranks,gpus,transport,schedule,routes,hidden,\
     top_k,experts,iters,warmup,rows_written_ratio";

impl Report for HierReport {
    /// Checks what came back from the workers: schema, ops and finite numbers.
    ///
    /// # Errors
    /// [`ResultError`] naming the first problem.
    fn check(&self) -> Result<(), ResultError> {
        check_shape(&self.schema, HIER_SCHEMA, self.results.len())?;
        for r in self.results.iter().chain([&self.notify.dispatch]) {
            r.check()?;
        }
        let world = self.config.run.world;
        self.notify.rail.check("rail", world)?;
        self.notify.node.check("node", world)?;
        let issue = &self.notify.host_issue_us;
        if issue.len() != world || !issue.iter().all(|v| usable(*v)) {
            return Err(ResultError::Malformed(format!(
                "notify: host issue times {issue:?}, {world} positive numbers expected"
            )));
        }
        Ok(())
    }

    /// CSV: one line per op, then the notify line (its `tokens` is 128 and it alone fills the
    /// counts-ready and kernel columns, rank 0's); the configuration repeated on every line.
    fn csv(&self) -> String {
        let c = &self.config;
        let r = &c.run;
        let config = format!(
            "{},{},{},{},{},{},{},{},{},{},{},{},{}",
            r.world,
            c.nodes,
            c.local_ranks,
            r.gpus,
            r.transport,
            r.schedule,
            r.routes,
            r.hidden,
            r.top_k,
            r.experts,
            r.iters,
            r.warmup,
            c.rows_written_ratio
                .map_or_else(String::new, |v| format!("{v:.4}"))
        );
        let mut s = format!("{HIER_CSV_HEADER}\n");
        for row in &self.results {
            let _ = writeln!(s, "{},,,,,{config}", row.csv_fields());
        }
        let n = &self.notify;
        let ((rail_ready, rail_kernel), (node_ready, node_kernel)) =
            (n.rail.csv_fields(), n.node.csv_fields());
        let _ = writeln!(
            s,
            "{},{rail_ready},{node_ready},{rail_kernel},{node_kernel},{config}",
            n.dispatch.csv_fields()
        );
        s
    }

    /// The human-readable table.
    fn table(&self) -> String {
        let c = &self.config;
        let r = &c.run;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "epcomm bench --hierarchical: {} ranks = {} node(s) x {} local rank(s) on {} x {} \
             ({} SMs each), {}",
            r.world,
            c.nodes,
            c.local_ranks,
            r.gpus,
            r.gpu_name,
            r.gpu_sms,
            r.describe()
        );
        let _ = writeln!(
            s,
            "{} tokens/rank, hidden {}, top-{} of {} experts, {} SMs per tier; median of {} \
             calls after {} warm-up, L2 flushed between calls",
            r.tokens,
            r.hidden,
            r.top_k,
            r.experts,
            r.sms.first().copied().unwrap_or(0),
            r.iters,
            r.warmup
        );
        let _ = writeln!(
            s,
            "rank 0's bytes / time: rail = sent over the rail (\"RDMA\"), NVLink = sent to the \
             other ranks of its node, flat = received incl. self (the flat bench's metric)"
        );
        if let Some(note) = r.sharing_note() {
            let _ = writeln!(s, "{note}");
        }
        let _ = writeln!(
            s,
            "{:<28} {:>9} {:>9} {:>7} {:>10} {:>11} {:>9} {:>9} {:>11} {:>9} {:>20}",
            "op",
            "us",
            "flat us",
            "x flat",
            "rail GB/s",
            "NVLink GB/s",
            "flat GB/s",
            "rail rows",
            "NVLink rows",
            "recv rows",
            "us per rank"
        );
        let rows = self.results.iter().map(|r| (r, false));
        for (row, notify) in rows.chain([(&self.notify.dispatch, true)]) {
            let per: Vec<String> = row.rank_time_us.iter().map(|v| format!("{v:.1}")).collect();
            let name =
                HierOp::from_id(&row.op).map_or_else(|| row.op.clone(), |op| op.name().into());
            let name = if notify {
                format!("{name} ({} tok)", row.tokens)
            } else {
                name
            };
            let opt = |v: Option<f64>, digits: usize| {
                v.map_or_else(|| "-".to_string(), |v| format!("{v:.digits$}"))
            };
            let _ = writeln!(
                s,
                "{:<28} {:>9.1} {:>9} {:>7} {:>10.1} {:>11.1} {:>9.1} {:>9} {:>11} {:>9} {:>20}",
                name,
                row.time_us,
                opt(row.flat_time_us, 1),
                opt(row.vs_flat, 2),
                row.rail_gbps,
                row.nvlink_gbps,
                row.gbps,
                row.rail_rows,
                row.nvlink_rows,
                row.recv_rows,
                per.join(" / ")
            );
        }
        if let Some(ratio) = c.rows_written_ratio {
            let _ = writeln!(
                s,
                "flat us: the flat op over the same ranks, transport and SMs, same run; a two-tier \
                 op writes {ratio:.2}x the rows of the flat op (all ranks: the rail stage's, own \
                 node included, then the node stage's){}",
                if r.sharing_note().is_some() {
                    ", the floor of \"x flat\" for an op bound by the memory bandwidth the ranks \
                     share"
                } else {
                    ""
                }
            );
        }
        let n = &self.notify;
        let _ = writeln!(
            s,
            "\nnotify latency ({} tokens/rank, {} schedule): hierarchical dispatch BF16 {:.1} us \
             on rank 0 (both tiers' layouts and count exchanges included); the hosts issued it \
             in {} us",
            n.dispatch.tokens,
            r.schedule,
            n.dispatch.time_us,
            n.host_issue_us
                .iter()
                .map(|v| format!("{v:.1}"))
                .collect::<Vec<_>>()
                .join(" / ")
        );
        for (tier, t) in [("rail", &n.rail), ("node", &n.node)] {
            let _ = writeln!(
                s,
                "  {tier} tier: {} (rank 0); counts ready per rank, us: {}",
                t.rank0(),
                t.per_rank()
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::results::SCHEMA;
    use crate::results::tests::json_of;

    fn rows() -> HierRows {
        HierRows {
            recv: 8160,
            rail_sent: 4080,
            nvlink_sent: 0,
            nvlink_received: 0,
            combine_rail_sent: 4081,
            rail_stage: 8160,
        }
    }

    /// A synthetic 2-rank report (2 nodes x 1).
    pub(crate) fn synthetic() -> HierReport {
        let mut results = Vec::new();
        for (op, t) in [
            (HierOp::DispatchFp8, 150.0),
            (HierOp::DispatchBf16, 250.0),
            (HierOp::CachedDispatchBf16, 230.0),
            (HierOp::Combine, 400.0),
        ] {
            let row = make_hier_row(op, 4096, 24, vec![t, t + 2.0], &rows(), 7168).unwrap();
            results.push(row.with_flat(&[t / 2.0, t / 2.0 + 1.0]).unwrap());
        }
        let small = HierRows {
            recv: 255,
            rail_sent: 128,
            ..HierRows::default()
        };
        HierReport {
            schema: HIER_SCHEMA.into(),
            config: HierConfig {
                run: crate::results::tests::synthetic_config(vec![24], 1),
                nodes: 2,
                local_ranks: 1,
                rows_written_ratio: Some(2.0),
            },
            results,
            notify: NotifyReport {
                dispatch: make_hier_row(
                    HierOp::DispatchBf16,
                    NOTIFY_TOKENS,
                    24,
                    vec![40.0, 41.0],
                    &small,
                    7168,
                )
                .unwrap()
                .with_flat(&[20.0, 21.0])
                .unwrap(),
                rail: TierNotifyReport {
                    counts_ready_us: vec![Some(9.5), Some(10.5)],
                    kernel_us: vec![20.0, 21.0],
                },
                node: TierNotifyReport {
                    counts_ready_us: vec![Some(2.0), None],
                    kernel_us: vec![8.0, 8.5],
                },
                host_issue_us: vec![30.0, 31.5],
            },
        }
    }

    #[test]
    fn metrics_from_rows() {
        let r = synthetic();
        let d = &r.results[1];
        assert_eq!(d.op, "hier_dispatch_bf16");
        // 4080 rail rows * 7168 * 2 bytes in 250 us.
        let rail = 4080.0 * 7168.0 * 2.0 / 250e-6 / 1e9;
        assert!((d.rail_gbps - rail).abs() < 1e-9, "{}", d.rail_gbps);
        let flat = 8160.0 * 7168.0 * 2.0 / 250e-6 / 1e9;
        assert!((d.gbps - flat).abs() < 1e-9);
        assert_eq!(d.nvlink_gbps, 0.0);
        assert_eq!((d.rail_rows, d.nvlink_rows, d.recv_rows), (4080, 0, 8160));
        // The flat op of the same run: rank 0's time, and the ratio to it.
        assert_eq!((d.flat_time_us, d.vs_flat), (Some(125.0), Some(2.0)));
        assert_eq!(r.notify.dispatch.vs_flat, Some(2.0));
        // FP8 rows: hidden * (1 + 4/128) bytes.
        let f = &r.results[0];
        let rail = 4080.0 * 7168.0 * (1.0 + 4.0 / 128.0) / 150e-6 / 1e9;
        assert!((f.rail_gbps - rail).abs() < 1e-9);
        // Combine: the partials sent back over the rail.
        let c = &r.results[3];
        assert_eq!(c.rail_rows, 4081);
        let rail = 4081.0 * 7168.0 * 2.0 / 400e-6 / 1e9;
        assert!((c.rail_gbps - rail).abs() < 1e-9);
    }

    #[test]
    fn json_shape() {
        let r = synthetic();
        assert_ne!(HIER_SCHEMA, SCHEMA);
        let v = json_of(&r, HIER_SCHEMA, &["nodes", "local_ranks", "gpus"]);
        let rows = v["results"].as_array().unwrap();
        assert_eq!(rows.len(), 4);
        for row in rows.iter().chain([&v["notify"]["dispatch"]]) {
            for key in ["time_us", "rail_gbps", "nvlink_gbps", "gbps"] {
                assert!(row[key].as_f64().unwrap().is_finite(), "{key}: {row}");
            }
            for key in ["tokens", "sms", "rail_rows", "nvlink_rows", "recv_rows"] {
                assert!(row[key].is_u64(), "{key}: {row}");
            }
            assert!(row.get("flat_time_us").is_some() && row.get("vs_flat").is_some());
            assert_eq!(row["rank_time_us"].as_array().unwrap().len(), 2);
        }
        assert_eq!(v["notify"]["dispatch"]["tokens"], 128);
        assert_eq!(v["notify"]["dispatch"]["vs_flat"], 2.0);
        assert_eq!(v["results"][1]["vs_flat"], 2.0);
        assert_eq!(v["config"]["rows_written_ratio"], 2.0);
        assert_eq!(v["notify"]["dispatch"]["op"], "hier_dispatch_bf16");
        assert_eq!(
            v["notify"]["node"]["counts_ready_us"],
            serde_json::json!([2.0, null])
        );
        assert_eq!(
            v["notify"]["rail"]["kernel_us"].as_array().unwrap().len(),
            2
        );
        // Round trip (serde_json may move a float by an ulp).
        let back: HierReport = serde_json::from_value(v.clone()).unwrap();
        assert_eq!(
            (&back.config, &back.notify.rail),
            (&r.config, &r.notify.rail)
        );
        let rows = |x: &HierReport| {
            x.results
                .iter()
                .chain([&x.notify.dispatch])
                .cloned()
                .collect::<Vec<_>>()
        };
        for (b, a) in rows(&back).iter().zip(rows(&r).iter()) {
            assert_eq!(
                (&b.op, b.rail_rows, b.recv_rows),
                (&a.op, a.rail_rows, a.recv_rows)
            );
            assert!((b.gbps - a.gbps).abs() <= 1e-12 * a.gbps, "{b:?}");
        }
    }

    #[test]
    fn csv_shape() {
        let r = synthetic();
        let csv = r.csv();
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines.len(), 6, "{csv}");
        assert_eq!(lines[0], HIER_CSV_HEADER);
        let header: Vec<&str> = lines[0].split(',').collect();
        assert!(lines.iter().all(|l| l.split(',').count() == header.len()));
        let col = |line: &str, name: &str| {
            let i = header.iter().position(|h| *h == name).unwrap();
            line.split(',').nth(i).unwrap().to_string()
        };
        assert_eq!(col(lines[1], "op"), "hier_dispatch_fp8");
        assert_eq!(col(lines[2], "time_us"), "250.000");
        assert_eq!(col(lines[2], "tokens"), "4096");
        assert_eq!(col(lines[2], "rail_counts_ready_us"), "");
        assert_eq!(col(lines[2], "flat_time_us"), "125.000");
        assert_eq!(col(lines[2], "vs_flat"), "2.000");
        assert_eq!(col(lines[5], "flat_time_us"), "20.000");
        assert_eq!(col(lines[5], "rows_written_ratio"), "2.0000");
        assert_eq!(col(lines[5], "op"), "hier_dispatch_bf16");
        assert_eq!(col(lines[5], "tokens"), "128");
        assert_eq!(col(lines[5], "rail_counts_ready_us"), "9.500");
        assert_eq!(col(lines[5], "node_kernel_us"), "8.000");
        assert_eq!(col(lines[5], "transport"), "nvshmem:vnodes=2");
        assert_eq!(col(lines[5], "nodes"), "2");
        assert!(!csv.contains("NaN") && !csv.contains("inf"));
    }

    #[test]
    fn table_names_every_op_and_the_notify_latency() {
        let t = synthetic().table();
        for needle in [
            "2 ranks = 2 node(s) x 1 local rank(s) on 1 x Synthetic GPU",
            "nvshmem:vnodes=2 transport, epoch schedule, auto routes",
            "hier dispatch FP8",
            "hier cached dispatch BF16",
            "hier combine BF16",
            "hier dispatch BF16 (128 tok)",
            "250.0 / 252.0",
            "2 ranks shared 1 GPU(s) without MPS",
            "rail tier: counts ready after 9.5 us of a 20.0 us kernel",
            "counts ready per rank, us: 2.0 / -",
            "the hosts issued it in 30.0 / 31.5 us",
            "flat us",
            "x flat",
            "a two-tier op writes 2.00x the rows of the flat op",
            "the floor of \"x flat\"",
        ] {
            assert!(t.contains(needle), "{needle:?} missing:\n{t}");
        }
    }

    #[test]
    fn unusable_numbers_are_errors() {
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let e =
                make_hier_row(HierOp::Combine, 1, 24, vec![10.0, bad], &rows(), 128).unwrap_err();
            assert!(matches!(e, ResultError::BadTime { rank: 1, .. }), "{e}");
        }
        assert!(make_hier_row(HierOp::Combine, 1, 24, vec![], &rows(), 128).is_err());
        let mut r = synthetic();
        r.notify.rail.kernel_us[1] = f64::NAN;
        assert!(r.check().is_err());
        let mut r = synthetic();
        r.notify.node.counts_ready_us[0] = Some(f64::INFINITY);
        assert!(r.check().is_err());
        let mut r = synthetic();
        r.notify.node.counts_ready_us.pop();
        assert!(r.check().is_err());
        let mut r = synthetic();
        r.notify.host_issue_us[1] = f64::NAN;
        assert!(r.check().is_err());
        let mut r = synthetic();
        r.notify.host_issue_us.pop();
        assert!(r.check().is_err());
        let mut r = synthetic();
        r.results[0].op = "dispatch_bf16".into();
        assert!(r.check().is_err());
        let mut r = synthetic();
        r.schema = SCHEMA.into();
        assert!(r.check().is_err());
        // A flat time without its ratio, or an unusable one, is malformed.
        let mut r = synthetic();
        r.results[1].vs_flat = None;
        assert!(r.check().is_err());
        let mut r = synthetic();
        r.results[1].flat_time_us = Some(0.0);
        assert!(r.check().is_err());
        let row = synthetic().results[0].clone();
        assert!(matches!(
            row.with_flat(&[f64::NAN]),
            Err(ResultError::BadTime { rank: 0, .. })
        ));
        let mut r = synthetic();
        r.results.clear();
        assert!(r.check().is_err());
    }
}
