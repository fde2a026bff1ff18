//! `GET /metrics`: vLLM's Prometheus text, one series per data-parallel rank labelled
//! `engine="<rank>"` (as vLLM labels each engine core), plus `model_name`.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;

use crate::engine::Replica;
use crate::rank::{Engine, Metrics};

type Sampler = fn(&Engine, &Metrics) -> Vec<(&'static str, f64)>;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

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
}
