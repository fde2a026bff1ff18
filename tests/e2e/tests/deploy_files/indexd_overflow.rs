//! What the samples' circuit breakers on the indexd cluster do to requests
//! when they overflow, in real Envoy with the built filter: the thresholds of
//! `envoy/envoy.yaml` (the other samples carry the same: `hardening.rs`) with
//! `max_requests` lowered to [`HELD`], and the filter's default breaker
//! settings (the samples set none).
//!
//! A stand-in indexd holds every Pick until the test lets them go, so the
//! cluster stays full for as long as the test needs, with no timing to race:
//! a request answered while the Picks are still held was neither queued
//! behind them nor sent to indexd.
//!
//! Envoy refuses an overflowing Pick inside the filter's dispatch call
//! (`proxy_dispatch_grpc_call` answers `InternalFailure`; no gRPC status ever
//! arrives). The filter takes that as indexd being busy (`index_busy`), not
//! failing: the first test checks that every request is answered at once,
//! unrouted; the second that the filter's breaker stays closed, so routing
//! goes on for everyone.

use std::net::SocketAddr;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kvroute_e2e::envoy::{cluster_route, http_cluster, http_listener};
use kvroute_e2e::{Envoy, EnvoyConfig, http};
use serde_json::json;

use super::hardening::indexd_clusters;
use super::standins::{
    CHAT, PRECISE, Reply, Req, Script, Stub, assert_no_wasm_failure, decision, gateway_config,
    pick_answer, plugin_config, replica, serve,
};

/// The Picks the stand-in holds: the cluster's `max_requests` in this test.
const HELD: usize = 2;
/// The longest anything here waits: a held Pick for its release, a request
/// for its answer, the test for the held Picks to arrive.
const BOUND: Duration = Duration::from_secs(20);
/// Generous for a Pick Envoy refuses at once; far less than [`BOUND`], the
/// hold a queued Pick would wait out.
const REFUSED_WITHIN: Duration = Duration::from_secs(5);
/// The decisions of a request that went on without indexd's ranking.
const UNROUTED: [&str; 3] = ["index_busy", "index_unavailable", "breaker_open"];

/// A gate the stand-in's Picks wait at until [`Gate::open`] (or [`BOUND`]).
#[derive(Default)]
struct Gate {
    open: Mutex<bool>,
    opened: Condvar,
}

impl Gate {
    fn wait(&self) {
        let open = self.open.lock().unwrap();
        let _ = self
            .opened
            .wait_timeout_while(open, BOUND, |open| !*open)
            .unwrap();
    }

    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }
}

/// Opens the gate when dropped: however the test ends, the held Picks are
/// let go.
struct Release(Arc<Gate>);

impl Drop for Release {
    fn drop(&mut self) {
        self.0.open();
    }
}

/// indexd's stand-in (plain HTTP behind [`bridge`]): every Pick waits at the
/// gate, then names `replica` (precise); other calls get an empty message.
fn held_indexd(gate: Arc<Gate>, replica: SocketAddr) -> (Arc<Mutex<Vec<String>>>, SocketAddr) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    let addr = serve(Arc::new(move |req: &Req| {
        log.lock().unwrap().push(req.path.clone());
        if req.path.ends_with("/Pick") {
            gate.wait();
            return Reply::ok("application/grpc+proto", pick_answer(PRECISE, &[replica]));
        }
        Reply::ok("application/grpc+proto", Vec::new())
    }));
    (seen, addr)
}

/// `standins::bridge` with a route timeout past [`BOUND`] (its own is 5 s):
/// a held Pick must not end at the bridge.
fn bridge(index: SocketAddr) -> Envoy {
    let bridge_filter = json!({
        "name": "envoy.filters.http.grpc_http1_reverse_bridge",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.grpc_http1_reverse_bridge.v3.FilterConfig",
            "content_type": "application/grpc+proto",
            "withhold_grpc_frames": true
        }
    });
    Envoy::start(&EnvoyConfig::new(
        vec![http_listener(
            "grpc",
            vec![bridge_filter],
            vec![cluster_route("indexd_http", BOUND * 2)],
        )],
        vec![http_cluster("indexd_http", &[index])],
    ))
    .unwrap()
}

/// A counter or gauge of Envoy's Prometheus stats, summed over the lines
/// that name `label` (all lines if empty).
fn stat(stats: &str, name: &str, label: &str) -> u64 {
    stats
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// What one overflow did.
struct Overflow {
    /// The filter's `breaker.failures`.
    failures: u32,
    /// The decision of each request sent while the cluster was full.
    during: Vec<String>,
    /// Envoy's `upstream_rq_active_overflow` of the indexd cluster.
    overflows: u64,
    /// The filter's `kvroute_breaker_opened`.
    breaker_opened: u64,
}

/// Fills the indexd cluster with [`HELD`] held Picks, sends
/// `breaker.failures + 3` requests while they are held, lets them go, and
/// sends one more. Asserts what must hold whatever the filter's breaker
/// does: every request answered 200, those during the overflow without a
/// Pick reaching indexd and unrouted, the held ones and the one after routed.
fn overflow() -> Overflow {
    let mut breakers = indexd_clusters()[0].1["circuit_breakers"].clone();
    assert!(
        breakers["thresholds"][0]["max_requests"].as_u64().unwrap() > HELD as u64,
        "the sample's bound is already this small"
    );
    breakers["thresholds"][0]["max_requests"] = json!(HELD);

    let replicas: Vec<SocketAddr> = (0..2).map(|_| replica()).collect();
    let tokens: Vec<u32> = (1..=10).collect();
    let (_tokenizer, tok_addr) = Stub::start(
        "application/json",
        Script::Answer(
            json!({"count": 10, "max_model_len": 100, "tokens": tokens})
                .to_string()
                .into_bytes(),
        ),
    );
    let gate = Arc::new(Gate::default());
    let (seen, index_addr) = held_indexd(gate.clone(), replicas[1]);
    let release = Release(gate);
    let picks = || {
        seen.lock()
            .unwrap()
            .iter()
            .filter(|p| p.ends_with("/Pick"))
            .count()
    };

    let bridge = bridge(index_addr);
    let bridge_addr: SocketAddr = format!("127.0.0.1:{}", bridge.listener_port("grpc").unwrap())
        .parse()
        .unwrap();
    // The filter's default breaker; a Pick timeout past the hold, so that
    // only the overflow fails.
    let plugin = plugin_config(&json!({
        "breaker": {},
        "index_timeout_ms": BOUND.as_secs() * 2 * 1000,
    }));
    let failures = kvroute_filter::Config::parse(plugin.to_string().as_bytes())
        .unwrap()
        .breaker
        .failures;
    let base = gateway_config(&replicas, tok_addr, bridge_addr, &plugin);
    let resources = &base.as_json()["static_resources"];
    let mut clusters = resources["clusters"].as_array().unwrap().clone();
    let cluster = clusters.iter_mut().find(|c| c["name"] == "indexd").unwrap();
    cluster["circuit_breakers"] = breakers;
    let gateway = Envoy::start(&EnvoyConfig::new(
        resources["listeners"].as_array().unwrap().clone(),
        clusters,
    ))
    .unwrap();
    let url = format!(
        "{}/v1/chat/completions",
        gateway.listener_url("gateway").unwrap()
    );
    let send = |url: &str| http::post(url, &[], CHAT.as_bytes(), BOUND).unwrap();

    // HELD requests whose Picks fill the cluster.
    let held: Vec<_> = (0..HELD)
        .map(|_| {
            let url = url.clone();
            std::thread::spawn(move || send(&url))
        })
        .collect();
    let deadline = Instant::now() + BOUND;
    while picks() < HELD {
        assert!(
            Instant::now() < deadline,
            "{} of {HELD} Picks arrived",
            picks()
        );
        std::thread::sleep(Duration::from_millis(10));
    }

    // While they are held: answered, unrouted, no Pick reaches indexd.
    let mut during = Vec::new();
    for i in 0..failures + 3 {
        let r = http::post(&url, &[], CHAT.as_bytes(), REFUSED_WITHIN).unwrap_or_else(|e| {
            panic!(
                "request {i} during the overflow was not answered while the Picks were held \
                 (its Pick queued behind them?): {e}"
            )
        });
        assert_eq!(r.status, 200, "request {i} during the overflow: {r:?}");
        assert!(
            UNROUTED.contains(&decision(&r)),
            "request {i} during the overflow: {}",
            decision(&r)
        );
        during.push(decision(&r).to_owned());
    }
    assert_eq!(picks(), HELD, "an overflowing Pick reached indexd");
    assert!(
        held.iter().all(|h| !h.is_finished()),
        "a held request ended before its Pick was let go"
    );

    // Let go: the held requests are routed as indexd said, and so is the
    // next one (its Pick answered at once).
    drop(release);
    for h in held {
        let r = h.join().unwrap();
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(decision(&r), "precise", "a held request");
    }
    let after = send(&url);
    assert_eq!(after.status, 200, "{after:?}");
    assert_eq!(
        decision(&after),
        "precise",
        "the first request after the overflow"
    );
    assert!(
        after.body.contains(&replicas[1].to_string()),
        "not sent where indexd said: {}",
        after.body
    );
    assert_no_wasm_failure(&gateway);

    let stats = gateway.prometheus_stats().unwrap();
    let overflows = stat(
        &stats,
        "envoy_cluster_upstream_rq_active_overflow",
        "envoy_cluster_name=\"indexd\"",
    );
    // Each index_busy above is a Pick Envoy refused.
    let busy = during.iter().filter(|d| *d == "index_busy").count() as u64;
    assert!(
        overflows >= busy.max(1),
        "{overflows} overflows for {busy} index_busy:\n{stats}"
    );
    Overflow {
        failures,
        during,
        overflows,
        breaker_opened: stat(&stats, "kvroute_breaker_opened", ""),
    }
}

#[test]
fn an_overflowing_indexd_cluster_answers_every_request_unrouted_at_once() {
    let run = overflow();
    assert_eq!(run.during.len(), run.failures as usize + 3);
    eprintln!(
        "during the overflow: {:?}; {} overflows; filter breaker opened {} times",
        run.during, run.overflows, run.breaker_opened
    );
}

#[test]
fn an_overflowing_indexd_cluster_leaves_the_filters_breaker_closed() {
    let run = overflow();
    assert_eq!(
        run.breaker_opened, 0,
        "the filter's breaker opened on Envoy's overflow; decisions {:?}",
        run.during
    );
    assert!(
        run.during.iter().all(|d| d != "breaker_open"),
        "requests skipped indexd for everyone: {:?}",
        run.during
    );
}
