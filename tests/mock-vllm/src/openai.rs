//! `/v1/completions` and `/v1/chat/completions` (streaming and not), and the prompt building
//! they share with `/tokenize` and the render endpoints.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::api::served;
use crate::engine::{Job, ModelRef, Replica};
use crate::error::{ApiError, off_loop, parse_json, validate_cache_salt};
use crate::generate::{Output, TokenKind, generate};
use crate::runner::{Step, run_streaming, run_to_end, steps};
use crate::template::{RenderOptions, parse_chat_messages, render, render_chat_tokens};

/// `stream_options`.
#[derive(Debug, Default, Clone, Copy, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Fields of a completion-style body (`/v1/completions`, `/tokenize` completion form).
#[derive(Debug, Deserialize)]
pub struct CompletionBody {
    pub model: Option<String>,
    pub prompt: Option<Value>,
    pub max_tokens: Option<u64>,
    pub n: Option<u32>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub cache_salt: Option<String>,
    pub add_special_tokens: Option<bool>,
    #[serde(default)]
    pub return_token_strs: bool,
}

/// Fields of a chat-style body (`/v1/chat/completions`, `/tokenize` chat form).
#[derive(Debug, Deserialize)]
pub struct ChatBody {
    pub model: Option<String>,
    pub messages: Value,
    pub tools: Option<Value>,
    pub add_generation_prompt: Option<bool>,
    #[serde(default)]
    pub continue_final_message: bool,
    #[serde(default)]
    pub add_special_tokens: bool,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub n: Option<u32>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub cache_salt: Option<String>,
    #[serde(default)]
    pub return_token_strs: bool,
}

/// A tokenized prompt: ids plus the piece strings when asked for.
#[derive(Debug)]
pub struct Prompt {
    pub model: ModelRef,
    pub ids: Vec<u32>,
    pub strs: Option<Vec<String>>,
}

impl Prompt {
    /// The engine job for this prompt, with the served model's name and the
    /// prompt length that the response reports.
    pub(crate) fn into_job(self, cache_salt: Option<String>) -> (String, usize, Job) {
        let name = self.model.name.clone();
        let len = self.ids.len();
        let job = Job {
            model: self.model,
            prompt: self.ids,
            cache_salt,
        };
        (name, len, job)
    }
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub fn random_id(prefix: &str) -> String {
    format!("{prefix}{:032x}", rand::random::<u128>())
}

/// The mock generates one choice per request; asking for more is refused rather than ignored.
fn single_choice(n: Option<u32>) -> Result<(), ApiError> {
    match n {
        None | Some(1) => Ok(()),
        Some(n) => Err(ApiError::bad_request(format!(
            "mock-vllm generates one choice per request, got n={n}"
        ))
        .with_param("n")),
    }
}

/// Builds the completion prompt (`prompt`: a string, a token-id list, or a one-element list).
pub fn completion_prompt(
    replica: &Replica,
    body: &CompletionBody,
    with_strs: bool,
) -> Result<Prompt, ApiError> {
    let model = replica.resolve_model(body.model.as_deref())?;
    validate_cache_salt(body.cache_salt.as_deref())?;
    let add_special = body.add_special_tokens.unwrap_or(true);
    let prompt = body
        .prompt
        .as_ref()
        .ok_or_else(|| ApiError::bad_request("`prompt` is required").with_param("prompt"))?;
    let single = match prompt {
        Value::Array(items) if items.len() == 1 && !items[0].is_number() => &items[0],
        other => other,
    };
    let tok = &replica.tokenizer;
    let (ids, strs) = match single {
        Value::String(text) => (
            tok.encode(text, add_special),
            with_strs.then(|| tok.token_strs(text, add_special)),
        ),
        Value::Array(items) if items.iter().all(Value::is_u64) => {
            let ids: Vec<u32> = items
                .iter()
                .filter_map(Value::as_u64)
                .map(|v| u32::try_from(v).unwrap_or(u32::MAX))
                .collect();
            if let Some(bad) = ids.iter().find(|&&t| t >= crate::tokenizer::VOCAB_SIZE) {
                return Err(ApiError::bad_request(format!(
                    "Token id {bad} is out of vocabulary"
                )));
            }
            (ids, None)
        }
        Value::Array(_) => {
            return Err(ApiError::bad_request(
                "mock-vllm supports one prompt per request (a string or a list of token ids)",
            )
            .with_param("prompt"));
        }
        _ => {
            return Err(
                ApiError::bad_request("`prompt` must be a string or token ids")
                    .with_param("prompt"),
            );
        }
    };
    if ids.is_empty() {
        return Err(ApiError::bad_request("The prompt cannot be empty").with_param("prompt"));
    }
    Ok(Prompt { model, ids, strs })
}

/// Builds the chat prompt exactly as `/tokenize`'s chat form does.
pub fn chat_prompt(
    replica: &Replica,
    body: &ChatBody,
    with_strs: bool,
) -> Result<Prompt, ApiError> {
    let model = replica.resolve_model(body.model.as_deref())?;
    validate_cache_salt(body.cache_salt.as_deref())?;
    let messages = parse_chat_messages(&body.messages).map_err(|e| ApiError::bad_request(e.0))?;
    let opts = RenderOptions {
        template: replica.config.chat_template,
        tools: body.tools.as_ref(),
        add_generation_prompt: body.add_generation_prompt.unwrap_or(true),
        continue_final_message: body.continue_final_message,
    };
    let ids = render_chat_tokens(&replica.tokenizer, &messages, opts, body.add_special_tokens)
        .map_err(|e| ApiError::bad_request(e.0))?;
    let strs = if with_strs {
        let text = render(&messages, opts).map_err(|e| ApiError::bad_request(e.0))?;
        Some(replica.tokenizer.token_strs(&text, body.add_special_tokens))
    } else {
        None
    };
    Ok(Prompt { model, ids, strs })
}

fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

fn sse_json(v: &Value) -> Event {
    Event::default().data(v.to_string())
}

/// POST /v1/completions
pub async fn completions(
    State(replica): State<Arc<Replica>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let pin = replica.rank_pin(&headers)?;
    let (body, prompt) = off_loop({
        let replica = Arc::clone(&replica);
        move || {
            let body: CompletionBody = parse_json(&body)?;
            single_choice(body.n)?;
            let prompt = completion_prompt(&replica, &body, false)?;
            Ok((body, prompt))
        }
    })
    .await?;
    let (n, finish) = replica.plan_output(prompt.ids.len(), body.max_tokens)?;
    let output = generate(&prompt.ids, n, true, finish, 0);
    let id = random_id("cmpl-");
    let created = now_secs();
    let (model, prompt_len, job) = prompt.into_job(body.cache_salt.clone());
    let digest = job.digest();
    let guard = replica.assign(pin)?;
    let rank = guard.engine().rank;
    if !body.stream {
        let cached = run_to_end(guard, &job, &output).await;
        let resp = Json(json!({
            "id": id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [{
                "index": 0,
                "text": output.text(),
                "logprobs": null,
                "finish_reason": output.finish_reason,
                "stop_reason": null,
                "prompt_logprobs": null,
            }],
            "usage": usage(prompt_len, output.ids.len(), cached),
        }))
        .into_response();
        return Ok(served(resp, rank, &digest));
    }
    let include_usage = body.stream_options.unwrap_or_default().include_usage;
    let chunk = move |text: &str, finish: Value| {
        json!({
            "id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish, "stop_reason": null}],
        })
    };
    let out = output.clone();
    let mut cached = 0;
    let events = steps(run_streaming(guard, job, output)).flat_map(move |step| {
        let mut evs = Vec::new();
        match step {
            Step::Prefilled { cached_tokens } => cached = cached_tokens,
            Step::Token(i) => {
                let last = i + 1 == out.ids.len();
                let finish = if last {
                    json!(out.finish_reason)
                } else {
                    Value::Null
                };
                let text = out.pieces.get(i).map_or("", String::as_str);
                evs.push(sse_json(&chunk(text, finish)));
            }
            Step::Finished => {
                if include_usage {
                    let mut u = chunk("", Value::Null);
                    u["choices"] = json!([]);
                    u["usage"] = usage(prompt_len, out.ids.len(), cached);
                    evs.push(sse_json(&u));
                }
                evs.push(Event::default().data("[DONE]"));
            }
        }
        futures::stream::iter(evs.into_iter().map(Ok::<_, Infallible>))
    });
    Ok(served(Sse::new(events).into_response(), rank, &digest))
}

/// POST /v1/chat/completions
pub async fn chat_completions(
    State(replica): State<Arc<Replica>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let pin = replica.rank_pin(&headers)?;
    let (body, prompt) = off_loop({
        let replica = Arc::clone(&replica);
        move || {
            let body: ChatBody = parse_json(&body)?;
            single_choice(body.n)?;
            let prompt = chat_prompt(&replica, &body, false)?;
            Ok((body, prompt))
        }
    })
    .await?;
    let max_tokens = body.max_completion_tokens.or(body.max_tokens);
    let (n, finish) = replica.plan_output(prompt.ids.len(), max_tokens)?;
    let output = generate(
        &prompt.ids,
        n,
        false,
        finish,
        replica.config.reasoning_tokens as usize,
    );
    let id = random_id("chatcmpl-");
    let created = now_secs();
    let (model, prompt_len, job) = prompt.into_job(body.cache_salt.clone());
    let digest = job.digest();
    let guard = replica.assign(pin)?;
    let rank = guard.engine().rank;
    if !body.stream {
        let cached = run_to_end(guard, &job, &output).await;
        let resp = Json(json!({
            "id": id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [{
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": output.text(),
                    "reasoning_content": output.reasoning_text(),
                    "tool_calls": [],
                },
                "logprobs": null,
                "finish_reason": output.finish_reason,
                "stop_reason": null,
            }],
            "usage": usage(prompt_len, output.ids.len(), cached),
            "prompt_logprobs": null,
        }))
        .into_response();
        return Ok(served(resp, rank, &digest));
    }
    let include_usage = body.stream_options.unwrap_or_default().include_usage;
    let chunk = move |delta: Value, finish: Value| {
        json!({
            "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
        })
    };
    let out = output.clone();
    let mut cached = 0;
    let events = steps(run_streaming(guard, job, output)).flat_map(move |step| {
        let mut evs = Vec::new();
        match step {
            Step::Prefilled { cached_tokens } => {
                cached = cached_tokens;
                evs.push(sse_json(&chunk(
                    json!({"role": "assistant", "content": ""}),
                    Value::Null,
                )));
            }
            Step::Token(i) => {
                let last = i + 1 == out.ids.len();
                let finish = if last {
                    json!(out.finish_reason)
                } else {
                    Value::Null
                };
                let text = out.pieces.get(i).map_or("", String::as_str);
                match out.kind(i) {
                    TokenKind::Content => {
                        evs.push(sse_json(&chunk(json!({"content": text}), finish)))
                    }
                    TokenKind::Reasoning => {
                        evs.push(sse_json(&chunk(json!({"reasoning_content": text}), finish)));
                    }
                    TokenKind::Marker => {}
                }
            }
            Step::Finished => {
                if include_usage {
                    let mut u = chunk(Value::Null, Value::Null);
                    u["choices"] = json!([]);
                    u["usage"] = usage(prompt_len, out.ids.len(), cached);
                    evs.push(sse_json(&u));
                }
                evs.push(Event::default().data("[DONE]"));
            }
        }
        futures::stream::iter(evs.into_iter().map(Ok::<_, Infallible>))
    });
    Ok(served(Sse::new(events).into_response(), rank, &digest))
}

/// Output for a prompt that was already checked (shared with Responses).
pub fn plan(
    replica: &Replica,
    prompt_len: usize,
    max_tokens: Option<u64>,
    prompt: &[u32],
) -> Result<Output, ApiError> {
    let (n, finish) = replica.plan_output(prompt_len, max_tokens)?;
    Ok(generate(
        prompt,
        n,
        false,
        finish,
        replica.config.reasoning_tokens as usize,
    ))
}
