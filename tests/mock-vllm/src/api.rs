//! The vLLM HTTP surface: routes, `/tokenize`, the render endpoints, `/health` and `/v1/models`
//! (`/metrics` in `metrics.rs`). Every response carries `x-mock-vllm-replica: <name>` and
//! `x-mock-vllm-rank: <rank>`; a generation response also carries `x-mock-vllm-prompt-digest`
//! (see [`prompt_digest`]); a bad `x-data-parallel-rank` request header is a 400 on any route.

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};

use crate::engine::Replica;
use crate::error::{ApiError, off_loop, parse_json};
use crate::metrics::{metrics, metrics_named};
use crate::openai::{
    ChatBody, CompletionBody, chat_completions, chat_prompt, completion_prompt, completions,
};
use crate::responses::{ResponsesBody, get_response, responses, responses_prompt};

/// Header naming the replica that answered.
pub const REPLICA_HEADER: &str = "x-mock-vllm-replica";

/// Header naming the data-parallel rank that served the request: the engine a generation
/// request ran on; otherwise the pinned engine's rank, or the first engine's.
pub const RANK_HEADER: &str = "x-mock-vllm-rank";

/// Header with the [`prompt_digest`] of what a generation request ran: a client (or a benchmark
/// behind a router) compares it with the digest of what it sent to see whether the prompt or the
/// `cache_salt` was changed on the way.
pub const PROMPT_DIGEST_HEADER: &str = "x-mock-vllm-prompt-digest";

/// 16 hex digits of SHA-256 over the `cache_salt` (or its absence) and the prompt token ids.
pub fn prompt_digest(cache_salt: Option<&str>, token_ids: &[u32]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    match cache_salt {
        Some(salt) => {
            h.update(b"salt\0");
            h.update(salt.as_bytes());
        }
        None => h.update(b"nosalt"),
    }
    h.update(b"\0");
    for id in token_ids {
        h.update(id.to_le_bytes());
    }
    h.finalize()
        .iter()
        .take(8)
        .fold(String::with_capacity(16), |mut out, b| {
            out.push_str(&format!("{b:02x}"));
            out
        })
}

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
        .route("/metrics/", get(metrics_named))
        .route("/tokenize", post(tokenize))
        .route("/v1/completions/render", post(render_completion))
        .route("/v1/chat/completions/render", post(render_chat))
        .route("/v1/responses/render", post(render_responses))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/responses", post(responses))
        .route("/v1/messages", post(crate::messages::messages))
        .route(
            "/v1/messages/count_tokens",
            post(crate::messages::count_tokens),
        )
        .route("/v1/responses/{id}", get(get_response))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn_with_state(replica.clone(), tag_replica))
        .with_state(replica)
}

/// Sets `x-mock-vllm-rank` on a response (the rank a generation request ran on).
pub fn with_rank(mut resp: Response, rank: u32) -> Response {
    resp.headers_mut().insert(
        HeaderName::from_static(RANK_HEADER),
        HeaderValue::from(rank),
    );
    resp
}

/// Tags a generation response with its rank and the digest of what it ran.
pub fn served(resp: Response, rank: u32, digest: &str) -> Response {
    let mut resp = with_rank(resp, rank);
    if let Ok(v) = HeaderValue::from_str(digest) {
        resp.headers_mut()
            .insert(HeaderName::from_static(PROMPT_DIGEST_HEADER), v);
    }
    resp
}

/// Refuses a bad `x-data-parallel-rank`, then tags the response with the replica and the rank.
async fn tag_replica(State(replica): State<Arc<Replica>>, req: Request, next: Next) -> Response {
    let pin = replica.rank_pin(req.headers());
    let mut resp = match &pin {
        Ok(_) => next.run(req).await,
        Err(e) => e.clone().into_response(),
    };
    if let Ok(v) = HeaderValue::from_str(&replica.name) {
        resp.headers_mut()
            .insert(HeaderName::from_static(REPLICA_HEADER), v);
    }
    if !resp.headers().contains_key(RANK_HEADER) {
        let engines = replica.engines();
        let engine = pin
            .ok()
            .flatten()
            .and_then(|i| engines.get(i))
            .or(engines.first());
        if let Some(e) = engine {
            resp = with_rank(resp, e.rank);
        }
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
    off_loop(move || {
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
    })
    .await
}

fn render_answer(model: &str, ids: Vec<u32>) -> Json<Value> {
    Json(json!({"model": model, "count": ids.len(), "token_ids": ids}))
}

async fn render_completion(
    State(replica): State<Arc<Replica>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    off_loop(move || {
        let body: CompletionBody = parse_json(&body)?;
        let p = completion_prompt(&replica, &body, false)?;
        Ok(render_answer(&p.model.name, p.ids))
    })
    .await
}

async fn render_chat(
    State(replica): State<Arc<Replica>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    off_loop(move || {
        let body: ChatBody = parse_json(&body)?;
        let p = chat_prompt(&replica, &body, false)?;
        Ok(render_answer(&p.model.name, p.ids))
    })
    .await
}

async fn render_responses(
    State(replica): State<Arc<Replica>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    off_loop(move || {
        let body: ResponsesBody = parse_json(&body)?;
        let p = responses_prompt(&replica, &body)?;
        Ok(render_answer(&p.model.name, p.ids))
    })
    .await
}

/// Resets every rank's cache, as vLLM's endpoint does.
async fn reset_prefix_cache(State(replica): State<Arc<Replica>>) -> StatusCode {
    replica.reset_prefix_cache();
    StatusCode::OK
}
