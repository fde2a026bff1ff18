//! The HTTP server's bounds on real sockets: a stalled head, a silent or
//! kept-alive connection, a late body, one connection too many. Every wait
//! has a generous upper bound; none asserts how fast a timeout fired.

use std::net::SocketAddr;

use axum::routing::{get, post};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use super::*;
use crate::config::Config;

/// Far longer than any timeout configured here.
const BOUND: Duration = Duration::from_secs(10);

struct Server {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: CancellationToken,
    served: tokio::task::JoinHandle<()>,
}

impl Server {
    async fn start(tweak: impl FnOnce(&mut HttpServerConfig)) -> Self {
        let mut config = Config::new(Vec::new());
        tweak(&mut config.http);
        let shared = Arc::new(Shared::new(config, CancellationToken::new()));
        let router = Router::new()
            .route("/healthz", get(|| async { "ok\n" }))
            .route(
                "/slow",
                get(|| async {
                    tokio::time::sleep(Duration::from_millis(900)).await;
                    "slow\n"
                }),
            )
            .route(
                "/echo",
                post(|body: Bytes| async move { format!("{}\n", body.len()) }),
            );
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let served = tokio::spawn(serve(listener, router, Arc::clone(&shared), stop.clone()));
        Self {
            addr,
            shared,
            stop,
            served,
        }
    }

    async fn connect(&self) -> TcpStream {
        TcpStream::connect(self.addr).await.unwrap()
    }

    fn timeouts(&self, phase: &'static str) -> u64 {
        self.shared.metrics.http_timeouts.get([phase])
    }

    async fn stop(self) {
        self.stop.cancel();
        tokio::time::timeout(BOUND, self.served)
            .await
            .expect("the server stops with connections open")
            .unwrap();
    }
}

/// Reads until the peer closes (or resets) the connection; panics if it is
/// still open after [`BOUND`].
async fn until_closed(conn: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    let mut chunk = [0u8; 1024];
    let deadline = Instant::now() + BOUND;
    loop {
        match tokio::time::timeout_at(deadline, conn.read(&mut chunk)).await {
            Err(_) => panic!("the connection is still open after {BOUND:?}"),
            Ok(Ok(0) | Err(_)) => return got,
            Ok(Ok(n)) => got.extend_from_slice(&chunk[..n]),
        }
    }
}

/// Reads one response (head and a `content-length` body): its status and
/// body.
async fn response(conn: &mut TcpStream) -> (u16, String) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 1024];
    let deadline = Instant::now() + BOUND;
    let mut read = async |buf: &mut Vec<u8>| {
        let n = tokio::time::timeout_at(deadline, conn.read(&mut chunk))
            .await
            .expect("an answer within the bound")
            .unwrap();
        assert!(
            n > 0,
            "closed before the answer: {}",
            String::from_utf8_lossy(buf)
        );
        buf.extend_from_slice(&chunk[..n]);
    };
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        read(&mut buf).await;
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let status = head[9..12].parse().unwrap();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .map_or(0, |v| v.trim().parse().unwrap());
    while buf.len() < head_end + length {
        read(&mut buf).await;
    }
    let body = String::from_utf8_lossy(&buf[head_end..head_end + length]).into_owned();
    (status, body)
}

async fn get_on(conn: &mut TcpStream, path: &str) -> (u16, String) {
    conn.write_all(format!("GET {path} HTTP/1.1\r\nhost: indexd\r\n\r\n").as_bytes())
        .await
        .unwrap();
    response(conn).await
}

#[tokio::test]
async fn a_head_that_stalls_halfway_is_cut_off() {
    let server = Server::start(|h| {
        h.header_read_timeout = Duration::from_millis(200);
        h.idle_timeout = Duration::from_secs(60);
    })
    .await;
    let mut stalled = server.connect().await;
    stalled
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: indexd\r\nx-slow: ")
        .await
        .unwrap();
    let said = until_closed(&mut stalled).await;
    assert!(said.is_empty(), "{}", String::from_utf8_lossy(&said));
    assert_eq!(server.timeouts("header"), 1);
    assert_eq!(server.timeouts("idle"), 0);
    // A client that sends its head at once is served.
    let mut prompt = server.connect().await;
    assert_eq!(get_on(&mut prompt, "/healthz").await, (200, "ok\n".into()));
    server.stop().await;
}

#[tokio::test]
async fn silent_and_kept_alive_connections_close_after_the_idle_timeout() {
    let server = Server::start(|h| {
        h.header_read_timeout = Duration::from_secs(60);
        h.idle_timeout = Duration::from_millis(300);
    })
    .await;
    // Connected, nothing sent.
    let mut silent = server.connect().await;
    assert!(until_closed(&mut silent).await.is_empty());
    assert_eq!(server.timeouts("idle"), 1);
    // A handler that runs three idle timeouts long is not idle: answered.
    let mut kept = server.connect().await;
    assert_eq!(get_on(&mut kept, "/slow").await, (200, "slow\n".into()));
    // Kept alive after its answer, then idle: closed.
    assert_eq!(get_on(&mut kept, "/healthz").await, (200, "ok\n".into()));
    assert!(until_closed(&mut kept).await.is_empty());
    assert_eq!(server.timeouts("idle"), 2);
    assert_eq!(server.timeouts("header"), 0);
    server.stop().await;
}

#[tokio::test]
async fn a_body_that_does_not_arrive_in_time_fails_its_request() {
    let server = Server::start(|h| {
        h.body_read_timeout = Duration::from_millis(200);
    })
    .await;
    let mut whole = server.connect().await;
    whole
        .write_all(b"POST /echo HTTP/1.1\r\nhost: indexd\r\ncontent-length: 10\r\n\r\n0123456789")
        .await
        .unwrap();
    assert_eq!(response(&mut whole).await, (200, "10\n".into()));
    let mut late = server.connect().await;
    late.write_all(b"POST /echo HTTP/1.1\r\nhost: indexd\r\ncontent-length: 10\r\n\r\n012")
        .await
        .unwrap();
    let (status, body) = response(&mut late).await;
    assert_eq!(status, 408, "{body}");
    assert!(body.contains("http_body_read_timeout"), "{body}");
    assert_eq!(server.timeouts("body"), 1);
    // The rest of that body will not be read as a next request: closed.
    assert!(until_closed(&mut late).await.is_empty());
    assert_eq!(server.timeouts("idle") + server.timeouts("header"), 0);
    server.stop().await;
}

#[tokio::test]
async fn a_connection_over_the_limit_is_refused_and_counted() {
    let server = Server::start(|h| {
        h.max_connections = 2;
        h.idle_timeout = Duration::from_secs(60);
    })
    .await;
    // Two connections held open, each proven accepted by an answer.
    let mut first = server.connect().await;
    let mut second = server.connect().await;
    assert_eq!(get_on(&mut first, "/healthz").await.0, 200);
    assert_eq!(get_on(&mut second, "/healthz").await.0, 200);
    let mut third = server.connect().await;
    let said = String::from_utf8_lossy(&until_closed(&mut third).await).into_owned();
    assert!(said.starts_with("HTTP/1.1 503 "), "{said}");
    assert_eq!(server.shared.metrics.http_connections_refused.get(), 1);
    // The two are still served.
    assert_eq!(get_on(&mut second, "/healthz").await.0, 200);
    // One closes: its slot is free again (once its task has seen the close).
    drop(first);
    let deadline = Instant::now() + BOUND;
    let mut next = loop {
        let mut conn = server.connect().await;
        if conn
            .write_all(b"GET /healthz HTTP/1.1\r\nhost: indexd\r\n\r\n")
            .await
            .is_ok()
        {
            let mut peek = [0u8; 12];
            if conn.read_exact(&mut peek).await.is_ok() && &peek[9..12] == b"200" {
                break conn;
            }
        }
        assert!(Instant::now() < deadline, "no slot freed within {BOUND:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let _ = next.shutdown().await;
    // Stopping closes the idle connections and returns.
    server.stop().await;
    assert!(until_closed(&mut second).await.is_empty());
}

#[test]
fn the_refusal_declares_its_body_length() {
    let text = std::str::from_utf8(REFUSED).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let declared: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(declared, body.len());
}
