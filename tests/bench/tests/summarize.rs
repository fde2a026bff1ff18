//! A real (smoke-scale) run through Envoy, then `kvroute-bench summarize` on
//! its samples.csv alone: every derived file must come out byte for byte.
//! Needs the built filter and Envoy, as the e2e tests do (`make wasm`).

#![allow(clippy::unwrap_used)] // helpers outside #[test] fns unwrap too

use std::path::Path;
use std::process::Command;
use std::sync::Mutex;

/// One bench run at a time: each starts Envoys, indexd and replicas, and two
/// at once on 2 cores can push the filter's tokenizer and Pick calls past their
/// timeouts (the request then falls back to least-request and a pair is split).
static RUNS: Mutex<()> = Mutex::new(());

fn bench(args: &[&str]) {
    let _one_at_a_time = RUNS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let out = Command::new(env!("CARGO_BIN_EXE_kvroute-bench"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kvroute-bench {args:?}: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn derived(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().is_some_and(|n| n != "samples.csv"))
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect();
    files.sort();
    files
}

#[test]
fn summarize_reproduces_the_run_exactly() {
    let run = tempfile::tempdir().unwrap();
    let again = tempfile::tempdir().unwrap();
    let run_dir = run.path().to_str().unwrap();
    bench(&[
        "run",
        "--scale",
        "smoke",
        "--workload",
        "w1",
        "--profile",
        "least-request,precise",
        "--time-scale",
        "0",
        "--out",
        run_dir,
    ]);
    let csv = run.path().join("samples.csv");
    let samples = kvroute_bench::sample::read_csv::<kvroute_bench::Sample>(&csv).unwrap();
    // Smoke W1: 3 pairs per API, two profiles.
    assert_eq!(samples.len(), 2 * 2 * 6);
    assert!(samples.iter().all(|s| s.ok()), "{samples:#?}");
    let precise: Vec<_> = samples
        .iter()
        .filter(|s| s.profile == "kvroute-precise" && s.turn == 1)
        .collect();
    assert!(precise.iter().all(|s| s.warm_return()), "{precise:#?}");
    assert!(
        precise
            .iter()
            .all(|s| s.cached_tokens == s.oracle_cached_tokens && s.cached_tokens > 0)
    );

    bench(&[
        "summarize",
        csv.to_str().unwrap(),
        "--out",
        again.path().to_str().unwrap(),
    ]);
    let first = derived(run.path());
    let second = derived(again.path());
    let names: Vec<&str> = first.iter().map(|(n, _)| n.as_str()).collect();
    assert!(names.contains(&"summary.json") && names.contains(&"summary.md"));
    assert!(
        names.contains(&"latency_cdf_w1-chat.svg") && names.contains(&"hit_ratio_w1-responses.svg")
    );
    assert_eq!(first, second, "summarize must reproduce every derived file");
    let json = std::fs::read_to_string(run.path().join("summary.json")).unwrap();
    assert_eq!(json, kvroute_bench::summarize(&samples).to_json().unwrap());
}

#[test]
fn gateways_and_faults_keep_every_request_answered() {
    let run = tempfile::tempdir().unwrap();
    bench(&[
        "run",
        "--scale",
        "smoke",
        "--workload",
        "w4,w5",
        "--profile",
        "least-request,precise",
        "--time-scale",
        "0",
        "--out",
        run.path().to_str().unwrap(),
    ]);
    let samples =
        kvroute_bench::sample::read_csv::<kvroute_bench::Sample>(&run.path().join("samples.csv"))
            .unwrap();
    assert!(samples.iter().all(|s| s.ok()), "{samples:#?}");
    // The mock ran exactly what was sent: Envoy and the filter rewrite nothing.
    assert!(samples.iter().all(|s| s.intact == "yes"), "{samples:#?}");
    for profile in ["least-request", "kvroute-precise"] {
        let w4: Vec<_> = samples
            .iter()
            .filter(|s| s.workload == "w4" && s.profile == profile)
            .collect();
        let gateways: std::collections::BTreeSet<u32> = w4.iter().map(|s| s.gateway).collect();
        assert_eq!(gateways.len(), 3, "{profile}: {gateways:?}");
        let phases: Vec<&str> = samples
            .iter()
            .filter(|s| s.workload == "w5" && s.profile == profile)
            .map(|s| s.phase.as_str())
            .fold(Vec::new(), |mut seen, p| {
                if !seen.contains(&p) {
                    seen.push(p);
                }
                seen
            });
        for fault in [
            "replica-restart",
            "event-delay",
            "lost-batches",
            "indexd-restart",
        ] {
            assert!(phases.contains(&fault), "{profile}: {phases:?}");
        }
    }
    let summary = std::fs::read_to_string(run.path().join("summary.md")).unwrap();
    assert!(summary.contains("### w5 by fault phase"), "{summary}");
}
