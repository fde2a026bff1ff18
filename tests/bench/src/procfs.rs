//! What `/proc` says about a process: resident memory (`VmRSS` of
//! `/proc/<pid>/status`) and CPU time (`utime + stime` of `/proc/<pid>/stat`,
//! every thread of the process included), and the CPU time of the bench's
//! own threads grouped by thread name (`/proc/self/task/*/stat`), which is
//! how indexd's runtime is told apart from the mock replicas' when both run
//! inside the bench process. Linux only; a reading that fails is `None`.

use std::collections::BTreeMap;

pub use kvroute_e2e::threads::{
    TICKS_PER_SEC, stat_cpu_ms, this_thread_cpu_ms, this_thread_cpu_ns,
};

/// Which process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pid {
    /// The bench process itself.
    This,
    /// Another process (an Envoy).
    Other(u32),
}

impl Pid {
    fn dir(self) -> String {
        match self {
            Self::This => "/proc/self".to_owned(),
            Self::Other(pid) => format!("/proc/{pid}"),
        }
    }
}

/// Resident set size in KiB (`VmRSS`).
pub fn rss_kib(pid: Pid) -> Option<u64> {
    status_kib(pid, "VmRSS:")
}

/// Peak resident set size so far in KiB (`VmHWM`).
pub fn hwm_kib(pid: Pid) -> Option<u64> {
    status_kib(pid, "VmHWM:")
}

fn status_kib(pid: Pid, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("{}/status", pid.dir())).ok()?;
    status_field_kib(&status, field)
}

/// `field` (e.g. `VmRSS:`) of a `/proc/<pid>/status` text, in KiB.
pub fn status_field_kib(status: &str, field: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// CPU time used so far (user + system, every thread), in ms.
pub fn cpu_ms(pid: Pid) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("{}/stat", pid.dir())).ok()?;
    stat_cpu_ms(&stat)
}

/// The thread name (`comm`) of a stat line.
pub fn stat_comm(stat: &str) -> Option<&str> {
    let start = stat.find('(')?;
    let end = stat.rfind(')')?;
    stat.get(start + 1..end)
}

/// CPU time (ms; summed in ns, from `schedstat`) of the bench's threads
/// whose name starts with each of
/// `prefixes` (the longest matching prefix wins): the live ones, and those
/// of the harness's labelled runtimes that have exited
/// ([`kvroute_e2e::threads`]; tokio's blocking threads exit after idling).
pub fn own_threads_cpu_ms(prefixes: &[&str]) -> BTreeMap<String, u64> {
    let mut out: BTreeMap<String, u64> = prefixes.iter().map(|p| ((*p).to_owned(), 0)).collect();
    let mut ns: BTreeMap<&str, u64> = BTreeMap::new();
    let mut add = |name: &str, cpu_ns: u64| {
        let best = prefixes
            .iter()
            .filter(|p| name.starts_with(**p))
            .max_by_key(|p| p.len());
        if let Some(p) = best {
            *ns.entry(*p).or_default() += cpu_ns;
        }
    };
    for (name, cpu_ns) in kvroute_e2e::threads::exited_cpu_ns() {
        add(&name, cpu_ns);
    }
    if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
        for task in tasks.filter_map(Result::ok) {
            let Ok(comm) = std::fs::read_to_string(task.path().join("comm")) else {
                continue;
            };
            if let Some(cpu_ns) = kvroute_e2e::threads::task_cpu_ns(&task.path()) {
                add(comm.trim_end_matches('\n'), cpu_ns);
            }
        }
    }
    for (p, cpu_ns) in ns {
        out.insert(p.to_owned(), cpu_ns / 1_000_000);
    }
    out
}

/// The value of the Prometheus sample `name` (unlabelled, or the first of
/// its label sets) in exposition `text`.
pub fn prometheus_value(text: &str, name: &str) -> Option<f64> {
    samples(text, name).next()
}

/// The sum of every sample of `name` (all its label sets) in `text`.
pub fn prometheus_sum(text: &str, name: &str) -> Option<f64> {
    samples(text, name).reduce(|a, b| a + b)
}

fn samples<'a>(text: &'a str, name: &'a str) -> impl Iterator<Item = f64> + 'a {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(move |l| {
            let rest = l.strip_prefix(name)?;
            let value = match rest.chars().next()? {
                ' ' => rest,
                '{' => rest.split_once('}')?.1,
                _ => return None,
            };
            value.split_whitespace().next()?.parse().ok()
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines_give_cpu_and_name() {
        let line =
            "4242 (tokio-runtime-w) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 30 0 0 20 0 2 0 1 0 0";
        assert_eq!(stat_cpu_ms(line), Some(2_800));
        assert_eq!(stat_comm(line), Some("tokio-runtime-w"));
        let odd = "7 (a) b (c) R 1 7 7 0 -1 0 0 0 0 0 5 5 0 0 20 0 1 0 1 0 0";
        assert_eq!(stat_cpu_ms(odd), Some(100));
        assert_eq!(stat_comm(odd), Some("a) b (c"));
        assert_eq!(stat_cpu_ms("garbage"), None);
    }

    #[test]
    fn status_and_prometheus_fields_parse() {
        let status = "Name:\tenvoy\nVmHWM:\t  90000 kB\nVmRSS:\t   81234 kB\n";
        assert_eq!(status_field_kib(status, "VmRSS:"), Some(81_234));
        assert_eq!(status_field_kib(status, "VmSwap:"), None);
        let text = "# TYPE kvroute_vm_memory_bytes gauge\nkvroute_vm_memory_bytes_x 1\n\
                    kvroute_vm_memory_bytes{} 1245184\nenvoy_server_memory_allocated 5e6\n";
        assert_eq!(
            prometheus_value(text, "kvroute_vm_memory_bytes"),
            Some(1_245_184.0)
        );
        assert_eq!(
            prometheus_value(text, "envoy_server_memory_allocated"),
            Some(5e6)
        );
        assert_eq!(prometheus_value(text, "missing"), None);
        let labelled = "x_total{endpoint=\"a\"} 2\nx_total{endpoint=\"b\"} 3\nx_total_more 9\n";
        assert_eq!(prometheus_sum(labelled, "x_total"), Some(5.0));
        assert_eq!(prometheus_sum(labelled, "y_total"), None);
    }

    #[test]
    fn this_process_is_readable() {
        assert!(rss_kib(Pid::This).is_some_and(|kib| kib > 0));
        assert!(cpu_ms(Pid::This).is_some());
        assert!(this_thread_cpu_ms().is_some());
        let threads = own_threads_cpu_ms(&["", "nothing-named-so"]);
        assert_eq!(threads.get("nothing-named-so"), Some(&0));
    }
}
