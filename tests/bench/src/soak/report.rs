//! The soak's CSV rows and `soak.md`, computed from the CSV files alone.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::record::RunRow;

/// One row per sample.
pub const SAMPLES_CSV: &str = "soak.csv";
/// One row per request label.
pub const KINDS_CSV: &str = "soak-kinds.csv";
/// `key,value` settings, and the filter's counters at the end.
pub const RUN_CSV: &str = "soak-run.csv";
/// The report.
pub const MARKDOWN: &str = "soak.md";
/// The acceptance bound on Envoy's RSS growth after warm-up.
pub const FLAT_WITHIN: f64 = 0.10;
/// Rows of the samples table in the Markdown (every row is in the CSV).
const TABLE_ROWS: usize = 24;

/// What was seen at one moment of the run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SampleRow {
    /// Seconds since the load began.
    pub t_s: f64,
    /// Requests finished (answered or lost) so far.
    pub requests: u64,
    /// Requests lost so far.
    pub errors: u64,
    /// Requests answered since the previous sample.
    pub window_requests: u64,
    /// Their median latency (µs).
    pub p50_us: Option<f64>,
    /// Their 99th percentile (µs).
    pub p99_us: Option<f64>,
    /// Envoy's resident memory (`VmRSS`, KiB).
    pub envoy_rss_kib: Option<u64>,
    /// Envoy's heap in use (`server.memory_allocated`, bytes).
    pub envoy_heap_bytes: Option<u64>,
    /// The filter's `kvroute_vm_memory_bytes` gauge.
    pub wasm_memory_bytes: Option<u64>,
    /// The bench process's resident memory (indexd, the replicas and the client; KiB).
    pub bench_rss_kib: Option<u64>,
    /// Envoy's CPU time so far (ms).
    pub envoy_cpu_ms: Option<u64>,
    /// The filter's `kvroute_observe_sent` counter.
    pub observe_sent: Option<u64>,
    /// indexd's own estimate of its index's heap (`indexd_index_bytes`).
    pub indexd_index_bytes: Option<u64>,
    /// indexd's response-id affinity entries (`indexd_affinity_entries`).
    pub indexd_affinity_entries: Option<u64>,
}

/// One request label's totals.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct KindRow {
    /// The label (`chat-stream`, `responses-continue`, …).
    pub kind: String,
    /// Requests.
    pub requests: u64,
    /// Lost.
    pub errors: u64,
    /// Median latency of the answered ones (µs).
    pub p50_us: f64,
    /// Their 99th percentile (µs).
    pub p99_us: f64,
    /// The filter's decisions, `label count` joined by `; `.
    pub decisions: String,
    /// The first error.
    pub first_error: String,
}

/// Everything `soak.md` shows.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Report {
    /// Settings and end counters, in file order.
    pub settings: Vec<RunRow>,
    /// The samples, in time order.
    pub samples: Vec<SampleRow>,
    /// Per request label.
    pub kinds: Vec<KindRow>,
}

/// `(after − before) / before`.
fn growth(before: Option<u64>, after: Option<u64>) -> Option<f64> {
    let (b, a) = (before? as f64, after? as f64);
    (b > 0.0).then(|| (a - b) / b)
}

impl Report {
    /// A setting's value (`?` when the run did not record it).
    pub fn setting(&self, key: &str) -> &str {
        self.settings
            .iter()
            .find(|s| s.key == key)
            .map_or("?", |s| s.value.as_str())
    }

    /// The first sample at or after the warm-up (the reference of the
    /// growth figures), else the last one.
    pub fn reference(&self) -> Option<&SampleRow> {
        let warmup: f64 = self.setting("warmup_secs").parse().unwrap_or(0.0);
        self.samples
            .iter()
            .find(|s| s.t_s >= warmup)
            .or_else(|| self.samples.last())
    }

    /// Requests in all.
    pub fn requests(&self) -> u64 {
        self.kinds.iter().map(|k| k.requests).sum()
    }

    /// Requests lost.
    pub fn errors(&self) -> u64 {
        self.kinds.iter().map(|k| k.errors).sum()
    }

    /// Envoy's RSS growth from the reference to the last sample.
    pub fn envoy_rss_growth(&self) -> Option<f64> {
        growth(
            self.reference()?.envoy_rss_kib,
            self.samples.last()?.envoy_rss_kib,
        )
    }

    /// Whether the run meets the acceptance: Envoy's RSS within
    /// [`FLAT_WITHIN`] of the reference at the end, and nothing lost.
    pub fn accepted(&self) -> bool {
        self.errors() == 0
            && self
                .envoy_rss_growth()
                .is_some_and(|g| g.abs() <= FLAT_WITHIN)
    }

    /// The least-squares slope of Envoy's RSS over finished requests, after
    /// the reference, in KiB per 10,000 requests.
    pub fn envoy_rss_slope(&self) -> Option<f64> {
        let reference = self.reference()?;
        let points: Vec<(f64, f64)> = self
            .samples
            .iter()
            .filter(|s| s.t_s >= reference.t_s)
            .filter_map(|s| Some((s.requests as f64, s.envoy_rss_kib? as f64)))
            .collect();
        if points.len() < 2 {
            return None;
        }
        let n = points.len() as f64;
        let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
        let my = points.iter().map(|p| p.1).sum::<f64>() / n;
        let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
        let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
        (sxx > 0.0).then(|| sxy / sxx * 10_000.0)
    }

    /// The largest Envoy RSS at or after the reference.
    pub fn envoy_rss_max(&self) -> Option<u64> {
        let t = self.reference()?.t_s;
        self.samples
            .iter()
            .filter(|s| s.t_s >= t)
            .filter_map(|s| s.envoy_rss_kib)
            .max()
    }

    /// `soak.md`.
    pub fn to_markdown(&self) -> String {
        let mut out = String::new();
        let (first, reference, last) =
            match (self.samples.first(), self.reference(), self.samples.last()) {
                (Some(f), Some(r), Some(l)) => (f.clone(), r.clone(), l.clone()),
                _ => Default::default(),
            };
        let _ = write!(
            out,
            "# Soak: Envoy + kvroute filter + indexd (precise) under a steady mix\n\n\
             {requests} requests at {rate} req/s, open loop (each due on a fixed schedule, \
             whatever earlier ones are doing), from {senders} sender threads, through one Envoy \
             (2 workers) with the release filter, in front of {replicas} mock vLLM replicas that \
             answer at once (time_scale {ts}; their `/tokenize` and `/v1/responses/render` are the \
             filter's tokenizer). The mix: chat completions (streamed and not), completions (text \
             and token-id prompts), Responses (streamed and not, and stored turns continued by \
             `previous_response_id`: the filter holds a Responses answer until indexd has \
             Observed its id), bodies that are not JSON and `GET /v1/models`; the shares are in \
             the table below. Sampled every {every} s: Envoy's `VmRSS` (`/proc/<pid>/status`), \
             its heap in use (`server.memory_allocated`), the filter's `kvroute_vm_memory_bytes`, \
             and the bench process's RSS. indexd runs inside the bench process (with the mock \
             replicas and the client), so its memory is in the bench RSS, not measured on its \
             own. Run: {cores} cores, bench built `{build}`, seed {seed}. Every figure is \
             recomputed from `soak.csv`, `soak-kinds.csv` and `soak-run.csv` by \
             `kvroute-bench summarize-soak <dir>`.\n\n",
            requests = self.setting("requests"),
            rate = self.setting("rate"),
            senders = self.setting("senders"),
            replicas = self.setting("replicas"),
            ts = self.setting("time_scale"),
            every = self.setting("sample_secs"),
            cores = self.setting("cores"),
            build = self.setting("build"),
            seed = self.setting("seed"),
        );
        let kib = |v: Option<u64>| v.map_or_else(|| "–".to_owned(), |v| format!("{v} KiB"));
        let bytes = |v: Option<u64>| v.map_or_else(|| "–".to_owned(), |v| format!("{v} B"));
        let count = |v: Option<u64>| v.map_or_else(|| "–".to_owned(), |v| v.to_string());
        let pct =
            |v: Option<f64>| v.map_or_else(|| "–".to_owned(), |v| format!("{:+.1}%", v * 100.0));
        let _ = write!(
            out,
            "## Acceptance\n\n\
             Reference: the first sample at or after the {warmup} s warm-up (t = {rt:.1} s, \
             {rr} requests done); end: the last sample (t = {lt:.1} s, {lr} requests done).\n\n\
             | figure | first sample | reference | end | growth from the reference |\n\
             |---|---:|---:|---:|---:|\n\
             | Envoy RSS | {r0} | {r1} | {r2} | {g1} |\n\
             | Envoy heap in use | {h0} | {h1} | {h2} | {g2} |\n\
             | filter Wasm memory | {w0} | {w1} | {w2} | {g3} |\n\
             | bench RSS (indexd + replicas + client) | {b0} | {b1} | {b2} | {g4} |\n\
             | indexd's index (its own estimate) | {i0} | {i1} | {i2} | {g5} |\n\
             | indexd's affinity entries | {a0} | {a1} | {a2} | {g6} |\n\n\
             - Envoy RSS flat within {flat:.0}% of the reference: **{flat_ok}** (largest after \
             the reference {max}; slope {slope} per 10,000 requests).\n\
             - Requests lost: **{errors}** of {total}.\n\
             - Accepted (both): **{accepted}**.\n\n",
            warmup = self.setting("warmup_secs"),
            rt = reference.t_s,
            rr = reference.requests,
            lt = last.t_s,
            lr = last.requests,
            r0 = kib(first.envoy_rss_kib),
            r1 = kib(reference.envoy_rss_kib),
            r2 = kib(last.envoy_rss_kib),
            g1 = pct(growth(reference.envoy_rss_kib, last.envoy_rss_kib)),
            h0 = bytes(first.envoy_heap_bytes),
            h1 = bytes(reference.envoy_heap_bytes),
            h2 = bytes(last.envoy_heap_bytes),
            g2 = pct(growth(reference.envoy_heap_bytes, last.envoy_heap_bytes)),
            w0 = bytes(first.wasm_memory_bytes),
            w1 = bytes(reference.wasm_memory_bytes),
            w2 = bytes(last.wasm_memory_bytes),
            g3 = pct(growth(reference.wasm_memory_bytes, last.wasm_memory_bytes)),
            b0 = kib(first.bench_rss_kib),
            b1 = kib(reference.bench_rss_kib),
            b2 = kib(last.bench_rss_kib),
            g4 = pct(growth(reference.bench_rss_kib, last.bench_rss_kib)),
            i0 = bytes(first.indexd_index_bytes),
            i1 = bytes(reference.indexd_index_bytes),
            i2 = bytes(last.indexd_index_bytes),
            g5 = pct(growth(
                reference.indexd_index_bytes,
                last.indexd_index_bytes
            )),
            a0 = count(first.indexd_affinity_entries),
            a1 = count(reference.indexd_affinity_entries),
            a2 = count(last.indexd_affinity_entries),
            g6 = pct(growth(
                reference.indexd_affinity_entries,
                last.indexd_affinity_entries
            )),
            flat = FLAT_WITHIN * 100.0,
            flat_ok = yes_no(
                self.envoy_rss_growth()
                    .is_some_and(|g| g.abs() <= FLAT_WITHIN)
            ),
            max = kib(self.envoy_rss_max()),
            slope = self
                .envoy_rss_slope()
                .map_or_else(|| "–".to_owned(), |s| format!("{s:+.1} KiB")),
            errors = self.errors(),
            total = self.requests(),
            accepted = yes_no(self.accepted()),
        );
        self.kinds_table(&mut out);
        self.samples_table(&mut out);
        self.reading(&mut out, &reference, &last);
        out
    }

    fn kinds_table(&self, out: &mut String) {
        out.push_str(
            "## Requests by kind\n\n\
             | kind | requests | share | lost | p50 µs | p99 µs | filter decisions | first error |\n\
             |---|---:|---:|---:|---:|---:|---|---|\n",
        );
        let total = self.requests().max(1) as f64;
        for k in &self.kinds {
            let _ = writeln!(
                out,
                "| {} | {} | {:.1}% | {} | {:.0} | {:.0} | {} | {} |",
                k.kind,
                k.requests,
                k.requests as f64 / total * 100.0,
                k.errors,
                k.p50_us,
                k.p99_us,
                if k.decisions.is_empty() {
                    "–"
                } else {
                    &k.decisions
                },
                if k.first_error.is_empty() {
                    "–".to_owned()
                } else {
                    k.first_error.replace('|', "\\|")
                },
            );
        }
        out.push('\n');
    }

    fn samples_table(&self, out: &mut String) {
        let n = self.samples.len();
        let _ = write!(
            out,
            "## Samples\n\n\
             {shown} of the {n} samples, evenly spaced (all are in `soak.csv`); latency is over \
             the requests answered since the previous sample.\n\n\
             | t s | requests | lost | window p50 µs | window p99 µs | Envoy RSS KiB | Envoy heap B \
             | Wasm memory B | bench RSS KiB | indexd index B | indexd affinity | Observe sent |\n\
             |---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
            shown = n.min(TABLE_ROWS),
        );
        let opt = |v: Option<u64>| v.map_or_else(|| "–".to_owned(), |v| v.to_string());
        let optf = |v: Option<f64>| v.map_or_else(|| "–".to_owned(), |v| format!("{v:.0}"));
        for i in spaced(n, TABLE_ROWS) {
            let Some(s) = self.samples.get(i) else {
                continue;
            };
            let _ = writeln!(
                out,
                "| {:.1} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                s.t_s,
                s.requests,
                s.errors,
                optf(s.p50_us),
                optf(s.p99_us),
                opt(s.envoy_rss_kib),
                opt(s.envoy_heap_bytes),
                opt(s.wasm_memory_bytes),
                opt(s.bench_rss_kib),
                opt(s.indexd_index_bytes),
                opt(s.indexd_affinity_entries),
                opt(s.observe_sent),
            );
        }
        out.push('\n');
    }

    fn reading(&self, out: &mut String, reference: &SampleRow, last: &SampleRow) {
        let cpu = match (reference.envoy_cpu_ms, last.envoy_cpu_ms) {
            (Some(a), Some(b)) if last.requests > reference.requests => format!(
                "{:.3} ms",
                b.saturating_sub(a) as f64 / (last.requests - reference.requests) as f64
            ),
            _ => "–".to_owned(),
        };
        let counters: Vec<String> = self
            .settings
            .iter()
            .filter_map(|s| Some(format!("{} {}", s.key.strip_prefix("filter.")?, s.value)))
            .collect();
        let _ = write!(
            out,
            "## Reading\n\n\
             - Envoy's RSS went from {r1} to {r2} KiB after the warm-up ({g}); a leak per \
             request would show as a steady slope over the samples (here {slope} per 10,000 \
             requests). The Wasm memory gauge is the high-water mark of the filter's linear \
             memory (it never shrinks): a leak inside the VM would make it climb.\n\
             - Envoy used {cpu} of CPU per request after the warm-up (its `/proc` CPU time over \
             the requests finished, every kind together).\n\
             - The bench process's RSS holds indexd, both mock replicas and the client, so its \
             growth is not Envoy's or the filter's. The replicas keep their last 10,000 KV-event \
             batches each for replay (vLLM's `buffer_steps`) and every stored Responses turn (as \
             vLLM does), indexd up to 100,000 response ids for affinity: all of these fill up \
             over a long run. indexd's own figures (its estimate of the index's heap, its \
             affinity entries) are read from its `/metrics`.\n\
             - The filter's counters at the end: {counters}.\n",
            r1 = reference
                .envoy_rss_kib
                .map_or_else(|| "–".to_owned(), |v| v.to_string()),
            r2 = last
                .envoy_rss_kib
                .map_or_else(|| "–".to_owned(), |v| v.to_string()),
            g = self
                .envoy_rss_growth()
                .map_or_else(|| "–".to_owned(), |g| format!("{:+.1}%", g * 100.0)),
            slope = self
                .envoy_rss_slope()
                .map_or_else(|| "–".to_owned(), |s| format!("{s:+.1} KiB")),
            counters = if counters.is_empty() {
                "–".to_owned()
            } else {
                counters.join(", ")
            },
        );
    }
}

fn yes_no(v: bool) -> &'static str {
    if v { "yes" } else { "no" }
}

/// Up to `k` indices of `0..n`, evenly spaced, the first and last included.
pub fn spaced(n: usize, k: usize) -> Vec<usize> {
    if n <= k {
        return (0..n).collect();
    }
    if k < 2 {
        return (0..k).collect();
    }
    let mut out: Vec<usize> = (0..k).map(|i| i * (n - 1) / (k - 1)).collect();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(t_s: f64, requests: u64, rss: u64) -> SampleRow {
        SampleRow {
            t_s,
            requests,
            envoy_rss_kib: Some(rss),
            wasm_memory_bytes: Some(1 << 20),
            ..SampleRow::default()
        }
    }

    fn setting(key: &str, value: &str) -> RunRow {
        RunRow {
            key: key.into(),
            value: value.into(),
        }
    }

    #[test]
    fn growth_is_measured_from_the_first_sample_after_warm_up() {
        let report = Report {
            settings: vec![
                setting("warmup_secs", "10"),
                setting("filter.kvroute_observe_sent", "12"),
            ],
            samples: vec![
                sample(0.0, 0, 50_000),
                sample(10.0, 1_000, 80_000),
                sample(20.0, 2_000, 82_000),
                sample(30.0, 3_000, 84_000),
            ],
            kinds: vec![KindRow {
                kind: "chat".into(),
                requests: 3_000,
                ..KindRow::default()
            }],
        };
        assert_eq!(report.reference().unwrap().t_s, 10.0);
        assert_eq!(report.envoy_rss_growth(), Some(0.05));
        assert_eq!(report.envoy_rss_slope(), Some(20_000.0));
        assert_eq!(report.envoy_rss_max(), Some(84_000));
        assert!(report.accepted());
        let md = report.to_markdown();
        assert!(
            md.contains("| Envoy RSS | 50000 KiB | 80000 KiB | 84000 KiB | +5.0% |"),
            "{md}"
        );
        assert!(md.contains("kvroute_observe_sent 12"), "{md}");
        let mut lost = report.clone();
        lost.kinds[0].errors = 1;
        assert!(!lost.accepted());
    }

    #[test]
    fn spaced_indices_keep_both_ends() {
        assert_eq!(spaced(3, 24), vec![0, 1, 2]);
        assert_eq!(spaced(0, 24), Vec::<usize>::new());
        let s = spaced(100, 24);
        assert_eq!((s.len(), s[0], s[23]), (24, 0, 99));
    }
}
