//! CPU time of the harness's named runtime threads that have exited.
//!
//! A tokio runtime's blocking threads (and the threads `block_in_place`
//! hands a worker's core to) exit after idling, and `/proc/self/task` then
//! forgets them and their CPU time. Runtimes built with a thread label
//! ([`crate::stack::StackOptions::thread_label`]) record each thread's CPU
//! time as it stops, so that a reading of live threads plus
//! [`exited_cpu_ns`] counts all their work.
//!
//! A thread's CPU time is read from `/proc/thread-self/schedstat` (the
//! scheduler's own sum, in ns) where the kernel has it: `utime + stime`
//! come in 10 ms ticks, and a thread that worked 9 ms would count as 0.
//!
//! A thread read in the instant between its stop hook and its end is counted
//! twice (live and exited): the window is the thread's last instructions.

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};

/// The kernel's `USER_HZ`: the unit of `utime` and `stime` (100 on every
/// Linux architecture this runs on; `sysconf(_SC_CLK_TCK)` reports it).
pub const TICKS_PER_SEC: u64 = 100;

/// Exited threads' CPU time in ns, by thread name.
static EXITED: Mutex<BTreeMap<String, u64>> = Mutex::new(BTreeMap::new());

/// Adds the calling thread's CPU time to `name`'s exited total: call it
/// as the thread stops (tokio's `on_thread_stop`).
pub fn record_exit(name: &str) {
    let Some(ns) = this_thread_cpu_ns() else {
        return;
    };
    let mut exited = EXITED.lock().unwrap_or_else(PoisonError::into_inner);
    *exited.entry(name.to_owned()).or_default() += ns;
}

/// CPU time (ns) of every recorded thread that has exited, by thread name.
pub fn exited_cpu_ns() -> BTreeMap<String, u64> {
    EXITED
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone()
}

/// CPU time the calling thread has used so far, in ns.
pub fn this_thread_cpu_ns() -> Option<u64> {
    task_cpu_ns(std::path::Path::new("/proc/thread-self"))
}

/// CPU time the calling thread has used so far, in ms.
pub fn this_thread_cpu_ms() -> Option<u64> {
    this_thread_cpu_ns().map(|ns| ns / 1_000_000)
}

/// CPU time (ns) of the task whose `/proc` directory is `dir` (a thread's:
/// `/proc/<pid>/task/<tid>`): its `schedstat`, else its `stat`'s ticks.
pub fn task_cpu_ns(dir: &std::path::Path) -> Option<u64> {
    if let Ok(text) = std::fs::read_to_string(dir.join("schedstat"))
        && let Some(ns) = schedstat_ns(&text)
    {
        return Some(ns);
    }
    let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
    stat_cpu_ms(&stat).map(|ms| ms * 1_000_000)
}

/// The time on CPU (ns) of a `schedstat` line: its first field.
pub fn schedstat_ns(text: &str) -> Option<u64> {
    text.split_whitespace().next()?.parse().ok()
}

/// `utime + stime` of a `/proc/<pid>/stat` (or task stat) line, in ms.
pub fn stat_cpu_ms(stat: &str) -> Option<u64> {
    // `pid (comm) state ppid …`: comm may hold spaces and parentheses; after
    // it, utime and stime are the 12th and 13th fields.
    let after = stat.rsplit_once(')')?.1;
    let mut fields = after.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some((utime + stime) * 1_000 / TICKS_PER_SEC)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stopped_runtime_thread_keeps_its_cpu_time() {
        let name = "threads-test-burn";
        let before = exited_cpu_ns().get(name).copied().unwrap_or(0);
        std::thread::spawn(move || {
            // Burn until this thread's own clock passes 30 ms (bounded).
            let start = std::time::Instant::now();
            while this_thread_cpu_ms().unwrap_or(0) < 30
                && start.elapsed() < std::time::Duration::from_secs(10)
            {
                std::hint::black_box((0..1_000u64).sum::<u64>());
            }
            record_exit(name);
        })
        .join()
        .unwrap();
        let after = exited_cpu_ns().get(name).copied().unwrap_or(0);
        assert!(after >= before + 30_000_000, "{before} → {after}");
    }

    #[test]
    fn schedstat_and_stat_read() {
        assert_eq!(schedstat_ns("1659931 0 1\n"), Some(1_659_931));
        assert_eq!(schedstat_ns(""), None);
        assert_eq!(schedstat_ns("x 1 2"), None);
        assert!(this_thread_cpu_ns().is_some());
    }
}
