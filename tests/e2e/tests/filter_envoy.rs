//! The kvroute filter in real Envoy 1.40 with stand-in tokenizer and indexd
//! servers whose answers are scripted per test: the pick is honoured, every
//! failure still ends in a 200 through least-request, the breaker opens and
//! closes, clients cannot pin hosts, Responses ids are observed, and a bad
//! plugin configuration makes Envoy refuse to start.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod standins;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

use kvroute_e2e::{Envoy, http};
use serde_json::{Value, json};
use standins::{
    CHAT, DECISION, OVERRIDE, PRECISE, STALE, Script, Stub, TIMEOUT, assert_no_wasm_failure,
    bridge, contains, decision, gateway_config, pick_answer, pick_answer_busy, plugin_config,
    replica,
};

// ------------------------------------------------------------------ setup

struct Fleet {
    replicas: Vec<SocketAddr>,
    tokenizer: Stub,
    index: Stub,
    gateway: Envoy,
    _bridge: Envoy,
    url: String,
}

fn fleet(extra: &Value) -> Fleet {
    let replicas: Vec<SocketAddr> = (0..3).map(|_| replica()).collect();
    let tokens: Vec<u32> = (1..=10).collect();
    let (tokenizer, tok_addr) = Stub::start(
        "application/json",
        Script::Answer(
            json!({"count": 10, "max_model_len": 100, "tokens": tokens})
                .to_string()
                .into_bytes(),
        ),
    );
    let (index, index_addr) = Stub::start(
        "application/grpc+proto",
        Script::Answer(pick_answer(PRECISE, &[replicas[1], replicas[2]])),
    );
    let bridge = bridge(index_addr);
    let bridge_addr: SocketAddr = format!("127.0.0.1:{}", bridge.listener_port("grpc").unwrap())
        .parse()
        .unwrap();
    let gateway = Envoy::start(&gateway_config(
        &replicas,
        tok_addr,
        bridge_addr,
        &plugin_config(extra),
    ))
    .unwrap();
    let url = gateway.listener_url("gateway").unwrap();
    Fleet {
        replicas,
        tokenizer,
        index,
        gateway,
        _bridge: bridge,
        url,
    }
}

impl Fleet {
    /// POSTs `body` to the gateway's chat route.
    fn post(&self, headers: &[(&str, &str)], body: &[u8]) -> http::Response {
        http::post(
            &format!("{}/v1/chat/completions", self.url),
            headers,
            body,
            TIMEOUT,
        )
        .unwrap()
    }

    fn chat(&self, headers: &[(&str, &str)]) -> http::Response {
        let r = self.post(headers, CHAT.as_bytes());
        assert_eq!(r.status, 200, "{r:?}\n{}", self.gateway.log());
        r
    }
}

// ------------------------------------------------------------------ tests

#[test]
fn the_pick_is_honoured_and_client_pins_are_not() {
    let f = fleet(&json!({}));
    let pin = f.replicas[0].to_string();
    for _ in 0..10 {
        let r = f.chat(&[(OVERRIDE, &pin), ("x-data-parallel-rank", "3")]);
        assert_eq!(decision(&r), "precise");
        assert_eq!(r.body, f.replicas[1].to_string());
    }
    // The tokenizer saw a /tokenize body without the salt; indexd saw keys.
    let tok = f.tokenizer.seen("/tokenize");
    assert_eq!(tok.len(), 10);
    let sent: Value = serde_json::from_slice(&tok[0].body).unwrap();
    assert_eq!(sent["model"], "m");
    assert_eq!(sent["messages"][0]["content"], "hello there");
    let picks = f.index.seen("/kvroute.v1.Index/Pick");
    assert_eq!(picks.len(), 10);
    assert!(contains(&picks[0].body, b"m"));

    // With no decision (STALE) a client's pin is still ignored:
    // least-request spreads the requests.
    f.index.set(Script::Answer(pick_answer(STALE, &[])));
    let served: BTreeSet<String> = (0..30)
        .map(|_| {
            let r = f.chat(&[(OVERRIDE, &pin)]);
            assert_eq!(decision(&r), "index_stale");
            r.body
        })
        .collect();
    assert!(served.len() > 1, "a client pin was honoured: {served:?}");

    let stats = f.gateway.prometheus_stats().unwrap();
    assert!(stats.contains("kvroute_decisions_precise"), "{stats}");
    assert!(stats.contains("kvroute_decisions_index_stale"), "{stats}");
    assert_no_wasm_failure(&f.gateway);
}

#[test]
fn continuations_ask_again_where_indexd_saw_a_lasting_queue() {
    let f = fleet(&json!({"remember": true, "local_continuations": 8}));
    let (warm, other) = (f.replicas[1], f.replicas[2]);
    let post = |messages: &Value| {
        let body = json!({"model": "m", "messages": messages}).to_string();
        let r = f.post(&[], body.as_bytes());
        assert_eq!(r.status, 200, "{r:?}\n{}", f.gateway.log());
        r
    };
    let picks = || f.index.seen("/kvroute.v1.Index/Pick").len();
    // Turn 0: indexd picks the warm replica and calls it busy.
    f.index.set(Script::Answer(pick_answer_busy(
        PRECISE,
        &[warm, other],
        &[warm],
    )));
    let mut messages = json!([{"role": "user", "content": "hello there"}]);
    let r = post(&messages);
    assert_eq!(
        (decision(&r), r.body.as_str()),
        ("precise", warm.to_string().as_str())
    );
    // Turn 1 continues it, but its replica is busy: a Pick.
    messages.as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": r.body}),
        json!({"role": "user", "content": "and then?"}),
    ]);
    f.index.set(Script::Answer(pick_answer_busy(
        PRECISE,
        &[warm, other],
        &[],
    )));
    let r = post(&messages);
    assert_eq!(decision(&r), "precise");
    assert_eq!(picks(), 2);
    // That answer called nothing busy: turn 2 follows turn 1, no Pick.
    messages.as_array_mut().unwrap().extend([
        json!({"role": "assistant", "content": r.body}),
        json!({"role": "user", "content": "go on"}),
    ]);
    let r = post(&messages);
    assert_eq!(
        (decision(&r), r.body.as_str()),
        ("continued", warm.to_string().as_str())
    );
    assert_eq!(picks(), 2);
    let stats = f.gateway.prometheus_stats().unwrap();
    let busy: Vec<&str> = stats
        .lines()
        .filter(|l| l.starts_with("kvroute_continuations_busy"))
        .filter_map(|l| l.rsplit(' ').next())
        .collect();
    assert_eq!(busy, ["1"], "{stats}");
    assert_no_wasm_failure(&f.gateway);
}

#[test]
fn failures_end_in_200s_through_least_request() {
    let f = fleet(&json!({"breaker": {"failures": 100, "window_ms": 1000, "cooldown_ms": 1000}}));
    let good_tokens = json!({"tokens": (1..=10).collect::<Vec<u32>>()})
        .to_string()
        .into_bytes();
    let ok_pick = pick_answer(PRECISE, &[f.replicas[0]]);
    // (what, tokenizer script, index script, expected reason)
    let cases = [
        (
            "tokenizer 500",
            Script::Status(500),
            Script::Answer(ok_pick.clone()),
            "tokenize_failed",
        ),
        (
            "tokenizer slow",
            Script::Slow(good_tokens.clone()),
            Script::Answer(ok_pick.clone()),
            "tokenize_failed",
        ),
        (
            "tokenizer garbage",
            Script::Answer(b"\xff\x00garbage".to_vec()),
            Script::Answer(ok_pick.clone()),
            "tokenize_failed",
        ),
        (
            "index slow",
            Script::Answer(good_tokens.clone()),
            Script::Slow(ok_pick.clone()),
            "index_unavailable",
        ),
        (
            "index 503",
            Script::Answer(good_tokens.clone()),
            Script::Status(503),
            "index_unavailable",
        ),
        (
            "index garbage",
            Script::Answer(good_tokens.clone()),
            Script::Answer(vec![0xff; 7]),
            "index_unavailable",
        ),
        (
            "index names no usable host",
            Script::Answer(good_tokens.clone()),
            Script::Answer(pick_answer(PRECISE, &[])),
            "index_unavailable",
        ),
    ];
    for (what, tokenizer, index, want) in cases {
        f.tokenizer.set(tokenizer);
        f.index.set(index);
        let r = f.chat(&[]);
        assert_eq!(decision(&r), want, "{what}");
        assert!(
            f.replicas.iter().any(|a| a.to_string() == r.body),
            "{what}: {r:?}"
        );
    }
    // Short prompts and unparseable bodies are not routed either.
    f.tokenizer
        .set(Script::Answer(br#"{"tokens":[1,2]}"#.to_vec()));
    assert_eq!(decision(&f.chat(&[])), "short_prompt");
    let r = f.post(&[], b"{not json");
    assert_eq!((r.status, decision(&r)), (200, "unparseable"));
    // Non-routed paths are untouched.
    let r = http::get(&format!("{}/v1/models", f.url), &[], TIMEOUT).unwrap();
    assert_eq!((r.status, r.header(DECISION)), (200, None));
    assert_no_wasm_failure(&f.gateway);
}

#[test]
fn unknown_clusters_fail_open() {
    let replicas: Vec<SocketAddr> = (0..2).map(|_| replica()).collect();
    let (_tok, tok_addr) = Stub::start(
        "application/json",
        Script::Answer(
            json!({"tokens": (1..=10).collect::<Vec<u32>>()})
                .to_string()
                .into_bytes(),
        ),
    );
    for (field, want) in [
        ("index_cluster", "index_unavailable"),
        ("tokenizer_cluster", "tokenize_failed"),
    ] {
        let mut plugin = plugin_config(&json!({}));
        plugin[field] = json!("no-such-cluster");
        let gateway = Envoy::start(&gateway_config(
            &replicas,
            tok_addr,
            "127.0.0.1:1".parse().unwrap(),
            &plugin,
        ))
        .unwrap();
        let url = gateway.listener_url("gateway").unwrap();
        for _ in 0..3 {
            let r = http::post(
                &format!("{url}/v1/chat/completions"),
                &[],
                CHAT.as_bytes(),
                TIMEOUT,
            )
            .unwrap();
            assert_eq!((r.status, decision(&r)), (200, want), "{}", gateway.log());
        }
        assert_no_wasm_failure(&gateway);
    }
}

#[test]
fn the_breaker_opens_and_closes() {
    let f = fleet(&json!({}));
    f.index.set(Script::Status(503));
    for _ in 0..3 {
        assert_eq!(decision(&f.chat(&[])), "index_unavailable");
    }
    let picks = f.index.seen("/Pick").len();
    for _ in 0..5 {
        assert_eq!(decision(&f.chat(&[])), "breaker_open");
    }
    assert_eq!(
        f.index.seen("/Pick").len(),
        picks,
        "indexd called while open"
    );
    f.index
        .set(Script::Answer(pick_answer(PRECISE, &[f.replicas[2]])));
    std::thread::sleep(Duration::from_millis(1700));
    let r = f.chat(&[]);
    assert_eq!(decision(&r), "precise");
    assert_eq!(r.body, f.replicas[2].to_string());
    let stats = f.gateway.prometheus_stats().unwrap();
    assert!(
        stats.contains("kvroute_breaker_opened 1") || stats.contains("kvroute_breaker_opened{} 1"),
        "{stats}"
    );
    assert_no_wasm_failure(&f.gateway);
}

#[test]
fn an_open_breaker_probes_and_closes_once_indexd_is_back() {
    // A cool-down far longer than the test: only a probe can close it.
    let f = fleet(&json!({
        "breaker": {"failures": 3, "window_ms": 30000, "cooldown_ms": 600000, "probe_ms": 100}
    }));
    f.index.set(Script::Status(503));
    for _ in 0..3 {
        assert_eq!(decision(&f.chat(&[])), "index_unavailable");
    }
    assert_eq!(decision(&f.chat(&[])), "breaker_open");
    f.index
        .set(Script::Answer(pick_answer(PRECISE, &[f.replicas[2]])));
    let mut routed = None;
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(50));
        let r = f.chat(&[]);
        if decision(&r) == "precise" {
            routed = Some(r);
            break;
        }
        assert_eq!(decision(&r), "breaker_open");
    }
    let r = routed.expect("no probe reached indexd");
    assert_eq!(r.body, f.replicas[2].to_string());
    // Closed for everyone: the next requests are routed without waiting.
    for _ in 0..5 {
        assert_eq!(decision(&f.chat(&[])), "precise");
    }
    assert_no_wasm_failure(&f.gateway);
}

#[test]
fn responses_ids_are_observed_and_continuations_follow_them() {
    let f = fleet(&json!({}));
    f.tokenizer.set(Script::Answer(
        br#"{"token_ids":[1,2,3,4,5,6,7,8]}"#.to_vec(),
    ));
    let url = format!("{}/v1/responses", f.url);
    let r = http::post(&url, &[], br#"{"model":"m","input":"hi"}"#, TIMEOUT).unwrap();
    assert_eq!(r.status, 200);
    let body: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(body["served_by"], f.replicas[1].to_string());
    let id = body["id"].as_str().unwrap().to_owned();
    assert_eq!(f.tokenizer.seen("/v1/responses/render").len(), 1);
    let observed = f.index.seen("/Observe");
    assert_eq!(
        observed.len(),
        1,
        "Observe must arrive before the body is released; {}",
        f.gateway.prometheus_stats().unwrap_or_default()
    );
    assert!(contains(&observed[0].body, id.as_bytes()));
    assert!(contains(
        &observed[0].body,
        f.replicas[1].to_string().as_bytes()
    ));

    // A continuation is picked by id, without tokenizing.
    f.index
        .set(Script::Answer(pick_answer(2, &[f.replicas[1]])));
    let cont = json!({"model": "m", "input": "more", "previous_response_id": id, "stream": true});
    let r = http::post(&url, &[], cont.to_string().as_bytes(), TIMEOUT).unwrap();
    assert_eq!((r.status, decision(&r)), (200, "affinity"));
    assert!(r.body.contains("response.completed"), "{r:?}");
    assert_eq!(f.tokenizer.seen("/render").len(), 1);
    let picks = f.index.seen("/Pick");
    assert!(contains(&picks.last().unwrap().body, id.as_bytes()));
    let observed = f.index.seen("/Observe");
    assert_eq!(observed.len(), 2);
    let port = f.replicas[1].port();
    assert!(contains(
        &observed[1].body,
        format!("resp_sse_{port}").as_bytes()
    ));
    assert_no_wasm_failure(&f.gateway);
}

#[test]
fn config_errors_make_envoy_refuse_the_plugin() {
    let replicas = [replica()];
    let addr: SocketAddr = "127.0.0.1:1".parse().unwrap();
    for (bad, field) in [
        (
            json!({"index_cluster": "indexd", "tokenize_at": "cluster"}),
            "tokenizer_cluster",
        ),
        (
            json!({"index_cluster": "indexd", "tokenizer_cluster": "t", "blok_size": 64}),
            "unknown field `blok_size`",
        ),
        (
            json!({"index_cluster": "indexd", "tokenizer_cluster": "t", "block_size": 0}),
            "block_size",
        ),
        (
            json!({"index_cluster": "i", "tokenizer_cluster": "t", "breaker": {"failures": 0}}),
            "breaker.failures",
        ),
    ] {
        let err = Envoy::start(&gateway_config(&replicas, addr, addr, &bad))
            .expect_err("Envoy accepted a bad plugin configuration");
        let text = err.to_string();
        assert!(
            text.contains(&format!("invalid configuration: {field}"))
                || (field.starts_with("unknown") && text.contains(field)),
            "{text}"
        );
        assert!(
            text.contains("Unable to create Wasm plugin kvroute"),
            "{text}"
        );
    }
}

#[test]
fn big_bodies_pass_unrouted_and_approximate_mode_needs_no_tokenizer() {
    let f = fleet(&json!({}));
    // 3 MiB: over max_body_bytes (960 KiB) and over Envoy's 1 MiB buffer.
    let text = "x".repeat(3 << 20);
    let body = json!({"model": "m", "messages": [{"role": "user", "content": text}]}).to_string();
    let r = f.post(&[], body.as_bytes());
    assert_eq!(
        (r.status, decision(&r)),
        (200, "body_too_large"),
        "{}",
        f.gateway.log()
    );
    assert!(f.tokenizer.seen("").is_empty());
    // 600 KiB arrives in several chunks and is buffered whole.
    let text = "y".repeat(600 << 10);
    let body = json!({"model": "m", "messages": [{"role": "user", "content": text}]}).to_string();
    let r = f.post(&[], body.as_bytes());
    assert_eq!(
        (r.status, decision(&r)),
        (200, "precise"),
        "{}",
        f.gateway.log()
    );
    let tok = f.tokenizer.seen("/tokenize");
    let sent: Value = serde_json::from_slice(&tok[0].body).unwrap();
    assert_eq!(
        sent["messages"][0]["content"].as_str().map(str::len),
        Some(600 << 10)
    );
    assert_no_wasm_failure(&f.gateway);

    let f = fleet(&json!({"mode": "approximate", "approximate_chunk_bytes": 16}));
    f.index
        .set(Script::Answer(pick_answer(3, &[f.replicas[0]])));
    let r = f.chat(&[]);
    assert_eq!(decision(&r), "approximate");
    assert_eq!(r.body, f.replicas[0].to_string());
    assert!(
        f.tokenizer.seen("").is_empty(),
        "approximate mode called the tokenizer"
    );
    assert_eq!(f.index.seen("/Pick").len(), 1);
    assert_no_wasm_failure(&f.gateway);
}
