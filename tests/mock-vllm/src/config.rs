//! Typed configuration of one mock replica, and the command line that builds it.
//!
//! [`Config`] is what [`crate::MockVllm::start`] takes; [`Cli`] is the clap surface of the binary
//! (flag names follow `vllm serve` where vLLM has one). [`Config::validate`] names the offending
//! field in its error.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use clap::{Parser, ValueEnum};
use serde::Deserialize;

use crate::latency::LatencyConfig;

/// Which chat template the replica renders with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum ChatTemplate {
    /// Role markers around every message; assistant reasoning always rendered (append-only).
    #[default]
    RoleMarkers,
    /// Like `role-markers`, but reasoning of assistant turns before the last user message is
    /// dropped, as Qwen3/DeepSeek-R1 templates do (not append-only).
    DropReasoning,
}

/// How events inside a batch are encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum EventEncoding {
    /// msgpack maps tagged by `"type"` (vLLM >= mid-2026, the captured 0.32 form).
    #[default]
    Tagged,
    /// Older vLLM: arrays, tag first (`["BlockStored", block_hashes, ...]`).
    Legacy,
}

/// How block hashes are written on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum HashForm {
    /// u64 (the last 8 bytes of the 32-byte hash, big-endian); vLLM's default.
    #[default]
    Int,
    /// The full 32-byte hash as msgpack bin (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
    Bytes,
}

/// Where the PUB socket goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventsEndpoint {
    /// Bind (the subscriber connects). Port 0 picks a free port.
    Bind(SocketAddr),
    /// Connect out to `tcp://host:port` (the subscriber binds).
    Connect(String),
}

/// KV-event publishing (vLLM `--kv-events-config`).
#[derive(Debug, Clone)]
pub struct KvEventsConfig {
    pub endpoint: EventsEndpoint,
    /// ROUTER replay socket; `None` disables replay.
    pub replay: Option<SocketAddr>,
    pub topic: String,
    /// Batches kept for replay (vLLM `buffer_steps`, default 10,000).
    pub buffer_steps: usize,
    pub encoding: EventEncoding,
    pub hash_form: HashForm,
    /// Written as the third payload element (vLLM always sets it; 0 by default).
    pub data_parallel_rank: u32,
    /// Leave the rank out of the payload (`[ts, events]`), as some vLLM revisions do.
    pub omit_data_parallel_rank: bool,
    /// Encode the batch as a map `{ts, events, data_parallel_rank}` (a vLLM revision declared
    /// the batch without `array_like`).
    pub batch_as_map: bool,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        Self {
            endpoint: EventsEndpoint::Bind(loopback(0)),
            replay: Some(loopback(0)),
            topic: String::new(),
            buffer_steps: 10_000,
            encoding: EventEncoding::Tagged,
            hash_form: HashForm::Int,
            data_parallel_rank: 0,
            omit_data_parallel_rank: false,
            batch_as_map: false,
        }
    }
}

/// Everything one replica needs.
#[derive(Debug, Clone)]
pub struct Config {
    /// Shown in the `x-mock-vllm-replica` header; defaults to the bound HTTP address.
    pub name: Option<String>,
    pub http_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    /// First one is the default model (and the `model_name` metric label).
    pub served_model_names: Vec<String>,
    /// LoRA adapter names; a request naming one hashes it into every block's extra keys.
    pub lora_modules: Vec<String>,
    pub max_model_len: u32,
    pub block_size: u32,
    /// Prefix-cache capacity in blocks (LRU beyond it).
    pub num_gpu_blocks: usize,
    pub enable_prefix_caching: bool,
    pub chat_template: ChatTemplate,
    /// Output tokens when a request sets no limit.
    pub default_max_tokens: u32,
    /// Chat and Responses outputs open with this many reasoning tokens inside `<think>…</think>`
    /// (returned as `reasoning_content`); 0 turns reasoning off.
    pub reasoning_tokens: u32,
    /// Seed of the root block hash (vLLM's `PYTHONHASHSEED`); random per start when `None`.
    pub hash_seed: Option<String>,
    pub kv_events: Option<KvEventsConfig>,
    pub latency: LatencyConfig,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            name: None,
            http_addr: loopback(0),
            admin_addr: loopback(0),
            served_model_names: vec!["mock-model".to_owned()],
            lora_modules: Vec::new(),
            max_model_len: 32_768,
            block_size: 16,
            num_gpu_blocks: 8_192,
            enable_prefix_caching: true,
            chat_template: ChatTemplate::RoleMarkers,
            default_max_tokens: 16,
            reasoning_tokens: 0,
            hash_seed: None,
            kv_events: Some(KvEventsConfig::default()),
            latency: LatencyConfig::default(),
        }
    }
}

/// A configuration that cannot run; the message names the field.
#[derive(Debug, thiserror::Error)]
#[error("invalid config `{field}`: {reason}")]
pub struct ConfigError {
    pub field: &'static str,
    pub reason: String,
}

fn invalid(field: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        field,
        reason: reason.into(),
    }
}

impl Config {
    /// Checks the invariants the replica relies on.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.served_model_names.is_empty() {
            return Err(invalid("served_model_names", "at least one name is needed"));
        }
        if self.served_model_names.iter().any(String::is_empty) {
            return Err(invalid("served_model_names", "names must not be empty"));
        }
        if self.lora_modules.iter().any(String::is_empty) {
            return Err(invalid("lora_modules", "adapter names must not be empty"));
        }
        if self.block_size == 0 {
            return Err(invalid("block_size", "must be positive"));
        }
        if self.max_model_len == 0 {
            return Err(invalid("max_model_len", "must be positive"));
        }
        let needed = (self.max_model_len as usize).div_ceil(self.block_size as usize);
        if self.num_gpu_blocks < needed {
            return Err(invalid(
                "num_gpu_blocks",
                format!(
                    "{} blocks cannot hold max_model_len (needs {needed})",
                    self.num_gpu_blocks
                ),
            ));
        }
        if let Some(ev) = &self.kv_events
            && ev.buffer_steps == 0
        {
            return Err(invalid("kv_events.buffer_steps", "must be positive"));
        }
        self.latency.validate()
    }

    /// All names a request's `model` may carry: served names, then LoRA adapters.
    pub fn model_names(&self) -> impl Iterator<Item = &str> {
        self.served_model_names
            .iter()
            .chain(self.lora_modules.iter())
            .map(String::as_str)
    }
}

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port)
}

/// Parses a ZMQ endpoint the way vLLM does: `*` (or `::`) binds, a host connects out.
/// `bind_host` replaces the `*` (loopback unless told otherwise).
pub fn parse_events_endpoint(
    endpoint: &str,
    bind_host: IpAddr,
) -> Result<EventsEndpoint, ConfigError> {
    let rest = endpoint.strip_prefix("tcp://").ok_or_else(|| {
        invalid(
            "kv_events.endpoint",
            format!("`{endpoint}`: only tcp:// is supported"),
        )
    })?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| invalid("kv_events.endpoint", format!("`{endpoint}`: missing port")))?;
    let port: u16 = port
        .parse()
        .map_err(|_| invalid("kv_events.endpoint", format!("`{endpoint}`: bad port")))?;
    if host == "*" || host.contains("::") {
        Ok(EventsEndpoint::Bind(SocketAddr::new(bind_host, port)))
    } else if host.is_empty() {
        Err(invalid(
            "kv_events.endpoint",
            format!("`{endpoint}`: missing host"),
        ))
    } else {
        Ok(EventsEndpoint::Connect(endpoint.to_owned()))
    }
}

/// A replay endpoint always binds; `*` becomes `bind_host`.
pub fn parse_replay_endpoint(endpoint: &str, bind_host: IpAddr) -> Result<SocketAddr, ConfigError> {
    match parse_events_endpoint(endpoint, bind_host)? {
        EventsEndpoint::Bind(addr) => Ok(addr),
        EventsEndpoint::Connect(_) => {
            let rest = endpoint.trim_start_matches("tcp://");
            rest.parse().map_err(|_| {
                invalid(
                    "kv_events.replay_endpoint",
                    format!("`{endpoint}`: needs `*` or an IP:port"),
                )
            })
        }
    }
}

/// vLLM's data-parallel convention: rank `r` publishes on the configured port + `r` (port 0 stays
/// 0: the OS picks).
fn offset_port(port: u16, rank: u32) -> Result<u16, ConfigError> {
    if port == 0 {
        return Ok(0);
    }
    u32::from(port)
        .checked_add(rank)
        .and_then(|p| u16::try_from(p).ok())
        .ok_or_else(|| {
            invalid(
                "data_parallel_rank",
                format!("port {port} + rank {rank} overflows"),
            )
        })
}

fn offset_endpoint(ep: EventsEndpoint, rank: u32) -> Result<EventsEndpoint, ConfigError> {
    Ok(match ep {
        EventsEndpoint::Bind(mut addr) => {
            addr.set_port(offset_port(addr.port(), rank)?);
            EventsEndpoint::Bind(addr)
        }
        EventsEndpoint::Connect(s) => match s
            .rsplit_once(':')
            .and_then(|(h, p)| Some((h, p.parse::<u16>().ok()?)))
        {
            Some((host, port)) => {
                EventsEndpoint::Connect(format!("{host}:{}", offset_port(port, rank)?))
            }
            None => EventsEndpoint::Connect(s),
        },
    })
}

/// vLLM's `--kv-events-config` JSON (the fields the mock uses; others are ignored).
#[derive(Debug, Deserialize)]
struct VllmKvEventsJson {
    #[serde(default)]
    enable_kv_cache_events: bool,
    #[serde(default)]
    endpoint: Option<String>,
    #[serde(default)]
    replay_endpoint: Option<String>,
    #[serde(default)]
    topic: Option<String>,
    #[serde(default)]
    buffer_steps: Option<usize>,
}

/// Command line of the `mock-vllm` binary.
#[derive(Debug, Parser)]
#[command(
    name = "mock-vllm",
    version,
    about = "A protocol-exact simulator of a vLLM replica"
)]
pub struct Cli {
    /// Address the HTTP API and admin API listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// HTTP API port (0 = any free port).
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// Admin (fault-control) API port (0 = any free port).
    #[arg(long, default_value_t = 0)]
    pub admin_port: u16,
    /// Replica name for the `x-mock-vllm-replica` header (default: the HTTP address).
    #[arg(long)]
    pub name: Option<String>,
    /// Model names this replica serves; the first is the default.
    #[arg(long, num_args = 1.., default_values_t = vec!["mock-model".to_owned()])]
    pub served_model_name: Vec<String>,
    /// LoRA adapters as `name=path` (the path is ignored).
    #[arg(long, num_args = 1..)]
    pub lora_modules: Vec<String>,
    #[arg(long, default_value_t = 32_768)]
    pub max_model_len: u32,
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// Prefix-cache capacity in blocks.
    #[arg(long, default_value_t = 8_192)]
    pub num_gpu_blocks: usize,
    /// Turn automatic prefix caching off.
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
    #[arg(long, value_enum, default_value_t = ChatTemplate::RoleMarkers)]
    pub chat_template: ChatTemplate,
    /// Output tokens when a request sets no limit.
    #[arg(long, default_value_t = 16)]
    pub default_max_tokens: u32,
    /// Reasoning tokens opening each chat/Responses output (0 = none).
    #[arg(long, default_value_t = 0)]
    pub reasoning_tokens: u32,
    /// Seed of the root block hash (random per start when unset).
    #[arg(long, env = "PYTHONHASHSEED")]
    pub hash_seed: Option<String>,
    /// vLLM's JSON form, e.g. '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558","topic":"kv@r1@m"}'.
    #[arg(long)]
    pub kv_events_config: Option<String>,
    /// PUB endpoint: `tcp://*:PORT` binds, `tcp://HOST:PORT` connects out.
    #[arg(long, default_value = "tcp://*:0")]
    pub kv_events_endpoint: String,
    /// ROUTER replay endpoint (`none` disables replay).
    #[arg(long, default_value = "tcp://*:0")]
    pub kv_events_replay_endpoint: String,
    #[arg(long, default_value = "")]
    pub kv_events_topic: String,
    #[arg(long, default_value_t = 10_000)]
    pub kv_events_buffer_steps: usize,
    /// Host that replaces `*` in bind endpoints.
    #[arg(long, default_value = "127.0.0.1")]
    pub kv_events_bind_host: IpAddr,
    #[arg(long, value_enum, default_value_t = EventEncoding::Tagged)]
    pub kv_events_encoding: EventEncoding,
    #[arg(long, value_enum, default_value_t = HashForm::Int)]
    pub kv_events_hash: HashForm,
    #[arg(long, default_value_t = 0)]
    pub data_parallel_rank: u32,
    /// Leave data_parallel_rank out of event batches.
    #[arg(long)]
    pub kv_events_omit_dp_rank: bool,
    /// Encode batches as maps `{ts, events, data_parallel_rank}`.
    #[arg(long)]
    pub kv_events_batch_map: bool,
    /// Disable KV events entirely.
    #[arg(long)]
    pub no_kv_events: bool,
    /// Fixed part of time to first token, in ms.
    #[arg(long, default_value_t = LatencyConfig::default().base_ms)]
    pub ttft_base_ms: f64,
    /// Prefill cost per uncached prompt token, in ms.
    #[arg(long, default_value_t = LatencyConfig::default().prefill_ms_per_token)]
    pub prefill_ms_per_token: f64,
    /// Decode time per output token after the first, in ms.
    #[arg(long, default_value_t = LatencyConfig::default().decode_ms_per_token)]
    pub decode_ms_per_token: f64,
    /// Multiplies every simulated duration (0.01 runs 100x faster; 0 never sleeps).
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
}

impl Cli {
    /// Builds and validates the replica config.
    pub fn into_config(self) -> Result<Config, ConfigError> {
        let bind_host = self.kv_events_bind_host;
        let lora_modules = self
            .lora_modules
            .iter()
            .map(|m| {
                m.split_once('=')
                    .map_or(m.as_str(), |(name, _)| name)
                    .to_owned()
            })
            .collect();
        let kv_events = if self.no_kv_events {
            None
        } else {
            let mut endpoint = self.kv_events_endpoint.clone();
            let mut replay = Some(self.kv_events_replay_endpoint.clone());
            let mut topic = self.kv_events_topic.clone();
            let mut buffer_steps = self.kv_events_buffer_steps;
            let mut enabled = true;
            if let Some(json) = &self.kv_events_config {
                let v: VllmKvEventsJson = serde_json::from_str(json)
                    .map_err(|e| invalid("kv_events_config", e.to_string()))?;
                enabled = v.enable_kv_cache_events;
                if let Some(e) = v.endpoint {
                    endpoint = e;
                }
                replay = v.replay_endpoint;
                topic = v.topic.unwrap_or(topic);
                buffer_steps = v.buffer_steps.unwrap_or(buffer_steps);
            }
            if enabled {
                let rank = self.data_parallel_rank;
                let replay = match replay.as_deref() {
                    None | Some("none") | Some("") => None,
                    Some(r) => {
                        let mut addr = parse_replay_endpoint(r, bind_host)?;
                        addr.set_port(offset_port(addr.port(), rank)?);
                        Some(addr)
                    }
                };
                Some(KvEventsConfig {
                    endpoint: offset_endpoint(parse_events_endpoint(&endpoint, bind_host)?, rank)?,
                    replay,
                    topic,
                    buffer_steps,
                    encoding: self.kv_events_encoding,
                    hash_form: self.kv_events_hash,
                    data_parallel_rank: self.data_parallel_rank,
                    omit_data_parallel_rank: self.kv_events_omit_dp_rank,
                    batch_as_map: self.kv_events_batch_map,
                })
            } else {
                None
            }
        };
        let config = Config {
            name: self.name,
            http_addr: SocketAddr::new(self.host, self.port),
            admin_addr: SocketAddr::new(self.host, self.admin_port),
            served_model_names: self.served_model_name,
            lora_modules,
            max_model_len: self.max_model_len,
            block_size: self.block_size,
            num_gpu_blocks: self.num_gpu_blocks,
            enable_prefix_caching: !self.no_enable_prefix_caching,
            chat_template: self.chat_template,
            default_max_tokens: self.default_max_tokens,
            reasoning_tokens: self.reasoning_tokens,
            hash_seed: self.hash_seed,
            kv_events,
            latency: LatencyConfig {
                base_ms: self.ttft_base_ms,
                prefill_ms_per_token: self.prefill_ms_per_token,
                decode_ms_per_token: self.decode_ms_per_token,
                time_scale: self.time_scale,
            },
        };
        config.validate()?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn star_binds_host_connects() {
        let lo = IpAddr::V4(Ipv4Addr::LOCALHOST);
        assert_eq!(
            parse_events_endpoint("tcp://*:5557", lo).unwrap(),
            EventsEndpoint::Bind("127.0.0.1:5557".parse().unwrap())
        );
        assert_eq!(
            parse_events_endpoint("tcp://indexd:5557", lo).unwrap(),
            EventsEndpoint::Connect("tcp://indexd:5557".to_owned())
        );
        assert!(parse_events_endpoint("ipc:///tmp/x", lo).is_err());
        assert!(parse_events_endpoint("tcp://*:x", lo).is_err());
    }

    #[test]
    fn cli_parses_vllm_json_and_lora() {
        let cli = Cli::try_parse_from([
            "mock-vllm",
            "--served-model-name",
            "a",
            "b",
            "--lora-modules",
            "sql=/x",
            "--kv-events-config",
            r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558","topic":"kv@r@m"}"#,
        ])
        .unwrap();
        let c = cli.into_config().unwrap();
        assert_eq!(c.served_model_names, ["a", "b"]);
        assert_eq!(c.lora_modules, ["sql"]);
        let ev = c.kv_events.unwrap();
        assert_eq!(ev.topic, "kv@r@m");
        assert_eq!(ev.replay, Some("127.0.0.1:5558".parse().unwrap()));
    }

    #[test]
    fn data_parallel_rank_offsets_ports_like_vllm() {
        let cli = Cli::try_parse_from([
            "mock-vllm",
            "--data-parallel-rank",
            "2",
            "--kv-events-endpoint",
            "tcp://*:5557",
            "--kv-events-replay-endpoint",
            "tcp://*:5558",
        ])
        .unwrap();
        let ev = cli.into_config().unwrap().kv_events.unwrap();
        assert_eq!(
            ev.endpoint,
            EventsEndpoint::Bind("127.0.0.1:5559".parse().unwrap())
        );
        assert_eq!(ev.replay, Some("127.0.0.1:5560".parse().unwrap()));
        assert_eq!(ev.data_parallel_rank, 2);
        let connect =
            offset_endpoint(EventsEndpoint::Connect("tcp://indexd:6000".into()), 1).unwrap();
        assert_eq!(connect, EventsEndpoint::Connect("tcp://indexd:6001".into()));
        assert_eq!(offset_port(0, 3).unwrap(), 0);
    }

    #[test]
    fn validation_names_the_field() {
        let c = Config {
            num_gpu_blocks: 1,
            ..Config::default()
        };
        assert_eq!(c.validate().unwrap_err().field, "num_gpu_blocks");
        let c = Config {
            served_model_names: vec![],
            ..Config::default()
        };
        assert_eq!(c.validate().unwrap_err().field, "served_model_names");
    }
}
