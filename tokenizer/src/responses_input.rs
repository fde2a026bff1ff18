//! vLLM's validation of a Responses `input` list, and where its conversion
//! reads a valid item other than as the raw item.
//!
//! `ResponsesRequest` types each item as a union of the openai SDK's input
//! item params (TypedDicts) and output items (models), which pydantic
//! validates in lax mode after vLLM's before-validators (a `function_call`
//! or `reasoning` item becomes its model when it can, a missing reasoning
//! `id` is supplied, an assistant message with list content becomes the
//! output message model when it can, with `id`, `status: "completed"` and
//! `annotations: []` supplied; an image part in a message gets `detail:
//! "auto"`). An item no member takes is a 400 on `body.input` ([`check`]).
//! The rules, member by member (`schema`):
//!
//! - A message without `type` is an `EasyInputMessageParam` (`role` one of
//!   user, assistant, system, developer; `content` a string or a list of
//!   `input_text`, `input_image`, `input_file` parts), a `Message` (`role`
//!   user, system or developer; list `content`; a `status`), or an
//!   `ItemReference` (a string `id`; `type` may also be `null`).
//! - `type: "message"` adds the output message model, and the
//!   `ResponseOutputMessageParam` TypedDict (string `id`, `status`): its
//!   `content` may be any iterable, whose parts pydantic checks only when the
//!   chat parser reads them (output text or refusals).
//! - `function_call` and `custom_tool_call` need string `call_id`, `name`
//!   and `arguments` / `input`; `function_call_output` an `output` (a string
//!   or a list of input parts), `custom_tool_call_output` a string `call_id`
//!   too; `reasoning` a `summary`; `additional_tools` a developer `role` and
//!   `tools`. The SDK's other types need the fields they require.
//! - Optional fields hold their declared types (`null` where the type
//!   allows it): `status` in_progress, completed or incomplete, `caller`
//!   direct or program, `phase`, `detail`, `prompt_cache_breakpoint`, ….
//!   Other keys are allowed and kept; integers, floats and booleans are read
//!   as pydantic's lax mode reads them.
//!
//! Where several members take an item, pydantic picks the one with the most
//! fields set (nested ones counted), the first on a tie; that decides how the
//! conversion reads an assistant message ([`reading`]): the TypedDict's is
//! handed on whole, and its parts checked as the chat parser reads them
//! ([`read_later`]); so is a reasoning item that is not the model but has a
//! `role` (without one the conversion refuses it, as it refuses an item of
//! another type that is no TypedDict). The conversion fails
//! (a server error) on an output message model whose first part is not
//! output text, and on a raw assistant message whose first part is no
//! object; and the chat parser fails on a function output model's parts.

mod schema;
#[cfg(test)]
mod tests;

use minijinja::Value;
use minijinja::value::ValueKind;

use crate::error::RequestError;
use crate::value::{get, is_map, is_str, items};
use schema::{Field, Need, Ty};

/// Refuses, as vLLM's `ResponsesRequest` does, the first item of an
/// `input` list that no member of its item union takes.
pub fn check(list: &[Value]) -> Result<(), RequestError> {
    for (i, item) in list.iter().enumerate() {
        if !takes(item) {
            let what = match get(item, "type").as_ref().and_then(Value::as_str) {
                Some(kind) if is_map(item) => format!("{kind} item"),
                _ => "input item".to_owned(),
            };
            return Err(RequestError::invalid(
                "body.input",
                format!("input.{i}: Input should be a valid {what}"),
            ));
        }
    }
    Ok(())
}

/// How vLLM's conversion reads a valid item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reading {
    /// As the raw item.
    Raw,
    /// A message handed to the chat parser whole: the output message
    /// TypedDict (no content merged, every part read), or a reasoning
    /// TypedDict with a `role`.
    Whole,
    /// A function output whose parts reach the chat parser as models,
    /// which it fails on (a server error).
    ModelParts,
    /// Refused: the conversion does not read it as its type, and it is no
    /// chat message.
    Refused,
    /// The conversion fails on it (a server error): why.
    Fails(&'static str),
}

/// How vLLM's conversion reads `item` (one [`check`] took).
pub fn reading(item: &Value) -> Reading {
    let kind = get(item, "type");
    match kind.as_ref().and_then(Value::as_str) {
        Some("reasoning") if !is(item, &schema::REASONING) => {
            if get(item, "role").is_some() {
                Reading::Whole
            } else {
                Reading::Refused
            }
        }
        Some("additional_tools") if !is(item, &schema::ADDITIONAL_TOOLS) => Reading::Refused,
        Some("function_call_output")
            if !is(item, &schema::FUNCTION_CALL_OUTPUT)
                && get(item, "output").is_some_and(|o| o.kind() == ValueKind::Seq) =>
        {
            Reading::ModelParts
        }
        Some(other) if other_item(other).is_some_and(|(param, _)| !is(item, param)) => {
            Reading::Refused
        }
        Some("message") if whole_output_message(item) => Reading::Whole,
        Some("message") if is(item, &schema::OUTPUT_MESSAGE) => {
            let first = get(item, "content")
                .and_then(|c| items(&c))
                .and_then(|parts| parts.first().cloned());
            let first_type = first.as_ref().and_then(|p| get(p, "type"));
            if first_type.as_ref().and_then(Value::as_str) == Some("output_text") {
                Reading::Raw
            } else {
                Reading::Fails("an output message whose first part is not output text")
            }
        }
        Some(
            "function_call"
            | "function_call_output"
            | "reasoning"
            | "custom_tool_call"
            | "custom_tool_call_output",
        ) => Reading::Raw,
        _ if get(item, "role").as_ref().and_then(Value::as_str) == Some("assistant")
            && get(item, "content")
                .and_then(|c| items(&c))
                .and_then(|parts| parts.first().cloned())
                .is_some_and(|p| !is_map(&p)) =>
        {
            Reading::Fails("an assistant message whose first part is no object")
        }
        _ => Reading::Raw,
    }
}

/// What vLLM's chat parser finds wrong when it reads the late checked
/// parts of `item` (a message read whole, a custom tool output that is the
/// TypedDict), if anything.
pub fn read_later(item: &Value, at: &str) -> Option<RequestError> {
    let kind = get(item, "type");
    let (key, parts) = match kind.as_ref().and_then(Value::as_str) {
        Some("message") if whole_output_message(item) => ("content", &schema::OUTPUT_CONTENT_PARAM),
        Some("reasoning") if !is(item, &schema::REASONING) => ("content", &schema::REASONING_TEXT),
        Some("custom_tool_call_output") if !is(item, &schema::CUSTOM_TOOL_CALL_OUTPUT_ITEM) => {
            ("output", &schema::INPUT_PART)
        }
        _ => return None,
    };
    let v = get(item, key)?;
    let fine = match v.kind() {
        ValueKind::Seq => all(&v, parts),
        ValueKind::Map => v.len() == Some(0),
        // A custom tool's string output is the string member.
        ValueKind::String => key == "output" || v.len() == Some(0),
        _ => true,
    };
    (!fine).then(|| {
        RequestError::message(format!(
            "{at}.{key}: Input should be a valid list of content parts"
        ))
    })
}

/// Whether pydantic takes `item` as the output message TypedDict: neither
/// the model nor an easy input message (with at least as many fields set)
/// takes it.
fn whole_output_message(item: &Value) -> bool {
    if is(item, &schema::OUTPUT_MESSAGE) || !is(item, &schema::OUTPUT_MESSAGE_PARAM) {
        return false;
    }
    if !is(item, &schema::EASY_MESSAGE) {
        return true;
    }
    let phase = usize::from(get(item, "phase").is_some());
    let content = get(item, "content").unwrap_or_default();
    // vLLM supplies a message image's `detail` before pydantic counts it.
    let filled = items(&content).map_or(0, |parts| {
        parts
            .iter()
            .filter(|p| {
                get(p, "type").as_ref().and_then(Value::as_str) == Some("input_image")
                    && get(p, "detail").is_none()
            })
            .count()
    });
    let easy = 3 + phase + fields_set(&content, &schema::EASY_CONTENT) + filled;
    easy < 5 + phase
}

/// The other type's TypedDict and (where it requires less) model fields.
fn other_item(kind: &str) -> Option<(&'static [Field], &'static [Field])> {
    schema::OTHER_ITEMS
        .iter()
        .find(|(k, _, _)| *k == kind)
        .map(|(_, param, model)| (*param, *model))
}

/// Whether some member of the union takes `item`.
fn takes(item: &Value) -> bool {
    if !is_map(item) {
        return false;
    }
    let Some(kind) = get(item, "type") else {
        return is(item, &schema::EASY_MESSAGE)
            || is(item, &schema::INPUT_MESSAGE)
            || is(item, &schema::ITEM_REFERENCE);
    };
    if kind.is_none() {
        return is(item, &schema::ITEM_REFERENCE);
    }
    match kind.as_str() {
        Some("message") => {
            is(item, &schema::EASY_MESSAGE)
                || is(item, &schema::INPUT_MESSAGE)
                || is(item, &schema::OUTPUT_MESSAGE)
                || is(item, &schema::OUTPUT_MESSAGE_PARAM)
        }
        Some("function_call") => is(item, &schema::FUNCTION_CALL),
        Some("function_call_output") => {
            is(item, &schema::FUNCTION_CALL_OUTPUT) || is(item, &schema::FUNCTION_CALL_OUTPUT_ITEM)
        }
        Some("reasoning") => is(item, &schema::REASONING) || is(item, &schema::REASONING_PARAM),
        Some("custom_tool_call") => is(item, &schema::CUSTOM_TOOL_CALL),
        Some("custom_tool_call_output") => {
            is(item, &schema::CUSTOM_TOOL_CALL_OUTPUT)
                || is(item, &schema::CUSTOM_TOOL_CALL_OUTPUT_ITEM)
        }
        Some("item_reference") => is(item, &schema::ITEM_REFERENCE),
        Some("additional_tools") => {
            is(item, &schema::ADDITIONAL_TOOLS) || is(item, &schema::ADDITIONAL_TOOLS_ITEM)
        }
        Some(other) => other_item(other).is_some_and(|(param, model)| {
            is(item, param) || (!model.is_empty() && is(item, model))
        }),
        None => false,
    }
}

fn is(v: &Value, fields: &[Field]) -> bool {
    is_map(v)
        && fields.iter().all(|field| match get(v, field.key) {
            None => !matches!(field.need, Need::Req | Need::ReqNull),
            Some(x) if x.is_none() => matches!(field.need, Need::Null | Need::ReqNull),
            Some(x) => fits(&x, &field.ty),
        })
}

fn fits(v: &Value, ty: &Ty) -> bool {
    match ty {
        Ty::Str => is_str(v),
        Ty::Bool => lax_bool(v),
        Ty::Int => lax_int(v),
        Ty::Float => lax_float(v),
        Ty::Lit(options) => v.as_str().is_some_and(|s| options.contains(&s)),
        Ty::List(inner) => v.kind() == ValueKind::Seq && all(v, inner),
        Ty::Iterable => matches!(
            v.kind(),
            ValueKind::Seq | ValueKind::String | ValueKind::Map
        ),
        Ty::Any => true,
        Ty::Union(members) => members.iter().any(|m| fits(v, m)),
        Ty::Obj(fields) => is(v, fields),
    }
}

fn all(list: &Value, ty: &Ty) -> bool {
    list.try_iter()
        .is_ok_and(|mut items| items.all(|x| fits(&x, ty)))
}

/// The fields pydantic counts as set when `ty` takes `v`: the declared
/// keys present, and theirs, all the way down.
fn fields_set(v: &Value, ty: &Ty) -> usize {
    match ty {
        Ty::List(inner) => v
            .try_iter()
            .map_or(0, |items| items.map(|x| fields_set(&x, inner)).sum()),
        Ty::Union(members) => members
            .iter()
            .filter(|m| fits(v, m))
            .map(|m| fields_set(v, m))
            .max()
            .unwrap_or(0),
        Ty::Obj(fields) => fields
            .iter()
            .filter_map(|field| get(v, field.key).map(|x| 1 + fields_set(&x, &field.ty)))
            .sum(),
        _ => 0,
    }
}

/// A number as a float (booleans are numbers to pydantic's lax mode).
fn number(v: &Value) -> Option<f64> {
    match v.kind() {
        ValueKind::Bool => Some(if v.is_true() { 1.0 } else { 0.0 }),
        ValueKind::Number => f64::try_from(v.clone()).ok(),
        _ => None,
    }
}

/// pydantic's lax `int`: integers, booleans, integral floats, and strings
/// of digits (a fraction of zeros allowed).
fn lax_int(v: &Value) -> bool {
    if v.is_integer() {
        return true;
    }
    if let Some(text) = v.as_str() {
        let t = text.trim();
        let t = t.strip_prefix(['-', '+']).unwrap_or(t);
        let (whole, fraction) = t.split_once('.').unwrap_or((t, ""));
        return !whole.is_empty()
            && whole.bytes().all(|b| b.is_ascii_digit())
            && fraction.bytes().all(|b| b == b'0');
    }
    number(v).is_some_and(|x| x.is_finite() && x.fract() == 0.0)
}

/// pydantic's lax `float`: numbers, booleans, numeric strings.
fn lax_float(v: &Value) -> bool {
    match v.as_str() {
        Some(text) => text.trim().parse::<f64>().is_ok(),
        None => number(v).is_some(),
    }
}

/// pydantic's lax `bool`: booleans, 0 and 1, and its words for them.
fn lax_bool(v: &Value) -> bool {
    const WORDS: &[&str] = &[
        "0", "off", "f", "false", "n", "no", "1", "on", "t", "true", "y", "yes",
    ];
    match v.as_str() {
        Some(text) => WORDS.contains(&text.to_ascii_lowercase().as_str()),
        None => number(v).is_some_and(|x| x == 0.0 || x == 1.0),
    }
}
