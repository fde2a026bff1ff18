//! The optional shared token (`auth_token_file`).
//!
//! The file is read once at start; only the token's SHA-256 digest is kept,
//! and neither the token nor its digest is ever logged. With a token
//! configured, every gRPC call (an interceptor in front of the service) and
//! every HTTP route but `/healthz` and `/readyz` (the kubelet's probes) must
//! carry `authorization: Bearer <token>`. The comparison runs over the
//! digests of the expected and the presented token, in time independent of
//! where they differ or how long the presented one is. A refusal is
//! `UNAUTHENTICATED` (gRPC) or 401 (HTTP), counted in
//! `indexd_auth_failures_total{listener}`.

use std::path::Path;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};

use crate::error::{AuthError, ConfigError};
use crate::metrics::CounterVec;

/// The shortest token accepted.
pub const MIN_TOKEN_BYTES: usize = 16;
/// The longest token accepted.
pub const MAX_TOKEN_BYTES: usize = 4096;

/// The expected token, as its digest.
pub struct Token {
    digest: [u8; 32],
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

impl Token {
    /// Reads the token from `path` (field `auth_token_file`): the file's
    /// text without surrounding whitespace, 16 to 4096 visible ASCII
    /// characters.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let field = "auth_token_file";
        let bytes = std::fs::read(path).map_err(|e| {
            ConfigError::field(field, format!("cannot read {}: {e}", path.display()))
        })?;
        Self::from_bytes(&bytes)
            .map_err(|reason| ConfigError::field(field, format!("{}: {reason}", path.display())))
    }

    /// A token from its text (surrounding whitespace ignored).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, &'static str> {
        let token = bytes.trim_ascii();
        if token.len() < MIN_TOKEN_BYTES {
            return Err("the token must hold at least 16 characters");
        }
        if token.len() > MAX_TOKEN_BYTES {
            return Err("the token must hold at most 4096 characters");
        }
        if !token.iter().all(|b| b.is_ascii_graphic()) {
            return Err("the token must be visible ASCII (no spaces or control characters)");
        }
        Ok(Self {
            digest: Sha256::digest(token).into(),
        })
    }

    /// True when `presented` is the token.
    pub fn matches(&self, presented: &[u8]) -> bool {
        let digest: [u8; 32] = Sha256::digest(presented).into();
        let diff = self
            .digest
            .iter()
            .zip(digest.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        std::hint::black_box(diff) == 0
    }

    /// Checks an `authorization` header value: `Bearer <token>`.
    pub fn check(&self, header: Option<&[u8]>) -> Result<(), AuthError> {
        let value = header.ok_or(AuthError::Missing)?;
        let presented = value
            .strip_prefix(b"Bearer ")
            .or_else(|| value.strip_prefix(b"bearer "))
            .ok_or(AuthError::NotBearer)?;
        if self.matches(presented.trim_ascii()) {
            Ok(())
        } else {
            Err(AuthError::Mismatch)
        }
    }
}

/// What the checks read from the daemon's state: the token, if one is
/// configured, and the counter of refusals.
pub(crate) trait Guarded: Send + Sync + 'static {
    /// The expected token (None: every call passes).
    fn token(&self) -> Option<&Token>;
    /// `indexd_auth_failures_total{listener}`.
    fn auth_failures(&self) -> &CounterVec<1>;
}

/// The gRPC interceptor: passes every call when no token is configured.
#[derive(Debug)]
pub(crate) struct GrpcAuth<S> {
    state: Arc<S>,
}

impl<S> Clone for GrpcAuth<S> {
    fn clone(&self) -> Self {
        Self {
            state: Arc::clone(&self.state),
        }
    }
}

impl<S: Guarded> GrpcAuth<S> {
    pub(crate) fn new(state: Arc<S>) -> Self {
        Self { state }
    }
}

impl<S: Guarded> tonic::service::Interceptor for GrpcAuth<S> {
    fn call(&mut self, request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let Some(token) = self.state.token() else {
            return Ok(request);
        };
        let header = request
            .metadata()
            .get("authorization")
            .map(tonic::metadata::MetadataValue::as_bytes);
        match token.check(header) {
            Ok(()) => Ok(request),
            Err(e) => {
                self.state.auth_failures().inc(["grpc"]);
                Err(e.into())
            }
        }
    }
}

/// The HTTP middleware, layered on every route but the probes when a token
/// is configured.
pub(crate) async fn http<S: Guarded>(
    State(state): State<Arc<S>>,
    request: Request,
    next: Next,
) -> Response {
    let Some(token) = state.token() else {
        return next.run(request).await;
    };
    let header = request
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .map(axum::http::HeaderValue::as_bytes);
    match token.check(header) {
        Ok(()) => next.run(request).await,
        Err(e) => {
            state.auth_failures().inc(["http"]);
            (
                StatusCode::UNAUTHORIZED,
                [("www-authenticate", "Bearer")],
                format!("{e}\n"),
            )
                .into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_bearer_token_passes() {
        let t = Token::from_bytes(b"  s3cret-token-0123456789\n").unwrap();
        assert!(t.check(Some(b"Bearer s3cret-token-0123456789")).is_ok());
        assert_eq!(t.check(None), Err(AuthError::Missing));
        assert_eq!(
            t.check(Some(b"Basic s3cret-token-0123456789")),
            Err(AuthError::NotBearer)
        );
        for wrong in [
            &b"Bearer s3cret-token-0123456788"[..],
            b"Bearer s3cret-token-012345678",
            b"Bearer s3cret-token-01234567890",
            b"Bearer ",
        ] {
            assert_eq!(t.check(Some(wrong)), Err(AuthError::Mismatch));
        }
        assert!(format!("{t:?}").contains("redacted"));
    }

    #[test]
    fn weak_or_odd_tokens_are_refused() {
        assert!(Token::from_bytes(b"short").is_err());
        assert!(Token::from_bytes(b"has a space in the middle").is_err());
        assert!(Token::from_bytes(&[b'x'; MAX_TOKEN_BYTES + 1]).is_err());
        let dir = tempfile::tempdir().unwrap();
        let err = Token::load(&dir.path().join("missing")).unwrap_err();
        assert!(err.to_string().contains("auth_token_file"), "{err}");
        let path = dir.path().join("token");
        std::fs::write(&path, "tiny\n").unwrap();
        let err = Token::load(&path).unwrap_err().to_string();
        assert!(
            err.contains("auth_token_file") && !err.contains("tiny"),
            "{err}"
        );
    }
}
