//! What the indexd benches that run the real binary share: its memory and
//! CPU time from /proc, a child process killed on drop, and quantiles.

// Each bench uses part of this.
#![allow(dead_code)]

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

/// The `q` quantile of sorted `v` (nearest rank); `None` when empty.
pub fn quantile<T: Copy>(v: &[T], q: f64) -> Option<T> {
    if v.is_empty() {
        return None;
    }
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v.get(rank - 1).copied()
}
