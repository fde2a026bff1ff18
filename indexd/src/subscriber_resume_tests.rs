//! Resuming from a snapshot: a second indexd loads the first one's snapshot
//! and each replica's stream replays from its saved seq. Proven, it applies
//! only what it missed; not provable (the buffer moved on, the engine
//! restarted), that replica alone is purged and replayed from seq 0.

use std::path::PathBuf;

use super::*;
use crate::snapshot;

/// A replica's engine, the batches it published, and the model of what it
/// holds.
struct World {
    engine: Arc<Mutex<Engine>>,
    naive: Naive,
    ts: f64,
}

impl World {
    fn new(cap: usize) -> Self {
        Self {
            engine: Arc::new(Mutex::new(Engine {
                next_seq: 0,
                buffer: VecDeque::new(),
                cap,
            })),
            naive: Naive::default(),
            ts: 0.0,
        }
    }

    fn replay(&self) -> FakeReplay {
        self.replay_cut(None)
    }

    /// Replays whose answers are cut as [`FakeReplay::cut`] says.
    fn replay_cut(&self, cut: Option<(usize, bool)>) -> FakeReplay {
        FakeReplay {
            engine: Arc::clone(&self.engine),
            queue: VecDeque::new(),
            legacy: false,
            available: true,
            cut,
        }
    }

    /// Publishes a store of prompt `ids`; returns the live message.
    fn publish(&mut self, ids: &[u8]) -> Vec<Bytes> {
        let op = Op::Store {
            slot: 0,
            p: Prompt {
                salt: Some("s"),
                lora: None,
                ids: ids.to_vec(),
            },
            start: 0,
            tier: crate::event::Tier::Gpu,
            group: 0,
            unkeyable_at: None,
            extra: Extra::Full,
        };
        let (_, ev) = event(&op).unwrap();
        self.ts += 1.0;
        let payload = encode(&ev, self.ts);
        let seq = self.engine.lock().unwrap().publish(payload.clone());
        self.naive.apply(0, "m", &ev);
        vec![
            Bytes::from_static(b"kv@t@m"),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            Bytes::from(payload),
        ]
    }

    fn restart_engine(&mut self) {
        let mut e = self.engine.lock().unwrap();
        e.next_seq = 0;
        e.buffer.clear();
        self.naive.replicas.clear();
    }
}

struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn dir(name: &str) -> Dir {
    let d = std::env::temp_dir().join(format!("indexd-resume-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    Dir(d)
}

fn endpoint(port: u16) -> EndpointConfig {
    let mut e = EndpointConfig::new(SocketAddr::from(([127, 0, 0, 1], port)), "m");
    e.events = Some(format!("tcp://127.0.0.1:{}", port + 1));
    e.replay = Some(format!("tcp://127.0.0.1:{}", port + 2));
    e
}

/// indexd's state for `ports`, restoring from the snapshot in `dir`.
fn daemon(dir: &Dir, ports: &[u16]) -> (Shared, Vec<Arc<crate::state::Replica>>) {
    let mut config = Config::new(ports.iter().map(|p| endpoint(*p)).collect());
    config.block_size = bs(BLOCK);
    config.snapshot.path = Some(dir.0.join("index.snap"));
    let shared = Shared::new(config, CancellationToken::new());
    snapshot::load(&shared);
    let replicas = ports
        .iter()
        .map(|p| shared.add_replica(endpoint(*p)).unwrap())
        .collect();
    (shared, replicas)
}

/// Every prompt of `prompts` matches on `replica` as the model says.
fn agrees(shared: &Shared, replica: &crate::state::Replica, world: &World, prompts: &[&[u8]]) {
    for ids in prompts {
        let p = Prompt {
            salt: Some("s"),
            lora: None,
            ids: ids.to_vec(),
        };
        let keys = block_keys(&p.tokens(0..p.ids.len()), bs(BLOCK), p.salt);
        let index = shared.index.locked();
        let got = index.match_prefix(
            index.partition("m"),
            &keys,
            &[replica.slot],
            std::time::Instant::now(),
        )[0];
        assert_eq!(
            (got.blocks, got.per_tier),
            world.naive.matched(0, "m", &keys),
            "prompt {ids:?}"
        );
    }
}

fn block_on(f: impl std::future::Future<Output = ()>) {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(f);
}

/// First indexd: follows `world` live through `prompts`, then snapshots.
async fn first_life(dir: &Dir, world: &mut World, prompts: &[&[u8]]) {
    let (shared, replicas) = daemon(dir, &[7000]);
    let mut stream = Stream::new(&shared, &replicas[0], world.replay());
    stream.resync(false).await;
    for ids in prompts {
        let live = world.publish(ids);
        stream.on_live(live).await;
    }
    agrees(&shared, &replicas[0], world, prompts);
    snapshot::write(&shared).unwrap();
}

const EARLY: [&[u8]; 3] = [&[1, 2], &[1, 3], &[2, 2, 1]];
const LATE: [&[u8]; 2] = [&[0, 1], &[1, 2, 2]];

#[test]
fn a_proven_resume_applies_only_what_was_missed() {
    block_on(async {
        let dir = dir("proven");
        let mut world = World::new(usize::MAX);
        first_life(&dir, &mut world, &EARLY).await;
        // indexd is down while the engine goes on.
        for ids in LATE {
            world.publish(ids);
        }
        let (shared, replicas) = daemon(&dir, &[7000]);
        assert!(!replicas[0].is_fresh());
        let mut stream = Stream::new(&shared, &replicas[0], world.replay());
        stream.resync(false).await;
        assert!(replicas[0].is_fresh());
        assert_eq!(stream.tracker.next, Some(5));
        let m = &shared.metrics;
        assert_eq!(m.replay_requests.get(["snapshot"]), 1);
        assert_eq!(m.replay_requests.get(["start"]), 0, "no replay from seq 0");
        assert_eq!(m.snapshot_resumes.get(["proven"]), 1);
        assert_eq!(m.purges.get(["snapshot"]), 0);
        // Exactly the two missed batches were applied.
        assert_eq!(m.batches.get(), 2);
        let all: Vec<&[u8]> = EARLY.iter().chain(&LATE).copied().collect();
        agrees(&shared, &replicas[0], &world, &all);
        // The live copy of a replayed batch is a duplicate, the next applies.
        let next = world.publish(&[2, 1]);
        stream.on_live(next).await;
        assert_eq!(m.batches.get(), 3);
    });
}

#[test]
fn a_seq_the_buffer_no_longer_holds_purges_that_replica_and_replays_from_zero() {
    block_on(async {
        let dir = dir("gone");
        // A buffer of two batches: the saved seq (2) is gone after two more.
        let mut world = World::new(2);
        first_life(&dir, &mut world, &EARLY).await;
        for ids in LATE {
            world.publish(ids);
        }
        let (shared, replicas) = daemon(&dir, &[7000]);
        let mut stream = Stream::new(&shared, &replicas[0], world.replay());
        stream.resync(false).await;
        let m = &shared.metrics;
        assert_eq!(m.snapshot_resumes.get(["gone"]), 1);
        assert_eq!(m.purges.get(["snapshot"]), 1);
        assert_eq!(m.replay_requests.get(["start"]), 1);
        assert!(replicas[0].is_fresh());
        // What the buffer still held (the last two batches) is all it keeps:
        // the early prompts it cannot prove are forgotten, none invented.
        let index = shared.index.locked();
        assert_eq!(index.replica_entries(replicas[0].slot), 5);
    });
}

#[test]
fn a_restarted_engine_is_told_apart_by_its_batches_digest() {
    block_on(async {
        let dir = dir("restarted");
        let mut world = World::new(usize::MAX);
        first_life(&dir, &mut world, &EARLY).await;
        // A new engine process: seqs from 0 again, past the saved seq 2.
        world.restart_engine();
        for ids in [&[2u8, 2][..], &[0], &[0, 0], &[1]] {
            world.publish(ids);
        }
        let (shared, replicas) = daemon(&dir, &[7000]);
        let mut stream = Stream::new(&shared, &replicas[0], world.replay());
        stream.resync(false).await;
        let m = &shared.metrics;
        assert_eq!(m.snapshot_resumes.get(["restarted"]), 1);
        assert_eq!(m.replay_requests.get(["start"]), 1);
        assert_eq!(stream.tracker.next, Some(4));
        agrees(&shared, &replicas[0], &world, &[&[2, 2], &[1, 2], &[0, 0]]);
    });
}

#[test]
fn a_restarted_engine_with_fewer_batches_is_told_apart_by_its_empty_replay() {
    block_on(async {
        let dir = dir("fewer");
        let mut world = World::new(usize::MAX);
        first_life(&dir, &mut world, &EARLY).await;
        world.restart_engine();
        world.publish(&[0, 1]);
        let (shared, replicas) = daemon(&dir, &[7000]);
        let mut stream = Stream::new(&shared, &replicas[0], world.replay());
        stream.resync(false).await;
        assert_eq!(shared.metrics.snapshot_resumes.get(["restarted"]), 1);
        assert_eq!(stream.tracker.next, Some(1));
        agrees(&shared, &replicas[0], &world, &[&[0, 1], &[1, 2]]);
    });
}

/// vLLM's ROUTER drops what exceeds its send queue: a start-up replay of a
/// long buffer gets its first batches, then nothing (or, once the queue
/// drained, the rest after a hole). Read in pages, it still ends with every
/// batch applied, the end marker seen, and no gap at the next live batch.
#[test]
fn a_replay_answer_cut_short_is_read_in_pages() {
    const PROMPTS: [&[u8]; 7] = [
        &[1, 2],
        &[1, 3],
        &[2, 2, 1],
        &[0, 1],
        &[1, 2, 2],
        &[3],
        &[3, 1],
    ];
    for (window, resume) in [(2, false), (2, true), (3, false), (1, true)] {
        block_on(async {
            let mut world = World::new(usize::MAX);
            for ids in PROMPTS {
                world.publish(ids);
            }
            let shared = Shared::new(Config::new(Vec::new()), CancellationToken::new());
            let replica = shared.add_replica(endpoint(7100)).unwrap();
            let mut stream =
                Stream::new(&shared, &replica, world.replay_cut(Some((window, resume))));
            stream.resync(false).await;
            let case = format!("cut ({window}, {resume})");
            assert!(replica.is_fresh());
            let m = &shared.metrics;
            assert!(m.replay_requests.get(["page"]) >= 1, "{case}");
            if !resume {
                // Cut off for good each time: read to the end marker.
                assert_eq!(stream.tracker.next, Some(7), "{case}");
                assert_eq!(m.replays.get(["complete"]), 1, "{case}");
                agrees(&shared, &replica, &world, &PROMPTS);
            }
            // A batch dropped right before the end marker shows at the
            // next live batch, as a gap its replay reaches.
            let next = world.publish(&[2, 1]);
            stream.on_live(next).await;
            assert_eq!(stream.tracker.next, Some(8), "{case}");
            assert_eq!(m.purges.get(["gap"]), 0, "{case}");
            assert_eq!(m.batches.get(), 8, "{case}: each batch applied once");
            let all: Vec<&[u8]> = PROMPTS.iter().copied().chain([&[2u8, 1][..]]).collect();
            agrees(&shared, &replica, &world, &all);
        });
    }
}
