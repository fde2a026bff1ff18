//! The discovery file: endpoints added and removed as the file changes, an
//! empty or broken file changing nothing, and an endpoint on indexd's own
//! HTTP port refused.

use std::time::Duration;

use crate::harness::{Daemon, endpoint, eventually, replica};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_discovery_file_adds_and_removes_endpoints() {
    let dir = std::env::temp_dir().join(format!("indexd-discovery-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("endpoints.yaml");
    // The file replaced whole (written beside it, renamed over it).
    let replace = |text: &str| {
        let tmp = dir.join("endpoints.yaml.tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, &path).unwrap();
    };
    let write = |ports: &[u16]| {
        let mut text = String::from("endpoints:\n");
        for port in ports {
            text.push_str(&format!("  - address: 127.0.0.1:{port}\n    model: m\n"));
        }
        replace(&text);
    };
    write(&[18020]);
    let p = path.clone();
    let mut d = Daemon::start_with(vec![endpoint(18022, None)], 16, move |c| {
        c.discovery_file = Some(p);
        c.discovery_interval = Duration::from_millis(20);
    })
    .await;
    eventually("the discovered endpoint", || async {
        d.handle.replica(&replica(18020)).is_some()
    })
    .await;
    assert_eq!(d.pick(&[1], 16).await.candidates.len(), 2);

    write(&[18021, 18023]);
    eventually("the file change", || async {
        d.handle.replica(&replica(18020)).is_none() && d.handle.replica(&replica(18023)).is_some()
    })
    .await;
    // An empty file is one being written: nothing changes (read as an
    // empty list it would drop every endpoint until the next poll).
    replace("");
    eventually("the empty file to be read", || async {
        d.counter("indexd_discovery_reloads_total{result=\"empty\"}") >= 1.0
    })
    .await;
    assert!(
        d.handle.replica(&replica(18021)).is_some() && d.handle.replica(&replica(18023)).is_some()
    );
    // A broken file keeps the previous endpoints; static ones are never removed.
    std::fs::write(&path, "endpoints: [ {address: nope} ]").unwrap();
    eventually("the broken file to be read", || async {
        d.counter("indexd_discovery_reloads_total{result=\"error\"}") >= 1.0
    })
    .await;
    assert!(
        d.handle.replica(&replica(18021)).is_some() && d.handle.replica(&replica(18023)).is_some()
    );
    write(&[]);
    eventually("the removal", || async {
        d.handle.replica(&replica(18021)).is_none()
    })
    .await;
    assert!(d.handle.replica(&replica(18022)).is_some());
    let names: Vec<String> = d
        .pick(&[1], 16)
        .await
        .candidates
        .into_iter()
        .map(|c| c.address)
        .collect();
    assert_eq!(names, ["127.0.0.1:18022"]);
    d.stop().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_discovered_endpoint_on_indexds_own_http_port_is_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("endpoints.yaml");
    let p = path.clone();
    // HTTP on every address, port 0: the port is known once bound.
    let d = Daemon::start_with(vec![], 16, move |c| {
        c.http_listen = "0.0.0.0:0".parse().unwrap();
        c.access.allow_unauthenticated = true;
        c.discovery_file = Some(p);
        c.discovery_interval = Duration::from_millis(20);
    })
    .await;
    let own = d.http.port();
    let tmp = dir.path().join("endpoints.yaml.tmp");
    std::fs::write(
        &tmp,
        format!(
            "endpoints:\n  - {{address: 127.0.0.1:{own}, model: m}}\n  - {{address: 127.0.0.1:18024, model: m}}\n"
        ),
    )
    .unwrap();
    std::fs::rename(&tmp, &path).unwrap();
    eventually("the other endpoint", || async {
        d.handle.replica(&replica(18024)).is_some()
    })
    .await;
    assert!(d.handle.replica(&replica(own)).is_none());
    assert_eq!(
        d.counter("indexd_endpoints_refused_total{reason=\"self\"}"),
        1.0
    );
    // And /readyz says so.
    let ready = reqwest::get(format!("http://127.0.0.1:{own}/readyz"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let line = ready
        .lines()
        .find(|l| l.starts_with("endpoints refused as indexd's own HTTP listener"))
        .unwrap_or_else(|| panic!("{ready}"));
    assert!(
        line.contains("1 since start") && line.contains(&format!("127.0.0.1:{own} now")),
        "{line}"
    );
    d.stop().await;
}
