//! `POST /v1/messages` (Anthropic's Messages API) and
//! `POST /v1/messages/count_tokens`, as vLLM 0.32 serves them: the body is
//! converted to a chat request as vLLM converts it (the conversion of
//! `kvroute-tokenizer`, checked against vLLM's own in its tests; this
//! template accepts inline system messages and has no thinking switch, so
//! vLLM's defaults apply), the chat request runs as `/v1/chat/completions`
//! would, and the answer takes Anthropic's shape: `usage` with
//! `cache_read_input_tokens` (the prefix cache's hit) and `input_tokens` the
//! rest of the prompt. Streams are Anthropic's event sequence
//! (`message_start`, one text block's start, deltas and stop,
//! `message_delta`, `message_stop`). Errors are Anthropic's error object.

use std::convert::Infallible;
use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use kvroute_tokenizer::{MessagesConversion, MessagesRequest};
use serde_json::{Value, json};

use crate::api::served;
use crate::engine::Replica;
use crate::error::{ApiError, off_loop, parse_json};
use crate::generate::{TokenKind, generate};
use crate::openai::{ChatBody, chat_prompt, random_id};
use crate::runner::{Step, run_streaming, run_to_end, steps};

/// An error in the shape vLLM's Anthropic routes answer.
fn anthropic(e: ApiError) -> Response {
    let kind = e.kind();
    (
        e.status,
        Json(json!({"type": "error", "error": {"type": kind, "message": e.message}})),
    )
        .into_response()
}

/// The chat body vLLM converts a Messages body to, with the fields the
/// chat completion takes beside the prompt (`max_tokens`, `stream`,
/// `cache_salt`).
fn as_chat(body: &[u8], count_tokens: bool) -> Result<ChatBody, ApiError> {
    let parsed =
        MessagesRequest::from_json(body).map_err(|e| ApiError::bad_request(e.to_string()))?;
    let parsed = if count_tokens {
        parsed.for_count_tokens()
    } else {
        parsed
    };
    let chat = parsed
        .to_chat(&MessagesConversion::default())
        .and_then(|c| c.to_json())
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let mut chat: Value = parse_json(chat.as_bytes())?;
    let raw: Value = parse_json(body)?;
    for field in ["max_tokens", "stream", "cache_salt"] {
        if let Some(v) = raw.get(field).filter(|v| !v.is_null()) {
            chat[field] = v.clone();
        }
    }
    serde_json::from_value(chat)
        .map_err(|e| ApiError::bad_request(format!("Invalid request body: {e}")))
}

/// Anthropic's `usage` of a prompt of `prompt` tokens, `cached` of them
/// read from the prefix cache.
fn usage(prompt: usize, output: usize, cached: usize) -> Value {
    json!({
        "input_tokens": prompt.saturating_sub(cached),
        "output_tokens": output,
        "cache_read_input_tokens": cached,
    })
}

/// POST /v1/messages/count_tokens
pub async fn count_tokens(State(replica): State<Arc<Replica>>, body: Bytes) -> Response {
    let counted = off_loop(move || {
        let chat = as_chat(&body, true)?;
        chat_prompt(&replica, &chat, false).map(|p| p.ids.len())
    })
    .await;
    match counted {
        Ok(n) => Json(json!({
            "input_tokens": n,
            "context_management": {"original_input_tokens": n},
        }))
        .into_response(),
        Err(e) => anthropic(e),
    }
}

/// POST /v1/messages
pub async fn messages(
    State(replica): State<Arc<Replica>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match serve(replica, headers, body).await {
        Ok(r) => r,
        Err(e) => anthropic(e),
    }
}

async fn serve(
    replica: Arc<Replica>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let pin = replica.rank_pin(&headers)?;
    let (chat, prompt) = off_loop({
        let replica = Arc::clone(&replica);
        move || {
            let chat = as_chat(&body, false)?;
            let prompt = chat_prompt(&replica, &chat, false)?;
            Ok((chat, prompt))
        }
    })
    .await?;
    let (n, finish) = replica.plan_output(prompt.ids.len(), chat.max_tokens)?;
    let output = generate(
        &prompt.ids,
        n,
        false,
        finish,
        replica.config.reasoning_tokens as usize,
    );
    let id = random_id("msg_");
    let (model, prompt_len, job) = prompt.into_job(chat.cache_salt.clone());
    let digest = job.digest();
    let guard = replica.assign(pin)?;
    let rank = guard.engine().rank;
    let stop_reason = if output.finish_reason == "length" {
        "max_tokens"
    } else {
        "end_turn"
    };
    if !chat.stream {
        let cached = run_to_end(guard, &job, &output).await;
        let mut content = Vec::new();
        if let Some(reasoning) = output.reasoning_text().filter(|r| !r.is_empty()) {
            content.push(
                json!({"type": "thinking", "thinking": reasoning, "signature": random_id("sig")}),
            );
        }
        content.push(json!({"type": "text", "text": output.text()}));
        let resp = Json(json!({
            "id": id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": null,
            "usage": usage(prompt_len, output.ids.len(), cached),
        }))
        .into_response();
        return Ok(served(resp, rank, &digest));
    }
    let event = |name: &str, data: Value| Event::default().event(name).data(data.to_string());
    let out = output.clone();
    let events = steps(run_streaming(guard, job, output)).flat_map(move |step| {
        let mut evs = Vec::new();
        match step {
            Step::Prefilled { cached_tokens } => {
                evs.push(event("message_start", json!({"type": "message_start", "message": {
                    "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
                    "stop_reason": null, "stop_sequence": null,
                    "usage": usage(prompt_len, 0, cached_tokens),
                }})));
                evs.push(event("content_block_start", json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})));
            }
            Step::Token(i) => {
                if out.kind(i) == TokenKind::Content {
                    let text = out.pieces.get(i).map_or("", String::as_str);
                    evs.push(event("content_block_delta", json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}})));
                }
            }
            Step::Finished => {
                evs.push(event("content_block_stop", json!({"type": "content_block_stop", "index": 0})));
                evs.push(event("message_delta", json!({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": null}, "usage": {"output_tokens": out.ids.len()}})));
                evs.push(event("message_stop", json!({"type": "message_stop"})));
            }
        }
        futures::stream::iter(evs.into_iter().map(Ok::<_, Infallible>))
    });
    Ok(served(Sse::new(events).into_response(), rank, &digest))
}
