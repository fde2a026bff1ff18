//! KV events from a publisher into the index: captured vLLM 0.32 frames
//! whose keys equal the proto's keys of their tokens, salts that keep
//! tenants apart, a SUB that indexd binds for the replica to connect to,
//! and undecodable frames that are counted without stopping the stream.

use kvroute_proto::keys::{BlockSize, block_keys};
use kvroute_proto::v1::{DecisionKind, Tier};
use zeromq::{PubSocket, Socket};

use crate::harness::{
    Daemon, Publisher, endpoint, eventually, raw, replica, stored_batch, sync_live, tokens,
};

const FIXTURES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tests/fixtures/vllm-0.32-events/"
);

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(format!("{FIXTURES}{name}")).unwrap()
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
