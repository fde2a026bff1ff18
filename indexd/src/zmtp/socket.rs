//! The two socket roles over TCP: a connection (SUB or DEALER, connecting
//! out) and a bound SUB accepting any number of publishers.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::{Instant, timeout, timeout_at};

use super::codec::{self, Command, Decoder, Event, Frame, FrameLimits, Role};
use super::encode;
use super::{Endpoint, ZmtpError};

/// Largest read, and the most the input buffer grows by at once.
const READ_CHUNK: usize = 64 * 1024;
/// Smallest read buffer offered while waiting for a header.
const MIN_READ: usize = 4 * 1024;
/// How long a peer may leave a PONG or a request unread.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// Messages a bound SUB queues ahead of the session, from all publishers.
const QUEUE: usize = 8;
/// How long a bound SUB stops accepting after `accept` failed.
const ACCEPT_PAUSE: Duration = Duration::from_millis(100);

/// What every connection is held to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Options {
    /// Frame and message caps.
    pub limits: FrameLimits,
    /// Connecting plus greeting and READY must finish within this.
    pub handshake_timeout: Duration,
    /// Most publishers a bound SUB serves at once.
    pub max_connections: usize,
}

/// One handshaken connection.
#[derive(Debug)]
pub struct Connection {
    stream: TcpStream,
    peer: SocketAddr,
    decoder: Decoder,
    inbox: BytesMut,
    outbox: BytesMut,
}

impl Connection {
    /// Greets, exchanges READY and checks the peer's socket type.
    async fn handshake(
        stream: TcpStream,
        peer: SocketAddr,
        role: Role,
        limits: FrameLimits,
    ) -> Result<Self, ZmtpError> {
        stream.set_nodelay(true)?;
        let mut conn = Self {
            stream,
            peer,
            decoder: Decoder::new(limits),
            inbox: BytesMut::new(),
            outbox: BytesMut::new(),
        };
        conn.outbox.extend_from_slice(&encode::greeting());
        conn.flush().await?;
        // The decoder yields the greeting first, then READY (or ERROR): it
        // refuses anything else before READY.
        while !conn.decoder.is_ready() {
            match conn.next_event().await? {
                Event::Greeting(_) => {
                    encode::put_ready(&mut conn.outbox, role);
                    conn.flush().await?;
                }
                Event::Command(Command::Ready(meta)) => codec::check_peer(role, &meta)?,
                Event::Command(Command::Error(reason)) => return Err(ZmtpError::PeerError(reason)),
                Event::Command(_) | Event::Message(_) => {}
            }
        }
        Ok(conn)
    }

    /// The peer's address.
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// The next message. Answers PING, ignores other commands; an ERROR, a
    /// protocol violation or the peer closing ends the connection.
    pub async fn recv(&mut self) -> Result<Vec<Frame>, ZmtpError> {
        loop {
            match self.next_event().await? {
                Event::Message(frames) => return Ok(frames),
                Event::Command(Command::Ping { context, .. }) => {
                    encode::put_pong(&mut self.outbox, &context);
                    self.flush().await?;
                }
                Event::Command(Command::Error(reason)) => return Err(ZmtpError::PeerError(reason)),
                Event::Command(_) | Event::Greeting(_) => {}
            }
        }
    }

    /// Sends one message.
    pub async fn send(&mut self, frames: &[Bytes]) -> Result<(), ZmtpError> {
        encode::put_message(&mut self.outbox, frames);
        self.flush().await
    }

    /// Subscribes (a SUB's message-form subscription).
    async fn subscribe(&mut self, topic: &[u8]) -> Result<(), ZmtpError> {
        encode::put_subscribe(&mut self.outbox, topic);
        self.flush().await
    }

    async fn next_event(&mut self) -> Result<Event, ZmtpError> {
        loop {
            if let Some(event) = self.decoder.decode(&mut self.inbox)? {
                return Ok(event);
            }
            // Never more than the bounded frame still lacks (or a small
            // read-ahead), whatever the peer claims.
            let want = self
                .decoder
                .wants(self.inbox.len())
                .clamp(MIN_READ, READ_CHUNK);
            self.inbox.reserve(want);
            if self.stream.read_buf(&mut self.inbox).await? == 0 {
                return Err(ZmtpError::Closed);
            }
        }
    }

    async fn flush(&mut self) -> Result<(), ZmtpError> {
        match timeout(WRITE_TIMEOUT, self.stream.write_all(&self.outbox)).await {
            Ok(Ok(())) => {
                self.outbox.clear();
                Ok(())
            }
            Ok(Err(e)) => Err(e.into()),
            Err(_) => Err(ZmtpError::WriteTimeout(WRITE_TIMEOUT)),
        }
    }
}

/// Connects to `endpoint` (each resolved address in turn) and handshakes
/// as `role`, all within the handshake timeout.
pub async fn connect(
    endpoint: &Endpoint,
    role: Role,
    options: &Options,
) -> Result<Connection, ZmtpError> {
    let deadline = Instant::now() + options.handshake_timeout;
    let (stream, peer) = timeout_at(deadline, connect_any(endpoint))
        .await
        .map_err(|_| ZmtpError::ConnectTimeout(options.handshake_timeout))??;
    timeout_at(
        deadline,
        Connection::handshake(stream, peer, role, options.limits),
    )
    .await
    .map_err(|_| ZmtpError::HandshakeTimeout(options.handshake_timeout))?
}

/// A SUB connected to a publisher, subscribed to every topic.
pub async fn connect_sub(endpoint: &Endpoint, options: &Options) -> Result<Connection, ZmtpError> {
    let mut conn = connect(endpoint, Role::Sub, options).await?;
    conn.subscribe(b"").await?;
    Ok(conn)
}

async fn connect_any(endpoint: &Endpoint) -> Result<(TcpStream, SocketAddr), ZmtpError> {
    let mut last = None;
    for addr in endpoint.resolve().await? {
        match TcpStream::connect(addr).await {
            Ok(stream) => return Ok((stream, addr)),
            Err(e) => last = Some(e),
        }
    }
    Err(last.map_or(ZmtpError::Closed, ZmtpError::Io))
}

/// What a bound SUB reports.
#[derive(Debug)]
pub enum SubEvent {
    /// A publisher finished its handshake and was subscribed.
    Up(SocketAddr),
    /// A message from one of the publishers.
    Message(Vec<Frame>),
    /// A publisher that was up is gone, and why.
    Down {
        /// The publisher.
        peer: SocketAddr,
        /// Why the connection ended.
        error: ZmtpError,
    },
    /// A connection that never came up (failed handshake, over the cap).
    Refused {
        /// The peer.
        peer: SocketAddr,
        /// Why.
        error: ZmtpError,
    },
    /// Accepting failed (the listener goes on after a short pause).
    AcceptFailed(ZmtpError),
}

/// A bound SUB: one task per publisher connection, their messages
/// fair-queued into one bounded channel (waiting senders are served in
/// turn, so no publisher starves the others). Dropping it closes the
/// listener and every connection.
#[derive(Debug)]
pub struct SubListener {
    listener: TcpListener,
    local: SocketAddr,
    options: Options,
    connections: JoinSet<()>,
    tx: mpsc::Sender<SubEvent>,
    rx: mpsc::Receiver<SubEvent>,
}

impl SubListener {
    /// Binds the first address `endpoint` resolves to.
    pub async fn bind(endpoint: &Endpoint, options: Options) -> Result<Self, ZmtpError> {
        let mut last = None;
        for addr in endpoint.resolve().await? {
            match TcpListener::bind(addr).await {
                Ok(listener) => {
                    let local = listener.local_addr()?;
                    let (tx, rx) = mpsc::channel(QUEUE);
                    return Ok(Self {
                        listener,
                        local,
                        options,
                        connections: JoinSet::new(),
                        tx,
                        rx,
                    });
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.map_or(ZmtpError::Closed, ZmtpError::Io))
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The next event from any publisher.
    pub async fn next(&mut self) -> SubEvent {
        loop {
            tokio::select! {
                // Never None: `self.tx` keeps the channel open.
                Some(event) = self.rx.recv() => return event,
                accepted = self.listener.accept() => {
                    let (stream, peer) = match accepted {
                        Ok(a) => a,
                        Err(e) => {
                            // Out of descriptors, or a connection gone before
                            // it was accepted: pause rather than spin.
                            tokio::time::sleep(ACCEPT_PAUSE).await;
                            return SubEvent::AcceptFailed(e.into());
                        }
                    };
                    while self.connections.try_join_next().is_some() {}
                    if self.connections.len() >= self.options.max_connections {
                        drop(stream);
                        return SubEvent::Refused {
                            peer,
                            error: ZmtpError::TooManyConnections(self.options.max_connections),
                        };
                    }
                    self.connections
                        .spawn(serve_publisher(stream, peer, self.tx.clone(), self.options));
                }
                Some(_) = self.connections.join_next(), if !self.connections.is_empty() => {}
            }
        }
    }
}

/// One publisher connection of a bound SUB.
async fn serve_publisher(
    stream: TcpStream,
    peer: SocketAddr,
    tx: mpsc::Sender<SubEvent>,
    options: Options,
) {
    let handshake = async {
        let mut conn = Connection::handshake(stream, peer, Role::Sub, options.limits).await?;
        conn.subscribe(b"").await?;
        Ok::<_, ZmtpError>(conn)
    };
    let mut conn = match timeout(options.handshake_timeout, handshake).await {
        Ok(Ok(conn)) => conn,
        Ok(Err(error)) => {
            let _ = tx.send(SubEvent::Refused { peer, error }).await;
            return;
        }
        Err(_) => {
            let error = ZmtpError::HandshakeTimeout(options.handshake_timeout);
            let _ = tx.send(SubEvent::Refused { peer, error }).await;
            return;
        }
    };
    if tx.send(SubEvent::Up(peer)).await.is_err() {
        return;
    }
    let error = loop {
        match conn.recv().await {
            Ok(frames) => {
                if tx.send(SubEvent::Message(frames)).await.is_err() {
                    return;
                }
            }
            Err(e) => break e,
        }
    };
    drop(conn);
    let _ = tx.send(SubEvent::Down { peer, error }).await;
}

#[cfg(test)]
#[path = "socket_tests.rs"]
mod tests;
