//! Endpoints: the static list plus a watched discovery file (polled for
//! changes; endpoints are added and removed without a restart). Each
//! endpoint runs two tasks: its subscription and its scrape.
//!
//! The file should be replaced whole (written beside it, then renamed over
//! it, as Kubernetes does for a ConfigMap volume). An empty file is taken
//! for one being written and changes nothing; a file that does not parse
//! keeps the previous endpoints.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

use crate::config::{EndpointConfig, EndpointId, parse_discovery};
use crate::state::{Replica, Shared};
use crate::{load, subscriber};

/// Registers an endpoint and starts its tasks; false if already known.
pub fn start_endpoint(shared: &Arc<Shared>, config: EndpointConfig) -> bool {
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
        crate::state::lock(&shared.restores).clear();
    }
}

/// Applies a new discovered list: removes what vanished or changed, adds
/// what is new. Static endpoints are never removed.
pub fn reconcile(
    shared: &Arc<Shared>,
    known: &mut BTreeMap<EndpointId, EndpointConfig>,
    endpoints: Vec<EndpointConfig>,
) {
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
