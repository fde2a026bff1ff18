//! The files users copy from `envoy/`, checked statically: real Envoy
//! validates the Envoy config (loading the built filter, which validates its
//! own plugin configuration), and the Envoy fragments inside the Istio patches
//! are validated by Envoy the same way.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use std::path::{Path, PathBuf};

use kvroute_e2e::envoy::{self, http_listener, kvroute_filter, socket_address};
use kvroute_e2e::{EnvoyConfig, artifacts};
use serde_json::{Value, json};

fn repo(path: &str) -> PathBuf {
    artifacts::workspace_root().join(path)
}

fn yaml_docs(path: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(repo(path)).unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| {
            let v: serde_yaml::Value = serde::Deserialize::deserialize(doc).unwrap();
            serde_json::to_value(v).unwrap()
        })
        .filter(|v| !v.is_null())
        .collect()
}

fn validate_json(bootstrap: &Value) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("envoy.json");
    std::fs::write(&path, bootstrap.to_string()).unwrap();
    envoy::validate(&path, dir.path()).unwrap()
}

/// The release `.wasm` must sit where envoy/envoy.yaml expects it, relative to
/// the repository root; with `KVROUTE_WASM` elsewhere, validate a copy.
fn local_envoy_yaml_with(wasm: &Path) -> (tempfile::TempDir, PathBuf) {
    let text = std::fs::read_to_string(repo("envoy/envoy.yaml")).unwrap();
    let relative = "target/wasm32-wasip1/release/kvroute_filter.wasm";
    assert!(
        text.contains(relative),
        "envoy.yaml no longer loads {relative}"
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("envoy.yaml");
    std::fs::write(&path, text.replace(relative, &wasm.display().to_string())).unwrap();
    (dir, path)
}

#[test]
fn local_envoy_yaml_is_valid_for_envoy_and_the_filter() {
    let wasm = artifacts::filter_wasm().unwrap();
    let (dir, path) = local_envoy_yaml_with(&wasm);
    let out = envoy::validate(&path, dir.path()).unwrap();
    assert!(out.contains("configured (mode Precise"), "{out}");
}

#[test]
fn a_bad_plugin_configuration_fails_validation() {
    let wasm = artifacts::filter_wasm().unwrap();
    let (dir, path) = local_envoy_yaml_with(&wasm);
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(
        &path,
        text.replace("\"block_size\": 64", "\"block_size\": 0"),
    )
    .unwrap();
    let err = envoy::validate(&path, dir.path()).unwrap_err().to_string();
    assert!(err.contains("block_size"), "{err}");
}

#[test]
fn istio_wasmplugin_config_is_accepted_by_the_filter() {
    let docs = yaml_docs("envoy/istio/wasmplugin.yaml");
    let plugin = docs.iter().find(|d| d["kind"] == "WasmPlugin").unwrap();
    assert_eq!(plugin["spec"]["failStrategy"], "FAIL_OPEN");
    let config = plugin["spec"]["pluginConfig"].to_string();
    kvroute_filter::Config::parse(config.as_bytes()).unwrap();
}

#[test]
fn istio_envoyfilter_patches_are_valid_envoy_config() {
    let docs = yaml_docs("envoy/istio/envoyfilter.yaml");
    let filter = docs.iter().find(|d| d["kind"] == "EnvoyFilter").unwrap();
    let patches = filter["spec"]["configPatches"].as_array().unwrap();
    let by = |apply: &str, op: &str| -> Vec<&Value> {
        patches
            .iter()
            .filter(|p| p["applyTo"] == apply && p["patch"]["operation"] == op)
            .map(|p| &p["patch"]["value"])
            .collect()
    };

    // The ECDS patch turns on allow_on_headers_stop_iteration for the plugin.
    let ecds = by("EXTENSION_CONFIG", "MERGE");
    assert_eq!(ecds.len(), 1);
    assert_eq!(ecds[0]["name"], "inference.kvroute");
    assert_eq!(
        ecds[0]["typed_config"]["config"]["allow_on_headers_stop_iteration"],
        true
    );

    // The cluster patches: the override_host policy merged into the vLLM
    // cluster, and the indexd cluster added whole. Both go into a real
    // bootstrap that Envoy validates.
    let merged = by("CLUSTER", "MERGE");
    let policy = &merged[0]["load_balancing_policy"];
    let added = by("CLUSTER", "ADD");
    let mut indexd = added[0].clone();
    assert_eq!(indexd["name"], "kvroute-indexd");
    // Envoy's validate mode resolves nothing; a STATIC address keeps it offline.
    indexd["type"] = json!("STATIC");
    indexd["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"] =
        socket_address(50061);
    let vllm = json!({
        "name": "vllm",
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": { "cluster_name": "vllm", "endpoints": [{ "lb_endpoints": [
            { "endpoint": { "address": socket_address(8000) } }
        ] }] },
        "load_balancing_policy": policy,
    });

    // The listener patch and the plugin config of wasmplugin.yaml, on a listener
    // with the filter as Istio would run it after the ECDS merge.
    let wasm = artifacts::filter_wasm().unwrap();
    let plugin = yaml_docs("envoy/istio/wasmplugin.yaml")
        .into_iter()
        .find(|d| d["kind"] == "WasmPlugin")
        .unwrap();
    let plugin_config = plugin["spec"]["pluginConfig"].clone();
    let mut listener = http_listener(
        "gateway",
        vec![kvroute_filter(&wasm, &plugin_config)],
        vec![envoy::cluster_route(
            "vllm",
            std::time::Duration::from_secs(60),
        )],
    );
    for (k, v) in by("LISTENER", "MERGE")[0].as_object().unwrap() {
        listener[k] = v.clone();
    }

    let out = validate_json(EnvoyConfig::new(vec![listener], vec![vllm, indexd]).as_json());
    assert!(out.contains("OK"), "{out}");
}
