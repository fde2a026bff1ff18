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
//!   slower than the same turn under the sticky oracle).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::runner::STICKY_ORACLE;
use crate::sample::Sample;
use crate::stats::{Dist, ratio};

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
    /// k's conversations are numbered from (k − 1) × [`ROUND_CONVERSATIONS`]),
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
    let by_profile = grouped(samples);
    let mut groups: Vec<Group> = by_profile
        .iter()
        .map(|((workload, profile), rows)| group(workload.clone(), profile.clone(), rows))
        .collect();
    against_sticky(&by_profile, &mut groups);
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
    Summary { groups, phases }
}

/// Round k's conversations are numbered from (k − 1) × this in a
/// multi-round run's samples (a workload has far fewer conversations).
pub const ROUND_CONVERSATIONS: u32 = 1_000;

/// The round a sample belongs to (module docs of `ROUND_CONVERSATIONS`).
const fn round_of(s: &Sample) -> u32 {
    s.conversation / ROUND_CONVERSATIONS
}

/// Hit ratio of the continuations per round, in percent: `(round, hit)`,
/// ascending (rounds without prompt tokens left out).
fn round_hits(rows: &[&Sample]) -> BTreeMap<u32, f64> {
    let mut by_round: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
    for s in rows.iter().filter(|s| s.ok() && s.is_continuation()) {
        let e = by_round.entry(round_of(s)).or_default();
        e.0 += s.cached_tokens;
        e.1 += s.prompt_tokens;
    }
    by_round
        .into_iter()
        .filter_map(|(r, (cached, prompt))| ratio(cached, prompt).map(|h| (r, 100.0 * h)))
        .collect()
}

/// Mean continuation latency per round: `(round, mean)`, ascending.
fn round_means(rows: &[&Sample]) -> BTreeMap<u32, f64> {
    let mut by_round: BTreeMap<u32, Vec<f64>> = BTreeMap::new();
    for s in rows.iter().filter(|s| s.ok() && s.is_continuation()) {
        by_round.entry(round_of(s)).or_default().push(s.latency_ms);
    }
    by_round
        .into_iter()
        .map(|(r, v)| (r, Dist::of(&v).mean))
        .collect()
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

/// Round-by-round figures as `"6: 0.82–1.30, 1.02 ± 0.18"` (rounds, range,
/// mean ± CI95), or `–` for fewer than two rounds; `Signed` for
/// differences in percentage points (`"6: -1.2–+0.8, -0.10 ± 0.60"`).
fn by_round(values: &[f64], form: Form) -> String {
    if values.len() < 2 {
        return "–".to_owned();
    }
    let d = Dist::of(values);
    match form {
        Form::Ratio => format!(
            "{}: {:.2}–{:.2}, {:.2} ± {:.2}",
            d.n, d.min, d.max, d.mean, d.ci95
        ),
        Form::Signed => format!(
            "{}: {:+.1}–{:+.1}, {:+.2} ± {:.2}",
            d.n, d.min, d.max, d.mean, d.ci95
        ),
    }
}

/// How [`by_round`] writes its figures.
#[derive(Clone, Copy)]
enum Form {
    /// Ratios.
    Ratio,
    /// Signed differences.
    Signed,
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

/// `49.54%`, or `n/a`.
pub fn percent(r: Option<f64>) -> String {
    r.map_or_else(|| "n/a".to_owned(), |r| format!("{:.2}%", 100.0 * r))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::example;

    fn pair(
        profile: &str,
        c: u32,
        first: &str,
        second: &str,
        cached: u64,
        oracle: u64,
    ) -> [Sample; 2] {
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
}
