//! The soak's request mix: seeded, one draw per schedule slot.
//!
//! Mostly chat completions (streamed and not), some completions (text and
//! token-id prompts), some Responses (streamed and not, and pairs whose
//! second turn continues the first by `previous_response_id`, streamed, so
//! that the filter's Observe-and-hold path runs on the first turn and the
//! affinity pick on the second), and a share of failure paths: bodies that
//! are not JSON (the filter's `unparseable`, the replica's 400) and
//! `GET /v1/models` (not a routed request). A pair takes two slots of the
//! schedule: its second request leaves as soon as the first has answered.

use std::time::Duration;

use serde_json::{Value, json};

use crate::rng::Rng;

/// The mock's model.
pub const MODEL: &str = "tiny";
/// Output tokens per generation request.
pub const MAX_TOKENS: u32 = 4;
/// Shared system prompts (prefixes that indexd learns), one drawn per request.
pub const SYSTEM_PROMPTS: u64 = 4;
/// Words of each shared system prompt (one token per word).
pub const SYSTEM_WORDS: usize = 200;
/// Words of a request's own message: drawn in this range.
pub const USER_WORDS: (usize, usize) = (20, 300);
/// Token ids of a token-id completions prompt: drawn in this range.
pub const PROMPT_IDS: (usize, usize) = (100, 800);

/// What one schedule slot sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    /// Chat completions, streamed.
    ChatStream,
    /// Chat completions, one JSON answer.
    Chat,
    /// Completions with a text prompt.
    Completions,
    /// Completions with a token-id prompt, streamed (no tokenizer call).
    CompletionsIds,
    /// Responses, streamed (`store: false`).
    ResponsesStream,
    /// Responses, one JSON answer (`store: false`).
    Responses,
    /// A stored Responses turn, then a streamed continuation by
    /// `previous_response_id`: two requests.
    ResponsesPair,
    /// A body that is not JSON, to `/v1/chat/completions` (the replica answers 400).
    BadJson,
    /// `GET /v1/models`.
    Models,
}

impl Kind {
    /// Every kind with its share of the schedule's slots (per mille; a pair's
    /// share counts both of its requests).
    pub const SHARES: [(Self, u32); 9] = [
        (Self::ChatStream, 400),
        (Self::Chat, 150),
        (Self::Completions, 60),
        (Self::CompletionsIds, 40),
        (Self::ResponsesStream, 80),
        (Self::Responses, 50),
        (Self::ResponsesPair, 120),
        (Self::BadJson, 50),
        (Self::Models, 50),
    ];

    /// The label in the CSV files.
    pub const fn label(self) -> &'static str {
        match self {
            Self::ChatStream => "chat-stream",
            Self::Chat => "chat",
            Self::Completions => "completions",
            Self::CompletionsIds => "completions-ids",
            Self::ResponsesStream => "responses-stream",
            Self::Responses => "responses",
            Self::ResponsesPair => "responses-pair",
            Self::BadJson => "bad-json",
            Self::Models => "models",
        }
    }

    /// Requests a job of this kind sends.
    pub const fn requests(self) -> u64 {
        match self {
            Self::ResponsesPair => 2,
            _ => 1,
        }
    }

    /// The kind of a draw in `[0, 1)`; a pair's share of slots is halved
    /// into jobs, so that its requests hold the share [`Self::SHARES`] says.
    fn of(draw: f64) -> Self {
        let weight = |k: Self, share: u32| f64::from(share) / k.requests() as f64;
        let total: f64 = Self::SHARES.iter().map(|(k, s)| weight(*k, *s)).sum();
        let mut left = draw * total;
        for (k, s) in Self::SHARES {
            left -= weight(k, s);
            if left < 0.0 {
                return k;
            }
        }
        Self::ChatStream
    }
}

/// One scheduled job.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Job {
    /// Its index in the schedule (the seed stream of its bodies).
    pub slot: u64,
    /// What it sends.
    pub kind: Kind,
    /// When it is due, since the load began.
    pub at: Duration,
}

/// Jobs holding `requests` requests in all at `rate` requests/s: each job is
/// due when the requests before it are, at `rate`. Kinds are drawn from
/// `seed`; a pair that would pass `requests` becomes a streamed chat.
pub fn schedule(seed: u64, rate: f64, requests: u64) -> Vec<Job> {
    let mut jobs = Vec::new();
    if !(rate.is_finite() && rate > 0.0) {
        return jobs;
    }
    let mut sent = 0u64;
    let mut slot = 0u64;
    while sent < requests {
        let mut kind = Kind::of(Rng::new(seed, slot).unit());
        if sent + kind.requests() > requests {
            kind = Kind::ChatStream;
        }
        jobs.push(Job {
            slot,
            kind,
            at: Duration::from_secs_f64(sent as f64 / rate),
        });
        sent += kind.requests();
        slot += 1;
    }
    jobs
}

/// One HTTP request.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// `GET` or `POST`.
    pub method: &'static str,
    /// The path.
    pub path: &'static str,
    /// The body (`POST` only).
    pub body: Vec<u8>,
    /// Whether the answer is an event stream.
    pub stream: bool,
    /// The status a healthy stack answers.
    pub expect: u16,
}

/// The body texts, seeded.
#[derive(Debug, Clone)]
pub struct Bodies {
    seed: u64,
    systems: Vec<String>,
}

impl Bodies {
    /// Texts drawn from `seed`.
    pub fn new(seed: u64) -> Self {
        let systems = (0..SYSTEM_PROMPTS)
            .map(|i| Rng::new(seed, u64::MAX - i).words(SYSTEM_WORDS))
            .collect();
        Self { seed, systems }
    }

    /// The (first) request of `job`.
    pub fn request(&self, job: &Job) -> Request {
        let mut rng = Rng::new(self.seed, job.slot);
        // The kind's own draw comes first (as in `schedule`).
        let _ = rng.unit();
        let system = self
            .systems
            .get(rng.range(0, self.systems.len().saturating_sub(1)))
            .cloned()
            .unwrap_or_default();
        let words = rng.range(USER_WORDS.0, USER_WORDS.1);
        let user = rng.words(words);
        let post = |path: &'static str, body: Value, stream: bool| Request {
            method: "POST",
            path,
            body: body.to_string().into_bytes(),
            stream,
            expect: 200,
        };
        let chat = |stream: bool| {
            post(
                "/v1/chat/completions",
                json!({
                    "model": MODEL,
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": user},
                    ],
                    "max_tokens": MAX_TOKENS,
                    "stream": stream,
                }),
                stream,
            )
        };
        let responses = |stream: bool, store: bool| {
            post(
                "/v1/responses",
                json!({
                    "model": MODEL,
                    "instructions": system,
                    "input": user,
                    "max_output_tokens": MAX_TOKENS,
                    "stream": stream,
                    "store": store,
                }),
                stream,
            )
        };
        match job.kind {
            Kind::ChatStream => chat(true),
            Kind::Chat => chat(false),
            Kind::Completions => post(
                "/v1/completions",
                json!({
                    "model": MODEL,
                    "prompt": format!("{system} {user}"),
                    "max_tokens": MAX_TOKENS,
                }),
                false,
            ),
            Kind::CompletionsIds => {
                let n = rng.range(PROMPT_IDS.0, PROMPT_IDS.1);
                let ids: Vec<u32> = (0..n)
                    .map(|_| 16 + (rng.next_u64() % 31_000) as u32)
                    .collect();
                post(
                    "/v1/completions",
                    json!({"model": MODEL, "prompt": ids, "max_tokens": MAX_TOKENS, "stream": true}),
                    true,
                )
            }
            Kind::ResponsesStream => responses(true, false),
            Kind::Responses => responses(false, false),
            Kind::ResponsesPair => responses(false, true),
            Kind::BadJson => {
                let mut body = chat(false).body;
                // Cut in the middle: the JSON never closes.
                body.truncate(body.len() / 2);
                Request {
                    method: "POST",
                    path: "/v1/chat/completions",
                    body,
                    stream: false,
                    expect: 400,
                }
            }
            Kind::Models => Request {
                method: "GET",
                path: "/v1/models",
                body: Vec::new(),
                stream: false,
                expect: 200,
            },
        }
    }

    /// The second turn of a pair: continues `previous` (a response id), streamed.
    pub fn continuation(&self, job: &Job, previous: &str) -> Request {
        let mut rng = Rng::new(self.seed, job.slot ^ (1 << 63));
        let words = rng.range(USER_WORDS.0, USER_WORDS.1 / 2);
        let user = rng.words(words);
        Request {
            method: "POST",
            path: "/v1/responses",
            body: json!({
                "model": MODEL,
                "previous_response_id": previous,
                "input": user,
                "max_output_tokens": MAX_TOKENS,
                "stream": true,
                "store": false,
            })
            .to_string()
            .into_bytes(),
            stream: true,
            expect: 200,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_holds_the_requests_at_the_rate() {
        let jobs = schedule(42, 100.0, 1_000);
        let requests: u64 = jobs.iter().map(|j| j.kind.requests()).sum();
        assert_eq!(requests, 1_000);
        assert_eq!(jobs, schedule(42, 100.0, 1_000));
        // Due times follow the requests before each job.
        let mut before = 0u64;
        for j in &jobs {
            assert_eq!(j.at, Duration::from_secs_f64(before as f64 / 100.0));
            before += j.kind.requests();
        }
        // Every kind shows up, in roughly its share.
        for (kind, share) in Kind::SHARES {
            let got: u64 = jobs
                .iter()
                .filter(|j| j.kind == kind)
                .map(|j| j.kind.requests())
                .sum();
            let want = u64::from(share);
            assert!(got > want / 2 && got < want * 2, "{kind:?}: {got} of 1000");
        }
        assert!(schedule(1, 0.0, 10).is_empty());
    }

    #[test]
    fn bodies_are_seeded_and_shaped_per_kind() {
        let b = Bodies::new(7);
        let jobs = schedule(7, 50.0, 400);
        for j in &jobs {
            let r = b.request(j);
            assert_eq!(r, Bodies::new(7).request(j));
            match j.kind {
                Kind::Models => assert_eq!((r.method, r.body.len()), ("GET", 0)),
                Kind::BadJson => {
                    assert_eq!(r.expect, 400);
                    assert!(serde_json::from_slice::<Value>(&r.body).is_err());
                }
                _ => {
                    let v: Value = serde_json::from_slice(&r.body).unwrap();
                    assert_eq!(v["model"], MODEL);
                    assert_eq!(v["stream"].as_bool().unwrap_or(false), r.stream);
                }
            }
        }
        let pair = jobs.iter().find(|j| j.kind == Kind::ResponsesPair).unwrap();
        let first: Value = serde_json::from_slice(&b.request(pair).body).unwrap();
        assert_eq!(first["store"], true);
        let next: Value = serde_json::from_slice(&b.continuation(pair, "resp_1").body).unwrap();
        assert_eq!(next["previous_response_id"], "resp_1");
        assert_eq!(next["stream"], true);
    }
}
