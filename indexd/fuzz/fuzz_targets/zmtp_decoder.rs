//! Arbitrary bytes into indexd's ZMTP decoder, split into reads as the input
//! says. Byte 0: read size (0 → 1); byte 1, bit 0: start with a valid
//! publisher handshake so the fuzzer reaches the frame states at once.
//! Checks: no panic; an error is final; every message respects the caps;
//! what stays buffered is bounded by the largest frame, not by the input.
#![no_main]

use bytes::BytesMut;
use indexd::zmtp::MAX_FRAMES_PER_MESSAGE;
use indexd::zmtp::codec::{self, Event, Frame, FrameLimits, MAX_COMMAND_BYTES};
use indexd::zmtp::encode;
use libfuzzer_sys::fuzz_target;

const LIMITS: FrameLimits = FrameLimits {
    max_frame_bytes: 256,
    max_message_bytes: 2048,
};

fn handshake() -> Vec<u8> {
    let mut out = BytesMut::from(&encode::greeting()[..]);
    let mut meta = vec![11];
    meta.extend_from_slice(b"Socket-Type");
    meta.extend_from_slice(&3u32.to_be_bytes());
    meta.extend_from_slice(b"PUB");
    encode::put_command(&mut out, "READY", &meta);
    out.to_vec()
}

fn check(event: &Event) {
    if let Event::Message(frames) = event {
        assert!(!frames.is_empty() && frames.len() <= MAX_FRAMES_PER_MESSAGE);
        let mut total = 0u64;
        for f in frames {
            total += match f {
                Frame::Data(b) => {
                    assert!(b.len() <= LIMITS.max_frame_bytes);
                    b.len() as u64
                }
                Frame::Oversized(len) => {
                    assert!(*len > LIMITS.max_frame_bytes as u64);
                    *len
                }
            };
        }
        assert!(total <= LIMITS.max_message_bytes as u64);
    }
}

fuzz_target!(|data: &[u8]| {
    let [chunk, mode, rest @ ..] = data else {
        return;
    };
    let mut input = if mode & 1 == 1 {
        handshake()
    } else {
        Vec::new()
    };
    input.extend_from_slice(rest);
    let mut decoder = codec::Decoder::new(LIMITS);
    let mut buf = BytesMut::new();
    for piece in input.chunks(usize::from(*chunk).max(1)) {
        buf.extend_from_slice(piece);
        loop {
            match decoder.decode(&mut buf) {
                Ok(Some(event)) => check(&event),
                Ok(None) => break,
                Err(e) => {
                    assert_eq!(decoder.decode(&mut buf), Err(e));
                    return;
                }
            }
        }
        assert!(
            buf.len()
                < MAX_COMMAND_BYTES
                    .max(LIMITS.max_frame_bytes)
                    .max(codec::GREETING_LEN)
        );
        assert!(decoder.wants(buf.len()) >= 1);
    }
});
