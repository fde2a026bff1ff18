//! Errors at the two boundaries: loading a model directory, and serving a
//! request. Request errors carry what vLLM's 400 answers carry (a message and
//! the offending parameter, if any), so the HTTP layer maps them one to one.

use std::path::PathBuf;

/// A model directory that cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A file is not valid JSON.
    #[error("{path}: invalid JSON: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// Why.
        source: serde_json::Error,
    },
    /// A field holds something unusable.
    #[error("{path}: field `{field}`: {reason}")]
    Field {
        /// The file.
        path: PathBuf,
        /// The field.
        field: String,
        /// Why.
        reason: String,
    },
    /// The `tokenizers` library refused the tokenizer.
    #[error("{path}: {reason}")]
    Tokenizer {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The chat template does not compile.
    #[error("{origin}: chat template: {reason}")]
    Template {
        /// Where the template came from (file and field).
        origin: String,
        /// Why.
        reason: String,
    },
    /// Nothing gives the context length.
    #[error("no max_model_len given and config.json has none of {0}")]
    NoMaxModelLen(String),
}

/// A request that vLLM would answer with a 400 (or that we refuse as vLLM
/// would). `param()` names the offending field when vLLM names one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The body is not JSON.
    #[error("invalid JSON: {0}")]
    InvalidJson(String),
    /// The body nests deeper than the limit.
    #[error("JSON nests deeper than {limit} levels")]
    TooDeep {
        /// The limit.
        limit: usize,
    },
    /// A field is missing or has the wrong shape (vLLM's validation errors).
    #[error("{message}")]
    Invalid {
        /// The field, dotted (`messages.0.content`).
        param: Option<String>,
        /// What is wrong.
        message: String,
    },
    /// The chat template refused the conversation (`raise_exception`, a
    /// template error, or transformers' own checks).
    #[error("{0}")]
    Template(String),
    /// The prompt exceeds the model's context (Responses render).
    #[error("{message}")]
    TooLong {
        /// vLLM's message.
        message: String,
        /// The parameter vLLM names.
        param: String,
    },
    /// A request feature vLLM supports that this tokenizer does not
    /// reproduce (multimodal content, harmony models, …).
    #[error("{0}")]
    Unsupported(String),
    /// An input whose ids cannot be guaranteed equal to vLLM's here (a JSON
    /// value Python reads but a Rust string or number cannot hold, template
    /// text where Python 3.11's string functions are not reproduced,
    /// truncation vLLM applies in a way not reproduced). A local refusal:
    /// ask a replica.
    #[error("not reproduced exactly ({kind}): {detail}")]
    Inexact {
        /// What kind of input.
        kind: InexactKind,
        /// What exactly.
        detail: String,
    },
    /// The request is larger than a cap of the caller's [`crate::Budget`]
    /// (checked before anything is encoded; the rendered prompt's once
    /// rendered; a pre-token's before BPE sees it). A local refusal.
    #[error("{cap} over the cap: {actual} > {limit}")]
    OverCap {
        /// Which cap.
        cap: Cap,
        /// The cap.
        limit: usize,
        /// What the request has (at least: counting stops past the cap).
        actual: usize,
    },
    /// The budget's deadline passed before the ids were complete. A local
    /// refusal.
    #[error("the tokenizer's deadline passed")]
    DeadlineExceeded,
    /// The budget's cancellation flag was set. A local refusal.
    #[error("cancelled")]
    Cancelled,
}

/// The kinds of [`RequestError::Inexact`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum InexactKind {
    /// JSON Python accepts and this parser cannot represent: lone
    /// surrogates, bodies that are not UTF-8, integers past 128 bits.
    Json,
    /// Template string functions on text whose Python 3.11 result is not
    /// reproduced (e.g. `isalpha()` on non-ASCII text).
    Text,
    /// `truncate_prompt_tokens` / `truncation` in a form not reproduced.
    Truncation,
}

impl std::fmt::Display for InexactKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Json => "json",
            Self::Text => "text",
            Self::Truncation => "truncation",
        })
    }
}

/// The caps of a [`crate::Caps`], named in [`RequestError::OverCap`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Cap {
    /// Chat messages.
    Messages,
    /// Responses input items.
    Items,
    /// Tools.
    Tools,
    /// Bytes of text in the request's strings (keys included).
    TextBytes,
    /// Bytes of the rendered prompt.
    PromptBytes,
    /// Bytes of one pre-token (what BPE sees whole).
    WordBytes,
}

impl std::fmt::Display for Cap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Messages => "messages",
            Self::Items => "input items",
            Self::Tools => "tools",
            Self::TextBytes => "text bytes",
            Self::PromptBytes => "prompt bytes",
            Self::WordBytes => "pre-token bytes",
        })
    }
}

impl RequestError {
    /// A shape error on `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Invalid {
            param: Some(param.into()),
            message: message.into(),
        }
    }

    /// A shape error that names no parameter.
    pub fn message(message: impl Into<String>) -> Self {
        Self::Invalid {
            param: None,
            message: message.into(),
        }
    }

    /// The parameter vLLM would name in its error object.
    pub fn param(&self) -> Option<&str> {
        match self {
            Self::Invalid { param, .. } => param.as_deref(),
            Self::TooLong { param, .. } => Some(param),
            _ => None,
        }
    }

    /// Whether vLLM itself would have answered (so this request cannot be
    /// served by vLLM either), as opposed to a local refusal
    /// ([`RequestError::Unsupported`], [`RequestError::Inexact`],
    /// [`RequestError::OverCap`], [`RequestError::DeadlineExceeded`],
    /// [`RequestError::Cancelled`]) where the caller should fall back to a
    /// replica.
    pub fn is_client_error(&self) -> bool {
        !matches!(
            self,
            Self::Unsupported(_)
                | Self::Inexact { .. }
                | Self::OverCap { .. }
                | Self::DeadlineExceeded
                | Self::Cancelled
        )
    }

    /// A short, fixed label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            Self::InvalidJson(_) => "invalid_json",
            Self::TooDeep { .. } => "too_deep",
            Self::Invalid { .. } => "invalid",
            Self::Template(_) => "template",
            Self::TooLong { .. } => "too_long",
            Self::Unsupported(_) => "unsupported",
            Self::Inexact { .. } => "inexact",
            Self::OverCap { .. } => "over_cap",
            Self::DeadlineExceeded => "deadline",
            Self::Cancelled => "cancelled",
        }
    }
}
