//! The harness's one error type.

use std::path::PathBuf;
use std::time::Duration;

/// Why the harness could not set up or query a process.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// A binary or artifact the test needs is missing.
    #[error("{what} not found at {path}: {hint}")]
    Missing {
        /// What was looked for.
        what: &'static str,
        /// Where it was looked for.
        path: PathBuf,
        /// How to get it.
        hint: &'static str,
    },
    /// Spawning, writing a config or reading a file failed.
    #[error("{context}: {source}")]
    Io {
        /// What the harness was doing.
        context: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A process did not become ready in time.
    #[error("{what} not ready after {after:?}; log:\n{log}")]
    NotReady {
        /// The process.
        what: String,
        /// How long the harness waited.
        after: Duration,
        /// The tail of the process's log.
        log: String,
    },
    /// A process exited while the harness waited for it.
    #[error("{what} exited early ({status}); log:\n{log}")]
    Exited {
        /// The process.
        what: String,
        /// Its exit status.
        status: String,
        /// The tail of the process's log.
        log: String,
    },
    /// An HTTP exchange failed.
    #[error("HTTP {context}: {message}")]
    Http {
        /// The request.
        context: String,
        /// What went wrong.
        message: String,
    },
    /// An answer did not have the expected shape.
    #[error("unexpected answer from {context}: {message}")]
    Unexpected {
        /// The request.
        context: String,
        /// What was wrong with it.
        message: String,
    },
}

impl HarnessError {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            context: context.into(),
            source,
        }
    }

    /// Two lines at most: what failed and, for a process, its log's last
    /// line. For a panic message that a truncated CI log still shows whole
    /// (print the error itself before it).
    pub fn headline(&self) -> String {
        let text = self.to_string();
        let first = text.lines().next().unwrap_or_default();
        match self {
            Self::NotReady { log, .. } | Self::Exited { log, .. } => {
                match log.lines().rev().find(|l| !l.trim().is_empty()) {
                    Some(last) => format!("{first}\nlast log line: {last}"),
                    None => first.to_owned(),
                }
            }
            _ => first.to_owned(),
        }
    }
}
