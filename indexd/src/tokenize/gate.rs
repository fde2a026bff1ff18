//! The exactness gate of a local tokenizer: local ids are used for routing
//! only while they are proven equal to a replica's. Its evidence comes from
//! [`super::probe`]: probe rounds (indexd's own requests) and shadow checks
//! (a sample of live requests, compared with a replica).
//!
//! - **Pending** at start: requests go to a replica. The first clean probe
//!   round (every probe agrees, same ids or both refuse) opens it.
//! - **Open**: the local tokenizer answers. Probe rounds run every
//!   `gate_interval`; up to `shadow_per_second` live Picks per model are
//!   tokenized by a replica too, beside the Pick (routed on its local ids
//!   at once: no request waits on a replica's tokenizer). A clean probe
//!   round counts as the last such check: the first live one comes
//!   `1 / shadow_per_second` after it, not on the burst of Picks that an
//!   opening gate lets through. A difference is counted and logged at most
//!   every 10 s with the first differing position.
//! - **Closed** by a probe mismatch (the probe set is indexd's own: a
//!   difference there is the tokenizer's), or by live requests with
//!   `gate_close_after_mismatches` distinct bodies whose ids differed within
//!   `gate_mismatch_window` (one client's odd input cannot close it; a real
//!   difference shows on many). The replicas tokenize meanwhile.
//! - **Reopened** by `gate_reopen_after_rounds` clean probe rounds in a row.
//!   A closed gate's rounds come after a pause: `gate_reopen_backoff`,
//!   doubled with each strike (a close, or a mismatching round while closed)
//!   up to `gate_interval`; strikes are forgiven once the gate has stayed
//!   open for a whole `gate_interval` (a clean periodic round).
//!
//! Every change of state is counted
//! (`indexd_tokenizer_gate_transitions_total{model,from,to,reason}`) and
//! logged; `indexd_tokenizer_gate{model}` is the state, and `/readyz` says
//! why a gate is closed.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::Tokenizers;
use super::probe::Verdict;
use crate::config::tokenize::GateRules;
use crate::metrics::label_value as escape;
use crate::sync::{WarnGate, lock};

/// Where a gate stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum GateState {
    /// Not yet checked: the replicas tokenize.
    Pending,
    /// Checked: the local tokenizer is used.
    Open,
    /// A difference was seen: the replicas tokenize until clean probe
    /// rounds reopen it.
    Closed,
}

impl GateState {
    fn from_u8(v: u8) -> Self {
        match v {
            1 => Self::Open,
            2 => Self::Closed,
            _ => Self::Pending,
        }
    }

    /// The gauge's value: 0 pending, 1 open, 2 closed.
    pub const fn as_u8(self) -> u8 {
        match self {
            Self::Pending => 0,
            Self::Open => 1,
            Self::Closed => 2,
        }
    }

    /// Its name.
    pub const fn label(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Open => "open",
            Self::Closed => "closed",
        }
    }
}

/// Why a gate changed state (the transition metric's `reason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Why {
    /// A pending gate's first clean probe round.
    ProbesAgree,
    /// A probe's ids differed.
    ProbeMismatch,
    /// Live requests of enough distinct bodies differed within the window.
    ShadowMismatches,
    /// Clean probe rounds in a row reopened a closed gate.
    ProbesClean,
}

impl Why {
    /// The metric label.
    pub const fn label(self) -> &'static str {
        match self {
            Self::ProbesAgree => "probes_agree",
            Self::ProbeMismatch => "probe_mismatch",
            Self::ShadowMismatches => "shadow_mismatches",
            Self::ProbesClean => "probes_clean",
        }
    }
}

/// A change of state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transition {
    /// Before.
    pub from: GateState,
    /// After.
    pub to: GateState,
    /// Why.
    pub why: Why,
}

/// Checks counted by kind (probe, shadow) and verdict.
#[derive(Debug, Default)]
pub(super) struct Counts {
    probe_agree: AtomicU64,
    probe_mismatch: AtomicU64,
    shadow_agree: AtomicU64,
    shadow_mismatch: AtomicU64,
    inconclusive: AtomicU64,
    refused: AtomicU64,
}

/// What changes with the gate's state, under one lock.
#[derive(Debug, Default)]
struct Inner {
    /// Why it is closed (empty otherwise).
    detail: String,
    /// Live requests whose ids differed lately: when, and their body's hash.
    mismatches: VecDeque<(Instant, u64)>,
    /// Clean probe rounds in a row while closed.
    clean_rounds: u32,
    /// Closes and mismatching rounds since the gate last stayed open a whole
    /// interval: the closed gate's pause doubles with each.
    strikes: u32,
    /// Transitions so far, by (from, to, why).
    transitions: BTreeMap<(GateState, GateState, Why), u64>,
}

/// One model's gate.
#[derive(Debug)]
pub struct Gate {
    model: String,
    rules: GateRules,
    /// The state, read on every request without the lock; written under it.
    state: AtomicU8,
    inner: Mutex<Inner>,
    pub(super) counts: Counts,
    shadow_every: Option<Duration>,
    last_shadow: Mutex<Option<Instant>>,
    shadow_busy: AtomicBool,
    mismatch_log: WarnGate,
    /// Told of every change of state, so that the probe task, asleep for a
    /// whole interval, learns that live requests closed the gate.
    changed: tokio::sync::Notify,
}

impl Gate {
    /// A pending gate for `model`.
    pub fn new(model: &str, rules: GateRules) -> Self {
        let every = rules.shadow_per_second;
        let shadow_every =
            (every > 0.0 && every.is_finite()).then(|| Duration::from_secs_f64(1.0 / every));
        Self {
            model: model.to_owned(),
            rules,
            state: AtomicU8::new(GateState::Pending.as_u8()),
            inner: Mutex::new(Inner::default()),
            counts: Counts::default(),
            shadow_every,
            last_shadow: Mutex::new(None),
            shadow_busy: AtomicBool::new(false),
            mismatch_log: WarnGate::default(),
            changed: tokio::sync::Notify::new(),
        }
    }

    /// Where it stands.
    pub fn state(&self) -> GateState {
        GateState::from_u8(self.state.load(Ordering::Acquire))
    }

    /// Why it is closed (empty unless closed).
    pub fn detail(&self) -> String {
        lock(&self.inner).detail.clone()
    }

    /// Its state for `/readyz`: the name, and for a closed gate why and what
    /// reopens it.
    pub fn describe(&self) -> String {
        self.describe_at(Instant::now())
    }

    /// [`Gate::describe`] at `now`: an open gate also says how many live
    /// requests' local ids differed from a replica's (since start, and the
    /// distinct bodies within the window, of the number that closes it).
    pub fn describe_at(&self, now: Instant) -> String {
        let inner = lock(&self.inner);
        match self.state() {
            GateState::Closed => format!(
                "closed ({}; reopens after {} clean probe rounds in a row, {} so far)",
                inner.detail, self.rules.reopen_after_rounds, inner.clean_rounds
            ),
            GateState::Open => {
                let differed = self.counts.shadow_mismatch.load(Ordering::Relaxed);
                if differed == 0 {
                    return "open".to_owned();
                }
                let window = self.rules.mismatch_window;
                let recent = inner
                    .mismatches
                    .iter()
                    .filter(|(at, _)| now.saturating_duration_since(*at) <= window)
                    .count();
                format!(
                    "open ({differed} live requests whose local ids differed from a replica's; {recent} distinct bodies within {window:?}, {} close it)",
                    self.rules.close_after_mismatches
                )
            }
            other => other.label().to_owned(),
        }
    }

    /// Moves to `to` (the lock held), counts and logs the change.
    fn transition(&self, inner: &mut Inner, to: GateState, why: Why) -> Transition {
        let from = self.state();
        self.state.store(to.as_u8(), Ordering::Release);
        *inner.transitions.entry((from, to, why)).or_insert(0) += 1;
        let t = Transition { from, to, why };
        self.changed.notify_one();
        let model = &self.model;
        match to {
            GateState::Closed => {
                tracing::warn!(model, from = from.label(), reason = why.label(), difference = %inner.detail, "local tokenizer differs from the replicas: the gate is closed, the replicas' tokenizer serves this model until clean probe rounds reopen it");
            }
            GateState::Open if from == GateState::Closed => {
                tracing::info!(
                    model,
                    rounds = self.rules.reopen_after_rounds,
                    "clean probe rounds: the gate is open again, the local tokenizer serves"
                );
            }
            GateState::Open | GateState::Pending => {
                tracing::info!(
                    model,
                    "local tokenizer agrees with the replicas on the probe set; using it"
                );
            }
        }
        t
    }

    /// Applies a probe round's verdict (at `now`); the change, if any.
    pub fn probe_round(&self, verdict: &Verdict, now: Instant) -> Option<Transition> {
        if matches!(verdict, Verdict::Agree) {
            // The round just compared the whole probe set: a live check
            // right after it would add a replica's work and little evidence.
            *lock(&self.last_shadow) = Some(now);
        }
        let mut inner = lock(&self.inner);
        match (verdict, self.state()) {
            (Verdict::Agree, GateState::Pending) => {
                Some(self.transition(&mut inner, GateState::Open, Why::ProbesAgree))
            }
            (Verdict::Agree, GateState::Open) => {
                // A periodic round: the gate stayed open a whole interval.
                inner.strikes = 0;
                None
            }
            (Verdict::Agree, GateState::Closed) => {
                inner.clean_rounds = inner.clean_rounds.saturating_add(1);
                if inner.clean_rounds < self.rules.reopen_after_rounds {
                    return None;
                }
                inner.clean_rounds = 0;
                inner.detail.clear();
                inner.mismatches.clear();
                Some(self.transition(&mut inner, GateState::Open, Why::ProbesClean))
            }
            (Verdict::Mismatch(why), state) => {
                inner.strikes = inner.strikes.saturating_add(1);
                inner.clean_rounds = 0;
                inner.detail = why.clone();
                (state != GateState::Closed)
                    .then(|| self.transition(&mut inner, GateState::Closed, Why::ProbeMismatch))
            }
            (Verdict::Inconclusive(_) | Verdict::Refused(_), _) => None,
        }
    }

    /// A live request (its body hashed to `body`) whose local ids differed
    /// from a replica's by `why`, at `now`: counted and logged sparingly;
    /// the gate closes once enough distinct bodies differed within the
    /// window. The change, if any.
    pub fn shadow_mismatch(&self, body: u64, why: &str, now: Instant) -> Option<Transition> {
        if self.mismatch_log.open() {
            tracing::warn!(model = %self.model, difference = %why, "a live Pick's local ids differ from a replica's (it was routed on its own; logged at most every 10 s; indexd_tokenizer_checks_total counts them)");
        }
        let mut inner = lock(&self.inner);
        if self.state() != GateState::Open {
            return None;
        }
        let window = self.rules.mismatch_window;
        while inner
            .mismatches
            .front()
            .is_some_and(|(at, _)| now.saturating_duration_since(*at) > window)
        {
            inner.mismatches.pop_front();
        }
        if !inner.mismatches.iter().any(|(_, b)| *b == body) {
            inner.mismatches.push_back((now, body));
        }
        let distinct = inner.mismatches.len();
        if distinct < self.rules.close_after_mismatches as usize {
            return None;
        }
        inner.mismatches.clear();
        inner.strikes = inner.strikes.saturating_add(1);
        inner.clean_rounds = 0;
        inner.detail = format!(
            "live requests of {distinct} distinct bodies differed within {window:?}; the last: {why}"
        );
        Some(self.transition(&mut inner, GateState::Closed, Why::ShadowMismatches))
    }

    /// How long until the next probe round: a closed gate waits its backoff
    /// (`reopen_backoff` doubled per strike, up to `interval`); otherwise an
    /// inconclusive round is retried after `retry`, a conclusive one after
    /// `interval`.
    pub fn pause(&self, inconclusive: bool, retry: Duration) -> Duration {
        let strikes = lock(&self.inner).strikes;
        match self.state() {
            GateState::Closed => {
                let doublings = strikes.saturating_sub(1).min(20);
                self.rules
                    .reopen_backoff
                    .saturating_mul(1 << doublings)
                    .min(self.rules.interval)
            }
            GateState::Pending | GateState::Open if inconclusive => retry,
            GateState::Pending | GateState::Open => self.rules.interval,
        }
    }

    /// Resolves at the gate's next change of state (or at once, if one
    /// happened since the last call).
    pub async fn changed(&self) {
        self.changed.notified().await;
    }

    /// Whether [`Gate::take_shadow_slot`] would give a slot now (no check
    /// in flight, the last one, or the last clean probe round, at least
    /// `1 / shadow_per_second` ago); it takes none.
    pub fn shadow_due(&self) -> bool {
        self.shadow_due_at(&lock(&self.last_shadow), Instant::now())
    }

    /// [`Gate::shadow_due`] at `now`, the last check's time held.
    fn shadow_due_at(&self, last: &Option<Instant>, now: Instant) -> bool {
        self.shadow_every.is_some_and(|every| {
            !self.shadow_busy.load(Ordering::Acquire)
                && !last.is_some_and(|t| now.saturating_duration_since(t) < every)
        })
    }

    /// A shadow check's turn for a live request now, if one is due (at most
    /// `shadow_per_second`, one at a time): held until dropped.
    pub fn take_shadow_slot(&self) -> Option<ShadowSlot<'_>> {
        let mut last = lock(&self.last_shadow);
        let now = Instant::now();
        if !self.shadow_due_at(&last, now) || self.shadow_busy.swap(true, Ordering::AcqRel) {
            return None;
        }
        *last = Some(now);
        Some(ShadowSlot(self))
    }

    /// Counts one comparison.
    pub(super) fn count(&self, shadow: bool, verdict: &Verdict) {
        let c = &self.counts;
        let counter = match (shadow, verdict) {
            (_, Verdict::Inconclusive(_)) => &c.inconclusive,
            (_, Verdict::Refused(_)) => &c.refused,
            (false, Verdict::Agree) => &c.probe_agree,
            (false, Verdict::Mismatch(_)) => &c.probe_mismatch,
            (true, Verdict::Agree) => &c.shadow_agree,
            (true, Verdict::Mismatch(_)) => &c.shadow_mismatch,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Transitions so far, by (from, to, why).
    fn transitions(&self) -> Vec<((GateState, GateState, Why), u64)> {
        lock(&self.inner)
            .transitions
            .iter()
            .map(|(k, v)| (*k, *v))
            .collect()
    }
}

/// A shadow check in flight (one per gate at a time), ended when dropped.
#[derive(Debug)]
pub struct ShadowSlot<'a>(&'a Gate);

impl Drop for ShadowSlot<'_> {
    fn drop(&mut self) {
        self.0.shadow_busy.store(false, Ordering::Release);
    }
}

/// The per-model series: gate, its transitions, checks, cache.
pub fn render_metrics(tokenizers: &Tokenizers, out: &mut String) {
    let models: Vec<_> = tokenizers.locals().collect();
    if models.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "# HELP indexd_tokenizer_gate A local tokenizer's exactness gate: 0 pending, 1 open, 2 closed.\n# TYPE indexd_tokenizer_gate gauge"
    );
    for (model, l) in &models {
        let _ = writeln!(
            out,
            "indexd_tokenizer_gate{{model=\"{}\"}} {}",
            escape(model),
            l.gate.state().as_u8()
        );
    }
    let _ = writeln!(
        out,
        "# HELP indexd_tokenizer_gate_transitions_total Changes of a local tokenizer's gate, by from, to and reason (probes_agree, probe_mismatch, shadow_mismatches, probes_clean).\n# TYPE indexd_tokenizer_gate_transitions_total counter"
    );
    for (model, l) in &models {
        for ((from, to, why), n) in l.gate.transitions() {
            let _ = writeln!(
                out,
                "indexd_tokenizer_gate_transitions_total{{model=\"{}\",from=\"{}\",to=\"{}\",reason=\"{}\"}} {n}",
                escape(model),
                from.label(),
                to.label(),
                why.label()
            );
        }
    }
    let _ = writeln!(
        out,
        "# HELP indexd_tokenizer_checks_total Comparisons of local and replica ids, by kind and result.\n# TYPE indexd_tokenizer_checks_total counter"
    );
    for (model, l) in &models {
        let c = &l.gate.counts;
        for (kind, result, n) in [
            ("probe", "agree", &c.probe_agree),
            ("probe", "mismatch", &c.probe_mismatch),
            ("shadow", "agree", &c.shadow_agree),
            ("shadow", "mismatch", &c.shadow_mismatch),
            ("any", "inconclusive", &c.inconclusive),
            ("any", "refused", &c.refused),
        ] {
            let _ = writeln!(
                out,
                "indexd_tokenizer_checks_total{{model=\"{}\",kind=\"{kind}\",result=\"{result}\"}} {}",
                escape(model),
                n.load(Ordering::Relaxed)
            );
        }
    }
    let stats: Vec<_> = models
        .iter()
        .map(|(m, l)| (m, l.tokenizer.stats().encoder.cache))
        .collect();
    for (name, kind, help, get) in [
        (
            "indexd_tokenizer_cache_hits_total",
            "counter",
            "Text segments found in the tokenizer cache.",
            (|s: &kvroute_tokenizer::CacheStats| s.hits)
                as fn(&kvroute_tokenizer::CacheStats) -> u64,
        ),
        (
            "indexd_tokenizer_cache_misses_total",
            "counter",
            "Text segments encoded.",
            |s| s.misses,
        ),
        (
            "indexd_tokenizer_cache_evictions_total",
            "counter",
            "Tokenizer cache entries dropped to stay within the bound.",
            |s| s.evictions,
        ),
        (
            "indexd_tokenizer_cache_bytes",
            "gauge",
            "Bytes held by the tokenizer cache.",
            |s| s.bytes,
        ),
        (
            "indexd_tokenizer_cache_capacity_bytes",
            "gauge",
            "The tokenizer cache's bound.",
            |s| s.capacity_bytes,
        ),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (model, s) in &stats {
            let _ = writeln!(out, "{name}{{model=\"{}\"}} {}", escape(model), get(s));
        }
    }
}

#[cfg(test)]
#[path = "gate_tests.rs"]
mod tests;
