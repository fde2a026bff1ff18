//! The served tokenizer of one model: `/tokenize` and
//! `/v1/responses/render` as vLLM 0.32 answers them.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use minijinja::Value;

use crate::budget::{Budget, Caps, Tokens};
use crate::chat::{Origin, chat_tools, parse_messages};
use crate::encode::{Encoder, EncoderStats, Truncation};
use crate::error::{Cap, InexactKind, LoadError, RequestError};
use crate::protocol::{
    RenderResponse, ResponsesRequest, SamplingParams, TokenizeRequest, TokenizeResponse,
};
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

/// Request templates compiled so far (bounded).
const REQUEST_TEMPLATES: usize = 32;

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
        let mut extra = Vec::new();
        if completion {
            extra.push(("documents", get(body, "documents").unwrap_or_default()));
            let effort = get_some(body, "reasoning_effort");
            if let Some(e) = &effort {
                let user_set = kwargs
                    .as_ref()
                    .is_some_and(|k| get(k, "enable_thinking").is_some());
                if !user_set {
                    extra.push(("enable_thinking", Value::from(e.as_str() != Some("none"))));
                }
            }
            extra.push(("reasoning_effort", effort.unwrap_or_default()));
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

    /// `POST /v1/responses/render`.
    pub fn render_responses(&self, req: &ResponsesRequest) -> Result<RenderResponse, RequestError> {
        self.render_responses_with(req, &Budget::default())
    }

    /// `POST /v1/responses/render` under `budget`, whose `max_tokens` is
    /// not applied (the answer holds every id and the output budget left).
    pub fn render_responses_with(
        &self,
        req: &ResponsesRequest,
        budget: &Budget,
    ) -> Result<RenderResponse, RequestError> {
        let all = Budget {
            max_tokens: None,
            ..budget.clone()
        };
        let (tokens, max_output) = self.responses_tokens(req, &all)?;
        self.render_answer(&req.body, tokens.ids, max_output)
    }

    /// The prompt ids `POST /v1/responses/render` answers for `req`, under
    /// `budget`.
    pub fn responses_tokens_with(
        &self,
        req: &ResponsesRequest,
        budget: &Budget,
    ) -> Result<Tokens, RequestError> {
        let (tokens, _) = self.responses_tokens(req, budget)?;
        if tokens.ids.is_empty() {
            return Err(RequestError::message("No token_ids rendered"));
        }
        Ok(tokens)
    }

    fn responses_tokens(
        &self,
        req: &ResponsesRequest,
        budget: &Budget,
    ) -> Result<(Tokens, Option<i64>), RequestError> {
        let body = &req.body;
        check_request_caps(body, budget)?;
        Caps::check_len(Cap::Items, budget.caps.items, get(body, "input").as_ref())?;
        let kwargs = get_some(body, "chat_template_kwargs");
        self.check_template_trust(false, kwargs.as_ref())?;
        let converted = crate::responses::convert(body)?;
        let max_output = get_some(body, "max_output_tokens").and_then(|v| v.as_i64());
        if let Some(m) = max_output
            && m > i64::from(self.max_model_len)
        {
            return Err(RequestError::invalid(
                "max_output_tokens",
                format!(
                    "max_output_tokens={m} cannot be greater than max_model_len={}. Please request fewer output tokens. (parameter=max_output_tokens, value={m})",
                    self.max_model_len
                ),
            ));
        }
        let template = self.pick_template(None, kwargs.as_ref(), converted.tools.is_some())?;
        budget.check()?;
        let conversation = parse_messages(
            &Value::from(converted.messages),
            template.format,
            Origin::Responses,
        )?;
        let effort = get_some(body, "reasoning").and_then(|r| get_some(&r, "effort"));
        let mut extra = Vec::new();
        if let Some(e) = &effort {
            extra.push(("reasoning_effort", e.clone()));
            let user_set = kwargs
                .as_ref()
                .is_some_and(|k| get(k, "enable_thinking").is_some());
            if !user_set {
                extra.push(("enable_thinking", Value::from(e.as_str() != Some("none"))));
            }
        }
        let kwargs = self.merged_kwargs(kwargs);
        budget.check()?;
        let rendered = render(
            &template,
            &self.special_tokens,
            RenderInput {
                conversation,
                tools: converted.tools,
                request_kwargs: kwargs.as_ref(),
                add_generation_prompt: !converted.continue_final,
                continue_final_message: converted.continue_final,
                extra,
            },
        )?;
        let ids = self.responses_ids(body, &rendered, max_output.unwrap_or(0), budget)?;
        Ok((ids, max_output))
    }

    /// Tokenizes a Responses prompt with vLLM's length rules.
    fn responses_ids(
        &self,
        body: &Value,
        rendered: &crate::render::Rendered,
        max_output: i64,
        budget: &Budget,
    ) -> Result<Tokens, RequestError> {
        let max_len = self.max_model_len as usize;
        let auto = get_some(body, "truncation")
            .and_then(|t| t.as_str().map(str::to_owned))
            .as_deref()
            == Some("auto");
        let add_special = !rendered.tokenize;
        if auto {
            let keep = if max_output > 0 {
                max_len.saturating_sub(1)
            } else {
                max_len
            };
            let t = Truncation {
                max_len: keep,
                keep_last: true,
            };
            return self.encode_prompt(&rendered.text, add_special, Some(t), budget);
        }
        let chars = rendered.text.chars().count();
        let max_chars = max_len.saturating_mul(self.max_chars_per_token);
        if chars > max_chars {
            return Err(RequestError::TooLong {
                message: format!(
                    "This model's maximum context length is {max_len} tokens. However, your prompt contains {chars} characters (more than {max_chars} characters, which is the upper bound for {max_len} input tokens). Please reduce the length of the input prompt. (parameter=input_text, value={chars})"
                ),
                param: "input_text".into(),
            });
        }
        // vLLM truncates to `max_len + 1` tokens to tell "too long": which
        // end it keeps does not matter (only the count is reported), and
        // keeping the first lets encoding stop there.
        let t = Truncation {
            max_len: max_len + 1,
            keep_last: false,
        };
        let tokens = self.encode_prompt(&rendered.text, add_special, Some(t), budget)?;
        let n = tokens.ids.len();
        if !tokens.truncated && n > max_len {
            let qualifier = if n == max_len + 1 { "at least " } else { "" };
            return Err(RequestError::TooLong {
                message: format!(
                    "This model's maximum context length is {max_len} tokens. However, your prompt contains {qualifier}{n} input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. (parameter=input_tokens, value={n})"
                ),
                param: "input_tokens".into(),
            });
        }
        Ok(tokens)
    }

    fn render_answer(
        &self,
        body: &Value,
        ids: Vec<u32>,
        max_output: Option<i64>,
    ) -> Result<RenderResponse, RequestError> {
        if ids.is_empty() {
            return Err(RequestError::message("No token_ids rendered"));
        }
        let left = u64::from(self.max_model_len).saturating_sub(ids.len() as u64);
        let max_tokens = match max_output.and_then(|m| u64::try_from(m).ok()) {
            Some(m) => m.min(left),
            None => left,
        };
        let float = |k: &str, d: f64| {
            get_some(body, k)
                .and_then(|v| f64::try_from(v).ok())
                .unwrap_or(d)
        };
        let json_of = |k: &str| get_some(body, k).and_then(|v| serde_json::to_value(&v).ok());
        Ok(RenderResponse {
            request_id: opt_str(body, "request_id", "request_id")?
                .unwrap_or_else(random_response_id),
            token_ids: ids,
            token_offsets: None,
            features: None,
            content_parts: None,
            sampling_params: SamplingParams {
                presence_penalty: 0.0,
                frequency_penalty: 0.0,
                repetition_penalty: 1.0,
                temperature: float("temperature", 1.0),
                top_p: float("top_p", 1.0),
                min_p: 0.0,
                stop: Vec::new(),
                stop_token_ids: Vec::new(),
                max_tokens,
                output_kind: 2,
                skip_clone: true,
                extra_args: serde_json::Map::new(),
                bad_words: Vec::new(),
                skip_reading_prefix_cache: false,
            },
            model: opt_str(body, "model", "model")?,
            reasoning_ended: None,
            reasoning_parser_kwargs: None,
            return_token_ids: None,
            output_mode: "tokens".into(),
            stream: opt_bool(body, "stream", "stream")?.unwrap_or(false),
            stream_options: None,
            cache_salt: opt_str(body, "cache_salt", "cache_salt")?,
            priority: get_some(body, "priority")
                .and_then(|p| p.as_i64())
                .unwrap_or(0),
            kv_transfer_params: json_of("kv_transfer_params"),
            ec_transfer_params: json_of("ec_transfer_params"),
        })
    }

    /// vLLM refuses request-supplied templates unless trusted.
    fn check_template_trust(
        &self,
        request_template: bool,
        kwargs: Option<&Value>,
    ) -> Result<(), RequestError> {
        let in_kwargs = kwargs.is_some_and(|k| get_some(k, "chat_template").is_some());
        if !self.opts.trust_request_chat_template && (request_template || in_kwargs) {
            return Err(RequestError::message(
                "Chat template is passed with request, but --trust-request-chat-template is not set. Refused request with untrusted chat template.",
            ));
        }
        Ok(())
    }

    /// The request kwargs over the server's defaults.
    fn merged_kwargs(&self, request: Option<Value>) -> Option<Value> {
        let defaults = self
            .opts
            .default_chat_template_kwargs
            .as_ref()
            .and_then(|d| serde_json::to_vec(d).ok())
            .and_then(|b| crate::loads::parse(&b).ok());
        match (defaults, request) {
            (None, r) => r,
            (Some(d), None) => Some(d),
            (Some(d), Some(r)) => {
                let mut m = crate::value::entries(&d);
                for (k, v) in crate::value::entries(&r) {
                    if !(v.is_none() || v.as_str() == Some("auto")) {
                        m.insert(k, v);
                    }
                }
                Some(crate::value::object(m))
            }
        }
    }

    /// transformers' `get_chat_template`: a request template (by name or
    /// text, trusted only), else the model's (`tool_use` with tools when
    /// only named ones exist).
    fn pick_template(
        &self,
        request: Option<&str>,
        kwargs: Option<&Value>,
        tools: bool,
    ) -> Result<ChatTemplate, RequestError> {
        let from_kwargs = kwargs
            .and_then(|k| get_some(k, "chat_template"))
            .and_then(|t| t.as_str().map(str::to_owned));
        if let Some(src) = request.map(str::to_owned).or(from_kwargs) {
            if let Some((_, t)) = self.named.iter().find(|(n, _)| *n == src) {
                return Ok(t.clone());
            }
            return self.request_template(&src);
        }
        if let Some(t) = &self.template {
            return Ok(t.clone());
        }
        let by_name = |n: &str| {
            self.named
                .iter()
                .find(|(name, _)| name == n)
                .map(|(_, t)| t.clone())
        };
        let picked = if tools {
            by_name("tool_use").or_else(|| by_name("default"))
        } else {
            by_name("default")
        };
        picked.ok_or_else(|| {
            RequestError::Template(
                "As of transformers v4.44, default chat template is no longer allowed, so you must provide a chat template if the tokenizer does not define one.".into(),
            )
        })
    }

    fn request_template(&self, src: &str) -> Result<ChatTemplate, RequestError> {
        let mut cache = self
            .request_templates
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(t) = cache.get(src) {
            return Ok(t.clone());
        }
        let t = ChatTemplate::new(src, self.opts.content_format).map_err(RequestError::Template)?;
        if cache.len() >= REQUEST_TEMPLATES {
            cache.clear();
        }
        cache.insert(src.to_owned(), t.clone());
        Ok(t)
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

fn random_response_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    format!("resp_{:016x}", h.finish())
}

/// Shares a tokenizer across tasks.
pub type SharedTokenizer = Arc<Tokenizer>;

#[allow(dead_code)]
fn assert_send_sync() {
    fn check<T: Send + Sync>() {}
    check::<Tokenizer>();
}
