//! CPU per request, per process, per rate: `/proc` readings taken just
//! before and just after each rate's load (`overhead-cpu.csv`), divided by
//! the requests each profile sent.
//!
//! - Envoy: `utime + stime` of each stack's Envoy process.
//! - In the bench process, by thread name: each stack's tokio runtime
//!   (`kvroute`, `baseline`: the mock replicas, and on the kvroute stack
//!   also their `/tokenize` answers) and indexd's runtime of its own
//!   (`kvroute-indexd`). The rest of the bench process (`/proc/self/stat`
//!   less those threads) is the client: sender threads and the main thread.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::overhead::record::RequestRow;
use crate::procfs::{self, Pid};
use crate::record::{BASELINE, KVROUTE};

/// Per-rate CPU readings.
pub const CPU_CSV: &str = "overhead-cpu.csv";
/// Thread name of the kvroute stack's runtime (its indexd's: `kvroute-indexd`).
pub const KVROUTE_THREADS: &str = "kvroute";
/// Thread name of the baseline stack's runtime.
pub const BASELINE_THREADS: &str = "baseline";
/// indexd's runtime on the kvroute stack.
pub const INDEXD_THREADS: &str = "kvroute-indexd";

/// Envoy's process.
pub const ENVOY: &str = "envoy";
/// indexd's threads.
pub const INDEXD: &str = "indexd";
/// The mock replicas' runtime.
pub const REPLICAS: &str = "replicas";
/// The rest of the bench process: the client.
pub const CLIENT: &str = "client";
/// Rows not of one profile.
pub const BOTH: &str = "both";

/// CPU used by one process (or thread group) during one rate's load.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CpuRow {
    /// The phase's rate (requests/s per profile).
    pub rate: f64,
    /// [`KVROUTE`], [`BASELINE`] or [`BOTH`].
    pub profile: String,
    /// [`ENVOY`], [`INDEXD`], [`REPLICAS`] or [`CLIENT`].
    pub process: String,
    /// CPU time (user + system), ms.
    pub cpu_ms: u64,
    /// Wall time of the phase's load, ms.
    pub wall_ms: u64,
}

/// The readings at one moment (`None`: unreadable).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Snapshot {
    envoy_kvroute: Option<u64>,
    envoy_baseline: Option<u64>,
    indexd: u64,
    replicas_kvroute: u64,
    replicas_baseline: u64,
    bench: Option<u64>,
}

/// Reads everything now.
pub fn snapshot(envoy_kvroute: u32, envoy_baseline: u32) -> Snapshot {
    let threads = procfs::own_threads_cpu_ms(&[KVROUTE_THREADS, BASELINE_THREADS, INDEXD_THREADS]);
    let get = |k: &str| threads.get(k).copied().unwrap_or(0);
    Snapshot {
        envoy_kvroute: procfs::cpu_ms(Pid::Other(envoy_kvroute)),
        envoy_baseline: procfs::cpu_ms(Pid::Other(envoy_baseline)),
        indexd: get(INDEXD_THREADS),
        replicas_kvroute: get(KVROUTE_THREADS),
        replicas_baseline: get(BASELINE_THREADS),
        bench: procfs::cpu_ms(Pid::This),
    }
}

/// The rows of one phase from the readings before and after it.
pub fn rows(rate: f64, before: &Snapshot, after: &Snapshot, wall_ms: u64) -> Vec<CpuRow> {
    let diff = |a: Option<u64>, b: Option<u64>| match (a, b) {
        (Some(a), Some(b)) => Some(a.saturating_sub(b)),
        _ => None,
    };
    let own = after.indexd.saturating_sub(before.indexd)
        + after
            .replicas_kvroute
            .saturating_sub(before.replicas_kvroute)
        + after
            .replicas_baseline
            .saturating_sub(before.replicas_baseline);
    let entries = [
        (
            KVROUTE,
            ENVOY,
            diff(after.envoy_kvroute, before.envoy_kvroute),
        ),
        (
            BASELINE,
            ENVOY,
            diff(after.envoy_baseline, before.envoy_baseline),
        ),
        (
            KVROUTE,
            INDEXD,
            Some(after.indexd.saturating_sub(before.indexd)),
        ),
        (
            KVROUTE,
            REPLICAS,
            Some(
                after
                    .replicas_kvroute
                    .saturating_sub(before.replicas_kvroute),
            ),
        ),
        (
            BASELINE,
            REPLICAS,
            Some(
                after
                    .replicas_baseline
                    .saturating_sub(before.replicas_baseline),
            ),
        ),
        (
            BOTH,
            CLIENT,
            diff(after.bench, before.bench).map(|b| b.saturating_sub(own)),
        ),
    ];
    entries
        .into_iter()
        .filter_map(|(profile, process, cpu)| {
            Some(CpuRow {
                rate,
                profile: profile.to_owned(),
                process: process.to_owned(),
                cpu_ms: cpu?,
                wall_ms,
            })
        })
        .collect()
}

/// CPU-ms per request of one profile at one rate.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CpuFigures {
    /// Requests/s per profile.
    pub rate: f64,
    /// Requests kvroute's stack was sent.
    pub kvroute_sent: usize,
    /// Requests the baseline stack was sent.
    pub baseline_sent: usize,
    /// kvroute's Envoy (filter included), ms per request.
    pub envoy_kvroute: Option<f64>,
    /// Envoy alone, ms per request.
    pub envoy_baseline: Option<f64>,
    /// indexd, ms per kvroute request.
    pub indexd: Option<f64>,
    /// The kvroute stack's replicas (generation, `/tokenize`, KV events).
    pub replicas_kvroute: Option<f64>,
    /// The baseline stack's replicas (generation, KV events).
    pub replicas_baseline: Option<f64>,
    /// The client, ms per request of both profiles.
    pub client: Option<f64>,
    /// Cores busy on average during the load (all sources together).
    pub cores_busy: Option<f64>,
}

impl CpuFigures {
    /// What the filter adds to Envoy, ms per request.
    pub fn envoy_added(&self) -> Option<f64> {
        Some(self.envoy_kvroute? - self.envoy_baseline?)
    }

    /// The kvroute stack's replicas less the baseline's: ≈ the tokenizer.
    pub fn tokenizer(&self) -> Option<f64> {
        Some(self.replicas_kvroute? - self.replicas_baseline?)
    }
}

fn sent(rows: &[RequestRow], rate: f64, profile: &str) -> usize {
    rows.iter()
        .filter(|r| r.rate == rate && r.profile == profile && !r.error.starts_with("not sent"))
        .count()
}

/// Per-rate figures from the request rows and the CPU rows.
pub fn compute(requests: &[RequestRow], cpu: &[CpuRow]) -> Vec<CpuFigures> {
    let mut rates: Vec<f64> = cpu.iter().map(|c| c.rate).collect();
    rates.sort_by(f64::total_cmp);
    rates.dedup();
    rates
        .into_iter()
        .map(|rate| {
            let kvroute_sent = sent(requests, rate, KVROUTE);
            let baseline_sent = sent(requests, rate, BASELINE);
            let per = |profile: &str, process: &str, n: usize| {
                let row = cpu
                    .iter()
                    .find(|c| c.rate == rate && c.profile == profile && c.process == process)?;
                (n > 0).then(|| row.cpu_ms as f64 / n as f64)
            };
            let mine: Vec<&CpuRow> = cpu.iter().filter(|c| c.rate == rate).collect();
            let wall = mine.iter().map(|c| c.wall_ms).max().unwrap_or(0);
            let total: u64 = mine.iter().map(|c| c.cpu_ms).sum();
            CpuFigures {
                rate,
                kvroute_sent,
                baseline_sent,
                envoy_kvroute: per(KVROUTE, ENVOY, kvroute_sent),
                envoy_baseline: per(BASELINE, ENVOY, baseline_sent),
                indexd: per(KVROUTE, INDEXD, kvroute_sent),
                replicas_kvroute: per(KVROUTE, REPLICAS, kvroute_sent),
                replicas_baseline: per(BASELINE, REPLICAS, baseline_sent),
                client: per(BOTH, CLIENT, kvroute_sent + baseline_sent),
                cores_busy: (wall > 0).then(|| total as f64 / wall as f64),
            }
        })
        .collect()
}

fn ms(v: Option<f64>) -> String {
    v.map_or_else(|| "–".to_owned(), |v| format!("{v:.3}"))
}

/// The Markdown section (empty when the run recorded no CPU).
pub fn markdown(figures: &[CpuFigures]) -> String {
    if figures.is_empty() {
        return String::new();
    }
    let mut out = String::from(
        "\n## CPU per request\n\n\
         CPU time (user + system, from `/proc`) used during each rate's load, divided by the \
         requests the profile was sent, in ms per request. Envoy: each stack's Envoy process \
         (2 workers; kvroute's runs the Wasm filter). In the bench process, by thread name: \
         indexd (its own 2-thread runtime), each stack's mock replicas (a 2-thread runtime \
         per stack; on the kvroute stack they also answer the filter's `/tokenize` calls, so \
         the difference of the two replica columns ≈ the tokenizer), and the client (the rest \
         of the bench process: sender threads, per request of both profiles).\n\n\
         | rate/s | sent kvroute / alone | Envoy kvroute ms | Envoy alone ms | Envoy added ms | \
         indexd ms | replicas kvroute ms | replicas alone ms | ≈ tokenizer ms | client ms | \
         cores busy |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for f in figures {
        let _ = writeln!(
            out,
            "| {} | {} / {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            f.rate,
            f.kvroute_sent,
            f.baseline_sent,
            ms(f.envoy_kvroute),
            ms(f.envoy_baseline),
            ms(f.envoy_added()),
            ms(f.indexd),
            ms(f.replicas_kvroute),
            ms(f.replicas_baseline),
            ms(f.tokenizer()),
            ms(f.client),
            f.cores_busy
                .map_or_else(|| "–".to_owned(), |c| format!("{c:.2}")),
        );
    }
    out.push_str(
        "\n- `/proc` counts CPU in 10 ms ticks per thread: at low rates a figure rests on few \
         ticks. `cores busy` is every column's CPU over the load's wall time (the machine's \
         cores are the ceiling).\n",
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(profile: &str, seq: u32, error: &str) -> RequestRow {
        RequestRow {
            profile: profile.into(),
            rate: 10.0,
            seq,
            start_ms: 0.0,
            lag_us: 0,
            latency_us: 1_000,
            status: if error.is_empty() { 200 } else { 0 },
            error: error.into(),
            decision: String::new(),
            prompt_tokens: 10,
        }
    }

    #[test]
    fn per_request_cpu_from_snapshots() {
        let before = Snapshot {
            envoy_kvroute: Some(1_000),
            envoy_baseline: Some(500),
            indexd: 100,
            replicas_kvroute: 200,
            replicas_baseline: 150,
            bench: Some(2_000),
        };
        let after = Snapshot {
            envoy_kvroute: Some(1_400),
            envoy_baseline: Some(700),
            indexd: 140,
            replicas_kvroute: 300,
            replicas_baseline: 210,
            bench: Some(2_400),
        };
        let rows = rows(10.0, &before, &after, 1_000);
        assert_eq!(rows.len(), 6);
        let requests = vec![
            req(KVROUTE, 0, ""),
            req(KVROUTE, 1, ""),
            req(KVROUTE, 2, ""),
            req(KVROUTE, 3, "not sent: 2100 ms behind schedule"),
            req(BASELINE, 0, ""),
            req(BASELINE, 1, "HTTP 503"),
        ];
        let f = compute(&requests, &rows)[0];
        assert_eq!((f.kvroute_sent, f.baseline_sent), (3, 2));
        assert_eq!(f.envoy_kvroute, Some(400.0 / 3.0));
        assert_eq!(f.envoy_baseline, Some(100.0));
        assert_eq!(f.indexd, Some(40.0 / 3.0));
        assert_eq!(f.tokenizer(), Some(100.0 / 3.0 - 30.0));
        // 400 in the bench less 40 + 100 + 60 of the runtimes, over 5 requests.
        assert_eq!(f.client, Some(40.0));
        // 400 + 200 + 400 over 1 s.
        assert_eq!(f.cores_busy, Some(1.0));
        let md = markdown(&[f]);
        assert!(
            md.contains("| 10 | 3 / 2 | 133.333 | 100.000 | 33.333 |"),
            "{md}"
        );
        assert_eq!(markdown(&[]), "");
    }
}
