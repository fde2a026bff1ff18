//! The decoder against hand-built byte streams, then properties: no input
//! makes it panic, and what the encoders write decodes back.

use bytes::{BufMut, Bytes, BytesMut};
use proptest::prelude::*;

use super::*;
use crate::zmtp::encode::*;

const LIMITS: FrameLimits = FrameLimits {
    max_frame_bytes: 512,
    max_message_bytes: 4096,
};

/// A READY command with arbitrary properties (a peer's, not ours).
fn ready_with(props: &[(&str, &[u8])]) -> BytesMut {
    let mut data = Vec::new();
    for (name, value) in props {
        data.push(name.len() as u8);
        data.extend_from_slice(name.as_bytes());
        data.extend_from_slice(&(value.len() as u32).to_be_bytes());
        data.extend_from_slice(value);
    }
    let mut out = BytesMut::new();
    put_command(&mut out, "READY", &data);
    out
}

/// A publisher's greeting and READY.
fn pub_handshake() -> BytesMut {
    let mut out = BytesMut::from(&greeting()[..]);
    out.extend_from_slice(&ready_with(&[("Socket-Type", b"PUB")]));
    out
}

fn message(frames: &[&[u8]]) -> BytesMut {
    let frames: Vec<Bytes> = frames.iter().map(|f| Bytes::copy_from_slice(f)).collect();
    let mut out = BytesMut::new();
    put_message(&mut out, &frames);
    out
}

/// Decodes until more input is needed or an error.
fn drain(d: &mut Decoder, buf: &mut BytesMut) -> Result<Vec<Event>, ProtocolError> {
    let mut events = Vec::new();
    while let Some(e) = d.decode(buf)? {
        events.push(e);
    }
    Ok(events)
}

/// Feeds `input` in chunks of `chunk` bytes; every event, or the error.
fn feed(input: &[u8], chunk: usize) -> Result<Vec<Event>, ProtocolError> {
    let mut d = Decoder::new(LIMITS);
    let mut buf = BytesMut::new();
    let mut events = Vec::new();
    for piece in input.chunks(chunk.max(1)) {
        buf.extend_from_slice(piece);
        events.extend(drain(&mut d, &mut buf)?);
    }
    Ok(events)
}

fn data(frames: &[&[u8]]) -> Event {
    Event::Message(
        frames
            .iter()
            .map(|f| Frame::Data(Bytes::copy_from_slice(f)))
            .collect(),
    )
}

#[test]
fn our_greeting_is_zmtp_3_1_null() {
    let g = greeting();
    assert_eq!(g.len(), 64);
    assert_eq!((g[0], g[9], g[10], g[11]), (0xFF, 0x7F, 3, 1));
    assert_eq!(&g[12..16], b"NULL");
    assert!(g[1..9].iter().chain(&g[16..]).all(|&b| b == 0));
}

#[test]
fn handshake_then_messages() {
    let mut input = pub_handshake();
    input.extend_from_slice(&message(&[b"kv@0@m", &7u64.to_be_bytes(), b"payload"]));
    let events = feed(&input, usize::MAX).unwrap();
    assert_eq!(events.len(), 3, "{events:?}");
    assert_eq!(
        events[0],
        Event::Greeting(Greeting {
            major: 3,
            minor: 1,
            as_server: false
        })
    );
    let Event::Command(Command::Ready(meta)) = &events[1] else {
        panic!("{events:?}")
    };
    // Property names are case-insensitive.
    assert_eq!(meta.get("socket-type").map(|v| &v[..]), Some(&b"PUB"[..]));
    assert!(check_peer(Role::Sub, meta).is_ok());
    assert!(matches!(
        check_peer(Role::Dealer, meta),
        Err(ProtocolError::IncompatibleSocketType { ours: "DEALER", .. })
    ));
    assert_eq!(
        check_peer(Role::Sub, &Metadata::default()),
        Err(ProtocolError::MissingSocketType)
    );
    assert_eq!(
        events[2],
        data(&[b"kv@0@m", &7u64.to_be_bytes(), b"payload"])
    );
}

#[test]
fn our_ready_is_what_peers_expect() {
    let mut d = Decoder::new(LIMITS);
    let mut buf = BytesMut::from(&greeting()[..]);
    put_ready(&mut buf, Role::Dealer);
    let events = drain(&mut d, &mut buf).unwrap();
    let Event::Command(Command::Ready(meta)) = &events[1] else {
        panic!("{events:?}")
    };
    assert_eq!(
        meta.get("Socket-Type").map(|v| &v[..]),
        Some(&b"DEALER"[..])
    );
    assert_eq!(meta.get("Identity").map(|v| v.len()), Some(0));
    let mut sub = BytesMut::new();
    put_ready(&mut sub, Role::Sub);
    assert_eq!(sub, ready_with(&[("Socket-Type", b"SUB")]));
}

#[test]
fn byte_by_byte_equals_all_at_once() {
    let mut input = pub_handshake();
    put_ping(&mut input, 10, b"ctx");
    input.extend_from_slice(&message(&[b"a", b"", &[7u8; 300], b"z"]));
    input.extend_from_slice(&message(&[&[]]));
    input.extend_from_slice(&message(&[&[1u8; 512]]));
    let whole = feed(&input, usize::MAX).unwrap();
    assert_eq!(whole.len(), 6);
    for chunk in [1, 2, 3, 7, 64, 65] {
        assert_eq!(feed(&input, chunk).unwrap(), whole, "chunk {chunk}");
    }
}

#[test]
fn long_frames_and_multi_frame_messages() {
    let big = vec![9u8; 400]; // long form (> 255)
    let mut input = pub_handshake();
    input.extend_from_slice(&message(&[b"", b"topic", &big]));
    let events = feed(&input, usize::MAX).unwrap();
    assert_eq!(events[2], data(&[b"", b"topic", &big]));
    // A long header for a short frame is valid too.
    let mut input = pub_handshake();
    input.extend_from_slice(&[0x02, 0, 0, 0, 0, 0, 0, 0, 3, b'a', b'b', b'c']);
    assert_eq!(feed(&input, 1).unwrap()[2], data(&[b"abc"]));
}

#[test]
fn a_one_tib_header_is_refused_before_anything_is_allocated() {
    let mut d = Decoder::new(FrameLimits::from(&crate::Limits::default()));
    let mut buf = pub_handshake();
    assert_eq!(drain(&mut d, &mut buf).unwrap().len(), 2);
    assert!(buf.is_empty());
    let mut header = BytesMut::with_capacity(9);
    header.put_u8(0x02);
    header.put_u64(1 << 40);
    let capacity = header.capacity();
    let err = d.decode(&mut header).unwrap_err();
    assert_eq!(
        err,
        ProtocolError::FrameTooLarge {
            len: 1 << 40,
            limit: 16 << 20
        }
    );
    assert_eq!(err.label(), "frame_too_large");
    assert!(err.to_string().contains("max_message_bytes"), "{err}");
    // Nothing consumed, nothing reserved; the decoder stays failed.
    assert_eq!((header.len(), header.capacity()), (9, capacity));
    assert_eq!(d.decode(&mut header), Err(err));
    // The same with MORE set, and for u64::MAX.
    for (flags, len) in [(0x03u8, 1u64 << 40), (0x02, u64::MAX)] {
        let mut input = pub_handshake();
        input.put_u8(flags);
        input.put_u64(len);
        assert!(matches!(
            feed(&input, 1),
            Err(ProtocolError::FrameTooLarge { .. })
        ));
    }
}

#[test]
fn frames_over_max_frame_bytes_are_skipped_unbuffered() {
    let mut d = Decoder::new(LIMITS);
    let mut buf = pub_handshake();
    drain(&mut d, &mut buf).unwrap();
    let big = vec![5u8; 3000];
    let input = message(&[b"topic", &big, b"tail"]);
    let mut events = Vec::new();
    let mut peak = 0;
    for piece in input.chunks(100) {
        buf.extend_from_slice(piece);
        events.extend(drain(&mut d, &mut buf).unwrap());
        peak = peak.max(buf.len());
        // Only the bounded frame still lacks bytes ever asks for them.
        assert!(d.wants(buf.len()) <= 3000);
    }
    assert!(peak <= 100, "skipped bytes were buffered: {peak}");
    assert_eq!(
        events,
        [Event::Message(vec![
            Frame::Data(Bytes::from_static(b"topic")),
            Frame::Oversized(3000),
            Frame::Data(Bytes::from_static(b"tail")),
        ])]
    );
    // The next message decodes normally.
    buf.extend_from_slice(&message(&[b"next"]));
    assert_eq!(drain(&mut d, &mut buf).unwrap(), [data(&[b"next"])]);
}

#[test]
fn messages_are_bounded_in_frames_and_bytes() {
    let many: Vec<&[u8]> = vec![b"x"; MAX_FRAMES_PER_MESSAGE];
    let mut input = pub_handshake();
    input.extend_from_slice(&message(&many));
    assert_eq!(feed(&input, usize::MAX).unwrap().len(), 3);
    let too_many: Vec<&[u8]> = vec![b"x"; MAX_FRAMES_PER_MESSAGE + 1];
    let mut input = pub_handshake();
    input.extend_from_slice(&message(&too_many));
    assert_eq!(
        feed(&input, usize::MAX),
        Err(ProtocolError::TooManyFrames {
            limit: MAX_FRAMES_PER_MESSAGE
        })
    );
    // Oversized frames count toward the message's bytes.
    let chunk = vec![0u8; 1500];
    let mut input = pub_handshake();
    input.extend_from_slice(&message(&[&chunk, &chunk, &chunk]));
    assert_eq!(
        feed(&input, usize::MAX),
        Err(ProtocolError::MessageTooLarge { limit: 4096 })
    );
    // Each message has its own budget.
    let mut input = pub_handshake();
    for _ in 0..3 {
        input.extend_from_slice(&message(&[&chunk, &chunk]));
    }
    assert_eq!(feed(&input, 999).unwrap().len(), 5);
}

#[test]
fn bad_greetings_are_refused_as_soon_as_visible() {
    // An HTTP client: refused on its first byte.
    let mut d = Decoder::new(LIMITS);
    let mut buf = BytesMut::from(&b"G"[..]);
    assert_eq!(
        d.decode(&mut buf),
        Err(ProtocolError::BadGreeting {
            offset: 0,
            found: b'G'
        })
    );
    let g = greeting();
    let mut bad_tail = g;
    bad_tail[9] = 0x01;
    assert!(matches!(
        feed(&bad_tail[..10], 1),
        Err(ProtocolError::BadGreeting { offset: 9, .. })
    ));
    // ZMTP 2.0 (libzmq 3.x): refused on the version byte.
    let mut v2 = g;
    v2[10] = 1;
    assert_eq!(
        feed(&v2[..11], 1),
        Err(ProtocolError::UnsupportedVersion { major: 1 })
    );
    // A later major version is accepted (we speak 3.1 to it).
    let mut v4 = g;
    v4[10] = 4;
    assert!(feed(&v4, 64).is_ok());
    let mut curve = g;
    curve[12..32].copy_from_slice(b"CURVE\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0");
    let err = feed(&curve[..32], 1).unwrap_err();
    assert_eq!(err, ProtocolError::UnsupportedMechanism("CURVE".into()));
    assert!(err.to_string().contains("only NULL"), "{err}");
    // Nothing but the first 63 bytes: no event, no error.
    assert_eq!(feed(&g[..63], 5), Ok(vec![]));
}

#[test]
fn ping_is_decoded_and_pong_echoes_its_context() {
    let mut input = pub_handshake();
    put_ping(&mut input, 300, b"hello");
    let events = feed(&input, 1).unwrap();
    let Event::Command(Command::Ping { ttl, context }) = &events[2] else {
        panic!("{events:?}")
    };
    assert_eq!((*ttl, &context[..]), (300, &b"hello"[..]));
    let mut pong = BytesMut::new();
    put_pong(&mut pong, context);
    let mut input = pub_handshake();
    input.extend_from_slice(&pong);
    assert_eq!(
        feed(&input, usize::MAX).unwrap()[2],
        Event::Command(Command::Pong(Bytes::from_static(b"hello")))
    );
}

#[test]
fn commands_other_than_ready_and_error_are_refused_before_ready() {
    let hello = |cmd: BytesMut| {
        let mut input = BytesMut::from(&greeting()[..]);
        input.extend_from_slice(&cmd);
        feed(&input, usize::MAX)
    };
    let mut err = BytesMut::new();
    put_error(&mut err, "no thanks");
    assert_eq!(
        hello(err).unwrap()[1],
        Event::Command(Command::Error("no thanks".into()))
    );
    let mut ping = BytesMut::new();
    put_ping(&mut ping, 1, b"");
    assert_eq!(
        hello(ping),
        Err(ProtocolError::ExpectedReady("PING".into()))
    );
    assert_eq!(
        hello(message(&[b"early"])),
        Err(ProtocolError::MessageBeforeReady)
    );
    let mut twice = pub_handshake();
    twice.extend_from_slice(&ready_with(&[("Socket-Type", b"PUB")]));
    assert_eq!(feed(&twice, 3), Err(ProtocolError::DuplicateReady));
}

#[test]
fn malformed_frames_and_commands_are_refused() {
    let after_ready = |bytes: &[u8]| {
        let mut input = pub_handshake();
        input.extend_from_slice(bytes);
        feed(&input, usize::MAX)
    };
    assert_eq!(
        after_ready(&[0x08, 0]),
        Err(ProtocolError::ReservedFlags(0x08))
    );
    // A command with MORE, and a command between a message's frames.
    assert_eq!(
        after_ready(&[0x05, 1, 0]),
        Err(ProtocolError::MisplacedCommand)
    );
    assert_eq!(
        after_ready(&[0x01, 1, b'a', 0x04, 1, 0]),
        Err(ProtocolError::MisplacedCommand)
    );
    let mut huge = vec![0x06];
    huge.extend_from_slice(&(MAX_COMMAND_BYTES as u64 + 1).to_be_bytes());
    assert!(matches!(
        after_ready(&huge),
        Err(ProtocolError::CommandTooLarge { .. })
    ));
    // Unnamed and truncated commands.
    assert_eq!(
        after_ready(&[0x04, 0]),
        Err(ProtocolError::MalformedCommand("unnamed"))
    );
    assert_eq!(
        after_ready(&[0x04, 3, 9, b'a', b'b']),
        Err(ProtocolError::MalformedCommand("unnamed"))
    );
    assert_eq!(
        after_ready(&[0x04, 5, 4, b'P', b'I', b'N', b'G']),
        Err(ProtocolError::MalformedCommand("PING"))
    );
    assert_eq!(
        after_ready(&[0x04, 7, 5, b'E', b'R', b'R', b'O', b'R', 9]),
        Err(ProtocolError::MalformedCommand("ERROR"))
    );
    // Unknown commands decode (and are ignored by the socket).
    assert_eq!(
        after_ready(&[0x04, 4, 3, b'F', b'O', b'O']).unwrap()[2],
        Event::Command(Command::Other(Bytes::from_static(b"FOO")))
    );
    // A READY property whose value runs past the frame.
    let mut bad_ready = BytesMut::from(&greeting()[..]);
    put_command(&mut bad_ready, "READY", &[1, b'X', 0, 0, 0, 9, b'v']);
    assert_eq!(
        feed(&bad_ready, usize::MAX),
        Err(ProtocolError::MalformedCommand("READY"))
    );
}

#[test]
fn subscription_is_the_message_form() {
    let mut out = BytesMut::new();
    put_subscribe(&mut out, b"");
    assert_eq!(&out[..], &[0x00, 0x01, 0x01]);
    let mut out = BytesMut::new();
    put_subscribe(&mut out, b"kv");
    assert_eq!(&out[..], &[0x00, 0x03, 0x01, b'k', b'v']);
}

/// A message whose frames fit [`LIMITS`] in count and total size.
fn messages() -> impl Strategy<Value = Vec<Vec<Vec<u8>>>> {
    let frame = prop_oneof![
        4 => prop::collection::vec(any::<u8>(), 0..40),
        2 => prop::collection::vec(any::<u8>(), 250..300),
        1 => prop::collection::vec(any::<u8>(), 500..700),
    ];
    let message = prop::collection::vec(frame, 1..=MAX_FRAMES_PER_MESSAGE)
        .prop_filter("fits max_message_bytes", |m| {
            m.iter().map(Vec::len).sum::<usize>() <= LIMITS.max_message_bytes
        });
    prop::collection::vec(message, 0..6)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Arbitrary bytes, alone or after a valid handshake, in arbitrary
    /// chunks: no panic, what stays buffered is bounded, and an error is
    /// final.
    #[test]
    fn never_panics(
        bytes in prop::collection::vec(any::<u8>(), 0..2048),
        chunk in 1usize..300,
        after_handshake in any::<bool>(),
    ) {
        let mut input = if after_handshake { pub_handshake().to_vec() } else { Vec::new() };
        input.extend_from_slice(&bytes);
        let mut d = Decoder::new(LIMITS);
        let mut buf = BytesMut::new();
        let mut fed = 0;
        for piece in input.chunks(chunk) {
            buf.extend_from_slice(piece);
            fed += piece.len();
            match drain(&mut d, &mut buf) {
                Ok(_) => {
                    prop_assert!(buf.len() <= fed);
                    // Bounded by the largest frame, whatever the input.
                    prop_assert!(buf.len() < MAX_COMMAND_BYTES.max(LIMITS.max_frame_bytes));
                }
                Err(e) => {
                    prop_assert_eq!(d.decode(&mut buf), Err(e));
                    break;
                }
            }
            prop_assert!(d.wants(buf.len()) >= 1);
        }
    }

    /// What the encoders write decodes back, however it is split; frames
    /// over `max_frame_bytes` come back as their length.
    #[test]
    fn encode_then_decode_round_trips(
        msgs in messages(),
        chunk in 1usize..200,
        ping in prop::collection::vec(any::<u8>(), 0..16),
    ) {
        let mut input = pub_handshake();
        let mut want = vec![];
        for m in &msgs {
            let frames: Vec<Bytes> = m.iter().map(|f| Bytes::copy_from_slice(f)).collect();
            put_message(&mut input, &frames);
            want.push(Event::Message(m.iter().map(|f| {
                if f.len() > LIMITS.max_frame_bytes {
                    Frame::Oversized(f.len() as u64)
                } else {
                    Frame::Data(Bytes::copy_from_slice(f))
                }
            }).collect()));
        }
        put_ping(&mut input, 7, &ping);
        want.push(Event::Command(Command::Ping { ttl: 7, context: Bytes::from(ping) }));
        let got = feed(&input, chunk).unwrap();
        prop_assert_eq!(&got[2..], &want[..]);
    }
}
