use std::net::SocketAddr;
use std::time::Duration;

use kvroute_proto::keys::{BlockSize, block_keys};
use kvroute_proto::v1::{Continued, DecisionKind, Mode, ObserveRequest, PickRequest};
use tokio_util::sync::CancellationToken;

use super::*;
use crate::config::{Config, EndpointConfig};
use crate::event::{BlockStored, EngineHash, EventBatch, ExtraKeys, KvEvent};

fn shared(n: u16, tweak: impl FnOnce(&mut Config)) -> (Shared, Vec<Arc<Replica>>) {
    let eps: Vec<EndpointConfig> = (0..n)
        .map(|i| EndpointConfig::new(SocketAddr::from(([10, 0, 0, 1], 8000 + i)), "m"))
        .collect();
    let mut config = Config::new(eps.clone());
    config.block_size = BlockSize::new(4).unwrap();
    config.seed = Some(3);
    tweak(&mut config);
    let s = Shared::new(config, CancellationToken::new());
    let replicas = eps.into_iter().map(|e| s.add_replica(e).unwrap()).collect();
    (s, replicas)
}

fn req(keys: &[u64]) -> PickRequest {
    PickRequest {
        model: "m".into(),
        block_keys: keys.to_vec(),
        block_size: 4,
        mode: Mode::Precise as i32,
        key_scheme: kvroute_proto::SCHEME_VERSION.into(),
        ..PickRequest::default()
    }
}

fn store(s: &Shared, r: &Replica, tokens: &[u32]) {
    let n = tokens.len() / 4;
    let ev = KvEvent::BlockStored(BlockStored {
        block_hashes: (0..n as u64).map(EngineHash).collect(),
        parent: None,
        token_ids: tokens.to_vec(),
        block_size: 4,
        tier: crate::event::Tier::Gpu,
        lora_name: None,
        extra_keys: Some(vec![ExtraKeys::None; n]),
        group_idx: 0,
        kind: None,
        sliding_window: None,
    });
    s.ingest(
        r,
        EventBatch {
            ts: 0.0,
            events: vec![ev],
            data_parallel_rank: None,
        },
    );
}

fn keys(tokens: &[u32]) -> Vec<u64> {
    block_keys(tokens, BlockSize::new(4).unwrap(), None)
        .iter()
        .map(|k| k.as_u64())
        .collect()
}

#[test]
fn the_holder_wins_and_only_eligible_replicas_are_named() {
    let (s, rs) = shared(3, |_| {});
    let t: Vec<u32> = (0..16).collect();
    store(&s, &rs[2], &t);
    let r = pick(&s, &req(&keys(&t)), Instant::now()).unwrap();
    assert_eq!(r.decision, DecisionKind::Precise as i32);
    assert_eq!(r.candidates[0].address, "10.0.0.1:8002");
    assert_eq!(
        (
            r.candidates[0].matched_blocks,
            r.candidates[0].matched_tokens
        ),
        (4, 16)
    );
    assert_eq!(r.candidates.len(), 3);
    assert_eq!(r.index_block_size, 4);
    rs[2].set_fresh(false);
    let r = pick(&s, &req(&keys(&t)), Instant::now()).unwrap();
    assert!(r.candidates.iter().all(|c| c.address != "10.0.0.1:8002"));
    assert_eq!(r.decision, DecisionKind::Load as i32);
    for r in &rs {
        r.set_fresh(false);
    }
    let r = pick(&s, &req(&keys(&t)), Instant::now()).unwrap();
    assert_eq!(
        (r.decision, r.candidates.len()),
        (DecisionKind::Stale as i32, 0)
    );
}

/// A writer stalled mid-batch (here: the index's lock held, as by an ingest
/// thread descheduled while applying) holds back no Pick: Picks read what
/// was last published, and the batch shows once it is published.
#[test]
fn picks_do_not_wait_for_a_writer_holding_the_index() {
    let (s, rs) = shared(2, |_| {});
    let s = Arc::new(s);
    let (a, b): (Vec<u32>, Vec<u32>) = ((0..16).collect(), (100..116).collect());
    store(&s, &rs[0], &a);
    let mut index = s.index.locked();
    // Half a batch for replica 1, not yet published.
    let ev = KvEvent::BlockStored(BlockStored {
        block_hashes: (0..4).map(EngineHash).collect(),
        parent: None,
        token_ids: b.clone(),
        block_size: 4,
        tier: crate::event::Tier::Gpu,
        lora_name: None,
        extra_keys: Some(vec![ExtraKeys::None; 4]),
        group_idx: 0,
        kind: None,
        sliding_window: None,
    });
    index.apply_unpublished(rs[1].slot, "m", ev);
    let (tx, rx) = std::sync::mpsc::channel();
    let picker = {
        let s = Arc::clone(&s);
        let (ka, kb) = (keys(&a), keys(&b));
        std::thread::spawn(move || {
            let first = |k: &[u64]| {
                let r = pick(&s, &req(k), Instant::now()).unwrap();
                (
                    r.candidates[0].address.clone(),
                    r.candidates[0].matched_blocks,
                )
            };
            let _ = tx.send((first(&ka), first(&kb)));
        })
    };
    let answered = rx.recv_timeout(Duration::from_secs(30));
    index.publish(&mut crate::index::ApplyStats::default());
    drop(index);
    picker.join().unwrap();
    let (held, unpublished) = answered.expect("a Pick waited for the index's writer");
    assert_eq!(held, ("10.0.0.1:8000".to_owned(), 4));
    assert_eq!(unpublished.1, 0, "an unpublished batch was visible");
    let r = pick(&s, &req(&keys(&b)), Instant::now()).unwrap();
    assert_eq!(
        (
            r.candidates[0].address.as_str(),
            r.candidates[0].matched_blocks
        ),
        ("10.0.0.1:8001", 4)
    );
}

#[test]
fn speculative_entries_send_siblings_to_the_same_replica_then_expire() {
    let (s, _) = shared(4, |c| c.speculative_ttl = Duration::from_secs(2));
    // Long enough that the credit outweighs the first pick's pending load.
    let k = keys(&(100..4196).collect::<Vec<u32>>());
    let now = Instant::now();
    let first = pick(&s, &req(&k), now).unwrap();
    assert_eq!(first.decision, DecisionKind::Load as i32);
    let chosen = first.candidates[0].address.clone();
    let second = pick(&s, &req(&k), now).unwrap();
    assert_eq!(second.decision, DecisionKind::Precise as i32);
    assert_eq!(
        (
            second.candidates[0].address.as_str(),
            second.candidates[0].matched_blocks
        ),
        (chosen.as_str(), 1024)
    );
    let later = pick(&s, &req(&k), now + Duration::from_secs(3)).unwrap();
    assert_eq!(later.decision, DecisionKind::Load as i32);
}

#[test]
fn block_size_mismatch_is_reported_and_ranks_by_load() {
    let (s, rs) = shared(2, |_| {});
    let t: Vec<u32> = (0..16).collect();
    store(&s, &rs[0], &t);
    let mut r8 = req(&keys(&t));
    r8.block_size = 8;
    let r = pick(&s, &r8, Instant::now()).unwrap();
    assert_eq!(
        (r.decision, r.reason.as_str()),
        (DecisionKind::Load as i32, "block_size_mismatch")
    );
    assert!(r.block_size_mismatch);
    assert!(r.candidates.iter().all(|c| c.matched_blocks == 0));
    assert_eq!(s.metrics.block_size_mismatch.get(["pick"]), 1);
}

#[test]
fn keys_of_another_scheme_are_reported_and_rank_by_load() {
    let (s, rs) = shared(2, |_| {});
    let t: Vec<u32> = (0..16).collect();
    store(&s, &rs[0], &t);
    let matched = pick(&s, &req(&keys(&t)), Instant::now()).unwrap();
    assert_eq!(matched.decision, DecisionKind::Precise as i32);
    // A filter older than the field sends none; a newer one another name.
    for scheme in ["", "kvroute/v1", "kvroute/v3"] {
        let mut other = req(&keys(&t));
        other.key_scheme = scheme.into();
        let r = pick(&s, &other, Instant::now()).unwrap();
        assert_eq!(
            (r.decision, r.reason.as_str()),
            (DecisionKind::Load as i32, "key_scheme_mismatch"),
            "{scheme:?}"
        );
        assert!(r.key_scheme_mismatch && !r.block_size_mismatch);
        assert!(r.candidates.iter().all(|c| c.matched_blocks == 0));
    }
    assert_eq!(s.metrics.key_scheme_mismatch.get(), 3);
    // Approximate keys are indexd's own learning: no scheme to agree on.
    let mut approximate = req(&keys(&t));
    approximate.mode = Mode::Approximate as i32;
    approximate.key_scheme.clear();
    let r = pick(&s, &approximate, Instant::now()).unwrap();
    assert!(!r.key_scheme_mismatch);
    assert_eq!(s.metrics.key_scheme_mismatch.get(), 3);
}

#[test]
fn limits_and_candidate_caps() {
    let (s, _) = shared(5, |c| {
        c.max_pick_keys = 3;
        c.max_candidates = 2;
    });
    assert!(matches!(
        pick(&s, &req(&[1, 2, 3, 4]), Instant::now()),
        Err(RequestError::TooManyKeys { .. })
    ));
    assert_eq!(
        pick(&s, &req(&[1]), Instant::now())
            .unwrap()
            .candidates
            .len(),
        2
    );
    let mut one = req(&[1]);
    one.max_candidates = 1;
    assert_eq!(pick(&s, &one, Instant::now()).unwrap().candidates.len(), 1);
}

#[test]
fn pending_picks_spread_load_until_a_scrape_sees_them() {
    let (s, _) = shared(2, |c| c.speculative_ttl = Duration::ZERO);
    let now = Instant::now();
    let a = pick(&s, &req(&[1]), now).unwrap().candidates[0]
        .address
        .clone();
    let b = pick(&s, &req(&[2]), now).unwrap().candidates[0]
        .address
        .clone();
    assert_ne!(a, b, "the second pick sees the first as in flight");
}

/// Picks arriving together (Envoy's workers, conversations starting at
/// once) place one after the other: each sees the prefill the ones before
/// it queued, so eight equal first turns on two idle replicas split 4/4.
/// Read at the same moment, the loads would send several to one replica.
#[test]
fn picks_arriving_together_each_see_the_ones_before() {
    const THREADS: usize = 8;
    for round in 0..100u64 {
        let (s, _) = shared(2, |c| c.speculative_ttl = Duration::ZERO);
        let s = Arc::new(s);
        let now = Instant::now();
        let start = Arc::new(std::sync::Barrier::new(THREADS));
        let threads: Vec<_> = (0..THREADS as u64)
            .map(|t| {
                let (s, start) = (Arc::clone(&s), Arc::clone(&start));
                std::thread::spawn(move || {
                    let keys: Vec<u64> = (0..1024).map(|b| (round << 32) | (t << 16) | b).collect();
                    start.wait();
                    pick(&s, &req(&keys), now).unwrap().candidates[0]
                        .address
                        .clone()
                })
            })
            .collect();
        let mut on_first = 0;
        for t in threads {
            on_first += usize::from(t.join().unwrap() == "10.0.0.1:8000");
        }
        assert_eq!(on_first, THREADS / 2, "round {round}");
    }
}

#[test]
fn affinity_by_address_when_the_rank_is_unknown() {
    let (s, _) = shared(2, |_| {});
    let obs = ObserveRequest {
        model: "m".into(),
        endpoint: "10.0.0.1:8001".into(),
        response_id: "resp_1".into(),
        data_parallel_rank: Some(3),
        ..ObserveRequest::default()
    };
    observe(&s, &obs, Instant::now()).unwrap();
    let mut r = req(&[1]);
    r.previous_response_id = "resp_1".into();
    let resp = pick(&s, &r, Instant::now()).unwrap();
    assert_eq!(
        (resp.decision, resp.candidates[0].address.as_str()),
        (DecisionKind::Affinity as i32, "10.0.0.1:8001")
    );
}

/// A turn sent by `previous_response_id` counts where its conversation is,
/// as any other pick does: the move rule's counts see Responses traffic.
#[test]
fn an_affinity_pick_counts_its_conversation() {
    let (s, replicas) = shared(2, |c| c.speculative_ttl = Duration::ZERO);
    let now = Instant::now();
    let first = keys(&(0..16).collect::<Vec<u32>>());
    let at = pick(&s, &req(&first), now).unwrap().candidates[0]
        .address
        .clone();
    let other = if at == "10.0.0.1:8000" {
        "10.0.0.1:8001"
    } else {
        "10.0.0.1:8000"
    };
    // Its response was stored on the other replica (Envoy retried there).
    let obs = ObserveRequest {
        model: "m".into(),
        endpoint: other.into(),
        response_id: "resp_1".into(),
        ..ObserveRequest::default()
    };
    observe(&s, &obs, now).unwrap();
    let mut next = req(&keys(&(0..32).collect::<Vec<u32>>()));
    next.previous_response_id = "resp_1".into();
    let resp = pick(&s, &next, now).unwrap();
    assert_eq!(
        (resp.decision, resp.candidates[0].address.as_str()),
        (DecisionKind::Affinity as i32, other)
    );
    let on = |address: &str| {
        let r = replicas
            .iter()
            .find(|r| r.id().to_string() == address)
            .unwrap();
        lock(&s.conversations).on(r.slot, now)
    };
    assert_eq!((on(at.as_str()), on(other)), (0, 1));
    let turns = |t| s.metrics.conversation_turns.get([t]);
    assert_eq!((turns("new"), turns("moved")), (1, 1));
}

#[test]
fn an_answered_pick_stops_counting_as_queued_work() {
    let (s, _) = shared(2, |c| c.speculative_ttl = Duration::ZERO);
    let now = Instant::now();
    let pick_for = |id: &str, tokens: std::ops::Range<u32>| {
        let mut r = req(&keys(&tokens.collect::<Vec<u32>>()));
        r.request_id = id.into();
        pick(&s, &r, now).unwrap().candidates[0].address.clone()
    };
    // r1 queues 64 tokens of prefill on its replica; an unrelated request
    // goes to the other one.
    let busy = pick_for("r1", 0..64);
    let other = pick_for("r2", 1000..1016);
    assert_ne!(busy, other);
    // r1 answered: its replica is idle again, the other still has r2 queued.
    let answered = ObserveRequest {
        model: "m".into(),
        endpoint: busy.clone(),
        request_id: "r1".into(),
        ..ObserveRequest::default()
    };
    observe(&s, &answered, now).unwrap();
    assert_eq!(pick_for("r3", 2000..2016), busy);
}

#[test]
fn completed_ids_carried_by_a_pick_free_their_replicas_first() {
    let (s, _) = shared(2, |c| c.speculative_ttl = Duration::ZERO);
    let now = Instant::now();
    let mut first = req(&keys(&(0..64).collect::<Vec<u32>>()));
    first.request_id = "r1".into();
    let busy = pick(&s, &first, now).unwrap().candidates[0].address.clone();
    let mut second = req(&keys(&(1000..1016).collect::<Vec<u32>>()));
    second.request_id = "r2".into();
    let other = pick(&s, &second, now).unwrap().candidates[0]
        .address
        .clone();
    assert_ne!(busy, other);
    // The next Pick says r1 has started answering: r1's replica is the idle
    // one when this Pick is ranked.
    let mut third = req(&keys(&(2000..2016).collect::<Vec<u32>>()));
    third.request_id = "r3".into();
    third.completed_request_ids = vec!["r1".into()];
    assert_eq!(pick(&s, &third, now).unwrap().candidates[0].address, busy);
}

/// A continued request on `address`, routed `age_ms` ago.
fn continued(id: &str, address: &str, new_tokens: u32, age_ms: u32) -> Continued {
    Continued {
        request_id: id.into(),
        address: address.into(),
        data_parallel_rank: None,
        new_tokens,
        age_ms,
    }
}

#[test]
fn continued_requests_count_as_queued_work_until_completed() {
    let (s, replicas) = shared(2, |c| c.speculative_ttl = Duration::ZERO);
    let now = Instant::now();
    // Two continuations went to the first replica without a Pick: the next
    // Pick, a new conversation, goes to the other one.
    let mut first = req(&keys(&(0..16).collect::<Vec<u32>>()));
    first.continued = vec![
        continued("c1", "10.0.0.1:8000", 4_000, 10),
        continued("c2", "10.0.0.1:8000", 4_000, 10),
    ];
    first.request_id = "p1".into();
    let to = pick(&s, &first, now).unwrap().candidates[0].address.clone();
    assert_eq!(to, "10.0.0.1:8001");
    let pending = |r: &Replica| r.load(now, Duration::from_secs(5), 0).pending_picks;
    assert_eq!(pending(&replicas[0]), 2.0);
    assert_eq!(pending(&replicas[1]), 1.0);
    // Both answered (this Pick carries their completions and p1's): the
    // first replica is idle again and takes the next conversation.
    let mut second = req(&keys(&(100..116).collect::<Vec<u32>>()));
    second.completed_request_ids = vec!["c1".into(), "c2".into(), "p1".into()];
    second.request_id = "p2".into();
    assert_eq!(
        pick(&s, &second, now).unwrap().candidates[0].address,
        "10.0.0.1:8000"
    );
    // A continuation reported with its own completion in the same Pick
    // leaves nothing behind.
    let mut third = req(&keys(&(200..216).collect::<Vec<u32>>()));
    third.continued = vec![continued("c3", "10.0.0.1:8001", 10, 5)];
    third.completed_request_ids = vec!["c3".into(), "p2".into()];
    let to = pick(&s, &third, now).unwrap().candidates[0].address.clone();
    let own = if to == "10.0.0.1:8001" { 1.0 } else { 0.0 };
    assert_eq!(pending(&replicas[1]), own, "at most the third Pick itself");
}

#[test]
fn continued_entries_are_checked_and_aged() {
    let (s, replicas) = shared(1, |c| c.speculative_ttl = Duration::ZERO);
    let now = Instant::now();
    let mut r = req(&[]);
    r.continued = vec![
        continued("a", "10.0.0.9:8000", 10, 0),
        continued("b", "not an address", 10, 0),
        continued(
            &"x".repeat(MAX_REQUEST_ID_BYTES + 1),
            "10.0.0.1:8000",
            10,
            0,
        ),
        continued("", "10.0.0.1:8000", 10, 0),
        // Routed longer ago than pending_pick_ttl: it counts no more.
        continued("old", "10.0.0.1:8000", 10, 6_000),
        continued("new", "10.0.0.1:8000", 10, 0),
    ];
    pick(&s, &r, now).unwrap();
    let load = replicas[0].load(now, Duration::from_secs(5), 0);
    assert_eq!(load.pending_picks, 2.0, "\"new\" and this Pick");
    let mut text = String::new();
    s.metrics.render(&mut text);
    assert!(
        text.contains("indexd_continued_total{result=\"noted\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("indexd_continued_total{result=\"skipped\"} 4"),
        "{text}"
    );
    assert!(
        text.contains("indexd_continued_total{result=\"expired\"} 1"),
        "{text}"
    );
    let mut r = req(&[]);
    r.continued = vec![continued("a", "10.0.0.1:8000", 1, 0); MAX_COMPLETED_IDS + 1];
    assert!(matches!(
        pick(&s, &r, now),
        Err(RequestError::TooManyEntries {
            field: "continued requests",
            ..
        })
    ));
}

#[test]
fn ids_are_bounded() {
    let (s, _) = shared(1, |_| {});
    let now = Instant::now();
    let mut r = req(&[]);
    r.request_id = "x".repeat(MAX_REQUEST_ID_BYTES + 1);
    assert!(matches!(
        pick(&s, &r, now),
        Err(RequestError::IdTooLong {
            field: "request_id",
            ..
        })
    ));
    let mut r = req(&[]);
    r.completed_request_ids = vec!["a".into(); MAX_COMPLETED_IDS + 1];
    assert!(matches!(
        pick(&s, &r, now),
        Err(RequestError::TooManyEntries {
            field: "completed_request_ids",
            ..
        })
    ));
    let mut r = req(&[]);
    r.previous_response_id = "p".repeat(MAX_RESPONSE_ID_BYTES + 1);
    assert!(pick(&s, &r, now).is_err());
    let o = ObserveRequest {
        response_id: "p".repeat(MAX_RESPONSE_ID_BYTES + 1),
        ..ObserveRequest::default()
    };
    assert!(observe(&s, &o, now).is_err());
}

#[test]
fn a_continuation_of_a_pending_pick_stays_on_its_replica() {
    let (s, _) = shared(3, |_| {});
    let now = Instant::now();
    let tokens: Vec<u32> = (0..64).collect();
    let mut first = req(&keys(&tokens));
    first.prompt_tokens = 66;
    let warm = pick(&s, &first, now).unwrap().candidates[0].address.clone();
    // The next turn arrives before anything reports the first answered: the
    // first's queued blocks are the continuation's own prefix, not extra work.
    let longer: Vec<u32> = (0..96).collect();
    let mut next = req(&keys(&longer));
    next.prompt_tokens = 98;
    let resp = pick(&s, &next, now).unwrap();
    assert_eq!(resp.candidates[0].address, warm);
    assert_eq!(resp.decision, DecisionKind::Precise as i32);
}

#[test]
fn affinity_checks_the_model_the_adapter_and_freshness() {
    let eps: Vec<EndpointConfig> = (0..2)
        .map(|i| {
            let mut e = EndpointConfig::new(SocketAddr::from(([10, 0, 0, 1], 8000 + i)), "m");
            e.adapters = vec!["L".into()];
            e
        })
        .collect();
    let s = Shared::new(Config::new(eps.clone()), CancellationToken::new());
    let replicas: Vec<_> = eps.into_iter().map(|e| s.add_replica(e).unwrap()).collect();
    let now = Instant::now();
    let seen = |id: &str, endpoint: &str, model: &str| {
        let o = ObserveRequest {
            model: model.into(),
            endpoint: endpoint.into(),
            response_id: id.into(),
            ..ObserveRequest::default()
        };
        observe(&s, &o, now).unwrap();
    };
    let follow = |id: &str, model: &str| {
        let mut r = req(&[1]);
        r.model = model.into();
        r.previous_response_id = id.into();
        pick(&s, &r, now).unwrap()
    };
    let affinity = DecisionKind::Affinity as i32;
    seen("r_base", "10.0.0.1:8001", "m");
    seen("r_lora", "10.0.0.1:8001", "L");
    // Recorded for the base model: never answers for the adapter, nor the
    // other way round.
    assert_ne!(follow("r_base", "L").decision, affinity);
    assert_ne!(follow("r_lora", "m").decision, affinity);
    assert_eq!(s.metrics.affinity_lookups.get(["model_mismatch"]), 2);
    let hit = follow("r_lora", "L");
    assert_eq!(
        (hit.decision, hit.candidates[0].address.as_str()),
        (affinity, "10.0.0.1:8001")
    );
    // A stale replica is not named, by affinity or otherwise.
    replicas[1].set_fresh(false);
    let r = follow("r_lora", "L");
    assert_ne!(r.decision, affinity);
    assert!(r.candidates.iter().all(|c| c.address != "10.0.0.1:8001"));
    assert_eq!(s.metrics.affinity_lookups.get(["stale"]), 1);
    // Nor an unhealthy one.
    replicas[1].set_fresh(true);
    assert!(replicas[1].scrape_failed(1));
    let r = follow("r_base", "m");
    assert_ne!(r.decision, affinity);
    assert!(r.candidates.iter().all(|c| c.address != "10.0.0.1:8001"));
    assert_eq!(s.metrics.affinity_lookups.get(["unhealthy"]), 1);
    // A replica that left, or came back not serving the model any more.
    seen("r_gone", "10.0.0.1:8000", "m");
    seen("r_other", "10.0.0.1:8000", "L");
    let id0 = replicas[0].id().clone();
    assert!(s.remove_replica(&id0));
    assert_ne!(follow("r_gone", "m").decision, affinity);
    s.add_replica(EndpointConfig::new(id0.address, "m"))
        .unwrap();
    let r = follow("r_other", "L");
    assert_eq!(r.decision, DecisionKind::Stale as i32);
    assert_eq!(
        (
            s.metrics.affinity_lookups.get(["replica_gone"]),
            s.metrics.affinity_lookups.get(["model_not_served"]),
            s.metrics.affinity_lookups.get(["hit"]),
        ),
        (1, 1, 1)
    );
}

fn observed(endpoint: &str, rank: Option<u32>, model: &str, id: &str) -> ObserveRequest {
    ObserveRequest {
        model: model.into(),
        endpoint: endpoint.into(),
        data_parallel_rank: rank,
        response_id: id.into(),
        ..ObserveRequest::default()
    }
}

#[test]
fn observe_names_a_registered_replica_serving_its_model() {
    let mut eps: Vec<EndpointConfig> = (0..2)
        .map(|rank| {
            let mut e = EndpointConfig::new(SocketAddr::from(([10, 0, 0, 2], 8000)), "m");
            e.id.rank = Some(rank);
            e
        })
        .collect();
    eps.push(EndpointConfig::new(
        SocketAddr::from(([10, 0, 0, 3], 8000)),
        "m",
    ));
    let s = Shared::new(Config::new(eps.clone()), CancellationToken::new());
    for e in eps {
        s.add_replica(e).unwrap();
    }
    let now = Instant::now();
    let refused = |o: &ObserveRequest| observe(&s, o, now).unwrap_err();
    // Another address, another rank of a server registered by rank, another
    // model: refused, and nothing is recorded.
    for (o, label) in [
        (
            observed("10.0.0.9:8000", None, "m", "a"),
            "unknown_endpoint",
        ),
        (
            observed("10.0.0.2:8001", None, "m", "b"),
            "unknown_endpoint",
        ),
        (
            observed("10.0.0.2:8000", Some(2), "m", "c"),
            "unknown_endpoint",
        ),
        (
            observed("10.0.0.2:8000", Some(1), "other", "d"),
            "model_not_served",
        ),
        (
            observed("10.0.0.2:8000", Some(1), "", "e"),
            "model_not_served",
        ),
    ] {
        let e = refused(&o);
        assert_eq!(tonic::Status::from(e).code(), tonic::Code::InvalidArgument);
        assert!(s.metrics.observes.get([label]) > 0, "{label}");
    }
    assert_eq!(lock(&s.affinity).len(), 0);
    // A known rank, a rank of a server registered without ranks, or no rank.
    for o in [
        observed("10.0.0.2:8000", Some(1), "m", "f"),
        observed("10.0.0.3:8000", Some(4), "m", "g"),
        observed("10.0.0.2:8000", None, "m", "h"),
    ] {
        observe(&s, &o, now).unwrap();
    }
    assert_eq!(s.metrics.observes.get(["recorded"]), 3);
    // A recorded id is never moved to another replica or model.
    for o in [
        observed("10.0.0.2:8000", Some(0), "m", "f"),
        observed("10.0.0.3:8000", None, "m", "f"),
    ] {
        let e = refused(&o);
        assert_eq!(tonic::Status::from(e).code(), tonic::Code::AlreadyExists);
    }
    assert_eq!(s.metrics.observes.get(["conflict"]), 2);
    let mut r = req(&[1]);
    r.previous_response_id = "f".into();
    let resp = pick(&s, &r, now).unwrap();
    assert_eq!(
        (resp.decision, resp.candidates[0].data_parallel_rank),
        (DecisionKind::Affinity as i32, Some(1))
    );
    // The same facts again are fine.
    observe(&s, &observed("10.0.0.2:8000", Some(1), "m", "f"), now).unwrap();
}

#[test]
fn observe_is_rate_limited_before_anything_else() {
    let (s, _) = shared(1, |c| {
        c.access.observe_rate = std::num::NonZeroU32::new(10).unwrap();
        c.access.observe_burst = std::num::NonZeroU32::new(3).unwrap();
    });
    let now = Instant::now();
    let o = |id: &str| observed("10.0.0.1:8000", None, "m", id);
    for id in ["a", "b", "c"] {
        observe(&s, &o(id), now).unwrap();
    }
    // Over the burst: refused whatever it says, valid or not.
    for bad in [o("d"), observed("10.0.0.9:1", None, "m", "e")] {
        let e = observe(&s, &bad, now).unwrap_err();
        assert_eq!(e, RequestError::RateLimited);
        assert_eq!(
            tonic::Status::from(e).code(),
            tonic::Code::ResourceExhausted
        );
    }
    assert_eq!(s.metrics.observes.get(["rate_limited"]), 2);
    assert_eq!(s.metrics.observes.get(["unknown_endpoint"]), 0);
    assert_eq!(lock(&s.affinity).len(), 3);
    // 10 a second: one more after 100 ms.
    observe(&s, &o("d"), now + Duration::from_millis(100)).unwrap();
    assert!(observe(&s, &o("e"), now + Duration::from_millis(100)).is_err());
}

#[test]
fn picks_count_each_conversation_where_its_latest_turn_went() {
    let (s, replicas) = shared(2, |c| c.speculative_ttl = Duration::ZERO);
    let now = Instant::now();
    let to = |tokens: &[u32]| {
        let address = pick(&s, &req(&keys(tokens)), now).unwrap().candidates[0]
            .address
            .clone();
        replicas
            .iter()
            .position(|r| r.id().to_string() == address)
            .unwrap()
    };
    let counts = || {
        let mut c = lock(&s.conversations);
        [c.on(replicas[0].slot, now), c.on(replicas[1].slot, now)]
    };
    // Two conversations sharing their first 8 tokens (2 blocks).
    let x: Vec<u32> = (0..8).chain(100..124).collect();
    let y: Vec<u32> = (0..8).chain(200..216).collect();
    let (x_at, y_at) = (to(&x), to(&y));
    let mut expected = [0, 0];
    expected[x_at] += 1;
    expected[y_at] += 1;
    assert_eq!(counts(), expected);
    // x's next turns continue it, wherever they go: still two conversations.
    let mut turn = x;
    for next in 1..4u32 {
        turn.extend(1_000 * next..1_000 * next + 40);
        let at = to(&turn);
        let mut expected = [0, 0];
        expected[at] += 1;
        expected[y_at] += 1;
        assert_eq!(counts(), expected, "turn {next}");
    }
    // What each pick did to its conversation, counted.
    let turns = |t| s.metrics.conversation_turns.get([t]);
    assert_eq!(turns("new"), 2);
    assert_eq!(turns("stayed") + turns("moved"), 3);
}

#[test]
fn ranked_answers_name_the_replicas_a_continuation_should_ask_about() {
    let (s, reps) = shared(2, |c| c.speculative_ttl = Duration::ZERO);
    let now = Instant::now();
    let req = |keys: &[u64]| PickRequest {
        want_busy: true,
        ..req(keys)
    };
    let answer = pick(&s, &req(&[1]), now).unwrap();
    assert!(answer.busy_known);
    assert!(answer.busy.is_empty(), "idle replicas: none busy");
    // vLLM reports requests waiting on one replica in two scrapes in a row.
    reps[1].scrape_ok(2.0, 3.0, 0.1, None, now);
    reps[1].scrape_ok(2.0, 1.0, 0.1, None, now);
    let answer = pick(&s, &req(&[2]), now).unwrap();
    let busy: Vec<_> = answer.busy.iter().map(|b| b.address.as_str()).collect();
    assert_eq!(busy, [reps[1].address()]);
    assert_eq!(answer.busy[0].data_parallel_rank, reps[1].id().rank);
    // Gone from the latest scrape: not busy any more.
    reps[1].scrape_ok(2.0, 0.0, 0.1, None, now);
    assert!(pick(&s, &req(&[3]), now).unwrap().busy.is_empty());
}

#[test]
fn only_a_pick_that_asks_gets_the_busy_replicas() {
    let (s, reps) = shared(2, |c| c.speculative_ttl = Duration::ZERO);
    let now = Instant::now();
    reps[1].scrape_ok(2.0, 3.0, 0.1, None, now);
    reps[1].scrape_ok(2.0, 1.0, 0.1, None, now);
    let answer = pick(&s, &req(&[1]), now).unwrap();
    assert!(!answer.busy_known);
    assert!(answer.busy.is_empty());
    let asked = PickRequest {
        want_busy: true,
        ..req(&[2])
    };
    assert_eq!(pick(&s, &asked, now).unwrap().busy.len(), 1);
}

/// Under cache pressure a conversation is not held on its replica by blocks
/// the queue ahead of it there will evict first: it goes where it starts
/// soonest, and its pick stands for every block it allocates there.
#[test]
fn a_pick_credits_only_the_blocks_that_survive_the_queue_ahead() {
    let run = |predict: bool| {
        let (s, rs) = shared(2, |c| {
            c.speculative_ttl = Duration::ZERO;
            c.weights.predict_eviction = predict;
        });
        let now = Instant::now();
        // The conversation's 8 blocks on replica 0; both caches of 20
        // blocks, half in use: 10 free or evictable there, 8 of them its.
        let t: Vec<u32> = (0..40).collect();
        store(&s, &rs[0], &t[..32]);
        for r in &rs {
            r.scrape_ok(0.0, 0.0, 0.5, Some(20.0), now);
        }
        // Another request queued ahead on replica 0 allocates 12 blocks:
        // the 2 older free ones, then all 8 of the conversation's.
        rs[0].note_pick(now, "ahead", Duration::ZERO, 12);
        let answer = pick(&s, &req(&keys(&t)), now).unwrap();
        let load = |i: usize| rs[i].load(now, s.config.pending_pick_ttl, 0).demand_blocks;
        (
            answer.candidates[0].address.clone(),
            s.metrics.eviction_discounts.get(),
            load(0),
            load(1),
        )
    };
    let (to, discounts, d0, d1) = run(true);
    assert_eq!(to, "10.0.0.1:8001");
    assert_eq!(discounts, 1);
    assert_eq!(
        (d0, d1),
        (12.0, 10.0),
        "the pick allocates all 10 blocks there"
    );
    // Crediting the blocks as they stand, it stays where they are.
    let (to, discounts, d0, _) = run(false);
    assert_eq!(to, "10.0.0.1:8000");
    assert_eq!(discounts, 0);
    assert_eq!(d0, 14.0, "12 ahead, and the 2 blocks it adds");
}

/// A prompt longer than the model's context is refused by vLLM with a 400
/// before anything is scheduled: its Pick is routed by load and noted
/// nowhere, so a flood of such bodies leaves every conversation warm where
/// it is. Before the context length is known, the same Pick is the queue
/// and the cache demand it would be, and moves the conversation away.
#[test]
fn a_prompt_longer_than_the_context_queues_and_holds_nothing() {
    let run = |known: Option<u32>| {
        let (s, rs) = shared(2, |c| c.speculative_ttl = Duration::ZERO);
        if let Some(len) = known {
            s.tokenizers.learn_max_model_len("m", len);
        }
        let now = Instant::now();
        let t: Vec<u32> = (0..40).collect();
        store(&s, &rs[0], &t[..32]);
        for r in &rs {
            r.scrape_ok(0.0, 0.0, 0.5, Some(20.0), now);
        }
        // 4,096 tokens of text the conversation does not share, first
        // placed on its warm replica by load alone (the other has a queue).
        rs[1].note_pick(now, "other", Duration::from_millis(50), 0);
        let long: Vec<u32> = (100_000..104_096).collect();
        let mut hostile = req(&keys(&long));
        hostile.request_id = "long".into();
        hostile.prompt_tokens = 4_096;
        let answer = pick(&s, &hostile, now).unwrap();
        let to = answer.candidates[0].address.clone();
        let queued = rs[0].load(now, s.config.pending_pick_ttl, 0);
        let mut next = req(&keys(&t));
        next.prompt_tokens = 40;
        let cont = pick(&s, &next, now).unwrap();
        (
            answer.reason,
            to,
            queued.demand_blocks,
            queued.queued_seconds,
            cont.candidates[0].address.clone(),
        )
    };
    let (reason, to, demand, queued, cont) = run(Some(2_048));
    assert_eq!(reason, "over_max_model_len");
    assert_eq!(to, "10.0.0.1:8000");
    assert_eq!((demand, queued), (0.0, 0.0), "nothing noted");
    assert_eq!(cont, "10.0.0.1:8000", "the conversation stays warm");
    // Unknown context length: the long prompt is the load it would be.
    let (reason, to, demand, queued, cont) = run(None);
    assert_eq!(reason, "no_match");
    assert_eq!(to, "10.0.0.1:8000");
    assert!(demand >= 1_000.0 && queued > 0.0, "{demand} {queued}");
    assert_eq!(cont, "10.0.0.1:8001", "the queue moved it");
    // Within the context: noted as before.
    let (reason, ..) = run(Some(4_096));
    assert_eq!(reason, "no_match");
}

/// Two replicas settled at 8,000 prefill tokens a second, and a time past
/// their start.
fn two_settled(tweak: impl FnOnce(&mut Config)) -> (Shared, Vec<Arc<Replica>>, Instant) {
    let (s, rs) = shared(2, tweak);
    for r in &rs {
        believed(r, 8_000.0);
    }
    (s, rs, Instant::now() + Duration::from_secs(6))
}

fn believed(r: &Replica, tokens_per_second: f64) {
    let speed = crate::calibrate::PrefillSpeed {
        tokens_per_second,
        overhead_seconds: 0.0,
    };
    r.settle(Some(speed), 8_000.0);
}

#[test]
fn a_replica_kept_out_by_its_speed_estimate_alone_gets_a_new_conversation() {
    let (s, rs) = shared(2, |_| {});
    believed(&rs[0], 8_000.0);
    believed(&rs[1], 2_000.0);
    // Both registered more than starve_after ago.
    let t0 = Instant::now() + Duration::from_secs(6);
    let first: Vec<u32> = (0..400).collect();
    let r = pick(&s, &req(&keys(&first)), t0).unwrap();
    assert_eq!(
        r.candidates[0].address, "10.0.0.1:8000",
        "the faster on paper"
    );
    assert_eq!(s.metrics.explorations.get(), 0, "no new conversation yet");
    // The second new conversation: 0.1 s on the first choice behind the
    // first's prefill, 0.2 s on the other at its believed speed, 0.05 s
    // there at the first choice's. Its speed estimate alone keeps it out.
    let second: Vec<u32> = (1_000..1_400).collect();
    let r = pick(&s, &req(&keys(&second)), t0 + Duration::from_millis(1)).unwrap();
    assert_eq!(r.candidates[0].address, "10.0.0.1:8001", "explored");
    assert_eq!(s.metrics.explorations.get(), 1);
    // It has had one now; the next new conversation goes by cost again.
    let third: Vec<u32> = (2_000..2_400).collect();
    let r = pick(&s, &req(&keys(&third)), t0 + Duration::from_millis(2)).unwrap();
    assert_eq!(r.candidates[0].address, "10.0.0.1:8000");
    // A continuation is never explored.
    let mut turn = first.clone();
    turn.extend(3_000..3_100);
    let r = pick(&s, &req(&keys(&turn)), t0 + Duration::from_secs(6)).unwrap();
    assert_eq!(r.candidates[0].address, "10.0.0.1:8000");
    assert_eq!(s.metrics.explorations.get(), 1);
}

#[test]
fn a_replica_kept_out_by_the_cache_is_not_explored() {
    let (s, rs) = shared(2, |_| {});
    believed(&rs[0], 8_000.0);
    believed(&rs[1], 2_000.0);
    // A shared system prompt of 320 tokens, cached on the first replica.
    let system: Vec<u32> = (0..320).collect();
    store(&s, &rs[0], &system);
    let t0 = Instant::now() + Duration::from_secs(6);
    for (i, at) in [(0u32, 0u64), (1, 1), (2, 2)] {
        let mut prompt = system.clone();
        prompt.extend((10_000 + i * 1_000)..(10_080 + i * 1_000));
        let r = pick(&s, &req(&keys(&prompt)), t0 + Duration::from_millis(at)).unwrap();
        assert_eq!(r.candidates[0].address, "10.0.0.1:8000", "conversation {i}");
    }
    assert_eq!(s.metrics.explorations.get(), 0);
}

/// Two replicas settled at 8,000 tokens a second, both holding `system`: a
/// new conversation behind it costs a joiner that prompt's prefill, so the
/// cost model alone keeps it away.
fn fleet_holding(system: &[u32]) -> Shared {
    let (s, rs) = shared(2, |_| {});
    for r in &rs {
        believed(r, 8_000.0);
        store(&s, r, system);
    }
    s
}

/// A third replica (`10.0.0.1:8002`) joining `s`'s running fleet, settled
/// at the fleet's speed.
fn join(s: &Shared) -> Arc<Replica> {
    let joiner = s
        .add_joiner(EndpointConfig::new(
            SocketAddr::from(([10, 0, 0, 1], 8002)),
            "m",
        ))
        .unwrap();
    believed(&joiner, 8_000.0);
    joiner
}

/// `system` and the `i`-th conversation's own 80 tokens.
fn behind(system: &[u32], i: u32) -> Vec<u32> {
    let mut p = system.to_vec();
    p.extend((10_000 + i * 1_000)..(10_080 + i * 1_000));
    p
}

#[test]
fn a_replica_that_joins_takes_the_next_new_conversation_at_once() {
    let system: Vec<u32> = (0..320).collect();
    let s = fleet_holding(&system);
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let first = pick(&s, &req(&keys(&behind(&system, 0))), at(0)).unwrap();
    assert_ne!(first.candidates[0].address, "10.0.0.1:8002");
    let joiner = join(&s);
    assert!(joiner.filling(at(1)));
    // Well within starve_after of its joining: taken at once.
    let r = pick(&s, &req(&keys(&behind(&system, 1))), at(1)).unwrap();
    assert_eq!(r.candidates[0].address, "10.0.0.1:8002", "the joiner");
    assert_eq!(s.metrics.explorations.get(), 1);
    // It has had one: the next ones go by cost, to where the prompt is.
    for i in 2..4 {
        let r = pick(&s, &req(&keys(&behind(&system, i))), at(u64::from(i))).unwrap();
        assert_ne!(r.candidates[0].address, "10.0.0.1:8002", "conversation {i}");
    }
    assert_eq!(s.metrics.explorations.get(), 1);
}

#[test]
fn a_joiner_is_taken_even_when_the_fleet_had_no_new_conversation_lately() {
    let system: Vec<u32> = (0..320).collect();
    let prompt = behind(&system, 0);
    let s = fleet_holding(&system);
    join(&s);
    // No new conversation anywhere yet: the first goes to the joiner.
    let r = pick(&s, &req(&keys(&prompt)), Instant::now()).unwrap();
    assert_eq!(r.candidates[0].address, "10.0.0.1:8002");
    assert_eq!(s.metrics.explorations.get(), 1);
    // A continuation is never explored, even while a joiner has had none.
    let s = fleet_holding(&system);
    let t0 = Instant::now();
    let first = pick(&s, &req(&keys(&prompt)), t0).unwrap();
    let warm = first.candidates[0].address.clone();
    join(&s);
    let mut turn = prompt.clone();
    turn.extend(20_000..20_100);
    let r = pick(&s, &req(&keys(&turn)), t0 + Duration::from_millis(1)).unwrap();
    assert_eq!(r.candidates[0].address, warm, "the continuation stays warm");
    assert_eq!(s.metrics.explorations.get(), 0);
}

#[test]
fn a_continuation_this_indexd_did_not_follow_is_never_sent_to_a_joiner() {
    // Its earlier turns went through another gateway: replica 0 holds them
    // (its events show them), this indexd's conversations do not.
    let system: Vec<u32> = (0..320).collect();
    let mut turn = behind(&system, 0);
    turn.extend(20_000..20_100);
    let setup = || {
        let (s, rs) = shared(2, |_| {});
        for r in &rs {
            believed(r, 8_000.0);
            store(&s, r, &system);
        }
        store(&s, &rs[0], &behind(&system, 0));
        join(&s);
        (s, rs[0].id().to_string())
    };
    let t0 = Instant::now();
    // Unmarked, it looks like a new conversation: the fresh joiner takes it.
    let (s, _) = setup();
    let r = pick(&s, &req(&keys(&turn)), t0).unwrap();
    assert_eq!(r.candidates[0].address, "10.0.0.1:8002");
    assert_eq!(s.metrics.explorations.get(), 1);
    // Its body carries an earlier turn: it stays where its prefix is.
    let (s, warm) = setup();
    let marked = PickRequest {
        continuation: Some(true),
        ..req(&keys(&turn))
    };
    let r = pick(&s, &marked, t0).unwrap();
    assert_eq!(r.candidates[0].address, warm, "the continuation stays warm");
    assert_eq!(s.metrics.explorations.get(), 0);
    assert_eq!(s.metrics.balanced.get(), 0);
    let turns = |t| s.metrics.conversation_turns.get([t]);
    assert_eq!((turns("resumed"), turns("new")), (1, 0));
    // Counted from here on: its next turn continues it.
    turn.extend(30_000..30_040);
    let next = PickRequest {
        continuation: Some(true),
        ..req(&keys(&turn))
    };
    let r = pick(&s, &next, t0 + Duration::from_millis(1)).unwrap();
    assert_eq!(r.candidates[0].address, warm);
    assert_eq!(turns("stayed"), 1);
    // The joiner still takes the next new conversation.
    let r = pick(&s, &req(&keys(&behind(&system, 1))), t0).unwrap();
    assert_eq!(r.candidates[0].address, "10.0.0.1:8002");
}

#[test]
fn first_turns_behind_a_shared_prompt_are_new_conversations_by_their_bodies() {
    // Short tasks behind one 12-block system prompt: no full block of their
    // own, so each first turn's tip is the prompt's last block.
    let system: Vec<u32> = (0..48).collect();
    let task = |i: u32| -> Vec<u32> {
        let mut p = system.clone();
        p.extend([10_000 + i, 10_001 + i]);
        p
    };
    let run = |continuation: Option<bool>| {
        let (s, rs, now) = two_settled(|_| {});
        let mut at = Vec::new();
        for i in 0..2 {
            let p = task(i * 10);
            let r = PickRequest {
                continuation,
                prompt_tokens: u32::try_from(p.len()).unwrap(),
                ..req(&keys(&p))
            };
            let address = pick(&s, &r, now).unwrap().candidates[0].address.clone();
            at.push(
                rs.iter()
                    .position(|r| r.id().to_string() == address)
                    .unwrap(),
            );
        }
        let turns = |t| s.metrics.conversation_turns.get([t]);
        (at, turns("new"), s.metrics.balanced.get())
    };
    // Their bodies say they are first turns: two conversations, spread.
    let (at, new, balanced) = run(Some(false));
    assert_eq!(new, 2);
    assert_ne!(at[0], at[1], "spread by number");
    assert_eq!(balanced, 1);
    // Keys alone (a completions prompt): the second looks like the first's
    // next turn, and follows it.
    let (at, new, balanced) = run(None);
    assert_eq!(new, 1);
    assert_eq!(at[0], at[1]);
    assert_eq!(balanced, 0);
}

#[test]
fn a_turn_whose_prompt_ends_on_a_block_boundary_is_known_at_its_next_turn() {
    let (s, _) = shared(2, |c| c.speculative_ttl = Duration::ZERO);
    let now = Instant::now();
    let turn = |tokens: &[u32]| PickRequest {
        prompt_tokens: u32::try_from(tokens.len()).unwrap(),
        ..req(&keys(tokens))
    };
    // 20 tokens, 5 full blocks: the last one holds the prompt's last token
    // (a template's trailing space, say).
    let first: Vec<u32> = (0..20).collect();
    pick(&s, &turn(&first), now).unwrap();
    // The next turn's prompt has that token merged into the answer's first
    // one: its fifth block differs, the four before are the same.
    let next: Vec<u32> = (0..19).chain(900..940).collect();
    assert_eq!(keys(&next)[..4], keys(&first)[..4]);
    assert_ne!(keys(&next)[4], keys(&first)[4]);
    pick(&s, &turn(&next), now).unwrap();
    let turns = |t| s.metrics.conversation_turns.get([t]);
    assert_eq!(turns("new"), 1, "one conversation");
    assert_eq!(turns("stayed") + turns("moved"), 1);
    // A prompt not ending on a boundary is known by its last full block.
    let third: Vec<u32> = next.iter().copied().chain(1_000..1_030).collect();
    pick(&s, &turn(&third), now).unwrap();
    assert_eq!(turns("new"), 1);
    assert_eq!(turns("stayed") + turns("moved"), 2);
}

#[test]
fn starve_after_zero_never_explores() {
    let (s, rs) = shared(2, |c| c.starve_after = Duration::ZERO);
    believed(&rs[0], 8_000.0);
    believed(&rs[1], 2_000.0);
    let t0 = Instant::now() + Duration::from_secs(6);
    for i in 0..3u32 {
        let prompt: Vec<u32> = (i * 1_000..i * 1_000 + 400).collect();
        let r = pick(
            &s,
            &req(&keys(&prompt)),
            t0 + Duration::from_millis(u64::from(i)),
        )
        .unwrap();
        assert_eq!(r.candidates[0].address, "10.0.0.1:8000");
    }
    assert_eq!(s.metrics.explorations.get(), 0);
}

/// Eight new conversations behind one shared prompt of 2,048 tokens,
/// `gap_ms` apart, on two alike replicas: how many each replica was sent,
/// and how many times the balance rule chose.
fn burst_split(margin: f64, gap_ms: u64) -> (Vec<usize>, u64) {
    let (s, _, t0) = two_settled(|c| c.weights.balance_margin = margin);
    let system: Vec<u32> = (0..2_048).collect();
    let mut split = vec![0; 2];
    for i in 0..8u32 {
        let mut prompt = system.clone();
        // Tails of 48 to 160 tokens, as conversations' first messages differ.
        prompt.extend((100_000 + i * 1_000)..(100_048 + i * 1_000 + (i * 37) % 113));
        let r = pick(
            &s,
            &req(&keys(&prompt)),
            t0 + Duration::from_millis(u64::from(i) * gap_ms),
        )
        .unwrap();
        let at = usize::from(r.candidates[0].address != "10.0.0.1:8000");
        split[at] += 1;
    }
    (split, s.metrics.balanced.get())
}

#[test]
fn a_burst_of_new_conversations_spreads_by_number_where_costs_nearly_tie() {
    // 10 ms apart: eight conversations within 80 ms, as W6-burst starts.
    let (split, balanced) = burst_split(crate::config::Weights::default().balance_margin, 10);
    assert_eq!(split, vec![4, 4], "balanced {balanced} times");
    assert!(balanced >= 1);
    // By the first turn's cost alone, the queue behind the shared prompt's
    // prefill on one replica against its prefill on the other decides, a
    // few milliseconds either way, and the split is uneven (6/2 here).
    let (split, balanced) = burst_split(0.0, 10);
    assert_ne!(split, vec![4, 4]);
    assert_eq!(balanced, 0);
}

#[test]
fn balancing_never_leaves_blocks_the_events_show() {
    let (s, rs, t0) = two_settled(|_| {});
    // One conversation this indexd placed, on the first replica.
    let placed: Vec<u32> = (50_000..50_160).collect();
    store(&s, &rs[0], &placed);
    let r = pick(&s, &req(&keys(&placed)), t0).unwrap();
    assert_eq!(r.candidates[0].address, "10.0.0.1:8000");
    // A conversation whose earlier turns went through another gateway: a
    // system prompt both hold and 32 tokens of its own on the first. Its
    // 72 uncached tokens elsewhere cost 9 ms, within the margin of the 5 ms
    // here, and the second replica has fewer conversations; it stays.
    let system: Vec<u32> = (0..320).collect();
    store(&s, &rs[1], &system);
    let mut history = system.clone();
    history.extend(60_000..60_032);
    store(&s, &rs[0], &history);
    let mut turn = history.clone();
    turn.extend(70_000..70_040);
    let r = pick(&s, &req(&keys(&turn)), t0 + Duration::from_millis(1)).unwrap();
    assert_eq!(r.candidates[0].address, "10.0.0.1:8000");
    assert_eq!(s.metrics.balanced.get(), 0);
    // The same prompt held alike on both: the fewer conversations win.
    let mut other = system.clone();
    other.extend(80_000..80_040);
    let r = pick(&s, &req(&keys(&other)), t0 + Duration::from_millis(2)).unwrap();
    assert_eq!(r.candidates[0].address, "10.0.0.1:8001");
}

#[test]
fn a_match_overtaken_by_another_picks_credit_is_taken_again_under_the_lock() {
    let (s, _, t0) = two_settled(|_| {});
    let system: Vec<u32> = (0..2_048).collect();
    let conversation = |i: u32| {
        let mut p = system.clone();
        p.extend((100_000 + i * 1_000)..(100_064 + i * 1_000));
        req(&keys(&p))
    };
    // Three conversations start together; the third's match is taken before
    // the first two are placed and credited.
    let third = conversation(2);
    let (eligible, _) = read(&s.registry).eligible(&third.model);
    let mut snap = snapshot(&s, &third, eligible, t0);
    assert!(
        snap.matches.iter().all(|m| m.blocks == 0),
        "nothing held yet"
    );
    let a = pick(&s, &conversation(0), t0).unwrap();
    let b = pick(&s, &conversation(1), t0 + Duration::from_millis(1)).unwrap();
    assert_ne!(
        a.candidates[0].address, b.candidates[0].address,
        "the second behind the first's queue goes to the other"
    );
    let ranking = place(&s, &third, &mut snap, t0 + Duration::from_millis(2));
    // Both replicas are now credited with the shared prompt: the third
    // prices a few blocks of its own, not a cold prefill of 2,048 tokens.
    assert!(
        snap.inputs.iter().all(|i| i.matched.blocks >= 128),
        "{:?}",
        snap.inputs
            .iter()
            .map(|i| i.matched.blocks)
            .collect::<Vec<_>>()
    );
    assert_eq!(s.metrics.rematches.get(), 1);
    assert_eq!(ranking.ranked.len(), 2);
    // A match no credit overtook is not taken again.
    let fourth = conversation(3);
    let (eligible, _) = read(&s.registry).eligible(&fourth.model);
    let mut snap = snapshot(&s, &fourth, eligible, t0 + Duration::from_millis(3));
    place(&s, &fourth, &mut snap, t0 + Duration::from_millis(3));
    assert_eq!(s.metrics.rematches.get(), 1);
}
