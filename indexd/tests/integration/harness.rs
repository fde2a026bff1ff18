//! What the topic files share: a vLLM-like KV-event publisher, an in-process
//! indexd with a gRPC client, the indexd binary started as a child process,
//! builders of KV-event batches, and polling with a bounded wait.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use indexd::config::{EndpointConfig, HttpUrl};
use indexd::{Config, EndpointId, Handle, Server};
use kvroute_proto::keys::{BlockSize, block_keys};
use kvroute_proto::v1::index_client::IndexClient;
use kvroute_proto::v1::{Mode, PickRequest, PickResponse};
use rmpv::Value;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

pub(crate) const TIMEOUT: Duration = Duration::from_secs(15);
pub(crate) const POLL: Duration = Duration::from_millis(20);

/// Polls `cond` until it holds or the overall timeout passes.
pub(crate) async fn eventually<F, Fut>(what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    while !cond().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(POLL).await;
    }
}

type Buffer = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;

/// A vLLM-like KV-event publisher: live PUB plus a ROUTER serving replays
/// from its buffer.
pub(crate) struct Publisher {
    pub(crate) pub_socket: PubSocket,
    pub(crate) events: String,
    pub(crate) replay: String,
    pub(crate) buffer: Buffer,
    topic: &'static [u8],
    stop: CancellationToken,
}

impl Publisher {
    pub(crate) async fn start(legacy_replies: bool) -> Self {
        let mut pub_socket = PubSocket::new();
        let events = pub_socket
            .bind("tcp://127.0.0.1:0")
            .await
            .unwrap()
            .to_string();
        let mut router = RouterSocket::new();
        let replay = router.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        let buffer: Buffer = Arc::default();
        let stop = CancellationToken::new();
        let (buf, token) = (Arc::clone(&buffer), stop.clone());
        let topic: &'static [u8] = b"kv@test@model";
        tokio::spawn(async move {
            loop {
                let msg = tokio::select! {
                    () = token.cancelled() => return,
                    m = router.recv() => m.unwrap(),
                };
                let frames = msg.into_vec();
                let (id, start) = (
                    frames[0].clone(),
                    u64::from_be_bytes(frames[2][..].try_into().unwrap()),
                );
                let batches: Vec<_> = buf
                    .lock()
                    .unwrap()
                    .iter()
                    .filter(|(s, _)| *s >= start)
                    .cloned()
                    .collect();
                for (seq, payload) in batches {
                    let mut reply = vec![id.clone(), Bytes::new()];
                    if !legacy_replies {
                        reply.push(Bytes::from_static(topic));
                    }
                    reply.extend([
                        Bytes::copy_from_slice(&seq.to_be_bytes()),
                        Bytes::from(payload),
                    ]);
                    router
                        .send(ZmqMessage::try_from(reply).unwrap())
                        .await
                        .unwrap();
                }
                let mut end = vec![id, Bytes::new()];
                if !legacy_replies {
                    end.push(Bytes::new());
                }
                end.extend([Bytes::copy_from_slice(&[0xff; 8]), Bytes::new()]);
                router
                    .send(ZmqMessage::try_from(end).unwrap())
                    .await
                    .unwrap();
            }
        });
        Self {
            pub_socket,
            events,
            replay,
            buffer,
            topic,
            stop,
        }
    }

    /// Buffers a batch without sending it live (a lost message).
    pub(crate) fn buffer_only(&self, seq: u64, payload: &[u8]) {
        self.buffer.lock().unwrap().push((seq, payload.to_vec()));
    }

    /// Buffers and sends a batch live.
    pub(crate) async fn publish(&mut self, seq: u64, payload: &[u8]) {
        self.buffer_only(seq, payload);
        self.send_live(seq, payload).await;
    }

    async fn send_live(&mut self, seq: u64, payload: &[u8]) {
        let frames = vec![
            Bytes::from_static(self.topic),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            Bytes::copy_from_slice(payload),
        ];
        self.pub_socket
            .send(ZmqMessage::try_from(frames).unwrap())
            .await
            .unwrap();
    }

    /// A restarted engine: empty buffer, seqs from 0 again.
    pub(crate) fn restart_buffer(&self) {
        self.buffer.lock().unwrap().clear();
    }

    /// A restarted engine process: the PUB socket closes and a new one binds
    /// the same port, its buffer holding only `first` (published before any
    /// subscriber could reconnect).
    pub(crate) async fn restart_process(&mut self, first: &[u8]) {
        let old = std::mem::replace(&mut self.pub_socket, PubSocket::new());
        let _ = old.close().await;
        self.restart_buffer();
        self.buffer_only(0, first);
        let deadline = tokio::time::Instant::now() + TIMEOUT;
        while let Err(e) = self.pub_socket.bind(&self.events).await {
            assert!(
                tokio::time::Instant::now() < deadline,
                "rebind {}: {e}",
                self.events
            );
            tokio::time::sleep(POLL).await;
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

pub(crate) fn endpoint(port: u16, publisher: Option<&Publisher>) -> EndpointConfig {
    let mut ep = EndpointConfig::new(SocketAddr::from(([127, 0, 0, 1], port)), "m");
    if let Some(p) = publisher {
        ep.events = Some(p.events.clone());
        ep.replay = Some(p.replay.clone());
    }
    ep
}

pub(crate) struct Daemon {
    pub(crate) handle: Handle,
    pub(crate) client: IndexClient<Channel>,
    pub(crate) http: SocketAddr,
    stop: CancellationToken,
    served: tokio::task::JoinHandle<Result<(), indexd::StartError>>,
}

impl Daemon {
    pub(crate) async fn start(endpoints: Vec<EndpointConfig>, block_size: u32) -> Self {
        Self::start_with(endpoints, block_size, |_| {}).await
    }

    pub(crate) async fn start_with(
        endpoints: Vec<EndpointConfig>,
        block_size: u32,
        tweak: impl FnOnce(&mut Config),
    ) -> Self {
        let mut config = Config::new(endpoints);
        config.grpc_listen = "127.0.0.1:0".parse().unwrap();
        config.http_listen = "127.0.0.1:0".parse().unwrap();
        config.block_size = BlockSize::new(block_size).unwrap();
        config.seed = Some(7);
        config.replay_timeout = Duration::from_secs(5);
        config.scrape_interval = Duration::from_millis(50);
        config.scrape_timeout = Duration::from_millis(500);
        config.speculative_ttl = Duration::ZERO;
        tweak(&mut config);
        let bound = Server::bind(config).await.unwrap();
        let (grpc, http, handle) = (bound.grpc_addr(), bound.http_addr(), bound.handle());
        assert_ne!(grpc.tcp().map_or(1, |a| a.port()), 0);
        let stop = CancellationToken::new();
        let served = tokio::spawn(bound.serve(stop.clone()));
        // The listener is bound already: connecting cannot race the server.
        let client = IndexClient::connect(grpc.grpc_uri()).await.unwrap();
        Self {
            handle,
            client,
            http,
            stop,
            served,
        }
    }

    pub(crate) async fn pick(&mut self, keys: &[u64], block_size: u32) -> PickResponse {
        self.pick_req(PickRequest {
            model: "m".into(),
            block_keys: keys.to_vec(),
            block_size,
            mode: Mode::Precise as i32,
            key_scheme: kvroute_proto::SCHEME_VERSION.into(),
            ..PickRequest::default()
        })
        .await
    }

    /// Blocks of `tokens` (no salt) the first candidate of a precise Pick
    /// matches.
    pub(crate) async fn matched(&mut self, tokens: &[u32], block_size: u32) -> u32 {
        let bs = BlockSize::new(block_size).unwrap();
        let keys = raw(&block_keys(tokens, bs, None));
        self.pick(&keys, block_size).await.candidates[0].matched_blocks
    }

    /// Waits until the replica on `port` holds `entries` index entries.
    pub(crate) async fn await_entries(&self, what: &str, port: u16, entries: usize) {
        eventually(what, || async {
            self.handle.replica(&replica(port)).unwrap().entries == entries
        })
        .await;
    }

    pub(crate) async fn pick_req(&mut self, req: PickRequest) -> PickResponse {
        self.client.pick(req).await.unwrap().into_inner()
    }

    pub(crate) fn counter(&self, name: &str) -> f64 {
        let text = self.handle.metrics_text();
        text.lines()
            .filter(|l| l.starts_with(name) && !l.starts_with('#'))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    pub(crate) async fn http_get(&self, path: &str) -> Result<Vec<u8>, indexd::error::ScrapeError> {
        let url = HttpUrl::parse(&format!("http://{}{path}", self.http)).unwrap();
        indexd::load::get(
            &indexd::load::client().unwrap(),
            &url,
            Duration::from_secs(5),
        )
        .await
    }

    pub(crate) async fn stop(self) {
        self.stop.cancel();
        self.served.await.unwrap().unwrap();
    }
}

pub(crate) fn replica(port: u16) -> EndpointId {
    EndpointId {
        address: SocketAddr::from(([127, 0, 0, 1], port)),
        rank: None,
    }
}

/// A BlockStored batch (current vLLM shape) for `tokens`.
pub(crate) fn stored_batch(
    hashes: &[u64],
    parent: Option<u64>,
    tokens: &[u32],
    block_size: u32,
    salt: Option<&str>,
) -> Vec<u8> {
    let extra: Vec<Value> = (0..hashes.len())
        .map(|i| match (i, salt) {
            (0, Some(s)) if parent.is_none() => Value::Array(vec![Value::from(s)]),
            _ => Value::Nil,
        })
        .collect();
    let ev = Value::Map(vec![
        (Value::from("type"), Value::from("BlockStored")),
        (
            Value::from("block_hashes"),
            Value::Array(hashes.iter().map(|h| Value::from(*h)).collect()),
        ),
        (
            Value::from("parent_block_hash"),
            parent.map_or(Value::Nil, Value::from),
        ),
        (
            Value::from("token_ids"),
            Value::Array(tokens.iter().map(|t| Value::from(*t)).collect()),
        ),
        (Value::from("block_size"), Value::from(block_size)),
        (Value::from("lora_id"), Value::Nil),
        (Value::from("medium"), Value::from("GPU")),
        (Value::from("lora_name"), Value::Nil),
        (Value::from("extra_keys"), Value::Array(extra)),
        (Value::from("group_idx"), Value::from(0)),
    ]);
    batch(vec![ev])
}

pub(crate) fn batch(events: Vec<Value>) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(
        &mut out,
        &Value::Array(vec![Value::from(1.0), Value::Array(events)]),
    )
    .unwrap();
    out
}

pub(crate) fn tokens(n: u32, seed: u32) -> Vec<u32> {
    (0..n)
        .map(|i| (i * 7919 + seed * 104_729) % 32_000)
        .collect()
}

pub(crate) fn raw(keys: &[kvroute_proto::BlockKey]) -> Vec<u64> {
    keys.iter().map(|k| k.as_u64()).collect()
}

/// Waits until the replica finished its start-up replay, then publishes
/// empty batches from `next_seq` until one is applied live (the SUB
/// subscription is in place). Returns the next seq to use.
pub(crate) async fn sync_live(d: &Daemon, p: &mut Publisher, port: u16, mut next_seq: u64) -> u64 {
    eventually("start-up replay", || async {
        d.handle.replica(&replica(port)).unwrap().fresh
    })
    .await;
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    loop {
        let before = d.counter("indexd_batches_total");
        p.publish(next_seq, &batch(vec![])).await;
        next_seq += 1;
        let wait_until = tokio::time::Instant::now() + Duration::from_millis(300);
        while tokio::time::Instant::now() < wait_until {
            if d.counter("indexd_batches_total") > before {
                return next_seq;
            }
            tokio::time::sleep(POLL).await;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "live stream never reached indexd"
        );
    }
}

/// One gauge of indexd's /metrics page.
pub(crate) fn gauge(page: &str, series: &str) -> Option<f64> {
    page.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

/// The indexd binary started with `args` and `--print-addresses` (killed
/// when dropped), and the addresses it printed.
pub(crate) async fn start_binary(args: &[&str]) -> (tokio::process::Child, serde_json::Value) {
    start_binary_with(args, &[]).await
}

pub(crate) async fn start_binary_with(
    args: &[&str],
    env: &[(&str, &str)],
) -> (tokio::process::Child, serde_json::Value) {
    use tokio::io::AsyncBufReadExt;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_indexd"))
        .args(args)
        .envs(env.iter().copied())
        .arg("--print-addresses")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(TIMEOUT, lines.next_line())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    (child, serde_json::from_str(&line).unwrap())
}
