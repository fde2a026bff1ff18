//! Stand-ins for the filter's peers in real-Envoy tests: vLLM replicas that
//! answer with their own address, scripted tokenizer and indexd servers, and
//! the gateway's Envoy configuration.
//!
//! indexd's scripted stand-in speaks plain HTTP/1.1: a second Envoy in front
//! of it ([`bridge`]) runs `grpc_http1_reverse_bridge`, which turns the
//! filter's gRPC calls into `POST /kvroute.v1.Index/<Method>` with the bare
//! protobuf message and frames the answer (a non-200 status becomes a gRPC
//! error status).

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvroute_e2e::envoy::{
    cluster_route, grpc_cluster, http_cluster, http_listener, inference_cluster, kvroute_filters,
};
use kvroute_e2e::{Envoy, EnvoyConfig, artifacts, http};
use serde_json::{Value, json};

pub mod faults;

pub const OVERRIDE: &str = "x-gateway-destination-endpoint";
pub const DECISION: &str = "x-kvroute-decision";
pub const TIMEOUT: Duration = Duration::from_secs(10);
pub const CHAT: &str =
    r#"{"model":"m","messages":[{"role":"user","content":"hello there"}],"cache_salt":"t"}"#;

// ---------------------------------------------------------------- stand-ins

#[derive(Debug, Clone)]
pub struct Req {
    pub path: String,
    /// Header names lower-cased, with their values.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub content_type: &'static str,
    pub body: Vec<u8>,
    pub delay: Duration,
}

impl Reply {
    pub fn ok(content_type: &'static str, body: impl Into<Vec<u8>>) -> Self {
        Self {
            status: 200,
            content_type,
            body: body.into(),
            delay: Duration::ZERO,
        }
    }
}

pub type Handler = Arc<dyn Fn(&Req) -> Reply + Send + Sync>;

/// A threaded HTTP/1.1 server (keep-alive, chunked request bodies).
pub fn serve(handler: Handler) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { return };
            let handler = handler.clone();
            std::thread::spawn(move || connection(stream, &handler));
        }
    });
    addr
}

pub fn connection(stream: TcpStream, handler: &Handler) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut writer = stream;
    while let Some(req) = read_request(&mut reader) {
        let reply = handler(&req);
        std::thread::sleep(reply.delay);
        let head = format!(
            "HTTP/1.1 {} X\r\ncontent-type: {}\r\ncontent-length: {}\r\n\r\n",
            reply.status,
            reply.content_type,
            reply.body.len()
        );
        if writer.write_all(head.as_bytes()).is_err() || writer.write_all(&reply.body).is_err() {
            return;
        }
    }
}

pub fn read_line(reader: &mut impl BufRead) -> Option<String> {
    let mut line = String::new();
    (reader.read_line(&mut line).ok()? > 0).then_some(line)
}

pub fn read_request(reader: &mut BufReader<TcpStream>) -> Option<Req> {
    let request_line = read_line(reader)?;
    let path = request_line.split(' ').nth(1)?.to_owned();
    let (mut len, mut chunked) = (0usize, false);
    let mut headers = Vec::new();
    loop {
        let line = read_line(reader)?;
        let lower = line.to_ascii_lowercase();
        if let Some((name, value)) = lower.split_once(':') {
            headers.push((name.trim().to_owned(), value.trim().to_owned()));
        }
        if let Some(v) = lower.strip_prefix("content-length:") {
            len = v.trim().parse().ok()?;
        }
        if lower.starts_with("transfer-encoding:") && lower.contains("chunked") {
            chunked = true;
        }
        if line == "\r\n" {
            break;
        }
    }
    let mut body = Vec::new();
    if chunked {
        loop {
            let size = usize::from_str_radix(read_line(reader)?.trim(), 16).ok()?;
            if size == 0 {
                while read_line(reader)? != "\r\n" {}
                break;
            }
            let mut chunk = vec![0; size + 2];
            reader.read_exact(&mut chunk).ok()?;
            chunk.truncate(size);
            body.extend(chunk);
        }
    } else {
        body.resize(len, 0);
        reader.read_exact(&mut body).ok()?;
    }
    Some(Req {
        path,
        headers,
        body,
    })
}

/// A vLLM replica stand-in: answers with its own address; Responses get an
/// id naming it (JSON or SSE).
pub fn replica() -> SocketAddr {
    let me = Arc::new(Mutex::new(String::new()));
    let name = me.clone();
    let addr = serve(Arc::new(move |req: &Req| {
        let me = name.lock().unwrap().clone();
        let port = me.rsplit(':').next().unwrap_or_default().to_owned();
        if req.path.starts_with("/v1/responses") {
            if String::from_utf8_lossy(&req.body).contains("\"stream\":true") {
                let sse = format!(
                    "event: response.created\ndata: {{\"type\":\"response.created\",\"response\":{{\"id\":\"resp_sse_{port}\"}}}}\n\nevent: response.completed\ndata: {{\"type\":\"response.completed\",\"served_by\":\"{me}\"}}\n\n"
                );
                return Reply::ok("text/event-stream", sse);
            }
            let body = json!({"id": format!("resp_{port}"), "object": "response", "served_by": me});
            return Reply::ok("application/json", body.to_string());
        }
        Reply::ok("text/plain", me)
    }));
    *me.lock().unwrap() = addr.to_string();
    addr
}

/// What a scripted stand-in does next.
#[derive(Debug, Clone)]
pub enum Script {
    /// Answer with this body.
    Answer(Vec<u8>),
    /// Answer with an HTTP error status.
    Status(u16),
    /// Answer this body after a delay longer than the filter's timeout.
    Slow(Vec<u8>),
}

#[derive(Clone)]
pub struct Stub {
    script: Arc<Mutex<Script>>,
    seen: Arc<Mutex<Vec<Req>>>,
}

impl Stub {
    pub fn start(content_type: &'static str, initial: Script) -> (Self, SocketAddr) {
        let stub = Self {
            script: Arc::new(Mutex::new(initial)),
            seen: Arc::new(Mutex::new(Vec::new())),
        };
        let s = stub.clone();
        let addr = serve(Arc::new(move |req: &Req| {
            s.seen.lock().unwrap().push(req.clone());
            match s.script.lock().unwrap().clone() {
                Script::Answer(body) => Reply::ok(content_type, body),
                Script::Status(status) => Reply {
                    status,
                    ..Reply::ok(content_type, Vec::new())
                },
                Script::Slow(body) => Reply {
                    delay: Duration::from_millis(1500),
                    ..Reply::ok(content_type, body)
                },
            }
        }));
        (stub, addr)
    }

    pub fn set(&self, script: Script) {
        *self.script.lock().unwrap() = script;
    }

    pub fn seen(&self, path_suffix: &str) -> Vec<Req> {
        let seen = self.seen.lock().unwrap();
        seen.iter()
            .filter(|r| r.path.ends_with(path_suffix))
            .cloned()
            .collect()
    }
}

// ------------------------------------------------------ protobuf by hand

pub fn varint(mut n: u64, out: &mut Vec<u8>) {
    while n >= 0x80 {
        out.push((n as u8) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

pub fn bytes_field(field: u64, value: &[u8], out: &mut Vec<u8>) {
    varint(field << 3 | 2, out);
    varint(value.len() as u64, out);
    out.extend_from_slice(value);
}

/// `PickResponse { candidates: [{address}…], decision }`.
pub fn pick_answer(decision: u64, addrs: &[SocketAddr]) -> Vec<u8> {
    let mut out = Vec::new();
    for a in addrs {
        let mut cand = Vec::new();
        bytes_field(1, a.to_string().as_bytes(), &mut cand);
        bytes_field(1, &cand, &mut out);
    }
    varint(2 << 3, &mut out);
    varint(decision, &mut out);
    out
}

/// [`pick_answer`] from indexd's ranking, with the replicas it calls busy
/// (`busy`, `busy_known`).
pub fn pick_answer_busy(decision: u64, addrs: &[SocketAddr], busy: &[SocketAddr]) -> Vec<u8> {
    let mut out = pick_answer(decision, addrs);
    for a in busy {
        let mut replica = Vec::new();
        bytes_field(1, a.to_string().as_bytes(), &mut replica);
        bytes_field(9, &replica, &mut out);
    }
    varint(10 << 3, &mut out);
    varint(1, &mut out);
    out
}

pub const PRECISE: u64 = 1;
pub const STALE: u64 = 5;

pub fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

// ------------------------------------------------------------ gateways

pub fn plugin_config(extra: &Value) -> Value {
    let mut cfg = json!({
        "tokenizer_cluster": "tokenizer",
        "index_cluster": "indexd",
        "tokenizer_timeout_ms": 400,
        "index_timeout_ms": 400,
        "block_size": 4,
        "decision_header": DECISION,
        "breaker": {"failures": 3, "window_ms": 30000, "cooldown_ms": 1500, "probe_ms": 0},
        // The same body again and again: without this, the conversation
        // memory would route the failure cases to the last replica.
        "remember": false,
    });
    for (k, v) in extra.as_object().into_iter().flatten() {
        cfg[k] = v.clone();
    }
    cfg
}

/// The Envoy in front of a plain-HTTP indexd stand-in (see the module doc).
pub fn bridge(index: SocketAddr) -> Envoy {
    let bridge_filter = json!({
        "name": "envoy.filters.http.grpc_http1_reverse_bridge",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.grpc_http1_reverse_bridge.v3.FilterConfig",
            "content_type": "application/grpc+proto",
            "withhold_grpc_frames": true
        }
    });
    let config = EnvoyConfig::new(
        vec![http_listener(
            "grpc",
            vec![bridge_filter],
            vec![cluster_route("indexd_http", Duration::from_secs(5))],
        )],
        vec![http_cluster("indexd_http", &[index])],
    );
    Envoy::start(&config).unwrap()
}

pub fn gateway_config(
    replicas: &[SocketAddr],
    tokenizer: SocketAddr,
    index: SocketAddr,
    plugin: &Value,
) -> EnvoyConfig {
    let wasm = artifacts::filter_wasm().unwrap();
    EnvoyConfig::new(
        vec![http_listener(
            "gateway",
            kvroute_filters(&wasm, plugin),
            vec![cluster_route("vllm", Duration::from_secs(5))],
        )],
        vec![
            inference_cluster("vllm", replicas, OVERRIDE),
            http_cluster("tokenizer", &[tokenizer]),
            grpc_cluster("indexd", index),
        ],
    )
}

/// A panic in the VM shows in Envoy's log (and would fail requests).
pub fn assert_no_wasm_failure(envoy: &Envoy) {
    let log = std::fs::read_to_string(envoy.dir().join("envoy.log")).unwrap();
    for bad in ["panicked", "RuntimeError", "Uncaught"] {
        assert!(!log.contains(bad), "{bad} in Envoy's log:\n{log}");
    }
}

pub fn decision(r: &http::Response) -> &str {
    r.header(DECISION).unwrap_or("<none>")
}
