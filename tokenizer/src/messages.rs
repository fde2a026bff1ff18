//! vLLM's Anthropic Messages → chat conversion for `/v1/messages` and
//! `/v1/messages/count_tokens` (`to_chat_completion_request` in
//! `vllm/entrypoints/anthropic/serving.py`, validated as
//! `vllm/entrypoints/anthropic/protocol.py` validates the fields that reach
//! the prompt):
//!
//! - `system` (a string, or its text blocks concatenated without a
//!   separator, Claude Code's billing-header block dropped) becomes a first
//!   system message; inline `system` messages either follow in place or,
//!   for templates that refuse a non-leading system message, are appended
//!   to it ([`MessagesConversion::merge_inline_system`]);
//! - text and image blocks become content parts (one text part: a plain
//!   string), `thinking` blocks the message's `reasoning`, `tool_use`
//!   blocks tool calls (`arguments` as `json.dumps(input)`);
//! - a user's `tool_result` becomes a tool message placed *before* the
//!   user message it came in (text items joined with `"\n"`), followed by a
//!   user message of its images and a tool message of its tool references;
//!   an assistant's becomes the text `"Tool result: " + str(content)`;
//! - a user message left without content is dropped, an assistant's is not;
//! - `tool_addition`/`tool_removal` blocks (system messages only) edit the
//!   tool list, which becomes chat tools;
//! - `output_config.effort` becomes `reasoning_effort`, overridden by
//!   `thinking.type: "disabled"` ([`MessagesConversion::disabled_thinking_effort`]).
//!
//! The result is a `/tokenize` chat body whose ids are the Messages
//! prompt's: `reasoning_effort` (which `/tokenize` ignores) is folded into
//! `chat_template_kwargs`, where the chat completion would put it.

use indexmap::IndexMap;
use minijinja::Value;
use minijinja::value::ValueKind;

use crate::chat::BILLING_HEADER;
use crate::error::RequestError;
use crate::value::{Map, entries, get, get_some, is_map, is_str, items, object, s};

mod validate;

/// Efforts `output_config.effort` takes (vLLM's `AnthropicEffort`).
pub const EFFORTS: &[&str] = &["low", "medium", "high", "xhigh", "max"];

/// What a vLLM server decides once, from its chat template, for every
/// Messages request it converts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessagesConversion {
    /// Inline system messages are appended to the leading system prompt
    /// (vLLM's `_detect_merge_inline_system`: the template raises on
    /// `[system, user, system, user]`, or there is no template).
    pub merge_inline_system: bool,
    /// The `reasoning_effort` of `thinking: {"type": "disabled"}`: `"none"`,
    /// or `"low"` for templates that refuse or ignore `"none"` (vLLM's
    /// probe), or what `--anthropic-disabled-thinking-effort` names.
    pub disabled_thinking_effort: String,
}

impl Default for MessagesConversion {
    /// The defaults of vLLM's `to_chat_completion_request`.
    fn default() -> Self {
        Self {
            merge_inline_system: false,
            disabled_thinking_effort: "none".to_owned(),
        }
    }
}

/// Converts a Messages body (`count_tokens`: a `/v1/messages/count_tokens`
/// body, which has no `max_tokens`) to a `/tokenize` chat body.
pub fn convert(
    body: &Value,
    conv: &MessagesConversion,
    count_tokens: bool,
) -> Result<Value, RequestError> {
    validate::body(body, count_tokens)?;
    let messages = items(&get(body, "messages").unwrap_or_default()).unwrap_or_default();
    let mut out: Vec<Value> = Vec::with_capacity(messages.len() + 1);
    system_message(body, &messages, conv.merge_inline_system, &mut out);
    for msg in &messages {
        let role = str_of(msg, "role");
        let content = get(msg, "content").unwrap_or_default();
        if role == "system" {
            if !conv.merge_inline_system
                && let Some(text) = system_text(&content)
            {
                out.push(message("system", s(&text)));
            }
            continue;
        }
        if is_str(&content) {
            out.push(message(&role, content));
            continue;
        }
        let converted = convert_blocks(&role, &content, &mut out)?;
        // A user message left without content is dropped (its tool results
        // are already out); an assistant's is kept.
        if role != "user" || converted.contains_key(&s("content")) {
            out.push(object(converted));
        }
    }
    let mut chat = Map::new();
    chat.insert(s("model"), get(body, "model").unwrap_or_default());
    chat.insert(s("messages"), Value::from(out));
    if let Some(tools) = resolve_tools(body, &messages)? {
        chat.insert(s("tools"), Value::from(tools));
    }
    if let Some(kwargs) = template_kwargs(body, conv) {
        chat.insert(s("chat_template_kwargs"), kwargs);
    }
    Ok(object(chat))
}

/// Whether `body` converts the same under every chat template: no inline
/// `system` message (appended to the leading one or kept in place by what
/// the template accepts) and no `thinking: {"type": "disabled"}` (whose
/// effort vLLM probes the template for).
pub fn template_free(body: &Value) -> bool {
    let inline_system = items(&get(body, "messages").unwrap_or_default())
        .unwrap_or_default()
        .iter()
        .any(|m| str_of(m, "role") == "system");
    let thinking_disabled =
        get_some(body, "thinking").is_some_and(|t| str_of(&t, "type") == "disabled");
    !inline_system && !thinking_disabled
}

/// `msg[key]` as a string (`""` when absent or not a string).
fn str_of(v: &Value, key: &str) -> String {
    get(v, key)
        .and_then(|x| x.as_str().map(str::to_owned))
        .unwrap_or_default()
}

fn message(role: &str, content: Value) -> Value {
    let mut m = Map::new();
    m.insert(s("role"), s(role));
    m.insert(s("content"), content);
    object(m)
}

/// A non-empty text block's text (`block.type == "text" and block.text`).
fn block_text(block: &Value) -> Option<String> {
    if str_of(block, "type") != "text" {
        return None;
    }
    Some(str_of(block, "text")).filter(|t| !t.is_empty())
}

/// The leading system message: `system` and, when merging, the inline
/// system messages' texts, concatenated.
fn system_message(body: &Value, messages: &[Value], merge: bool, out: &mut Vec<Value>) {
    let mut text = String::new();
    if let Some(system) = get_some(body, "system") {
        if is_str(&system) {
            text.push_str(system.as_str().unwrap_or_default());
        } else {
            for block in items(&system).unwrap_or_default() {
                if let Some(t) = block_text(&block).filter(|t| !t.starts_with(BILLING_HEADER)) {
                    text.push_str(&t);
                }
            }
        }
    }
    if merge {
        for msg in messages.iter().filter(|m| str_of(m, "role") == "system") {
            if let Some(t) = system_text(&get(msg, "content").unwrap_or_default()) {
                text.push_str(&t);
            }
        }
    }
    if !text.is_empty() {
        out.push(message("system", s(&text)));
    }
}

/// An inline system message's text, billing headers dropped (`None`:
/// nothing left, and then no message).
fn system_text(content: &Value) -> Option<String> {
    if let Some(t) = content.as_str() {
        return (!t.is_empty() && !t.starts_with(BILLING_HEADER)).then(|| t.to_owned());
    }
    let text: String = items(content)
        .unwrap_or_default()
        .iter()
        .filter_map(block_text)
        .filter(|t| !t.starts_with(BILLING_HEADER))
        .collect();
    (!text.is_empty()).then_some(text)
}

/// A message's blocks as an OpenAI message (keys in vLLM's order: role,
/// reasoning, tool_calls, content); tool results of a user message are
/// pushed to `out` as they come.
fn convert_blocks(role: &str, content: &Value, out: &mut Vec<Value>) -> Result<Map, RequestError> {
    let mut parts: Vec<Value> = Vec::new();
    let mut calls: Vec<Value> = Vec::new();
    let mut reasoning: Option<String> = None;
    for block in items(content).unwrap_or_default() {
        match str_of(&block, "type").as_str() {
            "text" => {
                if let Some(t) = block_text(&block) {
                    parts.push(text_part(&t));
                }
            }
            "image" => {
                if let Some(source) = get_some(&block, "source").filter(Value::is_true) {
                    parts.push(image_part(image_url(&source)));
                }
            }
            "thinking" => {
                if let Some(t) = get_some(&block, "thinking") {
                    reasoning
                        .get_or_insert_default()
                        .push_str(t.as_str().unwrap_or_default());
                }
            }
            "tool_use" => calls.push(tool_call(&block)?),
            "tool_result" if role == "user" => user_tool_result(&block, out)?,
            "tool_result" => {
                let mut text = String::from("Tool result: ");
                if let Some(c) = get_some(&block, "content").filter(Value::is_true) {
                    crate::json::py_str(&mut text, &c);
                }
                parts.push(text_part(&text));
            }
            // redacted_thinking is opaque, tool_reference is expanded inside
            // tool results, tool changes edit the tool list.
            _ => {}
        }
    }
    let mut m = Map::new();
    m.insert(s("role"), s(role));
    if let Some(r) = reasoning {
        m.insert(s("reasoning"), s(&r));
    }
    if !calls.is_empty() {
        m.insert(s("tool_calls"), Value::from(calls));
    }
    match parts.as_slice() {
        [] => {}
        [only] if get(only, "type").as_ref().and_then(Value::as_str) == Some("text") => {
            m.insert(s("content"), get(only, "text").unwrap_or_default());
        }
        _ => {
            m.insert(s("content"), Value::from(parts));
        }
    }
    Ok(m)
}

fn text_part(text: &str) -> Value {
    let mut m = Map::new();
    m.insert(s("type"), s("text"));
    m.insert(s("text"), s(text));
    object(m)
}

fn image_part(url: Value) -> Value {
    let mut u = Map::new();
    u.insert(s("url"), url);
    let mut m = Map::new();
    m.insert(s("type"), s("image_url"));
    m.insert(s("image_url"), object(u));
    object(m)
}

/// `_convert_image_source_to_url`: a `url` source's URL, else a data URL.
fn image_url(source: &Value) -> Value {
    if get(source, "type").as_ref().and_then(Value::as_str) == Some("url") {
        return get(source, "url").unwrap_or_else(|| s(""));
    }
    let field = |key: &str, default: &str| {
        let mut out = String::new();
        match get(source, key) {
            Some(v) => crate::json::py_str(&mut out, &v),
            None => out.push_str(default),
        }
        out
    };
    s(&format!(
        "data:{};base64,{}",
        field("media_type", "image/jpeg"),
        field("data", "")
    ))
}

/// A `tool_use` block as a chat tool call. A missing id is vLLM's
/// `call_<unix seconds>`, as the replica would stamp it.
fn tool_call(block: &Value) -> Result<Value, RequestError> {
    let id = get_some(block, "id")
        .filter(Value::is_true)
        .unwrap_or_else(|| {
            let secs = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            s(&format!("call_{secs}"))
        });
    let name = get_some(block, "name")
        .filter(Value::is_true)
        .unwrap_or_else(|| s(""));
    let input = get_some(block, "input")
        .filter(Value::is_true)
        .unwrap_or_else(|| object(Map::new()));
    // vLLM writes json.dumps(input) and the chat path parses it back: the
    // same object whichever escaping is used.
    let arguments = crate::json::dumps(&input, &crate::json::DumpOptions::default())
        .map_err(RequestError::message)?;
    let mut f = Map::new();
    f.insert(s("name"), name);
    f.insert(s("arguments"), s(&arguments));
    let mut c = Map::new();
    c.insert(s("id"), id);
    c.insert(s("type"), s("function"));
    c.insert(s("function"), object(f));
    Ok(object(c))
}

/// A user's `tool_result`: a tool message (its text items joined), then a
/// user message of its images, then a tool message of its tool references.
fn user_tool_result(block: &Value, out: &mut Vec<Value>) -> Result<(), RequestError> {
    let content = get_some(block, "content").unwrap_or_default();
    let mut text = String::new();
    let mut images = Vec::new();
    let mut refs = Vec::new();
    if let Some(t) = content.as_str() {
        text.push_str(t);
    } else if let Some(list) = items(&content) {
        let mut texts = Vec::new();
        for item in list.iter().filter(|i| is_map(i)) {
            match str_of(item, "type").as_str() {
                "text" => match get(item, "text") {
                    None => texts.push(String::new()),
                    Some(t) if is_str(&t) => texts.push(t.as_str().unwrap_or_default().to_owned()),
                    Some(_) => {
                        return Err(RequestError::message("tool_result text must be a string"));
                    }
                },
                "image" => {
                    let source = get(item, "source").unwrap_or_else(|| object(Map::new()));
                    if !is_map(&source) {
                        return Err(RequestError::message(
                            "tool_result image source must be an object",
                        ));
                    }
                    let url = image_url(&source);
                    if url.is_true() {
                        images.push(image_part(url));
                    }
                }
                "tool_reference" => {
                    let name = get_some(item, "tool_name")
                        .filter(Value::is_true)
                        .or_else(|| get_some(item, "name"));
                    if let Some(n) = name.filter(Value::is_true) {
                        let mut r = Map::new();
                        r.insert(s("type"), s("tool_reference"));
                        r.insert(s("name"), n);
                        refs.push(object(r));
                    }
                }
                _ => {}
            }
        }
        text = texts.join("\n");
    }
    let id = get_some(block, "tool_use_id")
        .filter(Value::is_true)
        .unwrap_or_else(|| s(""));
    let tool = |content: Value| {
        let mut m = Map::new();
        m.insert(s("role"), s("tool"));
        m.insert(s("tool_call_id"), id.clone());
        m.insert(s("content"), content);
        object(m)
    };
    out.push(tool(s(&text)));
    if !images.is_empty() {
        out.push(message("user", Value::from(images)));
    }
    if !refs.is_empty() {
        out.push(tool(Value::from(refs)));
    }
    Ok(())
}

/// `_resolve_tools` then `_convert_tools`: the tools in effect at the end
/// of the conversation, as chat tool dicts.
fn resolve_tools(body: &Value, messages: &[Value]) -> Result<Option<Vec<Value>>, RequestError> {
    let declared = get_some(body, "tools").and_then(|t| items(&t));
    let changes: Vec<Value> = messages
        .iter()
        .filter_map(|m| items(&get(m, "content").unwrap_or_default()))
        .flatten()
        .filter(|b| matches!(str_of(b, "type").as_str(), "tool_addition" | "tool_removal"))
        .collect();
    let tools: Vec<Value> = if changes.is_empty() {
        match declared {
            Some(list) => list,
            None => return Ok(None),
        }
    } else {
        let mut by_name: IndexMap<String, Value> = IndexMap::new();
        for t in declared.unwrap_or_default() {
            by_name.insert(str_of(&t, "name"), t);
        }
        let mut removed = std::collections::HashSet::new();
        for block in &changes {
            let kind = str_of(block, "type");
            let change = get(block, "tool").unwrap_or_default();
            let name = if str_of(&change, "type") == "tool_definition" {
                let definition = get(&change, "definition").unwrap_or_default();
                let name = str_of(&definition, "name");
                by_name.insert(name.clone(), definition);
                name
            } else {
                let name = str_of(&change, "name");
                let Some(tool) = by_name.get_mut(&name) else {
                    return Err(RequestError::message(format!(
                        "{kind} references tool {}, which is not declared in tools",
                        py_repr_str(&name)
                    )));
                };
                if kind == "tool_addition" {
                    let mut e = entries(tool);
                    e.shift_remove(&s("defer_loading"));
                    *tool = object(e);
                }
                name
            };
            if kind == "tool_removal" {
                removed.insert(name);
            } else {
                removed.remove(&name);
            }
        }
        by_name
            .into_iter()
            .filter(|(n, _)| !removed.contains(n))
            .map(|(_, t)| t)
            .collect()
    };
    Ok(Some(tools.iter().map(chat_tool).collect()))
}

fn py_repr_str(text: &str) -> String {
    let mut out = String::new();
    crate::json::py_str(&mut out, &Value::from(vec![s(text)]));
    out.trim_start_matches('[').trim_end_matches(']').to_owned()
}

/// An Anthropic tool as `ChatCompletionToolsParam.model_dump()`, its
/// `input_schema` given `"type": "object"` (last) when it has no type, as
/// vLLM's validator does.
fn chat_tool(tool: &Value) -> Value {
    let mut schema = entries(&get(tool, "input_schema").unwrap_or_default());
    if !schema.contains_key(&s("type")) {
        schema.insert(s("type"), s("object"));
    }
    let mut f = Map::new();
    f.insert(s("name"), get(tool, "name").unwrap_or_default());
    f.insert(
        s("description"),
        get(tool, "description").unwrap_or(Value::from(())),
    );
    f.insert(s("parameters"), object(schema));
    for key in ["strict", "defer_loading"] {
        if let Some(v) = get_some(tool, key) {
            f.insert(s(key), v);
        }
    }
    let mut m = Map::new();
    m.insert(s("type"), s("function"));
    m.insert(s("function"), object(f));
    object(m)
}

/// The request's `chat_template_kwargs` with the effort the chat completion
/// would pass beside them (`reasoning_effort`, and `enable_thinking` unless
/// the request sets it); `None` when there are neither.
fn template_kwargs(body: &Value, conv: &MessagesConversion) -> Option<Value> {
    let user = get_some(body, "chat_template_kwargs");
    let mut effort = get_some(body, "output_config")
        .and_then(|o| get_some(&o, "effort"))
        .and_then(|e| e.as_str().map(str::to_owned));
    if let Some(t) = get_some(body, "thinking")
        && str_of(&t, "type") == "disabled"
    {
        effort = Some(conv.disabled_thinking_effort.clone());
    }
    let Some(effort) = effort else {
        return user;
    };
    let mut kwargs = user.as_ref().map(entries).unwrap_or_default();
    kwargs.insert(s("reasoning_effort"), s(&effort));
    let user_set = user
        .as_ref()
        .is_some_and(|k| get(k, "enable_thinking").is_some());
    if !user_set {
        kwargs.insert(s("enable_thinking"), Value::from(effort != "none"));
    }
    Some(object(kwargs))
}

/// Whether `v` is a JSON integer (or a float pydantic takes as one).
fn as_int(v: &Value) -> Option<f64> {
    if v.kind() != ValueKind::Number {
        return None;
    }
    if let Some(i) = v.as_i64() {
        return Some(i as f64);
    }
    f64::try_from(v.clone())
        .ok()
        .filter(|f| f.is_finite() && f.fract() == 0.0)
}

#[cfg(test)]
mod tests;
