//! What each gateway's indexd saw during a kvroute run, read from its
//! `/metrics` page when the run ends (the gateways are fresh each run, so its
//! counters are that run's): where the chosen replicas' matched blocks came
//! from, how many entries its index held, the KV cache groups it learned per
//! replica and what became of the blocks the replicas' events reported.
//!
//! On a hybrid model (a sliding-window group beside the full-attention one)
//! this is what tells an index that follows the replicas' events from one
//! that stays empty and routes on speculation: for every precise Pick indexd
//! counts the chosen replica's matched blocks by source
//! (`indexd_chosen_matched_blocks_total{source}`: `indexed`, the replica's
//! events showed them; `speculative`, only this indexd's own recent picks
//! credited them).
//!
//! One [`IndexdRow`] per workload × profile × round × gateway goes to
//! `indexd.csv` beside `samples.csv`; the summary reads it back (a run's
//! input, like the samples) and adds a table per workload ([`IndexdGroup`]).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::BenchError;
use crate::rounds::{Form, by_round, worst_round};
use crate::stats::{Dist, ratio};

/// The CSV of [`IndexdRow`]s, beside `samples.csv`.
pub const INDEXD_CSV: &str = "indexd.csv";

const CHOSEN: &str = "indexd_chosen_matched_blocks_total";
const ENTRIES: &str = "indexd_index_entries";
const SPECULATIVE_ENTRIES: &str = "indexd_speculative_entries";
const BLOCKS: &str = "indexd_blocks_total";
const KV_GROUPS: &str = "indexd_replica_kv_groups";
const OWN_PREFILL: &str = "indexd_replica_prefill_own_tokens_per_second";
const PREFILL_SAMPLES: &str = "indexd_replica_prefill_samples";
const PREFILL_IN_USE: &str = "indexd_replica_prefill_tokens_per_second";

/// One gateway's indexd at the end of one run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct IndexdRow {
    /// Workload name.
    pub workload: String,
    /// Profile name.
    pub profile: String,
    /// The round of the workload × profile, from 1.
    pub round: u32,
    /// Gateway index.
    pub gateway: u32,
    /// Matched blocks of the chosen replicas that its events showed.
    pub indexed_blocks: u64,
    /// Matched blocks of the chosen replicas credited by this indexd's own
    /// recent picks only.
    pub speculative_blocks: u64,
    /// `indexd_index_entries`: indexed (block, replica) entries.
    pub index_entries: u64,
    /// `indexd_speculative_entries`.
    pub speculative_entries: u64,
    /// The fewest KV cache groups it learned for a replica (None: no series).
    pub kv_groups_min: Option<u32>,
    /// The most.
    pub kv_groups_max: Option<u32>,
    /// `indexd_blocks_total{outcome="stored"}`.
    pub stored: u64,
    /// `removed`.
    pub removed: u64,
    /// `evicted`.
    pub evicted: u64,
    /// `skipped_group`: blocks of a group it does not index.
    pub skipped_group: u64,
    /// `skipped_bad_length`.
    pub skipped_bad_length: u64,
    /// `skipped_unknown_parent`.
    pub skipped_unknown_parent: u64,
    /// `parked`: blocks held until their group's parent arrives.
    pub parked: u64,
    /// `unparked`.
    pub unparked: u64,
    /// `parked_dropped`.
    pub parked_dropped: u64,
    /// The slowest replica's own prefill fit, tokens/s
    /// (`indexd_replica_prefill_own_tokens_per_second`, replicas with one;
    /// None: none fitted, or a run before the column).
    #[serde(default)]
    pub prefill_own_min: Option<f64>,
    /// The fastest's.
    #[serde(default)]
    pub prefill_own_max: Option<f64>,
    /// The fewest samples a replica's own fit has
    /// (`indexd_replica_prefill_samples`).
    #[serde(default)]
    pub prefill_samples_min: Option<u32>,
    /// The slowest replica's speed in use, tokens/s (its own fit shrunk
    /// toward its model's pooled one: `indexd_replica_prefill_tokens_per_second`).
    #[serde(default)]
    pub prefill_used_min: Option<f64>,
    /// The fastest's.
    #[serde(default)]
    pub prefill_used_max: Option<f64>,
}

/// A sample line of the text format.
struct Line<'a> {
    name: &'a str,
    labels: Vec<(&'a str, &'a str)>,
    value: f64,
}

impl Line<'_> {
    /// The value of label `key` (empty when absent).
    fn label(&self, key: &str) -> &str {
        self.labels
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| *v)
            .unwrap_or_default()
    }
}

/// A sample line (comments, blank and malformed lines give `None`).
fn sample(line: &str) -> Option<Line<'_>> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let (series, value) = line.rsplit_once(' ')?;
    let value: f64 = value.trim().parse().ok()?;
    let (name, labels) = match series.split_once('{') {
        Some((name, rest)) => {
            let inner = rest.strip_suffix('}')?;
            let labels = inner
                .split("\",")
                .filter(|p| !p.is_empty())
                .filter_map(|p| {
                    let (k, v) = p.split_once("=\"")?;
                    Some((k.trim(), v.trim_end_matches('"')))
                })
                .collect();
            (name, labels)
        }
        None => (series, Vec::new()),
    };
    Some(Line {
        name: name.trim(),
        labels,
        value,
    })
}

/// Counts are whole; a negative or fractional reading rounds into `u64`.
fn count(v: f64) -> u64 {
    v.max(0.0).round() as u64
}

impl IndexdRow {
    /// The figures of an indexd's `/metrics` page (`text`); the names are
    /// left empty.
    pub fn parse(text: &str) -> Self {
        let mut row = Self::default();
        let mut groups: Vec<u32> = Vec::new();
        let mut own: Vec<f64> = Vec::new();
        let mut samples: Vec<u32> = Vec::new();
        let mut used: Vec<f64> = Vec::new();
        for line in text.lines().filter_map(sample) {
            let n = count(line.value);
            match line.name {
                CHOSEN => match line.label("source") {
                    "indexed" => row.indexed_blocks += n,
                    "speculative" => row.speculative_blocks += n,
                    _ => {}
                },
                ENTRIES => row.index_entries = n,
                SPECULATIVE_ENTRIES => row.speculative_entries = n,
                KV_GROUPS => groups.push(u32::try_from(n).unwrap_or(u32::MAX)),
                OWN_PREFILL if line.value > 0.0 => own.push(line.value),
                PREFILL_SAMPLES => samples.push(u32::try_from(n).unwrap_or(u32::MAX)),
                PREFILL_IN_USE if line.value > 0.0 => used.push(line.value),
                BLOCKS => {
                    if let Some(slot) = row.outcome_mut(line.label("outcome")) {
                        *slot += n;
                    }
                }
                _ => {}
            }
        }
        row.kv_groups_min = groups.iter().copied().min();
        row.kv_groups_max = groups.iter().copied().max();
        row.prefill_own_min = own.iter().copied().reduce(f64::min);
        row.prefill_own_max = own.iter().copied().reduce(f64::max);
        row.prefill_samples_min = samples.iter().copied().min();
        row.prefill_used_min = used.iter().copied().reduce(f64::min);
        row.prefill_used_max = used.iter().copied().reduce(f64::max);
        row
    }

    /// The `indexd_blocks_total` outcomes it keeps, by label.
    fn outcomes(&self) -> [(&'static str, u64); 9] {
        [
            ("stored", self.stored),
            ("removed", self.removed),
            ("evicted", self.evicted),
            ("skipped_group", self.skipped_group),
            ("skipped_bad_length", self.skipped_bad_length),
            ("skipped_unknown_parent", self.skipped_unknown_parent),
            ("parked", self.parked),
            ("unparked", self.unparked),
            ("parked_dropped", self.parked_dropped),
        ]
    }

    /// The count of outcome `label`, if it is one it keeps.
    fn outcome_mut(&mut self, label: &str) -> Option<&mut u64> {
        Some(match label {
            "stored" => &mut self.stored,
            "removed" => &mut self.removed,
            "evicted" => &mut self.evicted,
            "skipped_group" => &mut self.skipped_group,
            "skipped_bad_length" => &mut self.skipped_bad_length,
            "skipped_unknown_parent" => &mut self.skipped_unknown_parent,
            "parked" => &mut self.parked,
            "unparked" => &mut self.unparked,
            "parked_dropped" => &mut self.parked_dropped,
            _ => return None,
        })
    }

    /// Named for its run (round 1 until the caller numbers it).
    #[must_use]
    pub fn of_run(mut self, workload: &str, profile: &str, gateway: u32) -> Self {
        self.workload = workload.to_owned();
        self.profile = profile.to_owned();
        self.gateway = gateway;
        self.round = 1;
        self
    }
}

/// Every gateway's indexd of one workload × profile, over its rounds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IndexdGroup {
    /// Workload name.
    pub workload: String,
    /// Profile name.
    pub profile: String,
    /// Rounds read.
    pub rounds: usize,
    /// Gateway readings (rounds × gateways).
    pub readings: usize,
    /// Σ matched blocks of the chosen replicas that their events showed.
    pub indexed_blocks: u64,
    /// Σ those credited by speculation only.
    pub speculative_blocks: u64,
    /// indexed / (indexed + speculative), pooled (None: no precise Pick
    /// matched anything).
    pub indexed_share: Option<f64>,
    /// The same per round (gateways pooled), in percent, keyed by round.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub indexed_share_rounds: BTreeMap<u32, f64>,
    /// `indexd_index_entries` at the end, over the readings.
    pub index_entries: Dist,
    /// The fewest KV cache groups a gateway learned for a replica.
    pub kv_groups_min: Option<u32>,
    /// The most.
    pub kv_groups_max: Option<u32>,
    /// `indexd_blocks_total` by outcome, Σ over the readings (outcomes
    /// never seen left out).
    pub blocks: BTreeMap<String, u64>,
    /// Per reading with two or more own prefill fits: the fastest over the
    /// slowest (identical replicas: near 1).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prefill_spreads: Vec<f64>,
    /// The fewest own samples behind a fit, over the readings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_samples_min: Option<u32>,
    /// Per reading with own fits: the fastest speed in use over the slowest
    /// (what the cost model compares).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prefill_used_spreads: Vec<f64>,
}

/// Groups `rows` by workload × profile, in order of first appearance.
pub fn groups(rows: &[IndexdRow]) -> Vec<IndexdGroup> {
    let mut keys: Vec<(&str, &str)> = Vec::new();
    for r in rows {
        let key = (r.workload.as_str(), r.profile.as_str());
        if !keys.contains(&key) {
            keys.push(key);
        }
    }
    keys.into_iter()
        .map(|(workload, profile)| {
            let these: Vec<&IndexdRow> = rows
                .iter()
                .filter(|r| r.workload == workload && r.profile == profile)
                .collect();
            group(workload, profile, &these)
        })
        .collect()
}

fn group(workload: &str, profile: &str, rows: &[&IndexdRow]) -> IndexdGroup {
    let indexed_blocks = rows.iter().map(|r| r.indexed_blocks).sum();
    let speculative_blocks = rows.iter().map(|r| r.speculative_blocks).sum();
    let mut per_round: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
    for r in rows {
        let e = per_round.entry(r.round).or_default();
        e.0 += r.indexed_blocks;
        e.1 += r.indexed_blocks + r.speculative_blocks;
    }
    let rounds = per_round.len();
    let indexed_share_rounds = if rounds >= 2 {
        per_round
            .iter()
            .filter_map(|(round, (i, all))| ratio(*i, *all).map(|s| (*round, 100.0 * s)))
            .collect()
    } else {
        BTreeMap::new()
    };
    let entries: Vec<f64> = rows.iter().map(|r| r.index_entries as f64).collect();
    let mut blocks: BTreeMap<String, u64> = BTreeMap::new();
    for r in rows {
        for (name, n) in r.outcomes() {
            if n > 0 {
                *blocks.entry(name.to_owned()).or_default() += n;
            }
        }
    }
    IndexdGroup {
        workload: workload.to_owned(),
        profile: profile.to_owned(),
        rounds,
        readings: rows.len(),
        indexed_blocks,
        speculative_blocks,
        indexed_share: ratio(indexed_blocks, indexed_blocks + speculative_blocks),
        indexed_share_rounds,
        index_entries: Dist::of(&entries),
        kv_groups_min: rows.iter().filter_map(|r| r.kv_groups_min).min(),
        kv_groups_max: rows.iter().filter_map(|r| r.kv_groups_max).max(),
        blocks,
        prefill_spreads: rows
            .iter()
            .filter_map(|r| match (r.prefill_own_min, r.prefill_own_max) {
                (Some(lo), Some(hi)) if lo > 0.0 => Some(hi / lo),
                _ => None,
            })
            .collect(),
        prefill_samples_min: rows.iter().filter_map(|r| r.prefill_samples_min).min(),
        prefill_used_spreads: rows
            .iter()
            .filter(|r| r.prefill_own_max.is_some())
            .filter_map(|r| match (r.prefill_used_min, r.prefill_used_max) {
                (Some(lo), Some(hi)) if lo > 0.0 => Some(hi / lo),
                _ => None,
            })
            .collect(),
    }
}

/// What the table's columns mean (once, above the first workload).
pub const LEGEND: &str = "\nindexd at the end of each kvroute run, from each gateway's \
    `/metrics` (the gateways are fresh each run: the counters are that run's; on a shared real \
    fleet the index also holds what earlier runs left, replayed at start). Indexed share: of \
    the matched blocks of the replicas precise Picks chose \
    (`indexd_chosen_matched_blocks_total`), those the replicas' KV events showed, the rest \
    credited only by this indexd's own recent picks (speculative); pooled, its worst round \
    (gateways pooled), and rounds: min–max, mean ± CI95. Entries: `indexd_index_entries` per \
    gateway at the end, smallest / mean. KV groups: `indexd_replica_kv_groups` (the groups \
    learned per replica, fewest–most). Blocks: `indexd_blocks_total` by outcome, summed over \
    the gateways and rounds.\n";

/// The table of one workload's groups (empty when it has none).
pub fn markdown(workload: &str, groups: &[IndexdGroup]) -> String {
    let these: Vec<&IndexdGroup> = groups.iter().filter(|g| g.workload == workload).collect();
    if these.is_empty() {
        return String::new();
    }
    let mut out = format!(
        "\n### {workload}: indexd\n\n\
         | profile | readings | indexed share | worst round | by round | indexed / speculative blocks | entries min / mean | KV groups | stored | skipped group / bad length | parked / unparked / dropped | evicted / removed |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    );
    for g in these {
        let share_rounds: Vec<f64> = g.indexed_share_rounds.values().copied().collect();
        let kv = match (g.kv_groups_min, g.kv_groups_max) {
            (Some(a), Some(b)) if a == b => a.to_string(),
            (Some(a), Some(b)) => format!("{a}–{b}"),
            _ => "n/a".to_owned(),
        };
        let b = |name: &str| g.blocks.get(name).copied().unwrap_or(0);
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} / {} | {:.0} / {:.0} | {kv} | {} | {} / {} | {} / {} / {} | {} / {} |",
            g.profile,
            g.readings,
            crate::stats::percent(g.indexed_share),
            worst_round(&g.indexed_share_rounds),
            by_round(&share_rounds, Form::Percent),
            g.indexed_blocks,
            g.speculative_blocks,
            g.index_entries.min,
            g.index_entries.mean,
            b("stored"),
            b("skipped_group"),
            b("skipped_bad_length"),
            b("parked"),
            b("unparked"),
            b("parked_dropped"),
            b("evicted"),
            b("removed"),
        );
    }
    out.push_str(&prefill_markdown(workload, groups));
    out
}

/// The spread of the replicas' own prefill fits at the end of each run
/// (empty when no reading has two): identical replicas should be fitted
/// alike.
fn prefill_markdown(workload: &str, groups: &[IndexdGroup]) -> String {
    let these: Vec<&IndexdGroup> = groups
        .iter()
        .filter(|g| g.workload == workload && !g.prefill_spreads.is_empty())
        .collect();
    if these.is_empty() {
        return String::new();
    }
    let mut out = format!(
        "\n### {workload}: prefill fits\n\n\
         Per reading, the fastest replica's own fit over the slowest's \
         (`indexd_replica_prefill_own_tokens_per_second`); samples: the fewest behind a fit \
         (`indexd_replica_prefill_samples`); in use: the same for the speeds the cost model \
         uses (`indexd_replica_prefill_tokens_per_second`: the own fits shrunk toward the \
         model's pooled one), over the readings with an own fit.\n\n\
         | profile | readings | median spread | worst spread | within 1.5× | fewest samples | in use: median | worst | within 1.5× |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    );
    for g in these {
        let mut spreads = g.prefill_spreads.clone();
        spreads.sort_by(f64::total_cmp);
        let median = crate::stats::Dist::of(&spreads).p50;
        let worst = spreads.last().copied().unwrap_or(1.0);
        let within = spreads.iter().filter(|s| **s <= 1.5).count();
        let mut used = g.prefill_used_spreads.clone();
        used.sort_by(f64::total_cmp);
        let in_use = if used.is_empty() {
            "n/a | n/a | n/a".to_owned()
        } else {
            format!(
                "{:.2}× | {:.2}× | {}/{}",
                crate::stats::Dist::of(&used).p50,
                used.last().copied().unwrap_or(1.0),
                used.iter().filter(|s| **s <= 1.5).count(),
                used.len()
            )
        };
        let _ = writeln!(
            out,
            "| {} | {} | {median:.2}× | {worst:.2}× | {within}/{} | {} | {in_use} |",
            g.profile,
            spreads.len(),
            spreads.len(),
            g.prefill_samples_min
                .map_or_else(|| "n/a".to_owned(), |n| n.to_string()),
        );
    }
    out
}

/// Reads `indexd.csv` from `dir` (none there: no rows).
pub fn read(dir: &Path) -> Result<Vec<IndexdRow>, BenchError> {
    let path = dir.join(INDEXD_CSV);
    if path.is_file() {
        crate::sample::read_csv(&path)
    } else {
        Ok(Vec::new())
    }
}

/// Writes `rows` to `dir/indexd.csv`; with none, removes one a run before
/// left there (the summary would read it back as this run's).
pub fn write(dir: &Path, rows: &[IndexdRow]) -> Result<(), BenchError> {
    let path = dir.join(INDEXD_CSV);
    if rows.is_empty() {
        return match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(BenchError::io(&path, e)),
            _ => Ok(()),
        };
    }
    crate::sample::write_csv(&path, rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// As indexd renders them (indexd/src/metrics.rs, http.rs).
    const PAGE: &str = "\
# HELP indexd_blocks_total Blocks by outcome (stored, tier_move, removed, skipped_*, evicted).
# TYPE indexd_blocks_total counter
indexd_blocks_total{outcome=\"parked\"} 12
indexd_blocks_total{outcome=\"skipped_group\"} 3
indexd_blocks_total{outcome=\"stored\"} 400
indexd_blocks_total{outcome=\"unparked\"} 11
# HELP indexd_chosen_matched_blocks_total Matched blocks of the replica each precise Pick chose, by source.
# TYPE indexd_chosen_matched_blocks_total counter
indexd_chosen_matched_blocks_total{source=\"indexed\"} 950
indexd_chosen_matched_blocks_total{source=\"speculative\"} 50
indexd_pick_latency_seconds_bucket{le=\"0.001\"} 7
# HELP indexd_index_entries Indexed (block, replica) entries.
# TYPE indexd_index_entries gauge
indexd_index_entries 812
indexd_speculative_entries 4
# TYPE indexd_replica_kv_groups gauge
indexd_replica_kv_groups{endpoint=\"127.0.0.1:4001\",model=\"tiny\"} 2
indexd_replica_kv_groups{endpoint=\"127.0.0.1:4002\",model=\"tiny\"} 1
";

    #[test]
    fn a_metrics_page_gives_the_chosen_blocks_entries_groups_and_outcomes() {
        let row = IndexdRow::parse(PAGE).of_run("w2-lite-hybrid", "kvroute-precise", 1);
        assert_eq!((row.indexed_blocks, row.speculative_blocks), (950, 50));
        assert_eq!((row.index_entries, row.speculative_entries), (812, 4));
        assert_eq!((row.kv_groups_min, row.kv_groups_max), (Some(1), Some(2)));
        assert_eq!(
            (row.stored, row.skipped_group, row.parked, row.unparked),
            (400, 3, 12, 11)
        );
        assert_eq!((row.evicted, row.skipped_bad_length), (0, 0));
        assert_eq!((row.round, row.gateway), (1, 1));
        // A page without the series (an approximate indexd before any Pick).
        let empty = IndexdRow::parse("# HELP x y\nindexd_batches_total 3\n");
        assert_eq!(empty, IndexdRow::default());
    }

    #[test]
    fn label_values_with_commas_and_odd_lines_parse() {
        let page = "indexd_replica_kv_groups{endpoint=\"a,b\",model=\"m\"} 3\nnot a sample\n\nindexd_index_entries  \n";
        let row = IndexdRow::parse(page);
        assert_eq!(row.kv_groups_max, Some(3));
        assert_eq!(row.index_entries, 0);
    }

    fn reading(
        round: u32,
        gateway: u32,
        indexed: u64,
        speculative: u64,
        entries: u64,
    ) -> IndexdRow {
        IndexdRow {
            workload: "w4".into(),
            profile: "kvroute-precise".into(),
            round,
            gateway,
            indexed_blocks: indexed,
            speculative_blocks: speculative,
            index_entries: entries,
            kv_groups_min: Some(2),
            kv_groups_max: Some(2),
            stored: 10,
            skipped_group: 1,
            ..IndexdRow::default()
        }
    }

    #[test]
    fn rounds_pool_their_gateways_and_the_worst_one_is_named() {
        let rows = vec![
            reading(1, 0, 90, 10, 500),
            reading(1, 1, 100, 0, 700),
            reading(2, 0, 40, 10, 300),
            reading(2, 1, 40, 10, 900),
        ];
        let g = groups(&rows);
        assert_eq!(g.len(), 1);
        let g = &g[0];
        assert_eq!((g.rounds, g.readings), (2, 4));
        assert_eq!((g.indexed_blocks, g.speculative_blocks), (270, 30));
        assert_eq!(g.indexed_share, Some(0.9));
        assert_eq!(g.indexed_share_rounds.get(&1), Some(&95.0));
        assert_eq!(g.indexed_share_rounds.get(&2), Some(&80.0));
        assert_eq!((g.index_entries.min, g.index_entries.mean), (300.0, 600.0));
        assert_eq!(g.blocks.get("stored"), Some(&40));
        assert_eq!(g.blocks.get("skipped_group"), Some(&4));
        assert!(!g.blocks.contains_key("parked"));
        let md = markdown("w4", std::slice::from_ref(g));
        assert!(md.contains("### w4: indexd"), "{md}");
        assert!(
            md.contains(
                "| kvroute-precise | 4 | 90.00% | 80.00% (round 2) | 2: 80.00–95.00%, 87.50 ± "
            ),
            "{md}"
        );
        assert!(
            md.contains("| 270 / 30 | 300 / 600 | 2 | 40 | 4 / 0 | 0 / 0 / 0 | 0 / 0 |"),
            "{md}"
        );
        assert_eq!(markdown("w2", std::slice::from_ref(g)), "");
        // One round: no spread, no worst round to name apart from the pool.
        let one = groups(&rows[..2]);
        assert!(one[0].indexed_share_rounds.is_empty());
        assert!(markdown("w4", &one).contains("| 95.00% | – | – |"));
    }

    #[test]
    fn no_precise_pick_is_no_share() {
        let g = &groups(&[reading(1, 0, 0, 0, 0)])[0];
        assert_eq!(g.indexed_share, None);
        assert!(markdown("w4", std::slice::from_ref(g)).contains("| n/a |"));
    }

    #[test]
    fn the_csv_round_trips_and_an_empty_run_removes_a_stale_one() {
        let dir = tempfile::tempdir().unwrap();
        let rows = vec![reading(1, 0, 9, 1, 5), reading(2, 1, 3, 0, 6)];
        write(dir.path(), &rows).unwrap();
        assert_eq!(read(dir.path()).unwrap(), rows);
        write(dir.path(), &[]).unwrap();
        assert!(read(dir.path()).unwrap().is_empty());
        assert!(!dir.path().join(INDEXD_CSV).exists());
        write(dir.path(), &[]).unwrap();
    }

    #[test]
    fn own_prefill_fits_give_their_spread_per_reading() {
        let page = "\
indexd_replica_prefill_own_tokens_per_second{endpoint=\"a\",model=\"m\"} 20000
indexd_replica_prefill_own_tokens_per_second{endpoint=\"b\",model=\"m\"} 25000
indexd_replica_prefill_own_tokens_per_second{endpoint=\"c\",model=\"m\"} 0
indexd_replica_prefill_samples{endpoint=\"a\",model=\"m\"} 12
indexd_replica_prefill_samples{endpoint=\"b\",model=\"m\"} 9
indexd_replica_prefill_samples{endpoint=\"c\",model=\"m\"} 0
indexd_replica_prefill_tokens_per_second{endpoint=\"a\",model=\"m\"} 20000
indexd_replica_prefill_tokens_per_second{endpoint=\"b\",model=\"m\"} 22000
indexd_replica_prefill_tokens_per_second{endpoint=\"c\",model=\"m\"} 21000
";
        let row = IndexdRow::parse(page).of_run("w", "kvroute-precise", 0);
        assert_eq!(
            row.prefill_own_min,
            Some(20_000.0),
            "unfitted ones left out"
        );
        assert_eq!(row.prefill_own_max, Some(25_000.0));
        assert_eq!(row.prefill_samples_min, Some(0));
        let mut far = row.clone();
        far.round = 2;
        far.prefill_own_max = Some(40_000.0);
        let g = groups(&[row, far]);
        assert_eq!(g[0].prefill_spreads, vec![1.25, 2.0]);
        let table = markdown("w", &g);
        assert!(table.contains("### w: prefill fits"), "{table}");
        assert!(
            table.contains(
                "| kvroute-precise | 2 | 1.62× | 2.00× | 1/2 | 0 | 1.10× | 1.10× | 2/2 |"
            ),
            "{table}"
        );
        // Readings without the columns (earlier runs) add no table.
        let old = IndexdRow::parse("indexd_index_entries 3\n").of_run("w", "p", 0);
        assert!(!markdown("w", &groups(&[old])).contains("prefill fits"));
    }
}
