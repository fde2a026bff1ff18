//! W6-burst's figures seed by seed (`kvroute-bench vllm`: each round of
//! `w6-burst` is one seed, with its own script and indexd seed on fresh
//! gateways and a fresh indexd; see [`crate::lite::w6_burst`]).
//!
//! What a burst can go wrong on is one round's placement, which pooled
//! figures hide: one round in eight sending all 48 requests to one replica
//! moves the pooled split by a few points only. So for every profile but the
//! sticky oracle, per round: the answered requests per replica (the load
//! split) and the mean continuation latency against the sticky oracle's in
//! the same round; then their distribution over the rounds: the worst split,
//! how many rounds' splits are worse than 65/35, the worst and the median
//! ratio.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::rounds::{repeat_of, round_means, round_of};
use crate::sample::{STICKY_ORACLE, Sample};
use crate::stats::{busiest_share, percentile};

/// The burst workload's name in samples.
pub const W6_BURST: &str = "w6-burst";

/// A round's split is worse than 65/35 when its busiest replica served more
/// than this many percent of its answered requests.
pub const MAX_SHARE_PERCENT: usize = 65;

/// One round (seed) of one profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BurstSeed {
    /// The round, from 1 (its seed is the run's `--seed` + round − 1).
    pub round: u32,
    /// Answered requests per replica, every turn (every replica of the
    /// workload, zero for those this round never used): of its most
    /// lopsided run, when it ran several times.
    pub replica_requests: BTreeMap<String, usize>,
    /// Its runs (`--burst-repeats`), pooled in its means.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub runs: u32,
    /// Mean latency of the continuations that answered, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mean_ms: Option<f64>,
    /// The sticky oracle's in the same round.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sticky_mean_ms: Option<f64>,
    /// `mean_ms` over `sticky_mean_ms`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vs_sticky: Option<f64>,
}

/// Serde's default of [`BurstSeed::runs`] (summaries of single runs omit it).
const fn one() -> u32 {
    1
}

/// Whether `runs` is the default.
#[allow(clippy::trivially_copy_pass_by_ref)]
const fn is_one(runs: &u32) -> bool {
    *runs == 1
}

impl BurstSeed {
    /// Its split is worse than 65/35 (no request answered: not a split).
    pub fn lopsided(&self) -> bool {
        let total: usize = self.replica_requests.values().sum();
        let max = self.replica_requests.values().copied().max().unwrap_or(0);
        total > 0 && max * 100 > total * MAX_SHARE_PERCENT
    }

    /// The busiest replica's share of its answered requests.
    pub fn share(&self) -> Option<f64> {
        busiest_share(&self.replica_requests)
    }
}

/// One profile of a burst workload: its rounds and their distribution.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Burst {
    /// Workload name.
    pub workload: String,
    /// Profile name.
    pub profile: String,
    /// Its rounds in order.
    pub seeds: Vec<BurstSeed>,
    /// Rounds whose split is worse than 65/35.
    pub lopsided_seeds: usize,
    /// The round with the busiest replica's largest share (the first on a tie).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worst_split_round: Option<u32>,
    /// The round with the largest ratio to the sticky oracle.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worst_vs_sticky_round: Option<u32>,
    /// The largest ratio.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worst_vs_sticky: Option<f64>,
    /// The median ratio over the rounds (interpolated for an even count).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub median_vs_sticky: Option<f64>,
}

/// The burst tables of every burst workload in `by_profile` (samples grouped
/// by workload × profile), every profile but the sticky oracle.
pub fn bursts(by_profile: &[((String, String), Vec<&Sample>)]) -> Vec<Burst> {
    let mut out = Vec::new();
    for ((workload, profile), rows) in by_profile {
        if workload != W6_BURST || profile == STICKY_ORACLE {
            continue;
        }
        let sticky = by_profile
            .iter()
            .find(|((w, p), _)| w == workload && p == STICKY_ORACLE)
            .map(|(_, rows)| round_means(rows))
            .unwrap_or_default();
        let replicas: BTreeMap<String, usize> = by_profile
            .iter()
            .filter(|((w, _), _)| w == workload)
            .flat_map(|(_, rows)| rows.iter())
            .filter(|s| !s.replica.is_empty())
            .map(|s| (s.replica.clone(), 0))
            .collect();
        // Each run's split: (round, repeat) → requests per replica.
        let mut load: BTreeMap<(u32, u32), BTreeMap<String, usize>> = BTreeMap::new();
        for s in rows {
            let run = load
                .entry((round_of(s), repeat_of(s)))
                .or_insert_with(|| replicas.clone());
            if s.ok() && !s.replica.is_empty() {
                *run.entry(s.replica.clone()).or_insert(0) += 1;
            }
        }
        // Each round's most lopsided run (the first on a tie), and its runs.
        let mut worst: BTreeMap<u32, (BTreeMap<String, usize>, u32)> = BTreeMap::new();
        for ((round, _), split) in load {
            let share = busiest_share(&split).unwrap_or(0.0);
            match worst.get_mut(&round) {
                Some((kept, runs)) => {
                    *runs += 1;
                    if share > busiest_share(kept).unwrap_or(0.0) {
                        *kept = split;
                    }
                }
                None => {
                    worst.insert(round, (split, 1));
                }
            }
        }
        let means = round_means(rows);
        let seeds = worst
            .into_iter()
            .map(|(round, (replica_requests, runs))| {
                let mean_ms = means.get(&round).copied();
                let sticky_mean_ms = sticky.get(&round).copied();
                BurstSeed {
                    round,
                    replica_requests,
                    runs,
                    mean_ms,
                    sticky_mean_ms,
                    vs_sticky: mean_ms
                        .zip(sticky_mean_ms.filter(|s| *s > 0.0))
                        .map(|(m, s)| m / s),
                }
            })
            .collect();
        out.push(distribution(workload, profile, seeds));
    }
    out
}

/// The rounds' distribution.
fn distribution(workload: &str, profile: &str, seeds: Vec<BurstSeed>) -> Burst {
    let mut worst_split: Option<(u32, f64)> = None;
    let mut worst_ratio: Option<(u32, f64)> = None;
    for s in &seeds {
        if let Some(share) = s.share()
            && worst_split.is_none_or(|(_, w)| share > w)
        {
            worst_split = Some((s.round, share));
        }
        if let Some(r) = s.vs_sticky
            && worst_ratio.is_none_or(|(_, w)| r > w)
        {
            worst_ratio = Some((s.round, r));
        }
    }
    let mut ratios: Vec<f64> = seeds.iter().filter_map(|s| s.vs_sticky).collect();
    ratios.sort_by(f64::total_cmp);
    Burst {
        workload: workload.to_owned(),
        profile: profile.to_owned(),
        lopsided_seeds: seeds.iter().filter(|s| s.lopsided()).count(),
        worst_split_round: worst_split.map(|(r, _)| r),
        worst_vs_sticky_round: worst_ratio.map(|(r, _)| r),
        worst_vs_sticky: worst_ratio.map(|(_, v)| v),
        median_vs_sticky: (!ratios.is_empty()).then(|| percentile(&ratios, 0.5)),
        seeds,
    }
}

/// What the burst tables' columns mean.
const LEGEND: &str = "Each round is one seed (`--seed` + round − 1: its script, its \
    conversations' start offsets within 100 ms and indexd's tie-breaks), run on fresh gateways \
    and a fresh indexd, as many times as runs says (`--burst-repeats`, every profile \
    interleaved). Split: answered requests per replica (r0/r1/…, every turn) and the busiest \
    one's share, of the round's most lopsided run, `✗` when worse than 65/35; mean: the round's \
    mean continuation latency (its runs pooled), ms; vs sticky: over the sticky oracle's in the \
    same round. Then over the rounds: how many splits are worse than 65/35, the worst split, \
    the worst and the median ratio.\n";

/// `1.02×`, or `n/a`.
fn times(r: Option<f64>) -> String {
    r.map_or_else(|| "n/a".to_owned(), |r| format!("{r:.2}×"))
}

/// `512.3`, or `n/a`.
fn ms(v: Option<f64>) -> String {
    v.map_or_else(|| "n/a".to_owned(), |v| format!("{v:.1}"))
}

/// Requests per replica and the busiest one's share to a tenth of a
/// percent (31/17 is 64.6%, within 65/35; 32/16 is not): `31/17 (64.6%)`.
fn split(load: &BTreeMap<String, usize>) -> String {
    let counts: Vec<String> = load.values().map(ToString::to_string).collect();
    let share =
        busiest_share(load).map_or_else(|| "n/a".to_owned(), |r| format!("{:.1}%", 100.0 * r));
    format!("{} ({share})", counts.join("/"))
}

/// A round's split, `✗` when worse than 65/35.
fn marked_split(s: &BurstSeed) -> String {
    let mark = if s.lopsided() { " ✗" } else { "" };
    format!("{}{mark}", split(&s.replica_requests))
}

/// Workload `w`'s burst tables (empty when it has none): a row per round
/// with every profile's split, mean and ratio beside the sticky oracle's
/// mean; then a row per profile with the distribution over the rounds.
pub fn markdown(bursts: &[Burst], w: &str) -> String {
    let these: Vec<&Burst> = bursts.iter().filter(|b| b.workload == w).collect();
    if these.is_empty() {
        return String::new();
    }
    let mut out = format!("\n### {w} by seed\n\n{LEGEND}\n| round |");
    let mut rule = String::from("|---:|");
    for b in &these {
        let _ = write!(out, " {0} split | {0} mean | vs sticky |", b.profile);
        rule.push_str("---:|---:|---:|");
    }
    let _ = write!(out, " {STICKY_ORACLE} mean |\n{rule}---:|\n");
    let mut rounds: Vec<u32> = these
        .iter()
        .flat_map(|b| b.seeds.iter().map(|s| s.round))
        .collect();
    rounds.sort_unstable();
    rounds.dedup();
    for round in rounds {
        let _ = write!(out, "| {round} |");
        let mut sticky = None;
        for b in &these {
            match b.seeds.iter().find(|s| s.round == round) {
                Some(s) => {
                    sticky = sticky.or(s.sticky_mean_ms);
                    let _ = write!(
                        out,
                        " {} | {} | {} |",
                        marked_split(s),
                        ms(s.mean_ms),
                        times(s.vs_sticky)
                    );
                }
                None => out.push_str(" – | – | – |"),
            }
        }
        let _ = writeln!(out, " {} |", ms(sticky));
    }
    out.push_str(
        "\n| profile | seeds | worse than 65/35 | worst split | worst vs sticky | median vs sticky |\n\
         |---|---:|---:|---:|---:|---:|\n",
    );
    for b in these {
        let worst_split = b
            .worst_split_round
            .and_then(|r| b.seeds.iter().find(|s| s.round == r))
            .map_or_else(
                || "n/a".to_owned(),
                |s| format!("{} (round {})", split(&s.replica_requests), s.round),
            );
        let worst_ratio = match (b.worst_vs_sticky, b.worst_vs_sticky_round) {
            (Some(v), Some(r)) => format!("{v:.2}× (round {r})"),
            _ => "n/a".to_owned(),
        };
        let runs: u32 = b.seeds.iter().map(|s| s.runs).sum();
        let seeds = if runs as usize == b.seeds.len() {
            b.seeds.len().to_string()
        } else {
            format!("{} ({runs} runs)", b.seeds.len())
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} |",
            b.profile,
            seeds,
            b.lopsided_seeds,
            worst_split,
            worst_ratio,
            times(b.median_vs_sticky),
        );
    }
    out
}

#[cfg(test)]
#[path = "burst_tests.rs"]
mod tests;
