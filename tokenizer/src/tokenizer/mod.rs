//! The served tokenizer of one model: `/tokenize` and
//! `/v1/responses/render` as vLLM 0.32 answers them.
//!
//! `templates` picks the chat template a request renders with;
//! `responses_render` answers `/v1/responses/render`; `messages_render`
//! tokenizes Anthropic Messages bodies.

mod messages_render;
mod responses_render;
mod templates;

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

use minijinja::Value;

use crate::budget::{Budget, Caps, Tokens};
use crate::chat::{Origin, chat_tools, parse_messages};
use crate::encode::{Encoder, EncoderStats, Truncation};
use crate::error::{Cap, InexactKind, LoadError, RequestError};
use crate::protocol::{TokenizeRequest, TokenizeResponse};
use crate::render::{RenderInput, render};
use crate::template::{ChatTemplate, ContentFormat};
use crate::value::{get, get_some, opt_bool, opt_str};

/// How to load a model directory.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// The context length vLLM reports (`--max-model-len`); else read from
    /// config.json as vLLM does.
    pub max_model_len: Option<u32>,
    /// Bound of the segment cache in bytes.
    pub cache_bytes: usize,
    /// vLLM's `--chat-template`: a template replacing the model's.
    pub chat_template: Option<String>,
    /// vLLM's `--chat-template-content-format` (`None`: detect).
    pub content_format: Option<ContentFormat>,
    /// vLLM's `--trust-request-chat-template`.
    pub trust_request_chat_template: bool,
    /// vLLM's `--default-chat-template-kwargs`.
    pub default_chat_template_kwargs: Option<serde_json::Value>,
    /// vLLM's `--anthropic-disabled-thinking-effort` (`None` or `"auto"`:
    /// probe the template, as vLLM does).
    pub anthropic_disabled_thinking_effort: Option<String>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            max_model_len: None,
            cache_bytes: 64 << 20,
            chat_template: None,
            content_format: None,
            trust_request_chat_template: false,
            default_chat_template_kwargs: None,
            anthropic_disabled_thinking_effort: None,
        }
    }
}

/// Counters and facts for metrics and readiness.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stats {
    /// The served model name.
    pub model: String,
    /// The encoder's cache counters and mode.
    pub encoder: EncoderStats,
}

/// One model's tokenizer. `Send + Sync`: share it behind an `Arc`.
#[derive(Debug)]
pub struct Tokenizer {
    name: String,
    encoder: Encoder,
    template: Option<ChatTemplate>,
    named: Vec<(String, ChatTemplate)>,
    special_tokens: Vec<(String, String)>,
    max_model_len: u32,
    max_chars_per_token: usize,
    opts: LoadOptions,
    request_templates: Mutex<HashMap<String, ChatTemplate>>,
    /// What vLLM reads off the template for Messages requests (on first
    /// use, as vLLM's probe).
    messages_conversion: OnceLock<crate::MessagesConversion>,
}

impl Tokenizer {
    /// Loads the model directory `dir`, served as `name`.
    pub fn load(dir: &Path, name: &str, opts: LoadOptions) -> Result<Self, LoadError> {
        let files = crate::model::load(dir, opts.max_model_len)?;
        let analysis = crate::segment::analyse(&files.tokenizer_json);
        let tok_path = dir.join("tokenizer.json");
        let fast_pre = files
            .tokenizer_json
            .get("pre_tokenizer")
            .and_then(crate::pretok::FastPreTokenizer::from_json);
        let encoder = Encoder::new(files.tokenizer, analysis, opts.cache_bytes, fast_pre).map_err(
            |reason| LoadError::Tokenizer {
                path: tok_path,
                reason,
            },
        )?;
        let compile = |origin: &str, src: &str| {
            ChatTemplate::new(src, opts.content_format).map_err(|reason| LoadError::Template {
                origin: origin.to_owned(),
                reason,
            })
        };
        let template = match (&opts.chat_template, &files.chat_template) {
            (Some(src), _) => Some(compile("--chat-template", src)?),
            (None, Some((origin, src))) => Some(compile(origin, src)?),
            (None, None) => None,
        };
        let mut named = Vec::new();
        for (n, src) in &files.named_templates {
            named.push((n.clone(), compile(&format!("chat_template[{n}]"), src)?));
        }
        let max_chars_per_token = encoder.max_chars_per_token();
        Ok(Self {
            name: name.to_owned(),
            encoder,
            template,
            named,
            special_tokens: files.special_tokens,
            max_model_len: files.max_model_len,
            max_chars_per_token,
            opts,
            request_templates: Mutex::new(HashMap::new()),
            messages_conversion: OnceLock::new(),
        })
    }

    /// The served model name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The context length reported in answers.
    pub fn max_model_len(&self) -> u32 {
        self.max_model_len
    }

    /// Counters for metrics.
    pub fn stats(&self) -> Stats {
        Stats {
            model: self.name.clone(),
            encoder: self.encoder.stats(),
        }
    }

    /// Caps for this model (see [`Caps::for_model`]): from its context
    /// length and its longest token (at most four bytes a character).
    pub fn caps(&self) -> Caps {
        Caps::for_model(
            self.max_model_len as usize,
            self.max_chars_per_token.saturating_mul(4),
        )
    }

    /// Token ids of `text` (as the tokenizer's `encode`).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, RequestError> {
        self.encode_with(text, add_special_tokens, &Budget::default())
            .map(|t| t.ids)
    }

    /// [`Tokenizer::encode`] under `budget` (`text` counts as the request's
    /// text and as its prompt).
    pub fn encode_with(
        &self,
        text: &str,
        add_special_tokens: bool,
        budget: &Budget,
    ) -> Result<Tokens, RequestError> {
        Caps::check(Cap::TextBytes, budget.caps.text_bytes, text.len())?;
        Caps::check(Cap::PromptBytes, budget.caps.prompt_bytes, text.len())?;
        self.encoder
            .encode_with(text, add_special_tokens, None, budget)
    }

    /// `POST /tokenize`.
    pub fn tokenize(&self, req: &TokenizeRequest) -> Result<TokenizeResponse, RequestError> {
        self.tokenize_with(req, &Budget::default())
    }

    /// `POST /tokenize` under `budget`, whose `max_tokens` is not applied
    /// (the answer holds every id).
    pub fn tokenize_with(
        &self,
        req: &TokenizeRequest,
        budget: &Budget,
    ) -> Result<TokenizeResponse, RequestError> {
        let body = &req.body;
        let want_strs = opt_bool(body, "return_token_strs", "return_token_strs")?.unwrap_or(false);
        let all = Budget {
            max_tokens: None,
            ..budget.clone()
        };
        // vLLM's /tokenize has no `truncate_prompt_tokens` (an extra field,
        // ignored).
        check_request_caps(body, &all)?;
        let tokens = self.tokenize_ids(req, &all)?.ids;
        Ok(TokenizeResponse {
            count: tokens.len(),
            max_model_len: self.max_model_len,
            token_strs: want_strs.then(|| self.encoder.token_strs(&tokens)),
            tokens,
        })
    }

    /// The prompt ids of a `/v1/completions` body under `budget`: the ids
    /// `POST /tokenize` answers for it (the chat shape, `messages`, is
    /// taken too, as `/tokenize` takes it), refusing a non-null
    /// `truncate_prompt_tokens` (see [`RequestError::Inexact`]), which
    /// completions apply and `/tokenize` ignores.
    pub fn completion_tokens_with(
        &self,
        req: &TokenizeRequest,
        budget: &Budget,
    ) -> Result<Tokens, RequestError> {
        let body = &req.body;
        check_request_caps(body, budget)?;
        reject_truncate_prompt_tokens(body)?;
        self.tokenize_ids(req, budget)
    }

    fn tokenize_ids(&self, req: &TokenizeRequest, budget: &Budget) -> Result<Tokens, RequestError> {
        let body = &req.body;
        if req.is_chat() {
            self.tokenize_chat(body, false, budget)
        } else {
            self.tokenize_prompt(body, budget)
        }
    }

    fn tokenize_prompt(&self, body: &Value, budget: &Budget) -> Result<Tokens, RequestError> {
        let prompt = match get(body, "prompt") {
            Some(p) if crate::value::is_str(&p) => p.as_str().unwrap_or_default().to_owned(),
            Some(_) => {
                return Err(RequestError::invalid(
                    "body.prompt",
                    "prompt: Input should be a valid string",
                ));
            }
            None => {
                return Err(RequestError::invalid(
                    "body.prompt",
                    "prompt or messages: Field required",
                ));
            }
        };
        let add_special =
            opt_bool(body, "add_special_tokens", "add_special_tokens")?.unwrap_or(true);
        Caps::check(Cap::PromptBytes, budget.caps.prompt_bytes, prompt.len())?;
        self.encoder.encode_with(&prompt, add_special, None, budget)
    }

    fn tokenize_chat(
        &self,
        body: &Value,
        completion: bool,
        budget: &Budget,
    ) -> Result<Tokens, RequestError> {
        let (rendered, add_special) = self.render_chat(body, completion, budget)?;
        let add_special = add_special && !rendered.tokenize;
        self.encode_prompt(&rendered.text, add_special, None, budget)
    }

    /// The rendered prompt's ids: its byte cap, then the encoder.
    fn encode_prompt(
        &self,
        text: &str,
        add_special: bool,
        truncation: Option<Truncation>,
        budget: &Budget,
    ) -> Result<Tokens, RequestError> {
        Caps::check(Cap::PromptBytes, budget.caps.prompt_bytes, text.len())?;
        budget.check()?;
        self.encoder
            .encode_with(text, add_special, truncation, budget)
    }

    /// The prompt text a chat-shaped `/tokenize` request renders to (for
    /// diagnostics: where a mismatch starts).
    pub fn chat_prompt(&self, req: &TokenizeRequest) -> Result<String, RequestError> {
        self.render_chat(&req.body, false, &Budget::default())
            .map(|(r, _)| r.text)
    }

    fn render_chat(
        &self,
        body: &Value,
        completion: bool,
        budget: &Budget,
    ) -> Result<(crate::render::Rendered, bool), RequestError> {
        let agp_given = opt_bool(body, "add_generation_prompt", "add_generation_prompt")?;
        let cfm =
            opt_bool(body, "continue_final_message", "continue_final_message")?.unwrap_or(false);
        if cfm && agp_given == Some(true) {
            return Err(RequestError::message(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            ));
        }
        let add_special =
            opt_bool(body, "add_special_tokens", "add_special_tokens")?.unwrap_or(false);
        let request_template = opt_str(body, "chat_template", "chat_template")?;
        let kwargs = get_some(body, "chat_template_kwargs");
        self.check_template_trust(request_template.is_some(), kwargs.as_ref())?;
        let tools = match get_some(body, "tools") {
            Some(t) => Some(chat_tools(&t)?),
            None => None,
        };
        let template = self.pick_template(
            request_template.as_deref(),
            kwargs.as_ref(),
            tools.is_some(),
        )?;
        let messages = get(body, "messages").unwrap_or_default();
        budget.check()?;
        let conversation = parse_messages(&messages, template.format, Origin::Chat)?;
        // Chat completions (not /tokenize) also hand the template `documents`
        // and `reasoning_effort` (and `enable_thinking` with the latter).
        // Unset ones leave the request's kwargs of the same name in place
        // (vLLM's `merge_kwargs` skips `None` overrides).
        let mut extra = Vec::new();
        if completion {
            if let Some(d) = get_some(body, "documents") {
                extra.push(("documents", d));
            }
            if let Some(e) = get_some(body, "reasoning_effort") {
                let user_set = kwargs
                    .as_ref()
                    .is_some_and(|k| get(k, "enable_thinking").is_some());
                if !user_set {
                    extra.push(("enable_thinking", Value::from(e.as_str() != Some("none"))));
                }
                extra.push(("reasoning_effort", e));
            }
        }
        let kwargs = self.merged_kwargs(kwargs);
        budget.check()?;
        let rendered = render(
            &template,
            &self.special_tokens,
            RenderInput {
                conversation,
                tools,
                request_kwargs: kwargs.as_ref(),
                add_generation_prompt: agp_given.unwrap_or(true),
                continue_final_message: cfm,
                extra,
            },
        )?;
        Ok((rendered, add_special))
    }

    /// The prompt ids of a `/v1/chat/completions` body (what
    /// `/v1/chat/completions/render` returns): as `/tokenize` with
    /// `messages`, plus the fields only chat completions hand the template
    /// (`documents`, `reasoning_effort`), which `/tokenize` ignores.
    pub fn chat_completion_tokens(&self, req: &TokenizeRequest) -> Result<Vec<u32>, RequestError> {
        self.chat_completion_tokens_with(req, &Budget::default())
            .map(|t| t.ids)
    }

    /// [`Tokenizer::chat_completion_tokens`] under `budget`, refusing a
    /// non-null `truncate_prompt_tokens` (see [`RequestError::Inexact`]).
    pub fn chat_completion_tokens_with(
        &self,
        req: &TokenizeRequest,
        budget: &Budget,
    ) -> Result<Tokens, RequestError> {
        let body = &req.body;
        check_request_caps(body, budget)?;
        reject_truncate_prompt_tokens(body)?;
        self.tokenize_chat(body, true, budget)
    }
}

/// The caps a request's body is checked against before anything else:
/// its text bytes, its messages and its tools.
fn check_request_caps(body: &Value, budget: &Budget) -> Result<(), RequestError> {
    budget.check()?;
    let caps = &budget.caps;
    Caps::check_len(Cap::Messages, caps.messages, get(body, "messages").as_ref())?;
    Caps::check_len(Cap::Tools, caps.tools, get(body, "tools").as_ref())?;
    caps.check_text(body)
}

/// Chat and completions requests' `truncate_prompt_tokens`, refused
/// whenever it is not `null`.
///
/// vLLM takes an integer ≥ -1 (`Annotated[int, Field(ge=-1)]`; some
/// releases also bound it by int64), -1 meaning the context length less
/// `max_tokens`; it answers 400 for anything else and for values over that
/// input budget. A valid value keeps the prompt's last (or, with the newer
/// `truncation_side`, first) tokens, *after* the length checks that differ
/// from the untruncated path (no character check), and 0 an empty prompt.
/// Not reproduced here: every non-null value is a local refusal
/// ([`RequestError::Inexact`] with [`InexactKind::Truncation`]), so a
/// replica answers, with the truncated ids or vLLM's own 400.
fn reject_truncate_prompt_tokens(body: &Value) -> Result<(), RequestError> {
    match get_some(body, "truncate_prompt_tokens") {
        None => Ok(()),
        Some(v) => Err(RequestError::Inexact {
            kind: InexactKind::Truncation,
            detail: format!("truncate_prompt_tokens={v}"),
        }),
    }
}

/// Shares a tokenizer across tasks.
pub type SharedTokenizer = Arc<Tokenizer>;

#[allow(dead_code)]
fn assert_send_sync() {
    fn check<T: Send + Sync>() {}
    check::<Tokenizer>();
}
