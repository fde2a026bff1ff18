//! One task per endpoint: a ZMTP SUB on the replica's KV-event publisher
//! (see [`crate::zmtp`]), with sequence tracking and replay over DEALER.
//!
//! - Start-up and every reconnect: purge the replica (what we held may be
//!   stale: the engine may have restarted while we were away) and replay from
//!   seq 0, recovering whatever the publisher's buffer still holds. A replica
//!   restored from a snapshot first resumes instead: its replay from the
//!   saved seq must prove the saved state (same batch, same digest) before
//!   the rest is applied; otherwise that replica alone falls back to the
//!   purge and the replay from 0 ([`crate::snapshot`]).
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

use std::fmt::Display;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::SubscribeError;
use crate::state::{Replica, Shared};
use crate::zmtp::{self, Endpoint, SubEvent, SubListener, ZmtpError};

mod replay;
mod stream;

use replay::ZmqReplay;
use stream::Stream;

/// Most batches accepted from one replay (vLLM buffers 10,000).
pub const MAX_REPLAY_BATCHES: usize = 20_000;
/// Most requests one replay is read in: vLLM's answer arrives whole up to
/// its ROUTER's send queue (≈ 1,000–1,500 batches), so its 10,000-batch
/// buffer takes up to about ten ([`stream`]'s `replay`).
pub const MAX_REPLAY_PAGES: usize = 32;
/// Once a replay answer has started, this long without its next message
/// ends the page: vLLM sends the whole answer at once, and what its ROUTER
/// dropped never comes.
pub const REPLAY_IDLE: std::time::Duration = std::time::Duration::from_millis(250);

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

#[cfg(test)]
#[path = "subscriber_tests.rs"]
mod stream_tests;
