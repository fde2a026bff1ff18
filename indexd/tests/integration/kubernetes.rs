//! Kubernetes discovery against a list/watch stand-in (`kube_api.rs`)
//! serving objects shaped as kube-apiserver returns them, with replicas
//! that are real ZMQ publishers: endpoints are added (and replay from seq
//! 0), removed (purged), re-added (a fresh replay), and relisted after a
//! 410 Gone inside the watch and as the watch request's status.

use std::net::SocketAddr;

use indexd::{Config, EndpointId};
use kvroute_proto::v1::{ObserveRequest, Outcome};
use serde_json::{Value, json};

use crate::harness::{Daemon, Publisher, eventually, replica, stored_batch, tokens};
use crate::kube_api::{KubeApi, PODS, SLICES};

const SLICE: &str = include_str!("../fixtures/kubernetes/endpointslice-vllm-llama.json");
const POD: &str = include_str!("../fixtures/kubernetes/pod-vllm-llama.json");

fn port_of(endpoint: &str) -> u16 {
    endpoint.rsplit(':').next().unwrap().parse().unwrap()
}

/// The recorded pod, renamed, on 127.0.0.1, serving model `m`.
fn pod(name: &str, annotations: Value) -> Value {
    let mut p: Value = serde_json::from_str(POD).unwrap();
    p["metadata"]["name"] = json!(name);
    p["metadata"]["annotations"] = annotations;
    p["status"]["podIP"] = json!("127.0.0.1");
    p["status"]["podIPs"] = json!([{"ip": "127.0.0.1"}]);
    p
}

/// The recorded EndpointSlice, renamed, listing one endpoint for `pod` at
/// 127.0.0.1 with the publisher's ports under the Service's port names.
fn slice(name: &str, pod: &str, http: u16, p: &Publisher, ready: bool) -> Value {
    let mut s: Value = serde_json::from_str(SLICE).unwrap();
    s["metadata"]["name"] = json!(name);
    s["metadata"]["labels"]["kubernetes.io/service-name"] = json!("vllm-test");
    let mut ep = s["endpoints"][0].clone();
    ep["addresses"] = json!(["127.0.0.1"]);
    ep["targetRef"]["name"] = json!(pod);
    ep["conditions"] = json!({"ready": ready, "serving": true, "terminating": !ready});
    s["endpoints"] = json!([ep]);
    s["ports"] = json!([
        {"name": "http", "protocol": "TCP", "port": http},
        {"name": "kv-events", "protocol": "TCP", "port": port_of(&p.events)},
        {"name": "kv-replay", "protocol": "TCP", "port": port_of(&p.replay)},
    ]);
    s
}

fn kubernetes(api: &KubeApi, source: indexd::KubernetesConfig) -> impl FnOnce(&mut Config) {
    let url = api.url();
    move |c: &mut Config| {
        let mut k = source;
        k.api_server = Some(url);
        k.namespace = Some("test".into());
        c.kubernetes = Some(k);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubernetes_endpointslices_add_remove_readd_and_relist() {
    let (a_port, b_port) = (18201, 18202);
    let (a, b) = (replica(a_port), replica(b_port));
    // Each engine has stored blocks before indexd knows it: only a replay
    // from seq 0 delivers them.
    let pa = Publisher::start(false).await;
    pa.buffer_only(0, &stored_batch(&[1], None, &tokens(16, 1), 16, None));
    let pb = Publisher::start(false).await;
    pb.buffer_only(0, &stored_batch(&[2, 3], None, &tokens(32, 2), 16, None));

    let api = KubeApi::start().await;
    let model = json!({"kvroute.io/model": "m"});
    api.put(PODS, pod("vllm-a", model.clone()), true);
    api.put(PODS, pod("vllm-b", model.clone()), true);
    // A pod no slice names, and one outside the Service: never endpoints.
    api.put(PODS, pod("vllm-c", model), true);
    api.put(
        SLICES,
        slice("vllm-test-a", "vllm-a", a_port, &pa, true),
        true,
    );

    let mut source = indexd::KubernetesConfig::service("vllm-test");
    source.port = indexd::config::kubernetes::PortRef::Name("http".into());
    source.events_port = indexd::config::kubernetes::PortRef::Name("kv-events".into());
    source.replay_port = indexd::config::kubernetes::PortRef::Name("kv-replay".into());
    let d = Daemon::start_with(vec![], 16, kubernetes(&api, source)).await;
    let entries = |id: EndpointId| {
        let h = d.handle.clone();
        move || {
            let s = h.replica(&id);
            async move { s.map(|s| (s.fresh, s.entries)) }
        }
    };

    // Listed: A is added and replays its engine's buffer.
    eventually("A added and replayed", || async {
        entries(a.clone())().await == Some((true, 1))
    })
    .await;
    assert!(d.handle.replica(&b).is_none());
    assert_eq!(d.counter("indexd_kubernetes_endpoints"), 1.0);

    // Watched: B's slice appears.
    let rv = api.bookmark(3);
    api.put(
        SLICES,
        slice("vllm-test-b", "vllm-b", b_port, &pb, true),
        true,
    );
    eventually("B added and replayed", || async {
        entries(b.clone())().await == Some((true, 2))
    })
    .await;
    assert!(api.watch_versions(SLICES).iter().all(|v| *v < rv));
    // A bookmark moves the watch on: cut, the watch resumes from it.
    let rv = api.bookmark(5);
    // Written to the open watch: its client reads it before the cut's end.
    eventually("the bookmark written to the watch", || async {
        api.bookmarks_sent(SLICES).contains(&rv)
    })
    .await;
    api.cut();
    eventually("the watch resumed from the bookmark", || async {
        api.watch_versions(SLICES).contains(&rv)
    })
    .await;

    // A terminates: its endpoint is no longer ready, so it goes.
    api.put(
        SLICES,
        slice("vllm-test-a", "vllm-a", a_port, &pa, false),
        true,
    );
    // (The purge is counted just after the replica leaves the registry.)
    eventually("A removed and purged", || async {
        d.handle.replica(&a).is_none()
            && d.counter("indexd_purges_total{reason=\"removed\"}") == 1.0
    })
    .await;
    assert!(d.handle.replica(&b).is_some());

    // While the watch is cut and its history gone, A comes back at the same
    // address and B's slice is deleted. The re-watch gets 410 inside the
    // stream; the relist shows both.
    let lists = api.lists(SLICES);
    api.put(
        SLICES,
        slice("vllm-test-a", "vllm-a", a_port, &pa, true),
        false,
    );
    api.delete(SLICES, "vllm-test-b", false);
    api.expire_and_cut();
    eventually("the relist after 410", || async {
        api.lists(SLICES) > lists
            && entries(a.clone())().await == Some((true, 1))
            && d.handle.replica(&b).is_none()
    })
    .await;
    // A started fresh: a third replay from seq 0 (A, B, A again).
    assert_eq!(
        d.counter("indexd_replay_requests_total{from=\"start\"}"),
        3.0
    );
    eventually("B purged", || async {
        d.counter("indexd_purges_total{reason=\"removed\"}") == 2.0
    })
    .await;
    assert!(
        d.counter("indexd_kubernetes_events_total{resource=\"endpointslices\",event=\"list\"}")
            >= 2.0
    );

    // A 410 as the watch request's status: indexd lists anew.
    let lists = api.lists(SLICES);
    api.refuse_watches_with_410(SLICES, 1);
    api.put(
        SLICES,
        slice("vllm-test-b", "vllm-b", b_port, &pb, true),
        false,
    );
    api.cut();
    eventually("the relist after an HTTP 410", || async {
        api.lists(SLICES) > lists && entries(b.clone())().await == Some((true, 2))
    })
    .await;
    assert!(d.handle.replica(&a).is_some());
    assert_eq!(d.counter("indexd_kubernetes_endpoints"), 2.0);
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubernetes_pods_by_selector_with_ranks_and_annotations() {
    let api = KubeApi::start().await;
    let annotations = json!({
        "kvroute.io/model": "llama",
        "kvroute.io/adapters": "sql-lora",
        "kvroute.io/data-parallel-ranks": "0-1",
    });
    let mut x = pod("vllm-x", annotations);
    x["status"]["podIP"] = json!("127.0.0.2");
    api.put(PODS, x, true);
    // Not matching the selector.
    let mut other = pod("other", json!({"kvroute.io/model": "llama"}));
    other["metadata"]["labels"]["app.kubernetes.io/name"] = json!("something-else");
    api.put(PODS, other, true);
    // Matching, ready, but without a model anywhere: left out, counted.
    let mut bare = pod("vllm-bare", json!({}));
    bare["status"]["podIP"] = json!("127.0.0.3");
    api.put(PODS, bare, true);

    let mut source = indexd::KubernetesConfig::pods("app.kubernetes.io/name=vllm");
    source.port = indexd::config::kubernetes::PortRef::Number(18301);
    let d = Daemon::start_with(vec![], 16, kubernetes(&api, source)).await;
    let rank = |r: u32| EndpointId {
        address: SocketAddr::from(([127, 0, 0, 2], 18301)),
        rank: Some(r),
    };
    eventually("both ranks", || async {
        d.handle.replica(&rank(0)).is_some() && d.handle.replica(&rank(1)).is_some()
    })
    .await;
    let text = d.handle.metrics_text();
    assert!(
        text.contains("indexd_replica_healthy{endpoint=\"127.0.0.2:18301#1\",model=\"llama\"}"),
        "{text}"
    );
    assert_eq!(d.counter("indexd_kubernetes_endpoints"), 2.0);
    assert_eq!(d.counter("indexd_kubernetes_skipped_addresses"), 1.0);
    assert!(!text.contains("127.0.0.3"), "{text}");

    // The annotations' adapter is served (an Observe for it is recorded),
    // another is not.
    let mut client = d.client.clone();
    let observe = |model: &str, id: &str| ObserveRequest {
        model: model.into(),
        endpoint: "127.0.0.2:18301".into(),
        data_parallel_rank: Some(1),
        response_id: id.into(),
        outcome: Outcome::Ok as i32,
        http_status: 200,
        ..ObserveRequest::default()
    };
    client.observe(observe("sql-lora", "resp_1")).await.unwrap();
    let refused = client.observe(observe("chat-lora", "resp_2")).await;
    assert_eq!(refused.unwrap_err().code(), tonic::Code::InvalidArgument);
    assert_eq!(d.counter("indexd_observes_total{result=\"recorded\"}"), 1.0);

    api.delete(PODS, "vllm-x", true);
    eventually("both ranks removed and purged", || async {
        d.handle.replica(&rank(0)).is_none()
            && d.handle.replica(&rank(1)).is_none()
            && d.counter("indexd_purges_total{reason=\"removed\"}") == 2.0
    })
    .await;
    d.stop().await;
}

#[test]
fn kubernetes_flags_are_documented_and_checked() {
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_indexd"))
            .args(args)
            .output()
            .unwrap()
    };
    let help = String::from_utf8(run(&["--help"]).stdout).unwrap();
    for flag in [
        "--kubernetes-service",
        "--kubernetes-pod-selector",
        "--kubernetes-namespace",
        "--kubernetes-model",
        "--kubernetes-api-server",
    ] {
        assert!(help.contains(flag), "{flag}: {help}");
    }
    let out = run(&["--kubernetes-model", "m"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("need --kubernetes-service"),
        "{out:?}"
    );
    let out = run(&["--kubernetes-service", "Not_A_Name"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("`kubernetes.service`"),
        "{out:?}"
    );
}
