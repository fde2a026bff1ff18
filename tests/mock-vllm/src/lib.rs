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
//! - [`layout`]: the KV cache groups of the simulated model ([`KvCacheLayout`]: full attention,
//!   sliding window, chunked local attention, Mamba).
//! - [`cache`]: vLLM-like chained block hashes; per-group residency in the block pool.
//! - [`pool`]: vLLM's block pool: physical blocks with reference counts, several copies of one
//!   hash, lazy LRU eviction as blocks are handed out again.
//! - [`groups`]: each kind of group's hit rule and which blocks it keeps (vLLM's single-type
//!   managers); [`coordinator`]: the hit over all groups (vLLM's fixed point) and what a step
//!   allocates, caches and announces, per group; [`table`]: the blocks a running request holds
//!   per group; `schedule`: prefill steps (chunked prefill, Mamba's block-aligned split).
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
pub mod coordinator;
mod engine;
mod error;
pub mod events;
mod generate;
pub mod groups;
pub mod latency;
pub mod layout;
mod messages;
mod metrics;
mod openai;
pub mod pool;
pub mod publisher;
mod rank;
mod responses;
mod runner;
mod schedule;
pub mod server;
pub mod table;
pub mod template;
pub mod tokenizer;

pub use api::{PROMPT_DIGEST_HEADER, RANK_HEADER, REPLICA_HEADER, prompt_digest};
pub use cache::{BlockHash, PrefixCache};
pub use cli::Cli;
pub use config::{ChatTemplate, Config, EventEncoding, EventsEndpoint, HashForm, KvEventsConfig};
pub use engine::DP_RANK_HEADER;
pub use error::ApiError;
pub use events::KvEvent;
pub use latency::LatencyConfig;
pub use layout::{KvCacheLayout, KvCacheSpec, LayoutError};
pub use server::{BoundAddresses, Handle, MockVllm, RankAddresses, StartError};
pub use tokenizer::Tokenizer;
