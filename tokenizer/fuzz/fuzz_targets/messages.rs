//! Fuzz bytes as Anthropic Messages (user and assistant text, tool_use and
//! tool_result blocks, thinking, inline system messages, tool additions),
//! or, starting with `{`, as a raw JSON body, on one of the two test
//! models. Checks: no panic; the budgeted ids are the first `max_tokens` of
//! the full prompt's; count_tokens counts the same prompt. Long tool loops
//! exercise the conversion's linear work (the per-input time limit catches
//! a super-linear relapse).
#![no_main]

use kvroute_tokenizer::{Budget, MessagesRequest};
use kvroute_tokenizer_fuzz::{budget, model, text};
use libfuzzer_sys::fuzz_target;
use serde_json::json;

fn message(kind: u8, payload: &[u8], i: usize) -> serde_json::Value {
    let t = text(payload);
    let id = format!("toolu_{i}");
    match kind % 8 {
        0 => json!({"role": "user", "content": t}),
        1 => json!({"role": "assistant", "content": [{"type": "text", "text": t}]}),
        2 => json!({"role": "assistant", "content": [{"type": "tool_use", "id": id, "name": "f", "input": {"q": t}}]}),
        3 => json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": format!("toolu_{}", i.saturating_sub(1)), "content": t}]}),
        4 => json!({"role": "assistant", "content": [{"type": "thinking", "thinking": t, "signature": "s"}, {"type": "text", "text": "ok"}]}),
        5 => json!({"role": "system", "content": t}),
        6 => json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": id, "is_error": true, "content": [{"type": "text", "text": t}]}, {"type": "text", "text": "next"}]}),
        _ => json!({"role": "user", "content": [{"type": "text", "text": t}, {"type": "text", "text": t}]}),
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let (tok, _) = model(first & 1 == 1);
    let bytes = if first == b'{' {
        data.to_vec()
    } else {
        let messages: Vec<serde_json::Value> = rest
            .split(|&b| b == 0xFF)
            .enumerate()
            .filter_map(|(i, c)| c.split_first().map(|(&k, p)| message(k, p, i)))
            .collect();
        let mut b = json!({"model": "m", "max_tokens": 64, "messages": messages});
        if first & 2 != 0 {
            b["system"] = json!([{"type": "text", "text": "be brief"}]);
        }
        if first & 4 != 0 {
            b["tools"] = json!([{"name": "f", "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}]);
        }
        serde_json::to_vec(&b).expect("json")
    };
    let Ok(req) = MessagesRequest::from_json(&bytes) else {
        return;
    };
    let max = usize::from(first >> 3) * 13;
    let limited = Budget {
        max_tokens: Some(max),
        ..budget(tok)
    };
    let full = tok.tokenize_messages_with(&req, &budget(tok));
    let cut = tok.tokenize_messages_with(&req, &limited);
    if let (Ok(full), Ok(cut)) = (&full, &cut) {
        assert_eq!(cut.ids, full.ids[..full.ids.len().min(max)]);
        assert_eq!(cut.truncated, full.ids.len() > max);
    }
    if let Ok(full) = &full {
        let counted = tok.tokenize_messages(&req.clone().for_count_tokens());
        assert_eq!(counted.as_deref().ok(), Some(full.ids.as_slice()));
    }
});
