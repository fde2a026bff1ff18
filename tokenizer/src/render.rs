//! Conversation → prompt text, as vLLM's `safe_apply_chat_template` calls
//! transformers' `apply_chat_template(tokenize=False)`: the kwargs merge
//! (server defaults < `tools`/`tokenize` < the request's
//! `chat_template_kwargs` < `add_generation_prompt`/`continue_final_message`,
//! `None` and `"auto"` values skipped), developer roles for templates that
//! lack them, the special-token variables, `documents`, and the
//! `continue_final_message` cut.

use minijinja::Value;

use crate::chat::developer_to_system;
use crate::error::RequestError;
use crate::template::ChatTemplate;
use crate::value::{Map, entries, get, is_map, items, object, s};

/// transformers' marker appended to the message being continued.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// `apply_chat_template` parameters consumed by transformers itself (never
/// passed to the template).
const CONSUMED: &[&str] = &[
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "tokenizer_kwargs",
    "return_assistant_tokens_mask",
];

/// What the template renders, before merging.
#[derive(Debug)]
pub struct RenderInput<'a> {
    /// The parsed conversation.
    pub conversation: Vec<Value>,
    /// Tool dicts (`None` without tools).
    pub tools: Option<Value>,
    /// The request's `chat_template_kwargs`.
    pub request_kwargs: Option<&'a Value>,
    /// Request-level `add_generation_prompt`.
    pub add_generation_prompt: bool,
    /// Request-level `continue_final_message`.
    pub continue_final_message: bool,
    /// Extra request-level kwargs (Responses: `reasoning_effort`, …), merged
    /// like `add_generation_prompt`.
    pub extra: Vec<(&'static str, Value)>,
}

/// The rendered prompt and whether transformers was asked to tokenize it
/// (then without special tokens, whatever the request says).
#[derive(Debug)]
pub struct Rendered {
    /// The prompt text.
    pub text: String,
    /// `tokenize=True` reached `apply_chat_template` (via the kwargs).
    pub tokenize: bool,
}

fn unset(v: &Value) -> bool {
    v.is_none() || v.is_undefined() || v.as_str() == Some("auto")
}

/// Renders `input` with `template`; `special_tokens` are transformers'
/// `special_tokens_map` (name → text).
pub fn render(
    template: &ChatTemplate,
    special_tokens: &[(String, String)],
    input: RenderInput<'_>,
) -> Result<Rendered, RequestError> {
    // ChatParams.with_defaults: defaults, overridden by request kwargs
    // (themselves overridden by the request's own fields).
    let mut kw = Map::new();
    kw.insert(s("tools"), input.tools.clone().unwrap_or(Value::from(())));
    kw.insert(s("tokenize"), Value::from(false));
    let mut request = Map::new();
    if let Some(rk) = input.request_kwargs {
        if !rk.is_none() && !is_map(rk) {
            return Err(RequestError::invalid(
                "chat_template_kwargs",
                "chat_template_kwargs: Input should be a valid dictionary",
            ));
        }
        for (k, v) in entries(rk) {
            request.insert(k, v);
        }
    }
    request.insert(
        s("add_generation_prompt"),
        Value::from(input.add_generation_prompt),
    );
    request.insert(
        s("continue_final_message"),
        Value::from(input.continue_final_message),
    );
    for (k, v) in input.extra {
        request.insert(s(k), v);
    }
    for (k, v) in request {
        if !unset(&v) {
            kw.insert(k, v);
        }
    }

    let tools = kw.shift_remove(&s("tools")).filter(|t| !t.is_none());
    let tokenize = kw.shift_remove(&s("tokenize")).is_some_and(|t| t.is_true());
    let take = |kw: &mut Map, k: &str| kw.shift_remove(&s(k));
    let add_generation_prompt = take(&mut kw, "add_generation_prompt").is_some_and(|v| v.is_true());
    let continue_final = take(&mut kw, "continue_final_message").is_some_and(|v| v.is_true());
    let documents = take(&mut kw, "documents").filter(|d| !d.is_none());
    if take(&mut kw, "return_assistant_tokens_mask").is_some_and(|v| v.is_true()) {
        return Err(RequestError::Template(
            "`return_assistant_tokens_mask=True` requires `return_dict=True` and `tokenize=True`"
                .into(),
        ));
    }
    for k in CONSUMED {
        kw.shift_remove(&s(k));
    }
    for clash in ["conversation", "messages"] {
        if kw.contains_key(&s(clash)) {
            return Err(RequestError::Template(format!(
                "got multiple values for argument '{clash}'"
            )));
        }
    }

    let mut conversation = crate::chat::drop_empty_tool_calls(input.conversation);
    let has_developer = conversation
        .iter()
        .any(|m| get(m, "role").as_ref().and_then(Value::as_str) == Some("developer"));
    if has_developer && !template.knows_developer {
        conversation = developer_to_system(conversation);
    }
    if conversation.is_empty() {
        return Err(RequestError::Template(
            "Cannot apply chat template to an empty conversation. Provide at least one message."
                .into(),
        ));
    }
    if continue_final && add_generation_prompt {
        return Err(RequestError::Template(
            "continue_final_message and add_generation_prompt are not compatible. Use continue_final_message when you want the model to continue the final message, and add_generation_prompt when you want to add a header that will prompt it to start a new assistant message instead.".into(),
        ));
    }
    if let Some(docs) = &documents {
        let ok = items(docs).is_some_and(|d| d.iter().all(is_map));
        if !ok {
            return Err(RequestError::Template(
                "Documents should be a list of dicts with 'title' and 'text' keys!".into(),
            ));
        }
    }

    let mut final_text = None;
    if continue_final {
        let (msgs, text) = tag_final_message(conversation, template.source())?;
        conversation = msgs;
        final_text = Some(text);
    }

    let mut ctx = Map::new();
    for (name, text) in special_tokens {
        ctx.insert(s(name), s(text));
    }
    for (k, v) in kw {
        ctx.insert(k, v);
    }
    ctx.insert(s("messages"), Value::from(conversation));
    ctx.insert(s("tools"), tools.unwrap_or(Value::from(())));
    ctx.insert(s("documents"), documents.unwrap_or(Value::from(())));
    ctx.insert(
        s("add_generation_prompt"),
        Value::from(add_generation_prompt),
    );
    let mut text = template.render(&object(ctx))?;

    if let Some(final_message) = final_text {
        text = cut_at_tag(&text, &final_message)?;
    }
    Ok(Rendered { text, tokenize })
}

/// transformers' `continue_final_message`: appends the tag to the last
/// message's content (its last text part for lists). Returns the messages
/// and the text that was continued.
fn tag_final_message(
    mut conversation: Vec<Value>,
    source: &str,
) -> Result<(Vec<Value>, String), RequestError> {
    let Some(last) = conversation.pop() else {
        return Err(RequestError::Template(
            "continue_final_message is set but the conversation is empty".into(),
        ));
    };
    let content = get(&last, "content").filter(|c| !c.is_none());
    let Some(content) = content else {
        return Err(RequestError::Template(
            "continue_final_message is set but the final message has no \"content\" to continue!"
                .into(),
        ));
    };
    if !source.contains("content") {
        return Err(RequestError::Template(
            "continue_final_message is set to \"content\" but this is not an accepted field in the chat_template".into(),
        ));
    }
    let mut msg = entries(&last);
    let final_text;
    if let Some(mut parts) = items(&content) {
        let idx = parts.iter().rposition(|p| get(p, "text").is_some()).ok_or_else(|| {
            RequestError::Template("continue_final_message is set but we could not find any text to continue in the final message!".into())
        })?;
        let part = parts.get(idx).cloned().unwrap_or_default();
        let text = get(&part, "text")
            .map(|t| t.to_string())
            .unwrap_or_default();
        let mut p = entries(&part);
        p.insert(s("text"), s(&format!("{text}{CONTINUE_TAG}")));
        if let Some(slot) = parts.get_mut(idx) {
            *slot = object(p);
        }
        msg.insert(s("content"), Value::from(parts));
        final_text = text;
    } else {
        let text = content
            .as_str()
            .map(str::to_owned)
            .unwrap_or_else(|| content.to_string());
        msg.insert(s("content"), s(&format!("{text}{CONTINUE_TAG}")));
        final_text = text;
    }
    conversation.push(object(msg));
    Ok((conversation, final_text))
}

/// Cuts the rendered text at the tag, as transformers does.
fn cut_at_tag(rendered: &str, final_message: &str) -> Result<String, RequestError> {
    let tag = CONTINUE_TAG.trim();
    if !rendered.contains(final_message.trim()) || !rendered.contains(tag) {
        return Err(RequestError::Template(
            "continue_final_message is set but the final message does not appear in the chat after applying the chat template! This can happen if the chat template deletes portions of the final message. Please verify the chat template and final message in your chat to ensure they are compatible.".into(),
        ));
    }
    let loc = rendered.rfind(tag).unwrap_or(0);
    let head = rendered.get(..loc).unwrap_or_default();
    if rendered.get(loc..loc + CONTINUE_TAG.len()) == Some(CONTINUE_TAG) {
        Ok(head.to_owned())
    } else {
        Ok(python_rstrip(head).to_owned())
    }
}

/// Python's `str.rstrip()` (Unicode whitespace).
fn python_rstrip(s: &str) -> &str {
    s.trim_end_matches(|c: char| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c))
}
