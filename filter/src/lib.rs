//! kvroute's Proxy-Wasm filter for Envoy and Istio: routes each vLLM request
//! to the replica that holds its KV-cache prefix, and never hurts a request
//! (every failure continues with Envoy's own choice).
//!
//! A host-independent core, tested natively, under thin proxy-wasm glue:
//! - [`config`]: the plugin configuration, validated field by field.
//! - [`request`]: parsing completions, chat and responses bodies.
//! - [`tokenize`]: the tokenizer callout's body and answer.
//! - [`approximate`]: text-chunk keys for approximate mode.
//! - [`decision`]: the per-request state machine (the failure table of the README).
//! - [`observe`]: finding a Responses id in the first response chunks.
//! - [`memo`]: where conversations went, to keep them there while indexd
//!   cannot answer.
//! - [`breaker`]: the index and tokenizer circuit breakers in shared data.
//! - [`busy`]: the replicas indexd's latest answer called busy, which
//!   continuations ask about again.
//! - [`completed`]: completed picks waiting in shared data for a Pick to
//!   carry them.
//! - [`metrics`]: reason labels and metric names.
//! - [`host`]: the trait hiding proxy-wasm; `glue` implements it (wasm only)
//!   over [`abi`], the host calls with every status as a value.
#![deny(clippy::indexing_slicing)]
#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

pub mod abi;
pub mod approximate;
pub mod breaker;
pub mod busy;
pub mod completed;
pub mod config;
pub mod decision;
pub mod host;
pub mod memo;
pub mod metrics;
pub mod observe;
pub mod request;
pub mod tokenize;

#[cfg(test)]
mod fake;
#[cfg(target_arch = "wasm32")]
mod glue;
#[cfg(test)]
mod proptests;

pub use config::{Config, ConfigError};
pub use decision::{Action, Flow};
pub use metrics::Reason;
