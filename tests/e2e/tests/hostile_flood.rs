//! Hostile bodies end to end: 16 clients each send ~8 MB adversarial requests
//! through real Envoy + the built filter (`max_body_bytes` 8,000,000 and an
//! 8 MiB buffer, as `envoy/envoy.yaml` ships them) + indexd + mock replicas,
//! in the three shapes of indexd's hostile bench (`make bench-hostile`): one
//! giant word in a chat message, megabytes of nested tools, a Responses body
//! of ~100k items. Meanwhile ordinary multi-turn conversations run through
//! the same Envoy.
//!
//! Every ordinary request is answered 200 and routed by the filter (never a
//! fail-open reason), every continuation lands on its warm replica; every
//! hostile request is answered by some replica (routed or not: none is
//! lost); the hostile bodies did reach indexd (its tokenization counters);
//! and indexd is still ready afterwards. No timing is asserted: every wait is
//! for an event, bounded. The filter's Pick budget is 12 s (indexd's wait
//! for a replica's `/tokenize` 10 s), not the shipped 550 ms. The mock
//! replicas read each body off their event loop, as vLLM's API server
//! tokenizes on a thread pool, and are optimised in test builds: the
//! hostile requests reach them too (as inference requests, and as
//! `/tokenize` calls of an indexd without a local tokenizer), and a debug
//! build of the stand-in for vLLM would be what the test measured.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvroute_e2e::client::{Outcome, chat_body, filler, message, post_json, post_raw};
use kvroute_e2e::stack::wait_until;
use kvroute_e2e::{Stack, StackOptions, http};
use serde_json::{Value, json};

/// The filter's `max_body_bytes` in `envoy/envoy.yaml`: a hostile body just
/// under it is buffered and sent to indexd in its Pick.
const MAX_BODY_BYTES: usize = 8_000_000;
/// Each hostile body's size (its JSON framing included, at most this).
const HOSTILE_BYTES: usize = MAX_BODY_BYTES - 16 * 1024;
/// Hostile clients, each with one request in flight at a time.
const FLOODERS: usize = 16;
/// Hostile requests per client (fewer if [`FLOOD_FOR`] passes first).
const PER_FLOODER: usize = 2;
/// No client starts a hostile request after this long.
const FLOOD_FOR: Duration = Duration::from_secs(40);
/// Ordinary conversations run while the flood lasts: at least this many…
const MIN_CONVERSATIONS: u64 = 3;
/// …and at most this many.
const MAX_CONVERSATIONS: u64 = 40;
/// Turns per ordinary conversation (the first, then continuations).
const TURNS: usize = 3;
/// Ordinary continuations that must have run while hostile requests were in
/// flight, both when sent and when answered.
const MIN_OVERLAPPED: usize = 3;
/// The bound of every wait for an event.
const WAIT: Duration = Duration::from_secs(30);
/// indexd's wait for a mock replica's `/tokenize` (see the test).
const REPLICA_TIMEOUT: Duration = Duration::from_secs(10);
/// The filter's reasons for a request it routed (set an override).
const ROUTED: [&str; 2] = ["precise", "load"];

/// The three hostile shapes: (name, path, body).
fn hostile_bodies(model: &str) -> Vec<(&'static str, &'static str, Vec<u8>)> {
    // One word of `HOSTILE_BYTES` less the JSON around it.
    let framing = json!({"model": model, "messages": [{"role": "user", "content": ""}]})
        .to_string()
        .len();
    let word = "a".repeat(HOSTILE_BYTES - framing);
    let single_word = json!({"model": model, "messages": [{"role": "user", "content": word}]});
    // Tools nested eight objects deep, as many as fit.
    let tool = |i: usize| {
        json!({"type": "function", "function": {"name": format!("tool_{i}"), "description": "d".repeat(64),
            "parameters": {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "array", "items": {"type": "object", "properties": {"c": {"type": "string", "description": "x".repeat(64)}}}}}}}}}})
    };
    let per_tool = tool(100_000).to_string().len() + 1;
    let tools: Vec<Value> = (0..(HOSTILE_BYTES - 200) / per_tool).map(tool).collect();
    let deep_tools =
        json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "tools": tools});
    // A Responses input of function calls, as many as fit.
    let item = |i: usize| json!({"type": "function_call", "call_id": format!("c{i}"), "name": "f", "arguments": "{}"});
    let per_item = item(1_000_000).to_string().len() + 1;
    let mut input = vec![json!({"role": "user", "content": "go"})];
    input.extend((0..(HOSTILE_BYTES - 200) / per_item).map(item));
    let items = json!({"model": model, "input": input});
    vec![
        (
            "single word chat",
            "/v1/chat/completions",
            single_word.to_string().into_bytes(),
        ),
        (
            "deep tools",
            "/v1/chat/completions",
            deep_tools.to_string().into_bytes(),
        ),
        (
            "Responses items",
            "/v1/responses",
            items.to_string().into_bytes(),
        ),
    ]
}

/// The sum of every series of `name` in indexd's metrics (all labels).
fn series_sum(stack: &Stack, name: &str) -> f64 {
    stack
        .indexd()
        .unwrap()
        .metrics_text()
        .lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// indexd's counters a failure's message shows.
const DIAGNOSED: [&str; 7] = [
    "eviction_discounts_total",
    "decisions_total",
    "moves_total",
    "scrapes_total",
    "tokenize_total",
    "tokenize_refused_total",
    "tokenize_cancelled_total",
];

/// indexd's Pick and tokenization counters, what it sees of each replica,
/// and Envoy's view of its link to indexd and of the filter's decisions: a
/// failure's message.
fn diagnostics(stack: &Stack) -> String {
    let indexd = stack.indexd().unwrap();
    let envoy = stack.envoy().prometheus_stats().unwrap_or_default();
    let mut lines: Vec<String> = indexd
        .metrics_text()
        .lines()
        .filter(|l| {
            DIAGNOSED
                .iter()
                .any(|s| l.starts_with(&format!("indexd_{s}")))
        })
        .map(str::to_owned)
        .collect();
    lines.extend(
        envoy
            .lines()
            .filter(|l| !l.starts_with('#') && !l.ends_with(" 0"))
            .filter(|l| {
                l.contains("kvroute_decisions")
                    || l.contains("kvroute_breaker")
                    || (l.contains("kvroute_indexd")
                        && (l.contains("upstream_rq_") || l.contains("upstream_cx_tx_bytes")))
                    || (l.contains("envoy_cluster_name=\"vllm\"")
                        && ["retry", "reset", "destroy", "rq_xx", "cx_total"]
                            .iter()
                            .any(|s| l.contains(s)))
            })
            .map(str::to_owned),
    );
    for a in stack.replica_addresses() {
        let id = indexd::EndpointId {
            address: a.parse().unwrap(),
            rank: None,
        };
        lines.push(format!("replica {a}: {:?}", indexd.replica(&id)));
    }
    lines.join("\n")
}

/// Blocks indexd holds for each replica, in cluster order.
fn entries(stack: &Stack) -> Vec<usize> {
    let indexd = stack.indexd().unwrap();
    stack
        .replica_addresses()
        .iter()
        .map(|a| {
            let id = indexd::EndpointId {
                address: a.parse().unwrap(),
                rank: None,
            };
            indexd.replica(&id).map_or(0, |s| s.entries)
        })
        .collect()
}

/// What the flood's clients share.
#[derive(Default)]
struct Flood {
    /// Hostile requests sent and not yet answered.
    in_flight: AtomicUsize,
    /// Hostile requests sent so far.
    sent: AtomicUsize,
    /// Clients that have sent all theirs.
    done: AtomicUsize,
}

/// One hostile client: up to [`PER_FLOODER`] bodies, one at a time, none
/// started after `until`. Returns each request's shape and outcome.
fn flooder(
    client: usize,
    url: &str,
    bodies: &[(&'static str, &'static str, Vec<u8>)],
    flood: &Flood,
    until: Instant,
) -> Vec<(&'static str, Result<Outcome, String>)> {
    let mut out = Vec::new();
    for k in 0..PER_FLOODER {
        if Instant::now() > until {
            break;
        }
        let (name, path, body) = &bodies[(client + k) % bodies.len()];
        flood.in_flight.fetch_add(1, Ordering::SeqCst);
        flood.sent.fetch_add(1, Ordering::SeqCst);
        let answer = post_raw(url, path, body, &[("content-type", "application/json")])
            .map_err(|e| e.to_string());
        flood.in_flight.fetch_sub(1, Ordering::SeqCst);
        out.push((*name, answer));
    }
    flood.done.fetch_add(1, Ordering::SeqCst);
    out
}

/// One ordinary turn: answered 200 and routed; returns the outcome once
/// indexd has ingested the blocks it stored on the replica that served.
fn ordinary_turn(stack: &Stack, messages: &[Value], what: &str) -> Outcome {
    let before = entries(stack);
    let body = chat_body(&stack.options().model, messages, None);
    let out = post_json(&stack.url().unwrap(), "/v1/chat/completions", &body, &[]).unwrap();
    assert_eq!(out.status, 200, "{what}: {} ({:?})", out.body, out.decision);
    let decision = out.decision.as_deref().unwrap_or("none");
    assert!(
        ROUTED.contains(&decision),
        "{what}: the filter did not route an ordinary request under the flood: {decision} after {:?}\n{}",
        out.latency,
        diagnostics(stack)
    );
    let served = stack
        .replica_addresses()
        .iter()
        .position(|a| Some(a.as_str()) == out.replica.as_deref())
        .unwrap_or_else(|| panic!("{what}: no replica answered: {out:?}"));
    // The conversation's text is its own: every full block of the prompt
    // that was not served from cache is new on that replica (whose cache is
    // far from full).
    let block = u64::from(stack.options().block_size);
    let blocks = (out.prompt_tokens / block).saturating_sub(out.cached_tokens / block) as usize;
    stack
        .wait_indexed(served, before[served] + blocks, WAIT)
        .unwrap();
    out
}

#[test]
#[allow(clippy::too_many_lines)]
fn hostile_bodies_leave_ordinary_requests_routed() {
    let mut options = StackOptions {
        replicas: 3,
        // indexd on a runtime of its own, as its own process would be: the
        // mock replicas parse each 8 MB body on the stack's two workers.
        thread_label: Some("flood".into()),
        // This indexd has no local tokenizer: an ordinary Pick's body is
        // tokenized by a mock replica's `/tokenize`, queued behind the
        // hostile bodies' on the same two busy cores (and every other test's
        // beside them). What is tested is indexd and the filter under the
        // flood, not how fast the stand-in for vLLM parses 8 MB: its call
        // gets 10 s, not the default 2 s, and the filter's Pick budget
        // covers it.
        indexd_replica_timeout: Some(REPLICA_TIMEOUT),
        ..StackOptions::default()
    };
    options.filter_overrides["tokenizer_timeout_ms"] =
        json!(REPLICA_TIMEOUT.as_millis() as u64 + 1_000);
    options.filter_overrides["max_body_bytes"] = json!(MAX_BODY_BYTES);
    let stack = Stack::start(options).unwrap();
    assert!(
        stack.options().buffer_limit_bytes as usize > MAX_BODY_BYTES,
        "Envoy must buffer what the filter reads"
    );
    let url = stack.url().unwrap();
    let addresses = stack.replica_addresses();
    let bodies = hostile_bodies(&stack.options().model);
    for (name, _, body) in &bodies {
        assert!(
            (MAX_BODY_BYTES - 512 * 1024..=HOSTILE_BYTES).contains(&body.len()),
            "{name}: {} bytes",
            body.len()
        );
    }
    let tokenized_before = series_sum(&stack, "indexd_tokenize_total");
    let refused_before = series_sum(&stack, "indexd_tokenize_refused_total");

    let flood = Flood::default();
    let started = Instant::now();
    let until = started + FLOOD_FOR;
    let mut ordinary = 0usize;
    let mut overlapped = 0usize;
    let mut conversations = 0u64;
    let hostile: Vec<(&'static str, Result<Outcome, String>)> = std::thread::scope(|s| {
        let clients: Vec<_> = (0..FLOODERS)
            .map(|c| {
                let (url, bodies, flood) = (&url, &bodies, &flood);
                s.spawn(move || flooder(c, url, bodies, flood, until))
            })
            .collect();
        // The ordinary stream starts once every hostile client has sent.
        wait_until("every hostile client sends", WAIT, || {
            flood.sent.load(Ordering::SeqCst) >= FLOODERS
        })
        .unwrap();
        while conversations < MIN_CONVERSATIONS
            || (flood.done.load(Ordering::SeqCst) < FLOODERS && conversations < MAX_CONVERSATIONS)
        {
            let c = conversations;
            let mut messages = vec![message("user", &filler(9_000 + c, 150))];
            let first = ordinary_turn(&stack, &messages, &format!("conversation {c} turn 0"));
            ordinary += 1;
            let warm = first.replica.clone().unwrap();
            let mut last = first;
            for t in 1..TURNS {
                let what = format!("conversation {c} turn {t}");
                messages.push(message("assistant", &last.text));
                messages.push(message("user", &filler(19_000 + c * 10 + t as u64, 40)));
                let during = flood.in_flight.load(Ordering::SeqCst) > 0;
                let next = ordinary_turn(&stack, &messages, &what);
                ordinary += 1;
                if during && flood.in_flight.load(Ordering::SeqCst) > 0 {
                    overlapped += 1;
                }
                assert_eq!(
                    next.decision.as_deref(),
                    Some("precise"),
                    "{what}\n{}",
                    diagnostics(&stack)
                );
                assert_eq!(
                    next.replica.as_deref(),
                    Some(warm.as_str()),
                    "{what}: cached {} of {}\n{}",
                    next.cached_tokens,
                    next.prompt_tokens,
                    diagnostics(&stack)
                );
                assert!(
                    next.cached_tokens >= last.prompt_tokens / 2,
                    "{what}: cached {} of a {}-token previous turn",
                    next.cached_tokens,
                    last.prompt_tokens
                );
                last = next;
            }
            conversations += 1;
        }
        clients
            .into_iter()
            .flat_map(|c| c.join().expect("a hostile client panicked"))
            .collect()
    });
    let flood_took = started.elapsed();

    // Every hostile request was answered by a replica, routed or not.
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for (name, answer) in &hostile {
        let out = answer
            .as_ref()
            .unwrap_or_else(|e| panic!("{name}: lost: {e}"));
        assert!(
            out.replica
                .as_deref()
                .is_some_and(|r| addresses.iter().any(|a| a == r)),
            "{name}: no replica answered: {} {}",
            out.status,
            out.body.chars().take(300).collect::<String>()
        );
        assert!(out.status < 500, "{name}: {} {}", out.status, out.body);
        *seen
            .entry(format!(
                "{name}: {} {}",
                out.status,
                out.decision.as_deref().unwrap_or("none")
            ))
            .or_default() += 1;
    }
    assert!(
        hostile.len() >= FLOODERS,
        "{} hostile requests",
        hostile.len()
    );
    assert!(
        overlapped >= MIN_OVERLAPPED,
        "only {overlapped} ordinary continuations ran while hostile requests were in flight"
    );

    // The hostile bodies reached indexd: it was asked to tokenize more bodies
    // than the ordinary requests carried (each Pick carries its body; a body
    // refused by the admission budget counts too). Counted once its work ends.
    wait_until("indexd finishes the bodies in flight", WAIT, || {
        series_sum(&stack, "indexd_tokenize_inflight_bodies") == 0.0
    })
    .unwrap();
    let tokenized = series_sum(&stack, "indexd_tokenize_total") - tokenized_before;
    let refused = series_sum(&stack, "indexd_tokenize_refused_total") - refused_before;
    let hostile_at_indexd = tokenized as usize - ordinary.min(tokenized as usize);
    // (A sum of no series is -0.0: counted as a whole number.)
    let over_length = series_sum(
        &stack,
        "indexd_decisions_total{decision=\"load\",reason=\"over_max_model_len\"}",
    ) as u64;
    eprintln!(
        "hostile flood: {} hostile requests in {:.1} s beside {ordinary} ordinary ({overlapped} continuations overlapped); \
         indexd tokenized {tokenized} bodies ({hostile_at_indexd} hostile), refused {refused} at admission, \
         routed {over_length} by load as longer than the model's context; hostile outcomes {seen:?}",
        hostile.len(),
        flood_took.as_secs_f64()
    );
    assert!(
        hostile_at_indexd >= FLOODERS,
        "only {hostile_at_indexd} hostile bodies reached indexd ({tokenized} bodies for {ordinary} ordinary requests)"
    );

    // indexd is alive and ready.
    let indexd_http = stack.indexd_http().unwrap();
    let ready = http::get(&format!("http://{indexd_http}/readyz"), &[], WAIT).unwrap();
    assert_eq!(ready.status, 200, "{}", ready.body);
    assert!(ready.body.starts_with("ready"), "{}", ready.body);
    stack.wait_index_ready(WAIT).unwrap();
}
