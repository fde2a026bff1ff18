//! Approximate mode: block keys from raw request text, no tokenizer call.
//!
//! The prompt-defining fields are serialized in a canonical, prefix-stable
//! order (tools and instructions first, then each message or input item on
//! its own, separated by a record separator), so a conversation that grows by
//! appending messages keeps the keys of its earlier chunks. The bytes are cut
//! into chunks of `approximate_chunk_bytes` and keyed with the same chained,
//! salt-scoped scheme as token blocks (each byte stands for one "token").
//! indexd learns these keys from its own picks.

use kvroute_proto::{BlockKey, BlockSize, block_keys};
use serde_json::Value;

use crate::config::Api;
use crate::request::ParsedRequest;

const SEPARATOR: u8 = 0x1e;

/// The canonical text of a request's prompt.
pub fn canonical_text(req: &ParsedRequest<'_>) -> Vec<u8> {
    let mut out = Vec::new();
    let mut push = |v: &Value| {
        match v {
            Value::String(s) => out.extend_from_slice(s.as_bytes()),
            other => out.extend_from_slice(other.to_string().as_bytes()),
        }
        out.push(SEPARATOR);
    };
    let values: Vec<(&str, Value)> = [
        "prompt",
        "chat_template",
        "chat_template_kwargs",
        "tools",
        "messages",
        "instructions",
        "input",
        "system",
    ]
    .into_iter()
    .filter_map(|name| req.value(name).map(|v| (name, v)))
    .collect();
    let field = |name: &str| values.iter().find(|(n, _)| *n == name).map(|(_, v)| v);
    match req.api {
        Api::Completions => {
            if let Some(ids) = &req.prompt_ids {
                for id in ids {
                    out.extend_from_slice(&id.to_le_bytes());
                }
            } else if let Some(p) = field("prompt") {
                match p {
                    Value::Array(items) => items.iter().for_each(&mut push),
                    other => push(other),
                }
            }
        }
        Api::Chat => {
            for name in ["chat_template", "chat_template_kwargs", "tools"] {
                if let Some(v) = field(name) {
                    push(v);
                }
            }
            if let Some(Value::Array(messages)) = field("messages") {
                messages.iter().for_each(&mut push);
            }
        }
        Api::Responses => {
            for name in ["instructions", "tools"] {
                if let Some(v) = field(name) {
                    push(v);
                }
            }
            match field("input") {
                Some(Value::Array(items)) => items.iter().for_each(&mut push),
                Some(other) => push(other),
                None => {}
            }
        }
        Api::Messages => {
            for name in ["chat_template_kwargs", "system", "tools"] {
                if let Some(v) = field(name) {
                    push(v);
                }
            }
            if let Some(Value::Array(messages)) = field("messages") {
                messages.iter().for_each(&mut push);
            }
        }
    }
    out
}

/// The keys of every full chunk of the request's canonical text, and the
/// text's length.
pub fn text_keys(req: &ParsedRequest<'_>, chunk: BlockSize) -> (Vec<BlockKey>, usize) {
    let text = canonical_text(req);
    let symbols: Vec<u32> = text.iter().map(|b| u32::from(*b)).collect();
    (
        block_keys(&symbols, chunk, req.cache_salt.as_deref()),
        text.len(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::parse;

    fn keys(api: Api, json: &str, chunk: u32) -> Vec<BlockKey> {
        let req = parse(api, json.as_bytes()).unwrap();
        text_keys(&req, BlockSize::new(chunk).unwrap()).0
    }

    #[test]
    fn appended_messages_keep_earlier_chunks() {
        let long = "x".repeat(100);
        let one = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"{long}"}}]}}"#);
        let two = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"{long}"}},{{"role":"assistant","content":"y"}}]}}"#
        );
        let a = keys(Api::Chat, &one, 16);
        let b = keys(Api::Chat, &two, 16);
        assert!(!a.is_empty());
        assert_eq!(&b[..a.len()], &a[..]);
    }

    #[test]
    fn key_order_in_client_json_does_not_matter() {
        let a = keys(
            Api::Chat,
            r#"{"messages":[{"role":"user","content":"0123456789abcdef0123"}]}"#,
            8,
        );
        let b = keys(
            Api::Chat,
            r#"{"messages":[{"content":"0123456789abcdef0123","role":"user"}]}"#,
            8,
        );
        assert_eq!(a, b);
    }

    #[test]
    fn salt_and_api_fields_matter() {
        let p = "p".repeat(64);
        let plain = keys(Api::Completions, &format!(r#"{{"prompt":"{p}"}}"#), 16);
        let salted = keys(
            Api::Completions,
            &format!(r#"{{"prompt":"{p}","cache_salt":"a"}}"#),
            16,
        );
        assert_eq!(plain.len(), 4);
        assert_ne!(plain, salted);
        let r1 = keys(
            Api::Responses,
            &format!(r#"{{"input":"{p}","instructions":"a"}}"#),
            16,
        );
        let r2 = keys(
            Api::Responses,
            &format!(r#"{{"input":"{p}","instructions":"b"}}"#),
            16,
        );
        assert_ne!(r1, r2);
        assert!(keys(Api::Completions, r#"{"prompt":"short"}"#, 16).is_empty());
    }
}
