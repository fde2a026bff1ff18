//! The ZMTP 3.x grammar with the NULL mechanism: a pure, bounded decoder.
//!
//! [`Decoder::decode`] is a state machine over a [`BytesMut`] that the caller
//! fills as bytes arrive: the 64-byte greeting (checked byte by byte as it
//! comes), then frame headers, lengths and bodies. Every bound is checked on
//! the header alone, before a body byte is buffered:
//!
//! - a data frame longer than [`FrameLimits::max_frame_bytes`] is never
//!   buffered: its bytes are discarded as they arrive and the message carries
//!   [`Frame::Oversized`] in its place;
//! - a frame, or a message (all frames, oversized ones included), longer than
//!   [`FrameLimits::max_message_bytes`] is a [`ProtocolError`];
//! - more than [`MAX_FRAMES_PER_MESSAGE`] frames, or a command longer than
//!   [`MAX_COMMAND_BYTES`], is a [`ProtocolError`];
//! - a data frame before the peer's READY, a second READY, reserved flag
//!   bits, a command inside a multi-frame message: [`ProtocolError`].
//!
//! After an error the decoder stays failed; the caller closes the connection.
//! How much the caller should read next is [`Decoder::wants`], never more
//! than the bounded frame still needs. What indexd writes is in
//! [`super::encode`].
#![deny(clippy::indexing_slicing)]

use bytes::{Buf, Bytes, BytesMut};

/// Length of the greeting each side sends first.
pub const GREETING_LEN: usize = 64;
/// Most frames in one message (vLLM sends 3 live, 4 per replay reply).
pub const MAX_FRAMES_PER_MESSAGE: usize = 16;
/// Largest command frame accepted (READY metadata, ERROR, PING, ...).
pub const MAX_COMMAND_BYTES: usize = 4096;
/// The version indexd announces: 3.1 (it answers PING).
pub const VERSION: (u8, u8) = (3, 1);

pub(super) const SIGNATURE_FIRST: u8 = 0xFF;
pub(super) const SIGNATURE_LAST: u8 = 0x7F;
pub(super) const MECHANISM_NULL: &[u8; 20] = b"NULL\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0";
pub(super) const FLAG_MORE: u8 = 0x01;
pub(super) const FLAG_LONG: u8 = 0x02;
pub(super) const FLAG_COMMAND: u8 = 0x04;
const FLAGS_RESERVED: u8 = !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND);
/// How much of a peer-supplied name an error message keeps.
const SHOWN: usize = 32;

/// The caps the decoder enforces (from [`crate::Limits`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameLimits {
    /// Largest data frame buffered; longer ones are discarded unread.
    pub max_frame_bytes: usize,
    /// Largest frame or message (its frames' lengths summed) tolerated at
    /// all; a peer claiming more is a protocol error.
    pub max_message_bytes: usize,
}

impl From<&crate::Limits> for FrameLimits {
    fn from(l: &crate::Limits) -> Self {
        Self {
            max_frame_bytes: l.max_frame_bytes,
            max_message_bytes: l.max_message_bytes,
        }
    }
}

/// Why a peer's bytes were refused. Each variant is a metric label.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// Not a ZMTP 3 greeting signature (`0xFF`, 8 bytes, `0x7F`).
    #[error("not a ZMTP greeting: byte {offset} is {found:#04x}")]
    BadGreeting {
        /// Offset of the offending byte.
        offset: usize,
        /// Its value.
        found: u8,
    },
    /// ZMTP 1.0 or 2.x.
    #[error("peer speaks ZMTP {major}.x; 3.0 or later is required")]
    UnsupportedVersion {
        /// The peer's major version.
        major: u8,
    },
    /// CURVE, PLAIN or anything but NULL.
    #[error("peer asks for the {0:?} security mechanism; only NULL is supported")]
    UnsupportedMechanism(String),
    /// Flag bits 3–7 must be zero.
    #[error("reserved frame flag bits set ({0:#04x})")]
    ReservedFlags(u8),
    /// A command frame with MORE set, or between the frames of a message.
    #[error("command frame inside a multi-frame message")]
    MisplacedCommand,
    /// A command frame over [`MAX_COMMAND_BYTES`].
    #[error("command frame of {len} bytes exceeds {limit}")]
    CommandTooLarge {
        /// The claimed length.
        len: u64,
        /// The cap.
        limit: usize,
    },
    /// One frame claims more than `max_message_bytes`.
    #[error("frame of {len} bytes exceeds max_message_bytes ({limit})")]
    FrameTooLarge {
        /// The claimed length.
        len: u64,
        /// The cap.
        limit: usize,
    },
    /// The frames of one message add up to more than `max_message_bytes`.
    #[error("message exceeds max_message_bytes ({limit})")]
    MessageTooLarge {
        /// The cap.
        limit: usize,
    },
    /// More than [`MAX_FRAMES_PER_MESSAGE`] frames in one message.
    #[error("message has more than {limit} frames")]
    TooManyFrames {
        /// The cap.
        limit: usize,
    },
    /// A command whose fields do not fit its frame.
    #[error("malformed {0} command")]
    MalformedCommand(&'static str),
    /// Something other than READY (or ERROR) opened the conversation.
    #[error("expected READY, got the {0:?} command")]
    ExpectedReady(String),
    /// A data frame before the peer's READY.
    #[error("data frame before the handshake completed")]
    MessageBeforeReady,
    /// READY after READY.
    #[error("second READY command")]
    DuplicateReady,
    /// The peer's READY names no `Socket-Type`.
    #[error("peer's READY names no Socket-Type")]
    MissingSocketType,
    /// The peer's socket type cannot talk to ours.
    #[error("peer socket type {peer:?} cannot talk to {ours}")]
    IncompatibleSocketType {
        /// Our socket type.
        ours: &'static str,
        /// The peer's (shortened).
        peer: String,
    },
}

impl ProtocolError {
    /// A short label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            Self::BadGreeting { .. } => "bad_greeting",
            Self::UnsupportedVersion { .. } => "unsupported_version",
            Self::UnsupportedMechanism(_) => "unsupported_mechanism",
            Self::ReservedFlags(_) => "reserved_flags",
            Self::MisplacedCommand => "misplaced_command",
            Self::CommandTooLarge { .. } => "command_too_large",
            Self::FrameTooLarge { .. } => "frame_too_large",
            Self::MessageTooLarge { .. } => "message_too_large",
            Self::TooManyFrames { .. } => "too_many_frames",
            Self::MalformedCommand(_) => "malformed_command",
            Self::ExpectedReady(_) => "expected_ready",
            Self::MessageBeforeReady => "message_before_ready",
            Self::DuplicateReady => "duplicate_ready",
            Self::MissingSocketType => "missing_socket_type",
            Self::IncompatibleSocketType { .. } => "incompatible_socket_type",
        }
    }
}

/// One frame of a received message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    /// The frame's bytes.
    Data(Bytes),
    /// A frame longer than `max_frame_bytes`, discarded unread: its length.
    Oversized(u64),
}

impl Frame {
    /// The bytes, unless the frame was too large to keep.
    pub fn data(&self) -> Option<&Bytes> {
        match self {
            Self::Data(b) => Some(b),
            Self::Oversized(_) => None,
        }
    }
}

impl From<Bytes> for Frame {
    fn from(b: Bytes) -> Self {
        Self::Data(b)
    }
}

/// The peer's greeting, once validated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Greeting {
    /// Major version (≥ 3).
    pub major: u8,
    /// Minor version.
    pub minor: u8,
    /// The as-server flag (meaningless for NULL).
    pub as_server: bool,
}

/// READY metadata: `(name, value)` pairs in the order sent.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Metadata(pub Vec<(Bytes, Bytes)>);

impl Metadata {
    /// The value of `name` (property names are case-insensitive).
    pub fn get(&self, name: &str) -> Option<&Bytes> {
        self.0
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name.as_bytes()))
            .map(|(_, v)| v)
    }
}

/// A command frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// The peer's READY and its metadata.
    Ready(Metadata),
    /// The peer refuses the connection, with a reason.
    Error(String),
    /// A heartbeat to answer with PONG and the same context.
    Ping {
        /// Time-to-live, in tenths of a second.
        ttl: u16,
        /// Echoed in the PONG.
        context: Bytes,
    },
    /// A heartbeat answer.
    Pong(Bytes),
    /// ZMTP 3.1 subscription command.
    Subscribe(Bytes),
    /// ZMTP 3.1 unsubscription command.
    Cancel(Bytes),
    /// Any other command (ignored): its name.
    Other(Bytes),
}

/// What one [`Decoder::decode`] call produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// The peer's greeting (always first).
    Greeting(Greeting),
    /// A command.
    Command(Command),
    /// A complete message.
    Message(Vec<Frame>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Greeting,
    Header,
    Body {
        command: bool,
        more: bool,
        len: usize,
    },
    Skip {
        more: bool,
        len: u64,
        remaining: u64,
    },
}

/// The inbound half of one ZMTP connection.
#[derive(Debug)]
pub struct Decoder {
    limits: FrameLimits,
    state: State,
    ready: bool,
    frames: Vec<Frame>,
    message_bytes: u64,
    failed: Option<ProtocolError>,
}

impl Decoder {
    /// A decoder expecting the peer's greeting.
    pub fn new(limits: FrameLimits) -> Self {
        Self {
            limits,
            state: State::Greeting,
            ready: false,
            frames: Vec::new(),
            message_bytes: 0,
            failed: None,
        }
    }

    /// True once the peer's READY was decoded.
    pub fn is_ready(&self) -> bool {
        self.ready
    }

    /// Consumes what it can of `buf` and returns the next event, `None` if
    /// more bytes are needed. Once it returned an error it returns it again.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Event>, ProtocolError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let result = self.step(buf);
        if let Err(e) = &result {
            self.failed = Some(e.clone());
        }
        result
    }

    /// How many more bytes (beyond the `buffered` ones) the decoder needs
    /// to make progress: at least 1, at most what the current bounded frame
    /// still lacks.
    pub fn wants(&self, buffered: usize) -> usize {
        let need = match self.state {
            State::Greeting => GREETING_LEN.saturating_sub(buffered),
            State::Header => 2usize.saturating_sub(buffered),
            State::Body { len, .. } => len.saturating_sub(buffered),
            State::Skip { remaining, .. } => usize::try_from(remaining).unwrap_or(usize::MAX),
        };
        need.max(1)
    }

    fn step(&mut self, buf: &mut BytesMut) -> Result<Option<Event>, ProtocolError> {
        loop {
            match self.state {
                State::Greeting => {
                    let Some(greeting) = check_greeting(buf)? else {
                        return Ok(None);
                    };
                    buf.advance(GREETING_LEN);
                    self.state = State::Header;
                    return Ok(Some(Event::Greeting(greeting)));
                }
                State::Header => {
                    if !self.header(buf)? {
                        return Ok(None);
                    }
                }
                State::Body { command, more, len } => {
                    if buf.len() < len {
                        return Ok(None);
                    }
                    let body = buf.split_to(len).freeze();
                    self.state = State::Header;
                    if command {
                        let command = parse_command(body)?;
                        self.on_command(&command)?;
                        return Ok(Some(Event::Command(command)));
                    }
                    self.frames.push(Frame::Data(body));
                    if !more {
                        return Ok(Some(self.finish_message()));
                    }
                }
                State::Skip {
                    more,
                    len,
                    remaining,
                } => {
                    let take = remaining.min(u64::try_from(buf.len()).unwrap_or(u64::MAX));
                    // `take` ≤ buf.len(), so it fits a usize.
                    buf.advance(usize::try_from(take).unwrap_or(0));
                    let remaining = remaining.saturating_sub(take);
                    if remaining > 0 {
                        self.state = State::Skip {
                            more,
                            len,
                            remaining,
                        };
                        return Ok(None);
                    }
                    self.state = State::Header;
                    self.frames.push(Frame::Oversized(len));
                    if !more {
                        return Ok(Some(self.finish_message()));
                    }
                }
            }
        }
    }

    /// Reads one frame header if complete; checks every bound on it before
    /// consuming it. False: more bytes needed.
    fn header(&mut self, buf: &mut BytesMut) -> Result<bool, ProtocolError> {
        let Some(&flags) = buf.first() else {
            return Ok(false);
        };
        if flags & FLAGS_RESERVED != 0 {
            return Err(ProtocolError::ReservedFlags(flags));
        }
        let (more, command) = (flags & FLAG_MORE != 0, flags & FLAG_COMMAND != 0);
        let (header_len, len) = if flags & FLAG_LONG != 0 {
            let Some(raw) = buf.get(1..9).and_then(|r| <[u8; 8]>::try_from(r).ok()) else {
                return Ok(false);
            };
            (9, u64::from_be_bytes(raw))
        } else {
            let Some(&short) = buf.get(1) else {
                return Ok(false);
            };
            (2, u64::from(short))
        };
        if command {
            if more || !self.frames.is_empty() {
                return Err(ProtocolError::MisplacedCommand);
            }
            let len = usize::try_from(len)
                .ok()
                .filter(|&l| l <= MAX_COMMAND_BYTES)
                .ok_or(ProtocolError::CommandTooLarge {
                    len,
                    limit: MAX_COMMAND_BYTES,
                })?;
            buf.advance(header_len);
            self.state = State::Body {
                command: true,
                more: false,
                len,
            };
            return Ok(true);
        }
        if !self.ready {
            return Err(ProtocolError::MessageBeforeReady);
        }
        if self.frames.len() >= MAX_FRAMES_PER_MESSAGE {
            return Err(ProtocolError::TooManyFrames {
                limit: MAX_FRAMES_PER_MESSAGE,
            });
        }
        let max_message = u64::try_from(self.limits.max_message_bytes).unwrap_or(u64::MAX);
        if len > max_message {
            return Err(ProtocolError::FrameTooLarge {
                len,
                limit: self.limits.max_message_bytes,
            });
        }
        if len > max_message.saturating_sub(self.message_bytes) {
            return Err(ProtocolError::MessageTooLarge {
                limit: self.limits.max_message_bytes,
            });
        }
        self.message_bytes = self.message_bytes.saturating_add(len);
        buf.advance(header_len);
        self.state = match usize::try_from(len) {
            Ok(l) if l <= self.limits.max_frame_bytes => State::Body {
                command: false,
                more,
                len: l,
            },
            _ => State::Skip {
                more,
                len,
                remaining: len,
            },
        };
        Ok(true)
    }

    fn on_command(&mut self, command: &Command) -> Result<(), ProtocolError> {
        match (command, self.ready) {
            (Command::Ready(_), true) => Err(ProtocolError::DuplicateReady),
            (Command::Ready(_), false) => {
                self.ready = true;
                Ok(())
            }
            (Command::Error(_), _) | (_, true) => Ok(()),
            (other, false) => Err(ProtocolError::ExpectedReady(command_name(other))),
        }
    }

    fn finish_message(&mut self) -> Event {
        self.message_bytes = 0;
        Event::Message(std::mem::take(&mut self.frames))
    }
}

/// Checks as much of the greeting as `buf` holds; the greeting once all 64
/// bytes are there.
fn check_greeting(buf: &[u8]) -> Result<Option<Greeting>, ProtocolError> {
    for (offset, want) in [(0, SIGNATURE_FIRST), (9, SIGNATURE_LAST)] {
        if let Some(&found) = buf.get(offset)
            && found != want
        {
            return Err(ProtocolError::BadGreeting { offset, found });
        }
    }
    if let Some(&major) = buf.get(10)
        && major < 3
    {
        return Err(ProtocolError::UnsupportedVersion { major });
    }
    if let Some(mechanism) = buf.get(12..32)
        && mechanism != MECHANISM_NULL
    {
        let name: Vec<u8> = mechanism.iter().copied().take_while(|&b| b != 0).collect();
        return Err(ProtocolError::UnsupportedMechanism(shown(&name)));
    }
    if buf.len() < GREETING_LEN {
        return Ok(None);
    }
    Ok(Some(Greeting {
        major: buf.get(10).copied().unwrap_or(0),
        minor: buf.get(11).copied().unwrap_or(0),
        as_server: buf.get(32).is_some_and(|&b| b == 1),
    }))
}

/// A peer-supplied name, shortened and made printable.
fn shown(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes.get(..SHOWN).unwrap_or(bytes)).into_owned()
}

fn command_name(c: &Command) -> String {
    match c {
        Command::Ready(_) => "READY".into(),
        Command::Error(_) => "ERROR".into(),
        Command::Ping { .. } => "PING".into(),
        Command::Pong(_) => "PONG".into(),
        Command::Subscribe(_) => "SUBSCRIBE".into(),
        Command::Cancel(_) => "CANCEL".into(),
        Command::Other(name) => shown(name),
    }
}

/// Parses a command frame's body: `name-size name data`.
pub fn parse_command(body: Bytes) -> Result<Command, ProtocolError> {
    let unnamed = || ProtocolError::MalformedCommand("unnamed");
    let name_len = usize::from(*body.first().ok_or_else(unnamed)?);
    let name = body.get(1..1 + name_len).ok_or_else(unnamed)?;
    // In bounds: `name` was.
    let data = body.slice(1 + name_len..);
    Ok(match name {
        b"READY" => Command::Ready(parse_metadata(data)?),
        b"ERROR" => {
            let bad = || ProtocolError::MalformedCommand("ERROR");
            let len = usize::from(*data.first().ok_or_else(bad)?);
            let reason = data.get(1..1 + len).ok_or_else(bad)?;
            Command::Error(String::from_utf8_lossy(reason).into_owned())
        }
        b"PING" => {
            let ttl = data
                .get(..2)
                .and_then(|t| <[u8; 2]>::try_from(t).ok())
                .ok_or(ProtocolError::MalformedCommand("PING"))?;
            Command::Ping {
                ttl: u16::from_be_bytes(ttl),
                context: data.slice(2..),
            }
        }
        b"PONG" => Command::Pong(data),
        b"SUBSCRIBE" => Command::Subscribe(data),
        b"CANCEL" => Command::Cancel(data),
        _ => Command::Other(body.slice(1..1 + name_len)),
    })
}

/// Parses READY metadata: `(name-size name value-size(u32 BE) value)*`.
fn parse_metadata(mut rest: Bytes) -> Result<Metadata, ProtocolError> {
    let bad = || ProtocolError::MalformedCommand("READY");
    let mut props = Vec::new();
    while let Some(&name_len) = rest.first() {
        let name_end = 1 + usize::from(name_len);
        let size = rest
            .get(name_end..name_end + 4)
            .and_then(|s| <[u8; 4]>::try_from(s).ok())
            .ok_or_else(bad)?;
        let value_len = usize::try_from(u32::from_be_bytes(size)).map_err(|_| bad())?;
        let value_end = (name_end + 4).checked_add(value_len).ok_or_else(bad)?;
        if value_end > rest.len() {
            return Err(bad());
        }
        // In bounds: value_end ≤ rest.len().
        props.push((rest.slice(1..name_end), rest.slice(name_end + 4..value_end)));
        rest = rest.slice(value_end..);
    }
    Ok(Metadata(props))
}

/// The two socket roles indexd plays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Receives a publisher's messages.
    Sub,
    /// Asks a ROUTER for replays.
    Dealer,
}

impl Role {
    /// The `Socket-Type` this role announces.
    pub fn socket_type(self) -> &'static str {
        match self {
            Self::Sub => "SUB",
            Self::Dealer => "DEALER",
        }
    }

    /// True when a peer of `socket_type` may talk to this role.
    pub fn accepts(self, socket_type: &[u8]) -> bool {
        match self {
            Self::Sub => socket_type == b"PUB" || socket_type == b"XPUB",
            Self::Dealer => socket_type == b"ROUTER",
        }
    }
}

/// Checks the peer's READY metadata against our role.
pub fn check_peer(role: Role, metadata: &Metadata) -> Result<(), ProtocolError> {
    let peer = metadata
        .get("Socket-Type")
        .ok_or(ProtocolError::MissingSocketType)?;
    if role.accepts(peer) {
        Ok(())
    } else {
        Err(ProtocolError::IncompatibleSocketType {
            ours: role.socket_type(),
            peer: shown(peer),
        })
    }
}

#[cfg(test)]
#[path = "codec_tests.rs"]
mod tests;
