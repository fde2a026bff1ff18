//! A conversation's history and how each API renders it: Chat Completions
//! messages, Responses input items with the full history, or Anthropic
//! Messages.

use serde_json::{Value, json};

use crate::client::Reply;
use crate::workload::{Api, Conversation, Step};

/// One message of the history, rendered per API.
#[derive(Debug, Clone)]
pub(crate) enum Msg {
    System(String),
    User(String),
    Assistant {
        content: String,
        reasoning: String,
        call: Option<(String, String, String)>,
    },
    Tool {
        call_id: String,
        content: String,
    },
}

pub(crate) fn chat_messages(history: &[Msg]) -> Value {
    Value::Array(
        history
            .iter()
            .map(|m| match m {
                Msg::System(t) => json!({"role": "system", "content": t}),
                Msg::User(t) => json!({"role": "user", "content": t}),
                Msg::Assistant {
                    content,
                    reasoning,
                    call,
                } => {
                    let mut v = json!({"role": "assistant", "content": content});
                    if !reasoning.is_empty() {
                        v["reasoning_content"] = json!(reasoning);
                    }
                    if let Some((id, name, arguments)) = call {
                        v["tool_calls"] = json!([{"id": id, "type": "function",
                            "function": {"name": name, "arguments": arguments}}]);
                    }
                    v
                }
                Msg::Tool { call_id, content } => {
                    json!({"role": "tool", "tool_call_id": call_id, "content": content})
                }
            })
            .collect(),
    )
}

pub(crate) fn responses_input(history: &[Msg]) -> Value {
    let mut items = Vec::new();
    for m in history {
        match m {
            Msg::System(t) => {
                items.push(json!({"type": "message", "role": "system", "content": t}))
            }
            Msg::User(t) => items.push(json!({"type": "message", "role": "user", "content": t})),
            Msg::Assistant {
                content,
                reasoning,
                call,
            } => {
                if !reasoning.is_empty() {
                    items.push(json!({"type": "reasoning", "summary": [],
                        "content": [{"type": "reasoning_text", "text": reasoning}]}));
                }
                items.push(json!({"type": "message", "role": "assistant",
                    "content": [{"type": "output_text", "text": content}]}));
                if let Some((id, name, arguments)) = call {
                    items.push(json!({"type": "function_call", "call_id": id,
                        "name": name, "arguments": arguments}));
                }
            }
            Msg::Tool { call_id, content } => items.push(
                json!({"type": "function_call_output", "call_id": call_id, "output": content}),
            ),
        }
    }
    Value::Array(items)
}

/// Anthropic Messages: the first system message as `system`, the rest as
/// messages (an assistant's reasoning a `thinking` block, its call a
/// `tool_use` block; a tool's result a user message's `tool_result` block).
pub(crate) fn messages_body(history: &[Msg]) -> (Option<String>, Value) {
    let mut system = None;
    let mut messages = Vec::new();
    for m in history {
        match m {
            Msg::System(t) if system.is_none() && messages.is_empty() => system = Some(t.clone()),
            Msg::System(t) => messages.push(json!({"role": "system", "content": t})),
            Msg::User(t) => messages.push(json!({"role": "user", "content": t})),
            Msg::Assistant {
                content,
                reasoning,
                call,
            } => {
                let mut blocks = Vec::new();
                if !reasoning.is_empty() {
                    blocks
                        .push(json!({"type": "thinking", "thinking": reasoning, "signature": "s"}));
                }
                if !content.is_empty() || call.is_none() {
                    blocks.push(json!({"type": "text", "text": content}));
                }
                if let Some((id, name, arguments)) = call {
                    let input: Value =
                        serde_json::from_str(arguments).unwrap_or_else(|_| json!({}));
                    blocks
                        .push(json!({"type": "tool_use", "id": id, "name": name, "input": input}));
                }
                messages.push(json!({"role": "assistant", "content": blocks}));
            }
            Msg::Tool { call_id, content } => messages.push(json!({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call_id, "content": content},
            ]})),
        }
    }
    (system, Value::Array(messages))
}

pub(crate) fn request_body(conversation: &Conversation, history: &[Msg], model: &str) -> Value {
    let mut body = match conversation.api {
        Api::Chat => json!({
            "model": model,
            "messages": chat_messages(history),
            "max_tokens": conversation.max_tokens,
        }),
        Api::Responses => json!({
            "model": model,
            "input": responses_input(history),
            "max_output_tokens": conversation.max_tokens,
            "store": false,
        }),
        Api::Messages => {
            let (system, messages) = messages_body(history);
            let mut body = json!({
                "model": model,
                "messages": messages,
                "max_tokens": conversation.max_tokens,
            });
            if let Some(system) = system {
                body["system"] = json!(system);
            }
            body
        }
    };
    if let Some(tools) = &conversation.tools {
        body["tools"] = match conversation.api {
            Api::Chat => tools.clone(),
            // Responses declares function tools flat.
            Api::Responses => Value::Array(
                tools
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|t| {
                        let mut f = t["function"].clone();
                        f["type"] = json!("function");
                        f
                    })
                    .collect(),
            ),
            // Messages declares a tool's schema as `input_schema`.
            Api::Messages => Value::Array(
                tools
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|t| {
                        let f = &t["function"];
                        json!({"name": f["name"], "description": f["description"],
                            "input_schema": f["parameters"]})
                    })
                    .collect(),
            ),
        };
    }
    if let Some(salt) = &conversation.salt {
        body["cache_salt"] = json!(salt);
    }
    body
}

/// Adds what the script says after the last reply.
pub(crate) fn apply(
    step: &Step,
    history: &mut Vec<Msg>,
    last: &Reply,
    conversation: u32,
    turn: usize,
) {
    let reply = |call| Msg::Assistant {
        content: last.content.clone(),
        reasoning: last.reasoning.clone(),
        call,
    };
    match step {
        Step::Tool {
            name,
            arguments,
            result,
        } => {
            let id = format!("call_{conversation}_{turn}");
            history.push(reply(Some((id.clone(), name.clone(), arguments.clone()))));
            history.push(Msg::Tool {
                call_id: id,
                content: result.clone(),
            });
        }
        Step::User(text) => {
            history.push(reply(None));
            history.push(Msg::User(text.clone()));
        }
        Step::Retry(text) => match history.last_mut() {
            Some(Msg::Tool { content, .. } | Msg::User(content)) => content.clone_from(text),
            _ => history.push(Msg::User(text.clone())),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_replaces_the_last_input_and_tool_calls_render() {
        let last = Reply {
            content: "ok".into(),
            reasoning: "think".into(),
            ..Reply::default()
        };
        let mut h = vec![Msg::User("task".into())];
        let tool = Step::Tool {
            name: "search".into(),
            arguments: "{}".into(),
            result: "found".into(),
        };
        apply(&tool, &mut h, &last, 1, 1);
        apply(&Step::Retry("found again".into()), &mut h, &last, 1, 2);
        assert_eq!(h.len(), 3);
        let chat = chat_messages(&h);
        assert_eq!(chat[1]["tool_calls"][0]["id"], "call_1_1");
        assert_eq!(chat[1]["reasoning_content"], "think");
        assert_eq!(chat[2]["content"], "found again");
        let items = responses_input(&h);
        let kinds: Vec<&str> = items
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["type"].as_str().unwrap())
            .collect();
        assert_eq!(
            kinds,
            [
                "message",
                "reasoning",
                "message",
                "function_call",
                "function_call_output"
            ]
        );
    }
}
