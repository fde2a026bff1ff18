//! KV events on the wire: decoded next to the captured vLLM 0.32 frames; replay.

use std::collections::BTreeSet;

use mock_vllm::{Config, EventEncoding, HashForm, KvEventsConfig};
use rmpv::Value as Mp;
use serde_json::json;

use crate::support::*;

/// The type shape of a msgpack value: what a decoder sees, not the values.
fn shape(v: &Mp) -> String {
    match v {
        Mp::Nil => "nil".into(),
        Mp::Boolean(_) => "bool".into(),
        Mp::Integer(_) => "int".into(),
        Mp::F32(_) | Mp::F64(_) => "float".into(),
        Mp::String(_) => "str".into(),
        Mp::Binary(b) => format!("bin{}", b.len()),
        Mp::Array(items) => {
            let kinds: BTreeSet<String> = items.iter().map(shape).collect();
            format!("[{}]", kinds.into_iter().collect::<Vec<_>>().join("|"))
        }
        Mp::Map(entries) => {
            let fields: Vec<String> = entries
                .iter()
                .map(|(k, v)| format!("{}:{}", k.as_str().unwrap_or("?"), shape(v)))
                .collect();
            format!("{{{}}}", fields.join(","))
        }
        Mp::Ext(..) => "ext".into(),
    }
}

/// Field names and shapes of a tagged event, or of a legacy array read with `names`.
fn fields_of(ev: &Mp, names: &[String]) -> Vec<(String, String)> {
    match ev {
        Mp::Map(entries) => entries
            .iter()
            .map(|(k, v)| (k.as_str().unwrap().to_owned(), shape(v)))
            .collect(),
        Mp::Array(items) => {
            assert_eq!(items.len(), names.len(), "legacy arity");
            names.iter().cloned().zip(items.iter().map(shape)).collect()
        }
        other => panic!("event is neither map nor array: {other:?}"),
    }
}

fn fixture_events(name: &str) -> Vec<Mp> {
    let payload = fixture(&format!("{name}.f2_payload.msgpack"));
    let batch = decode(&payload);
    let b = batch.as_array().unwrap();
    assert_eq!(shape(&b[0]), "float");
    assert_eq!(shape(&b[2]), "int");
    b[1].as_array().unwrap().clone()
}

fn tag_of(ev: &Mp) -> String {
    match ev {
        Mp::Map(_) => event_type(ev),
        Mp::Array(a) => a[0].as_str().unwrap().to_owned(),
        _ => panic!("bad event"),
    }
}

/// Drives a replica through: cold store, decode-filled store (with parent), salted store,
/// evictions, reset. Returns every batch payload from replay.
async fn scripted_events(ev: KvEventsConfig) -> Vec<Mp> {
    let h = start(Config {
        max_model_len: 256,
        num_gpu_blocks: 16,
        kv_events: Some(ev),
        ..test_config()
    })
    .await;
    let a = h.http_addr();
    for (prompt, salt) in [("a", None), ("b", Some("A")), ("c", None), ("d", None)] {
        let mut body = json!({"prompt": text(prompt, 40), "max_tokens": 40});
        if let Some(s) = salt {
            body["cache_salt"] = json!(s);
        }
        assert_eq!(post(a, "/v1/completions", body).await.status, 200);
    }
    assert_eq!(
        post(h.admin_addr(), "/admin/reset_prefix_cache", json!({}))
            .await
            .status,
        200
    );
    h.flush_events().await;
    let (batches, _) = replay(h.replay_endpoint().unwrap(), 0).await;
    for (i, b) in batches.iter().enumerate() {
        assert_eq!(seq(b), i as u64, "seq counts from 0 without gaps");
        assert_eq!(b.0.as_ref(), b"kv@test@model");
    }
    let values: Vec<Mp> = batches.iter().map(|b| decode(&b.2)).collect();
    let last = values.last().expect("batches");
    let last_events = last.as_array().unwrap()[1].as_array().unwrap();
    assert_eq!(
        tag_of(&last_events[0]),
        "AllBlocksCleared",
        "reset comes last"
    );
    values
}

fn names_from_fixture(ev: &Mp) -> Vec<String> {
    fields_of(ev, &[]).into_iter().map(|(k, _)| k).collect()
}

/// Finds a mock event of the same kind as the fixture event and compares names and shapes.
fn assert_same_shape(mock_batches: &[Mp], fixture: &Mp, pick: impl Fn(&Mp) -> bool, what: &str) {
    let names = names_from_fixture(fixture);
    let want = fields_of(fixture, &names);
    let tag = event_type(fixture);
    let mock: Vec<&Mp> = mock_batches
        .iter()
        .flat_map(|b| b.as_array().unwrap()[1].as_array().unwrap().iter())
        .filter(|e| tag_of(e) == tag && pick(e))
        .collect();
    assert!(!mock.is_empty(), "{what}: the mock produced no such event");
    let got = match mock[0] {
        Mp::Array(items) => {
            assert_eq!(items[0].as_str(), Some(tag.as_str()), "legacy tag first");
            fields_of(&Mp::Array(items[1..].to_vec()), &names[1..])
        }
        m => fields_of(m, &names),
    };
    let want = if matches!(mock[0], Mp::Array(_)) {
        want[1..].to_vec()
    } else {
        want
    };
    assert_eq!(got, want, "{what}");
}

fn legacy_or_map_field<'a>(ev: &'a Mp, name: &str, index: usize) -> &'a Mp {
    match ev {
        Mp::Map(_) => field(ev, name),
        Mp::Array(a) => &a[index],
        _ => panic!(),
    }
}

fn check_against_fixtures(batches: &[Mp], bytes: bool) {
    for b in batches {
        let arr = b.as_array().unwrap();
        assert_eq!(arr.len(), 3);
        assert_eq!(shape(&arr[0]), "float");
        assert_eq!(
            arr[2].as_u64(),
            Some(0),
            "data_parallel_rank 0 as in the captures"
        );
    }
    let parent = |e: &Mp| legacy_or_map_field(e, "parent_block_hash", 2).is_nil();
    let salted = |e: &Mp| !legacy_or_map_field(e, "extra_keys", 8).as_array().unwrap()[0].is_nil();
    let n_blocks = |e: &Mp| {
        legacy_or_map_field(e, "block_hashes", 1)
            .as_array()
            .unwrap()
            .len()
    };
    if bytes {
        let fx = &fixture_events("blockstored_2blk_bs128_byteshashes_emptytopic")[0];
        assert_same_shape(
            batches,
            fx,
            |e| parent(e) && !salted(e) && n_blocks(e) > 1,
            "bytes hashes",
        );
        return;
    }
    let fx = &fixture_events("blockstored_1blk_bs32_noparent")[0];
    assert_same_shape(
        batches,
        fx,
        |e| parent(e) && !salted(e),
        "stored, no parent",
    );
    let fx = &fixture_events("blockstored_1blk_bs32_withparent")[0];
    assert_same_shape(batches, fx, |e| !parent(e), "stored, with parent");
    let fx = &fixture_events("blockstored_8blk_bs64_salt_A")[0];
    assert_same_shape(
        batches,
        fx,
        |e| parent(e) && salted(e) && n_blocks(e) > 1,
        "salted",
    );
    let fx = &fixture_events("blockremoved_x7_then_blockstored_53blk")[0];
    assert_same_shape(batches, fx, |_| true, "removed");
    let fx = &fixture_events("allblockscleared_then_blockstored_salted")[0];
    assert_same_shape(batches, fx, |_| true, "cleared");
}

#[tokio::test]
async fn captured_and_mock_frames_decode_alike() {
    let base = KvEventsConfig {
        topic: "kv@test@model".to_owned(),
        ..KvEventsConfig::default()
    };
    // Sanity: the fixtures decode the way this test reads them.
    let fx = fixture_events("blockremoved_x7_then_blockstored_53blk");
    assert_eq!(
        fx.iter()
            .filter(|e| event_type(e) == "BlockRemoved")
            .count(),
        7
    );
    assert_eq!(
        fixture("blockstored_1blk_bs32_noparent.f0_topic.bin"),
        b"kv@test@model"
    );
    assert_eq!(
        fixture("blockstored_1blk_bs32_noparent.f1_seq.bin").len(),
        8
    );

    let tagged = scripted_events(base.clone()).await;
    check_against_fixtures(&tagged, false);
    let legacy = scripted_events(KvEventsConfig {
        encoding: EventEncoding::Legacy,
        ..base.clone()
    })
    .await;
    check_against_fixtures(&legacy, false);
    for hash_encoding in [EventEncoding::Tagged, EventEncoding::Legacy] {
        let bytes = scripted_events(KvEventsConfig {
            hash_form: HashForm::Bytes,
            encoding: hash_encoding,
            ..base.clone()
        })
        .await;
        check_against_fixtures(&bytes, true);
    }
}

#[tokio::test]
async fn salted_block_zero_carries_the_salt_and_removals_are_tail_first() {
    let batches = scripted_events(KvEventsConfig {
        topic: "kv@test@model".to_owned(),
        ..KvEventsConfig::default()
    })
    .await;
    let all: Vec<Vec<Mp>> = batches
        .iter()
        .map(|b| b.as_array().unwrap()[1].as_array().unwrap().clone())
        .collect();
    // Salted store: block 0's extra keys are ["A"], the others nil.
    let salted = all
        .iter()
        .flatten()
        .find(|e| {
            event_type(e) == "BlockStored"
                && !field(e, "extra_keys").as_array().unwrap()[0].is_nil()
        })
        .expect("a salted store");
    let keys = field(salted, "extra_keys").as_array().unwrap();
    assert_eq!(keys[0], Mp::Array(vec![Mp::from("A")]));
    assert!(keys[1..].iter().all(Mp::is_nil));
    assert!(field(salted, "parent_block_hash").is_nil());
    let ids = field(salted, "token_ids").as_array().unwrap();
    assert_eq!(ids.len(), keys.len() * BS);
    assert_eq!(ids[0].as_u64(), Some(1), "BOS first");

    // Evictions: BlockRemoved events come first in the batch of the step that took the blocks
    // (a prefill step's, with its stores; a decode step's that only starts a block, alone), one
    // hash each, tail first (the reverse of the order the evicted blocks were stored in).
    let stored_order: Vec<u64> = all
        .iter()
        .flatten()
        .filter(|e| event_type(e) == "BlockStored")
        .flat_map(|e| {
            field(e, "block_hashes")
                .as_array()
                .unwrap()
                .iter()
                .map(|h| h.as_u64().unwrap())
        })
        .collect();
    let evicting: Vec<&Vec<Mp>> = all
        .iter()
        .filter(|b| b.iter().any(|e| event_type(e) == "BlockRemoved"))
        .collect();
    assert!(!evicting.is_empty(), "an eviction batch");
    let mut removed = Vec::new();
    for batch in &evicting {
        let n = batch
            .iter()
            .take_while(|e| event_type(e) == "BlockRemoved")
            .count();
        assert!(
            batch[n..].iter().all(|e| event_type(e) == "BlockStored"),
            "removals come first"
        );
        for e in &batch[..n] {
            let hs = field(e, "block_hashes").as_array().unwrap();
            assert_eq!(hs.len(), 1);
            removed.push(hs[0].as_u64().unwrap());
        }
    }
    assert!(removed.len() >= 2);
    let pos: Vec<usize> = removed
        .iter()
        .map(|h| {
            stored_order
                .iter()
                .position(|s| s == h)
                .expect("removed a stored block")
        })
        .collect();
    assert!(pos.windows(2).all(|w| w[0] > w[1]), "tail first: {pos:?}");
}

#[tokio::test]
async fn lora_events_carry_the_adapter() {
    let h = start(Config {
        lora_modules: vec!["sql".into()],
        ..test_config()
    })
    .await;
    let r = post(
        h.http_addr(),
        "/v1/completions",
        json!({"model": "sql", "prompt": text("q", 40), "cache_salt": "t"}),
    )
    .await;
    assert_eq!(r.status, 200);
    h.flush_events().await;
    let (batches, _) = replay(h.replay_endpoint().unwrap(), 0).await;
    let ev = &events(&batches[0].2)[0];
    assert_eq!(field(ev, "lora_name").as_str(), Some("sql"));
    assert_eq!(field(ev, "lora_id").as_u64(), Some(1));
    let keys = field(ev, "extra_keys").as_array().unwrap();
    assert_eq!(keys[0], Mp::Array(vec![Mp::from("sql"), Mp::from("t")]));
    assert_eq!(keys[1], Mp::Array(vec![Mp::from("sql")]));
}

#[tokio::test]
async fn replay_returns_requested_batches_then_end_marker() {
    let h = start(Config {
        kv_events: Some(KvEventsConfig {
            topic: "kv@test@model".into(),
            ..KvEventsConfig::default()
        }),
        ..test_config()
    })
    .await;
    for p in ["a", "b", "c"] {
        let body = json!({"prompt": text(p, 30), "max_tokens": 1});
        assert_eq!(
            post(h.http_addr(), "/v1/completions", body).await.status,
            200
        );
    }
    let ep = h.replay_endpoint().unwrap();
    h.flush_events().await;
    let (all, _) = replay(ep, 0).await;
    assert_eq!(all.iter().map(seq).collect::<Vec<_>>(), [0, 1, 2]);
    let (from1, end) = replay(ep, 1).await;
    assert_eq!(from1.iter().map(seq).collect::<Vec<_>>(), [1, 2]);
    assert_eq!(
        from1[0].2, all[1].2,
        "replayed payload is the published one"
    );
    assert_eq!(from1[0].0.as_ref(), b"kv@test@model");
    // End marker: ["", "", ff×8, ""], the captured frames after the delimiter.
    assert!(end[0].is_empty());
    assert_eq!(
        end[1].as_ref(),
        fixture("replay_end_marker.f0.bin").as_slice()
    );
    assert_eq!(
        end[2].as_ref(),
        fixture("replay_end_marker.f1.bin").as_slice()
    );
    assert_eq!(
        end[3].as_ref(),
        fixture("replay_end_marker.f2.bin").as_slice()
    );
    let (none, _) = replay(ep, 99).await;
    assert!(none.is_empty());
}

#[tokio::test]
async fn replay_buffer_is_bounded() {
    let h = start(Config {
        kv_events: Some(KvEventsConfig {
            buffer_steps: 2,
            ..KvEventsConfig::default()
        }),
        ..test_config()
    })
    .await;
    for p in ["a", "b", "c", "d"] {
        let body = json!({"prompt": text(p, 30), "max_tokens": 1});
        post(h.http_addr(), "/v1/completions", body).await;
    }
    let ep = h.replay_endpoint().unwrap();
    h.flush_events().await;
    let seqs: Vec<u64> = replay(ep, 0).await.0.iter().map(seq).collect();
    assert_eq!(seqs, [2, 3]);
}
