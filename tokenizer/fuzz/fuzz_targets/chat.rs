//! Fuzz bytes as a chat conversation (or, starting with `{`, as a raw JSON
//! body) on one of the two test models. Checks: no panic; `/tokenize`'s ids
//! are `tokenizers`' encoding of the rendered prompt; the budgeted chat
//! completion ids are the first `max_tokens` of the unbudgeted ones.
#![no_main]

use kvroute_tokenizer::{Budget, TokenizeRequest};
use kvroute_tokenizer_fuzz::{budget, model, text};
use libfuzzer_sys::fuzz_target;
use serde_json::json;

const ROLES: &[&str] = &["user", "assistant", "system", "tool", "developer", "other"];

fn body(flags: u8, rest: &[u8]) -> serde_json::Value {
    let mut messages = Vec::new();
    for chunk in rest.split(|&b| b == 0xFF) {
        let Some((&kind, payload)) = chunk.split_first() else {
            continue;
        };
        let role = ROLES[usize::from(kind) % ROLES.len()];
        let content = text(payload);
        let mut m = if kind & 0x40 != 0 {
            json!({"role": role, "content": [{"type": "text", "text": content}, {"type": "text", "text": "part"}]})
        } else {
            json!({"role": role, "content": content})
        };
        if role == "assistant" && kind & 0x80 != 0 {
            m["tool_calls"] = json!([{"id": "c1", "type": "function", "function": {"name": "f", "arguments": content}}]);
            m["reasoning"] = json!("thinking");
        }
        if role == "tool" {
            m["tool_call_id"] = json!("c1");
        }
        messages.push(m);
    }
    let mut b = json!({"messages": messages});
    if flags & 4 != 0 {
        b["tools"] = json!([{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]);
    }
    if flags & 8 != 0 {
        b["add_generation_prompt"] = json!(false);
        b["continue_final_message"] = json!(true);
    }
    b
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let (tok, reference) = model(first & 1 == 1);
    let bytes = if first == b'{' {
        data.to_vec()
    } else {
        serde_json::to_vec(&body(first, rest)).expect("json")
    };
    let Ok(req) = TokenizeRequest::from_json(&bytes) else {
        return;
    };
    let b = budget(tok);
    // Generated bodies leave `add_special_tokens` and the kwargs alone:
    // /tokenize's ids are then the rendered prompt's, without specials.
    if first != b'{'
        && let (Ok(prompt), Ok(answer)) = (tok.chat_prompt(&req), tok.tokenize_with(&req, &b))
    {
        let want = reference
            .encode(prompt.as_str(), false)
            .expect("tokenizers encodes any text");
        assert_eq!(answer.tokens, want.get_ids(), "{prompt:?}");
    }
    let max = usize::from(first >> 2) * 11;
    let limited = Budget {
        max_tokens: Some(max),
        ..budget(tok)
    };
    if let (Ok(full), Ok(cut)) = (
        tok.chat_completion_tokens_with(&req, &b),
        tok.chat_completion_tokens_with(&req, &limited),
    ) {
        assert!(!full.truncated);
        assert_eq!(cut.ids, full.ids[..full.ids.len().min(max)]);
        assert_eq!(cut.truncated, full.ids.len() > max);
    }
});
