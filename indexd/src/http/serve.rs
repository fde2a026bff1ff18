//! The HTTP listener's accept loop and connections, bounded against slow
//! and idle clients (`http_*` settings, [`crate::config::HttpServerConfig`]).
//!
//! axum's `serve` takes no limits, so indexd accepts and serves HTTP/1.1
//! connections itself with hyper's connection builder:
//!
//! - **Connection limit.** At most `http_max_connections` are open; one
//!   accepted beyond that is answered `503` (if the socket takes it without
//!   waiting) and closed at once, counted in
//!   `indexd_http_connections_refused_total`. Closing rather than waiting
//!   keeps the accept loop free and tells the client now; the kernel's
//!   backlog is not used as a queue.
//! - **Header timeout.** A request head must be complete within
//!   `http_header_read_timeout` of its first byte.
//! - **Idle timeout.** A connection with no request under way (none begun
//!   yet, or the last answered) on which no byte has been read or written
//!   for `http_idle_timeout` is closed: a kept-alive connection waiting for
//!   its next request, a new one that sends nothing, or a client that does
//!   not read its answer.
//! - **Body timeout.** A request body must be read whole within
//!   `http_body_read_timeout` of the end of its head; after that its handler
//!   sees a body error, the client is answered `408 Request Timeout`
//!   whatever the handler made of it, and the connection is not reused.
//!
//! Header and idle timeouts close the connection and count in
//! `indexd_http_timeouts_total{phase}` (header, idle), body timeouts in
//! `phase="body"`. While a handler runs (from the end of the head to its
//! answer) neither applies: handlers bound their own work (a replica's
//! tokenizer call by `tokenize.replica_timeout`).
//!
//! hyper's own `header_read_timeout` is off: hyper starts it when it begins
//! waiting for a request (at accept, and after each answer on a kept-alive
//! connection), so it would bound the idle wait too and leave no room for a
//! separate idle timeout. The timers here start the head's clock at its
//! first byte instead, as Go's `ReadHeaderTimeout` and `IdleTimeout` do.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use bytes::Bytes;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt as _;

use crate::config::HttpServerConfig;
use crate::state::Shared;
use crate::sync::{WarnGate, lock};

/// What a connection over the limit is told before it is closed.
const REFUSED: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\ncontent-length: 31\r\nconnection: close\r\n\r\ntoo many connections to indexd\n";

/// Serves `router` on `listener` until `stop` fires; then lets every open
/// connection finish the request it is on (idle ones close at once) and
/// returns when all have closed.
pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    shared: Arc<Shared>,
    stop: CancellationToken,
) {
    let limits = shared.config.http.clone();
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let connections = TaskTracker::new();
    let refused_warning = WarnGate::default();
    let accept_warning = WarnGate::default();
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) if is_per_connection(&e) => continue,
            Err(e) => {
                // Out of file descriptors, or memory: wait a moment rather
                // than spin on the error.
                if accept_warning.open() {
                    tracing::warn!(error = %e, "HTTP accept failed; retrying in 1 s");
                }
                tokio::select! {
                    () = stop.cancelled() => break,
                    () = tokio::time::sleep(Duration::from_secs(1)) => continue,
                }
            }
        };
        let Ok(permit) = Arc::clone(&permits).try_acquire_owned() else {
            shared.metrics.http_connections_refused.inc();
            if refused_warning.open() {
                tracing::warn!(%peer, http_max_connections = limits.max_connections, "HTTP connection refused: http_max_connections are open");
            }
            // Never waits: a socket whose buffer is full gets nothing.
            let _ = stream.try_write(REFUSED);
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        connections.spawn(connection(
            stream,
            router.clone(),
            Arc::clone(&shared),
            stop.clone(),
            permit,
        ));
    }
    drop(listener);
    connections.close();
    connections.wait().await;
}

/// Accept errors about one connection (it went before it was accepted):
/// the next accept is unaffected.
fn is_per_connection(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

/// Serves one connection until the client closes it, a timeout closes it,
/// or `stop` fires and its request in flight is answered. The permit is
/// held until then.
async fn connection(
    stream: TcpStream,
    router: Router,
    shared: Arc<Shared>,
    stop: CancellationToken,
    _permit: OwnedSemaphorePermit,
) {
    let limits = shared.config.http.clone();
    let activity = Arc::new(Activity::new(Instant::now()));
    let io = TokioIo::new(Watched {
        inner: stream,
        activity: Arc::clone(&activity),
    });
    let service = {
        let activity = Arc::clone(&activity);
        let shared = Arc::clone(&shared);
        hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
            let busy = Busy::begin(&activity);
            let body_limit = limits.body_read_timeout;
            let late = Arc::new(AtomicBool::new(false));
            let request = request.map(|b| {
                Body::new(TimedBody {
                    inner: b,
                    deadline: Instant::now() + body_limit,
                    limit: body_limit,
                    sleep: None,
                    shared: Arc::clone(&shared),
                    expired: false,
                    late: Arc::clone(&late),
                })
            });
            let answer = router.clone().oneshot(request);
            async move {
                let response = answer.await;
                drop(busy);
                if late.load(Ordering::Relaxed) {
                    return Ok(body_timeout_answer(body_limit));
                }
                response
            }
        })
    };
    let mut builder = http1::Builder::new();
    // The head's clock is kept here, from its first byte (module docs).
    builder.header_read_timeout(None);
    let conn = builder.serve_connection(io, service);
    tokio::pin!(conn);
    let mut draining = false;
    loop {
        let deadline = activity.deadline(&limits);
        let wait = async {
            match deadline {
                Some((at, _)) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(e) = result {
                    tracing::debug!(error = %e, "HTTP connection ended with an error");
                }
                return;
            }
            () = stop.cancelled(), if !draining => {
                conn.as_mut().graceful_shutdown();
                draining = true;
            }
            // A phase changed: the deadline may be earlier now.
            () = activity.changed.notified() => {}
            () = wait => {
                if let Some((at, phase)) = activity.deadline(&limits)
                    && at <= Instant::now()
                {
                    shared.metrics.http_timeouts.inc([phase]);
                    tracing::debug!(phase, "HTTP connection closed by its timeout");
                    // Dropping the connection closes the socket.
                    return;
                }
            }
        }
    }
}

/// Where a connection is, as its reads, writes and requests show.
#[derive(Debug)]
struct Activity {
    state: Mutex<Phase>,
    /// Woken when the deadline may have moved earlier.
    changed: Notify,
}

#[derive(Debug)]
struct Phase {
    /// Requests whose handler has not answered yet.
    busy: usize,
    /// When the first byte of the next request's head was read, if it has
    /// been and its head is not complete.
    head_since: Option<Instant>,
    /// The last byte read or written, or the last answer.
    last: Instant,
}

impl Activity {
    fn new(now: Instant) -> Self {
        Self {
            state: Mutex::new(Phase {
                busy: 0,
                head_since: None,
                last: now,
            }),
            changed: Notify::new(),
        }
    }

    /// When the connection is to be closed, and by which timeout; none
    /// while a handler runs.
    fn deadline(&self, limits: &HttpServerConfig) -> Option<(Instant, &'static str)> {
        let p = lock(&self.state);
        if p.busy > 0 {
            return None;
        }
        Some(match p.head_since {
            Some(t) => (t + limits.header_read_timeout, "header"),
            None => (p.last + limits.idle_timeout, "idle"),
        })
    }

    fn read(&self, bytes: usize) {
        if bytes == 0 {
            return;
        }
        let now = Instant::now();
        let mut p = lock(&self.state);
        p.last = now;
        if p.busy == 0 && p.head_since.is_none() {
            p.head_since = Some(now);
            drop(p);
            self.changed.notify_one();
        }
    }

    fn wrote(&self, bytes: usize) {
        if bytes > 0 {
            lock(&self.state).last = Instant::now();
        }
    }
}

/// A request between its head and its handler's answer.
struct Busy(Arc<Activity>);

impl Busy {
    fn begin(activity: &Arc<Activity>) -> Self {
        let mut p = lock(&activity.state);
        p.busy = p.busy.saturating_add(1);
        p.head_since = None;
        drop(p);
        Self(Arc::clone(activity))
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        let mut p = lock(&self.0.state);
        p.busy = p.busy.saturating_sub(1);
        if p.busy == 0 {
            p.last = Instant::now();
            drop(p);
            self.0.changed.notify_one();
        }
    }
}

/// The socket, noting each read and write in its [`Activity`].
struct Watched {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let result = Pin::new(&mut self.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = &result {
            self.activity
                .read(buf.filled().len().saturating_sub(before));
        }
        result
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = &result {
            self.activity.wrote(*n);
        }
        result
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = &result {
            self.activity.wrote(*n);
        }
        result
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A request body that must arrive whole by `deadline`.
struct TimedBody {
    inner: Incoming,
    deadline: Instant,
    limit: Duration,
    /// Armed at the first wait (a request without a body never needs it).
    sleep: Option<Pin<Box<Sleep>>>,
    shared: Arc<Shared>,
    expired: bool,
    /// Set when the deadline passes, for the answer (408).
    late: Arc<AtomicBool>,
}

/// What a client whose body was late is answered: 408, and the connection
/// closes (the rest of the body must not be read as a next request).
fn body_timeout_answer(limit: Duration) -> axum::response::Response {
    let mut answer = axum::response::Response::new(Body::from(format!("{}\n", BodyTimeout(limit))));
    *answer.status_mut() = axum::http::StatusCode::REQUEST_TIMEOUT;
    let headers = answer.headers_mut();
    headers.insert(
        axum::http::header::CONNECTION,
        axum::http::HeaderValue::from_static("close"),
    );
    headers.insert(
        axum::http::header::CONTENT_TYPE,
        axum::http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    answer
}

/// The error a handler sees when a body is late.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within {0:?} (http_body_read_timeout)")]
pub(crate) struct BodyTimeout(Duration);

impl hyper::body::Body for TimedBody {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        if this.expired {
            return Poll::Ready(Some(Err(Box::new(BodyTimeout(this.limit)))));
        }
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(axum::BoxError::from)));
        }
        let deadline = this.deadline;
        let sleep = this
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if sleep.as_mut().poll(cx).is_ready() {
            this.expired = true;
            this.late.store(true, Ordering::Relaxed);
            this.shared.metrics.http_timeouts.inc(["body"]);
            return Poll::Ready(Some(Err(Box::new(BodyTimeout(this.limit)))));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
#[path = "serve_tests.rs"]
mod tests;
