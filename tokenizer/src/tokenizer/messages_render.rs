//! Anthropic Messages bodies (`POST /v1/messages`,
//! `POST /v1/messages/count_tokens`): converted to chat as vLLM converts
//! them, then tokenized as the chat completion vLLM makes of them.
//!
//! vLLM decides two things once per server from its chat template: whether
//! inline system messages must be merged into the leading one (it renders
//! `[system, user, system, user]` in a plain Jinja sandbox, without
//! transformers' globals, and merges if that raises), and which
//! `reasoning_effort` `thinking: {"type": "disabled"}` maps to (`"none"`,
//! unless the template fails on it or renders it as it renders some real
//! effort: then `"low"`).

use minijinja::Value;

use super::{Tokenizer, check_request_caps};
use crate::budget::{Budget, Tokens};
use crate::error::RequestError;
use crate::messages::{EFFORTS, MessagesConversion};
use crate::protocol::{MessagesRequest, TokenizeRequest};
use crate::template::ChatTemplate;
use crate::value::{Map, object, s};

impl Tokenizer {
    /// The prompt ids vLLM's engine gets for a `/v1/messages` body (or, for
    /// [`MessagesRequest::for_count_tokens`], the ids
    /// `/v1/messages/count_tokens` counts).
    pub fn tokenize_messages(&self, req: &MessagesRequest) -> Result<Vec<u32>, RequestError> {
        self.tokenize_messages_with(req, &Budget::default())
            .map(|t| t.ids)
    }

    /// [`Tokenizer::tokenize_messages`] under `budget`: the caps hold for
    /// the Messages body and for the chat body it becomes (a tool result
    /// can become up to three messages).
    pub fn tokenize_messages_with(
        &self,
        req: &MessagesRequest,
        budget: &Budget,
    ) -> Result<Tokens, RequestError> {
        check_request_caps(&req.body, budget)?;
        let chat = self.messages_chat_request(req)?;
        check_request_caps(&chat.body, budget)?;
        self.tokenize_chat(&chat.body, false, budget)
    }

    /// The `/tokenize` chat body vLLM's conversion makes of `req` on this
    /// model: a replica's `/tokenize` answers it with
    /// [`Tokenizer::tokenize_messages`]' ids.
    pub fn messages_chat_request(
        &self,
        req: &MessagesRequest,
    ) -> Result<TokenizeRequest, RequestError> {
        req.to_chat(&self.messages_conversion())
    }

    /// What vLLM, serving this model with these options, decides from its
    /// chat template for every Messages request (computed on first use).
    pub fn messages_conversion(&self) -> MessagesConversion {
        self.messages_conversion
            .get_or_init(|| MessagesConversion {
                merge_inline_system: self.merges_inline_system(),
                disabled_thinking_effort: match self
                    .opts
                    .anthropic_disabled_thinking_effort
                    .as_deref()
                {
                    Some(effort) if effort != "auto" => effort.to_owned(),
                    _ => self.probe_disabled_thinking_effort(),
                },
            })
            .clone()
    }

    /// `_should_merge_inline_system`: the templates chosen without and with
    /// tools, either refusing a non-leading system message (no template:
    /// merge).
    fn merges_inline_system(&self) -> bool {
        [false, true]
            .into_iter()
            .any(|tools| match self.pick_template(None, None, tools) {
                Ok(t) => refuses_inline_system(&t),
                Err(_) => true,
            })
    }

    /// `_probe_disabled_thinking_effort`: `"low"` when the chat completion
    /// of one "Hi" fails with `reasoning_effort: "none"` or renders as with
    /// a real effort.
    fn probe_disabled_thinking_effort(&self) -> String {
        let prompt = |effort: &str| {
            let mut user = Map::new();
            user.insert(s("role"), s("user"));
            user.insert(s("content"), s("Hi"));
            let mut body = Map::new();
            body.insert(s("messages"), Value::from(vec![object(user)]));
            body.insert(s("reasoning_effort"), s(effort));
            self.render_chat(&object(body), true, &Budget::default())
                .ok()
                .map(|(r, add_special)| (r.text, r.tokenize, add_special))
        };
        let Some(none) = prompt("none") else {
            return "low".to_owned();
        };
        if EFFORTS.iter().any(|e| prompt(e).as_ref() == Some(&none)) {
            "low".to_owned()
        } else {
            "none".to_owned()
        }
    }
}

/// `_detect_merge_inline_system`'s render: only `messages` and
/// `add_generation_prompt` defined. A string function not reproduced here
/// does not raise in Python, so only a template error counts.
fn refuses_inline_system(template: &ChatTemplate) -> bool {
    let messages: Vec<Value> = ["system", "user", "system", "user"]
        .iter()
        .map(|role| {
            let mut m = Map::new();
            m.insert(s("role"), s(role));
            m.insert(s("content"), s("t"));
            object(m)
        })
        .collect();
    let mut ctx = Map::new();
    ctx.insert(s("messages"), Value::from(messages));
    ctx.insert(s("add_generation_prompt"), Value::from(false));
    matches!(
        template.render(&object(ctx)),
        Err(RequestError::Template(_))
    )
}
