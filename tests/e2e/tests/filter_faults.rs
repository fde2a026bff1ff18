//! Callouts that fail mid-answer, on real Envoy 1.40 with the release filter:
//! a tokenizer (HTTP/1.1) and an indexd (gRPC over HTTP/2) that send their
//! headers and then reset or stall, reset before any header, or send garbage
//! after the headers. Every request is still served (through least-request),
//! the VM keeps routing once the peer is well again, unrouted paths are
//! untouched, and nothing in Envoy's log says the VM panicked.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod standins;

use std::net::SocketAddr;

use kvroute_e2e::{Envoy, http};
use serde_json::json;
use standins::faults::{FAULTS, Fault, FaultyGrpc, FaultyHttp};
use standins::{
    CHAT, DECISION, PRECISE, TIMEOUT, assert_no_wasm_failure, decision, gateway_config,
    pick_answer, plugin_config, replica,
};

struct Fleet {
    replicas: Vec<SocketAddr>,
    tokenizer: FaultyHttp,
    index: FaultyGrpc,
    gateway: Envoy,
    url: String,
}

fn fleet() -> Fleet {
    // Breakers that never open here: every request must reach its callouts.
    fleet_with(&json!({
        "breaker": {"failures": 1000, "window_ms": 1000, "cooldown_ms": 1000},
        "tokenizer_breaker": {"failures": 1000, "window_ms": 1000, "cooldown_ms": 1000},
    }))
}

fn fleet_with(extra: &serde_json::Value) -> Fleet {
    let replicas: Vec<SocketAddr> = (0..3).map(|_| replica()).collect();
    let tokens: Vec<u32> = (1..=10).collect();
    let (tokenizer, tok_addr) = FaultyHttp::start(
        "application/json",
        json!({"count": 10, "max_model_len": 100, "tokens": tokens, "token_ids": tokens})
            .to_string()
            .into_bytes(),
    );
    let (index, index_addr) = FaultyGrpc::start(pick_answer(PRECISE, &[replicas[1]]));
    let plugin = plugin_config(extra);
    let gateway = Envoy::start(&gateway_config(&replicas, tok_addr, index_addr, &plugin)).unwrap();
    let url = gateway.listener_url("gateway").unwrap();
    Fleet {
        replicas,
        tokenizer,
        index,
        gateway,
        url,
    }
}

impl Fleet {
    /// A routed request: served by one of the replicas, with a decision.
    fn served(&self, path: &str, body: &str, what: &str) -> String {
        let r = http::post(
            &format!("{}{path}", self.url),
            &[],
            body.as_bytes(),
            TIMEOUT,
        )
        .unwrap_or_else(|e| panic!("{what}: {path} lost: {e}\n{}", self.gateway.log()));
        assert_eq!(r.status, 200, "{what}: {r:?}\n{}", self.gateway.log());
        let by = r
            .header(kvroute_e2e::envoy::UPSTREAM_HEADER)
            .unwrap_or_default();
        assert!(
            self.replicas.iter().any(|a| a.to_string() == by),
            "{what}: served by {by:?}"
        );
        decision(&r).to_owned()
    }

    fn chat(&self, what: &str) -> String {
        self.served("/v1/chat/completions", CHAT, what)
    }

    fn responses(&self, what: &str) -> String {
        self.served("/v1/responses", r#"{"model":"m","input":"hello"}"#, what)
    }

    fn models_served(&self, what: &str) {
        let r = http::get(&format!("{}/v1/models", self.url), &[], TIMEOUT).unwrap();
        assert_eq!((r.status, r.header(DECISION)), (200, None), "{what}");
    }
}

#[test]
fn tokenizer_faults_never_trap_the_vm() {
    let f = fleet();
    assert_eq!(f.chat("healthy"), "precise");
    for fault in FAULTS {
        let what = format!("tokenizer {fault:?}");
        f.tokenizer.set(fault);
        let before = f.tokenizer.requests();
        // Several requests: Envoy runs two workers, each with its own VM.
        for _ in 0..4 {
            assert_eq!(f.chat(&what), "tokenize_failed", "{what}");
        }
        assert_eq!(f.responses(&what), "tokenize_failed", "{what}");
        assert!(
            f.tokenizer.requests() > before,
            "{what}: tokenizer not called"
        );
        f.models_served(&what);
        f.tokenizer.set(Fault::None);
        for _ in 0..4 {
            assert_eq!(f.chat(&what), "precise", "{what}: VM not routing after");
        }
    }
    assert_no_wasm_failure(&f.gateway);
}

#[test]
fn index_faults_never_trap_the_vm() {
    let f = fleet();
    assert_eq!(f.chat("healthy"), "precise");
    for fault in FAULTS {
        let what = format!("indexd {fault:?}");
        f.index.set(fault);
        let before = f.index.calls("/Pick");
        for _ in 0..4 {
            assert_eq!(f.chat(&what), "index_unavailable", "{what}");
        }
        // A Responses answer is held until Observe answers: a failing
        // Observe must release it.
        assert_eq!(f.responses(&what), "index_unavailable", "{what}");
        assert!(f.index.calls("/Pick") > before, "{what}: indexd not called");
        f.models_served(&what);
        f.index.set(Fault::None);
        for _ in 0..4 {
            assert_eq!(f.chat(&what), "precise", "{what}: VM not routing after");
        }
    }
    assert!(f.index.calls("/Observe") > 0);
    assert_no_wasm_failure(&f.gateway);
}

#[test]
fn a_stalling_tokenizer_stops_costing_its_timeout() {
    let f = fleet_with(&json!({
        "tokenizer_breaker": {"failures": 3, "window_ms": 10000, "cooldown_ms": 60000, "probe_ms": 0}
    }));
    f.tokenizer.set(Fault::HeadersThenStall);
    for _ in 0..3 {
        assert_eq!(f.chat("stalling"), "tokenize_failed");
    }
    // Open for every worker (shared data): no request waits for the
    // tokenizer's timeout any more, because none calls it.
    let calls = f.tokenizer.requests();
    for _ in 0..5 {
        assert_eq!(f.chat("breaker open"), "tokenizer_breaker_open");
    }
    assert_eq!(f.tokenizer.requests(), calls, "the tokenizer was called");
    // A Responses continuation needs no tokenizer and is still picked.
    let body = r#"{"model":"m","input":"x","previous_response_id":"resp_1"}"#;
    assert_eq!(f.served("/v1/responses", body, "affinity"), "precise");
    assert_no_wasm_failure(&f.gateway);
}
