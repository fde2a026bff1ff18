//! `kvroute-bench bodies`: the filter's memory and CPU on big request bodies
//! in Wasm, and what routing them costs end to end against Envoy alone.
//!
//! Two stacks whose Envoys buffer bodies of the size asked for (the
//! listener's `per_connection_buffer_limit_bytes`, the filter's
//! `max_body_bytes` and `max_tokenizer_response_bytes` raised to fit; the
//! mock replicas' `max_model_len` too, so the prompt is served): Envoy +
//! filter + indexd (precise) and Envoy alone. Per body kind ([`make`]:
//! chat, a token-id completions prompt, Responses; small and large), the
//! body is sent a few times to each, one request at a time; around each
//! phase the filter's histograms (`request_work_us`, `answer_work_us`, the
//! callouts) are differenced, and the Wasm memory gauge, each Envoy's RSS,
//! peak RSS, heap and CPU are read. Four CSV files, and `bodies.md` computed
//! from them ([`report`]): `kvroute-bench summarize-bodies <dir>`.

pub mod make;
pub mod report;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvroute_e2e::{HarnessError, Routing, Stack, StackOptions};
use serde_json::{Value, json};

use crate::client::DECISION_HEADER;
use crate::histogram::{self, Hist};
use crate::load::micros;
use crate::procfs::{self, Pid};
use crate::record::{BASELINE, KVROUTE, RunRow};
use crate::{BenchError, sample};
use make::Api;
use report::{HistogramRow, PhaseRow, Report, RequestRow};

/// The long help of the subcommand.
pub const ABOUT: &str = "\
Measure the kvroute filter on big request bodies: two stacks (Envoy + filter + indexd in precise
mode, and Envoy alone), both buffering bodies of --size-bytes (listener buffer limit, the filter's
max_body_bytes and max_tokenizer_response_bytes raised to fit; the mock replicas' max_model_len
too). For each body kind — chat (many messages of text), completions with a token-id prompt,
Responses (many input items) — first at --small-bytes, then at --size-bytes, the same body is sent
--repeat times to each stack, one request at a time. Per phase: the filter's kvroute_request_work_us
and kvroute_answer_work_us (and callout) histograms differenced from Envoy's admin, the
kvroute_vm_memory_bytes gauge, each Envoy's RSS, peak RSS, heap and CPU before and after, and the
end-to-end latency against Envoy alone.

Writes bodies.csv (one row per request), bodies-phases.csv (readings), bodies-histograms.csv,
bodies-run.csv and bodies.md (recomputable with `kvroute-bench summarize-bodies <dir>`). The
defaults (8 MiB, 3 times each) take about 2 minutes.";

/// Per-request timeout.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);
/// Admin and `/metrics` reads.
const ADMIN_TIMEOUT: Duration = Duration::from_secs(5);
/// The most of an answer that is read.
const MAX_ANSWER_BYTES: u64 = 64 * 1024 * 1024;
/// Replicas per stack.
const REPLICAS: usize = 2;
/// The filter's tokenizer timeout here (a large body takes a while to tokenize).
const TOKENIZER_TIMEOUT_MS: u64 = 30_000;
/// The filter's index timeout here.
const INDEX_TIMEOUT_MS: u64 = 10_000;
/// Unrecorded requests per kind and stack before the first phase.
const WARMUP: u32 = 3;
/// Their body size.
const WARMUP_BYTES: usize = 4 * 1024;

/// The `bodies` subcommand's flags.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Size of the large bodies, bytes.
    #[arg(long, default_value_t = 8 * 1024 * 1024)]
    pub size_bytes: usize,
    /// Size of the small bodies, bytes (0: none).
    #[arg(long, default_value_t = 4 * 1024)]
    pub small_bytes: usize,
    /// Sends of each body to each stack.
    #[arg(long, default_value_t = 3)]
    pub repeat: u32,
    /// Seed of the bodies (and of indexd's tie-breaks).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Output directory.
    #[arg(long, default_value = "tests/bench/results-bodies")]
    pub out: PathBuf,
}

/// What the stacks are set to for bodies of `size` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The listener's `per_connection_buffer_limit_bytes`.
    pub buffer_limit_bytes: u32,
    /// The filter's `max_body_bytes`.
    pub max_body_bytes: u64,
    /// The filter's `max_tokenizer_response_bytes`.
    pub max_tokenizer_response_bytes: u64,
    /// The replicas' `max_model_len` (at most one token per 2 bytes of body).
    pub max_model_len: u32,
}

impl Limits {
    /// Limits that fit a body of `size` bytes.
    pub fn for_size(size: usize) -> Option<Self> {
        let size = u64::try_from(size).ok()?;
        let buffer = size.checked_mul(2)?.max(16 * 1024 * 1024);
        Some(Self {
            buffer_limit_bytes: u32::try_from(buffer).ok()?,
            max_body_bytes: buffer - 1024 * 1024,
            max_tokenizer_response_bytes: size.checked_mul(8)?.max(64 * 1024 * 1024),
            max_model_len: u32::try_from(size / 2 + 4_096).ok()?,
        })
    }
}

fn invalid(message: String) -> BenchError {
    BenchError::Harness(HarnessError::Unexpected {
        context: "bodies flags".into(),
        message,
    })
}

/// Runs the measurement, writes the CSV files and `bodies.md` into
/// `args.out`, and returns the report. What was measured is written even
/// when a later step fails.
pub fn run(args: &Args) -> Result<Report, BenchError> {
    if args.size_bytes < 1_024 || args.size_bytes > 64 * 1024 * 1024 {
        return Err(invalid(format!(
            "--size-bytes must be in 1024..=64 MiB: {}",
            args.size_bytes
        )));
    }
    if args.small_bytes > args.size_bytes {
        return Err(invalid("--small-bytes must not pass --size-bytes".into()));
    }
    if args.repeat == 0 || args.repeat > 100 {
        return Err(invalid(format!(
            "--repeat must be in 1..=100: {}",
            args.repeat
        )));
    }
    let limits = Limits::for_size(args.size_bytes)
        .ok_or_else(|| invalid(format!("--size-bytes too large: {}", args.size_bytes)))?;
    std::fs::create_dir_all(&args.out).map_err(|e| BenchError::io(&args.out, e))?;
    let started = Instant::now();
    let options = |routing| StackOptions {
        routing,
        replicas: REPLICAS,
        time_scale: 0.0,
        seed: args.seed,
        max_model_len: limits.max_model_len,
        num_gpu_blocks: limits.max_model_len.div_ceil(16) as usize + 16,
        block_size: 16,
        buffer_limit_bytes: limits.buffer_limit_bytes,
        filter_overrides: json!({
            "tokenizer_timeout_ms": TOKENIZER_TIMEOUT_MS,
            "index_timeout_ms": INDEX_TIMEOUT_MS,
            "max_body_bytes": limits.max_body_bytes,
            "max_tokenizer_response_bytes": limits.max_tokenizer_response_bytes,
        }),
        ..StackOptions::default()
    };
    let kvroute = Stack::start(options(Routing::Precise))?;
    let baseline = Stack::start(options(Routing::LeastRequest))?;
    eprintln!(
        "bodies: stacks up in {:.1} s; kvroute {} (admin {}), Envoy alone {}",
        started.elapsed().as_secs_f64(),
        kvroute.url()?,
        kvroute.envoy().admin_url(),
        baseline.url()?
    );
    let mut rows = Rows::default();
    let measured = measure(args, [&kvroute, &baseline], &mut rows);
    drop(baseline);
    drop(kvroute);
    sample::write_csv(&args.out.join(report::REQUESTS_CSV), &rows.requests)?;
    sample::write_csv(&args.out.join(report::PHASES_CSV), &rows.phases)?;
    sample::write_csv(&args.out.join(report::HISTOGRAMS_CSV), &rows.histograms)?;
    sample::write_csv(&args.out.join(report::RUN_CSV), &settings(args, &limits))?;
    let report = summarize(&args.out)?;
    eprintln!(
        "bodies: {} requests in {:.0} s; results in {}",
        rows.requests.len(),
        started.elapsed().as_secs_f64(),
        args.out.display()
    );
    measured.map(|()| report)
}

/// Reads the CSV files in `dir` and (re)writes `dir/bodies.md`.
pub fn summarize(dir: &Path) -> Result<Report, BenchError> {
    let report = Report {
        settings: sample::read_csv(&dir.join(report::RUN_CSV))?,
        requests: sample::read_csv(&dir.join(report::REQUESTS_CSV))?,
        phases: sample::read_csv(&dir.join(report::PHASES_CSV))?,
        histograms: sample::read_csv(&dir.join(report::HISTOGRAMS_CSV))?,
    };
    let path = dir.join(report::MARKDOWN);
    std::fs::write(&path, report.to_markdown()).map_err(|e| BenchError::io(&path, e))?;
    Ok(report)
}

#[derive(Debug, Default)]
struct Rows {
    requests: Vec<RequestRow>,
    phases: Vec<PhaseRow>,
    histograms: Vec<HistogramRow>,
}

/// The filter histograms a phase reports.
const HISTOGRAMS: [&str; 5] = [
    report::REQUEST_WORK,
    report::ANSWER_WORK,
    histogram::FILTER_DURATION,
    histogram::TOKENIZER_DURATION,
    histogram::INDEX_DURATION,
];

/// One phase per size class and API; rows are appended as they come.
fn measure(
    args: &Args,
    [kvroute, baseline]: [&Stack; 2],
    rows: &mut Rows,
) -> Result<(), BenchError> {
    let agents = [
        crate::client::agent(REQUEST_TIMEOUT),
        crate::client::agent(REQUEST_TIMEOUT),
    ];
    let targets = [
        (KVROUTE, kvroute, kvroute.url()?),
        (BASELINE, baseline, baseline.url()?),
    ];
    let mut decided = 0u64;
    // A few small requests of every kind first (not recorded), so that the
    // first phase does not pay for V8 compiling the filter's code paths.
    for api in Api::ALL {
        let body = make::body(api, WARMUP_BYTES, args.seed.wrapping_add(1));
        for _ in 0..WARMUP {
            for ((profile, _, url), agent) in targets.iter().zip(&agents) {
                let row = send(agent, url, api, &body, ("warmup", "warmup"), profile, 0);
                decided += u64::from(*profile == KVROUTE && !row.decision.is_empty());
            }
        }
    }
    let mut hist_before = histogram::envoy_snapshot(kvroute, decided)?;
    let classes = [("small", args.small_bytes), ("large", args.size_bytes)];
    for (size, bytes) in classes.into_iter().filter(|(_, b)| *b > 0) {
        for api in Api::ALL {
            let body = make::body(api, bytes, args.seed);
            let phase = (api.label(), size);
            let before: Vec<Readings> = targets.iter().map(|(_, s, _)| Readings::of(s)).collect();
            for repeat in 0..args.repeat {
                for ((profile, _, url), agent) in targets.iter().zip(&agents) {
                    let row = send(agent, url, api, &body, phase, profile, repeat);
                    if *profile == KVROUTE && !row.decision.is_empty() {
                        decided += 1;
                    }
                    eprintln!(
                        "bodies: {}/{} {} bytes → {profile}: HTTP {} in {:.1} ms {}",
                        phase.0,
                        phase.1,
                        row.bytes,
                        row.status,
                        row.latency_us as f64 / 1_000.0,
                        row.decision
                    );
                    rows.requests.push(row);
                }
            }
            let after: Vec<Readings> = targets.iter().map(|(_, s, _)| Readings::of(s)).collect();
            for (((profile, _, _), b), a) in targets.iter().zip(&before).zip(&after) {
                rows.phases.extend(b.rows(a, phase, profile));
            }
            let hist_after = histogram::envoy_snapshot(kvroute, decided)?;
            for metric in HISTOGRAMS {
                let a = hist_after.get(metric).cloned().unwrap_or_default();
                let b = hist_before.get(metric).cloned().unwrap_or_default();
                rows.histograms
                    .extend(histogram_rows(phase, metric, &a.since(&b)));
            }
            hist_before = hist_after;
        }
    }
    Ok(())
}

fn histogram_rows(phase: (&str, &str), metric: &str, hist: &Hist) -> Vec<HistogramRow> {
    hist.bins
        .iter()
        .map(|b| HistogramRow {
            api: phase.0.to_owned(),
            size: phase.1.to_owned(),
            metric: metric.to_owned(),
            lower_us: b.lower,
            width_us: b.width,
            count: b.count,
        })
        .collect()
}

/// Sends `body` once and turns the answer into a row.
fn send(
    agent: &ureq::Agent,
    url: &str,
    api: Api,
    body: &[u8],
    phase: (&str, &str),
    profile: &str,
    repeat: u32,
) -> RequestRow {
    let mut row = RequestRow {
        api: phase.0.to_owned(),
        size: phase.1.to_owned(),
        bytes: body.len() as u64,
        profile: profile.to_owned(),
        repeat,
        ..RequestRow::default()
    };
    let started = Instant::now();
    let result = agent
        .post(&format!("{url}{}", api.path()))
        .header("content-type", "application/json")
        .send(body);
    let mut response = match result {
        Ok(r) => r,
        Err(e) => {
            row.latency_us = micros(started.elapsed());
            row.error = format!("transport: {e}");
            return row;
        }
    };
    row.status = response.status().as_u16();
    row.decision = response
        .headers()
        .get(DECISION_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let text = response
        .body_mut()
        .with_config()
        .limit(MAX_ANSWER_BYTES)
        .read_to_string();
    row.latency_us = micros(started.elapsed());
    match text {
        Ok(text) if row.status == 200 => {
            let v: Value = serde_json::from_str(&text).unwrap_or_default();
            let usage = &v["usage"];
            row.prompt_tokens = usage["prompt_tokens"]
                .as_u64()
                .or_else(|| usage["input_tokens"].as_u64())
                .unwrap_or(0);
        }
        Ok(text) => {
            row.error = format!(
                "HTTP {}: {}",
                row.status,
                text.chars().take(200).collect::<String>()
            );
        }
        Err(e) => row.error = format!("reading the answer: {e}"),
    }
    row
}

/// What one Envoy shows at one moment.
#[derive(Debug, Clone, Copy, Default)]
struct Readings {
    rss: Option<u64>,
    hwm: Option<u64>,
    cpu: Option<u64>,
    heap: Option<u64>,
    wasm: Option<u64>,
    decode_errors: Option<u64>,
}

impl Readings {
    fn of(stack: &Stack) -> Self {
        let pid = Pid::Other(stack.envoy().pid());
        let stats = stack.envoy().prometheus_stats().unwrap_or_default();
        let metric = |name: &str| {
            procfs::prometheus_value(&stats, name)
                .filter(|v| v.is_finite() && *v >= 0.0)
                .map(|v| v.round() as u64)
        };
        let indexd = stack
            .indexd_http()
            .and_then(|a| {
                kvroute_e2e::http::get(&format!("http://{a}/metrics"), &[], ADMIN_TIMEOUT).ok()
            })
            .map(|r| r.body)
            .unwrap_or_default();
        Self {
            decode_errors: procfs::prometheus_sum(&indexd, report::DECODE_ERRORS)
                .map(|v| v.round() as u64),
            rss: procfs::rss_kib(pid),
            hwm: procfs::hwm_kib(pid),
            cpu: procfs::cpu_ms(pid),
            heap: metric("envoy_server_memory_allocated"),
            wasm: metric("kvroute_vm_memory_bytes"),
        }
    }

    fn rows(&self, after: &Self, phase: (&str, &str), profile: &str) -> Vec<PhaseRow> {
        [
            (report::RSS, self.rss, after.rss),
            (report::HWM, self.hwm, after.hwm),
            (report::CPU, self.cpu, after.cpu),
            (report::HEAP, self.heap, after.heap),
            (report::WASM, self.wasm, after.wasm),
            (
                report::DECODE_ERRORS,
                self.decode_errors,
                after.decode_errors,
            ),
        ]
        .into_iter()
        .filter(|(_, b, a)| b.is_some() || a.is_some())
        .map(|(metric, before, after)| PhaseRow {
            api: phase.0.to_owned(),
            size: phase.1.to_owned(),
            profile: profile.to_owned(),
            metric: metric.to_owned(),
            before,
            after,
        })
        .collect()
    }
}

/// The settings `bodies.md` quotes.
fn settings(args: &Args, limits: &Limits) -> Vec<RunRow> {
    crate::record::settings([
        ("size_bytes", args.size_bytes.to_string()),
        ("small_bytes", args.small_bytes.to_string()),
        ("repeat", args.repeat.to_string()),
        ("warmup", WARMUP.to_string()),
        ("seed", args.seed.to_string()),
        ("replicas", REPLICAS.to_string()),
        ("buffer_limit_bytes", limits.buffer_limit_bytes.to_string()),
        ("max_body_bytes", limits.max_body_bytes.to_string()),
        (
            "max_tokenizer_response_bytes",
            limits.max_tokenizer_response_bytes.to_string(),
        ),
        ("max_model_len", limits.max_model_len.to_string()),
        ("tokenizer_timeout_ms", TOKENIZER_TIMEOUT_MS.to_string()),
        ("index_timeout_ms", INDEX_TIMEOUT_MS.to_string()),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_fit_the_body() {
        let l = Limits::for_size(8 * 1024 * 1024).unwrap();
        assert_eq!(l.buffer_limit_bytes, 16 * 1024 * 1024);
        assert!(l.max_body_bytes > 8 * 1024 * 1024);
        assert!(l.max_body_bytes < u64::from(l.buffer_limit_bytes));
        assert!(u64::from(l.max_model_len) > 4 * 1024 * 1024);
        assert!(Limits::for_size(usize::MAX).is_none());
    }

    #[test]
    fn flags_are_checked_before_anything_starts() {
        let args = Args {
            size_bytes: 10,
            small_bytes: 0,
            repeat: 1,
            seed: 1,
            out: PathBuf::from("/nonexistent/bodies"),
        };
        match run(&args) {
            Err(BenchError::Harness(HarnessError::Unexpected { context, message })) => {
                assert_eq!(context, "bodies flags");
                assert_eq!(message, "--size-bytes must be in 1024..=64 MiB: 10");
            }
            Err(other) => panic!("not the --size-bytes check: {other}"),
            Ok(_) => panic!("--size-bytes 10 was accepted"),
        }
    }
}
