//! One error enum per boundary. gRPC status mapping lives here only.

use std::net::SocketAddr;

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
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// The subscriptions' runtime could not be started.
    #[error("cannot start the ingest runtime: {source}")]
    Runtime {
        /// The OS error.
        source: std::io::Error,
    },
    /// A server stopped with an error.
    #[error("{what} server failed: {reason}")]
    Serve {
        /// `grpc` or `http`.
        what: &'static str,
        /// The error.
        reason: String,
    },
    /// A local tokenizer did not load.
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenize::LoadError),
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
    /// More `completed_request_ids` than one Pick may carry.
    #[error("{got} completed_request_ids exceed the limit of {max}")]
    TooManyCompleted {
        /// Ids in the request.
        got: usize,
        /// The limit.
        max: usize,
    },
}

impl From<RequestError> for tonic::Status {
    fn from(e: RequestError) -> Self {
        match e {
            RequestError::TooManyKeys { .. }
            | RequestError::BadEndpoint(_)
            | RequestError::IdTooLong { .. }
            | RequestError::TooManyCompleted { .. } => {
                tonic::Status::invalid_argument(e.to_string())
            }
        }
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
