//! The deployment files' share of "indexd under hostile bodies":
//!
//! - the Kubernetes sample guards indexd's HTTP routes with the shared token
//!   (the Secret, the filter's `index_token`, Prometheus' credentials agree
//!   with it, and the sample's indexd, run here, answers 401 without it on
//!   every route but the kubelet's probes);
//! - the DaemonSet bounds indexd's CPU and memory;
//! - every Envoy and Istio sample bounds its indexd cluster with circuit
//!   breakers (what an overflow does to requests: `indexd_overflow.rs`);
//! - compose's Envoy keeps its admin on its container's loopback.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use kvroute_e2e::http;
use serde_json::{Value, json};

use super::standins::TIMEOUT;
use super::{compose_file, repo, yaml_docs};

/// Envoy's default circuit-breaker thresholds, which the samples replace.
const ENVOY_DEFAULT_LIMIT: u64 = 1024;

/// The first document of `kind` (and `name`, if given) in a YAML file.
fn doc(path: &str, kind: &str, name: Option<&str>) -> Value {
    yaml_docs(path)
        .into_iter()
        .find(|d| d["kind"] == kind && name.is_none_or(|n| d["metadata"]["name"] == n))
        .unwrap_or_else(|| panic!("{path}: no {kind} {name:?}"))
}

/// The Kubernetes sample's indexd config, parsed.
fn kube_indexd_config() -> indexd::Config {
    let config = doc(
        "envoy/kubernetes/indexd.yaml",
        "ConfigMap",
        Some("kvroute-indexd"),
    );
    indexd::Config::from_yaml(config["data"]["indexd.yaml"].as_str().unwrap()).unwrap()
}

fn daemonset() -> Value {
    doc("envoy/kubernetes/indexd.yaml", "DaemonSet", None)
}

/// The Secret (name, key) that the DaemonSet mounts as the file `path`.
fn secret_file(pod: &Value, container: &Value, path: &Path) -> (String, String) {
    let dir = path.parent().unwrap().display().to_string();
    let file = path.file_name().unwrap().to_str().unwrap();
    let mount = container["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"] == dir.as_str())
        .unwrap_or_else(|| panic!("indexd mounts nothing at {dir}"));
    assert_eq!(mount["readOnly"], true, "{mount}");
    let volume = pod["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    let secret = &volume["secret"];
    let name = secret["secretName"]
        .as_str()
        .unwrap_or_else(|| panic!("{dir} is not a Secret volume: {volume}"))
        .to_owned();
    // The Secret's key that becomes the file: an item, or the key itself.
    let key = match secret["items"].as_array() {
        Some(items) => items
            .iter()
            .find(|i| i["path"] == file)
            .unwrap_or_else(|| panic!("the Secret volume has no item {file}"))["key"]
            .as_str()
            .unwrap()
            .to_owned(),
        None => file.to_owned(),
    };
    (name, key)
}

/// `$KVROUTE_PROMTOOL`, `promtool` on the PATH, or the one `.ci/deps.sh`
/// unpacks into `~/.cache/kvroute/promtool/`.
fn promtool() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KVROUTE_PROMTOOL") {
        return Some(PathBuf::from(p));
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("promtool"))
            .find(|p| p.is_file())
    });
    on_path.or_else(|| {
        let cached =
            PathBuf::from(std::env::var_os("HOME")?).join(".cache/kvroute/promtool/promtool");
        cached.is_file().then_some(cached)
    })
}

#[test]
fn kubernetes_indexd_requires_the_token_everywhere_but_the_probes() {
    let config = kube_indexd_config();
    let token_path = config
        .access
        .auth_token_file
        .clone()
        .expect("the Kubernetes sample sets auth_token_file");
    assert!(!config.access.allow_unauthenticated);
    // The listeners: gRPC on the node-local socket (the gateway's way in),
    // HTTP on the pod IP for the probes and Prometheus.
    assert!(
        config.grpc_listen.unix_path().is_some(),
        "{}",
        config.grpc_listen
    );
    assert!(config.http_listen.ip().is_unspecified());

    // The token file is a Secret's key, mounted read-only.
    let ds = daemonset();
    let template = &ds["spec"]["template"];
    let pod = &template["spec"];
    let container = &pod["containers"][0];
    let (secret, key) = secret_file(pod, container, &token_path);

    // The kubelet's probes ask only what the token leaves open.
    let probes = ["readinessProbe", "livenessProbe"].map(|p| {
        let get = &container[p]["httpGet"];
        assert_eq!(get["port"], "http", "{p}");
        get["path"].as_str().unwrap().to_owned()
    });
    for path in &probes {
        assert!(["/healthz", "/readyz"].contains(&path.as_str()), "{path}");
    }
    // No annotation invites a scrape that would go without the token.
    let annotations = template["metadata"]["annotations"].as_object().unwrap();
    assert!(
        annotations.keys().all(|k| !k.starts_with("prometheus.io/")),
        "{annotations:?}"
    );

    // The filter sends a token (the Secret's value, which the sample cannot
    // know): gRPC needs it as much as HTTP.
    let plugin = doc("envoy/istio/wasmplugin.yaml", "WasmPlugin", None);
    let filter =
        kvroute_filter::Config::parse(plugin["spec"]["pluginConfig"].to_string().as_bytes())
            .unwrap();
    assert!(
        filter.index_token.is_some(),
        "wasmplugin.yaml: no index_token"
    );

    // Prometheus, with the operator: a PodMonitor beside indexd reads the
    // same Secret and scrapes the HTTP port's /metrics.
    let monitor = doc("envoy/prometheus/podmonitor.yaml", "PodMonitor", None);
    assert_eq!(
        monitor["metadata"]["namespace"],
        ds["metadata"]["namespace"]
    );
    assert_eq!(
        monitor["spec"]["selector"]["matchLabels"],
        template["metadata"]["labels"]
    );
    let endpoints = monitor["spec"]["podMetricsEndpoints"].as_array().unwrap();
    assert_eq!(endpoints.len(), 1);
    let endpoint = &endpoints[0];
    let port = container["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == endpoint["port"])
        .unwrap_or_else(|| panic!("no container port {}", endpoint["port"]));
    assert_eq!(port["containerPort"], config.http_listen.port());
    let metrics_path = endpoint["path"].as_str().unwrap_or("/metrics").to_owned();
    assert_eq!(endpoint["authorization"]["type"], "Bearer");
    assert_eq!(
        endpoint["authorization"]["credentials"],
        json!({"name": secret, "key": key})
    );

    // Prometheus without the operator: a scrape job over the pods of
    // indexd's namespace, keeping indexd's http port, with the token file.
    let scrape = &yaml_docs("envoy/prometheus/scrape-config.yaml")[0];
    let jobs = scrape["scrape_configs"].as_array().unwrap();
    assert_eq!(jobs.len(), 1);
    let job = &jobs[0];
    let sd = &job["kubernetes_sd_configs"][0];
    assert_eq!(sd["role"], "pod");
    assert_eq!(
        sd["namespaces"]["names"],
        json!([ds["metadata"]["namespace"]])
    );
    assert_eq!(
        job["metrics_path"].as_str().unwrap_or("/metrics"),
        metrics_path
    );
    assert_eq!(job["authorization"]["type"], "Bearer");
    let keeps = |label: &str, value: &Value| {
        job["relabel_configs"].as_array().unwrap().iter().any(|r| {
            r["action"] == "keep" && r["source_labels"] == json!([label]) && r["regex"] == *value
        })
    };
    assert!(keeps(
        "__meta_kubernetes_pod_label_app_kubernetes_io_name",
        &template["metadata"]["labels"]["app.kubernetes.io/name"]
    ));
    assert!(keeps(
        "__meta_kubernetes_pod_container_port_name",
        &port["name"]
    ));
    let credentials_file = job["authorization"]["credentials_file"].as_str().unwrap();
    assert!(
        credentials_file.ends_with(&format!("/{secret}/{key}")),
        "{credentials_file}: not the Secret's {secret}/{key}"
    );
    promtool_accepts(scrape, credentials_file);

    // The sample's indexd, run here: the token guards /metrics and the
    // tokenizer routes; the probes answer without it.
    let served = SampleIndexd::start(config);
    let bearer = format!("Bearer {}", served.token);
    let with = [("authorization", bearer.as_str())];
    for path in &probes {
        let r = served.get(path, &[]);
        assert_ne!(r.status, 401, "{path} needs a token: the kubelet has none");
    }
    assert_eq!(served.get(&metrics_path, &[]).status, 401);
    assert_eq!(served.get(&metrics_path, &with).status, 200);
    for path in ["/tokenize", "/v1/responses/render"] {
        let body = br#"{"model":"llama","prompt":"hello"}"#;
        let wrong = [("authorization", "Bearer not-the-token-0123456789")];
        for headers in [&[][..], &wrong[..]] {
            let r = served.post(path, headers, body);
            assert_eq!(r.status, 401, "{path} without the token: {r:?}");
        }
        let r = served.post(path, &with, body);
        assert_ne!(r.status, 401, "{path} with the token: {r:?}");
    }
}

/// `promtool check config` on the scrape job. Debian's promtool is built
/// without Kubernetes discovery, so the job's `kubernetes_sd_configs` (checked
/// above) stands in as a static target; the token file is a temporary one
/// (promtool checks that it exists).
fn promtool_accepts(scrape: &Value, credentials_file: &str) {
    let Some(promtool) = promtool() else {
        assert!(
            std::env::var_os("CI").is_none(),
            "promtool is missing in CI: .ci/deps.sh installs it"
        );
        eprintln!(
            "SKIPPED promtool check config of envoy/prometheus/scrape-config.yaml: no promtool \
             (on the PATH, in ~/.cache/kvroute/promtool/, or $KVROUTE_PROMTOOL)"
        );
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "kvroute-e2e-token-0123456789").unwrap();
    let check = |config: &Value| {
        let path = dir.path().join("prometheus.yml");
        std::fs::write(&path, serde_yaml::to_string(config).unwrap()).unwrap();
        let out = std::process::Command::new(&promtool)
            .args(["check", "config"])
            .arg(&path)
            .output()
            .unwrap();
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), said)
    };
    let mut local = scrape.clone();
    let job = &mut local["scrape_configs"][0];
    job.as_object_mut().unwrap().remove("kubernetes_sd_configs");
    job["static_configs"] = json!([{ "targets": ["10.0.0.7:9471"] }]);
    assert_eq!(job["authorization"]["credentials_file"], credentials_file);
    job["authorization"]["credentials_file"] = json!(token.display().to_string());
    let (ok, said) = check(&local);
    assert!(ok, "promtool check config:\n{said}");
    // promtool refuses what it should: a token file that is not there.
    local["scrape_configs"][0]["authorization"]["credentials_file"] =
        json!(dir.path().join("missing").display().to_string());
    assert!(!check(&local).0, "promtool accepted a missing token file");
}

/// The Kubernetes sample's indexd config with what needs a cluster
/// swapped for local stand-ins: no watch, no tokenizer files, no snapshot,
/// the socket in a temporary directory, HTTP on loopback, the token in a
/// temporary file. Its access settings and HTTP routes are the sample's.
struct SampleIndexd {
    rt: tokio::runtime::Runtime,
    stop: tokio_util::sync::CancellationToken,
    http: SocketAddr,
    token: String,
    _dir: tempfile::TempDir,
}

impl SampleIndexd {
    fn start(mut config: indexd::Config) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let token = "kvroute-sample-token-5d1e7a0c9b".to_owned();
        let token_file = dir.path().join("token");
        std::fs::write(&token_file, format!("{token}\n")).unwrap();
        config.kubernetes = None;
        config.tokenize = indexd::tokenize::TokenizeConfig::default();
        config.snapshot = indexd::SnapshotConfig::default();
        config.grpc_listen = indexd::ListenAddr::Unix(dir.path().join("indexd.sock"));
        config.http_listen = SocketAddr::from(([127, 0, 0, 1], 0));
        config.access.auth_token_file = Some(token_file);
        let rt = tokio::runtime::Runtime::new().unwrap();
        let bound = rt.block_on(indexd::Server::bind(config)).unwrap();
        let http = bound.http_addr();
        let stop = tokio_util::sync::CancellationToken::new();
        rt.spawn(bound.serve(stop.clone()));
        Self {
            rt,
            stop,
            http,
            token,
            _dir: dir,
        }
    }

    fn get(&self, path: &str, headers: &[(&str, &str)]) -> http::Response {
        http::get(&format!("http://{}{path}", self.http), headers, TIMEOUT).unwrap()
    }

    fn post(&self, path: &str, headers: &[(&str, &str)], body: &[u8]) -> http::Response {
        let mut headers = headers.to_vec();
        headers.push(("content-type", "application/json"));
        http::post(
            &format!("http://{}{path}", self.http),
            &headers,
            body,
            TIMEOUT,
        )
        .unwrap()
    }
}

impl Drop for SampleIndexd {
    fn drop(&mut self) {
        self.stop.cancel();
        let _ = &self.rt;
    }
}

/// A Kubernetes quantity (`500m`, `2`, `512Mi`, `2Gi`, `1G`) in base units
/// (cores or bytes).
fn quantity(v: &Value) -> f64 {
    let text = match v {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        _ => panic!("not a quantity: {v}"),
    };
    let suffixes: [(&str, f64); 9] = [
        ("Ki", 1024.0),
        ("Mi", 1024.0 * 1024.0),
        ("Gi", 1024.0 * 1024.0 * 1024.0),
        ("Ti", 1024.0_f64.powi(4)),
        ("m", 1e-3),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
    ];
    for (suffix, factor) in suffixes {
        if let Some(n) = text.strip_suffix(suffix) {
            return n.parse::<f64>().unwrap() * factor;
        }
    }
    text.parse().unwrap()
}

#[test]
fn kubernetes_indexd_has_cpu_and_memory_bounds() {
    let ds = daemonset();
    let container = &ds["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(container["name"], "indexd");
    let resources = &container["resources"];
    for what in ["cpu", "memory"] {
        let request = quantity(&resources["requests"][what]);
        let limit = quantity(&resources["limits"][what]);
        assert!(
            request > 0.0 && request <= limit,
            "{what}: request {request} limit {limit}"
        );
    }
    let cpu = quantity(&resources["limits"]["cpu"]);
    // Whole CPUs, so that ingest_cpus (a Guaranteed pod) needs only the
    // request raised to it; at least two, one for ingest and one for Picks.
    assert!(cpu >= 2.0 && cpu.fract() == 0.0, "cpu limit {cpu}");
    // The memory limit holds the index at its bound: ~100 B an entry under
    // churn plus ~64 MiB of process (indexd/README.md, scaling), with room
    // for tokenizers and a snapshot being written.
    let config = kube_indexd_config();
    let index = config.max_index_entries as f64 * 100.0 + 64.0 * 1024.0 * 1024.0;
    let memory = quantity(&resources["limits"]["memory"]);
    assert!(
        memory >= index + f64::from(256u32 * 1024 * 1024),
        "memory limit {memory} B for an index of {} entries (~{index} B)",
        config.max_index_entries
    );
    // The quantity parser reads what it should.
    assert_eq!(quantity(&json!("500m")), 0.5);
    assert_eq!(quantity(&json!("2Gi")), 2.0 * 1024.0 * 1024.0 * 1024.0);
    assert_eq!(quantity(&json!(2)), 2.0);
}

/// The indexd cluster of each Envoy sample: the static one of the local and
/// compose configs, and the one Istio's EnvoyFilter adds.
pub(super) fn indexd_clusters() -> Vec<(&'static str, Value)> {
    let mut clusters: Vec<(&str, Value)> = ["envoy/envoy.yaml", "envoy/docker/envoy.yaml"]
        .into_iter()
        .map(|path| {
            let doc = yaml_docs(path).remove(0);
            let cluster = doc["static_resources"]["clusters"]
                .as_array()
                .unwrap()
                .iter()
                .find(|c| c["name"] == "kvroute_indexd")
                .unwrap_or_else(|| panic!("{path}: no kvroute_indexd cluster"))
                .clone();
            (path, cluster)
        })
        .collect();
    let filter = doc("envoy/istio/envoyfilter.yaml", "EnvoyFilter", None);
    let added: Vec<&Value> = filter["spec"]["configPatches"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["applyTo"] == "CLUSTER" && p["patch"]["operation"] == "ADD")
        .map(|p| &p["patch"]["value"])
        .filter(|c| c["name"] == "kvroute-indexd")
        .collect();
    assert_eq!(added.len(), 1, "envoyfilter.yaml adds one kvroute-indexd");
    clusters.push(("envoy/istio/envoyfilter.yaml", added[0].clone()));
    clusters
}

#[test]
fn every_indexd_cluster_has_circuit_breakers() {
    let clusters = indexd_clusters();
    let mut thresholds = Vec::new();
    for (path, cluster) in &clusters {
        // Over indexd's Unix socket, as the samples deploy it.
        assert!(
            cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
                ["pipe"]["path"]
                .is_string(),
            "{path}: indexd is not reached over its socket"
        );
        let all = cluster["circuit_breakers"]["thresholds"]
            .as_array()
            .unwrap_or_else(|| panic!("{path}: no circuit_breakers.thresholds"));
        assert_eq!(
            all.len(),
            1,
            "{path}: one threshold set (Picks use DEFAULT)"
        );
        let t = &all[0];
        if !t["priority"].is_null() {
            assert_eq!(t["priority"], "DEFAULT", "{path}");
        }
        for field in ["max_requests", "max_pending_requests", "max_connections"] {
            let n = t[field]
                .as_u64()
                .unwrap_or_else(|| panic!("{path}: no {field}"));
            assert!(
                n > 0 && n < ENVOY_DEFAULT_LIMIT,
                "{path}: {field} {n} is not below Envoy's default"
            );
        }
        // Picks are never retried: the filter fails open instead.
        assert_eq!(t["max_retries"], 0, "{path}: retries allowed");
        assert!(t["retry_budget"].is_null(), "{path}: a retry budget");
        thresholds.push(t.clone());
    }
    // The samples keep one sizing.
    for (t, (path, _)) in thresholds.iter().zip(&clusters) {
        assert_eq!(*t, thresholds[0], "{path} differs from {}", clusters[0].0);
    }
    // The bound carries a busy gateway at the Picks' usual time (≤ 5 ms,
    // indexd tokenizing): at least 10,000 requests/s.
    let max_requests = thresholds[0]["max_requests"].as_u64().unwrap();
    assert!(
        max_requests as f64 / 0.005 >= 10_000.0,
        "max_requests {max_requests}"
    );
    // (Envoy validates each cluster with the rest of its file: the tests of
    // envoy.yaml, docker/envoy.yaml and envoyfilter.yaml.)
}

#[test]
fn compose_envoy_admin_stays_on_its_container_loopback() {
    let envoy_doc = yaml_docs("envoy/docker/envoy.yaml").remove(0);
    let admin = &envoy_doc["admin"]["address"]["socket_address"];
    let ip: std::net::IpAddr = admin["address"].as_str().unwrap().parse().unwrap();
    assert!(ip.is_loopback(), "compose Envoy's admin on {ip}");
    let port = admin["port_value"].as_u64().unwrap();
    // The local sample's admin too.
    let local = yaml_docs("envoy/envoy.yaml").remove(0);
    let local_ip: std::net::IpAddr = local["admin"]["address"]["socket_address"]["address"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(local_ip.is_loopback(), "envoy.yaml's admin on {local_ip}");

    let compose = compose_file();
    let envoy = &compose["services"]["envoy"];
    // Not published (a published port would forward to the container's
    // network address, where nothing listens now) nor exposed.
    for mapping in envoy["ports"].as_array().into_iter().flatten() {
        let container_port = mapping
            .as_str()
            .unwrap()
            .rsplit(':')
            .next()
            .unwrap()
            .trim_end_matches("/tcp");
        assert_ne!(
            container_port,
            port.to_string(),
            "admin published: {mapping}"
        );
    }
    assert!(envoy["expose"].is_null());
    // Its healthcheck asks the admin from inside the container, on loopback.
    let test = envoy["healthcheck"]["test"].to_string();
    assert!(
        test.contains(&format!("/dev/tcp/127.0.0.1/{port}")) && test.contains("/ready"),
        "{test}"
    );
    // No environment variable names an admin port any more.
    let text = std::fs::read_to_string(repo("envoy/docker-compose.yaml")).unwrap();
    assert!(!text.contains("KVROUTE_ADMIN_PORT"));
}
