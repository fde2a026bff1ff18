//! The socket layer against scripted peers on 127.0.0.1: handshake
//! failures, PING, and a bound SUB's connection accounting.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::*;
use crate::zmtp::codec::Metadata;

fn options(handshake_timeout: Duration, max_connections: usize) -> Options {
    Options {
        limits: FrameLimits {
            max_frame_bytes: 1024,
            max_message_bytes: 4096,
        },
        handshake_timeout,
        max_connections,
    }
}

/// A greeting and READY announcing `socket_type`.
fn hello(socket_type: &str) -> BytesMut {
    let mut out = BytesMut::from(&encode::greeting()[..]);
    let mut meta = vec![11];
    meta.extend_from_slice(b"Socket-Type");
    meta.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    meta.extend_from_slice(socket_type.as_bytes());
    encode::put_command(&mut out, "READY", &meta);
    out
}

/// A scripted peer: reads indexd's bytes through a decoder of its own.
struct Peer {
    stream: TcpStream,
    decoder: Decoder,
    inbox: BytesMut,
}

impl Peer {
    fn new(stream: TcpStream) -> Self {
        Self {
            stream,
            decoder: Decoder::new(options(Duration::ZERO, 0).limits),
            inbox: BytesMut::new(),
        }
    }

    async fn next(&mut self) -> Event {
        loop {
            if let Some(e) = self.decoder.decode(&mut self.inbox).unwrap() {
                return e;
            }
            let n = tokio::time::timeout(
                Duration::from_secs(5),
                self.stream.read_buf(&mut self.inbox),
            )
            .await
            .unwrap()
            .unwrap();
            assert!(n > 0, "indexd closed the connection");
        }
    }

    /// Reads indexd's greeting and READY; returns its metadata.
    async fn handshake(&mut self) -> Metadata {
        assert!(matches!(self.next().await, Event::Greeting(_)));
        let Event::Command(Command::Ready(meta)) = self.next().await else {
            panic!("no READY")
        };
        meta
    }
}

async fn listener() -> (TcpListener, Endpoint) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let e = Endpoint::parse(&format!("tcp://{}", l.local_addr().unwrap())).unwrap();
    (l, e)
}

#[tokio::test]
async fn a_router_refusing_with_error_is_a_peer_error() {
    let (l, endpoint) = listener().await;
    tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mut out = BytesMut::from(&encode::greeting()[..]);
        encode::put_error(&mut out, "go away");
        s.write_all(&out).await.unwrap();
        let _ = s.read(&mut [0u8; 256]).await;
    });
    let err = connect(&endpoint, Role::Dealer, &options(Duration::from_secs(5), 1))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ZmtpError::PeerError(r) if r == "go away"),
        "{err}"
    );
    assert_eq!(err.violation(), Some("peer_error"));
}

#[tokio::test]
async fn a_sub_refuses_a_peer_that_is_not_a_publisher() {
    let (l, endpoint) = listener().await;
    tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        s.write_all(&hello("SUB")).await.unwrap();
        let _ = s.read(&mut [0u8; 256]).await;
    });
    let err = connect_sub(&endpoint, &options(Duration::from_secs(5), 1))
        .await
        .unwrap_err();
    assert_eq!(err.violation(), Some("incompatible_socket_type"), "{err}");
}

#[tokio::test]
async fn a_silent_peer_times_out() {
    let (l, endpoint) = listener().await;
    let held = tokio::spawn(async move { l.accept().await.unwrap() });
    let err = connect_sub(&endpoint, &options(Duration::from_millis(200), 1))
        .await
        .unwrap_err();
    assert!(matches!(err, ZmtpError::HandshakeTimeout(_)), "{err}");
    assert_eq!(err.violation(), Some("handshake_timeout"));
    drop(held);
}

#[tokio::test]
async fn a_dealer_sends_its_request_and_answers_ping() {
    let (l, endpoint) = listener().await;
    let router = tokio::spawn(async move {
        let (s, _) = l.accept().await.unwrap();
        let mut peer = Peer::new(s);
        peer.stream.write_all(&hello("ROUTER")).await.unwrap();
        let meta = peer.handshake().await;
        assert_eq!(meta.get("Socket-Type").unwrap(), &b"DEALER"[..]);
        assert_eq!(meta.get("Identity").unwrap().len(), 0);
        let Event::Message(request) = peer.next().await else {
            panic!("no request")
        };
        let mut out = BytesMut::new();
        encode::put_ping(&mut out, 10, b"abc");
        encode::put_message(&mut out, &[Bytes::new(), Bytes::from_static(b"reply")]);
        peer.stream.write_all(&out).await.unwrap();
        let pong = peer.next().await;
        (request, pong)
    });
    let mut dealer = connect(&endpoint, Role::Dealer, &options(Duration::from_secs(5), 1))
        .await
        .unwrap();
    dealer
        .send(&[Bytes::new(), Bytes::copy_from_slice(&7u64.to_be_bytes())])
        .await
        .unwrap();
    let reply = dealer.recv().await.unwrap();
    assert_eq!(
        reply,
        [
            Frame::Data(Bytes::new()),
            Frame::Data(Bytes::from_static(b"reply"))
        ]
    );
    let (request, pong) = router.await.unwrap();
    assert_eq!(
        request,
        [
            Frame::Data(Bytes::new()),
            Frame::Data(Bytes::copy_from_slice(&7u64.to_be_bytes()))
        ]
    );
    assert_eq!(
        pong,
        Event::Command(Command::Pong(Bytes::from_static(b"abc")))
    );
}

#[tokio::test]
async fn a_bound_sub_counts_its_publishers_and_refuses_over_the_cap() {
    let endpoint = Endpoint::parse("tcp://127.0.0.1:0").unwrap();
    let mut sub = SubListener::bind(&endpoint, options(Duration::from_secs(5), 1))
        .await
        .unwrap();
    let addr = sub.local_addr();
    assert_ne!(addr.port(), 0);

    // The peer's script runs beside `sub.next()`, which accepts.
    let first = tokio::spawn(async move {
        let mut first = Peer::new(TcpStream::connect(addr).await.unwrap());
        first.stream.write_all(&hello("PUB")).await.unwrap();
        let meta = first.handshake().await;
        assert_eq!(meta.get("Socket-Type").unwrap(), &b"SUB"[..]);
        // The subscription: everything, in the message form.
        assert_eq!(
            first.next().await,
            Event::Message(vec![Frame::Data(Bytes::from_static(&[1]))])
        );
        first
    });
    let SubEvent::Up(up) = sub.next().await else {
        panic!("no Up")
    };
    let mut first = first.await.unwrap();
    assert_eq!(up, first.stream.local_addr().unwrap());

    // Over the cap: refused at once.
    let mut second = TcpStream::connect(addr).await.unwrap();
    assert!(matches!(
        sub.next().await,
        SubEvent::Refused {
            error: ZmtpError::TooManyConnections(1),
            ..
        }
    ));
    assert_eq!(second.read(&mut [0u8; 64]).await.unwrap_or(0), 0);

    let mut msg = BytesMut::new();
    encode::put_message(
        &mut msg,
        &[Bytes::from_static(b"t"), Bytes::from_static(b"x")],
    );
    first.stream.write_all(&msg).await.unwrap();
    let SubEvent::Message(frames) = sub.next().await else {
        panic!("no message")
    };
    assert_eq!(frames.len(), 2);
    drop(first);
    assert!(matches!(
        sub.next().await,
        SubEvent::Down {
            error: ZmtpError::Closed,
            ..
        }
    ));
    // A slot is free again.
    let mut third = TcpStream::connect(addr).await.unwrap();
    third.write_all(&hello("XPUB")).await.unwrap();
    assert!(matches!(sub.next().await, SubEvent::Up(_)));
}
