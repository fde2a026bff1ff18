//! vLLM's chat preprocessing: request messages → the conversation the
//! template sees (`parse_chat_messages` and `_postprocess_messages` in
//! `vllm/renderers/chat_utils.py`), request tools → tool dicts
//! (`ChatCompletionToolsParam.model_dump()`), with the request validation
//! vLLM's pydantic models apply to these fields.
//!
//! What the template sees, key for key and in vLLM's order:
//! `role, content, tool_calls, reasoning, reasoning_content` (assistant),
//! `tool_call_id` (tool), `name`, `task`, `tools` (developer). Content is a
//! string of the text parts joined with `"\n"` ("string" format) or a list of
//! `{"type": "text", "text": …}` parts ("openai" format); tool messages' text
//! parts are always joined. Tool-call `arguments` strings are parsed to
//! objects (`{}` when empty, invalid or not an object).

use minijinja::Value;
use minijinja::value::ValueKind;

use crate::error::RequestError;
use crate::template::ContentFormat;
use crate::value::{
    Map, entries, get, get_some, is_map, is_str, items, object, opt_str, req_str, s,
};

/// Where the messages come from: a chat request (validated as vLLM's
/// pydantic models do) or vLLM's own Responses conversion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// `messages` of a chat request.
    Chat,
    /// Built from Responses input items.
    Responses,
}

/// Part fields vLLM knows; other fields of text parts are kept ("openai"
/// format).
const KNOWN_PART_FIELDS: &[&str] = &[
    "type",
    "text",
    "image_url",
    "input_audio",
    "refusal",
    "file",
    "audio_url",
    "video_url",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "data",
    "image_pil",
    "uuid",
    "thinking",
    "closed",
    "name",
    "image",
    "audio",
    "video",
    "detail",
    "file_id",
    "file_url",
    "filename",
];

const MEDIA_PARTS: &[&str] = &[
    "image_url",
    "input_image",
    "audio_url",
    "input_audio",
    "video_url",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "image_pil",
    "image",
    "audio",
    "video",
    "file",
];

pub(crate) const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// The conversation for the template.
pub fn parse_messages(
    messages: &Value,
    format: ContentFormat,
    origin: Origin,
) -> Result<Vec<Value>, RequestError> {
    let list = items(messages).ok_or_else(|| {
        RequestError::invalid("messages", "messages: Input should be a valid list")
    })?;
    let mut out = Vec::with_capacity(list.len());
    for (i, msg) in list.iter().enumerate() {
        out.push(parse_message(
            msg,
            format,
            origin,
            &format!("messages.{i}"),
        )?);
    }
    Ok(out)
}

fn parse_message(
    msg: &Value,
    format: ContentFormat,
    origin: Origin,
    at: &str,
) -> Result<Value, RequestError> {
    if !is_map(msg) {
        return Err(RequestError::invalid(
            at,
            format!("{at}: Input should be a valid dictionary"),
        ));
    }
    if origin == Origin::Responses && get(msg, "role").is_some_and(|r| !is_str(&r)) {
        // An item vLLM passes on by its `role` key alone: the template
        // would get a role that is not a string.
        return Err(RequestError::Unsupported(format!(
            "{at}.role: a role that is not a string is not rendered locally"
        )));
    }
    let role = req_str(msg, "role", &format!("{at}.role"))?;
    let parts = content_parts(msg, &role, origin, at)?;
    let parts = if role == "system" {
        strip_billing_header(parts)
    } else {
        parts
    };
    // With "string" content vLLM drops empty texts before joining them.
    let parts: Vec<Part> = match format {
        ContentFormat::String => parts
            .into_iter()
            .filter(|p| p.text().is_some_and(|t| !t.is_empty()))
            .collect(),
        ContentFormat::OpenAi => parts,
    };

    let mut m = Map::new();
    m.insert(s("role"), s(&role));
    let content_value = match format {
        ContentFormat::String => texts_joined(&parts),
        ContentFormat::OpenAi => Value::from(parts.iter().map(Part::to_value).collect::<Vec<_>>()),
    };
    m.insert(s("content"), content_value);

    if role == "assistant" {
        if let Some(calls) = get_some(msg, "tool_calls") {
            m.insert(
                s("tool_calls"),
                tool_calls(&calls, origin, &format!("{at}.tool_calls"))?,
            );
        }
        if let Some(r) = get_some(msg, "reasoning") {
            if !is_str(&r) {
                return Err(RequestError::invalid(
                    format!("{at}.reasoning"),
                    format!("{at}.reasoning: Input should be a valid string"),
                ));
            }
            m.insert(s("reasoning"), r.clone());
            m.insert(s("reasoning_content"), r);
        }
    } else if role == "tool" {
        if let Some(id) = get(msg, "tool_call_id") {
            if origin == Origin::Chat && !is_str(&id) {
                return Err(RequestError::invalid(
                    format!("{at}.tool_call_id"),
                    format!("{at}.tool_call_id: Input should be a valid string"),
                ));
            }
            m.insert(s("tool_call_id"), id);
        }
        let all_text = parts.iter().all(|p| matches!(p, Part::Text(..)));
        if all_text {
            m.insert(s("content"), texts_joined(&parts));
        }
    }
    if let Some(name) = get(msg, "name").filter(is_str) {
        m.insert(s("name"), name);
    }
    if let Some(task) = get(msg, "task").filter(is_str) {
        m.insert(s("task"), task);
    }
    if role == "developer" {
        m.insert(s("tools"), get(msg, "tools").unwrap_or(Value::from(())));
    }
    Ok(object(m))
}

/// A message's content as parts.
fn content_parts(
    msg: &Value,
    role: &str,
    origin: Origin,
    at: &str,
) -> Result<Vec<Part>, RequestError> {
    let content = get(msg, "content");
    Ok(match &content {
        None => Vec::new(),
        Some(c) if c.is_none() => {
            if origin == Origin::Chat && role != "assistant" {
                return Err(RequestError::invalid(
                    format!("{at}.content"),
                    format!("{at}.content: Input should be a valid string or list"),
                ));
            }
            Vec::new()
        }
        Some(c) if is_str(c) => vec![Part::Text(c.clone(), Map::new())],
        // vLLM's chat parser iterates the content of an item the Responses
        // conversion passes on unchecked: an object's keys are text parts.
        Some(c) if origin == Origin::Responses && is_map(c) => {
            let keys: Vec<Value> = entries(c).into_keys().collect();
            parse_parts(&keys, origin, &format!("{at}.content"))?
        }
        Some(c) => match items(c) {
            Some(list) => parse_parts(&list, origin, &format!("{at}.content"))?,
            None => {
                return Err(RequestError::invalid(
                    format!("{at}.content"),
                    format!("{at}.content: Input should be a valid string or list"),
                ));
            }
        },
    })
}

/// The texts of `parts` joined with newlines (one part's text is shared,
/// not copied).
fn texts_joined(parts: &[Part]) -> Value {
    match parts {
        [] => s(""),
        [Part::Text(t, _)] => t.clone(),
        _ => s(&parts
            .iter()
            .filter_map(Part::text)
            .collect::<Vec<_>>()
            .join("\n")),
    }
}

/// A parsed content part.
#[derive(Debug, Clone)]
enum Part {
    /// Text (a string value, from text, input_text, output_text, refusal,
    /// thinking parts) and the part's unknown fields.
    Text(Value, Map),
    /// A tool reference (its name).
    ToolReference(String),
}

impl Part {
    fn text(&self) -> Option<&str> {
        match self {
            Part::Text(t, _) => t.as_str(),
            Part::ToolReference(t) => Some(t),
        }
    }

    fn to_value(&self) -> Value {
        let mut m = Map::new();
        match self {
            Part::Text(t, extra) => {
                m.insert(s("type"), s("text"));
                m.insert(s("text"), t.clone());
                for (k, v) in extra {
                    m.insert(k.clone(), v.clone());
                }
            }
            Part::ToolReference(n) => {
                m.insert(s("type"), s("tool_reference"));
                m.insert(s("name"), s(n));
            }
        }
        object(m)
    }
}

fn parse_parts(list: &[Value], origin: Origin, at: &str) -> Result<Vec<Part>, RequestError> {
    let mut out = Vec::new();
    for (i, part) in list.iter().enumerate() {
        let here = format!("{at}.{i}");
        if is_str(part) && origin == Origin::Responses {
            out.push(Part::Text(part.clone(), Map::new()));
            continue;
        }
        if !is_map(part) {
            if origin == Origin::Responses {
                // vLLM's chat parser asserts that a part is text or an
                // object (a server error): a replica answers.
                return Err(RequestError::Unsupported(format!(
                    "{here}: a content part that is neither text nor an object, which vLLM's chat parser fails on"
                )));
            }
            return Err(RequestError::invalid(
                &here,
                format!("{here}: Input should be a valid dictionary"),
            ));
        }
        let kind = match get_some(part, "type") {
            None => "text".to_owned(),
            Some(t) if is_str(&t) => t.as_str().unwrap_or_default().to_owned(),
            Some(_) => {
                return Err(RequestError::invalid(
                    format!("{here}.type"),
                    format!("{here}.type: Input should be a valid string"),
                ));
            }
        };
        let field = match kind.as_str() {
            "text" | "input_text" | "output_text" => "text",
            "refusal" => "refusal",
            "thinking" => "thinking",
            "tool_reference" => "name",
            k if MEDIA_PARTS.contains(&k) => {
                return Err(RequestError::Unsupported(format!(
                    "content part type {k:?} (multimodal input) is not tokenized locally"
                )));
            }
            other => {
                return Err(RequestError::invalid(
                    "type",
                    format!("Unsupported chat content part type: {other:?}."),
                ));
            }
        };
        let Some(text) = get_some(part, field) else {
            continue; // vLLM skips parts whose content is missing
        };
        if !is_str(&text) {
            return Err(RequestError::invalid(
                format!("{here}.{field}"),
                format!("{here}.{field}: Input should be a valid string"),
            ));
        }
        if kind == "tool_reference" {
            out.push(Part::ToolReference(
                text.as_str().unwrap_or_default().to_owned(),
            ));
        } else {
            let extra: Map = entries(part)
                .into_iter()
                .filter(|(k, _)| !k.as_str().is_some_and(|k| KNOWN_PART_FIELDS.contains(&k)))
                .collect();
            out.push(Part::Text(text, extra));
        }
    }
    Ok(out)
}

/// Drops the attribution line some clients put first in system text.
fn strip_billing_header(parts: Vec<Part>) -> Vec<Part> {
    parts
        .into_iter()
        .filter_map(|p| match p {
            Part::Text(t, extra) if t.as_str().is_some_and(|t| t.starts_with(BILLING_HEADER)) => {
                let rest = t
                    .as_str()
                    .and_then(|t| t.split_once('\n'))
                    .map(|(_, r)| r.to_owned())
                    .unwrap_or_default();
                (!rest.is_empty()).then_some(Part::Text(s(&rest), extra))
            }
            other => Some(other),
        })
        .collect()
}

/// An assistant's tool calls: validated, keys in pydantic's order for chat
/// requests (`id, function{arguments, name, …}, type, …`), arguments parsed.
/// An empty list is dropped by the caller (`None`).
fn tool_calls(calls: &Value, origin: Origin, at: &str) -> Result<Value, RequestError> {
    let list = items(calls)
        .ok_or_else(|| RequestError::invalid(at, format!("{at}: Input should be a valid list")))?;
    let mut out = Vec::with_capacity(list.len());
    for (i, call) in list.iter().enumerate() {
        let here = format!("{at}.{i}");
        if !is_map(call) {
            return Err(RequestError::invalid(
                "tool_calls",
                "assistant tool_calls entries must be objects.",
            ));
        }
        let function = get(call, "function").unwrap_or_default();
        let kind = get_some(call, "type");
        let is_function = kind.as_ref().is_none_or(|t| t.as_str() == Some("function"));
        if !is_function || !is_map(&function) {
            return Err(RequestError::invalid(
                "tool_calls",
                "chat completions only support assistant tool_calls of type 'function'.",
            ));
        }
        if origin == Origin::Chat {
            req_str(call, "id", &format!("{here}.id"))?;
            req_str(&function, "name", &format!("{here}.function.name"))?;
            req_str(
                &function,
                "arguments",
                &format!("{here}.function.arguments"),
            )?;
        }
        let args = parse_arguments(get(&function, "arguments"))?;
        let mut f = Map::new();
        let mut c = Map::new();
        match origin {
            Origin::Chat => {
                f.insert(s("arguments"), args);
                f.insert(s("name"), get(&function, "name").unwrap_or_default());
                for (k, v) in entries(&function) {
                    if !matches!(k.as_str(), Some("arguments" | "name")) {
                        f.insert(k, v);
                    }
                }
                c.insert(s("id"), get(call, "id").unwrap_or_default());
                c.insert(s("function"), object(f));
                c.insert(s("type"), s("function"));
                for (k, v) in entries(call) {
                    if !matches!(k.as_str(), Some("id" | "function" | "type")) {
                        c.insert(k, v);
                    }
                }
            }
            Origin::Responses => {
                for (k, v) in entries(call) {
                    if k.as_str() == Some("function") {
                        for (fk, fv) in entries(&function) {
                            let fv = if fk.as_str() == Some("arguments") {
                                args.clone()
                            } else {
                                fv
                            };
                            f.insert(fk, fv);
                        }
                        c.insert(k, object(std::mem::take(&mut f)));
                    } else {
                        c.insert(k, v);
                    }
                }
            }
        }
        out.push(object(c));
    }
    Ok(Value::from(out))
}

/// `arguments` as vLLM hands it to templates: the parsed object; `{}` when
/// missing, empty, not valid JSON (Python's `JSONDecodeError`) or not an
/// object. JSON Python reads but this parser cannot hold (and nesting past
/// [`crate::MAX_DEPTH`], which Python reads) is a local refusal.
fn parse_arguments(args: Option<Value>) -> Result<Value, RequestError> {
    let empty = || object(Map::new());
    let Some(a) = args.filter(Value::is_true) else {
        return Ok(empty());
    };
    if a.kind() == ValueKind::Map {
        return Ok(a);
    }
    let Some(text) = a.as_str() else {
        return Ok(empty());
    };
    match crate::loads::parse_str(text.as_bytes()) {
        Ok(v) if v.kind() == ValueKind::Map => Ok(v),
        Ok(_) | Err(RequestError::InvalidJson(_)) => Ok(empty()),
        Err(RequestError::TooDeep { limit }) => Err(RequestError::Inexact {
            kind: crate::error::InexactKind::Json,
            detail: format!("tool call arguments nest deeper than {limit} levels"),
        }),
        Err(e) => Err(e),
    }
}

/// Drops empty `tool_calls` (vLLM keeps templates on the plain assistant
/// path).
pub fn drop_empty_tool_calls(conversation: Vec<Value>) -> Vec<Value> {
    conversation
        .into_iter()
        .map(|m| match get(&m, "tool_calls") {
            Some(tc) if tc.len() == Some(0) => {
                let mut e = entries(&m);
                e.shift_remove(&s("tool_calls"));
                object(e)
            }
            _ => m,
        })
        .collect()
}

/// Developer messages as vLLM rewrites them for templates that do not know
/// the role: system messages, all merged into one at the front.
pub fn developer_to_system(conversation: Vec<Value>) -> Vec<Value> {
    let converted: Vec<Value> = conversation
        .into_iter()
        .map(|m| {
            if get(&m, "role").as_ref().and_then(Value::as_str) == Some("developer") {
                let mut e = entries(&m);
                e.insert(s("role"), s("system"));
                e.shift_remove(&s("tools"));
                object(e)
            } else {
                m
            }
        })
        .collect();
    let mut system = Vec::new();
    let mut rest = Vec::new();
    let mut merge = false;
    for (i, m) in converted.iter().enumerate() {
        if get(m, "role").as_ref().and_then(Value::as_str) == Some("system") {
            if i > 0 || !system.is_empty() {
                merge = true;
            }
            let content = get(m, "content").unwrap_or_default();
            let text = match items(&content) {
                Some(parts) => parts
                    .iter()
                    .filter_map(|p| {
                        if is_str(p) {
                            p.as_str().map(str::to_owned)
                        } else {
                            get(p, "text").and_then(|t| t.as_str().map(str::to_owned))
                        }
                    })
                    .collect::<Vec<_>>()
                    .join("\n"),
                None => content.as_str().map(str::to_owned).unwrap_or_default(),
            };
            if !text.is_empty() {
                system.push(text);
            }
        } else {
            rest.push(m.clone());
        }
    }
    if !merge {
        return converted;
    }
    let mut first = Map::new();
    first.insert(s("role"), s("system"));
    first.insert(s("content"), s(&system.join("\n\n")));
    std::iter::once(object(first)).chain(rest).collect()
}

/// Chat request tools as `ChatCompletionToolsParam.model_dump()`:
/// `{type, function: {name, description, parameters, strict?, defer_loading?}, defer_loading?}`.
pub fn chat_tools(tools: &Value) -> Result<Value, RequestError> {
    let list = items(tools)
        .ok_or_else(|| RequestError::invalid("tools", "tools: Input should be a valid list"))?;
    let mut out = Vec::with_capacity(list.len());
    for (i, tool) in list.iter().enumerate() {
        let at = format!("tools.{i}");
        if !is_map(tool) {
            return Err(RequestError::invalid(
                &at,
                format!("{at}: Input should be a valid dictionary"),
            ));
        }
        if let Some(t) = get_some(tool, "type")
            && t.as_str() != Some("function")
        {
            return Err(RequestError::invalid(
                format!("{at}.type"),
                format!("{at}.type: Input should be 'function'"),
            ));
        }
        let function = get(tool, "function").ok_or_else(|| {
            RequestError::invalid(
                format!("{at}.function"),
                format!("{at}.function: Field required"),
            )
        })?;
        let defer = get_some(tool, "defer_loading");
        let f = function_definition(&function, defer, &format!("{at}.function"))?;
        let mut m = Map::new();
        m.insert(s("type"), s("function"));
        m.insert(s("function"), f);
        if let Some(d) = get_some(tool, "defer_loading") {
            m.insert(s("defer_loading"), d);
        }
        out.push(object(m));
    }
    Ok(Value::from(out))
}

/// `FunctionDefinition.model_dump()` of `f`.
pub fn function_definition(
    f: &Value,
    defer: Option<Value>,
    at: &str,
) -> Result<Value, RequestError> {
    if !is_map(f) {
        return Err(RequestError::invalid(
            at,
            format!("{at}: Input should be a valid dictionary"),
        ));
    }
    let name = req_str(f, "name", &format!("{at}.name"))?;
    let description = opt_str(f, "description", &format!("{at}.description"))?;
    let parameters = match get_some(f, "parameters") {
        None => Value::from(()),
        Some(p) if is_map(&p) => p,
        Some(_) => {
            return Err(RequestError::invalid(
                format!("{at}.parameters"),
                format!("{at}.parameters: Input should be a valid dictionary"),
            ));
        }
    };
    let mut m = Map::new();
    m.insert(s("name"), s(&name));
    m.insert(
        s("description"),
        description.as_deref().map_or(Value::from(()), s),
    );
    m.insert(s("parameters"), parameters);
    if let Some(strict) = get_some(f, "strict") {
        if strict.kind() != ValueKind::Bool {
            return Err(RequestError::invalid(
                format!("{at}.strict"),
                format!("{at}.strict: Input should be a valid boolean"),
            ));
        }
        m.insert(s("strict"), strict);
    }
    if let Some(d) = get_some(f, "defer_loading").or(defer) {
        m.insert(s("defer_loading"), d);
    }
    Ok(object(m))
}
