//! `index_token`: the shared token indexd may require.

use std::fmt;

use super::ConfigError;

/// The shared token indexd requires (`index_token`), kept as the
/// `authorization` value sent on every Pick and Observe; never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct IndexToken {
    authorization: String,
}

impl IndexToken {
    /// `Bearer <token>`.
    pub fn authorization(&self) -> &str {
        &self.authorization
    }
}

impl fmt::Debug for IndexToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("IndexToken(<redacted>)")
    }
}

/// indexd's token rules: 16 to 4096 visible ASCII characters.
pub(super) fn parse(value: String) -> Result<IndexToken, ConfigError> {
    let token = value.trim();
    if !(16..=4096).contains(&token.len()) || !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ConfigError::new(
            "index_token",
            "must be 16 to 4096 visible ASCII characters (indexd's auth_token_file)",
        ));
    }
    Ok(IndexToken {
        authorization: format!("Bearer {token}"),
    })
}
