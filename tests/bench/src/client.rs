//! Streaming requests through Envoy (TTFT = the first streamed output token),
//! and the mock's oracle: the request tokenized on a replica, then every
//! replica's `POST /admin/probe` asked what it holds (on real vLLM the
//! fleet's oracle indexd answers instead: [`crate::fleet`]).

use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::workload::Api;

/// The mock replica's name header (its `ip:port`).
pub const REPLICA_HEADER: &str = mock_vllm::REPLICA_HEADER;
/// The upstream host Envoy chose (`ip:port`), added by the gateways' and the
/// fleet's taps' routes.
pub const UPSTREAM_HEADER: &str = kvroute_e2e::envoy::UPSTREAM_HEADER;
/// The filter's reason label.
pub const DECISION_HEADER: &str = kvroute_e2e::stack::DECISION_HEADER;

/// What one streamed request returned.
#[derive(Debug, Clone, Default)]
pub struct Reply {
    /// HTTP status (0: none).
    pub status: u16,
    /// The serving replica's address.
    pub replica: Option<String>,
    /// The filter's decision label.
    pub decision: Option<String>,
    /// The mock's digest of the prompt and salt it ran.
    pub digest: Option<String>,
    /// Prompt tokens from the usage.
    pub prompt_tokens: u64,
    /// Cached prompt tokens from the usage.
    pub cached_tokens: u64,
    /// Output text.
    pub content: String,
    /// Reasoning text.
    pub reasoning: String,
    /// Time to the first streamed output token (reasoning or content).
    pub ttft: Option<Duration>,
    /// Time to the end of the stream.
    pub latency: Duration,
    /// What went wrong, if anything.
    pub error: Option<String>,
}

/// A blocking HTTP agent with a global timeout that reads non-2xx bodies.
pub fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .http_status_as_error(false)
        .build()
        .into()
}

/// Sends `body` (with `stream: true` set here) to `base` + the API's path,
/// with `headers` added, and reads the stream to its end.
pub fn stream(
    agent: &ureq::Agent,
    base: &str,
    api: Api,
    body: &Value,
    headers: &[(&str, String)],
) -> Reply {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let path = match api {
        Api::Chat => {
            body["stream_options"] = json!({"include_usage": true});
            "/v1/chat/completions"
        }
        Api::Responses => "/v1/responses",
        Api::Messages => "/v1/messages",
    };
    let started = Instant::now();
    let mut reply = Reply::default();
    let mut request = agent
        .post(&format!("{base}{path}"))
        .header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, value.as_str());
    }
    let result = request.send(body.to_string().as_bytes());
    let mut response = match result {
        Ok(r) => r,
        Err(e) => {
            reply.latency = started.elapsed();
            reply.error = Some(format!("transport: {e}"));
            return reply;
        }
    };
    reply.status = response.status().as_u16();
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    // The mock names itself; before a real replica, the gateway's Envoy
    // (or the fleet's tap) names the upstream it chose.
    reply.replica = header(REPLICA_HEADER).or_else(|| header(UPSTREAM_HEADER));
    reply.decision = header(DECISION_HEADER);
    reply.digest = header(mock_vllm::PROMPT_DIGEST_HEADER);
    if reply.status != 200 {
        let text = response
            .body_mut()
            .read_to_string()
            .unwrap_or_else(|e| format!("reading body: {e}"));
        reply.latency = started.elapsed();
        reply.error = Some(format!(
            "HTTP {}: {}",
            reply.status,
            text.chars().take(200).collect::<String>()
        ));
        return reply;
    }
    let reader = BufReader::new(response.body_mut().as_reader());
    let mut done = false;
    for line in reader.lines() {
        let line = match line {
            Ok(l) => l,
            Err(e) => {
                reply.error = Some(format!("reading stream: {e}"));
                break;
            }
        };
        let Some(data) = line.strip_prefix("data:").map(str::trim) else {
            continue;
        };
        if data == "[DONE]" {
            // Read on to the end of the body: the request is over for Envoy
            // (its active-request count) only when the stream is.
            done = true;
            continue;
        }
        let Ok(event) = serde_json::from_str::<Value>(data) else {
            continue;
        };
        let got_token = match api {
            Api::Chat => chat_event(&event, &mut reply),
            Api::Messages => {
                let (token, finished) = messages_event(&event, &mut reply);
                done |= finished;
                token
            }
            Api::Responses => {
                let finished = responses_event(&event, &mut reply);
                if finished {
                    done = true;
                }
                false
            }
        } || (api == Api::Responses && is_token_event(&event));
        if got_token && reply.ttft.is_none() {
            reply.ttft = Some(started.elapsed());
        }
    }
    reply.latency = started.elapsed();
    if !done && reply.error.is_none() {
        reply.error = Some("stream ended early".into());
    }
    reply
}

/// Folds one chat chunk into the reply; `true` when it carried output text.
fn chat_event(event: &Value, reply: &mut Reply) -> bool {
    let usage = &event["usage"];
    if let Some(p) = usage["prompt_tokens"].as_u64() {
        reply.prompt_tokens = p;
        reply.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
    }
    let delta = &event["choices"][0]["delta"];
    let mut token = false;
    if let Some(t) = delta["content"].as_str().filter(|t| !t.is_empty()) {
        reply.content.push_str(t);
        token = true;
    }
    if let Some(t) = delta["reasoning_content"]
        .as_str()
        .filter(|t| !t.is_empty())
    {
        reply.reasoning.push_str(t);
        token = true;
    }
    token
}

/// One event of an Anthropic Messages stream: whether it carried a token,
/// and whether it ended the message. The usage comes with `message_start`
/// and, whole (vLLM's), with `message_delta`: the prompt is its
/// `input_tokens` plus what the cache served or was written.
fn messages_event(event: &Value, reply: &mut Reply) -> (bool, bool) {
    let mut usage = |u: &Value| {
        if let Some(input) = u["input_tokens"].as_u64() {
            let cached = u["cache_read_input_tokens"].as_u64().unwrap_or(0);
            let created = u["cache_creation_input_tokens"].as_u64().unwrap_or(0);
            reply.prompt_tokens = input + cached + created;
            reply.cached_tokens = cached;
        }
    };
    match event["type"].as_str() {
        Some("message_start") => {
            usage(&event["message"]["usage"]);
            (false, false)
        }
        Some("message_delta") => {
            usage(&event["usage"]);
            (false, false)
        }
        Some("content_block_delta") => {
            let delta = &event["delta"];
            let (text, into) = match delta["type"].as_str() {
                Some("text_delta") => (delta["text"].as_str(), &mut reply.content),
                Some("thinking_delta") => (delta["thinking"].as_str(), &mut reply.reasoning),
                _ => (None, &mut reply.content),
            };
            let text = text.unwrap_or_default();
            into.push_str(text);
            (!text.is_empty(), false)
        }
        Some("message_stop") => (false, true),
        _ => (false, false),
    }
}

fn is_token_event(event: &Value) -> bool {
    matches!(
        event["type"].as_str(),
        Some("response.output_text.delta" | "response.reasoning_text.delta")
    )
}

/// Folds one Responses event into the reply; `true` at `response.completed`.
fn responses_event(event: &Value, reply: &mut Reply) -> bool {
    match event["type"].as_str() {
        Some("response.output_text.delta") => {
            reply
                .content
                .push_str(event["delta"].as_str().unwrap_or_default());
            false
        }
        Some("response.reasoning_text.delta") => {
            reply
                .reasoning
                .push_str(event["delta"].as_str().unwrap_or_default());
            false
        }
        Some("response.completed") => {
            let usage = &event["response"]["usage"];
            reply.prompt_tokens = usage["input_tokens"].as_u64().unwrap_or(0);
            reply.cached_tokens = usage["input_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0);
            true
        }
        _ => false,
    }
}

/// The request's prompt token ids, rendered by a replica exactly as it will
/// be served (`/tokenize` for chat, `/v1/responses/render` for Responses).
pub fn tokenize(
    agent: &ureq::Agent,
    replica: &str,
    api: Api,
    body: &Value,
) -> Result<Vec<u32>, String> {
    let (path, request, field) = match api {
        Api::Chat => {
            let mut t = json!({"model": body["model"], "messages": body["messages"]});
            if !body["tools"].is_null() {
                t["tools"] = body["tools"].clone();
            }
            ("/tokenize", t, "tokens")
        }
        Api::Responses => ("/v1/responses/render", body.clone(), "token_ids"),
        // The chat body vLLM converts it to (a body the template cannot
        // change: no inline system message, no thinking disabled).
        Api::Messages => {
            let chat = kvroute_tokenizer::MessagesRequest::from_json(body.to_string().as_bytes())
                .and_then(|m| m.to_chat(&kvroute_tokenizer::MessagesConversion::default()))
                .and_then(|c| c.to_json())
                .map_err(|e| format!("the Messages body: {e}"))?;
            let chat: Value = serde_json::from_str(&chat).map_err(|e| e.to_string())?;
            ("/tokenize", chat, "tokens")
        }
    };
    let doc = post_json(agent, &format!("http://{replica}{path}"), &request)?;
    serde_json::from_value(doc[field].clone()).map_err(|e| format!("{path}: {e}"))
}

/// `hit_tokens` of `token_ids` on one replica's admin API.
pub fn probe(
    agent: &ureq::Agent,
    admin: &str,
    model: &str,
    salt: Option<&str>,
    token_ids: &[u32],
) -> Result<u64, String> {
    let mut body = json!({"model": model, "token_ids": token_ids});
    if let Some(salt) = salt {
        body["cache_salt"] = json!(salt);
    }
    let doc = post_json(agent, &format!("http://{admin}/admin/probe"), &body)?;
    doc["hit_tokens"]
        .as_u64()
        .ok_or_else(|| format!("probe answered without hit_tokens: {doc}"))
}

/// POSTs JSON and parses a 200 answer's JSON body.
pub fn post_json(agent: &ureq::Agent, url: &str, body: &Value) -> Result<Value, String> {
    let mut response = agent
        .post(url)
        .header("content-type", "application/json")
        .send(body.to_string().as_bytes())
        .map_err(|e| format!("{url}: {e}"))?;
    let status = response.status().as_u16();
    let text = response
        .body_mut()
        .with_config()
        .limit(64 * 1024 * 1024)
        .read_to_string()
        .map_err(|e| format!("{url}: {e}"))?;
    if status != 200 {
        return Err(format!(
            "{url}: HTTP {status}: {}",
            text.chars().take(200).collect::<String>()
        ));
    }
    serde_json::from_str(&text).map_err(|e| format!("{url}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_chunks_fold_into_the_reply() {
        let mut r = Reply::default();
        assert!(!chat_event(
            &json!({"choices": [{"delta": {"role": "assistant", "content": ""}}]}),
            &mut r
        ));
        assert!(chat_event(
            &json!({"choices": [{"delta": {"reasoning_content": "hm"}}]}),
            &mut r
        ));
        assert!(chat_event(
            &json!({"choices": [{"delta": {"content": "hi"}}]}),
            &mut r
        ));
        chat_event(
            &json!({"choices": [], "usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 8}}}),
            &mut r,
        );
        assert_eq!((r.content.as_str(), r.reasoning.as_str()), ("hi", "hm"));
        assert_eq!((r.prompt_tokens, r.cached_tokens), (10, 8));
    }

    #[test]
    fn responses_events_fold_into_the_reply() {
        let mut r = Reply::default();
        let delta = json!({"type": "response.output_text.delta", "delta": "ok"});
        assert!(is_token_event(&delta));
        assert!(!responses_event(&delta, &mut r));
        let done = json!({"type": "response.completed", "response": {"usage": {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 5}}}});
        assert!(responses_event(&done, &mut r));
        assert_eq!(
            (r.content.as_str(), r.prompt_tokens, r.cached_tokens),
            ("ok", 7, 5)
        );
    }
}
