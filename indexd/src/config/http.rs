//! The HTTP server's bounds on what a client may hold: how long it may take
//! to send a request head and body, how long a connection may sit idle, and
//! how many connections may be open at once (`crate::http::serve` applies
//! them).
//!
//! ```yaml
//! http_header_read_timeout: 10s   # a request head, from its first byte to its last
//! http_body_read_timeout: 30s     # a request body, from the end of its head to its last byte
//! http_idle_timeout: 60s          # no request under way and no byte moving: closed
//! http_max_connections: 256       # open at once; more are closed as they are accepted
//! ```

use std::time::Duration;

use super::{RawDuration, duration};
use crate::error::ConfigError;

/// The HTTP server's limits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HttpServerConfig {
    /// How long a request head may take, from its first byte to the blank
    /// line that ends it; a connection over it is closed.
    pub header_read_timeout: Duration,
    /// How long a request body may take in all, from when its head was read
    /// to its last byte; the request then fails (its handler sees a body
    /// error) and the count of `indexd_http_timeouts_total{phase="body"}`
    /// rises.
    pub body_read_timeout: Duration,
    /// How long a connection may stay with no request under way (not yet
    /// begun, or answered) and no byte read or written: a kept-alive
    /// connection waiting for its next request, a new one that sends
    /// nothing, or a client that does not read its answer. Closed then.
    pub idle_timeout: Duration,
    /// Connections open at once; one accepted beyond it is answered 503 and
    /// closed at once (`indexd_http_connections_refused_total`).
    pub max_connections: usize,
}

impl Default for HttpServerConfig {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            max_connections: 256,
        }
    }
}

/// The YAML fields (top-level keys of the config).
#[derive(Debug, Default)]
pub(crate) struct RawHttpServer {
    pub(crate) header_read_timeout: Option<RawDuration>,
    pub(crate) body_read_timeout: Option<RawDuration>,
    pub(crate) idle_timeout: Option<RawDuration>,
    pub(crate) max_connections: Option<usize>,
}

impl RawHttpServer {
    pub(crate) fn into_config(self) -> Result<HttpServerConfig, ConfigError> {
        let d = HttpServerConfig::default();
        Ok(HttpServerConfig {
            header_read_timeout: duration(
                "http_header_read_timeout",
                self.header_read_timeout,
                d.header_read_timeout,
            )?,
            body_read_timeout: duration(
                "http_body_read_timeout",
                self.body_read_timeout,
                d.body_read_timeout,
            )?,
            idle_timeout: duration("http_idle_timeout", self.idle_timeout, d.idle_timeout)?,
            max_connections: self.max_connections.unwrap_or(d.max_connections),
        })
    }
}

/// Every timeout positive, at least one connection.
pub(crate) fn validate(c: &HttpServerConfig) -> Result<(), ConfigError> {
    for (field, d) in [
        ("http_header_read_timeout", c.header_read_timeout),
        ("http_body_read_timeout", c.body_read_timeout),
        ("http_idle_timeout", c.idle_timeout),
    ] {
        if d.is_zero() {
            return Err(ConfigError::field(field, "must be positive"));
        }
    }
    if c.max_connections == 0 {
        return Err(ConfigError::field(
            "http_max_connections",
            "must be positive",
        ));
    }
    Ok(())
}
