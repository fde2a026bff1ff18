//! A hybrid (sliding window + full attention) model's KV events next to the ones vLLM 0.32
//! published for the same prompt (`tests/fixtures/vllm-0.32-hybrid/`).

use std::collections::HashMap;
use std::fmt;

use mock_vllm::{Config, EventEncoding, KvEventsConfig};
use rmpv::Value as Mp;
use serde::de::{Deserialize, Deserializer, MapAccess, Visitor};
use serde_json::{Value, json};

use crate::support::*;

/// One BlockStored, reduced to what the comparison looks at.
#[derive(Debug, Clone, PartialEq)]
struct Stored {
    /// Field names in wire order.
    keys: Vec<String>,
    group_idx: u64,
    kind: String,
    sliding_window: Option<u64>,
    hashes: Vec<u64>,
    parent: Option<u64>,
    token_ids: Vec<u64>,
    block_size: u64,
    /// `None` when the key is absent.
    extra_keys: Option<usize>,
}

/// A JSON object with its keys in document order (serde_json's map sorts them).
struct Ordered(Vec<(String, Value)>);

impl<'de> Deserialize<'de> for Ordered {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Entries;
        impl<'de> Visitor<'de> for Entries {
            type Value = Ordered;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Ordered, A::Error> {
                let mut entries = Vec::new();
                while let Some(e) = m.next_entry()? {
                    entries.push(e);
                }
                Ok(Ordered(entries))
            }
        }
        d.deserialize_map(Entries)
    }
}

/// One decoded ZMQ message of the capture: its payload `[ts, events, data_parallel_rank]`.
#[derive(serde::Deserialize)]
struct Message {
    payload: (f64, Vec<Ordered>, u32),
}

fn fixture_batches() -> Vec<Vec<Stored>> {
    let path = format!(
        "{}/../fixtures/vllm-0.32-hybrid/gemma3-hybrid-decoded.jsonl",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    text.lines()
        .map(|line| {
            let msg: Message = serde_json::from_str(line).unwrap();
            assert_eq!(msg.payload.2, 0, "data_parallel_rank 0");
            msg.payload
                .1
                .iter()
                .map(|Ordered(entries)| {
                    let get = |name: &str| entries.iter().find(|(k, _)| k == name).map(|(_, v)| v);
                    let ints = |v: &Value| -> Vec<u64> {
                        v.as_array()
                            .unwrap()
                            .iter()
                            .map(|x| x.as_u64().unwrap())
                            .collect()
                    };
                    assert_eq!(get("type").unwrap(), "BlockStored");
                    Stored {
                        keys: entries.iter().map(|(k, _)| k.clone()).collect(),
                        group_idx: get("group_idx").unwrap().as_u64().unwrap(),
                        kind: get("kv_cache_spec_kind")
                            .unwrap()
                            .as_str()
                            .unwrap()
                            .to_owned(),
                        sliding_window: get("kv_cache_spec_sliding_window").and_then(Value::as_u64),
                        hashes: ints(get("block_hashes").unwrap()),
                        parent: get("parent_block_hash").unwrap().as_u64(),
                        token_ids: ints(get("token_ids").unwrap()),
                        block_size: get("block_size").unwrap().as_u64().unwrap(),
                        extra_keys: get("extra_keys").map(|k| k.as_array().unwrap().len()),
                    }
                })
                .collect()
        })
        .collect()
}

fn mock_stored(ev: &Mp) -> Stored {
    let map = ev.as_map().unwrap();
    let get = |name: &str| {
        map.iter()
            .find(|(k, _)| k.as_str() == Some(name))
            .map(|(_, v)| v)
    };
    let ints = |v: &Mp| -> Vec<u64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect()
    };
    assert_eq!(get("type").unwrap().as_str(), Some("BlockStored"));
    assert_eq!(get("medium").unwrap().as_str(), Some("GPU"));
    assert!(get("lora_name").unwrap().is_nil());
    Stored {
        keys: map
            .iter()
            .map(|(k, _)| k.as_str().unwrap().to_owned())
            .collect(),
        group_idx: get("group_idx").unwrap().as_u64().unwrap(),
        kind: get("kv_cache_spec_kind")
            .unwrap()
            .as_str()
            .unwrap()
            .to_owned(),
        sliding_window: get("kv_cache_spec_sliding_window").and_then(Mp::as_u64),
        hashes: ints(get("block_hashes").unwrap()),
        parent: get("parent_block_hash").unwrap().as_u64(),
        token_ids: ints(get("token_ids").unwrap()),
        block_size: get("block_size").unwrap().as_u64().unwrap(),
        extra_keys: get("extra_keys").map(|k| k.as_array().unwrap().len()),
    }
}

/// Block position of every hash the full-attention group (1) announced, in announcement order.
fn positions(batches: &[Vec<Stored>]) -> HashMap<u64, usize> {
    batches
        .iter()
        .flatten()
        .filter(|s| s.group_idx == 1)
        .flat_map(|s| s.hashes.iter().copied())
        .enumerate()
        .map(|(i, h)| (h, i))
        .collect()
}

/// What must match between vLLM and the mock: per batch, per group, the field names, kind and
/// window, the token range, which block positions are listed, the parent's position, the extra
/// keys' presence and length.
type Shape = (
    Vec<String>,
    u64,
    String,
    Option<u64>,
    usize,
    Vec<usize>,
    Option<usize>,
    Option<usize>,
);

fn shape(batches: &[Vec<Stored>]) -> Vec<Vec<Shape>> {
    let pos = positions(batches);
    batches
        .iter()
        .map(|batch| {
            batch
                .iter()
                .map(|s| {
                    (
                        s.keys.clone(),
                        s.group_idx,
                        s.kind.clone(),
                        s.sliding_window,
                        s.token_ids.len(),
                        s.hashes.iter().map(|h| pos[h]).collect(),
                        s.parent.map(|p| pos[&p]),
                        s.extra_keys,
                    )
                })
                .collect()
        })
        .collect()
}

#[tokio::test]
async fn gemma3_style_prefill_matches_the_vllm_capture() {
    let captured = fixture_batches();
    // Sanity: the capture reads as its README says.
    assert_eq!(captured.len(), 2);
    assert_eq!(captured[0][0].hashes.len(), 0);
    assert_eq!(captured[0][1].hashes.len(), 32);
    assert_eq!(captured[1][0].hashes.len(), 4);
    assert_eq!(captured[1][1].hashes.len(), 10);

    let h = start(Config {
        block_size: 64,
        kv_cache_layout: "sliding_window:256,full_attention".parse().unwrap(),
        max_num_batched_tokens: Some(2_048),
        kv_events: Some(KvEventsConfig {
            topic: "kv@A@tiny-llama".to_owned(),
            encoding: EventEncoding::Tagged,
            ..KvEventsConfig::default()
        }),
        ..test_config()
    })
    .await;
    // The captured prompt: the full blocks' tokens, then 13 more (not in any full block).
    let mut ids: Vec<u64> = captured[0][1].token_ids.clone();
    ids.extend(&captured[1][1].token_ids);
    ids.extend(100..113);
    assert_eq!(ids.len(), 2_701);
    let body = json!({"prompt": ids, "max_tokens": 1});
    assert_eq!(
        cached_of(h.http_addr(), "/v1/completions", body.clone()).await,
        (2_701, 0)
    );
    h.flush_events().await;
    let (frames, _) = replay(h.replay_endpoint().unwrap(), 0).await;
    let mock: Vec<Vec<Stored>> = frames
        .iter()
        .map(|f| {
            let batch = decode(&f.2);
            assert_eq!(batch.as_array().unwrap()[2].as_u64(), Some(0));
            events(&f.2).iter().map(mock_stored).collect()
        })
        .collect();

    assert_eq!(shape(&mock), shape(&captured));
    for (m, c) in mock.iter().flatten().zip(captured.iter().flatten()) {
        assert_eq!(m.token_ids, c.token_ids, "the same token range");
        assert_eq!(m.block_size, 64);
    }
    // A block's hash is the same in both groups; batch 2's parent is block 31 of batch 1.
    let full: Vec<u64> = mock
        .iter()
        .map(|b| b[1].hashes.clone())
        .collect::<Vec<_>>()
        .concat();
    assert_eq!(mock[1][0].hashes, full[38..42]);
    assert_eq!(mock[1][0].parent, Some(full[31]));
    assert_eq!(mock[1][1].parent, Some(full[31]));

    // Resent: the sliding tail serves the whole hit; nothing new is announced.
    assert_eq!(
        cached_of(h.http_addr(), "/v1/completions", body).await,
        (2_701, 2_688)
    );
    h.flush_events().await;
    assert_eq!(replay(h.replay_endpoint().unwrap(), 0).await.0.len(), 2);
}
