//! `kvroute-bench soak`: Envoy's memory under a long steady load through the
//! filter, with every request accounted for.
//!
//! One kvroute stack (Envoy + the release filter + indexd in precise mode, 2
//! mock replicas answering at once) gets a seeded mix of requests ([`mix`])
//! on an open-loop schedule at a fixed rate from a bounded pool of sender
//! threads ([`send`]). While they run, the main thread samples Envoy's RSS
//! and heap, the filter's Wasm memory gauge, the bench process's RSS and the
//! latency of the requests answered since the previous sample. Samples, per
//! kind totals and settings land in three CSV files from which `soak.md` is
//! computed ([`report`]), so `kvroute-bench summarize-soak <dir>` rewrites
//! it byte for byte.

pub mod mix;
pub mod report;
pub mod send;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvroute_e2e::{HarnessError, Routing, Stack, StackOptions};

use crate::procfs::{self, Pid};
use crate::record::RunRow;
use crate::{BenchError, sample, stats};
use report::{KindRow, Report, SampleRow};
use send::Tally;

/// The long help of the subcommand.
pub const ABOUT: &str = "\
Soak Envoy with the kvroute filter: one stack (Envoy + filter + indexd in precise mode, 2 mock
vLLM replicas answering at once) gets a seeded mix of requests at a fixed open-loop rate from a
bounded pool of sender threads: chat completions (streamed and not, most of them), completions
(text and token-id prompts), Responses (streamed and not, and stored turns continued by
previous_response_id, so the filter's Observe-and-hold path runs), bodies that are not JSON and
GET /v1/models. Every --sample-secs: Envoy's VmRSS (/proc/<pid>/status), its heap in use
(server.memory_allocated), the filter's kvroute_vm_memory_bytes gauge, the bench process's RSS
(indexd, the replicas and the client run inside it), indexd's own index-size estimate and
affinity entries (its /metrics) and the window's latency p50/p99.

Writes soak.csv (one row per sample), soak-kinds.csv (per request kind), soak-run.csv (settings
and the filter's counters at the end) and soak.md (start/end memory, growth from the first sample
after the warm-up, requests lost, a reading; recomputable with `kvroute-bench summarize-soak
<dir>`). The defaults (200,000 requests at 400/s) take about 9 minutes. Acceptance: Envoy's RSS
within 10% of the reference at the end, and no request lost.";

/// Per-request timeout.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
const ADMIN_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the sampler checks whether the senders are done.
const POLL: Duration = Duration::from_millis(50);
/// Replicas.
const REPLICAS: usize = 2;

/// The `soak` subcommand's flags.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Requests per second (open loop).
    #[arg(long, default_value_t = 400.0)]
    pub rate: f64,
    /// Requests in all (a Responses pair counts two).
    #[arg(long, default_value_t = 200_000)]
    pub requests: u64,
    /// Seconds between samples.
    #[arg(long, default_value_t = 10.0)]
    pub sample_secs: f64,
    /// Seconds of warm-up: growth is measured from the first sample at or after it.
    #[arg(long, default_value_t = 60.0)]
    pub warmup_secs: f64,
    /// Sender threads (the bound on requests in flight).
    #[arg(long, default_value_t = 32)]
    pub senders: usize,
    /// Seed of the mix and the bodies (and of indexd's tie-breaks).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Output directory.
    #[arg(long, default_value = "tests/bench/results-soak")]
    pub out: PathBuf,
}

fn invalid(message: String) -> BenchError {
    BenchError::Harness(HarnessError::Unexpected {
        context: "soak flags".into(),
        message,
    })
}

fn check(args: &Args) -> Result<(), BenchError> {
    if !args.rate.is_finite() || args.rate <= 0.0 || args.rate > 10_000.0 {
        return Err(invalid(format!(
            "--rate must be in (0, 10000]: {}",
            args.rate
        )));
    }
    if args.requests == 0 || args.requests > 10_000_000 {
        return Err(invalid(format!(
            "--requests must be in 1..=10000000: {}",
            args.requests
        )));
    }
    if !args.sample_secs.is_finite() || args.sample_secs < 0.1 || args.sample_secs > 600.0 {
        return Err(invalid(format!(
            "--sample-secs must be in [0.1, 600]: {}",
            args.sample_secs
        )));
    }
    if !args.warmup_secs.is_finite() || args.warmup_secs < 0.0 {
        return Err(invalid(format!(
            "--warmup-secs must be ≥ 0: {}",
            args.warmup_secs
        )));
    }
    if args.senders == 0 || args.senders > 256 {
        return Err(invalid(format!(
            "--senders must be in 1..=256: {}",
            args.senders
        )));
    }
    Ok(())
}

/// Runs the soak, writes the CSV files and `soak.md` into `args.out`, and
/// returns the report. What was sampled is written even when a sample fails.
pub fn run(args: &Args) -> Result<Report, BenchError> {
    check(args)?;
    std::fs::create_dir_all(&args.out).map_err(|e| BenchError::io(&args.out, e))?;
    let started = Instant::now();
    let stack = Stack::start(StackOptions {
        routing: Routing::Precise,
        replicas: REPLICAS,
        time_scale: 0.0,
        seed: args.seed,
        ..StackOptions::default()
    })?;
    let url = stack.url()?;
    let jobs = mix::schedule(args.seed, args.rate, args.requests);
    let schedule_len = jobs.last().map_or(Duration::ZERO, |j| j.at);
    eprintln!(
        "soak: stack up in {:.1} s ({url}, admin {}); {} requests in {} jobs over {:.0} s",
        started.elapsed().as_secs_f64(),
        stack.envoy().admin_url(),
        args.requests,
        jobs.len(),
        schedule_len.as_secs_f64()
    );
    let agent = crate::load::agent(REQUEST_TIMEOUT, args.senders);
    let bodies = mix::Bodies::new(args.seed);
    let tally = Tally::default();
    let sampler = Sampler::new(&stack);
    let mut samples = Vec::new();
    let finished = AtomicBool::new(false);
    // Senders may finish at most this long after the schedule's end: the
    // last job's lag bound plus a pair's two request timeouts.
    let deadline = schedule_len + send::MAX_LAG + 2 * REQUEST_TIMEOUT + Duration::from_secs(5);
    let begin = Instant::now() + Duration::from_millis(50);
    samples.push(sampler.take(Duration::ZERO, &tally));
    std::thread::scope(|scope| {
        scope.spawn(|| {
            send::run(&agent, &url, &bodies, &jobs, args.senders, begin, &tally);
            finished.store(true, Ordering::Release);
        });
        let every = Duration::from_secs_f64(args.sample_secs);
        let mut next = every;
        while !finished.load(Ordering::Acquire) && begin.elapsed() < deadline {
            std::thread::sleep(POLL);
            let now = begin.elapsed();
            if now >= next {
                samples.push(sampler.take(now, &tally));
                let done = tally.done();
                eprintln!(
                    "soak: {:.0} s: {done}/{} requests, {} lost",
                    now.as_secs_f64(),
                    args.requests,
                    tally.errors()
                );
                next += every;
            }
        }
    });
    samples.push(sampler.take(begin.elapsed(), &tally));
    let mut settings = settings(args, stack.options());
    settings.extend(filter_counters(&stack));
    drop(stack);
    let kinds = kind_rows(&tally);
    write(&args.out, &samples, &kinds, &settings)?;
    let report = summarize(&args.out)?;
    eprintln!(
        "soak: {} requests in {:.0} s, {} lost; results in {}",
        report.requests(),
        started.elapsed().as_secs_f64(),
        report.errors(),
        args.out.display()
    );
    Ok(report)
}

/// Writes the three CSV files.
fn write(
    dir: &Path,
    samples: &[SampleRow],
    kinds: &[KindRow],
    settings: &[RunRow],
) -> Result<(), BenchError> {
    sample::write_csv(&dir.join(report::SAMPLES_CSV), samples)?;
    sample::write_csv(&dir.join(report::KINDS_CSV), kinds)?;
    sample::write_csv(&dir.join(report::RUN_CSV), settings)
}

/// Reads the CSV files in `dir` and (re)writes `dir/soak.md`.
pub fn summarize(dir: &Path) -> Result<Report, BenchError> {
    let report = Report {
        samples: sample::read_csv(&dir.join(report::SAMPLES_CSV))?,
        kinds: sample::read_csv(&dir.join(report::KINDS_CSV))?,
        settings: sample::read_csv(&dir.join(report::RUN_CSV))?,
    };
    let path = dir.join(report::MARKDOWN);
    std::fs::write(&path, report.to_markdown()).map_err(|e| BenchError::io(&path, e))?;
    Ok(report)
}

/// Reads Envoy and the bench process.
struct Sampler {
    envoy_pid: u32,
    admin: String,
    indexd: Option<String>,
}

impl Sampler {
    fn new(stack: &Stack) -> Self {
        Self {
            envoy_pid: stack.envoy().pid(),
            admin: stack.envoy().admin_url().to_owned(),
            indexd: stack.indexd_http().map(|a| format!("http://{a}/metrics")),
        }
    }

    fn take(&self, at: Duration, tally: &Tally) -> SampleRow {
        let mut window: Vec<f64> = tally.take_window().into_iter().map(|v| v as f64).collect();
        window.sort_by(f64::total_cmp);
        let stats = kvroute_e2e::http::get(
            &format!("{}/stats/prometheus", self.admin),
            &[],
            ADMIN_TIMEOUT,
        )
        .map(|r| r.body)
        .unwrap_or_default();
        let indexd = self
            .indexd
            .as_ref()
            .and_then(|url| kvroute_e2e::http::get(url, &[], ADMIN_TIMEOUT).ok())
            .map(|r| r.body)
            .unwrap_or_default();
        let value = |text: &str, name: &str| {
            procfs::prometheus_value(text, name)
                .filter(|v| v.is_finite() && *v >= 0.0)
                .map(|v| v.round() as u64)
        };
        let metric = |name: &str| value(&stats, name);
        SampleRow {
            t_s: (at.as_secs_f64() * 1_000.0).round() / 1_000.0,
            requests: tally.done(),
            errors: tally.errors(),
            window_requests: window.len() as u64,
            p50_us: (!window.is_empty()).then(|| stats::percentile(&window, 0.50).round()),
            p99_us: (!window.is_empty()).then(|| stats::percentile(&window, 0.99).round()),
            envoy_rss_kib: procfs::rss_kib(Pid::Other(self.envoy_pid)),
            envoy_heap_bytes: metric("envoy_server_memory_allocated"),
            wasm_memory_bytes: metric("kvroute_vm_memory_bytes"),
            bench_rss_kib: procfs::rss_kib(Pid::This),
            envoy_cpu_ms: procfs::cpu_ms(Pid::Other(self.envoy_pid)),
            observe_sent: metric("kvroute_observe_sent"),
            indexd_index_bytes: value(&indexd, "indexd_index_bytes"),
            indexd_affinity_entries: value(&indexd, "indexd_affinity_entries"),
        }
    }
}

/// Per request label, in label order.
fn kind_rows(tally: &Tally) -> Vec<KindRow> {
    tally
        .kinds()
        .into_iter()
        .map(|(kind, t)| {
            let mut lat: Vec<f64> = t.latencies_us.iter().map(|v| *v as f64).collect();
            lat.sort_by(f64::total_cmp);
            let decisions: Vec<String> = t
                .decisions
                .iter()
                .map(|(d, n)| format!("{d} {n}"))
                .collect();
            KindRow {
                kind: kind.to_owned(),
                requests: t.requests,
                errors: t.errors,
                p50_us: stats::percentile(&lat, 0.50).round(),
                p99_us: stats::percentile(&lat, 0.99).round(),
                decisions: decisions.join("; "),
                first_error: t.first_error,
            }
        })
        .collect()
}

/// The filter's decision, Observe and breaker counters from Envoy's admin,
/// as `filter.<name>` rows (none when the admin cannot be read).
fn filter_counters(stack: &Stack) -> Vec<RunRow> {
    let Ok(text) = stack.envoy().prometheus_stats() else {
        return Vec::new();
    };
    let mut rows: Vec<RunRow> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (name, rest) = l.split_at(l.find(['{', ' '])?);
            let counter = name.starts_with("kvroute_decisions_")
                || name.starts_with("kvroute_observe_")
                || (name.starts_with("kvroute_") && name.ends_with("_opened"));
            let value = rest.rsplit(' ').next()?.trim();
            (counter && value != "0").then(|| RunRow {
                key: format!("filter.{name}"),
                value: value.to_owned(),
            })
        })
        .collect();
    rows.sort_by(|a, b| a.key.cmp(&b.key));
    rows.dedup_by(|a, b| a.key == b.key);
    rows
}

/// The settings `soak.md` quotes.
fn settings(args: &Args, options: &StackOptions) -> Vec<RunRow> {
    crate::record::settings([
        ("rate", args.rate.to_string()),
        ("requests", args.requests.to_string()),
        ("sample_secs", args.sample_secs.to_string()),
        ("warmup_secs", args.warmup_secs.to_string()),
        ("senders", args.senders.to_string()),
        ("seed", args.seed.to_string()),
        ("replicas", options.replicas.to_string()),
        ("block_size", options.block_size.to_string()),
        ("time_scale", options.time_scale.to_string()),
        (
            "request_timeout_ms",
            REQUEST_TIMEOUT.as_millis().to_string(),
        ),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summarize_rewrites_the_markdown_from_the_csv_files() {
        let dir = tempfile::tempdir().unwrap();
        let args = Args {
            rate: 100.0,
            requests: 300,
            sample_secs: 1.0,
            warmup_secs: 1.0,
            senders: 4,
            seed: 1,
            out: dir.path().to_owned(),
        };
        let samples: Vec<SampleRow> = (0..4u32)
            .map(|i| SampleRow {
                t_s: f64::from(i),
                requests: u64::from(i) * 100,
                envoy_rss_kib: Some(60_000 + u64::from(i)),
                ..SampleRow::default()
            })
            .collect();
        let kinds = vec![KindRow {
            kind: "chat".into(),
            requests: 300,
            decisions: "precise 290; load 10".into(),
            ..KindRow::default()
        }];
        let settings = settings(&args, &StackOptions::default());
        write(dir.path(), &samples, &kinds, &settings).unwrap();
        let first = summarize(dir.path()).unwrap();
        let md_path = dir.path().join(report::MARKDOWN);
        let text = std::fs::read_to_string(&md_path).unwrap();
        std::fs::write(&md_path, "stale").unwrap();
        let again = summarize(dir.path()).unwrap();
        assert_eq!(std::fs::read_to_string(&md_path).unwrap(), text);
        assert_eq!(first, again);
        assert!(first.accepted(), "{text}");
        assert!(text.contains("Requests lost: **0** of 300"), "{text}");
    }

    #[test]
    fn flags_are_checked_before_anything_starts() {
        let args = Args {
            rate: 0.0,
            requests: 10,
            sample_secs: 1.0,
            warmup_secs: 0.0,
            senders: 4,
            seed: 1,
            out: PathBuf::from("/nonexistent/soak"),
        };
        match run(&args) {
            Err(BenchError::Harness(HarnessError::Unexpected { context, message })) => {
                assert_eq!(context, "soak flags");
                assert_eq!(message, "--rate must be in (0, 10000]: 0");
            }
            Err(other) => panic!("not the --rate check: {other}"),
            Ok(_) => panic!("--rate 0 was accepted"),
        }
    }
}
