//! Round-by-round figures of a multi-round run (`kvroute-bench vllm`: every
//! workload runs several rounds of its profiles, pooled in the summary).
//! Round k's conversations are numbered from (k − 1) ×
//! [`ROUND_CONVERSATIONS`] in `samples.csv` (and a repeated round's repeat j
//! from j × [`REPEAT_CONVERSATIONS`] within it), so the samples alone say
//! which round each belongs to, and each turn meets the sticky oracle's same turn
//! of the same round.
//!
//! One round's figure moves with the shared machine (a passing stall, which
//! blocks an overfull cache happens to keep) far more than the pooled
//! samples' CI shows, so the summary gives them per round too: range, mean
//! ± CI95, and for the oracle ratio the worst round by number.

use std::collections::BTreeMap;

use crate::sample::Sample;
use crate::stats::{Dist, ratio};

/// Round k's conversations are numbered from (k − 1) × this in a
/// multi-round run's samples (a workload has far fewer conversations).
pub const ROUND_CONVERSATIONS: u32 = 1_000;

/// A round run several times (`w6-burst`'s `--burst-repeats`) numbers its
/// repeat k's conversations from k × this within the round's (from 0; a
/// repeated workload has far fewer conversations).
pub const REPEAT_CONVERSATIONS: u32 = 100;

/// The round a sample belongs to, from 1.
pub const fn round_of(s: &Sample) -> u32 {
    s.conversation / ROUND_CONVERSATIONS + 1
}

/// The repeat of its round a sample belongs to, from 0 (of a workload whose
/// rounds run several times; of any other, meaningless).
pub const fn repeat_of(s: &Sample) -> u32 {
    (s.conversation % ROUND_CONVERSATIONS) / REPEAT_CONVERSATIONS
}

/// The continuations that answered, by round.
fn continuations<'a>(rows: &[&'a Sample]) -> BTreeMap<u32, Vec<&'a Sample>> {
    let mut by_round: BTreeMap<u32, Vec<&Sample>> = BTreeMap::new();
    for s in rows.iter().filter(|s| s.ok() && s.is_continuation()) {
        by_round.entry(round_of(s)).or_default().push(s);
    }
    by_round
}

/// Σ cached / Σ `of(s)` over each round's continuations, in percent
/// (rounds whose denominator is 0 left out).
fn round_ratio(rows: &[&Sample], of: fn(&Sample) -> u64) -> BTreeMap<u32, f64> {
    continuations(rows)
        .into_iter()
        .filter_map(|(r, these)| {
            let cached = these.iter().map(|s| s.cached_tokens).sum();
            let whole = these.iter().map(|s| of(s)).sum();
            ratio(cached, whole).map(|h| (r, 100.0 * h))
        })
        .collect()
}

/// Hit ratio of the continuations per round, in percent.
pub fn round_hits(rows: &[&Sample]) -> BTreeMap<u32, f64> {
    round_ratio(rows, |s| s.prompt_tokens)
}

/// Cached over what the oracle held, of the continuations per round, in
/// percent.
pub fn round_oracle_ratios(rows: &[&Sample]) -> BTreeMap<u32, f64> {
    round_ratio(rows, |s| s.oracle_cached_tokens)
}

/// Mean continuation latency per round.
pub fn round_means(rows: &[&Sample]) -> BTreeMap<u32, f64> {
    continuations(rows)
        .into_iter()
        .map(|(r, these)| {
            let v: Vec<f64> = these.iter().map(|s| s.latency_ms).collect();
            (r, Dist::of(&v).mean)
        })
        .collect()
}

/// How [`by_round`] writes its figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// Ratios: `6: 0.82–1.30, 1.02 ± 0.18`.
    Ratio,
    /// Signed differences in percentage points: `6: -1.2–+0.8, -0.10 ± 0.60`.
    Signed,
    /// Percentages: `6: 98.50–100.00%, 99.70 ± 0.55`.
    Percent,
}

/// Round-by-round figures: rounds, range, mean ± CI95 (t), or `–` for
/// fewer than two rounds.
pub fn by_round(values: &[f64], form: Form) -> String {
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
        Form::Percent => format!(
            "{}: {:.2}–{:.2}%, {:.2} ± {:.2}",
            d.n, d.min, d.max, d.mean, d.ci95
        ),
    }
}

/// The round with the smallest value, as `99.20% (round 4)` (the first such
/// round on a tie), or `–` for no rounds.
pub fn worst_round(values: &BTreeMap<u32, f64>) -> String {
    values.iter().min_by(|a, b| a.1.total_cmp(b.1)).map_or_else(
        || "–".to_owned(),
        |(round, v)| format!("{v:.2}% (round {round})"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::example;

    fn turn(round: u32, c: u32, cached: u64, oracle: u64, prompt: u64) -> [Sample; 2] {
        let first = example("p", (round - 1) * ROUND_CONVERSATIONS + c, 0, "r0");
        let mut next = example("p", (round - 1) * ROUND_CONVERSATIONS + c, 1, "r0");
        next.cached_tokens = cached;
        next.oracle_cached_tokens = oracle;
        next.prompt_tokens = prompt;
        next.latency_ms = f64::from(10 * round + c);
        [first, next]
    }

    #[test]
    fn each_round_is_pooled_over_its_own_continuations() {
        let mut samples = Vec::new();
        samples.extend(turn(1, 0, 90, 90, 100));
        samples.extend(turn(1, 1, 60, 90, 100));
        samples.extend(turn(2, 0, 100, 100, 200));
        // A failed continuation counts nowhere.
        let mut failed = turn(2, 1, 0, 100, 100);
        failed[1].status = 502;
        samples.extend(failed);
        let rows: Vec<&Sample> = samples.iter().collect();
        let oracle = round_oracle_ratios(&rows);
        assert_eq!(oracle.len(), 2);
        assert!((oracle[&1] - 150.0 / 180.0 * 100.0).abs() < 1e-9);
        assert!((oracle[&2] - 100.0).abs() < 1e-9);
        let hits = round_hits(&rows);
        assert!((hits[&1] - 75.0).abs() < 1e-9 && (hits[&2] - 50.0).abs() < 1e-9);
        let means = round_means(&rows);
        assert_eq!((means[&1], means[&2]), (10.5, 20.0));
        assert_eq!(worst_round(&oracle), "83.33% (round 1)");
        assert_eq!(worst_round(&BTreeMap::new()), "–");
    }

    #[test]
    fn by_round_writes_range_and_mean_with_their_ci() {
        assert_eq!(by_round(&[1.0], Form::Ratio), "–");
        assert!(by_round(&[1.0, 1.5], Form::Ratio).starts_with("2: 1.00–1.50, 1.25 ± "));
        assert!(by_round(&[-10.0, 5.0], Form::Signed).starts_with("2: -10.0–+5.0, -2.50 ± "));
        assert!(by_round(&[99.0, 100.0], Form::Percent).starts_with("2: 99.00–100.00%, 99.50 ± "));
    }
}
