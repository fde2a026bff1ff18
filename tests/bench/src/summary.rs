//! `summary.json` and `summary.md`: per workload × profile, computed from
//! samples alone (`kvroute-bench summarize samples.csv` gives the same bytes).
//!
//! Continuations (turn ≥ 1) carry the routing question, so the hit ratios and
//! the latency/TTFT figures are over the continuations that answered; the
//! latency over every answered request is in `all_latency_ms`.
//!
//! - warm returns: continuations served by the replica that served the
//!   request they continue;
//! - hit ratio: Σ cached / Σ prompt tokens;
//! - oracle ratio: Σ cached / Σ oracle cached tokens, the oracle being the
//!   best prefix any replica held when the request was sent;
//! - missed oracle: continuations whose cached tokens fell short of the
//!   oracle's (a wrong-replica miss or an eviction in flight);
//! - rewritten: requests whose replica ran another prompt or `cache_salt`
//!   than the client sent (by the mock's prompt digest);
//! - with faults (W5), the same figures per phase: the requests sent after
//!   each fault, until the next;
//! - for workloads run with the sticky oracle: each profile's mean latency
//!   over the sticky oracle's, its mid-conversation moves, and the moves that
//!   did not pay (they re-prefilled what the best replica held and came out
//!   slower than the same turn under the sticky oracle);
//! - for runs of several rounds ([`crate::rounds`]): the oracle ratio round
//!   by round with its worst round, and the hit's difference to the sticky
//!   oracle pooled over the rounds they shared;
//! - with the run's `indexd.csv` ([`crate::indexd_metrics`]): each kvroute
//!   profile's indexd at the end of its runs (the chosen replicas' matched
//!   blocks by source, index entries, KV cache groups, block outcomes);
//! - for the burst workload ([`crate::burst`]): each round's load split and
//!   latency against the sticky oracle's, and their distribution.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::burst::{self, Burst};
use crate::indexd_metrics::{self, IndexdGroup, IndexdRow};
use crate::rounds::{
    Form, by_round, round_hits, round_means, round_of, round_oracle_ratios, worst_round,
};
use crate::sample::{STICKY_ORACLE, Sample};
use crate::stats::{Dist, percent, ratio};

/// One workload × profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Group {
    /// Workload name.
    pub workload: String,
    /// Profile name.
    pub profile: String,
    /// Requests sent.
    pub requests: usize,
    /// Requests that failed (status ≠ 200 or an error).
    pub errors: usize,
    /// Answered requests whose replica ran another prompt or salt than was sent.
    pub rewritten: usize,
    /// Continuations that answered.
    pub continuations: usize,
    /// Of those, served by the replica of the request they continue.
    pub warm_returns: usize,
    /// Of those, cached fewer tokens than the oracle.
    pub missed_oracle: usize,
    /// Σ prompt tokens of the continuations.
    pub prompt_tokens: u64,
    /// Σ cached tokens of the continuations.
    pub cached_tokens: u64,
    /// Σ oracle cached tokens of the continuations.
    pub oracle_cached_tokens: u64,
    /// cached / prompt.
    pub hit_ratio: Option<f64>,
    /// cached / oracle.
    pub oracle_ratio: Option<f64>,
    /// Total latency of the continuations, ms.
    pub latency_ms: Dist,
    /// TTFT of the continuations, ms.
    pub ttft_ms: Dist,
    /// Total latency of every answered request, ms.
    pub all_latency_ms: Dist,
    /// Mean continuation latency over the sticky oracle's of the same
    /// workload (workloads run with the sticky oracle only, as are the moves).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vs_sticky: Option<f64>,
    /// The same ratio round by round (`kvroute-bench vllm --rounds`: round
    /// k's conversations are numbered from (k − 1) ×
    /// [`crate::rounds::ROUND_CONVERSATIONS`]),
    /// when there are two rounds or more: how far one round's ratio moves on
    /// the machine, which the pooled ratio's CI does not show.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub vs_sticky_rounds: Vec<f64>,
    /// Its hit ratio less the sticky oracle's, round by round, in
    /// percentage points (two rounds or more): under cache pressure, which
    /// blocks survive follows the timing, and one round's hit moves by a
    /// point or more whatever the placement.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hit_vs_sticky_rounds: Vec<f64>,
    /// Its hit ratio less the sticky oracle's over the rounds they shared,
    /// pooled, in percentage points.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hit_vs_sticky: Option<f64>,
    /// Cached over what the oracle held, round by round (two rounds or
    /// more), in percent, keyed by round (from 1): the worst round is the
    /// bound's reading, which the pooled ratio can hide.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub oracle_ratio_rounds: BTreeMap<u32, f64>,
    /// Continuations served by another replica than the request they continue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moves: Option<usize>,
    /// Of those, moves that did not pay: they re-prefilled tokens the best
    /// replica held (cached < oracle) and were slower than the same turn under
    /// the sticky oracle.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unpaid_moves: Option<usize>,
    /// Σ (oracle − cached) tokens over the moves: what they re-prefilled that
    /// the best replica held.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moves_reprefilled_tokens: Option<u64>,
    /// Answered requests per replica (every turn): the load split.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica_requests: Option<BTreeMap<String, usize>>,
}

/// One workload × profile × fault phase.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PhaseGroup {
    /// The last fault before these requests were sent (`before faults` for none).
    pub phase: String,
    /// The figures of those requests.
    #[serde(flatten)]
    pub group: Group,
}

/// Every group, in order of first appearance in the samples.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// The groups.
    pub groups: Vec<Group>,
    /// Per fault phase, for workloads with faults.
    #[serde(default)]
    pub phases: Vec<PhaseGroup>,
    /// Each kvroute profile's indexds at the end of its runs (runs that
    /// wrote `indexd.csv`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub indexd: Vec<IndexdGroup>,
    /// The burst workload's rounds, per profile but the sticky oracle.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bursts: Vec<Burst>,
}

/// The phase label of requests sent before any fault.
const BEFORE_FAULTS: &str = "before faults";

/// Groups `samples` by workload × profile (order of first appearance).
pub fn grouped(samples: &[Sample]) -> Vec<((String, String), Vec<&Sample>)> {
    let mut out: Vec<((String, String), Vec<&Sample>)> = Vec::new();
    for s in samples {
        let key = (s.workload.clone(), s.profile.clone());
        match out.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => v.push(s),
            None => out.push((key, vec![s])),
        }
    }
    out
}

/// Summarises samples.
pub fn summarize(samples: &[Sample]) -> Summary {
    summarize_run(samples, &[])
}

/// Summarises a run's samples and its gateways' indexd readings.
pub fn summarize_run(samples: &[Sample], indexd: &[IndexdRow]) -> Summary {
    let by_profile = grouped(samples);
    let mut groups: Vec<Group> = by_profile
        .iter()
        .map(|((workload, profile), rows)| group(workload.clone(), profile.clone(), rows))
        .collect();
    against_sticky(&by_profile, &mut groups);
    let bursts = burst::bursts(&by_profile);
    let mut phases = Vec::new();
    for ((workload, profile), rows) in by_profile {
        if rows.iter().all(|s| s.phase.is_empty()) {
            continue;
        }
        // Phases in the order they began: by their earliest send time.
        let mut labels: Vec<(f64, &str)> = Vec::new();
        for s in &rows {
            match labels.iter_mut().find(|(_, l)| *l == s.phase) {
                Some((first, _)) => *first = first.min(s.start_ms),
                None => labels.push((s.start_ms, &s.phase)),
            }
        }
        labels.sort_by(|a, b| a.0.total_cmp(&b.0));
        for (_, label) in labels {
            let these: Vec<&Sample> = rows.iter().copied().filter(|s| s.phase == label).collect();
            phases.push(PhaseGroup {
                phase: if label.is_empty() {
                    BEFORE_FAULTS.to_owned()
                } else {
                    label.to_owned()
                },
                group: group(workload.clone(), profile.clone(), &these),
            });
        }
    }
    Summary {
        groups,
        phases,
        indexd: indexd_metrics::groups(indexd),
        bursts,
    }
}

/// For workloads run with the sticky oracle: each profile's mean latency
/// against it (pooled, and round by round), and its moves, judged turn by
/// turn against the sticky oracle's same turn.
fn against_sticky(by_profile: &[((String, String), Vec<&Sample>)], groups: &mut [Group]) {
    for g in groups.iter_mut() {
        let Some((_, sticky_rows)) = by_profile
            .iter()
            .find(|((w, p), _)| *w == g.workload && p == STICKY_ORACLE)
        else {
            continue;
        };
        let Some(rows) = by_profile
            .iter()
            .find(|((w, p), _)| *w == g.workload && *p == g.profile)
            .map(|(_, rows)| rows)
        else {
            continue;
        };
        let sticky_latency: HashMap<(u32, u32), f64> = sticky_rows
            .iter()
            .filter(|s| s.ok())
            .map(|s| ((s.conversation, s.turn), s.latency_ms))
            .collect();
        // Over the rounds this profile ran: the sticky oracle may run more
        // (`kvroute-bench vllm --reference-rounds`), on a machine whose
        // speed drifts from round to round.
        let rounds: BTreeSet<u32> = rows.iter().map(|s| round_of(s)).collect();
        let sticky_mean = Dist::of(
            &sticky_rows
                .iter()
                .filter(|s| s.ok() && s.is_continuation() && rounds.contains(&round_of(s)))
                .map(|s| s.latency_ms)
                .collect::<Vec<_>>(),
        );
        if sticky_mean.n > 0 && sticky_mean.mean > 0.0 && g.latency_ms.n > 0 {
            g.vs_sticky = Some(g.latency_ms.mean / sticky_mean.mean);
        }
        let sticky_rounds = round_means(sticky_rows);
        if sticky_rounds.len() >= 2 {
            g.vs_sticky_rounds = round_means(rows)
                .iter()
                .filter_map(|(r, mean)| {
                    sticky_rounds.get(r).filter(|s| **s > 0.0).map(|s| mean / s)
                })
                .collect();
            let sticky_hits = round_hits(sticky_rows);
            g.hit_vs_sticky_rounds = round_hits(rows)
                .iter()
                .filter_map(|(r, hit)| sticky_hits.get(r).map(|s| hit - s))
                .collect();
        }
        let shared: Vec<&Sample> = sticky_rows
            .iter()
            .copied()
            .filter(|s| s.ok() && s.is_continuation() && rounds.contains(&round_of(s)))
            .collect();
        let sticky_hit = ratio(
            shared.iter().map(|s| s.cached_tokens).sum(),
            shared.iter().map(|s| s.prompt_tokens).sum(),
        );
        g.hit_vs_sticky = g.hit_ratio.zip(sticky_hit).map(|(h, s)| 100.0 * (h - s));
        let moves: Vec<&&Sample> = rows.iter().filter(|s| s.ok() && s.moved()).collect();
        let unpaid = moves
            .iter()
            .filter(|s| {
                s.cached_tokens < s.oracle_cached_tokens
                    && sticky_latency
                        .get(&(s.conversation, s.turn))
                        .is_none_or(|l| s.latency_ms > *l)
            })
            .count();
        // Every replica of the workload (the sticky oracle uses them all),
        // zero for those this profile never used.
        let mut load: BTreeMap<String, usize> = by_profile
            .iter()
            .filter(|((w, _), _)| *w == g.workload)
            .flat_map(|(_, rows)| rows.iter())
            .filter(|s| !s.replica.is_empty())
            .map(|s| (s.replica.clone(), 0))
            .collect();
        for r in rows.iter().filter(|s| s.ok() && !s.replica.is_empty()) {
            *load.entry(r.replica.clone()).or_insert(0) += 1;
        }
        g.replica_requests = Some(load);
        g.moves = Some(moves.len());
        g.unpaid_moves = Some(unpaid);
        g.moves_reprefilled_tokens = Some(
            moves
                .iter()
                .map(|s| s.oracle_cached_tokens.saturating_sub(s.cached_tokens))
                .sum(),
        );
    }
}

fn group(workload: String, profile: String, rows: &[&Sample]) -> Group {
    let ok: Vec<&Sample> = rows.iter().copied().filter(|s| s.ok()).collect();
    let cont: Vec<&Sample> = ok.iter().copied().filter(|s| s.is_continuation()).collect();
    let prompt_tokens = cont.iter().map(|s| s.prompt_tokens).sum();
    let cached_tokens = cont.iter().map(|s| s.cached_tokens).sum();
    let oracle_cached_tokens = cont.iter().map(|s| s.oracle_cached_tokens).sum();
    let latency: Vec<f64> = cont.iter().map(|s| s.latency_ms).collect();
    let ttft: Vec<f64> = cont.iter().map(|s| s.ttft_ms).collect();
    let all: Vec<f64> = ok.iter().map(|s| s.latency_ms).collect();
    let rounds: BTreeSet<u32> = rows.iter().map(|s| round_of(s)).collect();
    let oracle_ratio_rounds = if rounds.len() >= 2 {
        round_oracle_ratios(rows)
    } else {
        BTreeMap::new()
    };
    Group {
        workload,
        profile,
        requests: rows.len(),
        errors: rows.len() - ok.len(),
        rewritten: ok.iter().filter(|s| s.rewritten()).count(),
        continuations: cont.len(),
        warm_returns: cont.iter().filter(|s| s.warm_return()).count(),
        missed_oracle: cont
            .iter()
            .filter(|s| s.cached_tokens < s.oracle_cached_tokens)
            .count(),
        prompt_tokens,
        cached_tokens,
        oracle_cached_tokens,
        hit_ratio: ratio(cached_tokens, prompt_tokens),
        oracle_ratio: ratio(cached_tokens, oracle_cached_tokens),
        latency_ms: Dist::of(&latency),
        ttft_ms: Dist::of(&ttft),
        all_latency_ms: Dist::of(&all),
        vs_sticky: None,
        vs_sticky_rounds: Vec::new(),
        hit_vs_sticky_rounds: Vec::new(),
        hit_vs_sticky: None,
        oracle_ratio_rounds,
        moves: None,
        unpaid_moves: None,
        moves_reprefilled_tokens: None,
        replica_requests: None,
    }
}

impl Summary {
    /// Pretty JSON with a trailing newline.
    pub fn to_json(&self) -> Result<String, serde_json::Error> {
        serde_json::to_string_pretty(self).map(|s| s + "\n")
    }

    /// The Markdown tables, one per workload.
    pub fn to_markdown(&self) -> String {
        let mut out = String::from(
            "# kvroute-bench summary\n\n\
             Continuations (turn ≥ 1) that answered; latency and TTFT in ms as mean ± 95% CI \
             (t), p50, p99. Warm: served by the replica of the request it continues. Hit: cached / \
             prompt tokens. vs oracle: cached / the best prefix any replica held at arrival. \
             Missed: continuations that cached less than the oracle. Rewritten: answered requests \
             whose replica ran another prompt or `cache_salt` than the client sent.\n",
        );
        let mut workloads: Vec<&str> = Vec::new();
        for g in &self.groups {
            if !workloads.contains(&g.workload.as_str()) {
                workloads.push(&g.workload);
            }
        }
        if self.groups.iter().any(|g| g.moves.is_some()) {
            out.push_str(
                "\nWith the sticky oracle (client-side affinity, conversations split evenly): \
                 vs sticky: mean continuation latency over the sticky oracle's; by round (runs \
                 with rounds): the same ratio in each round, its range and mean ± CI95 (t): one \
                 round's ratio moves with the shared machine far more than the pooled samples' \
                 CI shows; hit Δ by round: its hit ratio less the sticky oracle's in each \
                 round, in percentage points (range, mean ± CI95). Moves: \
                 continuations served by another replica than the request they continue; did \
                 not pay: moves that re-prefilled tokens the best replica held (cached < oracle) \
                 and were slower than the same turn under the sticky oracle; re-prefilled: \
                 Σ (oracle − cached) tokens over the moves; load split: answered requests per \
                 replica (r0/r1/…) and the busiest one's share.\n",
            );
        }
        if self
            .groups
            .iter()
            .any(|g| !g.oracle_ratio_rounds.is_empty())
        {
            out.push_str(ROUNDS_LEGEND);
        }
        if !self.indexd.is_empty() {
            out.push_str(indexd_metrics::LEGEND);
        }
        for w in workloads {
            let sticky = self
                .groups
                .iter()
                .any(|g| g.workload == w && g.moves.is_some());
            let (extra_head, extra_rule) = if sticky {
                (
                    " vs sticky | by round | hit Δ by round | moves | did not pay | re-prefilled | load split |",
                    "---:|---:|---:|---:|---:|---:|---:|",
                )
            } else {
                ("", "")
            };
            let _ = write!(
                out,
                "\n## {w}\n\n\
                 | profile | requests | errors | rewritten | warm returns | hit | vs oracle | missed | latency mean ± CI95 | p50 | p99 | TTFT mean ± CI95 | p50 | p99 |{extra_head}\n\
                 |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|{extra_rule}\n"
            );
            for g in self.groups.iter().filter(|g| g.workload == w) {
                let extra = if sticky {
                    format!(
                        " {} | {} | {} | {} | {} | {} | {} |",
                        g.vs_sticky
                            .map_or_else(|| "n/a".to_owned(), |r| format!("{r:.2}×")),
                        by_round(&g.vs_sticky_rounds, Form::Ratio),
                        by_round(&g.hit_vs_sticky_rounds, Form::Signed),
                        g.moves.map_or_else(|| "n/a".to_owned(), |n| n.to_string()),
                        g.unpaid_moves
                            .map_or_else(|| "n/a".to_owned(), |n| n.to_string()),
                        g.moves_reprefilled_tokens
                            .map_or_else(|| "n/a".to_owned(), |n| n.to_string()),
                        g.replica_requests
                            .as_ref()
                            .map_or_else(|| "n/a".to_owned(), load_split),
                    )
                } else {
                    String::new()
                };
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {} | {}/{} ({}) | {} | {} | {} | {:.1} ± {:.1} | {:.1} | {:.1} | {:.1} ± {:.1} | {:.1} | {:.1} |{extra}",
                    g.profile,
                    g.requests,
                    g.errors,
                    g.rewritten,
                    g.warm_returns,
                    g.continuations,
                    percent(ratio(g.warm_returns as u64, g.continuations as u64)),
                    percent(g.hit_ratio),
                    percent(g.oracle_ratio),
                    g.missed_oracle,
                    g.latency_ms.mean,
                    g.latency_ms.ci95,
                    g.latency_ms.p50,
                    g.latency_ms.p99,
                    g.ttft_ms.mean,
                    g.ttft_ms.ci95,
                    g.ttft_ms.p50,
                    g.ttft_ms.p99,
                );
            }
            out.push_str(&rounds_markdown(&self.groups, w));
            out.push_str(&burst::markdown(&self.bursts, w));
            out.push_str(&indexd_metrics::markdown(w, &self.indexd));
            let phases: Vec<&PhaseGroup> = self
                .phases
                .iter()
                .filter(|p| p.group.workload == w)
                .collect();
            if phases.is_empty() {
                continue;
            }
            let _ = write!(
                out,
                "\n### {w} by fault phase\n\n\
                 Requests sent after each fault, until the next (every request, first turns too, \
                 for errors; continuations for the rest).\n\n\
                 | profile | phase | requests | errors | warm returns | vs oracle | missed | latency mean ± CI95 | p99 |\n\
                 |---|---|---:|---:|---:|---:|---:|---:|---:|\n"
            );
            for p in phases {
                let g = &p.group;
                let _ = writeln!(
                    out,
                    "| {} | {} | {} | {} | {}/{} ({}) | {} | {} | {:.1} ± {:.1} | {:.1} |",
                    g.profile,
                    p.phase,
                    g.requests,
                    g.errors,
                    g.warm_returns,
                    g.continuations,
                    percent(ratio(g.warm_returns as u64, g.continuations as u64)),
                    percent(g.oracle_ratio),
                    g.missed_oracle,
                    g.latency_ms.mean,
                    g.latency_ms.ci95,
                    g.latency_ms.p99,
                );
            }
        }
        out
    }
}

/// What the by-round tables' columns mean (once, above the first workload).
const ROUNDS_LEGEND: &str = "\nBy round (runs of several rounds): vs oracle in each round \
    (the round's continuations pooled): its worst round, and rounds: min–max, mean ± CI95 (t); \
    hit Δ vs sticky: the hit ratio less the sticky oracle's over the rounds they both ran, \
    pooled, in percentage points.\n";

/// One workload's by-round table (empty when no profile ran two rounds).
fn rounds_markdown(groups: &[Group], w: &str) -> String {
    let these: Vec<&Group> = groups
        .iter()
        .filter(|g| g.workload == w && !g.oracle_ratio_rounds.is_empty())
        .collect();
    if these.is_empty() {
        return String::new();
    }
    let mut out = format!(
        "\n### {w} by round\n\n\
             | profile | rounds | vs oracle | worst round | by round | hit Δ vs sticky |\n\
             |---|---:|---:|---:|---:|---:|\n"
    );
    for g in these {
        let values: Vec<f64> = g.oracle_ratio_rounds.values().copied().collect();
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} |",
            g.profile,
            values.len(),
            percent(g.oracle_ratio),
            worst_round(&g.oracle_ratio_rounds),
            by_round(&values, Form::Percent),
            g.hit_vs_sticky
                .map_or_else(|| "n/a".to_owned(), |d| format!("{d:+.2}")),
        );
    }
    out
}

/// Requests per replica in name order, and the busiest one's share:
/// `25/23 (52%)`.
fn load_split(load: &BTreeMap<String, usize>) -> String {
    let total: usize = load.values().sum();
    let max = load.values().copied().max().unwrap_or(0);
    let counts: Vec<String> = load.values().map(ToString::to_string).collect();
    format!(
        "{} ({})",
        counts.join("/"),
        ratio(max as u64, total as u64)
            .map_or_else(|| "n/a".to_owned(), |r| format!("{:.0}%", 100.0 * r))
    )
}

#[cfg(test)]
#[path = "summary_tests.rs"]
mod tests;
