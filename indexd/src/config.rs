//! Typed configuration, valid by construction.
//!
//! [`Config`] is built in code ([`Config::new`] plus public fields that are
//! already typed) or parsed from YAML ([`Config::from_yaml`]); either way
//! [`Config::validate`] has run before indexd starts, and every error names
//! the field. Durations in YAML are strings with a unit (`250ms`, `5s`, `2m`,
//! `1h`) or plain numbers of seconds.
//!
//! ```yaml
//! grpc_listen: unix:///run/kvroute/indexd.sock   # or ip:port (default 127.0.0.1:50071)
//! http_listen: 127.0.0.1:9471
//! http_idle_timeout: 60s            # and http_header_read_timeout, http_body_read_timeout,
//!                                   # http_max_connections (see `http`)
//! block_size: 64
//! scrape_interval: 1s
//! speculative_ttl: 5s
//! endpoints:
//!   - address: 10.0.0.7:8000          # as Envoy knows the host (host:port: see
//!                                     # `from_file_with`)
//!     data_parallel_rank: 0           # optional
//!     model: llama-3-8b               # served model name
//!     adapters: [my-lora]             # optional LoRA adapters served
//!     events: tcp://10.0.0.7:5557     # indexd connects (events_bind: true → indexd binds)
//!     replay: tcp://10.0.0.7:5558
//!     metrics_url: http://10.0.0.7:8000/metrics
//!     capacity_url: http://10.0.0.7:9000/capacity   # optional
//! discovery_file: /etc/kvroute/endpoints.yaml        # optional, same `endpoints:` format
//! kubernetes: {service: vllm, model: llama}         # or watch the cluster (not with discovery_file)
//! ```
//!
//! Pieces with their own module: [`endpoint`] (endpoints and the discovery
//! file), [`kubernetes`] (Kubernetes discovery), [`http`] (the HTTP server's
//! timeouts and connection limit), [`access`] (the token, listeners beyond loopback, the Observe
//! rate), [`tokenize`] (the `tokenize:` section).

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kvroute_proto::keys::BlockSize;
use serde::Deserialize;

use crate::error::ConfigError;
use crate::listen::ListenAddr;
use crate::wire::Limits;

pub mod access;
pub mod endpoint;
pub mod http;
pub mod kubernetes;
pub mod snapshot;
pub mod tokenize;
pub mod weights;

pub use access::AccessConfig;
use endpoint::RawEndpoint;
pub use endpoint::{
    EndpointConfig, EndpointId, HttpUrl, NoResolve, Resolve, SystemResolve, parse_discovery,
    parse_endpoint, parse_endpoint_with, validate_endpoints,
};
pub use http::HttpServerConfig;
pub use kubernetes::KubernetesConfig;
pub use snapshot::SnapshotConfig;
pub use weights::Weights;

/// The whole daemon's configuration.
#[derive(Clone, Debug)]
pub struct Config {
    /// gRPC listen address: TCP (loopback by default; port 0 picks one) or
    /// a Unix domain socket.
    pub grpc_listen: ListenAddr,
    /// HTTP (`/metrics`, `/healthz`, `/readyz`) listen address.
    pub http_listen: SocketAddr,
    /// The HTTP server's timeouts and connection limit.
    pub http: HttpServerConfig,
    /// The block size the filter computes keys with (vLLM's `--block-size`).
    pub block_size: BlockSize,
    /// Static endpoints.
    pub endpoints: Vec<EndpointConfig>,
    /// A YAML file with an `endpoints:` list, polled for changes.
    pub discovery_file: Option<PathBuf>,
    /// How often the discovery file is checked.
    pub discovery_interval: Duration,
    /// Endpoints from a Kubernetes watch (not with `discovery_file`).
    pub kubernetes: Option<KubernetesConfig>,
    /// How often each replica's /metrics is scraped.
    pub scrape_interval: Duration,
    /// Timeout of one scrape.
    pub scrape_timeout: Duration,
    /// Consecutive failed scrapes before a replica is unhealthy.
    pub unhealthy_after: NonZeroU32,
    /// How long a picked replica is credited with the request's keys.
    pub speculative_ttl: Duration,
    /// How long a pick counts as in flight when no scrape has seen it.
    pub pending_pick_ttl: Duration,
    /// A replica without a new conversation for this long, while others of
    /// its model get them, takes the next one its speed estimate alone keeps
    /// from it (0: never).
    pub starve_after: Duration,
    /// A replica that joins its model's running fleet takes new
    /// conversations only, no moved ones, for this long (0: no warm-up).
    pub join_warmup: Duration,
    /// A conversation that changed replica (moved, or re-homed from one that
    /// left) is not moved again for this long.
    pub move_cooldown: Duration,
    /// How long a replay may take before it counts as incomplete.
    pub replay_timeout: Duration,
    /// Upper bound on the reconnect backoff of a subscription.
    pub max_backoff: Duration,
    /// Response-id affinity: entries and TTL.
    pub affinity_capacity: usize,
    /// See `affinity_capacity`.
    pub affinity_ttl: Duration,
    /// Approximate mode: learned `(key, replica)` entries and their TTL.
    pub approximate_capacity: usize,
    /// See `approximate_capacity`.
    pub approximate_ttl: Duration,
    /// Hard bound on indexed `(block, replica)` entries.
    pub max_index_entries: usize,
    /// Hard bound on speculative `(key, replica)` entries.
    pub max_speculative_entries: usize,
    /// Most keys accepted in one Pick.
    pub max_pick_keys: usize,
    /// Candidates returned when the request does not say (0: all).
    pub max_candidates: u32,
    /// How much nicer than the process the ingest threads run (0–19; Linux).
    /// Off by default: an ingest thread holds the index's write lock for most
    /// of its work, and a nicer holder is preempted for longer while a Pick
    /// waits on it (measured: no gain in the soak on 2 CPUs).
    pub ingest_nice: u8,
    /// The CPUs the ingest runtime runs on, one worker thread each (a
    /// cpuset list, or `last` / `last:N` of the process's own CPUs); the
    /// binary keeps every other thread (the request path) off them (Linux;
    /// [`crate::cpus`]). None (the default): ingest gets one worker thread
    /// less than the CPUs and the scheduler places everything.
    pub ingest_cpus: Option<crate::cpus::CpuSpec>,
    /// Decoder caps.
    pub limits: Limits,
    /// Cost-model weights.
    pub weights: Weights,
    /// Seed of the tie-breaking RNG (None: from entropy).
    pub seed: Option<u64>,
    /// Index snapshots (restart without a full replay).
    pub snapshot: SnapshotConfig,
    /// Tokenization: local tokenizers, the replica fallback, the gate.
    pub tokenize: tokenize::TokenizeConfig,
    /// Who may call: the token, listeners beyond loopback, Observe's rate.
    pub access: AccessConfig,
    /// Per served model, the chunk of its chunked local attention in tokens
    /// (Llama 4: its config's `attention_chunk_size`, 8,192). vLLM's KV
    /// events name a `chunked_local_attention` group but not its chunk:
    /// without this such a model's hits are estimated from its other groups
    /// and answered approximate.
    pub attention_chunk_size: std::collections::BTreeMap<String, u32>,
}

impl Config {
    /// Defaults with the given endpoints.
    pub fn new(endpoints: Vec<EndpointConfig>) -> Self {
        Self {
            grpc_listen: ListenAddr::Tcp(SocketAddr::from(([127, 0, 0, 1], 50071))),
            http_listen: SocketAddr::from(([127, 0, 0, 1], 9471)),
            http: HttpServerConfig::default(),
            block_size: DEFAULT_BLOCK_SIZE,
            endpoints,
            discovery_file: None,
            discovery_interval: Duration::from_secs(2),
            kubernetes: None,
            scrape_interval: Duration::from_secs(1),
            scrape_timeout: Duration::from_millis(800),
            unhealthy_after: NonZeroU32::MIN.saturating_add(1),
            speculative_ttl: Duration::from_secs(5),
            pending_pick_ttl: Duration::from_secs(5),
            starve_after: Duration::from_secs(5),
            join_warmup: Duration::from_secs(60),
            move_cooldown: Duration::from_secs(60),
            replay_timeout: Duration::from_secs(3),
            max_backoff: Duration::from_secs(5),
            affinity_capacity: 100_000,
            affinity_ttl: Duration::from_secs(3600),
            approximate_capacity: 1_000_000,
            approximate_ttl: Duration::from_secs(600),
            max_index_entries: 8_000_000,
            max_speculative_entries: 1_000_000,
            max_pick_keys: 65_536,
            max_candidates: 0,
            ingest_nice: 0,
            ingest_cpus: None,
            limits: Limits::default(),
            weights: Weights::default(),
            seed: None,
            snapshot: SnapshotConfig::default(),
            tokenize: tokenize::TokenizeConfig::default(),
            access: AccessConfig::default(),
            attention_chunk_size: std::collections::BTreeMap::new(),
        }
    }

    /// The chunked-local attention chunk of `model`'s replicas, if set.
    pub fn chunk_tokens(&self, model: &str) -> Option<u32> {
        self.attention_chunk_size.get(model).copied()
    }

    /// Parses YAML and validates it (endpoint addresses as `ip:port`).
    pub fn from_yaml(text: &str) -> Result<Self, ConfigError> {
        Self::from_yaml_with(text, &NoResolve)
    }

    /// Parses YAML and validates it; an endpoint `address` given as
    /// `host:port` is resolved by `resolve` to its one address (IPv4 first),
    /// once, now.
    pub fn from_yaml_with(text: &str, resolve: &dyn Resolve) -> Result<Self, ConfigError> {
        let raw: RawConfig =
            serde_yaml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        raw.into_config(resolve)
    }

    /// Reads and parses a YAML file (endpoint addresses as `ip:port`).
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        Self::from_file_with(path, &NoResolve)
    }

    /// Reads and parses a YAML file, resolving host names in endpoint
    /// addresses like [`Config::from_yaml_with`].
    pub fn from_file_with(path: &Path, resolve: &dyn Resolve) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        Self::from_yaml_with(&text, resolve)
    }

    /// Checks the invariants the types cannot express.
    pub fn validate(&self) -> Result<(), ConfigError> {
        validate_endpoints(&self.endpoints, "endpoints")?;
        refuse_own_listener(&self.endpoints, self.http_listen, "endpoints")?;
        if let Some(k) = &self.kubernetes {
            if self.discovery_file.is_some() {
                return Err(ConfigError::field(
                    "kubernetes",
                    "discovery_file is set too: use one source of discovered endpoints",
                ));
            }
            k.validate()?;
        }
        let positive = [
            ("scrape_interval", self.scrape_interval),
            ("scrape_timeout", self.scrape_timeout),
            ("replay_timeout", self.replay_timeout),
            ("discovery_interval", self.discovery_interval),
            ("max_backoff", self.max_backoff),
        ];
        for (field, d) in positive {
            if d.is_zero() {
                return Err(ConfigError::field(field, "must be positive"));
            }
        }
        if self.max_index_entries == 0 {
            return Err(ConfigError::field("max_index_entries", "must be positive"));
        }
        if self.ingest_nice > 19 {
            return Err(ConfigError::field("ingest_nice", "must be 0 to 19"));
        }
        for (model, chunk) in &self.attention_chunk_size {
            if *chunk == 0 || !chunk.is_multiple_of(self.block_size.get()) {
                return Err(ConfigError::field(
                    "attention_chunk_size",
                    format!(
                        "{model}: {chunk} is not a positive multiple of block_size {}",
                        self.block_size.get()
                    ),
                ));
            }
        }
        let l = &self.limits;
        if l.max_frame_bytes == 0 {
            return Err(ConfigError::field("max_frame_bytes", "must be positive"));
        }
        if l.max_message_bytes < l.max_frame_bytes {
            return Err(ConfigError::field(
                "max_message_bytes",
                format!("must be at least max_frame_bytes ({})", l.max_frame_bytes),
            ));
        }
        if l.max_publisher_connections == 0 {
            return Err(ConfigError::field(
                "max_publisher_connections",
                "must be positive",
            ));
        }
        self.weights.validate()?;
        let s = &self.snapshot;
        for (field, d) in [
            ("snapshot_interval", s.interval),
            ("max_snapshot_write_time", s.max_write_time),
        ] {
            if d.is_zero() {
                return Err(ConfigError::field(field, "must be positive"));
            }
        }
        if s.max_bytes < 64 {
            return Err(ConfigError::field(
                "max_snapshot_bytes",
                "must be at least 64",
            ));
        }
        http::validate(&self.http)?;
        tokenize::validate(&self.tokenize)?;
        access::validate(self)?;
        Ok(())
    }
}

/// Refuses an endpoint whose address is indexd's own HTTP listener
/// (`http_listen`, or the address it was bound to): a tokenize request
/// forwarded to that "replica" would come back to indexd, and again
/// ([`crate::listen::reaches`] says what is caught).
pub fn refuse_own_listener(
    endpoints: &[EndpointConfig],
    http_listen: SocketAddr,
    field: &str,
) -> Result<(), ConfigError> {
    for (i, ep) in endpoints.iter().enumerate() {
        if crate::listen::reaches(http_listen, ep.id.address, &crate::listen::is_local_ip) {
            return Err(ConfigError::field(
                format!("{field}[{i}].address"),
                format!(
                    "endpoint {} is indexd's own HTTP listener (http_listen {http_listen}): \
                     tokenize requests forwarded to it would loop back to indexd; name the \
                     replica's own address",
                    ep.id
                ),
            ));
        }
    }
    Ok(())
}

/// vLLM's usual `--block-size` on CPU and the design's default.
// Evaluated at compile time: a zero here would fail the build, not panic.
#[allow(clippy::panic)]
pub const DEFAULT_BLOCK_SIZE: BlockSize = match BlockSize::new(64) {
    Some(b) => b,
    None => panic!("64 is non-zero"),
};

/// Parses a duration: `250ms`, `5s`, `2m`, `1h`, or a number of seconds.
pub fn parse_duration(text: &str) -> Option<Duration> {
    let t = text.trim();
    let (num, scale) = if let Some(n) = t.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = t.strip_suffix('m') {
        (n, 60.0)
    } else if let Some(n) = t.strip_suffix('h') {
        (n, 3600.0)
    } else {
        (t, 1.0)
    };
    let value: f64 = num.trim().parse().ok()?;
    Duration::try_from_secs_f64(value * scale).ok()
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum RawDuration {
    Secs(f64),
    Text(String),
}

/// `ingest_cpus`: one CPU number, a cpuset list (`"2-3,6"`), `last[:N]`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum RawCpus {
    One(u64),
    List(String),
}

pub(crate) fn duration(
    field: &str,
    raw: Option<RawDuration>,
    default: Duration,
) -> Result<Duration, ConfigError> {
    match raw {
        None => Ok(default),
        Some(RawDuration::Secs(s)) => Duration::try_from_secs_f64(s)
            .map_err(|_| ConfigError::field(field, "not a valid duration")),
        Some(RawDuration::Text(t)) => parse_duration(&t).ok_or_else(|| {
            ConfigError::field(field, format!("{t:?} is not a duration (e.g. 500ms, 5s)"))
        }),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    grpc_listen: Option<String>,
    http_listen: Option<String>,
    http_header_read_timeout: Option<RawDuration>,
    http_body_read_timeout: Option<RawDuration>,
    http_idle_timeout: Option<RawDuration>,
    http_max_connections: Option<usize>,
    block_size: Option<u32>,
    #[serde(default)]
    endpoints: Vec<RawEndpoint>,
    discovery_file: Option<PathBuf>,
    discovery_interval: Option<RawDuration>,
    kubernetes: Option<kubernetes::RawKubernetes>,
    scrape_interval: Option<RawDuration>,
    scrape_timeout: Option<RawDuration>,
    unhealthy_after: Option<u32>,
    speculative_ttl: Option<RawDuration>,
    pending_pick_ttl: Option<RawDuration>,
    starve_after: Option<RawDuration>,
    join_warmup: Option<RawDuration>,
    move_cooldown: Option<RawDuration>,
    replay_timeout: Option<RawDuration>,
    max_backoff: Option<RawDuration>,
    affinity_capacity: Option<usize>,
    affinity_ttl: Option<RawDuration>,
    approximate_capacity: Option<usize>,
    approximate_ttl: Option<RawDuration>,
    max_index_entries: Option<usize>,
    max_speculative_entries: Option<usize>,
    max_pick_keys: Option<usize>,
    max_candidates: Option<u32>,
    ingest_nice: Option<u8>,
    ingest_cpus: Option<RawCpus>,
    max_frame_bytes: Option<usize>,
    max_events_per_batch: Option<usize>,
    max_blocks_per_event: Option<usize>,
    max_tokens_per_event: Option<usize>,
    max_message_bytes: Option<usize>,
    max_publisher_connections: Option<usize>,
    weights: Option<Weights>,
    seed: Option<u64>,
    snapshot_path: Option<PathBuf>,
    snapshot_interval: Option<RawDuration>,
    max_snapshot_bytes: Option<u64>,
    max_snapshot_age: Option<RawDuration>,
    max_snapshot_write_time: Option<RawDuration>,
    tokenize: Option<tokenize::RawTokenize>,
    auth_token_file: Option<PathBuf>,
    allow_unauthenticated: Option<bool>,
    observe_rate: Option<u32>,
    observe_burst: Option<u32>,
    #[serde(default)]
    attention_chunk_size: std::collections::BTreeMap<String, u32>,
}

impl RawConfig {
    fn into_config(self, resolve: &dyn Resolve) -> Result<Config, ConfigError> {
        let mut c = Config::new(Vec::new());
        let addr =
            |field: &str, v: Option<String>, d: SocketAddr| -> Result<SocketAddr, ConfigError> {
                v.map_or(Ok(d), |s| {
                    s.parse()
                        .map_err(|_| ConfigError::field(field, format!("{s:?} is not ip:port")))
                })
            };
        if let Some(s) = self.grpc_listen {
            c.grpc_listen = s
                .parse()
                .map_err(|e: crate::listen::ParseListenAddrError| {
                    ConfigError::field("grpc_listen", e.to_string())
                })?;
        }
        c.http_listen = addr("http_listen", self.http_listen, c.http_listen)?;
        c.http = http::RawHttpServer {
            header_read_timeout: self.http_header_read_timeout,
            body_read_timeout: self.http_body_read_timeout,
            idle_timeout: self.http_idle_timeout,
            max_connections: self.http_max_connections,
        }
        .into_config()?;
        if let Some(bs) = self.block_size {
            c.block_size = BlockSize::new(bs)
                .ok_or_else(|| ConfigError::field("block_size", "must be positive"))?;
        }
        c.endpoints = self
            .endpoints
            .into_iter()
            .enumerate()
            .map(|(i, e)| e.into_endpoint(&format!("endpoints[{i}]"), resolve))
            .collect::<Result<_, _>>()?;
        c.discovery_file = self.discovery_file;
        c.discovery_interval = duration(
            "discovery_interval",
            self.discovery_interval,
            c.discovery_interval,
        )?;
        c.kubernetes = self
            .kubernetes
            .map(kubernetes::RawKubernetes::into_config)
            .transpose()?;
        c.scrape_interval = duration("scrape_interval", self.scrape_interval, c.scrape_interval)?;
        c.scrape_timeout = duration("scrape_timeout", self.scrape_timeout, c.scrape_timeout)?;
        if let Some(n) = self.unhealthy_after {
            c.unhealthy_after = NonZeroU32::new(n)
                .ok_or_else(|| ConfigError::field("unhealthy_after", "must be positive"))?;
        }
        c.speculative_ttl = duration("speculative_ttl", self.speculative_ttl, c.speculative_ttl)?;
        c.pending_pick_ttl = duration(
            "pending_pick_ttl",
            self.pending_pick_ttl,
            c.pending_pick_ttl,
        )?;
        c.starve_after = duration("starve_after", self.starve_after, c.starve_after)?;
        c.join_warmup = duration("join_warmup", self.join_warmup, c.join_warmup)?;
        c.move_cooldown = duration("move_cooldown", self.move_cooldown, c.move_cooldown)?;
        c.replay_timeout = duration("replay_timeout", self.replay_timeout, c.replay_timeout)?;
        c.max_backoff = duration("max_backoff", self.max_backoff, c.max_backoff)?;
        c.affinity_capacity = self.affinity_capacity.unwrap_or(c.affinity_capacity);
        c.affinity_ttl = duration("affinity_ttl", self.affinity_ttl, c.affinity_ttl)?;
        c.approximate_capacity = self.approximate_capacity.unwrap_or(c.approximate_capacity);
        c.approximate_ttl = duration("approximate_ttl", self.approximate_ttl, c.approximate_ttl)?;
        c.max_index_entries = self.max_index_entries.unwrap_or(c.max_index_entries);
        c.max_speculative_entries = self
            .max_speculative_entries
            .unwrap_or(c.max_speculative_entries);
        c.max_pick_keys = self.max_pick_keys.unwrap_or(c.max_pick_keys);
        c.max_candidates = self.max_candidates.unwrap_or(c.max_candidates);
        c.ingest_nice = self.ingest_nice.unwrap_or(c.ingest_nice);
        c.ingest_cpus = match self.ingest_cpus {
            None => None,
            Some(RawCpus::One(n)) => Some(n.to_string()),
            Some(RawCpus::List(t)) => Some(t),
        }
        .map(|t| {
            t.parse().map_err(|e| {
                ConfigError::field(
                    "ingest_cpus",
                    format!("{t:?}: {e} (e.g. 1, '2-3', last, 'last:2')"),
                )
            })
        })
        .transpose()?;
        let l = &mut c.limits;
        l.max_frame_bytes = self.max_frame_bytes.unwrap_or(l.max_frame_bytes);
        l.max_events_per_batch = self.max_events_per_batch.unwrap_or(l.max_events_per_batch);
        l.max_blocks_per_event = self.max_blocks_per_event.unwrap_or(l.max_blocks_per_event);
        l.max_tokens_per_event = self.max_tokens_per_event.unwrap_or(l.max_tokens_per_event);
        l.max_message_bytes = self.max_message_bytes.unwrap_or(l.max_message_bytes);
        l.max_publisher_connections = self
            .max_publisher_connections
            .unwrap_or(l.max_publisher_connections);
        if let Some(w) = self.weights {
            c.weights = w;
        }
        c.seed = self.seed;
        let s = &mut c.snapshot;
        s.path = self.snapshot_path;
        s.interval = duration("snapshot_interval", self.snapshot_interval, s.interval)?;
        s.max_bytes = self.max_snapshot_bytes.unwrap_or(s.max_bytes);
        s.max_age = duration("max_snapshot_age", self.max_snapshot_age, s.max_age)?;
        s.max_write_time = duration(
            "max_snapshot_write_time",
            self.max_snapshot_write_time,
            s.max_write_time,
        )?;
        if let Some(t) = self.tokenize {
            c.tokenize = t.into_config()?;
        }
        c.attention_chunk_size = self.attention_chunk_size;
        c.access = access::RawAccess {
            auth_token_file: self.auth_token_file,
            allow_unauthenticated: self.allow_unauthenticated,
            observe_rate: self.observe_rate,
            observe_burst: self.observe_burst,
        }
        .into_config()?;
        c.validate()?;
        Ok(c)
    }
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
