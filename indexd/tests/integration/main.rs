//! indexd in-process, against a real ZMQ publisher (PUB + ROUTER for
//! replay) replaying captured vLLM 0.32 frames and synthetic ones, over real
//! gRPC and HTTP. Nothing sleeps to wait: every wait polls a condition in a
//! bounded loop.
//!
//! - `harness.rs`: what the other files share: the publisher, the in-process
//!   daemon, the binary as a child process, event builders and polling.
//! - `events.rs`: captured frames, salts, a bound SUB and bad frames.
//! - `replay.rs`: gaps healed by replay, purges, engine restarts, reconnects.
//! - `picks.rs`: fresh replicas, the holder first, Observes and continuations,
//!   approximate mode.
//! - `load.rs`: scraped load, fitted prefill speed, health, the capacity signal.
//! - `discovery.rs`: the discovery file.
//! - `binary.rs`: the binary, its printed addresses, huge pages and CPU pinning.
//! - `access.rs`: Unix socket, shared token, refusal to listen unprotected.
//! - `metrics.rs`: `/metrics` through `promtool`, the dashboard's queries.
//! - `snapshot.rs`: a restart that loads the previous snapshot.
//! - `kube_api.rs`, `kubernetes.rs`: Kubernetes discovery against a list/watch
//!   stand-in.
//! - `tokenize.rs`, `tokenize_hostile.rs`, `tokenize_messages.rs`: Picks
//!   with request bodies, the tokenizer endpoints and the exactness gate,
//!   under friendly and hostile bodies, and Anthropic Messages bodies.
//! - `hybrid.rs`: hybrid models' real vLLM events.
//! - `zmtp_faults.rs`: hostile and broken ZMTP peers.
//! - `libzmq.rs`: interop with libzmq through pyzmq (`make test-vllm` runs it).

// A test binary: its helpers may fail loudly too (clippy.toml only covers
// `#[test]` functions).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod access;
mod binary;
mod discovery;
mod events;
mod harness;
mod hybrid;
mod kube_api;
mod kubernetes;
mod libzmq;
mod load;
mod metrics;
mod picks;
mod replay;
mod snapshot;
mod tokenize;
mod tokenize_hostile;
mod tokenize_messages;
mod zmtp_faults;
