#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use super::*;
use proptest::prelude::*;

/// The former conversion, which copied the tool-call list on every
/// merge: the reference the linear one must equal.
mod quadratic {
    use super::super::*;

    /// The last message if it is an assistant's (to merge into).
    fn prev_assistant(messages: &mut [Value]) -> Option<&mut Value> {
        messages
            .last_mut()
            .filter(|m| get(m, "role").as_ref().and_then(Value::as_str) == Some("assistant"))
    }

    fn set_field(msg: &mut Value, key: &str, v: Value) {
        let mut e = entries(msg);
        e.insert(s(key), v);
        *msg = object(e);
    }

    pub fn add_item(messages: &mut Vec<Value>, item: &Value, at: &str) -> Result<(), RequestError> {
        let kind = item_type(item);
        let call = match kind.as_deref() {
            Some("function_call") => {
                let mut name = crate::value::req_str(item, "name", &format!("{at}.name"))?;
                if let Some(ns) = opt_str(item, "namespace", &format!("{at}.namespace"))?
                    .filter(|n| !n.is_empty())
                {
                    name = format!("{ns}__{name}");
                }
                let args = crate::value::req_str(item, "arguments", &format!("{at}.arguments"))?;
                let id = crate::value::req_str(item, "call_id", &format!("{at}.call_id"))?;
                Some(tool_call(&id, &name, &args))
            }
            Some("custom_tool_call") => {
                let name = crate::value::req_str(item, "name", &format!("{at}.name"))?;
                let id = crate::value::req_str(item, "call_id", &format!("{at}.call_id"))?;
                let payload = opt_str(item, "input", &format!("{at}.input"))?.unwrap_or_default();
                let mut m = Map::new();
                m.insert(s(CUSTOM_TOOL_INPUT_KEY), s(&payload));
                let args = crate::json::dumps(&object(m), &crate::json::DumpOptions::default())
                    .map_err(RequestError::message)?;
                Some(tool_call(&id, &name, &args))
            }
            _ => None,
        };
        if let Some(call) = call {
            if let Some(prev) = prev_assistant(messages) {
                match get(prev, "tool_calls") {
                    None => {
                        set_field(prev, "tool_calls", Value::from(vec![call]));
                        return Ok(());
                    }
                    Some(tc) => {
                        if let Some(mut list) = items(&tc) {
                            list.push(call);
                            set_field(prev, "tool_calls", Value::from(list));
                            return Ok(());
                        }
                    }
                }
            }
            let mut m = Map::new();
            m.insert(s("role"), s("assistant"));
            m.insert(s("tool_calls"), Value::from(vec![call]));
            messages.push(object(m));
            return Ok(());
        }
        match kind.as_deref() {
            Some("reasoning") => {
                if get_some(item, "encrypted_content").is_some_and(|e| e.is_true()) {
                    return Err(RequestError::invalid(
                        "input",
                        "Encrypted content is not supported.",
                    ));
                }
                let first_text = |key: &str| {
                    get_some(item, key)
                        .and_then(|c| items(&c))
                        .and_then(|l| l.first().cloned())
                        .and_then(|p| get_some(&p, "text"))
                };
                let reasoning = first_text("content")
                    .or_else(|| first_text("summary"))
                    .unwrap_or_else(|| s(""));
                if let Some(prev) = prev_assistant(messages)
                    && get_some(prev, "reasoning").is_none()
                {
                    set_field(prev, "reasoning", reasoning);
                    return Ok(());
                }
                let mut m = Map::new();
                m.insert(s("role"), s("assistant"));
                m.insert(s("reasoning"), reasoning);
                messages.push(object(m));
                Ok(())
            }
            Some("function_call_output" | "custom_tool_call_output") => {
                let mut m = Map::new();
                m.insert(s("role"), s("tool"));
                m.insert(s("content"), get(item, "output").unwrap_or(Value::from(())));
                m.insert(
                    s("tool_call_id"),
                    get(item, "call_id").unwrap_or(Value::from(())),
                );
                messages.push(object(m));
                Ok(())
            }
            _ if get(item, "role").as_ref().and_then(Value::as_str) == Some("assistant") => {
                let content = get(item, "content").unwrap_or_default();
                let text = if is_str(&content) {
                    Some(content)
                } else {
                    items(&content)
                        .and_then(|l| l.first().cloned())
                        .and_then(|p| get_some(&p, "text"))
                };
                match text {
                    Some(text) => {
                        if let Some(prev) = prev_assistant(messages)
                            && get_some(prev, "content").is_none()
                        {
                            set_field(prev, "content", text);
                            return Ok(());
                        }
                        messages.push(message("assistant", Some(text)));
                        Ok(())
                    }
                    None => {
                        messages.push(item.clone());
                        Ok(())
                    }
                }
            }
            _ if get(item, "role").is_some() => {
                messages.push(item.clone());
                Ok(())
            }
            other => Err(RequestError::invalid(
                "input",
                format!("Unsupported input item type: {}", other.unwrap_or("None")),
            )),
        }
    }
}

fn body_of(items: &[serde_json::Value]) -> Value {
    let body = serde_json::json!({"model": "m", "instructions": "be brief", "input": items});
    crate::loads::parse(body.to_string().as_bytes()).unwrap()
}

/// The messages the former code built, as JSON text (key order kept).
fn quadratic_messages(body: &Value) -> Result<String, RequestError> {
    let mut messages = vec![message("system", Some(s("be brief")))];
    let list = items(&get(body, "input").unwrap()).unwrap();
    crate::responses_input::check(&list)?;
    for (i, item) in list.iter().enumerate() {
        quadratic::add_item(&mut messages, item, &format!("input.{i}"))?;
    }
    dump(&messages)
}

fn dump(messages: &[Value]) -> Result<String, RequestError> {
    crate::json::dumps(
        &Value::from(messages.to_vec()),
        &crate::json::DumpOptions::default(),
    )
    .map_err(RequestError::message)
}

fn linear_messages(body: &Value) -> Result<String, RequestError> {
    dump(&convert(body)?.messages)
}

fn arb_item() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::json;
    prop_oneof![
        (0u8..3).prop_map(|i| json!({"type": "function_call", "call_id": format!("c{i}"), "name": "f", "arguments": "{\"a\": 1}"})),
        Just(json!({"type": "function_call", "call_id": "n", "name": "g", "namespace": "ns", "arguments": ""})),
        Just(json!({"type": "custom_tool_call", "call_id": "x", "name": "h", "input": "free text"})),
        Just(json!({"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]})),
        Just(json!({"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "deep"}]})),
        Just(json!({"type": "function_call_output", "call_id": "c0", "output": "42"})),
        Just(json!({"role": "assistant", "content": "said"})),
        Just(json!({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "out"}]})),
        Just(json!({"role": "assistant", "content": [{"type": "input_image"}]})),
        Just(json!({"role": "assistant", "content": [], "tool_calls": "not a list"})),
        Just(json!({"role": "assistant", "content": [], "tool_calls": null})),
        Just(json!({"role": "assistant", "content": [], "tool_calls": [{"id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}], "extra": 1})),
        Just(json!({"role": "user", "content": "hi"})),
        Just(json!({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]})),
        Just(json!({"type": "bogus"})),
        Just(json!({"type": "function_call", "call_id": 3, "name": "f", "arguments": "{}"})),
    ]
}

proptest::proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]
    #[test]
    fn equals_the_former_quadratic_conversion(
        list in proptest::collection::vec(arb_item(), 0..24)
    ) {
        let body = body_of(&list);
        proptest::prop_assert_eq!(linear_messages(&body), quadratic_messages(&body));
    }
}

#[test]
fn merges_a_run_of_calls_into_one_assistant_message() {
    let list: Vec<serde_json::Value> = (0..3)
        .map(|i| serde_json::json!({"type": "function_call", "call_id": format!("c{i}"), "name": "f", "arguments": "{}"}))
        .collect();
    let got = linear_messages(&body_of(&list)).unwrap();
    assert_eq!(
        got,
        r#"[{"role": "system", "content": "be brief"}, {"role": "assistant", "tool_calls": [{"id": "c0", "function": {"name": "f", "arguments": "{}"}, "type": "function"}, {"id": "c1", "function": {"name": "f", "arguments": "{}"}, "type": "function"}, {"id": "c2", "function": {"name": "f", "arguments": "{}"}, "type": "function"}]}]"#
    );
}

/// 64k calls in a row (42 s when each merge copied the list so far):
/// one message holding all of them, built in one pass.
#[test]
fn sixty_four_thousand_calls_convert() {
    let n = 65_536;
    let mut text = String::from(r#"{"input": [{"role": "user", "content": "go"}"#);
    for i in 0..n {
        text.push_str(&format!(
            r#", {{"type": "function_call", "call_id": "c{i}", "name": "f", "arguments": "{{}}"}}"#
        ));
    }
    text.push_str("]}");
    let body = crate::loads::parse(text.as_bytes()).unwrap();
    let converted = convert(&body).unwrap();
    assert_eq!(converted.messages.len(), 2);
    let calls = get(&converted.messages[1], "tool_calls").unwrap();
    assert_eq!(calls.len(), Some(n));
    let last = calls.get_item(&Value::from(n - 1)).unwrap();
    assert_eq!(
        get(&last, "id").unwrap().as_str(),
        Some(format!("c{}", n - 1).as_str())
    );
}
