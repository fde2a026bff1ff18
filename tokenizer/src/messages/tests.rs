#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use super::*;

fn chat(body: &str, conv: &MessagesConversion) -> Result<String, RequestError> {
    let body = crate::loads::parse(body.as_bytes()).unwrap();
    let out = convert(&body, conv, false)?;
    Ok(crate::json::dumps(&out, &crate::json::DumpOptions::default()).unwrap())
}

fn ok(body: &str) -> String {
    chat(body, &MessagesConversion::default()).unwrap()
}

#[test]
fn a_tool_result_comes_before_its_user_message() {
    let got = ok(
        r#"{"model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "x-anthropic-billing-header: 1"}, {"type": "text", "text": "b"}],
        "messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": "hm"}, {"type": "tool_use", "id": "t1", "name": "f", "input": {"é": 1}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}, {"type": "tool_reference", "tool_name": "g"}]}, {"type": "text", "text": "next"}]}]}"#,
    );
    assert_eq!(
        got,
        r#"{"model": "m", "messages": [{"role": "system", "content": "ab"}, {"role": "assistant", "reasoning": "hm", "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{\"é\": 1}"}}]}, {"role": "tool", "tool_call_id": "t1", "content": "r1\nr2"}, {"role": "tool", "tool_call_id": "t1", "content": [{"type": "tool_reference", "name": "g"}]}, {"role": "user", "content": "next"}]}"#
    );
}

#[test]
fn inline_system_messages_merge_when_the_template_needs_it() {
    let body = r#"{"model": "m", "max_tokens": 9, "system": "s1 ", "messages": [{"role": "user", "content": "u"}, {"role": "system", "content": "s2"}, {"role": "user", "content": []}]}"#;
    let merged = chat(
        body,
        &MessagesConversion {
            merge_inline_system: true,
            ..MessagesConversion::default()
        },
    )
    .unwrap();
    assert_eq!(
        merged,
        r#"{"model": "m", "messages": [{"role": "system", "content": "s1 s2"}, {"role": "user", "content": "u"}]}"#
    );
    assert_eq!(
        ok(body),
        r#"{"model": "m", "messages": [{"role": "system", "content": "s1 "}, {"role": "user", "content": "u"}, {"role": "system", "content": "s2"}]}"#
    );
}

#[test]
fn assistant_tool_results_print_as_python_does() {
    let got = ok(
        r#"{"model": "m", "max_tokens": 9, "messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x", "content": [{"type": "text", "text": "it's"}]}, {"type": "redacted_thinking", "data": "z"}]}]}"#,
    );
    assert_eq!(
        got,
        r#"{"model": "m", "messages": [{"role": "assistant", "content": "Tool result: [{'type': 'text', 'text': \"it's\"}]"}]}"#
    );
}

#[test]
fn tools_resolve_and_efforts_fold_into_the_kwargs() {
    let got = ok(
        r#"{"model": "m", "max_tokens": 9, "tools": [{"name": "a", "input_schema": {"properties": {}}, "defer_loading": true}, {"name": "b", "input_schema": {"type": "object"}}],
        "messages": [{"role": "system", "content": [{"type": "tool_addition", "tool": {"type": "tool_reference", "name": "a"}}, {"type": "tool_removal", "tool": {"type": "tool_reference", "name": "b"}}]}, {"role": "user", "content": "hi"}],
        "thinking": {"type": "disabled"}, "output_config": {"effort": "high"}, "chat_template_kwargs": {"enable_thinking": true}}"#,
    );
    assert_eq!(
        got,
        r#"{"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "a", "description": null, "parameters": {"properties": {}, "type": "object"}}}], "chat_template_kwargs": {"enable_thinking": true, "reasoning_effort": "none"}}"#
    );
}

#[test]
fn what_vllm_refuses_is_refused() {
    for body in [
        r#"{"max_tokens": 9, "messages": []}"#,
        r#"{"model": "", "max_tokens": 9, "messages": []}"#,
        r#"{"model": "m", "messages": []}"#,
        r#"{"model": "m", "max_tokens": 0, "messages": []}"#,
        r#"{"model": "m", "max_tokens": 9, "messages": [{"role": "tool", "content": "x"}]}"#,
        r#"{"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": [{"type": "video"}]}]}"#,
        r#"{"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": [{"type": "tool_addition", "tool": {"type": "tool_reference", "name": "a"}}]}]}"#,
        r#"{"model": "m", "max_tokens": 9, "messages": [{"role": "system", "content": [{"type": "tool_removal", "tool": {"type": "tool_reference", "name": "a"}}]}]}"#,
        r#"{"model": "m", "max_tokens": 9, "messages": [], "tool_choice": {"type": "tool"}}"#,
        r#"{"model": "m", "max_tokens": 2000, "messages": [], "thinking": {"type": "enabled", "budget_tokens": 2000}}"#,
        r#"{"model": "m", "max_tokens": 9, "messages": [], "thinking": {"type": "enabled", "budget_tokens": 1000}}"#,
        r#"{"model": "m", "max_tokens": 9, "messages": [], "output_config": {"effort": "none"}}"#,
        r#"{"model": "m", "max_tokens": 9, "messages": [], "stop_sequences": ["a", "b", "c", "d", "e"]}"#,
        r#"{"model": "m", "max_tokens": 9, "messages": [], "tools": [{"name": "a"}]}"#,
    ] {
        assert!(
            chat(body, &MessagesConversion::default()).is_err(),
            "{body}"
        );
    }
    // Prefill legs of disaggregated serving skip the budget check.
    ok(
        r#"{"model": "m", "max_tokens": 1, "messages": [], "thinking": {"type": "enabled", "budget_tokens": 2000}, "kv_transfer_params": {"do_remote_decode": true}}"#,
    );
}

#[test]
fn a_missing_tool_use_id_is_stamped_with_the_time() {
    let got = ok(
        r#"{"model": "m", "max_tokens": 9, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f"}]}]}"#,
    );
    assert!(got.contains(r#"{"id": "call_1"#), "{got}");
    assert!(got.contains(r#""arguments": "{}""#), "{got}");
}

#[test]
fn a_template_free_body_converts_alike_under_every_conversion() {
    let other = MessagesConversion {
        merge_inline_system: true,
        disabled_thinking_effort: "low".to_owned(),
    };
    let free = [
        r#"{"model": "m", "max_tokens": 9, "system": "s", "messages": [{"role": "user", "content": "u"}]}"#,
        r#"{"model": "m", "max_tokens": 4096, "thinking": {"type": "enabled", "budget_tokens": 1024}, "messages": [{"role": "user", "content": "u"}]}"#,
    ];
    for body in free {
        let parsed = crate::loads::parse(body.as_bytes()).unwrap();
        assert!(template_free(&parsed), "{body}");
        assert_eq!(ok(body), chat(body, &other).unwrap(), "{body}");
    }
    let bound = [
        r#"{"model": "m", "max_tokens": 9, "system": "s", "messages": [{"role": "user", "content": "u"}, {"role": "system", "content": "s2"}, {"role": "user", "content": "v"}]}"#,
        r#"{"model": "m", "max_tokens": 9, "thinking": {"type": "disabled"}, "messages": [{"role": "user", "content": "u"}]}"#,
    ];
    for body in bound {
        let parsed = crate::loads::parse(body.as_bytes()).unwrap();
        assert!(!template_free(&parsed), "{body}");
        assert_ne!(ok(body), chat(body, &other).unwrap(), "{body}");
    }
}
