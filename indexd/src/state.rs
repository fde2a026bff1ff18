//! Shared state: the replica registry, the index and the side tables, with
//! one owner each.
//!
//! - `index`: `Mutex` — the writer's side: subscribers apply one batch at a
//!   time and publish it; the snapshot writer, discovery and `/metrics` read
//!   it. Never held across `.await`. Picks never take it.
//! - `lookup`: what Picks read ([`Lookup`]): the index's one copy under a
//!   read lock (a publish takes the write lock a block at a time and yields
//!   it to waiting Picks in between; see [`crate::index`]), the partitions (an
//!   `RwLock` written only for a new model name) and the speculative
//!   credits (a short `Mutex`, Picks and purges; a purge takes it with
//!   `index` held, a Pick never takes `index`).
//! - `registry`: `RwLock` — read on every Pick (a clone of a few `Arc`s),
//!   written only when discovery adds or removes endpoints.
//! - per-replica load, freshness and health: atomics and small mutexes inside
//!   [`Replica`], written by that replica's own tasks.
//! - `affinity`, `approximate`, `rng`: short `Mutex`es.
//! - `conversations`: a `Mutex` that also places Picks one at a time: held
//!   from reading the candidates' loads to noting the chosen replica's
//!   queued prefill (a few µs; inside it a Pick takes `rng` and each
//!   candidate's own short mutexes, and nothing takes `conversations` with
//!   one of those held). The prefix match before it and the speculative
//!   credit after it stay outside.
//! - `observe_bucket`: a short `Mutex` over the Observe rate limit's token
//!   bucket, taken once per Observe before anything else (a few float
//!   operations; never with another lock held).
//! - `token`: no lock — the shared token's digest, set once at start.
//! - `tokenizers`: no lock — the set of models is fixed at start; each
//!   model's gate is atomics plus a `Mutex` over its closing reason, and its
//!   tokenizer's segment cache locks itself briefly (never while encoding).
//!   Local tokenization runs on the worker that took the Pick
//!   (`block_in_place`) or on the blocking pool, never under a lock here.
//! - `restores` (a snapshot's replicas not registered yet): a short `Mutex`,
//!   taken when a replica is added; restoring its blocks then takes the
//!   `index` write lock once (start-up or discovery, not the request path).
//!   The snapshot writer reads the index one replica at a time, under the
//!   read lock, in a blocking task (no `.await` while held); `snapshot_lock`
//!   serializes writers (the periodic one and the one at shutdown).
//! - per-replica prefill calibration: a short `Mutex`, written by that
//!   replica's scrape task, which copies the fitted speed into the
//!   replica's scraped load while holding it (the one nesting of the two,
//!   always in this order); a Pick reads the copy with the rest of the
//!   load, under the scraped load's mutex alone.
//! - per-replica resume point (from a snapshot): a short `Mutex`, taken once
//!   by the replica's subscription.
//!
//! Subscriptions run on their own runtime (`ingest`, one thread less than
//! the CPUs, at least one; or one per `ingest_cpus` CPU, pinned there, with
//! the request path on the other CPUs), so a flood of events cannot queue
//! Picks behind it, and at most that many writers contend for `index`.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand::rngs::StdRng;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::affinity::{Affinity, Approximate};
use crate::auth::Token;
use crate::calibrate::{Calibration, PrefillCounters, PrefillSpeed};
use crate::config::{Config, EndpointConfig};
use crate::conversations::Conversations;
use crate::event::{EventBatch, KvEvent};
use crate::ids::EndpointId;
use crate::ids::ReplicaSlot;
use crate::index::layout::Unmodelled;
use crate::index::{Applied, ApplyStats, Index, Layout, Lookup};
use crate::metrics::Metrics;
use crate::ratelimit::TokenBucket;
use crate::score::Load;
use crate::snapshot::Pending;
use crate::sync::{WarnGate, lock, read, write};
use crate::tokenize::Tokenizers;

/// Load as scraped, plus bookkeeping.
#[derive(Debug, Default)]
struct Scraped {
    running: f64,
    waiting: f64,
    /// `waiting` of the scrape before the latest.
    waiting_before: f64,
    kv_usage: f64,
    consecutive_failures: u32,
    occupancy: Option<f64>,
    cache_available: Option<bool>,
    /// The calibration's latest speed, copied here so that a Pick reads a
    /// replica's load under this one lock (and its pending picks').
    prefill: Option<PrefillSpeed>,
    /// Its KV cache's size in blocks, as its metrics say.
    cache_blocks: Option<f64>,
}

/// One replica's runtime state.
#[derive(Debug)]
pub struct Replica {
    /// Its configuration.
    pub(crate) config: EndpointConfig,
    /// Its slot in the index.
    pub(crate) slot: ReplicaSlot,
    /// Cancels its tasks when it is removed or indexd stops.
    pub(crate) cancel: CancellationToken,
    fresh: AtomicBool,
    healthy: AtomicBool,
    scraped: Mutex<Scraped>,
    pending: Mutex<PickQueue>,
    block_size_seen: AtomicU32,
    block_size_warned: AtomicBool,
    /// The KV cache layout last reported (`kind/reason` of its first group
    /// not modelled, or empty): a warning per change.
    layout_reported: Mutex<String>,
    loras: Mutex<BTreeSet<String>>,
    warning: WarnGate,
    /// Where its event stream resumes, when a snapshot restored its blocks.
    resume: Mutex<Option<Applied>>,
    /// Its prefill speed, fitted from its metrics.
    calibration: Mutex<Fitted>,
    /// Its host as a Pick's candidates name it (`ip:port`), written once:
    /// formatting the address took a twentieth of a Pick.
    address: String,
}

/// A replica's calibration and what it last concluded.
#[derive(Debug, Default)]
struct Fitted {
    fit: Calibration,
    speed: Option<PrefillSpeed>,
    /// The rate last logged (changes of a quarter or more are logged).
    logged: Option<f64>,
}

const MAX_PENDING: usize = 4096;
/// The longest prefill one pick may stand for (a bound on bad estimates).
const MAX_PICK_PREFILL: Duration = Duration::from_secs(60);

/// The picks sent to a replica, and the prefill queue they make there.
///
/// Each pick's prefill is placed after those before it (one replica's
/// prefill is compute-bound: work queued ahead delays it by its own length)
/// and lasts its estimated time, so the queue drains as the replica works
/// instead of standing until a scrape or an answer: a request that is
/// decoding has left the prefill queue. An answer that comes sooner than
/// estimated shortens the queue by what its pick had left.
///
/// Apart from time, each pick stands for the KV blocks its prompt will
/// allocate there until the filter reports it answered (or
/// `pending_pick_ttl` passes): blocks that requests queued ahead of a new
/// one take from the cache before it is admitted ([`crate::score`]).
#[derive(Debug, Default)]
struct PickQueue {
    /// Picks its metrics may not show yet, oldest first (a scrape that began
    /// after a pick drops it from here, not from the queue).
    picks: VecDeque<PendingPick>,
    /// When the prefill of every pick noted so far is estimated to be done.
    busy_until: Option<Instant>,
    /// Picks not answered yet with the blocks they allocate, oldest first.
    allocating: VecDeque<Allocation>,
}

/// A pick's KV blocks still to come, until it is answered.
#[derive(Clone, Debug)]
struct Allocation {
    at: Instant,
    /// Shared with its [`PendingPick`]: one copy of the id a pick.
    request_id: Arc<str>,
    blocks: u32,
}

/// One pick sent to the replica.
#[derive(Clone, Debug)]
struct PendingPick {
    at: Instant,
    /// The request's `x-request-id` (empty if none).
    request_id: Arc<str>,
    /// Its prefill's estimated start and end.
    start: Instant,
    end: Instant,
}

impl PickQueue {
    /// Queues a pick made at `at` (at most `now`: a request the filter
    /// reports after the fact) whose prefill starts once the queue ahead of
    /// it is done, `now` at the earliest.
    fn note(
        &mut self,
        at: Instant,
        now: Instant,
        request_id: Arc<str>,
        prefill: Duration,
        blocks: u32,
    ) {
        if self.picks.len() >= MAX_PENDING {
            self.picks.pop_front();
        }
        if self.allocating.len() >= MAX_PENDING {
            self.allocating.pop_front();
        }
        if blocks > 0 {
            self.allocating.push_back(Allocation {
                at: at.min(now),
                request_id: Arc::clone(&request_id),
                blocks,
            });
        }
        let start = self.busy_until.filter(|b| *b > now).unwrap_or(now);
        let end = start + prefill.min(MAX_PICK_PREFILL);
        self.busy_until = Some(end);
        self.picks.push_back(PendingPick {
            at: at.min(now),
            request_id,
            start,
            end,
        });
    }

    /// Forgets `request_id`'s pick; the queue loses what its prefill had
    /// left. Returns whether one was found.
    fn complete(&mut self, now: Instant, request_id: &str) -> bool {
        let allocated = self
            .allocating
            .iter()
            .position(|a| *a.request_id == *request_id)
            .and_then(|i| self.allocating.remove(i))
            .is_some();
        let Some(i) = self.picks.iter().position(|p| *p.request_id == *request_id) else {
            return allocated;
        };
        let Some(p) = self.picks.remove(i) else {
            return false;
        };
        let left = p.end.saturating_duration_since(p.start.max(now));
        if let Some(b) = self.busy_until
            && b > now
        {
            self.busy_until = Some(b.checked_sub(left).map_or(now, |e| e.max(now)));
        }
        true
    }

    /// Blocks the unanswered picks not admitted yet will allocate: all but
    /// the oldest `admitted` (the replica's running requests: admitted in
    /// order, their blocks are allocated already), those older than `ttl`
    /// at `now` forgotten first.
    fn demand_blocks(&mut self, now: Instant, ttl: Duration, admitted: usize) -> u64 {
        while self
            .allocating
            .front()
            .is_some_and(|a| now.saturating_duration_since(a.at) > ttl)
        {
            self.allocating.pop_front();
        }
        self.allocating
            .iter()
            .skip(admitted)
            .map(|a| u64::from(a.blocks))
            .sum()
    }

    /// Seconds of prefill queued at `now`.
    fn queued_seconds(&self, now: Instant) -> f64 {
        self.busy_until
            .map_or(0.0, |b| b.saturating_duration_since(now).as_secs_f64())
    }
}
const MAX_LORAS: usize = 256;

impl Replica {
    fn new(config: EndpointConfig, slot: ReplicaSlot, cancel: CancellationToken) -> Self {
        Self {
            // Without an event source there is nothing to be stale about;
            // without a metrics URL there is no health signal.
            fresh: AtomicBool::new(config.events.is_none()),
            healthy: AtomicBool::new(config.metrics_url.is_none()),
            address: config.id.address.to_string(),
            config,
            slot,
            cancel,
            scraped: Mutex::new(Scraped::default()),
            pending: Mutex::new(PickQueue::default()),
            block_size_seen: AtomicU32::new(0),
            block_size_warned: AtomicBool::new(false),
            layout_reported: Mutex::new(String::new()),
            loras: Mutex::new(BTreeSet::new()),
            warning: WarnGate::default(),
            resume: Mutex::new(None),
            calibration: Mutex::new(Fitted::default()),
        }
    }

    /// Takes one scrape's prefill counters, scraped at `at`, into the fit of
    /// its speed (`prior`: the configured tokens per second).
    pub(crate) fn calibrate(&self, counters: PrefillCounters, at: Instant, prior: f64) {
        let mut f = lock(&self.calibration);
        // An idle interval adds nothing; a restart resets the fit.
        f.fit.observe(counters, Some(at));
        f.speed = f.fit.speed(prior);
        lock(&self.scraped).prefill = f.speed;
        let Some(speed) = f.speed else {
            return;
        };
        let moved = f.logged.is_none_or(|l| {
            let ratio = speed.tokens_per_second / l;
            !(0.8..=1.25).contains(&ratio)
        });
        if moved {
            f.logged = Some(speed.tokens_per_second);
            drop(f);
            tracing::info!(
                endpoint = %self.id(),
                tokens_per_second = speed.tokens_per_second.round(),
                overhead_ms = (speed.overhead_seconds * 1e3).round(),
                prior,
                "prefill speed calibrated from the replica's metrics"
            );
        }
    }

    /// Its fitted prefill speed (None: not enough evidence yet; the prior
    /// applies).
    pub(crate) fn prefill_speed(&self) -> Option<PrefillSpeed> {
        lock(&self.calibration).speed
    }

    /// True at most once per 10 s: bad input from one replica is counted
    /// always but logged sparingly.
    pub(crate) fn may_warn(&self) -> bool {
        self.warning.open()
    }

    /// Takes the point a snapshot says its stream resumes from.
    pub(crate) fn take_resume(&self) -> Option<Applied> {
        lock(&self.resume).take()
    }

    /// Records the point its stream resumes from (its blocks were restored).
    pub(crate) fn set_resume(&self, point: Applied) {
        *lock(&self.resume) = Some(point);
    }

    /// Its identity.
    pub fn id(&self) -> &EndpointId {
        &self.config.id
    }

    /// Its host address as text (`ip:port`, what Envoy's override names).
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Subscribed with no unrecovered gap.
    pub fn is_fresh(&self) -> bool {
        self.fresh.load(Ordering::Acquire)
    }

    /// Marks the event stream complete (or not).
    pub(crate) fn set_fresh(&self, fresh: bool) {
        self.fresh.store(fresh, Ordering::Release);
    }

    /// The last scrapes succeeded (or there is nothing to scrape).
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Acquire)
    }

    /// Healthy and fresh: may be named in an answer.
    pub fn is_eligible(&self) -> bool {
        self.is_healthy() && self.is_fresh()
    }

    /// The block size its events carry (0: none seen).
    pub(crate) fn block_size_seen(&self) -> u32 {
        self.block_size_seen.load(Ordering::Relaxed)
    }

    /// True if it serves `model` (configured, or a LoRA seen in its events).
    pub(crate) fn serves(&self, model: &str) -> bool {
        self.config.serves(model) || lock(&self.loras).contains(model)
    }

    /// Records a successful scrape that started at `started`: its load and
    /// the KV cache size it gave (None: the page does not say), under one
    /// lock, so that a Pick never pairs one scrape's usage with another's
    /// cache size.
    pub(crate) fn scrape_ok(
        &self,
        running: f64,
        waiting: f64,
        kv_usage: f64,
        cache_blocks: Option<f64>,
        started: Instant,
    ) {
        {
            let mut s = lock(&self.scraped);
            s.running = running;
            s.waiting_before = s.waiting;
            s.waiting = waiting;
            s.kv_usage = kv_usage;
            s.cache_blocks = cache_blocks;
            s.consecutive_failures = 0;
        }
        // Picks made before the scrape started are visible in it now (their
        // prefill stays in the queue: a scrape does not say it is done).
        let mut pending = lock(&self.pending);
        while pending.picks.front().is_some_and(|p| p.at < started) {
            pending.picks.pop_front();
        }
        drop(pending);
        self.healthy.store(true, Ordering::Release);
    }

    /// Records a failed scrape; returns true if the replica just became
    /// unhealthy.
    pub(crate) fn scrape_failed(&self, unhealthy_after: u32) -> bool {
        let failures = {
            let mut s = lock(&self.scraped);
            s.consecutive_failures = s.consecutive_failures.saturating_add(1);
            s.consecutive_failures
        };
        failures >= unhealthy_after && self.healthy.swap(false, Ordering::AcqRel)
    }

    /// Its KV cache size in blocks, if its metrics said.
    pub(crate) fn cache_blocks(&self) -> Option<f64> {
        lock(&self.scraped).cache_blocks
    }

    /// Records the capacity signal.
    pub(crate) fn set_capacity(&self, occupancy: Option<f64>, cache_available: Option<bool>) {
        let mut s = lock(&self.scraped);
        s.occupancy = occupancy;
        s.cache_available = cache_available;
    }

    /// Queues a pick's estimated `prefill` time behind the prefill already
    /// queued ([`PickQueue`]), and counts the pick until a scrape shows it or
    /// the filter reports it answered ([`Self::complete_pick`]), and the
    /// `blocks` it allocates until it is answered.
    pub(crate) fn note_pick(&self, now: Instant, request_id: &str, prefill: Duration, blocks: u32) {
        // The id's copy is made before the lock is taken.
        let request_id = Arc::from(request_id);
        lock(&self.pending).note(now, now, request_id, prefill, blocks);
    }

    /// [`Self::note_pick`] for a request routed at `at` without a Pick (the
    /// filter's `local_continuations`), reported by a later Pick: it counts
    /// for `pending_pick_ttl` from `at`.
    pub(crate) fn note_continued(
        &self,
        at: Instant,
        now: Instant,
        request_id: &str,
        prefill: Duration,
        blocks: u32,
    ) {
        let request_id = Arc::from(request_id);
        lock(&self.pending).note(at, now, request_id, prefill, blocks);
    }

    /// Forgets the pending pick of `request_id`: the replica has answered
    /// (its prefill is done), so what its prefill had left leaves the queue.
    /// Returns whether one was found.
    pub(crate) fn complete_pick(&self, now: Instant, request_id: &str) -> bool {
        if request_id.is_empty() {
            return false;
        }
        lock(&self.pending).complete(now, request_id)
    }

    /// The load snapshot the scorer uses; `conversations` is this indexd's
    /// count of conversations whose latest turn went here
    /// ([`crate::conversations`], kept for all replicas at once).
    pub(crate) fn load(&self, now: Instant, pending_ttl: Duration, conversations: usize) -> Load {
        // The scraped figures first (one lock each, never both held): its
        // running requests are its oldest unanswered picks, admitted already.
        let mut load = {
            let s = lock(&self.scraped);
            let prefill = s.prefill;
            Load {
                prefill_tokens_per_second: prefill.map(|p| p.tokens_per_second),
                prefill_overhead_seconds: prefill.map_or(0.0, |p| p.overhead_seconds),
                running: s.running,
                waiting: s.waiting,
                waiting_before: s.waiting_before,
                kv_usage: s.kv_usage,
                cache_blocks: s.cache_blocks,
                conversations: conversations as f64,
                occupancy: s.occupancy,
                cache_available: s.cache_available.unwrap_or(true),
                ..Load::default()
            }
        };
        let admitted = load.running.max(0.0).min(MAX_PENDING as f64) as usize;
        let mut p = lock(&self.pending);
        while p
            .picks
            .front()
            .is_some_and(|p| now.saturating_duration_since(p.at) > pending_ttl)
        {
            p.picks.pop_front();
        }
        load.pending_picks = p.picks.len() as f64;
        load.demand_blocks = p.demand_blocks(now, pending_ttl, admitted) as f64;
        load.queued_seconds = p.queued_seconds(now);
        load
    }
}

/// The replicas indexd knows, by identity.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    replicas: BTreeMap<EndpointId, Arc<Replica>>,
    next_slot: u32,
}

impl Registry {
    /// All replicas.
    pub(crate) fn all(&self) -> Vec<Arc<Replica>> {
        self.replicas.values().cloned().collect()
    }

    /// The replicas serving `model` that are eligible (healthy and fresh),
    /// in [`Registry::all`]'s order, and whether any replica serves it at
    /// all.
    pub(crate) fn eligible(&self, model: &str) -> (Vec<Arc<Replica>>, bool) {
        let mut serving = false;
        let eligible = self
            .replicas
            .values()
            .filter(|r| {
                let serves = r.serves(model);
                serving |= serves;
                serves && r.is_eligible()
            })
            .cloned()
            .collect();
        (eligible, serving)
    }

    /// One replica.
    pub(crate) fn get(&self, id: &EndpointId) -> Option<Arc<Replica>> {
        self.replicas.get(id).cloned()
    }

    /// The replica an Observe may name: `id` itself; with no rank, any
    /// replica at the address; with a rank, a replica registered at the
    /// address without ranks. Never a replica at another address, nor
    /// another rank of a server registered by rank.
    pub(crate) fn observed(&self, id: &EndpointId) -> Option<Arc<Replica>> {
        if id.rank.is_none() {
            return self.find(id);
        }
        self.get(id).or_else(|| {
            self.get(&EndpointId {
                address: id.address,
                rank: None,
            })
        })
    }

    /// The replica `id` names, or, when the rank is unknown or differs, the
    /// first replica at that address.
    pub(crate) fn find(&self, id: &EndpointId) -> Option<Arc<Replica>> {
        self.get(id).or_else(|| {
            self.replicas
                .values()
                .find(|r| r.id().address == id.address)
                .cloned()
        })
    }
}

/// Everything the tasks and handlers share.
#[derive(Debug)]
pub struct Shared {
    /// The configuration indexd started with.
    pub(crate) config: Config,
    /// The block index (the writer's side).
    pub(crate) index: Mutex<Index>,
    /// What Picks read (the index's published side).
    pub(crate) lookup: Arc<Lookup>,
    /// The replica registry.
    pub(crate) registry: RwLock<Registry>,
    /// Response-id affinity.
    pub(crate) affinity: Mutex<Affinity>,
    /// Approximate-mode keys.
    pub(crate) approximate: Mutex<Approximate>,
    /// Where this indexd's conversations are (the move rule).
    pub(crate) conversations: Mutex<Conversations>,
    /// Metrics.
    pub(crate) metrics: Metrics,
    /// Tie-breaking RNG.
    pub(crate) rng: Mutex<StdRng>,
    /// Cancelled when indexd stops.
    pub(crate) shutdown: CancellationToken,
    /// Every background task, awaited on shutdown.
    pub(crate) tasks: TaskTracker,
    /// A loaded snapshot's replicas, restored when they are registered.
    pub(crate) restores: Mutex<Pending>,
    /// Held while a snapshot is written.
    pub(crate) snapshot_lock: Mutex<()>,
    /// The runtime the subscriptions run on, apart from the request path
    /// (unset: the current one).
    pub(crate) ingest: OnceLock<tokio::runtime::Handle>,
    /// Local tokenizers and the replica fallback (read-only after start;
    /// each model's gate and cache synchronise themselves).
    pub(crate) tokenizers: Tokenizers,
    /// The shared token every call must carry, if configured.
    pub(crate) token: Option<Token>,
    /// The Observe rate limit.
    pub(crate) observe_bucket: Mutex<TokenBucket>,
    /// Warnings about Picks the index cannot answer (block size, key
    /// scheme): each such Pick is counted, the log says so once per 10 s.
    pub(crate) pick_warning: WarnGate,
    /// The address the HTTP listener was bound to (unset before the bind,
    /// and in tests that bind none: `http_listen` then).
    pub(crate) http_addr: OnceLock<std::net::SocketAddr>,
    /// Discovered endpoints skipped as indexd's own HTTP listener, as the
    /// last discovered list named them (each logged and counted when it
    /// first appears there).
    pub(crate) refused_self: Mutex<std::collections::BTreeSet<EndpointId>>,
    /// Warnings about endpoints added in code that name indexd's own HTTP
    /// listener.
    pub(crate) refused_warning: WarnGate,
}

impl Shared {
    /// Fresh state for `config`.
    pub fn new(config: Config, shutdown: CancellationToken) -> Self {
        let rng = match config.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_os_rng(),
        };
        let index = Index::new(config.max_index_entries, config.max_speculative_entries);
        Self {
            lookup: index.lookup(),
            index: Mutex::new(index),
            registry: RwLock::new(Registry::default()),
            affinity: Mutex::new(Affinity::new(config.affinity_capacity, config.affinity_ttl)),
            approximate: Mutex::new(Approximate::new(config.approximate_capacity)),
            conversations: Mutex::new(Conversations::default()),
            metrics: Metrics::new(),
            rng: Mutex::new(rng),
            shutdown,
            tasks: TaskTracker::new(),
            restores: Mutex::new(Pending::default()),
            snapshot_lock: Mutex::new(()),
            ingest: OnceLock::new(),
            tokenizers: Tokenizers::none(),
            token: None,
            observe_bucket: Mutex::new(TokenBucket::new(
                config.access.observe_rate,
                config.access.observe_burst,
            )),
            pick_warning: WarnGate::default(),
            http_addr: OnceLock::new(),
            refused_self: Mutex::new(std::collections::BTreeSet::new()),
            refused_warning: WarnGate::default(),
            config,
        }
    }

    /// indexd's own HTTP listener: the address bound, else `http_listen`.
    pub fn http_addr(&self) -> std::net::SocketAddr {
        self.http_addr
            .get()
            .copied()
            .unwrap_or(self.config.http_listen)
    }

    /// True when `address` is indexd's own HTTP listener
    /// ([`crate::listen::reaches`]): no endpoint may have it.
    pub fn is_own_http(&self, address: std::net::SocketAddr) -> bool {
        crate::listen::reaches(self.http_addr(), address, &crate::listen::is_local_ip)
    }

    /// The same state requiring `token` on every call.
    pub fn with_token(mut self, token: Option<Token>) -> Self {
        self.token = token;
        self
    }

    /// The same state tokenizing with `tokenizers`.
    pub fn with_tokenizers(mut self, tokenizers: Tokenizers) -> Self {
        self.tokenizers = tokenizers;
        self
    }

    /// Registers an endpoint; `None` if it is already known.
    pub fn add_replica(&self, config: EndpointConfig) -> Option<Arc<Replica>> {
        let mut reg = write(&self.registry);
        if reg.replicas.contains_key(&config.id) {
            return None;
        }
        let slot = ReplicaSlot(reg.next_slot);
        reg.next_slot = reg.next_slot.saturating_add(1);
        let replica = Arc::new(Replica::new(config, slot, self.shutdown.child_token()));
        reg.replicas
            .insert(replica.id().clone(), Arc::clone(&replica));
        drop(reg);
        crate::snapshot::restore(self, &replica);
        Some(replica)
    }

    /// Unregisters an endpoint, stops its tasks and drops its entries.
    pub(crate) fn remove_replica(&self, id: &EndpointId) -> bool {
        let Some(replica) = write(&self.registry).replicas.remove(id) else {
            return false;
        };
        replica.cancel.cancel();
        lock(&self.index).remove_replica(replica.slot);
        lock(&self.approximate).forget_replica(replica.slot);
        self.metrics.purges.inc(["removed"]);
        true
    }

    /// Forgets what `replica` holds.
    pub(crate) fn purge(&self, replica: &Replica, reason: &'static str) {
        lock(&self.index).purge(replica.slot);
        self.metrics.purges.inc([reason]);
        tracing::info!(endpoint = %replica.id(), reason, "purged replica from the index");
    }

    /// Applies one decoded batch from `replica`.
    pub fn ingest(&self, replica: &Replica, batch: EventBatch) {
        self.ingest_applied(replica, batch, None);
    }

    /// Applies one decoded batch from `replica` and records it as the last
    /// applied (in the same write lock: a snapshot sees both or neither).
    pub(crate) fn ingest_applied(
        &self,
        replica: &Replica,
        batch: EventBatch,
        applied: Option<Applied>,
    ) {
        let m = &self.metrics;
        m.batches.inc();
        if let (Some(got), Some(want)) = (batch.data_parallel_rank, replica.id().rank)
            && got != want
        {
            m.rank_mismatch.inc();
        }
        for ev in &batch.events {
            let ty = match ev {
                KvEvent::BlockStored(s) => {
                    self.note_block_size(replica, s.block_size);
                    if let Some(lora) = &s.lora_name {
                        let mut loras = lock(&replica.loras);
                        if loras.len() < MAX_LORAS {
                            loras.insert(lora.clone());
                        }
                    }
                    "block_stored"
                }
                KvEvent::BlockRemoved(_) => "block_removed",
                KvEvent::AllBlocksCleared => "all_blocks_cleared",
                KvEvent::Unknown => "unknown",
            };
            m.events.inc([ty]);
        }
        let mut stats = ApplyStats::default();
        let layout = {
            let mut index = lock(&self.index);
            for ev in batch.events {
                index.apply_unpublished(replica.slot, &replica.config.model, ev);
            }
            if let Some(applied) = applied {
                index.set_applied(replica.slot, applied);
            }
            index.publish(&mut stats);
            (stats.groups_learned > 0)
                .then(|| index.layout(replica.slot))
                .flatten()
        };
        if let Some(layout) = layout {
            self.note_layout(replica, &layout);
        }
        if stats.layout_changes > 0 {
            m.purges.add(["layout_changed"], stats.layout_changes);
            tracing::warn!(
                endpoint = %replica.id(),
                "replica's KV cache groups changed kind or window without a restart: its blocks \
                 were dropped and its layout is learned afresh"
            );
        }
        if stats.cleared > 0 {
            m.purges.add(["cleared"], stats.cleared);
        }
        let outcomes = [
            ("stored", stats.stored),
            ("tier_move", stats.tier_moves),
            ("removed", stats.removed),
            ("skipped_unknown_parent", stats.skipped_unknown_parent),
            ("skipped_unkeyable", stats.skipped_unkeyable),
            ("skipped_salt_unknown", stats.skipped_salt_unknown),
            (
                "skipped_partition_conflict",
                stats.skipped_partition_conflict,
            ),
            ("skipped_group", stats.skipped_group),
            ("skipped_bad_length", stats.skipped_bad_length),
            ("evicted", stats.evicted),
            ("parked", stats.parked),
            ("unparked", stats.unparked),
            ("parked_dropped", stats.parked_dropped),
        ];
        for (label, n) in outcomes {
            m.blocks.add([label], n);
        }
    }

    /// Logs what the replica's KV cache groups are when they change, and
    /// warns when one is not modelled: its Picks are then upper bounds,
    /// answered `approximate` (`indexd_unmodelled_kv_groups`, `/readyz`).
    fn note_layout(&self, replica: &Replica, layout: &Layout) {
        let chunk = self.config.chunk_tokens(&replica.config.model);
        let unmodelled = layout.unmodelled(self.config.block_size.get(), chunk);
        let now = unmodelled
            .as_ref()
            .map(|u| format!("{}/{}", u.kind, u.reason))
            .unwrap_or_default();
        let mut reported = lock(&replica.layout_reported);
        let groups = describe_layout(layout);
        match &unmodelled {
            Some(u) if *reported != now => tracing::warn!(
                endpoint = %replica.id(),
                model = %replica.config.model,
                group = u.group,
                kind = %u.kind,
                reason = u.reason,
                groups = %groups,
                "replica has a KV cache group indexd does not model: its hits are estimated \
                 from the other groups and its Picks are answered approximate \
                 (indexd_unmodelled_kv_groups)"
            ),
            _ => tracing::info!(
                endpoint = %replica.id(),
                groups = %groups,
                "replica's KV cache groups"
            ),
        }
        *reported = now;
    }

    fn note_block_size(&self, replica: &Replica, block_size: u32) {
        replica.block_size_seen.store(block_size, Ordering::Relaxed);
        if block_size != self.config.block_size.get() {
            self.metrics.block_size_mismatch.inc(["event"]);
            if !replica.block_size_warned.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    endpoint = %replica.id(),
                    event_block_size = block_size,
                    configured = self.config.block_size.get(),
                    "replica's KV events use a different block size than configured: its blocks will not match"
                );
            }
        }
    }

    /// Per replica, its KV cache groups (`index:kind[/window]`) and the
    /// first one not modelled, if any (`/readyz`, `/metrics`).
    pub(crate) fn layouts(&self) -> Vec<(Arc<Replica>, String, Option<Unmodelled>)> {
        let replicas = read(&self.registry).all();
        let index = lock(&self.index);
        replicas
            .into_iter()
            .filter_map(|r| {
                let layout = index.layout(r.slot)?;
                let chunk = self.config.chunk_tokens(&r.config.model);
                let unmodelled = layout.unmodelled(self.config.block_size.get(), chunk);
                Some((r, describe_layout(&layout), unmodelled))
            })
            .collect()
    }

    /// True when some replica may be named in an answer.
    pub fn is_ready(&self) -> bool {
        read(&self.registry)
            .replicas
            .values()
            .any(|r| r.is_eligible())
    }
}

/// A layout as `0:sliding_window/256 1:full_attention` (block size when
/// it is not the first group's).
pub(crate) fn describe_layout(layout: &Layout) -> String {
    let mut out = String::new();
    for (i, g) in layout.groups() {
        if !out.is_empty() {
            out.push(' ');
        }
        let _ = write!(out, "{i}:{}", g.kind.label());
        if let Some(w) = g.sliding_window {
            let _ = write!(out, "/{w}");
        }
        let _ = write!(out, "@{}", g.block_size);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A replica of model `m`, never scraped.
    fn replica() -> Replica {
        Replica::new(
            EndpointConfig::new("10.0.0.1:8000".parse().expect("address"), "m"),
            ReplicaSlot(0),
            CancellationToken::new(),
        )
    }

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn picks_queue_behind_each_other_and_drain_with_time() {
        let t0 = Instant::now();
        let mut q = PickQueue::default();
        q.note(t0, t0, "a".into(), 300 * MS, 0);
        q.note(t0, t0, "b".into(), 200 * MS, 0);
        assert!((q.queued_seconds(t0) - 0.5).abs() < 1e-9);
        assert!((q.queued_seconds(t0 + 400 * MS) - 0.1).abs() < 1e-9);
        assert_eq!(q.queued_seconds(t0 + 600 * MS), 0.0);
        // A pick after the queue ran dry starts at once.
        q.note(t0 + 600 * MS, t0 + 600 * MS, "c".into(), 100 * MS, 0);
        assert!((q.queued_seconds(t0 + 600 * MS) - 0.1).abs() < 1e-9);
    }

    #[test]
    fn an_answer_takes_what_its_pick_had_left_out_of_the_queue() {
        let t0 = Instant::now();
        let mut q = PickQueue::default();
        q.note(t0, t0, "a".into(), 300 * MS, 0);
        q.note(t0, t0, "b".into(), 200 * MS, 0);
        // `b` answered 100 ms in, before its estimated start: all of its
        // 200 ms leave; `a` still has 200 ms.
        assert!(q.complete(t0 + 100 * MS, "b"));
        assert!((q.queued_seconds(t0 + 100 * MS) - 0.2).abs() < 1e-9);
        assert!(!q.complete(t0 + 100 * MS, "b"), "once");
        // `a` answered early: the queue is empty, never negative.
        assert!(q.complete(t0 + 150 * MS, "a"));
        assert_eq!(q.queued_seconds(t0 + 150 * MS), 0.0);
    }

    #[test]
    fn a_scrape_stops_counting_picks_but_leaves_their_prefill_queued() {
        let r = replica();
        let t0 = Instant::now();
        r.note_pick(t0, "a", 500 * MS, 0);
        let ttl = Duration::from_secs(5);
        assert_eq!(r.load(t0, ttl, 0).pending_picks, 1.0);
        r.scrape_ok(1.0, 0.0, 0.1, None, t0 + MS);
        let load = r.load(t0 + 100 * MS, ttl, 0);
        assert_eq!(load.pending_picks, 0.0);
        assert!((load.queued_seconds - 0.4).abs() < 1e-9);
    }

    #[test]
    fn picks_stand_for_the_blocks_they_allocate_until_answered_or_expired() {
        let r = replica();
        let (t0, ttl) = (Instant::now(), Duration::from_secs(5));
        assert_eq!(r.load(t0, ttl, 0).cache_blocks, None);
        r.scrape_ok(0.0, 0.0, 0.0, Some(86.0), t0);
        r.note_pick(t0, "a", 100 * MS, 30);
        r.note_pick(t0 + MS, "b", 100 * MS, 12);
        r.note_pick(t0 + MS, "c", 100 * MS, 0);
        let load = r.load(t0 + MS, ttl, 0);
        assert_eq!((load.cache_blocks, load.demand_blocks), (Some(86.0), 42.0));
        // A scrape shows them (they leave the pending count); one is
        // running: the oldest, whose blocks are allocated (in the usage).
        r.scrape_ok(1.0, 2.0, 0.5, Some(86.0), t0 + 2 * MS);
        assert_eq!(r.load(t0 + 2 * MS, ttl, 0).demand_blocks, 12.0);
        r.scrape_ok(0.0, 3.0, 0.5, Some(86.0), t0 + 2 * MS);
        assert_eq!(r.load(t0 + 2 * MS, ttl, 0).demand_blocks, 42.0);
        assert!(
            r.complete_pick(t0 + 3 * MS, "a"),
            "found by its blocks alone"
        );
        assert_eq!(r.load(t0 + 3 * MS, ttl, 0).demand_blocks, 12.0);
        // Unanswered past the TTL: forgotten.
        assert_eq!(r.load(t0 + ttl + 2 * MS, ttl, 0).demand_blocks, 0.0);
    }

    #[test]
    fn the_load_keeps_the_waiting_of_the_scrape_before() {
        let r = replica();
        let (t0, ttl) = (Instant::now(), Duration::from_secs(5));
        let waiting = |r: &Replica| {
            let l = r.load(t0, ttl, 0);
            (l.waiting, l.waiting_before)
        };
        assert_eq!(waiting(&r), (0.0, 0.0));
        r.scrape_ok(1.0, 3.0, 0.1, None, t0);
        assert_eq!(waiting(&r), (3.0, 0.0), "one scrape: no queue seen before");
        r.scrape_ok(1.0, 2.0, 0.1, None, t0);
        assert_eq!(waiting(&r), (2.0, 3.0));
        // A failed scrape changes neither.
        r.scrape_failed(3);
        assert_eq!(waiting(&r), (2.0, 3.0));
    }
}
