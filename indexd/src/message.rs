//! vLLM's KV-event messages frame by frame: which frame is the seq and which
//! the payload, in live messages and replay answers. Pure functions over the
//! transport's frames (fuzzed in `indexd/fuzz`).
//!
//! - Live: `[topic, seq, payload]`, or `[seq, payload]`.
//! - Replay answer (DEALER side): `["", topic, seq, payload]`, or without the
//!   topic frame (vLLM < 0.26); the end marker has seq `ff × 8`
//!   ([`REPLAY_END_SEQ`]) and an empty payload.
//!
//! A seq frame is exactly 8 bytes, big-endian.

use crate::wire::{REPLAY_END_SEQ, decode_seq};
use crate::zmtp::Frame;

/// Why a message's frames are not a batch. Each variant is a metric label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MessageError {
    /// Not two or three frames (after a replay answer's delimiter).
    #[error("unexpected frame count {0}")]
    FrameCount(usize),
    /// The seq frame is not 8 bytes.
    #[error("seq frame is not 8 bytes")]
    Seq,
}

impl MessageError {
    /// The metric label (`indexd_decode_errors_total{kind}`); `replay`
    /// tells a replay answer from a live message.
    pub fn label(self, replay: bool) -> &'static str {
        match (self, replay) {
            (Self::FrameCount(_), false) => "frames",
            (Self::FrameCount(_), true) => "replay_frames",
            (Self::Seq, _) => "seq",
        }
    }
}

/// A replay answer, classified.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplayAnswer<'a> {
    /// One buffered batch.
    Batch {
        /// Its seq.
        seq: u64,
        /// Its payload frame.
        payload: &'a Frame,
    },
    /// The end of the replay.
    End,
}

/// The seq and payload of a live message.
pub fn live(frames: &[Frame]) -> Result<(u64, &Frame), MessageError> {
    let (seq, payload) = match frames {
        [_, seq, payload] | [seq, payload] => (seq, payload),
        _ => return Err(MessageError::FrameCount(frames.len())),
    };
    let seq = seq
        .data()
        .and_then(|f| decode_seq(f))
        .ok_or(MessageError::Seq)?;
    Ok((seq, payload))
}

/// A replay answer: a batch or the end marker.
pub fn replay_answer(frames: &[Frame]) -> Result<ReplayAnswer<'_>, MessageError> {
    let body = match frames.split_first() {
        Some((Frame::Data(first), rest)) if first.is_empty() => rest,
        _ => frames,
    };
    let (seq, payload) = live(body)?;
    Ok(if seq == REPLAY_END_SEQ {
        ReplayAnswer::End
    } else {
        ReplayAnswer::Batch { seq, payload }
    })
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    fn f(b: &[u8]) -> Frame {
        Frame::Data(Bytes::copy_from_slice(b))
    }

    #[test]
    fn live_and_replay_layouts() {
        let seq = 7u64.to_be_bytes();
        let payload = f(b"p");
        assert_eq!(live(&[f(b"topic"), f(&seq), f(b"p")]), Ok((7, &payload)));
        assert_eq!(live(&[f(&seq), f(b"p")]), Ok((7, &payload)));
        assert_eq!(live(&[f(&seq)]), Err(MessageError::FrameCount(1)));
        assert_eq!(live(&[f(b"short"), f(b"p")]), Err(MessageError::Seq));
        assert_eq!(
            live(&[Frame::Oversized(8), f(b"p")]),
            Err(MessageError::Seq)
        );
        for frames in [
            vec![f(b""), f(b"topic"), f(&seq), f(b"p")],
            vec![f(b""), f(&seq), f(b"p")],
        ] {
            assert_eq!(
                replay_answer(&frames),
                Ok(ReplayAnswer::Batch {
                    seq: 7,
                    payload: &payload
                })
            );
        }
        let end = [0xff; 8];
        assert_eq!(
            replay_answer(&[f(b""), f(b""), f(&end), f(b"")]),
            Ok(ReplayAnswer::End)
        );
        assert_eq!(
            replay_answer(&[f(b""), f(&end), f(b"")]),
            Ok(ReplayAnswer::End)
        );
        assert_eq!(
            replay_answer(&[f(b""), f(b"a"), f(b"b"), f(b"c"), f(b"d")]),
            Err(MessageError::FrameCount(4))
        );
        assert_eq!(MessageError::FrameCount(4).label(true), "replay_frames");
    }
}
