//! One error enum per boundary. gRPC status mapping lives here only.

/// Invalid configuration; the message names the field.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The YAML did not parse (serde names the field and line).
    #[error("config: {0}")]
    Parse(String),
    /// The file could not be read.
    #[error("config file {path}: {reason}")]
    Read {
        /// The file.
        path: String,
        /// The OS error.
        reason: String,
    },
    /// A field has an invalid value.
    #[error("config field `{field}`: {reason}")]
    Field {
        /// Dotted path of the field, e.g. `endpoints[2].address`.
        field: String,
        /// What is wrong.
        reason: String,
    },
}

impl ConfigError {
    /// An error naming `field`.
    pub fn field(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Field {
            field: field.into(),
            reason: reason.into(),
        }
    }
}

/// Starting or running the servers failed.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A listener could not be bound.
    #[error("cannot bind {what} listener on {addr}: {source}")]
    Bind {
        /// `grpc` or `http`.
        what: &'static str,
        /// The address (`ip:port` or `unix://path`).
        addr: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The subscriptions' runtime could not be started.
    #[error("cannot start the ingest runtime: {source}")]
    Runtime {
        /// The OS error.
        source: std::io::Error,
    },
    /// `ingest_cpus` names CPUs the process cannot place its ingest on.
    #[error("{reason}")]
    Placement {
        /// What is wrong.
        reason: String,
    },
    /// A server stopped with an error.
    #[error("{what} server failed: {reason}")]
    Serve {
        /// `grpc` or `http`.
        what: &'static str,
        /// The error.
        reason: String,
    },
    /// The Kubernetes client could not be set up.
    #[error("kubernetes discovery: {reason}")]
    Kubernetes {
        /// What is missing or wrong.
        reason: String,
    },
    /// A local tokenizer did not load.
    #[error(transparent)]
    Tokenizer(#[from] LoadError),
}

/// A Pick or Observe the daemon refuses.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RequestError {
    /// More keys than `max_pick_keys`.
    #[error("{got} block keys exceed the limit of {max}")]
    TooManyKeys {
        /// Keys in the request.
        got: usize,
        /// The limit.
        max: usize,
    },
    /// The endpoint named in an Observe is not `ip:port`.
    #[error("endpoint {0:?} is not ip:port")]
    BadEndpoint(String),
    /// An id longer than the protocol allows.
    #[error("{field} is {len} bytes, more than {max}")]
    IdTooLong {
        /// The field.
        field: &'static str,
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// More entries in a list (`completed_request_ids`, `continued`) than
    /// one Pick may carry.
    #[error("{got} {field} exceed the limit of {max}")]
    TooManyEntries {
        /// The list.
        field: &'static str,
        /// Entries in the request.
        got: usize,
        /// The limit.
        max: usize,
    },
    /// An Observe names a replica indexd does not know.
    #[error("endpoint {0} is not a known replica")]
    UnknownEndpoint(String),
    /// An Observe names a replica that does not serve its model.
    #[error("endpoint {endpoint} does not serve model {model:?}")]
    ModelNotServed {
        /// The replica.
        endpoint: String,
        /// The Observe's model.
        model: String,
    },
    /// More Observe calls than `observe_rate` and `observe_burst` admit.
    #[error("too many Observe calls: over observe_rate")]
    RateLimited,
    /// An Observe's response id is recorded already for another replica or
    /// model.
    #[error("response_id is recorded already for another endpoint or model")]
    ResponseIdTaken,
}

impl From<RequestError> for tonic::Status {
    fn from(e: RequestError) -> Self {
        match e {
            RequestError::TooManyKeys { .. }
            | RequestError::BadEndpoint(_)
            | RequestError::IdTooLong { .. }
            | RequestError::TooManyEntries { .. }
            | RequestError::UnknownEndpoint(_)
            | RequestError::ModelNotServed { .. } => tonic::Status::invalid_argument(e.to_string()),
            RequestError::RateLimited => tonic::Status::resource_exhausted(e.to_string()),
            RequestError::ResponseIdTaken => tonic::Status::already_exists(e.to_string()),
        }
    }
}

/// A call without the shared token (its text never appears here).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AuthError {
    /// No `authorization` header or metadata.
    #[error("authorization required: Bearer token")]
    Missing,
    /// Another scheme than `Bearer`.
    #[error("authorization must use the Bearer scheme")]
    NotBearer,
    /// Not the token.
    #[error("the Bearer token is not valid")]
    Mismatch,
}

impl From<AuthError> for tonic::Status {
    fn from(e: AuthError) -> Self {
        tonic::Status::unauthenticated(e.to_string())
    }
}

/// A subscription session ended.
#[derive(Debug, thiserror::Error)]
pub enum SubscribeError {
    /// The ZMTP connection (or the bound listener) failed.
    #[error("zmtp: {0}")]
    Zmtp(#[from] crate::zmtp::ZmtpError),
}

/// A scrape failed.
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    /// Connecting, sending or reading failed.
    #[error("http: {0}")]
    Http(#[from] reqwest::Error),
    /// The whole exchange took too long.
    #[error("timed out")]
    Timeout,
    /// Not a 200 response.
    #[error("http status {0}")]
    Status(u16),
    /// The body exceeded the cap.
    #[error("response larger than {0} bytes")]
    TooLarge(usize),
}

/// A local tokenizer that did not load.
#[derive(Debug, thiserror::Error)]
#[error("tokenizer for model {model:?} in {dir}: {source}")]
pub struct LoadError {
    /// The model.
    pub model: String,
    /// Its directory.
    pub dir: String,
    /// Why.
    #[source]
    pub source: LoadFailure,
}

/// Why a local tokenizer could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum LoadFailure {
    /// Its files.
    #[error(transparent)]
    Tokenizer(#[from] kvroute_tokenizer::LoadError),
    /// The threads large bodies are tokenized on.
    #[error("cannot start the large-body threads: {0}")]
    Threads(#[from] std::io::Error),
}
