//! The chat template a request renders with, as transformers'
//! `get_chat_template` picks it: a request template (trusted only, compiled
//! once and cached), else the model's; and the request's template kwargs
//! over the server's defaults.

use minijinja::Value;

use super::Tokenizer;
use crate::error::RequestError;
use crate::template::ChatTemplate;
use crate::value::get_some;

/// Request templates compiled so far (bounded).
const REQUEST_TEMPLATES: usize = 32;

impl Tokenizer {
    /// vLLM refuses request-supplied templates unless trusted.
    pub(super) fn check_template_trust(
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
    pub(super) fn merged_kwargs(&self, request: Option<Value>) -> Option<Value> {
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
    pub(super) fn pick_template(
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
