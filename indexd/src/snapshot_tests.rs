//! The snapshot file: round trip, and every way a file can be bad (corrupt,
//! truncated, another version, foreign, too old, too large, left half
//! written by a crash) is refused with a reason, never a panic.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};

use kvroute_proto::keys::{BlockSize, block_keys};
use tokio_util::sync::CancellationToken;

use super::*;
use crate::config::{Config, EndpointConfig};
use crate::event::{BlockStored, EngineHash, EventBatch, ExtraKeys, KvEvent, Tier};
use crate::index::Applied;
use crate::state::Shared;

const BS: u32 = 4;

/// A fresh directory under the system's temporary one, removed on drop.
struct Dir(PathBuf);

impl Dir {
    fn new() -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "indexd-snapshot-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    fn file(&self) -> PathBuf {
        self.0.join("index.snap")
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn endpoint(port: u16, replay: &str) -> EndpointConfig {
    let mut e = EndpointConfig::new(SocketAddr::from(([10, 0, 0, 1], port)), "m");
    e.events = Some(format!("tcp://10.0.0.1:{}", port + 1000));
    e.replay = Some(replay.to_owned());
    e
}

fn config(path: &Path, endpoints: Vec<EndpointConfig>) -> Config {
    let mut c = Config::new(endpoints);
    c.block_size = BlockSize::new(BS).unwrap();
    c.snapshot.path = Some(path.to_owned());
    c
}

fn tokens(blocks: u32, seed: u32) -> Vec<u32> {
    (0..blocks * BS)
        .map(|i| (i * 31 + seed * 7) % 32_000)
        .collect()
}

/// A daemon's state with `endpoints` registered (restoring from the loaded
/// snapshot, as `Server::bind` does).
fn start(config: Config) -> (Shared, Vec<Arc<Replica>>) {
    let endpoints = config.endpoints.clone();
    let shared = Shared::new(config, CancellationToken::new());
    load(&shared);
    let replicas = endpoints
        .into_iter()
        .map(|e| shared.add_replica(e).unwrap())
        .collect();
    (shared, replicas)
}

/// Stores `blocks` salted blocks on `replica` as batch `seq`.
fn store(shared: &Shared, replica: &Replica, seq: u64, blocks: u32, salt: &str) -> Vec<u64> {
    let t = tokens(blocks, seq as u32);
    let mut extra = vec![ExtraKeys::None; blocks as usize];
    extra[0] = ExtraKeys::Salt(salt.into());
    let ev = KvEvent::BlockStored(BlockStored {
        block_hashes: (0..u64::from(blocks))
            .map(|i| EngineHash(seq * 1000 + i))
            .collect(),
        parent: None,
        token_ids: t.clone(),
        block_size: BS,
        tier: Tier::Cpu,
        lora_name: None,
        extra_keys: Some(extra),
        group_idx: 0,
        kind: None,
        sliding_window: None,
    });
    let batch = EventBatch {
        ts: 0.0,
        events: vec![ev],
        data_parallel_rank: None,
    };
    let applied = Applied {
        seq,
        digest: 0xd1 + seq,
    };
    shared.ingest_applied(replica, batch, Some(applied));
    block_keys(&t, BlockSize::new(BS).unwrap(), Some(salt))
        .iter()
        .map(|k| k.as_u64())
        .collect()
}

fn matched(shared: &Shared, replica: &Replica, keys: &[u64]) -> u32 {
    let index = shared.index.locked();
    let keys: Vec<_> = keys
        .iter()
        .map(|k| kvroute_proto::BlockKey::from_u64(*k))
        .collect();
    index.match_prefix(
        index.partition("m"),
        &keys,
        &[replica.slot],
        std::time::Instant::now(),
    )[0]
    .blocks
}

#[test]
fn a_snapshot_round_trips_blocks_tiers_and_resume_points() {
    let dir = Dir::new();
    let eps = vec![
        endpoint(8000, "tcp://10.0.0.1:5558"),
        endpoint(8001, "tcp://10.0.0.1:5559"),
    ];
    let (shared, replicas) = start(config(&dir.file(), eps.clone()));
    let a = store(&shared, &replicas[0], 4, 3, "s");
    let b = store(&shared, &replicas[1], 9, 5, "t");
    let written = write(&shared).unwrap();
    assert_eq!(
        (written.replicas, written.entries, written.left_out),
        (2, 8, 0)
    );
    assert_eq!(written.bytes, fs::metadata(dir.file()).unwrap().len());
    assert!(!partial_path(&dir.file()).exists());

    let (restored, replicas) = start(config(&dir.file(), eps));
    assert_eq!(restored.metrics.snapshot_loads.get(["ok"]), 1);
    assert_eq!(restored.metrics.snapshot_loaded_entries.get(), 8.0);
    assert_eq!(matched(&restored, &replicas[0], &a), 3);
    assert_eq!(matched(&restored, &replicas[1], &b), 5);
    assert_eq!(matched(&restored, &replicas[0], &b), 0);
    let m = {
        let index = restored.index.locked();
        let keys: Vec<_> = a
            .iter()
            .map(|k| kvroute_proto::BlockKey::from_u64(*k))
            .collect();
        index.match_prefix(
            index.partition("m"),
            &keys,
            &[replicas[0].slot],
            std::time::Instant::now(),
        )[0]
    };
    assert_eq!(m.per_tier, [0, 3, 0], "tiers survive");
    assert_eq!(
        replicas[1].take_resume(),
        Some(Applied {
            seq: 9,
            digest: 0xd1 + 9
        })
    );
    // Not fresh until its replay proves the point.
    assert!(!replicas[1].is_fresh());
}

#[test]
fn only_replicas_with_the_same_sources_are_restored_and_others_are_ignored() {
    let dir = Dir::new();
    let (shared, replicas) = start(config(
        &dir.file(),
        vec![endpoint(8000, "tcp://10.0.0.1:5558")],
    ));
    let keys = store(&shared, &replicas[0], 1, 2, "s");
    write(&shared).unwrap();
    // Same address, another replay endpoint: not the same replica.
    let (moved, replicas) = start(config(
        &dir.file(),
        vec![endpoint(8000, "tcp://10.0.0.2:5558")],
    ));
    assert_eq!(matched(&moved, &replicas[0], &keys), 0);
    assert_eq!(replicas[0].take_resume(), None);
}

#[test]
fn a_replica_that_applied_nothing_since_its_purge_is_not_saved() {
    let dir = Dir::new();
    let eps = vec![endpoint(8000, "tcp://10.0.0.1:5558")];
    let (shared, replicas) = start(config(&dir.file(), eps));
    store(&shared, &replicas[0], 1, 2, "s");
    shared.purge(&replicas[0], "resync");
    assert_eq!(write(&shared).unwrap().replicas, 0);
}

/// A valid snapshot's bytes (two replicas).
fn snapshot_bytes(dir: &Dir) -> Vec<u8> {
    let eps = vec![
        endpoint(8000, "tcp://10.0.0.1:5558"),
        endpoint(8001, "tcp://10.0.0.1:5559"),
    ];
    let (shared, replicas) = start(config(&dir.file(), eps));
    store(&shared, &replicas[0], 4, 3, "s");
    store(&shared, &replicas[1], 9, 5, "t");
    write(&shared).unwrap();
    fs::read(dir.file()).unwrap()
}

fn parse_now(bytes: &[u8]) -> Result<Loaded, SnapshotError> {
    parse(bytes, BS, Duration::from_secs(600), SystemTime::now())
}

#[test]
fn corrupt_truncated_foreign_and_other_version_files_are_refused() {
    let dir = Dir::new();
    let good = snapshot_bytes(&dir);
    assert_eq!(parse_now(&good).unwrap().sections.len(), 2);
    // Any flipped byte past the magic and version: the checksum says so.
    for at in [20, good.len() / 2, good.len() - 5, good.len() - 1] {
        let mut bad = good.clone();
        bad[at] ^= 0x40;
        assert!(
            matches!(parse_now(&bad), Err(SnapshotError::Corrupt(_))),
            "byte {at}"
        );
    }
    // Every truncation is refused, none panics.
    for len in 0..good.len() {
        let err = parse_now(&good[..len]).unwrap_err();
        assert!(matches!(err, SnapshotError::Corrupt(_)), "{len}: {err}");
    }
    // The next version, and version 1 (chains of the kvroute/v1 key scheme).
    for version in [VERSION + 1, 1] {
        let mut other = good.clone();
        other[8..12].copy_from_slice(&version.to_le_bytes());
        assert!(
            matches!(parse_now(&other), Err(SnapshotError::Version(v)) if v == version),
            "{version}"
        );
    }
    assert!(matches!(
        parse_now(b"GARBAGE!and more bytes"),
        Err(SnapshotError::Foreign("magic"))
    ));
    assert!(matches!(
        parse(&good, BS * 2, Duration::from_secs(600), SystemTime::now()),
        Err(SnapshotError::Foreign(_))
    ));
    // A section that is well framed (checksum fixed up) but not a section.
    let mut forged = good[..good.len() - 4].to_vec();
    let end = forged.len() - 4;
    forged.truncate(end);
    forged.extend_from_slice(&3u32.to_le_bytes());
    forged.extend_from_slice(&[0xff, 0xff, 0xff]);
    forged.extend_from_slice(&0u32.to_le_bytes());
    let crc = crc32fast::hash(&forged);
    forged.extend_from_slice(&crc.to_le_bytes());
    assert!(matches!(parse_now(&forged), Err(SnapshotError::Corrupt(_))));
}

#[test]
fn a_refused_file_restores_nothing_and_is_counted() {
    let dir = Dir::new();
    let mut bad = snapshot_bytes(&dir);
    let mid = bad.len() / 2;
    bad[mid] ^= 1;
    fs::write(dir.file(), &bad).unwrap();
    let eps = vec![endpoint(8000, "tcp://10.0.0.1:5558")];
    let (shared, replicas) = start(config(&dir.file(), eps));
    assert_eq!(shared.metrics.snapshot_loads.get(["corrupt"]), 1);
    assert_eq!(shared.index.locked().entries(), 0);
    assert_eq!(replicas[0].take_resume(), None);
}

#[test]
fn a_snapshot_older_than_max_age_is_refused() {
    let dir = Dir::new();
    let good = snapshot_bytes(&dir);
    let later = SystemTime::now() + Duration::from_secs(601);
    assert!(matches!(
        parse(&good, BS, Duration::from_secs(600), later),
        Err(SnapshotError::TooOld { .. })
    ));
    let mut cfg = config(&dir.file(), vec![endpoint(8000, "tcp://10.0.0.1:5558")]);
    cfg.snapshot.max_age = Duration::ZERO;
    std::thread::sleep(Duration::from_millis(5));
    let (shared, _) = start(cfg);
    assert_eq!(shared.metrics.snapshot_loads.get(["too_old"]), 1);
    assert_eq!(shared.index.locked().entries(), 0);
}

#[test]
fn max_snapshot_bytes_leaves_replicas_out_and_refuses_larger_files() {
    let dir = Dir::new();
    let eps = vec![
        endpoint(8000, "tcp://10.0.0.1:5558"),
        endpoint(8001, "tcp://10.0.0.1:5559"),
    ];
    let mut cfg = config(&dir.file(), eps.clone());
    let (shared, replicas) = start(cfg.clone());
    let small = store(&shared, &replicas[0], 1, 2, "s");
    let large = store(&shared, &replicas[1], 2, 200, "t");
    // Room for the header and the small replica only.
    let full = write(&shared).unwrap();
    cfg.snapshot.max_bytes = full.bytes - 2000;
    let shared = Shared {
        ..reconfigure(shared, cfg.clone())
    };
    let w = write(&shared).unwrap();
    assert_eq!((w.replicas, w.left_out), (1, 1));
    assert!(w.bytes <= cfg.snapshot.max_bytes);
    let (restored, replicas) = start(cfg.clone());
    assert_eq!(matched(&restored, &replicas[0], &small), 2);
    assert_eq!(matched(&restored, &replicas[1], &large), 0);
    // A file larger than the limit is not even read.
    let mut tiny = cfg;
    tiny.snapshot.max_bytes = 64;
    assert!(matches!(
        read_file(&dir.file(), &tiny.snapshot, BS),
        Err(SnapshotError::TooLarge { .. })
    ));
}

/// `shared` under another configuration, its index kept.
fn reconfigure(shared: Shared, config: Config) -> Shared {
    let mut s = shared;
    s.snapshots = Snapshots::new(config.snapshot.clone(), config.block_size.get());
    s.config = config;
    s
}

#[test]
fn a_crash_mid_write_leaves_the_previous_snapshot_and_its_leftover_is_cleaned() {
    let dir = Dir::new();
    let eps = vec![endpoint(8000, "tcp://10.0.0.1:5558")];
    let (shared, replicas) = start(config(&dir.file(), eps.clone()));
    let keys = store(&shared, &replicas[0], 1, 2, "s");
    write(&shared).unwrap();
    // A write interrupted after part of its bytes: the partial file is
    // there, the snapshot is untouched.
    let partial = partial_path(&dir.file());
    fs::write(&partial, &fs::read(dir.file()).unwrap()[..30]).unwrap();
    let (restored, replicas) = start(config(&dir.file(), eps.clone()));
    assert!(!partial.exists(), "the leftover is removed at start");
    assert_eq!(matched(&restored, &replicas[0], &keys), 2);
    // Only a leftover, no snapshot yet: removed, nothing loaded.
    fs::remove_file(dir.file()).unwrap();
    fs::write(&partial, b"KVRTSNAP half").unwrap();
    let (fresh, _) = start(config(&dir.file(), eps));
    assert!(!partial.exists());
    assert_eq!(fresh.metrics.snapshot_loads.get(["missing"]), 1);
}

#[test]
fn a_symlink_at_the_partial_path_is_replaced_not_written_through() {
    let dir = Dir::new();
    let eps = vec![endpoint(8000, "tcp://10.0.0.1:5558")];
    let (shared, replicas) = start(config(&dir.file(), eps.clone()));
    let keys = store(&shared, &replicas[0], 1, 2, "s");
    // Someone who can write the directory points the partial path at a
    // file indexd may write to (its own, or another's).
    let victim = dir.0.join("victim");
    fs::write(&victim, b"precious").unwrap();
    let partial = partial_path(&dir.file());
    std::os::unix::fs::symlink(&victim, &partial).unwrap();
    let written = write(&shared).unwrap();
    assert_eq!(written.replicas, 1);
    assert_eq!(
        fs::read(&victim).unwrap(),
        b"precious",
        "not written through"
    );
    assert!(
        fs::symlink_metadata(&partial).is_err(),
        "the link is gone and the partial file renamed"
    );
    let file = fs::symlink_metadata(dir.file()).unwrap();
    assert!(
        file.file_type().is_file(),
        "the snapshot is a file of its own"
    );
    assert_eq!(written.bytes, file.len());
    // A dangling link too (O_CREAT alone would create its target).
    let target = dir.0.join("created-through-the-link");
    std::os::unix::fs::symlink(&target, &partial).unwrap();
    write(&shared).unwrap();
    assert!(!target.exists());
    let (restored, replicas) = start(config(&dir.file(), eps));
    assert_eq!(matched(&restored, &replicas[0], &keys), 2);
}

#[test]
fn the_partial_file_is_opened_exclusively_without_following_links() {
    let dir = Dir::new();
    let victim = dir.0.join("victim");
    fs::write(&victim, b"precious").unwrap();
    let partial = dir.0.join("x.partial");
    // Created fresh over a stale regular file.
    fs::write(&partial, b"stale").unwrap();
    let mut f = create_partial(&partial).unwrap();
    f.write_all(b"new").unwrap();
    drop(f);
    assert_eq!(fs::read(&partial).unwrap(), b"new");
    fs::remove_file(&partial).unwrap();
    // A directory at the path cannot be unlinked as a file: a clear error
    // naming the path, nothing written anywhere.
    fs::create_dir(&partial).unwrap();
    let err = create_partial(&partial).unwrap_err().to_string();
    assert!(err.contains("x.partial"), "{err}");
    assert_eq!(fs::read(&victim).unwrap(), b"precious");
}

#[test]
fn a_write_over_its_time_budget_is_abandoned_and_keeps_the_previous_file() {
    let dir = Dir::new();
    let eps = vec![endpoint(8000, "tcp://10.0.0.1:5558")];
    let mut cfg = config(&dir.file(), eps);
    let (shared, replicas) = start(cfg.clone());
    store(&shared, &replicas[0], 1, 2, "s");
    write(&shared).unwrap();
    let before = fs::read(dir.file()).unwrap();
    store(&shared, &replicas[0], 2, 3, "t");
    cfg.snapshot.max_write_time = Duration::ZERO;
    let shared = reconfigure(shared, cfg);
    assert!(matches!(write(&shared), Err(SnapshotError::Timeout(_))));
    assert_eq!(fs::read(dir.file()).unwrap(), before);
    assert!(!partial_path(&dir.file()).exists());
}

#[test]
fn a_snapshot_keeps_kv_cache_groups_and_the_layout() {
    use crate::event::{FullLabel, GroupKind};
    use crate::index::Query;
    let dir = Dir::new();
    let eps = vec![endpoint(8000, "tcp://10.0.0.1:5558")];
    let (shared, replicas) = start(config(&dir.file(), eps.clone()));
    // A Gemma-3-style replica: group 0 sliding (window 2 blocks), whose
    // event lists the range's last two of four blocks and comes first;
    // group 1 full attention with all four.
    let t = tokens(4, 7);
    let group = |g: u32, hashes: Vec<u64>| {
        let n = hashes.len();
        KvEvent::BlockStored(BlockStored {
            block_hashes: hashes.into_iter().map(EngineHash).collect(),
            parent: None,
            token_ids: t.clone(),
            block_size: BS,
            tier: Tier::Gpu,
            lora_name: None,
            extra_keys: Some(vec![ExtraKeys::None; n]),
            group_idx: g,
            kind: Some(if g == 0 {
                GroupKind::SlidingWindow { mla: false }
            } else {
                GroupKind::FullAttention(FullLabel::Full)
            }),
            sliding_window: (g == 0).then_some(2 * BS),
        })
    };
    let batch = EventBatch {
        ts: 0.0,
        events: vec![group(0, vec![2, 3]), group(1, vec![0, 1, 2, 3])],
        data_parallel_rank: None,
    };
    shared.ingest_applied(&replicas[0], batch, Some(Applied { seq: 3, digest: 7 }));
    let hit = |s: &Shared, r: &Replica| {
        let keys = block_keys(&t, BlockSize::new(BS).unwrap(), None);
        let lookup = &s.lookup;
        let q = Query {
            partition: lookup.partition("m"),
            keys: &keys,
            block_size: BS,
            max_blocks: 4,
            chunk_tokens: None,
            now: std::time::Instant::now(),
        };
        lookup.match_query(&q, &[r.slot])[0].blocks
    };
    assert_eq!(hit(&shared, &replicas[0]), 4);
    let written = write(&shared).unwrap();
    assert_eq!(written.entries, 6);

    let (restored, replicas) = start(config(&dir.file(), eps));
    assert_eq!(restored.metrics.snapshot_loaded_entries.get(), 6.0);
    let layout = restored.index.locked().layout(replicas[0].slot).unwrap();
    assert_eq!(
        crate::state::describe_layout(&layout),
        "0:sliding_window/8@4 1:full_attention@4"
    );
    // The sliding group's tail came back in its group: the same hit.
    assert_eq!(hit(&restored, &replicas[0]), 4);
}
