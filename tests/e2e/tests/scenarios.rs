//! End-to-end scenarios on the mock: real Envoy + the built filter + indexd
//! + mock vLLM replicas, all on loopback.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::time::Duration;

use kvroute_e2e::client::{Outcome, chat_body, filler, message, post_json, post_raw};
use kvroute_e2e::stack::OVERRIDE_HEADER;
use kvroute_e2e::{Routing, Stack, StackOptions, http};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(10);

fn index_of(stack: &Stack, name: &str) -> usize {
    stack
        .replica_addresses()
        .iter()
        .position(|a| a == name)
        .unwrap_or_else(|| panic!("{name} is not a replica"))
}

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

fn chat(stack: &Stack, messages: &[Value], salt: Option<&str>) -> Outcome {
    let url = stack.url().unwrap();
    let body = chat_body(&stack.options().model, messages, salt);
    let out = post_json(&url, "/v1/chat/completions", &body, &[]).unwrap();
    assert_eq!(out.status, 200, "{}", out.body);
    out
}

/// Sends `messages`, waits until indexd has ingested the blocks it stored,
/// and returns the outcome.
fn turn(stack: &Stack, messages: &[Value], salt: Option<&str>) -> Outcome {
    let out = chat(stack, messages, salt);
    let served = index_of(stack, out.replica.as_deref().unwrap());
    let blocks = (out.prompt_tokens / u64::from(stack.options().block_size)) as usize;
    stack.wait_indexed(served, blocks, WAIT).unwrap();
    out
}

fn admin(stack: &Stack, replica: usize, path: &str, body: &Value) {
    let url = format!("http://{}{path}", stack.replicas()[replica].admin_addr());
    let r = http::post(
        &url,
        &[("content-type", "application/json")],
        body.to_string().as_bytes(),
        WAIT,
    )
    .unwrap();
    assert_eq!(r.status, 200, "{path}: {}", r.body);
}

/// A conversation's first turn: a system prompt every conversation shares,
/// then its own question.
fn opening(conversation: u64) -> Vec<Value> {
    vec![
        message("system", &filler(1_000, 60)),
        message("user", &filler(conversation, 120)),
    ]
}

/// A first turn that shares no block with any other conversation.
fn unshared(conversation: u64) -> Vec<Value> {
    vec![message("user", &filler(conversation + 5_000, 150))]
}

#[test]
fn continuations_land_on_the_warm_replica() {
    let stack = Stack::start(StackOptions {
        replicas: 3,
        ..StackOptions::default()
    })
    .unwrap();

    for conversation in 0..6u64 {
        let mut messages = opening(conversation);
        let first = turn(&stack, &messages, None);
        let warm = first.replica.clone().unwrap();

        messages.push(message("assistant", &first.text));
        messages.push(message("user", &filler(conversation + 100, 40)));
        let second = chat(&stack, &messages, None);
        assert_eq!(
            second.replica.as_deref(),
            Some(warm.as_str()),
            "conversation {conversation}"
        );
        assert_eq!(second.decision.as_deref(), Some("precise"));
        assert!(
            second.cached_tokens >= first.prompt_tokens / 2,
            "cached {} of a {}-token first turn",
            second.cached_tokens,
            first.prompt_tokens
        );
    }
}

/// Picks indexd answered, from its metrics (every decision kind).
fn picks(stack: &Stack) -> u64 {
    stack
        .indexd()
        .unwrap()
        .metrics_text()
        .lines()
        .filter(|l| l.starts_with("indexd_decisions_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

#[test]
fn local_continuations_skip_the_pick_and_stay_warm() {
    let mut options = StackOptions::default();
    options.filter_overrides["local_continuations"] = json!(2);
    // A loaded test machine may take seconds between turns: indexd's last
    // answer on the replicas' load stays good for this test's length.
    options.filter_overrides["continuation_load_ms"] = json!(60_000);
    let stack = Stack::start(options).unwrap();
    let mut messages = opening(31);
    let first = turn(&stack, &messages, None);
    let warm = first.replica.clone().unwrap();
    let before = picks(&stack);
    assert!(before >= 1, "the first turn was a Pick");
    let mut last = first;
    for i in 0..3 {
        messages.push(message("assistant", &last.text));
        messages.push(message("user", &filler(300 + i, 40)));
        last = chat(&stack, &messages, None);
        assert_eq!(last.replica.as_deref(), Some(warm.as_str()), "turn {i}");
        assert!(last.cached_tokens > 0, "turn {i} missed its cache");
        let expected = if i < 2 { "continued" } else { "precise" };
        assert_eq!(last.decision.as_deref(), Some(expected), "turn {i}");
    }
    // Two turns from the memory alone, then one Pick checks again; it told
    // indexd of the two (queued work on their replica until answered).
    assert_eq!(picks(&stack), before + 1);
    let metrics = stack.indexd().unwrap().metrics_text();
    assert!(
        metrics.contains("indexd_continued_total{result=\"noted\"} 2"),
        "{metrics}"
    );
    // A branch from the first turn continues it (that request was answered
    // here); a request whose previous turn never passed here asks indexd.
    let mut branch = messages[..2].to_vec();
    branch.push(message("assistant", "another answer"));
    branch.push(message("user", "and then?"));
    let out = chat(&stack, &branch, None);
    assert_eq!(out.decision.as_deref(), Some("continued"));
    let mut unknown = messages[..2].to_vec();
    for (role, text) in [
        ("assistant", "an answer"),
        ("user", "a question"),
        ("assistant", "an answer given elsewhere"),
        ("user", "more"),
    ] {
        unknown.push(message(role, text));
    }
    let out = chat(&stack, &unknown, None);
    assert_eq!(out.decision.as_deref(), Some("precise"));
    assert_eq!(picks(&stack), before + 2);
}

#[test]
fn salts_never_share_blocks() {
    let stack = Stack::start(StackOptions::default()).unwrap();
    let messages = opening(7);
    let a = turn(&stack, &messages, Some("tenant-a"));
    let b = turn(&stack, &messages, Some("tenant-b"));
    let b_again = chat(&stack, &messages, Some("tenant-b"));
    assert_eq!(a.cached_tokens, 0);
    assert_eq!(b.cached_tokens, 0, "tenant-b hit tenant-a's blocks");
    assert!(
        b_again.cached_tokens > 0,
        "tenant-b's repeat missed its own blocks"
    );
    assert_eq!(b_again.replica, b.replica);
    // Without a salt the same text is another identity again.
    let unsalted = chat(&stack, &messages, None);
    assert_eq!(unsalted.cached_tokens, 0);
}

#[test]
fn a_clients_override_header_is_ignored() {
    let stack = Stack::start(StackOptions::default()).unwrap();
    let mut messages = opening(11);
    let first = turn(&stack, &messages, None);
    let warm = first.replica.clone().unwrap();
    let other = stack
        .replica_addresses()
        .into_iter()
        .find(|a| *a != warm)
        .unwrap();
    messages.push(message("user", "and then?"));
    let url = stack.url().unwrap();
    let body = chat_body(&stack.options().model, &messages, None);
    for _ in 0..3 {
        let out = post_json(
            &url,
            "/v1/chat/completions",
            &body,
            &[(OVERRIDE_HEADER, &other)],
        )
        .unwrap();
        assert_eq!(
            out.replica.as_deref(),
            Some(warm.as_str()),
            "the client pinned the host"
        );
    }
}

#[test]
fn responses_continuations_reach_the_storing_replica() {
    let stack = Stack::start(StackOptions {
        replicas: 3,
        // indexd answers Observe late: the filter must hold each answer until
        // indexd knows its id, or the client's next step overtakes it.
        slow_indexd_link: true,
        ..StackOptions::default()
    })
    .unwrap();
    stack.set_indexd_delay(Duration::from_millis(100));
    let url = stack.url().unwrap();
    let model = stack.options().model.clone();
    for conversation in 0..4u64 {
        let mut previous: Option<String> = None;
        let mut served = None;
        for step in 0..4u64 {
            let mut body = json!({
                "model": model,
                "input": filler(conversation * 10 + step, 30),
                "max_output_tokens": 4,
            });
            if let Some(id) = &previous {
                body["previous_response_id"] = json!(id);
            }
            let out = post_json(&url, "/v1/responses", &body, &[]).unwrap();
            assert_eq!(
                out.status,
                200,
                "conversation {conversation} step {step}: {} ({:?}); indexd: {}",
                out.body,
                out.decision,
                stack
                    .indexd()
                    .unwrap()
                    .metrics_text()
                    .lines()
                    .filter(|l| l.contains("observes_total{") || l.contains("decisions_total{"))
                    .collect::<Vec<_>>()
                    .join("\n")
                    + &stack
                        .envoy()
                        .prometheus_stats()
                        .unwrap()
                        .lines()
                        .filter(|l| !l.starts_with('#')
                            && (l.contains("kvroute_observe")
                                || (l.contains("kvroute_indexd")
                                    && (l.contains("rq_") || l.contains("cx_"))
                                    && !l.ends_with(" 0"))))
                        .collect::<Vec<_>>()
                        .join("\n"),
            );
            if step > 0 {
                assert_eq!(out.decision.as_deref(), Some("affinity"));
                assert_eq!(out.replica, served);
            }
            served = out.replica.clone();
            previous = Some(out.response_id.clone().unwrap());
        }
    }
}

#[test]
fn indexd_down_fails_open_and_routing_resumes() {
    let mut stack = Stack::start(StackOptions::default()).unwrap();
    let mut messages = opening(21);
    let first = turn(&stack, &messages, None);
    let warm = first.replica.clone().unwrap();

    // While indexd is down, the filter's memory keeps the conversation on
    // the replica its previous turns went to.
    stack.stop_indexd();
    for i in 0..8 {
        messages.push(message("user", &format!("question {i}")));
        let out = chat(&stack, &messages, None);
        assert_eq!(out.decision.as_deref(), Some("remembered"), "turn {i}");
        assert_eq!(out.replica.as_deref(), Some(warm.as_str()), "turn {i}");
        assert!(out.cached_tokens > 0, "turn {i} missed its cache");
    }
    // A new conversation has nothing to remember: Envoy chooses.
    let fresh = chat(&stack, &unshared(21), None);
    let reason = fresh.decision.unwrap();
    assert!(
        reason == "index_unavailable" || reason == "breaker_open",
        "reason {reason}"
    );

    stack.start_indexd().unwrap();
    // The restarted indexd recovered the replica's blocks by replay.
    let held = entries(&stack)[index_of(&stack, &warm)];
    assert!(held > 0, "nothing recovered after the restart");
    // The breaker lets requests through to indexd again after its cool-down.
    let mut routed = None;
    for _ in 0..100 {
        messages.push(message("user", "more"));
        let out = chat(&stack, &messages, None);
        if out.decision.as_deref() == Some("precise") {
            routed = Some(out);
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let routed = routed.expect("routing never resumed");
    assert!(routed.cached_tokens > 0);
}

#[test]
fn a_slow_indexd_falls_back_and_the_breaker_opens_and_closes() {
    let stack = Stack::start(StackOptions {
        // A Pick carrying its body may take the tokenizer's time plus
        // indexd's: 100 ms in all here.
        filter_overrides: json!({
            "index_timeout_ms": 50,
            "tokenizer_timeout_ms": 50,
            "breaker": { "failures": 3, "window_ms": 10_000, "cooldown_ms": 300 },
            // The breaker alone: the conversation memory would route these.
            "remember": false,
        }),
        slow_indexd_link: true,
        ..StackOptions::default()
    })
    .unwrap();
    let mut messages = opening(25);
    let first = turn(&stack, &messages, None);

    // indexd answers after the filter's 100 ms timeout: every request goes on
    // unrouted, and after three failures the breaker skips indexd altogether.
    stack.set_indexd_delay(Duration::from_millis(400));
    let mut reasons = Vec::new();
    for i in 0..8 {
        messages.push(message("user", &format!("slow {i}")));
        reasons.push(chat(&stack, &messages, None).decision.unwrap());
    }
    assert!(
        reasons
            .iter()
            .all(|r| r == "index_unavailable" || r == "breaker_open"),
        "{reasons:?}"
    );
    assert_eq!(reasons[..3], ["index_unavailable"; 3], "{reasons:?}");
    assert!(reasons.contains(&"breaker_open".to_owned()), "{reasons:?}");

    // indexd is quick again: after the cool-down the breaker closes and the
    // conversation is routed to a replica holding its history once more (the
    // unrouted turns may have warmed either).
    stack.set_indexd_delay(Duration::ZERO);
    let mut routed = None;
    for i in 0..50 {
        messages.push(message("user", &format!("fast {i}")));
        let out = chat(&stack, &messages, None);
        if out.decision.as_deref() == Some("precise") {
            routed = Some(out);
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let routed = routed.expect("the breaker never closed");
    assert!(
        routed.cached_tokens >= first.prompt_tokens / 2,
        "{routed:?}"
    );
}

#[test]
fn a_restarted_replica_is_purged() {
    let stack = Stack::start(StackOptions::default()).unwrap();
    let messages = unshared(31);
    let first = turn(&stack, &messages, None);
    let warm = index_of(&stack, first.replica.as_deref().unwrap());
    assert!(entries(&stack)[warm] > 0);

    admin(&stack, warm, "/admin/restart", &json!({}));
    // The restarted engine's next batch starts again at seq 0: indexd purges
    // everything it held for the replica before applying it.
    let direct = format!("http://{}", stack.replicas()[warm].http_addr());
    let other = chat_body(&stack.options().model, &unshared(32), None);
    assert_eq!(
        post_json(&direct, "/v1/chat/completions", &other, &[])
            .unwrap()
            .status,
        200
    );
    let fresh_blocks = (first.prompt_tokens / u64::from(stack.options().block_size)) as usize;
    kvroute_e2e::stack::wait_until("the purge", WAIT, || entries(&stack)[warm] <= fresh_blocks)
        .unwrap();

    // The first conversation's blocks are gone everywhere: no precise claim.
    let again = chat(&stack, &messages, None);
    assert_eq!(again.decision.as_deref(), Some("load"));
    assert_eq!(again.cached_tokens, 0);
}

#[test]
fn lost_batches_are_replayed() {
    let stack = Stack::start(StackOptions::default()).unwrap();
    let warm = turn(&stack, &unshared(41), None);
    let r = index_of(&stack, warm.replica.as_deref().unwrap());
    let before = entries(&stack)[r];

    // The next batch is numbered but never sent live: a gap.
    admin(&stack, r, "/admin/events/drop", &json!({ "batches": 1 }));
    let direct = format!("http://{}", stack.replicas()[r].http_addr());
    let lost = chat_body(&stack.options().model, &unshared(42), None);
    let lost_out = post_json(&direct, "/v1/chat/completions", &lost, &[]).unwrap();
    let lost_blocks = (lost_out.prompt_tokens / u64::from(stack.options().block_size)) as usize;
    // A later batch reveals the gap; indexd replays the missing one.
    let next = chat_body(&stack.options().model, &unshared(43), None);
    let next_out = post_json(&direct, "/v1/chat/completions", &next, &[]).unwrap();
    let next_blocks = (next_out.prompt_tokens / u64::from(stack.options().block_size)) as usize;
    stack
        .wait_indexed(r, before + lost_blocks + next_blocks, WAIT)
        .unwrap();

    let metrics = stack.indexd().unwrap().metrics_text();
    assert!(metrics.contains("indexd_seq_gaps_total 1"), "{metrics}");

    // The conversation whose batch was lost live is routed to its replica.
    let mut messages = unshared(42);
    messages.push(message("user", "continue"));
    let out = chat(&stack, &messages, None);
    assert_eq!(out.replica, warm.replica);
    assert_eq!(out.decision.as_deref(), Some("precise"));
}

#[test]
fn lora_adapters_are_kept_apart() {
    let stack = Stack::start(StackOptions {
        adapters: vec!["sql-lora".into()],
        ..StackOptions::default()
    })
    .unwrap();
    let messages = opening(51);
    let base = turn(&stack, &messages, None);
    assert_eq!(base.decision.as_deref(), Some("load"));

    let url = stack.url().unwrap();
    let adapter = post_json(
        &url,
        "/v1/chat/completions",
        &chat_body("sql-lora", &messages, None),
        &[],
    )
    .unwrap();
    assert_eq!(adapter.status, 200);
    assert_eq!(
        adapter.decision.as_deref(),
        Some("load"),
        "the adapter matched base-model blocks"
    );
    assert_eq!(adapter.cached_tokens, 0);
}

#[test]
fn data_parallel_ranks_are_pinned_by_header() {
    let stack = Stack::start(StackOptions {
        replicas: 2,
        data_parallel_size: 2,
        ..StackOptions::default()
    })
    .unwrap();
    let url = stack.url().unwrap();
    let model = stack.options().model.clone();
    for conversation in 0..4u64 {
        // The first turn goes straight to one engine of one server; left to
        // itself the server would put an unpinned request on its idle rank 0.
        let server = (conversation % 2) as usize;
        let rank = ((conversation / 2) % 2 + 1) % 2;
        let direct = format!("http://{}", stack.replica_addresses()[server]);
        let mut messages = unshared(70 + conversation);
        let body = chat_body(&model, &messages, None);
        let rank_header = rank.to_string();
        // The server already holds the earlier conversations' blocks: wait
        // for this one's on top of them.
        let before = stack.indexed_entries(server);
        let first = post_json(
            &direct,
            "/v1/chat/completions",
            &body,
            &[("x-data-parallel-rank", &rank_header)],
        )
        .unwrap();
        assert_eq!(first.rank.as_deref(), Some(rank_header.as_str()));
        let blocks = (first.prompt_tokens / u64::from(stack.options().block_size)) as usize;
        stack.wait_indexed(server, before + blocks, WAIT).unwrap();

        messages.push(message("user", "and the next step?"));
        let body = chat_body(&model, &messages, None);
        let next = post_json(&url, "/v1/chat/completions", &body, &[]).unwrap();
        assert_eq!(next.status, 200, "{}", next.body);
        assert_eq!(
            next.decision.as_deref(),
            Some("precise"),
            "conversation {conversation}; indexd's decisions so far:\n{}",
            decisions(&stack)
        );
        assert_eq!(next.replica, first.replica, "conversation {conversation}");
        // The filter pinned the rank indexd named: the warm engine served.
        assert_eq!(next.rank, first.rank, "conversation {conversation}");
        assert!(next.cached_tokens > 0);
        // Its blocks indexed before the next conversation counts the
        // server's (at least the continuation's prompt on top of `before`).
        let next_blocks = (next.prompt_tokens / u64::from(stack.options().block_size)) as usize;
        stack
            .wait_indexed(server, before + next_blocks, WAIT)
            .unwrap();
    }
}

/// indexd's `indexd_decisions_total` lines (decision and reason), for a
/// failure's message.
fn decisions(stack: &Stack) -> String {
    stack
        .indexd()
        .map(|i| i.metrics_text())
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("indexd_decisions_total{"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn bad_bodies_still_reach_a_replica() {
    let stack = Stack::start(StackOptions::default()).unwrap();
    let url = stack.url().unwrap();
    let huge = format!(
        r#"{{"model":"tiny","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x ".repeat(1_500_000)
    );
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "malformed",
            b"{\"model\": \"tiny\", \"messages\": [".to_vec(),
            "unparseable",
        ),
        (
            "binary",
            (0..4096u32).map(|i| (i * 7 % 256) as u8).collect(),
            "unparseable",
        ),
        (
            "no model",
            br#"{"messages":[{"role":"user","content":"hi"}]}"#.to_vec(),
            "unparseable",
        ),
        ("huge", huge.into_bytes(), "body_too_large"),
    ];
    for (name, body, reason) in cases {
        let out = post_raw(
            &url,
            "/v1/chat/completions",
            &body,
            &[("content-type", "application/json")],
        )
        .unwrap();
        assert!(
            out.replica.is_some(),
            "{name}: no replica answered: {} {}",
            out.status,
            out.body
        );
        assert_eq!(out.decision.as_deref(), Some(reason), "{name}");
    }
}

#[test]
fn least_request_baseline_has_no_filter() {
    let stack = Stack::start(StackOptions {
        routing: Routing::LeastRequest,
        ..StackOptions::default()
    })
    .unwrap();
    let out = chat(&stack, &opening(61), None);
    assert_eq!(out.decision, None);
}

#[test]
fn gateways_share_the_replicas_picture() {
    // Active-active: three gateways, each Envoy with its own indexd, all fed
    // by the same replicas' events. A conversation that moves between
    // gateways still reaches its warm replica.
    let stack = Stack::start(StackOptions {
        replicas: 3,
        gateways: 3,
        ..StackOptions::default()
    })
    .unwrap();
    let urls = stack.gateway_urls().unwrap();
    assert_eq!(urls.len(), 3);
    for conversation in 0..3u64 {
        let mut messages = opening(200 + conversation);
        // Each turn goes to the next gateway; turn() waits until every
        // gateway's indexd has ingested the first turn's blocks.
        let first = turn(&stack, &messages, None);
        let warm = first.replica.clone().unwrap();
        messages.push(message("assistant", &first.text));
        messages.push(message("user", &filler(conversation + 300, 40)));
        let body = chat_body(&stack.options().model, &messages, None);
        let url = &urls[1 + conversation as usize % 2];
        let second = post_json(url, "/v1/chat/completions", &body, &[]).unwrap();
        assert_eq!(second.status, 200, "{}", second.body);
        assert_eq!(
            second.replica.as_deref(),
            Some(warm.as_str()),
            "conversation {conversation} via {url}"
        );
        assert_eq!(second.decision.as_deref(), Some("precise"));
        assert!(second.cached_tokens >= first.prompt_tokens / 2);
    }
}
