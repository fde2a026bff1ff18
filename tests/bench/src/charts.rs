//! SVG charts drawn with `plotters` (SVG backend only: text is written as SVG
//! `<text>`, no font files are read): per workload, the latency CDF of each
//! profile's continuations and each profile's hit ratio against the oracle's.

use std::path::{Path, PathBuf};

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::BenchError;
use crate::sample::Sample;
use crate::summary::{Summary, grouped};

const COLORS: [RGBColor; 6] = [
    RGBColor(214, 39, 40),
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(140, 86, 75),
];

fn color(i: usize) -> RGBColor {
    COLORS.get(i % COLORS.len()).copied().unwrap_or(BLACK)
}

fn plot_error(e: impl std::fmt::Display) -> BenchError {
    BenchError::Plot(e.to_string())
}

/// Writes every chart for `samples` into `dir`; returns the files written.
pub fn write_all(
    dir: &Path,
    samples: &[Sample],
    summary: &Summary,
) -> Result<Vec<PathBuf>, BenchError> {
    let mut written = Vec::new();
    let mut workloads: Vec<String> = Vec::new();
    for s in samples {
        if !workloads.contains(&s.workload) {
            workloads.push(s.workload.clone());
        }
    }
    for w in &workloads {
        let path = dir.join(format!("latency_cdf_{w}.svg"));
        write_svg(&path, &latency_cdf(w, samples)?)?;
        written.push(path);
        let path = dir.join(format!("hit_ratio_{w}.svg"));
        write_svg(&path, &hit_ratio(w, summary)?)?;
        written.push(path);
    }
    Ok(written)
}

fn write_svg(path: &Path, svg: &str) -> Result<(), BenchError> {
    std::fs::write(path, svg).map_err(|e| BenchError::io(path, e))
}

fn canvas(svg: &mut String) -> DrawingArea<SVGBackend<'_>, Shift> {
    SVGBackend::with_string(svg, (800, 480)).into_drawing_area()
}

/// The empirical CDF of continuation latency, one line per profile.
pub fn latency_cdf(workload: &str, samples: &[Sample]) -> Result<String, BenchError> {
    let series: Vec<(String, Vec<f64>)> = grouped(samples)
        .into_iter()
        .filter(|((w, _), _)| w == workload)
        .map(|((_, profile), rows)| {
            let mut v: Vec<f64> = rows
                .iter()
                .filter(|s| s.ok() && s.is_continuation())
                .map(|s| s.latency_ms)
                .collect();
            v.sort_by(f64::total_cmp);
            (profile, v)
        })
        .collect();
    let x_max = series
        .iter()
        .filter_map(|(_, v)| v.last().copied())
        .fold(1.0_f64, f64::max)
        * 1.05;
    let mut svg = String::new();
    {
        let root = canvas(&mut svg);
        root.fill(&WHITE).map_err(plot_error)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!("{workload}: continuation latency CDF"),
                ("sans-serif", 20),
            )
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d(0f64..x_max, 0f64..1.0)
            .map_err(plot_error)?;
        chart
            .configure_mesh()
            .x_desc("latency (ms)")
            .y_desc("fraction of continuations")
            .draw()
            .map_err(plot_error)?;
        for (i, (profile, values)) in series.iter().enumerate() {
            let n = values.len() as f64;
            let mut points = Vec::with_capacity(values.len() * 2 + 1);
            points.push((0.0, 0.0));
            for (k, v) in values.iter().enumerate() {
                points.push((*v, k as f64 / n));
                points.push((*v, (k + 1) as f64 / n));
            }
            let c = color(i);
            chart
                .draw_series(LineSeries::new(points, c.stroke_width(2)))
                .map_err(plot_error)?
                .label(profile.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .draw()
            .map_err(plot_error)?;
        root.present().map_err(plot_error)?;
    }
    Ok(svg)
}

/// Each profile's hit ratio (bar) and what the oracle held (black tick), both
/// over the continuations' prompt tokens.
pub fn hit_ratio(workload: &str, summary: &Summary) -> Result<String, BenchError> {
    let groups: Vec<_> = summary
        .groups
        .iter()
        .filter(|g| g.workload == workload)
        .collect();
    let names: Vec<String> = groups.iter().map(|g| g.profile.clone()).collect();
    let mut svg = String::new();
    {
        let root = canvas(&mut svg);
        root.fill(&WHITE).map_err(plot_error)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!("{workload}: cache hit of continuations (bar) vs oracle (tick)"),
                ("sans-serif", 20),
            )
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(50)
            // A discrete range holds both ends: n profiles are 0..n − 1.
            .build_cartesian_2d(
                (0..groups.len().saturating_sub(1)).into_segmented(),
                0f64..1.05,
            )
            .map_err(plot_error)?;
        let label = |v: &SegmentValue<usize>| match v {
            SegmentValue::CenterOf(i) | SegmentValue::Exact(i) => {
                names.get(*i).cloned().unwrap_or_default()
            }
            SegmentValue::Last => String::new(),
        };
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_label_formatter(&label)
            .y_desc("cached / prompt tokens")
            .draw()
            .map_err(plot_error)?;
        for (i, g) in groups.iter().enumerate() {
            let hit = g.hit_ratio.unwrap_or(0.0);
            let oracle = if g.prompt_tokens > 0 {
                g.oracle_cached_tokens as f64 / g.prompt_tokens as f64
            } else {
                0.0
            };
            let bar = Histogram::vertical(&chart)
                .margin(30)
                .style(color(i).mix(0.8).filled())
                .data(std::iter::once((i, hit)));
            chart.draw_series(bar).map_err(plot_error)?;
            let tick = PathElement::new(
                vec![
                    (SegmentValue::Exact(i), oracle),
                    (SegmentValue::Exact(i + 1), oracle),
                ],
                BLACK.stroke_width(3),
            );
            chart
                .draw_series(std::iter::once(tick))
                .map_err(plot_error)?;
        }
        root.present().map_err(plot_error)?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::example;
    use crate::summary::summarize;

    #[test]
    fn charts_render_as_svg() {
        let mut samples = Vec::new();
        for (p, replica) in [("least-request", "r1"), ("precise", "r0")] {
            samples.push(example(p, 0, 0, "r0"));
            let mut s = example(p, 0, 1, replica);
            s.prev_replica = "r0".into();
            s.cached_tokens = 80;
            s.oracle_cached_tokens = 96;
            samples.push(s);
        }
        let summary = summarize(&samples);
        let cdf = latency_cdf("w", &samples).unwrap();
        assert!(
            cdf.starts_with("<svg") && cdf.contains("least-request"),
            "{cdf}"
        );
        let bars = hit_ratio("w", &summary).unwrap();
        assert!(bars.contains("<rect") && bars.contains("precise"));
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(write_all(dir.path(), &samples, &summary).unwrap().len(), 2);
    }
}
