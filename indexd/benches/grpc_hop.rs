//! The Pick hop over loopback TCP vs indexd's Unix domain socket: two
//! in-process indexd with the same replicas and index, one listening on
//! `127.0.0.1:0`, one on a socket in a temporary directory, and a tonic
//! client per transport issuing Picks one at a time (the filter's pattern:
//! one Pick in flight per request). The transports take turns in rounds so
//! that drift on a shared machine hits both alike. Prints p50, p90, p99,
//! p99.9 and the mean per transport, side by side.
//!
//! ```sh
//! cargo bench -p indexd --bench grpc_hop --profile perf -- --picks 20000 --rounds 5
//! ```

// A benchmark binary: setup may fail loudly.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use clap::Parser;
use indexd::{Config, EndpointConfig, ListenAddr, Server};
use kvroute_proto::keys::{BlockSize, block_keys};
use kvroute_proto::v1::index_client::IndexClient;
use kvroute_proto::v1::{Mode, PickRequest};
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

#[derive(Debug, Parser)]
#[command(about = "Pick latency over loopback TCP vs a Unix domain socket")]
struct Args {
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
    /// Picks measured per transport (split over the rounds).
    #[arg(long, default_value_t = 20_000)]
    picks: usize,
    /// Rounds (each: a batch over TCP, then one over the socket; the order
    /// alternates from round to round).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Unmeasured Picks per transport first.
    #[arg(long, default_value_t = 2_000)]
    warmup: usize,
    /// Replicas registered (no event sources: all fresh and healthy).
    #[arg(long, default_value_t = 8)]
    replicas: u16,
    /// Block keys per Pick.
    #[arg(long, default_value_t = 64)]
    keys: usize,
}

fn config(replicas: u16, grpc: ListenAddr) -> Config {
    let endpoints = (0..replicas)
        .map(|i| EndpointConfig::new(SocketAddr::from(([10, 0, 0, 1], 8000 + i)), "m"))
        .collect();
    let mut c = Config::new(endpoints);
    c.grpc_listen = grpc;
    c.http_listen = SocketAddr::from(([127, 0, 0, 1], 0));
    c.block_size = BlockSize::new(16).unwrap();
    c.seed = Some(1);
    c
}

struct Running {
    client: IndexClient<Channel>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), indexd::StartError>>,
}

async fn start(config: Config) -> Running {
    let bound = Server::bind(config).await.unwrap();
    let uri = bound.grpc_addr().grpc_uri();
    let stop = CancellationToken::new();
    let task = tokio::spawn(bound.serve(stop.clone()));
    let client = IndexClient::connect(uri).await.unwrap();
    Running { client, stop, task }
}

async fn picks(client: &mut IndexClient<Channel>, req: &PickRequest, n: usize, out: &mut Vec<u32>) {
    for _ in 0..n {
        let started = Instant::now();
        let answer = client.pick(req.clone()).await.unwrap().into_inner();
        let ns = started.elapsed().as_nanos();
        assert!(!answer.candidates.is_empty());
        out.push(u32::try_from(ns).unwrap_or(u32::MAX));
    }
}

fn quantile(sorted: &[u32], q: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    f64::from(sorted[i]) / 1000.0
}

fn main() {
    let args = Args::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let socket = ListenAddr::Unix(dir.path().join("indexd.sock"));
    let tcp = ListenAddr::Tcp(SocketAddr::from(([127, 0, 0, 1], 0)));
    let tokens: Vec<u32> = (0..16 * args.keys as u32).collect();
    let req = PickRequest {
        model: "m".into(),
        block_keys: block_keys(&tokens, BlockSize::new(16).unwrap(), None)
            .iter()
            .map(|k| k.as_u64())
            .collect(),
        block_size: 16,
        mode: Mode::Precise as i32,
        prompt_tokens: tokens.len() as u32,
        key_scheme: kvroute_proto::SCHEME_VERSION.into(),
        ..PickRequest::default()
    };
    let per_round = args.picks.div_ceil(args.rounds.max(1));
    let (tcp_ns, uds_ns) = rt.block_on(async {
        let mut over_tcp = start(config(args.replicas, tcp)).await;
        let mut over_uds = start(config(args.replicas, socket)).await;
        let mut scratch = Vec::new();
        picks(&mut over_tcp.client, &req, args.warmup, &mut scratch).await;
        picks(&mut over_uds.client, &req, args.warmup, &mut scratch).await;
        let (mut tcp_ns, mut uds_ns) = (Vec::new(), Vec::new());
        for round in 0..args.rounds.max(1) {
            if round % 2 == 0 {
                picks(&mut over_tcp.client, &req, per_round, &mut tcp_ns).await;
                picks(&mut over_uds.client, &req, per_round, &mut uds_ns).await;
            } else {
                picks(&mut over_uds.client, &req, per_round, &mut uds_ns).await;
                picks(&mut over_tcp.client, &req, per_round, &mut tcp_ns).await;
            }
        }
        for r in [over_tcp, over_uds] {
            r.stop.cancel();
            tokio::time::timeout(Duration::from_secs(10), r.task)
                .await
                .unwrap()
                .unwrap()
                .unwrap();
        }
        (tcp_ns, uds_ns)
    });
    println!(
        "Pick round trip, tonic client -> indexd in one process ({} picks per transport, {} keys, {} replicas, {} rounds)\n",
        tcp_ns.len(),
        args.keys,
        args.replicas,
        args.rounds
    );
    println!("| transport | p50 µs | p90 µs | p99 µs | p99.9 µs | mean µs |");
    println!("|---|---|---|---|---|---|");
    let mut means = Vec::new();
    for (name, mut ns) in [("loopback TCP", tcp_ns), ("Unix socket", uds_ns)] {
        ns.sort_unstable();
        let mean = ns.iter().map(|&v| f64::from(v)).sum::<f64>() / ns.len() as f64 / 1000.0;
        means.push(mean);
        println!(
            "| {name} | {:.1} | {:.1} | {:.1} | {:.1} | {mean:.1} |",
            quantile(&ns, 0.5),
            quantile(&ns, 0.9),
            quantile(&ns, 0.99),
            quantile(&ns, 0.999),
        );
    }
    println!(
        "\nThe socket saves {:.1} µs per Pick on average ({:.0}%).",
        means[0] - means[1],
        100.0 * (means[0] - means[1]) / means[0]
    );
}
