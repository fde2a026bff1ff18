//! Who may call indexd: the shared token, the rule for listeners beyond
//! loopback, and the Observe rate limit.
//!
//! ```yaml
//! grpc_listen: unix:///run/kvroute/indexd.sock   # or ip:port
//! auth_token_file: /etc/kvroute/token/token      # optional: `authorization: Bearer <token>`
//! allow_unauthenticated: false    # true: serve beyond loopback without a token
//! observe_rate: 2000              # Observe calls a second, all callers together
//! observe_burst: 4000             # saved up at most
//! ```
//!
//! A TCP listener on anything but a loopback address needs a token, or
//! `allow_unauthenticated: true` said explicitly (for a network that a
//! NetworkPolicy or a mesh guards already); otherwise indexd refuses to
//! start. mTLS belongs to the mesh (an Istio sidecar on indexd's pods), not
//! to indexd.

use std::num::NonZeroU32;
use std::path::PathBuf;

use super::Config;
use crate::error::ConfigError;

/// The access settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AccessConfig {
    /// A file holding the shared token (read at start, never logged).
    pub auth_token_file: Option<PathBuf>,
    /// Serve on non-loopback TCP addresses without a token.
    pub allow_unauthenticated: bool,
    /// Observe calls admitted per second (all callers together).
    pub observe_rate: NonZeroU32,
    /// Observe calls admitted at once after a quiet spell.
    pub observe_burst: NonZeroU32,
}

impl Default for AccessConfig {
    fn default() -> Self {
        Self {
            auth_token_file: None,
            allow_unauthenticated: false,
            observe_rate: NonZeroU32::MIN.saturating_add(1999),
            observe_burst: NonZeroU32::MIN.saturating_add(3999),
        }
    }
}

/// The YAML fields (top-level keys of the config).
#[derive(Debug, Default)]
pub(crate) struct RawAccess {
    pub(crate) auth_token_file: Option<PathBuf>,
    pub(crate) allow_unauthenticated: Option<bool>,
    pub(crate) observe_rate: Option<u32>,
    pub(crate) observe_burst: Option<u32>,
}

impl RawAccess {
    pub(crate) fn into_config(self) -> Result<AccessConfig, ConfigError> {
        let d = AccessConfig::default();
        let positive = |field: &str, v: Option<u32>, default: NonZeroU32| {
            v.map_or(Ok(default), |n| {
                NonZeroU32::new(n).ok_or_else(|| ConfigError::field(field, "must be positive"))
            })
        };
        Ok(AccessConfig {
            auth_token_file: self.auth_token_file,
            allow_unauthenticated: self.allow_unauthenticated.unwrap_or(false),
            observe_rate: positive("observe_rate", self.observe_rate, d.observe_rate)?,
            observe_burst: positive("observe_burst", self.observe_burst, d.observe_burst)?,
        })
    }
}

/// Refuses listeners beyond loopback without a token, unless allowed.
pub(crate) fn validate(config: &Config) -> Result<(), ConfigError> {
    let a = &config.access;
    if a.auth_token_file
        .as_ref()
        .is_some_and(|p| p.as_os_str().is_empty())
    {
        return Err(ConfigError::field("auth_token_file", "must name a file"));
    }
    if a.auth_token_file.is_some() || a.allow_unauthenticated {
        return Ok(());
    }
    let listeners = [
        (
            "grpc_listen",
            config.grpc_listen.is_node_local(),
            config.grpc_listen.to_string(),
        ),
        (
            "http_listen",
            config.http_listen.ip().is_loopback(),
            config.http_listen.to_string(),
        ),
    ];
    for (field, local, addr) in listeners {
        if !local {
            return Err(ConfigError::field(
                field,
                format!(
                    "{addr} is reachable beyond this host: set `auth_token_file` (a shared \
                     token) or, on a network guarded otherwise, `allow_unauthenticated: true`"
                ),
            ));
        }
    }
    Ok(())
}
