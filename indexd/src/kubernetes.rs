//! Kubernetes discovery: a watch on a Service's EndpointSlices (and the
//! namespace's pods, for their annotations), or on pods by label selector,
//! feeding the same reconcile as the discovery file.
//!
//! kube-runtime's watcher lists, then watches from the list's
//! resourceVersion (with bookmarks), relists when the API server answers
//! 410 Gone inside the watch, and backs off on errors (0.8 s doubling to
//! 30 s). A 410 as the status of the watch request itself would leave it
//! retrying the same resourceVersion; indexd starts a new watcher then,
//! which lists again. Each watched kind is mirrored here (a relist replaces
//! the mirror whole when it is done, so objects that vanished meanwhile go),
//! and once every kind has been listed, each change derives the endpoints
//! anew ([`derive`]) and [`crate::discovery::reconcile`] adds what is new
//! (its subscription replays from seq 0), removes what went (purged) and
//! restarts what changed.
//!
//! Why EndpointSlices first: they list the addresses the Service routes to,
//! which is what Envoy's cluster (EDS, or Istio's) knows the hosts by, with
//! the readiness the Service uses (a terminating or unready pod drops out at
//! once) and the Service's named ports. Pods by selector are the way when
//! no Service fronts the replicas.

pub mod derive;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use futures::stream::{BoxStream, StreamExt};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher;
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;

use crate::config::EndpointConfig;
use crate::config::kubernetes::{KubeSource, KubernetesConfig};
use crate::error::StartError;
use crate::ids::EndpointId;
use crate::state::Shared;

/// A client for the configured API server and the namespace to watch.
#[derive(Clone)]
pub struct Connection {
    client: Client,
    namespace: String,
}

impl Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("namespace", &self.namespace)
            .finish_non_exhaustive()
    }
}

impl Connection {
    /// Builds the client: `api_server` without credentials when set (a
    /// `kubectl proxy`, a test server), else the pod's service account,
    /// else the kubeconfig. Nothing is sent yet.
    pub async fn new(config: &KubernetesConfig) -> Result<Self, StartError> {
        let err = |reason: String| StartError::Kubernetes { reason };
        let kube_config = match &config.api_server {
            Some(url) => {
                let uri = url
                    .parse::<http::Uri>()
                    .map_err(|e| err(format!("kubernetes.api_server {url:?}: {e}")))?;
                kube::Config::new(uri)
            }
            None => kube::Config::infer().await.map_err(|e| {
                err(format!(
                    "no Kubernetes API to talk to ({e}); run in a pod with a service account, \
                     set KUBECONFIG, or set kubernetes.api_server"
                ))
            })?,
        };
        let namespace = config
            .namespace
            .clone()
            .unwrap_or_else(|| kube_config.default_namespace.clone());
        let client = Client::try_from(kube_config).map_err(|e| err(e.to_string()))?;
        Ok(Self { client, namespace })
    }
}

/// Objects of one kind as the API server last told them, by name.
struct Mirror<K> {
    current: BTreeMap<String, K>,
    /// A relist in progress.
    pending: Option<BTreeMap<String, K>>,
    listed: bool,
}

impl<K: Resource> Mirror<K> {
    fn new() -> Self {
        Self {
            current: BTreeMap::new(),
            pending: None,
            listed: false,
        }
    }

    /// Applies one watcher event; true when `current` changed.
    fn apply(&mut self, event: watcher::Event<K>) -> bool {
        let name = |o: &K| o.meta().name.clone().unwrap_or_default();
        match event {
            watcher::Event::Init => {
                self.pending = Some(BTreeMap::new());
                false
            }
            watcher::Event::InitApply(o) => {
                let key = name(&o);
                self.pending
                    .get_or_insert_with(BTreeMap::new)
                    .insert(key, o);
                false
            }
            watcher::Event::InitDone => {
                self.current = self.pending.take().unwrap_or_default();
                self.listed = true;
                true
            }
            watcher::Event::Apply(o) => {
                self.current.insert(name(&o), o);
                true
            }
            watcher::Event::Delete(o) => self.current.remove(&name(&o)).is_some(),
        }
    }
}

const RESTART_PAUSE: Duration = Duration::from_millis(800);
const MAX_RESTART_PAUSE: Duration = Duration::from_secs(30);

type Events<K> = BoxStream<'static, Result<watcher::Event<K>, watcher::Error>>;

fn events<K>(api: &Api<K>, selector: Option<&str>) -> Events<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let mut config = watcher::Config::default();
    if let Some(s) = selector {
        config = config.labels(s);
    }
    watcher::watcher(api.clone(), config)
        .default_backoff()
        .boxed()
}

/// One watched kind: its API, selector, stream and mirror.
struct Watched<K> {
    resource: &'static str,
    api: Api<K>,
    selector: Option<String>,
    stream: Events<K>,
    mirror: Mirror<K>,
    /// New watchers started since the last change seen, for their backoff.
    restarts: u32,
}

impl<K> Watched<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    fn new(resource: &'static str, api: Api<K>, selector: Option<String>) -> Self {
        let stream = events(&api, selector.as_deref());
        Self {
            resource,
            api,
            selector,
            stream,
            mirror: Mirror::new(),
            restarts: 0,
        }
    }

    /// Handles one item of the stream; true when the mirror changed.
    fn handle(
        &mut self,
        shared: &Shared,
        item: Option<Result<watcher::Event<K>, watcher::Error>>,
    ) -> bool {
        let count = |event: &'static str| {
            shared.metrics.kubernetes_events.inc([self.resource, event]);
        };
        match item {
            Some(Ok(event)) => {
                match &event {
                    watcher::Event::Init => count("list"),
                    watcher::Event::Apply(_) => count("apply"),
                    watcher::Event::Delete(_) => count("delete"),
                    watcher::Event::InitApply(_) | watcher::Event::InitDone => {}
                }
                if matches!(event, watcher::Event::Apply(_) | watcher::Event::Delete(_)) {
                    // A watch delivered: the next restart need not wait long.
                    self.restarts = 0;
                }
                self.mirror.apply(event)
            }
            Some(Err(e)) => {
                count("error");
                tracing::warn!(resource = self.resource, error = %e, "kubernetes watch");
                // A 410 Gone as the watch request's status: the watcher
                // would retry the expired resourceVersion; list anew.
                if let watcher::Error::WatchStartFailed(kube::Error::Api(status)) = &e
                    && status.code == 410
                {
                    self.restart();
                }
                false
            }
            None => {
                // The watcher's stream does not end; if it did, start over.
                self.restart();
                false
            }
        }
    }

    /// A new watcher (it lists first), after a pause that doubles with each
    /// restart without a change in between (0.8 s to 30 s, as the watcher's
    /// own backoff): an API that refuses every watch is not listed in a
    /// tight loop.
    fn restart(&mut self) {
        let pause = RESTART_PAUSE
            .saturating_mul(1 << self.restarts.min(6))
            .min(MAX_RESTART_PAUSE);
        self.restarts = self.restarts.saturating_add(1);
        let fresh = events(&self.api, self.selector.as_deref());
        self.stream = futures::stream::once(tokio::time::sleep(pause))
            .filter_map(|()| std::future::ready(None))
            .chain(fresh)
            .boxed();
    }
}

/// Watches until shutdown, reconciling the endpoints on every change.
pub async fn watch(shared: Arc<Shared>, connection: Connection, config: KubernetesConfig) {
    let Connection { client, namespace } = connection;
    tracing::info!(namespace = %namespace, source = ?config.source, "kubernetes discovery");
    let (mut slices, mut pods) = match &config.source {
        KubeSource::Service { name, pods } => (
            Some(Watched::new(
                "endpointslices",
                Api::<EndpointSlice>::namespaced(client.clone(), &namespace),
                Some(format!("kubernetes.io/service-name={name}")),
            )),
            Watched::new(
                "pods",
                Api::<Pod>::namespaced(client, &namespace),
                pods.clone(),
            ),
        ),
        KubeSource::Pods { selector } => (
            None,
            Watched::new(
                "pods",
                Api::<Pod>::namespaced(client, &namespace),
                Some(selector.clone()),
            ),
        ),
    };
    let mut known: BTreeMap<EndpointId, EndpointConfig> = BTreeMap::new();
    let mut skipped_before: BTreeSet<(String, String)> = BTreeSet::new();
    let mut first = true;
    loop {
        let changed = tokio::select! {
            () = shared.shutdown.cancelled() => return,
            item = async {
                match slices.as_mut() {
                    Some(s) => s.stream.next().await,
                    None => std::future::pending().await,
                }
            } => slices.as_mut().is_some_and(|s| s.handle(&shared, item)),
            item = pods.stream.next() => pods.handle(&shared, item),
        };
        let listed = pods.mirror.listed && slices.as_ref().is_none_or(|s| s.mirror.listed);
        if !changed || !listed {
            continue;
        }
        let derived = match &slices {
            Some(s) => {
                let by_name: BTreeMap<String, &Pod> = pods
                    .mirror
                    .current
                    .iter()
                    .map(|(k, v)| (k.clone(), v))
                    .collect();
                derive::from_slices(&config, s.mirror.current.values(), Some(&by_name))
            }
            None => derive::from_pods(&config, pods.mirror.current.values()),
        };
        report(&shared, &derived, &mut skipped_before);
        crate::discovery::reconcile(&shared, &mut known, derived.endpoints);
        if first {
            // Every replica the cluster has is known now: a snapshot's
            // replicas that it does not list are gone.
            shared.snapshots.forget_unrestored();
            first = false;
        }
    }
}

/// Gauges, and a warning for each address newly left out.
fn report(shared: &Shared, derived: &derive::Derived, before: &mut BTreeSet<(String, String)>) {
    {
        shared
            .metrics
            .kubernetes_endpoints
            .set(derived.endpoints.len() as f64);
        shared
            .metrics
            .kubernetes_skipped
            .set(derived.skipped.len() as f64);
    }
    let now: BTreeSet<(String, String)> = derived.skipped.iter().cloned().collect();
    for (object, reason) in now.difference(before) {
        tracing::warn!(%object, %reason, "kubernetes: ready address left out");
    }
    *before = now;
}
