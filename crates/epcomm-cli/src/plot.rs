//! SM sweeps drawn as SVG charts: one line per op against the SM count, both axes
//! logarithmic.
//!
//! Two ways in: `epcomm bench --sweep-sms ... --plot PATH` draws the run it just made (GB/s),
//! and `epcomm plot RUN.json` draws a saved `epcomm bench --json` document (time per op by
//! default, or GB/s). The chart is a pure function of its input (same document, same bytes),
//! which is how the charts of docs/benchmarks.md are kept in step with docs/data (a test of this
//! crate redraws them).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use plotters::prelude::*;
use serde::Deserialize;

use epcomm_check::timing::BenchOp;

pub use crate::cli::Metric;
use crate::results::{BenchReport, SCHEMA, op_display, op_id};

/// Why a chart was not drawn; each names the input or the output.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// Nothing to draw.
    #[error("{input}: no results to plot")]
    Empty {
        /// What was drawn from.
        input: String,
    },
    /// A value cannot go on the chart's logarithmic axis.
    #[error(
        "{input}: {field} is {value}: a chart draws numbers from {MIN_VALUE:e} to {MAX_VALUE:e}"
    )]
    NotPositive {
        /// What was drawn from.
        input: String,
        /// The offending field, e.g. `results[3].gbps`.
        field: String,
        /// Its value.
        value: f64,
    },
    /// The saved document cannot be read.
    #[error("{path}: {detail}")]
    Read {
        /// The document.
        path: PathBuf,
        /// Why.
        detail: String,
    },
    /// The drawing backend failed.
    #[error("drawing {input}: {detail}")]
    Draw {
        /// What was drawn from.
        input: String,
        /// The backend's error.
        detail: String,
    },
    /// The chart could not be written.
    #[error("writing {path}: {source}")]
    Write {
        /// The chart's path.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

/// The smallest value a chart draws (below, a logarithmic axis degenerates).
pub const MIN_VALUE: f64 = 1e-9;
/// The largest value a chart draws.
pub const MAX_VALUE: f64 = 1e15;

impl Metric {
    fn axis(self) -> &'static str {
        match self {
            Self::Us => "us per op, rank 0's median (log scale)",
            Self::Gbps => "GB/s, DeepEP's metric on rank 0 (log scale)",
        }
    }
}

/// A chart's content: captions and, per op (in the bench's op order), points (SMs, value)
/// in increasing SM order.
#[derive(Debug, PartialEq)]
pub struct Sweep {
    title: String,
    metric: Metric,
    series: Vec<(String, Vec<(f64, f64)>)>,
}

/// The fields of a saved `epcomm bench --json` document a chart reads; the others are ignored,
/// so a document holding only these (e.g. numbers copied from a table) draws too.
#[derive(Debug, Deserialize)]
struct SavedRun {
    schema: String,
    config: SavedConfig,
    results: Vec<SavedRow>,
}

#[derive(Debug, Deserialize)]
struct SavedConfig {
    world: usize,
    transport: String,
    schedule: String,
    tokens: usize,
    hidden: usize,
}

#[derive(Debug, Deserialize)]
struct SavedRow {
    op: String,
    sms: u32,
    time_us: f64,
    gbps: Option<f64>,
}

fn title(transport: &str, schedule: &str, world: usize, tokens: usize, hidden: usize) -> String {
    format!(
        "epcomm, {transport} transport, {schedule} schedule: {world} ranks, {tokens} tokens, hidden {hidden}"
    )
}

impl Sweep {
    /// Groups `(op, sms, value)` rows; `field(i)` names row `i`'s value in errors.
    fn group(
        input: &str,
        title: String,
        metric: Metric,
        rows: impl Iterator<Item = (String, u32, f64)>,
        field: impl Fn(usize) -> String,
    ) -> Result<Self, PlotError> {
        let mut by_op: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
        for (i, (op, sms, value)) in rows.enumerate() {
            if !(MIN_VALUE..=MAX_VALUE).contains(&value) {
                return Err(PlotError::NotPositive {
                    input: input.to_owned(),
                    field: field(i),
                    value,
                });
            }
            if sms == 0 {
                return Err(PlotError::NotPositive {
                    input: input.to_owned(),
                    field: format!("results[{i}].sms"),
                    value: 0.0,
                });
            }
            by_op.entry(op).or_default().push((f64::from(sms), value));
        }
        if by_op.is_empty() {
            return Err(PlotError::Empty {
                input: input.to_owned(),
            });
        }
        // The bench's op order (the order of its table), unknown ops after, by name.
        let rank = |op: &str| {
            BenchOp::ALL
                .into_iter()
                .chain(BenchOp::LOW_LATENCY)
                .position(|o| op_id(o) == op)
                .unwrap_or(usize::MAX)
        };
        let mut series: Vec<(String, Vec<(f64, f64)>)> = by_op.into_iter().collect();
        series.sort_by_key(|(op, _)| rank(op));
        for (_, points) in &mut series {
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
        }
        Ok(Self {
            title,
            metric,
            series,
        })
    }

    /// The sweep of a run just made, in GB/s.
    ///
    /// # Errors
    /// [`PlotError`] when there are no results or a value is not positive and finite.
    pub fn of_report(report: &BenchReport) -> Result<Self, PlotError> {
        let c = &report.config;
        Self::group(
            "the sweep",
            title(&c.transport, &c.schedule, c.world, c.tokens, c.hidden),
            Metric::Gbps,
            report.results.iter().map(|r| (r.op.clone(), r.sms, r.gbps)),
            |i| format!("results[{i}].gbps"),
        )
    }

    /// The sweep of a saved `epcomm bench --json` document (schema [`SCHEMA`]).
    ///
    /// # Errors
    /// [`PlotError::Read`] when the file cannot be read, is not such a document, or lacks
    /// `gbps` for [`Metric::Gbps`]; the others as [`Sweep::of_report`].
    pub fn of_saved(path: &Path, metric: Metric) -> Result<Self, PlotError> {
        let read = |detail: String| PlotError::Read {
            path: path.to_owned(),
            detail,
        };
        let text = std::fs::read_to_string(path).map_err(|e| read(e.to_string()))?;
        let run: SavedRun = serde_json::from_str(&text)
            .map_err(|e| read(format!("not an `epcomm bench --json` document: {e}")))?;
        if run.schema != SCHEMA {
            return Err(read(format!(
                "schema is {:?}; this epcomm reads {SCHEMA:?}",
                run.schema
            )));
        }
        let mut rows = Vec::with_capacity(run.results.len());
        for (i, r) in run.results.into_iter().enumerate() {
            let value = match metric {
                Metric::Us => r.time_us,
                Metric::Gbps => r.gbps.ok_or_else(|| {
                    read(format!(
                        "results[{i}].gbps is missing: draw `--metric us` instead"
                    ))
                })?,
            };
            rows.push((r.op, r.sms, value));
        }
        let c = &run.config;
        let field = match metric {
            Metric::Us => "time_us",
            Metric::Gbps => "gbps",
        };
        Self::group(
            &path.display().to_string(),
            title(&c.transport, &c.schedule, c.world, c.tokens, c.hidden),
            metric,
            rows.into_iter(),
            |i| format!("results[{i}].{field}"),
        )
    }

    /// Every point's coordinate `pick` lies inside the range, which runs from a power of two to
    /// a power of two, so each axis has at least two ticks (one point, or equal values, too).
    fn range(&self, pick: fn(&(f64, f64)) -> f64) -> std::ops::Range<f64> {
        let values = || self.series.iter().flat_map(|(_, p)| p.iter().map(pick));
        let lo = values().fold(f64::INFINITY, f64::min);
        let hi = values().fold(f64::NEG_INFINITY, f64::max);
        (lo / 1.05).log2().floor().exp2()..(hi * 1.05).log2().ceil().exp2()
    }

    /// The chart as SVG text.
    ///
    /// # Errors
    /// [`PlotError::Draw`] when the backend fails.
    pub fn render(&self) -> Result<String, PlotError> {
        let mut svg = String::new();
        self.draw(&mut svg)?;
        Ok(svg)
    }

    fn draw(&self, out: &mut String) -> Result<(), PlotError> {
        let fail = |e: &dyn std::fmt::Display| PlotError::Draw {
            input: self.title.clone(),
            detail: e.to_string(),
        };
        let root = SVGBackend::with_string(out, (900, 560)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| fail(&e))?;
        let mut chart = ChartBuilder::on(&root)
            .caption(&self.title, ("sans-serif", 18))
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(64)
            // Ticks at powers of two on both axes (4, 8, 16 SMs; 64, 128, 256 us): with at
            // most 8 labels requested, the log axis puts no ticks between them.
            .build_cartesian_2d(
                self.range(|p| p.0).log_scale().base(2.0),
                self.range(|p| p.1).log_scale().base(2.0),
            )
            .map_err(|e| fail(&e))?;
        chart
            .configure_mesh()
            .x_desc("SMs per op (log scale)")
            .y_desc(self.metric.axis())
            .x_labels(8)
            .y_labels(8)
            .x_label_formatter(&|x| tick_label(*x))
            .y_label_formatter(&|y| tick_label(*y))
            .draw()
            .map_err(|e| fail(&e))?;
        for (i, (op, points)) in self.series.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            chart
                .draw_series(LineSeries::new(
                    points.iter().copied(),
                    color.stroke_width(2),
                ))
                .map_err(|e| fail(&e))?
                .label(op_display(op).to_string())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color));
            chart
                .draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))
                .map_err(|e| fail(&e))?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(match self.metric {
                Metric::Us => SeriesLabelPosition::UpperRight,
                Metric::Gbps => SeriesLabelPosition::LowerRight,
            })
            .draw()
            .map_err(|e| fail(&e))?;
        root.present().map_err(|e| fail(&e))?;
        Ok(())
    }

    /// Writes the chart to `path`.
    ///
    /// # Errors
    /// As [`Sweep::render`], and [`PlotError::Write`] when the file cannot be written.
    pub fn write(&self, path: &Path) -> Result<(), PlotError> {
        let svg = self.render()?;
        std::fs::write(path, svg).map_err(|source| PlotError::Write {
            path: path.to_owned(),
            source,
        })
    }
}

/// A tick's label: whole numbers from 1 up, else as many decimals as the value needs (at most
/// 9, `0.125`).
fn tick_label(v: f64) -> String {
    if v >= 1.0 {
        format!("{v:.0}")
    } else {
        let s = format!("{v:.9}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::results::tests::synthetic;

    fn temp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("epcomm-cli-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join(name)
    }

    #[test]
    fn a_report_draws_one_line_per_op() {
        let sweep = Sweep::of_report(&synthetic()).unwrap();
        let svg = sweep.render().unwrap();
        assert!(svg.contains("<svg"), "{svg}");
        assert!(svg.contains("dispatch BF16") && svg.contains("combine BF16"));
        assert!(svg.contains("<polyline") || svg.contains("<path"));
        assert!(!svg.contains("NaN"));
        assert_eq!(svg, sweep.render().unwrap(), "deterministic");
    }

    #[test]
    fn one_point_empty_bad_values_and_bad_path() {
        let mut r = synthetic();
        r.results.truncate(1);
        Sweep::of_report(&r).unwrap().render().unwrap();
        r.results.clear();
        assert!(matches!(Sweep::of_report(&r), Err(PlotError::Empty { .. })));
        let mut r = synthetic();
        r.results[1].gbps = f64::NAN;
        let err = Sweep::of_report(&r).unwrap_err().to_string();
        assert!(err.contains("results[1].gbps"), "{err}");
        let err = Sweep::of_report(&synthetic())
            .unwrap()
            .write(Path::new("/nonexistent-epcomm/x.svg"))
            .unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent-epcomm/x.svg"),
            "{err}"
        );
    }

    #[test]
    fn extreme_values_are_refused_and_small_ones_labelled() {
        let mut r = synthetic();
        for bad in [1.5e308, 1e-320, 0.0, -1.0, f64::INFINITY] {
            r.results[0].gbps = bad;
            let err = Sweep::of_report(&r).unwrap_err().to_string();
            assert!(err.contains("results[0].gbps"), "{bad}: {err}");
        }
        assert_eq!(tick_label(0.125), "0.125");
        assert_eq!(tick_label(0.5), "0.5");
        assert_eq!(tick_label(64.0), "64");
    }

    #[test]
    fn every_axis_has_two_ticks_even_for_one_point() {
        let mut r = synthetic();
        r.results.truncate(1);
        let sms = r.results[0].sms;
        let sweep = Sweep::of_report(&r).unwrap();
        let x = sweep.range(|p| p.0);
        assert!(
            x.start <= f64::from(sms) && f64::from(sms) <= x.end,
            "{x:?}"
        );
        // Both ends are powers of two, at least a factor of two apart.
        for end in [x.start, x.end] {
            assert_eq!(end.log2().fract(), 0.0, "{x:?}");
        }
        assert!(x.end >= 2.0 * x.start, "{x:?}");
        sweep.render().unwrap();
    }

    #[test]
    fn a_saved_document_draws_as_the_run_did() {
        let report = synthetic();
        let path = temp("saved.json");
        std::fs::write(&path, serde_json::to_string(&report).unwrap()).unwrap();
        let saved = Sweep::of_saved(&path, Metric::Gbps).unwrap();
        assert_eq!(saved, Sweep::of_report(&report).unwrap());
        let us = Sweep::of_saved(&path, Metric::Us).unwrap();
        assert_eq!(us.series.len(), saved.series.len());
        assert!(us.render().unwrap().contains("us per op"));
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_saved_document_with_only_times_draws_them_and_names_what_is_missing() {
        let path = temp("times.json");
        std::fs::write(
            &path,
            format!(
                r#"{{"schema":"{SCHEMA}","config":{{"world":2,"transport":"ipc","schedule":"epoch",
                "tokens":4096,"hidden":7168}},"results":[
                {{"op":"combine_bf16","sms":8,"time_us":500.0}},
                {{"op":"dispatch_fp8","sms":8,"time_us":190.0}},
                {{"op":"combine_bf16","sms":4,"time_us":1000.0}}]}}"#
            ),
        )
        .unwrap();
        let s = Sweep::of_saved(&path, Metric::Us).unwrap();
        assert_eq!(s.series[0].0, "dispatch_fp8", "the bench's op order");
        assert_eq!(s.series[1].1, vec![(4.0, 1000.0), (8.0, 500.0)]);
        let err = Sweep::of_saved(&path, Metric::Gbps)
            .unwrap_err()
            .to_string();
        assert!(err.contains("results[0].gbps is missing"), "{err}");
        std::fs::write(
            &path,
            r#"{"schema":"epcomm-bench/1","config":{},"results":[]}"#,
        )
        .unwrap();
        let err = Sweep::of_saved(&path, Metric::Us).unwrap_err().to_string();
        assert!(
            err.contains("not an `epcomm bench --json` document"),
            "{err}"
        );
        let err = Sweep::of_saved(&temp("absent.json"), Metric::Us).unwrap_err();
        assert!(matches!(err, PlotError::Read { .. }));
        let _ = std::fs::remove_file(&path);
    }

    /// The charts of docs/benchmarks.md are what `epcomm plot` draws from docs/data: redraw
    /// each and compare (regenerate with `epcomm plot docs/data/NAME.json -o docs/img/NAME.svg`).
    #[test]
    fn the_docs_charts_are_drawn_from_their_data() {
        let docs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs");
        let mut checked = 0;
        for entry in std::fs::read_dir(docs.join("data")).unwrap() {
            let data = entry.unwrap().path();
            if data.extension().is_none_or(|e| e != "json") {
                continue;
            }
            let stem = data.file_stem().unwrap().to_string_lossy().into_owned();
            let svg = docs.join("img").join(format!("{stem}.svg"));
            let drawn = Sweep::of_saved(&data, Metric::Us)
                .unwrap()
                .render()
                .unwrap();
            let on_disk = std::fs::read_to_string(&svg).unwrap_or_default();
            assert!(
                drawn == on_disk,
                "{} is not what {} draws: run `cargo run -p epcomm-cli -- plot {} -o {}` and \
                 commit it",
                svg.display(),
                data.display(),
                data.display(),
                svg.display()
            );
            checked += 1;
        }
        assert!(
            checked > 0,
            "no chart data in {}",
            docs.join("data").display()
        );
        // Every chart of docs/img is drawn from data (none is left over or hand-made).
        for entry in std::fs::read_dir(docs.join("img")).unwrap() {
            let svg = entry.unwrap().path();
            if svg.extension().is_some_and(|e| e == "svg") {
                let stem = svg.file_stem().unwrap().to_string_lossy().into_owned();
                let data = docs.join("data").join(format!("{stem}.json"));
                assert!(
                    data.is_file(),
                    "{} has no data {}",
                    svg.display(),
                    data.display()
                );
            }
        }
    }
}
