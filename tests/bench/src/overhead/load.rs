//! Open-loop load: requests leave on a fixed schedule whatever earlier ones
//! are doing, from a bounded pool of sender threads.
//!
//! At `rate` requests/s per profile the schedule interleaves the profiles
//! request by request: profile `p` of `P` sends its request `k` at
//! `(k + p / P) / rate` seconds, so both profiles see the same machine, at
//! the same moments, and the machine sees `P × rate`. A sender takes the next
//! request in schedule order, sleeps until it is due and sends it; when every
//! sender is busy the request leaves late and its lag is recorded (one more
//! than [`MAX_LAG`] late is not sent at all and counts as an error).

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::client;
use crate::load::micros;
use crate::overhead::record::RequestRow;
use crate::rng::Rng;
use crate::sample::millis;
use crate::workload::Api;

/// A request due later than this is not sent (the client is saturated).
pub const MAX_LAG: Duration = Duration::from_secs(2);
/// The mock's model.
pub const MODEL: &str = "tiny";
/// Output tokens per request.
pub const MAX_TOKENS: u32 = 4;
/// Words of the system prompt every request shares (one token per word).
pub const SYSTEM_WORDS: usize = 1_024;
/// Words of each request's own user message.
pub const USER_WORDS: usize = 512;

/// Where one profile's requests go.
#[derive(Debug, Clone)]
pub struct Target {
    /// The profile's name in the rows.
    pub profile: &'static str,
    /// `http://127.0.0.1:port` of its Envoy.
    pub url: String,
}

/// One scheduled request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Job {
    /// Index into the targets.
    pub target: usize,
    /// The request's index in its profile's schedule.
    pub seq: u32,
    /// When it is due, since the phase began.
    pub at: Duration,
}

/// Requests per profile at `rate` for `secs`.
pub fn per_profile(rate: f64, secs: f64) -> u32 {
    let n = (rate * secs).floor();
    if n.is_finite() && n > 0.0 {
        n.min(f64::from(u32::MAX)) as u32
    } else {
        0
    }
}

/// The interleaved schedule of `profiles` profiles at `rate` each, for `secs`.
pub fn schedule(rate: f64, secs: f64, profiles: usize) -> Vec<Job> {
    let n = per_profile(rate, secs);
    let p = profiles.max(1);
    let mut jobs = Vec::with_capacity(n as usize * p);
    for seq in 0..n {
        for target in 0..p {
            let at = (f64::from(seq) + target as f64 / p as f64) / rate;
            jobs.push(Job {
                target,
                seq,
                at: Duration::from_secs_f64(at),
            });
        }
    }
    jobs
}

/// The chat request bodies: one system prompt shared by every request (a
/// prefix the replicas and indexd hold after the first request) and a
/// seeded user message of its own per request, so each request also brings
/// new blocks. The same `(phase, seq)` gives both profiles the same body.
#[derive(Debug, Clone)]
pub struct Prompts {
    seed: u64,
    system: String,
}

impl Prompts {
    /// Prompts drawn from `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            system: Rng::new(seed, 0).words(SYSTEM_WORDS),
        }
    }

    /// The body of request `seq` in phase `phase` (the warm-up is phase 0).
    pub fn body(&self, phase: u64, seq: u32) -> Value {
        let stream = 1 + (phase << 32) + u64::from(seq);
        let user = Rng::new(self.seed, stream).words(USER_WORDS);
        json!({
            "model": MODEL,
            "messages": [
                {"role": "system", "content": self.system},
                {"role": "user", "content": user},
            ],
            "max_tokens": MAX_TOKENS,
        })
    }
}

/// Sends one request to `target` and turns the reply into a row.
pub fn send(agent: &ureq::Agent, target: &Target, rate: f64, seq: u32, body: &Value) -> RequestRow {
    let reply = client::stream(agent, &target.url, Api::Chat, body, &[]);
    RequestRow {
        profile: target.profile.to_owned(),
        rate,
        seq,
        start_ms: 0.0,
        lag_us: 0,
        latency_us: micros(reply.latency),
        status: reply.status,
        error: reply.error.unwrap_or_default(),
        decision: reply.decision.unwrap_or_default(),
        prompt_tokens: reply.prompt_tokens,
    }
}

/// Runs `jobs` against `targets` from `senders` threads; `bodies[seq]` is
/// request `seq`'s body. Ends when every job is sent or skipped.
pub fn run(
    agent: &ureq::Agent,
    targets: &[Target],
    rate: f64,
    jobs: &[Job],
    bodies: &[Value],
    senders: usize,
) -> Vec<RequestRow> {
    let next = AtomicUsize::new(0);
    let rows = Mutex::new(Vec::with_capacity(jobs.len()));
    // A short lead so every sender is up before the first request is due.
    let begin = Instant::now() + Duration::from_millis(50);
    std::thread::scope(|scope| {
        for _ in 0..senders.clamp(1, jobs.len().max(1)) {
            scope.spawn(|| {
                loop {
                    let Some(job) = jobs.get(next.fetch_add(1, Ordering::Relaxed)) else {
                        return;
                    };
                    let (Some(target), Some(body)) =
                        (targets.get(job.target), bodies.get(job.seq as usize))
                    else {
                        continue;
                    };
                    let due = begin + job.at;
                    if let Some(wait) = due.checked_duration_since(Instant::now()) {
                        std::thread::sleep(wait);
                    }
                    let lag = Instant::now().saturating_duration_since(due);
                    let mut row = if lag > MAX_LAG {
                        RequestRow {
                            profile: target.profile.to_owned(),
                            rate,
                            seq: job.seq,
                            start_ms: 0.0,
                            lag_us: 0,
                            latency_us: 0,
                            status: 0,
                            error: format!("not sent: {} ms behind schedule", lag.as_millis()),
                            decision: String::new(),
                            prompt_tokens: 0,
                        }
                    } else {
                        send(agent, target, rate, job.seq, body)
                    };
                    row.start_ms = millis(job.at);
                    row.lag_us = micros(lag);
                    if let Ok(mut all) = rows.lock() {
                        all.push(row);
                    }
                }
            });
        }
    });
    rows.into_inner().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_interleaves_profiles_at_half_periods() {
        let jobs = schedule(10.0, 0.25, 2);
        let got: Vec<(usize, u32, u128)> = jobs
            .iter()
            .map(|j| (j.target, j.seq, j.at.as_millis()))
            .collect();
        assert_eq!(got, [(0, 0, 0), (1, 0, 50), (0, 1, 100), (1, 1, 150)]);
        assert_eq!(per_profile(100.0, 15.0), 1_500);
        assert_eq!(per_profile(0.0, 15.0), 0);
        assert!(schedule(f64::NAN, 1.0, 2).is_empty());
    }

    #[test]
    fn prompts_are_seeded_shared_prefix_and_own_suffix() {
        let p = Prompts::new(42);
        let a = p.body(1, 0);
        assert_eq!(a, Prompts::new(42).body(1, 0));
        let b = p.body(1, 1);
        assert_eq!(a["messages"][0], b["messages"][0]);
        assert_ne!(a["messages"][1], b["messages"][1]);
        assert_ne!(p.body(2, 0)["messages"][1], a["messages"][1]);
        let words = a["messages"][1]["content"]
            .as_str()
            .unwrap()
            .split(' ')
            .count();
        assert_eq!(words, USER_WORDS);
    }
}
