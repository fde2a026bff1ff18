//! indexd: the node-local KV-cache index daemon behind the kvroute filter.
//!
//! It subscribes to every vLLM replica's KV events, keeps an exact, bounded
//! index of which replica holds which block, and answers
//! `kvroute.v1.Index/Pick` from memory.
//!
//! - [`config`]: typed configuration (YAML or code), valid by construction.
//! - [`event`]: indexd's own KV-event types (a leaf module); `ids`: the
//!   dense replica and partition identities.
//! - [`wire`]: vLLM's msgpack KV events → [`event`] types, bounded.
//! - [`zmtp`]: indexd's own bounded ZMTP 3.x transport (SUB, DEALER, NULL
//!   mechanism): a pure decoder that checks every cap before buffering.
//! - `subscriber`: one SUB task per endpoint; its stream tracks seqs,
//!   replays over DEALER, purges.
//! - [`index`]: the block index (partitions, tiers); `credits`: speculative
//!   entries and approximate-mode keys (runs credited for a while).
//! - `score`: the cost model, a pure function over a snapshot;
//!   `conversations`: where this indexd's conversations are (its move rule).
//! - [`load`]: background scrape of each replica's /metrics;
//!   [`calibrate`]: each replica's prefill speed fitted from them.
//! - `affinity`: response-id affinity and approximate-mode keys.
//! - [`pick`]: Pick/Observe decisions; `server`: their tonic glue.
//! - [`listen`]: the gRPC listen address (TCP or a Unix domain socket) and
//!   the socket file's life, and whether an address reaches a listener (no
//!   endpoint may be indexd's own HTTP port); [`auth`]: the optional shared token;
//!   `ratelimit`: the token bucket in front of Observe.
//! - [`tokenize`]: request bodies → vLLM's exact token ids (a local
//!   tokenizer behind an exactness gate, else a replica's), for Picks that
//!   carry their body and for vLLM-compatible `/tokenize` and
//!   `/v1/responses/render`.
//! - `http`: Prometheus `/metrics`, `/healthz`, `/readyz`; `http::serve`:
//!   the HTTP accept loop with its timeouts and connection limit.
//! - `discovery`: static endpoints plus a watched discovery file;
//!   [`kubernetes`]: endpoints from a watch on EndpointSlices or pods.
//! - `snapshot`: the index saved periodically and at shutdown, restored at
//!   start and proven by each replica's replay ([`SnapshotConfig`]).
//! - [`message`]: vLLM's live messages and replay answers, frame by frame.
//! - [`state`], `metrics`, [`error`]: shared state, counters, errors.
//! - [`cpus`]: CPU placement, the ingest runtime apart from the request
//!   path (`ingest_cpus`).
//! - `daemon`: [`Server`], [`Bound`] and [`Handle`], the daemon as a whole.
//!
//! Start in-process with [`Server::bind`] (port 0 works), read the bound
//! addresses, then [`Bound::serve`] until the shutdown token fires.

mod affinity;
pub mod auth;
pub mod calibrate;
pub mod config;
mod conversations;
pub mod cpus;
mod credits;
mod daemon;
mod discovery;
pub mod error;
pub mod event;
mod http;
mod ids;
pub mod index;
pub mod kubernetes;
pub mod listen;
pub mod load;
mod machine;
pub mod message;
mod metrics;
pub mod pick;
mod ratelimit;
mod score;
mod server;
mod snapshot;
pub mod state;
mod subscriber;
mod sync;
pub mod tokenize;
pub mod wire;
pub mod zmtp;

pub use config::{
    AccessConfig, Config, EndpointConfig, EndpointId, HttpUrl, KubernetesConfig, SnapshotConfig,
    Weights,
};
pub use daemon::{Bound, Handle, ReplicaStatus, Server, run, without_huge_pages};
pub use error::{ConfigError, StartError};
pub use event::Tier;
pub use ids::{PartitionId, ReplicaSlot};
pub use index::Index;
pub use listen::ListenAddr;
pub use state::Shared;
pub use wire::Limits;
