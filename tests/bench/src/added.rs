//! Where kvroute's own time goes on real replicas: after each kvroute run the
//! bench reads every gateway's filter histograms from its Envoy admin (the
//! whole hold of a request, the tokenizer callout, the Pick callout; µs) and
//! its indexd's own (the local tokenization, the task's wait for a blocking
//! thread included; the Pick on the index), and writes them, per workload ×
//! profile × gateway, to `added.csv` and `added.md` beside the samples. With
//! the one-call path (indexd tokenizes the body the Pick carries) the
//! tokenizer callout does not happen and the Pick callout includes indexd's
//! tokenization: the callout less indexd's two is the gRPC hop (both ends'
//! scheduling included).

use std::fmt::Write as _;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::BenchError;
use crate::histogram::{
    FILTER_DURATION, Hist, INDEX_DURATION, PICK_LATENCY, REQUEST_WORK, TOKENIZE_LOCAL,
    TOKENIZER_DURATION,
};

/// The CSV of [`AddedRow`]s.
pub const ADDED_CSV: &str = "added.csv";
/// Its table.
pub const ADDED_MD: &str = "added.md";

/// The histograms read (the filter's in Envoy, then indexd's), and their
/// names in the files.
const METRICS: [(&str, &str); 6] = [
    (FILTER_DURATION, "hold"),
    (REQUEST_WORK, "filter_work"),
    (TOKENIZER_DURATION, "tokenizer_call"),
    (INDEX_DURATION, "pick_call"),
    (TOKENIZE_LOCAL, "indexd_tokenize"),
    (PICK_LATENCY, "indexd_pick"),
];

/// One filter histogram of one gateway after one run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AddedRow {
    /// Workload name.
    pub workload: String,
    /// Profile name.
    pub profile: String,
    /// Gateway index.
    pub gateway: u32,
    /// The round of the workload × profile (`kvroute-bench vllm --rounds`),
    /// from 1.
    pub round: u32,
    /// `hold`, `filter_work`, `tokenizer_call`, `pick_call`,
    /// `indexd_tokenize` or `indexd_pick`.
    pub metric: String,
    /// Observations.
    pub count: u64,
    /// Mean, µs.
    pub mean_us: Option<f64>,
    /// Median, µs.
    pub p50_us: Option<f64>,
    /// 99th percentile, µs.
    pub p99_us: Option<f64>,
}

/// The rows of one gateway's histograms (`hists` as read from its Envoy and
/// its indexd, by their source names).
pub fn rows(
    workload: &str,
    profile: &str,
    gateway: u32,
    hists: &std::collections::BTreeMap<String, Hist>,
) -> Vec<AddedRow> {
    METRICS
        .iter()
        .map(|(name, metric)| {
            let h = hists.get(*name).cloned().unwrap_or_default();
            AddedRow {
                workload: workload.to_owned(),
                profile: profile.to_owned(),
                gateway,
                round: 1,
                metric: (*metric).to_owned(),
                count: h.count(),
                mean_us: h.mean(),
                p50_us: h.quantile(0.5),
                p99_us: h.quantile(0.99),
            }
        })
        .collect()
}

fn ms(v: Option<f64>) -> String {
    v.map_or_else(|| "–".to_owned(), |us| format!("{:.1}", us / 1e3))
}

/// The table of `added.md`: one line per workload × profile × gateway.
pub fn markdown(rows: &[AddedRow]) -> String {
    let mut out = String::from(
        "# What kvroute's filter added per request\n\n\
         Per gateway, from its Envoy's filter histograms after the run (every request of the run, \
         first turns included), in ms: mean / p50 / p99. Hold: from the request's headers until \
         the filter lets it go on (the body buffered, tokens and the Pick). Filter work: the \
         filter's own work on the buffered body (JSON parse, fingerprints, the Pick's \
         encoding). Pick call: the \
         callout to indexd, which here also tokenizes the body (one-call path); tokenizer call: \
         the replica's `/tokenize` when the filter calls it itself (`–`: not used). From the \
         gateway's indexd: tokenize, its own tokenizer on a body (the wait for a blocking \
         thread included), and pick, the Pick on the index. The pick call less these two is \
         the gRPC hop, both ends' scheduling on the busy machine included. indexd's quantiles \
         come from its coarse fixed buckets; its means are exact.\n\n\
         | workload | profile | round | gateway | requests | hold | filter work | pick call | tokenizer call | indexd tokenize | indexd pick |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    // One line per gateway of a run: its rows are written together, so a
    // line is a run of rows with one key and no metric twice (a round run
    // several times, `--burst-repeats`, has a line per run).
    let mut lines: Vec<Vec<&AddedRow>> = Vec::new();
    let same = |a: &AddedRow, b: &AddedRow| {
        a.workload == b.workload
            && a.profile == b.profile
            && a.round == b.round
            && a.gateway == b.gateway
    };
    for r in rows {
        match lines.last_mut() {
            Some(line)
                if line.first().is_some_and(|f| same(f, r))
                    && !line.iter().any(|x| x.metric == r.metric) =>
            {
                line.push(r);
            }
            _ => lines.push(vec![r]),
        }
    }
    for line in lines {
        let Some(first) = line.first() else {
            continue;
        };
        let (workload, profile, round, gateway) =
            (&first.workload, &first.profile, first.round, first.gateway);
        let of = |metric: &str| line.iter().copied().find(|r| r.metric == metric);
        let cell = |metric: &str| {
            of(metric).filter(|r| r.count > 0).map_or_else(
                || "–".to_owned(),
                |r| format!("{} / {} / {}", ms(r.mean_us), ms(r.p50_us), ms(r.p99_us)),
            )
        };
        let requests = of("hold").map_or(0, |r| r.count);
        let _ = writeln!(
            out,
            "| {workload} | {profile} | {round} | {gateway} | {requests} | {} | {} | {} | {} | {} | {} |",
            cell("hold"),
            cell("filter_work"),
            cell("pick_call"),
            cell("tokenizer_call"),
            cell("indexd_tokenize"),
            cell("indexd_pick")
        );
    }
    out
}

/// Writes `added.csv` and `added.md` into `dir` (nothing when `rows` is empty).
pub fn write(dir: &Path, rows: &[AddedRow]) -> Result<(), BenchError> {
    crate::table::write_table(dir, ADDED_CSV, ADDED_MD, rows, markdown)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::histogram::Bin;

    #[test]
    fn a_table_line_per_gateway_with_each_metric_in_ms() {
        let mut hists = std::collections::BTreeMap::new();
        let bin = |lower: f64, count: u64| Bin {
            lower,
            width: 100.0,
            count,
        };
        hists.insert(
            FILTER_DURATION.to_owned(),
            Hist::new(vec![bin(1_000.0, 3), bin(5_000.0, 1)], Some(8_000.0)),
        );
        hists.insert(
            INDEX_DURATION.to_owned(),
            Hist::new(vec![bin(900.0, 4)], Some(3_800.0)),
        );
        hists.insert(
            PICK_LATENCY.to_owned(),
            Hist::new(vec![bin(300.0, 4)], Some(1_200.0)),
        );
        let mut all = rows("w2-lite", "kvroute-precise", 0, &hists);
        all.extend(rows("w2-lite", "kvroute-precise", 1, &hists));
        let mut second = rows("w2-lite", "kvroute-precise", 0, &hists);
        for r in &mut second {
            r.round = 2;
            r.count = 0;
        }
        all.extend(second);
        assert_eq!(all.len(), 18);
        let md = markdown(&all);
        assert!(
            md.contains(
                "| w2-lite | kvroute-precise | 1 | 0 | 4 | 2.0 / 1.1 / 5.1 | – | 0.9 / 0.9 / 1.0 | – | – | 0.3 / 0.3 / 0.4 |"
            ),
            "{md}"
        );
        assert!(
            md.contains("| w2-lite | kvroute-precise | 1 | 1 | 4 |"),
            "{md}"
        );
        assert!(
            md.contains("| w2-lite | kvroute-precise | 2 | 0 | 0 | – | – | – | – | – | – |"),
            "each round its own line: {md}"
        );
        // A round run twice (`--burst-repeats`): a line per run, each its own.
        let mut again = rows("w2-lite", "kvroute-precise", 0, &hists);
        for r in &mut again {
            r.round = 2;
        }
        all.extend(again);
        let md = markdown(&all);
        assert!(
            md.contains("| w2-lite | kvroute-precise | 2 | 0 | 0 | – | – | – | – | – | – |"),
            "{md}"
        );
        assert!(
            md.contains("| w2-lite | kvroute-precise | 2 | 0 | 4 | 2.0 / 1.1 / 5.1 |"),
            "the second run's own figures: {md}"
        );
        assert_eq!(
            md.matches("| w2-lite | kvroute-precise | 2 | 0 |").count(),
            2
        );
    }
}
