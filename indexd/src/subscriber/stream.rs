//! One replica's event stream: sequence tracking, replays, resuming from a
//! snapshot, and application to the index.

use std::collections::VecDeque;

use sha2::{Digest as _, Sha256};

use super::replay::Replay;
use super::{MAX_REPLAY_BATCHES, MAX_REPLAY_PAGES};
use crate::index::Applied;
use crate::message::{self, ReplayAnswer};
use crate::state::{Replica, Shared};
use crate::wire::{self, DecodeError};
use crate::zmtp::Frame;

/// What a live seq means given what has been applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The next batch (or the first one seen): apply it.
    Apply,
    /// Already applied by a replay: skip.
    Duplicate,
    /// Batches `from..seq` are missing.
    Gap {
        /// The first missing seq.
        from: u64,
    },
    /// The publisher restarted.
    Restart,
}

/// Sequence bookkeeping of one stream.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tracker {
    /// The seq expected next (None: nothing applied yet).
    pub next: Option<u64>,
    /// `(seq, payload digest)` of the batches the last replay delivered, in
    /// seq order: a live copy of one of them is a duplicate, anything else
    /// below `next` is a restarted engine. Cleared once live seqs pass `next`.
    replayed: VecDeque<(u64, u64)>,
}

/// A digest of a payload, to tell a replayed batch's live copy from a
/// restarted engine's batch with the same seq. Stable across processes and
/// builds (the first 8 bytes of its SHA-256): a snapshot keeps the digest of
/// the last batch applied, and a restarted indexd compares it with the
/// replayed batch of that seq.
pub fn digest(payload: &[u8]) -> u64 {
    let hash = Sha256::digest(payload);
    let mut first = [0u8; 8];
    for (dst, src) in first.iter_mut().zip(hash.iter()) {
        *dst = *src;
    }
    u64::from_le_bytes(first)
}

/// [`digest`] of a payload frame (an oversized one by its length).
pub(crate) fn frame_digest(payload: &Frame) -> u64 {
    match payload {
        Frame::Data(b) => digest(b),
        Frame::Oversized(len) => {
            let mut tagged = b"oversized".to_vec();
            tagged.extend_from_slice(&len.to_le_bytes());
            digest(&tagged)
        }
    }
}

impl Tracker {
    /// Classifies a live batch.
    pub fn classify(&mut self, seq: u64, digest: u64) -> Verdict {
        let Some(next) = self.next else {
            return Verdict::Apply;
        };
        if seq >= next {
            self.replayed.clear();
            return if seq == next {
                Verdict::Apply
            } else {
                Verdict::Gap { from: next }
            };
        }
        match self.replayed.binary_search_by_key(&seq, |(s, _)| *s) {
            Ok(i) if self.replayed.get(i).is_some_and(|(_, d)| *d == digest) => Verdict::Duplicate,
            _ => Verdict::Restart,
        }
    }

    /// Records that batch `seq` was applied.
    pub fn applied(&mut self, seq: u64) {
        self.next = Some(seq.saturating_add(1));
    }

    /// Records a batch a replay delivered (bounded).
    pub fn note_replayed(&mut self, seq: u64, digest: u64) {
        if self.replayed.back().is_some_and(|(s, _)| *s >= seq) {
            self.replayed.clear();
        }
        if self.replayed.len() >= MAX_REPLAY_BATCHES {
            self.replayed.pop_front();
        }
        self.replayed.push_back((seq, digest));
    }
}

/// How a replay went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ReplayResult {
    /// Every batch from the requested seq to the end of the buffer.
    Complete,
    /// The buffer no longer held the first batches, or the replay broke off.
    Incomplete,
    /// No replay endpoint, or it did not answer.
    Unavailable,
    /// Resuming: the first batch was not the one expected (metric label).
    Unproven(&'static str),
}

/// One replica's event stream: sequence tracking, replays, and application
/// to the index. Independent of the live transport (the caller hands it each
/// live message's frames).
#[derive(Debug)]
pub struct Stream<'a, R> {
    shared: &'a Shared,
    replica: &'a Replica,
    replay: R,
    pub(super) tracker: Tracker,
}

impl<'a, R: Replay> Stream<'a, R> {
    /// A stream with nothing applied yet.
    pub fn new(shared: &'a Shared, replica: &'a Replica, replay: R) -> Self {
        Self {
            shared,
            replica,
            replay,
            tracker: Tracker::default(),
        }
    }

    /// Start-up, reconnect, restart: resumes from a snapshot's point where
    /// the replica has one and the replay proves it, else purges and replays
    /// from seq 0.
    pub async fn resync(&mut self, purge_counted: bool) {
        self.replica.set_fresh(false);
        if let Some(point) = self.replica.take_resume() {
            if self.resume(point).await {
                self.replica.set_fresh(true);
                return;
            }
            // What cannot be proven is forgotten: this replica only.
            self.shared.purge(self.replica, "snapshot");
        } else if purge_counted {
            self.shared.purge(self.replica, "resync");
        } else {
            self.shared.index.purge(self.replica.slot);
        }
        self.tracker = Tracker::default();
        let result = self.replay(0, None, None, "start").await;
        let label = match result {
            ReplayResult::Complete => "complete",
            // Already purged: a partial buffer is all there is to recover.
            ReplayResult::Incomplete | ReplayResult::Unproven(_) => "partial",
            ReplayResult::Unavailable => "unavailable",
        };
        self.shared.metrics.replays.inc([label]);
        // vLLM's buffer is never emptied: a complete replay with nothing in
        // it means nothing was published yet, so the next batch is seq 0 and
        // a first live seq above it is a gap (a slow-joiner loss), not a
        // baseline.
        if result == ReplayResult::Complete && self.tracker.next.is_none() {
            self.tracker.next = Some(0);
        }
        self.replica.set_fresh(true);
    }

    /// Resumes from a snapshot's point: replays from its seq, which must come
    /// back first with the same digest (the same publisher process, nothing
    /// lost since), then applies what follows. False, with the index as the
    /// snapshot left it, when that cannot be proven: the buffer no longer
    /// holds the seq, or holds another batch there, or nothing at all (the
    /// engine restarted), or no replay answers.
    async fn resume(&mut self, point: Applied) -> bool {
        self.tracker = Tracker::default();
        let result = self.replay(point.seq, Some(point), None, "snapshot").await;
        let (resumed, label) = match result {
            ReplayResult::Complete => (true, "proven"),
            // Proven, then broken off: the live stream (a gap) carries on.
            ReplayResult::Incomplete if self.tracker.next.is_some() => (true, "proven_partial"),
            ReplayResult::Incomplete | ReplayResult::Unavailable => (false, "unavailable"),
            ReplayResult::Unproven(why) => (false, why),
        };
        self.shared.metrics.snapshot_resumes.inc([label]);
        if resumed {
            self.shared.metrics.replays.inc(["complete"]);
            tracing::info!(endpoint = %self.replica.id(), seq = point.seq, "resumed from the snapshot");
        } else {
            tracing::info!(endpoint = %self.replica.id(), seq = point.seq, reason = label, "snapshot not provable for this replica; resyncing from seq 0");
        }
        resumed
    }

    /// Handles one live message (`[topic, seq, payload]` or `[seq, payload]`).
    pub async fn on_live<F: Into<Frame>>(&mut self, frames: Vec<F>) {
        let frames: Vec<Frame> = frames.into_iter().map(Into::into).collect();
        let (seq, payload) = match message::live(&frames) {
            Ok(m) => m,
            Err(e) => {
                self.shared.metrics.decode_errors.inc([e.label(false)]);
                if self.replica.may_warn() {
                    tracing::warn!(endpoint = %self.replica.id(), frames = frames.len(), error = %e, "unusable live message");
                }
                return;
            }
        };
        let live_digest = frame_digest(payload);
        match self.tracker.classify(seq, live_digest) {
            Verdict::Apply => self.apply(seq, payload, live_digest),
            Verdict::Duplicate => self.shared.metrics.duplicates.inc(),
            Verdict::Gap { from } => {
                self.shared.metrics.gaps.inc();
                // The replica stays a candidate meanwhile: its index lacks
                // only the gap's batches, which the replay is about to
                // apply. Taking it out would send its conversations to
                // replicas holding less of them (a Pick names only fresh
                // replicas), which is worse than a few batches' lag.
                tracing::info!(endpoint = %self.replica.id(), from, to = seq, "seq gap; replaying");
                let result = self.replay(from, None, Some(seq), "gap").await;
                // Covered: the replay reached this batch (after a purge of its
                // own if the buffer had lost the start of the gap).
                let covered = self.tracker.next.is_some_and(|n| n > seq);
                self.shared.metrics.replays.inc([match (result, covered) {
                    (ReplayResult::Complete, true) => "complete",
                    (ReplayResult::Unavailable, _) => "unavailable",
                    _ => "incomplete",
                }]);
                if !covered {
                    // What is missing cannot be recovered: forget the replica
                    // and continue from this batch.
                    self.shared.purge(self.replica, "gap");
                    self.tracker = Tracker::default();
                    self.apply(seq, payload, live_digest);
                }
            }
            Verdict::Restart => {
                tracing::info!(endpoint = %self.replica.id(), seq, "seq dropped: engine restarted");
                self.shared.purge(self.replica, "restart");
                self.tracker = Tracker::default();
                if seq == 0 {
                    self.apply(seq, payload, live_digest);
                } else {
                    // Batches 0..seq of the new engine were missed.
                    self.resync(false).await;
                    if self.tracker.classify(seq, live_digest) == Verdict::Apply {
                        self.apply(seq, payload, live_digest);
                    }
                }
            }
        }
    }

    fn apply(&mut self, seq: u64, payload: &Frame, digest: u64) {
        self.tracker.applied(seq);
        let applied = Applied { seq, digest };
        let limits = &self.shared.config.limits;
        let decoded = match payload {
            Frame::Data(bytes) => wire::decode_batch(bytes, limits),
            // Discarded unread by the transport: what the decoder says of it.
            Frame::Oversized(_) => Err(DecodeError::TooLarge {
                what: "frame",
                limit: limits.max_frame_bytes,
            }),
        };
        match decoded {
            Ok(batch) => self
                .shared
                .ingest_applied(self.replica, batch, Some(applied)),
            Err(e) => {
                self.shared.metrics.decode_errors.inc([e.label()]);
                if self.replica.may_warn() {
                    tracing::warn!(endpoint = %self.replica.id(), seq, error = %e, "undecodable KV-event batch; purging replica (further warnings for 10 s suppressed; see indexd_decode_errors_total)");
                }
                // Its removals are lost: what we hold may be wrong.
                self.shared.purge(self.replica, "decode_error");
                self.shared.index.set_applied(self.replica.slot, applied);
            }
        }
    }

    /// Replays from `from`, applying batches as they come. Resuming
    /// (`expect`), the first batch must be `expect` itself: it is checked,
    /// not applied again.
    ///
    /// vLLM answers a replay by sending every buffered batch at once through
    /// a ROUTER socket, which drops what exceeds its send queue (1,000
    /// messages by default) without a word: a reader slower than the
    /// publisher gets the first ~1,500 batches, then nothing, the end marker
    /// included. A replay is therefore read in pages: when the answer goes
    /// quiet or skips seqs after the page's first batch (vLLM's buffer holds
    /// consecutive seqs, so a skip inside an answer is a drop), it is asked
    /// again from the first batch not yet applied, until the end marker
    /// comes ([`MAX_REPLAY_PAGES`] at most). A batch dropped just before
    /// the end marker cannot be seen in the answer: a gap's replay knows
    /// the live batch it must reach (`reach`) and asks again until it has.
    async fn replay(
        &mut self,
        from: u64,
        expect: Option<Applied>,
        reach: Option<u64>,
        why: &'static str,
    ) -> ReplayResult {
        self.shared.metrics.replay_requests.inc([why]);
        let mut r = Replaying {
            from,
            expect,
            reach,
            expected: from,
            complete: true,
            received: 0,
            page_received: 0,
        };
        for page in 0..MAX_REPLAY_PAGES {
            if page > 0 {
                self.shared.metrics.replay_requests.inc(["page"]);
            }
            if !self.replay.request(r.expected).await {
                return r.broken_off();
            }
            r.page_received = 0;
            let ended = loop {
                let Some(frames) = self.replay.next_reply().await else {
                    break None;
                };
                match self.replayed_batch(&mut r, &frames) {
                    Read::Next => {}
                    Read::Cut => break None,
                    Read::Ended(result) => break Some(result),
                }
            };
            if let Some(result) = ended {
                return result;
            }
            if r.page_received == 0 {
                break;
            }
            tracing::debug!(endpoint = %self.replica.id(), from, next = r.expected, "replay answer cut short; asking again from the next batch");
        }
        tracing::warn!(endpoint = %self.replica.id(), from, next = r.expected, "replay broke off before its end marker");
        r.broken_off()
    }

    /// One message of a replay's answer: a batch applied (or checked, or
    /// already applied), the answer cut short (ask again from
    /// `r.expected`), or the replay's end.
    fn replayed_batch(&mut self, r: &mut Replaying, frames: &[Frame]) -> Read {
        let (seq, payload) = match message::replay_answer(frames) {
            Ok(ReplayAnswer::Batch { seq, payload }) => (seq, payload),
            Ok(ReplayAnswer::End) => {
                if r.reach.is_some_and(|reach| r.expected <= reach) && r.page_received > 0 {
                    // Short of the live batch: dropped on the way.
                    return Read::Cut;
                }
                return Read::Ended(match (r.expect, r.received) {
                    // Nothing at or after the saved seq: the engine's seqs
                    // went back (it restarted).
                    (Some(_), 0) => ReplayResult::Unproven("restarted"),
                    _ if r.complete => ReplayResult::Complete,
                    _ => ReplayResult::Incomplete,
                });
            }
            Err(e) => {
                self.shared.metrics.decode_errors.inc([e.label(true)]);
                if r.expect.is_some() && r.received == 0 {
                    return Read::Ended(ReplayResult::Unproven("unreadable"));
                }
                r.complete = false;
                return Read::Next;
            }
        };
        if r.page_received > 0 && seq != r.expected {
            // Dropped on the way (see [`Self::replay`]): ask again from there.
            return Read::Cut;
        }
        r.received += 1;
        r.page_received += 1;
        if r.received > MAX_REPLAY_BATCHES {
            return Read::Ended(ReplayResult::Incomplete);
        }
        let digest = frame_digest(payload);
        if let Some(point) = r.expect
            && r.received == 1
        {
            if seq != point.seq {
                // The buffer no longer holds the saved seq.
                return Read::Ended(ReplayResult::Unproven("gone"));
            }
            if digest != point.digest {
                return Read::Ended(ReplayResult::Unproven("restarted"));
            }
            // Proven: what the snapshot holds is this publisher's state up
            // to `seq`.
            self.tracker.note_replayed(seq, digest);
            self.tracker.applied(seq);
            r.expected = seq.saturating_add(1);
            return Read::Next;
        }
        if seq != r.expected && r.complete {
            r.complete = false;
            if r.from > 0 || r.expect.is_some() {
                // Batches expected..seq are gone from the buffer.
                self.shared.purge(self.replica, "gap");
                self.tracker = Tracker::default();
            }
        }
        r.expected = seq.saturating_add(1);
        self.tracker.note_replayed(seq, digest);
        if self.tracker.next.is_some_and(|n| seq < n) {
            return Read::Next;
        }
        self.apply(seq, payload, digest);
        Read::Next
    }
}

/// A replay in progress ([`Stream::replay`]).
#[derive(Debug)]
struct Replaying {
    /// The seq asked for first.
    from: u64,
    /// Resuming: the batch the answer must start with.
    expect: Option<Applied>,
    /// A gap's replay: the live batch it must reach.
    reach: Option<u64>,
    /// The next seq wanted (where a cut answer is asked again from).
    expected: u64,
    /// No batch was missing from the buffer so far.
    complete: bool,
    /// Batches received, over every page and in this page.
    received: usize,
    page_received: usize,
}

impl Replaying {
    /// The result of a replay that ended without its end marker.
    fn broken_off(&self) -> ReplayResult {
        if self.received == 0 {
            ReplayResult::Unavailable
        } else {
            ReplayResult::Incomplete
        }
    }
}

/// What one message of a replay's answer did ([`Stream::replayed_batch`]).
#[derive(Debug)]
enum Read {
    /// Go on reading this page.
    Next,
    /// The answer was cut short: ask again from the next seq wanted.
    Cut,
    /// The replay is over.
    Ended(ReplayResult),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracker_classifies() {
        let mut t = Tracker::default();
        assert_eq!(t.classify(5, 0), Verdict::Apply);
        t.applied(5);
        assert_eq!(t.classify(6, 0), Verdict::Apply);
        t.applied(6);
        assert_eq!(t.classify(9, 0), Verdict::Gap { from: 7 });
        // A replay delivered 7..=12 after live 9 triggered it.
        for seq in 7..=12 {
            t.note_replayed(seq, 100 + seq);
            t.applied(seq);
        }
        assert_eq!(t.classify(10, 110), Verdict::Duplicate);
        assert_eq!(t.classify(12, 112), Verdict::Duplicate);
        // Same seq, other bytes: a restarted engine.
        assert_eq!(t.classify(10, 999), Verdict::Restart);
        assert_eq!(t.classify(3, 0), Verdict::Restart);
        assert_eq!(t.classify(13, 0), Verdict::Apply);
        t.applied(13);
        // Live seqs passed the replay: an old seq now means a restart.
        assert_eq!(t.classify(11, 111), Verdict::Restart);
        assert_eq!(t.classify(0, 0), Verdict::Restart);
    }
}
