//! OpenAI-style requests through the stack, and what came back.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::stack::DECISION_HEADER;
use crate::{HarnessError, http};

/// The mock replica's name header (its `ip:port`).
pub const REPLICA_HEADER: &str = mock_vllm::REPLICA_HEADER;
/// The mock's header naming the data-parallel rank that served.
pub const RANK_HEADER: &str = mock_vllm::RANK_HEADER;

/// One request's outcome.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// HTTP status.
    pub status: u16,
    /// The replica that served it (`ip:port`), if a replica answered.
    pub replica: Option<String>,
    /// The filter's reason label, when the decision header is on.
    pub decision: Option<String>,
    /// The data-parallel rank that served (mock only).
    pub rank: Option<String>,
    /// `usage.prompt_tokens` (`input_tokens` for Responses; for Anthropic
    /// Messages, `input_tokens` + `cache_read_input_tokens` +
    /// `cache_creation_input_tokens`).
    pub prompt_tokens: u64,
    /// `…tokens_details.cached_tokens` (Messages: `cache_read_input_tokens`).
    pub cached_tokens: u64,
    /// The Responses API id, if any.
    pub response_id: Option<String>,
    /// Assistant text (chat) or output text (Responses).
    pub text: String,
    /// Wall time of the request.
    pub latency: Duration,
    /// The raw body.
    pub body: String,
}

const TIMEOUT: Duration = Duration::from_secs(60);

/// POSTs `body` as JSON to `base` + `path` and reads the usage back.
pub fn post_json(
    base: &str,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> Result<Outcome, HarnessError> {
    let mut all = vec![("content-type", "application/json")];
    all.extend_from_slice(headers);
    let bytes = body.to_string();
    post_raw(base, path, bytes.as_bytes(), &all)
}

/// POSTs raw bytes (for malformed bodies) and reads what it can.
pub fn post_raw(
    base: &str,
    path: &str,
    body: &[u8],
    headers: &[(&str, &str)],
) -> Result<Outcome, HarnessError> {
    let started = Instant::now();
    let response = http::post(&format!("{base}{path}"), headers, body, TIMEOUT)?;
    let latency = started.elapsed();
    let doc: Value = serde_json::from_str(&response.body).unwrap_or(Value::Null);
    let usage = &doc["usage"];
    let count = |key: &str| usage[key].as_u64().unwrap_or(0);
    // Anthropic's input_tokens leaves out what the cache served.
    let anthropic = doc["type"] == "message";
    let prompt_tokens = if anthropic {
        count("input_tokens")
            + count("cache_read_input_tokens")
            + count("cache_creation_input_tokens")
    } else {
        usage["prompt_tokens"]
            .as_u64()
            .or_else(|| usage["input_tokens"].as_u64())
            .unwrap_or(0)
    };
    let cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .or_else(|| usage["input_tokens_details"]["cached_tokens"].as_u64())
        .or_else(|| usage["cache_read_input_tokens"].as_u64())
        .unwrap_or(0);
    let text = doc["choices"][0]["message"]["content"]
        .as_str()
        .or_else(|| doc["choices"][0]["text"].as_str())
        .map(str::to_owned)
        .or_else(|| responses_text(&doc))
        .or_else(|| messages_text(&doc))
        .unwrap_or_default();
    Ok(Outcome {
        status: response.status,
        replica: response
            .header(REPLICA_HEADER)
            .or_else(|| response.header(crate::envoy::UPSTREAM_HEADER))
            .map(str::to_owned),
        decision: response.header(DECISION_HEADER).map(str::to_owned),
        rank: response.header(RANK_HEADER).map(str::to_owned),
        prompt_tokens,
        cached_tokens,
        response_id: doc["id"]
            .as_str()
            .filter(|id| id.starts_with("resp"))
            .map(str::to_owned),
        text,
        latency,
        body: response.body,
    })
}

/// An Anthropic Messages answer's text blocks.
fn messages_text(doc: &Value) -> Option<String> {
    let content = doc["content"].as_array()?;
    Some(
        content
            .iter()
            .filter(|b| b["type"] == "text")
            .filter_map(|b| b["text"].as_str())
            .collect(),
    )
}

fn responses_text(doc: &Value) -> Option<String> {
    let output = doc["output"].as_array()?;
    let text: String = output
        .iter()
        .filter(|item| item["type"] == "message")
        .flat_map(|item| item["content"].as_array().into_iter().flatten())
        .filter_map(|part| part["text"].as_str())
        .collect();
    Some(text)
}

/// A chat completion request body.
pub fn chat_body(model: &str, messages: &[Value], salt: Option<&str>) -> Value {
    let mut body = json!({ "model": model, "messages": messages, "max_tokens": 4 });
    if let Some(salt) = salt {
        body["cache_salt"] = json!(salt);
    }
    body
}

/// A chat message.
pub fn message(role: &str, content: &str) -> Value {
    json!({ "role": role, "content": content })
}

/// Deterministic filler text of about `words` words (distinct per `seed`).
pub fn filler(seed: u64, words: usize) -> String {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = String::with_capacity(words * 7);
    for i in 0..words {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if i > 0 {
            out.push(' ');
        }
        out.push_str(&format!("w{}", x % 50_000));
    }
    out
}
