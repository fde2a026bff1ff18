//! What the machine gives indexd: CPUs and memory, container limits
//! included. Defaults that scale with the machine read them here
//! (tokenization's admission budget, [`crate::tokenize::AdmissionConfig`]).

use std::path::Path;

/// Memory assumed when neither a cgroup limit nor `/proc/meminfo` says.
const FALLBACK_MEMORY: u64 = 4 << 30;

/// The CPUs this process may run on (its affinity and, on Linux, its
/// cgroup's CPU quota); 1 when unknown.
pub fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
}

/// The memory this process may use: the smaller of its cgroup's limit
/// (v2 `memory.max`, v1 `memory.limit_in_bytes`) and the machine's
/// `MemTotal`; 4 GiB when neither can be read.
pub fn memory_bytes() -> u64 {
    let total = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| mem_total(&t));
    let limit = cgroup_limit(Path::new("/sys/fs/cgroup"));
    match (total, limit) {
        (Some(t), Some(l)) => t.min(l),
        (Some(m), None) | (None, Some(m)) => m,
        (None, None) => FALLBACK_MEMORY,
    }
}

/// `MemTotal` of a `/proc/meminfo` text, in bytes.
fn mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The memory limit of the cgroup mounted at `root` (inside a container,
/// the container's own), if one is set.
fn cgroup_limit(root: &Path) -> Option<u64> {
    let v2 = std::fs::read_to_string(root.join("memory.max")).ok();
    let v1 = || std::fs::read_to_string(root.join("memory/memory.limit_in_bytes")).ok();
    let text = v2.or_else(v1)?;
    let text = text.trim();
    // "max" (v2) or a huge number (v1's "unlimited") mean no limit.
    let bytes: u64 = text.parse().ok()?;
    (bytes < 1 << 60).then_some(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_meminfo_and_cgroup_limits() {
        assert_eq!(
            mem_total("MemTotal:       24575916 kB\nMemFree: 1 kB\n"),
            Some(24_575_916 * 1024)
        );
        assert_eq!(mem_total("MemFree: 1 kB\n"), None);
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(cgroup_limit(dir.path()), None);
        std::fs::write(dir.path().join("memory.max"), "max\n").unwrap();
        assert_eq!(cgroup_limit(dir.path()), None);
        std::fs::write(dir.path().join("memory.max"), "2147483648\n").unwrap();
        assert_eq!(cgroup_limit(dir.path()), Some(2 << 30));
        assert!(cpus() >= 1);
        assert!(memory_bytes() > 0);
    }
}
