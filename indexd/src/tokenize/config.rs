//! The `tokenize:` section of indexd's YAML, and `--tokenizer NAME=DIR`.
//!
//! ```yaml
//! tokenize:
//!   tokenizers:                      # models tokenized in process
//!     - model: tiny-llama            # the name requests carry
//!       dir: /models/tiny-llama      # tokenizer.json, tokenizer_config.json, …
//!       max_model_len: 4096          # vLLM's --max-model-len (else config.json)
//!       chat_template: /t.jinja      # vLLM's --chat-template (optional)
//!       trust_request_chat_template: false
//!   cache_bytes: 67108864            # per model: the segment cache's bound
//!   replica_timeout: 2s              # a replica's /tokenize or render call
//!   gate_interval: 10m               # the probe set runs again this often
//!   shadow_per_second: 1             # live requests compared, per model (0: none)
//!   max_body_bytes: 16777216         # largest body tokenized (HTTP and Pick)
//! ```

use std::path::PathBuf;

use serde::Deserialize;

use super::{TokenizeConfig, TokenizerSpec};
use crate::config::{RawDuration, duration};
use crate::error::ConfigError;

/// The YAML shape.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawTokenize {
    #[serde(default)]
    tokenizers: Vec<RawTokenizer>,
    cache_bytes: Option<usize>,
    replica_timeout: Option<RawDuration>,
    gate_interval: Option<RawDuration>,
    shadow_per_second: Option<f64>,
    max_body_bytes: Option<usize>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTokenizer {
    model: String,
    dir: PathBuf,
    max_model_len: Option<u32>,
    chat_template: Option<PathBuf>,
    #[serde(default)]
    trust_request_chat_template: bool,
}

impl RawTokenize {
    pub(crate) fn into_config(self) -> Result<TokenizeConfig, ConfigError> {
        let d = TokenizeConfig::default();
        let f = |name: &str| format!("tokenize.{name}");
        Ok(TokenizeConfig {
            tokenizers: self
                .tokenizers
                .into_iter()
                .map(|t| TokenizerSpec {
                    model: t.model,
                    dir: t.dir,
                    max_model_len: t.max_model_len,
                    chat_template: t.chat_template,
                    trust_request_chat_template: t.trust_request_chat_template,
                })
                .collect(),
            cache_bytes: self.cache_bytes.unwrap_or(d.cache_bytes),
            replica_timeout: duration(
                &f("replica_timeout"),
                self.replica_timeout,
                d.replica_timeout,
            )?,
            gate_interval: duration(&f("gate_interval"), self.gate_interval, d.gate_interval)?,
            shadow_per_second: self.shadow_per_second.unwrap_or(d.shadow_per_second),
            max_body_bytes: self.max_body_bytes.unwrap_or(d.max_body_bytes),
        })
    }
}

/// `NAME=DIR` (the `--tokenizer` flag).
pub fn parse_flag(text: &str) -> Result<TokenizerSpec, ConfigError> {
    let (model, dir) = text
        .split_once('=')
        .ok_or_else(|| ConfigError::field("--tokenizer", format!("{text:?} is not NAME=DIR")))?;
    Ok(TokenizerSpec {
        model: model.to_owned(),
        dir: PathBuf::from(dir),
        max_model_len: None,
        chat_template: None,
        trust_request_chat_template: false,
    })
}

/// Checks what the types cannot express.
pub fn validate(c: &TokenizeConfig) -> Result<(), ConfigError> {
    for (i, t) in c.tokenizers.iter().enumerate() {
        let at = |field: &str| format!("tokenize.tokenizers[{i}].{field}");
        if t.model.trim().is_empty() {
            return Err(ConfigError::field(at("model"), "must not be empty"));
        }
        if t.dir.as_os_str().is_empty() {
            return Err(ConfigError::field(at("dir"), "must not be empty"));
        }
        if c.tokenizers.iter().take(i).any(|o| o.model == t.model) {
            return Err(ConfigError::field(
                at("model"),
                format!("{:?} is given twice", t.model),
            ));
        }
    }
    if c.replica_timeout.is_zero() {
        return Err(ConfigError::field(
            "tokenize.replica_timeout",
            "must be positive",
        ));
    }
    if c.gate_interval.is_zero() {
        return Err(ConfigError::field(
            "tokenize.gate_interval",
            "must be positive",
        ));
    }
    if !(c.shadow_per_second >= 0.0 && c.shadow_per_second.is_finite()) {
        return Err(ConfigError::field(
            "tokenize.shadow_per_second",
            "must be a non-negative number",
        ));
    }
    if c.max_body_bytes == 0 {
        return Err(ConfigError::field(
            "tokenize.max_body_bytes",
            "must be positive",
        ));
    }
    if c.cache_bytes == 0 {
        return Err(ConfigError::field(
            "tokenize.cache_bytes",
            "must be positive",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Config;

    #[test]
    fn yaml_section_and_flag() {
        let c = Config::from_yaml(
            "tokenize:\n  tokenizers:\n    - {model: tiny, dir: /m/tiny, max_model_len: 4096}\n  replica_timeout: 500ms\n  shadow_per_second: 0\n",
        )
        .unwrap();
        assert_eq!(c.tokenize.tokenizers.len(), 1);
        assert_eq!(c.tokenize.tokenizers[0].max_model_len, Some(4096));
        assert_eq!(
            c.tokenize.replica_timeout,
            std::time::Duration::from_millis(500)
        );
        assert_eq!(c.tokenize.shadow_per_second, 0.0);
        assert_eq!(parse_flag("a=/x/y").unwrap().dir, PathBuf::from("/x/y"));
        assert!(parse_flag("nodir").is_err());
        for (bad, field) in [
            (
                "tokenize:\n  tokenizers:\n    - {model: a, dir: /x}\n    - {model: a, dir: /y}\n",
                "tokenizers[1].model",
            ),
            ("tokenize:\n  shadow_per_second: -1\n", "shadow_per_second"),
            (
                "tokenize:\n  tokenizers:\n    - {model: a, dri: /x}\n",
                "dri",
            ),
        ] {
            let err = Config::from_yaml(bad).unwrap_err().to_string();
            assert!(err.contains(field), "{err}");
        }
    }
}
