//! One task per endpoint: a ZMTP SUB on the replica's KV-event publisher
//! (see [`crate::zmtp`]), with sequence tracking and replay over DEALER.
//!
//! - Start-up and every reconnect: purge the replica (what we held may be
//!   stale: the engine may have restarted while we were away) and replay from
//!   seq 0, recovering whatever the publisher's buffer still holds.
//! - A jump in seq: replay from the next missing seq. Replies come with or
//!   without the topic frame (vLLM ≥ 0.26 / older); the end marker has seq
//!   `ff × 8`. If the replay is unavailable or does not cover the gap, purge
//!   the replica and carry on from the live seq.
//! - A drop in seq (outside the window of batches a replay just delivered):
//!   the engine restarted with an empty cache — purge, then replay from 0.
//! - Freshness: subscribed, start-up replay done, no unrecovered gap.
//! - Connecting out, a lost connection ends the session; with
//!   `events_bind`, indexd accepts any publisher, and when the last one is
//!   gone the replica is stale until one is back (then it resyncs).
//! - A connection closed for a protocol violation (an oversized frame
//!   header, a bad greeting, ...) is counted in `indexd_zmtp_violations_total`
//!   and logged at most every 10 s per replica, naming the peer; the other
//!   connections and replicas are not affected.
//!
//! The task ends when the replica's `CancellationToken` fires; a failing
//! session is retried with bounded exponential backoff.

use std::collections::VecDeque;
use std::fmt::Display;
use std::future::Future;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::time::{Instant, timeout_at};

use crate::error::SubscribeError;
use crate::state::{Replica, Shared};
use crate::wire::{self, DecodeError, REPLAY_END_SEQ};
use crate::zmtp::{self, Connection, Endpoint, Frame, Role, SubEvent, SubListener, ZmtpError};

/// Most batches accepted from one replay (vLLM buffers 10,000).
pub const MAX_REPLAY_BATCHES: usize = 20_000;

/// How long connecting plus the ZMTP handshake may take (a bound publisher
/// that does not finish its handshake in time is dropped).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Runs the subscription of `replica` until it is cancelled.
pub async fn run(shared: Arc<Shared>, replica: Arc<Replica>) {
    let Some(endpoint) = replica.config.events.clone() else {
        return;
    };
    let cancel = replica.cancel.clone();
    let initial = Duration::from_millis(100);
    let mut backoff = initial;
    // Once a session got its socket, later ones count their purge as a resync.
    let mut reconnect = false;
    loop {
        let started = Instant::now();
        let result = tokio::select! {
            () = cancel.cancelled() => return,
            r = session(&shared, &replica, &endpoint, &mut reconnect) => r,
        };
        replica.set_fresh(false);
        if let Err(e) = result {
            tracing::warn!(endpoint = %replica.id(), events = %endpoint, error = %e, "KV-event subscription failed; retrying");
        }
        if started.elapsed() > shared.config.max_backoff {
            backoff = initial;
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(shared.config.max_backoff);
    }
}

/// The transport options every connection of this daemon gets.
fn options(shared: &Shared) -> zmtp::Options {
    let limits = &shared.config.limits;
    zmtp::Options {
        limits: limits.into(),
        handshake_timeout: HANDSHAKE_TIMEOUT,
        max_connections: limits.max_publisher_connections,
    }
}

/// Counts and (sparingly) logs a connection closed for what its peer did.
fn report_violation(shared: &Shared, replica: &Replica, peer: &dyn Display, error: &ZmtpError) {
    let Some(reason) = error.violation() else {
        return;
    };
    shared.metrics.zmtp_violations.inc([reason]);
    if replica.may_warn() {
        tracing::warn!(endpoint = %replica.id(), peer = %peer, error = %error, "closed a ZMTP connection for a protocol violation (further warnings for 10 s suppressed; see indexd_zmtp_violations_total)");
    }
}

async fn session(
    shared: &Shared,
    replica: &Replica,
    endpoint: &str,
    reconnect: &mut bool,
) -> Result<(), SubscribeError> {
    let endpoint = Endpoint::parse(endpoint).map_err(ZmtpError::from)?;
    let options = options(shared);
    let replay = ZmqReplay::new(shared, replica);
    if replica.config.events_bind {
        let sub = SubListener::bind(&endpoint, options).await?;
        tracing::info!(endpoint = %replica.id(), events = %endpoint, local = %sub.local_addr(), "listening for KV-event publishers");
        let mut stream = Stream::new(shared, replica, replay);
        stream.resync(std::mem::replace(reconnect, true)).await;
        return bound_session(shared, replica, sub, stream).await;
    }
    let mut sub = match zmtp::connect_sub(&endpoint, &options).await {
        Ok(sub) => sub,
        Err(e) => {
            report_violation(shared, replica, &endpoint, &e);
            return Err(e.into());
        }
    };
    tracing::info!(endpoint = %replica.id(), events = %endpoint, peer = %sub.peer(), "subscribed to KV events");
    let mut stream = Stream::new(shared, replica, replay);
    stream.resync(std::mem::replace(reconnect, true)).await;
    loop {
        match sub.recv().await {
            Ok(frames) => stream.on_live(frames).await,
            Err(e) => {
                report_violation(shared, replica, &sub.peer(), &e);
                return Err(e.into());
            }
        }
    }
}

/// A bound SUB: publishers come and go; losing the last one makes the
/// replica stale, and the next one to come up triggers a resync.
async fn bound_session(
    shared: &Shared,
    replica: &Replica,
    mut sub: SubListener,
    mut stream: Stream<'_, ZmqReplay<'_>>,
) -> Result<(), SubscribeError> {
    let mut peers = 0usize;
    let mut lost_peer = false;
    loop {
        match sub.next().await {
            // Logged at info only when the first publisher comes or the last
            // one goes: a peer connecting in a loop cannot flood the log.
            SubEvent::Up(peer) => {
                peers += 1;
                if lost_peer {
                    lost_peer = false;
                    tracing::info!(endpoint = %replica.id(), %peer, "KV-event publisher back; resyncing");
                    stream.resync(true).await;
                } else if peers == 1 {
                    tracing::info!(endpoint = %replica.id(), %peer, "KV-event publisher connected");
                } else {
                    tracing::debug!(endpoint = %replica.id(), %peer, peers, "another KV-event publisher connected");
                }
            }
            SubEvent::Message(frames) => stream.on_live(frames).await,
            SubEvent::Down { peer, error } => {
                report_violation(shared, replica, &peer, &error);
                peers = peers.saturating_sub(1);
                if peers == 0 {
                    lost_peer = true;
                    replica.set_fresh(false);
                    tracing::info!(endpoint = %replica.id(), %peer, reason = %error, "KV-event publisher disconnected; none left");
                } else {
                    tracing::debug!(endpoint = %replica.id(), %peer, reason = %error, peers, "KV-event publisher disconnected");
                }
            }
            SubEvent::Refused { peer, error } => report_violation(shared, replica, &peer, &error),
            SubEvent::AcceptFailed(error) => {
                if replica.may_warn() {
                    tracing::warn!(endpoint = %replica.id(), %error, "accepting a KV-event publisher failed");
                }
            }
        }
    }
}

/// What a live seq means given what has been applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The next batch (or the first one seen): apply it.
    Apply,
    /// Already applied by a replay: skip.
    Duplicate,
    /// Batches `from..seq` are missing.
    Gap {
        /// The first missing seq.
        from: u64,
    },
    /// The publisher restarted.
    Restart,
}

/// Sequence bookkeeping of one stream.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tracker {
    /// The seq expected next (None: nothing applied yet).
    pub next: Option<u64>,
    /// `(seq, payload digest)` of the batches the last replay delivered, in
    /// seq order: a live copy of one of them is a duplicate, anything else
    /// below `next` is a restarted engine. Cleared once live seqs pass `next`.
    replayed: VecDeque<(u64, u64)>,
}

/// A digest of a payload, to tell a replayed batch's live copy from a
/// restarted engine's batch with the same seq.
pub fn digest(payload: &[u8]) -> u64 {
    let mut h = DefaultHasher::new();
    payload.hash(&mut h);
    h.finish()
}

/// [`digest`] of a payload frame (an oversized one by its length).
fn frame_digest(payload: &Frame) -> u64 {
    match payload {
        Frame::Data(b) => digest(b),
        Frame::Oversized(len) => {
            let mut h = DefaultHasher::new();
            ("oversized", len).hash(&mut h);
            h.finish()
        }
    }
}

impl Tracker {
    /// Classifies a live batch.
    pub fn classify(&mut self, seq: u64, digest: u64) -> Verdict {
        let Some(next) = self.next else {
            return Verdict::Apply;
        };
        if seq >= next {
            self.replayed.clear();
            return if seq == next {
                Verdict::Apply
            } else {
                Verdict::Gap { from: next }
            };
        }
        match self.replayed.binary_search_by_key(&seq, |(s, _)| *s) {
            Ok(i) if self.replayed.get(i).is_some_and(|(_, d)| *d == digest) => Verdict::Duplicate,
            _ => Verdict::Restart,
        }
    }

    /// Records that batch `seq` was applied.
    pub fn applied(&mut self, seq: u64) {
        self.next = Some(seq.saturating_add(1));
    }

    /// Records a batch a replay delivered (bounded).
    pub fn note_replayed(&mut self, seq: u64, digest: u64) {
        if self.replayed.back().is_some_and(|(s, _)| *s >= seq) {
            self.replayed.clear();
        }
        if self.replayed.len() >= MAX_REPLAY_BATCHES {
            self.replayed.pop_front();
        }
        self.replayed.push_back((seq, digest));
    }
}

/// How a replay went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ReplayResult {
    /// Every batch from the requested seq to the end of the buffer.
    Complete,
    /// The buffer no longer held the first batches, or the replay broke off.
    Incomplete,
    /// No replay endpoint, or it did not answer.
    Unavailable,
}

/// Where replays come from: the replica's ROUTER over a DEALER
/// ([`ZmqReplay`]), or a test double.
pub trait Replay {
    /// Asks for every buffered batch from `from` on; false if no replay is
    /// possible (no endpoint, connect failed).
    fn request(&mut self, from: u64) -> impl Future<Output = bool> + Send;
    /// The frames of the next reply, `None` once the replay broke off
    /// (timeout, socket error). The end marker is a reply like any other.
    fn next_reply(&mut self) -> impl Future<Output = Option<Vec<Frame>>> + Send;
}

/// Replays over a fresh DEALER connection per request (the replica's
/// `replay` endpoint), bounded by `replay_timeout`.
pub struct ZmqReplay<'a> {
    shared: &'a Shared,
    replica: &'a Replica,
    endpoint: Option<Endpoint>,
    dealer: Option<Connection>,
    deadline: Instant,
}

impl std::fmt::Debug for ZmqReplay<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZmqReplay")
            .field("endpoint", &self.endpoint)
            .field("connected", &self.dealer.is_some())
            .finish()
    }
}

impl<'a> ZmqReplay<'a> {
    /// Replays from `replica`'s `replay` endpoint (none: replay impossible).
    pub fn new(shared: &'a Shared, replica: &'a Replica) -> Self {
        // Validated with the config: an endpoint that does not parse is
        // treated as none.
        let endpoint = replica
            .config
            .replay
            .as_deref()
            .and_then(|e| Endpoint::parse(e).ok());
        Self {
            shared,
            replica,
            endpoint,
            dealer: None,
            deadline: Instant::now(),
        }
    }
}

impl Replay for ZmqReplay<'_> {
    async fn request(&mut self, from: u64) -> bool {
        self.dealer = None;
        let Some(endpoint) = self.endpoint.clone() else {
            return false;
        };
        self.deadline = Instant::now() + self.shared.config.replay_timeout;
        let options = options(self.shared);
        let connected = timeout_at(
            self.deadline,
            zmtp::connect(&endpoint, Role::Dealer, &options),
        )
        .await;
        let mut dealer = match connected {
            Ok(Ok(dealer)) => dealer,
            Ok(Err(e)) => {
                report_violation(self.shared, self.replica, &endpoint, &e);
                tracing::warn!(endpoint = %self.replica.id(), replay = %endpoint, error = %e, "replay connect failed");
                return false;
            }
            Err(_) => return false,
        };
        let request = [Bytes::new(), Bytes::copy_from_slice(&from.to_be_bytes())];
        match timeout_at(self.deadline, dealer.send(&request)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                report_violation(self.shared, self.replica, &dealer.peer(), &e);
                return false;
            }
            Err(_) => return false,
        }
        self.dealer = Some(dealer);
        true
    }

    async fn next_reply(&mut self) -> Option<Vec<Frame>> {
        let dealer = self.dealer.as_mut()?;
        match timeout_at(self.deadline, dealer.recv()).await {
            Ok(Ok(frames)) => Some(frames),
            Ok(Err(e)) => {
                report_violation(self.shared, self.replica, &dealer.peer(), &e);
                self.dealer = None;
                None
            }
            Err(_) => {
                self.dealer = None;
                None
            }
        }
    }
}

/// One replica's event stream: sequence tracking, replays, and application
/// to the index. Independent of the live transport (the caller hands it each
/// live message's frames).
#[derive(Debug)]
pub struct Stream<'a, R> {
    shared: &'a Shared,
    replica: &'a Replica,
    replay: R,
    tracker: Tracker,
}

impl<'a, R: Replay> Stream<'a, R> {
    /// A stream with nothing applied yet.
    pub fn new(shared: &'a Shared, replica: &'a Replica, replay: R) -> Self {
        Self {
            shared,
            replica,
            replay,
            tracker: Tracker::default(),
        }
    }

    /// Purges and replays from seq 0 (start-up, reconnect, restart).
    pub async fn resync(&mut self, purge_counted: bool) {
        self.replica.set_fresh(false);
        if purge_counted {
            self.shared.purge(self.replica, "resync");
        } else {
            crate::state::write(&self.shared.index).purge(self.replica.slot);
        }
        self.tracker = Tracker::default();
        let result = self.replay(0).await;
        let label = match result {
            ReplayResult::Complete => "complete",
            // Already purged: a partial buffer is all there is to recover.
            ReplayResult::Incomplete => "partial",
            ReplayResult::Unavailable => "unavailable",
        };
        self.shared.metrics.replays.inc([label]);
        // vLLM's buffer is never emptied: a complete replay with nothing in
        // it means nothing was published yet, so the next batch is seq 0 and
        // a first live seq above it is a gap (a slow-joiner loss), not a
        // baseline.
        if result == ReplayResult::Complete && self.tracker.next.is_none() {
            self.tracker.next = Some(0);
        }
        self.replica.set_fresh(true);
    }

    /// Handles one live message (`[topic, seq, payload]` or `[seq, payload]`).
    pub async fn on_live<F: Into<Frame>>(&mut self, frames: Vec<F>) {
        let frames: Vec<Frame> = frames.into_iter().map(Into::into).collect();
        let (seq_frame, payload) = match frames.as_slice() {
            [_, seq, payload] | [seq, payload] => (seq, payload),
            _ => {
                self.shared.metrics.decode_errors.inc(["frames"]);
                if self.replica.may_warn() {
                    tracing::warn!(endpoint = %self.replica.id(), frames = frames.len(), "live message with an unexpected frame count");
                }
                return;
            }
        };
        let Some(seq) = seq_frame.data().and_then(|f| wire::decode_seq(f)) else {
            self.shared.metrics.decode_errors.inc(["seq"]);
            return;
        };
        let live_digest = frame_digest(payload);
        match self.tracker.classify(seq, live_digest) {
            Verdict::Apply => self.apply(seq, payload),
            Verdict::Duplicate => self.shared.metrics.duplicates.inc(),
            Verdict::Gap { from } => {
                self.shared.metrics.gaps.inc();
                self.replica.set_fresh(false);
                tracing::info!(endpoint = %self.replica.id(), from, to = seq, "seq gap; replaying");
                let result = self.replay(from).await;
                // Covered: the replay reached this batch (after a purge of its
                // own if the buffer had lost the start of the gap).
                let covered = self.tracker.next.is_some_and(|n| n > seq);
                self.shared.metrics.replays.inc([match (result, covered) {
                    (ReplayResult::Complete, true) => "complete",
                    (ReplayResult::Unavailable, _) => "unavailable",
                    _ => "incomplete",
                }]);
                if !covered {
                    // What is missing cannot be recovered: forget the replica
                    // and continue from this batch.
                    self.shared.purge(self.replica, "gap");
                    self.tracker = Tracker::default();
                    self.apply(seq, payload);
                }
                self.replica.set_fresh(true);
            }
            Verdict::Restart => {
                tracing::info!(endpoint = %self.replica.id(), seq, "seq dropped: engine restarted");
                self.shared.purge(self.replica, "restart");
                self.tracker = Tracker::default();
                if seq == 0 {
                    self.apply(seq, payload);
                } else {
                    // Batches 0..seq of the new engine were missed.
                    self.resync(false).await;
                    if self.tracker.classify(seq, live_digest) == Verdict::Apply {
                        self.apply(seq, payload);
                    }
                }
            }
        }
    }

    fn apply(&mut self, seq: u64, payload: &Frame) {
        self.tracker.applied(seq);
        let limits = &self.shared.config.limits;
        let decoded = match payload {
            Frame::Data(bytes) => wire::decode_batch(bytes, limits),
            // Discarded unread by the transport: what the decoder says of it.
            Frame::Oversized(_) => Err(DecodeError::TooLarge {
                what: "frame",
                limit: limits.max_frame_bytes,
            }),
        };
        match decoded {
            Ok(batch) => self.shared.ingest(self.replica, &batch),
            Err(e) => {
                self.shared.metrics.decode_errors.inc([e.label()]);
                if self.replica.may_warn() {
                    tracing::warn!(endpoint = %self.replica.id(), seq, error = %e, "undecodable KV-event batch; purging replica (further warnings for 10 s suppressed; see indexd_decode_errors_total)");
                }
                // Its removals are lost: what we hold may be wrong.
                self.shared.purge(self.replica, "decode_error");
            }
        }
    }

    /// Replays from `from`, applying batches as they come.
    async fn replay(&mut self, from: u64) -> ReplayResult {
        if !self.replay.request(from).await {
            return ReplayResult::Unavailable;
        }
        let mut expected = from;
        let mut complete = true;
        let mut received = 0usize;
        loop {
            let Some(frames) = self.replay.next_reply().await else {
                tracing::warn!(endpoint = %self.replica.id(), from, "replay broke off before its end marker");
                return if received == 0 {
                    ReplayResult::Unavailable
                } else {
                    ReplayResult::Incomplete
                };
            };
            let body = match frames.split_first() {
                Some((Frame::Data(first), rest)) if first.is_empty() => rest,
                _ => frames.as_slice(),
            };
            let (seq_frame, payload) = match body {
                [_, seq, payload] | [seq, payload] => (seq, payload),
                _ => {
                    self.shared.metrics.decode_errors.inc(["replay_frames"]);
                    complete = false;
                    continue;
                }
            };
            let Some(seq) = seq_frame.data().and_then(|f| wire::decode_seq(f)) else {
                self.shared.metrics.decode_errors.inc(["seq"]);
                complete = false;
                continue;
            };
            if seq == REPLAY_END_SEQ {
                return if complete {
                    ReplayResult::Complete
                } else {
                    ReplayResult::Incomplete
                };
            }
            received += 1;
            if received > MAX_REPLAY_BATCHES {
                return ReplayResult::Incomplete;
            }
            if seq != expected && complete {
                complete = false;
                if from > 0 {
                    // Batches expected..seq are gone from the buffer.
                    self.shared.purge(self.replica, "gap");
                    self.tracker = Tracker::default();
                }
            }
            expected = seq.saturating_add(1);
            self.tracker.note_replayed(seq, frame_digest(payload));
            if self.tracker.next.is_some_and(|n| seq < n) {
                continue;
            }
            self.apply(seq, payload);
        }
    }
}

#[cfg(test)]
#[path = "subscriber_tests.rs"]
mod stream_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracker_classifies() {
        let mut t = Tracker::default();
        assert_eq!(t.classify(5, 0), Verdict::Apply);
        t.applied(5);
        assert_eq!(t.classify(6, 0), Verdict::Apply);
        t.applied(6);
        assert_eq!(t.classify(9, 0), Verdict::Gap { from: 7 });
        // A replay delivered 7..=12 after live 9 triggered it.
        for seq in 7..=12 {
            t.note_replayed(seq, 100 + seq);
            t.applied(seq);
        }
        assert_eq!(t.classify(10, 110), Verdict::Duplicate);
        assert_eq!(t.classify(12, 112), Verdict::Duplicate);
        // Same seq, other bytes: a restarted engine.
        assert_eq!(t.classify(10, 999), Verdict::Restart);
        assert_eq!(t.classify(3, 0), Verdict::Restart);
        assert_eq!(t.classify(13, 0), Verdict::Apply);
        t.applied(13);
        // Live seqs passed the replay: an old seq now means a restart.
        assert_eq!(t.classify(11, 111), Verdict::Restart);
        assert_eq!(t.classify(0, 0), Verdict::Restart);
    }
}
