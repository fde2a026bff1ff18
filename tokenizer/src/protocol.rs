//! The wire shapes of vLLM 0.32's `POST /tokenize` and
//! `POST /v1/responses/render`, and the Anthropic Messages bodies of
//! `POST /v1/messages` and `POST /v1/messages/count_tokens`.
//!
//! Requests are kept as ordered JSON (key order reaches the template through
//! `tojson`), parsed once with a depth limit; responses are serde types that
//! serialize as vLLM's do.

pub use kvroute_proto::turns::{earlier_role, output_item};
use serde::{Deserialize, Serialize};

use crate::error::RequestError;

/// A `/tokenize` body: completions (`prompt`) or chat (`messages`) shape.
#[derive(Debug, Clone)]
pub struct TokenizeRequest {
    pub(crate) body: minijinja::Value,
}

/// A `/v1/responses/render` body (a Responses request).
#[derive(Debug, Clone)]
pub struct ResponsesRequest {
    pub(crate) body: minijinja::Value,
}

/// A `/v1/messages` body (an Anthropic Messages request), or a
/// `/v1/messages/count_tokens` body ([`MessagesRequest::for_count_tokens`]).
#[derive(Debug, Clone)]
pub struct MessagesRequest {
    pub(crate) body: minijinja::Value,
    /// A count_tokens body: no `max_tokens`, and nothing checked against it.
    pub(crate) count_tokens: bool,
}

impl TokenizeRequest {
    /// Parses a JSON body (nesting limited to [`crate::loads::MAX_DEPTH`]).
    pub fn from_json(body: &[u8]) -> Result<Self, RequestError> {
        Self::from_json_within(body, &crate::Caps::UNBOUNDED)
    }

    /// [`Self::from_json`], refusing ([`RequestError::OverCap`]) as soon as
    /// the body's text passes `caps.text_bytes`: a body over the caps costs
    /// no more than the cap to refuse.
    pub fn from_json_within(body: &[u8], caps: &crate::Caps) -> Result<Self, RequestError> {
        let body = crate::loads::parse_within(body, caps.text_bytes)?;
        if body.kind() != minijinja::value::ValueKind::Map {
            return Err(RequestError::message("the body must be a JSON object"));
        }
        Ok(Self { body })
    }

    /// The `cache_salt` field (`null` or absent: none); an error, as vLLM
    /// answers it, when it is not a string.
    pub fn cache_salt(&self) -> Result<Option<String>, RequestError> {
        crate::value::opt_str(&self.body, "cache_salt", "cache_salt")
    }

    /// The `model` field, if a string.
    pub fn model(&self) -> Option<String> {
        crate::value::get_some(&self.body, "model").and_then(|m| m.as_str().map(str::to_owned))
    }

    /// Whether this is the chat shape.
    pub fn is_chat(&self) -> bool {
        crate::value::get(&self.body, "messages").is_some()
    }

    /// Whether the body carries an earlier turn of its conversation (a
    /// chat message from the assistant or a tool, [`earlier_turn`]), or is
    /// a conversation's first turn; `None` for a completions prompt, which
    /// does not tell.
    pub fn continues_a_conversation(&self) -> Option<bool> {
        self.is_chat().then(|| earlier_turn(&self.body, "messages"))
    }
}

impl ResponsesRequest {
    /// Parses a JSON body (nesting limited to [`crate::loads::MAX_DEPTH`]).
    pub fn from_json(body: &[u8]) -> Result<Self, RequestError> {
        Self::from_json_within(body, &crate::Caps::UNBOUNDED)
    }

    /// [`Self::from_json`], refusing ([`RequestError::OverCap`]) as soon as
    /// the body's text passes `caps.text_bytes`: a body over the caps costs
    /// no more than the cap to refuse.
    pub fn from_json_within(body: &[u8], caps: &crate::Caps) -> Result<Self, RequestError> {
        let body = crate::loads::parse_within(body, caps.text_bytes)?;
        if body.kind() != minijinja::value::ValueKind::Map {
            return Err(RequestError::message("the body must be a JSON object"));
        }
        Ok(Self { body })
    }

    /// The `cache_salt` field (`null` or absent: none); an error, as vLLM
    /// answers it, when it is not a string.
    pub fn cache_salt(&self) -> Result<Option<String>, RequestError> {
        crate::value::opt_str(&self.body, "cache_salt", "cache_salt")
    }

    /// The `model` field, if a string.
    pub fn model(&self) -> Option<String> {
        crate::value::get_some(&self.body, "model").and_then(|m| m.as_str().map(str::to_owned))
    }

    /// Whether the body carries an earlier turn of its conversation (a
    /// `previous_response_id`, or an `input` item the model produced or a
    /// tool answered, [`earlier_turn`]), or is a conversation's first turn.
    pub fn continues_a_conversation(&self) -> Option<bool> {
        let stored = crate::value::get_some(&self.body, "previous_response_id")
            .is_some_and(|id| id.as_str().is_some_and(|s| !s.is_empty()));
        Some(stored || earlier_turn(&self.body, "input"))
    }
}

impl TokenizeRequest {
    /// The body as JSON text (keys in order; what a replica's `/tokenize`
    /// takes).
    pub fn to_json(&self) -> Result<String, RequestError> {
        crate::json::dumps(&self.body, &crate::json::DumpOptions::default())
            .map_err(RequestError::message)
    }
}

impl MessagesRequest {
    /// Parses a JSON body (nesting limited to [`crate::loads::MAX_DEPTH`]).
    pub fn from_json(body: &[u8]) -> Result<Self, RequestError> {
        Self::from_json_within(body, &crate::Caps::UNBOUNDED)
    }

    /// [`Self::from_json`], refusing ([`RequestError::OverCap`]) as soon as
    /// the body's text passes `caps.text_bytes`.
    pub fn from_json_within(body: &[u8], caps: &crate::Caps) -> Result<Self, RequestError> {
        let body = crate::loads::parse_within(body, caps.text_bytes)?;
        if body.kind() != minijinja::value::ValueKind::Map {
            return Err(RequestError::message("the body must be a JSON object"));
        }
        Ok(Self {
            body,
            count_tokens: false,
        })
    }

    /// The same body as a `/v1/messages/count_tokens` request (its prompt
    /// is the same; it has no `max_tokens`).
    pub fn for_count_tokens(self) -> Self {
        Self {
            count_tokens: true,
            ..self
        }
    }

    /// The `cache_salt` field (`null` or absent: none); an error, as vLLM
    /// answers it, when it is not a string.
    pub fn cache_salt(&self) -> Result<Option<String>, RequestError> {
        crate::value::opt_str(&self.body, "cache_salt", "cache_salt")
    }

    /// The `model` field, if a string.
    pub fn model(&self) -> Option<String> {
        crate::value::get_some(&self.body, "model").and_then(|m| m.as_str().map(str::to_owned))
    }

    /// Whether this body converts the same under every chat template (no
    /// inline `system` message, no `thinking: {"type": "disabled"}`): then
    /// [`Self::to_chat`] with [`crate::MessagesConversion::default`] is
    /// exact without the model's tokenizer, as a caller asking a replica's
    /// `/tokenize` needs.
    pub fn converts_without_template(&self) -> bool {
        crate::messages::template_free(&self.body)
    }

    /// Whether the body carries an earlier turn of its conversation (a
    /// message from the assistant, [`earlier_turn`]), or is a
    /// conversation's first turn.
    pub fn continues_a_conversation(&self) -> Option<bool> {
        Some(earlier_turn(&self.body, "messages"))
    }

    /// The `/tokenize` chat body whose ids are this request's prompt ids,
    /// converted as a server deciding `conv` converts (see
    /// [`crate::Tokenizer::messages_conversion`]): for a caller without the
    /// model's tokenizer, to send to a replica's `/tokenize`.
    pub fn to_chat(
        &self,
        conv: &crate::MessagesConversion,
    ) -> Result<TokenizeRequest, RequestError> {
        let body = crate::messages::convert(&self.body, conv, self.count_tokens)?;
        Ok(TokenizeRequest { body })
    }
}

/// Whether the list `body[key]` (a chat or Messages body's `messages`, a
/// Responses body's `input`) holds an earlier turn of the conversation: an
/// item from the assistant (`role`), a tool's answer (`role` `tool` or
/// `function`), or a Responses output item (`type` `reasoning`, `*_call`,
/// `*_call_output`). A router places such a request where its conversation
/// is, never as a new one, whether or not it saw the turns before.
fn earlier_turn(body: &minijinja::Value, key: &str) -> bool {
    let Some(items) = crate::value::get(body, key) else {
        return false;
    };
    if items.kind() != minijinja::value::ValueKind::Seq {
        return false;
    }
    let Ok(mut items) = items.try_iter() else {
        return false;
    };
    items.any(|item| {
        let field = |name| crate::value::get(&item, name);
        let role = field("role");
        let kind = field("type");
        role.as_ref()
            .and_then(minijinja::Value::as_str)
            .is_some_and(earlier_role)
            || kind
                .as_ref()
                .and_then(minijinja::Value::as_str)
                .is_some_and(output_item)
    })
}

/// `/tokenize`'s answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenizeResponse {
    /// Number of tokens.
    pub count: usize,
    /// The model's context length.
    pub max_model_len: u32,
    /// The token ids.
    pub tokens: Vec<u32>,
    /// Token strings, when `return_token_strs` was set (else `null`).
    pub token_strs: Option<Vec<String>>,
}

/// The sampling parameters in a render answer: vLLM's defaults, with
/// `max_tokens` computed as vLLM does and the request's temperature and
/// top_p (the other sampling fields of a request are not mirrored).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// Presence penalty.
    pub presence_penalty: f64,
    /// Frequency penalty.
    pub frequency_penalty: f64,
    /// Repetition penalty.
    pub repetition_penalty: f64,
    /// Temperature.
    pub temperature: f64,
    /// Top-p.
    pub top_p: f64,
    /// Min-p.
    pub min_p: f64,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Stop token ids.
    pub stop_token_ids: Vec<u32>,
    /// Output budget: the context left after the prompt, or less if asked.
    pub max_tokens: u64,
    /// vLLM's output kind (2: final only).
    pub output_kind: u8,
    /// vLLM internal.
    pub skip_clone: bool,
    /// Extra args.
    pub extra_args: serde_json::Map<String, serde_json::Value>,
    /// Bad words.
    pub bad_words: Vec<String>,
    /// vLLM internal.
    pub skip_reading_prefix_cache: bool,
}

/// `/v1/responses/render`'s answer (vLLM's `GenerateRequest`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RenderResponse {
    /// The request id (the request's or a fresh `resp_…`).
    pub request_id: String,
    /// The prompt's token ids.
    pub token_ids: Vec<u32>,
    /// Always `null` here.
    pub token_offsets: Option<serde_json::Value>,
    /// Multimodal features (always `null`: text only).
    pub features: Option<serde_json::Value>,
    /// Always `null`.
    pub content_parts: Option<serde_json::Value>,
    /// Sampling parameters.
    pub sampling_params: SamplingParams,
    /// The request's model.
    pub model: Option<String>,
    /// Always `null`.
    pub reasoning_ended: Option<bool>,
    /// Always `null`.
    pub reasoning_parser_kwargs: Option<serde_json::Value>,
    /// Always `null`.
    pub return_token_ids: Option<bool>,
    /// `"tokens"`.
    pub output_mode: String,
    /// The request's `stream`.
    pub stream: bool,
    /// Always `null`.
    pub stream_options: Option<serde_json::Value>,
    /// The request's `cache_salt`.
    pub cache_salt: Option<String>,
    /// The request's `priority`.
    pub priority: i64,
    /// The request's `kv_transfer_params`.
    pub kv_transfer_params: Option<serde_json::Value>,
    /// The request's `ec_transfer_params`.
    pub ec_transfer_params: Option<serde_json::Value>,
}
