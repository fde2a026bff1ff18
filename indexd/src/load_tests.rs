use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::*;

const PAGE: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:num_requests_running_total 99
"#;

#[test]
fn prefill_histogram_counters_are_read_per_engine() {
    let page = "\
vllm:request_prefill_time_seconds_bucket{engine=\"0\",le=\"+Inf\",model_name=\"m\"} 3.0
vllm:request_prefill_time_seconds_count{engine=\"0\",model_name=\"m\"} 3.0
vllm:request_prefill_time_seconds_sum{engine=\"0\",model_name=\"m\"} 1.5
vllm:request_prefill_time_seconds_count{engine=\"1\",model_name=\"m\"} 1.0
vllm:request_prefill_time_seconds_sum{engine=\"1\",model_name=\"m\"} 0.25
vllm:request_prefill_kv_computed_tokens_sum{engine=\"0\",model_name=\"m\"} 3000.0
vllm:request_prefill_kv_computed_tokens_sum{engine=\"1\",model_name=\"m\"} 500.0
vllm:request_prefill_kv_computed_tokens_count{engine=\"1\",model_name=\"m\"} 1.0
";
    let all = parse_vllm_metrics(page, None).prefill;
    assert_eq!(
        all,
        Some(PrefillCounters {
            requests: 4.0,
            seconds: 1.75,
            tokens: 3_500.0
        })
    );
    let own = parse_vllm_metrics(page, Some(1)).prefill;
    assert_eq!(
        own,
        Some(PrefillCounters {
            requests: 1.0,
            seconds: 0.25,
            tokens: 500.0
        })
    );
    assert_eq!(
        parse_vllm_metrics(PAGE, None).prefill,
        None,
        "an older vLLM"
    );
}

#[test]
fn sums_all_series_without_rank_and_takes_own_engine_with_rank() {
    let all = parse_vllm_metrics(PAGE, None);
    assert_eq!((all.running, all.waiting, all.kv_usage), (4.0, 9.0, 0.5));
    let one = parse_vllm_metrics(PAGE, Some(1));
    assert_eq!((one.running, one.waiting, one.kv_usage), (1.0, 7.0, 0.5));
    let plain = parse_vllm_metrics(
        "vllm:num_requests_waiting 5\nvllm:gpu_cache_usage_perc 0.9\n",
        Some(0),
    );
    assert_eq!((plain.waiting, plain.kv_usage), (5.0, 0.9));
}

#[test]
fn label_values_are_read_as_quoted_escaped_strings() {
    let set = r#"a="x,num_gpu_blocks=999",b="q\"uote\\d",c="l\nf", num_gpu_blocks="12","#;
    assert_eq!(label(set, "num_gpu_blocks").as_deref(), Some("12"));
    assert_eq!(label(set, "a").as_deref(), Some("x,num_gpu_blocks=999"));
    assert_eq!(label(set, "b").as_deref(), Some("q\"uote\\d"));
    assert_eq!(label(set, "c").as_deref(), Some("l\nf"));
    assert_eq!(label(set, "d"), None);
    assert_eq!(label("", "a"), None);
    for malformed in [r#"a=x"#, r#"a="x"#, r#"a"#, r#"b="y" a"#] {
        assert_eq!(label(malformed, "a"), None, "{malformed}");
    }
    let page = format!(
        "vllm:cache_config_info{{{set}}} 1.0\nvllm:num_requests_running{{engine=\"0\"}} 2\n"
    );
    let load = parse_vllm_metrics(&page, Some(0));
    assert_eq!((load.cache_blocks, load.running), (Some(12.0), 2.0));
}

proptest::proptest! {
    #[test]
    fn label_values_written_by_the_text_format_read_back(
        values in proptest::collection::vec(proptest::prelude::any::<String>(), 1..6),
        spaced in proptest::prelude::any::<bool>(),
    ) {
        let sep = if spaced { ", " } else { "," };
        let set = values
            .iter()
            .enumerate()
            .map(|(i, v)| format!("k{i}=\"{}\"", crate::metrics::label_value(v)))
            .collect::<Vec<_>>()
            .join(sep);
        for (i, v) in values.iter().enumerate() {
            let got = label(&set, &format!("k{i}"));
            proptest::prop_assert_eq!(got.as_deref(), Some(v.as_str()), "{}", set);
        }
    }
}

#[test]
fn the_cache_size_comes_from_cache_config_info() {
    // As vLLM 0.32 renders it: every CacheConfig field a label (the
    // override's name starts like the size's), one series per engine.
    let page = "\
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size=\"64\",cache_dtype=\"auto\",engine=\"0\",num_gpu_blocks=\"86\",num_gpu_blocks_override=\"86\",sliding_window=\"None\"} 1.0
vllm:cache_config_info{block_size=\"64\",cache_dtype=\"auto\",engine=\"1\",num_gpu_blocks=\"120\",num_gpu_blocks_override=\"None\",sliding_window=\"None\"} 1.0
vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 1.0
";
    assert_eq!(parse_vllm_metrics(page, Some(0)).cache_blocks, Some(86.0));
    assert_eq!(parse_vllm_metrics(page, Some(1)).cache_blocks, Some(120.0));
    assert_eq!(parse_vllm_metrics(page, None).cache_blocks, Some(120.0));
    assert_eq!(parse_vllm_metrics(PAGE, None).cache_blocks, None);
    let bad = "vllm:cache_config_info{num_gpu_blocks=\"None\"} 1.0\n";
    assert_eq!(parse_vllm_metrics(bad, None).cache_blocks, None);
    let url = HttpUrl::parse("http://127.0.0.1:8000/metrics").unwrap();
    let q = filtered(&url).unwrap().path;
    assert!(q.contains("name%5B%5D=vllm%3Acache_config_info"), "{q}");
}

#[tokio::test]
async fn scrape_follows_vllms_metrics_redirect_and_bounds_the_body() {
    use axum::response::Redirect;
    use axum::routing::get as route;
    let app = axum::Router::new()
        .route(
            "/metrics",
            route(|| async { Redirect::temporary("/metrics/") }),
        )
        .route(
            "/metrics/",
            route(|| async { "vllm:num_requests_running 2\n" }),
        )
        .route("/huge", route(|| async { "x".repeat(MAX_BODY + 1) }))
        .route(
            "/down",
            route(|| async { (axum::http::StatusCode::SERVICE_UNAVAILABLE, "no") }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let client = client().unwrap();
    let url = |p: &str| HttpUrl::parse(&format!("http://{addr}{p}")).unwrap();
    let t = Duration::from_secs(5);
    let body = get(&client, &url("/metrics"), t).await.unwrap();
    assert_eq!(
        parse_vllm_metrics(&String::from_utf8_lossy(&body), None).running,
        2.0
    );
    assert!(matches!(
        get(&client, &url("/huge"), t).await,
        Err(ScrapeError::TooLarge(_))
    ));
    assert!(matches!(
        get(&client, &url("/down"), t).await,
        Err(ScrapeError::Status(503))
    ));
}

/// A server with `/metrics` (the whole page) and `/metrics/` answering
/// as `narrow` says; it counts the calls of each.
async fn metrics_server(
    narrow: fn(Option<String>) -> (axum::http::StatusCode, String),
) -> (SocketAddr, Arc<[AtomicUsize; 2]>) {
    use axum::extract::RawQuery;
    use axum::routing::get as route;
    let calls: Arc<[AtomicUsize; 2]> = Arc::new([AtomicUsize::new(0), AtomicUsize::new(0)]);
    let (whole, part) = (calls.clone(), calls.clone());
    let app = axum::Router::new()
        .route(
            "/metrics",
            route(move || async move {
                whole[0].fetch_add(1, Ordering::SeqCst);
                "vllm:num_requests_running 2\nvllm:num_requests_waiting 1\nother 5\n"
            }),
        )
        .route(
            "/metrics/",
            route(move |RawQuery(q): RawQuery| async move {
                part[1].fetch_add(1, Ordering::SeqCst);
                narrow(q)
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, calls)
}

/// Two scrapes of `addr`'s `/metrics`, the page's form kept between
/// them, and the form after each.
async fn twice(client: &reqwest::Client, addr: SocketAddr) -> [(ScrapedLoad, Page); 2] {
    let mut page = page_of(addr);
    let t = Duration::from_secs(5);
    let mut scrape = async || {
        let load = page.fetch(client, &ID, t).await.unwrap();
        (load, page.form)
    };
    [scrape().await, scrape().await]
}

const ID: EndpointId = EndpointId {
    address: SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 1),
    rank: None,
};

/// `addr`'s `/metrics`, its filtered form untried.
fn page_of(addr: SocketAddr) -> MetricsPage {
    MetricsPage::new(&HttpUrl::parse(&format!("http://{addr}/metrics")).unwrap())
}

#[tokio::test]
async fn only_the_series_read_are_asked_for_and_the_whole_page_is_the_fallback() {
    use axum::http::StatusCode;
    let client = client().unwrap();
    let t = Duration::from_secs(5);
    // vLLM: `/metrics/` renders only the samples named.
    let (addr, calls) = metrics_server(|q| {
        let q = q.unwrap_or_default();
        assert!(q.contains("name%5B%5D=vllm%3Anum_requests_waiting"), "{q}");
        (StatusCode::OK, "vllm:num_requests_waiting 3\n".into())
    })
    .await;
    for (load, page) in twice(&client, addr).await {
        assert_eq!((load.waiting, page), (3.0, Page::Filtered));
    }
    let n = |c: &Arc<[AtomicUsize; 2]>| [0, 1].map(|i| c[i].load(Ordering::SeqCst));
    assert_eq!(n(&calls), [0, 2]);
    // A server without the filtered form (404), or one answering it
    // with something else: the whole page, then and from then on.
    for narrow in [
        (|_| (StatusCode::NOT_FOUND, String::new())) as fn(Option<String>) -> (StatusCode, String),
        |_| (StatusCode::OK, "<html>metrics</html>".into()),
    ] {
        let (addr, calls) = metrics_server(narrow).await;
        for (load, page) in twice(&client, addr).await {
            assert_eq!((load.running, page), (2.0, Page::Whole));
        }
        assert_eq!(n(&calls), [2, 1]);
    }
    // Once it worked, a client error (another server in its place)
    // gives the filtered form up...
    let (addr, _) = metrics_server(|_| (StatusCode::NOT_FOUND, String::new())).await;
    let mut page = page_of(addr);
    page.form = Page::Filtered;
    let load = page.fetch(&client, &ID, t).await;
    assert_eq!((load.unwrap().running, page.form), (2.0, Page::Whole));
    // ... a server error is a failed scrape, not a reason to.
    let (addr, _) = metrics_server(|_| (StatusCode::SERVICE_UNAVAILABLE, String::new())).await;
    let mut page = page_of(addr);
    page.form = Page::Filtered;
    let r = page.fetch(&client, &ID, t).await;
    assert!(matches!(r, Err(ScrapeError::Status(503))), "{r:?}");
    assert_eq!(page.form, Page::Filtered);
    // Nothing listening: not answered, still untried.
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut page = page_of(closed.local_addr().unwrap());
    drop(closed);
    assert!(page.fetch(&client, &ID, t).await.is_err());
    assert_eq!(page.form, Page::Untried);
    // A query of its own: scraped as given.
    let url = HttpUrl::parse("http://h:1/metrics?format=x").unwrap();
    assert_eq!(filtered(&url), None);
    assert_eq!(MetricsPage::new(&url).form, Page::Whole);
    let url = HttpUrl::parse("http://h:1/stats/").unwrap();
    assert!(
        filtered(&url)
            .unwrap()
            .path
            .starts_with("/stats/?name%5B%5D=vllm%3A")
    );
}

#[test]
fn capacity_signal() {
    assert_eq!(
        parse_capacity(br#"{"occupancy":0.5,"cache_available":false}"#),
        (Some(0.5), Some(false))
    );
    assert_eq!(parse_capacity(b"nope"), (None, None));
}

#[test]
fn context_lengths_from_model_cards() {
    // vLLM 0.32's /v1/models: the base model and an adapter, each with its
    // max_model_len.
    let body = br#"{"object":"list","data":[
        {"id":"m","object":"model","created":0,"owned_by":"vllm","root":"m","parent":null,"max_model_len":4096,"permission":[]},
        {"id":"lora-a","object":"model","root":"lora-a","parent":"m","max_model_len":4096},
        {"id":"other","object":"model"},
        {"id":"zero","max_model_len":0}]}"#;
    assert_eq!(
        parse_context_lengths(body),
        [("m".to_owned(), 4096), ("lora-a".to_owned(), 4096)]
    );
    assert!(parse_context_lengths(b"<html>").is_empty());
    assert!(parse_context_lengths(br#"{"data":"x"}"#).is_empty());
}
