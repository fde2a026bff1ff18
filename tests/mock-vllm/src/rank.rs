//! One data-parallel rank's engine: its prefix cache, prefill queue, KV-event publisher and
//! metrics, and the life of one request through them.
//!
//! A request is prefilled in its turn of the [`PrefillQueue`]: the cache hit (the coordinator's
//! fixed point over the KV cache groups) is taken when the turn starts, and the request holds the
//! hit's blocks from then on (its [`BlockTable`]); then each prefill step (one, or chunks of
//! `max_num_batched_tokens`; see `schedule.rs`) sleeps its share of the prefill time, takes
//! blocks for its tokens, stores the blocks filled so far and publishes one event batch
//! (`BlockRemoved` for the evictions, then one `BlockStored` per group). After decoding,
//! [`Engine::finish`] replays the decode steps (one token each) that take or fill blocks, one
//! batch per step that has events. When the request's [`RequestGuard`] drops (finished, failed or
//! abandoned), its blocks are freed.
//!
//! Running requests' blocks are never evicted. vLLM's scheduler would keep a request waiting
//! while the pool has no free block; the mock's requests never wait for blocks, so the pool
//! lends blocks beyond capacity then and takes them back as requests finish (`pool.rs`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use crate::cache::PrefixCache;
use crate::config::Config;
use crate::coordinator::{Coordinator, Hit, RequestBlocks};
use crate::engine::Job;
use crate::events::KvEvent;
use crate::latency::{PrefillQueue, pause};
use crate::publisher::Publisher;
use crate::schedule::prefill_steps;
use crate::table::BlockTable;

/// Counters behind `/metrics` (one set per rank, labelled `engine="<rank>"`).
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
    /// Requests assigned and not yet finished (waiting + running), for internal balancing.
    pub in_flight: AtomicUsize,
    /// `vllm:request_prefill_time_seconds`: scheduled to first token, per request.
    pub prefill_time: Histogram,
    /// `vllm:request_prefill_kv_computed_tokens`: prompt tokens computed (not cached), per
    /// request.
    pub prefill_computed: Histogram,
}

/// vLLM's `REQUEST_LATENCY_BUCKETS` (seconds).
pub const LATENCY_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// vLLM's 1-2-5 token buckets up to `max`.
pub fn token_buckets(max: u32) -> Vec<f64> {
    let mut out = Vec::new();
    let mut exp = 1u64;
    'outer: loop {
        for m in [1u64, 2, 5] {
            let b = m * exp;
            if b > u64::from(max) {
                break 'outer;
            }
            out.push(b as f64);
        }
        exp *= 10;
    }
    out
}

/// A Prometheus histogram: cumulative-free bucket counts (rendered cumulatively), sum, count.
#[derive(Debug, Default)]
pub struct Histogram {
    inner: std::sync::Mutex<HistogramInner>,
}

#[derive(Debug, Default, Clone)]
pub struct HistogramInner {
    /// Observations per bucket of the bounds given at observe time (not cumulative).
    pub counts: Vec<u64>,
    pub sum: f64,
    pub count: u64,
}

impl Histogram {
    pub fn observe(&self, bounds: &[f64], value: f64) {
        let mut h = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        if h.counts.len() != bounds.len() {
            h.counts = vec![0; bounds.len()];
        }
        if let Some(i) = bounds.iter().position(|b| value <= *b)
            && let Some(c) = h.counts.get_mut(i)
        {
            *c += 1;
        }
        h.sum += value;
        h.count += 1;
    }

    pub fn snapshot(&self) -> HistogramInner {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

#[derive(Debug)]
struct State {
    cache: PrefixCache,
    /// The engine incarnation; a restart bumps it so in-flight requests store nothing.
    generation: u64,
    /// Blocks of the requests admitted and not yet freed, by request number.
    tables: HashMap<u64, BlockTable>,
    next_request: u64,
}

/// One rank's engine.
#[derive(Debug)]
pub struct Engine {
    /// The data-parallel rank: payload rank, `engine` metric label, `x-mock-vllm-rank`.
    pub rank: u32,
    pub config: Arc<Config>,
    pub publisher: Option<Publisher>,
    pub metrics: Metrics,
    coordinator: Coordinator,
    queue: PrefillQueue,
    state: Mutex<State>,
}

/// Outcome of a prefill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefilled {
    pub cached_tokens: usize,
    /// The engine incarnation the request ran in (a restart bumps it).
    pub generation: u64,
    /// vLLM's `shared_prefix_boundary` of the request (0: none); decode-filled blocks are cached
    /// with it too.
    pub shared_prefix_boundary: usize,
    /// The request's number in this incarnation (its block table), `None` without prefix
    /// caching.
    pub request: Option<u64>,
}

/// A request assigned to an engine: counted in flight and waiting, then running, until dropped.
#[derive(Debug)]
pub struct RequestGuard {
    engine: Arc<Engine>,
    running: bool,
    blocks: usize,
    /// `(generation, request)` of the blocks it holds, freed on drop.
    table: Option<(u64, u64)>,
}

impl RequestGuard {
    /// The engine the request runs on.
    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    fn admit(&mut self, blocks: usize) {
        if !self.running {
            let m = &self.engine.metrics;
            m.waiting.fetch_sub(1, Ordering::Relaxed);
            m.running.fetch_add(1, Ordering::Relaxed);
            m.running_blocks.fetch_add(blocks, Ordering::Relaxed);
            self.running = true;
            self.blocks = blocks;
        }
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        if let Some((generation, request)) = self.table.take() {
            self.engine.release(generation, request);
        }
        let m = &self.engine.metrics;
        if self.running {
            m.running.fetch_sub(1, Ordering::Relaxed);
            m.running_blocks.fetch_sub(self.blocks, Ordering::Relaxed);
        } else {
            m.waiting.fetch_sub(1, Ordering::Relaxed);
        }
        m.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

fn fresh_cache(config: &Config) -> PrefixCache {
    let seed = config
        .hash_seed
        .clone()
        .unwrap_or_else(|| format!("{:032x}", rand::random::<u128>()));
    PrefixCache::new(config.block_size as usize, config.num_gpu_blocks, &seed)
}

impl Engine {
    pub fn new(rank: u32, config: Arc<Config>, publisher: Option<Publisher>) -> Self {
        Self {
            rank,
            publisher,
            metrics: Metrics::default(),
            coordinator: Coordinator::new(
                &config.kv_cache_layout,
                config.block_size as usize,
                config.prefix_cache_retention_interval,
            ),
            queue: PrefillQueue::default(),
            state: Mutex::new(State {
                cache: fresh_cache(&config),
                generation: 0,
                tables: HashMap::new(),
                next_request: 0,
            }),
            config,
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Assigns a request to this engine: counted in flight and waiting until the guard drops.
    pub fn enter(self: &Arc<Self>) -> RequestGuard {
        self.metrics.in_flight.fetch_add(1, Ordering::Relaxed);
        self.metrics.waiting.fetch_add(1, Ordering::Relaxed);
        RequestGuard {
            engine: self.clone(),
            running: false,
            blocks: 0,
            table: None,
        }
    }

    /// Requests assigned and not finished.
    pub fn in_flight(&self) -> usize {
        self.metrics.in_flight.load(Ordering::Relaxed)
    }

    /// Waits for the prefill turn, takes the cache hit (and holds its blocks), then runs the
    /// prefill steps: each sleeps its share of the prefill time, takes blocks, stores the blocks
    /// filled so far and publishes a batch.
    pub async fn prefill(&self, job: &Job, guard: &mut RequestGuard) -> Prefilled {
        let turn = self.queue.turn().await;
        let block_size = self.config.block_size as usize;
        let n = job.prompt.len();
        guard.admit(self.config.kv_cache_layout.blocks_held(n, block_size));
        let (hit, generation, blocks, request) = {
            let mut st = self.state();
            let blocks = st.cache.blocks(&job.prompt, job.scope());
            let (hit, request) = if self.config.enable_prefix_caching {
                let hit = self
                    .coordinator
                    .longest_hit(&st.cache, &blocks, n.saturating_sub(1));
                let table = self.coordinator.admit(&mut st.cache, &blocks, hit);
                let request = st.next_request;
                st.next_request += 1;
                st.tables.insert(request, table);
                (hit, Some(request))
            } else {
                (Hit::default(), None)
            };
            (hit, st.generation, blocks, request)
        };
        guard.table = request.map(|r| (generation, r));
        let cached_tokens = hit.tokens;
        let m = &self.metrics;
        m.prefix_queries.fetch_add(n as u64, Ordering::Relaxed);
        m.prefix_hits
            .fetch_add(cached_tokens as u64, Ordering::Relaxed);
        m.prompt_tokens.fetch_add(n as u64, Ordering::Relaxed);
        let latency = &self.config.latency;
        let scheduled = std::time::Instant::now();
        let junction = hit.shared_prefix_boundary();
        let req = RequestBlocks {
            tokens: &job.prompt,
            blocks: &blocks,
            num_prompt_tokens: n,
            shared_prefix_boundary: junction,
            lora: job.lora(),
        };
        let mut steps = prefill_steps(
            cached_tokens,
            n,
            self.config.max_num_batched_tokens.map(|t| t as usize),
            block_size,
            self.config.kv_cache_layout.has_mamba(),
            junction,
        );
        if steps.is_empty() {
            steps.push(n);
        }
        let mut done = cached_tokens;
        for (i, end) in steps.into_iter().enumerate() {
            let ms = if i == 0 {
                latency.prefill_ms(end, done)
            } else {
                end.saturating_sub(done) as f64 * latency.prefill_ms_per_token
            };
            pause(latency.scaled(ms)).await;
            self.store(req, request, &[end], generation);
            done = end;
        }
        m.prefill_time
            .observe(LATENCY_BUCKETS, scheduled.elapsed().as_secs_f64());
        m.prefill_computed.observe(
            &token_buckets(self.config.max_model_len),
            n.saturating_sub(cached_tokens) as f64,
        );
        drop(turn);
        Prefilled {
            cached_tokens,
            generation,
            shared_prefix_boundary: junction,
            request,
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
    /// counts the request finished. Each decode step computes one token and publishes a batch
    /// when it has events (a block taken, with its evictions, or a block filled). The blocks stay
    /// held until the request's guard drops.
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
        if all.len() <= job.prompt.len() || pre.request.is_none() {
            return;
        }
        let blocks = self.state().cache.blocks(&all, job.scope());
        let req = RequestBlocks {
            tokens: &all,
            blocks: &blocks,
            num_prompt_tokens: job.prompt.len(),
            shared_prefix_boundary: pre.shared_prefix_boundary,
            lora: job.lora(),
        };
        let steps: Vec<usize> = (job.prompt.len() + 1..=all.len()).collect();
        self.store(req, pre.request, &steps, pre.generation);
    }

    /// Runs the request's engine steps ending at `ends` (tokens computed after each) and
    /// publishes each step's batch.
    fn store(&self, req: RequestBlocks<'_>, request: Option<u64>, ends: &[usize], generation: u64) {
        let Some(request) = request else {
            return;
        };
        let mut st = self.state();
        if st.generation != generation {
            return; // the engine "restarted" meanwhile
        }
        let State { cache, tables, .. } = &mut *st;
        let Some(table) = tables.get_mut(&request) else {
            return;
        };
        for end in ends {
            let events = self.coordinator.cache_blocks(cache, table, req, *end);
            // Published under the state lock so batches follow the cache's order of changes.
            if let Some(publisher) = &self.publisher {
                publisher.publish(events);
            }
        }
    }

    /// Frees a request's blocks (its guard dropped).
    fn release(&self, generation: u64, request: u64) {
        let mut st = self.state();
        if st.generation != generation {
            return;
        }
        let Some(table) = st.tables.remove(&request) else {
            return;
        };
        let events = self.coordinator.free(&mut st.cache, table);
        if let Some(publisher) = &self.publisher {
            publisher.publish(events);
        }
    }

    /// `(held, hit)`: prefix tokens this engine holds now for `job` (whole cached blocks a longer
    /// request could reuse: the groups' fixed point, not capped), and what a request would be
    /// served from the cache.
    pub fn probe(&self, job: &Job) -> (usize, usize) {
        let st = self.state();
        let blocks = st.cache.blocks(&job.prompt, job.scope());
        let c = &self.coordinator;
        (
            c.longest_hit(&st.cache, &blocks, blocks.len() * st.cache.block_size())
                .tokens,
            c.longest_hit(&st.cache, &blocks, job.prompt.len().saturating_sub(1))
                .tokens,
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

    /// Simulates an engine restart: empty cache (new hash root unless seeded), event seq back
    /// to 0; requests in flight store nothing.
    pub fn restart(&self) {
        let mut st = self.state();
        st.generation += 1;
        st.cache = fresh_cache(&self.config);
        st.tables.clear();
        if let Some(p) = &self.publisher {
            p.restart();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::ModelRef;

    fn config(blocks: usize) -> Config {
        Config {
            block_size: 4,
            num_gpu_blocks: blocks,
            max_model_len: 16,
            latency: crate::latency::LatencyConfig {
                time_scale: 0.0,
                ..Default::default()
            },
            ..Config::default()
        }
    }

    fn engine(config: Config) -> Arc<Engine> {
        Arc::new(Engine::new(0, Arc::new(config), None))
    }

    fn job(prompt: Vec<u32>, salt: Option<&str>) -> Job {
        Job {
            model: ModelRef {
                name: "mock-model".to_owned(),
                lora: None,
            },
            prompt,
            cache_salt: salt.map(str::to_owned),
        }
    }

    #[tokio::test]
    async fn repeat_hits_and_salts_isolate() {
        let e = engine(config(64));
        let p: Vec<u32> = (100..110).collect();
        for (salt, expect) in [
            (None, 0),
            (None, 8),
            (Some("A"), 0),
            (Some("B"), 0),
            (Some("B"), 8),
            (None, 8),
        ] {
            let j = job(p.clone(), salt);
            let mut g = e.enter();
            assert_eq!(
                e.prefill(&j, &mut g).await.cached_tokens,
                expect,
                "salt {salt:?}"
            );
        }
        assert_eq!(e.metrics.waiting.load(Ordering::Relaxed), 0);
        assert_eq!(e.metrics.running.load(Ordering::Relaxed), 0);
        assert_eq!(e.in_flight(), 0);
    }

    #[tokio::test]
    async fn decode_filled_blocks_are_cached() {
        let e = engine(config(64));
        let j = job((100..106).collect(), None);
        let mut g = e.enter();
        let pre = e.prefill(&j, &mut g).await;
        e.finish(&j, pre, &[1, 2, 3, 4, 5], "length");
        // prompt(6) + 4 decoded = 10 tokens → 2 full blocks.
        assert_eq!(
            e.probe(&job(vec![100, 101, 102, 103, 104, 105, 1, 2, 3], None))
                .0,
            8
        );
    }

    #[tokio::test]
    async fn restart_empties_the_cache_and_discards_in_flight_stores() {
        let e = engine(config(64));
        let j = job((100..110).collect(), None);
        let mut g = e.enter();
        let pre = e.prefill(&j, &mut g).await;
        assert_eq!(e.cached_blocks(), 2);
        e.restart();
        assert_eq!(e.cached_blocks(), 0);
        e.finish(&j, pre, &[1, 2, 3, 4, 5, 6, 7], "length");
        assert_eq!(e.cached_blocks(), 0, "stored by the previous incarnation");
    }

    /// Chunked prefill: the same total time in steps, every full block cached.
    #[tokio::test(start_paused = true)]
    async fn chunked_prefill_takes_the_same_time_in_steps() {
        let mut c = config(2048);
        c.max_model_len = 4096;
        c.latency.time_scale = 1.0;
        c.max_num_batched_tokens = Some(400);
        let e = engine(c);
        let whole = e
            .config
            .latency
            .scaled(e.config.latency.prefill_ms(1000, 0));
        let start = tokio::time::Instant::now();
        let j = job((0..1000).collect(), None);
        let mut g = e.enter();
        e.prefill(&j, &mut g).await;
        let took = tokio::time::Instant::now() - start;
        assert!(
            took.abs_diff(whole) <= Duration::from_millis(3),
            "{took:?} vs {whole:?}"
        );
        assert_eq!(e.cached_blocks(), 250);
        assert_eq!(e.probe(&j), (1000, 996));
    }

    /// A hybrid layout: the hit is the groups' fixed point (here the sliding tail).
    #[tokio::test]
    async fn hybrid_layout_hits_through_the_coordinator() {
        let mut c = config(64);
        c.kv_cache_layout = "sliding_window:8,full_attention".parse().unwrap();
        let e = engine(c);
        let j = job((100..110).collect(), None);
        let mut g = e.enter();
        assert_eq!(e.prefill(&j, &mut g).await.cached_tokens, 0);
        // 2 full blocks; the window needs cdiv(7, 4) = 2 blocks ending at ⌊9 / 4⌋ = 2.
        assert_eq!(e.cached_blocks(), 2 + 2);
        let mut g = e.enter();
        assert_eq!(e.prefill(&j, &mut g).await.cached_tokens, 8);
    }

    /// Virtual time (tokio's paused clock): exact, not wall-clock timing.
    #[tokio::test(start_paused = true)]
    async fn concurrent_prefills_wait_their_turn() {
        let mut c = config(2048);
        c.max_model_len = 4096;
        c.latency.time_scale = 1.0;
        let e = engine(c);
        let one = e
            .config
            .latency
            .scaled(e.config.latency.prefill_ms(1000, 0));
        let t0 = tokio::time::Instant::now();
        let run = |offset: u32| {
            let e = e.clone();
            tokio::spawn(async move {
                let j = job((offset..offset + 1000).collect(), None);
                let mut g = e.enter();
                e.prefill(&j, &mut g).await;
                tokio::time::Instant::now() - t0
            })
        };
        let first = run(0);
        tokio::task::yield_now().await;
        let second = run(5000);
        tokio::task::yield_now().await;
        assert_eq!(e.metrics.running.load(Ordering::Relaxed), 1);
        assert_eq!(e.metrics.waiting.load(Ordering::Relaxed), 1);
        assert_eq!(e.in_flight(), 2);
        // tokio's timer has 1 ms resolution.
        let close = |a: Duration, b: Duration| a.abs_diff(b) <= Duration::from_millis(2);
        let (t1, t2) = (first.await.unwrap(), second.await.unwrap());
        assert!(close(t1, one), "{t1:?} vs {one:?}");
        assert!(close(t2, one * 2), "the second waits for the first: {t2:?}");
        // A cached repeat only pays the base cost.
        let j = job((0..1000).collect(), None);
        let start = tokio::time::Instant::now();
        let mut g = e.enter();
        let pre = e.prefill(&j, &mut g).await;
        assert_eq!(pre.cached_tokens, 996, "(1000 - 1) / 4 * 4");
        let warm = e
            .config
            .latency
            .scaled(e.config.latency.prefill_ms(1000, 996));
        assert!(close(tokio::time::Instant::now() - start, warm));
    }
}
