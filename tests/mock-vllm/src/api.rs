//! The vLLM HTTP surface: routes, `/tokenize`, the render endpoints, `/health`, `/v1/models` and
//! `/metrics`. Every response carries `x-mock-vllm-replica: <name>`.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};

use crate::engine::Replica;
use crate::error::{ApiError, parse_json};
use crate::openai::{
    ChatBody, CompletionBody, chat_completions, chat_prompt, completion_prompt, completions,
};
use crate::responses::{ResponsesBody, get_response, responses, responses_prompt};

/// Header naming the replica that answered.
pub const REPLICA_HEADER: &str = "x-mock-vllm-replica";

/// vLLM sets no body limit; long agentic contexts run to megabytes.
const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;

/// The vLLM version this mock reproduces.
pub const VLLM_VERSION: &str = "0.32.0";

/// The main (vLLM) router.
pub fn router(replica: Arc<Replica>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/version", get(version))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route("/tokenize", post(tokenize))
        .route("/v1/completions/render", post(render_completion))
        .route("/v1/chat/completions/render", post(render_chat))
        .route("/v1/responses/render", post(render_responses))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/responses", post(responses))
        .route("/v1/responses/{id}", get(get_response))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn_with_state(replica.clone(), tag_replica))
        .with_state(replica)
}

async fn tag_replica(State(replica): State<Arc<Replica>>, req: Request, next: Next) -> Response {
    let mut resp = next.run(req).await;
    if let Ok(v) = HeaderValue::from_str(&replica.name) {
        resp.headers_mut()
            .insert(HeaderName::from_static(REPLICA_HEADER), v);
    }
    resp
}

async fn health() -> StatusCode {
    StatusCode::OK
}

async fn version() -> Json<Value> {
    Json(json!({"version": VLLM_VERSION}))
}

async fn models(State(replica): State<Arc<Replica>>) -> Json<Value> {
    let cfg = &replica.config;
    let root = cfg.served_model_names.first().cloned().unwrap_or_default();
    let card = |id: &str, parent: Option<&str>| {
        json!({
            "id": id,
            "object": "model",
            "created": 0,
            "owned_by": "vllm",
            "root": if parent.is_some() { id } else { root.as_str() },
            "parent": parent,
            "max_model_len": cfg.max_model_len,
        })
    };
    let mut data: Vec<Value> = cfg
        .served_model_names
        .iter()
        .map(|m| card(m, None))
        .collect();
    data.extend(
        cfg.lora_modules
            .iter()
            .map(|l| card(l, Some(root.as_str()))),
    );
    Json(json!({"object": "list", "data": data}))
}

fn metric(out: &mut String, name: &str, kind: &str, help: &str, samples: &[(String, f64)]) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    for (labels, value) in samples {
        let _ = writeln!(out, "{name}{{{labels}}} {value:?}");
    }
}

async fn metrics(State(replica): State<Arc<Replica>>) -> impl IntoResponse {
    let m = &replica.metrics;
    let cfg = &replica.config;
    let model = cfg.served_model_names.first().cloned().unwrap_or_default();
    let labels = format!("engine=\"0\",model_name=\"{model}\"");
    let one = |v: f64| [(labels.clone(), v)];
    let g = |a: &AtomicUsize| a.load(Ordering::Relaxed) as f64;
    let c = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
    let capacity = cfg.num_gpu_blocks.max(1) as f64;
    let usage = (g(&m.running_blocks) / capacity).min(1.0);
    let mut out = String::new();
    let o = &mut out;
    metric(
        o,
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        &one(g(&m.running)),
    );
    metric(
        o,
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        &one(g(&m.waiting)),
    );
    metric(
        o,
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        &one(usage),
    );
    metric(
        o,
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        &one(c(&m.prefix_queries)),
    );
    metric(
        o,
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        &one(c(&m.prefix_hits)),
    );
    metric(
        o,
        "vllm:prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed.",
        &one(c(&m.prompt_tokens)),
    );
    metric(
        o,
        "vllm:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        &one(c(&m.generation_tokens)),
    );
    metric(
        o,
        "vllm:request_success_total",
        "counter",
        "Count of successfully processed requests.",
        &[
            (
                format!("{labels},finished_reason=\"stop\""),
                c(&m.finished_stop),
            ),
            (
                format!("{labels},finished_reason=\"length\""),
                c(&m.finished_length),
            ),
        ],
    );
    let info = format!(
        "{labels},block_size=\"{}\",num_gpu_blocks=\"{}\",enable_prefix_caching=\"{}\"",
        cfg.block_size, cfg.num_gpu_blocks, cfg.enable_prefix_caching
    );
    metric(
        o,
        "vllm:cache_config_info",
        "gauge",
        "Information of the LLMEngine CacheConfig",
        &[(info, 1.0)],
    );
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        out,
    )
}

fn tokenize_answer(replica: &Replica, ids: Vec<u32>, strs: Option<Vec<String>>) -> Json<Value> {
    Json(json!({
        "count": ids.len(),
        "max_model_len": replica.config.max_model_len,
        "tokens": ids,
        "token_strs": strs,
    }))
}

/// POST /tokenize: the completion form (`prompt`) or the chat form (`messages`); anything else
/// (a Responses body with `input`) is a 400, as in vLLM.
async fn tokenize(
    State(replica): State<Arc<Replica>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let raw: Value = parse_json(&body)?;
    if raw.get("messages").is_some() {
        let body: ChatBody = parse_json(&body)?;
        let p = chat_prompt(&replica, &body, body.return_token_strs)?;
        Ok(tokenize_answer(&replica, p.ids, p.strs))
    } else if raw.get("prompt").is_some() {
        let body: CompletionBody = parse_json(&body)?;
        let p = completion_prompt(&replica, &body, body.return_token_strs)?;
        Ok(tokenize_answer(&replica, p.ids, p.strs))
    } else {
        Err(ApiError::bad_request(
            "Invalid request body: /tokenize takes a completion body (`prompt`) or a chat body (`messages`)",
        ))
    }
}

fn render_answer(model: &str, ids: Vec<u32>) -> Json<Value> {
    Json(json!({"model": model, "count": ids.len(), "token_ids": ids}))
}

async fn render_completion(
    State(replica): State<Arc<Replica>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let body: CompletionBody = parse_json(&body)?;
    let p = completion_prompt(&replica, &body, false)?;
    Ok(render_answer(&p.model.name, p.ids))
}

async fn render_chat(
    State(replica): State<Arc<Replica>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let body: ChatBody = parse_json(&body)?;
    let p = chat_prompt(&replica, &body, false)?;
    Ok(render_answer(&p.model.name, p.ids))
}

async fn render_responses(
    State(replica): State<Arc<Replica>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let body: ResponsesBody = parse_json(&body)?;
    let p = responses_prompt(&replica, &body)?;
    Ok(render_answer(&p.model.name, p.ids))
}

async fn reset_prefix_cache(State(replica): State<Arc<Replica>>) -> StatusCode {
    replica.reset_prefix_cache();
    StatusCode::OK
}
