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
//! subscribed to) the same replicas.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::runtime::Runtime;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::envoy::{
    cluster_route, grpc_cluster, http_cluster, http_listener, inference_cluster, kvroute_filters,
};
use crate::proxy::Relay;
use crate::vllm::{RealVllm, VllmOptions, free_port};
use crate::{Envoy, EnvoyConfig, HarnessError, artifacts};

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
    /// keeps 15 bytes), so `/proc/self/task/*/stat` tells their CPU apart.
    pub thread_label: Option<String>,
    /// Local tokenizers of every indexd (none: the replicas' `/tokenize`).
    pub tokenizers: Vec<indexd::tokenize::TokenizerSpec>,
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
        }
    }
}

struct RunningIndexd {
    stop: CancellationToken,
    task: JoinHandle<Result<(), indexd::StartError>>,
    handle: indexd::Handle,
    http: SocketAddr,
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
    indexd_grpc: SocketAddr,
    indexd_link: Option<Relay>,
    endpoints: Vec<indexd::EndpointConfig>,
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
        let mut endpoints = Vec::new();
        for r in &replicas {
            if options.data_parallel_size > 1 {
                // One endpoint per rank: same address, its own event stream.
                let replays = r.replay_endpoints();
                for (rank, events) in r.events_endpoints() {
                    let replay = replays
                        .iter()
                        .find(|(k, _)| *k == rank)
                        .map(|(_, e)| e.clone());
                    let mut e = endpoint(&options, r.http_addr(), Some((events, false)), replay);
                    e.id.rank = Some(rank);
                    endpoints.push(e);
                }
            } else {
                endpoints.push(endpoint(
                    &options,
                    r.http_addr(),
                    r.events_endpoint().map(|e| (e.to_owned(), false)),
                    r.replay_endpoint().map(str::to_owned),
                ));
            }
        }
        Self::assemble(options, runtime, endpoints, replicas, Vec::new())
    }

    /// Starts `options.replicas` real vLLM servers (CPU, the tiny model) with
    /// their KV events flowing into indexd, then indexd and Envoy.
    pub fn start_real_vllm(options: StackOptions) -> Result<Self, HarnessError> {
        let runtime = runtime(options.thread_label.as_deref())?;
        let mut plans = Vec::new();
        for i in 0..options.replicas {
            let vllm = VllmOptions {
                served_name: options.model.clone(),
                block_size: options.block_size,
                events_endpoint: format!("tcp://127.0.0.1:{}", free_port()?),
                topic: format!("kv@r{i}@{}", options.model),
                cpu: i % 2,
                port: free_port()?,
                replay_port: free_port()?,
            };
            plans.push(vllm);
        }
        let endpoints = plans
            .iter()
            .map(|p| {
                endpoint(
                    &options,
                    SocketAddr::from(([127, 0, 0, 1], p.port)),
                    Some((p.events_endpoint.clone(), true)),
                    Some(format!("tcp://127.0.0.1:{}", p.replay_port)),
                )
            })
            .collect();
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
        let (indexd, indexd_grpc, indexd_link) = if options.routing == Routing::LeastRequest {
            (None, SocketAddr::from(([127, 0, 0, 1], 9)), None)
        } else {
            let mut config =
                indexd_config(&options, &endpoints, SocketAddr::from(([127, 0, 0, 1], 0)));
            config.snapshot.path = Some(snapshots.path().join("indexd.snapshot"));
            let (running, grpc) = start_indexd(indexd_rt, config)?;
            // With `slow_indexd_link`, Envoy reaches indexd through a relay the
            // test can slow down.
            let link = if options.slow_indexd_link {
                Some(Relay::start(&runtime, grpc)?)
            } else {
                None
            };
            (Some(running), grpc, link)
        };
        let envoy_to_indexd = indexd_link.as_ref().map_or(indexd_grpc, Relay::addr);
        let envoy = Envoy::start(&envoy_config(&options, &addresses, envoy_to_indexd)?)?;
        let mut extra_gateways = Vec::new();
        for gateway in 1..options.gateways {
            let (indexd, grpc) = if options.routing == Routing::LeastRequest {
                (None, SocketAddr::from(([127, 0, 0, 1], 9)))
            } else {
                let mut config =
                    indexd_config(&options, &endpoints, SocketAddr::from(([127, 0, 0, 1], 0)));
                // Each indexd draws its own tie-breaks, as independently started
                // ones do (seeded from entropy); the same seed everywhere would
                // make every gateway send the same first requests to the same
                // replicas.
                config.seed = Some(options.seed.wrapping_add(gateway as u64));
                let (running, grpc) = start_indexd(indexd_rt, config)?;
                (Some(running), grpc)
            };
            let envoy = Envoy::start(&envoy_config(&options, &addresses, grpc)?)?;
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

    /// indexd's gRPC address.
    pub fn indexd_grpc(&self) -> SocketAddr {
        self.indexd_grpc
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
        let mut config = indexd_config(&self.options, &self.endpoints, self.indexd_grpc);
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

    /// Waits until every running indexd sees every replica fresh and healthy.
    pub fn wait_index_ready(&self, timeout: Duration) -> Result<(), HarnessError> {
        let started = Instant::now();
        for indexd in self.all_indexd() {
            let left = timeout.saturating_sub(started.elapsed());
            self.wait_one_index_ready(indexd, left)?;
        }
        Ok(())
    }

    fn wait_one_index_ready(
        &self,
        indexd: &RunningIndexd,
        timeout: Duration,
    ) -> Result<(), HarnessError> {
        let ids: Vec<indexd::EndpointId> = self.endpoints.iter().map(|e| e.id.clone()).collect();
        wait_until(
            "indexd sees every replica fresh and healthy",
            timeout,
            || {
                ids.iter().all(|id| {
                    indexd
                        .handle
                        .replica(id)
                        .is_some_and(|s| s.fresh && s.healthy)
                })
            },
        )
        .map_err(|e| match e {
            HarnessError::NotReady { what, after, .. } => {
                let status: Vec<String> = ids
                    .iter()
                    .map(|id| format!("{id}: {:?}", indexd.handle.replica(id)))
                    .collect();
                HarnessError::NotReady {
                    what,
                    after,
                    log: format!("{}\n{}", status.join("\n"), indexd.handle.metrics_text()),
                }
            }
            other => other,
        })
    }

    /// Waits until every running indexd holds at least `entries` blocks for
    /// replica `i` (all its data-parallel ranks together).
    pub fn wait_indexed(
        &self,
        i: usize,
        entries: usize,
        timeout: Duration,
    ) -> Result<(), HarnessError> {
        let addresses = self.replica_addresses();
        let Some(address) = addresses.get(i) else {
            return Ok(());
        };
        if let Some(replica) = self.replicas.get(i) {
            self.runtime.block_on(replica.flush_events());
        }
        // Every rank of the server counts.
        let ids: Vec<indexd::EndpointId> = self
            .endpoints
            .iter()
            .filter(|e| e.id.address.to_string() == *address)
            .map(|e| e.id.clone())
            .collect();
        let all: Vec<&RunningIndexd> = self.all_indexd().collect();
        wait_until("indexd ingests the replica's events", timeout, || {
            all.iter().all(|indexd| {
                let held: usize = ids
                    .iter()
                    .filter_map(|id| indexd.handle.replica(id))
                    .map(|s| s.entries)
                    .sum();
                held >= entries
            })
        })
    }
}

/// Polls `done` every 10 ms until it holds or `timeout` passes.
pub fn wait_until(
    what: &str,
    timeout: Duration,
    mut done: impl FnMut() -> bool,
) -> Result<(), HarnessError> {
    let started = Instant::now();
    while !done() {
        if started.elapsed() > timeout {
            return Err(HarnessError::NotReady {
                what: what.to_owned(),
                after: timeout,
                log: String::new(),
            });
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

fn mock_config(options: &StackOptions) -> mock_vllm::Config {
    let mut config = mock_vllm::Config {
        served_model_names: vec![options.model.clone()],
        lora_modules: options.adapters.clone(),
        block_size: options.block_size,
        num_gpu_blocks: options.num_gpu_blocks,
        default_max_tokens: options.default_max_tokens,
        chat_template: options.chat_template,
        reasoning_tokens: options.reasoning_tokens,
        // One hash seed for all replicas, as a fleet started with one
        // PYTHONHASHSEED would have; indexd must not depend on it either way.
        hash_seed: Some("kvroute-e2e".into()),
        data_parallel_size: options.data_parallel_size,
        max_model_len: options.max_model_len,
        ..mock_vllm::Config::default()
    };
    config.latency.time_scale = options.time_scale;
    config
}

/// A 2-thread runtime, its threads named `label` when given.
fn runtime(label: Option<&str>) -> Result<Runtime, HarnessError> {
    // KVROUTE_E2E_LOG=indexd=debug,mock_vllm=info shows the in-process
    // components' logs on stderr.
    if let Ok(filter) = std::env::var("KVROUTE_E2E_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .try_init();
    }
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(label) = label {
        builder.thread_name(label);
    }
    builder
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| HarnessError::io("tokio runtime", e))
}

/// One replica as indexd knows it; `events` is `(endpoint, indexd binds)`.
fn endpoint(
    options: &StackOptions,
    http: SocketAddr,
    events: Option<(String, bool)>,
    replay: Option<String>,
) -> indexd::EndpointConfig {
    let mut endpoint = indexd::EndpointConfig::new(http, options.model.clone());
    endpoint.adapters = options.adapters.clone();
    if let Some((events, bind)) = events {
        endpoint.events = Some(events);
        endpoint.events_bind = bind;
    }
    endpoint.replay = replay;
    endpoint.metrics_url = indexd::HttpUrl::parse(&format!("http://{http}/metrics"));
    endpoint
}

fn indexd_config(
    options: &StackOptions,
    endpoints: &[indexd::EndpointConfig],
    grpc: SocketAddr,
) -> indexd::Config {
    let mut config = indexd::Config::new(endpoints.to_vec());
    config.grpc_listen = grpc;
    config.http_listen = SocketAddr::from(([127, 0, 0, 1], 0));
    config.scrape_interval = Duration::from_millis(200);
    config.seed = Some(options.seed);
    if let Some(bs) = kvroute_proto::BlockSize::new(options.block_size) {
        config.block_size = bs;
    }
    config.tokenize.tokenizers = options.tokenizers.clone();
    config
}

fn start_indexd(
    runtime: &Runtime,
    config: indexd::Config,
) -> Result<(RunningIndexd, SocketAddr), HarnessError> {
    let bound = runtime
        .block_on(indexd::Server::bind(config))
        .map_err(|e| setup("indexd", e))?;
    let grpc = bound.grpc_addr();
    let http = bound.http_addr();
    let handle = bound.handle();
    let stop = CancellationToken::new();
    let task = runtime.spawn(bound.serve(stop.clone()));
    Ok((
        RunningIndexd {
            stop,
            task,
            handle,
            http,
        },
        grpc,
    ))
}

fn envoy_config(
    options: &StackOptions,
    replicas: &[SocketAddr],
    indexd: SocketAddr,
) -> Result<EnvoyConfig, HarnessError> {
    let route = cluster_route("vllm", Duration::from_secs(120));
    let mut clusters = vec![
        inference_cluster("vllm", replicas, OVERRIDE_HEADER),
        http_cluster("vllm_tokenizer", replicas),
    ];
    let filters = match options.routing {
        Routing::LeastRequest => vec![],
        Routing::Precise | Routing::Approximate => {
            clusters.push(grpc_cluster("kvroute_indexd", indexd));
            // Picks carry the request body and indexd tokenizes it (the
            // mock's `/tokenize`: no local tokenizer for the mock model).
            // `filter_overrides` may choose the two-call path instead:
            // {"tokenize_at": "cluster", "tokenizer_cluster": "vllm_tokenizer"}.
            let mut plugin = json!({
                "index_cluster": "kvroute_indexd",
                "block_size": options.block_size,
                "decision_header": DECISION_HEADER,
                "mode": if options.routing == Routing::Precise { "precise" } else { "approximate" },
            });
            if let (Some(plugin), Some(extra)) =
                (plugin.as_object_mut(), options.filter_overrides.as_object())
            {
                for (k, v) in extra {
                    plugin.insert(k.clone(), v.clone());
                }
            }
            kvroute_filters(&artifacts::filter_wasm()?, &plugin)
        }
    };
    let mut listener = http_listener(LISTENER, filters, vec![route]);
    listener["per_connection_buffer_limit_bytes"] = json!(options.buffer_limit_bytes);
    Ok(EnvoyConfig::new(vec![listener], clusters))
}
