//! Tests of the summary: figures per workload × profile, against the sticky
//! oracle, round by round, and the indexd tables.

use super::*;
use crate::rounds::ROUND_CONVERSATIONS;
use crate::sample::example;

fn pair(profile: &str, c: u32, first: &str, second: &str, cached: u64, oracle: u64) -> [Sample; 2] {
    let a = example(profile, c, 0, first);
    let mut b = example(profile, c, 1, second);
    b.prev_replica = first.into();
    b.cached_tokens = cached;
    b.oracle_cached_tokens = oracle;
    b.latency_ms = 10.0 + f64::from(c);
    [a, b]
}

#[test]
fn warm_returns_hits_and_oracle() {
    let mut samples = Vec::new();
    samples.extend(pair("lr", 0, "r0", "r0", 90, 90));
    samples.extend(pair("lr", 1, "r0", "r1", 0, 90));
    let mut failed = example("lr", 2, 1, "");
    failed.status = 502;
    samples.push(failed);
    samples.extend(pair("precise", 0, "r1", "r1", 96, 96));
    let s = summarize(&samples);
    assert_eq!(s.groups.len(), 2);
    let lr = &s.groups[0];
    assert_eq!((lr.requests, lr.errors, lr.continuations), (5, 1, 2));
    assert_eq!((lr.warm_returns, lr.missed_oracle), (1, 1));
    assert_eq!(lr.hit_ratio, Some(0.45));
    assert_eq!(lr.oracle_ratio, Some(0.5));
    assert_eq!(lr.latency_ms.n, 2);
    assert_eq!(lr.latency_ms.mean, 10.5);
    assert_eq!(lr.all_latency_ms.n, 4);
    let p = &s.groups[1];
    assert_eq!(p.oracle_ratio, Some(1.0));
    let md = s.to_markdown();
    assert!(
        md.contains("| lr | 5 | 1 | 0 | 1/2 (50.00%) | 45.00% | 50.00% | 1 |"),
        "{md}"
    );
}

#[test]
fn rewritten_requests_and_fault_phases_are_counted() {
    let mut samples = Vec::new();
    samples.extend(pair("sg", 0, "r0", "r0", 90, 0));
    samples[1].intact = "no".into();
    let mut later = pair("sg", 1, "r1", "r0", 0, 90);
    for s in &mut later {
        s.phase = "replica-restart".into();
    }
    samples.extend(later);
    let s = summarize(&samples);
    assert_eq!(s.groups[0].rewritten, 1);
    assert_eq!(s.phases.len(), 2);
    assert_eq!(s.phases[0].phase, BEFORE_FAULTS);
    assert_eq!(
        (s.phases[1].group.requests, s.phases[1].group.warm_returns),
        (2, 0)
    );
    let md = s.to_markdown();
    assert!(md.contains("### w by fault phase"), "{md}");
    assert!(
        md.contains("| sg | replica-restart | 2 | 0 | 0/1 (0.00%) | 0.00% | 1 |"),
        "{md}"
    );
    // Without phases there is no phase table.
    assert!(summarize(&samples[..2]).phases.is_empty());
}

#[test]
fn moves_are_judged_against_the_sticky_oracle() {
    let mut samples = Vec::new();
    // The sticky oracle: warm, 100 ms per continuation.
    for c in 0..2 {
        let mut p = pair(STICKY_ORACLE, c, "r0", "r0", 90, 90);
        p[1].latency_ms = 100.0;
        samples.extend(p);
    }
    // A router that moved both: one lost the held prefix and was slower
    // (did not pay), one lost it but was faster than the sticky turn.
    let mut slow = pair("lr", 0, "r0", "r1", 10, 90);
    slow[1].latency_ms = 300.0;
    let mut fast = pair("lr", 1, "r0", "r1", 10, 90);
    fast[1].latency_ms = 50.0;
    samples.extend(slow);
    samples.extend(fast);
    let s = summarize(&samples);
    let lr = s.groups.iter().find(|g| g.profile == "lr").unwrap();
    assert_eq!((lr.moves, lr.unpaid_moves), (Some(2), Some(1)));
    assert_eq!(lr.moves_reprefilled_tokens, Some(160));
    assert_eq!(lr.vs_sticky, Some(1.75));
    let sticky = s
        .groups
        .iter()
        .find(|g| g.profile == STICKY_ORACLE)
        .unwrap();
    assert_eq!((sticky.moves, sticky.vs_sticky), (Some(0), Some(1.0)));
    let md = s.to_markdown();
    assert!(
        md.contains("| 1.75× | – | – | 2 | 1 | 160 | 2/2 (50%) |"),
        "{md}"
    );
    assert!(lr.vs_sticky_rounds.is_empty(), "one round: no spread");
    // Without the sticky oracle the table and JSON keep their old shape.
    let plain = summarize(&samples[4..]);
    assert!(plain.groups.iter().all(|g| g.moves.is_none()));
    assert!(!plain.to_markdown().contains("vs sticky"));
    assert!(!plain.to_json().unwrap().contains("vs_sticky"));
}

#[test]
fn the_sticky_ratio_is_also_given_round_by_round() {
    let mut samples = Vec::new();
    // Two rounds; the sticky oracle 100 then 200 ms, the router 150
    // then 200 ms: 1.5× and 1.0× by round, 350 / 300 pooled.
    // Of 100 prompt tokens, the oracle caches 90 both times, the router
    // 80 then 95: −10 and +5 points.
    for (round, sticky_ms, lr_ms, lr_cached) in [(0, 100.0, 150.0, 80), (1, 200.0, 200.0, 95)] {
        let c = round * ROUND_CONVERSATIONS;
        let mut s = pair(STICKY_ORACLE, c, "r0", "r0", 90, 90);
        s[1].latency_ms = sticky_ms;
        let mut l = pair("lr", c, "r0", "r0", lr_cached, 90);
        l[1].latency_ms = lr_ms;
        samples.extend(s);
        samples.extend(l);
    }
    let s = summarize(&samples);
    let lr = s.groups.iter().find(|g| g.profile == "lr").unwrap();
    assert_eq!(lr.vs_sticky_rounds, vec![1.5, 1.0]);
    let pooled = lr.vs_sticky.unwrap();
    assert!((pooled - 350.0 / 300.0).abs() < 1e-9, "{pooled}");
    let md = s.to_markdown();
    assert!(md.contains("| 2: 1.00–1.50, 1.25 ± "), "{md}");
    assert_eq!(lr.hit_vs_sticky_rounds.len(), 2);
    assert!((lr.hit_vs_sticky_rounds[0] + 10.0).abs() < 1e-9);
    assert!((lr.hit_vs_sticky_rounds[1] - 5.0).abs() < 1e-9);
    assert!(md.contains("| 2: -10.0–+5.0, -2.50 ± "), "{md}");
    let json: serde_json::Value = serde_json::from_str(&s.to_json().unwrap()).unwrap();
    let rounds = json["groups"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["profile"] == "lr")
        .map(|g| g["vs_sticky_rounds"].clone());
    assert_eq!(rounds, Some(serde_json::json!([1.5, 1.0])));
}

#[test]
fn a_profile_is_held_to_the_sticky_rounds_it_shared() {
    // The sticky oracle ran three rounds (100, 200, 600 ms), the router
    // only the first two (150, 200 ms): (150 + 200) / (100 + 200), not its
    // mean over the sticky oracle's three rounds (175 / 300).
    let mut samples = Vec::new();
    for (round, sticky_ms) in [(0, 100.0), (1, 200.0), (2, 600.0)] {
        let mut s = pair(
            STICKY_ORACLE,
            round * ROUND_CONVERSATIONS,
            "r0",
            "r0",
            90,
            90,
        );
        s[1].latency_ms = sticky_ms;
        samples.extend(s);
    }
    for (round, lr_ms) in [(0, 150.0), (1, 200.0)] {
        let mut l = pair("lr", round * ROUND_CONVERSATIONS, "r0", "r0", 90, 90);
        l[1].latency_ms = lr_ms;
        samples.extend(l);
    }
    let s = summarize(&samples);
    let lr = s.groups.iter().find(|g| g.profile == "lr").unwrap();
    let pooled = lr.vs_sticky.unwrap();
    assert!((pooled - 350.0 / 300.0).abs() < 1e-9, "{pooled}");
    assert_eq!(lr.vs_sticky_rounds, vec![1.5, 1.0]);
    let sticky = s
        .groups
        .iter()
        .find(|g| g.profile == STICKY_ORACLE)
        .unwrap();
    assert_eq!(sticky.vs_sticky, Some(1.0));
    assert_eq!(sticky.latency_ms.n, 3);
}

#[test]
fn no_oracle_tokens_is_not_a_ratio() {
    let s = summarize(&pair("lr", 0, "r0", "r1", 0, 0));
    assert_eq!(s.groups[0].oracle_ratio, None);
    assert!(s.to_markdown().contains("n/a"));
}

#[test]
fn the_oracle_ratio_by_round_names_the_worst_round_and_the_pooled_hit_gap() {
    // Three rounds; the router caches 90, 60 then 90 of the oracle's 90
    // (of 100 prompt tokens), the sticky oracle 90 each time.
    let mut samples = Vec::new();
    for (round, cached) in [(0, 90), (1, 60), (2, 90)] {
        let c = round * ROUND_CONVERSATIONS;
        samples.extend(pair(STICKY_ORACLE, c, "r0", "r0", 90, 90));
        samples.extend(pair("precise", c, "r0", "r0", cached, 90));
    }
    let s = summarize(&samples);
    let p = s.groups.iter().find(|g| g.profile == "precise").unwrap();
    assert_eq!(p.oracle_ratio_rounds.len(), 3);
    assert!((p.oracle_ratio_rounds[&2] - 100.0 * 60.0 / 90.0).abs() < 1e-9);
    // 240 / 300 cached against the sticky oracle's 270 / 300: −10 points.
    assert!((p.hit_vs_sticky.unwrap() + 10.0).abs() < 1e-9);
    let md = s.to_markdown();
    assert!(md.contains("### w by round"), "{md}");
    assert!(
        md.contains("| precise | 3 | 88.89% | 66.67% (round 2) | 3: 66.67–100.00%, 88.89 ± "),
        "{md}"
    );
    assert!(md.contains("| -10.00 |"), "{md}");
    assert!(
        md.contains("| sticky-oracle | 3 | 100.00% | 100.00% (round 1) |"),
        "{md}"
    );
    let json: serde_json::Value = serde_json::from_str(&s.to_json().unwrap()).unwrap();
    let precise = json["groups"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["profile"] == "precise")
        .unwrap();
    assert_eq!(precise["oracle_ratio_rounds"]["1"], 100.0);
    let gap = precise["hit_vs_sticky"].as_f64().unwrap();
    assert!((gap + 10.0).abs() < 1e-9, "{gap}");
    // One round: no by-round table, and the JSON keeps its old shape.
    let one = summarize(&samples[..4]);
    assert!(!one.to_markdown().contains("by round\n"));
    assert!(!one.to_json().unwrap().contains("oracle_ratio_rounds"));
}

#[test]
fn indexd_readings_get_a_table_per_workload() {
    use crate::indexd_metrics::IndexdRow;
    let samples: Vec<Sample> = pair("kvroute-precise", 0, "r0", "r0", 90, 90).into();
    let reading = |gateway, indexed, speculative| IndexdRow {
        workload: "w".into(),
        profile: "kvroute-precise".into(),
        round: 1,
        gateway,
        indexed_blocks: indexed,
        speculative_blocks: speculative,
        index_entries: 100,
        kv_groups_min: Some(2),
        kv_groups_max: Some(2),
        ..IndexdRow::default()
    };
    let s = summarize_run(&samples, &[reading(0, 30, 0), reading(1, 9, 1)]);
    assert_eq!(s.indexd.len(), 1);
    assert_eq!(s.indexd[0].indexed_share, Some(39.0 / 40.0));
    let md = s.to_markdown();
    assert!(md.contains("### w: indexd"), "{md}");
    assert!(md.contains("| kvroute-precise | 2 | 97.50% |"), "{md}");
    assert!(md.contains("Indexed share: of the matched blocks"), "{md}");
    assert!(s.to_json().unwrap().contains("\"indexed_share\""));
    // Without readings, neither the table nor the JSON field.
    let plain = summarize(&samples);
    assert!(!plain.to_markdown().contains(": indexd"));
    assert!(!plain.to_json().unwrap().contains("\"indexd\""));
}
