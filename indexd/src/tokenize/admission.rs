//! Admission control for tokenization: a budget of request-body bytes and
//! of bodies in flight, shared by the Picks that carry a body and the HTTP
//! `/tokenize` and `/v1/responses/render`, checked before any work starts
//! and answered at once when a body does not fit (a Pick: UNTOKENIZED, the
//! filter routes it without an override; HTTP: 503 with `Retry-After`).
//!
//! Tokenizing a body costs memory in proportion to it, and a hostile body
//! many times its size (an 8 MB single-word chat took ~0.5 GB in the
//! tokenizer); CPU-bound work beyond the CPUs only adds memory. So:
//!
//! - **Bytes.** A body is charged its length (a chunked HTTP body, whose
//!   length is not declared, is charged `max_body_bytes`). A body larger
//!   than the shared part of the budget is charged the whole part: it runs
//!   alone.
//! - **Bodies.** Each admitted body takes one of `max_concurrent` places.
//! - **A reserve for small bodies.** `reserved_bytes` of the bytes and
//!   `reserved_concurrent` of the places are only for bodies of at most
//!   `small_body_bytes`; large bodies share the rest. A small body takes the
//!   shared part first and the reserve when that is full. So a few 8 MB
//!   bodies can fill the shared part, and ordinary 20 KB requests are still
//!   admitted from the reserve.
//!
//! A body's share of the budget travels with its work ([`Ticket`]): it is
//! returned when the work ends, not when the caller goes away, so a caller
//! that cancels and sends again cannot stack work past the budget. The
//! caller's side holds a [`Caller`]: dropped before it finishes (a gRPC
//! Pick cancelled, an HTTP connection closed), it sets the ticket's cancel
//! flag, which the work checks between its phases (and which the
//! tokenizer's own `Budget` will carry into its loops).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::config::tokenize::AdmissionConfig;
use crate::metrics::{CounterVec, gauge};
use crate::sync::{WarnGate, lock};

/// Where a body came in (the metric's `path` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    /// A Pick carrying its body (gRPC).
    Pick,
    /// `POST /tokenize`.
    Tokenize,
    /// `POST /v1/responses/render`.
    Render,
}

impl Via {
    /// The metric label.
    pub const fn label(self) -> &'static str {
        match self {
            Self::Pick => "pick",
            Self::Tokenize => "tokenize",
            Self::Render => "render",
        }
    }
}

/// Why a body was not admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// Its bytes do not fit in what is left of the budget.
    #[error(
        "over indexd's tokenization budget: the bytes of the bodies in flight (tokenize.admission.max_bytes)"
    )]
    Bytes,
    /// Every place is taken.
    #[error(
        "over indexd's tokenization budget: as many bodies in flight as it takes (tokenize.admission.max_concurrent)"
    )]
    Concurrency,
}

impl Refusal {
    /// The metric label.
    pub const fn label(self) -> &'static str {
        match self {
            Self::Bytes => "bytes",
            Self::Concurrency => "concurrency",
        }
    }
}

/// What is in use, per part of the budget.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Used {
    shared_bytes: usize,
    reserve_bytes: usize,
    shared_places: usize,
    reserve_places: usize,
}

/// One admitted body's share.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Grant {
    shared_bytes: usize,
    reserve_bytes: usize,
    reserve_place: bool,
}

/// The budget, with its counters.
#[derive(Debug)]
pub struct Admission {
    config: AdmissionConfig,
    used: Mutex<Used>,
    refused: CounterVec<2>,
    cancelled: CounterVec<1>,
    warn: WarnGate,
    /// The last refusal: when, its path and its reason (for `/readyz`).
    last_refused: Mutex<Option<(Instant, &'static str, &'static str)>>,
}

impl Admission {
    /// A budget of `config` (validated: the reserves are smaller than the
    /// totals).
    pub fn new(config: AdmissionConfig) -> Arc<Self> {
        Arc::new(Self {
            config,
            used: Mutex::new(Used::default()),
            refused: CounterVec::new(
                "indexd_tokenize_refused_total",
                "Bodies refused before any work, by path (pick, tokenize, render) and reason: bytes, concurrency (over tokenize.admission), loop (an indexd forwarded it already).",
                ["path", "reason"],
            ),
            cancelled: CounterVec::new(
                "indexd_tokenize_cancelled_total",
                "Admitted bodies whose caller went away before the answer (a Pick cancelled, an HTTP connection closed), by path; their work is told to stop.",
                ["path"],
            ),
            warn: WarnGate::default(),
            last_refused: Mutex::new(None),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &AdmissionConfig {
        &self.config
    }

    /// Admits a body of `body_bytes` that came in by `via`, or refuses it
    /// (counted; logged at most every 10 s).
    pub fn try_admit(
        self: &Arc<Self>,
        via: Via,
        body_bytes: usize,
    ) -> Result<(Ticket, Caller), Refusal> {
        let granted = {
            let mut used = lock(&self.used);
            let grant = self.grant(&used, body_bytes);
            if let Ok(g) = grant {
                used.shared_bytes += g.shared_bytes;
                used.reserve_bytes += g.reserve_bytes;
                if g.reserve_place {
                    used.reserve_places += 1;
                } else {
                    used.shared_places += 1;
                }
            }
            grant.map_err(|r| (r, *used))
        };
        match granted {
            Ok(grant) => {
                let cancel = Cancel::default();
                Ok((
                    Ticket {
                        admission: Arc::clone(self),
                        grant,
                        cancel: cancel.clone(),
                    },
                    Caller {
                        cancel,
                        admission: Arc::clone(self),
                        via,
                        finished: false,
                    },
                ))
            }
            Err((refusal, used)) => {
                self.count_refused(via, refusal.label());
                if self.warn.open() {
                    tracing::warn!(
                        path = via.label(),
                        reason = refusal.label(),
                        body_bytes,
                        bytes_in_flight = used.shared_bytes + used.reserve_bytes,
                        bodies_in_flight = used.shared_places + used.reserve_places,
                        "tokenization budget full: refusing bodies at once (indexd_tokenize_refused_total counts them; logged at most every 10 s)"
                    );
                }
                Err(refusal)
            }
        }
    }

    /// Counts a request refused before admission for another reason (a
    /// forwarding loop).
    pub fn count_refused(&self, via: Via, reason: &'static str) {
        self.refused.inc([via.label(), reason]);
        *lock(&self.last_refused) = Some((Instant::now(), via.label(), reason));
    }

    /// For `/readyz`, once a body has been refused: how many since start,
    /// the last one's age, path and reason, and the budget.
    pub fn describe(&self, now: Instant) -> Option<String> {
        let (at, path, reason) = (*lock(&self.last_refused))?;
        let total: u64 = self.refused.total();
        let c = &self.config;
        Some(format!(
            "tokenize admission: {total} bodies refused before any work since start, the last {:.0?} ago ({path}, {reason}); budget {} bodies, {} MiB",
            now.saturating_duration_since(at),
            c.max_concurrent,
            c.max_bytes >> 20
        ))
    }

    /// What a body of `body_bytes` would be granted now.
    fn grant(&self, used: &Used, body_bytes: usize) -> Result<Grant, Refusal> {
        let c = &self.config;
        let shared_bytes = c.max_bytes.saturating_sub(c.reserved_bytes);
        let shared_places = c.max_concurrent.saturating_sub(c.reserved_concurrent);
        let small = body_bytes <= c.small_body_bytes;
        let reserve_place = if used.shared_places < shared_places {
            false
        } else if small && used.reserve_places < c.reserved_concurrent {
            true
        } else {
            return Err(Refusal::Concurrency);
        };
        // A body larger than the whole shared part runs alone.
        let cost = if small {
            body_bytes
        } else {
            body_bytes.min(shared_bytes)
        };
        if used.shared_bytes.saturating_add(cost) <= shared_bytes {
            Ok(Grant {
                shared_bytes: cost,
                reserve_bytes: 0,
                reserve_place,
            })
        } else if small && used.reserve_bytes.saturating_add(cost) <= c.reserved_bytes {
            Ok(Grant {
                shared_bytes: 0,
                reserve_bytes: cost,
                reserve_place,
            })
        } else {
            Err(Refusal::Bytes)
        }
    }

    fn release(&self, grant: Grant) {
        let mut used = lock(&self.used);
        used.shared_bytes = used.shared_bytes.saturating_sub(grant.shared_bytes);
        used.reserve_bytes = used.reserve_bytes.saturating_sub(grant.reserve_bytes);
        if grant.reserve_place {
            used.reserve_places = used.reserve_places.saturating_sub(1);
        } else {
            used.shared_places = used.shared_places.saturating_sub(1);
        }
    }

    /// Bytes and bodies in flight.
    pub fn in_flight(&self) -> (usize, usize) {
        let used = lock(&self.used);
        (
            used.shared_bytes + used.reserve_bytes,
            used.shared_places + used.reserve_places,
        )
    }

    /// The counters and gauges.
    pub fn render(&self, out: &mut String) {
        self.refused.render(out);
        self.cancelled.render(out);
        let (bytes, bodies) = self.in_flight();
        gauge(
            out,
            "indexd_tokenize_inflight_bytes",
            "Request-body bytes being tokenized (as charged to the admission budget).",
            bytes as f64,
        );
        gauge(
            out,
            "indexd_tokenize_inflight_bodies",
            "Request bodies being tokenized.",
            bodies as f64,
        );
        gauge(
            out,
            "indexd_tokenize_budget_bytes",
            "tokenize.admission.max_bytes.",
            self.config.max_bytes as f64,
        );
        gauge(
            out,
            "indexd_tokenize_budget_bodies",
            "tokenize.admission.max_concurrent.",
            self.config.max_concurrent as f64,
        );
    }

    #[cfg(test)]
    pub(crate) fn refused(&self, via: Via, reason: &'static str) -> u64 {
        self.refused.get([via.label(), reason])
    }

    #[cfg(test)]
    pub(crate) fn cancelled(&self, via: Via) -> u64 {
        self.cancelled.get([via.label()])
    }
}

/// A request's cancel flag: set once its caller has gone away.
#[derive(Clone, Debug, Default)]
pub struct Cancel(Arc<AtomicBool>);

impl Cancel {
    /// A flag nobody sets (probes, tests).
    pub fn never() -> Self {
        Self::default()
    }

    /// Whether the caller has gone away.
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    /// The flag itself, for the tokenizer's `Budget`.
    pub fn flag(&self) -> &Arc<AtomicBool> {
        &self.0
    }
}

/// An admitted body's share of the budget, held by its work until the work
/// ends (moved onto the blocking thread with it), and the request's cancel
/// flag.
#[derive(Debug)]
pub struct Ticket {
    admission: Arc<Admission>,
    grant: Grant,
    cancel: Cancel,
}

impl Ticket {
    /// The request's cancel flag.
    pub fn cancel(&self) -> &Cancel {
        &self.cancel
    }

    /// Whether the caller has gone away.
    pub fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled()
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.admission.release(self.grant);
    }
}

/// The caller's side of an admitted request: dropped before
/// [`Caller::finish`] (the request's future dropped: the caller went away),
/// it sets the cancel flag and counts the request as cancelled.
#[derive(Debug)]
pub struct Caller {
    cancel: Cancel,
    admission: Arc<Admission>,
    via: Via,
    finished: bool,
}

impl Caller {
    /// The answer is ready: nothing to cancel.
    pub fn finish(mut self) {
        self.finished = true;
    }
}

impl Drop for Caller {
    fn drop(&mut self) {
        if !self.finished {
            self.cancel.0.store(true, Ordering::Relaxed);
            self.admission.cancelled.inc([self.via.label()]);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::tokenize::reserve_for;

    fn budget() -> Arc<Admission> {
        Admission::new(AdmissionConfig {
            max_bytes: 16 << 20,
            max_concurrent: 8,
            small_body_bytes: 1 << 20,
            reserved_bytes: 4 << 20,
            reserved_concurrent: 4,
            retry_after: Duration::from_secs(1),
        })
    }

    #[test]
    fn large_bodies_share_what_the_reserve_leaves() {
        let a = budget();
        let (first, _c1) = a.try_admit(Via::Pick, 8 << 20).unwrap();
        // 8 + 8 MiB would pass the 12 MiB shared part.
        assert_eq!(a.try_admit(Via::Pick, 8 << 20).unwrap_err(), Refusal::Bytes);
        assert_eq!(a.refused(Via::Pick, "bytes"), 1);
        // Small bodies still come in: the shared part's 4 MiB, then the
        // reserve.
        let smalls: Vec<_> = (0..7)
            .map(|_| a.try_admit(Via::Tokenize, 1 << 20).unwrap())
            .collect();
        assert_eq!(a.in_flight(), (15 << 20, 8));
        // Every place is taken now.
        assert_eq!(
            a.try_admit(Via::Pick, 20_000).unwrap_err(),
            Refusal::Concurrency
        );
        drop(first);
        drop(smalls);
        assert_eq!(a.in_flight(), (0, 0));
    }

    #[test]
    fn a_body_larger_than_the_shared_part_runs_alone() {
        let a = budget();
        let (huge, _c) = a.try_admit(Via::Render, 64 << 20).unwrap();
        assert_eq!(a.in_flight(), (12 << 20, 1));
        assert_eq!(
            a.try_admit(Via::Render, 2 << 20).unwrap_err(),
            Refusal::Bytes
        );
        let (small, _c) = a.try_admit(Via::Render, 512 << 10).unwrap();
        drop((huge, small));
        assert_eq!(a.in_flight(), (0, 0));
    }

    #[test]
    fn large_bodies_never_take_the_reserved_places() {
        let a = budget();
        let large: Vec<_> = (0..4)
            .map(|_| a.try_admit(Via::Pick, (1 << 20) + 1).unwrap())
            .collect();
        assert_eq!(
            a.try_admit(Via::Pick, (1 << 20) + 1).unwrap_err(),
            Refusal::Concurrency
        );
        let small: Vec<_> = (0..4)
            .map(|_| a.try_admit(Via::Pick, 100).unwrap())
            .collect();
        assert_eq!(a.in_flight().1, 8);
        drop((large, small));
    }

    #[test]
    fn the_share_returns_with_the_work_and_a_dropped_caller_cancels_it() {
        let a = budget();
        let (ticket, caller) = a.try_admit(Via::Pick, 10).unwrap();
        assert!(!ticket.is_cancelled());
        drop(caller);
        assert!(ticket.is_cancelled(), "the caller went away");
        assert_eq!(a.cancelled(Via::Pick), 1);
        assert_eq!(a.in_flight(), (10, 1), "the work still holds its share");
        drop(ticket);
        assert_eq!(a.in_flight(), (0, 0));

        let (ticket, caller) = a.try_admit(Via::Tokenize, 10).unwrap();
        caller.finish();
        assert!(!ticket.is_cancelled());
        assert_eq!(a.cancelled(Via::Tokenize), 0);
    }

    #[test]
    fn defaults_scale_with_the_machine() {
        let small = AdmissionConfig::for_machine(2, 4 << 30);
        assert_eq!(small.max_bytes, 16 << 20);
        assert_eq!(small.max_concurrent, 8);
        assert_eq!(small.reserved_bytes, 4 << 20);
        assert_eq!(small.reserved_concurrent, 7, "one large body on 2 CPUs");
        let big = AdmissionConfig::for_machine(64, 512 << 30);
        assert_eq!(big.max_bytes, 256 << 20);
        assert_eq!(big.max_concurrent, 256);
        assert_eq!(big.reserved_concurrent, 224, "32 large bodies on 64 CPUs");
        assert_eq!(reserve_for(1), 0);
    }
}
