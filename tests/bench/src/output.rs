//! What a run (or `summarize`) writes: `samples.csv`, `indexd.csv` (runs with
//! kvroute profiles), `summary.json`, `summary.md` and the SVG charts. The
//! summary and charts are always computed from the samples as read back from
//! `samples.csv` (and the indexd readings from `indexd.csv` beside it), so
//! `kvroute-bench summarize samples.csv` reproduces them byte for byte.

use std::path::{Path, PathBuf};

use crate::indexd_metrics::{self, IndexdRow};
use crate::sample::{self, Sample};
use crate::summary::{Summary, summarize_run};
use crate::{BenchError, charts};

/// Writes `samples.csv` (canonical order), `indexd.csv` (the gateways'
/// indexd readings; none: no file) and everything derived from them.
pub fn write_run(
    dir: &Path,
    samples: &mut [Sample],
    indexd: &[IndexdRow],
) -> Result<Summary, BenchError> {
    std::fs::create_dir_all(dir).map_err(|e| BenchError::io(dir, e))?;
    sample::sort(samples);
    let csv = dir.join("samples.csv");
    sample::write_csv(&csv, samples)?;
    indexd_metrics::write(dir, indexd)?;
    summarize_file(&csv, dir)
}

/// Reads `csv` (and `indexd.csv` beside it, if there) and writes
/// `summary.json`, `summary.md` and the charts into `dir`.
pub fn summarize_file(csv: &Path, dir: &Path) -> Result<Summary, BenchError> {
    let samples = sample::read_csv(csv)?;
    let indexd = indexd_metrics::read(csv.parent().unwrap_or_else(|| Path::new(".")))?;
    std::fs::create_dir_all(dir).map_err(|e| BenchError::io(dir, e))?;
    let summary = summarize_run(&samples, &indexd);
    write(&dir.join("summary.json"), &summary.to_json()?)?;
    write(&dir.join("summary.md"), &summary.to_markdown())?;
    charts::write_all(dir, &samples, &summary)?;
    Ok(summary)
}

/// The files a run leaves besides the charts.
pub fn files(dir: &Path) -> [PathBuf; 3] {
    [
        dir.join("samples.csv"),
        dir.join("summary.json"),
        dir.join("summary.md"),
    ]
}

fn write(path: &Path, text: &str) -> Result<(), BenchError> {
    std::fs::write(path, text).map_err(|e| BenchError::io(path, e))
}
