//! Load and soak (not CI): the real `indexd` binary as a child process, an
//! event flood from many simulated replicas (real ZMTP over TCP, at the rate
//! indexd decodes), and a steady stream of Picks; indexd's RSS (from
//! `/proc/<pid>/status`) and Pick latency (p50/p99 per window, at the client
//! and inside indexd) sampled throughout, then one window of Picks with the
//! flood stopped (the round trip's floor). Fails when the peak RSS passes
//! its budget or a window's p99 inside indexd passes 1 ms. With two or more
//! CPUs, indexd's ingest runtime and the flood run on the last CPU and the
//! request path and the Picks on the others (`--ingest-cpus`). Report:
//! `<out>/soak-indexd.{csv,md}`.
//!
//! ```sh
//! make soak-indexd                                   # 10 minutes
//! cargo bench -p indexd --bench soak --profile perf -- --soak --duration 60s --out /tmp/soak
//! ```
//!
//! Without `--soak` it does nothing (so a plain `cargo bench` does not start
//! a 10-minute run).

// A benchmark binary: setup may fail loudly.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;
#[path = "soak/flood.rs"]
mod flood;
#[path = "soak/report.rs"]
mod report;

use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use indexd::HttpUrl;
use indexd::config::parse_duration;
use kvroute_proto::keys::{BlockSize, block_keys};
use kvroute_proto::v1::index_client::IndexClient;
use kvroute_proto::v1::{Mode, PickRequest};
use tokio::net::TcpListener;

use common::status_mib;
use flood::{Counters, Progress};
use report::{Setup, Window};

#[derive(Debug, Parser)]
#[command(about = "indexd under an event flood: RSS and Pick latency over time")]
struct Args {
    /// Run (without it, nothing happens).
    #[arg(long)]
    soak: bool,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
    /// How long the flood lasts (e.g. 60s, 10m).
    #[arg(long, default_value = "10m", value_parser = duration)]
    duration: Duration,
    /// Sampling window.
    #[arg(long, default_value = "10s", value_parser = duration)]
    window: Duration,
    /// Simulated replicas (one ZMTP publisher each).
    #[arg(long, default_value_t = 64)]
    replicas: usize,
    /// Each replica also offloads every other prompt to the CPU tier (and
    /// evicts it from there).
    #[arg(long)]
    tier_moves: bool,
    /// Each replica restarts (AllBlocksCleared) after this many prompts (0:
    /// never).
    #[arg(long, default_value_t = 0)]
    restart_every: u64,
    /// Prompts per second per replica (0: as fast as indexd reads).
    #[arg(long, default_value_t = 0.0)]
    prompts_per_second: f64,
    /// Picks per second.
    #[arg(long, default_value_t = 200)]
    pick_rate: u32,
    /// indexd's `max_index_entries`.
    #[arg(long, default_value_t = 1_000_000)]
    max_index_entries: usize,
    /// How much nicer the flood's thread runs than the Picks (it stands for
    /// remote replicas; 0 lets it compete with indexd for the CPUs).
    #[arg(long, default_value_t = 10)]
    flood_nice: i32,
    /// indexd's `ingest_nice`.
    #[arg(long, default_value_t = 0)]
    ingest_nice: u8,
    /// indexd's `ingest_cpus` (a cpuset list or `last[:N]`), where the flood
    /// runs too (it stands for other machines; here it has to take some
    /// CPU), the Picks' client on the other CPUs; `auto`: the last CPU when
    /// there are two or more; `none`: no placement, the scheduler mixes
    /// everything.
    #[arg(long, default_value = "auto")]
    ingest_cpus: String,
    /// The RSS budget in MiB (default: derived from `max_index_entries`, see
    /// the report).
    #[arg(long)]
    rss_budget_mib: Option<f64>,
    /// The Pick p99 budget per window inside indexd, in µs.
    #[arg(long, default_value_t = 1000.0)]
    p99_budget_us: f64,
    /// Where the report goes.
    #[arg(long, default_value = "indexd/results-soak")]
    out: PathBuf,
    /// The indexd binary (default: the one cargo built with this bench).
    #[arg(long)]
    indexd: Option<PathBuf>,
    /// Also snapshot the index (`<out>/index.snap`, every 30 s and at the
    /// end) and report the writes' size and duration under the flood.
    #[arg(long)]
    snapshot: bool,
    /// How Picks reach indexd: its default for the node-local case, a Unix
    /// socket (in a temporary directory), or loopback TCP.
    #[arg(long, value_enum, default_value_t = Transport::Unix)]
    transport: Transport,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Transport {
    Unix,
    Tcp,
}

/// Makes the calling thread `by` steps nicer (Linux: per thread); 20 puts
/// it in `SCHED_IDLE` instead (it runs only on CPUs nothing else wants, and
/// the scheduler counts those CPUs as idle when it places a waking thread).
fn nicer(by: i32) {
    use rustix::process::{getpriority_process, setpriority_process};
    let tid = rustix::thread::gettid();
    if by >= 20 {
        let status = Command::new("chrt")
            .args(["--idle", "-p", "0", &tid.as_raw_nonzero().to_string()])
            .status();
        if !status.as_ref().is_ok_and(|s| s.success()) {
            eprintln!("soak: chrt --idle failed for the flood's thread: {status:?}");
        }
        return;
    }
    if let Ok(now) = getpriority_process(Some(tid)) {
        let _ = setpriority_process(Some(tid), (now + by).min(19));
    }
}

fn duration(s: &str) -> Result<Duration, String> {
    parse_duration(s).ok_or_else(|| format!("{s:?} is not a duration (e.g. 60s, 10m)"))
}

/// Bytes of RSS per index entry the budget allows. Without churn an entry
/// costs about 60 B (BENCHMARKS.md: a 40-byte slab entry and a 5-byte slot
/// in each of two tables at half load); at the bound, with entries evicted
/// and added all the time, each table can settle at up to four slots per
/// entry (a table doubles to clear its tombstones once it is half full):
/// 40 + 2 × 4 × 5 = 80 B, plus the groups and spilled holder lists of keys
/// several replicas hold and the slab's free chunks: 100 B.
const BYTES_PER_ENTRY: f64 = 100.0;
/// The process without its index: runtime, 64 connections' read buffers,
/// metrics, allocator slack.
const BASE_MIB: f64 = 64.0;

/// `name` (with its labels) from a Prometheus page, summed over series.
fn metric(page: &str, name: &str) -> f64 {
    page.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter(|l| {
            l.get(name.len()..)
                .is_some_and(|r| r.starts_with(' ') || r.starts_with('{'))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// `(le, cumulative count)` of indexd's Pick latency histogram.
fn pick_buckets(page: &str) -> Vec<(f64, f64)> {
    page.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("indexd_pick_latency_seconds_bucket{le=\"")?;
            let (le, count) = rest.split_once("\"} ")?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, count.parse().ok()?))
        })
        .collect()
}

/// The bucket bound holding 99% of the picks between two scrapes, µs.
fn server_p99(before: &[(f64, f64)], after: &[(f64, f64)]) -> f64 {
    let total = after.last().map_or(0.0, |b| b.1) - before.last().map_or(0.0, |b| b.1);
    if total <= 0.0 {
        return 0.0;
    }
    for (i, (le, n)) in after.iter().enumerate() {
        let prev = before.get(i).map_or(0.0, |b| b.1);
        if n - prev >= 0.99 * total {
            return le * 1e6;
        }
    }
    f64::INFINITY
}

async fn scrape(http: &HttpUrl) -> String {
    let client = indexd::load::client().unwrap();
    let body = indexd::load::get(&client, http, Duration::from_secs(5))
        .await
        .unwrap_or_default();
    String::from_utf8_lossy(&body).into_owned()
}

/// Picks at `rate` until `stop`, pushing each latency (µs) into `sink`.
fn picker(
    grpc: String,
    rate: u32,
    replicas: usize,
    progress: Vec<Arc<Progress>>,
    sink: Arc<Mutex<Vec<u32>>>,
    stop: Arc<AtomicBool>,
    cpus: Option<indexd::cpus::CpuList>,
) {
    if let Some(cpus) = &cpus {
        indexd::cpus::pin_current_thread(cpus).unwrap();
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let mut client = IndexClient::connect(grpc).await.unwrap();
        let bs = BlockSize::new(flood::BLOCK).unwrap();
        let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / f64::from(rate)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut n = 0u64;
        while !stop.load(Ordering::Relaxed) {
            tick.tick().await;
            n += 1;
            // A recent prompt of some replica: system prefix plus its own.
            let r = (n * 7919) % replicas as u64;
            let done = progress[r as usize].prompts.load(Ordering::Relaxed);
            let p = done.saturating_sub(1 + n % 64);
            let tokens: Vec<u32> = (0..flood::FIRST)
                .flat_map(|b| flood::tokens(r, p, b))
                .collect();
            let keys = block_keys(&tokens, bs, None)
                .iter()
                .map(|k| k.as_u64())
                .collect();
            let req = PickRequest {
                model: "m".into(),
                block_keys: keys,
                block_size: flood::BLOCK,
                prompt_tokens: tokens.len() as u32,
                mode: Mode::Precise as i32,
                request_id: format!("soak-{n}"),
                key_scheme: kvroute_proto::SCHEME_VERSION.into(),
                ..PickRequest::default()
            };
            let started = Instant::now();
            let ok = client.pick(req).await.is_ok();
            let us = started.elapsed().as_micros().min(u128::from(u32::MAX)) as u32;
            if ok {
                sink.lock().unwrap().push(us);
            }
        }
    });
}

fn main() -> ExitCode {
    let args = Args::parse();
    if !args.soak {
        eprintln!("soak: skipped (run it with --soak, e.g. `make soak-indexd`)");
        return ExitCode::SUCCESS;
    }
    // The flood stands for replicas on other machines: on a small machine
    // its thread runs nicer, so that it takes what the CPUs have left rather
    // than a share of the time indexd's request path needs.
    let machine = match indexd::cpus::allowed() {
        Ok(m) => m,
        Err(e) => {
            eprintln!("soak: this process's CPUs: {e}");
            return ExitCode::FAILURE;
        }
    };
    let placement = match placement(&args.ingest_cpus, &machine) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("soak: {e}");
            return ExitCode::FAILURE;
        }
    };
    // The flood's threads on the ingest side (the picker moves itself to
    // the other; this thread, which starts indexd, stays where it is).
    let flood_nice = args.flood_nice;
    let flood_cpus = placement.as_ref().map(|p| p.ingest.clone());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .on_thread_start(move || {
            if let Some(cpus) = &flood_cpus {
                indexd::cpus::pin_current_thread(cpus).unwrap();
            }
            nicer(flood_nice);
        })
        .enable_all()
        .build()
        .unwrap();
    match rt.block_on(run(args, placement, machine)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("soak: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `--ingest-cpus` against this process's CPUs.
fn placement(
    text: &str,
    allowed: &indexd::cpus::CpuList,
) -> Result<Option<indexd::cpus::Placement>, String> {
    let ingest: indexd::cpus::CpuSpec = match text {
        "none" => return Ok(None),
        "auto" if allowed.len() < 2 => return Ok(None),
        "auto" => indexd::cpus::CpuSpec::Last(1),
        spec => spec
            .parse()
            .map_err(|e| format!("--ingest-cpus {spec:?}: {e}"))?,
    };
    indexd::cpus::Placement::split(&ingest, allowed).map(Some)
}

async fn run(
    args: Args,
    placement: Option<indexd::cpus::Placement>,
    machine: indexd::cpus::CpuList,
) -> Result<bool, String> {
    std::fs::create_dir_all(&args.out).map_err(|e| format!("{}: {e}", args.out.display()))?;
    let binary = args
        .indexd
        .clone()
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_indexd")));
    let stop = Arc::new(AtomicBool::new(false));
    let flood_stop = Arc::new(AtomicBool::new(false));
    let counters = Arc::new(Counters::default());
    let mut listeners = Vec::new();
    let mut endpoints = String::new();
    for r in 0..args.replicas {
        let l = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| e.to_string())?;
        let port = l.local_addr().map_err(|e| e.to_string())?.port();
        endpoints.push_str(&format!(
            "  - {{address: 127.0.0.2:{}, model: m, events: 'tcp://127.0.0.1:{port}'}}\n",
            20_000 + r
        ));
        listeners.push(l);
    }
    let config = args.out.join("soak-indexd.yaml");
    let socket_dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let grpc_listen = match args.transport {
        Transport::Unix => format!("unix://{}", socket_dir.path().join("indexd.sock").display()),
        Transport::Tcp => "127.0.0.1:0".to_owned(),
    };
    let cpus = placement
        .as_ref()
        .map(|p| format!("ingest_cpus: '{}'\n", p.ingest))
        .unwrap_or_default();
    let snapshot = if args.snapshot {
        format!("snapshot_path: {}\n", args.out.join("index.snap").display())
    } else {
        String::new()
    };
    std::fs::write(
        &config,
        format!(
            "grpc_listen: '{grpc_listen}'\nhttp_listen: 127.0.0.1:0\nblock_size: {}\nmax_index_entries: {}\nspeculative_ttl: 5s\ningest_nice: {}\n{cpus}{snapshot}endpoints:\n{endpoints}",
            flood::BLOCK,
            args.max_index_entries,
            args.ingest_nice
        ),
    )
    .map_err(|e| e.to_string())?;
    let (mut child, pid, grpc, http) =
        common::spawn_indexd(&binary, &config, &args.out.join("indexd.log"))?;
    let grpc = if grpc.starts_with("unix:") {
        grpc.to_owned()
    } else {
        format!("http://{grpc}")
    };
    let http = HttpUrl::parse(&format!("http://{http}/metrics")).ok_or("no http address")?;

    let progress: Vec<Arc<Progress>> = (0..args.replicas).map(|_| Arc::default()).collect();
    let mut floods = Vec::new();
    for (r, l) in listeners.into_iter().enumerate() {
        floods.push(tokio::spawn(flood::publish(
            r as u64,
            l,
            Arc::clone(&flood_stop),
            Arc::clone(&counters),
            Arc::clone(&progress[r]),
            flood::Mix {
                tier_moves: args.tier_moves,
                restart_every: args.restart_every,
                prompts_per_second: args.prompts_per_second,
            },
        )));
    }
    // Every replica subscribed and fresh (bounded wait).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let page = scrape(&http).await;
        if metric(&page, "indexd_replica_fresh") as usize == args.replicas {
            break;
        }
        if Instant::now() > deadline {
            return Err("replicas did not all become fresh within 30 s".into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "soak: {} replicas flooding indexd (pid {pid}) for {:?}",
        args.replicas, args.duration
    );

    let latencies = Arc::new(Mutex::new(Vec::new()));
    let pick_thread = {
        let (grpc, sink, stop, progress) = (
            grpc.clone(),
            Arc::clone(&latencies),
            Arc::clone(&stop),
            progress.clone(),
        );
        let (rate, replicas) = (args.pick_rate, args.replicas);
        let cpus = placement.as_ref().map(|p| p.request.clone());
        std::thread::Builder::new()
            .name("soak-picker".into())
            .spawn(move || picker(grpc, rate, replicas, progress, sink, stop, cpus))
            .map_err(|e| format!("the picker's thread: {e}"))?
    };

    let started = Instant::now();
    let mut windows = Vec::new();
    let mut page = scrape(&http).await;
    let mut last = (
        Instant::now(),
        metric(&page, "indexd_batches_total"),
        metric(&page, "indexd_blocks_total{outcome=\"stored\"}"),
    );
    let mut buckets = pick_buckets(&page);
    // One window's figures from the page scraped at its end.
    let mut measure = |page: &str| {
        let now = Instant::now();
        let secs = now.duration_since(last.0).as_secs_f64().max(1e-9);
        let (batches, blocks) = (
            metric(page, "indexd_batches_total"),
            metric(page, "indexd_blocks_total{outcome=\"stored\"}"),
        );
        let mut lat = std::mem::take(&mut *latencies.lock().unwrap());
        lat.sort_unstable();
        let after = pick_buckets(page);
        let w = Window {
            end_s: started.elapsed().as_secs_f64(),
            rss_mib: status_mib(pid, "VmRSS:"),
            hwm_mib: status_mib(pid, "VmHWM:"),
            entries: metric(page, "indexd_index_entries"),
            index_mib: metric(page, "indexd_index_bytes") / (1 << 20) as f64,
            batches_per_s: (batches - last.1) / secs,
            blocks_per_s: (blocks - last.2) / secs,
            picks: lat.len(),
            p50_us: report::quantile(&lat, 0.5),
            p99_us: report::quantile(&lat, 0.99),
            max_us: lat.last().map_or(0.0, |v| f64::from(*v)),
            server_p99_us: server_p99(&buckets, &after),
            gaps: metric(page, "indexd_seq_gaps_total"),
            decode_errors: metric(page, "indexd_decode_errors_total"),
        };
        eprintln!("{}", w.csv());
        buckets = after;
        last = (now, batches, blocks);
        w
    };
    while started.elapsed() < args.duration {
        let next = (windows.len() as u32 + 1) * args.window;
        tokio::time::sleep(next.saturating_sub(started.elapsed())).await;
        page = scrape(&http).await;
        windows.push(measure(&page));
    }
    // The floor: the same Picks on the same index with the flood stopped.
    flood_stop.store(true, Ordering::Relaxed);
    for f in &floods {
        f.abort();
    }
    // indexd drains what the sockets still buffer (seconds of the flood on
    // loopback) before it is calm; those Picks count in no window.
    let drained = Instant::now() + Duration::from_secs(120);
    let mut applied = metric(&scrape(&http).await, "indexd_batches_total");
    while Instant::now() < drained {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = metric(&scrape(&http).await, "indexd_batches_total");
        if now == applied {
            break;
        }
        applied = now;
    }
    let _ = measure(&scrape(&http).await);
    let calm_from = started.elapsed();
    tokio::time::sleep(args.window).await;
    page = scrape(&http).await;
    let mut calm = measure(&page);
    calm.end_s = calm_from.as_secs_f64() + args.window.as_secs_f64();
    eprintln!("soak: calm window (flood stopped): {}", calm.csv());
    let snapshots = format!(
        "snapshot writes {} (ok {}), last {:.1} MiB in {:.3} s",
        metric(&page, "indexd_snapshot_writes_total"),
        metric(&page, "indexd_snapshot_writes_total{result=\"ok\"}"),
        metric(&page, "indexd_snapshot_bytes") / (1 << 20) as f64,
        metric(&page, "indexd_snapshot_write_seconds"),
    );
    stop.store(true, Ordering::Relaxed);
    let _ = pick_thread.join();
    // A graceful stop, then a hard one.
    let _ = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    let deadline = Instant::now() + Duration::from_secs(15);
    while Instant::now() < deadline && child.0.try_wait().ok().flatten().is_none() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(child);

    let budget = args
        .rss_budget_mib
        .unwrap_or(BASE_MIB + args.max_index_entries as f64 * BYTES_PER_ENTRY / (1 << 20) as f64);
    let offered =
        args.replicas as u64 * (flood::KEPT * (flood::PROMPT - flood::SYSTEM) + flood::SYSTEM);
    let note = format!(
        "- RSS: {budget:.0} MiB = {BASE_MIB:.0} MiB (the process without its index: runtime, {} \
         connections' read buffers, metrics, allocator slack) + `max_index_entries` {} × {BYTES_PER_ENTRY:.0} B \
         (60 B per entry without churn, BENCHMARKS.md; at the bound, entries evicted and added all \
         the time, the two tables settle at up to four slots per entry: 80 B, plus shared keys' \
         groups and the slab's free chunks). The flood offers about {} entries (64 blocks per prompt, \
         {} prompts kept per replica){}.\n\
         - Pick p99: {:.0} µs per window inside indexd (`indexd_pick_latency_seconds`, from the \
         decoded request to the answer: the bucket bound holding 99% of the window's Picks). The \
         client's figure adds the gRPC round trip (both processes' HTTP/2 stacks and wake-ups, on \
         a VM whose idle CPUs halt): reported per window, next to its floor measured in the same \
         run once the flood has stopped and indexd has drained its sockets.",
        args.replicas,
        args.max_index_entries,
        offered,
        flood::KEPT,
        if offered as usize > args.max_index_entries {
            ", past the bound: indexd evicts"
        } else {
            ", within the bound"
        },
        args.p99_budget_us
    );
    let setup = Setup {
        duration_s: args.duration.as_secs_f64(),
        window_s: args.window.as_secs_f64(),
        replicas: args.replicas,
        pick_rate: args.pick_rate,
        max_index_entries: args.max_index_entries,
        rss_budget_mib: budget,
        p99_budget_us: args.p99_budget_us,
        // A name, not this machine's path.
        indexd: format!(
            "target/perf/{}",
            binary.file_name().unwrap_or_default().to_string_lossy()
        ),
        flood_nice: args.flood_nice,
        ingest_nice: args.ingest_nice,
        cpus: machine.len(),
        placement: match &placement {
            Some(p) => format!(
                "indexd's ingest runtime (`ingest_cpus: '{}'`) and the flood on CPU {}, indexd's \
                 request path and the Picks' client on CPU {}",
                p.ingest, p.ingest, p.request
            ),
            None => "no CPU placement: the scheduler places every thread".to_owned(),
        },
        calm,
        mix: format!(
            "64-block prompts (two BlockStored batches), the prompt {} earlier evicted{}{}; {}.",
            flood::KEPT,
            if args.tier_moves {
                format!(
                    ", every other prompt offloaded to the CPU tier {} prompts after it was stored (and evicted from there too)",
                    flood::KEPT / 2
                )
            } else {
                String::new()
            },
            if args.restart_every > 0 {
                format!(
                    ", a restart (AllBlocksCleared) every {} prompts",
                    args.restart_every
                )
            } else {
                String::new()
            },
            if args.prompts_per_second > 0.0 {
                format!("{} prompts/s", args.prompts_per_second)
            } else {
                "as fast as indexd reads".to_owned()
            }
        ),
        transport: match args.transport {
            Transport::Unix => "a Unix socket",
            Transport::Tcp => "loopback TCP",
        },
    };
    let ok = report::write(&args.out, &setup, &windows, &note).map_err(|e| e.to_string())?;
    let (_, summary) = report::verdict(&setup, &windows);
    if args.snapshot {
        eprintln!("{snapshots}");
    }
    eprintln!(
        "{summary}report: {}",
        args.out.join("soak-indexd.md").display()
    );
    Ok(ok)
}
