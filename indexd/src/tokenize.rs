//! Tokenization in indexd: request bodies → the exact token ids vLLM will
//! compute, so that the filter needs one call (a Pick carrying its body)
//! instead of a tokenizer call on a serving replica and then a Pick.
//!
//! - A model given a local tokenizer directory (`tokenizers:` in the config,
//!   `--tokenizer NAME=DIR`) is tokenized in process by
//!   [`kvroute_tokenizer`], whose segment cache makes a continuation cost
//!   what is new in it — once its exactness [`gate`] is open.
//! - Any other model, or one whose gate is pending or closed, is tokenized by
//!   a healthy replica serving it ([`replica`]): vLLM's own `/tokenize` or
//!   `/v1/responses/render`, as before, one hop further.
//! - The gate compares the local tokenizer with a replica's on a probe set at
//!   start and periodically, and on a sample of live requests (shadow
//!   checks). Any difference closes it for that model: requests then go to
//!   the replicas, a metric and a log line say where the ids first differ.
//! - [`http`] serves vLLM-compatible `POST /tokenize` and
//!   `POST /v1/responses/render` on indexd's HTTP port, by the same rules.
//!
//! Local tokenization runs on the worker that took the Pick, inside
//! `block_in_place` (tokio moves the worker's other tasks to another thread
//! meanwhile, so a cold 32k-token conversation's milliseconds stall no one);
//! on a current-thread runtime, on tokio's blocking pool.

pub mod config;
pub mod gate;
pub mod http;
pub mod replica;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvroute_tokenizer::{LoadOptions, ResponsesRequest, TokenizeRequest, Tokenizer};

use crate::metrics::{CounterVec, Histogram};
use crate::state::{Replica, Shared, read};
pub use gate::{Gate, GateState};

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
    /// How often the probe set is checked again.
    pub gate_interval: Duration,
    /// Live requests checked against a replica, at most this many a second
    /// per model (0: no shadow checks).
    pub shadow_per_second: f64,
    /// Largest request body accepted.
    pub max_body_bytes: usize,
}

impl Default for TokenizeConfig {
    fn default() -> Self {
        Self {
            tokenizers: Vec::new(),
            cache_bytes: 64 << 20,
            replica_timeout: Duration::from_secs(2),
            gate_interval: Duration::from_secs(600),
            shadow_per_second: 1.0,
            max_body_bytes: 16 << 20,
        }
    }
}

/// The OpenAI-compatible API a body speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// `/v1/completions`: `prompt`.
    Completions,
    /// `/v1/chat/completions`: `messages`.
    Chat,
    /// `/v1/responses`: `input`, `instructions`.
    Responses,
}

/// Where a request's ids came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// indexd's own tokenizer.
    Local,
    /// A replica's tokenizer endpoint.
    Replica,
}

impl Source {
    /// The metric label.
    pub const fn label(self) -> &'static str {
        match self {
            Self::Local => "local",
            Self::Replica => "replica",
        }
    }
}

/// A tokenized request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tokenized {
    /// The prompt's token ids.
    pub ids: Vec<u32>,
    /// The request's `cache_salt`.
    pub salt: Option<String>,
    /// Who tokenized it.
    pub source: Source,
}

/// Why a body was not tokenized.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TokenizeError {
    /// vLLM would refuse the request (its 4xx), with vLLM's status.
    #[error("refused ({status}): {message}")]
    Refused {
        /// The HTTP status vLLM answers.
        status: u16,
        /// Its message.
        message: String,
    },
    /// No tokenizer could answer: no local one, no healthy replica, or the
    /// replica failed.
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// The local tokenizer does not reproduce a feature of this request
    /// (vLLM would take it): a replica must tokenize it.
    #[error("not reproduced locally: {0}")]
    Unsupported(String),
}

impl TokenizeError {
    /// The metric label.
    pub const fn label(&self) -> &'static str {
        match self {
            Self::Refused { .. } => "refused",
            Self::Unavailable(_) => "unavailable",
            Self::Unsupported(_) => "unsupported",
        }
    }
}

/// One model with a local tokenizer.
#[derive(Debug)]
pub struct LocalModel {
    /// The tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// Its exactness gate.
    pub gate: Gate,
}

/// Tokenization metrics (model labels are dynamic: per-model series are
/// rendered from the registry, see [`Tokenizers::render_metrics`]).
#[derive(Debug)]
pub struct TokenizeMetrics {
    /// Tokenizations by source and result.
    pub requests: CounterVec<2>,
    /// Local tokenization time.
    pub local_latency: Histogram,
    /// Replica tokenization time (the call included).
    pub replica_latency: Histogram,
}

impl TokenizeMetrics {
    const fn new() -> Self {
        Self {
            requests: CounterVec::new(
                "indexd_tokenize_total",
                "Request bodies tokenized, by source (local, replica) and result.",
                ["source", "result"],
            ),
            local_latency: Histogram::new(
                "indexd_tokenize_local_seconds",
                "Time to tokenize a body with indexd's own tokenizer.",
            ),
            replica_latency: Histogram::new(
                "indexd_tokenize_replica_seconds",
                "Time to tokenize a body with a replica's tokenizer endpoint, the call included.",
            ),
        }
    }
}

/// Whether this task runs on a multi-thread tokio runtime, where
/// `block_in_place` may run blocking work on the worker itself (it panics
/// elsewhere: a current-thread runtime, as in tests, or none).
fn on_multi_thread_runtime() -> bool {
    tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
}

/// Every local tokenizer, the replica client, and their metrics.
#[derive(Debug)]
pub struct Tokenizers {
    models: BTreeMap<String, LocalModel>,
    config: TokenizeConfig,
    client: reqwest::Client,
    next_replica: AtomicUsize,
    /// Whether replicas serve `/v1/chat/completions/render` (cleared by the
    /// first 404: then chat bodies go to `/tokenize`).
    chat_render: AtomicBool,
    /// Metrics.
    pub metrics: TokenizeMetrics,
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
    pub source: kvroute_tokenizer::LoadError,
}

impl Tokenizers {
    /// Loads every configured tokenizer (each gate starts pending).
    pub fn load(config: TokenizeConfig) -> Result<Self, LoadError> {
        let mut models = BTreeMap::new();
        for spec in &config.tokenizers {
            let err = |source| LoadError {
                model: spec.model.clone(),
                dir: spec.dir.display().to_string(),
                source,
            };
            let chat_template = match &spec.chat_template {
                None => None,
                Some(path) => Some(std::fs::read_to_string(path).map_err(|e| {
                    err(kvroute_tokenizer::LoadError::Io {
                        path: path.clone(),
                        source: e,
                    })
                })?),
            };
            let opts = LoadOptions {
                max_model_len: spec.max_model_len,
                cache_bytes: config.cache_bytes,
                chat_template,
                trust_request_chat_template: spec.trust_request_chat_template,
                ..LoadOptions::default()
            };
            let tokenizer = Tokenizer::load(&spec.dir, &spec.model, opts).map_err(err)?;
            tracing::info!(model = %spec.model, dir = %spec.dir.display(), max_model_len = tokenizer.max_model_len(), "local tokenizer loaded; its exactness gate opens once a replica agrees");
            models.insert(
                spec.model.clone(),
                LocalModel {
                    tokenizer: Arc::new(tokenizer),
                    gate: Gate::new(config.shadow_per_second),
                },
            );
        }
        Ok(Self {
            models,
            client: replica::client(),
            config,
            next_replica: AtomicUsize::new(0),
            chat_render: AtomicBool::new(true),
            metrics: TokenizeMetrics::new(),
        })
    }

    /// No local tokenizers (every body goes to a replica).
    pub fn none() -> Self {
        Self {
            models: BTreeMap::new(),
            client: replica::client(),
            config: TokenizeConfig::default(),
            next_replica: AtomicUsize::new(0),
            chat_render: AtomicBool::new(true),
            metrics: TokenizeMetrics::new(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &TokenizeConfig {
        &self.config
    }

    /// The local model named `model`, if any.
    pub fn local(&self, model: &str) -> Option<&LocalModel> {
        self.models.get(model)
    }

    /// Every local model.
    pub fn locals(&self) -> impl Iterator<Item = (&String, &LocalModel)> {
        self.models.iter()
    }

    /// A healthy replica serving `model`, round robin.
    pub fn replica_for(&self, shared: &Shared, model: &str) -> Option<Arc<Replica>> {
        let candidates: Vec<Arc<Replica>> = read(&shared.registry)
            .all()
            .into_iter()
            .filter(|r| r.serves(model) && r.is_healthy())
            .collect();
        if candidates.is_empty() {
            return None;
        }
        let n = self.next_replica.fetch_add(1, Ordering::Relaxed);
        candidates.get(n % candidates.len()).cloned()
    }

    /// The token ids of `body` (a request of `api` for `model`): locally if
    /// the model's gate is open, else from a replica.
    pub async fn tokenize(
        &self,
        shared: &Arc<Shared>,
        api: Api,
        model: &str,
        body: Bytes,
    ) -> Result<Tokenized, TokenizeError> {
        let salt = salt_of(&body)?;
        let result = match self.local(model) {
            Some(local) if local.gate.state() == GateState::Open => {
                let started = Instant::now();
                let ids = if on_multi_thread_runtime() {
                    // On this very thread: tokio hands the worker's other
                    // tasks to another thread meanwhile. Handing the work to
                    // a blocking thread instead costs two thread wake-ups,
                    // which on a node whose CPUs the replicas keep busy
                    // took longer than a continuation's tokenization.
                    tokio::task::block_in_place(|| local_ids(&local.tokenizer, api, &body))
                } else {
                    let tokenizer = local.tokenizer.clone();
                    let input = body.clone();
                    tokio::task::spawn_blocking(move || local_ids(&tokenizer, api, &input))
                        .await
                        .map_err(|e| TokenizeError::Unavailable(format!("tokenizer task: {e}")))?
                };
                self.metrics.local_latency.observe(started.elapsed());
                if let Ok(ids) = &ids
                    && local.gate.take_shadow_slot()
                {
                    gate::spawn_shadow_check(
                        shared.clone(),
                        model.to_owned(),
                        api,
                        body.clone(),
                        ids.clone(),
                    );
                }
                match ids {
                    Err(TokenizeError::Unsupported(why)) => {
                        tracing::debug!(model, reason = %why, "request not reproduced locally; asking a replica");
                        let started = Instant::now();
                        let ids = self.replica_ids(shared, api, model, &body).await;
                        self.metrics.replica_latency.observe(started.elapsed());
                        ids.map(|ids| (ids, Source::Replica))
                    }
                    other => other.map(|ids| (ids, Source::Local)),
                }
            }
            _ => {
                let started = Instant::now();
                let ids = self.replica_ids(shared, api, model, &body).await;
                self.metrics.replica_latency.observe(started.elapsed());
                ids.map(|ids| (ids, Source::Replica))
            }
        };
        match result {
            Ok((ids, source)) => {
                self.metrics.requests.inc([source.label(), "ok"]);
                Ok(Tokenized { ids, salt, source })
            }
            Err(e) => {
                let source = match self.local(model) {
                    Some(l) if l.gate.state() == GateState::Open => Source::Local,
                    _ => Source::Replica,
                };
                self.metrics.requests.inc([source.label(), e.label()]);
                Err(e)
            }
        }
    }

    /// The token ids a healthy replica serving `model` computes for `body`.
    pub async fn replica_ids(
        &self,
        shared: &Shared,
        api: Api,
        model: &str,
        body: &[u8],
    ) -> Result<Vec<u32>, TokenizeError> {
        let Some(replica) = self.replica_for(shared, model) else {
            return Err(TokenizeError::Unavailable(format!(
                "no healthy replica serves {model:?}"
            )));
        };
        replica::token_ids(
            &self.client,
            replica.id().address,
            api,
            model,
            body,
            self.config.replica_timeout,
            &self.chat_render,
        )
        .await
    }

    /// The client replicas are called with.
    pub fn client(&self) -> &reqwest::Client {
        &self.client
    }

    /// Per-model series: cache counters, the gate, mismatches.
    pub fn render_metrics(&self, out: &mut String) {
        self.metrics.requests.render(out);
        self.metrics.local_latency.render(out);
        self.metrics.replica_latency.render(out);
        gate::render_metrics(self, out);
    }
}

/// The ids `tokenizer` computes for a body of `api`.
pub fn local_ids(tokenizer: &Tokenizer, api: Api, body: &[u8]) -> Result<Vec<u32>, TokenizeError> {
    let refused = |e: kvroute_tokenizer::RequestError| {
        if e.is_client_error() {
            TokenizeError::Refused {
                status: 400,
                message: e.to_string(),
            }
        } else {
            TokenizeError::Unsupported(e.to_string())
        }
    };
    match api {
        Api::Completions => {
            let req = TokenizeRequest::from_json(body).map_err(refused)?;
            tokenizer.tokenize(&req).map(|r| r.tokens).map_err(refused)
        }
        // What the chat completion itself renders (`/tokenize` ignores the
        // few fields only chat completions hand the template).
        Api::Chat => {
            let req = TokenizeRequest::from_json(body).map_err(refused)?;
            tokenizer.chat_completion_tokens(&req).map_err(refused)
        }
        Api::Responses => {
            let req = ResponsesRequest::from_json(body).map_err(refused)?;
            tokenizer
                .render_responses(&req)
                .map(|r| r.token_ids)
                .map_err(refused)
        }
    }
}

/// The body's `cache_salt` (vLLM's rules: a non-empty string of at most 128
/// characters without `@ / \ NUL`).
pub fn salt_of(body: &[u8]) -> Result<Option<String>, TokenizeError> {
    #[derive(serde::Deserialize)]
    struct Salt {
        cache_salt: Option<String>,
    }
    let refused = |message: &str| TokenizeError::Refused {
        status: 400,
        message: message.to_owned(),
    };
    let salt: Salt = serde_json::from_slice(body).map_err(|e| TokenizeError::Refused {
        status: 400,
        message: format!("invalid JSON body: {e}"),
    })?;
    match salt.cache_salt {
        None => Ok(None),
        Some(s)
            if !s.is_empty() && s.chars().count() <= 128 && !s.contains(['@', '/', '\\', '\0']) =>
        {
            Ok(Some(s))
        }
        Some(_) => Err(refused("`cache_salt` is not a valid salt")),
    }
}

#[cfg(test)]
#[path = "tokenize_tests.rs"]
mod tests;
