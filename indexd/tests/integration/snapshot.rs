//! Restart in a second: an indexd that stops gracefully writes its snapshot;
//! the next one loads it, resumes each replica's stream from its saved seq
//! (proven by the replay), and routes on the restored blocks as soon as the
//! replica is fresh, without a replay from seq 0.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use indexd::config::EndpointConfig;
use kvroute_proto::keys::{BlockSize, block_keys};
use kvroute_proto::v1::{DecisionKind, PickRequest, PickResponse};

use crate::harness::{
    Daemon, Publisher, batch, endpoint, eventually, raw, replica, stored_batch, sync_live, tokens,
};

struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn dir(name: &str) -> Dir {
    let d = std::env::temp_dir().join(format!("indexd-it-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    Dir(d)
}

async fn start(endpoints: Vec<EndpointConfig>, path: &std::path::Path) -> Daemon {
    let path = path.to_owned();
    Daemon::start_with(endpoints, 16, move |c| {
        c.snapshot.path = Some(path);
        // Only the write at shutdown, in these tests.
        c.snapshot.interval = Duration::from_secs(3600);
    })
    .await
}

/// Picks `keys` until a candidate holds `blocks` of them.
async fn until_matched(d: &Daemon, keys: &[u64], blocks: u32) {
    eventually("the restored blocks to match", || {
        let mut client = d.client.clone();
        let keys = keys.to_vec();
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
            r.candidates.iter().any(|c| c.matched_blocks == blocks)
        }
    })
    .await;
}

fn matched(r: &PickResponse, port: u16) -> u32 {
    let address = format!("127.0.0.1:{port}");
    r.candidates
        .iter()
        .find(|c| c.address == address)
        .map_or(0, |c| c.matched_blocks)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_indexd_resumes_from_its_snapshot_and_routes_at_once() {
    let dir = dir("resume");
    let path = dir.0.join("index.snap");
    let (pa, pb) = (18040, 18041);
    let mut p1 = Publisher::start(false).await;
    let mut p2 = Publisher::start(false).await;
    let endpoints = vec![endpoint(pa, Some(&p1)), endpoint(pb, Some(&p2))];
    let eps = || endpoints.clone();
    let bs = BlockSize::new(16).unwrap();
    let first = tokens(64, 1);
    let second = tokens(48, 2);
    let (keys1, keys2) = (
        raw(&block_keys(&first, bs, Some("tenant"))),
        raw(&block_keys(&second, bs, None)),
    );

    let d = start(eps(), &path).await;
    let s1 = sync_live(&d, &mut p1, pa, 0).await;
    let s2 = sync_live(&d, &mut p2, pb, 0).await;
    p1.publish(
        s1,
        &stored_batch(&[1, 2, 3, 4], None, &first, 16, Some("tenant")),
    )
    .await;
    p2.publish(s2, &stored_batch(&[7, 8, 9], None, &second, 16, None))
        .await;
    until_matched(&d, &keys1, 4).await;
    until_matched(&d, &keys2, 3).await;
    d.stop().await;
    assert!(path.exists(), "graceful shutdown wrote the snapshot");

    // While indexd is away, replica A stores one more block.
    let more = tokens(16, 3);
    p1.buffer_only(s1 + 1, &stored_batch(&[5], Some(4), &more, 16, None));
    let mut all = first.clone();
    all.extend(&more);
    let keys_all = raw(&block_keys(&all, bs, Some("tenant")));

    let started = Instant::now();
    let mut d = start(eps(), &path).await;
    eventually("both replicas fresh", || async {
        [pa, pb]
            .iter()
            .all(|p| d.handle.replica(&replica(*p)).unwrap().fresh)
    })
    .await;
    let ready = started.elapsed();
    // The first Pick after readiness finds everything, the missed block too.
    let r = d.pick(&keys_all, 16).await;
    let routed = started.elapsed();
    assert_eq!(r.decision, DecisionKind::Precise as i32);
    assert_eq!((matched(&r, pa), matched(&r, pb)), (5, 0));
    let r = d.pick(&keys2, 16).await;
    assert_eq!((matched(&r, pa), matched(&r, pb)), (0, 3));
    // At once: the replicas resumed from the snapshot's sequence numbers
    // (below), not from an empty index; how long that took is a figure to
    // read, not a bound to race.
    eprintln!("restart: fresh after {ready:?}, first routed Pick after {routed:?}");
    assert_eq!(
        d.counter("indexd_replay_requests_total{from=\"snapshot\"}"),
        2.0
    );
    assert_eq!(
        d.counter("indexd_replay_requests_total{from=\"start\"}"),
        0.0,
        "no replica replayed from seq 0"
    );
    assert_eq!(
        d.counter("indexd_snapshot_resumes_total{result=\"proven\"}"),
        2.0
    );
    assert_eq!(d.counter("indexd_snapshot_loaded_entries"), 7.0);
    assert_eq!(d.counter("indexd_snapshot_loads_total{result=\"ok\"}"), 1.0);
    // The next live batch of each replica continues its stream.
    p1.publish(s1 + 2, &batch(vec![])).await;
    eventually("the live stream to continue", || async {
        d.counter("indexd_batches_total") >= 2.0
    })
    .await;
    assert_eq!(d.counter("indexd_seq_gaps_total"), 0.0);
    let handle = d.handle.clone();
    d.stop().await;
    assert!(
        handle
            .metrics_text()
            .contains("indexd_snapshot_writes_total{result=\"ok\"} 1")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_older_than_a_replay_buffer_purges_only_that_replica() {
    let dir = dir("older");
    let path = dir.0.join("index.snap");
    let (pa, pb) = (18042, 18043);
    let mut p1 = Publisher::start(false).await;
    let mut p2 = Publisher::start(false).await;
    let endpoints = vec![endpoint(pa, Some(&p1)), endpoint(pb, Some(&p2))];
    let eps = || endpoints.clone();
    let bs = BlockSize::new(16).unwrap();
    let (ta, tb, tc) = (tokens(32, 4), tokens(32, 5), tokens(16, 6));
    let keys_a = raw(&block_keys(&ta, bs, None));
    let keys_b = raw(&block_keys(&tb, bs, None));
    let keys_c = raw(&block_keys(&tc, bs, None));

    let d = start(eps(), &path).await;
    let s1 = sync_live(&d, &mut p1, pa, 0).await;
    let s2 = sync_live(&d, &mut p2, pb, 0).await;
    p1.publish(s1, &stored_batch(&[1, 2], None, &ta, 16, None))
        .await;
    p2.publish(s2, &stored_batch(&[3, 4], None, &tb, 16, None))
        .await;
    until_matched(&d, &keys_a, 2).await;
    until_matched(&d, &keys_b, 2).await;
    d.stop().await;

    // Replica B's buffer moves on past the saved seq while indexd is away.
    p2.buffer_only(s2 + 1, &stored_batch(&[5], None, &tc, 16, None));
    p2.buffer.lock().unwrap().retain(|(seq, _)| *seq > s2);

    let mut d = start(eps(), &path).await;
    eventually("both replicas fresh", || async {
        [pa, pb]
            .iter()
            .all(|p| d.handle.replica(&replica(*p)).unwrap().fresh)
    })
    .await;
    // A keeps what the snapshot proved; B forgot what it could not prove and
    // holds what its buffer still had.
    assert_eq!(matched(&d.pick(&keys_a, 16).await, pa), 2);
    assert_eq!(matched(&d.pick(&keys_b, 16).await, pb), 0);
    assert_eq!(matched(&d.pick(&keys_c, 16).await, pb), 1);
    assert_eq!(
        d.counter("indexd_snapshot_resumes_total{result=\"proven\"}"),
        1.0
    );
    assert_eq!(
        d.counter("indexd_snapshot_resumes_total{result=\"gone\"}"),
        1.0
    );
    assert_eq!(d.counter("indexd_purges_total{reason=\"snapshot\"}"), 1.0);
    assert_eq!(
        d.counter("indexd_replay_requests_total{from=\"start\"}"),
        1.0
    );
    d.stop().await;
}
