//! Tokenization under bodies a client controls: a Pick whose ids differ
//! from a replica's is routed on its own ids while its check runs beside
//! it, and one client cannot close the exactness gate; a real difference on the probe set still closes it and
//! clean rounds reopen it; bodies over the admission budget are answered at
//! once (a Pick unrouted, HTTP 503 with `Retry-After`); a Pick whose caller
//! goes away gives its share back; a body an indexd forwarded is not
//! forwarded again.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes as Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use indexd::tokenize::{AdmissionConfig, GateRules, TokenizeConfig};
use kvroute_proto::v1::{Api, DecisionKind, Mode, PickRequest, PickResponse, TokenizerSource};
use kvroute_tokenizer::{LoadOptions, TokenizeRequest, Tokenizer};

use crate::harness::eventually;
use crate::tokenize::{Daemon, MODEL, chat, get, model_dir, start_indexd_with, tokens_of};

/// A replica's `/tokenize`, answered by the real tokenizer, except:
/// - a body containing `DIVERGE`, or any body while `diverge` is set, gets
///   one id more than the truth (a tokenizer difference);
/// - a body containing `SLOW` is answered after 10 s.
#[derive(Clone)]
struct Stub {
    tokenizer: Arc<Tokenizer>,
    diverge: Arc<AtomicBool>,
    calls: Arc<AtomicUsize>,
    /// Calls that carried indexd's hop header.
    hops: Arc<AtomicUsize>,
}

async fn stub_tokenize(
    State(s): State<Stub>,
    headers: HeaderMap,
    body: Body,
) -> (StatusCode, String) {
    s.calls.fetch_add(1, Ordering::Relaxed);
    if headers.contains_key("x-kvroute-hop") {
        s.hops.fetch_add(1, Ordering::Relaxed);
    }
    let text = String::from_utf8_lossy(&body);
    if text.contains("SLOW") {
        tokio::time::sleep(Duration::from_secs(10)).await;
    }
    let mut answer = TokenizeRequest::from_json(&body)
        .and_then(|r| s.tokenizer.tokenize(&r))
        .unwrap();
    if text.contains("DIVERGE") || s.diverge.load(Ordering::Relaxed) {
        answer.tokens.push(1);
        answer.count += 1;
    }
    (StatusCode::OK, serde_json::to_string(&answer).unwrap())
}

async fn start_stub(dir: &Path) -> (SocketAddr, Stub) {
    let stub = Stub {
        tokenizer: Arc::new(Tokenizer::load(dir, MODEL, LoadOptions::default()).unwrap()),
        diverge: Arc::default(),
        calls: Arc::default(),
        hops: Arc::default(),
    };
    let app = Router::new()
        .route("/tokenize", post(stub_tokenize))
        .with_state(stub.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, stub)
}

/// indexd with the stub as its replica; `local` tokenizes locally.
async fn start(
    replica: SocketAddr,
    local: Option<&Path>,
    tweak: impl FnOnce(&mut TokenizeConfig),
) -> Daemon {
    start_indexd_with(replica, local, |c| tweak(&mut c.tokenize)).await
}

fn pick(body: Vec<u8>) -> PickRequest {
    PickRequest {
        model: MODEL.into(),
        block_size: 4,
        mode: Mode::Precise.into(),
        request_id: "r".into(),
        body: body.into(),
        api: Api::Chat.into(),
        ..PickRequest::default()
    }
}

async fn pick_body(d: &mut Daemon, body: Vec<u8>) -> PickResponse {
    d.client.pick(pick(body)).await.unwrap().into_inner()
}

async fn metric_shows(d: &Daemon, line: &str) {
    let url = format!("{}/metrics", d.http);
    eventually(line, || {
        let url = url.clone();
        async move { get(&url).await.lines().any(|l| l == line) }
    })
    .await;
}

fn gate_line(state: u8) -> String {
    format!("indexd_tokenizer_gate{{model=\"{MODEL}\"}} {state}")
}

/// Rules under which every live request is shadow-checked and a closed gate
/// retries its probes within a fraction of a second.
fn eager(c: &mut TokenizeConfig) {
    c.gate = GateRules {
        shadow_per_second: 1e6,
        close_after_mismatches: 3,
        mismatch_window: Duration::from_secs(600),
        reopen_after_rounds: 2,
        reopen_backoff: Duration::from_millis(100),
        ..GateRules::default()
    };
}

/// The shadow mismatches counted so far, `n`: shown on the metrics page.
fn mismatches(n: u32) -> String {
    format!(
        "indexd_tokenizer_checks_total{{model=\"{MODEL}\",kind=\"shadow\",result=\"mismatch\"}} {n}"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_cannot_close_the_gate_and_clean_rounds_reopen_it() {
    let dir = model_dir();
    let (addr, stub) = start_stub(&dir).await;
    let mut d = start(addr, Some(&dir), eager).await;
    metric_shows(&d, &gate_line(1)).await;
    let truth = Tokenizer::load(&dir, MODEL, LoadOptions::default()).unwrap();

    // One odd body sent again and again: each Pick is routed on its local
    // ids at once, its check beside it counts the difference, and the gate
    // stays open.
    let odd = chat("DIVERGE: an input the local tokenizer gets wrong");
    for n in 1..=8 {
        let a = pick_body(&mut d, odd.clone()).await;
        assert_eq!(a.tokenizer, TokenizerSource::Local as i32);
        assert_eq!(a.prompt_tokens as usize, tokens_of(&truth, &odd).len());
        // The check ends after the Pick's answer: wait for it, so that the
        // next Pick's is not skipped as one already in flight.
        metric_shows(&d, &mismatches(n)).await;
    }
    // Ordinary requests are answered locally (and agree).
    let plain = chat("an ordinary request");
    let a = pick_body(&mut d, plain.clone()).await;
    assert_eq!(a.tokenizer, TokenizerSource::Local as i32);
    assert_eq!(a.prompt_tokens as usize, tokens_of(&truth, &plain).len());
    metric_shows(
        &d,
        &format!(
            "indexd_tokenizer_checks_total{{model=\"{MODEL}\",kind=\"shadow\",result=\"agree\"}} 1"
        ),
    )
    .await;
    let metrics = get(&format!("{}/metrics", d.http)).await;
    assert!(metrics.lines().any(|l| l == gate_line(1)), "{metrics}");
    let ready = get(&format!("{}/readyz", d.http)).await;
    assert!(
        ready.contains("tokenizer tiny: open (8 live requests whose local ids differed from a replica's; 1 distinct bodies within 600s, 3 close it)"),
        "{ready}"
    );
    // The stand-in serves no chat render endpoint: said too.
    assert!(
        ready.contains("replica tokenizer: no render endpoints"),
        "{ready}"
    );

    // Differences on three distinct bodies are the tokenizer's: closed.
    pick_body(&mut d, chat("DIVERGE: a second body")).await;
    metric_shows(&d, &mismatches(9)).await;
    pick_body(&mut d, chat("DIVERGE: a third body")).await;
    metric_shows(&d, &gate_line(2)).await;
    let ready = get(&format!("{}/readyz", d.http)).await;
    assert!(
        ready.contains("tokenizer tiny: closed (live requests of 3 distinct bodies"),
        "{ready}"
    );
    // The probe set agrees: two clean rounds after the backoff reopen it.
    metric_shows(&d, &gate_line(1)).await;
    let metrics = get(&format!("{}/metrics", d.http)).await;
    for transition in [
        "from=\"open\",to=\"closed\",reason=\"shadow_mismatches\"} 1",
        "from=\"closed\",to=\"open\",reason=\"probes_clean\"} 1",
    ] {
        assert!(
            metrics.contains(&format!(
                "indexd_tokenizer_gate_transitions_total{{model=\"{MODEL}\",{transition}"
            )),
            "{transition}\n{metrics}"
        );
    }
    assert!(stub.calls.load(Ordering::Relaxed) > 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_mismatch_closes_the_gate_until_clean_rounds_reopen_it() {
    let dir = model_dir();
    let (addr, stub) = start_stub(&dir).await;
    let d = start(addr, Some(&dir), |c| {
        eager(c);
        c.gate.interval = Duration::from_millis(200);
    })
    .await;
    metric_shows(&d, &gate_line(1)).await;
    stub.diverge.store(true, Ordering::Relaxed);
    metric_shows(&d, &gate_line(2)).await;
    let ready = get(&format!("{}/readyz", d.http)).await;
    assert!(ready.contains("tokenizer tiny: closed (probe"), "{ready}");
    // While the replica still differs, the gate stays closed.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let metrics = get(&format!("{}/metrics", d.http)).await;
    assert!(metrics.lines().any(|l| l == gate_line(2)), "{metrics}");
    stub.diverge.store(false, Ordering::Relaxed);
    metric_shows(&d, &gate_line(1)).await;
    metric_shows(
        &d,
        &format!(
            "indexd_tokenizer_gate_transitions_total{{model=\"{MODEL}\",from=\"closed\",to=\"open\",reason=\"probes_clean\"}} 1"
        ),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_over_the_budget_are_answered_at_once_and_a_gone_caller_gives_its_share_back() {
    let dir = model_dir();
    let (addr, _stub) = start_stub(&dir).await;
    // The replicas tokenize (no local tokenizer); one body at a time.
    let mut d = start(addr, None, |c| {
        c.replica_timeout = Duration::from_secs(30);
        c.admission = AdmissionConfig {
            max_bytes: 1 << 20,
            max_concurrent: 1,
            small_body_bytes: 1 << 10,
            reserved_bytes: 0,
            reserved_concurrent: 0,
            retry_after: Duration::from_secs(3),
        };
    })
    .await;
    // A body the replica takes 10 s over holds the only place.
    let mut client = d.client.clone();
    let slow = tokio::spawn(async move { client.pick(pick(chat("SLOW"))).await });
    metric_shows(&d, "indexd_tokenize_inflight_bodies 1").await;

    let a = pick_body(&mut d, chat("an ordinary request")).await;
    assert_eq!(a.decision, DecisionKind::Untokenized as i32);
    assert!(a.reason.contains("tokenization budget"), "{}", a.reason);
    let r = reqwest::Client::new()
        .post(format!("{}/tokenize", d.http))
        .body(chat("an ordinary request"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "3");
    let metrics = get(&format!("{}/metrics", d.http)).await;
    for line in [
        "indexd_tokenize_refused_total{path=\"pick\",reason=\"concurrency\"} 1",
        "indexd_tokenize_refused_total{path=\"tokenize\",reason=\"concurrency\"} 1",
    ] {
        assert!(metrics.contains(line), "{line}\n{metrics}");
    }
    let ready = get(&format!("{}/readyz", d.http)).await;
    assert!(
        ready.contains("tokenize admission: 2 bodies refused before any work since start")
            && ready.contains("(tokenize, concurrency)"),
        "{ready}"
    );

    // The slow Pick's caller goes away: its work is cancelled and the place
    // returns long before the replica would have answered.
    slow.abort();
    metric_shows(&d, "indexd_tokenize_cancelled_total{path=\"pick\"} 1").await;
    metric_shows(&d, "indexd_tokenize_inflight_bodies 0").await;
    let a = pick_body(&mut d, chat("an ordinary request")).await;
    assert_ne!(a.decision, DecisionKind::Untokenized as i32, "{}", a.reason);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_body_is_not_forwarded_again() {
    let dir = model_dir();
    let (addr, stub) = start_stub(&dir).await;
    let d = start(addr, None, |_| {}).await;
    let http = reqwest::Client::new();
    // indexd marks what it forwards.
    let r = http
        .post(format!("{}/tokenize", d.http))
        .body(chat("forwarded once"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-kvroute-tokenizer"], "replica");
    assert_eq!(stub.hops.load(Ordering::Relaxed), 1);
    // And refuses what carries the mark.
    let calls = stub.calls.load(Ordering::Relaxed);
    let r = http
        .post(format!("{}/tokenize", d.http))
        .header("x-kvroute-hop", "1")
        .body(chat("forwarded twice"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 508);
    assert_eq!(stub.calls.load(Ordering::Relaxed), calls, "not forwarded");
    let metrics = get(&format!("{}/metrics", d.http)).await;
    assert!(
        metrics.contains("indexd_tokenize_refused_total{path=\"tokenize\",reason=\"loop\"} 1"),
        "{metrics}"
    );
}

/// A metric's value on a Prometheus page.
fn value(page: &str, series: &str) -> f64 {
    page.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_one_salt_sent_is_not_cached_for_another() {
    let dir = model_dir();
    let (addr, _stub) = start_stub(&dir).await;
    let mut d = start(addr, Some(&dir), |c| c.gate.shadow_per_second = 0.0).await;
    metric_shows(&d, &gate_line(1)).await;
    let salted = |salt: &str| {
        serde_json::json!({
            "model": MODEL,
            "messages": [{"role": "user", "content": "A conversation one tenant sent, long enough to be worth caching. ".repeat(20)}],
            "cache_salt": salt,
        })
        .to_string()
        .into_bytes()
    };
    let url = format!("{}/metrics", d.http);
    let hits = format!("indexd_tokenizer_cache_hits_total{{model=\"{MODEL}\"}}");
    let misses = format!("indexd_tokenizer_cache_misses_total{{model=\"{MODEL}\"}}");
    let counts = |page: String| (value(&page, &hits), value(&page, &misses));
    pick_body(&mut d, salted("tenant-a")).await;
    let (h0, m0) = counts(get(&url).await);
    // The same text again under its salt: found.
    pick_body(&mut d, salted("tenant-a")).await;
    let (h1, m1) = counts(get(&url).await);
    assert!(h1 > h0, "tenant-a's second send hits: {h0} -> {h1}");
    assert_eq!(m1, m0, "and misses nothing");
    // Under another salt: encoded afresh.
    pick_body(&mut d, salted("tenant-b")).await;
    let (h2, m2) = counts(get(&url).await);
    assert!(m2 > m1, "tenant-b's first send misses: {m1} -> {m2}");
    assert_eq!(h2, h1, "and finds nothing of tenant-a's");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pick_encodes_no_more_than_the_blocks_it_keys() {
    let dir = model_dir();
    let (addr, stub) = start_stub(&dir).await;
    // 3 keys of 4 tokens: encoding stops at 12 ids.
    let mut d = start_indexd_with(addr, Some(&dir), |c| {
        c.max_pick_keys = 3;
        eager(&mut c.tokenize);
    })
    .await;
    metric_shows(&d, &gate_line(1)).await;
    let truth = Tokenizer::load(&dir, MODEL, LoadOptions::default()).unwrap();
    let long = chat(&"a conversation far longer than three blocks ".repeat(20));
    assert!(tokens_of(&truth, &long).len() > 100);
    let a = pick_body(&mut d, long).await;
    assert_eq!(a.tokenizer, TokenizerSource::Local as i32);
    assert_eq!(a.prompt_tokens, 12, "encoding stopped at the cap");
    // Its shadow check, beside it, compared the ids it had with the
    // replica's first 12.
    metric_shows(
        &d,
        &format!(
            "indexd_tokenizer_checks_total{{model=\"{MODEL}\",kind=\"shadow\",result=\"agree\"}} 1"
        ),
    )
    .await;
    let metrics = get(&format!("{}/metrics", d.http)).await;
    assert!(!metrics.contains("result=\"mismatch\"} 1"), "{metrics}");
    assert!(stub.calls.load(Ordering::Relaxed) >= 1);
    // HTTP's /tokenize answers every id.
    let r = reqwest::Client::new()
        .post(format!("{}/tokenize", d.http))
        .body(chat(
            &"a conversation far longer than three blocks ".repeat(20),
        ))
        .send()
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
    assert!(v["count"].as_u64().unwrap() > 100, "{v}");
}
