//! Replica load as indexd scrapes it: prefill speed fitted from vLLM's
//! histograms, queue lengths ranking replicas and failing scrapes marking
//! them unhealthy, and the capacity signal's occupancy added to the cost.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use indexd::config::HttpUrl;
use kvroute_proto::v1::DecisionKind;

use crate::harness::{Daemon, endpoint, eventually, gauge, replica};

/// A stand-in for vLLM's /metrics whose status and body the test controls.
async fn metrics_server(body: Arc<Mutex<(u16, String)>>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            let (status, text) = body.lock().unwrap().clone();
            tokio::spawn(async move {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf).await;
                let resp = format!(
                    "HTTP/1.1 {status} X\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
                    text.len()
                );
                let _ = s.write_all(resp.as_bytes()).await;
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_speed_is_fitted_from_the_replicas_histograms() {
    // A replica prefilling 100,000 tokens/s with 0.2 ms per request on top;
    // its counters advance between scrapes, requests of varied sizes, never
    // faster than the wall clock (indexd caps a sample's seconds at the time
    // between its scrapes: batched prefills).
    let page = |requests: f64, seconds: f64, tokens: f64| {
        format!(
            "vllm:num_requests_running{{engine=\"0\"}} 0\n\
             vllm:request_prefill_time_seconds_count{{engine=\"0\"}} {requests}\n\
             vllm:request_prefill_time_seconds_sum{{engine=\"0\"}} {seconds}\n\
             vllm:request_prefill_kv_computed_tokens_sum{{engine=\"0\"}} {tokens}\n\
             vllm:cache_config_info{{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"2048\"}} 1.0\n"
        )
    };
    let body = Arc::new(Mutex::new((200, page(0.0, 0.0, 0.0))));
    let addr = metrics_server(Arc::clone(&body)).await;
    let feeder = {
        let body = Arc::clone(&body);
        tokio::spawn(async move {
            let (mut requests, mut seconds, mut tokens) = (0.0, 0.0, 0.0);
            for i in 0..400u32 {
                let (n, t) = (f64::from(1 + i % 3), f64::from(30 + (i * 733) % 300));
                requests += n;
                tokens += t;
                seconds += 0.000_2 * n + t / 100_000.0;
                body.lock().unwrap().1 = page(requests, seconds, tokens);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let mut a = endpoint(18016, None);
    a.metrics_url = HttpUrl::parse(&format!("http://{addr}/metrics"));
    let mut b = endpoint(18017, None);
    b.metrics_url = None;
    let d = Daemon::start(vec![a, b], 16).await;
    let series =
        |port: u16, name: &str| format!("{name}{{endpoint=\"127.0.0.1:{port}\",model=\"m\"}}");
    eventually("a fitted speed near 100,000 tokens/s", || async {
        let page = String::from_utf8(d.http_get("/metrics").await.unwrap()).unwrap();
        gauge(
            &page,
            &series(18016, "indexd_replica_prefill_tokens_per_second"),
        )
        .is_some_and(|r| (r - 100_000.0).abs() < 1_000.0)
    })
    .await;
    let page = String::from_utf8(d.http_get("/metrics").await.unwrap()).unwrap();
    let overhead = gauge(
        &page,
        &series(18016, "indexd_replica_prefill_overhead_seconds"),
    );
    assert!(
        overhead.is_some_and(|o| (o - 0.000_2).abs() < 0.000_02),
        "{overhead:?}"
    );
    // The cache's size, as its metrics give it; unknown without them.
    assert_eq!(
        gauge(&page, &series(18016, "indexd_replica_cache_blocks")),
        Some(2048.0)
    );
    assert_eq!(
        gauge(&page, &series(18017, "indexd_replica_cache_blocks")),
        Some(0.0)
    );
    // Without metrics of its own, a replica takes its model's pooled
    // speed (here the other replica's evidence alone), not the prior.
    let pooled = gauge(&page, "indexd_model_prefill_tokens_per_second{model=\"m\"}")
        .expect("the model's pooled speed");
    assert!((pooled - 100_000.0).abs() < 1_000.0, "{pooled}");
    let unscraped = gauge(
        &page,
        &series(18017, "indexd_replica_prefill_tokens_per_second"),
    )
    .expect("a speed");
    assert!((unscraped - 100_000.0).abs() < 1_000.0, "{unscraped}");
    assert_eq!(
        gauge(&page, &series(18017, "indexd_replica_prefill_samples")),
        Some(0.0)
    );
    assert_eq!(
        gauge(
            &page,
            &series(18017, "indexd_replica_prefill_own_tokens_per_second")
        ),
        Some(0.0)
    );
    assert!(
        gauge(&page, &series(18016, "indexd_replica_prefill_samples")).is_some_and(|n| n >= 3.0)
    );
    feeder.abort();
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_from_metrics_and_failing_scrapes_mark_unhealthy() {
    let busy = Arc::new(Mutex::new((
        200,
        "vllm:num_requests_running{engine=\"0\"} 8\nvllm:num_requests_waiting{engine=\"0\"} 30\n"
            .to_owned(),
    )));
    let calm = Arc::new(Mutex::new((
        200,
        "vllm:num_requests_running{engine=\"0\"} 0\nvllm:num_requests_waiting{engine=\"0\"} 0\n"
            .to_owned(),
    )));
    let (busy_addr, calm_addr) = (
        metrics_server(Arc::clone(&busy)).await,
        metrics_server(Arc::clone(&calm)).await,
    );
    let mut a = endpoint(18014, None);
    a.metrics_url = HttpUrl::parse(&format!("http://{busy_addr}/metrics"));
    let mut b = endpoint(18015, None);
    b.metrics_url = HttpUrl::parse(&format!("http://{calm_addr}/metrics"));
    let mut d = Daemon::start(vec![a, b], 16).await;
    assert_eq!(d.http_get("/healthz").await.unwrap(), b"ok\n");
    eventually("both healthy", || async {
        d.handle.replica(&replica(18014)).unwrap().healthy
            && d.handle.replica(&replica(18015)).unwrap().healthy
    })
    .await;
    assert!(d.http_get("/readyz").await.is_ok());
    let r = d.pick(&[1, 2], 16).await;
    assert_eq!(
        r.candidates[0].address, "127.0.0.1:18015",
        "the calm replica first: {r:?}"
    );

    // The calm one starts failing: it drops out of every answer.
    *calm.lock().unwrap() = (500, String::new());
    eventually("unhealthy", || async {
        !d.handle.replica(&replica(18015)).unwrap().healthy
    })
    .await;
    let r = d.pick(&[1, 2], 16).await;
    let names: Vec<&str> = r.candidates.iter().map(|c| c.address.as_str()).collect();
    assert_eq!(names, ["127.0.0.1:18014"]);
    *busy.lock().unwrap() = (503, String::new());
    eventually("all unhealthy", || async {
        !d.handle.replica(&replica(18014)).unwrap().healthy
    })
    .await;
    let r = d.pick(&[1, 2], 16).await;
    assert_eq!(
        (r.decision, r.reason.as_str()),
        (DecisionKind::Stale as i32, "no_fresh_replica")
    );
    assert!(matches!(
        d.http_get("/readyz").await,
        Err(indexd::error::ScrapeError::Status(503))
    ));
    let page = String::from_utf8(d.http_get("/metrics").await.unwrap()).unwrap();
    for name in [
        "indexd_pick_latency_seconds_bucket",
        "indexd_decisions_total{decision=\"stale\",reason=\"no_fresh_replica\"}",
        "indexd_scrapes_total{result=\"error\"}",
        "indexd_index_entries",
        "indexd_replica_healthy{endpoint=\"127.0.0.1:18014\"",
    ] {
        assert!(page.contains(name), "{name} missing from /metrics");
    }
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_capacity_signal_adds_occupancy_to_the_cost() {
    let full = Arc::new(Mutex::new((
        200,
        r#"{"occupancy": 1.0, "cache_available": true}"#.to_owned(),
    )));
    let empty = Arc::new(Mutex::new((
        200,
        r#"{"occupancy": 0.0, "cache_available": true}"#.to_owned(),
    )));
    let (full_addr, empty_addr) = (metrics_server(full).await, metrics_server(empty).await);
    let mut a = endpoint(18050, None);
    a.capacity_url = HttpUrl::parse(&format!("http://{full_addr}/capacity"));
    let mut b = endpoint(18051, None);
    b.capacity_url = HttpUrl::parse(&format!("http://{empty_addr}/capacity"));
    let mut d = Daemon::start_with(vec![a, b], 16, |c| c.speculative_ttl = Duration::ZERO).await;
    eventually("both capacity signals", || async {
        d.counter("indexd_scrapes_total{result=\"capacity_ok\"}") >= 4.0
    })
    .await;
    let r = d.pick(&[1], 16).await;
    assert_eq!(r.candidates[0].address, "127.0.0.1:18051");
    let weights = indexd::Weights::default();
    let diff = r.candidates[1].cost - r.candidates[0].cost;
    assert!(
        (diff - weights.occupancy_penalty_seconds).abs() < 1e-9,
        "{r:?}"
    );
    d.stop().await;
}
