//! CPU placement (`ingest_cpus`): the ingest runtime on CPUs of its own, the
//! request path (gRPC, HTTP, scrapes, tokenizing) on the rest.
//!
//! Decoding and applying a flood of KV events keeps its CPUs busy; a Pick
//! that has to wake up on one of them waits behind it for up to a scheduler
//! slice, which is the whole Pick budget. Niceness does not help (measured,
//! README "Load and soak"); separate CPUs do. On Linux a thread's CPU
//! affinity is inherited by the threads it starts, so the binary narrows its
//! main thread to the request side before it builds the request runtime
//! ([`pin_request_side`]), and each ingest thread pins itself to the ingest
//! side as it starts ([`pin_current_thread`]). In a Kubernetes pod the CPUs
//! named are those of the container's cpuset (a Guaranteed pod with the
//! static CPU manager policy gets whole CPUs of its own).

use std::fmt;
use std::str::FromStr;

/// A set of CPU numbers, in the Linux cpuset list format: `"1"`, `"2-3"`,
/// `"0,4-5"`. Sorted, without repeats, never empty.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuList(Vec<usize>);

/// The highest CPU number accepted (the kernel's `CPU_SETSIZE` is 1,024).
pub const MAX_CPU: usize = 1023;

impl CpuList {
    /// A list from CPU numbers (sorted and deduplicated); None when empty
    /// or when a number passes [`MAX_CPU`].
    pub fn new(mut cpus: Vec<usize>) -> Option<Self> {
        cpus.sort_unstable();
        cpus.dedup();
        (!cpus.is_empty() && cpus.iter().all(|c| *c <= MAX_CPU)).then_some(Self(cpus))
    }

    /// The CPU numbers, ascending.
    pub fn cpus(&self) -> &[usize] {
        &self.0
    }

    /// How many CPUs.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Never true (a list holds at least one CPU); for clippy's sake.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The CPUs of `self` not in `other`, if any.
    pub fn without(&self, other: &Self) -> Option<Self> {
        Self::new(
            self.0
                .iter()
                .copied()
                .filter(|c| !other.0.contains(c))
                .collect(),
        )
    }

    /// Whether every CPU of `self` is in `other`.
    pub fn is_subset_of(&self, other: &Self) -> bool {
        self.0.iter().all(|c| other.0.contains(c))
    }
}

impl FromStr for CpuList {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let mut cpus = Vec::new();
        for part in text.split(',').map(str::trim) {
            let number = |s: &str| {
                s.trim()
                    .parse::<usize>()
                    .ok()
                    .filter(|c| *c <= MAX_CPU)
                    .ok_or_else(|| format!("{s:?} is not a CPU number (0 to {MAX_CPU})"))
            };
            match part.split_once('-') {
                Some((a, b)) => {
                    let (a, b) = (number(a)?, number(b)?);
                    if a > b {
                        return Err(format!("{part:?}: a range runs from low to high"));
                    }
                    cpus.extend(a..=b);
                }
                None => cpus.push(number(part)?),
            }
        }
        Self::new(cpus).ok_or_else(|| "no CPU named".to_owned())
    }
}

impl fmt::Display for CpuList {
    /// The cpuset list format, ranges folded (`0,2-5`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        let mut rest = self.0.iter().copied().peekable();
        while let Some(start) = rest.next() {
            let mut end = start;
            while rest.peek() == Some(&(end + 1)) {
                end += 1;
                rest.next();
            }
            if !first {
                f.write_str(",")?;
            }
            first = false;
            if end == start {
                write!(f, "{start}")?;
            } else {
                write!(f, "{start}-{end}")?;
            }
        }
        Ok(())
    }
}

/// What `ingest_cpus` names: CPU numbers, or the last `n` CPUs of the
/// process's own set (`last`, `last:2`), for a container whose exclusive
/// CPUs the kubelet chooses (a Guaranteed pod under the static CPU manager
/// policy: the numbers are not known when the config is written).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CpuSpec {
    /// These CPUs.
    List(CpuList),
    /// The last `n` of the CPUs the process may use.
    Last(usize),
}

impl FromStr for CpuSpec {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let text = text.trim();
        match text.strip_prefix("last") {
            Some("") => Ok(Self::Last(1)),
            Some(rest) => rest
                .strip_prefix(':')
                .and_then(|n| n.trim().parse::<usize>().ok())
                .filter(|n| (1..=MAX_CPU).contains(n))
                .map(Self::Last)
                .ok_or_else(|| format!("{text:?}: `last` or `last:N` with N ≥ 1")),
            None => text.parse().map(Self::List),
        }
    }
}

impl fmt::Display for CpuSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::List(list) => list.fmt(f),
            Self::Last(n) => write!(f, "last:{n}"),
        }
    }
}

impl CpuSpec {
    /// The CPUs meant, among `allowed` (the process's).
    pub fn resolve(&self, allowed: &CpuList) -> Result<CpuList, String> {
        match self {
            Self::List(list) => Ok(list.clone()),
            Self::Last(n) => {
                let cpus = allowed.cpus();
                let from = cpus.len().checked_sub(*n).ok_or_else(|| {
                    format!(
                        "ingest_cpus last:{n}: this process may use only {} CPUs ({allowed})",
                        cpus.len()
                    )
                })?;
                CpuList::new(cpus.get(from..).unwrap_or_default().to_vec())
                    .ok_or_else(|| "ingest_cpus names no CPU".to_owned())
            }
        }
    }
}

/// Where the threads go: `ingest` as configured, `request` the rest of the
/// CPUs this process may use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// The ingest runtime's CPUs (one worker thread each).
    pub ingest: CpuList,
    /// Every other thread's.
    pub request: CpuList,
}

impl Placement {
    /// Splits `allowed` (the process's CPUs) into `ingest` and the rest;
    /// an error names what is wrong with `ingest`.
    pub fn split(ingest: &CpuSpec, allowed: &CpuList) -> Result<Self, String> {
        let ingest = &ingest.resolve(allowed)?;
        if !ingest.is_subset_of(allowed) {
            return Err(format!(
                "ingest_cpus {ingest} is not within the CPUs this process may use ({allowed})"
            ));
        }
        let request = allowed.without(ingest).ok_or_else(|| {
            format!(
                "ingest_cpus {ingest} takes every CPU this process may use ({allowed}); \
                 leave at least one to the request path"
            )
        })?;
        Ok(Self {
            ingest: ingest.clone(),
            request,
        })
    }
}

/// The CPUs the calling thread may run on.
#[cfg(target_os = "linux")]
pub fn allowed() -> std::io::Result<CpuList> {
    let set = rustix::thread::sched_getaffinity(None)?;
    let cpus = (0..=MAX_CPU.min(rustix::thread::CpuSet::MAX_CPU - 1))
        .filter(|c| set.is_set(*c))
        .collect();
    CpuList::new(cpus).ok_or_else(|| std::io::Error::other("no CPU in this thread's affinity"))
}

/// Restricts the calling thread (and the threads it starts from now on) to
/// `cpus`.
#[cfg(target_os = "linux")]
pub fn pin_current_thread(cpus: &CpuList) -> std::io::Result<()> {
    let mut set = rustix::thread::CpuSet::new();
    for c in cpus.cpus() {
        set.set(*c);
    }
    rustix::thread::sched_setaffinity(None, &set).map_err(std::io::Error::from)
}

/// Without Linux's per-thread affinity: the CPUs are not known.
#[cfg(not(target_os = "linux"))]
pub fn allowed() -> std::io::Result<CpuList> {
    Err(std::io::Error::other(
        "CPU placement (ingest_cpus) needs Linux",
    ))
}

/// Without Linux's per-thread affinity: refused.
#[cfg(not(target_os = "linux"))]
pub fn pin_current_thread(_cpus: &CpuList) -> std::io::Result<()> {
    Err(std::io::Error::other(
        "CPU placement (ingest_cpus) needs Linux",
    ))
}

/// Splits this process's CPUs by `ingest` and pins the calling thread to
/// the request side, so that the runtime it builds next (and every thread
/// that starts from it) runs there. Call it on the main thread before the
/// request runtime exists.
pub fn pin_request_side(ingest: &CpuSpec) -> Result<Placement, String> {
    let allowed =
        allowed().map_err(|e| format!("ingest_cpus: cannot read this process's CPUs: {e}"))?;
    let placement = Placement::split(ingest, &allowed)?;
    pin_current_thread(&placement.request).map_err(|e| {
        format!(
            "ingest_cpus: cannot move the request path to CPUs {}: {e}",
            placement.request
        )
    })?;
    Ok(placement)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn list(s: &str) -> CpuList {
        s.parse().unwrap()
    }

    #[test]
    fn lists_parse_in_the_cpuset_format_and_print_folded() {
        assert_eq!(list("1").cpus(), &[1]);
        assert_eq!(list("2-4").cpus(), &[2, 3, 4]);
        assert_eq!(list(" 5, 0,2-3 ,3").cpus(), &[0, 2, 3, 5]);
        assert_eq!(list("5,0,2-3,3,7-9").to_string(), "0,2-3,5,7-9");
        for bad in ["", "a", "1-", "3-1", "1,,2", "-1", "1024", "0-5000"] {
            assert!(bad.parse::<CpuList>().is_err(), "{bad:?} parsed");
        }
    }

    fn spec(s: &str) -> CpuSpec {
        s.parse().unwrap()
    }

    #[test]
    fn a_placement_leaves_the_rest_to_the_request_path() {
        let p = Placement::split(&spec("1"), &list("0-1")).unwrap();
        assert_eq!((p.ingest, p.request), (list("1"), list("0")));
        let p = Placement::split(&spec("2-3"), &list("0-7")).unwrap();
        assert_eq!(p.request, list("0-1,4-7"));
        let all = Placement::split(&spec("0-1"), &list("0-1")).unwrap_err();
        assert!(all.contains("leave at least one"), "{all}");
        let outside = Placement::split(&spec("4"), &list("0-1")).unwrap_err();
        assert!(outside.contains("not within"), "{outside}");
    }

    #[test]
    fn last_names_the_end_of_the_process_own_cpus() {
        assert_eq!(spec("last"), CpuSpec::Last(1));
        assert_eq!(spec(" last:3 "), CpuSpec::Last(3));
        assert_eq!(spec("last:2").to_string(), "last:2");
        for bad in ["last:0", "last:", "last:x", "lastx", "last2"] {
            assert!(bad.parse::<CpuSpec>().is_err(), "{bad:?} parsed");
        }
        let p = Placement::split(&spec("last:2"), &list("4-7")).unwrap();
        assert_eq!((p.ingest, p.request), (list("6-7"), list("4-5")));
        let p = Placement::split(&spec("last"), &list("0,3")).unwrap();
        assert_eq!((p.ingest, p.request), (list("3"), list("0")));
        let short = Placement::split(&spec("last:3"), &list("0-1")).unwrap_err();
        assert!(short.contains("only 2 CPUs"), "{short}");
        let all = Placement::split(&spec("last:2"), &list("0-1")).unwrap_err();
        assert!(all.contains("leave at least one"), "{all}");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_thread_pins_itself_and_its_children_inherit_it() {
        let allowed = allowed().unwrap();
        let one = CpuList::new(vec![*allowed.cpus().last().unwrap()]).unwrap();
        let seen = std::thread::spawn(move || {
            pin_current_thread(&one).unwrap();
            let own = allowed_now();
            let child = std::thread::spawn(allowed_now).join().unwrap();
            (one, own, child)
        })
        .join()
        .unwrap();
        assert_eq!(seen.0, seen.1);
        assert_eq!(seen.0, seen.2);
    }

    #[cfg(target_os = "linux")]
    fn allowed_now() -> CpuList {
        allowed().unwrap()
    }
}
