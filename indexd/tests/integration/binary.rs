//! The indexd binary and its flags: the addresses it prints and serves on,
//! transparent huge pages turned off unless `MIMALLOC_ALLOW_THP` says
//! otherwise, and the request path kept off the `--ingest-cpus`.

use std::net::SocketAddr;
use std::time::Duration;

use indexd::config::HttpUrl;
use kvroute_proto::v1::index_client::IndexClient;
use kvroute_proto::v1::{DecisionKind, PickRequest};

use crate::harness::start_binary;
#[cfg(target_os = "linux")]
use crate::harness::{TIMEOUT, start_binary_with};

/// `THP_enabled` of a process (Linux ≥ 5.0): 0 once it disabled transparent
/// huge pages for itself.
#[cfg(target_os = "linux")]
fn thp_enabled(pid: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("THP_enabled:"))
        .unwrap_or_else(|| panic!("no THP_enabled in /proc/{pid}/status"))
        .trim()
        .to_owned()
}

/// The daemon turns transparent huge pages off for itself (they cost RSS per
/// index entry and bought no speed: BENCHMARKS.md); with `MIMALLOC_ALLOW_THP`
/// set it leaves them as it found them.
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_runs_without_huge_pages_unless_told() {
    let ours = thp_enabled("self");
    let args = [
        "--grpc-listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
    ];
    for (env, want) in [(&[][..], "0"), (&[("MIMALLOC_ALLOW_THP", "1")][..], &*ours)] {
        let (mut child, _) = start_binary_with(&args, env).await;
        let pid = child.id().unwrap().to_string();
        assert_eq!(thp_enabled(&pid), want, "env {env:?}");
        child.kill().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_prints_its_addresses_and_serves() {
    let (mut child, v) = start_binary(&[
        "--grpc-listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
        "--endpoint",
        "{address: 127.0.0.1:18060, model: m}",
    ])
    .await;
    let http = v["http"].as_str().unwrap();
    let grpc: SocketAddr = v["grpc"].as_str().unwrap().parse().unwrap();
    assert_ne!(grpc.port(), 0);
    let url = HttpUrl::parse(&format!("http://{http}/healthz")).unwrap();
    assert_eq!(
        indexd::load::get(
            &indexd::load::client().unwrap(),
            &url,
            Duration::from_secs(5)
        )
        .await
        .unwrap(),
        b"ok\n"
    );
    let mut client = IndexClient::connect(format!("http://{grpc}"))
        .await
        .unwrap();
    let r = client
        .pick(PickRequest {
            model: "m".into(),
            block_keys: vec![1],
            block_size: 64,
            key_scheme: kvroute_proto::SCHEME_VERSION.into(),
            ..PickRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.decision, DecisionKind::Load as i32);
    assert_eq!(r.candidates[0].address, "127.0.0.1:18060");
    child.kill().await.unwrap();

    let help = std::process::Command::new(env!("CARGO_BIN_EXE_indexd"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(help.status.success());
    assert!(String::from_utf8_lossy(&help.stdout).contains("--print-addresses"));
}

/// Each thread of `pid` with its name and `Cpus_allowed_list`.
#[cfg(target_os = "linux")]
fn thread_cpus(pid: u32) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
    {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        let status = std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
        let cpus = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .unwrap_or_default();
        out.push((comm.trim().to_owned(), cpus.trim().to_owned()));
    }
    out
}

#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_keeps_its_request_path_off_the_ingest_cpus() {
    let allowed = indexd::cpus::allowed().unwrap();
    if allowed.len() < 2 {
        eprintln!("skipped: needs two CPUs, this process has {allowed}");
        return;
    }
    let ingest = allowed.cpus().last().unwrap().to_string();
    let rest = allowed
        .without(&ingest.parse().unwrap())
        .unwrap()
        .to_string();
    let (mut child, _) = start_binary(&[
        "--grpc-listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
        "--ingest-cpus",
        &ingest,
        "--endpoint",
        "{address: 127.0.0.1:18061, model: m, events: 'tcp://127.0.0.1:9'}",
    ])
    .await;
    // Threads pin themselves as they start: give them a moment.
    let pid = child.id().unwrap();
    let placed = |threads: &[(String, String)]| {
        let ingest_threads = threads
            .iter()
            .filter(|(name, _)| name.starts_with("indexd-ingest"))
            .count();
        ingest_threads == 1
            && threads.iter().all(|(name, cpus)| {
                let want = if name.starts_with("indexd-ingest") {
                    &ingest
                } else {
                    &rest
                };
                cpus == want
            })
    };
    let deadline = std::time::Instant::now() + TIMEOUT;
    let mut threads = thread_cpus(pid);
    while !placed(&threads) && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        threads = thread_cpus(pid);
    }
    assert!(
        placed(&threads),
        "one ingest worker on CPU {ingest}, every other thread on {rest}: {threads:?}"
    );
    child.kill().await.unwrap();

    // A CPU the process may not use is refused, with the reason.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_indexd"))
        .args([
            "--grpc-listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
        ])
        .args(["--ingest-cpus", &allowed.to_string()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("leave at least one"), "{stderr}");
}
