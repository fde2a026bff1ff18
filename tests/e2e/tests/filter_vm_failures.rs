//! The gateway without a working filter, on real Envoy 1.40: a Wasm VM that
//! traps on every request, and one whose code fails to load. Envoy's own
//! header-mutation filter (before the Wasm filter) still strips clients'
//! routing headers, and `failure_policy: FAIL_OPEN` lets requests through
//! with least-request's choice.
//!
//! The request in flight when a VM traps is answered 503 by Envoy whatever
//! the policy (one per worker); the filter must therefore never trap, which
//! `filter_faults.rs` checks. This file checks what the gateway does if it
//! did anyway.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod standins;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvroute_e2e::envoy::{
    ROUTING_HEADERS, cluster_route, http_cluster, http_listener, inference_cluster,
    routing_header_strip,
};
use kvroute_e2e::{Envoy, EnvoyConfig, http};
use serde_json::{Value, json};
use standins::{OVERRIDE, Reply, Req, TIMEOUT, serve};

/// A proxy-wasm module that loads and configures, then traps (`unreachable`)
/// in every request-headers callback.
const TRAPPING_MODULE: &str = r#"(module
  (memory (export "memory") 1)
  (func (export "proxy_abi_version_0_2_1"))
  (func (export "_initialize"))
  (func (export "proxy_on_memory_allocate") (param i32) (result i32) i32.const 1024)
  (func (export "proxy_on_context_create") (param i32 i32))
  (func (export "proxy_on_vm_start") (param i32 i32) (result i32) i32.const 1)
  (func (export "proxy_on_configure") (param i32 i32) (result i32) i32.const 1)
  (func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32) unreachable)
  (func (export "proxy_on_done") (param i32) (result i32) i32.const 1)
  (func (export "proxy_on_log") (param i32))
  (func (export "proxy_on_delete") (param i32)))"#;

/// A replica that answers `address|routing headers it received`.
fn echo_replica() -> SocketAddr {
    let me = Arc::new(Mutex::new(String::new()));
    let name = me.clone();
    let addr = serve(Arc::new(move |req: &Req| {
        let seen: Vec<&str> = req
            .headers
            .iter()
            .map(|(k, _)| k.as_str())
            .filter(|k| ROUTING_HEADERS.contains(k) || k.starts_with("x-kvroute-"))
            .collect();
        Reply::ok(
            "text/plain",
            format!("{}|{}", name.lock().unwrap(), seen.join(",")),
        )
    }));
    *me.lock().unwrap() = addr.to_string();
    addr
}

fn wasm_filter(code: Value) -> Value {
    json!({
        "name": "kvroute",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "name": "kvroute",
                "root_id": "kvroute",
                "failure_policy": "FAIL_OPEN",
                "allow_on_headers_stop_iteration": true,
                "configuration": {
                    "@type": "type.googleapis.com/google.protobuf.StringValue",
                    "value": r#"{"index_cluster":"indexd","tokenizer_cluster":"tokenizer"}"#,
                },
                "vm_config": {
                    "vm_id": "kvroute",
                    "runtime": "envoy.wasm.runtime.v8",
                    "code": code,
                },
            }
        }
    })
}

fn gateway(code: Value, extra_clusters: Vec<Value>) -> (Envoy, Vec<SocketAddr>) {
    let replicas: Vec<SocketAddr> = (0..3).map(|_| echo_replica()).collect();
    let mut clusters = vec![inference_cluster("vllm", &replicas, OVERRIDE)];
    clusters.extend(extra_clusters);
    let config = EnvoyConfig::new(
        vec![http_listener(
            "gateway",
            vec![routing_header_strip(), wasm_filter(code)],
            vec![cluster_route("vllm", Duration::from_secs(5))],
        )],
        clusters,
    );
    (Envoy::start(&config).unwrap(), replicas)
}

/// Requests pinned by the client to `replicas[0]` (with every kind of
/// routing header) are all served, spread by least-request, and no routing
/// header reaches a replica.
fn assert_served_and_unpinned(envoy: &Envoy, replicas: &[SocketAddr]) {
    let url = envoy.listener_url("gateway").unwrap();
    let pin = replicas[0].to_string();
    let mut served = BTreeSet::new();
    for _ in 0..30 {
        let r = http::post(
            &format!("{url}/v1/chat/completions"),
            &[
                (OVERRIDE, pin.as_str()),
                ("x-data-parallel-rank", "3"),
                ("x-kvroute-debug", "1"),
            ],
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
            TIMEOUT,
        )
        .unwrap();
        assert_eq!(r.status, 200, "{r:?}\n{}", envoy.log());
        let (by, seen) = r.body.split_once('|').unwrap();
        assert_eq!(seen, "", "routing headers reached {by}");
        served.insert(by.to_owned());
    }
    assert!(
        served.len() > 1,
        "the client's pin was honoured: {served:?}"
    );
}

#[test]
fn a_trapping_vm_leaves_requests_served_and_pins_stripped() {
    let dir = tempfile::tempdir().unwrap();
    let module = dir.path().join("trap.wasm");
    std::fs::write(&module, wat::parse_str(TRAPPING_MODULE).unwrap()).unwrap();
    let (envoy, replicas) = gateway(
        json!({ "local": { "filename": module.display().to_string() } }),
        vec![],
    );
    let url = envoy.listener_url("gateway").unwrap();
    // Each worker's VM traps once (Envoy answers that request 503), then the
    // worker passes requests without it. Bounded: two workers.
    let mut trapped = 0;
    for _ in 0..10 {
        let r = http::post(&format!("{url}/v1/chat/completions"), &[], b"{}", TIMEOUT).unwrap();
        if r.status == 503 {
            trapped += 1;
        }
    }
    assert!(trapped >= 1, "the module never trapped");
    assert!(envoy.log().contains("RuntimeError: unreachable"));
    assert_served_and_unpinned(&envoy, &replicas);
}

#[test]
fn a_vm_that_fails_to_load_leaves_requests_served_and_pins_stripped() {
    let code_server = serve(Arc::new(|_: &Req| Reply {
        status: 404,
        ..Reply::ok("text/plain", "no module here")
    }));
    let (envoy, replicas) = gateway(
        json!({ "remote": {
            "http_uri": {
                "uri": format!("http://{code_server}/kvroute_filter.wasm"),
                "cluster": "code",
                "timeout": "1s",
            },
            "sha256": "0".repeat(64),
        } }),
        vec![http_cluster("code", &[code_server])],
    );
    assert!(
        envoy.log().contains("failed to load"),
        "the module loaded:\n{}",
        envoy.log()
    );
    assert_served_and_unpinned(&envoy, &replicas);
}
