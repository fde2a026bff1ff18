//! The trust boundary of a running indexd: gRPC over a Unix domain socket,
//! the shared token on gRPC and HTTP (not on the probes), and the binary
//! refusing to listen beyond loopback unprotected.

use std::os::unix::fs::{FileTypeExt as _, PermissionsExt as _};

use indexd::ListenAddr;
use kvroute_proto::v1::{DecisionKind, ObserveRequest, PickRequest};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::harness::{Daemon, TIMEOUT, endpoint, start_binary};

const TOKEN: &str = "kvroute-test-token-0123456789abcdef";

fn pick_req() -> PickRequest {
    PickRequest {
        model: "m".into(),
        block_keys: vec![1, 2],
        block_size: 16,
        key_scheme: kvroute_proto::SCHEME_VERSION.into(),
        ..PickRequest::default()
    }
}

fn with_token<T>(message: T, token: &str) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    request
}

/// `GET path` (`POST` for the tokenizer routes) over HTTP/1.1; the status.
async fn http_status(addr: std::net::SocketAddr, path: &str, token: Option<&str>) -> u16 {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let auth = token.map_or(String::new(), |t| format!("authorization: Bearer {t}\r\n"));
    let method = if path.starts_with("/v1/") || path == "/tokenize" {
        "POST"
    } else {
        "GET"
    };
    let request = format!(
        "{method} {path} HTTP/1.1\r\nhost: indexd\r\n{auth}content-length: 0\r\nconnection: close\r\n\r\n"
    );
    s.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(TIMEOUT, s.read_to_end(&mut answer))
        .await
        .unwrap()
        .unwrap();
    let text = String::from_utf8_lossy(&answer);
    text.split(' ').nth(1).unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pick_over_a_unix_socket() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("indexd.sock");
    let listen = ListenAddr::Unix(path.clone());
    let mut d = Daemon::start_with(vec![endpoint(18090, None)], 16, |c| {
        c.grpc_listen = listen.clone();
    })
    .await;
    // The client reached indexd through the socket file (tonic's Unix
    // connector: `unix:///…`), which only owner and group may open.
    let meta = std::fs::metadata(&path).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o660);
    let r = d.pick_req(pick_req()).await;
    assert_eq!(r.decision, DecisionKind::Load as i32);
    assert_eq!(r.candidates[0].address, "127.0.0.1:18090");
    d.client
        .observe(ObserveRequest {
            model: "m".into(),
            endpoint: "127.0.0.1:18090".into(),
            response_id: "resp_uds".into(),
            ..ObserveRequest::default()
        })
        .await
        .unwrap();
    d.stop().await;
    // Unlinked at shutdown.
    assert!(!path.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_guards_grpc_and_http_but_not_the_probes() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let mut d = Daemon::start_with(vec![endpoint(18091, None)], 16, |c| {
        c.access.auth_token_file = Some(token_file.clone());
    })
    .await;

    // gRPC: no token, a wrong one, another scheme → UNAUTHENTICATED.
    let err = d.client.pick(pick_req()).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
    assert!(!err.message().contains(TOKEN));
    let wrong = with_token(pick_req(), "kvroute-test-token-0123456789abcdeX");
    let err = d.client.pick(wrong).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
    let observe = ObserveRequest {
        model: "m".into(),
        endpoint: "127.0.0.1:18091".into(),
        response_id: "resp_1".into(),
        ..ObserveRequest::default()
    };
    let err = d.client.observe(observe.clone()).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
    // With it: answered.
    let r = d
        .client
        .pick(with_token(pick_req(), TOKEN))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.candidates[0].address, "127.0.0.1:18091");
    d.client.observe(with_token(observe, TOKEN)).await.unwrap();

    // HTTP: the probes stay open; /metrics and the tokenizer routes need it.
    assert_eq!(http_status(d.http, "/healthz", None).await, 200);
    assert_eq!(http_status(d.http, "/readyz", None).await, 200);
    assert_eq!(http_status(d.http, "/metrics", None).await, 401);
    assert_eq!(
        http_status(d.http, "/metrics", Some("wrong-token-0123456789")).await,
        401
    );
    assert_eq!(http_status(d.http, "/tokenize", None).await, 401);
    assert_eq!(http_status(d.http, "/v1/responses/render", None).await, 401);
    assert_eq!(http_status(d.http, "/metrics", Some(TOKEN)).await, 200);
    assert_eq!(
        d.counter("indexd_auth_failures_total{listener=\"grpc\"}"),
        3.0
    );
    assert_eq!(
        d.counter("indexd_auth_failures_total{listener=\"http\"}"),
        4.0
    );
    assert_eq!(d.counter("indexd_observes_total{result=\"recorded\"}"), 1.0);
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_refuses_an_open_listener_without_a_token() {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_indexd"))
        .args(["--grpc-listen", "0.0.0.0:0", "--http-listen", "127.0.0.1:0"])
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(TIMEOUT, out).await.unwrap().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("grpc_listen")
            && stderr.contains("auth_token_file")
            && stderr.contains("allow_unauthenticated"),
        "{stderr}"
    );

    // On a socket it serves, and says where.
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("indexd.sock");
    let listen = format!("unix://{}", socket.display());
    let (mut child, v) =
        start_binary(&["--grpc-listen", &listen, "--http-listen", "127.0.0.1:0"]).await;
    assert_eq!(v["grpc"], format!("unix://{}", socket.display()));
    assert!(socket.exists());
    child.kill().await.unwrap();
}
