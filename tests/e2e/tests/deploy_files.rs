//! The files users copy from `envoy/`, checked statically (no Docker engine
//! or cluster here): real Envoy validates every Envoy config (loading the
//! built filter, which validates its own plugin configuration), the Envoy
//! fragments inside the Istio patches are validated by Envoy the same way,
//! indexd parses its configs, the mock's CLI parses the compose commands, and
//! the files agree with each other on addresses, ports, socket paths, labels
//! and groups (the NetworkPolicies against the DaemonSet and the Service).
//! `deploy_files/hardening.rs`: the shared token (the Kubernetes sample's
//! indexd run on loopback), indexd's CPU and memory bounds, the circuit
//! breakers on every indexd cluster, compose's admin on loopback.
//! `deploy_files/indexd_overflow.rs`: those circuit breakers overflowing in
//! real Envoy with the filter.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::path::{Path, PathBuf};

mod standins;

#[path = "deploy_files/hardening.rs"]
mod hardening;
#[path = "deploy_files/indexd_overflow.rs"]
mod indexd_overflow;

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

/// indexd's gRPC socket path (the deploy files listen on a Unix socket).
fn socket_path(config: &indexd::Config) -> String {
    config
        .grpc_listen
        .unix_path()
        .unwrap_or_else(|| panic!("grpc_listen {} is not a socket", config.grpc_listen))
        .display()
        .to_string()
}

/// The one `pipe` path of an Envoy config's kvroute_indexd cluster (YAML).
fn envoy_indexd_pipe(envoy_yaml: &str) -> String {
    let doc: serde_yaml::Value = serde_yaml::from_str(envoy_yaml).unwrap();
    let doc = serde_json::to_value(doc).unwrap();
    let cluster = doc["static_resources"]["clusters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "kvroute_indexd")
        .unwrap()
        .clone();
    cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["pipe"]
        ["path"]
        .as_str()
        .unwrap()
        .to_owned()
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

/// `filters` strip every routing header before the kvroute filter, and the
/// kvroute filter fails open.
fn assert_gateway_filters(filters: &[Value], what: &str) {
    let strip = &filters[0]["typed_config"];
    assert_eq!(
        strip["@type"],
        "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
        "{what}: the first filter does not strip routing headers"
    );
    let mutations = strip["mutations"]["request_mutations"].as_array().unwrap();
    for header in envoy::ROUTING_HEADERS {
        assert!(
            mutations.iter().any(|m| m["remove"] == header),
            "{what}: {header} is not removed"
        );
    }
    assert!(
        mutations
            .iter()
            .any(|m| m["remove_on_match"]["key_matcher"]["prefix"] == "x-kvroute-"),
        "{what}: x-kvroute-* is not removed"
    );
    let wasm = filters
        .iter()
        .position(|f| f["name"] == "kvroute")
        .unwrap_or_else(|| panic!("{what}: no kvroute filter"));
    assert!(wasm > 0, "{what}: the kvroute filter runs before the strip");
    let config = &filters[wasm]["typed_config"]["config"];
    if !config.is_null() {
        assert_eq!(config["failure_policy"], "FAIL_OPEN", "{what}");
    }
}

fn listener_filters(path: &str) -> Vec<Value> {
    let doc = yaml_docs(path).remove(0);
    doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        ["http_filters"]
        .as_array()
        .unwrap()
        .clone()
}

#[test]
fn every_envoy_config_strips_routing_headers_before_the_filter() {
    for path in ["envoy/envoy.yaml", "envoy/docker/envoy.yaml"] {
        assert_gateway_filters(&listener_filters(path), path);
    }
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
    let indexd = added[0].clone();
    assert_eq!(indexd["name"], "kvroute-indexd");
    // indexd's socket, as the DaemonSet's config names it (validated as is).
    let pipe = &indexd["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
        ["pipe"]["path"];
    let kube = yaml_docs("envoy/kubernetes/indexd.yaml");
    let config = kube
        .iter()
        .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == "kvroute-indexd")
        .unwrap();
    let parsed =
        indexd::Config::from_yaml(config["data"]["indexd.yaml"].as_str().unwrap()).unwrap();
    assert_eq!(pipe.as_str(), Some(socket_path(&parsed).as_str()));
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
    // Patch 0 goes first in the chain, before the plugin.
    let strip = by("HTTP_FILTER", "INSERT_FIRST");
    assert_eq!(strip.len(), 1);
    let filters = vec![strip[0].clone(), kvroute_filter(&wasm, &plugin_config)];
    assert_gateway_filters(&filters, "envoyfilter.yaml");
    let mut listener = http_listener(
        "gateway",
        filters,
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

#[test]
fn kubernetes_indexd_config_is_valid_for_indexd() {
    let docs = yaml_docs("envoy/kubernetes/indexd.yaml");
    let kind = |k: &'static str| docs.iter().filter(move |d| d["kind"] == k);
    let config = kind("ConfigMap")
        .find(|d| d["metadata"]["name"] == "kvroute-indexd")
        .unwrap();
    let parsed =
        indexd::Config::from_yaml(config["data"]["indexd.yaml"].as_str().unwrap()).unwrap();
    // The replicas come from the watch, not from a list of pod IPs.
    assert!(parsed.endpoints.is_empty() && parsed.discovery_file.is_none());
    let watch = parsed.kubernetes.clone().expect("kubernetes discovery");
    assert!(matches!(
        watch.source,
        indexd::config::kubernetes::KubeSource::Service { .. }
    ));

    let daemonset = kind("DaemonSet").next().unwrap();
    let pod = &daemonset["spec"]["template"]["spec"];
    // Its ServiceAccount may list and watch what the watch reads, in the
    // namespace it watches (its own, unless the config names one).
    let namespace = daemonset["metadata"]["namespace"].as_str().unwrap();
    let watched = watch.namespace.as_deref().unwrap_or(namespace);
    let account = pod["serviceAccountName"].as_str().unwrap();
    assert!(
        kind("ServiceAccount")
            .any(|a| a["metadata"]["name"] == account && a["metadata"]["namespace"] == namespace)
    );
    let binding = kind("RoleBinding")
        .find(|b| {
            b["subjects"].as_array().unwrap().iter().any(|s| {
                s["kind"] == "ServiceAccount" && s["name"] == account && s["namespace"] == namespace
            })
        })
        .unwrap();
    assert_eq!(binding["metadata"]["namespace"], watched);
    assert_eq!(binding["roleRef"]["kind"], "Role");
    let role = kind("Role")
        .find(|r| r["metadata"]["name"] == binding["roleRef"]["name"])
        .unwrap();
    assert_eq!(role["metadata"]["namespace"], watched);
    let allows = |group: &str, resource: &str| {
        role["rules"].as_array().unwrap().iter().any(|r| {
            let has = |key: &str, v: &str| r[key].as_array().unwrap().iter().any(|x| x == v);
            has("apiGroups", group)
                && has("resources", resource)
                && has("verbs", "list")
                && has("verbs", "watch")
        })
    };
    assert!(allows("discovery.k8s.io", "endpointslices"));
    assert!(allows("", "pods"));
    let container = &pod["containers"][0];
    assert_eq!(
        container["args"],
        json!(["--config", "/etc/kvroute/indexd.yaml"])
    );

    // gRPC on the socket, in a hostPath directory the gateway patch mounts
    // too; the socket's group (indexd's runAsGroup) is the gateway's.
    let socket = socket_path(&parsed);
    let dir = Path::new(&socket).parent().unwrap().display().to_string();
    let mount = container["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"] == dir.as_str())
        .unwrap_or_else(|| panic!("indexd does not mount {dir}"));
    let volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    let host_dir = volume["hostPath"]["path"].as_str().unwrap();
    let group = &pod["securityContext"]["runAsGroup"];
    assert!(
        group.as_u64().is_some_and(|g| g != 0 && g != 65532),
        "{group}"
    );
    let init = &pod["initContainers"][0];
    let prepare = init["command"].to_string();
    assert!(
        prepare.contains(&format!(":{group} {dir}")) && prepare.contains("0750"),
        "{prepare}"
    );
    let patch = &yaml_docs("envoy/istio/gateway-socket-patch.yaml")[0]["spec"]["template"]["spec"];
    assert!(
        patch["securityContext"]["supplementalGroups"]
            .as_array()
            .unwrap()
            .contains(group)
    );
    let gateway_volume = &patch["volumes"][0];
    assert_eq!(gateway_volume["hostPath"]["path"], host_dir);
    let gateway_mount = &patch["containers"][0]["volumeMounts"][0];
    assert_eq!(gateway_mount["name"], gateway_volume["name"]);
    assert_eq!(gateway_mount["mountPath"], dir.as_str());
    // HTTP on the pod IP (probes, Prometheus), on the declared port.
    let http_port = parsed.http_listen.port();
    assert!(
        container["ports"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["name"] == "http" && p["containerPort"] == http_port)
    );

    // The TCP alternative: the Service the commented Istio cluster names
    // leads to the node-local pod's grpc port.
    let service = kind("Service").next().unwrap();
    assert_eq!(service["spec"]["internalTrafficPolicy"], "Local");
    let name = service["metadata"]["name"].as_str().unwrap();
    let grpc_port = container["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "grpc")
        .unwrap()["containerPort"]
        .as_u64()
        .unwrap();
    let patches = std::fs::read_to_string(repo("envoy/istio/envoyfilter.yaml")).unwrap();
    assert!(patches.contains(&format!(
        "{name}.inference.svc.cluster.local, port_value: {grpc_port}"
    )));
}

/// The ports a NetworkPolicy ingress rule admits.
fn rule_ports(rule: &Value) -> Vec<u64> {
    rule["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            assert_eq!(p["protocol"], "TCP");
            p["port"].as_u64().unwrap()
        })
        .collect()
}

#[test]
fn kubernetes_network_policies_match_the_daemonset_and_the_service() {
    let kube = yaml_docs("envoy/kubernetes/indexd.yaml");
    let daemonset = kube.iter().find(|d| d["kind"] == "DaemonSet").unwrap();
    let service = kube.iter().find(|d| d["kind"] == "Service").unwrap();
    let config = kube
        .iter()
        .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == "kvroute-indexd")
        .unwrap();
    let parsed =
        indexd::Config::from_yaml(config["data"]["indexd.yaml"].as_str().unwrap()).unwrap();
    let template = &daemonset["spec"]["template"];
    let indexd_labels = &template["metadata"]["labels"];
    let container_ports: Vec<(String, u64)> = template["spec"]["containers"][0]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap().to_owned(),
                p["containerPort"].as_u64().unwrap(),
            )
        })
        .collect();
    let port_named = |name: &str| {
        container_ports
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("no container port {name}"))
            .1
    };
    let gateway = yaml_docs("envoy/istio/wasmplugin.yaml")
        .into_iter()
        .find(|d| d["kind"] == "WasmPlugin")
        .unwrap()["spec"]["selector"]["matchLabels"]
        .clone();
    let envoyfilter = &yaml_docs("envoy/istio/envoyfilter.yaml")[0];
    assert_eq!(envoyfilter["spec"]["workloadSelector"]["labels"], gateway);

    let policies = yaml_docs("envoy/kubernetes/networkpolicy.yaml");
    let policy = |name: &str| {
        policies
            .iter()
            .find(|d| d["kind"] == "NetworkPolicy" && d["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no NetworkPolicy {name}"))
    };
    let from_gateway = |rule: &Value| rule["from"][0]["podSelector"]["matchLabels"] == gateway;
    let from_prometheus = |rule: &Value| {
        rule["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == "prometheus"
    };

    // indexd's pods: the policy selects them, like the Service does.
    let indexd = policy("kvroute-indexd");
    assert_eq!(
        indexd["metadata"]["namespace"],
        daemonset["metadata"]["namespace"]
    );
    assert_eq!(indexd["spec"]["podSelector"]["matchLabels"], *indexd_labels);
    assert_eq!(service["spec"]["selector"], *indexd_labels);
    assert_eq!(indexd["spec"]["policyTypes"], json!(["Ingress"]));
    let rules: Vec<&Value> = indexd["spec"]["ingress"]
        .as_array()
        .unwrap()
        .iter()
        .collect();
    assert_eq!(rules.len(), 2, "the gateway and Prometheus, nobody else");
    // The gateway: every port of the pod and every port the Service leads to.
    let gateway_rule = rules.iter().find(|r| from_gateway(r)).unwrap();
    let admitted = rule_ports(gateway_rule);
    for (name, port) in &container_ports {
        assert!(
            admitted.contains(port),
            "gateway: {name} ({port}) not admitted"
        );
    }
    for p in service["spec"]["ports"].as_array().unwrap() {
        let target = port_named(p["targetPort"].as_str().unwrap());
        assert!(admitted.contains(&target), "Service port {p} not admitted");
    }
    // Prometheus: only the HTTP port, the one envoy/prometheus/ scrapes
    // (the PodMonitor by its name, the scrape job keeps it by name too:
    // deploy_files/hardening.rs).
    let prometheus_rule = rules.iter().find(|r| from_prometheus(r)).unwrap();
    let http = port_named("http");
    assert_eq!(rule_ports(prometheus_rule), vec![http]);
    assert_eq!(parsed.http_listen.port() as u64, http);
    let monitor = yaml_docs("envoy/prometheus/podmonitor.yaml")
        .into_iter()
        .find(|d| d["kind"] == "PodMonitor")
        .unwrap();
    let scraped = monitor["spec"]["podMetricsEndpoints"][0]["port"]
        .as_str()
        .unwrap();
    assert_eq!(port_named(scraped), http);

    // The replicas' KV-event and replay ports: from indexd only.
    let vllm = policy("kvroute-vllm");
    use indexd::config::kubernetes::PortRef;
    let watch = parsed.kubernetes.clone().expect("kubernetes discovery");
    let number = |p: &PortRef| match p {
        PortRef::Number(n) => u64::from(*n),
        PortRef::Name(n) => panic!("the sample names port {n:?}: the policy needs numbers"),
    };
    let mut kv_ports = vec![number(&watch.events_port), number(&watch.replay_port)];
    kv_ports.sort_unstable();
    assert_eq!(kv_ports, vec![5557, 5558]);
    let replica_ports = vec![number(&watch.port)];
    for rule in vllm["spec"]["ingress"].as_array().unwrap() {
        let ports = rule_ports(rule);
        let from = &rule["from"][0]["podSelector"]["matchLabels"];
        if from == indexd_labels {
            for port in kv_ports.iter().chain(&replica_ports) {
                assert!(ports.contains(port), "indexd cannot reach {port}");
            }
        } else {
            assert!(
                ports.iter().all(|p| !kv_ports.contains(p)),
                "{from} may reach the KV-event sockets"
            );
        }
    }
    assert!(
        vllm["spec"]["ingress"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| from_gateway(r) && replica_ports.iter().all(|p| rule_ports(r).contains(p))),
        "the gateway cannot reach the replicas"
    );
}

/// The compose file with its YAML merge keys (`<<: *mock-vllm`) applied.
fn compose_file() -> Value {
    let text = std::fs::read_to_string(repo("envoy/docker-compose.yaml")).unwrap();
    let mut doc: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
    doc.apply_merge().unwrap();
    serde_json::to_value(doc).unwrap()
}

/// The compose network's DNS, as indexd sees it there: each service name is
/// one container address.
fn compose_dns(
    services: &[String],
) -> impl Fn(&str, u16) -> std::io::Result<Vec<std::net::SocketAddr>> {
    let services = services.to_vec();
    move |host: &str, port: u16| {
        let i = services
            .iter()
            .position(|s| s == host)
            .ok_or_else(|| std::io::Error::other(format!("{host} is no compose service")))?;
        let ip = std::net::Ipv4Addr::new(172, 30, 0, 10 + u8::try_from(i).unwrap());
        Ok(vec![std::net::SocketAddr::from((ip, port))])
    }
}

#[test]
fn compose_services_match_their_binaries_and_each_other() {
    let compose = &compose_file();
    let services = compose["services"].as_object().unwrap();
    let dockerfile = std::fs::read_to_string(repo("envoy/docker/Dockerfile")).unwrap();
    let names: Vec<String> = services.keys().cloned().collect();
    let dns = compose_dns(&names);

    let mut replicas = Vec::new();
    for (name, service) in services {
        let target = service["build"]["target"].as_str().unwrap();
        assert!(
            dockerfile.contains(&format!(" AS {target}\n")),
            "{name}: no Dockerfile target {target}"
        );
        // Every image builds from the same context, prebuilt or not as the environment says.
        assert_eq!(service["build"]["context"], "..", "{name}");
        assert_eq!(
            service["build"]["args"]["BINARIES"], "${KVROUTE_BINARIES:-build}",
            "{name}"
        );
        // Health checks, so that depends_on can wait for them.
        assert!(
            service["healthcheck"]["test"].is_array(),
            "{name}: no healthcheck"
        );
        // Host ports on loopback only.
        for port in service["ports"].as_array().into_iter().flatten() {
            assert!(
                port.as_str().unwrap().starts_with("127.0.0.1:"),
                "{name}: {port}"
            );
        }
        let command: Vec<String> = service["command"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_owned())
            .collect();
        if target == "mock-vllm" {
            use clap::Parser;
            let cli = mock_vllm::Cli::try_parse_from(
                std::iter::once("mock-vllm".to_owned()).chain(command),
            )
            .unwrap_or_else(|e| panic!("{name}: {e}"));
            let config = cli.into_config().unwrap();
            replicas.push((name.clone(), config));
        }
    }
    assert_eq!(replicas.len(), 2);
    // No fixed addresses: services find each other by name on the project's own network.
    assert!(compose.get("networks").is_none());

    // indexd's endpoints are exactly the replicas by service name, with their event ports;
    // indexd resolves the names to the addresses Envoy resolves them to.
    let indexd_yaml = std::fs::read_to_string(repo("envoy/docker/indexd.yaml")).unwrap();
    let indexd = indexd::Config::from_yaml_with(&indexd_yaml, &dns).unwrap();
    assert!(
        indexd::Config::from_yaml(&indexd_yaml).is_err(),
        "names need resolving"
    );
    let mut named: Vec<String> = indexd
        .endpoints
        .iter()
        .map(|e| e.id.address.to_string())
        .collect();
    let mut expected: Vec<String> = replicas
        .iter()
        .map(|(name, config)| dns(name, config.http_addr.port()).unwrap()[0].to_string())
        .collect();
    named.sort();
    expected.sort();
    assert_eq!(named, expected);
    for (name, config) in &replicas {
        let port = config.http_addr.port();
        let e = indexd
            .endpoints
            .iter()
            .find(|e| e.id.address == dns(name, port).unwrap()[0])
            .unwrap();
        let events = config.kv_events.as_ref().unwrap();
        assert_eq!(indexd.block_size.get(), config.block_size);
        assert_eq!(
            e.events.as_deref(),
            Some(format!("tcp://{name}:5557").as_str())
        );
        assert_eq!(
            e.replay.as_deref(),
            Some(format!("tcp://{name}:5558").as_str())
        );
        assert_eq!(events.replay.map(|r| r.port()), Some(5558));
        assert_eq!(
            e.metrics_url.as_ref().map(ToString::to_string),
            Some(format!("http://{name}:{port}/metrics"))
        );
        assert!(indexd_yaml.contains(&format!("address: {name}:{port}\n")));
    }
    // indexd starts once the replicas are healthy (it resolves their names at start).
    for (name, _) in &replicas {
        assert_eq!(
            services["indexd"]["depends_on"][name]["condition"], "service_healthy",
            "indexd on {name}"
        );
        assert_eq!(
            services["envoy"]["depends_on"][name]["condition"], "service_healthy",
            "envoy on {name}"
        );
    }

    // Envoy's STRICT_DNS cluster names the same replicas and indexd; Envoy validates it.
    let envoy_yaml = std::fs::read_to_string(repo("envoy/docker/envoy.yaml")).unwrap();
    let envoy_doc = yaml_docs("envoy/docker/envoy.yaml").remove(0);
    let vllm = envoy_doc["static_resources"]["clusters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "vllm")
        .unwrap()
        .clone();
    assert_eq!(vllm["type"], "STRICT_DNS");
    // indexd picks a name's IPv4 address first, as this family policy does.
    assert_eq!(vllm["dns_lookup_family"], "V4_PREFERRED");
    for (name, config) in &replicas {
        let port = config.http_addr.port();
        assert!(envoy_yaml.contains(&format!("address: {name}, port_value: {port}")));
    }
    // Envoy reaches indexd's socket through the volume both mount, as
    // indexd's user and group.
    let socket = socket_path(&indexd);
    assert_eq!(envoy_indexd_pipe(&envoy_yaml), socket);
    let dir = Path::new(&socket).parent().unwrap().display().to_string();
    let mounted = |service: &str| -> String {
        services[service]["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .find(|v| v.split(':').nth(1) == Some(dir.as_str()))
            .unwrap_or_else(|| panic!("{service} does not mount {dir}"))
            .split(':')
            .next()
            .unwrap()
            .to_owned()
    };
    let volume = mounted("indexd");
    assert_eq!(mounted("envoy"), volume);
    assert!(compose["volumes"][volume.as_str()].is_object());
    assert!(dockerfile.contains(&format!(
        "USER {}\n",
        services["envoy"]["user"].as_str().unwrap()
    )));
    assert!(dockerfile.contains(&format!(" {dir}\n")));
    let wasm = artifacts::filter_wasm().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("envoy.yaml");
    std::fs::write(
        &path,
        envoy_yaml.replace(
            "/etc/kvroute/kvroute_filter.wasm",
            &wasm.display().to_string(),
        ),
    )
    .unwrap();
    envoy::validate(&path, dir.path()).unwrap();
}

#[test]
fn the_docker_build_context_keeps_sources_and_only_the_prebuilt_outputs() {
    let ignore = std::fs::read_to_string(repo(".dockerignore")).unwrap();
    let rules: Vec<&str> = ignore
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    assert!(rules.contains(&".git"));
    assert!(rules.contains(&"**/target"));
    // What the Dockerfile's prebuilt stage copies is let back in, and nothing else of target/.
    let dockerfile = std::fs::read_to_string(repo("envoy/docker/Dockerfile")).unwrap();
    let prebuilt = dockerfile
        .split("\nFROM ")
        .find(|stage| stage.contains(" AS prebuilt\n"))
        .unwrap();
    let copied: Vec<&str> = prebuilt
        .split_whitespace()
        .filter(|w| w.starts_with("target/"))
        .collect();
    assert_eq!(copied.len(), 3, "{prebuilt}");
    // `PREBUILT_DIR` names the cargo profile's directory: release, or debug (CI).
    let mut copied: Vec<String> = copied
        .iter()
        .flat_map(|c| {
            if c.contains("${PREBUILT_DIR}") {
                ["release", "debug"]
                    .map(|d| c.replace("${PREBUILT_DIR}", d))
                    .to_vec()
            } else {
                vec![(*c).to_owned()]
            }
        })
        .collect();
    let mut allowed: Vec<&str> = rules.iter().filter_map(|r| r.strip_prefix('!')).collect();
    allowed.sort_unstable();
    copied.sort_unstable();
    assert_eq!(allowed, copied);
}

#[test]
fn local_indexd_yaml_matches_the_local_envoy_yaml() {
    let indexd = indexd::Config::from_file(&repo("envoy/indexd.yaml")).unwrap();
    let envoy_yaml = std::fs::read_to_string(repo("envoy/envoy.yaml")).unwrap();
    for e in &indexd.endpoints {
        let a = e.id.address;
        assert!(
            envoy_yaml.contains(&format!("address: {}, port_value: {}", a.ip(), a.port())),
            "{a} is not in envoy.yaml's clusters"
        );
        assert!(
            e.events_bind,
            "a loopback events endpoint must be bound by indexd"
        );
    }
    assert_eq!(envoy_indexd_pipe(&envoy_yaml), socket_path(&indexd));
}

/// `kubernetes-validate` (PyPI; `.ci/deps.sh` installs it in a venv):
/// `$KVROUTE_K8S_VALIDATE_VENV` or `~/.cache/kvroute/k8s-validate`.
fn kubernetes_validate() -> Option<PathBuf> {
    let venv = std::env::var_os("KVROUTE_K8S_VALIDATE_VENV").map_or_else(
        || {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/kvroute/k8s-validate")
        },
        PathBuf::from,
    );
    let bin = venv.join("bin/kubernetes-validate");
    bin.is_file().then_some(bin)
}

#[test]
fn kubernetes_manifests_validate_against_the_api_schemas() {
    let Some(validate) = kubernetes_validate() else {
        assert!(
            std::env::var_os("CI").is_none(),
            "kubernetes-validate is missing in CI: .ci/deps.sh installs it"
        );
        eprintln!(
            "SKIPPED kubernetes_manifests_validate_against_the_api_schemas: no kubernetes-validate \
             in ~/.cache/kvroute/k8s-validate (or $KVROUTE_K8S_VALIDATE_VENV); `bash .ci/deps.sh` \
             installs it"
        );
        return;
    };
    let dir = repo("envoy/kubernetes");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 2, "{files:?}");
    let run = |version: &str, files: &[PathBuf]| {
        std::process::Command::new(&validate)
            .args(["--strict", "--kubernetes-version", version])
            .args(files)
            .output()
            .unwrap()
    };
    // The oldest API the client is built for (k8s-openapi's v1_33) and the
    // newest the validator knows.
    for version in ["1.33.0", "1.37.0"] {
        let out = run(version, &files);
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{version}:\n{said}");
        for kind in ["role/", "rolebinding/", "serviceaccount/", "daemonset/"] {
            assert!(
                said.contains(&format!("passed for resource {kind}")),
                "{kind}: {said}"
            );
        }
    }
    // The validator refuses what it should: a misspelled field.
    let bad = tempfile::Builder::new().suffix(".yaml").tempfile().unwrap();
    std::fs::write(
        bad.path(),
        "apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata: {name: r, namespace: n}\n\
         rules:\n- apiGroups: [\"\"]\n  resources: [pods]\n  verb: [list]\n",
    )
    .unwrap();
    assert!(!run("1.37.0", &[bad.path().to_path_buf()]).status.success());
}
