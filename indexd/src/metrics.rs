//! Prometheus metrics: counters and one histogram, rendered as text.
//!
//! Hand-rolled (atomics and small maps keyed by static labels) so the hot
//! paths cost an atomic add or one short lock.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A counter family keyed by `N` static label values.
#[derive(Debug)]
pub struct CounterVec<const N: usize> {
    name: &'static str,
    help: &'static str,
    labels: [&'static str; N],
    values: Mutex<BTreeMap<[&'static str; N], u64>>,
}

impl<const N: usize> CounterVec<N> {
    pub(crate) const fn new(
        name: &'static str,
        help: &'static str,
        labels: [&'static str; N],
    ) -> Self {
        Self {
            name,
            help,
            labels,
            values: Mutex::new(BTreeMap::new()),
        }
    }

    /// Adds `n` to the series with `values`.
    pub fn add(&self, values: [&'static str; N], n: u64) {
        if n == 0 {
            return;
        }
        let mut map = self
            .values
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *map.entry(values).or_insert(0) += n;
    }

    /// Adds one.
    pub fn inc(&self, values: [&'static str; N]) {
        self.add(values, 1);
    }

    /// The current value of one series.
    pub fn get(&self, values: [&'static str; N]) -> u64 {
        let map = self
            .values
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        map.get(&values).copied().unwrap_or(0)
    }

    /// The sum over every label set.
    pub fn total(&self) -> u64 {
        let map = self
            .values
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        map.values().sum()
    }

    pub(crate) fn render(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "# HELP {} {}\n# TYPE {} counter",
            self.name, self.help, self.name
        );
        let map = self
            .values
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for (values, n) in map.iter() {
            let labels: Vec<String> = self
                .labels
                .iter()
                .zip(values)
                .map(|(k, v)| format!("{k}=\"{v}\""))
                .collect();
            let _ = writeln!(out, "{}{{{}}} {n}", self.name, labels.join(","));
        }
    }
}

/// A plain counter.
#[derive(Debug)]
pub struct Counter {
    name: &'static str,
    help: &'static str,
    value: AtomicU64,
}

impl Counter {
    pub(crate) const fn new(name: &'static str, help: &'static str) -> Self {
        Self {
            name,
            help,
            value: AtomicU64::new(0),
        }
    }

    /// Adds `n`.
    pub fn add(&self, n: u64) {
        self.value.fetch_add(n, Ordering::Relaxed);
    }

    /// Adds one.
    pub fn inc(&self) {
        self.add(1);
    }

    /// The current value.
    pub fn get(&self) -> u64 {
        self.value.load(Ordering::Relaxed)
    }

    pub(crate) fn render(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "# HELP {0} {1}\n# TYPE {0} counter\n{0} {2}",
            self.name,
            self.help,
            self.get()
        );
    }
}

/// A gauge holding the last value set.
#[derive(Debug)]
pub struct Gauge {
    name: &'static str,
    help: &'static str,
    bits: AtomicU64,
}

impl Gauge {
    pub(crate) const fn new(name: &'static str, help: &'static str) -> Self {
        Self {
            name,
            help,
            bits: AtomicU64::new(0),
        }
    }

    /// Sets the value.
    pub fn set(&self, value: f64) {
        self.bits.store(value.to_bits(), Ordering::Relaxed);
    }

    /// The current value.
    pub fn get(&self) -> f64 {
        f64::from_bits(self.bits.load(Ordering::Relaxed))
    }

    pub(crate) fn render(&self, out: &mut String) {
        gauge(out, self.name, self.help, self.get());
    }
}

/// Upper bounds in seconds: fine where a Pick lands (tens of µs), coarser
/// up to 100 ms.
const LATENCY_BUCKETS: [f64; 20] = [
    5e-6, 1e-5, 1.5e-5, 2e-5, 2.5e-5, 3e-5, 4e-5, 5e-5, 7.5e-5, 1e-4, 1.5e-4, 2.5e-4, 5e-4, 1e-3,
    2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 1e-1,
];

/// A latency histogram with fixed buckets (5 µs … 100 ms).
#[derive(Debug)]
pub struct Histogram {
    name: &'static str,
    help: &'static str,
    buckets: [AtomicU64; LATENCY_BUCKETS.len()],
    count: AtomicU64,
    sum_nanos: AtomicU64,
}

impl Histogram {
    pub(crate) const fn new(name: &'static str, help: &'static str) -> Self {
        Self {
            name,
            help,
            buckets: [const { AtomicU64::new(0) }; LATENCY_BUCKETS.len()],
            count: AtomicU64::new(0),
            sum_nanos: AtomicU64::new(0),
        }
    }

    /// Records one observation.
    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        for (b, le) in self.buckets.iter().zip(LATENCY_BUCKETS) {
            if secs <= le {
                b.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    pub(crate) fn render(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "# HELP {0} {1}\n# TYPE {0} histogram",
            self.name, self.help
        );
        for (b, le) in self.buckets.iter().zip(LATENCY_BUCKETS) {
            let _ = writeln!(
                out,
                "{}_bucket{{le=\"{le}\"}} {}",
                self.name,
                b.load(Ordering::Relaxed)
            );
        }
        let count = self.count();
        let sum = self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(
            out,
            "{0}_bucket{{le=\"+Inf\"}} {count}\n{0}_sum {sum}\n{0}_count {count}",
            self.name
        );
    }
}

/// Every metric indexd exports.
#[derive(Debug)]
pub struct Metrics {
    /// KV events by type.
    pub events: CounterVec<1>,
    /// Payload batches applied.
    pub batches: Counter,
    /// Blocks by what happened to them.
    pub blocks: CounterVec<1>,
    /// Sequence gaps detected.
    pub gaps: Counter,
    /// Replays by result.
    pub replays: CounterVec<1>,
    /// Replica purges by reason.
    pub purges: CounterVec<1>,
    /// Frames or payloads that failed to decode, by kind.
    pub decode_errors: CounterVec<1>,
    /// Live batches skipped as already replayed.
    pub duplicates: Counter,
    /// Candidates whose matched blocks the cost model expects evicted, in
    /// part or whole, before the request is admitted.
    pub eviction_discounts: Counter,
    /// Pick latency.
    pub pick_latency: Histogram,
    /// Pick decisions by kind and reason.
    pub decisions: CounterVec<2>,
    /// Block-size mismatches by where they were seen.
    pub block_size_mismatch: CounterVec<1>,
    /// Picks by what they did to their conversation
    /// ([`crate::conversations`]): a new one, a turn on the replica of the
    /// conversation's previous one, or a move.
    pub conversation_turns: CounterVec<1>,
    /// The chosen replica's matched blocks by where the match came from:
    /// the replica's own events, or this indexd's picks not yet confirmed.
    pub chosen_blocks: CounterVec<1>,
    /// Metrics scrapes by result.
    pub scrapes: CounterVec<1>,
    /// Batches whose data_parallel_rank differs from the endpoint's.
    pub rank_mismatch: Counter,
    /// Picks whose block keys use another key scheme than indexd's.
    pub key_scheme_mismatch: Counter,
    /// Observe calls by result: recorded, or why not (refused ones too:
    /// rate_limited, unknown_endpoint, model_not_served, invalid).
    pub observes: CounterVec<1>,
    /// Calls refused for a missing or wrong token, by listener.
    pub auth_failures: CounterVec<1>,
    /// Discovery file reloads by result.
    pub discovery: CounterVec<1>,
    /// `previous_response_id` lookups by result (hit, or why not).
    pub affinity_lookups: CounterVec<1>,
    pub continued: CounterVec<1>,
    /// New conversations sent to a replica that had none for
    /// `starve_after` and lost them only on its speed estimate, or that
    /// joined the fleet and had none yet.
    pub explorations: Counter,
    /// New conversations sent to a replica with fewer conversations than
    /// the cheapest, at a cost within `balance_margin` of it.
    pub balanced: Counter,
    /// Picks whose match was taken again under the placement lock, a
    /// concurrent Pick having credited blocks since.
    pub rematches: Counter,
    /// Picks whose cheapest candidate holds less than another (a move away
    /// from the warm replica): `moved` when it paid, `held` when not.
    pub moves: CounterVec<1>,
    pub moves_barred: CounterVec<1>,
    /// Replays asked for, by where they start (start, snapshot, gap).
    pub replay_requests: CounterVec<1>,
    /// Replicas resumed from a snapshot (proven) or not, and why.
    pub snapshot_resumes: CounterVec<1>,
    /// Snapshot writes by result.
    pub snapshot_writes: CounterVec<1>,
    /// Snapshot loads at start by result.
    pub snapshot_loads: CounterVec<1>,
    /// Size of the last snapshot written.
    pub snapshot_bytes: Gauge,
    /// Duration of the last snapshot write.
    pub snapshot_write_seconds: Gauge,
    /// Entries restored from the snapshot at start.
    pub snapshot_loaded_entries: Gauge,
    /// ZMTP connections closed (or refused) for what the peer did, by reason.
    pub zmtp_violations: CounterVec<1>,
    /// Kubernetes watch events by resource and event (list, apply, delete,
    /// error).
    pub kubernetes_events: CounterVec<2>,
    /// Endpoints Kubernetes discovery derived at its last change.
    pub kubernetes_endpoints: Gauge,
    /// Ready addresses Kubernetes discovery left out at its last change.
    pub kubernetes_skipped: Gauge,
    /// Discovered (or added) endpoints refused, by reason.
    pub endpoints_refused: CounterVec<1>,
    /// HTTP connections closed at accept: `http_max_connections` were open.
    pub http_connections_refused: Counter,
    /// HTTP connections closed by a timeout, by phase (header, idle), and
    /// request bodies cut off (body).
    pub http_timeouts: CounterVec<1>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// All zero.
    pub const fn new() -> Self {
        Self {
            events: CounterVec::new(
                "indexd_events_total",
                "KV events received, by type.",
                ["type"],
            ),
            batches: Counter::new("indexd_batches_total", "KV event batches applied."),
            blocks: CounterVec::new(
                "indexd_blocks_total",
                "Blocks by outcome (stored, tier_move, removed, skipped_*, evicted).",
                ["outcome"],
            ),
            gaps: Counter::new(
                "indexd_seq_gaps_total",
                "Sequence gaps detected in live streams.",
            ),
            replays: CounterVec::new("indexd_replays_total", "Replays by result.", ["result"]),
            purges: CounterVec::new(
                "indexd_purges_total",
                "Replica purges by reason.",
                ["reason"],
            ),
            decode_errors: CounterVec::new(
                "indexd_decode_errors_total",
                "Frames or payloads rejected by the decoder, by kind.",
                ["kind"],
            ),
            duplicates: Counter::new(
                "indexd_duplicate_batches_total",
                "Live batches skipped because a replay already applied them.",
            ),
            eviction_discounts: Counter::new(
                "indexd_eviction_discounts_total",
                "Pick candidates whose matched blocks the cost model expects evicted (in part or whole) before the request is admitted: the queue ahead needs more than the cache's other free blocks.",
            ),
            pick_latency: Histogram::new("indexd_pick_latency_seconds", "Time to answer a Pick."),
            decisions: CounterVec::new(
                "indexd_decisions_total",
                "Pick decisions by kind and reason.",
                ["decision", "reason"],
            ),
            conversation_turns: CounterVec::new(
                "indexd_conversation_turns_total",
                "Picks by what they did to their conversation: new, stayed (the replica of its previous turn), moved, resumed (a continuation by its body whose earlier turns this indexd did not follow: another gateway's, or idle past its memory).",
                ["turn"],
            ),
            chosen_blocks: CounterVec::new(
                "indexd_chosen_matched_blocks_total",
                "Matched blocks of the replica each precise Pick chose, by source: indexed (the replica's KV events showed them) or speculative (this indexd's own recent picks sent them there; its events had not shown them yet).",
                ["source"],
            ),
            block_size_mismatch: CounterVec::new(
                "indexd_block_size_mismatch_total",
                "Block sizes differing from the configured one, by source (event, pick).",
                ["source"],
            ),
            scrapes: CounterVec::new(
                "indexd_scrapes_total",
                "Replica /metrics scrapes by result.",
                ["result"],
            ),
            rank_mismatch: Counter::new(
                "indexd_rank_mismatch_total",
                "Batches whose data_parallel_rank differs from the endpoint's.",
            ),
            key_scheme_mismatch: Counter::new(
                "indexd_key_scheme_mismatch_total",
                "Picks whose block keys use another key scheme than indexd's (ranked by load only): upgrade the filter and indexd together.",
            ),
            observes: CounterVec::new(
                "indexd_observes_total",
                "Observe calls by result.",
                ["result"],
            ),
            auth_failures: CounterVec::new(
                "indexd_auth_failures_total",
                "Calls refused for a missing or wrong token, by listener.",
                ["listener"],
            ),
            discovery: CounterVec::new(
                "indexd_discovery_reloads_total",
                "Discovery file reloads by result: ok, error (did not parse: the previous endpoints stay), empty (taken for a write in progress: nothing changes).",
                ["result"],
            ),
            moves: CounterVec::new(
                "indexd_moves_total",
                "Picks whose cheapest replica holds less than another: moved (the saving paid the re-prefill), held (it did not: the warm replica stayed first) or barred (it did, but the conversation moved a moment ago or the target is still filling with new conversations: the warm replica stayed first; see indexd_moves_barred_total).",
                ["result"],
            ),
            moves_barred: CounterVec::new(
                "indexd_moves_barred_total",
                "Moves that would have paid but were not made, by reason: cooldown (the conversation changed replica within move_cooldown), joining (the target joined within join_warmup and is still filling with new conversations).",
                ["reason"],
            ),
            affinity_lookups: CounterVec::new(
                "indexd_affinity_lookups_total",
                "previous_response_id lookups by result (hit, unknown, model_mismatch, replica_gone, model_not_served, unhealthy, stale).",
                ["result"],
            ),
            continued: CounterVec::new(
                "indexd_continued_total",
                "Requests a filter routed without a Pick (local_continuations), as later Picks report them: noted as queued work on their replica, skipped (no such replica, a bad id) or expired (older than pending_pick_ttl).",
                ["result"],
            ),
            explorations: Counter::new(
                "indexd_explorations_total",
                "New conversations sent, against the cost model's first choice, to a replica that had none for starve_after while others of its model did, and that would have cost no more at the first choice's prefill speed (its speed estimate alone kept them from it), or to a replica that joined its model's running fleet and had none yet.",
            ),
            balanced: Counter::new(
                "indexd_balanced_total",
                "New conversations sent, against the cost model's first choice, to a replica holding fewer of this indexd's conversations at a cost within weights.balance_margin of it: a near tie on the first turn's cost, where the conversation's later turns load the replica it joins.",
            ),
            rematches: Counter::new(
                "indexd_pick_rematches_total",
                "Picks whose prefix match was taken again under the placement lock because another Pick had credited blocks speculatively since it was taken (conversations starting together).",
            ),
            replay_requests: CounterVec::new(
                "indexd_replay_requests_total",
                "Replays asked for, by where they start: start (seq 0), snapshot (a snapshot's saved seq), gap.",
                ["from"],
            ),
            snapshot_resumes: CounterVec::new(
                "indexd_snapshot_resumes_total",
                "Replicas restored from a snapshot, by whether the replay proved it (proven, proven_partial) or not (gone, restarted, unreadable, unavailable).",
                ["result"],
            ),
            snapshot_writes: CounterVec::new(
                "indexd_snapshot_writes_total",
                "Snapshot writes by result (ok, truncated, timeout, error).",
                ["result"],
            ),
            snapshot_loads: CounterVec::new(
                "indexd_snapshot_loads_total",
                "Snapshot loads at start by result (ok, missing, corrupt, version, too_old, too_large, foreign, error).",
                ["result"],
            ),
            snapshot_bytes: Gauge::new(
                "indexd_snapshot_bytes",
                "Size of the last snapshot written, in bytes.",
            ),
            snapshot_write_seconds: Gauge::new(
                "indexd_snapshot_write_seconds",
                "Duration of the last snapshot write (capture, encode, write, fsync, rename).",
            ),
            snapshot_loaded_entries: Gauge::new(
                "indexd_snapshot_loaded_entries",
                "Block entries restored from the snapshot at start.",
            ),
            zmtp_violations: CounterVec::new(
                "indexd_zmtp_violations_total",
                "ZMTP connections closed or refused for a protocol violation, by reason.",
                ["reason"],
            ),
            kubernetes_events: CounterVec::new(
                "indexd_kubernetes_events_total",
                "Kubernetes watch events by resource and event: list (a full list began: at start and after 410 Gone), apply, delete, error.",
                ["resource", "event"],
            ),
            kubernetes_endpoints: Gauge::new(
                "indexd_kubernetes_endpoints",
                "Endpoints derived from the watched Kubernetes objects at the last change.",
            ),
            kubernetes_skipped: Gauge::new(
                "indexd_kubernetes_skipped_addresses",
                "Ready addresses left out at the last change (no model, a bad annotation, a missing named port).",
            ),
            endpoints_refused: CounterVec::new(
                "indexd_endpoints_refused_total",
                "Endpoints refused, by reason: self (the address is indexd's own HTTP listener, where a forwarded tokenize request would loop back; a discovered one counts when it first appears in the list).",
                ["reason"],
            ),
            http_connections_refused: Counter::new(
                "indexd_http_connections_refused_total",
                "HTTP connections closed as soon as accepted: http_max_connections were open.",
            ),
            http_timeouts: CounterVec::new(
                "indexd_http_timeouts_total",
                "HTTP timeouts by phase: header (a request head not complete within http_header_read_timeout of its first byte), idle (no request for http_idle_timeout, or a response not read), body (a request body not complete within http_body_read_timeout). header and idle close the connection.",
                ["phase"],
            ),
        }
    }

    /// Renders the counters (gauges are appended by the caller).
    pub fn render(&self, out: &mut String) {
        self.events.render(out);
        self.batches.render(out);
        self.blocks.render(out);
        self.gaps.render(out);
        self.replays.render(out);
        self.purges.render(out);
        self.decode_errors.render(out);
        self.duplicates.render(out);
        self.eviction_discounts.render(out);
        self.pick_latency.render(out);
        self.decisions.render(out);
        self.block_size_mismatch.render(out);
        self.conversation_turns.render(out);
        self.chosen_blocks.render(out);
        self.scrapes.render(out);
        self.rank_mismatch.render(out);
        self.key_scheme_mismatch.render(out);
        self.observes.render(out);
        self.auth_failures.render(out);
        self.discovery.render(out);
        self.affinity_lookups.render(out);
        self.continued.render(out);
        self.explorations.render(out);
        self.balanced.render(out);
        self.rematches.render(out);
        self.moves.render(out);
        self.moves_barred.render(out);
        self.replay_requests.render(out);
        self.snapshot_resumes.render(out);
        self.snapshot_writes.render(out);
        self.snapshot_loads.render(out);
        self.snapshot_bytes.render(out);
        self.snapshot_write_seconds.render(out);
        self.snapshot_loaded_entries.render(out);
        self.zmtp_violations.render(out);
        self.kubernetes_events.render(out);
        self.kubernetes_endpoints.render(out);
        self.kubernetes_skipped.render(out);
        self.endpoints_refused.render(out);
        self.http_connections_refused.render(out);
        self.http_timeouts.render(out);
    }
}

/// A label value as the text format writes it: backslash, double quote
/// and line feed escaped, everything else (UTF-8 included) as it is.
pub fn label_value(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Appends one gauge.
pub fn gauge(out: &mut String, name: &str, help: &str, value: f64) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative_and_sum_is_exact() {
        let h = Histogram::new("t_latency_seconds", "test");
        for micros in [3, 12, 38, 38, 90, 2_000, 500_000] {
            h.observe(Duration::from_micros(micros));
        }
        let mut out = String::new();
        h.render(&mut out);
        let bucket = |le: &str| {
            out.lines()
                .find_map(|l| l.strip_prefix(&format!("t_latency_seconds_bucket{{le=\"{le}\"}} ")))
                .and_then(|v| v.parse::<u64>().ok())
        };
        assert_eq!(bucket("0.000005"), Some(1));
        assert_eq!(bucket("0.000015"), Some(2));
        assert_eq!(bucket("0.00004"), Some(4));
        assert_eq!(bucket("0.0001"), Some(5));
        assert_eq!(bucket("0.1"), Some(6));
        assert_eq!(bucket("+Inf"), Some(7));
        assert!(out.contains("t_latency_seconds_sum 0.502181\n"), "{out}");
        assert!(out.contains("t_latency_seconds_count 7\n"), "{out}");
        // Bounds strictly increase, so every bucket is a proper cumulative count.
        assert!(LATENCY_BUCKETS.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn label_values_escape_what_the_text_format_escapes_only() {
        assert_eq!(label_value("plain-1.0"), "plain-1.0");
        assert_eq!(
            label_value("o'brien \"q\" \\ é\n"),
            "o'brien \\\"q\\\" \\\\ é\\n"
        );
    }
}
