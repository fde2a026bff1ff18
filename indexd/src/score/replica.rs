//! One replica as the cost model sees it ([`Replica`]): its scraped load,
//! its fitted prefill speed ([`Fitted`]), the picks sent to it and the
//! prefill queue they make there ([`PickQueue`]); and the [`Registry`] of
//! the replicas indexd knows. [`Replica::load`] is the cost model's input.

use std::collections::{BTreeSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::Load;
use crate::calibrate::{self, Calibration, PrefillCounters, PrefillSpeed, Sums};
use crate::config::EndpointConfig;
use crate::ids::{EndpointId, ReplicaSlot};
use crate::index::Applied;
use crate::index::layout::Unmodelled;
use crate::sync::{WarnGate, lock};

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
    /// When it last got a new conversation, in milliseconds after
    /// `registered` ([`NEVER`]: none yet), read on every new conversation's
    /// Pick, for each candidate, without a lock.
    last_new_conversation: AtomicU64,
    /// When it was registered.
    pub(super) registered: Instant,
    /// Until when it fills with new conversations only, no moved ones: it
    /// joined its model's running fleet ([`Registry::add`]).
    pub(super) filling_until: Option<Instant>,
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
/// `last_new_conversation` of a replica that has had none.
const NEVER: u64 = u64::MAX;
/// A replica registered this long after another of its model joins a
/// running fleet; the ones discovery finds at start come within a second.
pub(crate) const JOINS_AFTER: Duration = Duration::from_secs(5);
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
    pub(crate) fn new(
        config: EndpointConfig,
        slot: ReplicaSlot,
        cancel: CancellationToken,
    ) -> Self {
        let registered = Instant::now();
        Self {
            registered,
            filling_until: None,
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
            last_new_conversation: AtomicU64::new(NEVER),
        }
    }

    /// Takes one scrape's prefill counters, scraped at `at`, into the fit of
    /// its speed; the speed in use holds outliers back
    /// ([`Calibration::observe_near`]). [`Replica::settle`] then publishes.
    pub(crate) fn calibrate(&self, counters: PrefillCounters, at: Instant) {
        let mut f = lock(&self.calibration);
        // An idle interval adds nothing; a restart resets the fit.
        let standing = f.speed;
        f.fit.observe_near(counters, Some(at), standing);
    }

    /// Its own evidence ([`Registry::settle_prefill`] pools it).
    pub(crate) fn prefill_sums(&self) -> Sums {
        lock(&self.calibration).fit.sums()
    }

    /// Its own fit (None: not enough evidence yet) and its samples.
    pub(crate) fn own_prefill(&self, prior: f64) -> (Option<PrefillSpeed>, u32) {
        let f = lock(&self.calibration);
        (f.fit.speed(prior), f.fit.sums().samples)
    }

    /// Publishes the speed the cost model uses for it: its own fit shrunk
    /// toward its model's `pooled` one ([`calibrate::settle`]; `prior`: the
    /// configured tokens per second).
    pub(crate) fn settle(&self, pooled: Option<PrefillSpeed>, prior: f64) {
        let mut f = lock(&self.calibration);
        let own = f.fit.speed(prior);
        let samples = f.fit.sums().samples;
        f.speed = calibrate::settle(own, samples, pooled, f.speed);
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
                own_tokens_per_second = own.map(|o| o.tokens_per_second.round()),
                own_samples = samples,
                pooled_tokens_per_second = pooled.map(|p| p.tokens_per_second.round()),
                prior,
                "prefill speed calibrated from the replica's metrics and its model's"
            );
        }
    }

    /// The prefill speed the cost model uses for it (None: no evidence for
    /// its model yet; the prior applies).
    pub(crate) fn prefill_speed(&self) -> Option<PrefillSpeed> {
        lock(&self.calibration).speed
    }

    /// Whether it still fills with new conversations only at `now` (no
    /// conversation moves there to fill it).
    pub(crate) fn filling(&self, now: Instant) -> bool {
        self.filling_until.is_some_and(|until| now < until)
    }

    /// How long it goes on filling with new conversations before moves may
    /// reach it (`join_warmup`; None: it is not filling).
    pub(crate) fn filling_for(&self, now: Instant) -> Option<Duration> {
        self.filling_until
            .filter(|until| now < *until)
            .map(|until| until.saturating_duration_since(now))
    }

    /// Notes that a new conversation was sent to it at `now`.
    pub(crate) fn note_new_conversation(&self, now: Instant) {
        let ms = now.saturating_duration_since(self.registered).as_millis();
        self.last_new_conversation.store(
            u64::try_from(ms).unwrap_or(NEVER).min(NEVER - 1),
            Ordering::Relaxed,
        );
    }

    /// Whether it has been sent a new conversation since it was registered.
    pub(crate) fn had_new_conversation(&self) -> bool {
        self.last_new_conversation.load(Ordering::Relaxed) != NEVER
    }

    /// How long it has gone without a new conversation as of `now` (since it
    /// was registered, if it never had one).
    pub(crate) fn without_new_conversation(&self, now: Instant) -> Duration {
        let ms = match self.last_new_conversation.load(Ordering::Relaxed) {
            NEVER => 0,
            ms => ms,
        };
        let last = self
            .registered
            .checked_add(Duration::from_millis(ms))
            .unwrap_or(self.registered);
        now.saturating_duration_since(last)
    }

    /// True at most once per 10 s: bad input from one replica is counted
    /// always but logged sparingly.
    pub(crate) fn may_warn(&self) -> bool {
        self.warning.open()
    }

    /// Notes a LoRA adapter its events name (at most [`MAX_LORAS`]).
    pub(crate) fn note_lora(&self, lora: &str) {
        let mut loras = lock(&self.loras);
        if loras.len() < MAX_LORAS && !loras.contains(lora) {
            loras.insert(lora.to_owned());
        }
    }

    /// Notes the block size its events carry; false (and a warning, the
    /// first time) when it is not the `configured` one: its blocks will not
    /// match.
    pub(crate) fn note_block_size(&self, seen: u32, configured: u32) -> bool {
        self.block_size_seen.store(seen, Ordering::Relaxed);
        if seen == configured {
            return true;
        }
        if !self.block_size_warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                endpoint = %self.id(),
                event_block_size = seen,
                configured,
                "replica's KV events use a different block size than configured: its blocks will not match"
            );
        }
        false
    }

    /// Logs its KV cache groups (`groups`) when the group indexd does not
    /// model changes (`now`: `kind/reason` of it, or empty): a warning
    /// naming it, else the groups at info.
    pub(crate) fn report_layout(&self, now: String, unmodelled: Option<&Unmodelled>, groups: &str) {
        let mut reported = lock(&self.layout_reported);
        match unmodelled {
            Some(u) if *reported != now => tracing::warn!(
                endpoint = %self.id(),
                model = %self.config.model,
                group = u.group,
                kind = %u.kind,
                reason = u.reason,
                groups = %groups,
                "replica has a KV cache group indexd does not model: its hits are estimated \
                 from the other groups and its Picks are answered approximate \
                 (indexd_unmodelled_kv_groups)"
            ),
            _ => tracing::info!(
                endpoint = %self.id(),
                groups = %groups,
                "replica's KV cache groups"
            ),
        }
        *reported = now;
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

#[cfg(test)]
#[path = "replica_tests.rs"]
mod tests;
