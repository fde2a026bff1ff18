//! indexd's own ZMTP transport: ZMTP 3.0/3.1 (RFC 23, RFC 37) with the NULL
//! mechanism, for the two socket roles indexd plays — SUB on a replica's
//! KV-event publisher, DEALER on its replay ROUTER — over `tcp://` only.
//!
//! Why not a ZMQ library: the one available to a tokio daemon allocates the
//! length a peer claims in a frame header before reading the frame (one
//! header claiming 1 TiB aborts the process), its codec is private so it
//! cannot be wrapped, and it has no message-size option; a fork would mean
//! carrying some 7k lines to use a fraction of them. indexd needs two roles
//! and one mechanism, and a bounded decoder is a pure function that can be
//! unit-tested, property-tested and fuzzed (`indexd/fuzz`).
//!
//! - [`codec`]: the pure [`Decoder`] (greeting, READY, frames; every cap
//!   checked on the header before a body byte is buffered); [`encode`]: what
//!   indexd writes.
//! - [`socket`]: handshakes, a [`Connection`] for SUB or DEALER connecting
//!   out, and a [`SubListener`] accepting publishers (`events_bind`).
//! - [`endpoint`]: `tcp://host:port` parsing and resolution.
//!
//! Subscriptions are sent in the message form (`0x01` + topic), which libzmq
//! 4.x (pyzmq, used by vLLM) and ZMTP 3.0 peers accept alike. PING is
//! answered with PONG; indexd sends no heartbeats of its own.
//!
//! Memory a peer can make indexd hold: per connection, one message being
//! read (its kept frames, at most `max_message_bytes`, each at most
//! `max_frame_bytes`) plus read-ahead; a bound SUB adds up to
//! `max_publisher_connections` connections and a queue of 8 messages.
#![deny(clippy::indexing_slicing)]

use std::time::Duration;

pub mod codec;
pub mod encode;
pub mod endpoint;
pub mod socket;

pub use codec::{
    Command, Decoder, Event, Frame, FrameLimits, MAX_COMMAND_BYTES, MAX_FRAMES_PER_MESSAGE,
    ProtocolError, Role,
};
pub use endpoint::{Endpoint, EndpointError};
pub use socket::{Connection, Options, SubEvent, SubListener, connect, connect_sub};

/// Why a ZMTP connection could not be made or ended.
#[derive(Debug, thiserror::Error)]
pub enum ZmtpError {
    /// The peer broke the protocol or a cap.
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// The peer sent ERROR.
    #[error("peer sent ERROR: {0}")]
    PeerError(String),
    /// Connecting took too long.
    #[error("connect did not finish within {0:?}")]
    ConnectTimeout(Duration),
    /// Greeting and READY took too long.
    #[error("handshake did not finish within {0:?}")]
    HandshakeTimeout(Duration),
    /// The peer left what we sent unread.
    #[error("peer did not read within {0:?}")]
    WriteTimeout(Duration),
    /// A bound SUB already serves its maximum of publishers.
    #[error("refused: {0} publishers already connected")]
    TooManyConnections(usize),
    /// The peer closed the connection.
    #[error("connection closed by the peer")]
    Closed,
    /// The endpoint's host name did not resolve.
    #[error("cannot resolve {endpoint}: {reason}")]
    Resolve {
        /// The endpoint.
        endpoint: String,
        /// The resolver's error.
        reason: String,
    },
    /// The endpoint string is invalid.
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    /// A socket error.
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
}

impl ZmtpError {
    /// The metric label when the connection was closed (or refused) for
    /// what the peer did; None for network failures and plain closes.
    pub fn violation(&self) -> Option<&'static str> {
        match self {
            Self::Protocol(p) => Some(p.label()),
            Self::PeerError(_) => Some("peer_error"),
            Self::HandshakeTimeout(_) => Some("handshake_timeout"),
            Self::WriteTimeout(_) => Some("write_timeout"),
            Self::TooManyConnections(_) => Some("too_many_connections"),
            Self::ConnectTimeout(_)
            | Self::Closed
            | Self::Resolve { .. }
            | Self::Endpoint(_)
            | Self::Io(_) => None,
        }
    }
}
