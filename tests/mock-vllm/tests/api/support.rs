//! Test helpers: a minimal HTTP/1.1 client, ZMQ replay/subscribe helpers, fixture loading.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use mock_vllm::{Config, Handle, LatencyConfig, MockVllm};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// Block size of [`test_config`].
pub const BS: usize = 16;

/// vLLM's full-block hit for an `n`-token prompt whose blocks are all cached.
pub fn hit(n: usize) -> usize {
    (n - 1) / BS * BS
}

pub const STEP: Duration = Duration::from_secs(10);

/// A config for tests: no sleeping, fixed hash seed, small blocks.
pub fn test_config() -> Config {
    Config {
        block_size: 16,
        hash_seed: Some("test".to_owned()),
        latency: LatencyConfig {
            time_scale: 0.0,
            ..LatencyConfig::default()
        },
        ..Config::default()
    }
}

pub async fn start(config: Config) -> Handle {
    MockVllm::start(config).await.expect("replica starts")
}

#[derive(Debug)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl HttpResponse {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// `(event, data)` pairs of an SSE body.
    pub fn sse(&self) -> Vec<(Option<String>, String)> {
        self.text()
            .split("\n\n")
            .filter(|b| !b.trim().is_empty())
            .map(|block| {
                let mut event = None;
                let mut data = String::new();
                for line in block.lines() {
                    if let Some(e) = line.strip_prefix("event:") {
                        event = Some(e.trim().to_owned());
                    } else if let Some(d) = line.strip_prefix("data:") {
                        data.push_str(d.trim_start());
                    }
                }
                (event, data)
            })
            .collect()
    }
}

fn dechunk(mut body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(pos) = body.windows(2).position(|w| w == b"\r\n") {
        let size_line = std::str::from_utf8(&body[..pos]).unwrap();
        let size = usize::from_str_radix(size_line.split(';').next().unwrap().trim(), 16).unwrap();
        body = &body[pos + 2..];
        if size == 0 {
            break;
        }
        out.extend_from_slice(&body[..size]);
        body = &body[size + 2..];
    }
    out
}

pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> HttpResponse {
    request_with(addr, method, path, &[], body).await
}

/// The raw request `request_with` sends.
pub fn raw_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&Value>,
) -> String {
    let payload = body.map(|b| b.to_string()).unwrap_or_default();
    let extra: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\n{extra}Content-Length: {}\r\n\r\n{payload}",
        payload.len()
    )
}

/// A request with extra headers.
pub async fn request_with(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&Value>,
) -> HttpResponse {
    tokio::time::timeout(STEP, async {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let req = raw_request(addr, method, path, headers, body);
        stream.write_all(req.as_bytes()).await.unwrap();
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.unwrap();
        let split = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("header end");
        let head = std::str::from_utf8(&raw[..split]).unwrap();
        let mut lines = head.split("\r\n");
        let status = lines
            .next()
            .unwrap()
            .split(' ')
            .nth(1)
            .unwrap()
            .parse()
            .unwrap();
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
            .collect();
        let mut body = raw[split + 4..].to_vec();
        if headers
            .iter()
            .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"))
        {
            body = dechunk(&body);
        }
        HttpResponse {
            status,
            headers,
            body,
        }
    })
    .await
    .expect("HTTP request timed out")
}

pub async fn post(addr: SocketAddr, path: &str, body: Value) -> HttpResponse {
    request(addr, "POST", path, Some(&body)).await
}

pub async fn get(addr: SocketAddr, path: &str) -> HttpResponse {
    request(addr, "GET", path, None).await
}

/// One replayed batch: `(topic, seq, payload)`.
pub type Frame = (Bytes, [u8; 8], Bytes);

/// Sends a replay request for `start_seq`; returns the batches and the end marker's frames.
pub async fn replay(endpoint: &str, start_seq: u64) -> (Vec<Frame>, Vec<Bytes>) {
    tokio::time::timeout(STEP, async {
        let mut dealer = DealerSocket::new();
        dealer.connect(endpoint).await.unwrap();
        let req = ZmqMessage::try_from(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&start_seq.to_be_bytes()),
        ])
        .unwrap();
        dealer.send(req).await.unwrap();
        let mut batches = Vec::new();
        for _ in 0..100_000 {
            let frames = dealer.recv().await.unwrap().into_vec();
            assert_eq!(frames.len(), 4, "reply is [\"\", topic, seq, payload]");
            assert!(frames[0].is_empty(), "empty delimiter first");
            if frames[2].as_ref() == [0xff; 8] {
                return (batches, frames);
            }
            let seq: [u8; 8] = frames[2].as_ref().try_into().unwrap();
            batches.push((frames[1].clone(), seq, frames[3].clone()));
        }
        panic!("no end marker");
    })
    .await
    .expect("replay timed out")
}

pub fn seq(frame: &Frame) -> u64 {
    u64::from_be_bytes(frame.1)
}

pub fn decode(payload: &[u8]) -> rmpv::Value {
    let mut slice = payload;
    let v = rmpv::decode::read_value(&mut slice).unwrap();
    assert!(slice.is_empty(), "trailing bytes after the payload");
    v
}

/// Events of a decoded batch payload.
pub fn events(payload: &[u8]) -> Vec<rmpv::Value> {
    decode(payload).as_array().unwrap()[1]
        .as_array()
        .unwrap()
        .clone()
}

/// `"type"` of a tagged event.
pub fn event_type(ev: &rmpv::Value) -> String {
    field(ev, "type").as_str().unwrap().to_owned()
}

pub fn field<'a>(ev: &'a rmpv::Value, name: &str) -> &'a rmpv::Value {
    ev.as_map()
        .unwrap()
        .iter()
        .find(|(k, _)| k.as_str() == Some(name))
        .map(|(_, v)| v)
        .unwrap_or_else(|| panic!("no field {name}"))
}

/// A SUB socket connected and subscribed to everything.
pub async fn subscriber(endpoint: &str) -> SubSocket {
    let mut sub = SubSocket::new();
    sub.connect(endpoint).await.unwrap();
    sub.subscribe("").await.unwrap();
    sub
}

/// Messages published before a subscription is active are lost (as with real ZMQ): sends
/// distinct prompts until a live batch arrives (bounded), and returns its frames.
pub async fn first_live_batch(sub: &mut SubSocket, http: SocketAddr) -> Vec<Bytes> {
    for i in 0..50 {
        let body = serde_json::json!({"prompt": text(&format!("warm{i}-"), 20), "max_tokens": 1});
        assert_eq!(post(http, "/v1/completions", body).await.status, 200);
        if let Some(f) = recv_live(sub, Duration::from_millis(200)).await {
            return f;
        }
    }
    panic!("no live batch arrived");
}

pub async fn recv_live(sub: &mut SubSocket, wait: Duration) -> Option<Vec<Bytes>> {
    tokio::time::timeout(wait, sub.recv())
        .await
        .ok()
        .map(|m| m.unwrap().into_vec())
}

pub fn fixture(name: &str) -> Vec<u8> {
    let path = format!(
        "{}/../fixtures/vllm-0.32-events/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// A prompt of roughly `words` words, distinct per `tag`.
pub fn text(tag: &str, words: usize) -> String {
    (0..words).map(|i| format!("{tag}{i} ")).collect()
}

/// `(prompt tokens, cached tokens)` of a non-streaming request.
pub async fn cached_of(addr: SocketAddr, path: &str, body: Value) -> (usize, usize) {
    let r = post(addr, path, body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let u = &r.json()["usage"];
    if path == "/v1/responses" {
        (
            u["input_tokens"].as_u64().unwrap() as usize,
            u["input_tokens_details"]["cached_tokens"].as_u64().unwrap() as usize,
        )
    } else {
        (
            u["prompt_tokens"].as_u64().unwrap() as usize,
            u["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap() as usize,
        )
    }
}
