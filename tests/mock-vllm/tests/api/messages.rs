//! Anthropic Messages: the answer's shape and its cache usage, count_tokens
//! against `/tokenize` of the chat body the request converts to, the event
//! stream, and Anthropic's error object.

use kvroute_tokenizer::{MessagesConversion, MessagesRequest};
use serde_json::{Value, json};

use crate::support::*;

fn body(stream: bool) -> Value {
    let words: Vec<String> = (0..400).map(|i| format!("w{i}")).collect();
    json!({
        "model": "mock-model",
        "max_tokens": 3,
        "stream": stream,
        "system": [{"type": "text", "text": "You run tools. "}, {"type": "text", "text": words.join(" ")}],
        "messages": [
            {"role": "user", "content": "List the files."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {"path": "."}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.rs"}]},
        ],
        "tools": [{"name": "ls", "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}],
    })
}

#[tokio::test]
async fn messages_answer_in_anthropic_shape_with_the_cache_hit() {
    let h = start(test_config()).await;
    let count = post(h.http_addr(), "/v1/messages/count_tokens", body(false)).await;
    assert_eq!(count.status, 200);
    let n = count.json()["input_tokens"].as_u64().unwrap();
    // count_tokens is the prompt of the chat body vLLM converts it to.
    let chat = MessagesRequest::from_json(body(false).to_string().as_bytes())
        .unwrap()
        .for_count_tokens()
        .to_chat(&MessagesConversion::default())
        .unwrap()
        .to_json()
        .unwrap();
    let tokenized = post(
        h.http_addr(),
        "/tokenize",
        serde_json::from_str(&chat).unwrap(),
    )
    .await;
    assert_eq!(tokenized.json()["count"].as_u64(), Some(n));

    let first = post(h.http_addr(), "/v1/messages", body(false)).await;
    assert_eq!(first.status, 200);
    let doc = first.json();
    assert_eq!(doc["type"], "message");
    assert_eq!(doc["role"], "assistant");
    assert!(doc["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(doc["content"][0]["type"], "text");
    assert_eq!(doc["stop_reason"], "max_tokens");
    assert_eq!(doc["usage"]["output_tokens"], 3);
    let usage = |d: &Value| {
        (
            d["usage"]["input_tokens"].as_u64().unwrap(),
            d["usage"]["cache_read_input_tokens"].as_u64().unwrap(),
        )
    };
    let (input, cached) = usage(&doc);
    assert_eq!(input + cached, n);
    let again = post(h.http_addr(), "/v1/messages", body(false))
        .await
        .json();
    let (input, cached) = usage(&again);
    assert_eq!(input + cached, n);
    assert!(
        cached >= n / 2,
        "the same prompt again: cached {cached} of {n}"
    );
}

#[tokio::test]
async fn streamed_messages_are_anthropic_events() {
    let h = start(test_config()).await;
    let r = post(h.http_addr(), "/v1/messages", body(true)).await;
    assert_eq!(r.status, 200);
    let kinds: Vec<String> = r.sse().into_iter().map(|(e, _)| e.unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
    );
}

#[tokio::test]
async fn a_bad_messages_body_gets_anthropic_errors() {
    let h = start(test_config()).await;
    for path in ["/v1/messages", "/v1/messages/count_tokens"] {
        let r = post(
            h.http_addr(),
            path,
            json!({"model": "mock-model", "messages": "no"}),
        )
        .await;
        assert_eq!(r.status, 400, "{path}");
        let doc = r.json();
        assert_eq!(doc["type"], "error", "{path}: {doc}");
        assert!(doc["error"]["message"].is_string(), "{path}: {doc}");
    }
}
