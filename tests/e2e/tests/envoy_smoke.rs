//! The built filter loads in real Envoy 1.40 and requests pass through it,
//! even with no tokenizer or indexd behind it (every path fails open).

use std::time::Duration;

use kvroute_e2e::envoy::{direct_response_route, http_listener, kvroute_filter};
use kvroute_e2e::{Envoy, EnvoyConfig, HarnessError, artifacts, http};
use serde_json::json;

const TIMEOUT: Duration = Duration::from_secs(10);

#[test]
fn filter_loads_and_listener_serves() {
    let wasm = artifacts::filter_wasm().unwrap();
    let config = EnvoyConfig::new(
        vec![http_listener(
            "ingress",
            vec![kvroute_filter(
                &wasm,
                &json!({ "index_cluster": "indexd", "tokenizer_cluster": "tokenizer" }),
            )],
            vec![direct_response_route(200, "through\n")],
        )],
        vec![],
    );
    let envoy = Envoy::start(&config).unwrap();

    let url = envoy.listener_url("ingress").unwrap();
    let chat = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
    for (path, body) in [
        ("/v1/chat/completions", &chat[..]),
        ("/v1/chat/completions", b"{}"),
        ("/health", b""),
    ] {
        let response = http::post(&format!("{url}{path}"), &[], body, TIMEOUT).unwrap();
        assert_eq!(response.status, 200, "{path}: {response:?}");
        assert_eq!(response.body, "through\n");
    }

    // The module runs in Envoy's V8 and accepted its configuration.
    assert!(
        envoy.log().contains("configured (mode Precise"),
        "no load line in the Envoy log:\n{}",
        envoy.log()
    );
}

#[test]
fn a_missing_module_makes_envoy_refuse_the_config() {
    // (Invalid plugin configurations are covered in filter_envoy.rs.)
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.wasm");
    let config = EnvoyConfig::new(
        vec![http_listener(
            "ingress",
            vec![kvroute_filter(&missing, &json!({}))],
            vec![direct_response_route(200, "")],
        )],
        vec![],
    );
    match Envoy::start(&config) {
        Err(HarnessError::Exited { .. }) => {}
        other => panic!("expected Envoy to exit on a bad config, got {other:?}"),
    }
}
