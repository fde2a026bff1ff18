//! Hybrid models over the wire: real vLLM 0.32 events of the tier's tiny
//! Gemma-3-style and Llama-4-style models (`tests/fixtures/
//! vllm-0.32-hybrid-real/`) published over ZMQ to an in-process indexd; its
//! Picks, `/metrics` and `/readyz` say what it made of them.

use kvroute_proto::keys::{BlockSize, block_keys};
use kvroute_proto::v1::{DecisionKind, Mode, PickRequest, PickResponse};

use crate::harness::{Daemon, Publisher, endpoint, eventually, gauge, raw, sync_live};

const HYBRID: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tests/fixtures/vllm-0.32-hybrid-real/"
);

/// A capture's payloads in seq order, with the step each belongs to.
fn payloads(dir: &str) -> Vec<(String, Vec<u8>)> {
    let dir = format!("{HYBRID}{dir}");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".f2_payload.msgpack"))
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|n| {
            let step = n.split('_').nth(1).unwrap().to_owned();
            (step, std::fs::read(format!("{dir}/{n}")).unwrap())
        })
        .collect()
}

/// A request of the capture: its prompt's token ids and vLLM's hit.
fn request(dir: &str, step: &str) -> (Vec<u32>, u32, u32) {
    let text = std::fs::read_to_string(format!("{HYBRID}{dir}/requests.jsonl")).unwrap();
    let v: serde_json::Value = text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|v| v["step"] == step)
        .unwrap();
    let tokens = v["prompt_token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    (
        tokens,
        v["prompt_tokens"].as_u64().unwrap() as u32,
        v["cached_tokens"].as_u64().unwrap() as u32,
    )
}

/// A precise Pick of a captured request's prompt.
async fn pick_prompt(d: &mut Daemon, tokens: &[u32], prompt_tokens: u32) -> PickResponse {
    let keys = raw(&block_keys(tokens, BlockSize::new(64).unwrap(), None));
    d.pick_req(PickRequest {
        model: "m".into(),
        block_keys: keys,
        block_size: 64,
        prompt_tokens,
        mode: Mode::Precise as i32,
        key_scheme: kvroute_proto::SCHEME_VERSION.into(),
        ..PickRequest::default()
    })
    .await
}

/// Publishes a capture's messages up to (not including) `until`'s.
async fn publish_until(d: &Daemon, p: &mut Publisher, port: u16, dir: &str, until: &str) {
    let mut seq = sync_live(d, p, port, 0).await;
    for (step, payload) in payloads(dir) {
        if step == until {
            break;
        }
        let before = d.counter("indexd_batches_total");
        p.publish(seq, &payload).await;
        seq += 1;
        eventually("the batch applied", || async {
            d.counter("indexd_batches_total") > before
        })
        .await;
    }
}

async fn text(d: &Daemon, path: &str) -> String {
    String::from_utf8(d.http_get(path).await.unwrap()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sliding_window_fleet_is_indexed_and_its_hits_are_vllms() {
    let dir = "gemma3/session";
    let mut p = Publisher::start(false).await;
    let mut d = Daemon::start(vec![endpoint(18210, Some(&p))], 64).await;
    // Conversation C's first turn: A and B came before it, B leaving the
    // sliding tail at the end of the system prompt both share.
    publish_until(&d, &mut p, 18210, dir, "c1").await;
    let (tokens, prompt_tokens, cached) = request(dir, "c1");
    let r = pick_prompt(&mut d, &tokens, prompt_tokens).await;
    assert_eq!(r.decision, DecisionKind::Precise as i32, "{r:?}");
    assert_eq!(r.candidates[0].matched_tokens, cached);
    assert_eq!(cached, 2944);

    let page = text(&d, "/metrics").await;
    assert!(gauge(&page, "indexd_index_entries").unwrap() > 0.0);
    assert_eq!(
        gauge(
            &page,
            "indexd_replica_kv_groups{endpoint=\"127.0.0.1:18210\",model=\"m\"}"
        ),
        Some(2.0)
    );
    for outcome in ["skipped_group", "skipped_bad_length", "parked_dropped"] {
        assert_eq!(
            d.counter(&format!("indexd_blocks_total{{outcome=\"{outcome}\"}}")),
            0.0,
            "{outcome}"
        );
    }
    assert_eq!(
        d.counter("indexd_blocks_total{outcome=\"parked\"}"),
        d.counter("indexd_blocks_total{outcome=\"unparked\"}")
    );
    assert!(d.counter("indexd_blocks_total{outcome=\"parked\"}") > 0.0);
    let ready = text(&d, "/readyz").await;
    assert!(
        ready.contains(
            "kv groups 127.0.0.1:18210: 0:sliding_window/256@64 1:full_attention@64 (modelled)"
        ),
        "{ready}"
    );
    assert!(!page.contains("indexd_unmodelled_kv_groups{"), "{page}");
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layout_not_modelled_is_reported_and_never_precise() {
    let dir = "llama4/session";
    // Without the chunk of its chunked local attention: reported, and its
    // Picks are approximate.
    let mut p = Publisher::start(false).await;
    let mut d = Daemon::start(vec![endpoint(18211, Some(&p))], 64).await;
    publish_until(&d, &mut p, 18211, dir, "b1").await;
    let (tokens, prompt_tokens, cached) = request(dir, "b1");
    let r = pick_prompt(&mut d, &tokens, prompt_tokens).await;
    assert_eq!(
        (r.decision, r.reason.as_str()),
        (DecisionKind::Approximate as i32, "unmodelled_kv_layout"),
        "{r:?}"
    );
    assert!(r.candidates[0].matched_tokens >= cached);
    let page = text(&d, "/metrics").await;
    assert_eq!(
        gauge(
            &page,
            "indexd_unmodelled_kv_groups{model=\"m\",kind=\"chunked_local_attention\"}"
        ),
        Some(1.0)
    );
    let ready = text(&d, "/readyz").await;
    assert!(
        ready.contains("group 0 chunked_local_attention not modelled: chunk_size_unknown"),
        "{ready}"
    );
    d.stop().await;

    // With it (the tier's model: chunks of 1,024 tokens): precise, vLLM's hit.
    let mut p = Publisher::start(false).await;
    let mut d = Daemon::start_with(vec![endpoint(18212, Some(&p))], 64, |c| {
        c.attention_chunk_size.insert("m".into(), 1024);
    })
    .await;
    publish_until(&d, &mut p, 18212, dir, "b1").await;
    let r = pick_prompt(&mut d, &tokens, prompt_tokens).await;
    assert_eq!(r.decision, DecisionKind::Precise as i32, "{r:?}");
    assert_eq!(r.candidates[0].matched_tokens, cached);
    let page = text(&d, "/metrics").await;
    assert!(!page.contains("indexd_unmodelled_kv_groups{"), "{page}");
    d.stop().await;
}
