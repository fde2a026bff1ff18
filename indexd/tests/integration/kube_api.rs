//! A Kubernetes API server stand-in on 127.0.0.1 (port 0) that speaks the
//! list/watch protocol as kube-apiserver does for EndpointSlices and pods in
//! one namespace: lists carry the collection's resourceVersion and items
//! without kind/apiVersion; `?watch=true&resourceVersion=N` streams
//! newline-delimited ADDED/MODIFIED/DELETED events after N, then BOOKMARKs
//! when asked; a resourceVersion older than the kept history gets HTTP 200
//! with one ERROR event carrying a 410 Status (Expired), as kube-apiserver
//! answers; or, when told, the watch request itself is answered 410 Gone.
//! Equality label selectors (`k=v,k2=v2`) filter both lists and watches.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use bytes::Bytes;
use serde_json::{Value, json};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

/// The collections served.
pub const SLICES: &str = "endpointslices";
pub const PODS: &str = "pods";

#[derive(Clone, Debug)]
enum Msg {
    /// A change: its collection and the watch event's JSON.
    Event(&'static str, Value),
    /// A BOOKMARK at this resourceVersion to every open watch.
    Bookmark(u64),
    /// End every open watch (as a server restart or a timeout would).
    Cut,
}

#[derive(Default)]
struct Inner {
    rv: u64,
    /// The oldest resourceVersion a watch may start from.
    oldest: u64,
    objects: BTreeMap<(&'static str, String), Value>,
    history: Vec<(u64, &'static str, Value)>,
    /// Watch requests still to be answered with HTTP 410, by collection.
    gone_watches: BTreeMap<&'static str, u32>,
    lists: BTreeMap<&'static str, u32>,
    watch_versions: Vec<(&'static str, u64)>,
    /// BOOKMARKs written to open watches: collection and resourceVersion.
    bookmarks_sent: Vec<(&'static str, u64)>,
}

type Shared = Arc<(Mutex<Inner>, broadcast::Sender<Msg>)>;

/// The running stand-in.
pub struct KubeApi {
    pub addr: SocketAddr,
    shared: Shared,
    stop: CancellationToken,
}

impl Drop for KubeApi {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn kind_of(collection: &str) -> (&'static str, &'static str) {
    if collection == SLICES {
        ("EndpointSlice", "discovery.k8s.io/v1")
    } else {
        ("Pod", "v1")
    }
}

fn collection(name: &str) -> Option<&'static str> {
    match name {
        SLICES => Some(SLICES),
        PODS => Some(PODS),
        _ => None,
    }
}

fn matches(selector: Option<&str>, object: &Value) -> bool {
    let Some(sel) = selector.filter(|s| !s.is_empty()) else {
        return true;
    };
    let labels = &object["metadata"]["labels"];
    sel.split(',').all(|term| match term.split_once('=') {
        Some((k, v)) => labels[k.trim()].as_str() == Some(v.trim()),
        None => true,
    })
}

fn status_410(rv: u64, oldest: u64) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": format!("too old resource version: {rv} ({oldest})"),
        "reason": "Expired",
        "code": 410
    })
}

fn line(v: &Value) -> Result<Bytes, Infallible> {
    let mut text = v.to_string();
    text.push('\n');
    Ok(Bytes::from(text))
}

async fn serve(
    State(shared): State<Shared>,
    Path((_ns, name)): Path<(String, String)>,
    Query(q): Query<BTreeMap<String, String>>,
) -> Response {
    let Some(coll) = collection(&name) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let selector = q.get("labelSelector").cloned();
    let watch = q.get("watch").is_some_and(|w| w == "true" || w == "1");
    let (kind, api_version) = kind_of(coll);
    let mut inner = shared.0.lock().unwrap();
    if !watch {
        *inner.lists.entry(coll).or_default() += 1;
        let items: Vec<Value> = inner
            .objects
            .iter()
            .filter(|((c, _), o)| *c == coll && matches(selector.as_deref(), o))
            .map(|(_, o)| {
                let mut o = o.clone();
                if let Some(m) = o.as_object_mut() {
                    m.remove("kind");
                    m.remove("apiVersion");
                }
                o
            })
            .collect();
        let list = json!({
            "kind": format!("{kind}List"),
            "apiVersion": api_version,
            "metadata": {"resourceVersion": inner.rv.to_string()},
            "items": items,
        });
        return ([("content-type", "application/json")], list.to_string()).into_response();
    }
    let from: u64 = q
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    inner.watch_versions.push((coll, from));
    if let Some(n) = inner.gone_watches.get_mut(coll).filter(|n| **n > 0) {
        *n -= 1;
        let body = status_410(from, inner.oldest).to_string();
        return (
            StatusCode::GONE,
            [("content-type", "application/json")],
            body,
        )
            .into_response();
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, Infallible>>(64);
    if from < inner.oldest {
        let err = json!({"type": "ERROR", "object": status_410(from, inner.oldest)});
        let _ = tx.try_send(line(&err));
        drop(tx);
    } else {
        for (rv, c, ev) in &inner.history {
            if *rv > from && *c == coll && matches(selector.as_deref(), &ev["object"]) {
                let _ = tx.try_send(line(ev));
            }
        }
        // Subscribed under the lock that also orders changes: nothing is
        // missed between the history and the live events.
        let mut live = shared.1.subscribe();
        let sent = Arc::clone(&shared);
        tokio::spawn(async move {
            loop {
                let msg = match live.recv().await {
                    Ok(m) => m,
                    Err(_) => return,
                };
                let out = match msg {
                    Msg::Event(c, ev)
                        if c == coll && matches(selector.as_deref(), &ev["object"]) =>
                    {
                        ev
                    }
                    Msg::Event(..) => continue,
                    Msg::Bookmark(rv) => json!({
                        "type": "BOOKMARK",
                        "object": {
                            "kind": kind,
                            "apiVersion": api_version,
                            "metadata": {"resourceVersion": rv.to_string()}
                        }
                    }),
                    Msg::Cut => return,
                };
                if tx.send(line(&out)).await.is_err() {
                    return;
                }
                if out["type"] == "BOOKMARK" {
                    let rv = out["object"]["metadata"]["resourceVersion"]
                        .as_str()
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(0);
                    sent.0.lock().unwrap().bookmarks_sent.push((coll, rv));
                }
            }
        });
    }
    drop(inner);
    let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
    Response::builder()
        .header("content-type", "application/json")
        .header("transfer-encoding", "chunked")
        .body(Body::from_stream(stream))
        .unwrap()
}

impl KubeApi {
    pub async fn start() -> Self {
        let (tx, _) = broadcast::channel(256);
        let shared: Shared = Arc::new((Mutex::new(Inner::default()), tx));
        let app = Router::new()
            .route("/api/v1/namespaces/{ns}/{name}", get(serve))
            .route(
                "/apis/discovery.k8s.io/v1/namespaces/{ns}/{name}",
                get(serve),
            )
            .with_state(Arc::clone(&shared));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let token = stop.clone();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move { token.cancelled().await })
                .await;
        });
        Self { addr, shared, stop }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Creates or replaces an object; `live: false` records the change
    /// without telling open watches (they are to miss it).
    pub fn put(&self, coll: &'static str, mut object: Value, live: bool) {
        let (kind, api_version) = kind_of(coll);
        let mut inner = self.shared.0.lock().unwrap();
        inner.rv += 1;
        let rv = inner.rv;
        object["kind"] = json!(kind);
        object["apiVersion"] = json!(api_version);
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        let name = object["metadata"]["name"].as_str().unwrap().to_owned();
        let existed = inner.objects.insert((coll, name), object.clone()).is_some();
        let ev = json!({"type": if existed { "MODIFIED" } else { "ADDED" }, "object": object});
        inner.history.push((rv, coll, ev.clone()));
        if live {
            let _ = self.shared.1.send(Msg::Event(coll, ev));
        }
    }

    /// Deletes an object (see `put` for `live`).
    pub fn delete(&self, coll: &'static str, name: &str, live: bool) {
        let mut inner = self.shared.0.lock().unwrap();
        let Some(mut object) = inner.objects.remove(&(coll, name.to_owned())) else {
            return;
        };
        inner.rv += 1;
        let rv = inner.rv;
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        let ev = json!({"type": "DELETED", "object": object});
        inner.history.push((rv, coll, ev.clone()));
        if live {
            let _ = self.shared.1.send(Msg::Event(coll, ev));
        }
    }

    /// Other objects of the cluster changed: the resourceVersion moves on by
    /// `by`, and open watches get a BOOKMARK at it. Returns it.
    pub fn bookmark(&self, by: u64) -> u64 {
        let mut inner = self.shared.0.lock().unwrap();
        inner.rv += by;
        let rv = inner.rv;
        let _ = self.shared.1.send(Msg::Bookmark(rv));
        rv
    }

    /// Forgets the history (a watch from any earlier resourceVersion gets
    /// 410) and ends every open watch, so that clients come back with their
    /// last resourceVersion.
    pub fn expire_and_cut(&self) {
        let mut inner = self.shared.0.lock().unwrap();
        inner.oldest = inner.rv;
        inner.history.clear();
        let _ = self.shared.1.send(Msg::Cut);
    }

    /// Ends every open watch.
    pub fn cut(&self) {
        let _guard = self.shared.0.lock().unwrap();
        let _ = self.shared.1.send(Msg::Cut);
    }

    /// The next `n` watch requests of `coll` are answered HTTP 410 Gone.
    pub fn refuse_watches_with_410(&self, coll: &'static str, n: u32) {
        self.shared.0.lock().unwrap().gone_watches.insert(coll, n);
    }

    /// Lists served for `coll`.
    pub fn lists(&self, coll: &str) -> u32 {
        let inner = self.shared.0.lock().unwrap();
        inner.lists.get(coll).copied().unwrap_or(0)
    }

    /// The resourceVersions of the BOOKMARKs written to watches of `coll`
    /// (a watch's lines reach its client in order, before its end).
    pub fn bookmarks_sent(&self, coll: &str) -> Vec<u64> {
        let inner = self.shared.0.lock().unwrap();
        inner
            .bookmarks_sent
            .iter()
            .filter(|(c, _)| *c == coll)
            .map(|(_, v)| *v)
            .collect()
    }

    /// The resourceVersions watches of `coll` started from.
    pub fn watch_versions(&self, coll: &str) -> Vec<u64> {
        let inner = self.shared.0.lock().unwrap();
        inner
            .watch_versions
            .iter()
            .filter(|(c, _)| *c == coll)
            .map(|(_, v)| *v)
            .collect()
    }
}
