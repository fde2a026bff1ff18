//! Lost batches and restarts: a gap in the seqs healed by a replay (with
//! and without topic frames in the replies), a gap the publisher's buffer no
//! longer holds, an engine that restarts its seqs, and a reconnect to a
//! restarted engine process that resyncs from seq 0.

use kvroute_proto::keys::{BlockSize, block_keys};
use kvroute_proto::v1::PickRequest;

use crate::harness::{
    Daemon, Publisher, batch, endpoint, eventually, raw, replica, stored_batch, sync_live, tokens,
};

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
