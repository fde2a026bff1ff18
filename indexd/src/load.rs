//! Load and health: a background scrape of each replica's vLLM `/metrics`
//! (and the optional capacity signal), over a tiny HTTP/1.1 client.
//!
//! - `vllm:num_requests_running` and `vllm:num_requests_waiting` are summed
//!   over the series of the replica (the series whose `engine` label equals
//!   its data-parallel rank, when it has one and such series exist);
//!   `vllm:kv_cache_usage_perc` (or the older `vllm:gpu_cache_usage_perc`)
//!   takes the maximum.
//! - `unhealthy_after` consecutive failures mark the replica unhealthy; one
//!   success marks it healthy again.
//! - Picks made after a scrape started stay counted as in flight
//!   ([`crate::state::Replica::note_pick`]).

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::{Instant, MissedTickBehavior};

use crate::config::HttpUrl;
use crate::error::ScrapeError;
use crate::state::{Replica, Shared};

/// Largest response body read.
pub const MAX_BODY: usize = 4 << 20;

/// Scrapes `replica` until it is cancelled.
pub async fn run(shared: Arc<Shared>, replica: Arc<Replica>) {
    if replica.config.metrics_url.is_none() && replica.config.capacity_url.is_none() {
        return;
    }
    let mut tick = tokio::time::interval(shared.config.scrape_interval);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = replica.cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        scrape_once(&shared, &replica).await;
    }
}

/// One scrape of metrics and capacity.
pub async fn scrape_once(shared: &Shared, replica: &Replica) {
    let timeout = shared.config.scrape_timeout;
    if let Some(url) = &replica.config.metrics_url {
        let started = std::time::Instant::now();
        match get(url, timeout).await {
            Ok(body) => {
                let text = String::from_utf8_lossy(&body);
                let load = parse_vllm_metrics(&text, replica.id().rank);
                replica.scrape_ok(load.running, load.waiting, load.kv_usage, started);
                shared.metrics.scrapes.inc(["ok"]);
            }
            Err(e) => {
                shared.metrics.scrapes.inc(["error"]);
                if replica.scrape_failed(shared.config.unhealthy_after.get()) {
                    tracing::warn!(endpoint = %replica.id(), url = %url, error = %e, "replica unhealthy: /metrics scrape failing");
                } else {
                    tracing::debug!(endpoint = %replica.id(), error = %e, "scrape failed");
                }
            }
        }
    }
    if let Some(url) = &replica.config.capacity_url {
        match get(url, timeout).await {
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
pub struct ScrapedLoad {
    /// Running requests.
    pub running: f64,
    /// Waiting requests.
    pub waiting: f64,
    /// KV-cache usage, 0..1.
    pub kv_usage: f64,
}

/// Parses vLLM's Prometheus text (see the module docs).
pub fn parse_vllm_metrics(text: &str, rank: Option<u32>) -> ScrapedLoad {
    let rank_label = rank.map(|r| r.to_string());
    let has_engine_label = text
        .lines()
        .any(|l| l.starts_with("vllm:") && l.contains("engine=\""));
    let mut out = ScrapedLoad::default();
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
            && label(labels, "engine").is_some_and(|e| e != rank)
        {
            continue;
        }
        match name {
            "vllm:num_requests_running" => out.running += value,
            "vllm:num_requests_waiting" => out.waiting += value,
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => {
                out.kv_usage = out.kv_usage.max(value)
            }
            _ => {}
        }
    }
    out
}

fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    labels.split(',').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k.trim() == key).then(|| v.trim().trim_matches('"'))
    })
}

/// Parses `{"occupancy": 0..1, "cache_available": bool}`.
pub fn parse_capacity(body: &[u8]) -> (Option<f64>, Option<bool>) {
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

/// GET `url` with an overall timeout; the body of a 200 response.
pub async fn get(url: &HttpUrl, timeout: Duration) -> Result<Vec<u8>, ScrapeError> {
    tokio::time::timeout_at(Instant::now() + timeout, get_inner(url))
        .await
        .map_err(|_| ScrapeError::Timeout)?
}

async fn get_inner(url: &HttpUrl) -> Result<Vec<u8>, ScrapeError> {
    let mut stream = TcpStream::connect(&url.authority).await?;
    let request = format!(
        "GET {} HTTP/1.1\r\nHost: {}\r\nUser-Agent: kvroute-indexd\r\nAccept: text/plain, application/json\r\nConnection: close\r\n\r\n",
        url.path, url.authority
    );
    stream.write_all(request.as_bytes()).await?;
    let mut raw = Vec::new();
    let mut limited = (&mut stream).take(MAX_BODY as u64 + 64 * 1024);
    limited.read_to_end(&mut raw).await?;
    parse_response(&raw)
}

/// Splits an HTTP/1.x response read to EOF; decodes chunked bodies.
pub fn parse_response(raw: &[u8]) -> Result<Vec<u8>, ScrapeError> {
    let head_end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or(ScrapeError::Malformed("no end of headers"))?;
    let head = std::str::from_utf8(raw.get(..head_end).unwrap_or_default())
        .map_err(|_| ScrapeError::Malformed("headers not utf-8"))?;
    let body = raw.get(head_end + 4..).unwrap_or_default();
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .ok_or(ScrapeError::Malformed("status line"))?;
    if status != 200 {
        return Err(ScrapeError::Status(status));
    }
    let mut chunked = false;
    let mut length = None;
    for line in lines {
        if let Some((k, v)) = line.split_once(':') {
            let (k, v) = (k.trim(), v.trim());
            if k.eq_ignore_ascii_case("transfer-encoding")
                && v.to_ascii_lowercase().contains("chunked")
            {
                chunked = true;
            } else if k.eq_ignore_ascii_case("content-length") {
                length = v.parse::<usize>().ok();
            }
        }
    }
    let body = if chunked {
        dechunk(body)?
    } else if let Some(n) = length {
        body.get(..n)
            .ok_or(ScrapeError::Malformed("short body"))?
            .to_vec()
    } else {
        body.to_vec()
    };
    if body.len() > MAX_BODY {
        return Err(ScrapeError::TooLarge(MAX_BODY));
    }
    Ok(body)
}

fn dechunk(mut body: &[u8]) -> Result<Vec<u8>, ScrapeError> {
    let mut out = Vec::new();
    loop {
        let line_end = body
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or(ScrapeError::Malformed("chunk size"))?;
        let size_text = std::str::from_utf8(body.get(..line_end).unwrap_or_default())
            .map_err(|_| ScrapeError::Malformed("chunk size"))?;
        let size_hex = size_text.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_hex, 16)
            .map_err(|_| ScrapeError::Malformed("chunk size"))?;
        let rest = body.get(line_end + 2..).unwrap_or_default();
        if size == 0 {
            return Ok(out);
        }
        if out.len() + size > MAX_BODY {
            return Err(ScrapeError::TooLarge(MAX_BODY));
        }
        out.extend_from_slice(
            rest.get(..size)
                .ok_or(ScrapeError::Malformed("short chunk"))?,
        );
        body = rest.get(size + 2..).unwrap_or_default();
    }
}

#[cfg(test)]
mod tests {
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
    fn http_responses_plain_sized_and_chunked() {
        assert_eq!(
            parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhiXX").unwrap(),
            b"hi"
        );
        assert_eq!(
            parse_response(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhe\r\n3\r\nllo\r\n0\r\n\r\n").unwrap(),
            b"hello"
        );
        assert!(matches!(
            parse_response(b"HTTP/1.1 503 No\r\n\r\n"),
            Err(ScrapeError::Status(503))
        ));
        assert!(parse_response(b"garbage").is_err());
        assert!(
            parse_response(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n").is_err()
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
