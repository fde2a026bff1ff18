//! Arbitrary frames as a replay answer and as a live message, classified as
//! indexd's subscriber does (seq, payload, end marker), and a batch's payload
//! decoded. The input is a list of frames: a length byte, then that many
//! bytes, repeated. Checks: no panic; a batch never carries the end seq.
#![no_main]

use bytes::Bytes;
use indexd::message::{self, ReplayAnswer};
use indexd::wire::{self, Limits, REPLAY_END_SEQ};
use indexd::zmtp::Frame;
use libfuzzer_sys::fuzz_target;

fn frames(mut data: &[u8]) -> Vec<Frame> {
    let mut out = Vec::new();
    while let [len, rest @ ..] = data {
        // 0xff: a frame the transport discarded as oversized.
        if *len == 0xff {
            out.push(Frame::Oversized(1 << 30));
            data = rest;
            continue;
        }
        let n = usize::from(*len).min(rest.len());
        out.push(Frame::Data(Bytes::copy_from_slice(&rest[..n])));
        data = &rest[n..];
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let frames = frames(data);
    let payload = match message::replay_answer(&frames) {
        Ok(ReplayAnswer::Batch { seq, payload }) => {
            assert_ne!(seq, REPLAY_END_SEQ);
            Some(payload)
        }
        Ok(ReplayAnswer::End) | Err(_) => None,
    };
    if let Some(Frame::Data(bytes)) = payload {
        let _ = wire::decode_batch(bytes, &Limits::default());
    }
    if let Ok((_, Frame::Data(bytes))) = message::live(&frames) {
        let _ = wire::decode_batch(bytes, &Limits::default());
    }
});
