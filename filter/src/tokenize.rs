//! The tokenizer callout: its request body and the parsing of its answer.
//!
//! | API | call | body sent | answer |
//! |---|---|---|---|
//! | completions | `/tokenize` | `{model, prompt, add_special_tokens?}` | `tokens` |
//! | chat | `/tokenize` | `{model, messages, tools?, chat_template?, chat_template_kwargs?, add_generation_prompt?, continue_final_message?, add_special_tokens?, documents?}` | `tokens` |
//! | any | `…/render` | the request body unchanged | `token_ids` |
//!
//! Responses bodies must go to `/v1/responses/render`: `/tokenize` rejects
//! them and rendering them as chat misses the second BOS vLLM adds.

use kvroute_proto::tokenize_fields::{CHAT as CHAT_FIELDS, COMPLETION as COMPLETION_FIELDS};
use serde_json::Value;

use crate::config::{Api, TokenizerCall};
use crate::request::ParsedRequest;

/// The body of the tokenizer call for `req`, whose raw bytes are `raw`.
/// Fields are copied as the client sent them (no re-serialization).
pub fn request_body(
    call: TokenizerCall,
    req: &ParsedRequest<'_>,
    model: &str,
    raw: &[u8],
) -> Vec<u8> {
    match call {
        TokenizerCall::Render if req.model.is_some() => raw.to_vec(),
        TokenizerCall::Render => object(model, req.fields_except("model")),
        TokenizerCall::Tokenize => {
            let fields = match req.api {
                Api::Completions => COMPLETION_FIELDS,
                // Messages bodies never come here (`Api::Messages`).
                Api::Chat | Api::Responses | Api::Messages => CHAT_FIELDS,
            };
            object(
                model,
                fields.iter().filter_map(|f| req.raw(f).map(|v| (*f, v))),
            )
        }
    }
}

/// `{"model": model, name: raw, …}`.
fn object<'a>(
    model: &str,
    fields: impl Iterator<Item = (&'a str, &'a serde_json::value::RawValue)>,
) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(b"{\"model\":");
    // Serializing a string to memory cannot fail.
    out.extend_from_slice(&serde_json::to_vec(model).unwrap_or_default());
    for (name, value) in fields {
        out.push(b',');
        out.extend_from_slice(&serde_json::to_vec(name).unwrap_or_default());
        out.push(b':');
        out.extend_from_slice(value.get().as_bytes());
    }
    out.push(b'}');
    out
}

/// Why a tokenizer answer is unusable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BadAnswer(pub String);

/// The prompt's token ids from a `/tokenize` (`tokens`) or render
/// (`token_ids`, possibly inside a one-element list or an `engine_prompts`
/// style wrapper) answer.
pub fn parse_token_ids(bytes: &[u8]) -> Result<Vec<u32>, BadAnswer> {
    let value: Value =
        serde_json::from_slice(bytes).map_err(|e| BadAnswer(format!("invalid JSON: {e}")))?;
    find_ids(&value, 0).ok_or_else(|| BadAnswer("no token ids in the answer".to_owned()))?
}

const ID_FIELDS: &[&str] = &["tokens", "token_ids", "prompt_token_ids"];
const WRAPPERS: &[&str] = &["engine_prompts", "prompts", "data"];
const MAX_DEPTH: usize = 4;

fn find_ids(value: &Value, depth: usize) -> Option<Result<Vec<u32>, BadAnswer>> {
    if depth > MAX_DEPTH {
        return None;
    }
    let next = depth.saturating_add(1);
    match value {
        Value::Object(map) => {
            for field in ID_FIELDS {
                if let Some(Value::Array(ids)) = map.get(*field) {
                    return Some(ids_of(ids));
                }
            }
            WRAPPERS
                .iter()
                .find_map(|w| map.get(*w).and_then(|v| find_ids(v, next)))
        }
        Value::Array(items) => match items.as_slice() {
            [only] => find_ids(only, next),
            [] => None,
            _ => Some(Err(BadAnswer("several prompts in the answer".to_owned()))),
        },
        _ => None,
    }
}

fn ids_of(items: &[Value]) -> Result<Vec<u32>, BadAnswer> {
    items
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| BadAnswer("a token id is not a u32".to_owned()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::parse;

    fn json(bytes: &[u8]) -> Value {
        serde_json::from_slice(bytes).unwrap()
    }

    #[test]
    fn completions_tokenize_body() {
        let raw = br#"{"model":"m","prompt":"hi","max_tokens":5,"cache_salt":"s","add_special_tokens":false}"#;
        let req = parse(Api::Completions, raw).unwrap();
        let body = json(&request_body(TokenizerCall::Tokenize, &req, "m", raw));
        assert_eq!(
            body,
            serde_json::json!({"model":"m","prompt":"hi","add_special_tokens":false})
        );
    }

    #[test]
    fn chat_tokenize_body_keeps_template_fields_only() {
        let raw = br#"{"model":"m","messages":[{"role":"user","content":"x"}],"tools":[{"type":"function"}],
            "chat_template_kwargs":{"enable_thinking":true},"add_generation_prompt":false,
            "continue_final_message":true,"stream":true,"temperature":0.1,"tool_choice":"auto"}"#;
        let req = parse(Api::Chat, raw).unwrap();
        let body = json(&request_body(
            TokenizerCall::Tokenize,
            &req,
            "fallback",
            raw,
        ));
        assert_eq!(
            body,
            serde_json::json!({"model":"fallback","messages":[{"role":"user","content":"x"}],
                "tools":[{"type":"function"}],"chat_template_kwargs":{"enable_thinking":true},
                "add_generation_prompt":false,"continue_final_message":true})
        );
    }

    #[test]
    fn render_body_is_the_request() {
        let raw = br#"{"model":"m","input":"x","instructions":"i"}"#;
        let req = parse(Api::Responses, raw).unwrap();
        assert_eq!(
            request_body(TokenizerCall::Render, &req, "m", raw),
            raw.to_vec()
        );
        let raw = br#"{"input":"x"}"#;
        let req = parse(Api::Responses, raw).unwrap();
        let body = json(&request_body(TokenizerCall::Render, &req, "fb", raw));
        assert_eq!(body, serde_json::json!({"model":"fb","input":"x"}));
    }

    #[test]
    fn answers() {
        assert_eq!(
            parse_token_ids(br#"{"count":3,"max_model_len":10,"tokens":[1,2,3]}"#),
            Ok(vec![1, 2, 3])
        );
        assert_eq!(parse_token_ids(br#"{"token_ids":[4]}"#), Ok(vec![4]));
        assert_eq!(parse_token_ids(br#"[{"token_ids":[5,6]}]"#), Ok(vec![5, 6]));
        assert_eq!(
            parse_token_ids(br#"{"engine_prompts":[{"prompt_token_ids":[7]}]}"#),
            Ok(vec![7])
        );
        assert_eq!(parse_token_ids(br#"{"tokens":[]}"#), Ok(vec![]));
        for bad in [
            &b"{\"tokens\":[1,\"a\"]}"[..],
            b"{\"tokens\":[4294967296]}",
            b"{\"tokens\":[-1]}",
            b"[{\"token_ids\":[1]},{\"token_ids\":[2]}]",
            b"{\"error\":\"x\"}",
            b"{\"tokens\":",
            b"\xff",
            b"",
            b"[[[[[[{\"tokens\":[1]}]]]]]]",
        ] {
            assert!(
                parse_token_ids(bad).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
