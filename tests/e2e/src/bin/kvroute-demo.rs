//! `make run`: the whole path on loopback. Starts mock vLLM replicas, indexd
//! and Envoy with the kvroute filter, drives a multi-turn agentic workload
//! through Envoy once with Envoy's least-request alone and once with
//! kvroute, prints what each achieved, and stops everything.
//! `make up` (`--up`) keeps a kvroute stack running until Ctrl-C instead.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use kvroute_e2e::workload::{self, Shape, Summary};
use kvroute_e2e::{Routing, Stack, StackOptions};

#[derive(Debug, Parser)]
#[command(
    name = "kvroute-demo",
    about = "kvroute end to end on loopback: least-request vs kvroute"
)]
struct Args {
    /// Mock vLLM replicas behind Envoy.
    #[arg(long, default_value_t = 4)]
    replicas: usize,
    /// Conversations in the workload.
    #[arg(long, default_value_t = 24)]
    conversations: usize,
    /// Turns per conversation.
    #[arg(long, default_value_t = 6)]
    turns: usize,
    /// Conversations in flight at once.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Words per new user message (tool results are three times longer).
    #[arg(long, default_value_t = 120)]
    words: usize,
    /// The mock's latency model speed (1.0 = GPU-calibrated real time).
    #[arg(long, default_value_t = 0.5)]
    time_scale: f64,
    /// vLLM block size.
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// Start a kvroute stack and keep it running until Ctrl-C.
    #[arg(long)]
    up: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let result = if args.up { up(&args) } else { demo(&args) };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvroute-demo: {e}");
            ExitCode::FAILURE
        }
    }
}

fn options(args: &Args, routing: Routing) -> StackOptions {
    StackOptions {
        replicas: args.replicas,
        block_size: args.block_size,
        time_scale: args.time_scale,
        routing,
        ..StackOptions::default()
    }
}

fn demo(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let shape = Shape {
        conversations: args.conversations,
        turns: args.turns,
        concurrency: args.concurrency,
        words_per_turn: args.words,
    };
    println!(
        "kvroute demo: {} mock vLLM replicas (block size {}), {} conversations x {} turns, {} at a time",
        args.replicas, args.block_size, args.conversations, args.turns, args.concurrency
    );
    let mut rows: Vec<(&str, Summary, Duration)> = Vec::new();
    for (name, routing) in [
        ("least-request", Routing::LeastRequest),
        ("kvroute", Routing::Precise),
    ] {
        let started = Instant::now();
        let stack = Stack::start(options(args, routing))?;
        println!("\n[{name}] Envoy admin {} ", stack.envoy().admin_url());
        if let Some(http) = stack.indexd_http() {
            println!("[{name}] indexd metrics http://{http}/metrics");
        }
        let total = shape.conversations * shape.turns;
        let terminal = std::io::stdout().is_terminal();
        let last_tenth = std::sync::atomic::AtomicUsize::new(usize::MAX);
        let samples = workload::run(&stack, shape, &|done| {
            if terminal {
                print!("\r[{name}] {} {done}/{total} requests", bar(done, total));
                let _ = std::io::stdout().flush();
            } else {
                // A log or CI: one line per tenth of the run.
                let tenth = done * 10 / total.max(1);
                if last_tenth.swap(tenth, std::sync::atomic::Ordering::Relaxed) != tenth {
                    println!("[{name}] {done}/{total} requests");
                }
            }
        })?;
        if terminal {
            println!();
        }
        rows.push((name, workload::summarize(&samples), started.elapsed()));
    }

    println!(
        "\n| profile | requests | errors | warm returns | cache hit (continuations) | mean latency | p50 latency |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for (name, s, _) in &rows {
        println!(
            "| {name} | {} | {} | {}/{} ({:.0}%) | {:.1}% | {:.0} ms | {:.0} ms |",
            s.requests,
            s.errors,
            s.warm_returns,
            s.continuations,
            100.0 * s.warm_returns as f64 / s.continuations.max(1) as f64,
            s.hit_percent(),
            s.mean_latency.as_secs_f64() * 1000.0,
            s.p50_latency.as_secs_f64() * 1000.0,
        );
    }
    println!(
        "\nWarm return: a continuation served by the replica that served the conversation's previous turn.\n\
         Cache hit: prompt tokens vLLM (the mock) served from its prefix cache, from each response's usage.\n\
         `make up` keeps a kvroute stack running to curl; docs/demo.md explains the figures."
    );
    Ok(())
}

fn up(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let stack = Stack::start(options(args, Routing::Precise))?;
    let url = stack.url()?;
    println!(
        "kvroute is up: {} mock replicas {:?}",
        args.replicas,
        stack.replica_addresses()
    );
    println!(
        "  inference:      {url}  (model \"{}\")",
        stack.options().model
    );
    println!(
        "  Envoy admin:    {}/stats/prometheus",
        stack.envoy().admin_url()
    );
    if let Some(http) = stack.indexd_http() {
        println!("  indexd metrics: http://{http}/metrics");
    }
    println!(
        "\n  curl -si {url}/v1/chat/completions -H 'content-type: application/json' \\\n    \
         -d '{{\"model\":\"{}\",\"messages\":[{{\"role\":\"user\",\"content\":\"hello\"}}]}}'\n\n\
         The x-kvroute-decision and x-mock-vllm-replica response headers show the routing. Ctrl-C stops.",
        stack.options().model
    );
    stack.block_on(async {
        let _ = tokio::signal::ctrl_c().await;
    });
    println!("stopping");
    Ok(())
}

/// A 20-cell progress bar: `[#######             ]`.
fn bar(done: usize, total: usize) -> String {
    let filled = (done * 20 / total.max(1)).min(20);
    format!("[{}{}]", "#".repeat(filled), " ".repeat(20 - filled))
}
