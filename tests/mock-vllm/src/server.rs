//! Starting a replica in-process and the [`Handle`] that owns it.

use std::net::SocketAddr;
use std::sync::Arc;

use serde::Serialize;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, ConfigError, EventsEndpoint};
use crate::engine::{Job, Replica};
use crate::publisher::{Publisher, PublisherError};
use crate::rank::Engine;

/// A replica could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("binding {what} on {addr}: {source}")]
    Bind {
        what: &'static str,
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error(transparent)]
    Events(#[from] PublisherError),
}

/// The bound addresses, as the binary prints them (one JSON line).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BoundAddresses {
    pub name: String,
    pub http: SocketAddr,
    pub admin: SocketAddr,
    /// `tcp://ip:port` of the first rank's PUB socket (bound, or the one it connects to).
    pub kv_events: Option<String>,
    /// `bind` or `connect`.
    pub kv_events_mode: Option<&'static str>,
    /// The first rank's replay socket.
    pub replay: Option<String>,
    pub data_parallel_size: u32,
    /// Every rank's event sockets, in rank order.
    pub ranks: Vec<RankAddresses>,
}

/// One data-parallel rank's event sockets.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RankAddresses {
    pub rank: u32,
    pub kv_events: Option<String>,
    pub replay: Option<String>,
}

/// Entry point: `MockVllm::start(config).await`.
#[derive(Debug)]
pub struct MockVllm;

/// A running replica; shuts down on [`Handle::shutdown`] or drop.
#[derive(Debug)]
pub struct Handle {
    addresses: BoundAddresses,
    replica: Arc<Replica>,
    cancel: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

async fn bind(
    what: &'static str,
    addr: SocketAddr,
) -> Result<(TcpListener, SocketAddr), StartError> {
    let err = |source| StartError::Bind { what, addr, source };
    let listener = TcpListener::bind(addr).await.map_err(err)?;
    let local = listener.local_addr().map_err(err)?;
    Ok((listener, local))
}

impl MockVllm {
    /// Validates `config`, binds every listener (port 0 allowed), and serves until the handle is
    /// shut down or dropped. When this returns, every socket accepts connections.
    pub async fn start(config: Config) -> Result<Handle, StartError> {
        config.validate()?;
        let cancel = CancellationToken::new();
        let (http, http_addr) = bind("HTTP API", config.http_addr).await?;
        let (admin, admin_addr) = bind("admin API", config.admin_addr).await?;
        // Tasks started before a failure stop with the token.
        let stop_on_error = cancel.clone().drop_guard();
        let mut tasks = Vec::new();
        let mut publishers = Vec::new();
        let mut ranks = Vec::new();
        for index in 0..config.data_parallel_size {
            let publisher = match &config.kv_events {
                Some(ev) => {
                    let (p, t) =
                        Publisher::start(&ev.for_rank(index)?, cancel.child_token()).await?;
                    tasks.extend(t);
                    Some(p)
                }
                None => None,
            };
            ranks.push(RankAddresses {
                rank: config.first_rank().saturating_add(index),
                kv_events: publisher.as_ref().map(|p| p.endpoint().to_owned()),
                replay: publisher
                    .as_ref()
                    .and_then(|p| p.replay_endpoint().map(str::to_owned)),
            });
            publishers.push(publisher);
        }
        let first = ranks.first();
        let addresses = BoundAddresses {
            name: config.name.clone().unwrap_or_else(|| http_addr.to_string()),
            http: http_addr,
            admin: admin_addr,
            kv_events: first.and_then(|r| r.kv_events.clone()),
            kv_events_mode: config.kv_events.as_ref().map(|e| match e.endpoint {
                EventsEndpoint::Bind(_) => "bind",
                EventsEndpoint::Connect(_) => "connect",
            }),
            replay: first.and_then(|r| r.replay.clone()),
            data_parallel_size: config.data_parallel_size,
            ranks,
        };
        let replica = Arc::new(Replica::new(config, addresses.name.clone(), publishers));
        for (listener, app) in [
            (http, crate::api::router(replica.clone())),
            (admin, crate::admin::router(replica.clone())),
        ] {
            let stop = cancel.clone();
            // Streamed chunks go out at once, as from vLLM's uvicorn: with
            // Nagle on, a chunk can wait ~40 ms for a delayed ACK.
            let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
                if let Err(e) = tcp.set_nodelay(true) {
                    tracing::debug!(error = %e, "TCP_NODELAY not set");
                }
            });
            tasks.push(tokio::spawn(async move {
                let served = axum::serve(listener, app)
                    .with_graceful_shutdown(async move { stop.cancelled().await })
                    .await;
                if let Err(e) = served {
                    tracing::error!(error = %e, "HTTP server failed");
                }
            }));
        }
        stop_on_error.disarm();
        tracing::info!(?addresses, "mock-vllm ready");
        Ok(Handle {
            addresses,
            replica,
            cancel,
            tasks,
        })
    }
}

impl Handle {
    pub fn addresses(&self) -> &BoundAddresses {
        &self.addresses
    }

    pub fn name(&self) -> &str {
        &self.addresses.name
    }

    pub fn http_addr(&self) -> SocketAddr {
        self.addresses.http
    }

    pub fn admin_addr(&self) -> SocketAddr {
        self.addresses.admin
    }

    /// `tcp://ip:port` of the first rank's PUB socket, when events are on.
    pub fn events_endpoint(&self) -> Option<&str> {
        self.addresses.kv_events.as_deref()
    }

    /// `tcp://ip:port` of the first rank's ROUTER replay socket, when on.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.addresses.replay.as_deref()
    }

    /// The data-parallel ranks this server runs, in order.
    pub fn ranks(&self) -> Vec<u32> {
        self.addresses.ranks.iter().map(|r| r.rank).collect()
    }

    /// `(rank, tcp://ip:port)` of every rank's PUB socket, when events are on.
    pub fn events_endpoints(&self) -> Vec<(u32, String)> {
        let ranks = self.addresses.ranks.iter();
        ranks
            .filter_map(|r| Some((r.rank, r.kv_events.clone()?)))
            .collect()
    }

    /// `(rank, tcp://ip:port)` of every rank's ROUTER replay socket, when on.
    pub fn replay_endpoints(&self) -> Vec<(u32, String)> {
        let ranks = self.addresses.ranks.iter();
        ranks
            .filter_map(|r| Some((r.rank, r.replay.clone()?)))
            .collect()
    }

    /// Oracle: prefix tokens (whole blocks) the first rank holds now for `token_ids` (0 for an
    /// unknown model).
    pub fn cached_prefix_tokens(
        &self,
        model: Option<&str>,
        cache_salt: Option<&str>,
        token_ids: &[u32],
    ) -> usize {
        self.replica
            .first_engine()
            .map_or(0, |e| self.probe(e, model, cache_salt, token_ids))
    }

    /// Oracle: prefix tokens (whole blocks) data-parallel `rank` holds now for `token_ids`;
    /// `None` when this server does not run `rank`.
    pub fn cached_prefix_tokens_on_rank(
        &self,
        rank: u32,
        model: Option<&str>,
        cache_salt: Option<&str>,
        token_ids: &[u32],
    ) -> Option<usize> {
        let engine = self.replica.engine_by_rank(rank).ok()?;
        Some(self.probe(engine, model, cache_salt, token_ids))
    }

    fn probe(
        &self,
        engine: &Engine,
        model: Option<&str>,
        cache_salt: Option<&str>,
        token_ids: &[u32],
    ) -> usize {
        let Ok(model) = self.replica.resolve_model(model) else {
            return 0;
        };
        let job = Job {
            model,
            prompt: token_ids.to_vec(),
            cache_salt: cache_salt.map(str::to_owned),
        };
        engine.probe(&job).0
    }

    /// Waits until every KV-event batch produced so far, on every rank, is published (or
    /// dropped by a fault control), so a replay sees it. Blocks while events are paused.
    pub async fn flush_events(&self) {
        for e in self.replica.engines() {
            if let Some(p) = &e.publisher {
                p.flushed().await;
            }
        }
    }

    /// Same as `POST /admin/restart` (every rank; stored responses forgotten).
    pub fn restart(&self) {
        self.replica.restart();
    }

    /// Stops every listener and task and waits for them.
    pub async fn shutdown(mut self) {
        self.cancel.cancel();
        for t in self.tasks.drain(..) {
            let _ = t.await;
        }
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn send_sync<T: Send + Sync + 'static>() {}

    #[test]
    fn handle_can_move_between_tasks() {
        send_sync::<Handle>();
        send_sync::<BoundAddresses>();
    }

    #[tokio::test]
    async fn invalid_config_is_refused_before_binding() {
        let config = Config {
            block_size: 0,
            ..Config::default()
        };
        match MockVllm::start(config).await {
            Err(StartError::Config(e)) => assert_eq!(e.field, "block_size"),
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn port_in_use_is_a_clear_error() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let config = Config {
            http_addr: taken.local_addr().unwrap(),
            ..Config::default()
        };
        let err = MockVllm::start(config).await.unwrap_err();
        assert!(err.to_string().contains("HTTP API"), "{err}");
    }
}
