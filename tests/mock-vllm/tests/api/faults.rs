//! Fault controls: dropped batches, pause, restart.

use std::time::Duration;

use mock_vllm::{Config, KvEventsConfig};
use serde_json::json;

use crate::support::*;

#[tokio::test]
async fn live_pub_frames_and_dropped_batches_leave_a_replayable_gap() {
    let h = start(Config {
        kv_events: Some(KvEventsConfig {
            topic: "kv@r1@mock-model".into(),
            ..KvEventsConfig::default()
        }),
        ..test_config()
    })
    .await;
    let a = h.http_addr();
    let mut sub = subscriber(h.events_endpoint().unwrap()).await;
    let first = first_live_batch(&mut sub, a).await;
    assert_eq!(first.len(), 3, "[topic, seq, payload]");
    assert_eq!(first[0].as_ref(), b"kv@r1@mock-model");
    let mut last_seq = u64::from_be_bytes(first[1].as_ref().try_into().unwrap());
    // Drain anything else already sent.
    h.flush_events().await;
    while let Some(f) = recv_live(&mut sub, Duration::from_millis(100)).await {
        last_seq = u64::from_be_bytes(f[1].as_ref().try_into().unwrap());
    }
    post(h.admin_addr(), "/admin/events/drop", json!({"batches": 1})).await;
    post(
        a,
        "/v1/completions",
        json!({"prompt": text("x", 20), "max_tokens": 1}),
    )
    .await;
    post(
        a,
        "/v1/completions",
        json!({"prompt": text("y", 20), "max_tokens": 1}),
    )
    .await;
    let next = recv_live(&mut sub, STEP)
        .await
        .expect("batch after the dropped one");
    let got = u64::from_be_bytes(next[1].as_ref().try_into().unwrap());
    assert_eq!(got, last_seq + 2, "one seq skipped");
    let (replayed, _) = replay(h.replay_endpoint().unwrap(), last_seq + 1).await;
    assert_eq!(
        seq(&replayed[0]),
        last_seq + 1,
        "the dropped batch is replayable"
    );
    let ev = &events(&replayed[0].2)[0];
    assert_eq!(event_type(ev), "BlockStored");
}

#[tokio::test]
async fn pub_connect_mode_reaches_a_binding_subscriber() {
    use zeromq::Socket;
    let mut sub = zeromq::SubSocket::new();
    let bound = sub.bind("tcp://127.0.0.1:0").await.unwrap();
    sub.subscribe("").await.unwrap();
    let h = start(Config {
        kv_events: Some(KvEventsConfig {
            endpoint: mock_vllm::EventsEndpoint::Connect(bound.to_string()),
            topic: "kv@c@m".into(),
            ..KvEventsConfig::default()
        }),
        ..test_config()
    })
    .await;
    assert_eq!(h.addresses().kv_events_mode, Some("connect"));
    let first = first_live_batch(&mut sub, h.http_addr()).await;
    assert_eq!(first[0].as_ref(), b"kv@c@m");
    let ev = &events(&first[2])[0];
    assert_eq!(event_type(ev), "BlockStored");
}

#[tokio::test]
async fn restart_resets_seq_and_empties_cache() {
    let h = start(test_config()).await;
    let a = h.http_addr();
    let body = json!({"prompt": text("r", 60), "max_tokens": 1});
    let (n, _) = cached_of(a, "/v1/completions", body.clone()).await;
    let resp = post(
        a,
        "/v1/responses",
        json!({"input": text("m", 30), "max_output_tokens": 2}),
    )
    .await
    .json();
    let id = resp["id"].as_str().unwrap().to_owned();
    let ep = h.replay_endpoint().unwrap().to_owned();
    h.flush_events().await;
    assert_eq!(replay(&ep, 0).await.0.len(), 2);
    let st = post(h.admin_addr(), "/admin/restart", json!({}))
        .await
        .json();
    assert_eq!(st["cached_blocks"], 0);
    assert_eq!(st["events"]["next_seq"], 0);
    assert!(replay(&ep, 0).await.0.is_empty(), "replay buffer emptied");
    assert_eq!(
        cached_of(a, "/v1/completions", body.clone()).await,
        (n, 0),
        "cache emptied"
    );
    h.flush_events().await;
    let (after, _) = replay(&ep, 0).await;
    assert_eq!(seq(&after[0]), 0, "seq starts again at 0");
    let r = post(
        a,
        "/v1/responses",
        json!({"input": "again", "previous_response_id": id}),
    )
    .await;
    assert_eq!(r.status, 404, "responses forgotten");
}

#[tokio::test]
async fn delayed_batches_wait_until_the_delay_is_lifted() {
    let h = start(test_config()).await;
    let admin = h.admin_addr();
    let st = post(admin, "/admin/events/delay", json!({"ms": 600_000}))
        .await
        .json();
    assert_eq!(st["events"]["delay_ms"], 600_000);
    let body = json!({"prompt": text("d", 30), "max_tokens": 1});
    assert_eq!(
        post(h.http_addr(), "/v1/completions", body).await.status,
        200
    );
    let ep = h.replay_endpoint().unwrap();
    assert!(replay(ep, 0).await.0.is_empty(), "held for ten minutes");
    post(admin, "/admin/events/delay", json!({"ms": 0})).await;
    h.flush_events().await;
    let (got, _) = replay(ep, 0).await;
    assert_eq!(got.len(), 1);
    assert_eq!(seq(&got[0]), 0);
}
