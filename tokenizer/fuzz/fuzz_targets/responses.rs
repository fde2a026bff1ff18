//! Fuzz bytes as Responses input items (messages, function calls and
//! outputs, reasoning, partial assistant messages), or, starting with `{`,
//! as a raw JSON body, on one of the two test models. Checks: no panic; the
//! budgeted ids are the first `max_tokens` of the render's ids. Runs of
//! function calls exercise the merge into one assistant message (once
//! quadratic: the per-input time limit catches a relapse).
#![no_main]

use kvroute_tokenizer::{Budget, ResponsesRequest};
use kvroute_tokenizer_fuzz::{budget, model, text};
use libfuzzer_sys::fuzz_target;
use serde_json::json;

fn item(kind: u8, payload: &[u8], i: usize) -> serde_json::Value {
    let t = text(payload);
    match kind % 9 {
        0 => json!({"role": "user", "content": t}),
        1 => {
            json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": t}]})
        }
        2 => {
            json!({"type": "function_call", "call_id": format!("c{i}"), "name": "f", "arguments": t})
        }
        3 => json!({"type": "function_call_output", "call_id": format!("c{i}"), "output": t}),
        4 => json!({"type": "reasoning", "summary": [{"type": "summary_text", "text": t}]}),
        5 => {
            json!({"type": "custom_tool_call", "call_id": format!("c{i}"), "name": "g", "input": t})
        }
        6 => json!({"role": "developer", "content": t}),
        7 => {
            json!({"type": "message", "role": "assistant", "status": "in_progress", "content": [{"type": "output_text", "text": t}]})
        }
        _ => json!({"role": "system", "content": [{"type": "input_text", "text": t}]}),
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
        let items: Vec<serde_json::Value> = rest
            .split(|&b| b == 0xFF)
            .enumerate()
            .filter_map(|(i, c)| c.split_first().map(|(&k, p)| item(k, p, i)))
            .collect();
        let mut b = json!({"input": items});
        if first & 2 != 0 {
            b["instructions"] = json!("be brief");
        }
        if first & 4 != 0 {
            b["tools"] = json!([{"type": "function", "name": "f", "parameters": {"type": "object"}}, {"type": "custom", "name": "g"}]);
        }
        serde_json::to_vec(&b).expect("json")
    };
    let Ok(req) = ResponsesRequest::from_json(&bytes) else {
        return;
    };
    let max = usize::from(first >> 3) * 13;
    let limited = Budget {
        max_tokens: Some(max),
        ..budget(tok)
    };
    let full = tok.render_responses_with(&req, &budget(tok));
    let cut = tok.responses_tokens_with(&req, &limited);
    if let (Ok(full), Ok(cut)) = (&full, &cut) {
        let ids = &full.token_ids;
        assert_eq!(cut.ids, ids[..ids.len().min(max)]);
        assert_eq!(cut.truncated, ids.len() > max);
    }
    if full.is_ok() && max > 0 {
        // What renders whole renders under a token budget too (a budget
        // only skips the context-length refusal).
        assert!(cut.is_ok(), "{cut:?}");
    }
});
