//! How Picks choose: only fresh replicas, the holder of the prompt's blocks
//! first; Observes that give a continuation its replica back; approximate
//! mode learning from its own answered Picks.

use kvroute_proto::keys::{BlockSize, block_keys};
use kvroute_proto::v1::{DecisionKind, Mode, ObserveRequest, Outcome, PickRequest};

use crate::harness::{Daemon, Publisher, endpoint, raw, stored_batch, sync_live, tokens};

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
