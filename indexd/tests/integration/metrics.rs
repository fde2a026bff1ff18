//! indexd's `/metrics` as tools read it: `promtool check metrics` (from
//! Prometheus; `.ci/deps.sh` installs it) passes on a page where every
//! family has samples, label values carry quotes, backslashes and
//! non-ASCII, and a local tokenizer is loaded.

use std::path::PathBuf;
use std::process::Stdio;

use kvroute_proto::keys::{BlockSize, block_keys};
use kvroute_proto::v1::{Mode, PickRequest};
use tokio::io::AsyncWriteExt;

use crate::harness::{
    Daemon, Publisher, endpoint, eventually, raw, replica, stored_batch, sync_live, tokens,
};

/// `$KVROUTE_PROMTOOL`, `promtool` on the PATH, or the one `.ci/deps.sh`
/// unpacks into `~/.cache/kvroute/promtool/`.
pub fn promtool() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KVROUTE_PROMTOOL") {
        return Some(PathBuf::from(p));
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("promtool"))
            .find(|p| p.is_file())
    });
    on_path.or_else(|| {
        let cached =
            PathBuf::from(std::env::var_os("HOME")?).join(".cache/kvroute/promtool/promtool");
        cached.is_file().then_some(cached)
    })
}

/// Runs `promtool check metrics` on `text`: its exit status and output.
async fn check(promtool: &PathBuf, text: &str) -> (bool, String) {
    let mut child = tokio::process::Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(text.as_bytes()).await.unwrap();
    drop(stdin);
    let out = child.wait_with_output().await.unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), said)
}

fn tiny_llama() -> Option<PathBuf> {
    let dir = std::env::var_os("KVROUTE_VLLM_MODEL").map_or_else(
        || {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/kvroute/tiny-llama")
        },
        PathBuf::from,
    );
    dir.join("tokenizer.json").is_file().then_some(dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promtool_accepts_the_metrics_page() {
    let Some(promtool) = promtool() else {
        assert!(
            std::env::var_os("CI").is_none(),
            "promtool is missing in CI: .ci/deps.sh installs it"
        );
        eprintln!(
            "SKIPPED promtool_accepts_the_metrics_page: no promtool (on the PATH, in \
             ~/.cache/kvroute/promtool/, or $KVROUTE_PROMTOOL); `bash .ci/deps.sh` installs it"
        );
        return;
    };
    // promtool itself must refuse what it should, or a pass means nothing.
    let (ok, said) = check(
        &promtool,
        "# HELP x_seconds A counter without _total.\n# TYPE x_seconds counter\nx_seconds 1\n",
    )
    .await;
    assert!(!ok && said.contains("_total"), "{said}");

    let mut p = Publisher::start(false).await;
    // A model name with every character a label value must escape.
    let odd = "o'brien \"q\" \\ é";
    let mut ep = endpoint(18401, Some(&p));
    ep.model = odd.into();
    let mut plain = endpoint(18402, None);
    plain.id.rank = Some(1);
    let tokenizer = tiny_llama();
    let dir = tokenizer.clone();
    let mut d = Daemon::start_with(vec![ep, plain], 16, move |c| {
        if let Some(dir) = dir {
            c.tokenize.tokenizers.push(
                indexd::config::tokenize::parse_flag(&format!("m={}", dir.display())).unwrap(),
            );
        }
    })
    .await;
    let seq = sync_live(&d, &mut p, 18401, 0).await;
    let t = tokens(32, 4);
    p.publish(seq, &stored_batch(&[1, 2], None, &t, 16, None))
        .await;
    eventually("the store", || async {
        d.handle.replica(&replica(18401)).unwrap().entries == 2
    })
    .await;
    let keys = raw(&block_keys(&t, BlockSize::new(16).unwrap(), None));
    d.pick_req(PickRequest {
        model: odd.into(),
        block_keys: keys,
        block_size: 16,
        mode: Mode::Precise as i32,
        key_scheme: kvroute_proto::SCHEME_VERSION.into(),
        ..PickRequest::default()
    })
    .await;
    let _ = d.pick(&[7], 16).await;

    let text = String::from_utf8(d.http_get("/metrics").await.unwrap()).unwrap();
    let (ok, said) = check(&promtool, &text).await;
    assert!(ok, "promtool check metrics:\n{said}\n--- page ---\n{text}");
    // The page had what it was meant to show.
    for family in [
        "indexd_decisions_total{",
        "indexd_pick_latency_seconds_bucket{",
        "indexd_replica_fresh{endpoint=\"127.0.0.1:18401\",model=\"o'brien \\\"q\\\" \\\\ é\"}",
        "indexd_replica_fresh{endpoint=\"127.0.0.1:18402#1\"",
        "indexd_kubernetes_endpoints ",
    ] {
        assert!(text.contains(family), "{family}\n{text}");
    }
    if tokenizer.is_some() {
        assert!(
            text.contains("indexd_tokenizer_gate{model=\"m\"}"),
            "{text}"
        );
    }
    d.stop().await;
}

/// The metric names a PromQL expression reads: identifiers that are not
/// functions, aggregations, keywords, label names (inside `{}` or after
/// `by`/`without`/`on`/`ignoring`/`group_*`), durations, numbers, strings or
/// Grafana variables.
fn metric_names(expr: &str) -> Vec<String> {
    let chars: Vec<char> = expr.chars().collect();
    let mut names = Vec::new();
    let mut i = 0;
    // The index after the `close` matching `chars[from]`, past quoted
    // strings (whose content may hold anything).
    let skip_to = |from: usize, close: char| {
        let mut j = from + 1;
        let mut quote: Option<char> = None;
        while j < chars.len() {
            match (quote, chars[j]) {
                (Some(_), '\\') => j += 1,
                (Some(q), c) if c == q => quote = None,
                (None, '"' | '\'' | '`') if !matches!(close, '"' | '\'' | '`') => {
                    quote = Some(chars[j]);
                }
                (None, c) if c == close => break,
                _ => {}
            }
            j += 1;
        }
        j + 1
    };
    let next_non_space = |from: usize| (from..chars.len()).find(|&j| !chars[j].is_whitespace());
    while i < chars.len() {
        let c = chars[i];
        match c {
            '"' | '\'' | '`' => i = skip_to(i, c),
            '{' => i = skip_to(i, '}'),
            '[' => i = skip_to(i, ']'),
            '$' => {
                i += 1;
                while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                    i += 1;
                }
            }
            c if c.is_ascii_digit() || c == '.' => {
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                    let exp = matches!(chars[i], 'e' | 'E');
                    i += 1;
                    if exp && i < chars.len() && matches!(chars[i], '+' | '-') {
                        i += 1;
                    }
                }
            }
            c if c.is_ascii_alphabetic() || c == '_' || c == ':' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
                {
                    i += 1;
                }
                let word: String = chars[start..i].iter().collect();
                let next = next_non_space(i);
                let next_word: String = next
                    .map(|j| {
                        chars[j..]
                            .iter()
                            .take_while(|c| c.is_ascii_alphabetic() || **c == '_')
                            .collect()
                    })
                    .unwrap_or_default();
                // A function or aggregation: `f(`, `sum by (…) (`.
                let paren = next.is_some_and(|j| chars[j] == '(')
                    || matches!(next_word.as_str(), "by" | "without");
                let label_list = matches!(
                    word.as_str(),
                    "by" | "without" | "on" | "ignoring" | "group_left" | "group_right"
                );
                let keyword = matches!(
                    word.as_str(),
                    "and" | "or" | "unless" | "bool" | "offset" | "atan2" | "inf" | "nan"
                );
                if label_list && paren {
                    i = skip_to(next.unwrap_or(i), ')');
                } else if !paren && !keyword && !label_list {
                    names.push(word);
                }
            }
            _ => i += 1,
        }
    }
    names
}

#[test]
fn the_promql_reader_finds_metric_names_only() {
    assert_eq!(
        metric_names(
            "histogram_quantile(0.99, sum by (le) (rate(a_bucket{x=\"y{z}\", w=~'v'}[5m]))) / 1e-9 \
             + on(i) group_left(j) b offset 5m + label_replace(e, \"l\", \"it's {x}\", \"m\", \"(.*)\") > bool 0.5 and c:rec or sum without(k) (d[$__rate_interval])"
        ),
        ["a_bucket", "b", "e", "c:rec", "d"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_names_only_exported_metrics() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../envoy/grafana/kvroute.json");
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert_eq!(dashboard["uid"], "kvroute");

    // What indexd exports: every family on a page with a local tokenizer
    // (its gate and cache families appear only then).
    let dir = tiny_llama().expect(
        "no tiny-llama tokenizer in ~/.cache/kvroute/tiny-llama (run .ci/deps.sh, or set KVROUTE_VLLM_MODEL)",
    );
    let d = Daemon::start_with(vec![endpoint(18411, None)], 16, move |c| {
        c.tokenize
            .tokenizers
            .push(indexd::config::tokenize::parse_flag(&format!("m={}", dir.display())).unwrap());
    })
    .await;
    let page = d.handle.metrics_text();
    d.stop().await;
    let mut exported = std::collections::BTreeSet::new();
    let histogram = |exported: &mut std::collections::BTreeSet<String>, name: &str| {
        for suffix in ["_bucket", "_sum", "_count"] {
            exported.insert(format!("{name}{suffix}"));
        }
    };
    for line in page.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let (name, kind) = rest.split_once(' ').unwrap();
        if kind == "histogram" {
            histogram(&mut exported, name);
        } else {
            exported.insert(name.to_owned());
        }
    }
    // What the filter exports through Envoy's /stats/prometheus: its own
    // names with '.' as '_' (filter/README.md).
    use kvroute_filter::metrics as fm;
    let envoy = |name: &str| name.replace('.', "_");
    for c in fm::Counter::all() {
        exported.insert(envoy(&c.name()));
    }
    for h in fm::Histogram::ALL {
        histogram(&mut exported, &envoy(h.name()));
    }
    for g in fm::Gauge::ALL {
        exported.insert(envoy(g.name()));
    }

    // Every query of every panel (rows hold panels too).
    let mut used = std::collections::BTreeSet::new();
    let mut panels: Vec<&serde_json::Value> =
        dashboard["panels"].as_array().unwrap().iter().collect();
    let mut queries = 0;
    while let Some(panel) = panels.pop() {
        if let Some(inner) = panel["panels"].as_array() {
            panels.extend(inner);
        }
        let mut ref_ids = std::collections::BTreeSet::new();
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().unwrap();
            assert!(
                ref_ids.insert(target["refId"].as_str().unwrap()),
                "{}: a repeated refId",
                panel["title"]
            );
            let names = metric_names(expr);
            assert!(!names.is_empty(), "{}: no metric in {expr}", panel["title"]);
            for name in names {
                assert!(
                    exported.contains(&name),
                    "panel {}: {name} is not exported (query: {expr})",
                    panel["title"]
                );
                used.insert(name);
            }
            queries += 1;
        }
    }
    assert!(queries >= 20, "{queries} queries");
    // What the dashboard is for: every reason, pick latency, index entries
    // and bytes, replica freshness, the tokenizer's path, the breaker.
    for reason in fm::Reason::ALL {
        assert!(
            used.contains(&format!("kvroute_decisions_{}", reason.label())),
            "{reason:?}"
        );
    }
    for name in [
        "indexd_decisions_total",
        "indexd_pick_latency_seconds_bucket",
        "kvroute_index_duration_us_bucket",
        "indexd_index_entries",
        "indexd_index_bytes",
        "indexd_replica_fresh",
        "indexd_tokenize_total",
        "indexd_tokenizer_gate",
        "kvroute_breaker_opened",
        "indexd_kubernetes_endpoints",
    ] {
        assert!(used.contains(name), "{name}");
    }
}
