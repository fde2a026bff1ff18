//! The end-to-end harness: real processes on loopback, torn down with the test.
//!
//! - [`process`]: [`Spawned`] children in their own process group, logging to
//!   files, killed on drop (and when the test process dies), with their logs
//!   printed when the test that owns them fails.
//! - [`envoy`]: [`Envoy`] 1.40 from the project venv, started on port 0 with a
//!   dynamic `--base-id`, ready when its admin endpoint says `LIVE`; the
//!   listener ports are read back from the admin API, so nothing races for a
//!   port.
//! - [`artifacts`]: where the built filter and binaries are.
//! - [`http`]: a small blocking HTTP client for tests.
//! - [`client`]: OpenAI-style requests and their usage.
//! - [`proxy`]: a TCP relay that can slow a link down (indexd made slow).
//! - [`stack`]: a whole deployment (mock replicas, indexd, Envoy + filter).
//! - [`threads`]: CPU time of the harness's runtime threads, exited ones too.
//! - [`vllm`]: real vLLM on CPU for the slow tier.
//! - [`workload`]: the demo's multi-turn agentic workload and its summary.
//!
//! The harness builds nothing itself: `make test` builds the `.wasm` first.

pub mod artifacts;
pub mod client;
pub mod envoy;
pub mod error;
pub mod http;
pub mod process;
pub mod proxy;
pub mod stack;
pub mod threads;
pub mod vllm;
pub mod workload;

pub use envoy::{Envoy, EnvoyConfig};
pub use error::HarnessError;
pub use process::Spawned;
pub use stack::{ExternalReplica, Routing, Stack, StackOptions};
