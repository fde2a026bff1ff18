//! The committed results, recomputed: every `tests/bench/results*` directory
//! (and every run directory inside one) is summarised again from its CSV
//! files by the bench's own summarising code, into a temporary directory, and
//! every derived file committed beside those CSV files must come out byte
//! for byte.
//!
//! - A `run` or `vllm` run (`samples.csv`): [`output::summarize_file`], the
//!   step both subcommands end with and `summarize` runs (`summary.json`,
//!   `summary.md` and the charts; `indexd.csv` is read beside
//!   `samples.csv`), and a `vllm` run's side tables from their CSV files with
//!   the writers the run calls: [`added::write`] (`added.md`) and
//!   [`load_cpu::write`] (`cpu.md`).
//! - `overhead`: [`overhead::summarize`] (`overhead.md`).
//! - `soak`: [`soak::summarize`] (`soak.md`).
//! - `bodies`: [`bodies::summarize`] (`bodies.md`).
//!
//! The last three write their markdown beside the CSV files they read, so
//! they run on copies of those files in the temporary directory. A committed
//! file that is neither read nor derived by these steps, and is not in
//! [`NOT_RESULTS`], fails the test, and so does a directory none of them
//! handles. Charts the summarising step draws that were not committed
//! (`results-local-mock`) have nothing to be compared with. [`BLESS`]
//! rewrites what differs.

use std::collections::BTreeSet;
use std::error::Error;
use std::path::{Path, PathBuf};

use kvroute_bench::added::{self, AddedRow};
use kvroute_bench::load_cpu::{self, CpuRow};
use kvroute_bench::{BenchError, bodies, indexd_metrics, output, overhead, sample, soak};

type Failure = Box<dyn Error>;

/// Committed files that no summarising step reads or writes: `(directory,
/// file)`, the directory relative to `tests/bench`.
const NOT_RESULTS: &[(&str, &str)] = &[
    // The helper script run beside those runs (see its docstring), not a result.
    ("results-vllm-slice", "slicer.py"),
];

/// A committed file that the recomputation does not reproduce: `(directory,
/// file, first differing line, committed lines, recomputed lines)`, lines
/// counted from 1.
type Known = (&'static str, &'static str, usize, usize, usize);

/// Derived files kept as their run wrote them, though their step now writes
/// them otherwise, each with its reason. The test asserts that the
/// differences are exactly these.
#[rustfmt::skip]
const KNOWN_DIFFERENCES: &[Known] = &[
    // `cpu.md` without the "clients" column: that run's `cpu.csv` has no
    // `clients_ms` (its client threads were counted in "bench", from /proc
    // ticks), so the current writer would print a "clients" column of 0.00
    // under a legend that counts them apart: the committed table is the one
    // that describes its data.
    ("results-vllm-held", "cpu.md", 3, 12, 12),
];

/// With this variable set to 1, a derived file that differs (and is not in
/// [`KNOWN_DIFFERENCES`]) is rewritten from its CSV files instead of failing
/// the test: after a summarising step gains a column, the committed results
/// are brought up to date with `KVROUTE_BENCH_BLESS=1 cargo test -p
/// kvroute-bench --test committed_results`, and the diff shows that no
/// figure moved.
const BLESS: &str = "KVROUTE_BENCH_BLESS";

/// How the files of one run directory were produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// `run` or `vllm`: `samples.csv` and what is derived from it.
    Run,
    /// `overhead`.
    Overhead,
    /// `soak`.
    Soak,
    /// `bodies`.
    Bodies,
}

impl Step {
    /// The step whose marker file `dir` holds.
    fn of(dir: &Path) -> Option<Self> {
        [
            (Self::Run, "samples.csv"),
            (Self::Overhead, overhead::record::REQUESTS_CSV),
            (Self::Soak, soak::report::SAMPLES_CSV),
            (Self::Bodies, bodies::report::REQUESTS_CSV),
        ]
        .into_iter()
        .find(|(_, marker)| dir.join(marker).is_file())
        .map(|(step, _)| step)
    }

    /// The files the step reads.
    fn inputs(self) -> &'static [&'static str] {
        match self {
            Self::Run => &[
                "samples.csv",
                indexd_metrics::INDEXD_CSV,
                added::ADDED_CSV,
                load_cpu::CPU_CSV,
            ],
            Self::Overhead => &[
                overhead::record::REQUESTS_CSV,
                overhead::record::HISTOGRAMS_CSV,
                overhead::record::RUN_CSV,
                overhead::cpu::CPU_CSV,
            ],
            Self::Soak => &[
                soak::report::SAMPLES_CSV,
                soak::report::KINDS_CSV,
                soak::report::RUN_CSV,
            ],
            Self::Bodies => &[
                bodies::report::REQUESTS_CSV,
                bodies::report::PHASES_CSV,
                bodies::report::HISTOGRAMS_CSV,
                bodies::report::RUN_CSV,
            ],
        }
    }

    /// Writes into `out` what the step derives from the files in `dir`.
    fn recompute(self, dir: &Path, out: &Path) -> Result<(), BenchError> {
        match self {
            Self::Run => recompute_run(dir, out),
            Self::Overhead => {
                self.copy_inputs(dir, out)?;
                overhead::summarize(out).map(drop)
            }
            Self::Soak => {
                self.copy_inputs(dir, out)?;
                soak::summarize(out).map(drop)
            }
            Self::Bodies => {
                self.copy_inputs(dir, out)?;
                bodies::summarize(out).map(drop)
            }
        }
    }

    /// Copies the inputs found in `dir` into `out`.
    fn copy_inputs(self, dir: &Path, out: &Path) -> Result<(), BenchError> {
        for name in self.inputs() {
            let from = dir.join(name);
            if from.is_file() {
                let to = out.join(name);
                std::fs::copy(&from, &to).map_err(|e| BenchError::io(&to, e))?;
            }
        }
        Ok(())
    }
}

/// A `run` or `vllm` run: the summary and charts from `samples.csv` (and
/// `indexd.csv` beside it), and the side tables from their CSV files.
fn recompute_run(dir: &Path, out: &Path) -> Result<(), BenchError> {
    output::summarize_file(&dir.join("samples.csv"), out)?;
    if dir.join(added::ADDED_CSV).is_file() {
        let rows: Vec<AddedRow> = sample::read_csv(&dir.join(added::ADDED_CSV))?;
        added::write(out, &rows)?;
    }
    if dir.join(load_cpu::CPU_CSV).is_file() {
        let rows: Vec<CpuRow> = sample::read_csv(&dir.join(load_cpu::CPU_CSV))?;
        load_cpu::write(out, &rows)?;
    }
    Ok(())
}

/// A derived file that differs from its committed copy.
#[derive(Debug)]
struct Difference {
    dir: String,
    file: String,
    /// The first line that differs, from 1.
    line: usize,
    committed: Option<String>,
    recomputed: Option<String>,
    committed_lines: usize,
    recomputed_lines: usize,
}

impl Difference {
    fn known(&self) -> (&str, &str, usize, usize, usize) {
        (
            &self.dir,
            &self.file,
            self.line,
            self.committed_lines,
            self.recomputed_lines,
        )
    }
}

impl std::fmt::Display for Difference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shown = |line: &Option<String>| {
            line.as_ref().map_or_else(
                || "(no such line)".to_owned(),
                |l| format!("{:?}", l.chars().take(300).collect::<String>()),
            )
        };
        write!(
            f,
            "{}/{}: first difference at line {} ({} lines committed, {} recomputed)\n  committed:  {}\n  recomputed: {}",
            self.dir,
            self.file,
            self.line,
            self.committed_lines,
            self.recomputed_lines,
            shown(&self.committed),
            shown(&self.recomputed)
        )
    }
}

/// The first line at which `recomputed` differs from `committed`, if any.
fn first_difference(
    dir: &str,
    file: &str,
    committed: &str,
    recomputed: &str,
) -> Option<Difference> {
    if committed == recomputed {
        return None;
    }
    let a: Vec<&str> = committed.split('\n').collect();
    let b: Vec<&str> = recomputed.split('\n').collect();
    let at = (0..a.len().max(b.len())).find(|&i| a.get(i) != b.get(i))?;
    Some(Difference {
        dir: dir.to_owned(),
        file: file.to_owned(),
        line: at + 1,
        committed: a.get(at).map(|l| (*l).to_owned()),
        recomputed: b.get(at).map(|l| (*l).to_owned()),
        committed_lines: committed.lines().count(),
        recomputed_lines: recomputed.lines().count(),
    })
}

/// The names of the regular files in `dir`, sorted.
fn file_names(dir: &Path) -> Result<BTreeSet<String>, Failure> {
    let mut names = BTreeSet::new();
    for entry in std::fs::read_dir(dir).map_err(|e| BenchError::io(dir, e))? {
        let entry = entry.map_err(|e| BenchError::io(dir, e))?;
        if entry
            .file_type()
            .map_err(|e| BenchError::io(dir, e))?
            .is_file()
        {
            names.insert(entry.file_name().to_string_lossy().into_owned());
        }
    }
    Ok(names)
}

/// `dir` and every directory below it, sorted.
fn directories(dir: &Path) -> Result<Vec<PathBuf>, Failure> {
    let mut all = vec![dir.to_owned()];
    let mut below: Vec<PathBuf> = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| BenchError::io(dir, e))? {
        let path = entry.map_err(|e| BenchError::io(dir, e))?.path();
        if path.is_dir() {
            below.push(path);
        }
    }
    below.sort();
    for sub in below {
        all.extend(directories(&sub)?);
    }
    Ok(all)
}

/// What checking the committed results found.
#[derive(Debug, Default)]
struct Findings {
    /// Run directories recomputed, with their step.
    checked: Vec<(String, Step)>,
    /// Files compared.
    compared: usize,
    differences: Vec<Difference>,
    /// Files or directories no step accounts for.
    unaccounted: Vec<String>,
}

/// Recomputes the run directory `dir` (named `name`) by `step` and compares.
fn check_run(name: &str, dir: &Path, step: Step, found: &mut Findings) -> Result<(), Failure> {
    let out = tempfile::tempdir()?;
    step.recompute(dir, out.path())
        .map_err(|e| format!("{name}: recomputing ({step:?}) failed: {e}"))?;
    let inputs: BTreeSet<&str> = step.inputs().iter().copied().collect();
    let derived: BTreeSet<String> = file_names(out.path())?
        .into_iter()
        .filter(|n| !inputs.contains(n.as_str()))
        .collect();
    for file in file_names(dir)? {
        if inputs.contains(file.as_str()) {
            continue;
        }
        if !derived.contains(&file) {
            if !NOT_RESULTS.contains(&(name, file.as_str())) {
                found.unaccounted.push(format!(
                    "{name}/{file}: committed, but {step:?} neither reads nor writes it"
                ));
            }
            continue;
        }
        let read =
            |path: &Path| std::fs::read(path).map_err(|e| Failure::from(BenchError::io(path, e)));
        let committed = read(&dir.join(&file))?;
        let recomputed = read(&out.path().join(&file))?;
        found.compared += 1;
        let kept = KNOWN_DIFFERENCES
            .iter()
            .any(|(d, f, ..)| *d == name && *f == file);
        if committed != recomputed && !kept && std::env::var(BLESS).is_ok_and(|v| v == "1") {
            let to = dir.join(&file);
            std::fs::write(&to, &recomputed).map_err(|e| Failure::from(BenchError::io(&to, e)))?;
            eprintln!("{name}/{file}: rewritten from its CSV files ({BLESS}=1)");
            continue;
        }
        if committed != recomputed {
            let difference = first_difference(
                name,
                &file,
                &String::from_utf8_lossy(&committed),
                &String::from_utf8_lossy(&recomputed),
            )
            .ok_or_else(|| format!("{name}/{file}: bytes differ, text does not"))?;
            found.differences.push(difference);
        }
    }
    found.checked.push((name.to_owned(), step));
    Ok(())
}

/// Checks every `results*` directory under `root` (`tests/bench`).
fn check_all(root: &Path) -> Result<Findings, Failure> {
    let mut results: Vec<PathBuf> = Vec::new();
    for entry in std::fs::read_dir(root).map_err(|e| BenchError::io(root, e))? {
        let path = entry.map_err(|e| BenchError::io(root, e))?.path();
        let is_results = path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("results"));
        if is_results && path.is_dir() {
            results.push(path);
        }
    }
    results.sort();
    let mut found = Findings::default();
    for top in &results {
        let before = found.checked.len();
        for dir in directories(top)? {
            let name = dir.strip_prefix(root)?.to_string_lossy().replace('\\', "/");
            match Step::of(&dir) {
                Some(step) => check_run(&name, &dir, step, &mut found)?,
                None => {
                    for file in file_names(&dir)? {
                        if !NOT_RESULTS.contains(&(name.as_str(), file.as_str())) {
                            found.unaccounted.push(format!(
                                "{name}/{file}: in a directory no summarising step handles"
                            ));
                        }
                    }
                }
            }
        }
        if found.checked.len() == before {
            found.unaccounted.push(format!(
                "{}: no run directory a summarising step handles",
                top.display()
            ));
        }
    }
    Ok(found)
}

#[test]
fn committed_results_are_what_their_csv_files_summarise_to() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let found = check_all(root).unwrap();
    assert!(
        found.unaccounted.is_empty(),
        "committed files no summarising step accounts for:\n{}",
        found.unaccounted.join("\n")
    );
    // Each kind of run is there: a directory that stopped being recognised
    // would otherwise pass unchecked.
    for step in [Step::Run, Step::Overhead, Step::Soak, Step::Bodies] {
        assert!(
            found.checked.iter().any(|(_, s)| *s == step),
            "no {step:?} directory among {:?}",
            found.checked
        );
    }
    let seen: BTreeSet<(&str, &str, usize, usize, usize)> =
        found.differences.iter().map(Difference::known).collect();
    let known: BTreeSet<Known> = KNOWN_DIFFERENCES.iter().copied().collect();
    assert_eq!(
        known.len(),
        KNOWN_DIFFERENCES.len(),
        "KNOWN_DIFFERENCES lists an entry twice"
    );
    let unexpected: Vec<String> = found
        .differences
        .iter()
        .filter(|d| !known.contains(&d.known()))
        .map(ToString::to_string)
        .collect();
    let gone: Vec<String> = KNOWN_DIFFERENCES
        .iter()
        .filter(|k| !seen.contains(*k))
        .map(|k| format!("{k:?}"))
        .collect();
    assert!(
        unexpected.is_empty() && gone.is_empty(),
        "the recomputed results differ from the committed ones otherwise than KNOWN_DIFFERENCES says\n\
         \nnew differences ({}):\n{}\n\
         \nknown differences no longer found as listed ({}):\n{}\n\
         \nall differences found, as KNOWN_DIFFERENCES entries:\n{}",
        unexpected.len(),
        unexpected.join("\n"),
        gone.len(),
        gone.join("\n"),
        found
            .differences
            .iter()
            .map(|d| format!("    {:?},", d.known()))
            .collect::<Vec<_>>()
            .join("\n")
    );
    eprintln!(
        "{} run directories recomputed, {} committed files compared; {} known differences \
         (KNOWN_DIFFERENCES) in {} directories",
        found.checked.len(),
        found.compared,
        found.differences.len(),
        found
            .differences
            .iter()
            .map(|d| d.dir.as_str())
            .collect::<BTreeSet<_>>()
            .len()
    );
}

#[test]
fn a_difference_names_its_first_differing_line() {
    let d = first_difference("results-x", "summary.md", "a\nb\nc\n", "a\nB\nc\nd\n").unwrap();
    assert_eq!(d.known(), ("results-x", "summary.md", 2, 3, 4));
    assert_eq!(
        (d.committed.as_deref(), d.recomputed.as_deref()),
        (Some("b"), Some("B"))
    );
    // A recomputed file that only goes on: the first line past the committed end.
    let longer = first_difference("r", "f", "a\n", "a\nb\n").unwrap();
    assert_eq!((longer.line, longer.committed.as_deref()), (2, Some("")));
    assert!(first_difference("r", "f", "same\n", "same\n").is_none());
    let shown = d.to_string();
    assert!(
        shown.starts_with("results-x/summary.md: first difference at line 2"),
        "{shown}"
    );
}
