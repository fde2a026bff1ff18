//! A whole kvroute deployment on loopback: N mock vLLM replicas and indexd
//! in-process (on the stack's own tokio runtime), and a real Envoy 1.40 with
//! the built filter in front of them.
//!
//! Envoy's `inference` listener routes to the replicas' cluster with the
//! `override_host` policy (least-request fallback). With
//! [`Routing::LeastRequest`] the filter is left out: that is the baseline.
//! indexd can be stopped and started again on the same port mid-test.
//! With [`StackOptions::gateways`] > 1 the stack is active-active: each
//! gateway is its own Envoy with its own indexd, all in front of (and
//! subscribed to) the same replicas. With [`StackOptions::indexd_unix_socket`]
//! indexd serves gRPC on a Unix socket that Envoy reaches as a `pipe`
//! address; with [`StackOptions::indexd_token`] indexd requires a shared
//! token and the filter sends it. [`Stack::start_external`] starts only the
//! gateways, in front of replicas that run elsewhere (the bench's real vLLM
//! fleet, shared by several stacks one after another). With
//! [`StackOptions::membership_files`] the replicas can change while it runs:
//! [`Stack::add_replica`] and [`Stack::remove_replica`] rewrite indexd's
//! discovery file and Envoy's EDS files.

use std::net::SocketAddr;
use std::time::Duration;

use indexd::ListenAddr;
use serde_json::{Value, json};
use tokio::runtime::Runtime;

use crate::proxy::Relay;
use crate::vllm::{RealVllm, VllmOptions, free_port};
use crate::{Envoy, HarnessError};

mod membership;
mod parts;
mod waits;

pub use waits::wait_until;

use parts::{
    RunningIndexd, endpoint, envoy_config, indexd_config, mock_config, mock_endpoints, runtime,
    start_indexd,
};

/// The request header the filter writes and Envoy's override_host reads.
pub const OVERRIDE_HEADER: &str = "x-gateway-destination-endpoint";
/// The response header carrying the filter's reason label.
pub const DECISION_HEADER: &str = "x-kvroute-decision";
/// The listener the stack's clients talk to.
pub const LISTENER: &str = "inference";

/// How requests are routed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routing {
    /// Envoy's least-request alone (no filter): the baseline.
    LeastRequest,
    /// kvroute with exact token-block keys.
    Precise,
    /// kvroute with text-chunk keys learned from its own picks.
    Approximate,
}

/// What to start.
#[derive(Debug, Clone)]
pub struct StackOptions {
    /// Mock vLLM replicas.
    pub replicas: usize,
    /// The served model.
    pub model: String,
    /// LoRA adapters every replica serves.
    pub adapters: Vec<String>,
    /// vLLM `--block-size`, used by replicas, filter and indexd alike.
    pub block_size: u32,
    /// Prefix-cache capacity of each replica, in blocks.
    pub num_gpu_blocks: usize,
    /// The mock's latency model runs this much faster than real time when < 1.
    pub time_scale: f64,
    /// Output tokens per request when the request sets none.
    pub default_max_tokens: u32,
    /// Routing profile.
    pub routing: Routing,
    /// Fields merged into the filter's plugin configuration.
    pub filter_overrides: Value,
    /// Seed of indexd's tie-breaking RNG.
    pub seed: u64,
    /// Put a relay between Envoy and indexd that [`Stack::set_indexd_delay`]
    /// can slow down.
    pub slow_indexd_link: bool,
    /// Data-parallel ranks per mock server (indexd sees one endpoint per
    /// rank; the filter pins requests with `x-data-parallel-rank`).
    pub data_parallel_size: u32,
    /// The mock replicas' chat template.
    pub chat_template: mock_vllm::ChatTemplate,
    /// Reasoning tokens opening each chat/Responses output of the mock (0: none).
    pub reasoning_tokens: u32,
    /// Gateways (Envoy + its own indexd each) in front of the same replicas.
    pub gateways: usize,
    /// The replicas' `max_model_len` (their caches must hold it: raise
    /// `num_gpu_blocks` along).
    pub max_model_len: u32,
    /// Envoy's `per_connection_buffer_limit_bytes` on the inference listener:
    /// the largest request body it buffers for the filter.
    pub buffer_limit_bytes: u32,
    /// When set, the stack's tokio threads are named after it and indexd runs
    /// on a runtime of its own, threads named `<label>-indexd` (a thread name
    /// keeps 15 bytes), so `/proc/self/task/*/stat` tells their CPU apart;
    /// threads that exit leave theirs in [`crate::threads::exited_cpu_ns`].
    pub thread_label: Option<String>,
    /// Local tokenizers of every indexd (none: the replicas' `/tokenize`).
    pub tokenizers: Vec<indexd::tokenize::TokenizerSpec>,
    /// indexd serves gRPC on a Unix socket in a temporary directory (mode
    /// 0660) and Envoy's indexd cluster is a `pipe` address. Not together
    /// with `slow_indexd_link` (a TCP relay).
    pub indexd_unix_socket: bool,
    /// indexd requires this shared token (its `auth_token_file`) and the
    /// filter sends it (`index_token`).
    pub indexd_token: Option<String>,
    /// indexd's `observe_rate` and `observe_burst` (None: its defaults).
    pub observe_limit: Option<(u32, u32)>,
    /// indexd's `scrape_interval` (200 ms: tests see load sooner than with
    /// indexd's 1 s default).
    pub scrape_interval: Duration,
    /// The mock replicas' KV cache groups (default: one full-attention
    /// group), e.g. `sliding_window:256,full_attention` for a Gemma-3-style
    /// model.
    pub kv_cache_layout: mock_vllm::KvCacheLayout,
    /// The mock replicas' prefill chunk (`max_num_batched_tokens`; None: a
    /// prompt in one step).
    pub max_num_batched_tokens: Option<u32>,
    /// The model directory real vLLM replicas serve (None: the tiny Llama,
    /// [`crate::vllm::model_dir`]).
    pub vllm_model_dir: Option<std::path::PathBuf>,
    /// indexd's `speculative_ttl` (None: its default). Zero turns the
    /// speculative credit off: a test's own probing Picks then credit no
    /// replica with a prompt it was never sent, and every match comes from
    /// the replicas' events.
    pub indexd_speculative_ttl: Option<Duration>,
    /// indexd's `shadow_per_second` for its local tokenizers (None: its
    /// default): how many live Picks a second a replica tokenizes too.
    pub indexd_shadow_per_second: Option<f64>,
    /// indexd's `weights.balance_margin` (None: its default; 0: new
    /// conversations go by cost alone).
    pub indexd_balance_margin: Option<f64>,
    /// indexd's `tokenize.replica_timeout` (None: its default, 2 s): how
    /// long it waits for a replica's `/tokenize` or `/render`.
    pub indexd_replica_timeout: Option<Duration>,
    /// The replicas are not fixed: indexd follows a discovery file (no
    /// static endpoints) and Envoy's replica clusters are EDS clusters fed
    /// from files, so [`Stack::add_replica`] (a mock),
    /// [`Stack::start_spare_vllm`] with [`Stack::announce`] (a real vLLM)
    /// and [`Stack::remove_replica`] can change them while requests run.
    pub membership_files: bool,
}

impl Default for StackOptions {
    fn default() -> Self {
        Self {
            replicas: 2,
            model: "tiny".into(),
            adapters: Vec::new(),
            block_size: 16,
            num_gpu_blocks: 8_192,
            time_scale: 0.0,
            default_max_tokens: 4,
            routing: Routing::Precise,
            // Generous: parallel tests share two cores with every Envoy and
            // replica; production keeps the 50 ms / 500 ms defaults.
            filter_overrides: json!({ "index_timeout_ms": 1_000, "tokenizer_timeout_ms": 2_000 }),
            seed: 7,
            slow_indexd_link: false,
            data_parallel_size: 1,
            chat_template: mock_vllm::ChatTemplate::RoleMarkers,
            reasoning_tokens: 0,
            gateways: 1,
            max_model_len: 32_768,
            buffer_limit_bytes: 8 * 1024 * 1024,
            thread_label: None,
            tokenizers: Vec::new(),
            indexd_unix_socket: false,
            indexd_token: None,
            observe_limit: None,
            scrape_interval: Duration::from_millis(200),
            kv_cache_layout: mock_vllm::KvCacheLayout::default(),
            max_num_batched_tokens: None,
            vllm_model_dir: None,
            indexd_speculative_ttl: None,
            indexd_shadow_per_second: None,
            indexd_balance_margin: None,
            indexd_replica_timeout: None,
            membership_files: false,
        }
    }
}

/// A replica the stack does not own ([`Stack::start_external`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExternalReplica {
    /// Its OpenAI API address (`ip:port`, as Envoy's cluster names the host).
    pub http: SocketAddr,
    /// The bound PUB endpoint its KV events are published on (`tcp://ip:port`).
    pub events: String,
    /// Its replay ROUTER endpoint (`tcp://ip:port`).
    pub replay: String,
}

/// A gateway beyond the first: its own Envoy and indexd.
struct Gateway {
    // Envoy drops (stops) before its indexd.
    envoy: Envoy,
    indexd: Option<RunningIndexd>,
}

/// A running deployment; everything stops on drop.
pub struct Stack {
    options: StackOptions,
    /// Where the first gateway's indexd writes its snapshots.
    snapshots: tempfile::TempDir,
    // Field order is drop order: the Envoys first, then indexd, then the
    // replicas, then the runtime they run on.
    extra_gateways: Vec<Gateway>,
    envoy: Envoy,
    indexd: Option<RunningIndexd>,
    indexd_grpc: ListenAddr,
    indexd_link: Option<Relay>,
    endpoints: Vec<indexd::EndpointConfig>,
    /// The discovery and EDS files, with [`StackOptions::membership_files`].
    membership: Option<membership::Files>,
    replicas: Vec<mock_vllm::Handle>,
    real: Vec<RealVllm>,
    indexd_runtime: Option<Runtime>,
    runtime: Runtime,
}

impl std::fmt::Debug for Stack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stack")
            .field("routing", &self.options.routing)
            .field("replicas", &self.replica_addresses())
            .field("indexd_grpc", &self.indexd_grpc)
            .finish_non_exhaustive()
    }
}

fn setup(context: &str, message: impl std::fmt::Display) -> HarnessError {
    HarnessError::Unexpected {
        context: context.to_owned(),
        message: message.to_string(),
    }
}

/// How real vLLM replica `i` of the stack is started (its ports free now).
fn vllm_plan(options: &StackOptions, i: usize) -> Result<VllmOptions, HarnessError> {
    Ok(VllmOptions {
        served_name: options.model.clone(),
        block_size: options.block_size,
        events_endpoint: format!("tcp://127.0.0.1:{}", free_port()?),
        topic: format!("kv@r{i}@{}", options.model),
        cpu: i % 2,
        port: free_port()?,
        replay_port: free_port()?,
        max_model_len: 8192,
        num_gpu_blocks: None,
        model_dir: options.vllm_model_dir.clone(),
    })
}

/// indexd's endpoint for a real vLLM replica started from `plan` (indexd
/// binds its events endpoint; vLLM connects).
fn vllm_endpoint(options: &StackOptions, plan: &VllmOptions) -> indexd::EndpointConfig {
    endpoint(
        options,
        SocketAddr::from(([127, 0, 0, 1], plan.port)),
        Some((plan.events_endpoint.clone(), true)),
        Some(format!("tcp://127.0.0.1:{}", plan.replay_port)),
    )
}

impl Stack {
    /// Starts mock replicas, indexd (unless least-request) and Envoy, and
    /// waits until indexd sees every replica fresh and healthy.
    pub fn start(options: StackOptions) -> Result<Self, HarnessError> {
        let runtime = runtime(options.thread_label.as_deref())?;
        let mut replicas = Vec::with_capacity(options.replicas);
        for _ in 0..options.replicas {
            let config = mock_config(&options);
            let replica = runtime
                .block_on(mock_vllm::MockVllm::start(config))
                .map_err(|e| setup("mock vLLM replica", e))?;
            replicas.push(replica);
        }
        let endpoints = replicas
            .iter()
            .flat_map(|r| mock_endpoints(&options, r))
            .collect();
        Self::assemble(options, runtime, endpoints, replicas, Vec::new())
    }

    /// Starts `options.replicas` real vLLM servers (CPU, the tiny model) with
    /// their KV events flowing into indexd, then indexd and Envoy.
    pub fn start_real_vllm(options: StackOptions) -> Result<Self, HarnessError> {
        let runtime = runtime(options.thread_label.as_deref())?;
        let plans = (0..options.replicas)
            .map(|i| vllm_plan(&options, i))
            .collect::<Result<Vec<_>, _>>()?;
        let endpoints = plans.iter().map(|p| vllm_endpoint(&options, p)).collect();
        // All servers start at once (from this thread, which owns them);
        // most of their start-up is waiting.
        let mut real = plans
            .iter()
            .map(RealVllm::spawn)
            .collect::<Result<Vec<_>, _>>()?;
        for server in &mut real {
            server.wait_ready()?;
        }
        Self::assemble(options, runtime, endpoints, Vec::new(), real)
    }

    /// Starts only the gateways (Envoy, and indexd unless least-request) in
    /// front of replicas that run elsewhere and outlive the stack: indexd
    /// connects to each replica's `events` publisher (a bound PUB socket) and
    /// its `replay` ROUTER, and scrapes its `/metrics`.
    pub fn start_external(
        options: StackOptions,
        replicas: &[ExternalReplica],
    ) -> Result<Self, HarnessError> {
        let runtime = runtime(options.thread_label.as_deref())?;
        let endpoints = replicas
            .iter()
            .map(|r| {
                endpoint(
                    &options,
                    r.http,
                    Some((r.events.clone(), false)),
                    Some(r.replay.clone()),
                )
            })
            .collect();
        Self::assemble(options, runtime, endpoints, Vec::new(), Vec::new())
    }

    fn assemble(
        options: StackOptions,
        runtime: Runtime,
        endpoints: Vec<indexd::EndpointConfig>,
        replicas: Vec<mock_vllm::Handle>,
        real: Vec<RealVllm>,
    ) -> Result<Self, HarnessError> {
        let mut addresses: Vec<SocketAddr> = endpoints.iter().map(|e| e.id.address).collect();
        addresses.dedup();
        let indexd_runtime = match &options.thread_label {
            Some(label) if options.routing != Routing::LeastRequest => {
                Some(self::runtime(Some(&format!("{label}-indexd")))?)
            }
            _ => None,
        };
        let indexd_rt = indexd_runtime.as_ref().unwrap_or(&runtime);
        // The first gateway's indexd keeps snapshots, so a restart
        // (`stop_indexd`, `start_indexd`) restores its index.
        let snapshots = tempfile::Builder::new()
            .prefix("kvroute-indexd-")
            .tempdir()
            .map_err(|e| HarnessError::io("create snapshot dir", e))?;
        if options.indexd_unix_socket && options.slow_indexd_link {
            return Err(setup(
                "stack options",
                "slow_indexd_link relays TCP: not with indexd_unix_socket",
            ));
        }
        let membership = if options.membership_files {
            let mut files = membership::Files::new(snapshots.path())?;
            files.write_discovery(&endpoints)?;
            files.write_eds(&addresses)?;
            Some(files)
        } else {
            None
        };
        if let Some(token) = &options.indexd_token {
            std::fs::write(snapshots.path().join("token"), token)
                .map_err(|e| HarnessError::io("write the token file", e))?;
        }
        // Where gateway `i`'s indexd listens for gRPC.
        let listen = |i: usize| {
            if options.indexd_unix_socket {
                ListenAddr::Unix(snapshots.path().join(format!("indexd-{i}.sock")))
            } else {
                ListenAddr::Tcp(SocketAddr::from(([127, 0, 0, 1], 0)))
            }
        };
        let (indexd, indexd_grpc, indexd_link) = if options.routing == Routing::LeastRequest {
            (
                None,
                ListenAddr::Tcp(SocketAddr::from(([127, 0, 0, 1], 9))),
                None,
            )
        } else {
            let mut config = indexd_config(
                &options,
                &endpoints,
                listen(0),
                snapshots.path(),
                membership.as_ref(),
            );
            config.snapshot.path = Some(snapshots.path().join("indexd.snapshot"));
            let (running, grpc) = start_indexd(indexd_rt, config)?;
            // With `slow_indexd_link`, Envoy reaches indexd through a relay the
            // test can slow down.
            let link = match (options.slow_indexd_link, grpc.tcp()) {
                (true, Some(tcp)) => Some(Relay::start(&runtime, tcp)?),
                _ => None,
            };
            (Some(running), grpc, link)
        };
        let envoy_to_indexd = indexd_link
            .as_ref()
            .map_or_else(|| indexd_grpc.clone(), |l| ListenAddr::Tcp(l.addr()));
        let envoy = Envoy::start(&envoy_config(
            &options,
            &addresses,
            &envoy_to_indexd,
            membership.as_ref(),
        )?)?;
        let mut extra_gateways = Vec::new();
        for gateway in 1..options.gateways {
            let (indexd, grpc) = if options.routing == Routing::LeastRequest {
                (None, ListenAddr::Tcp(SocketAddr::from(([127, 0, 0, 1], 9))))
            } else {
                let mut config = indexd_config(
                    &options,
                    &endpoints,
                    listen(gateway),
                    snapshots.path(),
                    membership.as_ref(),
                );
                // Each indexd draws its own tie-breaks, as independently started
                // ones do (seeded from entropy); the same seed everywhere would
                // make every gateway send the same first requests to the same
                // replicas.
                config.seed = Some(options.seed.wrapping_add(gateway as u64));
                let (running, grpc) = start_indexd(indexd_rt, config)?;
                (Some(running), grpc)
            };
            let envoy = Envoy::start(&envoy_config(
                &options,
                &addresses,
                &grpc,
                membership.as_ref(),
            )?)?;
            extra_gateways.push(Gateway { envoy, indexd });
        }
        let stack = Self {
            options,
            snapshots,
            extra_gateways,
            envoy,
            indexd,
            indexd_grpc,
            indexd_link,
            endpoints,
            membership,
            replicas,
            real,
            indexd_runtime,
            runtime,
        };
        stack.wait_index_ready(Duration::from_secs(60))?;
        Ok(stack)
    }

    /// The real vLLM servers (empty on the mock).
    pub fn real_vllm(&self) -> &[RealVllm] {
        &self.real
    }

    /// indexd's gRPC address (`ip:port` or a socket file); a tonic client
    /// connects to its [`ListenAddr::grpc_uri`].
    pub fn indexd_grpc(&self) -> &ListenAddr {
        &self.indexd_grpc
    }

    /// Delays every request on Envoy's link to indexd (zero: no delay); needs
    /// [`StackOptions::slow_indexd_link`].
    pub fn set_indexd_delay(&self, delay: Duration) {
        if let Some(link) = &self.indexd_link {
            link.set_delay(delay);
        }
    }

    /// `http://127.0.0.1:port` of Envoy's inference listener.
    pub fn url(&self) -> Result<String, HarnessError> {
        self.envoy.listener_url(LISTENER)
    }

    /// The inference listener of every gateway, the first gateway's first.
    pub fn gateway_urls(&self) -> Result<Vec<String>, HarnessError> {
        std::iter::once(&self.envoy)
            .chain(self.extra_gateways.iter().map(|g| &g.envoy))
            .map(|e| e.listener_url(LISTENER))
            .collect()
    }

    /// The Envoy in front.
    pub fn envoy(&self) -> &Envoy {
        &self.envoy
    }

    /// Every gateway's Envoy, the first gateway's first.
    pub fn gateway_envoys(&self) -> Vec<&Envoy> {
        std::iter::once(&self.envoy)
            .chain(self.extra_gateways.iter().map(|g| &g.envoy))
            .collect()
    }

    /// The replicas, in cluster order.
    pub fn replicas(&self) -> &[mock_vllm::Handle] {
        &self.replicas
    }

    /// `ip:port` of every replica, in cluster order (for the mock, the names
    /// in `x-mock-vllm-replica`).
    pub fn replica_addresses(&self) -> Vec<String> {
        let mut addresses: Vec<String> = self
            .endpoints
            .iter()
            .map(|e| e.id.address.to_string())
            .collect();
        // Data-parallel ranks share their server's address.
        addresses.dedup();
        addresses
    }

    /// The options the stack was started with.
    pub fn options(&self) -> &StackOptions {
        &self.options
    }

    /// The running indexd, if any.
    pub fn indexd(&self) -> Option<&indexd::Handle> {
        self.indexd.as_ref().map(|i| &i.handle)
    }

    /// Every running indexd, the first gateway's first.
    pub fn indexd_handles(&self) -> Vec<&indexd::Handle> {
        self.all_indexd().map(|i| &i.handle).collect()
    }

    /// indexd's HTTP address (`/metrics`), if running.
    pub fn indexd_http(&self) -> Option<SocketAddr> {
        self.indexd.as_ref().map(|i| i.http)
    }

    /// Runs a future on the stack's runtime.
    pub fn block_on<F: std::future::Future>(&self, future: F) -> F::Output {
        self.runtime.block_on(future)
    }

    /// Waits until every replica has published what it produced so far.
    pub fn flush_events(&self) {
        for replica in &self.replicas {
            self.runtime.block_on(replica.flush_events());
        }
    }

    /// Stops indexd (gracefully: it writes its snapshot); Envoy keeps running.
    pub fn stop_indexd(&mut self) {
        if let Some(running) = self.indexd.take() {
            running.stop.cancel();
            let _ = self.runtime.block_on(running.task);
        }
    }

    /// Starts indexd again on its previous gRPC port: it restores the index
    /// from the snapshot it wrote when it stopped, and resumes each replica
    /// from its saved seq (what cannot be proven is purged and replayed).
    pub fn start_indexd(&mut self) -> Result<(), HarnessError> {
        if self.indexd.is_some() || self.options.routing == Routing::LeastRequest {
            return Ok(());
        }
        let mut config = indexd_config(
            &self.options,
            &self.endpoints,
            self.indexd_grpc.clone(),
            self.snapshots.path(),
            self.membership.as_ref(),
        );
        config.snapshot.path = Some(self.snapshots.path().join("indexd.snapshot"));
        let rt = self.indexd_runtime.as_ref().unwrap_or(&self.runtime);
        let (running, _) = start_indexd(rt, config)?;
        self.indexd = Some(running);
        self.wait_index_ready(Duration::from_secs(20))
    }

    /// Every running indexd, the first gateway's first.
    fn all_indexd(&self) -> impl Iterator<Item = &RunningIndexd> {
        std::iter::once(&self.indexd)
            .chain(self.extra_gateways.iter().map(|g| &g.indexd))
            .flatten()
    }
}
