//! Sending the soak's jobs from a bounded pool of sender threads, on the
//! open-loop schedule of [`super::mix::schedule`], and tallying what came back.
//!
//! A request is answered when its status is the one a healthy stack gives
//! (400 for a body that is not JSON, 200 otherwise) and, for a stream, the
//! stream ran to its end (`[DONE]`, or `response.completed` for Responses);
//! anything else — a transport error, another status, a stream cut short, a
//! job more than [`MAX_LAG`] behind its schedule — is an error: a request
//! lost.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::client::DECISION_HEADER;
use crate::load::micros;
use crate::soak::mix::{Bodies, Job, Kind, Request};

/// A job due later than this is not sent (the client is saturated).
pub const MAX_LAG: Duration = Duration::from_secs(2);
/// The most of an answer that is read.
const MAX_ANSWER_BYTES: u64 = 16 * 1024 * 1024;
/// The label of a pair's first (stored) turn.
pub const PAIR_FIRST: &str = "responses-stored";
/// The label of a pair's second turn (by `previous_response_id`).
pub const PAIR_NEXT: &str = "responses-continue";

/// What one request did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Outcome {
    /// Answered as a healthy stack answers.
    pub ok: bool,
    /// Send to the end of the answer.
    pub latency: Duration,
    /// The filter's `x-kvroute-decision`.
    pub decision: Option<String>,
    /// What went wrong.
    pub error: Option<String>,
    /// The `id` of a JSON answer (a Responses turn's).
    pub response_id: Option<String>,
}

/// Sends `request` to `base` and reads the whole answer.
pub fn exchange(agent: &ureq::Agent, base: &str, request: &Request) -> Outcome {
    let url = format!("{base}{}", request.path);
    let started = Instant::now();
    let result = if request.method == "GET" {
        agent.get(&url).call()
    } else {
        agent
            .post(&url)
            .header("content-type", "application/json")
            .send(request.body.as_slice())
    };
    let mut response = match result {
        Ok(r) => r,
        Err(e) => {
            return Outcome {
                latency: started.elapsed(),
                error: Some(format!("transport: {e}")),
                ..Outcome::default()
            };
        }
    };
    let status = response.status().as_u16();
    let decision = response
        .headers()
        .get(DECISION_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let text = response
        .body_mut()
        .with_config()
        .limit(MAX_ANSWER_BYTES)
        .read_to_string();
    let latency = started.elapsed();
    let mut outcome = Outcome {
        latency,
        decision,
        ..Outcome::default()
    };
    let text = match text {
        Ok(t) => t,
        Err(e) => {
            outcome.error = Some(format!("reading the answer: {e}"));
            return outcome;
        }
    };
    outcome.error = check(request, status, &text);
    if outcome.error.is_none() && !request.stream && request.expect == 200 {
        outcome.response_id = serde_json::from_str::<Value>(&text)
            .ok()
            .and_then(|v| v["id"].as_str().map(str::to_owned));
    }
    outcome.ok = outcome.error.is_none();
    outcome
}

/// Why an answer is not what a healthy stack gives (`None`: it is).
pub fn check(request: &Request, status: u16, text: &str) -> Option<String> {
    if status != request.expect {
        return Some(format!(
            "HTTP {status} (expected {}): {}",
            request.expect,
            text.chars().take(160).collect::<String>()
        ));
    }
    if request.expect != 200 {
        return None;
    }
    if request.stream {
        let ended = text.lines().any(|l| {
            let data = l.strip_prefix("data:").map(str::trim);
            data == Some("[DONE]")
                || data.is_some_and(|d| d.contains("\"type\":\"response.completed\""))
        });
        return (!ended).then(|| "stream ended early".to_owned());
    }
    match serde_json::from_str::<Value>(text) {
        Ok(v) if v.is_object() => None,
        _ => Some(format!(
            "not a JSON object: {}",
            text.chars().take(160).collect::<String>()
        )),
    }
}

/// One request label's totals.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KindTally {
    /// Requests (sent or not).
    pub requests: u64,
    /// Not answered as a healthy stack answers.
    pub errors: u64,
    /// Latencies of every answered request, µs.
    pub latencies_us: Vec<u64>,
    /// The filter's decisions and their counts.
    pub decisions: BTreeMap<String, u64>,
    /// The first error seen.
    pub first_error: String,
}

/// What the senders report, read by the sampler while they run.
#[derive(Debug, Default)]
pub struct Tally {
    done: AtomicU64,
    errors: AtomicU64,
    window: Mutex<Vec<u64>>,
    kinds: Mutex<BTreeMap<&'static str, KindTally>>,
}

impl Tally {
    /// Requests finished (answered or lost) so far.
    pub fn done(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    /// Requests lost so far.
    pub fn errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }

    /// The latencies (µs) of requests answered since the last call.
    pub fn take_window(&self) -> Vec<u64> {
        self.window
            .lock()
            .map(|mut w| std::mem::take(&mut *w))
            .unwrap_or_default()
    }

    /// Totals per request label.
    pub fn kinds(&self) -> BTreeMap<&'static str, KindTally> {
        self.kinds.lock().map(|k| k.clone()).unwrap_or_default()
    }

    /// Counts one request of `label`.
    pub fn record(&self, label: &'static str, outcome: &Outcome) {
        let latency = micros(outcome.latency);
        if let Ok(mut kinds) = self.kinds.lock() {
            let k = kinds.entry(label).or_default();
            k.requests += 1;
            if let Some(d) = &outcome.decision {
                *k.decisions.entry(d.clone()).or_insert(0) += 1;
            }
            if outcome.ok {
                k.latencies_us.push(latency);
            } else {
                k.errors += 1;
                if k.first_error.is_empty() {
                    k.first_error = outcome.error.clone().unwrap_or_default();
                }
            }
        }
        if outcome.ok {
            if let Ok(mut w) = self.window.lock() {
                w.push(latency);
            }
        } else {
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
        self.done.fetch_add(1, Ordering::Relaxed);
    }
}

/// The label a job's (first) request is counted under.
pub fn label(kind: Kind) -> &'static str {
    match kind {
        Kind::ResponsesPair => PAIR_FIRST,
        other => other.label(),
    }
}

/// Sends one job (both turns of a pair) and records its requests.
pub fn run_job(agent: &ureq::Agent, base: &str, bodies: &Bodies, job: &Job, tally: &Tally) {
    let first = exchange(agent, base, &bodies.request(job));
    tally.record(label(job.kind), &first);
    if job.kind != Kind::ResponsesPair {
        return;
    }
    let next = match (&first.response_id, first.ok) {
        (Some(id), true) => exchange(agent, base, &bodies.continuation(job, id)),
        _ => Outcome {
            error: Some("not sent: the first turn failed".into()),
            ..Outcome::default()
        },
    };
    tally.record(PAIR_NEXT, &next);
}

/// Runs `jobs` against `base` from `senders` threads; returns when every job
/// is sent or skipped. `begin` is when the schedule starts.
pub fn run(
    agent: &ureq::Agent,
    base: &str,
    bodies: &Bodies,
    jobs: &[Job],
    senders: usize,
    begin: Instant,
    tally: &Tally,
) {
    let next = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for _ in 0..senders.clamp(1, jobs.len().max(1)) {
            scope.spawn(|| {
                while let Some(job) = jobs.get(next.fetch_add(1, Ordering::Relaxed)) {
                    let due = begin + job.at;
                    if let Some(wait) = due.checked_duration_since(Instant::now()) {
                        std::thread::sleep(wait);
                    }
                    let lag = Instant::now().saturating_duration_since(due);
                    if lag > MAX_LAG {
                        let skipped = Outcome {
                            error: Some(format!(
                                "not sent: {} ms behind schedule",
                                lag.as_millis()
                            )),
                            ..Outcome::default()
                        };
                        tally.record(label(job.kind), &skipped);
                        if job.kind == Kind::ResponsesPair {
                            tally.record(PAIR_NEXT, &skipped);
                        }
                        continue;
                    }
                    run_job(agent, base, bodies, job, tally);
                }
            });
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(stream: bool, expect: u16) -> Request {
        Request {
            method: "POST",
            path: "/v1/chat/completions",
            body: Vec::new(),
            stream,
            expect,
        }
    }

    #[test]
    fn answers_are_checked_against_a_healthy_stack() {
        assert_eq!(check(&request(false, 200), 200, r#"{"id":"x"}"#), None);
        assert!(check(&request(false, 200), 200, "[1]").is_some());
        assert!(check(&request(false, 200), 503, "no healthy upstream").is_some());
        assert_eq!(check(&request(false, 400), 400, "bad"), None);
        assert!(check(&request(false, 400), 200, "{}").is_some());
        let stream = "data: {\"choices\":[]}\n\ndata: [DONE]\n\n";
        assert_eq!(check(&request(true, 200), 200, stream), None);
        assert!(check(&request(true, 200), 200, "data: {\"choices\":[]}\n").is_some());
        let responses =
            "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{}}\n";
        assert_eq!(check(&request(true, 200), 200, responses), None);
    }

    #[test]
    fn the_tally_counts_windows_kinds_and_errors() {
        let t = Tally::default();
        let ok = Outcome {
            ok: true,
            latency: Duration::from_micros(1_500),
            decision: Some("precise".into()),
            ..Outcome::default()
        };
        let lost = Outcome {
            error: Some("transport: reset".into()),
            ..Outcome::default()
        };
        t.record("chat", &ok);
        t.record("chat", &lost);
        t.record("models", &ok);
        assert_eq!((t.done(), t.errors()), (3, 1));
        assert_eq!(t.take_window(), vec![1_500, 1_500]);
        assert!(t.take_window().is_empty());
        let kinds = t.kinds();
        assert_eq!(kinds["chat"].requests, 2);
        assert_eq!(kinds["chat"].errors, 1);
        assert_eq!(kinds["chat"].first_error, "transport: reset");
        assert_eq!(kinds["chat"].decisions["precise"], 1);
    }
}
