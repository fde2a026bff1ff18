//! Real vLLM 0.32 KV events of hybrid models (`tests/fixtures/
//! vllm-0.32-hybrid-real/`, captured by `tests/vllm/capture_hybrid.py`)
//! replayed into the index, message by message; before each request's own
//! events the index predicts its hit from its prompt's token ids, and the
//! prediction must be what vLLM reported (`cached_tokens`).

use std::collections::BTreeMap;
use std::time::Instant;

use kvroute_proto::keys::{BlockSize, block_keys};

use super::*;
use crate::event::KvEvent;
use crate::wire::{Limits, decode_batch};

const ROOT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tests/fixtures/vllm-0.32-hybrid-real/"
);

/// One request of a capture.
struct Request {
    step: String,
    tokens: Vec<u32>,
    prompt_tokens: u32,
    cached_tokens: u32,
}

/// A capture: its messages in order (seq, step, events) and its requests
/// in the order they ran.
struct Capture {
    messages: Vec<(u64, String, Vec<KvEvent>)>,
    requests: Vec<Request>,
}

fn load(dir: &str) -> Capture {
    let dir = format!("{ROOT}{dir}");
    let mut messages = Vec::new();
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".f2_payload.msgpack"))
        .collect();
    names.sort();
    for name in names {
        // seqNNN_<step>_<types>.f2_payload.msgpack
        let mut parts = name.splitn(3, '_');
        let seq: u64 = parts.next().unwrap()[3..].parse().unwrap();
        let step = parts.next().unwrap().to_owned();
        let bytes = std::fs::read(format!("{dir}/{name}")).unwrap();
        let batch = decode_batch(&bytes, &Limits::default()).unwrap();
        messages.push((seq, step, batch.events));
    }
    let mut requests = Vec::new();
    for line in std::fs::read_to_string(format!("{dir}/requests.jsonl"))
        .unwrap()
        .lines()
    {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let tokens = v["prompt_token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        requests.push(Request {
            step: v["step"].as_str().unwrap().to_owned(),
            tokens,
            prompt_tokens: v["prompt_tokens"].as_u64().unwrap() as u32,
            cached_tokens: v["cached_tokens"].as_u64().unwrap() as u32,
        });
    }
    Capture { messages, requests }
}

/// What the replay saw: per request `(step, predicted, vLLM's)` in tokens,
/// whether the layout was modelled, the stats.
struct Replayed {
    hits: Vec<(String, u32, u32, bool)>,
    stats: ApplyStats,
    entries_seen: usize,
    layout: String,
}

fn replay(dir: &str, chunk_tokens: Option<u32>) -> Replayed {
    let capture = load(dir);
    let mut ix = Index::new(1 << 20, 0);
    let mut stats = ApplyStats::default();
    let slot = ReplicaSlot(0);
    let lookup = ix.lookup();
    let mut hits = Vec::new();
    let mut entries_seen = 0;
    // Block size from the first store (every request is replayed in order,
    // each before its own messages).
    let mut block_size = capture
        .messages
        .iter()
        .flat_map(|(_, _, evs)| evs)
        .find_map(|e| match e {
            KvEvent::BlockStored(s) if !s.token_ids.is_empty() => Some(s.block_size),
            _ => None,
        })
        .unwrap();
    let mut messages = capture.messages.into_iter().peekable();
    for r in &capture.requests {
        let mut own: Vec<Vec<KvEvent>> = Vec::new();
        while let Some((_, step, _)) = messages.peek() {
            if *step != r.step {
                break;
            }
            if let Some((_, _, events)) = messages.next() {
                own.push(events);
            }
        }
        // vLLM announces a reset of its prefix cache (`AllBlocksCleared`)
        // with the next step's events, after the request that follows it
        // was admitted: a router learns of it one request late. The
        // prediction is made as if it had been announced in time.
        if let Some(first) = own.first_mut()
            && matches!(first.first(), Some(KvEvent::AllBlocksCleared))
        {
            ix.apply(slot, "m", &first.remove(0), &mut stats);
        }
        // The request's hit, from what the replica announced before it.
        let keys = block_keys(&r.tokens, BlockSize::new(block_size).unwrap(), None);
        let q = Query {
            partition: lookup.partition("m"),
            keys: &keys,
            block_size,
            max_blocks: ((r.prompt_tokens - 1) / block_size) as usize,
            chunk_tokens,
            now: Instant::now(),
        };
        let m = lookup.match_query(&q, &[slot])[0];
        hits.push((
            r.step.clone(),
            m.blocks * block_size,
            r.cached_tokens,
            !m.unmodelled,
        ));
        for events in own {
            for ev in events {
                if let KvEvent::BlockStored(s) = &ev {
                    block_size = block_size.max(s.block_size);
                }
                ix.apply_unpublished(slot, "m", ev);
            }
            ix.publish(&mut stats);
            entries_seen = entries_seen.max(ix.entries());
        }
    }
    assert!(messages.next().is_none(), "{dir}: messages of no request");
    let layout = ix
        .layout(slot)
        .map(|l| {
            l.groups()
                .map(|(i, g)| format!("{i}:{}", g.kind.label()))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default();
    Replayed {
        hits,
        stats,
        entries_seen,
        layout,
    }
}

fn assert_exact(dir: &str, layout: &str, chunk_tokens: Option<u32>) {
    let r = replay(dir, chunk_tokens);
    assert_eq!(r.layout, layout, "{dir}");
    for (step, predicted, vllm, modelled) in &r.hits {
        assert!(modelled, "{dir} {step}: layout not modelled");
        assert_eq!(
            predicted, vllm,
            "{dir} {step}: predicted vs vLLM's cached tokens"
        );
    }
    assert!(r.entries_seen > 0, "{dir}: nothing indexed");
    let s = r.stats;
    assert_eq!(
        (
            s.skipped_group,
            s.skipped_bad_length,
            s.skipped_unknown_parent
        ),
        (0, 0, 0),
        "{dir}: {s:?}"
    );
    assert_eq!(
        s.parked, s.unparked,
        "{dir}: parked blocks never resolved: {s:?}"
    );
    // Some request of every capture hits: the check is not vacuous.
    assert!(r.hits.iter().any(|(_, _, vllm, _)| *vllm > 0), "{dir}");
}

#[test]
fn gemma3_hits_are_vllms() {
    for dir in ["gemma3/session", "gemma3/pressure"] {
        assert_exact(dir, "0:sliding_window 1:full_attention", None);
    }
    // The capture's point: conversation B shares only the system prompt
    // with A, which the full-attention group holds; vLLM gives it nothing
    // (the sliding group kept no tail there), and C then hits at the
    // junction B's prefill kept.
    let r = replay("gemma3/session", None);
    let by_step: BTreeMap<&str, (u32, u32)> = r
        .hits
        .iter()
        .map(|(s, p, v, _)| (s.as_str(), (*p, *v)))
        .collect();
    assert_eq!(by_step["b1"], (0, 0));
    assert_eq!(by_step["c1"], (2944, 2944));
}

#[test]
fn gpt_oss_hits_are_vllms() {
    for dir in ["gpt-oss/session", "gpt-oss/pressure"] {
        assert_exact(dir, "0:sliding_window 1:full_attention", None);
    }
}

#[test]
fn qwen3_next_hits_are_vllms() {
    for dir in ["qwen3-next/session", "qwen3-next/pressure"] {
        assert_exact(dir, "0:mamba 1:full_attention", None);
    }
}

#[test]
fn llama4_hits_are_vllms_with_its_chunk_configured() {
    // The tier's Llama-4-style model has chunks of 1,024 tokens.
    let layout = "0:chunked_local_attention 1:chunked_local_attention 2:chunked_local_attention 3:full_attention";
    for dir in ["llama4/session", "llama4/pressure"] {
        assert_exact(dir, layout, Some(1024));
    }
}

#[test]
fn llama4_chunked_local_groups_are_reported_and_bounded() {
    // vLLM's events do not carry the attention chunk: without it the
    // chunked-local groups are not modelled, and the hit is the
    // full-attention group's, an upper bound on vLLM's.
    for dir in ["llama4/session", "llama4/pressure"] {
        let r = replay(dir, None);
        assert_eq!(
            r.layout,
            "0:chunked_local_attention 1:chunked_local_attention 2:chunked_local_attention 3:full_attention"
        );
        for (step, predicted, vllm, modelled) in &r.hits {
            if *predicted > 0 {
                assert!(!modelled, "{dir} {step}");
            }
            assert!(predicted >= vllm, "{dir} {step}: {predicted} < {vllm}");
        }
        assert!(r.entries_seen > 0);
    }
}
