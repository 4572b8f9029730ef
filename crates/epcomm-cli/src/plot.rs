//! `epcomm bench --sweep-sms ... --plot PATH`: GB/s against SMs, one line per op, as SVG.

use std::collections::BTreeMap;
use std::path::Path;

use plotters::prelude::*;

use crate::results::{BenchReport, op_display};

/// Why the plot was not written.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// Nothing to draw.
    #[error("--plot: no results to plot")]
    Empty,
    /// A value cannot be drawn.
    #[error("--plot: {0} is not a finite number")]
    NotFinite(String),
    /// The drawing backend failed (e.g. the file cannot be written).
    #[error("--plot {path}: {detail}")]
    Draw {
        /// The output file.
        path: String,
        /// The backend's error.
        detail: String,
    },
}

/// `[lo, hi]` widened so that it is never empty (one point, or all values equal).
fn padded(lo: f64, hi: f64, from_zero: bool) -> (f64, f64) {
    let lo = if from_zero { lo.min(0.0) } else { lo };
    if hi > lo {
        let pad = (hi - lo) * 0.05;
        (if from_zero { lo } else { lo - pad }, hi + pad)
    } else if from_zero {
        (lo, lo + 1.0)
    } else {
        (lo - 1.0, hi + 1.0)
    }
}

/// Writes the sweep in `report` to `path` as an SVG chart.
///
/// # Errors
/// [`PlotError`] when there is nothing (finite) to draw or the file cannot be written.
pub fn write_svg(report: &BenchReport, path: &Path) -> Result<(), PlotError> {
    let mut series: BTreeMap<&str, Vec<(f64, f64)>> = BTreeMap::new();
    for r in &report.results {
        if !r.gbps.is_finite() {
            return Err(PlotError::NotFinite(format!("{} GB/s of {}", r.gbps, r.op)));
        }
        series
            .entry(r.op.as_str())
            .or_default()
            .push((f64::from(r.sms), r.gbps));
    }
    if series.is_empty() {
        return Err(PlotError::Empty);
    }
    for points in series.values_mut() {
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    let all = || series.values().flatten();
    let fold = |f: fn(f64, f64) -> f64, init: f64, y: bool| {
        all().map(|p| if y { p.1 } else { p.0 }).fold(init, f)
    };
    let (x0, x1) = padded(
        fold(f64::min, f64::INFINITY, false),
        fold(f64::max, f64::NEG_INFINITY, false),
        false,
    );
    let (y0, y1) = padded(0.0, fold(f64::max, 0.0, true), true);

    let draw = |e: &dyn std::fmt::Display| PlotError::Draw {
        path: path.display().to_string(),
        detail: e.to_string(),
    };
    let c = &report.config;
    let title = format!(
        "epcomm, {}: {} ranks, {} tokens, hidden {}",
        c.describe(),
        c.world,
        c.tokens,
        c.hidden
    );
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| draw(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(|e| draw(&e))?;
    chart
        .configure_mesh()
        .x_desc("SMs")
        .y_desc("GB/s (DeepEP metric, rank 0)")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()
        .map_err(|e| draw(&e))?;
    for (i, (op, points)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(|e| draw(&e))?
            .label(op_display(op).to_string())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color));
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))
            .map_err(|e| draw(&e))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(|e| draw(&e))?;
    root.present().map_err(|e| draw(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::results::tests::synthetic;

    fn temp(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("epcomm-cli-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join(name)
    }

    #[test]
    fn writes_an_svg_from_synthetic_data() {
        let path = temp("sweep.svg");
        write_svg(&synthetic(), &path).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.contains("<svg"), "{svg}");
        assert!(svg.contains("dispatch BF16") && svg.contains("combine BF16"));
        assert!(svg.contains("<polyline") || svg.contains("<path"));
        assert!(!svg.contains("NaN"));
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn one_point_and_empty_and_bad_path() {
        let mut r = synthetic();
        r.results.truncate(1);
        let path = temp("one.svg");
        write_svg(&r, &path).unwrap();
        let _ = std::fs::remove_file(&path);
        r.results.clear();
        assert!(matches!(write_svg(&r, &path), Err(PlotError::Empty)));
        let err = write_svg(&synthetic(), Path::new("/nonexistent-epcomm/x.svg")).unwrap_err();
        assert!(err.to_string().contains("--plot"), "{err}");
        let mut r = synthetic();
        r.results[0].gbps = f64::NAN;
        assert!(matches!(write_svg(&r, &path), Err(PlotError::NotFinite(_))));
    }

    #[test]
    fn ranges_are_never_empty() {
        assert_eq!(padded(24.0, 24.0, false), (23.0, 25.0));
        assert_eq!(padded(0.0, 0.0, true), (0.0, 1.0));
        let (lo, hi) = padded(0.0, 100.0, true);
        assert!(lo == 0.0 && hi > 100.0);
    }
}
