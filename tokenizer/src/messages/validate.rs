//! The validation vLLM's pydantic models (`AnthropicMessagesRequest`,
//! `AnthropicCountTokensRequest`) apply to the fields that reach the prompt
//! or decide whether there is one: a body they refuse is refused here too.

use minijinja::Value;
use minijinja::value::ValueKind;

use super::{EFFORTS, as_int, str_of};
use crate::error::RequestError;
use crate::value::{get, get_some, is_map, is_str, items};

const BLOCK_TYPES: &[&str] = &[
    "text",
    "image",
    "tool_use",
    "tool_result",
    "tool_reference",
    "thinking",
    "redacted_thinking",
    "tool_addition",
    "tool_removal",
];

/// `VLLM_MAX_STOP_STRINGS`' default.
const MAX_STOP_STRINGS: usize = 4;

/// The kinds an optional field may have.
#[derive(Clone, Copy)]
enum Kind {
    Str,
    Bool,
    Map,
    List,
    StrOrList,
}

fn bad(at: &str, what: &str) -> RequestError {
    RequestError::invalid(at, format!("{at}: Input should be {what}"))
}

/// `v[key]` unless absent or `null`, refused unless of `kind`.
fn opt(v: &Value, key: &str, kind: Kind, at: &str) -> Result<Option<Value>, RequestError> {
    let Some(x) = get_some(v, key) else {
        return Ok(None);
    };
    let here = format!("{at}{key}");
    let ok = match kind {
        Kind::Str => is_str(&x),
        Kind::Bool => x.kind() == ValueKind::Bool,
        Kind::Map => is_map(&x),
        Kind::List => x.kind() == ValueKind::Seq,
        Kind::StrOrList => is_str(&x) || x.kind() == ValueKind::Seq,
    };
    if !ok {
        let what = match kind {
            Kind::Str => "a valid string",
            Kind::Bool => "a valid boolean",
            Kind::Map => "a valid dictionary",
            Kind::List => "a valid list",
            Kind::StrOrList => "a valid string or list",
        };
        return Err(bad(&here, what));
    }
    Ok(Some(x))
}

/// A whole Messages (or count_tokens) body.
pub fn body(body: &Value, count_tokens: bool) -> Result<(), RequestError> {
    match get(body, "model") {
        Some(m) if m.as_str().is_some_and(|m| !m.is_empty()) => {}
        Some(m) if is_str(&m) => {
            return Err(RequestError::invalid("model", "Model is required"));
        }
        Some(_) => return Err(bad("model", "a valid string")),
        None => return Err(RequestError::invalid("model", "model: Field required")),
    }
    let messages = get(body, "messages")
        .ok_or_else(|| RequestError::invalid("messages", "messages: Field required"))?;
    let messages = items(&messages).ok_or_else(|| bad("messages", "a valid list"))?;
    for (i, msg) in messages.iter().enumerate() {
        message(msg, &format!("messages.{i}"))?;
    }
    if !count_tokens {
        match get(body, "max_tokens") {
            None => {
                return Err(RequestError::invalid(
                    "max_tokens",
                    "max_tokens: Field required",
                ));
            }
            Some(m) => match as_int(&m) {
                Some(n) if n > 0.0 => {}
                Some(_) => {
                    return Err(RequestError::invalid(
                        "max_tokens",
                        "max_tokens must be positive",
                    ));
                }
                None => return Err(bad("max_tokens", "a valid integer")),
            },
        }
        if let Some(stops) = opt(body, "stop_sequences", Kind::List, "")? {
            let list = items(&stops).unwrap_or_default();
            if list.len() > MAX_STOP_STRINGS || !list.iter().all(is_str) {
                return Err(RequestError::invalid(
                    "stop_sequences",
                    format!("stop_sequences: at most {MAX_STOP_STRINGS} strings"),
                ));
            }
        }
    }
    if let Some(system) = opt(body, "system", Kind::StrOrList, "")? {
        for (i, block) in items(&system).unwrap_or_default().iter().enumerate() {
            content_block(block, false, &format!("system.{i}"))?;
        }
    }
    if let Some(tools) = opt(body, "tools", Kind::List, "")? {
        for (i, t) in items(&tools).unwrap_or_default().iter().enumerate() {
            tool(t, &format!("tools.{i}"))?;
        }
    }
    tool_choice(body)?;
    thinking(body, count_tokens)?;
    output_config(body)?;
    opt(body, "chat_template_kwargs", Kind::Map, "")?;
    Ok(())
}

fn message(msg: &Value, at: &str) -> Result<(), RequestError> {
    if !is_map(msg) {
        return Err(bad(at, "a valid dictionary"));
    }
    let role = str_of(msg, "role");
    if !matches!(role.as_str(), "user" | "assistant" | "system") {
        return Err(bad(
            &format!("{at}.role"),
            "'user', 'assistant' or 'system'",
        ));
    }
    let content = get(msg, "content").unwrap_or_default();
    if is_str(&content) {
        return Ok(());
    }
    let blocks =
        items(&content).ok_or_else(|| bad(&format!("{at}.content"), "a valid string or list"))?;
    for (i, block) in blocks.iter().enumerate() {
        content_block(block, role == "system", &format!("{at}.content.{i}"))?;
    }
    Ok(())
}

/// `AnthropicContentBlock`; tool changes only where `changes_ok` (in
/// system messages).
fn content_block(block: &Value, changes_ok: bool, at: &str) -> Result<(), RequestError> {
    if !is_map(block) {
        return Err(bad(at, "a valid dictionary"));
    }
    let kind = str_of(block, "type");
    if !BLOCK_TYPES.contains(&kind.as_str()) || !get(block, "type").is_some_and(|t| is_str(&t)) {
        return Err(bad(&format!("{at}.type"), "a known content block type"));
    }
    let here = format!("{at}.");
    for key in [
        "text",
        "id",
        "tool_use_id",
        "name",
        "tool_name",
        "thinking",
        "signature",
        "data",
    ] {
        opt(block, key, Kind::Str, &here)?;
    }
    opt(block, "source", Kind::Map, &here)?;
    opt(block, "input", Kind::Map, &here)?;
    opt(block, "is_error", Kind::Bool, &here)?;
    if let Some(c) = opt(block, "content", Kind::StrOrList, &here)?
        && !items(&c).unwrap_or_default().iter().all(is_map)
    {
        return Err(bad(&format!("{at}.content"), "a list of dictionaries"));
    }
    if matches!(kind.as_str(), "tool_addition" | "tool_removal") {
        if !changes_ok {
            return Err(RequestError::invalid(
                at,
                format!("{kind} blocks are only allowed in messages with role \"system\""),
            ));
        }
        tool_change(block, &kind, at)?;
    }
    Ok(())
}

fn tool_change(block: &Value, kind: &str, at: &str) -> Result<(), RequestError> {
    let change = get_some(block, "tool")
        .ok_or_else(|| RequestError::invalid(at, format!("tool is required for {kind} blocks")))?;
    if !is_map(&change) {
        return Err(bad(&format!("{at}.tool"), "a valid dictionary"));
    }
    match get(&change, "type").as_ref().and_then(Value::as_str) {
        Some("tool_reference") => match get(&change, "name") {
            Some(n) if is_str(&n) => Ok(()),
            _ => Err(bad(&format!("{at}.tool.name"), "a valid string")),
        },
        Some("tool_definition") if kind == "tool_addition" => tool(
            &get(&change, "definition").unwrap_or_default(),
            &format!("{at}.tool.definition"),
        ),
        Some("tool_definition") => Err(RequestError::invalid(
            at,
            "tool_removal only accepts a tool_reference",
        )),
        _ => Err(bad(
            &format!("{at}.tool.type"),
            "'tool_reference' or 'tool_definition'",
        )),
    }
}

/// `AnthropicTool`.
fn tool(t: &Value, at: &str) -> Result<(), RequestError> {
    if !is_map(t) {
        return Err(bad(at, "a valid dictionary"));
    }
    match get(t, "name") {
        Some(n) if is_str(&n) => {}
        _ => return Err(bad(&format!("{at}.name"), "a valid string")),
    }
    match get(t, "input_schema") {
        Some(i) if is_map(&i) => {}
        _ => return Err(bad(&format!("{at}.input_schema"), "a valid dictionary")),
    }
    let here = format!("{at}.");
    opt(t, "description", Kind::Str, &here)?;
    opt(t, "strict", Kind::Bool, &here)?;
    opt(t, "defer_loading", Kind::Bool, &here)?;
    Ok(())
}

fn tool_choice(body: &Value) -> Result<(), RequestError> {
    let Some(tc) = opt(body, "tool_choice", Kind::Map, "")? else {
        return Ok(());
    };
    let kind = str_of(&tc, "type");
    if !matches!(kind.as_str(), "auto" | "any" | "tool" | "none") {
        return Err(bad("tool_choice.type", "'auto', 'any', 'tool' or 'none'"));
    }
    let name = opt(&tc, "name", Kind::Str, "tool_choice.")?;
    opt(&tc, "disable_parallel_tool_use", Kind::Bool, "tool_choice.")?;
    if kind == "tool" && !name.is_some_and(|n| n.is_true()) {
        return Err(RequestError::invalid(
            "tool_choice",
            "tool_choice.name is required when type is 'tool'",
        ));
    }
    Ok(())
}

fn thinking(body: &Value, count_tokens: bool) -> Result<(), RequestError> {
    let Some(th) = opt(body, "thinking", Kind::Map, "")? else {
        return Ok(());
    };
    let kind = str_of(&th, "type");
    if !matches!(kind.as_str(), "enabled" | "disabled" | "adaptive") {
        return Err(bad("thinking.type", "'enabled', 'disabled' or 'adaptive'"));
    }
    if kind != "disabled"
        && let Some(d) = get_some(&th, "display")
        && !matches!(d.as_str(), Some("summarized" | "omitted" | "updates"))
    {
        return Err(bad(
            "thinking.display",
            "'summarized', 'omitted' or 'updates'",
        ));
    }
    if kind != "enabled" {
        return Ok(());
    }
    let budget = get(&th, "budget_tokens").as_ref().and_then(as_int);
    let Some(budget) = budget.filter(|b| *b >= 1024.0) else {
        return Err(RequestError::invalid(
            "thinking.budget_tokens",
            "thinking.budget_tokens: Input should be an integer greater than or equal to 1024",
        ));
    };
    if count_tokens {
        return Ok(());
    }
    // Prefill legs of disaggregated serving never decode.
    let remote = opt(body, "kv_transfer_params", Kind::Map, "")?
        .and_then(|k| get(&k, "do_remote_decode"))
        .is_some_and(|d| d.is_true());
    let max = get(body, "max_tokens")
        .as_ref()
        .and_then(as_int)
        .unwrap_or(0.0);
    if !remote && budget >= max {
        return Err(RequestError::invalid(
            "thinking",
            "thinking.budget_tokens must be less than max_tokens",
        ));
    }
    Ok(())
}

fn output_config(body: &Value) -> Result<(), RequestError> {
    let Some(oc) = opt(body, "output_config", Kind::Map, "")? else {
        return Ok(());
    };
    if let Some(e) = get_some(&oc, "effort")
        && !e.as_str().is_some_and(|e| EFFORTS.contains(&e))
    {
        return Err(bad(
            "output_config.effort",
            "'low', 'medium', 'high', 'xhigh' or 'max'",
        ));
    }
    if let Some(f) = opt(&oc, "format", Kind::Map, "output_config.")? {
        opt(&f, "schema", Kind::Map, "output_config.format.")?;
        if let Some(t) = get(&f, "type")
            && t.as_str() != Some("json_schema")
        {
            return Err(bad("output_config.format.type", "'json_schema'"));
        }
    }
    Ok(())
}
