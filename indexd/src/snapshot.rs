//! Snapshots of the index, so that a restarted indexd routes within about a
//! second instead of waiting for every replica's replay from seq 0.
//!
//! What is saved, per replica: its identity and sources (address, rank,
//! model, event and replay endpoints), the last batch applied (seq and the
//! digest of its payload), and its blocks (engine hash, chain, partition,
//! tiers, oldest first). Speculative entries, affinity and load are not: they
//! live seconds.
//!
//! On start ([`load`]) the file is read whole and checked (magic, version,
//! CRC-32, age, size); each replica's blocks are restored when the replica is
//! registered ([`restore`]), and its subscription then *resumes*: it replays
//! from the saved seq, which must come back first with the saved digest (the
//! same publisher process, nothing lost since) before what follows is
//! applied and the replica turns fresh. A replica whose replay cannot prove
//! it (the buffer no longer holds the seq, another batch sits there, the
//! engine restarted) is purged and resynced from seq 0, alone.
//!
//! Writing ([`write`]) is periodic and at shutdown: into `<file>.partial` in
//! the same directory (created anew, never through a symbolic link:
//! `create_partial`), fsynced, then renamed over the file (and the directory
//! fsynced), so a crash mid-write leaves the previous snapshot intact; a
//! leftover partial file is removed at the next start. The index is read one
//! replica at a time under its read lock. Bounded: a replica whose section
//! would take the file past `max_snapshot_bytes` is left out (it resyncs from
//! seq 0), and a write still running after `max_snapshot_write_time` is
//! abandoned.
//!
//! Layout (integers little-endian; sections are postcard-encoded):
//!
//! ```text
//! "KVRTSNAP" | version u32 | header_len u32 | Header
//! { section_len u32 (> 0) | Section }* | 0u32 | crc32 of everything before
//! ```

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

pub use crate::config::SnapshotConfig;
use crate::ids::EndpointId;
use tokio_util::sync::CancellationToken;

use crate::index::SharedIndex;
use crate::metrics::Metrics;
use crate::score::Replica;
use crate::sync::lock;

mod format;

use format::{Header, Sink, encode, unix_ms};
pub(crate) use format::{Loaded, MAGIC, Section, VERSION, parse};

/// Why a snapshot was not written or not loaded. Each variant is a metric
/// label ([`SnapshotError::label`]).
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// There is no snapshot file.
    #[error("no snapshot file")]
    Missing,
    /// Reading or writing failed.
    #[error("io: {0}")]
    Io(#[from] io::Error),
    /// The file is larger than `max_snapshot_bytes`.
    #[error("{size} bytes exceed max_snapshot_bytes ({max})")]
    TooLarge {
        /// The file's size.
        size: u64,
        /// The limit.
        max: u64,
    },
    /// Not a snapshot of this kind (magic), or of another block size.
    #[error("not an indexd snapshot for this configuration: {0}")]
    Foreign(&'static str),
    /// Written by another format version.
    #[error("format version {0}, this build reads {VERSION}")]
    Version(u32),
    /// Truncated, or its checksum or contents do not hold.
    #[error("corrupt: {0}")]
    Corrupt(&'static str),
    /// Older than `max_snapshot_age`.
    #[error("{age:?} old, more than max_snapshot_age")]
    TooOld {
        /// Its age.
        age: Duration,
    },
    /// Writing took longer than `max_snapshot_write_time`.
    #[error("write took longer than max_snapshot_write_time ({0:?})")]
    Timeout(Duration),
}

impl SnapshotError {
    /// The metric label.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Missing => "missing",
            Self::Io(_) => "error",
            Self::TooLarge { .. } => "too_large",
            Self::Foreign(_) => "foreign",
            Self::Version(_) => "version",
            Self::Corrupt(_) => "corrupt",
            Self::TooOld { .. } => "too_old",
            Self::Timeout(_) => "timeout",
        }
    }
}

/// A loaded snapshot's replicas not registered yet, by identity.
#[derive(Debug, Default)]
pub(crate) struct Pending {
    sections: HashMap<EndpointId, Section>,
}

/// The snapshot feature's own state: its settings, the loaded snapshot's
/// replicas still to restore, and the lock that serializes writers (the
/// periodic one and the one at shutdown).
#[derive(Debug)]
pub(crate) struct Snapshots {
    config: SnapshotConfig,
    block_size: u32,
    restores: std::sync::Mutex<Pending>,
    one_writer: std::sync::Mutex<()>,
}

impl Snapshots {
    /// Snapshots as `config` says, of an index of `block_size` blocks.
    pub(crate) fn new(config: SnapshotConfig, block_size: u32) -> Self {
        Self {
            config,
            block_size,
            restores: std::sync::Mutex::new(Pending::default()),
            one_writer: std::sync::Mutex::new(()),
        }
    }

    /// Forgets every replica not restored by now (their endpoints are gone).
    pub(crate) fn forget_unrestored(&self) {
        lock(&self.restores).sections = HashMap::new();
    }
}

/// What snapshots read of the daemon's state: the shared state implements
/// it, so this module needs nothing else of it.
pub(crate) trait Source: Send + Sync + 'static {
    /// The snapshot feature's own state.
    fn snapshots(&self) -> &Snapshots;
    /// The index saved and restored.
    fn index(&self) -> &SharedIndex;
    /// Every registered replica.
    fn replicas(&self) -> Vec<Arc<Replica>>;
    /// The counters (`indexd_snapshot_*`).
    fn metrics(&self) -> &Metrics;
    /// Fires at shutdown.
    fn shutdown(&self) -> &CancellationToken;
}

/// What a write did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Written {
    /// Bytes in the file.
    pub(crate) bytes: u64,
    /// Replicas saved.
    pub(crate) replicas: usize,
    /// Blocks saved.
    pub(crate) entries: usize,
    /// Replicas left out to stay under `max_snapshot_bytes`.
    pub(crate) left_out: usize,
}

/// The partial file a write goes to before its rename.
pub(crate) fn partial_path(path: &Path) -> PathBuf {
    let mut name = path
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_default();
    name.push(".partial");
    path.with_file_name(name)
}

/// One replica's section: captured under the index's read lock, encoded
/// after it is released. None if the replica has applied nothing since its
/// last purge (nothing to resume from).
fn capture<S: Source>(
    shared: &S,
    replica: &Replica,
) -> Result<Option<(Vec<u8>, usize)>, SnapshotError> {
    let Some(c) = shared.index().capture(replica.slot) else {
        return Ok(None);
    };
    format::section(
        &replica.config,
        c.applied,
        c.layout.as_deref(),
        c.blocks,
        c.names,
    )
    .map(Some)
}

/// Writes a snapshot of `shared`'s index to the configured path (blocking:
/// run it off the async threads). Writers are serialized.
pub(crate) fn write<S: Source>(shared: &S) -> Result<Written, SnapshotError> {
    let cfg = &shared.snapshots().config;
    let Some(path) = cfg.path.as_deref() else {
        return Ok(Written::default());
    };
    let _one_writer = lock(&shared.snapshots().one_writer);
    let deadline = Instant::now() + cfg.max_write_time;
    let partial = partial_path(path);
    let result = write_to(shared, &partial, deadline);
    let result = result.and_then(|written| {
        if Instant::now() > deadline {
            return Err(SnapshotError::Timeout(cfg.max_write_time));
        }
        fs::rename(&partial, path)?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            // The rename itself is durable once the directory is.
            File::open(dir)?.sync_all()?;
        }
        Ok(written)
    });
    if result.is_err() {
        let _ = fs::remove_file(&partial);
    }
    result
}

fn write_to<S: Source>(
    shared: &S,
    partial: &Path,
    deadline: Instant,
) -> Result<Written, SnapshotError> {
    let cfg = &shared.snapshots().config;
    let file = create_partial(partial)?;
    let mut sink = Sink {
        out: BufWriter::with_capacity(1 << 20, file),
        crc: crc32fast::Hasher::new(),
        written: 0,
    };
    sink.put(MAGIC)?;
    sink.put(&VERSION.to_le_bytes())?;
    let header = encode(&Header {
        created_unix_ms: unix_ms(SystemTime::now()),
        block_size: shared.snapshots().block_size,
    })?;
    sink.put_section(&header)?;
    let mut written = Written::default();
    let mut replicas = shared.replicas();
    replicas.sort_by(|a, b| a.id().cmp(b.id()));
    // The end marker and the checksum.
    let trailer = 8;
    for replica in &replicas {
        if Instant::now() > deadline {
            return Err(SnapshotError::Timeout(cfg.max_write_time));
        }
        let Some((section, entries)) = capture(shared, replica)? else {
            continue;
        };
        let needed = sink.written + 4 + section.len() as u64 + trailer;
        if needed > cfg.max_bytes {
            written.left_out += 1;
            tracing::warn!(endpoint = %replica.id(), entries, section_bytes = section.len(), max_snapshot_bytes = cfg.max_bytes, "snapshot would exceed max_snapshot_bytes: this replica is left out (it will resync from seq 0 after a restart)");
            continue;
        }
        sink.put_section(&section)?;
        written.replicas += 1;
        written.entries += entries;
    }
    sink.put(&0u32.to_le_bytes())?;
    let crc = sink.crc.clone().finalize();
    sink.out.write_all(&crc.to_le_bytes())?;
    written.bytes = sink.written + 4;
    let file = sink.out.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()?;
    Ok(written)
}

/// Creates the partial file afresh, never through a link: whatever is at
/// the path (a leftover, or a symbolic link someone placed there) is
/// unlinked first (a link itself, not what it points to), then the file is
/// created exclusively (`O_CREAT | O_EXCL`) with `O_NOFOLLOW`.
/// Something created at the path between the two steps makes the open fail
/// (`AlreadyExists`, or `ELOOP` for a link) rather than write through it; the
/// write is then counted as an error and the next one tries again.
fn create_partial(partial: &Path) -> Result<File, SnapshotError> {
    use std::os::unix::fs::OpenOptionsExt as _;
    match fs::remove_file(partial) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(SnapshotError::Io(io::Error::new(
                e.kind(),
                format!("cannot remove {}: {e}", partial.display()),
            )));
        }
    }
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits().cast_signed())
        .open(partial)
        .map_err(|e| {
            SnapshotError::Io(io::Error::new(
                e.kind(),
                format!(
                    "cannot create {} (O_EXCL, O_NOFOLLOW): {e}",
                    partial.display()
                ),
            ))
        })
}

/// Reads and checks the snapshot at `path`.
pub(crate) fn read_file(
    path: &Path,
    cfg: &SnapshotConfig,
    block_size: u32,
) -> Result<Loaded, SnapshotError> {
    let size = match fs::metadata(path) {
        Ok(m) => m.len(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(SnapshotError::Missing),
        Err(e) => return Err(e.into()),
    };
    if size > cfg.max_bytes {
        return Err(SnapshotError::TooLarge {
            size,
            max: cfg.max_bytes,
        });
    }
    let bytes = fs::read(path)?;
    parse(&bytes, block_size, cfg.max_age, SystemTime::now())
}

/// At start, before any replica is registered: removes a partial file left
/// by a crash, reads the snapshot, and keeps its replicas for [`restore`].
pub(crate) fn load<S: Source>(shared: &S) {
    let cfg = &shared.snapshots().config;
    let Some(path) = cfg.path.as_deref() else {
        return;
    };
    let partial = partial_path(path);
    if fs::remove_file(&partial).is_ok() {
        tracing::info!(path = %partial.display(), "removed a partial snapshot left by an interrupted write");
    }
    let result = read_file(path, cfg, shared.snapshots().block_size);
    let label = result.as_ref().map_or_else(SnapshotError::label, |_| "ok");
    shared.metrics().snapshot_loads.inc([label]);
    match result {
        Ok(loaded) => {
            let entries: usize = loaded.sections.iter().map(Section::entries).sum();
            tracing::info!(path = %path.display(), replicas = loaded.sections.len(), entries, age = ?loaded.age, "loaded the index snapshot");
            let mut pending = lock(&shared.snapshots().restores);
            for section in loaded.sections {
                if let Some(id) = section.id() {
                    pending.sections.insert(id, section);
                }
            }
        }
        Err(SnapshotError::Missing) => {
            tracing::info!(path = %path.display(), "no index snapshot yet: every replica replays from seq 0");
        }
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "ignoring the index snapshot: every replica replays from seq 0");
        }
    }
}

/// Restores what the loaded snapshot saved of `replica` (if anything, and if
/// it was saved with the same model and sources) and sets its resume point.
pub(crate) fn restore<S: Source>(shared: &S, replica: &Replica) {
    let Some(section) = lock(&shared.snapshots().restores)
        .sections
        .remove(replica.id())
    else {
        return;
    };
    if !section.matches(&replica.config) {
        tracing::info!(endpoint = %replica.id(), "snapshot saved this endpoint with another model or sources: not restored");
        return;
    }
    let applied = section.applied();
    let restored = shared.index().restore(
        replica.slot,
        applied,
        Some(section.layout()),
        section.blocks(),
    );
    replica.set_resume(applied);
    let gauge = &shared.metrics().snapshot_loaded_entries;
    gauge.set(gauge.get() + restored as f64);
    tracing::debug!(endpoint = %replica.id(), entries = restored, seq = applied.seq, "restored from the snapshot");
}

/// Writes a snapshot now, off the async threads, and records the outcome.
pub(crate) async fn write_now<S: Source>(shared: &Arc<S>) {
    if shared.snapshots().config.path.is_none() {
        return;
    }
    let started = Instant::now();
    let for_write = Arc::clone(shared);
    let result = tokio::task::spawn_blocking(move || write(for_write.as_ref())).await;
    let elapsed = started.elapsed();
    let m = &shared.metrics();
    m.snapshot_write_seconds.set(elapsed.as_secs_f64());
    match result {
        Ok(Ok(w)) => {
            m.snapshot_writes
                .inc([if w.left_out > 0 { "truncated" } else { "ok" }]);
            m.snapshot_bytes.set(w.bytes as f64);
            tracing::debug!(
                bytes = w.bytes,
                replicas = w.replicas,
                entries = w.entries,
                left_out = w.left_out,
                ?elapsed,
                "wrote the index snapshot"
            );
        }
        Ok(Err(e)) => {
            m.snapshot_writes.inc([e.label()]);
            tracing::warn!(error = %e, ?elapsed, "index snapshot not written; the previous one stays");
        }
        Err(e) => {
            m.snapshot_writes.inc(["error"]);
            tracing::warn!(error = %e, "index snapshot task failed");
        }
    }
}

/// Writes a snapshot every `snapshot_interval` until shutdown.
pub(crate) async fn run<S: Source>(shared: Arc<S>) {
    if shared.snapshots().config.path.is_none() {
        return;
    }
    let interval = shared.snapshots().config.interval;
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shared.shutdown().cancelled() => return,
            _ = tick.tick() => {}
        }
        write_now(&shared).await;
    }
}

#[cfg(test)]
#[path = "snapshot_tests.rs"]
mod tests;
