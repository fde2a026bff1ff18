//! Peers that fail mid-answer: an HTTP/1.1 tokenizer and an HTTP/2 gRPC
//! indexd whose next answers break in a scripted way (headers then a reset,
//! headers then a stall, a reset before any header, garbage after the
//! headers), or answer well.

use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use socket2::SockRef;

use super::{Req, read_request};

/// How long a stalling peer holds its answer: well past the filter's
/// callout timeouts, bounded so the test ends.
pub const STALL: Duration = Duration::from_millis(2500);

/// What a faulty peer does with its next answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Answer well.
    None,
    /// Send the response headers and part of the body, then reset.
    HeadersThenReset,
    /// Send the response headers and part of the body, then stall.
    HeadersThenStall,
    /// Reset before any response header.
    ResetBeforeHeaders,
    /// Send the response headers, then bytes that break the framing.
    GarbageAfterHeaders,
}

/// Every fault, in the order tests walk them.
pub const FAULTS: [Fault; 4] = [
    Fault::HeadersThenReset,
    Fault::HeadersThenStall,
    Fault::ResetBeforeHeaders,
    Fault::GarbageAfterHeaders,
];

#[derive(Debug, Clone)]
struct Shared {
    fault: Arc<Mutex<Fault>>,
    seen: Arc<Mutex<Vec<Req>>>,
}

impl Shared {
    fn new() -> Self {
        Self {
            fault: Arc::new(Mutex::new(Fault::None)),
            seen: Arc::new(Mutex::new(Vec::new())),
        }
    }

    fn fault(&self) -> Fault {
        *self.fault.lock().unwrap()
    }
}

/// An HTTP/1.1 server answering every request with `body` (a tokenizer),
/// unless a fault is set.
#[derive(Debug, Clone)]
pub struct FaultyHttp {
    shared: Shared,
}

impl FaultyHttp {
    /// Starts it on `127.0.0.1:0`.
    pub fn start(content_type: &'static str, body: Vec<u8>) -> (Self, SocketAddr) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Shared::new();
        let s = shared.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { return };
                let (s, body) = (s.clone(), body.clone());
                std::thread::spawn(move || http_connection(stream, &s, content_type, &body));
            }
        });
        (Self { shared }, addr)
    }

    /// Sets what the next answers do.
    pub fn set(&self, fault: Fault) {
        *self.shared.fault.lock().unwrap() = fault;
    }

    /// Requests received so far.
    pub fn requests(&self) -> usize {
        self.shared.seen.lock().unwrap().len()
    }
}

/// Closes with a TCP reset (RST) rather than a FIN.
fn reset(stream: TcpStream) {
    let _ = SockRef::from(&stream).set_linger(Some(Duration::ZERO));
    drop(stream);
}

fn http_connection(stream: TcpStream, shared: &Shared, content_type: &str, body: &[u8]) {
    let mut reader = std::io::BufReader::new(stream.try_clone().unwrap());
    let mut writer = stream;
    while let Some(req) = read_request(&mut reader) {
        shared.seen.lock().unwrap().push(req);
        let half = body.get(..body.len() / 2).unwrap_or_default();
        // Announces more than is sent: the body is cut short.
        let partial_head = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n\r\n",
            body.len() + 64
        );
        match shared.fault() {
            Fault::None => {
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n\r\n",
                    body.len()
                );
                if writer.write_all(head.as_bytes()).is_err() || writer.write_all(body).is_err() {
                    return;
                }
            }
            Fault::HeadersThenReset => {
                let _ = writer.write_all(partial_head.as_bytes());
                let _ = writer.write_all(half);
                let _ = writer.flush();
                std::thread::sleep(Duration::from_millis(20));
                return reset(writer);
            }
            Fault::HeadersThenStall => {
                let _ = writer.write_all(partial_head.as_bytes());
                let _ = writer.write_all(half);
                let _ = writer.flush();
                std::thread::sleep(STALL);
                return;
            }
            Fault::ResetBeforeHeaders => return reset(writer),
            Fault::GarbageAfterHeaders => {
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ntransfer-encoding: chunked\r\n\r\n"
                );
                let _ = writer.write_all(head.as_bytes());
                let _ = writer.write_all(b"zz-not-a-chunk-size\r\n\xff\xfe\x00garbage\r\n");
                let _ = writer.flush();
                std::thread::sleep(Duration::from_millis(20));
                return;
            }
        }
    }
}

/// An HTTP/2 gRPC server answering every unary call with `message` (a Pick
/// answer; Observe calls get the same bytes, which the filter ignores),
/// unless a fault is set.
#[derive(Debug, Clone)]
pub struct FaultyGrpc {
    shared: Shared,
}

impl FaultyGrpc {
    /// Starts it on `127.0.0.1:0`, served by its own runtime thread.
    pub fn start(message: Vec<u8>) -> (Self, SocketAddr) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Shared::new();
        let s = shared.clone();
        let message = Bytes::from(message);
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                loop {
                    let Ok((socket, _)) = listener.accept().await else {
                        return;
                    };
                    let (s, message) = (s.clone(), message.clone());
                    tokio::spawn(async move { grpc_connection(socket, s, message).await });
                }
            });
        });
        (Self { shared }, addr)
    }

    /// Sets what the next answers do.
    pub fn set(&self, fault: Fault) {
        *self.shared.fault.lock().unwrap() = fault;
    }

    /// Calls received so far whose path ends with `suffix`.
    pub fn calls(&self, suffix: &str) -> usize {
        let seen = self.shared.seen.lock().unwrap();
        seen.iter().filter(|r| r.path.ends_with(suffix)).count()
    }
}

async fn grpc_connection(socket: tokio::net::TcpStream, shared: Shared, message: Bytes) {
    let Ok(mut conn) = h2::server::handshake(socket).await else {
        return;
    };
    while let Some(Ok((request, respond))) = conn.accept().await {
        let (s, message) = (shared.clone(), message.clone());
        tokio::spawn(async move { grpc_call(request, respond, s, message).await });
    }
}

/// The gRPC length-prefixed framing of one message.
fn grpc_frame(message: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(message.len() + 5);
    out.push(0);
    out.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
    out.extend_from_slice(message);
    out.into()
}

async fn grpc_call(
    request: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<Bytes>,
    shared: Shared,
    message: Bytes,
) {
    let path = request.uri().path().to_owned();
    let mut body = request.into_body();
    let mut received = Vec::new();
    while let Some(Ok(chunk)) = body.data().await {
        let _ = body.flow_control().release_capacity(chunk.len());
        received.extend_from_slice(&chunk);
    }
    shared.seen.lock().unwrap().push(Req {
        path,
        headers: Vec::new(),
        body: received,
    });
    let fault = shared.fault();
    if fault == Fault::ResetBeforeHeaders {
        respond.send_reset(h2::Reason::INTERNAL_ERROR);
        return;
    }
    let head = http::Response::builder()
        .status(200)
        .header("content-type", "application/grpc")
        .body(())
        .unwrap();
    let Ok(mut send) = respond.send_response(head, false) else {
        return;
    };
    let frame = grpc_frame(&message);
    let half = frame.slice(..frame.len() / 2);
    match fault {
        Fault::None | Fault::ResetBeforeHeaders => {
            let _ = send.send_data(frame, false);
            let mut trailers = http::HeaderMap::new();
            trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
            let _ = send.send_trailers(trailers);
        }
        Fault::HeadersThenReset => {
            let _ = send.send_data(half, false);
            tokio::time::sleep(Duration::from_millis(20)).await;
            send.send_reset(h2::Reason::INTERNAL_ERROR);
        }
        Fault::HeadersThenStall => {
            let _ = send.send_data(half, false);
            tokio::time::sleep(STALL).await;
            send.send_reset(h2::Reason::CANCEL);
        }
        Fault::GarbageAfterHeaders => {
            // A frame header claiming a compression flag that does not exist
            // and a 4 GiB message, then a clean end.
            let _ = send.send_data(Bytes::from_static(b"\x07\xff\xff\xff\xffgarbage"), false);
            let mut trailers = http::HeaderMap::new();
            trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
            let _ = send.send_trailers(trailers);
        }
    }
}
