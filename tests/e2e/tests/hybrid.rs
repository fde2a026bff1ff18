//! End-to-end on a hybrid fleet: mock replicas whose model has a sliding-window KV cache group
//! next to full attention (group 0 sliding, as in gpt-oss and Gemma 3), behind real Envoy with
//! the filter and indexd.
//!
//! Agentic conversations run in parallel: a system prompt they all share, then turns that each
//! append the answer and a new message. Every continuation is held against the oracle — what the
//! best replica would serve it from cache (each mock's `/admin/probe`), asked just before it is
//! sent. On a sliding-window model a replica holding a conversation's blocks in the full-attention
//! group alone serves none of them, so the router must know each group's blocks. After every
//! turn the test waits until each indexd has applied every batch the replicas published, as a
//! client's think time would.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::time::Duration;

use kvroute_e2e::client::{Outcome, chat_body, filler, message, post_json};
use kvroute_e2e::stack::wait_until;
use kvroute_e2e::{Stack, StackOptions, http};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(20);
const BLOCK_SIZE: u32 = 16;
const REPLICAS: usize = 3;
const CONVERSATIONS: u64 = 4;
const TURNS: usize = 4;

fn start(layout: &str, gateways: usize, num_gpu_blocks: usize) -> Stack {
    Stack::start(StackOptions {
        replicas: REPLICAS,
        gateways,
        num_gpu_blocks,
        max_model_len: 2_048,
        block_size: BLOCK_SIZE,
        kv_cache_layout: layout.parse().unwrap(),
        // Chunked prefill: the sliding group keeps nothing of the first chunk.
        max_num_batched_tokens: Some(512),
        // Several gateways: each indexd knows blocks from the replicas' events alone, not from
        // its own Picks.
        indexd_speculative_ttl: (gateways > 1).then_some(Duration::ZERO),
        ..StackOptions::default()
    })
    .unwrap()
}

fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

fn admin_post(stack: &Stack, replica: usize, path: &str, body: &Value) -> Value {
    let url = format!("http://{}{path}", stack.replicas()[replica].admin_addr());
    let r = http::post(
        &url,
        &[("content-type", "application/json")],
        body.to_string().as_bytes(),
        WAIT,
    )
    .unwrap();
    assert_eq!(r.status, 200, "{path}: {}", r.body);
    serde_json::from_str(&r.body).unwrap()
}

/// Waits until every indexd has applied every batch the replicas published so far.
fn settle(stack: &Stack) {
    stack.flush_events();
    let produced: f64 = (0..REPLICAS)
        .map(|i| {
            let url = format!("http://{}/admin/state", stack.replicas()[i].admin_addr());
            let r = http::get(&url, &[], WAIT).unwrap();
            let state: Value = serde_json::from_str(&r.body).unwrap();
            state["events"]["next_seq"].as_f64().unwrap()
        })
        .sum();
    wait_until("every indexd applies the replicas' batches", WAIT, || {
        stack
            .indexd_handles()
            .iter()
            .all(|h| value(&h.metrics_text(), "indexd_batches_total") >= produced)
    })
    .unwrap();
}

/// The oracle for `body`: the most any replica would serve from its cache now, and which
/// replicas (`ip:port`) hold that much.
fn oracle(stack: &Stack, body: &Value, prompt_tokens: Option<u64>) -> (u64, Vec<String>) {
    let url = format!("http://{}/tokenize", stack.replica_addresses()[0]);
    let request = json!({"model": body["model"], "messages": body["messages"]});
    let r = http::post(
        &url,
        &[("content-type", "application/json")],
        request.to_string().as_bytes(),
        WAIT,
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let tokens = serde_json::from_str::<Value>(&r.body).unwrap()["tokens"].clone();
    if let Some(n) = prompt_tokens {
        assert_eq!(tokens.as_array().unwrap().len() as u64, n);
    }
    let hits: Vec<u64> = (0..REPLICAS)
        .map(|i| {
            let probe = json!({"model": body["model"], "token_ids": tokens});
            admin_post(stack, i, "/admin/probe", &probe)["hit_tokens"]
                .as_u64()
                .unwrap()
        })
        .collect();
    let best = hits.iter().copied().max().unwrap_or(0);
    let holders = stack
        .replica_addresses()
        .into_iter()
        .zip(&hits)
        .filter(|(_, h)| **h == best)
        .map(|(a, _)| a)
        .collect();
    (best, holders)
}

/// What continuations got, and what the oracle held for them.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    continuations: u64,
    cached: u64,
    oracle: u64,
}

impl Tally {
    fn add(self, other: Tally) -> Tally {
        Tally {
            continuations: self.continuations + other.continuations,
            cached: self.cached + other.cached,
            oracle: self.oracle + other.oracle,
        }
    }

    fn ratio(&self) -> f64 {
        self.cached as f64 / self.oracle.max(1) as f64
    }
}

/// One agentic conversation; each turn goes through the next gateway.
struct Conversation {
    id: u64,
    messages: Vec<Value>,
    previous: Option<Outcome>,
    turn: usize,
    tally: Tally,
}

impl Conversation {
    fn new(id: u64) -> Self {
        Self {
            id,
            messages: vec![
                // Every conversation's system prompt is the same.
                message("system", &filler(9_000, 300)),
                message("user", &filler(id + 1, 150)),
            ],
            previous: None,
            turn: 0,
            tally: Tally::default(),
        }
    }

    /// Sends the next turn, checks a continuation against the oracle, waits until every
    /// indexd has its events, then appends the answer and a new message.
    fn step(&mut self, stack: &Stack, urls: &[String]) {
        let mut body = chat_body(&stack.options().model, &self.messages, None);
        body["max_tokens"] = json!(24);
        let url = &urls[(self.id as usize + self.turn) % urls.len()];
        let expected = self.previous.as_ref().map(|_| oracle(stack, &body, None));
        let out = post_json(url, "/v1/chat/completions", &body, &[]).unwrap();
        assert_eq!(out.status, 200, "{}", out.body);
        let what = format!("conversation {} turn {} via {url}", self.id, self.turn);
        if let (Some(prev), Some((best, holders))) = (&self.previous, expected) {
            // Its history is held where the previous turn ran (unless evicted since): the
            // sliding group's tail at that prompt's last full block, every block in the
            // full-attention group.
            let bs = u64::from(BLOCK_SIZE);
            let boundary = (prev.prompt_tokens - 1) / bs * bs;
            assert!(best > 0, "{what}: no replica holds its history");
            let served = out.replica.clone().unwrap();
            assert!(
                holders.contains(&served),
                "{what}: served by {served}, the history is on {holders:?} ({:?}; oracle {best}, boundary {boundary})",
                out.decision
            );
            assert_eq!(out.decision.as_deref(), Some("precise"), "{what}");
            assert!(
                out.cached_tokens >= best,
                "{what}: cached {} of the oracle's {best}",
                out.cached_tokens
            );
            self.tally.continuations += 1;
            self.tally.cached += out.cached_tokens;
            self.tally.oracle += best;
        }
        settle(stack);
        self.messages.push(message("assistant", &out.text));
        self.messages.push(message(
            "user",
            &filler(self.id * 100 + self.turn as u64 + 50, 40),
        ));
        self.previous = Some(out);
        self.turn += 1;
    }
}

/// Runs the conversations in parallel, one thread each; returns their tallies summed.
fn run_parallel(stack: &Stack) -> Tally {
    let urls = stack.gateway_urls().unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..CONVERSATIONS)
            .map(|id| {
                let urls = &urls;
                s.spawn(move || {
                    let mut c = Conversation::new(id);
                    for _ in 0..TURNS {
                        c.step(stack, urls);
                    }
                    c.tally
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .fold(Tally::default(), Tally::add)
    })
}

/// Runs the conversations' turns one at a time, round robin (under cache pressure a parallel
/// turn could evict what the oracle saw before the request arrives).
fn run_interleaved(stack: &Stack, conversations: u64) -> Tally {
    let urls = stack.gateway_urls().unwrap();
    let mut all: Vec<Conversation> = (0..conversations).map(Conversation::new).collect();
    for _ in 0..TURNS {
        for c in &mut all {
            c.step(stack, &urls);
        }
    }
    all.iter()
        .map(|c| c.tally)
        .fold(Tally::default(), Tally::add)
}

/// Replicas holding some cached block now.
fn warm_replicas(stack: &Stack) -> usize {
    (0..REPLICAS)
        .filter(|i| {
            let url = format!("http://{}/admin/state", stack.replicas()[*i].admin_addr());
            let r = http::get(&url, &[], WAIT).unwrap();
            let state: Value = serde_json::from_str(&r.body).unwrap();
            state["cached_blocks"].as_u64().unwrap_or(0) > 0
        })
        .count()
}

/// Every indexd indexed the groups (no block skipped for its group or its length) and the
/// first one's `/readyz` lists the groups of each replica that published events as modelled.
fn check_indexd(stack: &Stack, groups: &str) {
    for (i, indexd) in stack.indexd_handles().iter().enumerate() {
        let m = indexd.metrics_text();
        assert!(value(&m, "indexd_index_entries") > 0.0, "indexd {i}\n{m}");
        assert!(
            value(&m, "indexd_blocks_total{outcome=\"stored\"}") > 0.0,
            "indexd {i}"
        );
        for outcome in ["skipped_group", "skipped_bad_length"] {
            let series = format!("indexd_blocks_total{{outcome=\"{outcome}\"}}");
            assert_eq!(value(&m, &series), 0.0, "indexd {i}: {series}");
        }
    }
    let url = format!("http://{}/readyz", stack.indexd_http().unwrap());
    let r = http::get(&url, &[], WAIT).unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let listed = format!("{groups} (modelled)");
    let lines: Vec<&str> = r
        .body
        .lines()
        .filter(|l| l.starts_with("kv groups "))
        .collect();
    assert_eq!(lines.len(), warm_replicas(stack), "{}", r.body);
    assert!(lines.iter().all(|l| l.ends_with(&listed)), "{}", r.body);
}

/// One gateway: continuations land warm and the mock serves them from cache.
#[test]
fn agentic_conversations_stay_warm_on_a_sliding_window_fleet() {
    let stack = start("sliding_window:256,full_attention", 1, 8_192);
    let t = run_parallel(&stack);
    eprintln!("one gateway, window 256: {t:?}");
    assert_eq!(t.continuations, CONVERSATIONS * (TURNS as u64 - 1));
    assert!(t.ratio() >= 0.99, "{t:?}");
    check_indexd(&stack, "0:sliding_window/256@16 1:full_attention@16");
}

/// Three gateways, each its own indexd, every turn through the next one: each indexd knows where
/// a conversation is warm only from the events of both groups.
#[test]
fn three_gateways_reach_the_oracle_on_a_sliding_window_fleet() {
    let stack = start("sliding_window:256,full_attention", 3, 8_192);
    let t = run_parallel(&stack);
    eprintln!("three gateways, window 256: {t:?}");
    assert!(t.ratio() >= 0.99, "{t:?}");
    check_indexd(&stack, "0:sliding_window/256@16 1:full_attention@16");
}

/// gpt-oss's window (128 tokens), three gateways, and caches small enough that blocks are
/// evicted: conversations sharing only the system prompt store copies of its blocks, each copy
/// evicted on its own; an index that miscounted them would send continuations to replicas that
/// lost their history.
#[test]
fn three_gateways_reach_the_oracle_with_a_gpt_oss_window_under_pressure() {
    let stack = start("sliding_window:128,full_attention", 3, 160);
    let t = run_interleaved(&stack, 6);
    eprintln!("three gateways, window 128, 160 blocks: {t:?}");
    assert!(t.ratio() >= 0.99, "{t:?}");
    let m = stack.indexd_handles()[0].metrics_text();
    let removed = value(&m, "indexd_blocks_total{outcome=\"removed\"}");
    eprintln!("blocks removed: {removed}");
    assert!(
        removed > 0.0,
        "no eviction: the cache was not under pressure"
    );
    check_indexd(&stack, "0:sliding_window/128@16 1:full_attention@16");
}
