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
//!   start and periodically ([`probe`]), and on a sample of live Picks
//!   (shadow checks, run beside the Pick, which is routed on its local ids
//!   without waiting). A probe mismatch, or live mismatches from several
//!   distinct bodies within a window, close it for that model; clean probe
//!   rounds reopen it ([`gate`]).
//! - [`http`] serves vLLM-compatible `POST /tokenize` and
//!   `POST /v1/responses/render` on indexd's HTTP port, by the same rules.
//! - Every body, Pick or HTTP, is first admitted to a budget of bytes and
//!   bodies in flight ([`admission`]); over it, a Pick is answered at once
//!   UNTOKENIZED (the filter routes it without an override) and HTTP with 503
//!   and `Retry-After`. An admitted body's work stops when its caller goes
//!   away and at `tokenize.time_budget`.
//!
//! Local tokenization of a body up to [`INLINE_BODY_BYTES`] runs on the
//! worker that took the Pick, inside `block_in_place` (tokio moves the
//! worker's other tasks to another thread meanwhile, so a cold 32k-token
//! conversation's milliseconds stall no one); a larger body, or any body on a
//! current-thread runtime, on tokio's blocking pool, where the caller's going
//! away can be seen while it runs; a body over `admission.small_body_bytes`
//! on threads of its own at a lower CPU priority ([`bulk`]), so that on a
//! busy node the workers answering ordinary Picks go first.

pub mod admission;
pub mod bulk;
pub mod gate;
mod local;
pub mod probe;
pub mod replica;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use kvroute_tokenizer::{LoadOptions, Tokenizer};

/// The `tokenize:` section's types live with the rest of the configuration.
pub use crate::config::tokenize::{
    AdmissionConfig, GateRules, TokenizeConfig, TokenizerSpec, reserve_for,
};
pub use crate::error::{LoadError, LoadFailure};
use crate::metrics::{CounterVec, Histogram};
use crate::sync::lock;
pub use admission::{Admission, Cancel, Refusal, Via};
pub use gate::{Gate, GateState};
use local::body_hash;
pub use local::{Head, Limits, LocalIds, head_of, local_ids, valid_salt};

/// Bodies up to this size are tokenized on the worker that took them
/// (`block_in_place`); larger ones on the blocking pool, so that a caller
/// going away is seen while the work runs.
pub const INLINE_BODY_BYTES: usize = 256 << 10;

/// The replicas tokenization may ask for ids, as it sees them: the shared
/// state implements this over its registry, so tokenization needs nothing
/// else of it.
pub trait Replicas: Send + Sync {
    /// The addresses of the healthy replicas serving `model`.
    fn serving(&self, model: &str) -> Vec<std::net::SocketAddr>;
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
    /// `/v1/messages` (Anthropic's Messages): `system`, `messages`, `tools`,
    /// converted to chat as vLLM converts it.
    Messages,
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
    /// Whether the body carries an earlier turn of its conversation, or is
    /// a first turn; `None` if it does not tell ([`Head`]).
    pub continuation: Option<bool>,
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
    /// Over the admission budget: refused before any work.
    #[error("{0}")]
    Busy(Refusal),
    /// Over a cap of the local tokenizer (sizes checked before encoding) or
    /// its time budget: a Pick goes on unrouted rather than handing the
    /// work to a replica.
    #[error("over the tokenizer's budget: {0}")]
    OverBudget(String),
    /// The caller went away.
    #[error("cancelled: the caller went away")]
    Cancelled,
    /// indexd's own forwarding came back to it.
    #[error("forwarded by an indexd already: refusing to forward it again")]
    Loop,
}

impl TokenizeError {
    /// The metric label.
    pub const fn label(&self) -> &'static str {
        match self {
            Self::Refused { .. } => "refused",
            Self::Unavailable(_) => "unavailable",
            Self::Unsupported(_) => "unsupported",
            Self::Busy(_) => "busy",
            Self::OverBudget(_) => "over_budget",
            Self::Cancelled => "cancelled",
            Self::Loop => "loop",
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
    /// The budget of bodies in flight.
    pub admission: Arc<Admission>,
    /// The threads large bodies are tokenized on (with local tokenizers).
    bulk: Option<bulk::Bulk>,
    /// Each model's context length as its replicas give it (`/v1/models`,
    /// `/tokenize`; the longest seen).
    context_lengths: Mutex<BTreeMap<String, u32>>,
    /// Metrics.
    pub metrics: TokenizeMetrics,
}

impl Tokenizers {
    /// Loads every configured tokenizer (each gate starts pending).
    pub fn load(config: TokenizeConfig) -> Result<Self, LoadError> {
        let mut models = BTreeMap::new();
        for spec in &config.tokenizers {
            let err = |source: kvroute_tokenizer::LoadError| LoadError {
                model: spec.model.clone(),
                dir: spec.dir.display().to_string(),
                source: source.into(),
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
                    gate: Gate::new(&spec.model, config.gate.clone()),
                },
            );
        }
        // As many threads as large bodies may be in flight.
        let bulk = match config.tokenizers.first() {
            None => None,
            Some(spec) => {
                let a = &config.admission;
                let places = a.max_concurrent.saturating_sub(a.reserved_concurrent);
                Some(
                    bulk::Bulk::start(places, config.large_body_nice).map_err(|e| LoadError {
                        model: spec.model.clone(),
                        dir: spec.dir.display().to_string(),
                        source: e.into(),
                    })?,
                )
            }
        };
        Ok(Self {
            models,
            client: replica::client(),
            admission: Admission::new(config.admission.clone()),
            bulk,
            config,
            next_replica: AtomicUsize::new(0),
            chat_render: AtomicBool::new(true),
            context_lengths: Mutex::new(BTreeMap::new()),
            metrics: TokenizeMetrics::new(),
        })
    }

    /// No local tokenizers (every body goes to a replica).
    pub fn none() -> Self {
        Self {
            models: BTreeMap::new(),
            client: replica::client(),
            admission: Admission::new(TokenizeConfig::default().admission),
            bulk: None,
            config: TokenizeConfig::default(),
            next_replica: AtomicUsize::new(0),
            chat_render: AtomicBool::new(true),
            context_lengths: Mutex::new(BTreeMap::new()),
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

    /// The longest prompt `model`'s replicas admit, in tokens: the longest
    /// `max_model_len` its replicas gave (their `/v1/models`, read by the
    /// scrape, and their `/tokenize` answers), else the
    /// local tokenizer's (`max_model_len` in its spec, else config.json);
    /// `None` before either is known. vLLM refuses a longer prompt with a
    /// 400 before it allocates anything.
    pub fn max_model_len(&self, model: &str) -> Option<u32> {
        lock(&self.context_lengths)
            .get(model)
            .copied()
            .or_else(|| self.local(model).map(|l| l.tokenizer.max_model_len()))
            .filter(|l| *l > 0)
    }

    /// Every local model.
    pub fn locals(&self) -> impl Iterator<Item = (&String, &LocalModel)> {
        self.models.iter()
    }

    /// A healthy replica serving `model`, round robin: its address.
    pub fn replica_for(
        &self,
        replicas: &dyn Replicas,
        model: &str,
    ) -> Option<std::net::SocketAddr> {
        let candidates = replicas.serving(model);
        if candidates.is_empty() {
            return None;
        }
        let n = self.next_replica.fetch_add(1, Ordering::Relaxed);
        candidates.get(n % candidates.len()).copied()
    }

    /// The token ids of `body` (a request of `api` for `model`, come in by
    /// `via`): admitted to the budget first, then locally if the model's
    /// gate is open, else from a replica. A local refusal over the
    /// tokenizer's caps or time budget is not handed to a replica: the Pick
    /// goes on unrouted. Local encoding stops once `max_tokens` ids exist
    /// (a Pick keys no more than `max_pick_keys` blocks): the ids are then
    /// the prompt's first `max_tokens`.
    pub async fn tokenize(
        &self,
        replicas: &dyn Replicas,
        via: Via,
        api: Api,
        model: &str,
        body: Bytes,
        max_tokens: Option<usize>,
    ) -> Result<Tokenized, TokenizeError> {
        let result = self
            .admitted(replicas, via, api, model, body, max_tokens)
            .await;
        match result {
            Ok((ids, head, source)) => {
                self.metrics.requests.inc([source.label(), "ok"]);
                Ok(Tokenized {
                    ids,
                    salt: head.salt,
                    source,
                    continuation: head.continuation,
                })
            }
            Err((e, source)) => {
                self.metrics.requests.inc([source.label(), e.label()]);
                Err(e)
            }
        }
    }

    /// [`Tokenizers::tokenize`] without its metric: the ids, what else the
    /// body tells ([`Head`]) and who tokenized; or the error and who failed.
    async fn admitted(
        &self,
        replicas: &dyn Replicas,
        via: Via,
        api: Api,
        model: &str,
        body: Bytes,
        max_tokens: Option<usize>,
    ) -> Result<(Vec<u32>, Head, Source), (TokenizeError, Source)> {
        let open = self
            .local(model)
            .filter(|l| l.gate.state() == GateState::Open);
        let tried = if open.is_some() {
            Source::Local
        } else {
            Source::Replica
        };
        let (ticket, caller) = self
            .admission
            .try_admit(via, body.len())
            .map_err(|r| (TokenizeError::Busy(r), tried))?;
        let answer = match open {
            // The local path reads the salt (and the rest of the head) from
            // the body it parses anyway.
            Some(local) => {
                let work = Admitted { ticket, max_tokens };
                self.local_or_replica(replicas, local, api, model, body, work)
                    .await
            }
            None => match head_of(&body) {
                Ok(head) => {
                    let ids = self.timed_replica_ids(replicas, api, model, &body).await;
                    drop(ticket);
                    ids.map(|ids| (ids, head, Source::Replica))
                        .map_err(|e| (e, Source::Replica))
                }
                Err(e) => Err((e, tried)),
            },
        };
        caller.finish();
        answer
    }

    /// An open gate's path: the local ids (a Pick's shadow check runs
    /// beside it, [`Tokenizers::shadow_beside`]); a replica's ids where the
    /// local tokenizer does not reproduce the request.
    async fn local_or_replica(
        &self,
        replicas: &dyn Replicas,
        local: &LocalModel,
        api: Api,
        model: &str,
        body: Bytes,
        work: Admitted,
    ) -> Result<(Vec<u32>, Head, Source), (TokenizeError, Source)> {
        let Admitted { ticket, max_tokens } = work;
        let started = Instant::now();
        let limits = Limits {
            cancel: ticket.cancel().clone(),
            deadline: started.checked_add(self.config.time_budget),
            max_tokens,
        };
        let ids = if body.len() <= INLINE_BODY_BYTES && on_multi_thread_runtime() {
            // On this very thread: tokio hands the worker's other tasks to
            // another thread meanwhile. Handing the work to a blocking
            // thread instead costs two thread wake-ups, which on a node
            // whose CPUs the replicas keep busy took longer than a
            // continuation's tokenization.
            let ids =
                tokio::task::block_in_place(|| local_ids(&local.tokenizer, api, &body, &limits));
            drop(ticket);
            ids
        } else {
            // The share of the budget travels with the work and returns
            // when it ends, even if this future is dropped meanwhile.
            let tokenizer = local.tokenizer.clone();
            let input = body.clone();
            self.off_worker(body.len(), move || {
                let ids = local_ids(&tokenizer, api, &input, &limits);
                drop(ticket);
                ids
            })
            .await
            .and_then(|ids| ids)
        };
        self.metrics.local_latency.observe(started.elapsed());
        match ids {
            Ok(mine) => Ok((mine.ids, mine.head, Source::Local)),
            Err(TokenizeError::Unsupported(why)) => {
                tracing::debug!(model, reason = %why, "request not reproduced locally; asking a replica");
                let head = head_of(&body).map_err(|e| (e, Source::Local))?;
                self.timed_replica_ids(replicas, api, model, &body)
                    .await
                    .map(|ids| (ids, head, Source::Replica))
                    .map_err(|e| (e, Source::Replica))
            }
            Err(e) => Err((e, Source::Local)),
        }
    }

    /// Runs `work` for a body of `body_bytes` off the async workers: on the
    /// [`bulk`] threads, of lower priority, when the body is over
    /// `admission.small_body_bytes`; else on tokio's blocking pool.
    pub async fn off_worker<T: Send + 'static>(
        &self,
        body_bytes: usize,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, TokenizeError> {
        match &self.bulk {
            Some(bulk) if body_bytes > self.config.admission.small_body_bytes => {
                bulk.run(work).await
            }
            _ => tokio::task::spawn_blocking(work)
                .await
                .map_err(|e| TokenizeError::Unavailable(format!("tokenizer task: {e}"))),
        }
    }

    /// Whether a Pick of `model` answered with local ids should have its
    /// ids checked against a replica's now ([`Tokenizers::shadow_beside`]):
    /// the model's gate is open and its shadow rate allows a check.
    pub fn shadow_due(&self, model: &str) -> bool {
        self.local(model)
            .is_some_and(|l| l.gate.state() == GateState::Open && l.gate.shadow_due())
    }

    /// A Pick's shadow check, run beside the Pick rather than inside it:
    /// the Pick was routed on `ids` (the local ids of `body`; `truncated`:
    /// they stopped at the Pick's token cap) without waiting, and here a
    /// replica tokenizes `body` too, if a check is due (at most
    /// `shadow_per_second`, one at a time). The verdict is counted, and a
    /// difference is logged (sparingly) and noted toward closing the gate:
    /// one body's differences cannot close it. A check inside the Pick made
    /// the sampled request wait on vLLM's `/tokenize` (every request of a
    /// model that sees less than one a second), and one that took longer
    /// than the filter's Pick timeout left that request to least-request.
    pub async fn shadow_beside(
        &self,
        replicas: &dyn Replicas,
        api: Api,
        model: &str,
        body: &[u8],
        ids: Vec<u32>,
        truncated: bool,
    ) {
        let Some(local) = self.local(model) else {
            return;
        };
        let Some(_slot) = local.gate.take_shadow_slot() else {
            return;
        };
        let verdict = if api == Api::Messages {
            self.shadow_counted(replicas, model, body, ids.len(), truncated)
                .await
        } else {
            let mut theirs = self.timed_replica_ids(replicas, api, model, body).await;
            if truncated && let Ok(full) = &mut theirs {
                full.truncate(ids.len());
            }
            probe::compare(&Ok(ids), &theirs)
        };
        local.gate.count(true, &verdict);
        if let probe::Verdict::Mismatch(why) = verdict {
            local
                .gate
                .shadow_mismatch(body_hash(body), &why, Instant::now());
        }
    }

    /// A Messages body's shadow verdict: its length (`count` local ids)
    /// against the replica's `/v1/messages/count_tokens`, which runs vLLM's
    /// own conversion (there is no vLLM endpoint for a Messages body's ids).
    async fn shadow_counted(
        &self,
        replicas: &dyn Replicas,
        model: &str,
        body: &[u8],
        count: usize,
        truncated: bool,
    ) -> probe::Verdict {
        if truncated {
            return probe::Verdict::Inconclusive(
                "the local ids stopped at the Pick's token cap".to_owned(),
            );
        }
        let started = Instant::now();
        let counted = self.replica_count_tokens(replicas, model, body).await;
        self.metrics.replica_latency.observe(started.elapsed());
        probe::compare_count(count, &counted)
    }

    /// [`Tokenizers::replica_ids`], timed.
    async fn timed_replica_ids(
        &self,
        replicas: &dyn Replicas,
        api: Api,
        model: &str,
        body: &[u8],
    ) -> Result<Vec<u32>, TokenizeError> {
        let started = Instant::now();
        let ids = self.replica_ids(replicas, api, model, body).await;
        self.metrics.replica_latency.observe(started.elapsed());
        ids
    }

    /// The token ids a healthy replica serving `model` computes for `body`.
    pub async fn replica_ids(
        &self,
        replicas: &dyn Replicas,
        api: Api,
        model: &str,
        body: &[u8],
    ) -> Result<Vec<u32>, TokenizeError> {
        let Some(address) = self.replica_for(replicas, model) else {
            return Err(TokenizeError::Unavailable(format!(
                "no healthy replica serves {model:?}"
            )));
        };
        let replied = replica::token_ids(
            &self.client,
            address,
            api,
            model,
            body,
            self.config.replica_timeout,
            &self.chat_render,
        )
        .await?;
        if let Some(len) = replied.max_model_len {
            self.learn_max_model_len(model, len);
        }
        Ok(replied.ids)
    }

    /// A replica serving `model` gave its `max_model_len`: the longest seen
    /// is kept ([`Tokenizers::max_model_len`]). Bounded: the models are the
    /// replicas' own (a bounded list each).
    pub(crate) fn learn_max_model_len(&self, model: &str, len: u32) {
        let mut known = lock(&self.context_lengths);
        if let Some(at) = known.get_mut(model) {
            *at = (*at).max(len);
        } else {
            known.insert(model.to_owned(), len);
        }
    }

    /// The prompt length a healthy replica's `/v1/messages/count_tokens`
    /// gives a Messages body: vLLM's own conversion, counted.
    pub async fn replica_count_tokens(
        &self,
        replicas: &dyn Replicas,
        model: &str,
        body: &[u8],
    ) -> Result<usize, TokenizeError> {
        let Some(address) = self.replica_for(replicas, model) else {
            return Err(TokenizeError::Unavailable(format!(
                "no healthy replica serves {model:?}"
            )));
        };
        replica::count_tokens(&self.client, address, body, self.config.replica_timeout).await
    }

    /// Whether replicas are still taken to serve the render endpoints (a
    /// 404 from one clears it: chat bodies then go to `/tokenize`, and
    /// bodies with `truncate_prompt_tokens` are not tokenized).
    pub fn replicas_render(&self) -> bool {
        self.chat_render.load(Ordering::Relaxed)
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
        self.admission.render(out);
        gate::render_metrics(self, out);
    }
}

/// A body admitted to local tokenization: its share of the budget, and
/// where its encoding may stop.
#[derive(Debug)]
struct Admitted {
    ticket: admission::Ticket,
    max_tokens: Option<usize>,
}

#[cfg(test)]
#[path = "tokenize_tests.rs"]
mod tests;
