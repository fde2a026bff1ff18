//! HTTP errors in vLLM's shape: `{"error": {"message", "type", "param", "code"}}`.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An error answered to an HTTP client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<String>,
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: None,
        }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: message.into(),
            param: None,
        }
    }

    /// A failure of the mock itself (never expected).
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            param: None,
        }
    }

    pub fn with_param(mut self, param: &str) -> Self {
        self.param = Some(param.to_owned());
        self
    }

    /// vLLM's error `type` for this status.
    pub(crate) fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::BAD_REQUEST => "BadRequestError",
            StatusCode::NOT_FOUND => "NotFoundError",
            StatusCode::UNPROCESSABLE_ENTITY => "BadRequestError",
            _ => "InternalServerError",
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "param": self.param,
                "code": self.status.as_u16(),
            }
        });
        (self.status, Json(body)).into_response()
    }
}

/// Parses a JSON body, answering 400 (not axum's 422) on malformed input, as vLLM does.
pub fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("Invalid request body: {e}")))
}

/// vLLM's `cache_salt` rules: non-empty, at most 128 characters, none of `@ / \ NUL`.
pub fn validate_cache_salt(salt: Option<&str>) -> Result<(), ApiError> {
    let Some(salt) = salt else { return Ok(()) };
    let reason = if salt.is_empty() {
        Some("Parameter 'cache_salt' must be a non-empty string if provided.")
    } else if salt.chars().count() > 128 {
        Some("Parameter 'cache_salt' must be at most 128 characters.")
    } else if salt.contains(['@', '/', '\\', '\0']) {
        Some("Parameter 'cache_salt' must not contain '@', '/', '\\\\' or NUL characters.")
    } else {
        None
    };
    match reason {
        Some(r) => Err(ApiError::bad_request(r).with_param("cache_salt")),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn salt_rules() {
        assert!(validate_cache_salt(None).is_ok());
        assert!(validate_cache_salt(Some("tenant-1")).is_ok());
        assert!(validate_cache_salt(Some(&"x".repeat(128))).is_ok());
        for bad in ["", "a@b", "a/b", "a\\b", "a\0b"] {
            let e = validate_cache_salt(Some(bad)).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{bad:?}");
        }
        assert!(validate_cache_salt(Some(&"x".repeat(129))).is_err());
    }

    #[test]
    fn bad_json_is_400() {
        let e = parse_json::<serde_json::Value>(b"{").unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
    }
}

/// A configuration that cannot run; the message names the field.
#[derive(Debug, thiserror::Error)]
#[error("invalid config `{field}`: {reason}")]
pub struct ConfigError {
    pub field: &'static str,
    pub reason: String,
}

pub(crate) fn invalid(field: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        field,
        reason: reason.into(),
    }
}

/// Runs a request's parsing and tokenization on the blocking pool, as vLLM's API server
/// tokenizes on a thread pool beside its event loop: a body of megabytes keeps this replica's
/// `/metrics`, `/health` and small requests answering while it is read.
pub async fn off_loop<T, F>(work: F) -> Result<T, ApiError>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, ApiError> + Send + 'static,
{
    tokio::task::spawn_blocking(work).await.unwrap_or_else(|e| {
        Err(ApiError::internal(format!(
            "request preparation failed: {e}"
        )))
    })
}
