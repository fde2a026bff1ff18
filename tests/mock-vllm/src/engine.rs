//! The server behind one HTTP address: its data-parallel engines ([`crate::rank::Engine`], one
//! per rank), the request-to-rank assignment, and what vLLM's API server keeps outside the
//! engines (model names, limits, the Responses store).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use axum::http::HeaderMap;

use crate::cache::BlockScope;
use crate::config::Config;
use crate::error::ApiError;
use crate::publisher::Publisher;
use crate::rank::{Engine, RequestGuard};
use crate::template::Message;
use crate::tokenizer::Tokenizer;

/// vLLM's request header pinning a request to a data-parallel rank (a local engine index).
pub const DP_RANK_HEADER: &str = "x-data-parallel-rank";

/// A model name a request resolved to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelRef {
    pub name: String,
    /// LoRA adapter name and its 1-based id.
    pub lora: Option<(String, u32)>,
}

/// The tokens and cache scope of one request.
#[derive(Debug, Clone)]
pub struct Job {
    pub model: ModelRef,
    pub prompt: Vec<u32>,
    pub cache_salt: Option<String>,
}

impl Job {
    pub(crate) fn scope(&self) -> BlockScope<'_> {
        BlockScope {
            cache_salt: self.cache_salt.as_deref(),
            lora_name: self.model.lora.as_ref().map(|(n, _)| n.as_str()),
        }
    }

    /// The LoRA adapter `(name, id)` the job runs under.
    pub(crate) fn lora(&self) -> Option<(&str, u32)> {
        self.model
            .lora
            .as_ref()
            .map(|(name, id)| (name.as_str(), *id))
    }

    /// [`crate::api::prompt_digest`] of this job's salt and prompt.
    pub(crate) fn digest(&self) -> String {
        crate::api::prompt_digest(self.cache_salt.as_deref(), &self.prompt)
    }
}

/// A stored Responses-API response (for `previous_response_id`).
#[derive(Debug, Clone)]
pub struct StoredResponse {
    /// The conversation including the response's own output, instructions excluded.
    pub messages: Vec<Message>,
    pub body: serde_json::Value,
}

/// One vLLM server: the API-server state plus its engines.
#[derive(Debug)]
pub struct Replica {
    pub config: Arc<Config>,
    /// Shown in the `x-mock-vllm-replica` header.
    pub name: String,
    pub tokenizer: Tokenizer,
    /// Never empty; index `i` runs data-parallel rank `config.first_rank() + i`.
    engines: Vec<Arc<Engine>>,
    /// Makes "pick the least loaded engine, then count the request on it" atomic.
    assigning: Mutex<()>,
    /// The API server's response store, shared by all ranks (as vLLM's).
    responses: Mutex<HashMap<String, StoredResponse>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Replica {
    /// One engine per rank of `config.data_parallel_size` (at least one), taking the publishers
    /// in rank order (missing ones: events off).
    pub fn new(config: Config, name: String, publishers: Vec<Option<Publisher>>) -> Self {
        let config = Arc::new(config);
        let first = config.first_rank();
        let mut publishers = publishers.into_iter();
        let engines = (0..config.data_parallel_size.max(1))
            .map(|i| {
                Arc::new(Engine::new(
                    first.saturating_add(i),
                    config.clone(),
                    publishers.next().flatten(),
                ))
            })
            .collect();
        Self {
            config,
            name,
            tokenizer: Tokenizer,
            engines,
            assigning: Mutex::new(()),
            responses: Mutex::new(HashMap::new()),
        }
    }

    /// The engines in rank order (never empty).
    pub fn engines(&self) -> &[Arc<Engine>] {
        &self.engines
    }

    /// The first engine (rank 0 unless a single-rank server was given another rank).
    pub fn first_engine(&self) -> Result<&Arc<Engine>, ApiError> {
        self.engines
            .first()
            .ok_or_else(|| ApiError::internal("the server has no engine"))
    }

    /// The engine running data-parallel `rank` (admin API and the in-process handle).
    pub fn engine_by_rank(&self, rank: u32) -> Result<&Arc<Engine>, ApiError> {
        self.engines.iter().find(|e| e.rank == rank).ok_or_else(|| {
            let ranks: Vec<String> = self.engines.iter().map(|e| e.rank.to_string()).collect();
            ApiError::bad_request(format!(
                "data_parallel_rank {rank} is not served here; ranks: [{}].",
                ranks.join(", ")
            ))
            .with_param("rank")
        })
    }

    /// The `x-data-parallel-rank` header as an engine index: `None` without the header; 400 for
    /// a value that is not an integer or is outside `[0, engines)` (vLLM's message).
    pub fn rank_pin(&self, headers: &HeaderMap) -> Result<Option<usize>, ApiError> {
        let Some(value) = headers.get(DP_RANK_HEADER) else {
            return Ok(None);
        };
        let n = self.engines.len();
        let text = value.to_str().unwrap_or("<non-ASCII>").trim();
        let rank: i64 = text.parse().map_err(|_| {
            ApiError::bad_request(format!(
                "Invalid {DP_RANK_HEADER} header `{text}`: expected an integer data-parallel rank in [0, {n})."
            ))
        })?;
        usize::try_from(rank)
            .ok()
            .filter(|r| *r < n)
            .map(Some)
            .ok_or_else(|| {
                ApiError::bad_request(format!(
                    "data_parallel_rank {rank} is out of range [0, {n})."
                ))
            })
    }

    /// Assigns a request: to the pinned engine index, else to the engine with the fewest
    /// requests in flight (ties to the lowest rank). The guard counts it until dropped.
    pub fn assign(&self, pin: Option<usize>) -> Result<RequestGuard, ApiError> {
        let _picking = lock(&self.assigning);
        let engine = match pin {
            Some(i) => self.engines.get(i).ok_or_else(|| {
                ApiError::bad_request(format!(
                    "data_parallel_rank {i} is out of range [0, {}).",
                    self.engines.len()
                ))
            })?,
            None => self
                .engines
                .iter()
                .min_by_key(|e| (e.in_flight(), e.rank))
                .ok_or_else(|| ApiError::internal("the server has no engine"))?,
        };
        Ok(engine.enter())
    }

    /// Resolves a request's `model` (absent: the first served name); 404 as vLLM otherwise.
    pub fn resolve_model(&self, model: Option<&str>) -> Result<ModelRef, ApiError> {
        let Some(model) = model else {
            return Ok(ModelRef {
                name: self
                    .config
                    .served_model_names
                    .first()
                    .cloned()
                    .unwrap_or_default(),
                lora: None,
            });
        };
        if self.config.served_model_names.iter().any(|m| m == model) {
            return Ok(ModelRef {
                name: model.to_owned(),
                lora: None,
            });
        }
        if let Some(i) = self.config.lora_modules.iter().position(|m| m == model) {
            return Ok(ModelRef {
                name: model.to_owned(),
                lora: Some((model.to_owned(), u32::try_from(i + 1).unwrap_or(u32::MAX))),
            });
        }
        Err(ApiError::not_found(format!("The model `{model}` does not exist.")).with_param("model"))
    }

    /// Checks the prompt against `max_model_len` and settles the output length:
    /// `(tokens, finish_reason)`.
    pub fn plan_output(
        &self,
        prompt_len: usize,
        max_tokens: Option<u64>,
    ) -> Result<(usize, &'static str), ApiError> {
        let limit = self.config.max_model_len as usize;
        let requested = max_tokens.map(|m| usize::try_from(m).unwrap_or(usize::MAX));
        let total = prompt_len.saturating_add(requested.unwrap_or(0));
        if prompt_len >= limit || total > limit {
            return Err(ApiError::bad_request(format!(
                "This model's maximum context length is {limit} tokens. However, you requested {total} tokens ({prompt_len} in the messages, {} in the completion). Please reduce the length of the messages or completion.",
                requested.unwrap_or(0)
            )));
        }
        Ok(match requested {
            Some(0) => {
                return Err(ApiError::bad_request(
                    "max_tokens must be at least 1, got 0.",
                ));
            }
            Some(n) => (n, "length"),
            None => (
                (self.config.default_max_tokens as usize).min(limit - prompt_len),
                "stop",
            ),
        })
    }

    /// Empties every engine's prefix cache (vLLM's `/reset_prefix_cache` resets all ranks).
    pub fn reset_prefix_cache(&self) {
        for e in &self.engines {
            e.reset_prefix_cache();
        }
    }

    /// Simulates a process restart: every engine restarts, stored responses are forgotten.
    pub fn restart(&self) {
        for e in &self.engines {
            e.restart();
        }
        lock(&self.responses).clear();
    }

    pub fn store_response(&self, id: String, response: StoredResponse) {
        lock(&self.responses).insert(id, response);
    }

    pub fn response(&self, id: &str) -> Option<StoredResponse> {
        lock(&self.responses).get(id).cloned()
    }

    pub fn stored_responses(&self) -> usize {
        lock(&self.responses).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn replica(size: u32) -> Replica {
        let config = Config {
            block_size: 4,
            num_gpu_blocks: 64,
            max_model_len: 16,
            lora_modules: vec!["sql".to_owned()],
            data_parallel_size: size,
            latency: crate::latency::LatencyConfig {
                time_scale: 0.0,
                ..Default::default()
            },
            ..Config::default()
        };
        Replica::new(config, "r".to_owned(), Vec::new())
    }

    #[test]
    fn models_resolve_and_limits_apply() {
        let r = replica(1);
        assert_eq!(
            r.resolve_model(Some("sql")).unwrap().lora,
            Some(("sql".to_owned(), 1))
        );
        assert_eq!(
            r.resolve_model(Some("nope")).unwrap_err().status.as_u16(),
            404
        );
        assert_eq!(r.plan_output(4, None).unwrap(), (12, "stop"));
        assert_eq!(r.plan_output(4, Some(3)).unwrap(), (3, "length"));
        assert!(r.plan_output(4, Some(13)).is_err());
        assert!(r.plan_output(16, None).is_err());
    }

    #[test]
    fn restart_forgets() {
        let r = replica(1);
        r.store_response(
            "resp_1".to_owned(),
            StoredResponse {
                messages: vec![],
                body: serde_json::json!({}),
            },
        );
        r.restart();
        assert!(r.response("resp_1").is_none());
    }

    #[test]
    fn unpinned_requests_go_to_the_least_loaded_rank() {
        let r = replica(3);
        let ranks: Vec<u32> = r.engines().iter().map(|e| e.rank).collect();
        assert_eq!(ranks, [0, 1, 2]);
        let a = r.assign(None).unwrap();
        let b = r.assign(None).unwrap();
        let c = r.assign(Some(0)).unwrap();
        assert_eq!(
            [a.engine().rank, b.engine().rank, c.engine().rank],
            [0, 1, 0]
        );
        // Loads 2, 1, 0 → rank 2; then 2, 1, 1 → rank 1 (lowest of the tie).
        let d = r.assign(None).unwrap();
        assert_eq!(d.engine().rank, 2);
        assert_eq!(r.assign(None).unwrap().engine().rank, 1);
        drop((a, c));
        assert_eq!(r.engines()[0].in_flight(), 0);
        assert_eq!(r.assign(None).unwrap().engine().rank, 0);
    }

    #[test]
    fn rank_header_is_validated_like_vllm() {
        let r = replica(2);
        let pin = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(DP_RANK_HEADER, HeaderValue::from_str(v).unwrap());
            r.rank_pin(&h)
        };
        assert_eq!(r.rank_pin(&HeaderMap::new()).unwrap(), None);
        assert_eq!(pin("1").unwrap(), Some(1));
        assert_eq!(
            pin("2").unwrap_err().message,
            "data_parallel_rank 2 is out of range [0, 2)."
        );
        assert_eq!(
            pin("-1").unwrap_err().message,
            "data_parallel_rank -1 is out of range [0, 2)."
        );
        let e = pin("one").unwrap_err();
        assert_eq!(e.status.as_u16(), 400);
        assert!(e.message.contains("x-data-parallel-rank"), "{}", e.message);
        assert!(r.engine_by_rank(1).is_ok());
        assert!(r.engine_by_rank(2).is_err());
    }
}
