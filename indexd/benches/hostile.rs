//! Hostile bodies (not CI): the real `indexd` binary as a child process with
//! a local tokenizer (its gate opened by an in-process replica stand-in that
//! tokenizes with the same tokenizer), then:
//!
//! 1. **One body at a time**: a 64k-item Responses body, an 8 MB single-word
//!    chat, 8 MB of tools: how long each Pick takes and what it answers.
//! 2. **Abandoned**: each of those given up by its caller after 300 ms, its
//!    work under way; indexd's CPU time over the next 100 ms and the next
//!    second after the caller left.
//! 3. **Flood**: `--hostile-concurrency` (16) such bodies kept in flight,
//!    each abandoned after `--abandon-after` (550 ms: the filter's tokenizer
//!    plus index timeouts; a slot sends its next body no sooner than that
//!    after its last, as a client whose request went on unrouted waits for
//!    its answer), while ordinary chat Picks run at `--ordinary-rate` on a
//!    connection of their own; the ordinary Picks' latency (p50, p99, max) and
//!    decisions, against the same ordinary stream alone first, and indexd's
//!    peak RSS over its idle size.
//!
//! Fails when the flood's peak RSS passes idle + 1 GiB or an ordinary Pick
//! is not answered. Report: `<out>/hostile.md`.
//!
//! ```sh
//! make bench-hostile
//! cargo bench -p indexd --bench hostile --profile perf -- --hostile --out /tmp/hostile
//! ```

// A benchmark binary: setup may fail loudly.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use clap::Parser;
use kvroute_proto::v1::index_client::IndexClient;
use kvroute_proto::v1::{Api, DecisionKind, Mode, PickRequest};
use kvroute_tokenizer::{LoadOptions, ResponsesRequest, TokenizeRequest, Tokenizer};
use serde_json::json;
use tonic::transport::Channel;

use common::{Child, cpu_time, status_mib};

const MODEL: &str = "tiny";

#[derive(Debug, Parser)]
#[command(
    about = "indexd under hostile request bodies: time, CPU and memory per body, and ordinary Picks beside them",
    // HOSTILE_ARGS may repeat the Makefile's --out: the last one wins.
    args_override_self = true
)]
struct Args {
    /// Run (without it, nothing happens).
    #[arg(long)]
    hostile: bool,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
    /// The tokenizer directory ($KVROUTE_VLLM_MODEL, else
    /// ~/.cache/kvroute/tiny-llama).
    #[arg(long)]
    model_dir: Option<PathBuf>,
    /// The context length indexd's tokenizer is given (`max_model_len`):
    /// its caps grow with it. The default is a long-context model's, the
    /// most lenient caps (the test model's own is 16,384).
    #[arg(long, default_value_t = 131_072)]
    max_model_len: u32,
    /// indexd's `tokenize.large_body_nice` (0: large bodies at indexd's
    /// own CPU priority).
    #[arg(long, default_value_t = 10)]
    large_body_nice: i32,
    /// Send the flood to a second indexd instead (a control: the ordinary
    /// Picks' tail that is left is the machine's, not indexd's).
    #[arg(long)]
    flood_elsewhere: bool,
    /// Bytes of each hostile body.
    #[arg(long, default_value_t = 8 << 20)]
    body_bytes: usize,
    /// Hostile bodies in flight during the flood.
    #[arg(long, default_value_t = 16)]
    hostile_concurrency: usize,
    /// A hostile Pick's caller gives up after this long.
    #[arg(long, default_value = "550ms", value_parser = duration)]
    abandon_after: Duration,
    /// Ordinary Picks per second.
    #[arg(long, default_value_t = 50.0)]
    ordinary_rate: f64,
    /// How long the ordinary stream runs, alone and then under the flood.
    #[arg(long, default_value = "20s", value_parser = duration)]
    duration: Duration,
    /// The indexd binary (default: this build's).
    #[arg(long)]
    indexd: Option<PathBuf>,
    /// Where the report goes.
    #[arg(long, default_value = "indexd/results-hostile")]
    out: PathBuf,
}

fn duration(s: &str) -> Result<Duration, String> {
    indexd::config::parse_duration(s)
        .ok_or_else(|| format!("{s:?} is not a duration (e.g. 550ms, 20s)"))
}

fn main() -> ExitCode {
    let args = Args::parse();
    if !args.hostile {
        return ExitCode::SUCCESS;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    match rt.block_on(run(args)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("hostile: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The replica stand-in: `/tokenize` and `/v1/responses/render` by the same
/// tokenizer, so that indexd's gate opens.
async fn stand_in(tokenizer: Arc<Tokenizer>) -> std::net::SocketAddr {
    async fn tokenize(State(t): State<Arc<Tokenizer>>, body: Bytes) -> (StatusCode, String) {
        match TokenizeRequest::from_json(&body).and_then(|r| t.tokenize(&r)) {
            Ok(a) => (StatusCode::OK, serde_json::to_string(&a).unwrap()),
            Err(e) => (
                StatusCode::BAD_REQUEST,
                json!({"error": {"message": e.to_string(), "code": 400}}).to_string(),
            ),
        }
    }
    async fn render(State(t): State<Arc<Tokenizer>>, body: Bytes) -> (StatusCode, String) {
        match ResponsesRequest::from_json(&body).and_then(|r| t.render_responses(&r)) {
            Ok(a) => (StatusCode::OK, serde_json::to_string(&a).unwrap()),
            Err(e) => (
                StatusCode::BAD_REQUEST,
                json!({"error": {"message": e.to_string(), "code": 400}}).to_string(),
            ),
        }
    }
    let app = Router::new()
        .route("/tokenize", post(tokenize))
        .route("/v1/responses/render", post(render))
        .with_state(tokenizer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// The hostile bodies, each about `bytes` long.
fn hostile_bodies(bytes: usize) -> Vec<(&'static str, Api, Vec<u8>)> {
    let word = "a".repeat(bytes);
    let single_word = json!({"model": MODEL, "messages": [{"role": "user", "content": word}]});
    let tool = |i: usize| {
        json!({"type": "function", "function": {"name": format!("tool_{i}"), "description": "d".repeat(64),
            "parameters": {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "array", "items": {"type": "object", "properties": {"c": {"type": "string", "description": "x".repeat(64)}}}}}}}}}})
    };
    let one = tool(0).to_string().len();
    let tools: Vec<_> = (0..bytes / one).map(tool).collect();
    let deep_tools =
        json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": tools});
    let item = |i: usize| json!({"type": "function_call", "call_id": format!("c{i}"), "name": "f", "arguments": "{}"});
    let per = item(0).to_string().len() + 1;
    let mut input: Vec<serde_json::Value> = vec![json!({"role": "user", "content": "go"})];
    input.extend((0..bytes / per).map(item));
    let items = json!({"model": MODEL, "input": input});
    vec![
        (
            "single word chat",
            Api::Chat,
            single_word.to_string().into_bytes(),
        ),
        ("tools", Api::Chat, deep_tools.to_string().into_bytes()),
        (
            "Responses items",
            Api::Responses,
            items.to_string().into_bytes(),
        ),
    ]
}

/// The 64k-item Responses body of the issue's measurement.
fn items_64k() -> Vec<u8> {
    let mut input: Vec<serde_json::Value> = vec![json!({"role": "user", "content": "go"})];
    input.extend((0..65_536).map(|i| {
        json!({"type": "function_call", "call_id": format!("c{i}"), "name": "f", "arguments": "{}"})
    }));
    json!({"model": MODEL, "input": input})
        .to_string()
        .into_bytes()
}

fn ordinary(i: u64) -> Vec<u8> {
    let system = "You are a careful coding agent. Follow the repository's conventions. ".repeat(40);
    json!({"model": MODEL, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": format!("Request {i}: summarise the change and list the files it touches.")},
    ]})
    .to_string()
    .into_bytes()
}

fn pick(api: Api, body: Vec<u8>) -> PickRequest {
    PickRequest {
        model: MODEL.into(),
        block_size: 16,
        mode: Mode::Precise.into(),
        request_id: "r".into(),
        body: body.into(),
        api: api.into(),
        ..PickRequest::default()
    }
}

fn decision_label(d: i32) -> &'static str {
    match DecisionKind::try_from(d) {
        Ok(DecisionKind::Untokenized) => "untokenized",
        Ok(DecisionKind::Stale) => "stale",
        Ok(DecisionKind::Precise) => "precise",
        Ok(DecisionKind::Load) => "load",
        Ok(DecisionKind::Affinity) => "affinity",
        Ok(DecisionKind::Approximate) => "approximate",
        _ => "other",
    }
}

/// One Pick: its time and its decision (or the error).
async fn timed(client: &mut IndexClient<Channel>, req: PickRequest) -> (Duration, String) {
    let started = Instant::now();
    let answer = client.pick(req).await;
    let took = started.elapsed();
    match answer {
        Ok(a) => {
            let a = a.into_inner();
            let mut d = decision_label(a.decision).to_owned();
            if !a.reason.is_empty() {
                let _ = write!(d, " ({})", a.reason.chars().take(90).collect::<String>());
            }
            (took, d)
        }
        Err(s) => (took, format!("error {:?}", s.code())),
    }
}

fn quantile(sorted: &[Duration], q: f64) -> Duration {
    common::quantile(sorted, q).unwrap_or_default()
}

fn ms(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64() * 1e3)
}

/// Ordinary Picks at `rate` for `length`: their latencies and how many were
/// not answered with a decision.
async fn ordinary_stream(
    mut client: IndexClient<Channel>,
    rate: f64,
    length: Duration,
) -> (Vec<Duration>, usize) {
    let every = Duration::from_secs_f64(1.0 / rate.max(0.1));
    let mut tick = tokio::time::interval(every);
    let end = Instant::now() + length;
    let (mut lat, mut failed, mut i) = (Vec::new(), 0usize, 0u64);
    while Instant::now() < end {
        tick.tick().await;
        i += 1;
        let (took, d) = timed(&mut client, pick(Api::Chat, ordinary(i))).await;
        if d.starts_with("error") || d.starts_with("untokenized") {
            failed += 1;
        }
        lat.push(took);
    }
    lat.sort_unstable();
    (lat, failed)
}

#[allow(clippy::too_many_lines)]
async fn run(args: Args) -> Result<bool, String> {
    std::fs::create_dir_all(&args.out).map_err(|e| format!("{}: {e}", args.out.display()))?;
    let dir = args
        .model_dir
        .clone()
        .or_else(|| std::env::var_os("KVROUTE_VLLM_MODEL").map(PathBuf::from))
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/kvroute/tiny-llama")
        });
    let tokenizer = Arc::new(
        Tokenizer::load(&dir, MODEL, LoadOptions::default())
            .map_err(|e| format!("{}: {e}", dir.display()))?,
    );
    let replica = stand_in(tokenizer).await;
    let binary = args
        .indexd
        .clone()
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_indexd")));
    let config = args.out.join("hostile-indexd.yaml");
    std::fs::write(
        &config,
        format!(
            "grpc_listen: 127.0.0.1:0\nhttp_listen: 127.0.0.1:0\nblock_size: 16\nendpoints:\n  - {{address: '{replica}', model: {MODEL}}}\ntokenize:\n  tokenizers:\n    - {{model: {MODEL}, dir: '{}', max_model_len: {}}}\n  shadow_per_second: 0\n  large_body_nice: {}\n",
            dir.display(),
            args.max_model_len,
            args.large_body_nice
        ),
    )
    .map_err(|e| e.to_string())?;
    let (child, pid, grpc, http) = spawn_indexd(&binary, &config, &args.out.join("indexd.log"))?;
    wait_for_gate(&http).await?;
    // The control: the flood goes to a second indexd, so that what is left
    // of the ordinary Picks' tail is the machine's (the clients, the
    // kernel's loopback), not the indexd they ask.
    let elsewhere = if args.flood_elsewhere {
        let (other, _, other_grpc, other_http) =
            spawn_indexd(&binary, &config, &args.out.join("indexd-flooded.log"))?;
        wait_for_gate(&other_http).await?;
        Some((other, other_grpc))
    } else {
        None
    };
    let grpc_for_flood = elsewhere
        .as_ref()
        .map_or_else(|| grpc.clone(), |(_, g)| g.clone());
    let client = IndexClient::connect(grpc.clone())
        .await
        .map_err(|e| e.to_string())?;
    // The ordinary Picks' own connection (Envoy's workers each have one).
    let ordinary_client = IndexClient::connect(grpc)
        .await
        .map_err(|e| e.to_string())?;
    let idle = status_mib(pid, "VmRSS:");
    let mut report = format!(
        "# indexd under hostile bodies\n\n`{}` (release build) with a local tokenizer ({}, max_model_len {}: its caps), its gate open, large bodies at nice {}; {} CPUs. Idle RSS {idle:.0} MiB.{}\n\n",
        // Names, not this machine's paths.
        binary.file_name().unwrap_or_default().to_string_lossy(),
        dir.file_name().unwrap_or_default().to_string_lossy(),
        args.max_model_len,
        args.large_body_nice,
        std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
        if args.flood_elsewhere {
            " **Control run**: the flood of the last part goes to a second indexd, not to the one the ordinary Picks ask (its RSS is not the one shown)."
        } else {
            ""
        }
    );

    // 1. One at a time.
    let mut bodies = hostile_bodies(args.body_bytes);
    bodies.push(("Responses, 65,536 items", Api::Responses, items_64k()));
    report.push_str("## One body at a time\n\n| body | bytes | Pick time (ms) | answer | RSS after (MiB) |\n|---|---:|---:|---|---:|\n");
    for (name, api, body) in &bodies {
        let mut c = client.clone();
        let (took, d) = timed(&mut c, pick(*api, body.clone())).await;
        let _ = writeln!(
            report,
            "| {name} | {} | {} | {d} | {:.0} |",
            body.len(),
            ms(took),
            status_mib(pid, "VmRSS:")
        );
    }

    // 2. Abandoned.
    report.push_str("\n## Abandoned after 300 ms\n\nindexd's CPU time after the caller left (its work should stop; /proc counts 10 ms ticks).\n\n| body | CPU in the next 100 ms (ms) | CPU in the next 1 s (ms) |\n|---|---:|---:|\n");
    for (name, api, body) in &bodies {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut c = client.clone();
        let req = pick(*api, body.clone());
        let _ = tokio::time::timeout(Duration::from_millis(300), c.pick(req)).await;
        let left = cpu_time(pid);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let after_100 = cpu_time(pid);
        tokio::time::sleep(Duration::from_millis(900)).await;
        let after_1s = cpu_time(pid);
        let _ = writeln!(
            report,
            "| {name} | {} | {} |",
            ms(after_100.saturating_sub(left)),
            ms(after_1s.saturating_sub(left))
        );
    }

    // 3. Ordinary alone, then under the flood.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (alone, alone_failed) =
        ordinary_stream(ordinary_client.clone(), args.ordinary_rate, args.duration).await;
    let base = status_mib(pid, "VmRSS:");
    let stop = Arc::new(AtomicBool::new(false));
    let mut floods = Vec::new();
    let outcomes = Arc::new(std::sync::Mutex::new(std::collections::BTreeMap::<
        String,
        u64,
    >::new()));
    // The hostile clients run on a runtime of their own: encoding 8 MB
    // messages must not delay the ordinary stream's client, only indexd.
    let flood_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    // Its own connection too, made there, so that its I/O runs there.
    let grpc_addr = grpc_for_flood;
    let flood_client = flood_rt
        .spawn(async move { IndexClient::connect(grpc_addr).await })
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    for k in 0..args.hostile_concurrency {
        let (_, api, body) = bodies[k % 3].clone();
        let mut c = flood_client.clone();
        let stop = stop.clone();
        let outcomes = outcomes.clone();
        let abandon = args.abandon_after;
        floods.push(flood_rt.spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let sent = tokio::time::Instant::now();
                let outcome =
                    match tokio::time::timeout(abandon, c.pick(pick(api, body.clone()))).await {
                        Err(_) => "abandoned".to_owned(),
                        Ok(Ok(a)) => decision_label(a.into_inner().decision).to_owned(),
                        Ok(Err(s)) => format!("error {:?}", s.code()),
                    };
                *outcomes.lock().unwrap().entry(outcome).or_default() += 1;
                tokio::time::sleep_until(sent + abandon).await;
            }
        }));
    }
    let sampling = stop.clone();
    let sampler = tokio::spawn(async move {
        let mut peak: f64 = 0.0;
        while !sampling.load(Ordering::Relaxed) {
            peak = peak.max(status_mib(pid, "VmRSS:"));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        peak
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (cpu_before, own_before) = (cpu_time(pid), cpu_time(std::process::id()));
    let (flooded, flooded_failed) =
        ordinary_stream(ordinary_client.clone(), args.ordinary_rate, args.duration).await;
    let (indexd_cpu, own_cpu) = (
        cpu_time(pid).saturating_sub(cpu_before),
        cpu_time(std::process::id()).saturating_sub(own_before),
    );
    stop.store(true, Ordering::Relaxed);
    for f in floods {
        let _ = f.await;
    }
    drop(flood_client);
    flood_rt.shutdown_background();
    let peak = sampler.await.unwrap_or(0.0);
    let metrics = reqwest::get(format!("{http}/metrics"))
        .await
        .map_err(|e| e.to_string())?
        .text()
        .await
        .map_err(|e| e.to_string())?;
    let refused: Vec<&str> = metrics
        .lines()
        .filter(|l| {
            l.starts_with("indexd_tokenize_refused_total{")
                || l.starts_with("indexd_tokenize_cancelled_total{")
        })
        .collect();
    let _ = write!(
        report,
        "\n## Ordinary Picks beside {} hostile bodies in flight\n\n{} ordinary chat Picks a second (a ~700-token system prompt and a new question each) for {:?}, alone and then while {} hostile bodies ({} bytes each, the three kinds in turn) are kept in flight, each abandoned after {:?}.\n\n| | Picks | not tokenized | p50 (ms) | p99 (ms) | max (ms) |\n|---|---:|---:|---:|---:|---:|\n| alone | {} | {alone_failed} | {} | {} | {} |\n| beside the flood | {} | {flooded_failed} | {} | {} | {} |\n\nRSS: idle {idle:.0} MiB, before the flood {base:.0} MiB, peak during it {peak:.0} MiB ({:+.0} MiB over idle).\n\nCPU during the flood's {:?}: indexd {:.1} s, this bench (both clients) {:.1} s, of {} CPUs.\n\nHostile Picks: {:?}\n\n```\n{}\n```\n",
        args.hostile_concurrency,
        args.ordinary_rate,
        args.duration,
        args.hostile_concurrency,
        args.body_bytes,
        args.abandon_after,
        alone.len(),
        ms(quantile(&alone, 0.5)),
        ms(quantile(&alone, 0.99)),
        ms(alone.last().copied().unwrap_or_default()),
        flooded.len(),
        ms(quantile(&flooded, 0.5)),
        ms(quantile(&flooded, 0.99)),
        ms(flooded.last().copied().unwrap_or_default()),
        peak - idle,
        args.duration,
        indexd_cpu.as_secs_f64(),
        own_cpu.as_secs_f64(),
        std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
        outcomes.lock().unwrap(),
        refused.join("\n"),
    );
    drop(child);
    let path = args.out.join("hostile.md");
    std::fs::write(&path, &report).map_err(|e| e.to_string())?;
    println!("{report}");
    let ok = peak - idle <= 1024.0 && flooded_failed == 0;
    if !ok {
        eprintln!(
            "hostile: FAILED (peak {peak:.0} MiB over idle {idle:.0} MiB, {flooded_failed} ordinary Picks not tokenized)"
        );
    }
    Ok(ok)
}

/// [`common::spawn_indexd`], its addresses as URLs.
fn spawn_indexd(
    binary: &std::path::Path,
    config: &std::path::Path,
    log: &std::path::Path,
) -> Result<(Child, u32, String, String), String> {
    let (child, pid, grpc, http) = common::spawn_indexd(binary, config, log)?;
    Ok((
        child,
        pid,
        format!("http://{grpc}"),
        format!("http://{http}"),
    ))
}

async fn wait_for_gate(http: &str) -> Result<(), String> {
    let want = format!("indexd_tokenizer_gate{{model=\"{MODEL}\"}} 1");
    for _ in 0..300 {
        if let Ok(r) = reqwest::get(format!("{http}/metrics")).await
            && let Ok(page) = r.text().await
            && page.contains(&want)
        {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err("the tokenizer gate did not open within 30 s".to_owned())
}
