//! Hostile and broken ZMTP peers: a raw TCP client on a bound SUB and a
//! replay ROUTER stand-in that answer with frame headers claiming 1 TiB.
//! Each must cost only its own connection: indexd stays up, counts it, and
//! the other subscriptions keep flowing. The bytes are written by hand here,
//! independently of indexd's encoder.

use std::sync::Arc;

use kvroute_proto::keys::{BlockSize, block_keys};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use zeromq::{PubSocket, Socket};

use crate::harness::{
    Daemon, POLL, Publisher, TIMEOUT, endpoint, eventually, raw, replica, stored_batch, sync_live,
    tokens,
};

/// A ZMTP 3.0 NULL greeting, as any peer sends it.
fn greeting() -> Vec<u8> {
    let mut g = vec![0u8; 64];
    g[0] = 0xFF;
    g[9] = 0x7F;
    g[10] = 3;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// A READY command naming `socket_type`.
fn ready(socket_type: &str) -> Vec<u8> {
    let mut body = vec![5];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    body.extend_from_slice(socket_type.as_bytes());
    let mut frame = vec![0x04, body.len() as u8];
    frame.extend(body);
    frame
}

/// A long frame header (flags `0x02`) claiming 1 TiB, and nothing after it.
fn one_tib_header() -> Vec<u8> {
    let mut h = vec![0x02];
    h.extend_from_slice(&(1u64 << 40).to_be_bytes());
    h
}

/// True once the peer closed the connection (reads drained until EOF).
async fn closed_by_peer(stream: &mut TcpStream) -> bool {
    tokio::time::timeout(TIMEOUT, async {
        let mut sink = [0u8; 1024];
        loop {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await
    .is_ok()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Publishes a stored batch and waits until a Pick finds its blocks there.
async fn store_and_find(d: &mut Daemon, p: &mut Publisher, port: u16, seq: u64, seed: u32) {
    let t = tokens(32, seed);
    let h = u64::from(seed) * 100;
    p.publish(seq, &stored_batch(&[h, h + 1], None, &t, 16, None))
        .await;
    let keys = raw(&block_keys(&t, BlockSize::new(16).unwrap(), None));
    let want = format!("127.0.0.1:{port}");
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    loop {
        // No candidate while the replica is stale (a replay in progress).
        let r = d.pick(&keys, 16).await;
        if r.candidates
            .first()
            .is_some_and(|c| c.address == want && c.matched_blocks == 2)
        {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "blocks of {port} never found: {r:?}"
        );
        tokio::time::sleep(POLL).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_1_tib_frame_header_on_a_bound_sub_closes_only_that_connection() {
    let mut a = Publisher::start(false).await;
    let mut b = Publisher::start(false).await;
    let port = free_port();
    let mut bound = endpoint(18090, Some(&b));
    bound.events = Some(format!("tcp://127.0.0.1:{port}"));
    bound.events_bind = true;
    let mut d = Daemon::start(vec![endpoint(18091, Some(&a)), bound], 16).await;
    eventually("the SUB to bind", || async {
        d.handle.replica(&replica(18090)).unwrap().fresh
    })
    .await;
    let mut connected = PubSocket::new();
    connected
        .connect(&format!("tcp://127.0.0.1:{port}"))
        .await
        .unwrap();
    b.pub_socket = connected;
    let seq_a = sync_live(&d, &mut a, 18091, 0).await;
    let seq_b = sync_live(&d, &mut b, 18090, 0).await;

    // A well-behaved handshake, then a header claiming 1 TiB.
    let mut attacker = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let mut hello = greeting();
    hello.extend(ready("PUB"));
    hello.extend(one_tib_header());
    attacker.write_all(&hello).await.unwrap();
    assert!(
        closed_by_peer(&mut attacker).await,
        "indexd kept the connection"
    );
    eventually("the violation to be counted", || async {
        d.counter("indexd_zmtp_violations_total{reason=\"frame_too_large\"}") == 1.0
    })
    .await;
    // Not ZMTP at all: refused on its first byte.
    let mut http = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    http.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    assert!(closed_by_peer(&mut http).await);
    eventually("the bad greeting to be counted", || async {
        d.counter("indexd_zmtp_violations_total{reason=\"bad_greeting\"}") == 1.0
    })
    .await;

    assert_eq!(d.http_get("/healthz").await.unwrap(), b"ok\n");
    // Both subscriptions go on: the connected one and the bound one, whose
    // own publisher was never disturbed (no resync, still fresh).
    store_and_find(&mut d, &mut a, 18091, seq_a, 1).await;
    store_and_find(&mut d, &mut b, 18090, seq_b, 2).await;
    assert!(d.handle.replica(&replica(18090)).unwrap().fresh);
    assert_eq!(d.counter("indexd_purges_total{reason=\"resync\"}"), 0.0);
    assert_eq!(d.counter("indexd_decode_errors_total"), 0.0);
    let page = String::from_utf8(d.http_get("/metrics").await.unwrap()).unwrap();
    assert!(page.contains("indexd_zmtp_violations_total{reason=\"frame_too_large\"} 1"));
    d.stop().await;
}

/// A replay ROUTER stand-in: greets as a ROUTER and answers every
/// connection with a frame header claiming 1 TiB. Returns its endpoint and
/// how many connections it served.
async fn lying_router() -> (String, Arc<std::sync::atomic::AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    let served = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = Arc::clone(&served);
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tokio::spawn(async move {
                let mut reply = greeting();
                reply.extend(ready("ROUTER"));
                reply.extend(one_tib_header());
                let _ = s.write_all(&reply).await;
                // Read until indexd hangs up, so nothing is reset early.
                let mut sink = [0u8; 1024];
                while matches!(s.read(&mut sink).await, Ok(n) if n > 0) {}
            });
        }
    });
    (endpoint, served)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_router_claiming_1_tib_fails_the_replay_and_the_stream_goes_on() {
    let mut p = Publisher::start(false).await;
    let (router, served) = lying_router().await;
    let mut ep = endpoint(18092, Some(&p));
    ep.replay = Some(router);
    let mut d = Daemon::start(vec![ep], 16).await;
    // The start-up replay fails on the header; the replica is fresh anyway.
    let mut seq = sync_live(&d, &mut p, 18092, 0).await;
    assert_eq!(served.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(
        d.counter("indexd_zmtp_violations_total{reason=\"frame_too_large\"}"),
        1.0
    );
    assert_eq!(
        d.counter("indexd_replays_total{result=\"unavailable\"}"),
        1.0
    );
    store_and_find(&mut d, &mut p, 18092, seq, 3).await;
    seq += 1;

    // A gap: the replay fails again, indexd forgets the replica and goes on
    // from the live batch.
    let lost = tokens(16, 4);
    p.buffer_only(seq, &stored_batch(&[40], None, &lost, 16, None));
    store_and_find(&mut d, &mut p, 18092, seq + 1, 5).await;
    assert_eq!(served.load(std::sync::atomic::Ordering::SeqCst), 2);
    assert_eq!(
        d.counter("indexd_zmtp_violations_total{reason=\"frame_too_large\"}"),
        2.0
    );
    assert_eq!(d.counter("indexd_purges_total{reason=\"gap\"}"), 1.0);
    let lost_keys = raw(&block_keys(&lost, BlockSize::new(16).unwrap(), None));
    assert_eq!(d.pick(&lost_keys, 16).await.candidates[0].matched_blocks, 0);
    assert!(d.handle.replica(&replica(18092)).unwrap().fresh);
    assert_eq!(d.http_get("/healthz").await.unwrap(), b"ok\n");
    d.stop().await;
}
