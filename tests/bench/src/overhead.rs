//! `kvroute-bench overhead`: what kvroute adds to a request's latency
//! against Envoy alone: the routing overhead of filter + indexd.
//!
//! Two stacks run side by side on the same machine: Envoy + the kvroute
//! filter + indexd in precise mode, and Envoy alone (least-request, no
//! filter), each in front of 2 mock vLLM replicas that answer instantly
//! (`time_scale` 0; their `/tokenize` is the filter's tokenizer). At each
//! rate both get the same open-loop schedule of identical chat requests,
//! interleaved request by request ([`load`]). After each rate the filter's
//! own histograms (Envoy admin) and indexd's Pick histogram are captured as
//! that rate's bins ([`histogram`]), and the CPU each process used during
//! the rate's load is read from `/proc` ([`cpu`]). Everything lands in four
//! CSV files ([`record`], [`cpu`]) from which `overhead.md` is computed
//! ([`report`]), so `kvroute-bench summarize-overhead <dir>` rewrites it
//! byte for byte.

pub mod cpu;
pub mod load;
pub mod record;
pub mod report;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvroute_e2e::{HarnessError, Routing, Stack, StackOptions, http};

use crate::histogram::{self, Hist, PICK_LATENCY};
use crate::record::{BASELINE, KVROUTE, RunRow};
use crate::{BenchError, sample};
use load::{Prompts, Target};
use record::{HistogramRow, RequestRow};
pub use report::Report;

/// The long help of the subcommand.
pub const ABOUT: &str = "\
Measure what kvroute adds to a request's latency: Envoy + kvroute filter + indexd (precise mode)
against Envoy alone (least-request, no filter), both in front of 2 mock vLLM replicas that answer
instantly (the mock's /tokenize is the filter's tokenizer). At each rate both profiles get the same
open-loop schedule of streamed chat requests (~1.5k-token prompts: a shared 1,024-token system
prompt and a 512-token message of their own, max_tokens 4), interleaved request by request, from a
bounded pool of sender threads. After each rate the filter's histograms (kvroute.filter_duration_us,
kvroute.tokenizer_duration_us, kvroute.index_duration_us from Envoy's admin) and indexd's
indexd_pick_latency_seconds are captured for that rate alone, and the CPU time of each Envoy, of
indexd, of each stack's replicas and of the client during the rate's load is read from /proc
(CPU-ms per request).

Writes overhead.csv (one row per request), overhead-histograms.csv (histogram bins per rate),
overhead-cpu.csv (CPU per process per rate), overhead-run.csv (settings) and overhead.md (tables
and a reading, recomputable from the CSVs with `kvroute-bench summarize-overhead <dir>`). Build
the bench optimised (`make bench-overhead` uses the `perf` profile): the mock replicas and indexd
run inside the bench process, each stack's runtime and indexd's on threads of their own names.
Defaults take about 2 minutes.";

/// Per-request timeout.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How long to wait for Envoy's stats flush to include a phase.
const ADMIN_TIMEOUT: Duration = Duration::from_secs(5);
/// Replicas per stack.
const REPLICAS: usize = 2;
/// The mock's latency-model speed: 0 never sleeps.
const TIME_SCALE: f64 = 0.0;

/// The `overhead` subcommand's flags.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Requests per second per profile, one phase each.
    #[arg(long, value_delimiter = ',', default_values_t = [10.0, 50.0, 100.0, 250.0, 500.0])]
    pub rates: Vec<f64>,
    /// Seconds of schedule per rate.
    #[arg(long, default_value_t = 15.0)]
    pub secs: f64,
    /// Sender threads (the bound on requests in flight).
    #[arg(long, default_value_t = 32)]
    pub senders: usize,
    /// Sequential requests per profile before the first rate (not recorded).
    #[arg(long, default_value_t = 50)]
    pub warmup: u32,
    /// Seed of the prompts (and of indexd's tie-breaks).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Where kvroute tokenizes: `indexd` (the Pick carries the body; indexd
    /// asks the mock's render endpoint, the mock model having no tokenizer
    /// files) or `cluster` (the filter calls the mock's /tokenize, then Picks).
    #[arg(long, value_enum, default_value_t = TokenizeAt::Indexd)]
    pub tokenize_at: TokenizeAt,
    /// Output directory.
    #[arg(long, default_value = "tests/bench/results-overhead")]
    pub out: PathBuf,
}

/// The filter's `tokenize_at`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TokenizeAt {
    /// One call: a Pick carrying the body.
    Indexd,
    /// Two calls: the tokenizer cluster, then a Pick with keys.
    Cluster,
}

impl TokenizeAt {
    fn label(self) -> &'static str {
        match self {
            Self::Indexd => "indexd",
            Self::Cluster => "cluster",
        }
    }
}

/// Runs the measurement, writes the CSV files and `overhead.md` into
/// `args.out`, and returns the report. Whatever was measured is written even
/// when a later step fails.
pub fn run(args: &Args) -> Result<Report, BenchError> {
    let invalid = |message: String| {
        BenchError::Harness(HarnessError::Unexpected {
            context: "overhead flags".into(),
            message,
        })
    };
    if args.rates.is_empty() || args.rates.iter().any(|r| !r.is_finite() || *r <= 0.0) {
        return Err(invalid(format!(
            "--rates must be positive: {:?}",
            args.rates
        )));
    }
    let mut distinct = args.rates.clone();
    distinct.sort_by(f64::total_cmp);
    distinct.dedup();
    if distinct.len() != args.rates.len() {
        return Err(invalid(format!("--rates must differ: {:?}", args.rates)));
    }
    if !args.secs.is_finite() || args.secs <= 0.0 || args.secs > 600.0 {
        return Err(invalid(format!(
            "--secs must be in (0, 600]: {}",
            args.secs
        )));
    }
    if args.senders == 0 || args.senders > 256 {
        return Err(invalid(format!(
            "--senders must be in 1..=256: {}",
            args.senders
        )));
    }
    std::fs::create_dir_all(&args.out).map_err(|e| BenchError::io(&args.out, e))?;
    let started = Instant::now();
    let mut filter_overrides = StackOptions::default().filter_overrides;
    if args.tokenize_at == TokenizeAt::Cluster {
        filter_overrides["tokenize_at"] = serde_json::json!("cluster");
        filter_overrides["tokenizer_cluster"] = serde_json::json!("vllm_tokenizer");
    }
    let stack = |routing, threads: &str| {
        Stack::start(StackOptions {
            routing,
            replicas: REPLICAS,
            time_scale: TIME_SCALE,
            seed: args.seed,
            thread_label: Some(threads.to_owned()),
            filter_overrides: filter_overrides.clone(),
            ..StackOptions::default()
        })
    };
    let kvroute = stack(Routing::Precise, cpu::KVROUTE_THREADS)?;
    let baseline = stack(Routing::LeastRequest, cpu::BASELINE_THREADS)?;
    let targets = [
        Target {
            profile: KVROUTE,
            url: kvroute.url()?,
        },
        Target {
            profile: BASELINE,
            url: baseline.url()?,
        },
    ];
    let settings = settings(args, kvroute.options());
    eprintln!(
        "overhead: stacks up in {:.1} s; kvroute {} (admin {}), Envoy alone {}",
        started.elapsed().as_secs_f64(),
        targets[0].url,
        kvroute.envoy().admin_url(),
        targets[1].url
    );
    let agent = crate::load::agent(REQUEST_TIMEOUT, args.senders);
    let prompts = Prompts::new(args.seed);
    let mut requests = Vec::new();
    let mut histograms = Vec::new();
    let mut cpu_rows = Vec::new();
    let measured = measure(
        args,
        [&kvroute, &baseline],
        &targets,
        &agent,
        &prompts,
        &mut Rows {
            requests: &mut requests,
            histograms: &mut histograms,
            cpu: &mut cpu_rows,
        },
    );
    drop(baseline);
    drop(kvroute);
    record::sort_requests(&mut requests);
    let path = args.out.join(record::REQUESTS_CSV);
    sample::write_csv(&path, &requests)?;
    let path = args.out.join(record::HISTOGRAMS_CSV);
    sample::write_csv(&path, &histograms)?;
    let path = args.out.join(cpu::CPU_CSV);
    sample::write_csv(&path, &cpu_rows)?;
    let path = args.out.join(record::RUN_CSV);
    sample::write_csv(&path, &settings)?;
    let report = summarize(&args.out)?;
    eprintln!(
        "overhead: {} requests in {:.0} s; results in {}",
        requests.len(),
        started.elapsed().as_secs_f64(),
        args.out.display()
    );
    measured.map(|()| report)
}

/// Reads the CSV files in `dir` and (re)writes `dir/overhead.md`.
pub fn summarize(dir: &Path) -> Result<Report, BenchError> {
    let requests: Vec<RequestRow> = sample::read_csv(&dir.join(record::REQUESTS_CSV))?;
    let histograms: Vec<HistogramRow> = sample::read_csv(&dir.join(record::HISTOGRAMS_CSV))?;
    let settings: Vec<RunRow> = sample::read_csv(&dir.join(record::RUN_CSV))?;
    // Runs from before CPU was recorded have no CPU file.
    let cpu_path = dir.join(cpu::CPU_CSV);
    let cpu_rows: Vec<cpu::CpuRow> = if cpu_path.exists() {
        sample::read_csv(&cpu_path)?
    } else {
        Vec::new()
    };
    let mut report = report::compute(&requests, &histograms, &settings);
    report.cpu = cpu::compute(&requests, &cpu_rows);
    let path = dir.join(record::MARKDOWN);
    std::fs::write(&path, report.to_markdown()).map_err(|e| BenchError::io(&path, e))?;
    Ok(report)
}

/// Where a run's rows go as they come.
struct Rows<'a> {
    requests: &'a mut Vec<RequestRow>,
    histograms: &'a mut Vec<HistogramRow>,
    cpu: &'a mut Vec<cpu::CpuRow>,
}

/// The warm-up, then one phase per rate; rows are appended as they come.
fn measure(
    args: &Args,
    [kvroute, baseline]: [&Stack; 2],
    targets: &[Target],
    agent: &ureq::Agent,
    prompts: &Prompts,
    out: &mut Rows<'_>,
) -> Result<(), BenchError> {
    let envoy_pids = (kvroute.envoy().pid(), baseline.envoy().pid());
    // Filter decisions Envoy should have recorded so far.
    let mut decided = 0u64;
    for seq in 0..args.warmup {
        let body = prompts.body(0, seq);
        for target in targets {
            let row = load::send(agent, target, 0.0, seq, &body);
            decided += u64::from(!row.decision.is_empty());
        }
    }
    let mut envoy_before = histogram::envoy_snapshot(kvroute, decided)?;
    let mut indexd_before = indexd_snapshot(kvroute)?;
    for (phase, &rate) in args.rates.iter().enumerate() {
        let jobs = load::schedule(rate, args.secs, targets.len());
        let n = load::per_profile(rate, args.secs);
        let phase = phase as u64 + 1;
        let bodies: Vec<_> = (0..n).map(|seq| prompts.body(phase, seq)).collect();
        let cpu_before = cpu::snapshot(envoy_pids.0, envoy_pids.1);
        let began = Instant::now();
        let mut rows = load::run(agent, targets, rate, &jobs, &bodies, args.senders);
        let took = began.elapsed();
        let cpu_after = cpu::snapshot(envoy_pids.0, envoy_pids.1);
        out.cpu.extend(cpu::rows(
            rate,
            &cpu_before,
            &cpu_after,
            u64::try_from(took.as_millis()).unwrap_or(u64::MAX),
        ));
        decided += rows.iter().filter(|r| !r.decision.is_empty()).count() as u64;
        let errors = rows.iter().filter(|r| !r.ok()).count();
        out.requests.append(&mut rows);
        let envoy_after = histogram::envoy_snapshot(kvroute, decided)?;
        let indexd_after = indexd_snapshot(kvroute)?;
        for name in [
            histogram::FILTER_DURATION,
            histogram::TOKENIZER_DURATION,
            histogram::INDEX_DURATION,
        ] {
            let after = envoy_after.get(name).cloned().unwrap_or_default();
            let before = envoy_before.get(name).cloned().unwrap_or_default();
            out.histograms.extend(report::histogram_rows(
                rate,
                "envoy",
                name,
                &after.since(&before),
            ));
        }
        out.histograms.extend(report::histogram_rows(
            rate,
            "indexd",
            PICK_LATENCY,
            &indexd_after.since(&indexd_before),
        ));
        eprintln!(
            "overhead: {rate}/s: {} requests per profile in {:.1} s, {errors} errors",
            n,
            took.as_secs_f64()
        );
        envoy_before = envoy_after;
        indexd_before = indexd_after;
    }
    Ok(())
}

/// indexd's Pick histogram from its `/metrics`.
fn indexd_snapshot(stack: &Stack) -> Result<Hist, BenchError> {
    let Some(addr) = stack.indexd_http() else {
        return Ok(Hist::default());
    };
    let url = format!("http://{addr}/metrics");
    let text = http::get(&url, &[], ADMIN_TIMEOUT)?.body;
    histogram::parse_prometheus_seconds(&text, PICK_LATENCY).ok_or_else(|| {
        BenchError::Harness(HarnessError::Unexpected {
            context: url,
            message: format!("no {PICK_LATENCY} histogram"),
        })
    })
}

/// The settings `overhead.md` quotes.
fn settings(args: &Args, options: &StackOptions) -> Vec<RunRow> {
    crate::record::settings([
        ("secs", args.secs.to_string()),
        ("senders", args.senders.to_string()),
        ("warmup", args.warmup.to_string()),
        ("seed", args.seed.to_string()),
        ("tokenize_at", args.tokenize_at.label().to_owned()),
        ("replicas", options.replicas.to_string()),
        ("block_size", options.block_size.to_string()),
        ("time_scale", options.time_scale.to_string()),
        ("system_words", load::SYSTEM_WORDS.to_string()),
        ("user_words", load::USER_WORDS.to_string()),
        ("max_tokens", load::MAX_TOKENS.to_string()),
        ("max_lag_ms", load::MAX_LAG.as_millis().to_string()),
        (
            "request_timeout_ms",
            REQUEST_TIMEOUT.as_millis().to_string(),
        ),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::histogram::{Bin, FILTER_DURATION, INDEX_DURATION, TOKENIZER_DURATION};

    /// A small synthetic run: summarize-overhead must give the same
    /// overhead.md twice, and the figures must be the ones the rows imply.
    #[test]
    fn summarize_recomputes_the_markdown_from_the_csv_files() {
        let dir = tempfile::tempdir().unwrap();
        let mut requests = Vec::new();
        for rate in [10.0, 50.0] {
            for seq in 0..5u32 {
                for (profile, base, decision) in
                    [(BASELINE, 1_000, ""), (KVROUTE, 1_600, "precise")]
                {
                    requests.push(RequestRow {
                        profile: profile.into(),
                        rate,
                        seq,
                        start_ms: f64::from(seq) * 1_000.0 / rate,
                        lag_us: 20,
                        latency_us: base + u64::from(seq) * 100,
                        status: 200,
                        error: String::new(),
                        decision: decision.into(),
                        prompt_tokens: 1_545,
                    });
                }
            }
        }
        requests[0].status = 503;
        requests[0].error = "HTTP 503: no healthy upstream".into();
        let mut histograms = Vec::new();
        for rate in [10.0, 50.0] {
            let bins = |lower: f64| {
                Hist::new(
                    vec![Bin {
                        lower,
                        width: 10.0,
                        count: 5,
                    }],
                    None,
                )
            };
            histograms.extend(report::histogram_rows(
                rate,
                "envoy",
                FILTER_DURATION,
                &bins(500.0),
            ));
            histograms.extend(report::histogram_rows(
                rate,
                "envoy",
                TOKENIZER_DURATION,
                &bins(200.0),
            ));
            histograms.extend(report::histogram_rows(
                rate,
                "envoy",
                INDEX_DURATION,
                &bins(150.0),
            ));
            let pick = Hist::new(
                vec![Bin {
                    lower: 25.0,
                    width: 25.0,
                    count: 5,
                }],
                Some(160.0),
            );
            histograms.extend(report::histogram_rows(rate, "indexd", PICK_LATENCY, &pick));
        }
        let args = Args {
            rates: vec![10.0, 50.0],
            secs: 0.5,
            senders: 4,
            warmup: 0,
            seed: 1,
            tokenize_at: TokenizeAt::Indexd,
            out: dir.path().to_owned(),
        };
        let settings = settings(&args, &StackOptions::default());
        sample::write_csv(&dir.path().join(record::REQUESTS_CSV), &requests).unwrap();
        sample::write_csv(&dir.path().join(record::HISTOGRAMS_CSV), &histograms).unwrap();
        sample::write_csv(&dir.path().join(record::RUN_CSV), &settings).unwrap();

        let report = summarize(dir.path()).unwrap();
        let md_path = dir.path().join(record::MARKDOWN);
        let first = std::fs::read_to_string(&md_path).unwrap();
        std::fs::write(&md_path, "stale").unwrap();
        summarize(dir.path()).unwrap();
        assert_eq!(std::fs::read_to_string(&md_path).unwrap(), first);
        assert_eq!(first, report.to_markdown());

        let r10 = &report.rates[0];
        // Baseline at 10/s: seq 0 failed; 1100..1400 → p50 1250. kvroute: 1600..2000 → 1800.
        assert_eq!((r10.baseline.requests, r10.baseline.errors), (5, 1));
        assert_eq!(r10.added_p50(), 550.0);
        assert_eq!(report.rates[1].added_p50(), 600.0);
        assert_eq!(r10.index.unwrap().p50, 155.0);
        assert_eq!(r10.pick.unwrap().mean, 32.0);
        assert!(first.contains("| 50 | 600 | 600 | 600 ± "), "{first}");
        // 155 / 600 ≈ 26%.
        assert!(first.contains("| 26% |"), "{first}");
        assert!(first.contains("precise 5"), "{first}");
    }

    #[test]
    fn flags_are_checked_before_anything_starts() {
        let args = Args {
            rates: vec![10.0, -1.0],
            secs: 1.0,
            senders: 4,
            warmup: 0,
            seed: 1,
            tokenize_at: TokenizeAt::Indexd,
            out: PathBuf::from("/nonexistent/overhead"),
        };
        match run(&args) {
            Err(BenchError::Harness(HarnessError::Unexpected { context, message })) => {
                assert_eq!(context, "overhead flags");
                assert_eq!(message, "--rates must be positive: [10.0, -1.0]");
            }
            Err(other) => panic!("not the --rates check: {other}"),
            Ok(_) => panic!("--rates 10,-1 was accepted"),
        }
    }
}
