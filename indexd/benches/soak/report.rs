//! Per-window samples and the report: `soak-indexd.csv` (one row per window)
//! and `soak-indexd.md` (setup, budgets, verdict, the windows).

use std::fmt::Write as _;
use std::path::Path;

/// One window's measurements.
#[derive(Clone, Debug, Default)]
pub struct Window {
    /// Seconds since the flood started, at the window's end.
    pub end_s: f64,
    /// indexd's resident set (VmRSS) and its peak so far (VmHWM), MiB.
    pub rss_mib: f64,
    pub hwm_mib: f64,
    /// `indexd_index_entries` and `indexd_index_bytes` (MiB).
    pub entries: f64,
    pub index_mib: f64,
    /// Batches and blocks indexd applied per second in the window.
    pub batches_per_s: f64,
    pub blocks_per_s: f64,
    /// Picks answered in the window and their latency at the client (gRPC
    /// round trip on loopback), µs.
    pub picks: usize,
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
    /// indexd's own Pick latency (`indexd_pick_latency_seconds`): the bucket
    /// bound under which 99% of the window's picks fall, µs.
    pub server_p99_us: f64,
    /// Seq gaps and decode errors so far.
    pub gaps: f64,
    pub decode_errors: f64,
}

/// The `q` quantile of sorted `v` (nearest rank; 0 when empty).
pub fn quantile(v: &[u32], q: f64) -> f64 {
    super::common::quantile(v, q).map_or(0.0, f64::from)
}

pub const CSV_HEADER: &str = "phase,end_s,rss_mib,hwm_mib,index_entries,index_mib,batches_per_s,blocks_per_s,picks,pick_p50_us,pick_p99_us,pick_max_us,server_p99_us,seq_gaps,decode_errors";

impl Window {
    pub fn csv(&self) -> String {
        format!(
            "{:.1},{:.1},{:.1},{:.0},{:.1},{:.0},{:.0},{},{:.0},{:.0},{:.0},{:.0},{:.0},{:.0}",
            self.end_s,
            self.rss_mib,
            self.hwm_mib,
            self.entries,
            self.index_mib,
            self.batches_per_s,
            self.blocks_per_s,
            self.picks,
            self.p50_us,
            self.p99_us,
            self.max_us,
            self.server_p99_us,
            self.gaps,
            self.decode_errors
        )
    }
}

/// What the run was and what it had to stay under.
#[derive(Debug)]
pub struct Setup {
    pub duration_s: f64,
    pub window_s: f64,
    pub replicas: usize,
    pub pick_rate: u32,
    pub max_index_entries: usize,
    pub rss_budget_mib: f64,
    pub p99_budget_us: f64,
    pub indexd: String,
    pub flood_nice: i32,
    pub ingest_nice: u8,
    /// What each replica publishes and how fast, in words.
    pub mix: String,
    /// How Picks reach indexd ("a Unix socket", "loopback TCP").
    pub transport: &'static str,
    /// The machine's CPUs (those the soak may use).
    pub cpus: usize,
    /// Which threads ran where, in words.
    pub placement: String,
    /// The window after the flood stopped: the same Picks on the same index,
    /// nothing ingesting (the round trip's floor on this machine).
    pub calm: Window,
}

/// The verdict: peak RSS, and the worst window's Pick p99 inside indexd
/// (`indexd_pick_latency_seconds`, what indexd does with a Pick), against
/// their budgets; the first window, while the connections come up, is
/// reported but not judged. The client's p99 adds the gRPC round trip,
/// reported next to its floor on the machine (the calm window).
pub fn verdict(setup: &Setup, windows: &[Window]) -> (bool, String) {
    let peak = windows.iter().map(|w| w.hwm_mib).fold(0.0, f64::max);
    let judged = windows.get(1..).unwrap_or_default();
    let worst = judged.iter().map(|w| w.p99_us).fold(0.0, f64::max);
    let worst_server = judged.iter().map(|w| w.server_p99_us).fold(0.0, f64::max);
    let mean_blocks = if windows.is_empty() {
        0.0
    } else {
        windows.iter().map(|w| w.blocks_per_s).sum::<f64>() / windows.len() as f64
    };
    let calm = &setup.calm;
    let rss_ok = peak <= setup.rss_budget_mib;
    let p99_ok = worst_server <= setup.p99_budget_us;
    let text = format!(
        "- peak RSS (VmHWM): **{peak:.0} MiB** of a {:.0} MiB budget: {}\n\
         - worst window Pick p99 inside indexd: **≤ {worst_server:.0} µs** of a {:.0} µs budget: {}\n\
         - worst window Pick p99 at the client: {worst:.0} µs (the gRPC round trip included)\n\
         - the flood stopped (one window, the same Picks on the same index, nothing ingesting): \
         p50 {:.0} µs, p99 {:.0} µs, max {:.0} µs at the client, ≤ {:.0} µs inside indexd: the \
         round trip's floor on this machine\n\
         - mean ingest: {mean_blocks:.0} blocks/s\n",
        setup.rss_budget_mib,
        if rss_ok { "pass" } else { "FAIL" },
        setup.p99_budget_us,
        if p99_ok { "pass" } else { "FAIL" },
        calm.p50_us,
        calm.p99_us,
        calm.max_us,
        calm.server_p99_us,
    );
    (rss_ok && p99_ok, text)
}

/// Writes the CSV and the Markdown report into `out`.
pub fn write(
    out: &Path,
    setup: &Setup,
    windows: &[Window],
    budget_note: &str,
) -> std::io::Result<bool> {
    let mut csv = String::from(CSV_HEADER);
    csv.push('\n');
    for (phase, w) in windows
        .iter()
        .map(|w| ("flood", w))
        .chain([("calm", &setup.calm)])
    {
        csv.push_str(phase);
        csv.push(',');
        csv.push_str(&w.csv());
        csv.push('\n');
    }
    std::fs::write(out.join("soak-indexd.csv"), csv)?;
    let (ok, summary) = verdict(setup, windows);
    let mut md = String::new();
    let _ = writeln!(md, "# indexd soak\n");
    let _ = writeln!(
        md,
        "`make soak-indexd` (`cargo bench -p indexd --bench soak --profile perf -- --soak`): \
         the real `indexd` binary ({}) as a child process with `max_index_entries: {}`, {} \
         simulated replicas publishing KV events over ZMTP (what and how fast: below), and {} \
         Picks/s over gRPC on {}, for {:.0} s in {:.0} s windows, then one window more with \
         the flood stopped. Machine: {} CPUs, shared. Placement: {}. indexd's ingest threads \
         run at `ingest_nice: {}`; the flood's thread (the replicas, which are other machines \
         in a fleet) at nice +{}.\n",
        setup.indexd,
        setup.max_index_entries,
        setup.replicas,
        setup.pick_rate,
        setup.transport,
        setup.duration_s,
        setup.window_s,
        setup.cpus,
        setup.placement,
        setup.ingest_nice,
        setup.flood_nice
    );
    let _ = writeln!(md, "Each replica: {}\n", setup.mix);
    let _ = writeln!(md, "## Budgets\n\n{budget_note}\n");
    let _ = writeln!(
        md,
        "## Result: {}\n\n{summary}",
        if ok { "pass" } else { "FAIL" }
    );
    let _ = writeln!(
        md,
        "## Windows\n\n| end s | RSS MiB | peak MiB | entries | index MiB | batches/s | blocks/s | picks | p50 µs | p99 µs | max µs | indexd p99 µs | gaps | decode errors |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for w in windows {
        let _ = writeln!(md, "| {} |", w.csv().replace(',', " | "));
    }
    let _ = writeln!(md, "| calm: {} |", setup.calm.csv().replace(',', " | "));
    std::fs::write(out.join("soak-indexd.md"), md)?;
    Ok(ok)
}
