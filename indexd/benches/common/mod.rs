//! What the indexd benches that run the real binary share: starting it,
//! its memory and CPU time from /proc, a child process killed on drop, and
//! quantiles.

// Each bench uses part of this.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

/// A `/proc/<pid>/status` field given in kB (`VmRSS:`, `VmHWM:`), in MiB;
/// 0 when unreadable.
pub fn status_mib(pid: u32, field: &str) -> f64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|rest| rest.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(0.0, |kib| kib / 1024.0)
}

/// The process's user + system CPU time (in the kernel's 10 ms ticks).
pub fn cpu_time(pid: u32) -> Duration {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command's closing parenthesis; utime and stime are
    // the 14th and 15th of the whole line.
    let rest = text.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0)
        + f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0);
    // USER_HZ is 100 on Linux.
    Duration::from_millis(ticks * 10)
}

/// A child process, killed (and reaped) on drop: a bench that fails half
/// way leaves no indexd running.
pub struct Child(pub std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// indexd started as `binary --config config --print-addresses`, its log
/// (at `warn`) to `log`: the child, its pid, and the gRPC and HTTP
/// addresses it printed (as printed: `ip:port`, or `unix:PATH` for gRPC).
pub fn spawn_indexd(
    binary: &Path,
    config: &Path,
    log: &Path,
) -> Result<(Child, u32, String, String), String> {
    let log = std::fs::File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
    let mut child = Command::new(binary)
        .args([
            "--config".as_ref(),
            config.as_os_str(),
            "--print-addresses".as_ref(),
        ])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .map_err(|e| format!("{}: {e}", binary.display()))?;
    let pid = child.id();
    let stdout = child.stdout.take().ok_or("no stdout")?;
    // Killed on drop from here: an early return leaves no indexd running.
    let child = Child(child);
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .map_err(|e| e.to_string())?;
    let addrs: serde_json::Value =
        serde_json::from_str(&line).map_err(|e| format!("{line:?}: {e}"))?;
    let field = |name: &str| addrs[name].as_str().unwrap_or_default().to_owned();
    Ok((child, pid, field("grpc"), field("http")))
}

/// The `q` quantile of sorted `v` (nearest rank); `None` when empty.
pub fn quantile<T: Copy>(v: &[T], q: f64) -> Option<T> {
    if v.is_empty() {
        return None;
    }
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v.get(rank - 1).copied()
}
