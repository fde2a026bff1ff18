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
    /// served by vLLM either), as opposed to a local limitation
    /// ([`RequestError::Unsupported`]) where the caller should fall back to
    /// a replica.
    pub fn is_client_error(&self) -> bool {
        !matches!(self, Self::Unsupported(_))
    }
}
