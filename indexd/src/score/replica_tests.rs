use super::*;
use crate::score::Registry;

/// A replica of model `m`, never scraped.
fn replica() -> Replica {
    Replica::new(
        EndpointConfig::new("10.0.0.1:8000".parse().expect("address"), "m"),
        ReplicaSlot(0),
        CancellationToken::new(),
    )
}

const MS: Duration = Duration::from_millis(1);

#[test]
fn picks_queue_behind_each_other_and_drain_with_time() {
    let t0 = Instant::now();
    let mut q = PickQueue::default();
    q.note(t0, t0, "a".into(), 300 * MS, 0);
    q.note(t0, t0, "b".into(), 200 * MS, 0);
    assert!((q.queued_seconds(t0) - 0.5).abs() < 1e-9);
    assert!((q.queued_seconds(t0 + 400 * MS) - 0.1).abs() < 1e-9);
    assert_eq!(q.queued_seconds(t0 + 600 * MS), 0.0);
    // A pick after the queue ran dry starts at once.
    q.note(t0 + 600 * MS, t0 + 600 * MS, "c".into(), 100 * MS, 0);
    assert!((q.queued_seconds(t0 + 600 * MS) - 0.1).abs() < 1e-9);
}

#[test]
fn an_answer_takes_what_its_pick_had_left_out_of_the_queue() {
    let t0 = Instant::now();
    let mut q = PickQueue::default();
    q.note(t0, t0, "a".into(), 300 * MS, 0);
    q.note(t0, t0, "b".into(), 200 * MS, 0);
    // `b` answered 100 ms in, before its estimated start: all of its
    // 200 ms leave; `a` still has 200 ms.
    assert!(q.complete(t0 + 100 * MS, "b"));
    assert!((q.queued_seconds(t0 + 100 * MS) - 0.2).abs() < 1e-9);
    assert!(!q.complete(t0 + 100 * MS, "b"), "once");
    // `a` answered early: the queue is empty, never negative.
    assert!(q.complete(t0 + 150 * MS, "a"));
    assert_eq!(q.queued_seconds(t0 + 150 * MS), 0.0);
}

#[test]
fn a_scrape_stops_counting_picks_but_leaves_their_prefill_queued() {
    let r = replica();
    let t0 = Instant::now();
    r.note_pick(t0, "a", 500 * MS, 0);
    let ttl = Duration::from_secs(5);
    assert_eq!(r.load(t0, ttl, 0).pending_picks, 1.0);
    r.scrape_ok(1.0, 0.0, 0.1, None, t0 + MS);
    let load = r.load(t0 + 100 * MS, ttl, 0);
    assert_eq!(load.pending_picks, 0.0);
    assert!((load.queued_seconds - 0.4).abs() < 1e-9);
}

#[test]
fn picks_stand_for_the_blocks_they_allocate_until_answered_or_expired() {
    let r = replica();
    let (t0, ttl) = (Instant::now(), Duration::from_secs(5));
    assert_eq!(r.load(t0, ttl, 0).cache_blocks, None);
    r.scrape_ok(0.0, 0.0, 0.0, Some(86.0), t0);
    r.note_pick(t0, "a", 100 * MS, 30);
    r.note_pick(t0 + MS, "b", 100 * MS, 12);
    r.note_pick(t0 + MS, "c", 100 * MS, 0);
    let load = r.load(t0 + MS, ttl, 0);
    assert_eq!((load.cache_blocks, load.demand_blocks), (Some(86.0), 42.0));
    // A scrape shows them (they leave the pending count); one is
    // running: the oldest, whose blocks are allocated (in the usage).
    r.scrape_ok(1.0, 2.0, 0.5, Some(86.0), t0 + 2 * MS);
    assert_eq!(r.load(t0 + 2 * MS, ttl, 0).demand_blocks, 12.0);
    r.scrape_ok(0.0, 3.0, 0.5, Some(86.0), t0 + 2 * MS);
    assert_eq!(r.load(t0 + 2 * MS, ttl, 0).demand_blocks, 42.0);
    assert!(
        r.complete_pick(t0 + 3 * MS, "a"),
        "found by its blocks alone"
    );
    assert_eq!(r.load(t0 + 3 * MS, ttl, 0).demand_blocks, 12.0);
    // Unanswered past the TTL: forgotten.
    assert_eq!(r.load(t0 + ttl + 2 * MS, ttl, 0).demand_blocks, 0.0);
}

#[test]
fn the_load_keeps_the_waiting_of_the_scrape_before() {
    let r = replica();
    let (t0, ttl) = (Instant::now(), Duration::from_secs(5));
    let waiting = |r: &Replica| {
        let l = r.load(t0, ttl, 0);
        (l.waiting, l.waiting_before)
    };
    assert_eq!(waiting(&r), (0.0, 0.0));
    r.scrape_ok(1.0, 3.0, 0.1, None, t0);
    assert_eq!(waiting(&r), (3.0, 0.0), "one scrape: no queue seen before");
    r.scrape_ok(1.0, 2.0, 0.1, None, t0);
    assert_eq!(waiting(&r), (2.0, 3.0));
    // A failed scrape changes neither.
    r.scrape_failed(3);
    assert_eq!(waiting(&r), (2.0, 3.0));
}

#[test]
fn an_unvisited_replica_takes_its_models_pooled_speed_not_the_prior() {
    // The pin: the replica that served everything is fitted at 32,500
    // tokens/s; the one that served nothing must not stay at the 8,000
    // prior, four times slower on paper, and so never be chosen.
    let mut registry = Registry::default();
    let parent = CancellationToken::new();
    let mut add = |address: &str, model: &str| {
        let config = EndpointConfig::new(address.parse().expect("address"), model);
        registry
            .add(config, &parent, Duration::from_secs(60))
            .expect("a new endpoint")
    };
    let busy = add("10.0.0.1:8000", "m");
    let idle = add("10.0.0.2:8000", "m");
    let elsewhere = add("10.0.0.3:8000", "other");
    let t0 = Instant::now();
    let mut at = crate::calibrate::PrefillCounters::default();
    busy.calibrate(at, t0);
    for i in 1..=6 {
        at.requests += 1.0;
        at.tokens += 3_250.0;
        at.seconds += 0.1;
        busy.calibrate(at, t0 + Duration::from_secs(i));
        registry.settle_prefill("m", 8_000.0);
    }
    let rate = |r: &Replica| r.prefill_speed().map(|s| s.tokens_per_second);
    let fitted = rate(&busy).expect("fitted");
    assert!((fitted - 32_500.0).abs() < 1.0, "{fitted}");
    assert_eq!(rate(&idle), Some(fitted), "the pooled fit, not the prior");
    assert_eq!(registry.pooled_prefill("m", 8_000.0).1, 6);
    assert_eq!(
        rate(&elsewhere),
        None,
        "another model's evidence is not pooled"
    );
    assert_eq!(idle.own_prefill(8_000.0), (None, 0));
}

#[test]
fn a_replica_joining_a_running_fleet_fills_with_new_conversations_first() {
    let parent = CancellationToken::new();
    let warmup = Duration::from_secs(60);
    let config =
        |address: &str, model: &str| EndpointConfig::new(address.parse().expect("address"), model);
    let mut registry = Registry::default();
    // The fleet found at start registers within a moment: no warm-up.
    let a = registry
        .add(config("10.0.0.1:8000", "m"), &parent, warmup)
        .expect("new");
    let b = registry
        .add(config("10.0.0.2:8000", "m"), &parent, warmup)
        .expect("new");
    let now = Instant::now();
    assert!(!a.filling(now) && !b.filling(now));
    // A replica of the fleet registered a while ago...
    let mut old = Replica::new(
        config("10.0.0.3:8000", "m"),
        ReplicaSlot(9),
        CancellationToken::new(),
    );
    old.registered = now.checked_sub(JOINS_AFTER * 2).expect("in the past");
    registry
        .replicas
        .insert(old.config.id.clone(), Arc::new(old));
    // ...makes the next one a joiner, for join_warmup; another model's not.
    let joiner = registry
        .add(config("10.0.0.4:8000", "m"), &parent, warmup)
        .expect("new");
    let elsewhere = registry
        .add(config("10.0.0.5:8000", "x"), &parent, warmup)
        .expect("new");
    let later = Instant::now();
    assert!(joiner.filling(later));
    assert!(!joiner.filling(later + warmup));
    assert!(!elsewhere.filling(later));
    let unwarmed = registry
        .add(config("10.0.0.6:8000", "m"), &parent, Duration::ZERO)
        .expect("new");
    assert!(!unwarmed.filling(later), "join_warmup 0: none");
}
