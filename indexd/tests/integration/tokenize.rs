//! Picks that carry their request body, and indexd's vLLM-compatible
//! `/tokenize` and `/v1/responses/render`: a real local tokenizer (the
//! tiny-llama directory the test tiers build) behind its exactness gate, and
//! a replica stand-in answering the tokenizer endpoints with the same
//! tokenizer — or, to show the gate working, a local copy whose chat
//! template was changed, which the gate must catch and route around.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Bytes as Body;
use axum::extract::State;
use axum::routing::post;
use indexd::config::EndpointConfig;
use indexd::tokenize::{TokenizeConfig, TokenizerSpec};
use indexd::{Config, Server};
use kvroute_proto::v1::index_client::IndexClient;
use kvroute_proto::v1::{Api, DecisionKind, Mode, PickRequest, PickResponse, TokenizerSource};
use kvroute_tokenizer::{
    LoadOptions, MessagesRequest, ResponsesRequest, TokenizeRequest, Tokenizer,
};
use tokio_util::sync::CancellationToken;

use crate::harness::eventually;

pub(super) const MODEL: &str = "tiny";

/// The tiny-llama model directory (`KVROUTE_VLLM_MODEL`, default
/// `~/.cache/kvroute/tiny-llama`, written by tests/vllm/ and .ci/deps.sh).
pub(super) fn model_dir() -> PathBuf {
    let dir = std::env::var_os("KVROUTE_VLLM_MODEL").map_or_else(
        || {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/kvroute/tiny-llama")
        },
        PathBuf::from,
    );
    assert!(
        dir.join("tokenizer.json").is_file(),
        "no tiny-llama tokenizer in {} (run .ci/deps.sh, or set KVROUTE_VLLM_MODEL)",
        dir.display()
    );
    dir
}

/// A replica's tokenizer endpoints, answered by `tokenizer`; counts calls.
pub(super) struct Replica {
    pub(super) addr: std::net::SocketAddr,
    pub(super) calls: Arc<AtomicUsize>,
    /// Added to every `count_tokens` answer (a replica that counts
    /// differently from this tokenizer).
    pub(super) count_skew: Arc<AtomicUsize>,
}

#[derive(Clone)]
struct ReplicaState {
    tokenizer: Arc<Tokenizer>,
    calls: Arc<AtomicUsize>,
    /// Refuse requests with tools, as vLLM does without
    /// `--enable-auto-tool-choice`.
    refuse_tools: bool,
    count_skew: Arc<AtomicUsize>,
}

/// vLLM's answer to tools when auto tool choice is off.
fn tools_refused(s: &ReplicaState, body: &[u8]) -> Option<(axum::http::StatusCode, String)> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let with_tools = v["tools"].as_array().is_some_and(|t| !t.is_empty());
    (s.refuse_tools && with_tools).then(|| {
        (
            axum::http::StatusCode::BAD_REQUEST,
            serde_json::json!({"error": {"message": "\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set", "type": "BadRequestError", "code": 400}}).to_string(),
        )
    })
}

async fn replica_tokenize(
    State(s): State<ReplicaState>,
    body: Body,
) -> (axum::http::StatusCode, String) {
    s.calls.fetch_add(1, Ordering::Relaxed);
    if let Some(refusal) = tools_refused(&s, &body) {
        return refusal;
    }
    match TokenizeRequest::from_json(&body).and_then(|r| s.tokenizer.tokenize(&r)) {
        Ok(a) => (axum::http::StatusCode::OK, serde_json::to_string(&a).unwrap()),
        Err(e) => (
            axum::http::StatusCode::BAD_REQUEST,
            serde_json::json!({"error": {"message": e.to_string(), "type": "BadRequestError", "code": 400}}).to_string(),
        ),
    }
}

async fn replica_render(
    State(s): State<ReplicaState>,
    body: Body,
) -> (axum::http::StatusCode, String) {
    s.calls.fetch_add(1, Ordering::Relaxed);
    if let Some(refusal) = tools_refused(&s, &body) {
        return refusal;
    }
    match ResponsesRequest::from_json(&body).and_then(|r| s.tokenizer.render_responses(&r)) {
        Ok(a) => (
            axum::http::StatusCode::OK,
            serde_json::to_string(&a).unwrap(),
        ),
        Err(e) => (
            axum::http::StatusCode::BAD_REQUEST,
            serde_json::json!({"error": {"message": e.to_string(), "code": 400}}).to_string(),
        ),
    }
}

/// vLLM's `/v1/messages/count_tokens`: the Messages prompt's length, or
/// Anthropic's error object.
async fn replica_count_tokens(
    State(s): State<ReplicaState>,
    body: Body,
) -> (axum::http::StatusCode, String) {
    s.calls.fetch_add(1, Ordering::Relaxed);
    let counted = MessagesRequest::from_json(&body)
        .map(MessagesRequest::for_count_tokens)
        .and_then(|r| s.tokenizer.tokenize_messages(&r));
    match counted {
        Ok(ids) => (
            axum::http::StatusCode::OK,
            serde_json::json!({"input_tokens": ids.len() + s.count_skew.load(Ordering::Relaxed)})
                .to_string(),
        ),
        Err(e) => (
            axum::http::StatusCode::BAD_REQUEST,
            serde_json::json!({"type": "error", "error": {"type": "BadRequestError", "message": e.to_string()}}).to_string(),
        ),
    }
}

pub(super) async fn start_replica(dir: &Path) -> Replica {
    start_replica_with(dir, false).await
}

async fn start_replica_with(dir: &Path, refuse_tools: bool) -> Replica {
    let tokenizer = Arc::new(Tokenizer::load(dir, MODEL, LoadOptions::default()).unwrap());
    let calls = Arc::new(AtomicUsize::new(0));
    let count_skew = Arc::new(AtomicUsize::new(0));
    let state = ReplicaState {
        tokenizer,
        calls: calls.clone(),
        refuse_tools,
        count_skew: count_skew.clone(),
    };
    let app = Router::new()
        .route("/tokenize", post(replica_tokenize))
        .route("/v1/responses/render", post(replica_render))
        .route("/v1/messages/count_tokens", post(replica_count_tokens))
        .with_state(state);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    Replica {
        addr,
        calls,
        count_skew,
    }
}

/// An indexd in this process, stopped on drop.
pub(super) struct Daemon {
    pub(super) client: IndexClient<tonic::transport::Channel>,
    pub(super) http: String,
    stop: CancellationToken,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn start_indexd(replica: std::net::SocketAddr, local_dir: &Path) -> Daemon {
    start_indexd_with(replica, Some(local_dir), |_| {}).await
}

/// indexd with `replica` as its one endpoint (block size 4), tokenizing
/// locally with `local`'s tokenizer if given, its configuration then
/// changed by `tweak`.
pub(super) async fn start_indexd_with(
    replica: std::net::SocketAddr,
    local: Option<&Path>,
    tweak: impl FnOnce(&mut Config),
) -> Daemon {
    let mut config = Config::new(vec![EndpointConfig::new(replica, MODEL)]);
    config.grpc_listen = "127.0.0.1:0".parse().unwrap();
    config.http_listen = "127.0.0.1:0".parse().unwrap();
    config.block_size = kvroute_proto::BlockSize::new(4).unwrap();
    config.tokenize = TokenizeConfig {
        tokenizers: local
            .map(|dir| TokenizerSpec {
                model: MODEL.into(),
                dir: dir.to_path_buf(),
                max_model_len: None,
                chat_template: None,
                trust_request_chat_template: false,
            })
            .into_iter()
            .collect(),
        ..TokenizeConfig::default()
    };
    tweak(&mut config);
    let bound = Server::bind(config).await.unwrap();
    let (grpc, http) = (bound.grpc_addr(), bound.http_addr());
    let stop = CancellationToken::new();
    let s = stop.clone();
    tokio::spawn(async move { bound.serve(s).await });
    let client = IndexClient::connect(format!("http://{grpc}"))
        .await
        .unwrap();
    Daemon {
        client,
        http: format!("http://{http}"),
        stop,
    }
}

pub(super) async fn get(url: &str) -> String {
    reqwest::get(url).await.unwrap().text().await.unwrap()
}

pub(super) async fn wait_for_gate(d: &Daemon, state: u8) {
    let want = format!("indexd_tokenizer_gate{{model=\"{MODEL}\"}} {state}");
    let url = format!("{}/metrics", d.http);
    eventually(&format!("gate {state}"), || {
        let url = url.clone();
        let want = want.clone();
        async move { get(&url).await.contains(&want) }
    })
    .await;
}

pub(super) fn chat(content: &str) -> Vec<u8> {
    serde_json::json!({
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You route requests."},
            {"role": "user", "content": content},
        ],
        "max_tokens": 16,
        "stream": true,
        "cache_salt": "tenant-a",
    })
    .to_string()
    .into_bytes()
}

pub(super) async fn pick_body(d: &mut Daemon, api: Api, body: Vec<u8>) -> PickResponse {
    d.client
        .pick(PickRequest {
            model: MODEL.into(),
            block_size: 4,
            mode: Mode::Precise.into(),
            request_id: "r".into(),
            body: body.into(),
            api: api.into(),
            ..PickRequest::default()
        })
        .await
        .unwrap()
        .into_inner()
}

/// Sends only the head of a `POST /tokenize` claiming `length` body bytes and
/// returns the head of the answer (within 10 s).
async fn oversized_request_head(http: &str, length: usize) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let authority = http.trim_start_matches("http://");
    let mut s = tokio::net::TcpStream::connect(authority).await.unwrap();
    let head = format!(
        "POST /tokenize HTTP/1.1\r\nhost: {authority}\r\ncontent-type: application/json\r\n\
         content-length: {length}\r\n\r\n"
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let mut answer = vec![0u8; 4096];
    let n = tokio::time::timeout(std::time::Duration::from_secs(10), s.read(&mut answer))
        .await
        .expect("no answer to an oversized Content-Length: the server waited for the body")
        .unwrap();
    String::from_utf8_lossy(&answer[..n]).into_owned()
}

/// A replica and an indexd tokenizing `dir`'s model locally, its gate open,
/// and the tokenizer to check their answers against.
pub(super) async fn gate_open(dir: &Path) -> (Replica, Daemon, Tokenizer) {
    let replica = start_replica(dir).await;
    let d = start_indexd(replica.addr, dir).await;
    wait_for_gate(&d, 1).await;
    let truth = Tokenizer::load(dir, MODEL, LoadOptions::default()).unwrap();
    (replica, d, truth)
}

/// The token ids `truth` gives a `/tokenize` body.
pub(super) fn tokens_of(truth: &Tokenizer, body: &[u8]) -> Vec<u32> {
    truth
        .tokenize(&TokenizeRequest::from_json(body).unwrap())
        .unwrap()
        .tokens
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn picks_with_bodies_are_tokenized_locally_once_the_gate_opens() {
    let dir = model_dir();
    let (replica, mut d, truth) = gate_open(&dir).await;

    let body = chat("How long is a block?");
    let want = tokens_of(&truth, &body);
    let calls = replica.calls.load(Ordering::Relaxed);
    let a = pick_body(&mut d, Api::Chat, body).await;
    assert_eq!(a.tokenizer, TokenizerSource::Local as i32);
    assert_eq!(a.prompt_tokens as usize, want.len());
    assert_eq!(
        a.decision,
        DecisionKind::Load as i32,
        "no events: ranked by load"
    );
    assert!(!a.candidates.is_empty());

    // Completions and Responses bodies too.
    let completion =
        serde_json::json!({"model": MODEL, "prompt": "The quick brown fox"}).to_string();
    let a = pick_body(&mut d, Api::Completions, completion.into_bytes()).await;
    assert_eq!(a.tokenizer, TokenizerSource::Local as i32);
    let responses =
        serde_json::json!({"model": MODEL, "instructions": "Be brief.", "input": "Hi"}).to_string();
    let a = pick_body(&mut d, Api::Responses, responses.clone().into_bytes()).await;
    assert_eq!(a.tokenizer, TokenizerSource::Local as i32);
    let rendered = truth
        .render_responses(&ResponsesRequest::from_json(responses.as_bytes()).unwrap())
        .unwrap();
    assert_eq!(a.prompt_tokens as usize, rendered.token_ids.len());

    // A body vLLM would refuse: no override, and said why.
    let bad = br#"{"model":"tiny","messages":"not a list"}"#.to_vec();
    let a = pick_body(&mut d, Api::Chat, bad).await;
    assert_eq!(a.decision, DecisionKind::Untokenized as i32);
    assert!(a.candidates.is_empty());
    assert!(
        replica.calls.load(Ordering::Relaxed) - calls <= 1,
        "local tokenization called the replica (beyond one shadow check)"
    );

    // indexd's own /tokenize answers like vLLM's, locally.
    let http = reqwest::Client::new();
    let r = http
        .post(format!("{}/tokenize", d.http))
        .body(chat("How long is a block?"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-kvroute-tokenizer"], "local");
    let v: serde_json::Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
    assert_eq!(v["count"], want.len());
    assert_eq!(v["tokens"], serde_json::json!(want));
    let r = http
        .post(format!("{}/tokenize", d.http))
        .body(r#"{"model":"nobody","prompt":"x"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let r = http
        .post(format!("{}/v1/responses/render", d.http))
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    // Deeply nested and oversized bodies: vLLM-style refusals, no panic.
    let deep = format!(
        r#"{{"model":"tiny","messages":[{{"role":"user","content":{}1{}}}]}}"#,
        "[".repeat(5_000),
        "]".repeat(5_000)
    );
    let r = http
        .post(format!("{}/tokenize", d.http))
        .body(deep)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    // An oversized body is refused on its Content-Length, before any of it
    // is read. (Uploading the 17 MiB would race the server's early answer
    // against the kernel's reset of a socket closed with unread data.)
    let head = oversized_request_head(&d.http, 17 << 20).await;
    assert!(head.starts_with("HTTP/1.1 413"), "{head}");
    let r = http
        .post(format!("{}/tokenize", d.http))
        .body(r#"{"model":"tiny","prompt":"still serving"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let metrics = get(&format!("{}/metrics", d.http)).await;
    assert!(metrics.contains("indexd_tokenize_total{source=\"local\",result=\"ok\"}"));
    assert!(metrics.contains("indexd_tokenizer_cache_hits_total{model=\"tiny\"}"));
}

/// The test above runs on a multi-thread runtime, where a Pick's body is
/// tokenized on the worker itself (`block_in_place`); on a current-thread
/// runtime, where that would panic, it goes to the blocking pool and
/// answers the same.
#[tokio::test]
async fn a_current_thread_runtime_tokenizes_locally_too() {
    let dir = model_dir();
    let (_replica, mut d, truth) = gate_open(&dir).await;
    let body = chat("Which replica holds the prefix?");
    let want = tokens_of(&truth, &body);
    let a = pick_body(&mut d, Api::Chat, body).await;
    assert_eq!(a.tokenizer, TokenizerSource::Local as i32);
    assert_eq!(a.prompt_tokens as usize, want.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_local_template_closes_the_gate_and_replicas_tokenize() {
    let dir = model_dir();
    // The local copy renders the user role differently from the replica.
    let corrupt = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), corrupt.path().join(entry.file_name())).unwrap();
    }
    let template = std::fs::read_to_string(dir.join("chat_template.jinja")).unwrap();
    let changed = template.replace("| upper", "| lower");
    assert_ne!(changed, template, "the template has no `| upper` to change");
    std::fs::write(corrupt.path().join("chat_template.jinja"), changed).unwrap();

    let replica = start_replica(&dir).await;
    let mut d = start_indexd(replica.addr, corrupt.path()).await;
    wait_for_gate(&d, 2).await;
    let ready = get(&format!("{}/readyz", d.http)).await;
    assert!(ready.contains("tokenizer tiny: closed (probe"), "{ready}");
    let metrics = get(&format!("{}/metrics", d.http)).await;
    assert!(
        metrics.contains(
            "indexd_tokenizer_checks_total{model=\"tiny\",kind=\"probe\",result=\"mismatch\"} 1"
        ),
        "{metrics}"
    );

    // Routing keeps working, with the replica's (correct) ids.
    let truth = Tokenizer::load(&dir, MODEL, LoadOptions::default()).unwrap();
    let body = chat("Which tokenizer?");
    let want = truth
        .tokenize(&TokenizeRequest::from_json(&body).unwrap())
        .unwrap()
        .tokens;
    let calls = replica.calls.load(Ordering::Relaxed);
    let a = pick_body(&mut d, Api::Chat, body).await;
    assert_eq!(a.tokenizer, TokenizerSource::Replica as i32);
    assert_eq!(a.prompt_tokens as usize, want.len());
    assert_eq!(replica.calls.load(Ordering::Relaxed), calls + 1);
    let r = reqwest::Client::new()
        .post(format!("{}/tokenize", d.http))
        .body(chat("Which tokenizer?"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-kvroute-tokenizer"], "replica");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_a_replica_refuses_by_its_flags_leave_the_gate_to_the_others() {
    // vLLM without --enable-auto-tool-choice refuses every request with
    // tools; the gate opens on the other probes, and says what it left out.
    let dir = model_dir();
    let replica = start_replica_with(&dir, true).await;
    let d = start_indexd(replica.addr, &dir).await;
    wait_for_gate(&d, 1).await;
    let metrics = get(&format!("{}/metrics", d.http)).await;
    let refused = metrics
        .lines()
        .find(|l| {
            l.starts_with(
                "indexd_tokenizer_checks_total{model=\"tiny\",kind=\"any\",result=\"refused\"}",
            )
        })
        .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .unwrap();
    assert!(refused >= 2, "the tool probes were not refused: {metrics}");
    assert!(metrics.contains(
        "indexd_tokenizer_checks_total{model=\"tiny\",kind=\"probe\",result=\"mismatch\"} 0"
    ));
}
