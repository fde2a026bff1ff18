//! The CSV rows of a `bodies` run and `bodies.md`, computed from them alone.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::histogram::{Bin, Hist};
use crate::record::{BASELINE, KVROUTE, RunRow};
use crate::stats;

/// One row per request.
pub const REQUESTS_CSV: &str = "bodies.csv";
/// Readings before and after each phase.
pub const PHASES_CSV: &str = "bodies-phases.csv";
/// The filter's histograms per phase.
pub const HISTOGRAMS_CSV: &str = "bodies-histograms.csv";
/// Settings.
pub const RUN_CSV: &str = "bodies-run.csv";
/// The report.
pub const MARKDOWN: &str = "bodies.md";

/// Envoy's `VmRSS` (KiB).
pub const RSS: &str = "envoy_rss_kib";
/// Envoy's `VmHWM`: its peak RSS so far (KiB).
pub const HWM: &str = "envoy_hwm_kib";
/// Envoy's heap in use (`server.memory_allocated`, bytes).
pub const HEAP: &str = "envoy_heap_bytes";
/// Envoy's CPU time (ms).
pub const CPU: &str = "envoy_cpu_ms";
/// The filter's `kvroute_vm_memory_bytes`.
pub const WASM: &str = "wasm_memory_bytes";
/// KV-event batches indexd refused (all replicas).
pub const DECODE_ERRORS: &str = "indexd_decode_errors_total";

/// The filter's own work on a request body.
pub const REQUEST_WORK: &str = "wasmcustom.kvroute.request_work_us";
/// The filter's own work on a tokenizer answer.
pub const ANSWER_WORK: &str = "wasmcustom.kvroute.answer_work_us";

/// What one request did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestRow {
    /// `chat`, `completions-ids` or `responses`.
    pub api: String,
    /// `small` or `large`.
    pub size: String,
    /// The body's length.
    pub bytes: u64,
    /// [`KVROUTE`] or [`BASELINE`].
    pub profile: String,
    /// Which send of the body (0-based).
    pub repeat: u32,
    /// HTTP status (0: none).
    pub status: u16,
    /// Send to the end of the answer (µs).
    pub latency_us: u64,
    /// The filter's `x-kvroute-decision`.
    pub decision: String,
    /// The answer's prompt tokens (`usage`).
    pub prompt_tokens: u64,
    /// What went wrong.
    pub error: String,
}

impl RequestRow {
    /// Answered 200.
    pub fn ok(&self) -> bool {
        self.status == 200 && self.error.is_empty()
    }
}

/// One reading of one Envoy before and after a phase.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PhaseRow {
    /// The phase's API.
    pub api: String,
    /// The phase's size class.
    pub size: String,
    /// Whose Envoy: [`KVROUTE`] or [`BASELINE`].
    pub profile: String,
    /// [`RSS`], [`HWM`], [`HEAP`], [`CPU`], [`WASM`] or [`DECODE_ERRORS`].
    pub metric: String,
    /// Before the phase's first request.
    pub before: Option<u64>,
    /// Right after its last answer.
    pub after: Option<u64>,
}

/// One bin of one of the filter's histograms over one phase.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct HistogramRow {
    /// The phase's API.
    pub api: String,
    /// The phase's size class.
    pub size: String,
    /// The histogram as Envoy names it.
    pub metric: String,
    /// Lower bound (µs).
    pub lower_us: f64,
    /// Width (µs).
    pub width_us: f64,
    /// Observations.
    pub count: u64,
}

/// A phase: one API at one size.
pub type Phase = (String, String);

/// Everything `bodies.md` shows, from the CSV rows.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Report {
    /// Settings, in file order.
    pub settings: Vec<RunRow>,
    /// Requests, in run order.
    pub requests: Vec<RequestRow>,
    /// Readings.
    pub phases: Vec<PhaseRow>,
    /// Histogram bins.
    pub histograms: Vec<HistogramRow>,
}

fn fmt_opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "–".to_owned(), |v| format!("{v:.digits$}"))
}

fn mib(v: Option<u64>, unit: f64) -> String {
    v.map_or_else(
        || "–".to_owned(),
        |v| format!("{:.1}", v as f64 * unit / (1024.0 * 1024.0)),
    )
}

impl Report {
    /// A setting's value (`?` when absent).
    pub fn setting(&self, key: &str) -> &str {
        self.settings
            .iter()
            .find(|s| s.key == key)
            .map_or("?", |s| s.value.as_str())
    }

    /// The phases in run order.
    pub fn phases(&self) -> Vec<Phase> {
        let mut out: Vec<Phase> = Vec::new();
        for r in &self.requests {
            let p = (r.api.clone(), r.size.clone());
            if !out.contains(&p) {
                out.push(p);
            }
        }
        out
    }

    fn rows<'a>(
        &'a self,
        phase: &'a Phase,
        profile: &'a str,
    ) -> impl Iterator<Item = &'a RequestRow> {
        self.requests
            .iter()
            .filter(move |r| r.api == phase.0 && r.size == phase.1 && r.profile == profile)
    }

    /// The median latency of a profile's answered requests in a phase (ms).
    pub fn latency_p50_ms(&self, phase: &Phase, profile: &str) -> Option<f64> {
        let mut v: Vec<f64> = self
            .rows(phase, profile)
            .filter(|r| r.ok())
            .map(|r| r.latency_us as f64 / 1_000.0)
            .collect();
        v.sort_by(f64::total_cmp);
        (!v.is_empty()).then(|| stats::percentile(&v, 0.5))
    }

    /// A reading of a profile's Envoy in a phase: `(before, after)`.
    pub fn reading(
        &self,
        phase: &Phase,
        profile: &str,
        metric: &str,
    ) -> (Option<u64>, Option<u64>) {
        self.phases
            .iter()
            .find(|p| {
                p.api == phase.0 && p.size == phase.1 && p.profile == profile && p.metric == metric
            })
            .map_or((None, None), |p| (p.before, p.after))
    }

    /// A filter histogram over a phase.
    pub fn histogram(&self, phase: &Phase, metric: &str) -> Hist {
        let bins = self
            .histograms
            .iter()
            .filter(|h| h.api == phase.0 && h.size == phase.1 && h.metric == metric)
            .map(|h| Bin {
                lower: h.lower_us,
                width: h.width_us,
                count: h.count,
            })
            .collect();
        Hist::new(bins, None)
    }

    /// Envoy's CPU per request of `profile` in a phase (ms).
    pub fn cpu_per_request(&self, phase: &Phase, profile: &str) -> Option<f64> {
        let n = self.rows(phase, profile).count();
        match self.reading(phase, profile, CPU) {
            (Some(b), Some(a)) if n > 0 => Some(a.saturating_sub(b) as f64 / n as f64),
            _ => None,
        }
    }

    /// `bodies.md`.
    pub fn to_markdown(&self) -> String {
        let mut out = String::new();
        let _ = write!(
            out,
            "# Big bodies: the filter's work and memory in Wasm, and the latency against Envoy alone\n\n\
             Each body is sent {repeat} times, one request at a time, to Envoy + kvroute filter + \
             indexd (precise) and, interleaved, to Envoy alone (least-request), after {warmup} \
             unrecorded small requests of each kind to each (so that V8 has compiled the filter's \
             code paths), each stack in front of \
             {replicas} mock vLLM replicas answering at once (`max_model_len` {mml}, so even the \
             largest prompt is served). Both Envoys buffer up to {limit} bytes per request \
             (`per_connection_buffer_limit_bytes`); the filter's `max_body_bytes` is {max_body}, its \
             `max_tokenizer_response_bytes` {max_tok}, its tokenizer timeout {tok_timeout} ms and its \
             index timeout {idx_timeout} ms. Sequential requests on one kept-alive connection stay \
             on one Envoy worker, so the Wasm memory gauge is that worker's VM. Filter figures \
             are per-phase differences of Envoy's histograms; readings are taken right before a \
             phase's first request and right after its last answer. Run: {cores} cores, bench \
             built `{build}`, seed {seed}. Recomputed from the CSV files by `kvroute-bench \
             summarize-bodies <dir>`.\n\n",
            repeat = self.setting("repeat"),
            warmup = self.setting("warmup"),
            replicas = self.setting("replicas"),
            mml = self.setting("max_model_len"),
            limit = self.setting("buffer_limit_bytes"),
            max_body = self.setting("max_body_bytes"),
            max_tok = self.setting("max_tokenizer_response_bytes"),
            tok_timeout = self.setting("tokenizer_timeout_ms"),
            idx_timeout = self.setting("index_timeout_ms"),
            cores = self.setting("cores"),
            build = self.setting("build"),
            seed = self.setting("seed"),
        );
        out.push_str(
            "## The filter in Wasm\n\n\
             | body | bytes | prompt tokens | decisions | request work p50 µs | answer work p50 µs \
             | filter p50 µs | tokenizer call p50 µs | Pick call p50 µs | Wasm memory before → after MiB \
             | Envoy RSS before → after MiB | Envoy peak RSS after MiB | Envoy CPU ms/request |\n\
             |---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        for phase in self.phases() {
            let bytes = self
                .rows(&phase, KVROUTE)
                .map(|r| r.bytes)
                .max()
                .unwrap_or(0);
            let tokens = self
                .rows(&phase, KVROUTE)
                .filter(|r| r.ok())
                .map(|r| r.prompt_tokens)
                .max();
            let mut decisions: BTreeMap<&str, usize> = BTreeMap::new();
            for r in self.rows(&phase, KVROUTE) {
                let d = if r.decision.is_empty() {
                    "none"
                } else {
                    r.decision.as_str()
                };
                *decisions.entry(d).or_insert(0) += 1;
            }
            let decisions: Vec<String> =
                decisions.iter().map(|(d, n)| format!("{d} {n}")).collect();
            let p50 = |metric: &str| fmt_opt(self.histogram(&phase, metric).quantile(0.5), 0);
            let (w0, w1) = self.reading(&phase, KVROUTE, WASM);
            let (r0, r1) = self.reading(&phase, KVROUTE, RSS);
            let (_, h1) = self.reading(&phase, KVROUTE, HWM);
            let _ = writeln!(
                out,
                "| {}/{} | {bytes} | {} | {} | {} | {} | {} | {} | {} | {} → {} | {} → {} | {} | {} |",
                phase.0,
                phase.1,
                tokens.map_or_else(|| "–".to_owned(), |t| t.to_string()),
                decisions.join(", "),
                p50(REQUEST_WORK),
                p50(ANSWER_WORK),
                p50(crate::histogram::FILTER_DURATION),
                p50(crate::histogram::TOKENIZER_DURATION),
                p50(crate::histogram::INDEX_DURATION),
                mib(w0, 1.0),
                mib(w1, 1.0),
                mib(r0, 1024.0),
                mib(r1, 1024.0),
                mib(h1, 1024.0),
                fmt_opt(self.cpu_per_request(&phase, KVROUTE), 1),
            );
        }
        out.push_str(
            "\n## End to end against Envoy alone\n\n\
             | body | requests kvroute / alone | errors kvroute / alone | latency p50 kvroute ms \
             | latency p50 alone ms | added ms | Envoy alone RSS before → after MiB \
             | Envoy alone peak RSS after MiB | Envoy alone CPU ms/request | first error |\n\
             |---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n",
        );
        for phase in self.phases() {
            let count = |p: &str| self.rows(&phase, p).count();
            let errors = |p: &str| self.rows(&phase, p).filter(|r| !r.ok()).count();
            let (k, b) = (
                self.latency_p50_ms(&phase, KVROUTE),
                self.latency_p50_ms(&phase, BASELINE),
            );
            let added = k.zip(b).map(|(k, b)| k - b);
            let (r0, r1) = self.reading(&phase, BASELINE, RSS);
            let (_, h1) = self.reading(&phase, BASELINE, HWM);
            let first_error = self
                .requests
                .iter()
                .filter(|r| r.api == phase.0 && r.size == phase.1)
                .find(|r| !r.ok())
                .map_or_else(
                    || "–".to_owned(),
                    |r| {
                        format!(
                            "{}: {}",
                            r.profile,
                            r.error.chars().take(120).collect::<String>()
                        )
                        .replace('|', "\\|")
                    },
                );
            let _ = writeln!(
                out,
                "| {}/{} | {} / {} | {} / {} | {} | {} | {} | {} → {} | {} | {} | {} |",
                phase.0,
                phase.1,
                count(KVROUTE),
                count(BASELINE),
                errors(KVROUTE),
                errors(BASELINE),
                fmt_opt(k, 1),
                fmt_opt(b, 1),
                fmt_opt(added, 1),
                mib(r0, 1024.0),
                mib(r1, 1024.0),
                mib(h1, 1024.0),
                fmt_opt(self.cpu_per_request(&phase, BASELINE), 1),
                first_error,
            );
        }
        out.push_str(
            "\n## Reading\n\n\
             - `request work` is the filter's own time on a request body, from the body's end \
             to its first callout (reading the body into the VM, parsing, the tokenizer call's \
             body); `answer work` its time on the tokenizer's answer (token ids, block keys, \
             the Pick message). A token-id prompt makes no tokenizer call, so its answer work \
             is empty and its request work includes keying the ids. Both run on an Envoy \
             worker thread: while they run, that worker serves nothing else.\n\
             - The Wasm memory gauge is the VM's linear memory, which never shrinks: `after` is \
             the high-water mark the body left behind in that worker's VM. Envoy's RSS and \
             peak RSS include the buffered body itself (Envoy alone buffers nothing: it \
             streams the body through), its copy into the VM and the tokenizer's answer.\n\
             - `added` is the difference of the two medians over few requests: an indication of \
             what routing a body of that size costs, not a precise figure. Envoy's CPU per \
             request is its `/proc` CPU time over the phase (10 ms ticks) divided by the \
             requests it was sent.\n",
        );
        let refused: Vec<String> = self
            .phases()
            .iter()
            .filter_map(|p| match self.reading(p, KVROUTE, DECODE_ERRORS) {
                (Some(b), Some(a)) if a > b => Some(format!("{} in {}/{}", a - b, p.0, p.1)),
                _ => None,
            })
            .collect();
        if !refused.is_empty() {
            let _ = writeln!(
                out,
                "- indexd refused KV-event batches of the replicas while these phases ran ({}; \
                 `indexd_decode_errors_total` read at each phase's end, so an event that arrives \
                 late counts in the next phase): the mock reports a whole prompt's blocks in one \
                 event, and one that long passes indexd's wire limits (blocks per event, tokens \
                 per event, frame bytes), so indexd purged that replica and a repeated body found \
                 nothing to match (`load`) unless its own earlier pick still stood. vLLM reports \
                 a long prefill step by step, each step at most `max_num_batched_tokens`. The \
                 filter's own work does not depend on it.",
                refused.join(", ")
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_come_from_the_rows() {
        let phase: Phase = ("chat".into(), "large".into());
        let req = |profile: &str, latency_us: u64| RequestRow {
            api: "chat".into(),
            size: "large".into(),
            bytes: 8_000_000,
            profile: profile.into(),
            latency_us,
            status: 200,
            decision: if profile == KVROUTE {
                "load".into()
            } else {
                String::new()
            },
            prompt_tokens: 1_700_000,
            ..RequestRow::default()
        };
        let reading = |profile: &str, metric: &str, before: u64, after: u64| PhaseRow {
            api: "chat".into(),
            size: "large".into(),
            profile: profile.into(),
            metric: metric.into(),
            before: Some(before),
            after: Some(after),
        };
        let report = Report {
            settings: vec![],
            requests: vec![
                req(KVROUTE, 900_000),
                req(BASELINE, 300_000),
                req(KVROUTE, 1_100_000),
            ],
            phases: vec![
                reading(KVROUTE, CPU, 1_000, 3_000),
                reading(KVROUTE, WASM, 1 << 20, 64 << 20),
                reading(BASELINE, RSS, 40_960, 51_200),
            ],
            histograms: vec![HistogramRow {
                api: "chat".into(),
                size: "large".into(),
                metric: REQUEST_WORK.into(),
                lower_us: 90_000.0,
                width_us: 10_000.0,
                count: 2,
            }],
        };
        assert_eq!(report.phases(), vec![phase.clone()]);
        assert_eq!(report.latency_p50_ms(&phase, KVROUTE), Some(1_000.0));
        assert_eq!(report.cpu_per_request(&phase, KVROUTE), Some(1_000.0));
        assert_eq!(
            report.histogram(&phase, REQUEST_WORK).quantile(0.5),
            Some(95_000.0)
        );
        let md = report.to_markdown();
        assert!(
            md.contains("| chat/large | 8000000 | 1700000 | load 2 | 95000 |"),
            "{md}"
        );
        assert!(md.contains("| 1.0 → 64.0 |"), "{md}");
        assert!(
            md.contains("| 1000.0 | 300.0 | 700.0 | 40.0 → 50.0 |"),
            "{md}"
        );
    }
}
