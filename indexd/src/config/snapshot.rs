//! The `snapshot_*` settings: where and how indexd saves its index and
//! restores it at start.

use std::path::PathBuf;
use std::time::Duration;

/// Where and how indexd snapshots its index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotConfig {
    /// The snapshot file (None: no snapshots).
    pub path: Option<PathBuf>,
    /// How often it is written (and once more at shutdown).
    pub interval: Duration,
    /// Largest file written or read.
    pub max_bytes: u64,
    /// An older file is not loaded.
    pub max_age: Duration,
    /// A write still running after this is abandoned.
    pub max_write_time: Duration,
}

impl Default for SnapshotConfig {
    fn default() -> Self {
        Self {
            path: None,
            interval: Duration::from_secs(30),
            max_bytes: 256 << 20,
            max_age: Duration::from_secs(600),
            max_write_time: Duration::from_secs(10),
        }
    }
}
