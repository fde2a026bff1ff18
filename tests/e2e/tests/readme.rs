//! The front page and the guides it links keep their promises: every
//! relative link (and image) of `README.md` and `docs/*.md` names a file
//! or directory that exists, and a `#fragment` names a heading of the
//! Markdown file it points to; every command in their shell blocks, and
//! every `make` target named in their prose, exists: `make` targets in the
//! Makefile, `cargo -p` packages in the workspace, binaries and the flags
//! given to indexd, the files handed to Envoy, Docker, kubectl and bash.
//! A command of a kind this test does not know fails it, until the test
//! learns to check it or names it as the outside world's (`vllm`, `curl`,
//! …).
//!
//! Links to the web are not followed (the tests run offline); the front
//! page has none.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Commands of the outside world, or shell built-ins and helpers defined
/// in the same block: their names are not checked.
const NOT_OURS: &[&str] = &[
    "vllm", "curl", "grep", "sudo", "docker", "kubectl", "printf", "seq", "echo", "ask", "sys=",
    "head", "base64", "tr", "export", "cd",
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The documents checked: the front page and the guides under `docs/`.
fn documents() -> Vec<PathBuf> {
    let mut docs = vec![root().join("README.md")];
    let mut guides: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    guides.sort();
    docs.extend(guides);
    docs
}

/// GitHub's anchor of a heading: lower case, punctuation but `-` and `_`
/// dropped, spaces to `-`.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a Markdown file's headings (outside code blocks).
fn anchors(markdown: &str) -> BTreeSet<String> {
    let mut fenced = false;
    let mut out = BTreeSet::new();
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced && line.starts_with('#') {
            out.insert(slug(line.trim_start_matches('#')));
        }
    }
    out
}

/// Every `](target)` of the text outside code blocks.
fn links(markdown: &str) -> Vec<String> {
    let mut fenced = false;
    let mut out = Vec::new();
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            out.push(after[..end].to_owned());
            rest = &after[end..];
        }
    }
    out
}

/// The commands of the document's `sh` blocks: continuation lines and
/// quotes over several lines joined, comments cut.
fn shell_lines(markdown: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_sh = false;
    let mut pending = String::new();
    for line in markdown.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") {
            in_sh = !in_sh && trimmed.trim_start_matches('`').trim() == "sh";
            continue;
        }
        if !in_sh {
            continue;
        }
        let code = match line.find(" #") {
            Some(at) if !line[..at].contains('\'') => &line[..at],
            _ => line,
        };
        pending.push_str(code.trim_end().trim_end_matches('\\'));
        pending.push(' ');
        // A line ends the command unless it continues (`\`) or a quote
        // it opened is still open.
        let quoted = pending.matches('\'').count() % 2 == 1;
        if !code.trim_end().ends_with('\\') && !quoted {
            if !pending.trim().is_empty() {
                out.push(pending.trim().to_owned());
            }
            pending.clear();
        }
    }
    out
}

/// The Makefile's targets.
fn make_targets() -> BTreeSet<String> {
    std::fs::read_to_string(root().join("Makefile"))
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with(['\t', '#', ' ', '.']))
        .filter_map(|l| l.split_once(':').map(|(t, _)| t.trim().to_owned()))
        .filter(|t| !t.is_empty() && !t.contains(['=', '$', ' ']))
        .collect()
}

/// The workspace's package names and their directories.
fn packages() -> Vec<(String, PathBuf)> {
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    let members = manifest
        .split("members = [")
        .nth(1)
        .and_then(|s| s.split(']').next())
        .unwrap();
    members
        .split(',')
        .map(|m| m.trim().trim_matches('"'))
        .filter(|m| !m.is_empty())
        .map(|m| {
            let dir = root().join(m);
            let toml = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap();
            let name = toml
                .lines()
                .find_map(|l| l.strip_prefix("name = \""))
                .and_then(|n| n.strip_suffix('"'))
                .unwrap()
                .to_owned();
            (name, dir)
        })
        .collect()
}

/// The files named after `flag` in `words` that do not exist.
fn missing_after(words: &[&str], flag: &str) -> Vec<String> {
    words
        .windows(2)
        .filter(|pair| pair[0] == flag && !root().join(pair[1]).exists())
        .map(|pair| format!("`{flag} {}`: no such file", pair[1]))
        .collect()
}

/// What is wrong with one shell line (empty: nothing).
fn check_command(
    line: &str,
    targets: &BTreeSet<String>,
    packages: &[(String, PathBuf)],
) -> Vec<String> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let Some(first) = words.first().copied() else {
        return Vec::new();
    };
    let exists = |p: &str| root().join(p).exists();
    let mut problems = Vec::new();
    match first {
        "make" => {
            for t in words[1..]
                .iter()
                .filter(|w| !w.contains('=') && !w.starts_with('-'))
            {
                if !targets.contains(*t) {
                    return vec![format!("`make {t}`: no such target")];
                }
            }
        }
        "cargo" => {
            for pair in words.windows(2) {
                if pair[0] == "-p" && !packages.iter().any(|(n, _)| n == pair[1]) {
                    problems.push(format!("`cargo -p {}`: no such package", pair[1]));
                }
            }
        }
        "envoy" => problems.extend(missing_after(&words, "-c")),
        "bash" => {
            if let Some(script) = words.get(1)
                && !exists(script)
            {
                problems.push(format!("`bash {script}`: no such file"));
            }
        }
        bin if bin.starts_with("target/") => {
            let name = bin.rsplit('/').next().unwrap_or_default();
            let Some((_, dir)) = packages.iter().find(|(n, _)| n == name) else {
                return vec![format!("`{bin}`: no package builds a binary of that name")];
            };
            let main = std::fs::read_to_string(dir.join("src/main.rs")).unwrap_or_default();
            for flag in words.iter().filter_map(|w| w.strip_prefix("--")) {
                let flag = flag.split('=').next().unwrap_or_default();
                let field = flag.replace('-', "_");
                if !main.contains(&format!("long = \"{flag}\""))
                    && !main.contains(&format!("    {field}:"))
                {
                    problems.push(format!(
                        "`{name} --{flag}`: no such flag in {}",
                        dir.display()
                    ));
                }
            }
            problems.extend(missing_after(&words, "--config"));
        }
        other if NOT_OURS.iter().any(|n| other.starts_with(n)) => {
            problems.extend(missing_after(&words, "-f"));
        }
        other => problems.push(format!(
            "`{other}`: a command this test does not check (teach it, or name it in NOT_OURS)"
        )),
    }
    problems
}

#[test]
fn every_link_and_command_of_the_front_page_and_its_guides_holds() {
    let targets = make_targets();
    let packages = packages();
    assert!(
        targets.contains("test") && targets.contains("run"),
        "{targets:?}"
    );
    let mut problems = Vec::new();
    let mut checked = (0, 0);
    for doc in documents() {
        let text = std::fs::read_to_string(&doc).unwrap();
        let name = doc
            .strip_prefix(root())
            .unwrap_or(&doc)
            .display()
            .to_string();
        let dir = doc.parent().unwrap();
        for link in links(&text) {
            if link.starts_with("http://")
                || link.starts_with("https://")
                || link.starts_with("mailto:")
            {
                continue;
            }
            checked.0 += 1;
            let (path, fragment) = link.split_once('#').unwrap_or((&link, ""));
            let target = if path.is_empty() {
                doc.clone()
            } else {
                dir.join(path)
            };
            if !target.exists() {
                problems.push(format!(
                    "{name}: link `{link}`: {} does not exist",
                    target.display()
                ));
                continue;
            }
            if !fragment.is_empty() {
                let heads = anchors(&std::fs::read_to_string(&target).unwrap_or_default());
                if !heads.contains(fragment) {
                    problems.push(format!(
                        "{name}: link `{link}`: no heading `#{fragment}` there"
                    ));
                }
            }
        }
        for line in shell_lines(&text) {
            checked.1 += 1;
            for p in check_command(&line, &targets, &packages) {
                problems.push(format!("{name}: `{line}`: {p}"));
            }
        }
        // `make X` named in the prose.
        for part in text.split("`make ").skip(1) {
            let target = part.split(['`', ' ']).next().unwrap_or_default();
            if !target.contains('=') && !targets.contains(target) {
                problems.push(format!("{name}: `make {target}`: no such target"));
            }
        }
    }
    eprintln!("checked {} links and {} commands", checked.0, checked.1);
    assert!(
        checked.0 > 20 && checked.1 > 5,
        "the documents lost their links: {checked:?}"
    );
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_checks_catch_what_they_are_for() {
    let targets: BTreeSet<String> = ["run".to_owned()].into();
    let packages = packages();
    assert!(check_command("make run", &targets, &packages).is_empty());
    assert!(!check_command("make runn", &targets, &packages).is_empty());
    assert!(!check_command("cargo build -p no-such-crate", &targets, &packages).is_empty());
    assert!(check_command("cargo build -p indexd", &targets, &packages).is_empty());
    assert!(!check_command("target/release/indexd --no-such-flag", &targets, &packages).is_empty());
    assert!(
        !check_command(
            "target/release/indexd --config envoy/nope.yaml",
            &targets,
            &packages
        )
        .is_empty()
    );
    assert!(
        check_command(
            "target/release/indexd --config envoy/indexd.yaml",
            &targets,
            &packages
        )
        .is_empty()
    );
    assert!(!check_command("envoy -c envoy/nope.yaml", &targets, &packages).is_empty());
    assert!(!check_command("frobnicate --all", &targets, &packages).is_empty());
    assert_eq!(slug("Kubernetes and Istio"), "kubernetes-and-istio");
    assert_eq!(
        slug("Hybrid models (KV cache groups)"),
        "hybrid-models-kv-cache-groups"
    );
    assert_eq!(
        links("see [a](b.md#c) and ![x](y.svg)"),
        ["b.md#c", "y.svg"]
    );
}
