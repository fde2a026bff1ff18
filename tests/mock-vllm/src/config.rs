//! Typed configuration of one mock replica, and the command line that builds it.
//!
//! [`Config`] is what [`crate::MockVllm::start`] takes; [`Cli`] (in `cli.rs`) is the clap surface
//! of the binary (flag names follow `vllm serve` where vLLM has one). [`Config::validate`] names
//! the offending field in its error.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use clap::ValueEnum;

pub use crate::error::ConfigError;
pub(crate) use crate::error::invalid;
use crate::latency::LatencyConfig;
use crate::layout::KvCacheLayout;

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
    /// Written as the third payload element (vLLM always sets it; 0 by default). With
    /// [`Config::data_parallel_size`] > 1 it must be 0: the server runs ranks `0..size`, and
    /// [`KvEventsConfig::for_rank`] derives each rank's endpoints and payload rank.
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

impl KvEventsConfig {
    /// The publisher config of the engine `index` places after this one (vLLM's convention: both
    /// ports + `index`, port 0 stays 0; payload rank + `index`). `for_rank(0)` is a copy.
    pub fn for_rank(&self, index: u32) -> Result<KvEventsConfig, ConfigError> {
        let mut ev = self.clone();
        ev.endpoint = offset_endpoint(self.endpoint.clone(), index)?;
        if let Some(addr) = &mut ev.replay {
            addr.set_port(offset_port(addr.port(), index)?);
        }
        ev.data_parallel_rank = self
            .data_parallel_rank
            .checked_add(index)
            .ok_or_else(|| invalid("data_parallel_size", "rank overflows u32"))?;
        Ok(ev)
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
    /// Physical KV blocks, shared by all KV cache groups: cached, free, or held by running
    /// requests (vLLM's `num_gpu_blocks` less its null block). Cached blocks are evicted LRU as
    /// blocks are needed.
    pub num_gpu_blocks: usize,
    pub enable_prefix_caching: bool,
    /// The model's KV cache groups in `group_idx` order (default: one full-attention group).
    pub kv_cache_layout: KvCacheLayout,
    /// vLLM's `prefix_cache_retention_interval` for sliding-window and Mamba groups: `Some(0)`
    /// (vLLM's default) keeps only the blocks a later request can resume at (the replay boundary
    /// and shared-prefix junctions); `Some(n)` also one checkpoint per `n` tokens (a multiple of
    /// `block_size`); `None` keeps them densely.
    pub prefix_cache_retention_interval: Option<u32>,
    /// vLLM's `max_num_batched_tokens`: prefill in steps of at most this many tokens, one event
    /// batch per step (vLLM 0.32 on CPU: 2,048). `None`: the whole prompt in one step.
    pub max_num_batched_tokens: Option<u32>,
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
    /// Engine ranks behind the one HTTP address (vLLM `--data-parallel-size`), each with its own
    /// prefix cache, prefill queue and KV-event publisher. 1 (the default) is one engine whose
    /// rank is `kv_events.data_parallel_rank`.
    pub data_parallel_size: u32,
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
            kv_cache_layout: KvCacheLayout::default(),
            prefix_cache_retention_interval: Some(0),
            max_num_batched_tokens: None,
            chat_template: ChatTemplate::RoleMarkers,
            default_max_tokens: 16,
            reasoning_tokens: 0,
            hash_seed: None,
            kv_events: Some(KvEventsConfig::default()),
            latency: LatencyConfig::default(),
            data_parallel_size: 1,
        }
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
        self.check_kv_cache()?;
        if let Some(ev) = &self.kv_events
            && ev.buffer_steps == 0
        {
            return Err(invalid("kv_events.buffer_steps", "must be positive"));
        }
        if self.data_parallel_size == 0 {
            return Err(invalid("data_parallel_size", "must be at least 1"));
        }
        if self.data_parallel_size > 1 && self.first_rank() != 0 {
            return Err(invalid(
                "data_parallel_size",
                format!(
                    "data_parallel_rank {} names a single-rank server; with data_parallel_size {} the server runs ranks 0..{}",
                    self.first_rank(),
                    self.data_parallel_size,
                    self.data_parallel_size
                ),
            ));
        }
        self.check_event_ports()?;
        self.latency.validate()
    }

    /// The pool must hold what one request of `max_model_len` tokens leaves cached in every group;
    /// the retention interval and the step budget must be usable (vLLM's rules).
    fn check_kv_cache(&self) -> Result<(), ConfigError> {
        let bs = self.block_size as usize;
        let layout = &self.kv_cache_layout;
        let thin = self.prefix_cache_retention_interval == Some(0);
        let needed = layout.max_cached_blocks(self.max_model_len as usize, bs, thin);
        if self.num_gpu_blocks < needed {
            return Err(invalid(
                "num_gpu_blocks",
                format!(
                    "{} blocks cannot hold max_model_len in the KV cache groups `{layout}` (needs {needed})",
                    self.num_gpu_blocks
                ),
            ));
        }
        match self.prefix_cache_retention_interval {
            None | Some(0) => {}
            Some(_) if !layout.has_sparse_group() => {
                return Err(invalid(
                    "prefix_cache_retention_interval",
                    format!(
                        "the KV cache groups `{layout}` have no sliding-window or Mamba group, so a retention interval has no effect; set it to 0"
                    ),
                ));
            }
            Some(n) if !n.is_multiple_of(self.block_size) => {
                return Err(invalid(
                    "prefix_cache_retention_interval",
                    format!("{n} is not a multiple of block_size {}", self.block_size),
                ));
            }
            Some(_) => {}
        }
        if self.max_num_batched_tokens == Some(0) {
            return Err(invalid("max_num_batched_tokens", "must be positive"));
        }
        Ok(())
    }

    /// Every rank's bound PUB and replay ports must differ (a fixed replay port one above the PUB
    /// port collides with rank 1's PUB port, as it would in vLLM).
    fn check_event_ports(&self) -> Result<(), ConfigError> {
        let Some(ev) = &self.kv_events else {
            return Ok(());
        };
        let mut seen: HashMap<SocketAddr, String> = HashMap::new();
        for index in 0..self.data_parallel_size {
            let ev = ev.for_rank(index)?;
            let rank = ev.data_parallel_rank;
            let pub_addr = match ev.endpoint {
                EventsEndpoint::Bind(addr) => Some(addr),
                EventsEndpoint::Connect(_) => None,
            };
            let socks = [(pub_addr, "PUB"), (ev.replay, "replay")];
            for (addr, what) in socks {
                let Some(addr) = addr.filter(|a| a.port() != 0) else {
                    continue;
                };
                let this = format!("rank {rank}'s {what} port {}", addr.port());
                if let Some(other) = seen.insert(addr, this.clone()) {
                    return Err(invalid(
                        "kv_events",
                        format!(
                            "{this} is also {other}; space the ports at least data_parallel_size apart"
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The data-parallel rank of the first engine (`kv_events.data_parallel_rank`, else 0).
    pub fn first_rank(&self) -> u32 {
        self.kv_events.as_ref().map_or(0, |e| e.data_parallel_rank)
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
pub(crate) fn offset_port(port: u16, rank: u32) -> Result<u16, ConfigError> {
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

pub(crate) fn offset_endpoint(
    ep: EventsEndpoint,
    rank: u32,
) -> Result<EventsEndpoint, ConfigError> {
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
        let c = Config {
            data_parallel_size: 0,
            ..Config::default()
        };
        assert_eq!(c.validate().unwrap_err().field, "data_parallel_size");
    }

    #[test]
    fn kv_cache_fields_are_checked() {
        let gemma = |f: fn(&mut Config)| {
            let mut c = Config {
                block_size: 64,
                kv_cache_layout: "sliding_window:256,full_attention".parse().unwrap(),
                ..Config::default()
            };
            f(&mut c);
            c.validate()
        };
        gemma(|_| {}).unwrap();
        gemma(|c| c.prefix_cache_retention_interval = Some(512)).unwrap();
        gemma(|c| c.prefix_cache_retention_interval = None).unwrap();
        let e = gemma(|c| c.prefix_cache_retention_interval = Some(100)).unwrap_err();
        assert_eq!(e.field, "prefix_cache_retention_interval");
        let e = gemma(|c| c.max_num_batched_tokens = Some(0)).unwrap_err();
        assert_eq!(e.field, "max_num_batched_tokens");
        // 32,768 tokens: 512 full-attention blocks plus two 4-block sliding tails.
        let e = gemma(|c| c.num_gpu_blocks = 519).unwrap_err();
        assert_eq!(e.field, "num_gpu_blocks");
        assert!(e.reason.contains("needs 520"), "{e}");
        let plain = Config {
            prefix_cache_retention_interval: Some(64),
            ..Config::default()
        };
        assert_eq!(
            plain.validate().unwrap_err().field,
            "prefix_cache_retention_interval"
        );
    }

    fn fixed_ports(pub_port: u16, replay_port: u16, size: u32) -> Config {
        Config {
            kv_events: Some(KvEventsConfig {
                endpoint: EventsEndpoint::Bind(loopback(pub_port)),
                replay: Some(loopback(replay_port)),
                ..KvEventsConfig::default()
            }),
            data_parallel_size: size,
            ..Config::default()
        }
    }

    #[test]
    fn ranks_offset_ports_and_payload_rank() {
        let c = fixed_ports(5557, 5567, 3);
        c.validate().unwrap();
        let ev = c.kv_events.unwrap().for_rank(2).unwrap();
        assert_eq!(ev.endpoint, EventsEndpoint::Bind(loopback(5559)));
        assert_eq!(ev.replay, Some(loopback(5569)));
        assert_eq!(ev.data_parallel_rank, 2);
        // Port 0 stays 0: every rank binds its own free port.
        let ev = KvEventsConfig::default().for_rank(5).unwrap();
        assert_eq!(ev.endpoint, EventsEndpoint::Bind(loopback(0)));
    }

    #[test]
    fn colliding_rank_ports_are_refused() {
        fixed_ports(5557, 5558, 1).validate().unwrap();
        let e = fixed_ports(5557, 5558, 2).validate().unwrap_err();
        assert_eq!(e.field, "kv_events");
        assert!(e.reason.contains("rank 1's PUB port 5558"), "{e}");
        let mut c = fixed_ports(5557, 5567, 2);
        if let Some(ev) = &mut c.kv_events {
            ev.data_parallel_rank = 1;
        }
        assert_eq!(c.validate().unwrap_err().field, "data_parallel_size");
    }
}
