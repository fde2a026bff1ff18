//! Real (smoke-scale) runs through Envoy, then the matching `summarize`
//! command on their CSV files alone: every derived file must come out byte
//! for byte. `run` (W1, W4, W5), `soak` (300 requests) and `bodies` (1 MiB
//! bodies). Needs the built filter and Envoy, as the e2e tests do (`make wasm`).

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

/// The files a run derives from its records (`samples.csv` and
/// `indexd.csv`, which `summarize` reads and does not write).
fn derived(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name().is_some_and(|n| {
                n != "samples.csv" && n != kvroute_bench::indexd_metrics::INDEXD_CSV
            })
        })
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
        "least-request,precise,sticky-oracle",
        "--time-scale",
        "0",
        "--out",
        run_dir,
    ]);
    let csv = run.path().join("samples.csv");
    let samples = kvroute_bench::sample::read_csv::<kvroute_bench::Sample>(&csv).unwrap();
    // Smoke W1: 3 pairs per API, three profiles.
    assert_eq!(samples.len(), 2 * 3 * 6);
    // The sticky oracle pins pair c to replica c mod 2, both turns.
    let sticky: Vec<_> = samples
        .iter()
        .filter(|s| s.profile == "sticky-oracle")
        .collect();
    assert!(
        sticky
            .iter()
            .all(|s| s.replica == format!("r{}", s.conversation % 2)),
        "{sticky:#?}"
    );
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
    // Each precise run read its gateway's indexd: the index answered the
    // continuations.
    let indexd: Vec<kvroute_bench::indexd_metrics::IndexdRow> = kvroute_bench::sample::read_csv(
        &run.path().join(kvroute_bench::indexd_metrics::INDEXD_CSV),
    )
    .unwrap();
    assert_eq!(indexd.len(), 2, "one gateway per W1 API: {indexd:#?}");
    assert!(
        indexd
            .iter()
            .all(|r| r.profile == "kvroute-precise" && r.index_entries > 0 && r.indexed_blocks > 0),
        "{indexd:#?}"
    );
    let json = std::fs::read_to_string(run.path().join("summary.json")).unwrap();
    assert_eq!(
        json,
        kvroute_bench::summarize_run(&samples, &indexd)
            .to_json()
            .unwrap()
    );
    let md = std::fs::read_to_string(run.path().join("summary.md")).unwrap();
    assert!(
        md.contains("| vs sticky | by round | hit Δ by round | moves | did not pay |"),
        "{md}"
    );
    assert!(md.contains("### w1-chat: indexd"), "{md}");
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

/// `md` as the run wrote it, and as the summarize `command` rewrites it from the CSV files alone.
fn markdown_after_summarize(dir: &Path, md: &str, command: &str) -> (String, String) {
    let path = dir.join(md);
    let written = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    bench(&[command, dir.to_str().unwrap()]);
    (written, std::fs::read_to_string(&path).unwrap())
}

#[test]
fn soak_loses_nothing_and_summarize_soak_reproduces_it() {
    use kvroute_bench::soak::report::{KindRow, SampleRow};
    let run = tempfile::tempdir().unwrap();
    bench(&[
        "soak",
        "--requests",
        "300",
        "--rate",
        "100",
        "--sample-secs",
        "0.5",
        "--warmup-secs",
        "0.5",
        "--out",
        run.path().to_str().unwrap(),
    ]);
    let kinds: Vec<KindRow> =
        kvroute_bench::sample::read_csv(&run.path().join("soak-kinds.csv")).unwrap();
    assert_eq!(
        kinds.iter().map(|k| k.requests).sum::<u64>(),
        300,
        "{kinds:#?}"
    );
    assert!(kinds.iter().all(|k| k.errors == 0), "{kinds:#?}");
    // The Responses continuations ran, and were picked by their previous turn.
    let next = kinds
        .iter()
        .find(|k| k.kind == "responses-continue")
        .unwrap();
    assert!(
        next.requests > 0 && next.decisions.contains("affinity"),
        "{next:?}"
    );
    let samples: Vec<SampleRow> =
        kvroute_bench::sample::read_csv(&run.path().join("soak.csv")).unwrap();
    assert!(samples.len() >= 2, "{samples:#?}");
    assert!(samples.iter().all(|s| s.envoy_rss_kib.is_some()));
    let last = samples.last().unwrap();
    assert_eq!((last.requests, last.errors), (300, 0));
    assert!(last.wasm_memory_bytes.is_some_and(|b| b > 0), "{last:?}");
    let (written, again) = markdown_after_summarize(run.path(), "soak.md", "summarize-soak");
    assert!(written.contains("Requests lost: **0** of 300"), "{written}");
    assert_eq!(written, again, "summarize-soak must reproduce soak.md");
}

#[test]
fn big_bodies_are_routed_and_summarize_bodies_reproduces_them() {
    use kvroute_bench::bodies::report::{PhaseRow, RequestRow};
    let run = tempfile::tempdir().unwrap();
    bench(&[
        "bodies",
        "--size-bytes",
        "1048576",
        "--small-bytes",
        "0",
        "--repeat",
        "1",
        "--out",
        run.path().to_str().unwrap(),
    ]);
    let requests: Vec<RequestRow> =
        kvroute_bench::sample::read_csv(&run.path().join("bodies.csv")).unwrap();
    // Three APIs, one send each to both stacks.
    assert_eq!(requests.len(), 6, "{requests:#?}");
    assert!(requests.iter().all(RequestRow::ok), "{requests:#?}");
    assert!(requests.iter().all(|r| r.bytes > 1_000_000));
    // Every large body was routed (buffered whole and keyed), not passed as too large.
    for r in requests.iter().filter(|r| r.profile == "kvroute-precise") {
        assert!(["precise", "load"].contains(&r.decision.as_str()), "{r:?}");
    }
    let phases: Vec<PhaseRow> =
        kvroute_bench::sample::read_csv(&run.path().join("bodies-phases.csv")).unwrap();
    assert!(
        phases
            .iter()
            .any(|p| p.metric == "wasm_memory_bytes" && p.after.is_some_and(|b| b > 0)),
        "{phases:#?}"
    );
    let (written, again) = markdown_after_summarize(run.path(), "bodies.md", "summarize-bodies");
    assert_eq!(written, again, "summarize-bodies must reproduce bodies.md");
}
