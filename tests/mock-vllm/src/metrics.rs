//! `GET /metrics`: vLLM's Prometheus text, one series per data-parallel rank labelled
//! `engine="<rank>"` (as vLLM labels each engine core), plus `model_name`.
//!
//! `GET /metrics/` answers as vLLM's `prometheus_client` mount does: with `name[]` query
//! parameters, only the samples they name (a family's `# HELP`/`# TYPE` with the first of
//! its samples kept); without, the whole page.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use axum::extract::{Query, State};
use axum::http::header;
use axum::response::IntoResponse;

use crate::engine::Replica;
use crate::rank::{Engine, Metrics};

type Sampler = fn(&Engine, &Metrics) -> Vec<(&'static str, f64)>;
type HistogramOf = fn(&Metrics) -> &crate::rank::Histogram;

fn g(a: &AtomicUsize) -> f64 {
    a.load(Ordering::Relaxed) as f64
}

fn c(a: &AtomicU64) -> f64 {
    a.load(Ordering::Relaxed) as f64
}

/// `(name, type, help, samples)`: a sampler gives each engine's `(extra labels, value)` pairs.
const FAMILIES: &[(&str, &str, &str, Sampler)] = &[
    (
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        |_, m| vec![("", g(&m.running))],
    ),
    (
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        |_, m| vec![("", g(&m.waiting))],
    ),
    (
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        |e, m| {
            let capacity = e.config.num_gpu_blocks.max(1) as f64;
            vec![("", (g(&m.running_blocks) / capacity).min(1.0))]
        },
    ),
    (
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        |_, m| vec![("", c(&m.prefix_queries))],
    ),
    (
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        |_, m| vec![("", c(&m.prefix_hits))],
    ),
    (
        "vllm:prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed.",
        |_, m| vec![("", c(&m.prompt_tokens))],
    ),
    (
        "vllm:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        |_, m| vec![("", c(&m.generation_tokens))],
    ),
    (
        "vllm:request_success_total",
        "counter",
        "Count of successfully processed requests.",
        |_, m| {
            vec![
                (",finished_reason=\"stop\"", c(&m.finished_stop)),
                (",finished_reason=\"length\"", c(&m.finished_length)),
            ]
        },
    ),
];

/// The exposition text for every engine of `replica`.
pub fn render(replica: &Replica) -> String {
    let cfg = &replica.config;
    let model = cfg.served_model_names.first().cloned().unwrap_or_default();
    let labels = |e: &Engine| format!("engine=\"{}\",model_name=\"{model}\"", e.rank);
    let mut out = String::new();
    for (name, kind, help, sample) in FAMILIES {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for e in replica.engines() {
            for (extra, value) in sample(e, &e.metrics) {
                let _ = writeln!(out, "{name}{{{}{extra}}} {value:?}", labels(e));
            }
        }
    }
    let token_bounds = crate::rank::token_buckets(cfg.max_model_len);
    let histograms: [(&str, &str, &[f64], HistogramOf); 2] = [
        (
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            crate::rank::LATENCY_BUCKETS,
            |m| &m.prefill_time,
        ),
        (
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            &token_bounds,
            |m| &m.prefill_computed,
        ),
    ];
    for (name, help, bounds, pick) in histograms {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for e in replica.engines() {
            let h = pick(&e.metrics).snapshot();
            let mut cumulative = 0u64;
            for (i, le) in bounds.iter().enumerate() {
                cumulative += h.counts.get(i).copied().unwrap_or(0);
                let _ = writeln!(
                    out,
                    "{name}_bucket{{{},le=\"{le:?}\"}} {:?}",
                    labels(e),
                    cumulative as f64
                );
            }
            let _ = writeln!(
                out,
                "{name}_bucket{{{},le=\"+Inf\"}} {:?}",
                labels(e),
                h.count as f64
            );
            let _ = writeln!(out, "{name}_sum{{{}}} {:?}", labels(e), h.sum);
            let _ = writeln!(out, "{name}_count{{{}}} {:?}", labels(e), h.count as f64);
        }
    }
    let name = "vllm:cache_config_info";
    let _ = writeln!(
        out,
        "# HELP {name} Information of the LLMEngine CacheConfig\n# TYPE {name} gauge"
    );
    for e in replica.engines() {
        let _ = writeln!(
            out,
            "{name}{{{},block_size=\"{}\",num_gpu_blocks=\"{}\",enable_prefix_caching=\"{}\"}} 1.0",
            labels(e),
            cfg.block_size,
            cfg.num_gpu_blocks,
            cfg.enable_prefix_caching
        );
    }
    out
}

/// GET /metrics
pub async fn metrics(State(replica): State<Arc<Replica>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        render(&replica),
    )
}

/// GET /metrics/ (see the module docs).
pub async fn metrics_named(
    State(replica): State<Arc<Replica>>,
    Query(params): Query<Vec<(String, String)>>,
) -> impl IntoResponse {
    let names: Vec<&str> = params
        .iter()
        .filter(|(k, _)| k == "name[]")
        .map(|(_, v)| v.as_str())
        .collect();
    let page = render(&replica);
    let body = if names.is_empty() {
        page
    } else {
        restrict(&page, &names)
    };
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
}

/// The samples of `page` named in `names`, each family's comment lines before its first.
fn restrict(page: &str, names: &[&str]) -> String {
    let mut out = String::new();
    let mut comments: Vec<&str> = Vec::new();
    for line in page.lines() {
        if line.starts_with("# HELP") {
            comments.clear();
        }
        if line.starts_with('#') {
            comments.push(line);
            continue;
        }
        let name = line.split(['{', ' ']).next().unwrap_or_default();
        if names.contains(&name) {
            for c in comments.drain(..) {
                let _ = writeln!(out, "{c}");
            }
            let _ = writeln!(out, "{line}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn named_samples_only_as_prometheus_client_restricts() {
        let r = Replica::new(Config::default(), "r".to_owned(), Vec::new());
        let page = render(&r);
        let some = restrict(
            &page,
            &[
                "vllm:num_requests_waiting",
                "vllm:request_prefill_time_seconds_sum",
            ],
        );
        assert_eq!(
            some,
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
             # TYPE vllm:num_requests_waiting gauge\n\
             vllm:num_requests_waiting{engine=\"0\",model_name=\"mock-model\"} 0.0\n\
             # HELP vllm:request_prefill_time_seconds Histogram of time spent in PREFILL phase for request.\n\
             # TYPE vllm:request_prefill_time_seconds histogram\n\
             vllm:request_prefill_time_seconds_sum{engine=\"0\",model_name=\"mock-model\"} 0.0\n"
        );
        assert_eq!(restrict(&page, &["vllm:nothing"]), "");
    }

    #[test]
    fn one_series_per_rank() {
        let config = Config {
            data_parallel_size: 2,
            ..Config::default()
        };
        let r = Replica::new(config, "r".to_owned(), Vec::new());
        let text = render(&r);
        for rank in ["0", "1"] {
            let series = format!(
                "vllm:num_requests_running{{engine=\"{rank}\",model_name=\"mock-model\"}} 0.0"
            );
            assert!(text.contains(&series), "{text}");
            let success = format!(
                "vllm:request_success_total{{engine=\"{rank}\",model_name=\"mock-model\",finished_reason=\"length\"}} 0.0"
            );
            assert!(text.contains(&success), "{text}");
        }
        assert_eq!(
            text.matches("# TYPE vllm:kv_cache_usage_perc gauge")
                .count(),
            1
        );
        assert_eq!(text.matches("vllm:cache_config_info{").count(), 2);
    }

    #[test]
    fn prefill_histograms_are_cumulative_with_sum_and_count() {
        let r = Replica::new(Config::default(), "r".to_owned(), Vec::new());
        let e = r.engines().first().cloned().expect("one engine");
        e.metrics
            .prefill_time
            .observe(crate::rank::LATENCY_BUCKETS, 0.4);
        e.metrics
            .prefill_time
            .observe(crate::rank::LATENCY_BUCKETS, 3.0);
        let bounds = crate::rank::token_buckets(32_768);
        assert_eq!(bounds.first(), Some(&1.0));
        assert_eq!(bounds.last(), Some(&20_000.0));
        e.metrics.prefill_computed.observe(&bounds, 700.0);
        let text = render(&r);
        let l = "engine=\"0\",model_name=\"mock-model\"";
        for line in [
            "# TYPE vllm:request_prefill_time_seconds histogram".to_owned(),
            format!("vllm:request_prefill_time_seconds_bucket{{{l},le=\"0.3\"}} 0.0"),
            format!("vllm:request_prefill_time_seconds_bucket{{{l},le=\"0.5\"}} 1.0"),
            format!("vllm:request_prefill_time_seconds_bucket{{{l},le=\"5.0\"}} 2.0"),
            format!("vllm:request_prefill_time_seconds_bucket{{{l},le=\"+Inf\"}} 2.0"),
            format!("vllm:request_prefill_time_seconds_sum{{{l}}} 3.4"),
            format!("vllm:request_prefill_time_seconds_count{{{l}}} 2.0"),
            format!("vllm:request_prefill_kv_computed_tokens_bucket{{{l},le=\"500.0\"}} 0.0"),
            format!("vllm:request_prefill_kv_computed_tokens_bucket{{{l},le=\"1000.0\"}} 1.0"),
            format!("vllm:request_prefill_kv_computed_tokens_sum{{{l}}} 700.0"),
        ] {
            assert!(text.contains(&line), "{line} missing from\n{text}");
        }
    }
}
