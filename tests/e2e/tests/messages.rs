//! Anthropic Messages through real Envoy + the filter + indexd + mock
//! replicas: agent loops (a tool_use answered by a tool_result, turn after
//! turn) land each continuation on its warm replica, by the replica's own
//! `usage.cache_read_input_tokens`, and the answer keeps Anthropic's shape;
//! `count_tokens` is not routed; a
//! Messages body indexd cannot key without the model's template (an inline
//! system message, on a stack whose indexd has no tokenizer of its own)
//! goes on unrouted and is answered.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::time::Duration;

use kvroute_e2e::client::{Outcome, filler, post_json};
use kvroute_e2e::{Stack, StackOptions};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(30);
const HEADERS: [(&str, &str); 1] = [("anthropic-version", "2023-06-01")];

fn index_of(stack: &Stack, replica: &str) -> usize {
    stack
        .replica_addresses()
        .iter()
        .position(|a| a == replica)
        .unwrap()
}

/// Sends a Messages body, checks Anthropic's answer, waits until indexd has
/// the blocks the replica stored.
fn send(stack: &Stack, body: &Value) -> Outcome {
    let out = post_json(&stack.url().unwrap(), "/v1/messages", body, &HEADERS).unwrap();
    assert_eq!(out.status, 200, "{}", out.body);
    let doc: Value = serde_json::from_str(&out.body).unwrap();
    assert_eq!(doc["type"], "message", "{doc}");
    assert!(doc["usage"]["cache_read_input_tokens"].is_u64(), "{doc}");
    let served = index_of(stack, out.replica.as_deref().unwrap());
    let blocks = (out.prompt_tokens / u64::from(stack.options().block_size)) as usize;
    stack.wait_indexed(served, blocks, WAIT).unwrap();
    out
}

#[test]
fn messages_agent_loops_land_warm() {
    let stack = Stack::start(StackOptions {
        replicas: 3,
        ..StackOptions::default()
    })
    .unwrap();
    let model = stack.options().model.clone();
    let tools = json!([{"name": "run", "description": "Runs a shell command",
        "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]);
    for conversation in 0..4u64 {
        let mut messages = vec![json!({"role": "user", "content": filler(conversation, 120)})];
        let body = |messages: &[Value]| {
            json!({"model": model, "max_tokens": 4, "system": filler(1_000, 60),
                "tools": tools, "messages": messages})
        };
        let first = send(&stack, &body(&messages));
        assert!(
            matches!(first.decision.as_deref(), Some("load" | "precise")),
            "conversation {conversation}: {:?}",
            first.decision
        );
        let warm = first.replica.clone().unwrap();
        let mut last = first;
        for step in 1..4u64 {
            let id = format!("toolu_{conversation}_{step}");
            messages.push(json!({"role": "assistant", "content": [
                {"type": "text", "text": last.text},
                {"type": "tool_use", "id": id, "name": "run", "input": {"cmd": "ls"}},
            ]}));
            messages.push(json!({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": id, "content": filler(conversation * 10 + step, 40)},
            ]}));
            let next = send(&stack, &body(&messages));
            let what = format!("conversation {conversation} step {step}");
            assert_eq!(next.decision.as_deref(), Some("precise"), "{what}");
            assert_eq!(next.replica.as_deref(), Some(warm.as_str()), "{what}");
            assert!(
                next.cached_tokens >= last.prompt_tokens / 2,
                "{what}: cached {} of a {}-token previous turn",
                next.cached_tokens,
                last.prompt_tokens
            );
            last = next;
        }
    }

    // count_tokens is not inference: not routed, answered by a replica.
    let count = json!({"model": model, "messages": [{"role": "user", "content": "hi"}]});
    let out = post_json(
        &stack.url().unwrap(),
        "/v1/messages/count_tokens",
        &count,
        &HEADERS,
    )
    .unwrap();
    assert_eq!(out.status, 200, "{}", out.body);
    assert_eq!(out.decision, None, "count_tokens was routed");
    let doc: Value = serde_json::from_str(&out.body).unwrap();
    assert!(doc["input_tokens"].as_u64().unwrap() > 0, "{doc}");
}

#[test]
fn a_messages_body_that_needs_the_template_goes_on_unrouted() {
    let stack = Stack::start(StackOptions::default()).unwrap();
    let model = stack.options().model.clone();
    let body = json!({"model": model, "max_tokens": 4, "messages": [
        {"role": "user", "content": filler(7, 80)},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Go on."},
    ]});
    let out = post_json(&stack.url().unwrap(), "/v1/messages", &body, &HEADERS).unwrap();
    assert_eq!(out.status, 200, "{}", out.body);
    assert_eq!(out.decision.as_deref(), Some("tokenize_failed"));
}
