//! Where replays come from: the replica's ROUTER over a DEALER, or a test
//! double.

use std::future::Future;

use bytes::Bytes;
use tokio::time::{Instant, timeout_at};

use super::{REPLAY_IDLE, options, report_violation};
use crate::state::{Replica, Shared};
use crate::zmtp::{self, Connection, Endpoint, Frame, Role};

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
/// `replay` endpoint), bounded by `replay_timeout` per request and, once
/// an answer has started, by [`REPLAY_IDLE`] between its messages.
pub struct ZmqReplay<'a> {
    shared: &'a Shared,
    replica: &'a Replica,
    endpoint: Option<Endpoint>,
    dealer: Option<Connection>,
    deadline: Instant,
    /// The current answer has started (its next message is due within
    /// [`REPLAY_IDLE`]).
    started: bool,
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
            started: false,
        }
    }
}

impl Replay for ZmqReplay<'_> {
    async fn request(&mut self, from: u64) -> bool {
        self.dealer = None;
        self.started = false;
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
        let until = if self.started {
            self.deadline.min(Instant::now() + REPLAY_IDLE)
        } else {
            self.deadline
        };
        match timeout_at(until, dealer.recv()).await {
            Ok(Ok(frames)) => {
                self.started = true;
                Some(frames)
            }
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
