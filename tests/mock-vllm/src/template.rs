//! Chat templates: messages (chat and Responses forms) → prompt text.
//!
//! The role-marker template renders
//! `<s>[<|tools|>JSON<|end|>\n]` then per message `<|role|>[<think>R</think>]content[<|tool_call|>JSON]<|end|>\n`
//! and `<|assistant|>` as the generation prompt. The drop-reasoning variant omits the reasoning of
//! assistant turns that come before the last user message, so a conversation's prompt is not
//! append-only across turns (like real reasoning-model templates).
//!
//! Responses rendering adds a second BOS ([`render_responses_tokens`]), as vLLM 0.32 does.

use serde_json::Value;

use crate::config::ChatTemplate;
use crate::tokenizer::{BOS_ID, Tokenizer};

/// One message, normalised from the chat or Responses forms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    pub content: String,
    pub reasoning: Option<String>,
    /// Tool calls as compact JSON.
    pub tool_calls: Option<String>,
}

impl Message {
    pub fn new(role: &str, content: impl Into<String>) -> Self {
        Self {
            role: role.to_owned(),
            content: content.into(),
            reasoning: None,
            tool_calls: None,
        }
    }
}

/// Options of one rendering.
#[derive(Debug, Clone, Copy)]
pub struct RenderOptions<'a> {
    pub template: ChatTemplate,
    pub tools: Option<&'a Value>,
    pub add_generation_prompt: bool,
    pub continue_final_message: bool,
}

/// A request whose messages cannot be rendered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct TemplateError(pub String);

/// `<|role|>`: a special token for the known roles, plain text for any other.
fn role_marker(role: &str) -> String {
    format!("<|{role}|>")
}

/// Renders messages to prompt text.
pub fn render(messages: &[Message], opts: RenderOptions<'_>) -> Result<String, TemplateError> {
    if opts.add_generation_prompt && opts.continue_final_message {
        return Err(TemplateError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
                .to_owned(),
        ));
    }
    if opts.continue_final_message && messages.last().is_none_or(|m| m.role != "assistant") {
        return Err(TemplateError(
            "continue_final_message requires the last message to be from the assistant".to_owned(),
        ));
    }
    let last_user = messages.iter().rposition(|m| m.role == "user");
    let mut out = String::from("<s>");
    if let Some(tools) = opts
        .tools
        .filter(|t| !t.is_null() && t.as_array().is_none_or(|a| !a.is_empty()))
    {
        out.push_str("<|tools|>");
        out.push_str(&tools.to_string());
        out.push_str("<|end|>\n");
    }
    for (i, m) in messages.iter().enumerate() {
        out.push_str(&role_marker(&m.role));
        let keep_reasoning = match opts.template {
            ChatTemplate::RoleMarkers => true,
            ChatTemplate::DropReasoning => last_user.is_none_or(|u| i > u),
        };
        if let Some(r) = m.reasoning.as_deref().filter(|_| keep_reasoning) {
            out.push_str("<think>");
            out.push_str(r);
            out.push_str("</think>");
        }
        out.push_str(&m.content);
        if let Some(calls) = &m.tool_calls {
            out.push_str("<|tool_call|>");
            out.push_str(calls);
        }
        let is_last = i + 1 == messages.len();
        if !(is_last && opts.continue_final_message) {
            out.push_str("<|end|>\n");
        }
    }
    if opts.add_generation_prompt {
        out.push_str("<|assistant|>");
    }
    Ok(out)
}

/// Chat prompt tokens (the template carries its own BOS; `add_special_tokens` adds another).
pub fn render_chat_tokens(
    tokenizer: &Tokenizer,
    messages: &[Message],
    opts: RenderOptions<'_>,
    add_special_tokens: bool,
) -> Result<Vec<u32>, TemplateError> {
    let text = render(messages, opts)?;
    Ok(tokenizer.encode(&text, add_special_tokens))
}

/// Responses prompt tokens: the chat rendering with vLLM 0.32's extra leading BOS.
pub fn render_responses_tokens(
    tokenizer: &Tokenizer,
    messages: &[Message],
    opts: RenderOptions<'_>,
) -> Result<Vec<u32>, TemplateError> {
    let mut ids = render_chat_tokens(tokenizer, messages, opts, false)?;
    ids.insert(0, BOS_ID);
    Ok(ids)
}

/// Text of a content field: a string, null, or an array of parts.
pub fn content_text(content: &Value) -> Result<String, TemplateError> {
    match content {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut out = String::new();
            for p in parts {
                match p.get("type").and_then(Value::as_str) {
                    Some("text" | "input_text" | "output_text" | "refusal") => {
                        let text = p
                            .get("text")
                            .or_else(|| p.get("refusal"))
                            .and_then(Value::as_str)
                            .unwrap_or_default();
                        out.push_str(text);
                    }
                    Some("image_url" | "input_image" | "image") => out.push_str("<image>"),
                    Some(other) => {
                        return Err(TemplateError(format!("Unknown part type: {other}")));
                    }
                    None if p.is_string() => out.push_str(p.as_str().unwrap_or_default()),
                    None => return Err(TemplateError("content part without `type`".to_owned())),
                }
            }
            Ok(out)
        }
        other => Err(TemplateError(format!("invalid content: {other}"))),
    }
}

/// Parses chat `messages`.
pub fn parse_chat_messages(messages: &Value) -> Result<Vec<Message>, TemplateError> {
    let arr = messages
        .as_array()
        .ok_or_else(|| TemplateError("`messages` must be an array".to_owned()))?;
    arr.iter()
        .map(|m| {
            let role = m
                .get("role")
                .and_then(Value::as_str)
                .ok_or_else(|| TemplateError("each message needs a string `role`".to_owned()))?;
            let content = content_text(m.get("content").unwrap_or(&Value::Null))?;
            let reasoning = m
                .get("reasoning_content")
                .or_else(|| m.get("reasoning"))
                .and_then(Value::as_str)
                .map(str::to_owned);
            let tool_calls = m
                .get("tool_calls")
                .filter(|v| v.as_array().is_some_and(|a| !a.is_empty()))
                .map(Value::to_string);
            Ok(Message {
                role: role.to_owned(),
                content,
                reasoning,
                tool_calls,
            })
        })
        .collect()
}

/// Parses a Responses `input` (string or item list) into messages.
pub fn parse_responses_input(input: &Value) -> Result<Vec<Message>, TemplateError> {
    match input {
        Value::String(s) => Ok(vec![Message::new("user", s.clone())]),
        Value::Array(items) => {
            let mut out: Vec<Message> = Vec::new();
            for item in items {
                let kind = item
                    .get("type")
                    .and_then(Value::as_str)
                    .unwrap_or("message");
                match kind {
                    "message" => {
                        let role = item.get("role").and_then(Value::as_str).ok_or_else(|| {
                            TemplateError("input message needs a `role`".to_owned())
                        })?;
                        let content = content_text(item.get("content").unwrap_or(&Value::Null))?;
                        out.push(Message::new(role, content));
                    }
                    "function_call" => {
                        let call = serde_json::json!([{
                            "id": item.get("call_id"),
                            "type": "function",
                            "function": {"name": item.get("name"), "arguments": item.get("arguments")},
                        }]);
                        let mut m = Message::new("assistant", "");
                        m.tool_calls = Some(call.to_string());
                        out.push(m);
                    }
                    "function_call_output" => {
                        let output = item
                            .get("output")
                            .map(content_text)
                            .transpose()?
                            .unwrap_or_default();
                        out.push(Message::new("tool", output));
                    }
                    "reasoning" => {
                        let text = item
                            .get("content")
                            .or_else(|| item.get("summary"))
                            .and_then(Value::as_array)
                            .map(|parts| {
                                parts
                                    .iter()
                                    .filter_map(|p| p.get("text").and_then(Value::as_str))
                                    .collect::<Vec<_>>()
                                    .join("")
                            })
                            .unwrap_or_default();
                        let mut m = Message::new("assistant", "");
                        m.reasoning = Some(text);
                        out.push(m);
                    }
                    other => {
                        return Err(TemplateError(format!(
                            "Unsupported input item type: {other}"
                        )));
                    }
                }
            }
            Ok(out)
        }
        _ => Err(TemplateError(
            "`input` must be a string or an array".to_owned(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn opts(template: ChatTemplate) -> RenderOptions<'static> {
        RenderOptions {
            template,
            tools: None,
            add_generation_prompt: true,
            continue_final_message: false,
        }
    }

    #[test]
    fn role_markers_and_generation_prompt() {
        let msgs = parse_chat_messages(&json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        ]))
        .unwrap();
        let text = render(&msgs, opts(ChatTemplate::RoleMarkers)).unwrap();
        assert_eq!(
            text,
            "<s><|system|>Be brief.<|end|>\n<|user|>Hi<|end|>\n<|assistant|>"
        );
        let ids =
            render_chat_tokens(&Tokenizer, &msgs, opts(ChatTemplate::RoleMarkers), false).unwrap();
        assert_eq!(ids[0], BOS_ID);
        assert_ne!(ids[1], BOS_ID);
    }

    #[test]
    fn responses_add_a_second_bos() {
        let msgs = parse_responses_input(&json!("Hi")).unwrap();
        let chat =
            render_chat_tokens(&Tokenizer, &msgs, opts(ChatTemplate::RoleMarkers), false).unwrap();
        let resp =
            render_responses_tokens(&Tokenizer, &msgs, opts(ChatTemplate::RoleMarkers)).unwrap();
        assert_eq!(&resp[..2], &[BOS_ID, BOS_ID]);
        assert_eq!(&resp[1..], &chat[..]);
    }

    #[test]
    fn drop_reasoning_is_not_append_only() {
        let turn1 = json!([
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1", "reasoning_content": "because"},
        ]);
        let mut turn2 = turn1.clone();
        turn2
            .as_array_mut()
            .unwrap()
            .push(json!({"role": "user", "content": "q2"}));
        let m1 = parse_chat_messages(&turn1).unwrap();
        let m2 = parse_chat_messages(&turn2).unwrap();
        let o = RenderOptions {
            add_generation_prompt: false,
            ..opts(ChatTemplate::DropReasoning)
        };
        let t1 = render(&m1, o).unwrap();
        let t2 = render(&m2, o).unwrap();
        assert!(t1.contains("<think>because</think>"));
        assert!(!t2.contains("because"));
        assert!(!t2.starts_with(&t1));
        let keep = RenderOptions {
            template: ChatTemplate::RoleMarkers,
            ..o
        };
        assert!(
            render(&m2, keep)
                .unwrap()
                .starts_with(&render(&m1, keep).unwrap())
        );
    }

    #[test]
    fn continue_final_message_conflicts() {
        let msgs = vec![Message::new("assistant", "x")];
        let both = RenderOptions {
            continue_final_message: true,
            ..opts(ChatTemplate::RoleMarkers)
        };
        assert!(render(&msgs, both).is_err());
        let cont = RenderOptions {
            add_generation_prompt: false,
            ..both
        };
        assert!(render(&msgs, cont).unwrap().ends_with("<|assistant|>x"));
    }

    #[test]
    fn tools_are_rendered() {
        let tools = json!([{"type": "function", "function": {"name": "f"}}]);
        let o = RenderOptions {
            tools: Some(&tools),
            ..opts(ChatTemplate::RoleMarkers)
        };
        let text = render(&[Message::new("user", "x")], o).unwrap();
        assert!(text.starts_with("<s><|tools|>[{\"function\""));
    }

    #[test]
    fn responses_items() {
        let msgs = parse_responses_input(&json!([
            {"role": "user", "content": [{"type": "input_text", "text": "a"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
        ]))
        .unwrap();
        assert_eq!(msgs.len(), 3);
        assert_eq!(msgs[2], Message::new("tool", "42"));
        assert!(parse_responses_input(&json!(3)).is_err());
        assert!(parse_chat_messages(&json!([{"content": "x"}])).is_err());
    }
}
