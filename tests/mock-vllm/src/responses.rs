//! `/v1/responses` (streaming and not), `GET /v1/responses/{id}`, and the Responses prompt.
//!
//! The store is per replica, shared by its data-parallel ranks (vLLM's API server keeps it):
//! `previous_response_id` naming a response this replica did not store (or forgot in a restart)
//! is a 404.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::api::served;
use crate::engine::{Job, ModelRef, Replica, StoredResponse};
use crate::error::{ApiError, off_loop, parse_json, validate_cache_salt};
use crate::generate::{Output, TokenKind};
use crate::openai::{plan, random_id};
use crate::runner::{Step, run_streaming, run_to_end, steps};
use crate::template::{Message, RenderOptions, parse_responses_input, render_responses_tokens};

/// Fields of a Responses body.
#[derive(Debug, Deserialize)]
pub struct ResponsesBody {
    pub model: Option<String>,
    pub input: Option<Value>,
    pub instructions: Option<String>,
    pub tools: Option<Value>,
    pub previous_response_id: Option<String>,
    pub max_output_tokens: Option<u64>,
    #[serde(default)]
    pub stream: bool,
    pub store: Option<bool>,
    pub cache_salt: Option<String>,
}

/// A Responses prompt: ids and the conversation (without instructions) it was built from.
#[derive(Debug)]
pub struct ResponsesPrompt {
    pub model: ModelRef,
    pub ids: Vec<u32>,
    pub conversation: Vec<Message>,
}

/// Builds the prompt: instructions, the stored conversation of `previous_response_id`, the input.
pub fn responses_prompt(
    replica: &Replica,
    body: &ResponsesBody,
) -> Result<ResponsesPrompt, ApiError> {
    let model = replica.resolve_model(body.model.as_deref())?;
    validate_cache_salt(body.cache_salt.as_deref())?;
    let mut conversation = match &body.previous_response_id {
        Some(id) => {
            replica
                .response(id)
                .ok_or_else(|| {
                    ApiError::not_found(format!("Response with id '{id}' not found."))
                        .with_param("previous_response_id")
                })?
                .messages
        }
        None => Vec::new(),
    };
    let input = body
        .input
        .as_ref()
        .ok_or_else(|| ApiError::bad_request("`input` is required").with_param("input"))?;
    conversation.extend(parse_responses_input(input).map_err(|e| ApiError::bad_request(e.0))?);
    let mut messages = Vec::with_capacity(conversation.len() + 1);
    if let Some(instr) = &body.instructions {
        messages.push(Message::new("system", instr.clone()));
    }
    messages.extend(conversation.iter().cloned());
    let opts = RenderOptions {
        template: replica.config.chat_template,
        tools: body.tools.as_ref(),
        add_generation_prompt: true,
        continue_final_message: false,
    };
    let ids = render_responses_tokens(&replica.tokenizer, &messages, opts)
        .map_err(|e| ApiError::bad_request(e.0))?;
    Ok(ResponsesPrompt {
        model,
        ids,
        conversation,
    })
}

/// Everything needed to write the response object.
#[derive(Debug, Clone)]
struct Meta {
    id: String,
    msg_id: String,
    rs_id: String,
    created_at: u64,
    model: String,
    instructions: Option<String>,
    previous_response_id: Option<String>,
    tools: Value,
    store: bool,
    prompt_len: usize,
}

impl Meta {
    fn object(&self, status: &str, output: Option<&Output>, cached: usize) -> Value {
        let (items, usage) = match output {
            Some(out) => (
                Value::Array(
                    out.reasoning_text()
                        .map(|r| self.reasoning_item("completed", &r))
                        .into_iter()
                        .chain([self.message_item("completed", &out.text())])
                        .collect(),
                ),
                json!({
                    "input_tokens": self.prompt_len,
                    "input_tokens_details": {"cached_tokens": cached},
                    "output_tokens": out.ids.len(),
                    "output_tokens_details": {"reasoning_tokens": out.reasoning.len()},
                    "total_tokens": self.prompt_len + out.ids.len(),
                }),
            ),
            None => (json!([]), Value::Null),
        };
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model,
            "status": status,
            "instructions": self.instructions,
            "previous_response_id": self.previous_response_id,
            "output": items,
            "parallel_tool_calls": true,
            "tool_choice": "auto",
            "tools": self.tools,
            "store": self.store,
            "usage": usage,
        })
    }

    fn message_item(&self, status: &str, text: &str) -> Value {
        let content = if status == "completed" {
            json!([{"type": "output_text", "text": text, "annotations": [], "logprobs": []}])
        } else {
            json!([])
        };
        json!({"id": self.msg_id, "type": "message", "status": status, "role": "assistant", "content": content})
    }

    fn reasoning_item(&self, status: &str, text: &str) -> Value {
        let content = if status == "completed" {
            json!([{"type": "reasoning_text", "text": text}])
        } else {
            json!([])
        };
        json!({"id": self.rs_id, "type": "reasoning", "status": status, "summary": [], "content": content})
    }
}

/// Turns engine steps into Responses stream events (`response.created` … `response.completed`).
struct StreamWriter {
    meta: Meta,
    out: Output,
    replica: Arc<Replica>,
    conversation: Option<Vec<Message>>,
    cached: usize,
    message_started: bool,
}

impl StreamWriter {
    /// Output index of the message item (after the reasoning item, when there is one).
    fn msg_index(&self) -> usize {
        usize::from(!self.out.reasoning.is_empty())
    }

    fn start_message(&mut self, evs: &mut Vec<(&'static str, Value)>) {
        if self.message_started {
            return;
        }
        self.message_started = true;
        let idx = self.msg_index();
        if let Some(r) = self.out.reasoning_text() {
            let loc = json!({"item_id": self.meta.rs_id, "output_index": 0, "content_index": 0, "text": r});
            evs.push(("response.reasoning_text.done", loc));
            let item = self.meta.reasoning_item("completed", &r);
            evs.push((
                "response.output_item.done",
                json!({"output_index": 0, "item": item}),
            ));
        }
        let item = self.meta.message_item("in_progress", "");
        evs.push((
            "response.output_item.added",
            json!({"output_index": idx, "item": item}),
        ));
        let mut e = self.text_loc();
        e["part"] = text_part("");
        evs.push(("response.content_part.added", e));
    }

    fn text_loc(&self) -> Value {
        json!({"item_id": self.meta.msg_id, "output_index": self.msg_index(), "content_index": 0})
    }

    fn events(&mut self, step: Step) -> Vec<(&'static str, Value)> {
        let mut evs = Vec::new();
        match step {
            Step::Prefilled { cached_tokens } => {
                self.cached = cached_tokens;
                let obj = self.meta.object("in_progress", None, 0);
                evs.push(("response.created", json!({"response": obj})));
                evs.push(("response.in_progress", json!({"response": obj})));
                if self.out.reasoning.is_empty() {
                    self.start_message(&mut evs);
                } else {
                    let item = self.meta.reasoning_item("in_progress", "");
                    evs.push((
                        "response.output_item.added",
                        json!({"output_index": 0, "item": item}),
                    ));
                }
            }
            Step::Token(i) => {
                let delta = self.out.pieces.get(i).cloned().unwrap_or_default();
                match self.out.kind(i) {
                    TokenKind::Reasoning => {
                        let e = json!({"item_id": self.meta.rs_id, "output_index": 0, "content_index": 0, "delta": delta});
                        evs.push(("response.reasoning_text.delta", e));
                    }
                    TokenKind::Marker => {}
                    TokenKind::Content => {
                        self.start_message(&mut evs);
                        let mut e = self.text_loc();
                        e["delta"] = json!(delta);
                        e["logprobs"] = json!([]);
                        evs.push(("response.output_text.delta", e));
                    }
                }
            }
            Step::Finished => {
                self.start_message(&mut evs);
                let text = self.out.text();
                let mut e = self.text_loc();
                e["text"] = json!(text);
                e["logprobs"] = json!([]);
                evs.push(("response.output_text.done", e));
                let mut e = self.text_loc();
                e["part"] = text_part(&text);
                evs.push(("response.content_part.done", e));
                let item = self.meta.message_item("completed", &text);
                evs.push((
                    "response.output_item.done",
                    json!({"output_index": self.msg_index(), "item": item}),
                ));
                let obj = self.meta.object("completed", Some(&self.out), self.cached);
                if let Some(conv) = self.conversation.take() {
                    store(&self.replica, &self.meta, conv, &self.out, obj.clone());
                }
                evs.push(("response.completed", json!({"response": obj})));
            }
        }
        evs
    }
}

fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

fn store(replica: &Replica, meta: &Meta, conversation: Vec<Message>, output: &Output, body: Value) {
    if !meta.store {
        return;
    }
    let mut messages = conversation;
    let mut answer = Message::new("assistant", output.text());
    answer.reasoning = output.reasoning_text();
    messages.push(answer);
    replica.store_response(meta.id.clone(), StoredResponse { messages, body });
}

/// POST /v1/responses
pub async fn responses(
    State(replica): State<Arc<Replica>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let pin = replica.rank_pin(&headers)?;
    let (body, prompt) = off_loop({
        let replica = Arc::clone(&replica);
        move || {
            let body: ResponsesBody = parse_json(&body)?;
            let prompt = responses_prompt(&replica, &body)?;
            Ok((body, prompt))
        }
    })
    .await?;
    let output = plan(
        &replica,
        prompt.ids.len(),
        body.max_output_tokens,
        &prompt.ids,
    )?;
    let meta = Meta {
        id: random_id("resp_"),
        msg_id: random_id("msg_"),
        rs_id: random_id("rs_"),
        created_at: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        model: prompt.model.name.clone(),
        instructions: body.instructions.clone(),
        previous_response_id: body.previous_response_id.clone(),
        tools: body.tools.clone().unwrap_or_else(|| json!([])),
        store: body.store.unwrap_or(true),
        prompt_len: prompt.ids.len(),
    };
    let job = Job {
        model: prompt.model,
        prompt: prompt.ids,
        cache_salt: body.cache_salt.clone(),
    };
    let conversation = prompt.conversation;
    let digest = job.digest();
    let guard = replica.assign(pin)?;
    let rank = guard.engine().rank;
    if !body.stream {
        let cached = run_to_end(guard, &job, &output).await;
        let obj = meta.object("completed", Some(&output), cached);
        store(&replica, &meta, conversation, &output, obj.clone());
        return Ok(served(Json(obj).into_response(), rank, &digest));
    }
    let mut writer = StreamWriter {
        meta,
        out: output.clone(),
        replica: replica.clone(),
        conversation: Some(conversation),
        cached: 0,
        message_started: false,
    };
    let mut seq = 0u64;
    let events = steps(run_streaming(guard, job, output)).flat_map(move |step| {
        let events: Vec<Result<Event, Infallible>> = writer
            .events(step)
            .into_iter()
            .map(|(kind, mut data)| {
                data["type"] = json!(kind);
                data["sequence_number"] = json!(seq);
                seq += 1;
                Ok(Event::default().event(kind).data(data.to_string()))
            })
            .collect();
        futures::stream::iter(events)
    });
    Ok(served(Sse::new(events).into_response(), rank, &digest))
}

/// GET /v1/responses/{id}
pub async fn get_response(
    State(replica): State<Arc<Replica>>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    replica
        .response(&id)
        .map(|r| Json(r.body))
        .ok_or_else(|| ApiError::not_found(format!("Response with id '{id}' not found.")))
}
