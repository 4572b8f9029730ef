//! `cargo xtask plot-sweep`: draws an SM sweep of `epcomm bench --json` as an SVG line chart
//! (time per op against the SM count, both axes logarithmic), or checks that a drawn chart is
//! up to date with its data.
//!
//! Input: a document of schema `epcomm-bench/2` (docs/cli.md). The chart reads `results[]`'s
//! `op`, `sms` and `time_us` and, for its caption, `config`'s `world`, `transport`, `schedule`,
//! `tokens`, `hidden`, `top_k`, `experts` and `gpu_name`; other fields are ignored. The drawing is
//! a pure function of the input (same bytes in, same bytes out), which is what `--check` relies
//! on.
//!
//! With no input named, every `docs/data/*.json` is drawn into `docs/img/<stem>.svg` — the
//! charts docs/benchmarks.md shows.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// What can go wrong drawing a chart; each names the file and, where it applies, the field.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The input is not JSON of the bench's shape.
    #[error("{path}: not an `epcomm bench --json` document: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What serde said.
        source: serde_json::Error,
    },
    /// The input parsed but cannot be drawn.
    #[error("{path}: {field}: {rule}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// The offending field, e.g. `results[3].time_us`.
        field: String,
        /// The rule it broke.
        rule: String,
    },
    /// `--check`: a chart differs from what its data draws.
    #[error(
        "{} out of date with {}: run `cargo xtask plot-sweep` and commit the result",
        svg.display(),
        data.display()
    )]
    Stale {
        /// The chart on disk.
        svg: PathBuf,
        /// The data it is drawn from.
        data: PathBuf,
    },
    /// No input named and none found in the default folder.
    #[error("no *.json in {}: name an input (an `epcomm bench --json` file)", dir.display())]
    NoInput {
        /// The folder searched.
        dir: PathBuf,
    },
}

#[derive(Debug, Deserialize)]
struct BenchDoc {
    schema: String,
    config: BenchConfig,
    results: Vec<BenchResult>,
}

#[derive(Debug, Deserialize)]
struct BenchConfig {
    world: u32,
    transport: String,
    schedule: String,
    tokens: u64,
    hidden: u64,
    top_k: u32,
    experts: u32,
    gpu_name: String,
}

#[derive(Debug, Deserialize)]
struct BenchResult {
    op: String,
    sms: u32,
    time_us: f64,
}

/// The ops in the order the bench prints them, with their legend label and colour.
const OPS: [(&str, &str, &str); 5] = [
    ("dispatch_fp8", "dispatch FP8", "#1f77b4"),
    ("dispatch_bf16", "dispatch BF16", "#ff7f0e"),
    ("cached_dispatch_bf16", "cached dispatch BF16", "#2ca02c"),
    ("combine_bf16", "combine BF16", "#d62728"),
    ("combine_bf16_in_place", "combine BF16 in place", "#9467bd"),
];

/// One series: an op's (SMs, us) points in increasing SM order.
#[derive(Debug, PartialEq)]
struct Series {
    label: &'static str,
    colour: &'static str,
    points: Vec<(u32, f64)>,
}

/// Checks the document and groups its results per op.
fn series_of(path: &Path, doc: &BenchDoc) -> Result<Vec<Series>, PlotError> {
    let invalid = |field: String, rule: &str| PlotError::Invalid {
        path: path.to_owned(),
        field,
        rule: rule.to_owned(),
    };
    if doc.schema != "epcomm-bench/2" {
        return Err(invalid(
            "schema".into(),
            &format!("must be \"epcomm-bench/2\", is {:?}", doc.schema),
        ));
    }
    let mut by_op: BTreeMap<&str, BTreeMap<u32, f64>> = BTreeMap::new();
    for (i, r) in doc.results.iter().enumerate() {
        if !OPS.iter().any(|(op, _, _)| *op == r.op) {
            return Err(invalid(
                format!("results[{i}].op"),
                &format!("unknown op {:?}", r.op),
            ));
        }
        if r.sms == 0 {
            return Err(invalid(format!("results[{i}].sms"), "must be at least 1"));
        }
        if !(r.time_us.is_finite() && r.time_us > 0.0) {
            return Err(invalid(
                format!("results[{i}].time_us"),
                "must be a positive finite number",
            ));
        }
        if by_op
            .entry(r.op.as_str())
            .or_default()
            .insert(r.sms, r.time_us)
            .is_some()
        {
            return Err(invalid(
                format!("results[{i}]"),
                &format!("{} at {} SMs appears twice", r.op, r.sms),
            ));
        }
    }
    let series: Vec<Series> = OPS
        .iter()
        .filter_map(|(op, label, colour)| {
            by_op.get(op).map(|points| Series {
                label,
                colour,
                points: points.iter().map(|(&s, &t)| (s, t)).collect(),
            })
        })
        .collect();
    let sms: std::collections::BTreeSet<u32> = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .collect();
    if sms.len() < 2 {
        return Err(invalid(
            "results".into(),
            "a sweep needs at least two SM counts (run `epcomm bench --sweep-sms A,B,...`)",
        ));
    }
    Ok(series)
}

const WIDTH: f64 = 760.0;
const HEIGHT: f64 = 460.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 200.0;
const TOP: f64 = 74.0;
const BOTTOM: f64 = 56.0;

/// The y ticks of a log axis: 1, 2, 5 times powers of ten inside `[lo, hi]`.
fn y_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let mut ticks = Vec::new();
    let mut decade = 10f64.powf(lo.log10().floor());
    while decade <= hi {
        for m in [1.0, 2.0, 5.0] {
            let t = decade * m;
            if t >= lo && t <= hi {
                ticks.push(t);
            }
        }
        decade *= 10.0;
    }
    ticks
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Draws the chart. Deterministic: numbers are printed with one decimal.
fn draw(doc: &BenchDoc, series: &[Series]) -> String {
    let sms: Vec<u32> = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let times = series.iter().flat_map(|s| s.points.iter().map(|p| p.1));
    let (t_min, t_max) = times.fold((f64::MAX, f64::MIN), |(a, b), t| (a.min(t), b.max(t)));
    // Whole 1-2-5 steps around the data, so the extreme points sit inside the frame.
    let y_lo = y_ticks(t_min / 10.0, t_min)
        .last()
        .copied()
        .unwrap_or(t_min);
    let y_hi = y_ticks(t_max, t_max * 10.0)
        .first()
        .copied()
        .unwrap_or(t_max);
    let (x_lo, x_hi) = (f64::from(sms[0]), f64::from(sms[sms.len() - 1]));
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let x = |s: f64| LEFT + (s.ln() - x_lo.ln()) / (x_hi.ln() - x_lo.ln()) * plot_w;
    let y = |t: f64| TOP + (y_hi.ln() - t.ln()) / (y_hi.ln() - y_lo.ln()) * plot_h;

    let c = &doc.config;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        svg,
        r#"<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>"#
    );
    let _ = writeln!(
        svg,
        r#"<text x="{LEFT}" y="22" font-size="14">{}</text>"#,
        escape(&format!(
            "epcomm bench: time per op against SMs ({} ranks, {}, {} schedule)",
            c.world, c.transport, c.schedule
        ))
    );
    let _ = writeln!(
        svg,
        r##"<text x="{LEFT}" y="40" fill="#555">{}</text>"##,
        escape(&format!(
            "{} tokens/rank, hidden {}, top-{} of {} experts; rank 0's median",
            c.tokens, c.hidden, c.top_k, c.experts
        ))
    );
    let _ = writeln!(
        svg,
        r##"<text x="{LEFT}" y="58" fill="#555">{}</text>"##,
        escape(&c.gpu_name)
    );
    // Grid and axes.
    for t in y_ticks(y_lo, y_hi) {
        let yy = y(t);
        let _ = writeln!(
            svg,
            r##"<line x1="{LEFT:.1}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{t}</text>"##,
            LEFT + plot_w,
            LEFT - 6.0,
            yy + 4.0
        );
    }
    for &s in &sms {
        let xx = x(f64::from(s));
        let _ = writeln!(
            svg,
            r##"<line x1="{xx:.1}" y1="{TOP:.1}" x2="{xx:.1}" y2="{:.1}" stroke="#ddd"/><text x="{xx:.1}" y="{:.1}" text-anchor="middle">{s}</text>"##,
            TOP + plot_h,
            TOP + plot_h + 16.0
        );
    }
    let _ = writeln!(
        svg,
        r##"<rect x="{LEFT:.1}" y="{TOP:.1}" width="{plot_w:.1}" height="{plot_h:.1}" fill="none" stroke="#333"/>"##
    );
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">SMs per op (log scale)</text>"#,
        LEFT + plot_w / 2.0,
        HEIGHT - 14.0
    );
    let _ = writeln!(
        svg,
        r#"<text transform="translate(18 {:.1}) rotate(-90)" text-anchor="middle">us per op (log scale)</text>"#,
        TOP + plot_h / 2.0
    );
    // Series and legend.
    for (i, s) in series.iter().enumerate() {
        let path: Vec<String> = s
            .points
            .iter()
            .map(|&(sm, t)| format!("{:.1},{:.1}", x(f64::from(sm)), y(t)))
            .collect();
        let _ = writeln!(
            svg,
            r#"<polyline points="{}" fill="none" stroke="{}" stroke-width="2"/>"#,
            path.join(" "),
            s.colour
        );
        for &(sm, t) in &s.points {
            let _ = writeln!(
                svg,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{}"><title>{}: {sm} SMs, {t:.1} us</title></circle>"#,
                x(f64::from(sm)),
                y(t),
                s.colour,
                escape(s.label)
            );
        }
        let ly = TOP + 10.0 + 20.0 * i as f64;
        let lx = LEFT + plot_w + 16.0;
        let _ = writeln!(
            svg,
            r#"<line x1="{lx:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{}" stroke-width="2"/><text x="{:.1}" y="{:.1}">{}</text>"#,
            lx + 22.0,
            s.colour,
            lx + 28.0,
            ly + 4.0,
            escape(s.label)
        );
    }
    svg.push_str("</svg>\n");
    svg
}

/// Reads `input` and returns its chart.
fn render(input: &Path) -> Result<String, PlotError> {
    let text = fs::read_to_string(input).map_err(|source| PlotError::Io {
        path: input.to_owned(),
        source,
    })?;
    let doc: BenchDoc = serde_json::from_str(&text).map_err(|source| PlotError::Parse {
        path: input.to_owned(),
        source,
    })?;
    let series = series_of(input, &doc)?;
    Ok(draw(&doc, &series))
}

/// The charts to draw: `(input, output)` pairs.
fn jobs(
    workspace: &Path,
    inputs: &[PathBuf],
    out: Option<&Path>,
) -> Result<Vec<(PathBuf, PathBuf)>, PlotError> {
    if !inputs.is_empty() {
        return Ok(inputs
            .iter()
            .map(|i| {
                let svg = match out {
                    Some(o) if inputs.len() == 1 => o.to_owned(),
                    Some(o) => o.join(svg_name(i)),
                    None => i.with_extension("svg"),
                };
                (i.clone(), svg)
            })
            .collect());
    }
    let data = workspace.join("docs/data");
    let img = out.map_or_else(|| workspace.join("docs/img"), Path::to_owned);
    let mut found: Vec<PathBuf> = fs::read_dir(&data)
        .map_err(|source| PlotError::Io {
            path: data.clone(),
            source,
        })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    found.sort();
    if found.is_empty() {
        return Err(PlotError::NoInput { dir: data });
    }
    Ok(found
        .into_iter()
        .map(|i| {
            let svg = img.join(svg_name(&i));
            (i, svg)
        })
        .collect())
}

fn svg_name(input: &Path) -> PathBuf {
    PathBuf::from(input.file_stem().unwrap_or_default()).with_extension("svg")
}

/// Draws every chart (or, with `check`, compares each with the file on disk and writes nothing).
/// `out` is the chart's path for one input, else a folder. Returns what was done.
pub fn run(
    workspace: &Path,
    inputs: &[PathBuf],
    out: Option<&Path>,
    check: bool,
) -> Result<String, PlotError> {
    let mut done = Vec::new();
    for (input, svg) in jobs(workspace, inputs, out)? {
        let drawn = render(&input)?;
        if check {
            let on_disk = fs::read_to_string(&svg).map_err(|source| PlotError::Io {
                path: svg.clone(),
                source,
            })?;
            if on_disk != drawn {
                return Err(PlotError::Stale { svg, data: input });
            }
            done.push(format!("{} up to date", svg.display()));
        } else {
            if let Some(dir) = svg.parent().filter(|d| !d.as_os_str().is_empty()) {
                fs::create_dir_all(dir).map_err(|source| PlotError::Io {
                    path: dir.to_owned(),
                    source,
                })?;
            }
            fs::write(&svg, &drawn).map_err(|source| PlotError::Io {
                path: svg.clone(),
                source,
            })?;
            done.push(format!("wrote {}", svg.display()));
        }
    }
    Ok(done.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(results: &str) -> String {
        format!(
            r#"{{"schema":"epcomm-bench/2","config":{{"world":2,"transport":"ipc","schedule":"epoch",
            "tokens":4096,"hidden":7168,"top_k":8,"experts":256,"gpu_name":"G<1>","sms":[4,8]}},
            "results":[{results}]}}"#
        )
    }

    fn parse(text: &str) -> Result<Vec<Series>, PlotError> {
        let d: BenchDoc = serde_json::from_str(text).expect("json");
        series_of(Path::new("run.json"), &d)
    }

    #[test]
    fn results_group_per_op_in_sm_order() {
        let s = parse(&doc(r#"{"op":"combine_bf16","sms":8,"time_us":500.0},
               {"op":"dispatch_fp8","sms":8,"time_us":190.0},
               {"op":"combine_bf16","sms":4,"time_us":1000.0}"#))
        .expect("valid");
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].label, "dispatch FP8");
        assert_eq!(s[1].points, vec![(4, 1000.0), (8, 500.0)]);
    }

    #[test]
    fn bad_documents_name_the_field_and_rule() {
        let err = |r: &str| parse(&doc(r)).expect_err("invalid").to_string();
        assert!(err(r#"{"op":"combine","sms":8,"time_us":1.0}"#).contains("results[0].op"));
        assert!(err(r#"{"op":"combine_bf16","sms":0,"time_us":1.0}"#).contains("results[0].sms"));
        assert!(err(
            r#"{"op":"combine_bf16","sms":4,"time_us":1.0},{"op":"combine_bf16","sms":8,"time_us":-2.0}"#
        )
        .contains("results[1].time_us"));
        assert!(err(
            r#"{"op":"combine_bf16","sms":4,"time_us":1.0},{"op":"combine_bf16","sms":4,"time_us":2.0}"#
        )
        .contains("appears twice"));
        assert!(err(r#"{"op":"combine_bf16","sms":4,"time_us":1.0}"#).contains("two SM counts"));
        let old = doc(r#"{"op":"combine_bf16","sms":4,"time_us":1.0}"#)
            .replace("epcomm-bench/2", "epcomm-bench/1");
        assert!(
            parse(&old)
                .expect_err("schema")
                .to_string()
                .contains("schema")
        );
    }

    #[test]
    fn the_chart_places_points_on_log_axes_and_escapes_text() {
        let text = doc(r#"{"op":"combine_bf16","sms":4,"time_us":1000.0},
                          {"op":"combine_bf16","sms":16,"time_us":250.0}"#);
        let d: BenchDoc = serde_json::from_str(&text).expect("json");
        let s = series_of(Path::new("run.json"), &d).expect("valid");
        let svg = draw(&d, &s);
        // The first SM count on the left edge, the last on the right.
        let left = format!("cx=\"{LEFT:.1}\"");
        let right = format!("cx=\"{:.1}\"", WIDTH - RIGHT);
        assert!(svg.contains(&left) && svg.contains(&right), "{svg}");
        // 1000 and 250 us inside the frame, the slower point higher up.
        let cy: Vec<f64> = svg
            .split("cy=\"")
            .skip(1)
            .map(|r| r[..r.find('"').expect("quote")].parse().expect("number"))
            .collect();
        assert_eq!(cy.len(), 2);
        assert!(
            TOP <= cy[0] && cy[0] < cy[1] && cy[1] <= HEIGHT - BOTTOM,
            "{cy:?}"
        );
        assert!(svg.contains("G&lt;1&gt;") && !svg.contains("G<1>"));
        assert_eq!(svg, draw(&d, &s), "deterministic");
    }

    #[test]
    fn y_ticks_are_one_two_five_steps() {
        assert_eq!(
            y_ticks(50.0, 2000.0),
            vec![50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0]
        );
    }

    #[test]
    fn check_mode_finds_a_stale_chart_and_writes_nothing() {
        let dir = std::env::temp_dir().join(format!("xtask-plot-{}", std::process::id()));
        fs::create_dir_all(&dir).expect("dir");
        let input = dir.join("sweep.json");
        fs::write(
            &input,
            doc(r#"{"op":"combine_bf16","sms":4,"time_us":1000.0},
                   {"op":"combine_bf16","sms":8,"time_us":500.0}"#),
        )
        .expect("write");
        let svg = dir.join("sweep.svg");
        let inputs = [input.clone()];
        assert!(matches!(
            run(&dir, &inputs, Some(&svg), true),
            Err(PlotError::Io { .. })
        ));
        run(&dir, &inputs, Some(&svg), false).expect("draw");
        run(&dir, &inputs, Some(&svg), true).expect("up to date");
        fs::write(&svg, "<svg/>").expect("write");
        assert!(matches!(
            run(&dir, &inputs, Some(&svg), true),
            Err(PlotError::Stale { .. })
        ));
        assert_eq!(fs::read_to_string(&svg).expect("read"), "<svg/>");
        let _ = fs::remove_dir_all(&dir);
    }
}
