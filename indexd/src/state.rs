//! Shared state: the replica registry, the index and the side tables, with
//! one owner each.
//!
//! - `index`: [`SharedIndex`], the writer's side behind a `Mutex` that only
//!   its own methods take: subscribers apply one batch at a time and publish
//!   it; the snapshot writer, discovery and `/metrics` read it. Never held
//!   across `.await`. Picks never take it.
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
//! - `snapshots` ([`crate::snapshot`]): the snapshot's replicas not
//!   registered yet behind a short `Mutex`, taken when a replica is added;
//!   restoring its blocks then takes the `index` lock once (start-up or
//!   discovery, not the request path). The snapshot writer reads the index
//!   one replica at a time, in a blocking task; a second `Mutex` there
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

use std::fmt::Write as _;
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use rand::SeedableRng;
use rand::rngs::StdRng;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::affinity::{Affinity, Approximate};
use crate::auth::{Guarded, Token};
use crate::config::{Config, EndpointConfig};
use crate::conversations::Conversations;
use crate::event::{EventBatch, KvEvent};
use crate::ids::EndpointId;
use crate::index::layout::Unmodelled;
use crate::index::{Applied, ApplyStats, Index, Layout, Lookup, SharedIndex};
use crate::metrics::Metrics;
use crate::ratelimit::TokenBucket;
pub(crate) use crate::score::Registry;
pub use crate::score::Replica;
use crate::snapshot::{Snapshots, Source};
use crate::sync::{WarnGate, lock, read, write};
use crate::tokenize::{Replicas, Tokenizers};

/// Picks that went on by load because their body was not tokenized where a
/// tokenizer should have: none could answer, the local one does not
/// reproduce the request and no replica did, or it was over the tokenizer's
/// budget. Bodies vLLM refuses (the client's error), callers gone and
/// admission refusals (counted and logged by admission) are not noted here.
/// Every one is counted in `indexd_decisions_total{decision="untokenized"}`.
#[derive(Debug, Default)]
pub(crate) struct Untokenized {
    warning: WarnGate,
    /// How many since start, and the last one: when, its model and reason.
    noted: Mutex<Option<(u64, std::time::Instant, String, String)>>,
}

impl Untokenized {
    /// Notes a Pick for `model` not tokenized for `error`, if it is one this
    /// record keeps; logs it unless one was logged in the last 10 s.
    pub(crate) fn note(&self, model: &str, error: &crate::tokenize::TokenizeError) {
        use crate::tokenize::TokenizeError as E;
        if matches!(error, E::Refused { .. } | E::Cancelled | E::Busy(_)) {
            tracing::debug!(model, error = %error, "Pick body not tokenized");
            return;
        }
        {
            let mut noted = lock(&self.noted);
            let count = noted.as_ref().map_or(0, |n| n.0).saturating_add(1);
            *noted = Some((
                count,
                std::time::Instant::now(),
                model.to_owned(),
                error.to_string(),
            ));
        }
        if self.warning.open() {
            tracing::warn!(
                model,
                error = %error,
                "Pick body not tokenized: routed by load (logged at most every 10 s; \
                 indexd_decisions_total{{decision=\"untokenized\"}} counts them, /readyz names the last)"
            );
        }
    }

    /// The `/readyz` line: how many since start and the last one's reason.
    pub(crate) fn describe(&self, now: std::time::Instant) -> Option<String> {
        let noted = lock(&self.noted);
        let (count, at, model, reason) = noted.as_ref()?;
        Some(format!(
            "untokenized Picks: {count} since start went on by load with no ids; the last {:.0} s ago, model {model}: {reason}",
            now.saturating_duration_since(*at).as_secs_f64()
        ))
    }
}

/// Everything the tasks and handlers share.
#[derive(Debug)]
pub struct Shared {
    /// The configuration indexd started with.
    pub(crate) config: Config,
    /// The block index (the writer's side).
    pub(crate) index: SharedIndex,
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
    /// Snapshots: their settings, a loaded snapshot's replicas (restored
    /// when they are registered) and the writers' lock.
    pub(crate) snapshots: Snapshots,
    /// The runtime the subscriptions run on, apart from the request path
    /// (unset: the current one).
    pub(crate) ingest: OnceLock<tokio::runtime::Handle>,
    /// Local tokenizers and the replica fallback (read-only after start;
    /// each model's gate and cache synchronise themselves).
    pub(crate) tokenizers: Arc<Tokenizers>,
    /// The shared token every call must carry, if configured.
    pub(crate) token: Option<Token>,
    /// The Observe rate limit.
    pub(crate) observe_bucket: Mutex<TokenBucket>,
    /// Warnings about Picks the index cannot answer (block size, key
    /// scheme): each such Pick is counted, the log says so once per 10 s.
    pub(crate) pick_warning: WarnGate,
    /// Picks whose body no tokenizer could turn into ids (they go on by
    /// load): the last one for `/readyz`, the log once per 10 s.
    pub(crate) untokenized: Untokenized,
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

impl Replicas for Shared {
    fn serving(&self, model: &str) -> Vec<std::net::SocketAddr> {
        read(&self.registry)
            .all()
            .into_iter()
            .filter(|r| r.serves(model) && r.is_healthy())
            .map(|r| r.id().address)
            .collect()
    }
}

impl Source for Shared {
    fn snapshots(&self) -> &Snapshots {
        &self.snapshots
    }

    fn index(&self) -> &SharedIndex {
        &self.index
    }

    fn replicas(&self) -> Vec<Arc<Replica>> {
        read(&self.registry).all()
    }

    fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    fn shutdown(&self) -> &CancellationToken {
        &self.shutdown
    }
}

impl Guarded for Shared {
    fn token(&self) -> Option<&Token> {
        self.token.as_ref()
    }

    fn auth_failures(&self) -> &crate::metrics::CounterVec<1> {
        &self.metrics.auth_failures
    }
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
            index: SharedIndex::new(index),
            registry: RwLock::new(Registry::default()),
            affinity: Mutex::new(Affinity::new(config.affinity_capacity, config.affinity_ttl)),
            approximate: Mutex::new(Approximate::new(config.approximate_capacity)),
            conversations: Mutex::new(Conversations::default()),
            metrics: Metrics::new(),
            rng: Mutex::new(rng),
            shutdown,
            tasks: TaskTracker::new(),
            snapshots: Snapshots::new(config.snapshot.clone(), config.block_size.get()),
            ingest: OnceLock::new(),
            tokenizers: Arc::new(Tokenizers::none()),
            token: None,
            observe_bucket: Mutex::new(TokenBucket::new(
                config.access.observe_rate,
                config.access.observe_burst,
            )),
            pick_warning: WarnGate::default(),
            untokenized: Untokenized::default(),
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
        self.tokenizers = Arc::new(tokenizers);
        self
    }

    /// Registers an endpoint; `None` if it is already known.
    pub fn add_replica(&self, config: EndpointConfig) -> Option<Arc<Replica>> {
        let replica = write(&self.registry).add(config, &self.shutdown, self.config.join_warmup)?;
        crate::snapshot::restore(self, &replica);
        Some(replica)
    }

    /// Registers an endpoint as one joining its model's running fleet
    /// (tests: however recently the others registered).
    #[cfg(test)]
    pub(crate) fn add_joiner(&self, config: EndpointConfig) -> Option<Arc<Replica>> {
        write(&self.registry).add_joiner(config, &self.shutdown, self.config.join_warmup)
    }

    /// Unregisters an endpoint, stops its tasks and drops its entries.
    pub(crate) fn remove_replica(&self, id: &EndpointId) -> bool {
        let Some(replica) = write(&self.registry).remove(id) else {
            return false;
        };
        replica.cancel.cancel();
        self.index.remove_replica(replica.slot);
        lock(&self.approximate).forget_replica(replica.slot);
        self.metrics.purges.inc(["removed"]);
        true
    }

    /// Forgets what `replica` holds.
    pub(crate) fn purge(&self, replica: &Replica, reason: &'static str) {
        self.index.purge(replica.slot);
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
                        replica.note_lora(lora);
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
        let layout = self.index.apply_batch(
            replica.slot,
            &replica.config.model,
            batch.events,
            applied,
            &mut stats,
        );
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
        replica.report_layout(now, unmodelled.as_ref(), &describe_layout(layout));
    }

    fn note_block_size(&self, replica: &Replica, block_size: u32) {
        if !replica.note_block_size(block_size, self.config.block_size.get()) {
            self.metrics.block_size_mismatch.inc(["event"]);
        }
    }

    /// Per replica, its KV cache groups (`index:kind[/window]`) and the
    /// first one not modelled, if any (`/readyz`, `/metrics`).
    pub(crate) fn layouts(&self) -> Vec<(Arc<Replica>, String, Option<Unmodelled>)> {
        let replicas = read(&self.registry).all();
        replicas
            .into_iter()
            .filter_map(|r| {
                let layout = self.index.layout(r.slot)?;
                let chunk = self.config.chunk_tokens(&r.config.model);
                let unmodelled = layout.unmodelled(self.config.block_size.get(), chunk);
                Some((r, describe_layout(&layout), unmodelled))
            })
            .collect()
    }

    /// True when some replica may be named in an answer.
    pub fn is_ready(&self) -> bool {
        read(&self.registry).all().iter().any(|r| r.is_eligible())
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
