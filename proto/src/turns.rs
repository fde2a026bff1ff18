//! What marks a request as a conversation's later turn
//! (`PickRequest.continuation`): the filter reads it from the body it
//! parses, indexd from the body it tokenizes, and both must agree.
//!
//! A chat or Anthropic Messages body continues a conversation when one of
//! its `messages` has an [`earlier_role`]; a Responses body when one of its
//! `input` items has an [`earlier_role`] or is an [`output_item`], or when it
//! names a `previous_response_id`. A completions prompt does not tell.

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
