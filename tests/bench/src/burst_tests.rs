//! Tests of the burst tables: splits, ratios and their distribution from
//! synthetic rounds.

use super::*;
use crate::rounds::ROUND_CONVERSATIONS;
use crate::sample::example;
use crate::summary::summarize;

/// One round of `profile` on `w6-burst`: 8 conversations × 6 turns, the
/// first `r0` requests (in conversation, turn order) served by r0, the rest
/// by r1, every continuation taking `ms`.
fn round(profile: &str, round: u32, r0: usize, ms: f64) -> Vec<Sample> {
    let mut out = Vec::new();
    for c in 0..8u32 {
        for t in 0..6u32 {
            let replica = if out.len() < r0 { "r0" } else { "r1" };
            let mut s = example(profile, (round - 1) * ROUND_CONVERSATIONS + c, t, replica);
            s.workload = W6_BURST.into();
            s.latency_ms = if t == 0 { 1_000.0 } else { ms };
            out.push(s);
        }
    }
    out
}

/// Four rounds: the sticky oracle 24/24 at 100 ms each; precise 24/24 at
/// 101 ms, 48/0 at 150, 31/17 (64.6%: within 65/35) at 99 and 32/16
/// (66.7%: not) at 103.
fn four_rounds() -> Vec<Sample> {
    let mut samples = Vec::new();
    for (r, pinned, ms) in [
        (1, 24, 101.0),
        (2, 48, 150.0),
        (3, 31, 99.0),
        (4, 32, 103.0),
    ] {
        samples.extend(round(STICKY_ORACLE, r, 24, 100.0));
        samples.extend(round("kvroute-precise", r, pinned, ms));
    }
    samples
}

fn close(a: Option<f64>, b: f64) -> bool {
    a.is_some_and(|a| (a - b).abs() < 1e-9)
}

#[test]
fn a_pinned_seed_breaks_65_35_and_the_ratios_are_read_per_round() {
    let s = summarize(&four_rounds());
    assert_eq!(s.bursts.len(), 1, "the sticky oracle gets no table");
    let b = &s.bursts[0];
    assert_eq!(b.profile, "kvroute-precise");
    assert_eq!(b.seeds.len(), 4);
    let pinned = &b.seeds[1];
    assert_eq!(pinned.round, 2);
    // r1 never served this round, yet is counted: the sticky oracle used it.
    assert_eq!(
        pinned.replica_requests,
        BTreeMap::from([("r0".to_owned(), 48), ("r1".to_owned(), 0)])
    );
    assert!(pinned.lopsided());
    assert!(!b.seeds[0].lopsided() && !b.seeds[2].lopsided());
    assert!(b.seeds[3].lopsided(), "32/16 is worse than 65/35");
    assert_eq!(b.lopsided_seeds, 2);
    assert_eq!(b.worst_split_round, Some(2));
    assert!(close(pinned.mean_ms, 150.0) && close(pinned.sticky_mean_ms, 100.0));
    assert!(close(pinned.vs_sticky, 1.5));
    assert_eq!(
        (b.worst_vs_sticky_round, b.worst_vs_sticky),
        (Some(2), Some(1.5))
    );
    // Sorted ratios 0.99, 1.01, 1.03, 1.50: the median between the middle two.
    assert!(close(b.median_vs_sticky, 1.02), "{:?}", b.median_vs_sticky);
    // An odd count: the middle one.
    let three: Vec<Sample> = four_rounds().into_iter().take(3 * 96).collect();
    let b3 = &summarize(&three).bursts[0];
    assert!(
        close(b3.median_vs_sticky, 1.01),
        "{:?}",
        b3.median_vs_sticky
    );
    assert_eq!((b3.lopsided_seeds, b3.worst_vs_sticky_round), (1, Some(2)));
}

#[test]
fn the_tables_show_each_seed_then_the_distribution() {
    let md = summarize(&four_rounds()).to_markdown();
    assert!(md.contains("### w6-burst by seed"), "{md}");
    assert!(
        md.contains(
            "| round | kvroute-precise split | kvroute-precise mean | vs sticky | sticky-oracle mean |"
        ),
        "{md}"
    );
    assert!(
        md.contains("| 1 | 24/24 (50.0%) | 101.0 | 1.01× | 100.0 |"),
        "{md}"
    );
    assert!(
        md.contains("| 2 | 48/0 (100.0%) ✗ | 150.0 | 1.50× | 100.0 |"),
        "{md}"
    );
    assert!(
        md.contains("| 3 | 31/17 (64.6%) | 99.0 | 0.99× | 100.0 |"),
        "{md}"
    );
    assert!(
        md.contains("| 4 | 32/16 (66.7%) ✗ | 103.0 | 1.03× | 100.0 |"),
        "{md}"
    );
    assert!(
        md.contains(
            "| kvroute-precise | 4 | 2 | 48/0 (100.0%) (round 2) | 1.50× (round 2) | 1.02× |"
        ),
        "{md}"
    );
    println!("{}", markdown(&summarize(&four_rounds()).bursts, W6_BURST));
}

#[test]
fn failed_requests_count_in_no_split_and_no_oracle_means_no_ratio() {
    let mut samples = round("kvroute-precise", 1, 40, 120.0);
    // Two of r0's requests failed: 38/8.
    for s in samples.iter_mut().take(2) {
        s.status = 502;
    }
    let s = summarize(&samples);
    let b = &s.bursts[0];
    let seed = &b.seeds[0];
    assert_eq!(seed.replica_requests.values().sum::<usize>(), 46);
    assert_eq!(seed.replica_requests["r0"], 38);
    assert!(seed.lopsided());
    assert!(seed.sticky_mean_ms.is_none() && seed.vs_sticky.is_none());
    assert_eq!((b.worst_vs_sticky, b.median_vs_sticky), (None, None));
    let md = s.to_markdown();
    assert!(
        md.contains("| 1 | 38/8 (82.6%) ✗ | 120.0 | n/a | n/a |"),
        "{md}"
    );
    assert!(
        md.contains("| kvroute-precise | 1 | 1 | 38/8 (82.6%) (round 1) | n/a | n/a |"),
        "{md}"
    );
}

#[test]
fn several_profiles_share_one_row_per_round_and_json_round_trips() {
    let mut samples = four_rounds();
    for r in 1..=4 {
        samples.extend(round("least-request", r, 25, 110.0));
    }
    // As a run reads them back: the baseline first.
    crate::sample::sort(&mut samples);
    let s = summarize(&samples);
    assert_eq!(s.bursts.len(), 2);
    let md = s.to_markdown();
    assert!(
        md.contains(
            "| 2 | 25/23 (52.1%) | 110.0 | 1.10× | 48/0 (100.0%) ✗ | 150.0 | 1.50× | 100.0 |"
        ),
        "{md}"
    );
    let back: crate::summary::Summary = serde_json::from_str(&s.to_json().unwrap()).unwrap();
    assert_eq!(back, s);
}

#[test]
fn other_workloads_get_no_burst_table() {
    let mut samples = four_rounds();
    for s in &mut samples {
        s.workload = "w2-lite".into();
    }
    let s = summarize(&samples);
    assert!(s.bursts.is_empty());
    assert!(!s.to_markdown().contains("by seed"));
    assert!(!s.to_json().unwrap().contains("bursts"));
}

/// A round run three times (`--burst-repeats 3`): its mean pools the three
/// runs' continuations, its split is its most lopsided run's, so one pinned
/// run among even ones still breaks 65/35.
#[test]
fn a_repeated_round_pools_its_means_and_keeps_its_worst_split() {
    let mut samples = Vec::new();
    for (repeat, pinned, ms) in [(0, 24, 100.0), (1, 48, 130.0), (2, 24, 100.0)] {
        for mut s in round("kvroute-precise", 1, pinned, ms) {
            s.conversation += repeat * crate::rounds::REPEAT_CONVERSATIONS;
            samples.push(s);
        }
        for mut s in round(STICKY_ORACLE, 1, 24, 100.0) {
            s.conversation += repeat * crate::rounds::REPEAT_CONVERSATIONS;
            samples.push(s);
        }
    }
    let s = summarize(&samples);
    let b = &s.bursts[0];
    assert_eq!(b.seeds.len(), 1, "one seed, three runs");
    let seed = &b.seeds[0];
    assert_eq!(seed.runs, 3);
    assert_eq!(seed.replica_requests["r0"], 48, "the pinned run's split");
    assert!(seed.lopsided());
    assert!(close(seed.mean_ms, 110.0), "{:?}", seed.mean_ms);
    assert!(close(seed.vs_sticky, 1.1));
    let md = s.to_markdown();
    assert!(
        md.contains("| 1 | 48/0 (100.0%) ✗ | 110.0 | 1.10× | 100.0 |"),
        "{md}"
    );
    assert!(md.contains("| kvroute-precise | 1 (3 runs) | 1 |"), "{md}");
    // A single run omits its count from the summary's JSON.
    let one = serde_json::to_string(&summarize(&four_rounds()).bursts[0].seeds[0]).unwrap();
    assert!(!one.contains("runs"), "{one}");
    let three = serde_json::to_string(seed).unwrap();
    assert!(three.contains("\"runs\":3"), "{three}");
}
