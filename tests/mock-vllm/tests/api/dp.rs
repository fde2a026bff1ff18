//! Data parallelism: several engine ranks behind one HTTP address, each with its own cache and
//! KV-event publisher; `x-data-parallel-rank` pins a request.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use mock_vllm::{
    Config, DP_RANK_HEADER, KvEventsConfig, LatencyConfig, RANK_HEADER, REPLICA_HEADER,
};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use zeromq::SubSocket;

use crate::support::*;

const TOPIC: &str = "kv@dp@mock-model";

fn dp_config(size: u32) -> Config {
    Config {
        data_parallel_size: size,
        kv_events: Some(KvEventsConfig {
            topic: TOPIC.into(),
            ..KvEventsConfig::default()
        }),
        ..test_config()
    }
}

async fn pinned(addr: SocketAddr, path: &str, rank: &str, body: Value) -> HttpResponse {
    request_with(addr, "POST", path, &[(DP_RANK_HEADER, rank)], Some(&body)).await
}

fn cached(r: &HttpResponse) -> u64 {
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

async fn tokens(addr: SocketAddr, prompt: &str) -> Vec<u32> {
    let r = post(addr, "/tokenize", json!({"prompt": prompt})).await;
    serde_json::from_value(r.json()["tokens"].clone()).unwrap()
}

/// The payload's rank (third element).
fn payload_rank(payload: &[u8]) -> u64 {
    decode(payload).as_array().unwrap()[2].as_u64().unwrap()
}

/// `token_ids` of every BlockStored in a payload.
fn stored_tokens(payload: &[u8]) -> Vec<Vec<u64>> {
    events(payload)
        .iter()
        .filter(|ev| event_type(ev) == "BlockStored")
        .map(|ev| {
            let ids = field(ev, "token_ids").as_array().unwrap();
            ids.iter().map(|t| t.as_u64().unwrap()).collect()
        })
        .collect()
}

/// Like `first_live_batch`, with every warm-up request pinned to `rank`.
async fn first_live_batch_on(sub: &mut SubSocket, http: SocketAddr, rank: &str) -> Vec<Bytes> {
    for i in 0..50 {
        let body = json!({"prompt": text(&format!("warm{i}-"), 20), "max_tokens": 1});
        let r = pinned(http, "/v1/completions", rank, body).await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header(RANK_HEADER), Some(rank));
        if let Some(f) = recv_live(sub, Duration::from_millis(200)).await {
            return f;
        }
    }
    panic!("no live batch arrived on rank {rank}");
}

#[tokio::test]
async fn a_pinned_request_caches_and_publishes_only_on_its_rank() {
    let h = start(dp_config(2)).await;
    let a = h.http_addr();
    let pubs = h.events_endpoints();
    let replays = h.replay_endpoints();
    assert_eq!(h.ranks(), [0, 1]);
    assert_eq!(pubs.iter().map(|(r, _)| *r).collect::<Vec<_>>(), [0, 1]);
    assert_eq!(replays.iter().map(|(r, _)| *r).collect::<Vec<_>>(), [0, 1]);
    assert_ne!(pubs[0].1, pubs[1].1, "each rank binds its own port");
    assert_ne!(replays[0].1, replays[1].1);
    assert_eq!(h.events_endpoint(), Some(pubs[0].1.as_str()));
    assert_eq!(h.replay_endpoint(), Some(replays[0].1.as_str()));
    let line = serde_json::to_value(h.addresses()).unwrap();
    assert_eq!(line["data_parallel_size"], 2);
    assert_eq!(line["kv_events"], pubs[0].1);
    assert_eq!(line["ranks"][1]["rank"], 1);
    assert_eq!(line["ranks"][1]["kv_events"], pubs[1].1);
    assert_eq!(line["ranks"][1]["replay"], replays[1].1);

    // Live: rank 1's PUB carries rank 1's batches, with 1 as the payload's rank.
    let mut sub = subscriber(&pubs[1].1).await;
    let first = first_live_batch_on(&mut sub, a, "1").await;
    assert_eq!(
        first[0].as_ref(),
        TOPIC.as_bytes(),
        "same topic on every rank"
    );
    assert_eq!(payload_rank(&first[2]), 1);

    let prompt = text("dp", 80);
    let ids = tokens(a, &prompt).await;
    let full = ids.len() / BS * BS;
    let body = json!({"prompt": prompt, "max_tokens": 1});
    let r = pinned(a, "/v1/completions", "1", body.clone()).await;
    assert_eq!(r.header(RANK_HEADER), Some("1"));
    assert_eq!(cached(&r), 0);
    assert_eq!(
        h.cached_prefix_tokens_on_rank(1, None, None, &ids),
        Some(full)
    );
    assert_eq!(h.cached_prefix_tokens_on_rank(0, None, None, &ids), Some(0));
    assert_eq!(
        h.cached_prefix_tokens(None, None, &ids),
        0,
        "rank 0's oracle"
    );
    assert_eq!(h.cached_prefix_tokens_on_rank(2, None, None, &ids), None);

    let want: Vec<u64> = ids[..full].iter().map(|&t| u64::from(t)).collect();
    let live = loop {
        let f = recv_live(&mut sub, STEP).await.expect("the prompt's batch");
        if stored_tokens(&f[2]).contains(&want) {
            break f;
        }
    };
    assert_eq!(live[0].as_ref(), TOPIC.as_bytes());
    assert_eq!(payload_rank(&live[2]), 1);
    h.flush_events().await;
    let (on1, _) = replay(&replays[1].1, 0).await;
    assert!(on1.iter().all(|(_, _, p)| payload_rank(p) == 1));
    assert!(on1.iter().any(|(_, _, p)| stored_tokens(p).contains(&want)));
    let (on0, _) = replay(&replays[0].1, 0).await;
    assert!(
        on0.is_empty(),
        "rank 0 stored nothing: {} batches",
        on0.len()
    );

    // The same prompt on rank 0 hits nothing; back on rank 1 it hits.
    let r = pinned(a, "/v1/completions", "0", body.clone()).await;
    assert_eq!(r.header(RANK_HEADER), Some("0"));
    assert_eq!(cached(&r), 0);
    let r = pinned(a, "/v1/completions", "1", body).await;
    assert_eq!(cached(&r) as usize, hit(ids.len()));
    h.flush_events().await;
    let (on0, _) = replay(&replays[0].1, 0).await;
    assert_eq!(on0.len(), 1);
    assert_eq!(payload_rank(&on0[0].2), 0);
}

/// Sends a request and reads until its first SSE `data:` line; the connection stays open.
async fn open_stream(addr: SocketAddr, path: &str, body: &Value) -> (TcpStream, String) {
    tokio::time::timeout(STEP, async {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let req = raw_request(addr, "POST", path, &[], Some(body));
        stream.write_all(req.as_bytes()).await.unwrap();
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&seen).contains("data:") {
            let n = stream.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&seen));
            seen.extend_from_slice(&buf[..n]);
        }
        (stream, String::from_utf8_lossy(&seen).into_owned())
    })
    .await
    .expect("first SSE event")
}

#[tokio::test]
async fn unpinned_requests_go_to_the_least_loaded_rank_and_metrics_show_both() {
    let mut config = dp_config(2);
    // No prefill time; the second token of any request is ten minutes away.
    config.latency = LatencyConfig {
        base_ms: 0.0,
        prefill_ms_per_token: 0.0,
        decode_ms_per_token: 600_000.0,
        time_scale: 1.0,
    };
    let h = start(config).await;
    let a = h.http_addr();
    // A holds rank 0 (the lowest of two idle ranks) until its stream is dropped.
    let held = json!({"prompt": text("hold", 20), "max_tokens": 2, "stream": true});
    let (stream, head) = open_stream(a, "/v1/completions", &held).await;
    assert!(head.contains(&format!("{RANK_HEADER}: 0")), "{head}");
    // One-token requests finish at once; each finds rank 1 the least loaded.
    for tag in ["b", "c"] {
        let body = json!({"prompt": text(tag, 20), "max_tokens": 1});
        let r = post(a, "/v1/completions", body).await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header(RANK_HEADER), Some("1"), "{tag}");
    }
    // A pin wins over the load.
    let body = json!({"prompt": text("d", 20), "max_tokens": 1});
    let r = pinned(
        a,
        "/v1/chat/completions",
        "0",
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    )
    .await;
    assert_eq!(r.header(RANK_HEADER), Some("0"));
    let r = pinned(a, "/v1/completions", "0", body).await;
    assert_eq!(r.header(RANK_HEADER), Some("0"));

    let m = get(a, "/metrics").await.text();
    for series in [
        "vllm:num_requests_running{engine=\"0\",model_name=\"mock-model\"} 1.0",
        "vllm:num_requests_running{engine=\"1\",model_name=\"mock-model\"} 0.0",
        "vllm:num_requests_waiting{engine=\"1\",model_name=\"mock-model\"} 0.0",
        "vllm:request_success_total{engine=\"0\",model_name=\"mock-model\",finished_reason=\"length\"} 2.0",
        "vllm:request_success_total{engine=\"1\",model_name=\"mock-model\",finished_reason=\"length\"} 2.0",
        "vllm:cache_config_info{engine=\"1\",",
        "vllm:kv_cache_usage_perc{engine=\"1\",",
    ] {
        assert!(m.contains(series), "{series} missing:\n{m}");
    }
    assert_eq!(
        m.matches("# TYPE vllm:num_requests_running gauge").count(),
        1
    );
    let st = get(h.admin_addr(), "/admin/state").await.json();
    assert_eq!(st["data_parallel_size"], 2);
    assert_eq!(st["ranks"][0]["running"], 1);
    assert_eq!(st["ranks"][1]["running"], 0);
    drop(stream);
}

#[tokio::test]
async fn bad_rank_headers_are_400() {
    let h = start(dp_config(2)).await;
    let a = h.http_addr();
    let completion = json!({"prompt": "hello", "max_tokens": 1});
    for (value, message) in [
        ("2", "data_parallel_rank 2 is out of range [0, 2)."),
        ("-1", "data_parallel_rank -1 is out of range [0, 2)."),
    ] {
        let r = pinned(a, "/v1/completions", value, completion.clone()).await;
        assert_eq!(r.status, 400, "{value}");
        assert_eq!(r.json()["error"]["message"], message);
        assert_eq!(r.json()["error"]["type"], "BadRequestError");
        assert_eq!(r.header(RANK_HEADER), Some("0"));
        assert!(r.header(REPLICA_HEADER).is_some());
    }
    for (path, body) in [
        ("/v1/completions", completion.clone()),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}]}),
        ),
        ("/v1/responses", json!({"input": "hi"})),
    ] {
        let r = pinned(a, path, "one", body).await;
        assert_eq!(r.status, 400, "{path}");
        let msg = r.json()["error"]["message"].as_str().unwrap().to_owned();
        assert!(msg.contains(DP_RANK_HEADER), "{msg}");
    }
    // A single-rank server takes only index 0, as vLLM.
    let one = start(test_config()).await;
    let r = pinned(one.http_addr(), "/v1/completions", "0", completion.clone()).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header(RANK_HEADER), Some("0"));
    let r = pinned(one.http_addr(), "/v1/completions", "1", completion).await;
    assert_eq!(r.status, 400);
    assert_eq!(
        r.json()["error"]["message"],
        "data_parallel_rank 1 is out of range [0, 1)."
    );
}

#[tokio::test]
async fn admin_faults_take_a_rank_or_apply_to_all() {
    let h = start(dp_config(2)).await;
    let (a, admin) = (h.http_addr(), h.admin_addr());
    let st = post(admin, "/admin/events/pause?rank=1", json!({}))
        .await
        .json();
    assert_eq!(st["ranks"][0]["events"]["paused"], false);
    assert_eq!(st["ranks"][1]["events"]["paused"], true);
    let st = post(admin, "/admin/events/resume", Value::Null)
        .await
        .json();
    assert_eq!(st["ranks"][1]["events"]["paused"], false);

    let prompt = text("adm", 40);
    let ids = tokens(a, &prompt).await;
    let full = ids.len() / BS * BS;
    let r = pinned(
        a,
        "/v1/completions",
        "1",
        json!({"prompt": prompt, "max_tokens": 1}),
    )
    .await;
    assert_eq!(r.status, 200);
    let other = json!({"prompt": text("zero", 40), "max_tokens": 1});
    assert_eq!(pinned(a, "/v1/completions", "0", other).await.status, 200);
    let probe = |body: Value, query: &'static str| async move {
        post(admin, &format!("/admin/probe{query}"), body).await
    };
    let p = probe(json!({"token_ids": ids, "rank": 1}), "").await.json();
    assert_eq!(
        (p["rank"].as_u64(), p["cached_tokens"].as_u64()),
        (Some(1), Some(full as u64))
    );
    let p = probe(json!({"token_ids": ids}), "?rank=1").await.json();
    assert_eq!(p["cached_tokens"], full);
    let p = probe(json!({"token_ids": ids}), "").await.json();
    assert_eq!(
        (p["rank"].as_u64(), p["cached_tokens"].as_u64()),
        (Some(0), Some(0)),
        "default: rank 0"
    );
    assert_eq!(
        probe(json!({"token_ids": ids, "rank": 5}), "").await.status,
        400
    );
    assert_eq!(
        probe(json!({"token_ids": ids, "rank": 1}), "?rank=0")
            .await
            .status,
        400
    );

    h.flush_events().await;
    let st = post(admin, "/admin/restart?rank=1", json!({})).await.json();
    assert_eq!(st["ranks"][1]["cached_blocks"], 0);
    assert_eq!(st["ranks"][1]["events"]["next_seq"], 0);
    assert!(st["ranks"][0]["cached_blocks"].as_u64().unwrap() > 0);
    assert!(st["ranks"][0]["events"]["next_seq"].as_u64().unwrap() > 0);
    let st = post(admin, "/admin/reset_prefix_cache", json!({}))
        .await
        .json();
    assert_eq!(st["ranks"][0]["cached_blocks"], 0);

    let st = post(
        admin,
        "/admin/events/drop",
        json!({"batches": 2, "rank": 0}),
    )
    .await
    .json();
    assert_eq!(st["ranks"][0]["events"]["pending_drops"], 2);
    assert_eq!(st["ranks"][1]["events"]["pending_drops"], 0);
    let st = post(admin, "/admin/events/delay?rank=1", json!({"ms": 5}))
        .await
        .json();
    assert_eq!(st["ranks"][0]["events"]["delay_ms"], 0);
    assert_eq!(st["ranks"][1]["events"]["delay_ms"], 5);
    let r = post(admin, "/admin/events/delay", json!({"ms": 0, "rank": 9})).await;
    assert_eq!(r.status, 400);
    assert!(r.text().contains("ranks: [0, 1]"), "{}", r.text());
    assert_eq!(
        post(admin, "/admin/restart?rank=x", json!({})).await.status,
        400
    );
}

#[tokio::test]
async fn a_single_rank_server_keeps_its_rank() {
    let h = start(Config {
        kv_events: Some(KvEventsConfig {
            data_parallel_rank: 2,
            ..KvEventsConfig::default()
        }),
        ..test_config()
    })
    .await;
    let a = h.http_addr();
    assert_eq!(h.ranks(), [2]);
    assert_eq!(h.events_endpoints()[0].0, 2);
    // vLLM checks the header against the local engines: index 0 is this server's only rank.
    let body = json!({"prompt": text("s", 30), "max_tokens": 1});
    let r = pinned(a, "/v1/completions", "0", body).await;
    assert_eq!(r.header(RANK_HEADER), Some("2"));
    h.flush_events().await;
    let (got, _) = replay(h.replay_endpoint().unwrap(), 0).await;
    assert_eq!(payload_rank(&got[0].2), 2);
    let m = get(a, "/metrics").await.text();
    assert!(m.contains("vllm:prompt_tokens_total{engine=\"2\","), "{m}");
    let p = post(
        h.admin_addr(),
        "/admin/probe",
        json!({"token_ids": [1, 2], "rank": 2}),
    )
    .await;
    assert_eq!(p.status, 200);
}
