//! indexd benchmarks: Pick over 1,024 keys on 8 replicas, ingest rate, and
//! memory per indexed (block, replica) entry. Results: `indexd/BENCHMARKS.md`.

// A benchmark binary: setup may fail loudly.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::hint::black_box;
use std::net::SocketAddr;
use std::time::Instant;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group};
use indexd::config::{Config, EndpointConfig};
use indexd::event::{
    BlockStored, EngineHash, EventBatch, ExtraKeys, FullLabel, GroupKind, KvEvent,
};
use indexd::index::{ApplyStats, Index};
use indexd::state::Shared;
use indexd::wire::{self, Limits};
use indexd::{ReplicaSlot, Tier, pick};
use kvroute_proto::keys::{BlockSize, block_keys};
use kvroute_proto::v1::{Mode, PickRequest};
use rmpv::Value;
use tokio_util::sync::CancellationToken;

/// The allocator the indexd binary runs with (src/main.rs), so that a
/// Pick's few allocations cost here what they cost there.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

const BS: u32 = 64;

fn tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(7919) ^ seed.wrapping_mul(104_729)) % 32_000)
        .collect()
}

fn stored(hashes: std::ops::Range<u64>, parent: Option<u64>, tokens: Vec<u32>) -> KvEvent {
    let n = (hashes.end - hashes.start) as usize;
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes.map(EngineHash).collect(),
        parent: parent.map(EngineHash),
        token_ids: tokens,
        block_size: BS,
        tier: Tier::Gpu,
        lora_name: None,
        extra_keys: Some(vec![ExtraKeys::None; n]),
        group_idx: 0,
        kind: None,
        sliding_window: None,
    })
}

/// A store in KV cache group `group` of a Gemma-3 / gpt-oss layout (group 0
/// sliding, window 256 tokens; group 1 full attention): the range's tokens,
/// hashes for `kept` blocks of it only.
fn stored_in(group: u32, hashes: Vec<u64>, parent: Option<u64>, tokens: Vec<u32>) -> KvEvent {
    let n = hashes.len();
    let (kind, sliding_window) = if group == 0 {
        (GroupKind::SlidingWindow { mla: false }, Some(256))
    } else {
        (GroupKind::FullAttention(FullLabel::Full), None)
    };
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes.into_iter().map(EngineHash).collect(),
        parent: parent.map(EngineHash),
        token_ids: tokens,
        block_size: BS,
        tier: Tier::Gpu,
        lora_name: None,
        extra_keys: (n > 0).then(|| vec![ExtraKeys::None; n]),
        group_idx: group,
        kind: Some(kind),
        sliding_window,
    })
}

/// The sliding group's blocks of a conversation whose turns end every 64
/// blocks, up to `run`: the 4-block tail before each turn's end (vLLM 0.32
/// keeps only those, `reachable_block_mask`), the last turn's ending at
/// `run`.
fn sliding_tails(run: u64) -> Vec<u64> {
    let mut ends: Vec<u64> = (1..=run / 64).map(|t| t * 64).collect();
    ends.push(run);
    ends.sort_unstable();
    ends.dedup();
    ends.into_iter()
        .flat_map(|end| end.saturating_sub(4)..end)
        .collect::<std::collections::BTreeSet<u64>>()
        .into_iter()
        .collect()
}

/// `replicas` replicas of a two-group model (sliding first, as gpt-oss and
/// Gemma 3); replica i's full-attention group holds the first
/// 1,024·(i+1)/`replicas` blocks of one 1,024-block prompt, its sliding
/// group the tails at its turns' ends ([`sliding_tails`]). The request is
/// that prompt and one token more, so that vLLM would hit all 1,024 blocks
/// on the last replica (as the one-group bench's request is held whole:
/// neither queues prefill on it).
fn pick_setup_hybrid(replicas: u16) -> (Shared, PickRequest) {
    let (shared, mut req) = pick_setup_with(0, false);
    req.prompt_tokens = 1024 * BS + 1;
    let prompt = tokens(1024 * BS as usize, 1);
    for i in 0..replicas {
        let ep = EndpointConfig::new(
            SocketAddr::from(([10, 1, (i / 250) as u8, 1 + (i % 250) as u8], 8000)),
            "m",
        );
        let replica = shared.add_replica(ep).unwrap();
        let run = 1024 * (u64::from(i) + 1) / u64::from(replicas);
        let range = prompt[..run as usize * BS as usize].to_vec();
        let batch = EventBatch {
            ts: 0.0,
            events: vec![
                stored_in(0, sliding_tails(run), None, range.clone()),
                stored_in(1, (0..run).collect(), None, range),
            ],
            data_parallel_rank: None,
        };
        shared.ingest(&replica, batch);
    }
    (shared, req)
}

/// 8 replicas; replica i holds the first 128·(i+1) blocks of one 1,024-block
/// prompt (so the walk goes the whole way for the last one).
fn pick_setup(speculative: bool) -> (Shared, PickRequest) {
    pick_setup_with(8, speculative)
}

/// `replicas` replicas; replica i holds the first 1,024·(i+1)/`replicas`
/// blocks of one 1,024-block prompt.
fn pick_setup_with(replicas: u16, speculative: bool) -> (Shared, PickRequest) {
    let endpoints: Vec<EndpointConfig> = (0..replicas.max(1))
        .map(|i| {
            EndpointConfig::new(
                SocketAddr::from(([10, 0, (i / 250) as u8, 1 + (i % 250) as u8], 8000)),
                "m",
            )
        })
        .collect();
    let mut config = Config::new(endpoints.clone());
    config.seed = Some(1);
    if !speculative {
        config.speculative_ttl = std::time::Duration::ZERO;
    }
    let shared = Shared::new(config, CancellationToken::new());
    let prompt = tokens(1024 * BS as usize, 1);
    for (i, ep) in endpoints
        .into_iter()
        .enumerate()
        .take(usize::from(replicas))
    {
        let replica = shared.add_replica(ep).unwrap();
        let blocks = 1024 * (i + 1) / usize::from(replicas);
        let batch = EventBatch {
            ts: 0.0,
            events: vec![stored(
                0..blocks as u64,
                None,
                prompt[..blocks * BS as usize].to_vec(),
            )],
            data_parallel_rank: None,
        };
        shared.ingest(&replica, batch);
    }
    let keys = block_keys(&prompt, BlockSize::new(BS).unwrap(), None);
    let req = PickRequest {
        model: "m".into(),
        block_keys: keys.iter().map(|k| k.as_u64()).collect(),
        block_size: BS,
        prompt_tokens: 1024 * BS,
        mode: Mode::Precise as i32,
        key_scheme: kvroute_proto::SCHEME_VERSION.into(),
        ..PickRequest::default()
    };
    (shared, req)
}

/// Per-call Pick latency (p50, p99) at 1,024 blocks over 8, 64 and 256
/// replicas: 2,000 unmeasured calls, then 20,000 timed one by one.
fn pick_latency_report() {
    for replicas in [8u16, 64, 256] {
        let (shared, req) = pick_setup_with(replicas, false);
        let r = pick::pick(&shared, &req, Instant::now()).unwrap();
        assert_eq!(r.candidates[0].matched_blocks, 1024);
        for _ in 0..2_000 {
            black_box(pick::pick(&shared, black_box(&req), Instant::now()).unwrap());
        }
        let mut ns: Vec<u64> = (0..20_000)
            .map(|_| {
                let t = Instant::now();
                black_box(pick::pick(&shared, black_box(&req), Instant::now()).unwrap());
                t.elapsed().as_nanos() as u64
            })
            .collect();
        ns.sort_unstable();
        let at = |q: f64| ns[((ns.len() - 1) as f64 * q) as usize] as f64 / 1000.0;
        println!(
            "pick latency, 1024 blocks over {replicas} replicas: p50 {:.1} µs, p99 {:.1} µs",
            at(0.5),
            at(0.99)
        );
    }
    // A two-group model (sliding window 256 and full attention), 8 replicas:
    // the last holds all 1,024 blocks in full attention and the sliding
    // tails of its turns.
    let (shared, req) = pick_setup_hybrid(8);
    let r = pick::pick(&shared, &req, Instant::now()).unwrap();
    assert_eq!(r.candidates[0].matched_blocks, 1024);
    assert_eq!(r.decision, kvroute_proto::v1::DecisionKind::Precise as i32);
    for _ in 0..2_000 {
        black_box(pick::pick(&shared, black_box(&req), Instant::now()).unwrap());
    }
    let mut ns: Vec<u64> = (0..20_000)
        .map(|_| {
            let t = Instant::now();
            black_box(pick::pick(&shared, black_box(&req), Instant::now()).unwrap());
            t.elapsed().as_nanos() as u64
        })
        .collect();
    ns.sort_unstable();
    let at = |q: f64| ns[((ns.len() - 1) as f64 * q) as usize] as f64 / 1000.0;
    println!(
        "pick latency, two-group model (sliding + full), 1024 blocks over 8 replicas: p50 {:.1} µs, p99 {:.1} µs",
        at(0.5),
        at(0.99)
    );
}

fn bench_pick(c: &mut Criterion) {
    let mut g = c.benchmark_group("pick_1024_keys_8_replicas");
    // Warm: one replica holds all 1,024 blocks, the others 128..896; the
    // walk goes the whole way. Speculative entries off (nothing to credit
    // anyway: the chosen replica holds every key).
    let (shared, req) = pick_setup(false);
    let r = pick::pick(&shared, &req, Instant::now()).unwrap();
    assert_eq!(r.candidates[0].matched_blocks, 1024);
    g.bench_function("warm_prefix", |b| {
        b.iter(|| pick::pick(&shared, black_box(&req), Instant::now()).unwrap())
    });
    // The same on a two-group model: the full-attention walk, then each
    // replica's sliding tail found right to left.
    let (shared_h, req_h) = pick_setup_hybrid(8);
    g.bench_function("warm_prefix_two_groups", |b| {
        b.iter(|| pick::pick(&shared_h, black_box(&req_h), Instant::now()).unwrap())
    });
    // Cold: a new prompt every time (nobody holds its first block), so the
    // chosen replica is credited with all 1,024 keys as speculative entries.
    let (shared, mut req) = pick_setup(true);
    let mut seed = 0u64;
    g.bench_function("cold_prompt_with_speculative_insert", |b| {
        b.iter(|| {
            seed += 1;
            for (i, k) in req.block_keys.iter_mut().enumerate() {
                *k = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i as u64;
            }
            pick::pick(&shared, black_box(&req), Instant::now()).unwrap()
        })
    });
    g.finish();
}

/// The first token of every ingest event: a value msgpack writes as a uint
/// 32 (`0xce` and 4 bytes), so that the bench can give each event new
/// content by rewriting those bytes in place.
const FIRST_TOKEN: u32 = 0xdead_beef;

/// A new first token for event `n`, still a uint 32 on the wire.
fn first_token(n: u64) -> u32 {
    0x8000_0000 | (n as u32 & 0x7fff_ffff)
}

fn bench_ingest(c: &mut Criterion) {
    let mut g = c.benchmark_group("ingest");
    let blocks = 64u64;
    g.throughput(Throughput::Elements(blocks));
    let mut toks = tokens(blocks as usize * BS as usize, 2);
    toks[0] = FIRST_TOKEN;
    // Decode: vLLM's msgpack for one BlockStored of 64 blocks × 64 tokens.
    let ev = Value::Map(vec![
        (Value::from("type"), Value::from("BlockStored")),
        (
            Value::from("block_hashes"),
            Value::Array((0..blocks).map(|h| Value::from(h | 1 << 63)).collect()),
        ),
        (Value::from("parent_block_hash"), Value::Nil),
        (
            Value::from("token_ids"),
            Value::Array(toks.iter().map(|t| Value::from(*t)).collect()),
        ),
        (Value::from("block_size"), Value::from(BS)),
        (Value::from("medium"), Value::from("GPU")),
        (
            Value::from("extra_keys"),
            Value::Array(vec![Value::Nil; blocks as usize]),
        ),
        (Value::from("group_idx"), Value::from(0)),
    ]);
    let mut payload = Vec::new();
    rmpv::encode::write_value(
        &mut payload,
        &Value::Array(vec![Value::from(1.0), Value::Array(vec![ev])]),
    )
    .unwrap();
    g.bench_with_input(BenchmarkId::new("decode", "64_blocks"), &payload, |b, p| {
        b.iter(|| wire::decode_batch(black_box(p), &Limits::default()).unwrap())
    });
    // Where the first token sits in the payload.
    let mut marker = vec![0xce];
    marker.extend_from_slice(&FIRST_TOKEN.to_be_bytes());
    let first_at = 1 + payload
        .windows(marker.len())
        .position(|w| w == marker)
        .unwrap();
    // Apply: each event a new prompt's 64 blocks (its first token differs,
    // so every chain value and key is new), fresh engine hashes, into an
    // index at its memory bound (evicting as it goes). What a replica
    // publishes under load: content it already holds it does not store again.
    let KvEvent::BlockStored(template) = stored(0..blocks, None, toks) else {
        unreachable!()
    };
    bench_apply(&mut g, "apply", template.clone(), true);
    // Decode and apply as ingest does (`Shared::ingest`): the batch decoded,
    // its event queued, the batch published; new content and fresh engine
    // hashes each time.
    let mut index = Index::new(1 << 20, 0);
    let mut next = 0u64;
    let mut stats = ApplyStats::default();
    let mut fresh = payload.clone();
    g.bench_function(BenchmarkId::new("decode_and_apply", "64_blocks"), |b| {
        b.iter(|| {
            fresh[first_at..first_at + 4].copy_from_slice(&first_token(next).to_be_bytes());
            let batch = wire::decode_batch(black_box(&fresh), &Limits::default()).unwrap();
            let slot = ReplicaSlot((next / 4096 % 8) as u32);
            for mut ev in batch.events {
                if let KvEvent::BlockStored(s) = &mut ev {
                    for h in &mut s.block_hashes {
                        *h = EngineHash(next);
                        next += 1;
                    }
                }
                index.apply_unpublished(slot, "m", ev);
            }
            index.publish(&mut stats);
        })
    });
    // The same 64 blocks stored again and again under new engine hashes (the
    // pattern of the figures before 2026-12-03): every key's group holds up
    // to thousands of entries of each replica. No vLLM replica does this; it
    // stays as a stress figure for the group paths.
    bench_apply(&mut g, "apply_same_blocks", template, false);
    g.finish();
}

/// `Index::apply` of `template` under fresh engine hashes every iteration,
/// spread over 8 replicas, into an index bounded at 1 M entries; with
/// `new_content` its first token changes too, so that every key is new.
fn bench_apply(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    mut template: BlockStored,
    new_content: bool,
) {
    let mut index = Index::new(1 << 20, 0);
    let mut next = 0u64;
    let mut stats = ApplyStats::default();
    g.bench_function(BenchmarkId::new(name, "64_blocks"), |b| {
        b.iter(|| {
            if new_content {
                template.token_ids[0] = first_token(next);
            }
            for h in &mut template.block_hashes {
                *h = EngineHash(next);
                next += 1;
            }
            let ev = KvEvent::BlockStored(template.clone());
            index.apply(
                ReplicaSlot((next / 4096 % 8) as u32),
                "m",
                black_box(&ev),
                &mut stats,
            );
        })
    });
}

fn rss_bytes() -> Option<usize> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: usize = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

/// Bytes per (block, replica) entry: 8 replicas × 131,072 blocks, chained
/// 64 blocks per event, measured as RSS growth and as the index's own
/// capacity-based estimate.
fn memory_report() {
    let before = rss_bytes();
    let mut index = Index::new(usize::MAX, 0);
    let mut stats = ApplyStats::default();
    let per_replica = 131_072u64;
    for r in 0..8u32 {
        let mut parent = None;
        for start in (0..per_replica).step_by(64) {
            let base = u64::from(r) << 40 | start;
            let ev = stored(
                base..base + 64,
                parent,
                tokens(64 * BS as usize, (start / 64) as u32 ^ r),
            );
            // Independent prompts: restart the chain every 16 events.
            index.apply(ReplicaSlot(r), "m", &ev, &mut stats);
            parent = if (start / 64) % 16 == 15 {
                None
            } else {
                Some(base + 63)
            };
        }
    }
    let after = rss_bytes();
    let entries = index.entries();
    println!(
        "memory: {entries} entries, {} distinct keys; estimate {:.1} bytes/entry; RSS growth {}",
        index.distinct_keys(),
        index.approx_bytes() as f64 / entries as f64,
        match (before, after) {
            (Some(b), Some(a)) => format!(
                "{:.1} bytes/entry",
                a.saturating_sub(b) as f64 / entries as f64
            ),
            _ => "n/a".into(),
        }
    );
    black_box(index);
}

/// The same as [`memory_report`] on a two-group model: each event's blocks
/// in the full-attention group, and the sliding group's 4-block tail before
/// each event's end (a turn every 4k tokens), so entries are the two
/// groups'.
fn memory_report_hybrid() {
    let before = rss_bytes();
    let mut index = Index::new(usize::MAX, 0);
    let mut stats = ApplyStats::default();
    let per_replica = 131_072u64;
    for r in 0..8u32 {
        let mut parent = None;
        for start in (0..per_replica).step_by(64) {
            let base = u64::from(r) << 40 | start;
            let toks = tokens(64 * BS as usize, (start / 64) as u32 ^ r);
            let tail: Vec<u64> = (base + 60..base + 64).collect();
            index.apply(
                ReplicaSlot(r),
                "m",
                &stored_in(0, tail, parent, toks.clone()),
                &mut stats,
            );
            index.apply(
                ReplicaSlot(r),
                "m",
                &stored_in(1, (base..base + 64).collect(), parent, toks),
                &mut stats,
            );
            parent = if (start / 64) % 16 == 15 {
                None
            } else {
                Some(base + 63)
            };
        }
    }
    assert_eq!(index.parked(), 0);
    let after = rss_bytes();
    let entries = index.entries();
    println!(
        "memory, two-group model: {entries} entries ({} per replica in full attention), {} distinct keys; estimate {:.1} bytes/entry; RSS growth {}",
        per_replica,
        index.distinct_keys(),
        index.approx_bytes() as f64 / entries as f64,
        match (before, after) {
            (Some(b), Some(a)) => format!(
                "{:.1} bytes/entry",
                a.saturating_sub(b) as f64 / entries as f64
            ),
            _ => "n/a".into(),
        }
    );
    black_box(index);
}

criterion_group!(benches, bench_pick, bench_ingest);

fn main() {
    // As the daemon does (`indexd::without_huge_pages`): the RSS figure is
    // the daemon's.
    if let Err(e) = indexd::without_huge_pages() {
        eprintln!("transparent huge pages left as they were: {e}");
    }
    // INDEX_BENCH_PART: `memory-hybrid` (the child below), `criterion`
    // (the criterion benches alone, e.g. under a profiler).
    let part = std::env::var("INDEX_BENCH_PART").unwrap_or_default();
    if part == "memory-hybrid" {
        memory_report_hybrid();
        return;
    }
    if part == "criterion" {
        benches();
        criterion::Criterion::default()
            .configure_from_args()
            .final_summary();
        return;
    }
    memory_report();
    // The two-group model's memory in a process of its own: here its RSS
    // growth would reuse what the first report's index freed.
    match std::env::current_exe().and_then(|exe| {
        std::process::Command::new(exe)
            .env("INDEX_BENCH_PART", "memory-hybrid")
            .output()
    }) {
        Ok(out) => print!("{}", String::from_utf8_lossy(&out.stdout)),
        Err(e) => eprintln!("memory, two-group model: not measured: {e}"),
    }
    pick_latency_report();
    benches();
    criterion::Criterion::default()
        .configure_from_args()
        .final_summary();
}
