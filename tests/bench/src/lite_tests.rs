//! Tests of the lite workloads: their shapes, fleets and the hybrid pools.

use super::*;

#[test]
fn every_kind_builds_with_the_stated_shape() {
    let runs = build(
        &[
            LiteKind::W1,
            LiteKind::W2,
            LiteKind::W2Salted,
            LiteKind::W4,
            LiteKind::W3,
        ],
        Scale::Full,
        42,
    );
    let names: Vec<&str> = runs.iter().map(|r| r.workload.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "w1-chat",
            "w1-responses",
            "w2-lite",
            "w2-lite-salted",
            "w4-lite-2gw",
            "w4-lite-3gw",
            "w3-lite"
        ]
    );
    for r in &runs {
        assert_eq!(r.workload.replicas, 2);
        assert_eq!(r.workload.block_size, 64);
    }
    let w2 = &runs[2].workload;
    assert_eq!(w2.conversations.len(), 8);
    assert_eq!(w2.concurrency, 8);
    assert!(w2.conversations.iter().all(|c| c.requests() == 6));
    assert!(w2.conversations.iter().all(|c| c.salt.is_none()));
    assert!(
        runs[3]
            .workload
            .conversations
            .iter()
            .all(|c| c.salt.is_some())
    );
    let system = tokens(w2.conversations[0].system.as_deref().unwrap());
    assert!((700.0..900.0).contains(&system), "{system}");
    // The last turn of every conversation fits the smallest cache.
    let w3 = &runs[6];
    for c in &w3.workload.conversations {
        let last = system + conversation_tokens(c);
        assert!(last < f64::from(w3.fleet.max_model_len), "{last}");
        assert!((2_500.0..4_500.0).contains(&last), "{last}");
    }
    // 2× pressure: the caches together hold half the working set.
    let blocks = w3.fleet.num_gpu_blocks.unwrap();
    let ws = working_set_blocks(&w3.workload);
    assert!(
        blocks * 2 * 2 >= ws && (blocks - 1) * 2 * 2 < ws,
        "{blocks} {ws}"
    );
    assert_eq!(runs[0].fleet, roomy());
    assert!(runs.iter().all(|r| r.fleet.model == FleetModel::Llama));
}

#[test]
fn hybrid_variants_are_the_llama_scripts_on_fleets_of_their_own() {
    let kinds = [
        LiteKind::W2,
        LiteKind::W4,
        LiteKind::W3,
        LiteKind::W2Hybrid,
        LiteKind::W4Hybrid,
        LiteKind::W3Hybrid,
    ];
    let runs = build(&kinds, Scale::Full, 42);
    let names: Vec<&str> = runs.iter().map(|r| r.workload.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "w2-lite",
            "w4-lite-2gw",
            "w4-lite-3gw",
            "w3-lite",
            "w2-lite-hybrid",
            "w4-lite-3gw-hybrid",
            "w3-lite-hybrid"
        ]
    );
    let by_name = |n: &str| runs.iter().find(|r| r.workload.name == n).unwrap();
    for (llama, hybrid) in [
        ("w2-lite", "w2-lite-hybrid"),
        ("w4-lite-3gw", "w4-lite-3gw-hybrid"),
        ("w3-lite", "w3-lite-hybrid"),
    ] {
        let (l, h) = (by_name(llama), by_name(hybrid));
        assert!(!l.kind.is_hybrid() && h.kind.is_hybrid());
        assert_eq!(h.fleet.model, FleetModel::Gemma3);
        assert_eq!(l.fleet.model, FleetModel::Llama);
        assert_ne!(l.fleet, h.fleet, "a fleet of its own");
        assert_eq!(h.workload.gateways, l.workload.gateways);
        assert_eq!(h.workload.gateway_choice, l.workload.gateway_choice);
        assert_eq!(h.workload.requests(), l.workload.requests());
        for (a, b) in l
            .workload
            .conversations
            .iter()
            .zip(&h.workload.conversations)
        {
            assert_eq!(
                (&a.system, &a.first, &a.steps),
                (&b.system, &b.first, &b.steps)
            );
        }
    }
    // The roomy hybrid fleet is shared by w2-lite-hybrid and w4-lite-3gw-hybrid.
    assert_eq!(
        by_name("w2-lite-hybrid").fleet,
        roomy_of(FleetModel::Gemma3)
    );
    assert_eq!(
        by_name("w4-lite-3gw-hybrid").fleet,
        roomy_of(FleetModel::Gemma3)
    );
}

#[test]
fn the_hybrid_pool_adds_each_served_conversation_s_window_to_the_same_half() {
    let runs = build(&[LiteKind::W3, LiteKind::W3Hybrid], Scale::Full, 42);
    let (llama, hybrid) = (&runs[0], &runs[1]);
    let ws = working_set_blocks(&hybrid.workload);
    let half = ws.div_ceil(4);
    assert_eq!(llama.fleet.num_gpu_blocks, Some(half));
    // 256-token window of 64-token blocks: 5 blocks held per running
    // request; 4 conversations per replica.
    assert_eq!(window_blocks_held(256, 64), 5);
    assert_eq!(hybrid.fleet.num_gpu_blocks, Some(half + 4 * 5));
    // vLLM starts: a request at max_model_len fits the pool less its
    // null block, and one block more would not.
    let blocks = hybrid.fleet.num_gpu_blocks.unwrap();
    let len = hybrid.fleet.max_model_len;
    assert!(hybrid_request_blocks(len, 256, 64) < blocks);
    assert!(hybrid_request_blocks(len + 64, 256, 64) >= blocks);
    // Every prompt and its output fit.
    let system = tokens(hybrid.workload.conversations[0].system.as_deref().unwrap());
    for c in &hybrid.workload.conversations {
        let last = system + conversation_tokens(c) + f64::from(c.max_tokens);
        assert!(last <= f64::from(len), "{last} > {len}");
    }
}

#[test]
fn hybrid_admission_counts_both_groups_as_vllm_does() {
    // tests/fixtures/vllm-0.32-hybrid-real/gemma3/pressure: 120 blocks,
    // --max-model-len 4096 started ("Maximum concurrency for 4,096
    // tokens per request: 1.19x" = 120 / 101).
    assert_eq!(hybrid_request_blocks(4_096, 256, 64), 64 + 36 + 1);
    assert!(hybrid_max_model_len(120, 256, 64) >= 4_096);
    // Short requests: the sliding group never holds more than the request.
    assert_eq!(hybrid_request_blocks(128, 256, 64), 2 + 2 + 1);
    assert_eq!(hybrid_max_model_len(2, 256, 64), 0);
    assert_eq!(hybrid_max_model_len(100_000, 256, 64), MAX_MODEL_LEN);
    // Smoke scale still gets a pool its largest prompt fits.
    let smoke = build(&[LiteKind::W3Hybrid], Scale::Smoke, 42);
    let f = &smoke[0].fleet;
    assert!(f.max_model_len >= 64, "{f:?}");
    assert!(hybrid_request_blocks(f.max_model_len, 256, 64) < f.num_gpu_blocks.unwrap());
}

#[test]
fn w4_lite_alternates_gateways_every_turn() {
    let runs = build(&[LiteKind::W4], Scale::Full, 42);
    for r in &runs {
        let w = &r.workload;
        for c in &w.conversations {
            for t in 1..c.requests() {
                assert_ne!(w.gateway(42, c.id, t), w.gateway(42, c.id, t - 1));
            }
        }
    }
    assert_eq!(runs[1].workload.gateways, 3);
}

#[test]
fn w6_burst_is_w2_lite_behind_a_2k_prompt_started_within_100_ms() {
    let runs = build(&[LiteKind::W2, LiteKind::W6Burst], Scale::Full, 42);
    let (w2, burst) = (&runs[0], &runs[1]);
    assert_eq!(burst.workload.name, "w6-burst");
    assert_eq!(burst.fleet, roomy());
    assert!(burst.kind.reseeded() && !w2.kind.reseeded());
    let w = &burst.workload;
    assert_eq!((w.conversations.len(), w.concurrency), (8, 8));
    assert_eq!((w.gateways, w.replicas), (1, 2));
    assert_eq!(w.requests(), 48);
    assert!(w.conversations.iter().all(|c| c.requests() == 6));
    assert!(w.conversations.iter().all(|c| c.salt.is_none()));
    let system = w.conversations[0].system.as_deref().unwrap();
    assert!(
        w.conversations
            .iter()
            .all(|c| c.system.as_deref() == Some(system))
    );
    let system = tokens(system);
    assert!((1_900.0..2_100.0).contains(&system), "{system}");
    for c in &w.conversations {
        let last = system + conversation_tokens(c) + f64::from(c.max_tokens);
        assert!((3_500.0..6_000.0).contains(&last), "{last}");
        assert!(last < f64::from(MAX_MODEL_LEN));
    }
    // Every start within 100 ms, not all at the same instant.
    let starts: Vec<u32> = w.conversations.iter().map(|c| c.start_ms).collect();
    assert!(
        starts
            .iter()
            .all(|s| *s <= BURST_SPREAD_MS as u32 && *s < 100),
        "{starts:?}"
    );
    assert!(starts.iter().any(|s| *s != starts[0]), "{starts:?}");
    // W2-lite keeps its script: all at once, the same texts as before.
    assert!(w2.workload.conversations.iter().all(|c| c.start_ms == 0));
    assert_eq!(
        w2.workload.conversations[0]
            .first
            .split(' ')
            .take(2)
            .collect::<Vec<_>>(),
        ["Task", "0:"]
    );
    // A round's seed draws its own script and starts; the same seed the same.
    let again = burst.of_seed(Scale::Full, 42).unwrap();
    let other = burst.of_seed(Scale::Full, 43).unwrap();
    assert_eq!(again.conversations[3].first, w.conversations[3].first);
    assert_eq!(again.conversations[3].start_ms, w.conversations[3].start_ms);
    assert_ne!(other.conversations[3].first, w.conversations[3].first);
    assert_ne!(other.conversations[0].system, w.conversations[0].system);
    let other_starts: Vec<u32> = other.conversations.iter().map(|c| c.start_ms).collect();
    assert_ne!(other_starts, starts);
    assert!(w2.of_seed(Scale::Full, 43).is_none());
    // Smoke scale builds too.
    let smoke = build(&[LiteKind::W6Burst], Scale::Smoke, 42);
    assert_eq!(smoke[0].workload.requests(), 2 * 3);
}

#[test]
fn w1_lite_continuation_is_about_the_published_size() {
    let w = &build(&[LiteKind::W1], Scale::Full, 42)[0].workload;
    assert_eq!(w.requests(), 16);
    let c = &w.conversations[0];
    let t = conversation_tokens(c);
    assert!((6_000.0..7_500.0).contains(&t), "{t}");
    assert!(t < f64::from(MAX_MODEL_LEN));
}
