//! Endpoints: the static list plus a watched discovery file (polled for
//! changes; endpoints are added and removed without a restart). Each
//! endpoint runs two tasks: its subscription and its scrape.
//!
//! The file should be replaced whole (written beside it, then renamed over
//! it, as Kubernetes does for a ConfigMap volume). An empty file is taken
//! for one being written and changes nothing; a file that does not parse
//! keeps the previous endpoints.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

use crate::config::{EndpointConfig, parse_discovery};
use crate::ids::EndpointId;
use crate::state::{Replica, Shared};
use crate::{load, subscriber};

/// Registers an endpoint and starts its tasks; false if already known, or
/// if its address is indexd's own HTTP listener (refused: counted in
/// `indexd_endpoints_refused_total{reason="self"}`, logged at most every
/// 10 s).
pub fn start_endpoint(shared: &Arc<Shared>, config: EndpointConfig) -> bool {
    if shared.is_own_http(config.id.address) {
        shared.metrics.endpoints_refused.inc(["self"]);
        if shared.refused_warning.open() {
            tracing::warn!(endpoint = %config.id, http_listen = %shared.http_addr(), "endpoint refused: it is indexd's own HTTP listener (tokenize requests forwarded there would loop back)");
        }
        return false;
    }
    let Some(replica) = shared.add_replica(config) else {
        return false;
    };
    tracing::info!(endpoint = %replica.id(), model = %replica.config.model, "endpoint added");
    spawn_tasks(shared, replica);
    true
}

/// Starts the subscription and scrape tasks of a registered replica.
pub fn spawn_tasks(shared: &Arc<Shared>, replica: Arc<Replica>) {
    let subscription = subscriber::run(Arc::clone(shared), Arc::clone(&replica));
    match shared.ingest.get() {
        Some(ingest) => shared.tasks.spawn_on(subscription, ingest),
        None => shared.tasks.spawn(subscription),
    };
    shared.tasks.spawn(load::run(Arc::clone(shared), replica));
}

/// Polls `path` until shutdown, reconciling the endpoints it lists.
pub async fn watch(shared: Arc<Shared>, path: PathBuf) {
    let mut known: BTreeMap<EndpointId, EndpointConfig> = BTreeMap::new();
    let mut last_seen: Option<(SystemTime, u64)> = None;
    let mut tick = tokio::time::interval(shared.config.discovery_interval);
    loop {
        tokio::select! {
            () = shared.shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let stamp = match tokio::fs::metadata(&path).await {
            Ok(m) => m.modified().ok().map(|t| (t, m.len())),
            Err(e) => {
                tracing::debug!(path = %path.display(), error = %e, "discovery file unreadable");
                continue;
            }
        };
        if stamp.is_some() && stamp == last_seen {
            continue;
        }
        let text = match tokio::fs::read_to_string(&path).await {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot read discovery file");
                continue;
            }
        };
        if text.trim().is_empty() {
            // Most likely a write in progress (truncated, not yet written):
            // read as an empty list it would drop every endpoint, each
            // coming back on the next poll to a fresh replay. `endpoints: []`
            // removes them all.
            shared.metrics.discovery.inc(["empty"]);
            tracing::debug!(path = %path.display(), "discovery file empty; keeping the previous endpoints");
            // Read again once it changes (its length will).
            last_seen = stamp;
            continue;
        }
        let endpoints = match parse_discovery(&text) {
            Ok(e) => e,
            Err(e) => {
                shared.metrics.discovery.inc(["error"]);
                tracing::warn!(path = %path.display(), error = %e, "invalid discovery file; keeping the previous endpoints");
                last_seen = stamp;
                continue;
            }
        };
        shared.metrics.discovery.inc(["ok"]);
        last_seen = stamp;
        reconcile(&shared, &mut known, endpoints);
        // A snapshot's replicas the file no longer lists are gone.
        shared.snapshots.forget_unrestored();
    }
}

/// Applies a new discovered list: removes what vanished or changed, adds
/// what is new. Static endpoints are never removed. An entry whose address
/// is indexd's own HTTP listener is skipped: logged and counted
/// (`indexd_endpoints_refused_total{reason="self"}`) when it first appears
/// in the list, again only after the list has dropped it.
pub fn reconcile(
    shared: &Arc<Shared>,
    known: &mut BTreeMap<EndpointId, EndpointConfig>,
    endpoints: Vec<EndpointConfig>,
) {
    let (refused, endpoints): (Vec<EndpointConfig>, Vec<EndpointConfig>) = endpoints
        .into_iter()
        .partition(|e| shared.is_own_http(e.id.address));
    {
        let mut before = crate::sync::lock(&shared.refused_self);
        let now: BTreeSet<EndpointId> = refused.into_iter().map(|e| e.id).collect();
        for id in now.difference(&before) {
            shared.metrics.endpoints_refused.inc(["self"]);
            tracing::warn!(endpoint = %id, http_listen = %shared.http_addr(), "discovered endpoint skipped: it is indexd's own HTTP listener (tokenize requests forwarded there would loop back)");
        }
        *before = now;
    }
    let wanted: BTreeMap<EndpointId, EndpointConfig> =
        endpoints.into_iter().map(|e| (e.id.clone(), e)).collect();
    let is_static = |id: &EndpointId| shared.config.endpoints.iter().any(|e| &e.id == id);
    known.retain(|id, cfg| {
        let keep = wanted.get(id) == Some(cfg);
        if !keep && !is_static(id) {
            shared.remove_replica(id);
            tracing::info!(endpoint = %id, "endpoint removed");
        }
        keep
    });
    for (id, cfg) in wanted {
        if known.contains_key(&id) || is_static(&id) {
            continue;
        }
        start_endpoint(shared, cfg.clone());
        known.insert(id, cfg);
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::config::Config;

    fn ep(address: &str) -> EndpointConfig {
        EndpointConfig::new(address.parse().unwrap(), "m")
    }

    fn registered(shared: &Shared) -> Vec<String> {
        crate::sync::read(&shared.registry)
            .all()
            .iter()
            .map(|r| r.id().to_string())
            .collect()
    }

    async fn stop(shared: &Shared) {
        shared.shutdown.cancel();
        shared.tasks.close();
        shared.tasks.wait().await;
    }

    #[tokio::test]
    async fn an_entry_on_the_own_http_listener_is_skipped_and_counted_as_it_appears() {
        let mut config = Config::new(Vec::new());
        config.http_listen = "127.0.0.1:9471".parse().unwrap();
        let shared = Arc::new(Shared::new(config, CancellationToken::new()));
        let refused = || shared.metrics.endpoints_refused.get(["self"]);
        let (own, via_any, other) = (
            ep("127.0.0.1:9471"),
            ep("0.0.0.0:9471"),
            ep("127.0.0.1:8000"),
        );
        let mut known = BTreeMap::new();
        let list = vec![own.clone(), via_any.clone(), other.clone()];
        reconcile(&shared, &mut known, list.clone());
        assert_eq!(registered(&shared), ["127.0.0.1:8000"]);
        assert_eq!(refused(), 2);
        // The same list again (a Kubernetes change elsewhere): no new count.
        reconcile(&shared, &mut known, list);
        assert_eq!(registered(&shared), ["127.0.0.1:8000"]);
        assert_eq!(refused(), 2);
        // Dropped from the list, then back: counted again.
        reconcile(&shared, &mut known, vec![other.clone()]);
        assert_eq!(refused(), 2);
        reconcile(&shared, &mut known, vec![own.clone(), other]);
        assert_eq!(refused(), 3);
        assert_eq!(known.len(), 1);
        // Added in code (Handle::add_endpoint): refused too.
        assert!(!start_endpoint(&shared, own));
        assert_eq!(refused(), 4);
        assert_eq!(registered(&shared), ["127.0.0.1:8000"]);
        stop(&shared).await;
    }

    #[tokio::test]
    async fn the_bound_wildcard_listener_is_what_counts() {
        // Configured with port 0, bound on every address at 9555.
        let mut config = Config::new(Vec::new());
        config.http_listen = "[::]:0".parse().unwrap();
        let shared = Arc::new(Shared::new(config, CancellationToken::new()));
        let bound: SocketAddr = "[::]:9555".parse().unwrap();
        shared.http_addr.set(bound).unwrap();
        let mut known = BTreeMap::new();
        reconcile(
            &shared,
            &mut known,
            vec![
                ep("127.0.0.1:9555"),
                ep("[::1]:9555"),
                ep("[::]:9555"),
                ep("203.0.113.7:9555"),
            ],
        );
        assert_eq!(registered(&shared), ["203.0.113.7:9555"]);
        assert_eq!(shared.metrics.endpoints_refused.get(["self"]), 3);
        stop(&shared).await;
    }
}
