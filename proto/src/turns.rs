//! What marks a request as a conversation's later turn
//! (`PickRequest.continuation`): the filter reads it from the body it
//! parses, indexd from a body it forwards to a replica's tokenizer, each
//! with [`holds_earlier_turn`] (the tokenizer, from the request it parses,
//! with the same [`earlier_role`] and [`output_item`]).
//!
//! A chat or Anthropic Messages body continues a conversation when one of
//! its `messages` has an [`earlier_role`]; a Responses body when one of its
//! `input` items has an [`earlier_role`] or is an [`output_item`], or when it
//! names a `previous_response_id`. A completions prompt does not tell.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;

/// What tells a conversation item's author: chat and Messages `role`,
/// Responses `type` and `role`.
#[derive(Debug, Default, Deserialize)]
pub struct Author<'a> {
    /// The item's `role`.
    #[serde(borrow, default)]
    pub role: Option<Cow<'a, str>>,
    /// The item's `type`.
    #[serde(borrow, default, rename = "type")]
    pub kind: Option<Cow<'a, str>>,
}

impl<'a> Author<'a> {
    /// An item's author; `None` for an item that is no object with a string
    /// `role` and `type` where it has them (the client's, to every reader).
    pub fn of(item: &'a RawValue) -> Option<Self> {
        serde_json::from_str(item.get()).ok()
    }

    /// Whether the item is an earlier turn's: an [`earlier_role`], or an
    /// [`output_item`].
    pub fn is_earlier_turn(&self) -> bool {
        self.role.as_deref().is_some_and(earlier_role)
            || self.kind.as_deref().is_some_and(output_item)
    }
}

/// Whether `list` (a chat or Messages body's `messages`, a Responses body's
/// `input`) holds an earlier turn. Any value is read: anything but a list
/// holds none, and so does an item that is no [`Author`].
pub fn holds_earlier_turn(list: &RawValue) -> bool {
    serde_json::from_str::<Vec<&RawValue>>(list.get())
        .is_ok_and(|items| items.iter().rev().any(|item| is_earlier_turn(item)))
}

/// Whether one item of such a list is an earlier turn's ([`Author`]).
pub fn is_earlier_turn(item: &RawValue) -> bool {
    Author::of(item).is_some_and(|a| a.is_earlier_turn())
}

/// A message `role` only an earlier turn has: the assistant's, or a tool's.
pub fn earlier_role(role: &str) -> bool {
    matches!(role, "assistant" | "tool" | "function")
}

/// A Responses `input` item's `type` naming what a model produced or a
/// tool answered.
pub fn output_item(kind: &str) -> bool {
    kind == "reasoning" || kind.ends_with("_call") || kind.ends_with("_call_output")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_that_hold_earlier_turns() {
        let read =
            |json: &str| holds_earlier_turn(serde_json::from_str::<&RawValue>(json).unwrap());
        assert!(read(
            r#"[{"role":"user","content":"q"},{"role":"assistant","content":"a"}]"#
        ));
        assert!(read(
            r#"[{"type":"function_call_output","call_id":"c","output":"1"}]"#
        ));
        assert!(read(r#"[{"r\u006fle":"tool","content":"1"}]"#));
        assert!(!read(r#"[{"role":"user","content":{"role":"assistant"}}]"#));
        assert!(!read(
            r#"[1,null,"a",[{"role":"assistant"}],{"role":7,"type":{}}]"#
        ));
        assert!(!read(r#"{"role":"assistant"}"#));
        assert!(!read(r#""assistant""#));
    }

    #[test]
    fn roles_and_items_of_earlier_turns() {
        for role in ["assistant", "tool", "function"] {
            assert!(earlier_role(role), "{role}");
        }
        for role in ["user", "system", "developer", "Assistant", ""] {
            assert!(!earlier_role(role), "{role}");
        }
        for kind in [
            "reasoning",
            "function_call",
            "function_call_output",
            "web_search_call",
            "custom_tool_call_output",
        ] {
            assert!(output_item(kind), "{kind}");
        }
        for kind in ["message", "input_text", "item_reference", "call", ""] {
            assert!(!output_item(kind), "{kind}");
        }
    }
}
