//! The simulated engine: prefix cache, prefill queue, KV events, response store and metrics of
//! one replica, and the life of one request through them.
//!
//! A request is prefilled in its turn of the [`PrefillQueue`]: the cache hit is taken when the turn
//! starts, the prefill time slept, then the prompt's full blocks are stored and one event batch
//! (`BlockRemoved`… tail first, then `BlockStored`) is published. After decoding,
//! [`Replica::finish`] stores the blocks filled by decoded tokens as a second batch.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use crate::cache::{BlockScope, PrefixCache};
use crate::config::Config;
use crate::error::ApiError;
use crate::events::KvEvent;
use crate::latency::{PrefillQueue, pause};
use crate::publisher::Publisher;
use crate::template::Message;
use crate::tokenizer::Tokenizer;

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
    fn scope(&self) -> BlockScope<'_> {
        BlockScope {
            cache_salt: self.cache_salt.as_deref(),
            lora_name: self.model.lora.as_ref().map(|(n, _)| n.as_str()),
        }
    }
}

/// A stored Responses-API response (for `previous_response_id`).
#[derive(Debug, Clone)]
pub struct StoredResponse {
    /// The conversation including the response's own output, instructions excluded.
    pub messages: Vec<Message>,
    pub body: serde_json::Value,
}

/// Counters behind `/metrics`.
#[derive(Debug, Default)]
pub struct Metrics {
    pub waiting: AtomicUsize,
    pub running: AtomicUsize,
    pub running_blocks: AtomicUsize,
    pub prefix_queries: AtomicU64,
    pub prefix_hits: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub finished_stop: AtomicU64,
    pub finished_length: AtomicU64,
}

#[derive(Debug)]
struct State {
    cache: PrefixCache,
    responses: HashMap<String, StoredResponse>,
    generation: u64,
}

/// One replica's engine state.
#[derive(Debug)]
pub struct Replica {
    pub config: Config,
    /// Shown in the `x-mock-vllm-replica` header.
    pub name: String,
    pub tokenizer: Tokenizer,
    pub publisher: Option<Publisher>,
    pub metrics: Metrics,
    queue: PrefillQueue,
    state: Mutex<State>,
}

/// Outcome of a prefill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefilled {
    pub cached_tokens: usize,
    /// The engine incarnation the request ran in (a restart bumps it).
    pub generation: u64,
}

/// Counts a request as waiting, then running, until dropped.
#[derive(Debug)]
pub struct RequestGuard<'a> {
    metrics: &'a Metrics,
    running: bool,
    blocks: usize,
}

impl RequestGuard<'_> {
    fn admit(&mut self, blocks: usize) {
        if !self.running {
            self.metrics.waiting.fetch_sub(1, Ordering::Relaxed);
            self.metrics.running.fetch_add(1, Ordering::Relaxed);
            self.metrics
                .running_blocks
                .fetch_add(blocks, Ordering::Relaxed);
            self.running = true;
            self.blocks = blocks;
        }
    }
}

impl Drop for RequestGuard<'_> {
    fn drop(&mut self) {
        if self.running {
            self.metrics.running.fetch_sub(1, Ordering::Relaxed);
            self.metrics
                .running_blocks
                .fetch_sub(self.blocks, Ordering::Relaxed);
        } else {
            self.metrics.waiting.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

fn fresh_seed(config: &Config) -> String {
    config
        .hash_seed
        .clone()
        .unwrap_or_else(|| format!("{:032x}", rand::random::<u128>()))
}

impl Replica {
    pub fn new(config: Config, name: String, publisher: Option<Publisher>) -> Self {
        let cache = PrefixCache::new(
            config.block_size as usize,
            config.num_gpu_blocks,
            &fresh_seed(&config),
        );
        Self {
            name,
            tokenizer: Tokenizer,
            publisher,
            metrics: Metrics::default(),
            queue: PrefillQueue::default(),
            state: Mutex::new(State {
                cache,
                responses: HashMap::new(),
                generation: 0,
            }),
            config,
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
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

    /// A guard counting the request as waiting.
    pub fn enter(&self) -> RequestGuard<'_> {
        self.metrics.waiting.fetch_add(1, Ordering::Relaxed);
        RequestGuard {
            metrics: &self.metrics,
            running: false,
            blocks: 0,
        }
    }

    /// Waits for the prefill turn, takes the cache hit, sleeps the prefill time, stores the
    /// prompt's blocks and publishes the batch.
    pub async fn prefill(&self, job: &Job, guard: &mut RequestGuard<'_>) -> Prefilled {
        let turn = self.queue.turn().await;
        let block_size = self.config.block_size as usize;
        guard.admit(job.prompt.len().div_ceil(block_size));
        let (cached_tokens, generation, blocks) = {
            let st = self.state();
            let blocks = st.cache.blocks(&job.prompt, job.scope());
            let cached = if self.config.enable_prefix_caching {
                st.cache
                    .hit_tokens(job.prompt.len(), st.cache.cached_run(&blocks))
            } else {
                0
            };
            (cached, st.generation, blocks)
        };
        let m = &self.metrics;
        m.prefix_queries
            .fetch_add(job.prompt.len() as u64, Ordering::Relaxed);
        m.prefix_hits
            .fetch_add(cached_tokens as u64, Ordering::Relaxed);
        m.prompt_tokens
            .fetch_add(job.prompt.len() as u64, Ordering::Relaxed);
        let latency = &self.config.latency;
        pause(latency.scaled(latency.prefill_ms(job.prompt.len(), cached_tokens))).await;
        self.store(job, &job.prompt, &blocks, generation);
        drop(turn);
        Prefilled {
            cached_tokens,
            generation,
        }
    }

    /// Time to sleep between two decoded tokens.
    pub fn decode_step(&self) -> Duration {
        let l = &self.config.latency;
        l.scaled(l.decode_ms_per_token)
    }

    /// Sleeps the whole decode of `n` tokens (non-streaming responses).
    pub async fn decode_all(&self, n: usize) {
        let l = &self.config.latency;
        pause(l.scaled(l.decode_ms(n))).await;
    }

    /// Stores blocks filled by decoded tokens (the last sampled token is never in the cache) and
    /// counts the request finished.
    pub fn finish(&self, job: &Job, pre: Prefilled, output: &[u32], finish_reason: &str) {
        let m = &self.metrics;
        m.generation_tokens
            .fetch_add(output.len() as u64, Ordering::Relaxed);
        match finish_reason {
            "length" => m.finished_length.fetch_add(1, Ordering::Relaxed),
            _ => m.finished_stop.fetch_add(1, Ordering::Relaxed),
        };
        let mut all = job.prompt.clone();
        all.extend_from_slice(&output[..output.len().saturating_sub(1)]);
        let block_size = self.config.block_size as usize;
        if all.len() / block_size <= job.prompt.len() / block_size {
            return;
        }
        let blocks = self.state().cache.blocks(&all, job.scope());
        self.store(job, &all, &blocks, pre.generation);
    }

    fn store(&self, job: &Job, tokens: &[u32], blocks: &[crate::cache::Block], generation: u64) {
        if !self.config.enable_prefix_caching || blocks.is_empty() {
            return;
        }
        let mut st = self.state();
        if st.generation != generation {
            return; // the replica "restarted" meanwhile
        }
        let outcome = st.cache.store(blocks);
        let stored = blocks.len().min(st.cache.capacity());
        let Some(publisher) = &self.publisher else {
            return;
        };
        let mut events: Vec<KvEvent> = outcome
            .evicted
            .iter()
            .map(|h| KvEvent::BlockRemoved {
                block_hashes: vec![*h],
            })
            .collect();
        if outcome.first_new < stored {
            let new = blocks.get(outcome.first_new..stored).unwrap_or_default();
            let block_size = self.config.block_size as usize;
            let token_ids = tokens
                .get(outcome.first_new * block_size..stored * block_size)
                .unwrap_or_default()
                .to_vec();
            events.push(KvEvent::BlockStored {
                block_hashes: new.iter().map(|b| b.hash).collect(),
                parent_block_hash: outcome
                    .first_new
                    .checked_sub(1)
                    .and_then(|i| blocks.get(i))
                    .map(|b| b.hash),
                token_ids,
                block_size: self.config.block_size,
                lora_id: job.model.lora.as_ref().map(|(_, id)| *id),
                lora_name: job.model.lora.as_ref().map(|(n, _)| n.clone()),
                extra_keys: new.iter().map(|b| b.extra_keys.clone()).collect(),
            });
        }
        // Published under the state lock so batches follow the cache's order of changes.
        publisher.publish(events);
    }

    /// Prefix tokens this replica holds now for `job` (whole cached blocks, not capped).
    pub fn probe(&self, job: &Job) -> (usize, usize) {
        let st = self.state();
        let blocks = st.cache.blocks(&job.prompt, job.scope());
        let run = st.cache.cached_run(&blocks);
        (
            run * st.cache.block_size(),
            st.cache.hit_tokens(job.prompt.len(), run),
        )
    }

    /// Blocks cached now.
    pub fn cached_blocks(&self) -> usize {
        self.state().cache.len()
    }

    /// Empties the prefix cache and announces `AllBlocksCleared`.
    pub fn reset_prefix_cache(&self) {
        let mut st = self.state();
        st.cache.clear();
        if let Some(p) = &self.publisher {
            p.publish(vec![KvEvent::AllBlocksCleared]);
        }
    }

    /// Simulates a process restart: empty cache (new hash root unless seeded), responses
    /// forgotten, event seq back to 0.
    pub fn restart(&self) {
        let mut st = self.state();
        st.generation += 1;
        st.cache = PrefixCache::new(
            self.config.block_size as usize,
            self.config.num_gpu_blocks,
            &fresh_seed(&self.config),
        );
        st.responses.clear();
        if let Some(p) = &self.publisher {
            p.restart();
        }
    }

    pub fn store_response(&self, id: String, response: StoredResponse) {
        self.state().responses.insert(id, response);
    }

    pub fn response(&self, id: &str) -> Option<StoredResponse> {
        self.state().responses.get(id).cloned()
    }

    pub fn stored_responses(&self) -> usize {
        self.state().responses.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replica(blocks: usize) -> Replica {
        let config = Config {
            block_size: 4,
            num_gpu_blocks: blocks,
            max_model_len: 16,
            lora_modules: vec!["sql".to_owned()],
            latency: crate::latency::LatencyConfig {
                time_scale: 0.0,
                ..Default::default()
            },
            ..Config::default()
        };
        Replica::new(config, "r".to_owned(), None)
    }

    fn job(r: &Replica, prompt: Vec<u32>, salt: Option<&str>) -> Job {
        Job {
            model: r.resolve_model(None).unwrap(),
            prompt,
            cache_salt: salt.map(str::to_owned),
        }
    }

    #[tokio::test]
    async fn repeat_hits_and_salts_isolate() {
        let r = replica(64);
        let p: Vec<u32> = (100..110).collect();
        for (salt, expect) in [
            (None, 0),
            (None, 8),
            (Some("A"), 0),
            (Some("B"), 0),
            (Some("B"), 8),
            (None, 8),
        ] {
            let j = job(&r, p.clone(), salt);
            let mut g = r.enter();
            assert_eq!(
                r.prefill(&j, &mut g).await.cached_tokens,
                expect,
                "salt {salt:?}"
            );
        }
        assert_eq!(r.metrics.waiting.load(Ordering::Relaxed), 0);
        assert_eq!(r.metrics.running.load(Ordering::Relaxed), 0);
    }

    #[tokio::test]
    async fn decode_filled_blocks_are_cached() {
        let r = replica(64);
        let j = job(&r, (100..106).collect(), None);
        let mut g = r.enter();
        let pre = r.prefill(&j, &mut g).await;
        r.finish(&j, pre, &[1, 2, 3, 4, 5], "length");
        // prompt(6) + 4 decoded = 10 tokens → 2 full blocks.
        assert_eq!(
            r.probe(&job(&r, vec![100, 101, 102, 103, 104, 105, 1, 2, 3], None))
                .0,
            8
        );
    }

    /// Virtual time (tokio's paused clock): exact, not wall-clock timing.
    #[tokio::test(start_paused = true)]
    async fn concurrent_prefills_wait_their_turn() {
        let mut r = replica(2048);
        r.config.max_model_len = 4096;
        r.config.latency.time_scale = 1.0;
        let r = std::sync::Arc::new(r);
        let one = r
            .config
            .latency
            .scaled(r.config.latency.prefill_ms(1000, 0));
        let t0 = tokio::time::Instant::now();
        let run = |offset: u32| {
            let r = r.clone();
            tokio::spawn(async move {
                let j = job(&r, (offset..offset + 1000).collect(), None);
                let mut g = r.enter();
                r.prefill(&j, &mut g).await;
                tokio::time::Instant::now() - t0
            })
        };
        let first = run(0);
        tokio::task::yield_now().await;
        let second = run(5000);
        tokio::task::yield_now().await;
        assert_eq!(r.metrics.running.load(Ordering::Relaxed), 1);
        assert_eq!(r.metrics.waiting.load(Ordering::Relaxed), 1);
        // tokio's timer has 1 ms resolution.
        let close = |a: Duration, b: Duration| a.abs_diff(b) <= Duration::from_millis(2);
        let (t1, t2) = (first.await.unwrap(), second.await.unwrap());
        assert!(close(t1, one), "{t1:?} vs {one:?}");
        assert!(close(t2, one * 2), "the second waits for the first: {t2:?}");
        // A cached repeat only pays the base cost.
        let j = job(&r, (0..1000).collect(), None);
        let start = tokio::time::Instant::now();
        let mut g = r.enter();
        let pre = r.prefill(&j, &mut g).await;
        assert_eq!(pre.cached_tokens, 996, "(1000 - 1) / 4 * 4");
        let warm = r
            .config
            .latency
            .scaled(r.config.latency.prefill_ms(1000, 996));
        assert!(close(tokio::time::Instant::now() - start, warm));
    }

    #[test]
    fn models_resolve_and_limits_apply() {
        let r = replica(64);
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
        let r = replica(64);
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
}
