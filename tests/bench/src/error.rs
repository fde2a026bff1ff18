//! The bench's error type.

use std::path::{Path, PathBuf};

use kvroute_e2e::HarnessError;

/// What stopped a run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// Starting or driving the stack failed.
    #[error(transparent)]
    Harness(#[from] HarnessError),
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// `samples.csv` could not be read or written.
    #[error("{path}: {source}")]
    Csv {
        /// The file.
        path: PathBuf,
        /// Why.
        source: csv::Error,
    },
    /// JSON output failed.
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),
    /// A chart could not be drawn.
    #[error("chart: {0}")]
    Plot(String),
    /// A scripted fault could not be injected (the run's figures would not mean what they say).
    #[error("fault injection failed: {0}")]
    Fault(String),
}

impl BenchError {
    /// An I/O error on `path`.
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        Self::Io {
            path: path.to_owned(),
            source,
        }
    }

    /// A CSV error on `path`.
    pub fn csv(path: &Path, source: csv::Error) -> Self {
        Self::Csv {
            path: path.to_owned(),
            source,
        }
    }
}
