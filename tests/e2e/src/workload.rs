//! A small multi-turn agentic workload: conversations that share a system
//! prompt and tool list, then grow their own history turn by turn, run
//! concurrently through the stack. Used by `make run` (the demo).

use std::sync::Mutex;
use std::time::Duration;

use serde_json::Value;

use crate::client::{Outcome, chat_body, filler, message, post_json};
use crate::{HarnessError, Stack};

/// The workload's shape.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Conversations.
    pub conversations: usize,
    /// Turns per conversation.
    pub turns: usize,
    /// Conversations in flight at once.
    pub concurrency: usize,
    /// Words of each new user message (tool results are longer).
    pub words_per_turn: usize,
}

/// One request's record.
#[derive(Debug, Clone)]
pub struct Sample {
    /// Conversation index.
    pub conversation: usize,
    /// Turn index (0 = the first).
    pub turn: usize,
    /// What came back.
    pub outcome: Outcome,
}

/// What a profile achieved on the continuation turns (turn ≥ 1).
#[derive(Debug, Clone, Default)]
pub struct Summary {
    /// Requests sent.
    pub requests: usize,
    /// Requests that did not answer 200.
    pub errors: usize,
    /// Continuation turns.
    pub continuations: usize,
    /// Continuations served by the replica that served the previous turn.
    pub warm_returns: usize,
    /// Prompt tokens of the continuations.
    pub prompt_tokens: u64,
    /// Of those, served from the prefix cache.
    pub cached_tokens: u64,
    /// Mean latency over all requests.
    pub mean_latency: Duration,
    /// Median latency over all requests.
    pub p50_latency: Duration,
}

impl Summary {
    /// `cached_tokens / prompt_tokens` of the continuations, in percent.
    pub fn hit_percent(&self) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            100.0 * self.cached_tokens as f64 / self.prompt_tokens as f64
        }
    }
}

/// Runs the workload and returns every request's record.
pub fn run(
    stack: &Stack,
    shape: Shape,
    progress: &(dyn Fn(usize) + Sync),
) -> Result<Vec<Sample>, HarnessError> {
    let url = stack.url()?;
    let model = stack.options().model.clone();
    let next = Mutex::new(0usize);
    let samples = Mutex::new(Vec::new());
    let failure = Mutex::new(None);
    std::thread::scope(|scope| {
        for _ in 0..shape.concurrency.max(1) {
            scope.spawn(|| {
                loop {
                    let conversation = {
                        let Ok(mut n) = next.lock() else { return };
                        let c = *n;
                        *n += 1;
                        c
                    };
                    if conversation >= shape.conversations {
                        return;
                    }
                    match conversation_run(&url, &model, conversation, shape) {
                        Ok(mut done) => {
                            if let Ok(mut all) = samples.lock() {
                                all.append(&mut done);
                                progress(all.len());
                            }
                        }
                        Err(e) => {
                            if let Ok(mut f) = failure.lock() {
                                *f = Some(e);
                            }
                            return;
                        }
                    }
                }
            });
        }
    });
    if let Some(e) = failure.into_inner().ok().flatten() {
        return Err(e);
    }
    Ok(samples.into_inner().unwrap_or_default())
}

fn conversation_run(
    url: &str,
    model: &str,
    conversation: usize,
    shape: Shape,
) -> Result<Vec<Sample>, HarnessError> {
    let id = conversation as u64;
    let mut messages: Vec<Value> = vec![
        message(
            "system",
            &format!("You are a coding agent. Tools: {}", filler(9_999, 150)),
        ),
        message("user", &filler(id * 1_000, shape.words_per_turn)),
    ];
    let mut samples = Vec::with_capacity(shape.turns);
    for turn in 0..shape.turns {
        let outcome = post_json(
            url,
            "/v1/chat/completions",
            &chat_body(model, &messages, None),
            &[],
        )?;
        messages.push(message("assistant", &outcome.text));
        // The agent's next input: a tool result, longer than a user turn.
        let words = shape.words_per_turn * if turn % 2 == 0 { 3 } else { 1 };
        messages.push(message(
            if turn % 2 == 0 { "tool" } else { "user" },
            &filler(id * 1_000 + turn as u64 + 1, words),
        ));
        samples.push(Sample {
            conversation,
            turn,
            outcome,
        });
    }
    Ok(samples)
}

/// Summarises samples (continuation metrics over turns ≥ 1).
pub fn summarize(samples: &[Sample]) -> Summary {
    let mut summary = Summary {
        requests: samples.len(),
        ..Summary::default()
    };
    let mut latencies: Vec<Duration> = samples.iter().map(|s| s.outcome.latency).collect();
    latencies.sort();
    if !latencies.is_empty() {
        let total: Duration = latencies.iter().sum();
        summary.mean_latency = total / u32::try_from(latencies.len()).unwrap_or(u32::MAX);
        summary.p50_latency = latencies
            .get(latencies.len() / 2)
            .copied()
            .unwrap_or_default();
    }
    for s in samples {
        if s.outcome.status != 200 {
            summary.errors += 1;
        }
        if s.turn == 0 {
            continue;
        }
        summary.continuations += 1;
        summary.prompt_tokens += s.outcome.prompt_tokens;
        summary.cached_tokens += s.outcome.cached_tokens;
        let previous = samples
            .iter()
            .find(|p| p.conversation == s.conversation && p.turn + 1 == s.turn);
        if previous
            .is_some_and(|p| p.outcome.replica.is_some() && p.outcome.replica == s.outcome.replica)
        {
            summary.warm_returns += 1;
        }
    }
    summary
}
