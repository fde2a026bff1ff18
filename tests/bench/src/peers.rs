//! Peer routers from PyPI (`install-peers.sh` pins them in a bench venv),
//! started in front of the same mock replicas as a separate process:
//!
//! - vllm-router 0.1.17 `cache_aware` (approximate prefix tree of request text);
//! - vllm-router 0.1.17 `kv_aware`, subscribed to the replicas' KV events
//!   (and their replay sockets);
//! - sglang-router 0.3.2 `cache_aware`.
//!
//! The clients talk to the router instead of Envoy; everything else (replicas,
//! oracle, records) is the same as for the Envoy profiles.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use kvroute_e2e::process::Spawned;
use kvroute_e2e::vllm::free_port;

use crate::BenchError;
use crate::client;

/// A peer router and its policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    /// vllm-router `--policy cache_aware`.
    VllmCacheAware,
    /// vllm-router `--policy kv_aware` fed by the replicas' KV events.
    VllmKvAware,
    /// sglang-router `--policy cache_aware`.
    SglangCacheAware,
}

/// The bench venv (`$KVROUTE_BENCH_VENV`, else `~/.cache/kvroute/bench-venv`).
pub fn venv() -> PathBuf {
    if let Some(v) = std::env::var_os("KVROUTE_BENCH_VENV") {
        return PathBuf::from(v);
    }
    std::env::var_os("HOME")
        .map_or_else(|| PathBuf::from("/root"), PathBuf::from)
        .join(".cache/kvroute/bench-venv")
}

/// A replica as a peer router reaches it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Worker {
    /// `http://ip:port` (the replica, or a tap naming it in its answers).
    pub url: String,
    /// Its KV-event publisher, for `kv_aware` (mock replicas only).
    pub events: Option<String>,
    /// Its replay socket, for `kv_aware`.
    pub replay: Option<String>,
}

/// A running peer router; killed (with its process group) on drop.
#[derive(Debug)]
pub struct PeerRouter {
    process: Spawned,
    url: String,
}

impl PeerRouter {
    /// `http://127.0.0.1:port` of the router.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The router's process id.
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }
}

fn harness(context: &str, message: impl std::fmt::Display) -> BenchError {
    BenchError::Harness(kvroute_e2e::HarnessError::Unexpected {
        context: context.to_owned(),
        message: message.to_string(),
    })
}

/// Starts instance `instance` of `peer` in front of `workers` and waits
/// until it answers.
pub fn start(
    peer: Peer,
    workers: &[Worker],
    block_size: u32,
    model: &str,
    instance: usize,
) -> Result<PeerRouter, BenchError> {
    let (binary, policy) = match peer {
        Peer::VllmCacheAware => ("vllm-router", "cache_aware"),
        Peer::VllmKvAware => ("vllm-router", "kv_aware"),
        Peer::SglangCacheAware => ("sglang-router", "cache_aware"),
    };
    let program = venv().join("bin").join(binary);
    if !program.exists() {
        return Err(harness(
            binary,
            format!(
                "{} not found: run `bash tests/bench/install-peers.sh`",
                program.display()
            ),
        ));
    }
    let port = free_port()?;
    let metrics_port = free_port()?;
    let urls: Vec<&str> = workers.iter().map(|w| w.url.as_str()).collect();
    let mut command = Command::new(&program);
    if peer == Peer::SglangCacheAware {
        command.arg("launch");
    }
    command
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--prometheus-host", "127.0.0.1"])
        .args(["--prometheus-port", &metrics_port.to_string()])
        .args(["--policy", policy])
        .arg("--worker-urls")
        .args(&urls);
    if peer == Peer::VllmKvAware {
        for w in workers {
            if let Some(events) = &w.events {
                command.args(["--kv-event-source", &format!("{}={events}", w.url)]);
            }
            if let Some(replay) = &w.replay {
                command.args(["--kv-event-replay-source", &format!("{}={replay}", w.url)]);
            }
        }
        command
            .args(["--kv-event-block-size", &block_size.to_string()])
            .args(["--kv-event-model", model]);
    }
    let log = std::env::temp_dir().join(format!(
        "kvroute-bench-{}-{binary}-{policy}-{instance}.log",
        std::process::id()
    ));
    let mut process = Spawned::start(binary, command, &log)?;
    let url = format!("http://127.0.0.1:{port}");
    let agent = client::agent(Duration::from_secs(2));
    let started = Instant::now();
    loop {
        if let Some(status) = process.exited() {
            return Err(harness(
                binary,
                format!("exited ({status}): {}", process.log_tail()),
            ));
        }
        let ready = agent
            .get(&format!("{url}/health"))
            .call()
            .is_ok_and(|r| r.status().as_u16() == 200);
        if ready {
            break;
        }
        if started.elapsed() > Duration::from_secs(60) {
            return Err(harness(
                binary,
                format!("not ready after 60 s: {}", process.log_tail()),
            ));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(PeerRouter { process, url })
}
