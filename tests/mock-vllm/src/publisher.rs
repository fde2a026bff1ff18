//! The KV-event publisher: a ZMQ PUB socket plus a ROUTER replay socket, as vLLM's
//! `ZmqEventPublisher`.
//!
//! - Live: 3 frames `[topic, seq u64 BE, payload]`; `seq` counts from 0 per (simulated) process
//!   start and is assigned when a batch is published.
//! - Replay: a DEALER sends `["", start_seq 8 bytes BE]`; the ROUTER answers
//!   `["", topic, seq, payload]` for every buffered batch with `seq >= start_seq`, then the end
//!   marker `["", "", ff×8, ""]`. The buffer keeps the last `buffer_steps` batches.
//! - Fault controls ([`EventControls`]): pause (batches wait, unnumbered), delay each batch,
//!   drop the next N batches (numbered and buffered for replay, but never sent live — a seq gap),
//!   and [`Publisher::restart`] (seq back to 0, buffer and queued batches discarded).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::config::{EventsEndpoint, KvEventsConfig};
use crate::events::{END_SEQ, KvEvent, WireFormat, encode_batch};

/// The publisher could not start.
#[derive(Debug, thiserror::Error)]
pub enum PublisherError {
    #[error("binding the KV-event socket on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("ZMQ socket setup on {endpoint}: {source}")]
    Zmq {
        endpoint: String,
        source: zeromq::ZmqError,
    },
}

/// Runtime fault controls, shared with the admin API.
#[derive(Debug)]
pub struct EventControls {
    paused: watch::Sender<bool>,
    delay: watch::Sender<Duration>,
    drop_next: AtomicU64,
}

impl EventControls {
    fn new() -> Self {
        Self {
            paused: watch::channel(false).0,
            delay: watch::channel(Duration::ZERO).0,
            drop_next: AtomicU64::new(0),
        }
    }

    pub fn set_paused(&self, paused: bool) {
        self.paused.send_replace(paused);
    }

    pub fn paused(&self) -> bool {
        *self.paused.borrow()
    }

    /// Every batch is published this long after it was produced (a change applies to batches
    /// already waiting too).
    pub fn set_delay(&self, delay: Duration) {
        self.delay.send_replace(delay);
    }

    pub fn delay(&self) -> Duration {
        *self.delay.borrow()
    }

    /// The next `n` batches get a seq and go to the replay buffer, but are not sent live.
    pub fn drop_next(&self, n: u64) {
        self.drop_next.store(n, Ordering::Relaxed);
    }

    pub fn pending_drops(&self) -> u64 {
        self.drop_next.load(Ordering::Relaxed)
    }

    fn take_drop(&self) -> bool {
        self.drop_next
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok()
    }
}

/// Numbered batches kept for replay, and the next seq.
#[derive(Debug)]
struct Ring {
    epoch: u64,
    next_seq: u64,
    capacity: usize,
    entries: VecDeque<(u64, Bytes)>,
}

impl Ring {
    fn push(&mut self, payload: Bytes) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        if self.entries.len() == self.capacity {
            self.entries.pop_front();
        }
        self.entries.push_back((seq, payload));
        seq
    }
}

struct Batch {
    epoch: u64,
    produced: Instant,
    ts: f64,
    events: Vec<KvEvent>,
}

/// Handle to the running publisher.
#[derive(Debug)]
pub struct Publisher {
    tx: mpsc::UnboundedSender<Batch>,
    queued: AtomicU64,
    handled: watch::Receiver<u64>,
    ring: Arc<Mutex<Ring>>,
    controls: Arc<EventControls>,
    endpoint: String,
    replay_endpoint: Option<String>,
}

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch")
            .field("epoch", &self.epoch)
            .field("events", &self.events.len())
            .finish()
    }
}

fn lock(ring: &Mutex<Ring>) -> std::sync::MutexGuard<'_, Ring> {
    ring.lock().unwrap_or_else(PoisonError::into_inner)
}

fn bind_listener(addr: SocketAddr) -> Result<(std::net::TcpListener, SocketAddr), PublisherError> {
    let err = |source| PublisherError::Bind { addr, source };
    let listener = std::net::TcpListener::bind(addr).map_err(err)?;
    let local = listener.local_addr().map_err(err)?;
    Ok((listener, local))
}

fn zmq_err(endpoint: &str) -> impl FnOnce(zeromq::ZmqError) -> PublisherError + '_ {
    move |source| PublisherError::Zmq {
        endpoint: endpoint.to_owned(),
        source,
    }
}

impl Publisher {
    /// Binds (or starts connecting) the sockets and spawns the publishing and replay tasks.
    pub async fn start(
        config: &KvEventsConfig,
        cancel: CancellationToken,
    ) -> Result<(Self, Vec<JoinHandle<()>>), PublisherError> {
        let mut pub_socket = PubSocket::new();
        let (endpoint, connect_to) = match &config.endpoint {
            EventsEndpoint::Bind(addr) => {
                let (listener, local) = bind_listener(*addr)?;
                let ep = format!("tcp://{local}");
                pub_socket
                    .bind_listener(listener)
                    .await
                    .map_err(zmq_err(&ep))?;
                (ep, None)
            }
            EventsEndpoint::Connect(ep) => (ep.clone(), Some(ep.clone())),
        };
        let mut tasks = Vec::new();
        let ring = Arc::new(Mutex::new(Ring {
            epoch: 0,
            next_seq: 0,
            capacity: config.buffer_steps.max(1),
            entries: VecDeque::new(),
        }));
        let topic = Bytes::from(config.topic.clone().into_bytes());
        let replay_endpoint = match config.replay {
            Some(addr) => {
                let (listener, local) = bind_listener(addr)?;
                let ep = format!("tcp://{local}");
                let mut router = RouterSocket::new();
                router.bind_listener(listener).await.map_err(zmq_err(&ep))?;
                tasks.push(tokio::spawn(serve_replay(
                    router,
                    ring.clone(),
                    topic.clone(),
                    cancel.clone(),
                )));
                Some(ep)
            }
            None => None,
        };
        let controls = Arc::new(EventControls::new());
        let (tx, rx) = mpsc::unbounded_channel();
        let (handled_tx, handled) = watch::channel(0);
        let format = WireFormat {
            encoding: config.encoding,
            hash_form: config.hash_form,
            data_parallel_rank: (!config.omit_data_parallel_rank)
                .then_some(config.data_parallel_rank),
            batch_as_map: config.batch_as_map,
        };
        let worker = Worker {
            socket: pub_socket,
            connect_to,
            rx,
            ring: ring.clone(),
            controls: controls.clone(),
            topic,
            format,
            cancel,
            handled: handled_tx,
        };
        tasks.push(tokio::spawn(worker.run()));
        Ok((
            Self {
                tx,
                queued: AtomicU64::new(0),
                handled,
                ring,
                controls,
                endpoint,
                replay_endpoint,
            },
            tasks,
        ))
    }

    /// Queues one batch (one engine step's events).
    pub fn publish(&self, events: Vec<KvEvent>) {
        if events.is_empty() {
            return;
        }
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let epoch = lock(&self.ring).epoch;
        self.queued.fetch_add(1, Ordering::SeqCst);
        // A closed channel means the replica is shutting down: the batch is lost as in vLLM.
        let _ = self.tx.send(Batch {
            epoch,
            produced: Instant::now(),
            ts,
            events,
        });
    }

    /// Waits until every batch queued so far has been published, dropped or discarded. Blocks
    /// while events are paused; returns early if the publisher stopped.
    pub async fn flushed(&self) {
        let target = self.queued.load(Ordering::SeqCst);
        let mut handled = self.handled.clone();
        let _ = handled.wait_for(|n| *n >= target).await;
    }

    /// Simulates a process restart: seq back to 0, replay buffer and queued batches gone.
    pub fn restart(&self) {
        let mut ring = lock(&self.ring);
        ring.epoch += 1;
        ring.next_seq = 0;
        ring.entries.clear();
    }

    /// The seq the next published batch gets.
    pub fn next_seq(&self) -> u64 {
        lock(&self.ring).next_seq
    }

    pub fn controls(&self) -> &EventControls {
        &self.controls
    }

    /// `tcp://ip:port` the PUB socket is bound to (or connects to).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }
}

struct Worker {
    socket: PubSocket,
    connect_to: Option<String>,
    rx: mpsc::UnboundedReceiver<Batch>,
    ring: Arc<Mutex<Ring>>,
    controls: Arc<EventControls>,
    topic: Bytes,
    format: WireFormat,
    cancel: CancellationToken,
    handled: watch::Sender<u64>,
}

impl Worker {
    async fn run(mut self) {
        if let Some(ep) = self.connect_to.take() {
            tokio::select! {
                () = self.cancel.cancelled() => return,
                res = self.socket.connect(&ep) => {
                    if let Err(e) = res {
                        tracing::warn!(endpoint = %ep, error = %e, "KV-event PUB connect failed; events are only replayable");
                    }
                }
            }
        }
        loop {
            let batch = tokio::select! {
                () = self.cancel.cancelled() => break,
                b = self.rx.recv() => match b { Some(b) => b, None => break },
            };
            if !self.wait_turn(&batch).await {
                break;
            }
            self.handle(batch).await;
            self.handled.send_modify(|n| *n += 1);
        }
        let _ = self.socket.close().await;
    }

    /// Numbers, buffers and (unless dropped) sends one batch.
    async fn handle(&mut self, batch: Batch) {
        let payload = Bytes::from(encode_batch(batch.ts, &batch.events, self.format));
        let seq = {
            let mut ring = lock(&self.ring);
            if ring.epoch != batch.epoch {
                return; // produced before a restart: lost with the old process
            }
            ring.push(payload.clone())
        };
        if self.controls.take_drop() {
            tracing::debug!(seq, "dropping KV-event batch (fault control)");
            return;
        }
        let frames = vec![
            self.topic.clone(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload,
        ];
        if let Ok(msg) = ZmqMessage::try_from(frames)
            && let Err(e) = self.socket.send(msg).await
        {
            tracing::warn!(seq, error = %e, "KV-event send failed");
        }
    }

    /// Waits out pause and delay (re-checked whenever either control changes); false when
    /// cancelled.
    async fn wait_turn(&self, batch: &Batch) -> bool {
        let mut paused = self.controls.paused.subscribe();
        let mut delay = self.controls.delay.subscribe();
        loop {
            let is_paused = *paused.borrow_and_update();
            let due = batch.produced + *delay.borrow_and_update();
            if !is_paused && Instant::now() >= due {
                return true;
            }
            let wake = async {
                if is_paused {
                    std::future::pending::<()>().await;
                } else {
                    tokio::time::sleep_until(due.into()).await;
                }
            };
            tokio::select! {
                () = self.cancel.cancelled() => return false,
                () = wake => {}
                r = paused.changed() => if r.is_err() { return false },
                r = delay.changed() => if r.is_err() { return false },
            }
        }
    }
}

async fn serve_replay(
    mut router: RouterSocket,
    ring: Arc<Mutex<Ring>>,
    topic: Bytes,
    cancel: CancellationToken,
) {
    loop {
        let msg = tokio::select! {
            () = cancel.cancelled() => break,
            m = router.recv() => m,
        };
        let frames = match msg {
            Ok(m) => m.into_vec(),
            Err(e) => {
                tracing::debug!(error = %e, "replay recv failed");
                continue;
            }
        };
        let [identity, delimiter, start] = frames.as_slice() else {
            tracing::warn!(frames = frames.len(), "invalid replay request");
            continue;
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_ref()) else {
            tracing::warn!("replay start_seq is not 8 bytes");
            continue;
        };
        let start = u64::from_be_bytes(start);
        let batches: Vec<(u64, Bytes)> = lock(&ring)
            .entries
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .cloned()
            .collect();
        for (seq, payload) in batches {
            let reply = vec![
                identity.clone(),
                delimiter.clone(),
                topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload,
            ];
            if !send(&mut router, reply).await {
                break;
            }
        }
        let end = vec![
            identity.clone(),
            delimiter.clone(),
            Bytes::new(),
            Bytes::copy_from_slice(&END_SEQ),
            Bytes::new(),
        ];
        send(&mut router, end).await;
    }
    let _ = router.close().await;
}

async fn send(router: &mut RouterSocket, frames: Vec<Bytes>) -> bool {
    match ZmqMessage::try_from(frames) {
        Ok(msg) => match router.send(msg).await {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!(error = %e, "replay send failed");
                false
            }
        },
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_is_bounded_and_numbers_from_zero() {
        let mut r = Ring {
            epoch: 0,
            next_seq: 0,
            capacity: 2,
            entries: VecDeque::new(),
        };
        assert_eq!(r.push(Bytes::from_static(b"a")), 0);
        assert_eq!(r.push(Bytes::from_static(b"b")), 1);
        assert_eq!(r.push(Bytes::from_static(b"c")), 2);
        let seqs: Vec<_> = r.entries.iter().map(|(s, _)| *s).collect();
        assert_eq!(seqs, [1, 2]);
    }

    #[test]
    fn drop_counter_counts_down() {
        let c = EventControls::new();
        c.drop_next(2);
        assert!(c.take_drop());
        assert!(c.take_drop());
        assert!(!c.take_drop());
        assert_eq!(c.pending_drops(), 0);
    }
}
