//! indexd in-process, against a real ZMQ publisher (PUB + ROUTER for
//! replay) replaying captured vLLM 0.32 frames and synthetic ones, over real
//! gRPC and HTTP. Nothing sleeps to wait: every wait polls a condition in a
//! bounded loop.

// A test binary: its helpers may fail loudly too (clippy.toml only covers
// `#[test]` functions).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use indexd::config::{EndpointConfig, HttpUrl};
use indexd::{Config, EndpointId, Handle, Server};
use kvroute_proto::keys::{BlockSize, block_keys};
use kvroute_proto::v1::index_client::IndexClient;
use kvroute_proto::v1::{
    DecisionKind, Mode, ObserveRequest, Outcome, PickRequest, PickResponse, Tier,
};
use rmpv::Value;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

const FIXTURES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tests/fixtures/vllm-0.32-events/"
);
const TIMEOUT: Duration = Duration::from_secs(15);
const POLL: Duration = Duration::from_millis(20);

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(format!("{FIXTURES}{name}")).unwrap()
}

/// Polls `cond` until it holds or the overall timeout passes.
async fn eventually<F, Fut>(what: &str, mut cond: F)
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
struct Publisher {
    pub_socket: PubSocket,
    events: String,
    replay: String,
    buffer: Buffer,
    topic: &'static [u8],
    stop: CancellationToken,
}

impl Publisher {
    async fn start(legacy_replies: bool) -> Self {
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
    fn buffer_only(&self, seq: u64, payload: &[u8]) {
        self.buffer.lock().unwrap().push((seq, payload.to_vec()));
    }

    /// Buffers and sends a batch live.
    async fn publish(&mut self, seq: u64, payload: &[u8]) {
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
    fn restart_buffer(&self) {
        self.buffer.lock().unwrap().clear();
    }

    /// A restarted engine process: the PUB socket closes and a new one binds
    /// the same port, its buffer holding only `first` (published before any
    /// subscriber could reconnect).
    async fn restart_process(&mut self, first: &[u8]) {
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

fn endpoint(port: u16, publisher: Option<&Publisher>) -> EndpointConfig {
    let mut ep = EndpointConfig::new(SocketAddr::from(([127, 0, 0, 1], port)), "m");
    if let Some(p) = publisher {
        ep.events = Some(p.events.clone());
        ep.replay = Some(p.replay.clone());
    }
    ep
}

struct Daemon {
    handle: Handle,
    client: IndexClient<Channel>,
    http: SocketAddr,
    stop: CancellationToken,
    served: tokio::task::JoinHandle<Result<(), indexd::StartError>>,
}

impl Daemon {
    async fn start(endpoints: Vec<EndpointConfig>, block_size: u32) -> Self {
        Self::start_with(endpoints, block_size, |_| {}).await
    }

    async fn start_with(
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

    async fn pick(&mut self, keys: &[u64], block_size: u32) -> PickResponse {
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
    async fn matched(&mut self, tokens: &[u32], block_size: u32) -> u32 {
        let bs = BlockSize::new(block_size).unwrap();
        let keys = raw(&block_keys(tokens, bs, None));
        self.pick(&keys, block_size).await.candidates[0].matched_blocks
    }

    /// Waits until the replica on `port` holds `entries` index entries.
    async fn await_entries(&self, what: &str, port: u16, entries: usize) {
        eventually(what, || async {
            self.handle.replica(&replica(port)).unwrap().entries == entries
        })
        .await;
    }

    async fn pick_req(&mut self, req: PickRequest) -> PickResponse {
        self.client.pick(req).await.unwrap().into_inner()
    }

    fn counter(&self, name: &str) -> f64 {
        let text = self.handle.metrics_text();
        text.lines()
            .filter(|l| l.starts_with(name) && !l.starts_with('#'))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    async fn http_get(&self, path: &str) -> Result<Vec<u8>, indexd::error::ScrapeError> {
        let url = HttpUrl::parse(&format!("http://{}{path}", self.http)).unwrap();
        indexd::load::get(
            &indexd::load::client().unwrap(),
            &url,
            Duration::from_secs(5),
        )
        .await
    }

    async fn stop(self) {
        self.stop.cancel();
        self.served.await.unwrap().unwrap();
    }
}

fn replica(port: u16) -> EndpointId {
    EndpointId {
        address: SocketAddr::from(([127, 0, 0, 1], port)),
        rank: None,
    }
}

/// A BlockStored batch (current vLLM shape) for `tokens`.
fn stored_batch(
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

fn batch(events: Vec<Value>) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(
        &mut out,
        &Value::Array(vec![Value::from(1.0), Value::Array(events)]),
    )
    .unwrap();
    out
}

fn tokens(n: u32, seed: u32) -> Vec<u32> {
    (0..n)
        .map(|i| (i * 7919 + seed * 104_729) % 32_000)
        .collect()
}

fn raw(keys: &[kvroute_proto::BlockKey]) -> Vec<u64> {
    keys.iter().map(|k| k.as_u64()).collect()
}

fn stored_tokens(payload: &[u8]) -> Vec<u32> {
    let batch = indexd::wire::decode_batch(payload, &indexd::Limits::default()).unwrap();
    batch
        .events
        .iter()
        .find_map(|e| match e {
            indexd::event::KvEvent::BlockStored(s) if !s.token_ids.is_empty() => {
                Some(s.token_ids.clone())
            }
            _ => None,
        })
        .unwrap()
}

/// Waits until the replica finished its start-up replay, then publishes
/// empty batches from `next_seq` until one is applied live (the SUB
/// subscription is in place). Returns the next seq to use.
async fn sync_live(d: &Daemon, p: &mut Publisher, port: u16, mut next_seq: u64) -> u64 {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn captured_frames_index_and_keys_equal_proto_keys() {
    let mut p = Publisher::start(false).await;
    let salt_a = fixture("blockstored_8blk_bs64_salt_A.f2_payload.msgpack");
    let cleared = fixture("allblockscleared_then_blockstored_salted.f2_payload.msgpack");
    let long = fixture("blockremoved_x7_then_blockstored_53blk.f2_payload.msgpack");
    let frames = [
        salt_a.clone(),
        fixture("blockstored_2blk_bs128_byteshashes_emptytopic.f2_payload.msgpack"),
        fixture("blockstored_1blk_bs32_noparent.f2_payload.msgpack"),
        fixture("blockstored_1blk_bs32_withparent.f2_payload.msgpack"),
        cleared.clone(),
        long.clone(),
    ];
    // Buffered before indexd starts: recovered by the start-up replay from 0.
    for (seq, f) in frames.iter().enumerate() {
        p.buffer_only(seq as u64, f);
    }
    let mut d = Daemon::start(vec![endpoint(18000, Some(&p))], 32).await;
    sync_live(&d, &mut p, 18000, frames.len() as u64).await;

    assert_eq!(d.counter("indexd_decode_errors_total"), 0.0);
    assert_eq!(
        d.counter("indexd_events_total{type=\"block_removed\"}"),
        7.0
    );
    assert_eq!(
        d.counter("indexd_events_total{type=\"all_blocks_cleared\"}"),
        1.0
    );
    assert_eq!(d.counter("indexd_events_total{type=\"block_stored\"}"), 6.0);
    // The bs-64 and bs-128 frames differ from the configured 32.
    assert_eq!(
        d.counter("indexd_block_size_mismatch_total{source=\"event\"}"),
        2.0
    );

    // The 53-block prompt: keys from the event equal proto keys of its tokens.
    let bs32 = BlockSize::new(32).unwrap();
    let keys = raw(&block_keys(&stored_tokens(&long), bs32, None));
    assert_eq!(keys.len(), 53);
    let r = d.pick(&keys, 32).await;
    assert_eq!(r.decision, DecisionKind::Precise as i32, "{r:?}");
    assert_eq!(r.candidates.len(), 1);
    let c = &r.candidates[0];
    assert_eq!(
        (c.address.as_str(), c.matched_blocks, c.matched_tokens),
        ("127.0.0.1:18000", 53, 53 * 32)
    );
    assert_eq!(c.tier, Tier::Gpu as i32);

    // The salted block after AllBlocksCleared matches under its own salt only.
    let salted = stored_tokens(&cleared);
    let tenant1 = raw(&block_keys(&salted, bs32, Some("tenant-1")));
    assert_eq!(d.pick(&tenant1, 32).await.candidates[0].matched_blocks, 1);
    for other in [Some("tenant-2"), None] {
        let r = d.pick(&raw(&block_keys(&salted, bs32, other)), 32).await;
        assert_eq!(
            r.decision,
            DecisionKind::Load as i32,
            "salt {other:?}: {r:?}"
        );
        assert_eq!(r.candidates[0].matched_blocks, 0);
    }
    // AllBlocksCleared dropped what came before it (the salt-A prompt).
    let a = raw(&block_keys(
        &stored_tokens(&salt_a),
        BlockSize::new(64).unwrap(),
        Some("A"),
    ));
    let r = d.pick(&a, 64).await;
    assert!(r.block_size_mismatch);
    assert_eq!(r.reason, "block_size_mismatch");
    assert_eq!(r.index_block_size, 32);
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_tenant_salt_never_matches() {
    let mut p = Publisher::start(false).await;
    let salt_a = fixture("blockstored_8blk_bs64_salt_A.f2_payload.msgpack");
    p.buffer_only(0, &salt_a);
    let mut d = Daemon::start(vec![endpoint(18001, Some(&p))], 64).await;
    sync_live(&d, &mut p, 18001, 1).await;
    let bs = BlockSize::new(64).unwrap();
    let t = stored_tokens(&salt_a);
    let r = d.pick(&raw(&block_keys(&t, bs, Some("A"))), 64).await;
    assert_eq!(
        (r.decision, r.candidates[0].matched_blocks),
        (DecisionKind::Precise as i32, 8)
    );
    for salt in [Some("B"), Some("a"), None, Some("A ")] {
        let r = d.pick(&raw(&block_keys(&t, bs, salt)), 64).await;
        assert_eq!(r.candidates[0].matched_blocks, 0, "salt {salt:?}");
    }
    d.stop().await;
}

async fn gap_healed(legacy_replies: bool, port: u16) {
    let mut p = Publisher::start(legacy_replies).await;
    let mut d = Daemon::start(vec![endpoint(port, Some(&p))], 16).await;
    let mut seq = sync_live(&d, &mut p, port, 0).await;
    let gaps = d.counter("indexd_seq_gaps_total");
    let complete = d.counter("indexd_replays_total{result=\"complete\"}");

    let bs = BlockSize::new(16).unwrap();
    let lost = tokens(32, 1);
    let live = tokens(16, 2);
    p.buffer_only(seq, &stored_batch(&[11, 12], None, &lost, 16, None));
    p.publish(seq + 1, &stored_batch(&[21], None, &live, 16, None))
        .await;
    seq += 2;
    let lost_keys = raw(&block_keys(&lost, bs, None));
    eventually("the lost batch to be replayed", || {
        let mut client = d.client.clone();
        let keys = lost_keys.clone();
        async move {
            let r = client
                .pick(PickRequest {
                    model: "m".into(),
                    block_keys: keys,
                    block_size: 16,
                    key_scheme: kvroute_proto::SCHEME_VERSION.into(),
                    ..PickRequest::default()
                })
                .await
                .unwrap()
                .into_inner();
            r.candidates.first().is_some_and(|c| c.matched_blocks == 2)
        }
    })
    .await;
    assert_eq!(d.counter("indexd_seq_gaps_total"), gaps + 1.0);
    assert_eq!(
        d.counter("indexd_replays_total{result=\"complete\"}"),
        complete + 1.0
    );
    assert_eq!(d.counter("indexd_purges_total{reason=\"gap\"}"), 0.0);
    assert_eq!(d.matched(&live, 16).await, 1);
    // The live copy of the replayed batch is skipped, and the stream goes on.
    p.publish(seq, &batch(vec![])).await;
    eventually("the stream to continue", || async {
        d.counter("indexd_batches_total") >= 1.0 + seq as f64
    })
    .await;
    assert!(d.handle.replica(&replica(port)).unwrap().fresh);
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_is_healed_by_replay_from_a_real_router() {
    gap_healed(false, 18002).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_is_healed_by_a_legacy_replay_without_topic_frames() {
    gap_healed(true, 18003).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_the_buffer_no_longer_holds_purges() {
    let mut p = Publisher::start(false).await;
    let mut d = Daemon::start(vec![endpoint(18004, Some(&p))], 16).await;
    let seq = sync_live(&d, &mut p, 18004, 0).await;
    let old = tokens(16, 3);
    p.publish(seq, &stored_batch(&[1], None, &old, 16, None))
        .await;
    d.await_entries("the first store", 18004, 1).await;
    // seq+1 is lost and gone from the buffer too (wrapped): only seq+2 is left.
    let new = tokens(16, 4);
    p.publish(seq + 2, &stored_batch(&[2], None, &new, 16, None))
        .await;
    eventually("a purge", || async {
        d.counter("indexd_purges_total{reason=\"gap\"}") == 1.0
    })
    .await;
    assert_eq!(d.matched(&old, 16).await, 0);
    d.await_entries("the live batch after the purge", 18004, 1)
        .await;
    assert_eq!(d.matched(&new, 16).await, 1);
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restart_purges() {
    let mut p = Publisher::start(false).await;
    let mut d = Daemon::start(vec![endpoint(18005, Some(&p))], 16).await;
    let seq = sync_live(&d, &mut p, 18005, 0).await;
    let before = tokens(48, 5);
    p.publish(seq, &stored_batch(&[1, 2, 3], None, &before, 16, None))
        .await;
    d.await_entries("the store", 18005, 3).await;

    // The engine restarts: empty cache, seq from 0.
    p.restart_buffer();
    let after = tokens(16, 6);
    p.publish(0, &stored_batch(&[9], None, &after, 16, None))
        .await;
    eventually("the restart purge", || async {
        d.counter("indexd_purges_total{reason=\"restart\"}") == 1.0
    })
    .await;
    d.await_entries("the new engine's block", 18005, 1).await;
    assert_eq!(d.matched(&before, 16).await, 0);
    assert_eq!(d.matched(&after, 16).await, 1);
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn picks_only_fresh_replicas_and_prefers_the_holder() {
    let mut p = Publisher::start(false).await;
    // 18007's events endpoint has nobody behind it: never fresh.
    let mut dead = endpoint(18007, None);
    dead.events = Some("tcp://127.0.0.1:1".into());
    let idle = endpoint(18008, None); // no events source: fresh, empty index
    let mut d = Daemon::start(vec![endpoint(18006, Some(&p)), dead, idle], 16).await;
    let seq = sync_live(&d, &mut p, 18006, 0).await;
    let bs = BlockSize::new(16).unwrap();
    let t = tokens(64, 8);
    p.publish(seq, &stored_batch(&[1, 2, 3, 4], None, &t, 16, None))
        .await;
    d.await_entries("the store", 18006, 4).await;
    let r = d.pick(&raw(&block_keys(&t, bs, None)), 16).await;
    assert_eq!(r.decision, DecisionKind::Precise as i32);
    let names: Vec<&str> = r.candidates.iter().map(|c| c.address.as_str()).collect();
    assert_eq!(names, ["127.0.0.1:18006", "127.0.0.1:18008"]);
    assert!(r.candidates[0].cost < r.candidates[1].cost);

    // An unknown model is stale.
    let r = d
        .pick_req(PickRequest {
            model: "nope".into(),
            block_keys: vec![1],
            block_size: 16,
            key_scheme: kvroute_proto::SCHEME_VERSION.into(),
            ..PickRequest::default()
        })
        .await;
    assert_eq!(
        (r.decision, r.reason.as_str(), r.candidates.len()),
        (DecisionKind::Stale as i32, "unknown_model", 0)
    );
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observe_then_previous_response_id_gives_affinity() {
    let mut d = Daemon::start(vec![endpoint(18010, None), endpoint(18011, None)], 16).await;
    d.client
        .observe(ObserveRequest {
            model: "m".into(),
            endpoint: "127.0.0.1:18011".into(),
            response_id: "resp_123".into(),
            outcome: Outcome::Ok as i32,
            http_status: 200,
            ..ObserveRequest::default()
        })
        .await
        .unwrap();
    let r = d
        .pick_req(PickRequest {
            model: "m".into(),
            block_keys: vec![1, 2],
            block_size: 16,
            previous_response_id: "resp_123".into(),
            key_scheme: kvroute_proto::SCHEME_VERSION.into(),
            ..PickRequest::default()
        })
        .await;
    assert_eq!(r.decision, DecisionKind::Affinity as i32);
    assert_eq!(r.candidates.len(), 1);
    assert_eq!(r.candidates[0].address, "127.0.0.1:18011");
    // Unknown ids fall through to normal ranking.
    let r = d
        .pick_req(PickRequest {
            model: "m".into(),
            block_keys: vec![1],
            block_size: 16,
            previous_response_id: "resp_unknown".into(),
            key_scheme: kvroute_proto::SCHEME_VERSION.into(),
            ..PickRequest::default()
        })
        .await;
    assert_eq!(r.decision, DecisionKind::Load as i32);
    assert_eq!(r.candidates.len(), 2);
    // A malformed endpoint is an invalid argument.
    let err = d
        .client
        .observe(ObserveRequest {
            endpoint: "nope".into(),
            response_id: "x".into(),
            ..ObserveRequest::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approximate_mode_learns_from_its_own_picks() {
    let mut d = Daemon::start(vec![endpoint(18012, None), endpoint(18013, None)], 16).await;
    let req = |keys: Vec<u64>| PickRequest {
        model: "m".into(),
        block_keys: keys,
        block_size: 1024,
        mode: Mode::Approximate as i32,
        ..PickRequest::default()
    };
    let mut opening = req(vec![5, 6, 7]);
    opening.request_id = "turn-1".into();
    let first = d.pick_req(opening).await;
    assert_eq!(first.decision, DecisionKind::Load as i32);
    let chosen = first.candidates[0].address.clone();
    // The filter reports the first turn answered; the next turn follows it.
    d.client
        .observe(ObserveRequest {
            model: "m".into(),
            endpoint: chosen.clone(),
            request_id: "turn-1".into(),
            outcome: Outcome::Ok as i32,
            http_status: 200,
            ..ObserveRequest::default()
        })
        .await
        .unwrap();
    let again = d.pick_req(req(vec![5, 6, 9])).await;
    assert_eq!(again.decision, DecisionKind::Approximate as i32);
    assert_eq!(again.candidates[0].address, chosen);
    assert_eq!(again.candidates[0].matched_blocks, 2);
    d.stop().await;
}

/// A stand-in for vLLM's /metrics whose status and body the test controls.
async fn metrics_server(body: Arc<Mutex<(u16, String)>>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            let (status, text) = body.lock().unwrap().clone();
            tokio::spawn(async move {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf).await;
                let resp = format!(
                    "HTTP/1.1 {status} X\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
                    text.len()
                );
                let _ = s.write_all(resp.as_bytes()).await;
            });
        }
    });
    addr
}

/// One gauge of indexd's /metrics page.
fn gauge(page: &str, series: &str) -> Option<f64> {
    page.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_speed_is_fitted_from_the_replicas_histograms() {
    // A replica prefilling 100,000 tokens/s with 0.2 ms per request on top;
    // its counters advance between scrapes, requests of varied sizes, never
    // faster than the wall clock (indexd caps a sample's seconds at the time
    // between its scrapes: batched prefills).
    let page = |requests: f64, seconds: f64, tokens: f64| {
        format!(
            "vllm:num_requests_running{{engine=\"0\"}} 0\n\
             vllm:request_prefill_time_seconds_count{{engine=\"0\"}} {requests}\n\
             vllm:request_prefill_time_seconds_sum{{engine=\"0\"}} {seconds}\n\
             vllm:request_prefill_kv_computed_tokens_sum{{engine=\"0\"}} {tokens}\n\
             vllm:cache_config_info{{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"2048\"}} 1.0\n"
        )
    };
    let body = Arc::new(Mutex::new((200, page(0.0, 0.0, 0.0))));
    let addr = metrics_server(Arc::clone(&body)).await;
    let feeder = {
        let body = Arc::clone(&body);
        tokio::spawn(async move {
            let (mut requests, mut seconds, mut tokens) = (0.0, 0.0, 0.0);
            for i in 0..400u32 {
                let (n, t) = (f64::from(1 + i % 3), f64::from(30 + (i * 733) % 300));
                requests += n;
                tokens += t;
                seconds += 0.000_2 * n + t / 100_000.0;
                body.lock().unwrap().1 = page(requests, seconds, tokens);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let mut a = endpoint(18016, None);
    a.metrics_url = HttpUrl::parse(&format!("http://{addr}/metrics"));
    let mut b = endpoint(18017, None);
    b.metrics_url = None;
    let d = Daemon::start(vec![a, b], 16).await;
    let series =
        |port: u16, name: &str| format!("{name}{{endpoint=\"127.0.0.1:{port}\",model=\"m\"}}");
    eventually("a fitted speed near 100,000 tokens/s", || async {
        let page = String::from_utf8(d.http_get("/metrics").await.unwrap()).unwrap();
        gauge(
            &page,
            &series(18016, "indexd_replica_prefill_tokens_per_second"),
        )
        .is_some_and(|r| (r - 100_000.0).abs() < 1_000.0)
    })
    .await;
    let page = String::from_utf8(d.http_get("/metrics").await.unwrap()).unwrap();
    let overhead = gauge(
        &page,
        &series(18016, "indexd_replica_prefill_overhead_seconds"),
    );
    assert!(
        overhead.is_some_and(|o| (o - 0.000_2).abs() < 0.000_02),
        "{overhead:?}"
    );
    // The cache's size, as its metrics give it; unknown without them.
    assert_eq!(
        gauge(&page, &series(18016, "indexd_replica_cache_blocks")),
        Some(2048.0)
    );
    assert_eq!(
        gauge(&page, &series(18017, "indexd_replica_cache_blocks")),
        Some(0.0)
    );
    // Without metrics, the prior stands.
    assert_eq!(
        gauge(
            &page,
            &series(18017, "indexd_replica_prefill_tokens_per_second")
        ),
        Some(indexd::Weights::default().prefill_tokens_per_second)
    );
    feeder.abort();
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_from_metrics_and_failing_scrapes_mark_unhealthy() {
    let busy = Arc::new(Mutex::new((
        200,
        "vllm:num_requests_running{engine=\"0\"} 8\nvllm:num_requests_waiting{engine=\"0\"} 30\n"
            .to_owned(),
    )));
    let calm = Arc::new(Mutex::new((
        200,
        "vllm:num_requests_running{engine=\"0\"} 0\nvllm:num_requests_waiting{engine=\"0\"} 0\n"
            .to_owned(),
    )));
    let (busy_addr, calm_addr) = (
        metrics_server(Arc::clone(&busy)).await,
        metrics_server(Arc::clone(&calm)).await,
    );
    let mut a = endpoint(18014, None);
    a.metrics_url = HttpUrl::parse(&format!("http://{busy_addr}/metrics"));
    let mut b = endpoint(18015, None);
    b.metrics_url = HttpUrl::parse(&format!("http://{calm_addr}/metrics"));
    let mut d = Daemon::start(vec![a, b], 16).await;
    assert_eq!(d.http_get("/healthz").await.unwrap(), b"ok\n");
    eventually("both healthy", || async {
        d.handle.replica(&replica(18014)).unwrap().healthy
            && d.handle.replica(&replica(18015)).unwrap().healthy
    })
    .await;
    assert!(d.http_get("/readyz").await.is_ok());
    let r = d.pick(&[1, 2], 16).await;
    assert_eq!(
        r.candidates[0].address, "127.0.0.1:18015",
        "the calm replica first: {r:?}"
    );

    // The calm one starts failing: it drops out of every answer.
    *calm.lock().unwrap() = (500, String::new());
    eventually("unhealthy", || async {
        !d.handle.replica(&replica(18015)).unwrap().healthy
    })
    .await;
    let r = d.pick(&[1, 2], 16).await;
    let names: Vec<&str> = r.candidates.iter().map(|c| c.address.as_str()).collect();
    assert_eq!(names, ["127.0.0.1:18014"]);
    *busy.lock().unwrap() = (503, String::new());
    eventually("all unhealthy", || async {
        !d.handle.replica(&replica(18014)).unwrap().healthy
    })
    .await;
    let r = d.pick(&[1, 2], 16).await;
    assert_eq!(
        (r.decision, r.reason.as_str()),
        (DecisionKind::Stale as i32, "no_fresh_replica")
    );
    assert!(matches!(
        d.http_get("/readyz").await,
        Err(indexd::error::ScrapeError::Status(503))
    ));
    let page = String::from_utf8(d.http_get("/metrics").await.unwrap()).unwrap();
    for name in [
        "indexd_pick_latency_seconds_bucket",
        "indexd_decisions_total{decision=\"stale\",reason=\"no_fresh_replica\"}",
        "indexd_scrapes_total{result=\"error\"}",
        "indexd_index_entries",
        "indexd_replica_healthy{endpoint=\"127.0.0.1:18014\"",
    ] {
        assert!(page.contains(name), "{name} missing from /metrics");
    }
    d.stop().await;
}

/// The indexd binary started with `args` and `--print-addresses` (killed
/// when dropped), and the addresses it printed.
async fn start_binary(args: &[&str]) -> (tokio::process::Child, serde_json::Value) {
    start_binary_with(args, &[]).await
}

async fn start_binary_with(
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

/// `THP_enabled` of a process (Linux ≥ 5.0): 0 once it disabled transparent
/// huge pages for itself.
#[cfg(target_os = "linux")]
fn thp_enabled(pid: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("THP_enabled:"))
        .unwrap_or_else(|| panic!("no THP_enabled in /proc/{pid}/status"))
        .trim()
        .to_owned()
}

/// The daemon turns transparent huge pages off for itself (they cost RSS per
/// index entry and bought no speed: BENCHMARKS.md); with `MIMALLOC_ALLOW_THP`
/// set it leaves them as it found them.
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_runs_without_huge_pages_unless_told() {
    let ours = thp_enabled("self");
    let args = [
        "--grpc-listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
    ];
    for (env, want) in [(&[][..], "0"), (&[("MIMALLOC_ALLOW_THP", "1")][..], &*ours)] {
        let (mut child, _) = start_binary_with(&args, env).await;
        let pid = child.id().unwrap().to_string();
        assert_eq!(thp_enabled(&pid), want, "env {env:?}");
        child.kill().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_prints_its_addresses_and_serves() {
    let (mut child, v) = start_binary(&[
        "--grpc-listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
        "--endpoint",
        "{address: 127.0.0.1:18060, model: m}",
    ])
    .await;
    let http = v["http"].as_str().unwrap();
    let grpc: SocketAddr = v["grpc"].as_str().unwrap().parse().unwrap();
    assert_ne!(grpc.port(), 0);
    let url = HttpUrl::parse(&format!("http://{http}/healthz")).unwrap();
    assert_eq!(
        indexd::load::get(
            &indexd::load::client().unwrap(),
            &url,
            Duration::from_secs(5)
        )
        .await
        .unwrap(),
        b"ok\n"
    );
    let mut client = IndexClient::connect(format!("http://{grpc}"))
        .await
        .unwrap();
    let r = client
        .pick(PickRequest {
            model: "m".into(),
            block_keys: vec![1],
            block_size: 64,
            key_scheme: kvroute_proto::SCHEME_VERSION.into(),
            ..PickRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.decision, DecisionKind::Load as i32);
    assert_eq!(r.candidates[0].address, "127.0.0.1:18060");
    child.kill().await.unwrap();

    let help = std::process::Command::new(env!("CARGO_BIN_EXE_indexd"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(help.status.success());
    assert!(String::from_utf8_lossy(&help.stdout).contains("--print-addresses"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_discovery_file_adds_and_removes_endpoints() {
    let dir = std::env::temp_dir().join(format!("indexd-discovery-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("endpoints.yaml");
    // The file replaced whole (written beside it, renamed over it).
    let replace = |text: &str| {
        let tmp = dir.join("endpoints.yaml.tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, &path).unwrap();
    };
    let write = |ports: &[u16]| {
        let mut text = String::from("endpoints:\n");
        for port in ports {
            text.push_str(&format!("  - address: 127.0.0.1:{port}\n    model: m\n"));
        }
        replace(&text);
    };
    write(&[18020]);
    let p = path.clone();
    let mut d = Daemon::start_with(vec![endpoint(18022, None)], 16, move |c| {
        c.discovery_file = Some(p);
        c.discovery_interval = Duration::from_millis(20);
    })
    .await;
    eventually("the discovered endpoint", || async {
        d.handle.replica(&replica(18020)).is_some()
    })
    .await;
    assert_eq!(d.pick(&[1], 16).await.candidates.len(), 2);

    write(&[18021, 18023]);
    eventually("the file change", || async {
        d.handle.replica(&replica(18020)).is_none() && d.handle.replica(&replica(18023)).is_some()
    })
    .await;
    // An empty file is one being written: nothing changes (read as an
    // empty list it would drop every endpoint until the next poll).
    replace("");
    eventually("the empty file to be read", || async {
        d.counter("indexd_discovery_reloads_total{result=\"empty\"}") >= 1.0
    })
    .await;
    assert!(
        d.handle.replica(&replica(18021)).is_some() && d.handle.replica(&replica(18023)).is_some()
    );
    // A broken file keeps the previous endpoints; static ones are never removed.
    std::fs::write(&path, "endpoints: [ {address: nope} ]").unwrap();
    eventually("the broken file to be read", || async {
        d.counter("indexd_discovery_reloads_total{result=\"error\"}") >= 1.0
    })
    .await;
    assert!(
        d.handle.replica(&replica(18021)).is_some() && d.handle.replica(&replica(18023)).is_some()
    );
    write(&[]);
    eventually("the removal", || async {
        d.handle.replica(&replica(18021)).is_none()
    })
    .await;
    assert!(d.handle.replica(&replica(18022)).is_some());
    let names: Vec<String> = d
        .pick(&[1], 16)
        .await
        .candidates
        .into_iter()
        .map(|c| c.address)
        .collect();
    assert_eq!(names, ["127.0.0.1:18022"]);
    d.stop().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_discovered_endpoint_on_indexds_own_http_port_is_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("endpoints.yaml");
    let p = path.clone();
    // HTTP on every address, port 0: the port is known once bound.
    let d = Daemon::start_with(vec![], 16, move |c| {
        c.http_listen = "0.0.0.0:0".parse().unwrap();
        c.access.allow_unauthenticated = true;
        c.discovery_file = Some(p);
        c.discovery_interval = Duration::from_millis(20);
    })
    .await;
    let own = d.http.port();
    let tmp = dir.path().join("endpoints.yaml.tmp");
    std::fs::write(
        &tmp,
        format!(
            "endpoints:\n  - {{address: 127.0.0.1:{own}, model: m}}\n  - {{address: 127.0.0.1:18024, model: m}}\n"
        ),
    )
    .unwrap();
    std::fs::rename(&tmp, &path).unwrap();
    eventually("the other endpoint", || async {
        d.handle.replica(&replica(18024)).is_some()
    })
    .await;
    assert!(d.handle.replica(&replica(own)).is_none());
    assert_eq!(
        d.counter("indexd_endpoints_refused_total{reason=\"self\"}"),
        1.0
    );
    // And /readyz says so.
    let ready = reqwest::get(format!("http://127.0.0.1:{own}/readyz"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let line = ready
        .lines()
        .find(|l| l.starts_with("endpoints refused as indexd's own HTTP listener"))
        .unwrap_or_else(|| panic!("{ready}"));
    assert!(
        line.contains("1 since start") && line.contains(&format!("127.0.0.1:{own} now")),
        "{line}"
    );
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnect_resyncs_from_seq_zero() {
    let mut p = Publisher::start(false).await;
    let mut d = Daemon::start(vec![endpoint(18030, Some(&p))], 16).await;
    let seq = sync_live(&d, &mut p, 18030, 0).await;
    let before = tokens(32, 9);
    p.publish(seq, &stored_batch(&[1, 2], None, &before, 16, None))
        .await;
    d.await_entries("the store", 18030, 2).await;

    // The engine process restarts; its first batch is buffered before
    // indexd reconnects, so only the replay from 0 can deliver it.
    let after = tokens(16, 10);
    p.restart_process(&stored_batch(&[7], None, &after, 16, None))
        .await;
    eventually("the resync purge", || async {
        d.counter("indexd_purges_total{reason=\"resync\"}") >= 1.0
    })
    .await;
    d.await_entries("the replayed block", 18030, 1).await;
    assert_eq!(d.matched(&before, 16).await, 0);
    assert_eq!(d.matched(&after, 16).await, 1);
    assert!(d.handle.replica(&replica(18030)).unwrap().fresh);
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_bind_mode_indexd_binds_and_the_replica_connects() {
    let mut p = Publisher::start(false).await;
    // A port for indexd to bind (taken from the OS, then released).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut ep = endpoint(18040, Some(&p));
    ep.events = Some(format!("tcp://127.0.0.1:{port}"));
    ep.events_bind = true;
    let mut d = Daemon::start(vec![ep], 16).await;
    // indexd's SUB is bound once the replica is fresh; now the PUB connects.
    eventually("the SUB to bind", || async {
        d.handle.replica(&replica(18040)).unwrap().fresh
    })
    .await;
    let mut connected = PubSocket::new();
    connected
        .connect(&format!("tcp://127.0.0.1:{port}"))
        .await
        .unwrap();
    p.pub_socket = connected;
    let seq = sync_live(&d, &mut p, 18040, 0).await;
    let t = tokens(32, 12);
    p.publish(seq, &stored_batch(&[1, 2], None, &t, 16, None))
        .await;
    d.await_entries("the store", 18040, 2).await;
    let keys = raw(&block_keys(&t, BlockSize::new(16).unwrap(), None));
    assert_eq!(d.pick(&keys, 16).await.candidates[0].matched_blocks, 2);
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_capacity_signal_adds_occupancy_to_the_cost() {
    let full = Arc::new(Mutex::new((
        200,
        r#"{"occupancy": 1.0, "cache_available": true}"#.to_owned(),
    )));
    let empty = Arc::new(Mutex::new((
        200,
        r#"{"occupancy": 0.0, "cache_available": true}"#.to_owned(),
    )));
    let (full_addr, empty_addr) = (metrics_server(full).await, metrics_server(empty).await);
    let mut a = endpoint(18050, None);
    a.capacity_url = HttpUrl::parse(&format!("http://{full_addr}/capacity"));
    let mut b = endpoint(18051, None);
    b.capacity_url = HttpUrl::parse(&format!("http://{empty_addr}/capacity"));
    let mut d = Daemon::start_with(vec![a, b], 16, |c| c.speculative_ttl = Duration::ZERO).await;
    eventually("both capacity signals", || async {
        d.counter("indexd_scrapes_total{result=\"capacity_ok\"}") >= 4.0
    })
    .await;
    let r = d.pick(&[1], 16).await;
    assert_eq!(r.candidates[0].address, "127.0.0.1:18051");
    let weights = indexd::Weights::default();
    let diff = r.candidates[1].cost - r.candidates[0].cost;
    assert!(
        (diff - weights.occupancy_penalty_seconds).abs() < 1e-9,
        "{r:?}"
    );
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_frames_are_counted_and_the_stream_goes_on() {
    let mut p = Publisher::start(false).await;
    let mut d = Daemon::start(vec![endpoint(18070, Some(&p))], 16).await;
    let seq = sync_live(&d, &mut p, 18070, 0).await;
    let t = tokens(16, 13);
    p.publish(seq, &stored_batch(&[1], None, &t, 16, None))
        .await;
    d.await_entries("the store", 18070, 1).await;
    // Garbage msgpack, a truncated real frame, a frame that is too large.
    let real = fixture("blockremoved_x7_then_blockstored_53blk.f2_payload.msgpack");
    p.publish(seq + 1, b"\xc1\xff\x00garbage").await;
    p.publish(seq + 2, &real[..real.len() / 2]).await;
    p.publish(seq + 3, &vec![0x90; 9 << 20]).await;
    eventually("three decode errors", || async {
        d.counter("indexd_decode_errors_total") == 3.0
    })
    .await;
    // Each one made indexd forget the replica (its removals may be lost).
    assert_eq!(
        d.counter("indexd_purges_total{reason=\"decode_error\"}"),
        3.0
    );
    assert_eq!(d.handle.replica(&replica(18070)).unwrap().entries, 0);
    p.publish(seq + 4, &stored_batch(&[2], None, &t, 16, None))
        .await;
    d.await_entries("the next good batch", 18070, 1).await;
    let keys = raw(&block_keys(&t, BlockSize::new(16).unwrap(), None));
    assert_eq!(d.pick(&keys, 16).await.candidates[0].matched_blocks, 1);
    d.stop().await;
}

#[path = "integration/zmtp_faults.rs"]
mod zmtp_faults;

#[path = "integration/libzmq.rs"]
mod libzmq;

#[path = "integration/tokenize.rs"]
mod tokenize;

#[path = "integration/tokenize_hostile.rs"]
mod tokenize_hostile;

#[path = "integration/snapshot.rs"]
mod snapshot;

#[path = "integration/access.rs"]
mod access;

#[path = "integration/kube_api.rs"]
mod kube_api;

#[path = "integration/kubernetes.rs"]
mod kubernetes;

#[path = "integration/metrics.rs"]
mod metrics;

#[path = "integration/hybrid.rs"]
mod hybrid;

/// Each thread of `pid` with its name and `Cpus_allowed_list`.
#[cfg(target_os = "linux")]
fn thread_cpus(pid: u32) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
    {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        let status = std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
        let cpus = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .unwrap_or_default();
        out.push((comm.trim().to_owned(), cpus.trim().to_owned()));
    }
    out
}

#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_keeps_its_request_path_off_the_ingest_cpus() {
    let allowed = indexd::cpus::allowed().unwrap();
    if allowed.len() < 2 {
        eprintln!("skipped: needs two CPUs, this process has {allowed}");
        return;
    }
    let ingest = allowed.cpus().last().unwrap().to_string();
    let rest = allowed
        .without(&ingest.parse().unwrap())
        .unwrap()
        .to_string();
    let (mut child, _) = start_binary(&[
        "--grpc-listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
        "--ingest-cpus",
        &ingest,
        "--endpoint",
        "{address: 127.0.0.1:18061, model: m, events: 'tcp://127.0.0.1:9'}",
    ])
    .await;
    // Threads pin themselves as they start: give them a moment.
    let pid = child.id().unwrap();
    let placed = |threads: &[(String, String)]| {
        let ingest_threads = threads
            .iter()
            .filter(|(name, _)| name.starts_with("indexd-ingest"))
            .count();
        ingest_threads == 1
            && threads.iter().all(|(name, cpus)| {
                let want = if name.starts_with("indexd-ingest") {
                    &ingest
                } else {
                    &rest
                };
                cpus == want
            })
    };
    let deadline = std::time::Instant::now() + TIMEOUT;
    let mut threads = thread_cpus(pid);
    while !placed(&threads) && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        threads = thread_cpus(pid);
    }
    assert!(
        placed(&threads),
        "one ingest worker on CPU {ingest}, every other thread on {rest}: {threads:?}"
    );
    child.kill().await.unwrap();

    // A CPU the process may not use is refused, with the reason.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_indexd"))
        .args([
            "--grpc-listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
        ])
        .args(["--ingest-cpus", &allowed.to_string()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("leave at least one"), "{stderr}");
}
