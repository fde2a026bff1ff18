//! indexd's `/metrics` as tools read it: `promtool check metrics` (from
//! Prometheus; `.ci/deps.sh` installs it) passes on a page where every
//! family has samples, label values carry quotes, backslashes and
//! non-ASCII, and a local tokenizer is loaded.

use std::path::PathBuf;
use std::process::Stdio;

use tokio::io::AsyncWriteExt;

use super::*;

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
                indexd::tokenize::config::parse_flag(&format!("m={}", dir.display())).unwrap(),
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
