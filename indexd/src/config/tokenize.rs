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
//!   shadow_per_second: 0.1           # live Picks compared beside them, per model (0: none)
//!   gate_close_after_mismatches: 3   # distinct live bodies differing within…
//!   gate_mismatch_window: 10m        # …this window close the gate
//!   gate_reopen_after_rounds: 2      # clean probe rounds in a row reopen it
//!   gate_reopen_backoff: 30s         # a closed gate's first pause (doubles)
//!   max_body_bytes: 16777216         # largest body tokenized (HTTP and Pick)
//!   time_budget: 2s                  # one body's local tokenization, at most
//!   large_body_nice: 10              # CPU priority of bodies over small_body_bytes (0–19)
//!   admission:                       # bodies in flight (defaults: the machine's)
//!     max_bytes: 16777216            # memory/1024, 16–256 MiB
//!     max_concurrent: 8              # 4 per CPU, at least 8
//!     small_body_bytes: 1048576      # bodies this small may use the reserve
//!     reserved_bytes: 4194304        # a quarter of max_bytes
//!     reserved_concurrent: 7         # all but an eighth of max_concurrent
//!     retry_after: 1s                # HTTP 503's Retry-After
//! ```

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::config::{RawDuration, duration};
use crate::error::ConfigError;

/// One model's local tokenizer, as configured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenizerSpec {
    /// The model name requests carry.
    pub model: String,
    /// Its directory: `tokenizer.json`, `tokenizer_config.json`, optionally
    /// `chat_template.jinja` and `config.json`.
    pub dir: PathBuf,
    /// vLLM's `--max-model-len` (else from config.json, as vLLM does).
    pub max_model_len: Option<u32>,
    /// vLLM's `--chat-template`, as a file.
    pub chat_template: Option<PathBuf>,
    /// vLLM's `--trust-request-chat-template`.
    pub trust_request_chat_template: bool,
}

/// How tokenization behaves, from the configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenizeConfig {
    /// Local tokenizers.
    pub tokenizers: Vec<TokenizerSpec>,
    /// Bound of each local tokenizer's segment cache.
    pub cache_bytes: usize,
    /// Timeout of a replica's tokenizer call.
    pub replica_timeout: Duration,
    /// The exactness gate's rules (`gate_interval`, `shadow_per_second`,
    /// `gate_close_after_mismatches`, …).
    pub gate: GateRules,
    /// Largest request body accepted.
    pub max_body_bytes: usize,
    /// The budget of bodies in flight (`admission:`).
    pub admission: AdmissionConfig,
    /// How long one body's local tokenization may take before it is given
    /// up (checked between its segments).
    pub time_budget: Duration,
    /// The nice value of the threads that tokenize bodies over
    /// `admission.small_body_bytes` ([`bulk`]; 0: indexd's own priority).
    pub large_body_nice: i32,
}

impl Default for TokenizeConfig {
    fn default() -> Self {
        Self {
            tokenizers: Vec::new(),
            cache_bytes: 64 << 20,
            replica_timeout: Duration::from_secs(2),
            gate: GateRules::default(),
            max_body_bytes: 16 << 20,
            admission: AdmissionConfig::default(),
            time_budget: Duration::from_secs(2),
            large_body_nice: 10,
        }
    }
}

/// The budget's configuration (`tokenize.admission`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdmissionConfig {
    /// Request-body bytes tokenized at once (locally or by a replica).
    pub max_bytes: usize,
    /// Bodies tokenized at once.
    pub max_concurrent: usize,
    /// A body of at most this many bytes may use the reserve.
    pub small_body_bytes: usize,
    /// Of `max_bytes`, what only small bodies may use.
    pub reserved_bytes: usize,
    /// Of `max_concurrent`, what only small bodies may use.
    pub reserved_concurrent: usize,
    /// The `Retry-After` of an HTTP refusal.
    pub retry_after: Duration,
}

impl AdmissionConfig {
    /// The defaults for a machine with `cpus` CPUs and `memory` bytes:
    /// bodies worth a 1/1024th of the memory in flight (16 MiB to
    /// 256 MiB: at a hostile body's ~64× in the tokenizer, 1/16th of the
    /// memory), 4 per CPU and at least 8 bodies, a quarter of the bytes and
    /// all but an eighth of the places ([`reserve_for`]) kept for bodies of
    /// at most 1 MiB.
    pub fn for_machine(cpus: usize, memory: u64) -> Self {
        let max_bytes = usize::try_from(memory / 1024)
            .unwrap_or(usize::MAX)
            .clamp(16 << 20, 256 << 20);
        let max_concurrent = cpus.saturating_mul(4).max(8);
        Self {
            max_bytes,
            max_concurrent,
            small_body_bytes: 1 << 20,
            reserved_bytes: max_bytes / 4,
            reserved_concurrent: reserve_for(max_concurrent),
            retry_after: Duration::from_secs(1),
        }
    }
}

/// The places of `max_concurrent` kept for small bodies: all but an eighth
/// (at least one left for large bodies). Large bodies are the ones a hostile
/// client sends, and each keeps a CPU busy for as long as its time budget:
/// with the default of 4 places per CPU, an eighth is half the CPUs (one on
/// a 2-CPU node), so ordinary requests always find CPUs free.
pub fn reserve_for(max_concurrent: usize) -> usize {
    max_concurrent.saturating_sub((max_concurrent / 8).max(1))
}

impl Default for AdmissionConfig {
    /// [`AdmissionConfig::for_machine`] of this machine.
    fn default() -> Self {
        Self::for_machine(crate::machine::cpus(), crate::machine::memory_bytes())
    }
}

/// The rules a gate follows (from `tokenize:`).
#[derive(Clone, Debug, PartialEq)]
pub struct GateRules {
    /// The probe set's period while open; the cap of a closed gate's pause.
    pub interval: Duration,
    /// Live Picks compared per second at most, beside them (0: none).
    pub shadow_per_second: f64,
    /// Distinct live bodies whose ids differ within `mismatch_window` that
    /// close the gate (at least 1).
    pub close_after_mismatches: u32,
    /// See `close_after_mismatches`.
    pub mismatch_window: Duration,
    /// Clean probe rounds in a row that reopen a closed gate (at least 1).
    pub reopen_after_rounds: u32,
    /// A closed gate's first pause between probe rounds.
    pub reopen_backoff: Duration,
}

impl Default for GateRules {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(600),
            // One every 10 s per model and indexd: a DaemonSet of N nodes
            // sends N times this to the replicas' API servers, where each
            // costs a /tokenize of a whole conversation.
            shadow_per_second: 0.1,
            close_after_mismatches: 3,
            mismatch_window: Duration::from_secs(600),
            reopen_after_rounds: 2,
            reopen_backoff: Duration::from_secs(30),
        }
    }
}

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
    gate_close_after_mismatches: Option<u32>,
    gate_mismatch_window: Option<RawDuration>,
    gate_reopen_after_rounds: Option<u32>,
    gate_reopen_backoff: Option<RawDuration>,
    max_body_bytes: Option<usize>,
    time_budget: Option<RawDuration>,
    large_body_nice: Option<i32>,
    admission: Option<RawAdmission>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAdmission {
    max_bytes: Option<usize>,
    max_concurrent: Option<usize>,
    small_body_bytes: Option<usize>,
    reserved_bytes: Option<usize>,
    reserved_concurrent: Option<usize>,
    retry_after: Option<RawDuration>,
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
        let g = &d.gate;
        let gate = GateRules {
            interval: duration(&f("gate_interval"), self.gate_interval, g.interval)?,
            shadow_per_second: self.shadow_per_second.unwrap_or(g.shadow_per_second),
            close_after_mismatches: self
                .gate_close_after_mismatches
                .unwrap_or(g.close_after_mismatches),
            mismatch_window: duration(
                &f("gate_mismatch_window"),
                self.gate_mismatch_window,
                g.mismatch_window,
            )?,
            reopen_after_rounds: self
                .gate_reopen_after_rounds
                .unwrap_or(g.reopen_after_rounds),
            reopen_backoff: duration(
                &f("gate_reopen_backoff"),
                self.gate_reopen_backoff,
                g.reopen_backoff,
            )?,
        };
        let a = self.admission.unwrap_or_default();
        let da = &d.admission;
        // Reserves default to their share of the totals given.
        let max_bytes = a.max_bytes.unwrap_or(da.max_bytes);
        let max_concurrent = a.max_concurrent.unwrap_or(da.max_concurrent);
        let admission = AdmissionConfig {
            max_bytes,
            max_concurrent,
            small_body_bytes: a.small_body_bytes.unwrap_or(da.small_body_bytes),
            reserved_bytes: a.reserved_bytes.unwrap_or(max_bytes / 4),
            reserved_concurrent: a
                .reserved_concurrent
                .unwrap_or_else(|| reserve_for(max_concurrent)),
            retry_after: duration(&f("admission.retry_after"), a.retry_after, da.retry_after)?,
        };
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
            gate,
            max_body_bytes: self.max_body_bytes.unwrap_or(d.max_body_bytes),
            admission,
            time_budget: duration(&f("time_budget"), self.time_budget, d.time_budget)?,
            large_body_nice: self.large_body_nice.unwrap_or(d.large_body_nice),
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
    let g = &c.gate;
    for (name, d) in [
        ("gate_interval", g.interval),
        ("gate_mismatch_window", g.mismatch_window),
        ("gate_reopen_backoff", g.reopen_backoff),
        ("time_budget", c.time_budget),
        ("admission.retry_after", c.admission.retry_after),
    ] {
        if d.is_zero() {
            return Err(ConfigError::field(
                format!("tokenize.{name}"),
                "must be positive",
            ));
        }
    }
    for (name, n) in [
        ("gate_close_after_mismatches", g.close_after_mismatches),
        ("gate_reopen_after_rounds", g.reopen_after_rounds),
    ] {
        if n == 0 {
            return Err(ConfigError::field(
                format!("tokenize.{name}"),
                "must be at least 1",
            ));
        }
    }
    let a = &c.admission;
    if a.max_bytes == 0 || a.max_concurrent == 0 {
        return Err(ConfigError::field(
            "tokenize.admission",
            "max_bytes and max_concurrent must be positive",
        ));
    }
    if a.reserved_bytes >= a.max_bytes || a.reserved_concurrent >= a.max_concurrent {
        return Err(ConfigError::field(
            "tokenize.admission",
            format!(
                "the reserves must be smaller than the totals (reserved_bytes {} < max_bytes {}, reserved_concurrent {} < max_concurrent {})",
                a.reserved_bytes, a.max_bytes, a.reserved_concurrent, a.max_concurrent
            ),
        ));
    }
    let g_sps = g.shadow_per_second;
    if !(g_sps >= 0.0 && g_sps.is_finite()) {
        return Err(ConfigError::field(
            "tokenize.shadow_per_second",
            "must be a non-negative number",
        ));
    }
    if !(0..=19).contains(&c.large_body_nice) {
        return Err(ConfigError::field(
            "tokenize.large_body_nice",
            format!(
                "{} is not a nice value from 0 (indexd's own priority) to 19 (the lowest)",
                c.large_body_nice
            ),
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
        assert_eq!(c.tokenize.gate.shadow_per_second, 0.0);
        let c = Config::from_yaml(
            "tokenize:\n  gate_close_after_mismatches: 5\n  gate_reopen_backoff: 5s\n  time_budget: 300ms\n  large_body_nice: 5\n  admission: {max_bytes: 1000, max_concurrent: 4}\n",
        )
        .unwrap();
        assert_eq!(c.tokenize.gate.close_after_mismatches, 5);
        assert_eq!(
            c.tokenize.gate.reopen_backoff,
            std::time::Duration::from_secs(5)
        );
        assert_eq!(
            c.tokenize.time_budget,
            std::time::Duration::from_millis(300)
        );
        assert_eq!(c.tokenize.large_body_nice, 5);
        assert_eq!(
            (
                c.tokenize.admission.reserved_bytes,
                c.tokenize.admission.reserved_concurrent
            ),
            (250, 3),
            "the reserves follow the totals given"
        );
        assert_eq!(parse_flag("a=/x/y").unwrap().dir, PathBuf::from("/x/y"));
        assert!(parse_flag("nodir").is_err());
        for (bad, field) in [
            (
                "tokenize:\n  tokenizers:\n    - {model: a, dir: /x}\n    - {model: a, dir: /y}\n",
                "tokenizers[1].model",
            ),
            ("tokenize:\n  shadow_per_second: -1\n", "shadow_per_second"),
            ("tokenize:\n  large_body_nice: 20\n", "large_body_nice"),
            ("tokenize:\n  large_body_nice: -1\n", "large_body_nice"),
            (
                "tokenize:\n  gate_close_after_mismatches: 0\n",
                "gate_close_after_mismatches",
            ),
            (
                "tokenize:\n  admission: {max_bytes: 100, reserved_bytes: 100}\n",
                "admission",
            ),
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
