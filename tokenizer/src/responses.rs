//! vLLM's Responses → chat conversion for `/v1/responses/render`
//! (`construct_input_messages` and `construct_tool_dicts` in
//! `vllm/entrypoints/openai/responses/utils.py`):
//!
//! - a list `input` is first validated as vLLM validates it, and each item
//!   read as the member of the item union pydantic makes of it
//!   (`responses_input`): an output message TypedDict passes whole;
//! - `instructions` becomes a first system message; a string `input` a user
//!   message;
//! - `function_call` (and `custom_tool_call`) items become assistant tool
//!   calls, merged into a directly preceding assistant message;
//! - `reasoning` items become an assistant message's `reasoning` (the first
//!   content text, else the first summary text), merged likewise;
//! - assistant output messages become assistant content (first part's
//!   text), merged into a preceding assistant message without content;
//! - `function_call_output` becomes a tool message;
//! - other items with a `role` pass as chat messages;
//! - a final assistant message or reasoning item whose status is
//!   `in_progress` or `incomplete` is continued (`continue_final_message`);
//! - function tools (namespaces flattened to `ns__name`, custom tools as a
//!   one-string function) become chat tool dicts.

use minijinja::Value;

use crate::chat::{Origin, function_definition, parse_messages};
use crate::error::RequestError;
use crate::responses_input::Reading;
use crate::template::ContentFormat;
use crate::value::{Map, entries, get, get_some, is_map, is_str, items, object, opt_str, s};

/// The messages, tool dicts and continuation flag of a Responses request.
#[derive(Debug)]
pub struct Converted {
    /// Chat messages (before chat parsing).
    pub messages: Vec<Value>,
    /// Tool dicts, `None` without function tools.
    pub tools: Option<Value>,
    /// Whether the last input item is a partial assistant message.
    pub continue_final: bool,
    /// The first message whose parts vLLM's chat parser refuses as it
    /// reads them, and why.
    pub late: Option<(usize, RequestError)>,
}

const CUSTOM_TOOL_INPUT_KEY: &str = "input";

/// Converts `request` (a Responses body).
pub fn convert(request: &Value) -> Result<Converted, RequestError> {
    if get_some(request, "previous_response_id").is_some() {
        return Err(RequestError::invalid(
            "previous_response_id",
            "previous_response_id is not supported by the stateless render endpoint.",
        ));
    }
    let input = get(request, "input")
        .ok_or_else(|| RequestError::invalid("input", "input: Field required"))?;
    let mut messages: Vec<Msg> = Vec::new();
    if let Some(instructions) =
        opt_str(request, "instructions", "instructions")?.filter(|i| !i.is_empty())
    {
        messages.push(Msg::new(message("system", Some(s(&instructions)))));
    }
    let mut continue_final = false;
    let mut late = None;
    if is_str(&input) {
        messages.push(Msg::new(message("user", Some(input.clone()))));
    } else {
        // vLLM lists another iterable `input` before validating it: an
        // object becomes its keys (and `{}` an empty list).
        let list = match items(&input) {
            Some(list) => list,
            None if is_map(&input) => entries(&input).into_keys().collect(),
            None => {
                return Err(RequestError::invalid(
                    "input",
                    "input: Input should be a valid string or list",
                ));
            }
        };
        crate::responses_input::check(&list)?;
        for (i, item) in list.iter().enumerate() {
            if !is_map(item) {
                return Err(RequestError::invalid(
                    format!("input.{i}"),
                    format!("input.{i}: Input should be a valid dictionary"),
                ));
            }
            add_item(&mut messages, item, &format!("input.{i}"))?;
            if late.is_none()
                && let Some(e) = crate::responses_input::read_later(item, &format!("input.{i}"))
            {
                late = Some((messages.len().saturating_sub(1), e));
            }
        }
        continue_final = list.last().is_some_and(is_partial);
    }
    Ok(Converted {
        messages: messages.into_iter().map(Msg::into_value).collect(),
        tools: tools(request)?,
        continue_final,
        late,
    })
}

/// The chat conversation of converted `messages`, parsed as vLLM's chat
/// parser does, in order: a `late` failure (a message whose parts pydantic
/// checks as the parser reads them) is the answer unless a message before it
/// fails first.
pub fn conversation(
    messages: Vec<Value>,
    late: Option<(usize, RequestError)>,
    format: ContentFormat,
) -> Result<Vec<Value>, RequestError> {
    match late {
        Some((at, e)) => {
            let before: Vec<Value> = messages.into_iter().take(at).collect();
            parse_messages(&Value::from(before), format, Origin::Responses)?;
            Err(e)
        }
        None => parse_messages(&Value::from(messages), format, Origin::Responses),
    }
}

fn message(role: &str, content: Option<Value>) -> Value {
    let mut m = Map::new();
    m.insert(s("role"), s(role));
    if let Some(c) = content {
        m.insert(s("content"), c);
    }
    object(m)
}

fn item_type(item: &Value) -> Option<String> {
    get_some(item, "type").and_then(|t| t.as_str().map(str::to_owned))
}

fn is_partial(item: &Value) -> bool {
    let kind = item_type(item).unwrap_or_else(|| "message".to_owned());
    if kind != "message" && kind != "reasoning" {
        return false;
    }
    matches!(
        get_some(item, "status").as_ref().and_then(Value::as_str),
        Some("in_progress" | "incomplete")
    )
}

/// A message under construction. Merges only ever touch the last message,
/// and a run of `function_call` items only grows its tool calls: those are
/// kept as a plain list until the end, so each merge costs O(1) (vLLM
/// appends to the last assistant message in place) instead of copying the
/// list so far.
#[derive(Debug)]
struct Msg {
    /// The message as taken or built (when `fields` is `None`).
    raw: Value,
    /// Its fields once merged into, in order.
    fields: Option<Map>,
    /// Its tool calls once merged into; `fields` then holds the
    /// `tool_calls` key (in its place), whose value this list becomes.
    calls: Option<Vec<Value>>,
}

impl Msg {
    fn new(raw: Value) -> Self {
        Self {
            raw,
            fields: None,
            calls: None,
        }
    }

    /// `msg[key]` as [`get`] reads it from the finished message.
    fn get(&self, key: &str) -> Option<Value> {
        if key == "tool_calls"
            && let Some(calls) = &self.calls
        {
            return Some(Value::from(calls.clone()));
        }
        match &self.fields {
            Some(f) => f.get(&s(key)).filter(|v| !v.is_undefined()).cloned(),
            None => get(&self.raw, key),
        }
    }

    /// `msg[key]` unless absent or `null`.
    fn get_some(&self, key: &str) -> Option<Value> {
        self.get(key).filter(|v| !v.is_none())
    }

    fn is_assistant(&self) -> bool {
        let role = match &self.fields {
            Some(f) => f.get(&s("role")).cloned(),
            None => get(&self.raw, "role"),
        };
        role.as_ref().and_then(Value::as_str) == Some("assistant")
    }

    /// The fields, for merging (opened once).
    fn fields(&mut self) -> &mut Map {
        self.fields.get_or_insert_with(|| entries(&self.raw))
    }

    fn set_field(&mut self, key: &str, v: Value) {
        self.fields().insert(s(key), v);
    }

    /// Appends `call` to the tool calls, as vLLM does to the last assistant
    /// message; `Err(call)` when its `tool_calls` is there but not a list.
    fn push_call(&mut self, call: Value) -> Result<(), Value> {
        if let Some(calls) = &mut self.calls {
            calls.push(call);
            return Ok(());
        }
        let mut list = match self.get("tool_calls") {
            None => Vec::new(),
            Some(tc) => match items(&tc) {
                Some(list) => list,
                None => return Err(call),
            },
        };
        list.push(call);
        // The key takes its place now (last if new); its value is set at
        // the end.
        self.set_field("tool_calls", Value::from(()));
        self.calls = Some(list);
        Ok(())
    }

    fn into_value(self) -> Value {
        match self.fields {
            None => self.raw,
            Some(mut fields) => {
                if let Some(calls) = self.calls {
                    fields.insert(s("tool_calls"), Value::from(calls));
                }
                object(fields)
            }
        }
    }
}

/// The last message if it is an assistant's (to merge into).
fn prev_assistant(messages: &mut [Msg]) -> Option<&mut Msg> {
    messages.last_mut().filter(|m| m.is_assistant())
}

fn add_item(messages: &mut Vec<Msg>, item: &Value, at: &str) -> Result<(), RequestError> {
    let kind = item_type(item);
    let reading = crate::responses_input::reading(item);
    match reading {
        Reading::Raw | Reading::ModelParts => {}
        Reading::Whole => {
            messages.push(Msg::new(item.clone()));
            return Ok(());
        }
        Reading::Refused => return Err(unsupported_type(kind.as_deref())),
        Reading::Fails(why) => {
            return Err(RequestError::Unsupported(format!(
                "{at}: {why}, which vLLM's conversion fails on"
            )));
        }
    }
    if let Some(call) = call_of(item, kind.as_deref(), at)? {
        let call = match prev_assistant(messages) {
            Some(prev) => match prev.push_call(call) {
                Ok(()) => return Ok(()),
                Err(call) => call,
            },
            None => call,
        };
        let mut m = Msg::new(Value::from(()));
        m.fields = Some(Map::new());
        m.set_field("role", s("assistant"));
        m.set_field("tool_calls", Value::from(()));
        m.calls = Some(vec![call]);
        messages.push(m);
        return Ok(());
    }
    match kind.as_deref() {
        Some("reasoning") => add_reasoning(messages, item),
        Some("function_call_output" | "custom_tool_call_output") => {
            let mut output = get(item, "output").unwrap_or(Value::from(()));
            if reading == Reading::ModelParts {
                // The parts reach vLLM's chat parser as models, which it
                // takes for neither text nor objects.
                output = Value::from(vec![Value::from(()); output.len().unwrap_or(0)]);
            }
            let mut m = Map::new();
            m.insert(s("role"), s("tool"));
            m.insert(s("content"), output);
            m.insert(
                s("tool_call_id"),
                get(item, "call_id").unwrap_or(Value::from(())),
            );
            messages.push(Msg::new(object(m)));
            Ok(())
        }
        _ if get(item, "role").as_ref().and_then(Value::as_str) == Some("assistant") => {
            add_assistant(messages, item);
            Ok(())
        }
        _ if get(item, "role").is_some() => {
            messages.push(Msg::new(item.clone()));
            Ok(())
        }
        other => Err(unsupported_type(other)),
    }
}

/// The tool call a `function_call` or `custom_tool_call` item makes.
fn call_of(item: &Value, kind: Option<&str>, at: &str) -> Result<Option<Value>, RequestError> {
    Ok(match kind {
        Some("function_call") => {
            let mut name = crate::value::req_str(item, "name", &format!("{at}.name"))?;
            if let Some(ns) =
                opt_str(item, "namespace", &format!("{at}.namespace"))?.filter(|n| !n.is_empty())
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
    })
}

/// A reasoning item: the first content text, else the first summary text,
/// as the reasoning of a directly preceding assistant message without one.
fn add_reasoning(messages: &mut Vec<Msg>, item: &Value) -> Result<(), RequestError> {
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
        && prev.get_some("reasoning").is_none()
    {
        prev.set_field("reasoning", reasoning);
        return Ok(());
    }
    let mut m = Map::new();
    m.insert(s("role"), s("assistant"));
    m.insert(s("reasoning"), reasoning);
    messages.push(Msg::new(object(m)));
    Ok(())
}

/// An assistant message read raw: its text (the content string, else the
/// first part's text) as the content of a directly preceding assistant
/// message without one; without text, the item itself.
fn add_assistant(messages: &mut Vec<Msg>, item: &Value) {
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
                && prev.get_some("content").is_none()
            {
                prev.set_field("content", text);
                return;
            }
            messages.push(Msg::new(message("assistant", Some(text))));
        }
        None => messages.push(Msg::new(item.clone())),
    }
}

fn unsupported_type(kind: Option<&str>) -> RequestError {
    RequestError::invalid(
        "input",
        format!("Unsupported input item type: {}", kind.unwrap_or("None")),
    )
}

fn tool_call(id: &str, name: &str, arguments: &str) -> Value {
    let mut f = Map::new();
    f.insert(s("name"), s(name));
    f.insert(s("arguments"), s(arguments));
    let mut c = Map::new();
    c.insert(s("id"), s(id));
    c.insert(s("function"), object(f));
    c.insert(s("type"), s("function"));
    object(c)
}

/// The request's function tools as chat tool dicts.
fn tools(request: &Value) -> Result<Option<Value>, RequestError> {
    let Some(list) = get_some(request, "tools") else {
        return Ok(None);
    };
    let list = items(&list)
        .ok_or_else(|| RequestError::invalid("tools", "tools: Input should be a valid list"))?;
    if list.is_empty() {
        return Ok(None);
    }
    let mut out = Vec::new();
    for (i, tool) in list.iter().enumerate() {
        let at = format!("tools.{i}");
        match item_type(tool).as_deref() {
            Some("function") => out.push(wrap(function_definition(tool, None, &at)?)),
            Some("namespace") => {
                let ns = crate::value::req_str(tool, "name", &format!("{at}.name"))?;
                for (j, inner) in items(&get(tool, "tools").unwrap_or_default())
                    .unwrap_or_default()
                    .iter()
                    .enumerate()
                {
                    if item_type(inner).as_deref() != Some("function") {
                        continue;
                    }
                    let name =
                        crate::value::req_str(inner, "name", &format!("{at}.tools.{j}.name"))?;
                    let mut e = entries(inner);
                    e.insert(s("name"), s(&format!("{ns}__{name}")));
                    out.push(wrap(function_definition(
                        &object(e),
                        None,
                        &format!("{at}.tools.{j}"),
                    )?));
                }
            }
            Some("custom") => {
                let mut e = Map::new();
                e.insert(
                    s("name"),
                    s(&crate::value::req_str(tool, "name", &format!("{at}.name"))?),
                );
                e.insert(
                    s("description"),
                    get_some(tool, "description").unwrap_or(Value::from(())),
                );
                e.insert(s("parameters"), custom_tool_parameters());
                out.push(wrap(function_definition(&object(e), None, &at)?));
            }
            _ => {}
        }
    }
    Ok(Some(Value::from(out)))
}

fn wrap(function: Value) -> Value {
    let mut m = Map::new();
    m.insert(s("type"), s("function"));
    m.insert(s("function"), function);
    object(m)
}

fn custom_tool_parameters() -> Value {
    let text = r#"{"type": "object", "properties": {"input": {"type": "string", "description": "The freeform text payload for this tool."}}, "required": ["input"], "additionalProperties": false}"#;
    crate::loads::parse(text.as_bytes()).unwrap_or_default()
}

#[cfg(test)]
mod tests;
