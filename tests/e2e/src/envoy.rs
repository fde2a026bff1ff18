//! Real Envoy, started per test.
//!
//! Envoy binds its admin and listener sockets on port 0 and the harness reads
//! the bound ports back (admin: `--admin-address-path`; listeners: the admin
//! `/listeners` endpoint), so parallel tests never race for a port.
//! `--use-dynamic-base-id` keeps their shared-memory regions apart. Configs
//! are built as JSON values from the pieces below.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tempfile::TempDir;

use crate::{HarnessError, Spawned, artifacts, http};

/// How long Envoy may take to become ready.
const READY_TIMEOUT: Duration = Duration::from_secs(60);
const POLL: Duration = Duration::from_millis(25);
const ADMIN_TIMEOUT: Duration = Duration::from_secs(5);

/// A bootstrap configuration (Envoy's JSON form of its YAML).
#[derive(Debug, Clone)]
pub struct EnvoyConfig {
    bootstrap: Value,
}

impl EnvoyConfig {
    /// A bootstrap with the given static listeners and clusters and an admin
    /// endpoint on `127.0.0.1:0`. Stats flush when the admin endpoint is read
    /// (`stats_flush_on_admin`) rather than every 5 s: a histogram read right
    /// after a run holds all of it (the bench waited up to one flush interval
    /// per run for it), and no flush timer runs beside the traffic.
    pub fn new(listeners: Vec<Value>, clusters: Vec<Value>) -> Self {
        Self {
            bootstrap: json!({
                "admin": { "address": socket_address(0) },
                "stats_flush_on_admin": true,
                "static_resources": { "listeners": listeners, "clusters": clusters },
            }),
        }
    }

    /// The bootstrap as JSON.
    pub fn as_json(&self) -> &Value {
        &self.bootstrap
    }

    /// Names the node (`node.id`, `node.cluster`): Envoy requires one
    /// before it subscribes to any xDS source, a file one included
    /// ([`eds_cluster`]).
    pub fn with_node(mut self, id: &str, cluster: &str) -> Self {
        self.bootstrap["node"] = json!({ "id": id, "cluster": cluster });
        self
    }
}

/// `{"socket_address": {"address": "127.0.0.1", "port_value": port}}`.
pub fn socket_address(port: u16) -> Value {
    json!({ "socket_address": { "address": "127.0.0.1", "port_value": port } })
}

/// An HTTP listener named `name` on `127.0.0.1:0` with `http_filters` (the
/// router is appended) and `routes` for every domain.
pub fn http_listener(name: &str, http_filters: Vec<Value>, routes: Vec<Value>) -> Value {
    let mut filters = http_filters;
    filters.push(json!({
        "name": "envoy.filters.http.router",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
        }
    }));
    json!({
        "name": name,
        "address": socket_address(0),
        "filter_chains": [{
            "filters": [{
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                    "stat_prefix": name,
                    "route_config": {
                        "virtual_hosts": [{ "name": "all", "domains": ["*"], "routes": routes }]
                    },
                    "http_filters": filters,
                }
            }]
        }]
    })
}

/// A route answering every path with `status` and `body` from Envoy itself.
pub fn direct_response_route(status: u16, body: &str) -> Value {
    json!({
        "match": { "prefix": "/" },
        "direct_response": { "status": status, "body": { "inline_string": body } }
    })
}

/// The client request headers that could pin a host or speak for kvroute.
pub const ROUTING_HEADERS: [&str; 2] = ["x-gateway-destination-endpoint", "x-data-parallel-rank"];

/// Envoy's own `header_mutation` filter removing [`ROUTING_HEADERS`] and every
/// `x-kvroute-*` request header. It goes before the kvroute filter, so client
/// pins are gone even when the Wasm VM failed to load or trapped.
pub fn routing_header_strip() -> Value {
    let mut mutations: Vec<Value> = ROUTING_HEADERS
        .iter()
        .map(|h| json!({ "remove": h }))
        .collect();
    mutations.push(json!({ "remove_on_match": { "key_matcher": { "prefix": "x-kvroute-" } } }));
    json!({
        "name": "kvroute-strip-routing-headers",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": { "request_mutations": mutations },
        }
    })
}

/// [`routing_header_strip`], then [`kvroute_filter`]: the filters of a gateway.
pub fn kvroute_filters(wasm: &Path, plugin_config: &Value) -> Vec<Value> {
    vec![routing_header_strip(), kvroute_filter(wasm, plugin_config)]
}

/// The kvroute wasm HTTP filter, loaded from `wasm` into the V8 runtime with
/// `plugin_config` as its configuration. `allow_on_headers_stop_iteration` is
/// set: without it the filter never sees the request body (Envoy ≥ 1.35).
/// `failure_policy: FAIL_OPEN`: should the VM fail, requests pass as if the
/// filter were absent.
pub fn kvroute_filter(wasm: &Path, plugin_config: &Value) -> Value {
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
                    "value": plugin_config.to_string(),
                },
                "vm_config": {
                    "vm_id": "kvroute",
                    "runtime": "envoy.wasm.runtime.v8",
                    "code": { "local": { "filename": wasm.display().to_string() } },
                },
            }
        }
    })
}

/// A running Envoy, killed on drop.
#[derive(Debug)]
pub struct Envoy {
    process: Spawned,
    admin: String,
    // Held for the config, admin address and log files; removed on drop.
    dir: TempDir,
}

impl Envoy {
    /// Starts the Envoy from [`artifacts::envoy_binary`] with `config` and
    /// waits until its admin endpoint reports `LIVE`. A config Envoy rejects
    /// is an [`HarnessError::Exited`] carrying Envoy's log.
    pub fn start(config: &EnvoyConfig) -> Result<Self, HarnessError> {
        let binary = artifacts::envoy_binary()?;
        let dir = tempfile::Builder::new()
            .prefix("kvroute-envoy-")
            .tempdir()
            .map_err(|e| HarnessError::io("create temp dir", e))?;
        let config_path = dir.path().join("envoy.json");
        std::fs::write(&config_path, config.as_json().to_string())
            .map_err(|e| HarnessError::io("write envoy config", e))?;
        let admin_path = dir.path().join("admin-address");

        let mut command = Command::new(&binary);
        command
            .arg("--config-path")
            .arg(&config_path)
            .arg("--admin-address-path")
            .arg(&admin_path)
            .arg("--use-dynamic-base-id")
            .args(["--concurrency", "2", "--log-level", "info"]);
        // KVROUTE_ENVOY_WASM_LOG=debug shows the filter's per-request decisions.
        if let Ok(level) = std::env::var("KVROUTE_ENVOY_WASM_LOG") {
            command
                .arg("--component-log-level")
                .arg(format!("wasm:{level}"));
        }
        let mut process = Spawned::start("envoy", command, &dir.path().join("envoy.log"))?;

        let admin = wait_ready(&mut process, &admin_path)?;
        Ok(Self {
            process,
            admin,
            dir,
        })
    }

    /// Envoy's process id (for `/proc/<pid>/status` and `/proc/<pid>/stat`).
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// `http://127.0.0.1:port` of the admin endpoint.
    pub fn admin_url(&self) -> &str {
        &self.admin
    }

    /// The port Envoy bound for listener `name`.
    pub fn listener_port(&self, name: &str) -> Result<u16, HarnessError> {
        let url = format!("{}/listeners?format=json", self.admin);
        let response = http::get(&url, &[], ADMIN_TIMEOUT)?;
        let doc: Value =
            serde_json::from_str(&response.body).map_err(|e| HarnessError::Unexpected {
                context: url.clone(),
                message: e.to_string(),
            })?;
        doc["listener_statuses"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|l| l["name"] == name)
            .and_then(|l| l["local_address"]["socket_address"]["port_value"].as_u64())
            .and_then(|p| u16::try_from(p).ok())
            .ok_or_else(|| HarnessError::Unexpected {
                context: url,
                message: format!("no bound listener named {name:?} in {doc}"),
            })
    }

    /// `http://127.0.0.1:port` of listener `name`.
    pub fn listener_url(&self, name: &str) -> Result<String, HarnessError> {
        Ok(format!("http://127.0.0.1:{}", self.listener_port(name)?))
    }

    /// The hosts (`ip:port`) Envoy's cluster `name` has now, from the admin
    /// `/clusters` endpoint (a host an EDS update removed is gone at once,
    /// while its connections drain).
    pub fn cluster_hosts(&self, name: &str) -> Result<Vec<String>, HarnessError> {
        let url = format!("{}/clusters?format=json", self.admin);
        let response = http::get(&url, &[], ADMIN_TIMEOUT)?;
        let doc: Value =
            serde_json::from_str(&response.body).map_err(|e| HarnessError::Unexpected {
                context: url.clone(),
                message: e.to_string(),
            })?;
        let cluster = doc["cluster_statuses"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["name"] == name)
            .ok_or_else(|| HarnessError::Unexpected {
                context: url.clone(),
                message: format!("no cluster named {name:?}"),
            })?;
        Ok(cluster["host_statuses"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|h| {
                let a = &h["address"]["socket_address"];
                Some(format!(
                    "{}:{}",
                    a["address"].as_str()?,
                    a["port_value"].as_u64()?
                ))
            })
            .collect())
    }

    /// The admin `/stats/prometheus` text.
    pub fn prometheus_stats(&self) -> Result<String, HarnessError> {
        let url = format!("{}/stats/prometheus", self.admin);
        Ok(http::get(&url, &[], ADMIN_TIMEOUT)?.body)
    }

    /// Envoy's log so far.
    pub fn log(&self) -> String {
        self.process.log_tail()
    }

    /// The directory holding the config and log.
    pub fn dir(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        self.process.exited().is_none()
    }
}

fn wait_ready(process: &mut Spawned, admin_path: &Path) -> Result<String, HarnessError> {
    let started = Instant::now();
    loop {
        if let Some(status) = process.exited() {
            return Err(HarnessError::Exited {
                what: "envoy".into(),
                status,
                log: process.log_tail(),
            });
        }
        if let Some(admin) = std::fs::read_to_string(admin_path)
            .ok()
            .map(|a| a.trim().to_owned())
            .filter(|a| !a.is_empty())
        {
            let url = format!("http://{admin}");
            let ready = http::get(&format!("{url}/ready"), &[], ADMIN_TIMEOUT)
                .is_ok_and(|r| r.status == 200 && r.body.trim() == "LIVE");
            if ready {
                return Ok(url);
            }
        }
        if started.elapsed() > READY_TIMEOUT {
            return Err(HarnessError::NotReady {
                what: "envoy".into(),
                after: READY_TIMEOUT,
                log: process.log_tail(),
            });
        }
        std::thread::sleep(POLL);
    }
}

/// The response header naming the upstream host that served (`ip:port`).
pub const UPSTREAM_HEADER: &str = "x-kvroute-upstream";

/// A route sending every path to `cluster`, retrying once on another host
/// (the next entry of the override list) when the first cannot be reached.
/// Responses carry the serving host in [`UPSTREAM_HEADER`].
pub fn cluster_route(cluster: &str, timeout: Duration) -> Value {
    json!({
        "match": { "prefix": "/" },
        "response_headers_to_add": [{
            "header": { "key": UPSTREAM_HEADER, "value": "%UPSTREAM_REMOTE_ADDRESS%" },
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"
        }],
        "route": {
            "cluster": cluster,
            "timeout": format!("{}s", timeout.as_secs_f64()),
            "retry_policy": {
                "retry_on": "connect-failure,reset",
                "num_retries": 1,
                "retry_host_predicate": [{
                    "name": "envoy.retry_host_predicates.previous_hosts",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
                    }
                }],
                "host_selection_retry_max_attempts": 3,
            }
        }
    })
}

fn endpoints(addrs: &[SocketAddr]) -> Value {
    let lb_endpoints: Vec<Value> = addrs
        .iter()
        .map(|a| {
            json!({ "endpoint": { "address": {
                "socket_address": { "address": a.ip().to_string(), "port_value": a.port() }
            } } })
        })
        .collect();
    json!([{ "lb_endpoints": lb_endpoints }])
}

/// The vLLM replicas' cluster: the `override_host` load-balancing policy
/// reads the ordered `ip:port,…` list from `override_header`, falling back to
/// least-request when the header is absent or names no host of the cluster.
pub fn inference_cluster(name: &str, replicas: &[SocketAddr], override_header: &str) -> Value {
    json!({
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": { "cluster_name": name, "endpoints": endpoints(replicas) },
        "load_balancing_policy": { "policies": [{ "typed_extension_config": {
            "name": "envoy.load_balancing_policies.override_host",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                "override_host_sources": [{ "header": override_header }],
                "fallback_policy": { "policies": [{ "typed_extension_config": {
                    "name": "envoy.load_balancing_policies.least_request",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest"
                    }
                } }] }
            }
        } }] }
    })
}

/// `cluster` (a STATIC one of the above) turned into an EDS cluster whose
/// hosts come from the file `path` (a `DiscoveryResponse` holding one
/// `ClusterLoadAssignment` named after the cluster: [`eds_file`]). Envoy
/// reloads it whenever a file is moved into `watched_dir` (write it beside,
/// then rename it in), so hosts join and leave without a restart. The
/// bootstrap needs a node ([`EnvoyConfig::with_node`]).
pub fn eds_cluster(mut cluster: Value, path: &Path, watched_dir: &Path) -> Value {
    if let Some(c) = cluster.as_object_mut() {
        c.remove("load_assignment");
        c.insert("type".into(), json!("EDS"));
        c.insert(
            "eds_cluster_config".into(),
            json!({ "eds_config": {
                "resource_api_version": "V3",
                "path_config_source": {
                    "path": path.display().to_string(),
                    "watched_directory": { "path": watched_dir.display().to_string() },
                },
            } }),
        );
    }
    cluster
}

/// The contents of an EDS file ([`eds_cluster`]): cluster `name` with `hosts`.
pub fn eds_file(name: &str, hosts: &[SocketAddr], version: u64) -> Value {
    json!({
        "version_info": version.to_string(),
        "resources": [{
            "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
            "cluster_name": name,
            "endpoints": endpoints(hosts),
        }],
    })
}

/// A plain HTTP/1.1 cluster (e.g. the tokenizer: any replica of the model).
pub fn http_cluster(name: &str, hosts: &[SocketAddr]) -> Value {
    json!({
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "lb_policy": "LEAST_REQUEST",
        "load_assignment": { "cluster_name": name, "endpoints": endpoints(hosts) },
    })
}

/// An HTTP/2 cluster for gRPC (indexd).
pub fn grpc_cluster(name: &str, host: SocketAddr) -> Value {
    let mut cluster = http_cluster(name, &[host]);
    cluster["typed_extension_protocol_options"] = json!({
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": { "http2_protocol_options": {} }
        }
    });
    cluster
}

/// `{"pipe": {"path": path}}`: a Unix domain socket address.
pub fn pipe_address(path: &Path) -> Value {
    json!({ "pipe": { "path": path.display().to_string() } })
}

/// indexd's HTTP/2 cluster: a socket address for TCP, a `pipe` address for
/// a Unix socket.
pub fn indexd_cluster(name: &str, indexd: &indexd::ListenAddr) -> Value {
    match indexd {
        indexd::ListenAddr::Tcp(a) => grpc_cluster(name, *a),
        indexd::ListenAddr::Unix(path) => {
            let mut cluster = grpc_cluster(name, SocketAddr::from(([127, 0, 0, 1], 9)));
            cluster["load_assignment"]["endpoints"] = json!([{ "lb_endpoints": [
                { "endpoint": { "address": pipe_address(path) } }
            ] }]);
            cluster
        }
    }
}

/// Runs `envoy --mode validate` on a config file from directory `cwd`
/// (relative paths in the config, such as the `.wasm`, resolve from there).
/// Envoy loads the wasm module and runs its `on_configure`, so the plugin
/// configuration is checked by the filter itself. Returns Envoy's output.
pub fn validate(config: &Path, cwd: &Path) -> Result<String, HarnessError> {
    let output = Command::new(artifacts::envoy_binary()?)
        .arg("--mode")
        .arg("validate")
        .arg("--config-path")
        .arg(config)
        .arg("--use-dynamic-base-id")
        .current_dir(cwd)
        .output()
        .map_err(|e| HarnessError::io("run envoy --mode validate", e))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    if output.status.success() {
        Ok(text)
    } else {
        Err(HarnessError::Exited {
            what: format!("envoy --mode validate {}", config.display()),
            status: output.status.to_string(),
            log: text,
        })
    }
}
