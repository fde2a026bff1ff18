//! mock-vllm: a protocol-exact, compute-simple simulator of one vLLM server: one replica, or
//! several data-parallel engine ranks behind one HTTP address.
//!
//! What the router can see is byte-exact with vLLM 0.32 (HTTP shapes, tokenizer endpoints, KV
//! events and replay); what it cannot see (the model) is simulated cheaply:
//!
//! - [`config`]: typed [`Config`] and the binary's clap [`Cli`].
//! - [`tokenizer`]: deterministic stand-in tokenizer (vocab 32,000, BOS 1).
//! - [`template`]: chat templates (role markers; a variant dropping earlier reasoning) and the
//!   Responses rendering with its second BOS.
//! - [`cache`]: vLLM-like chained block hashes, full-block hits, LRU capacity.
//! - [`events`]: the KV-event msgpack wire format (tagged maps or legacy arrays; u64 or bin hashes).
//! - [`publisher`]: ZMQ PUB plus ROUTER replay with a bounded buffer and fault controls.
//! - [`latency`]: the TTFT/decode model and the per-replica prefill queue.
//! - `engine`: the server (model names, limits, Responses store) and request-to-rank assignment;
//!   `rank`: one data-parallel rank's engine (cache, prefill queue, publisher, metrics).
//! - `runner`, `generate`: one request's life (prefill, decode, events, output text).
//! - `api`, `openai`, `responses`, `metrics`: the HTTP routes; `admin`: fault controls and the
//!   oracle probe; `cli`: the binary's flags.
//! - [`server`]: [`MockVllm::start`] and the [`Handle`] that owns a running replica.

mod admin;
mod api;
pub mod cache;
mod cli;
pub mod config;
mod engine;
mod error;
pub mod events;
mod generate;
pub mod latency;
mod metrics;
mod openai;
pub mod publisher;
mod rank;
mod responses;
mod runner;
pub mod server;
pub mod template;
pub mod tokenizer;

pub use api::{PROMPT_DIGEST_HEADER, RANK_HEADER, REPLICA_HEADER, prompt_digest};
pub use cache::{BlockHash, PrefixCache};
pub use config::{
    ChatTemplate, Cli, Config, EventEncoding, EventsEndpoint, HashForm, KvEventsConfig,
};
pub use engine::DP_RANK_HEADER;
pub use error::ApiError;
pub use events::KvEvent;
pub use latency::LatencyConfig;
pub use server::{BoundAddresses, Handle, MockVllm, RankAddresses, StartError};
pub use tokenizer::Tokenizer;
