//! The `mock-vllm` command line ([`Cli`]) and how it builds a [`Config`].

use std::net::{IpAddr, SocketAddr};

use clap::Parser;
use serde::Deserialize;

use crate::config::{
    ChatTemplate, Config, ConfigError, EventEncoding, HashForm, KvEventsConfig, invalid,
    offset_endpoint, offset_port, parse_events_endpoint, parse_replay_endpoint,
};
use crate::groups::Retention;
use crate::latency::LatencyConfig;
use crate::layout::KvCacheLayout;

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
    /// Physical KV blocks shared by all KV cache groups (vLLM's num_gpu_blocks less its null
    /// block): cached, free or held by running requests.
    #[arg(long, default_value_t = 8_192)]
    pub num_gpu_blocks: usize,
    /// Turn automatic prefix caching off.
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
    /// KV cache groups in group_idx order: full_attention, sliding_window:W,
    /// chunked_local_attention:C, mamba; e.g. `sliding_window:128,full_attention` (gpt-oss).
    #[arg(long, visible_alias = "kv-layout", default_value = "full_attention")]
    pub kv_cache_layout: KvCacheLayout,
    /// Sliding-window and Mamba checkpoints kept every N tokens besides the resumable
    /// boundaries (0: only those, vLLM's default; `none`: every block).
    #[arg(long, default_value = "0")]
    pub prefix_cache_retention_interval: Retention,
    /// Prefill in steps of at most N tokens, one KV-event batch per step (vLLM on CPU: 2048).
    /// Unset: the whole prompt in one step.
    #[arg(long)]
    pub max_num_batched_tokens: Option<u32>,
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
    /// Data-parallel rank of a single-rank server (payload rank, `engine` metric label; both
    /// event ports + rank). Must stay 0 with `--data-parallel-size` > 1.
    #[arg(long, default_value_t = 0)]
    pub data_parallel_rank: u32,
    /// Engine ranks behind the one HTTP address, each with its own cache and KV-event publisher
    /// (rank r: both event ports + r; `x-data-parallel-rank: r` pins a request).
    #[arg(long, default_value_t = 1)]
    pub data_parallel_size: u32,
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
            kv_cache_layout: self.kv_cache_layout,
            prefix_cache_retention_interval: self.prefix_cache_retention_interval.0,
            max_num_batched_tokens: self.max_num_batched_tokens,
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
            data_parallel_size: self.data_parallel_size,
        };
        config.validate()?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EventsEndpoint;

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
    fn kv_cache_flags() {
        let parse = |args: &[&str]| Cli::try_parse_from(["mock-vllm"].iter().chain(args));
        let c = parse(&[]).unwrap().into_config().unwrap();
        assert_eq!(c.kv_cache_layout, KvCacheLayout::default());
        assert_eq!(c.prefix_cache_retention_interval, Some(0));
        assert_eq!(c.max_num_batched_tokens, None);
        let c = parse(&[
            "--block-size",
            "64",
            "--kv-layout",
            "sliding_window:256,full_attention",
            "--max-num-batched-tokens",
            "2048",
            "--prefix-cache-retention-interval",
            "none",
        ])
        .unwrap()
        .into_config()
        .unwrap();
        assert_eq!(
            c.kv_cache_layout.to_string(),
            "sliding_window:256,full_attention"
        );
        assert_eq!(c.max_num_batched_tokens, Some(2_048));
        assert_eq!(c.prefix_cache_retention_interval, None);
        let e = parse(&["--kv-cache-layout", "sliding_window"])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--kv-cache-layout") && e.contains("needs its window"),
            "{e}"
        );
        let e = parse(&["--kv-cache-layout", "linear_attention"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown KV cache group"), "{e}");
        assert!(parse(&["--prefix-cache-retention-interval", "x"]).is_err());
        let e = parse(&["--prefix-cache-retention-interval", "64"])
            .unwrap()
            .into_config()
            .unwrap_err();
        assert_eq!(e.field, "prefix_cache_retention_interval");
    }

    #[test]
    fn data_parallel_size_flag() {
        let parse = |args: &[&str]| {
            Cli::try_parse_from(["mock-vllm"].iter().chain(args))
                .unwrap()
                .into_config()
        };
        assert_eq!(parse(&[]).unwrap().data_parallel_size, 1);
        let c = parse(&[
            "--data-parallel-size",
            "2",
            "--kv-events-endpoint",
            "tcp://*:5557",
            "--kv-events-replay-endpoint",
            "tcp://*:5567",
        ])
        .unwrap();
        assert_eq!(c.data_parallel_size, 2);
        let ev = c.kv_events.unwrap();
        assert_eq!(
            ev.endpoint,
            EventsEndpoint::Bind("127.0.0.1:5557".parse().unwrap()),
            "the config holds rank 0's ports"
        );
        let e = parse(&["--data-parallel-size", "2", "--data-parallel-rank", "1"]).unwrap_err();
        assert_eq!(e.field, "data_parallel_size");
        assert!(parse(&["--data-parallel-size", "0"]).is_err());
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
}
