//! `POST /v1/responses/render`: a Responses request converted to chat,
//! rendered, and tokenized under vLLM's length rules (truncation `auto`,
//! else the character bound and the context length), then answered with
//! the sampling parameters vLLM reports.

use minijinja::Value;

use super::{Tokenizer, check_request_caps};
use crate::budget::{Budget, Caps, Tokens};
use crate::encode::Truncation;
use crate::error::{Cap, RequestError};
use crate::protocol::{RenderResponse, ResponsesRequest, SamplingParams};
use crate::render::{RenderInput, render};
use crate::value::{get, get_some, opt_bool, opt_str};

impl Tokenizer {
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
        let conversation =
            crate::responses::conversation(converted.messages, converted.late, template.format)?;
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
