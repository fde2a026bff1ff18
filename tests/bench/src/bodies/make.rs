//! The request bodies of `bodies`, seeded, of about a given size.
//!
//! - chat: many messages of text (user and assistant alternating), one
//!   token per word in the mock's tokenizer;
//! - completions with a token-id prompt (no tokenizer call: the filter keys
//!   the ids themselves);
//! - Responses: many input message items of text (the filter's tokenizer
//!   call is `/v1/responses/render` with the body as it came).

use std::fmt::Write as _;

use serde_json::{Value, json};

use crate::rng::Rng;

/// The mock's model.
pub const MODEL: &str = "tiny";
/// Output tokens per request.
pub const MAX_TOKENS: u32 = 4;
/// Largest text of one message.
const MESSAGE_BYTES: usize = 64 * 1024;
/// Average bytes per generated word, its space included.
const BYTES_PER_WORD: f64 = 4.5;

/// A body's API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Api {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions` with token ids.
    CompletionsIds,
    /// `/v1/responses`.
    Responses,
}

impl Api {
    /// Every API, in report order.
    pub const ALL: [Self; 3] = [Self::Chat, Self::CompletionsIds, Self::Responses];

    /// The label in the CSV files.
    pub const fn label(self) -> &'static str {
        match self {
            Self::Chat => "chat",
            Self::CompletionsIds => "completions-ids",
            Self::Responses => "responses",
        }
    }

    /// The path it is sent to.
    pub const fn path(self) -> &'static str {
        match self {
            Self::Chat => "/v1/chat/completions",
            Self::CompletionsIds => "/v1/completions",
            Self::Responses => "/v1/responses",
        }
    }
}

/// A body of about `bytes` bytes (never less than a few hundred) for `api`,
/// drawn from `seed`.
pub fn body(api: Api, bytes: usize, seed: u64) -> Vec<u8> {
    let mut rng = Rng::new(seed, api as u64 + 1);
    match api {
        Api::Chat => {
            let messages: Vec<Value> = texts(&mut rng, bytes)
                .into_iter()
                .enumerate()
                .map(|(i, t)| {
                    let role = if i % 2 == 0 { "user" } else { "assistant" };
                    json!({"role": role, "content": t})
                })
                .collect();
            json!({"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "stream": false})
                .to_string()
                .into_bytes()
        }
        Api::Responses => {
            let input: Vec<Value> = texts(&mut rng, bytes)
                .into_iter()
                .enumerate()
                .map(|(i, t)| {
                    let role = if i % 2 == 0 { "user" } else { "assistant" };
                    json!({"type": "message", "role": role, "content": t})
                })
                .collect();
            json!({
                "model": MODEL,
                "input": input,
                "max_output_tokens": MAX_TOKENS,
                "stream": false,
                "store": false,
            })
            .to_string()
            .into_bytes()
        }
        Api::CompletionsIds => {
            let mut out = format!("{{\"model\":\"{MODEL}\",\"prompt\":[");
            let tail = format!("],\"max_tokens\":{MAX_TOKENS},\"stream\":false}}");
            let mut first = true;
            while out.len() + tail.len() < bytes || first {
                if !first {
                    out.push(',');
                }
                first = false;
                let _ = write!(out, "{}", 16 + rng.next_u64() % 31_000);
            }
            out.push_str(&tail);
            out.into_bytes()
        }
    }
}

/// Message texts adding up to about `bytes` (each at most [`MESSAGE_BYTES`]).
fn texts(rng: &mut Rng, bytes: usize) -> Vec<String> {
    // JSON around each message: role, content, quotes and braces.
    const PER_MESSAGE: usize = 64;
    let mut out = Vec::new();
    let mut total = 100;
    while total < bytes {
        let left = bytes - total;
        let size = left.saturating_sub(PER_MESSAGE).clamp(16, MESSAGE_BYTES);
        let words = ((size as f64 / BYTES_PER_WORD).ceil() as usize).max(1);
        let text = rng.words(words);
        total += text.len() + PER_MESSAGE;
        out.push(text);
    }
    out
}

/// The number of ids in a token-id body (its prompt's length).
pub fn prompt_ids(body: &[u8]) -> usize {
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return 0;
    };
    v["prompt"].as_array().map_or(0, Vec::len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_come_near_their_size_and_parse() {
        for api in Api::ALL {
            for size in [2_000, 300_000] {
                let b = body(api, size, 3);
                assert_eq!(b, body(api, size, 3));
                let v: Value = serde_json::from_slice(&b).unwrap();
                assert_eq!(v["model"], MODEL);
                let len = b.len() as f64;
                assert!(
                    len > size as f64 * 0.9 && len < size as f64 * 1.1,
                    "{api:?} {size}: {len}"
                );
            }
        }
        let ids = body(Api::CompletionsIds, 10_000, 1);
        let n = prompt_ids(&ids);
        assert!(n > 1_400 && n < 2_000, "{n}");
    }
}
