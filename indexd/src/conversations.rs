//! Where this indexd's conversations are: the move rule's measure of a
//! lasting imbalance ([`crate::score`]).
//!
//! A conversation is known by its tip: the last full block key of the
//! prompt its latest turn sent, short of the block holding that prompt's
//! last token (the caller passes the keys so cut, `pick::track`). The next
//! turn's prompt continues the last one, so it holds that key among its
//! own, usually near its end (the answer and the new message come after
//! it): looking back from the end of a prompt for a known tip finds the
//! conversation it continues, and where it was. A prompt that continues
//! none starts a conversation. First turns behind one shared prompt with no
//! full block of their own share a tip (the prompt's last block): it counts
//! each, and each later turn takes one off it, the one on its own replica
//! if any. Each replica's count is the conversations whose latest turn went
//! there; conversations idle for [`IDLE`] are forgotten (indexd sees no
//! end).
//!
//! Counting tips is exact where counting picks is not: a replica whose
//! conversations advance faster gets more picks for as many conversations,
//! and a new conversation held on the replica holding only its shared
//! system prompt is still a new conversation.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use kvroute_proto::keys::BlockKey;
use smallvec::SmallVec;

use crate::ids::FastMap;
use crate::ids::ReplicaSlot;

/// A conversation without a turn for this long has ended, as far as the
/// counts go.
pub(crate) const IDLE: Duration = Duration::from_secs(300);
/// At most this many conversations are tracked; the least recent go first.
const MAX_CONVERSATIONS: usize = 65_536;
/// How far back from a prompt's end its previous tip is looked for: a turn
/// adding more blocks than this (a very long tool result) starts a new
/// conversation in the counts, and the old one is forgotten when idle.
const LOOKBACK: usize = 1_024;
/// Bits of the filter in front of the tips (128 KiB): a new conversation's
/// prompt looks up to [`LOOKBACK`] keys, nearly all of them no tip, and a
/// bit test costs a fraction of a map lookup. Keys are XXH3-128 digests
/// (uniform), so their low bits index it.
const FILTER_BITS: usize = 1 << 20;

/// The latest turn of the conversations whose latest prompt's tip is one
/// key: one conversation, nearly always. First turns behind one shared
/// system prompt, none with a full block of its own, share its last block.
#[derive(Clone, Debug)]
struct Tip {
    /// Where each of them went.
    slots: SmallVec<[ReplicaSlot; 1]>,
    at: Instant,
    /// When the conversation last changed replica (moved, or re-homed from
    /// one that left), if it ever did.
    moved_at: Option<Instant>,
}

/// The conversation a prompt continues ([`Conversations::continues`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Continues {
    /// Its tip: the key the prompt holds.
    pub key: BlockKey,
    /// Where its latest turn went (of several conversations sharing the
    /// tip, the first's).
    pub slot: ReplicaSlot,
    /// When it last changed replica, if it ever did.
    pub moved_at: Option<Instant>,
}

/// What [`Conversations::place`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Placed {
    /// The prompt continues no known conversation.
    New,
    /// It continues one whose latest turn went to this replica.
    Continued(ReplicaSlot),
}

/// The tracked conversations (module docs).
#[derive(Debug)]
pub(crate) struct Conversations {
    tips: FastMap<BlockKey, Tip>,
    /// A bit per tip ever set since the last rebuild (no false negatives).
    filter: Vec<u64>,
    /// Tips forgotten since the filter was rebuilt (their bits linger).
    stale_bits: usize,
    /// Tips in the order they were set (some since replaced: an entry
    /// counts only while the map holds the same time for its key).
    order: VecDeque<(BlockKey, Instant)>,
    per_slot: FastMap<ReplicaSlot, usize>,
}

impl Default for Conversations {
    fn default() -> Self {
        Self {
            tips: FastMap::default(),
            filter: vec![0; FILTER_BITS / 64],
            stale_bits: 0,
            order: VecDeque::new(),
            per_slot: FastMap::default(),
        }
    }
}

/// A key's word and bit in the filter.
fn bit(key: BlockKey) -> (usize, u64) {
    let at = (key.as_u64() as usize) & (FILTER_BITS - 1);
    (at / 64, 1 << (at % 64))
}

/// Sets `key`'s bit in `filter`.
fn mark(filter: &mut [u64], key: BlockKey) {
    let (word, mask) = bit(key);
    if let Some(w) = filter.get_mut(word) {
        *w |= mask;
    }
}

impl Conversations {
    /// Records that the prompt with block `keys` goes to `slot` at `now`.
    #[cfg(test)]
    pub(crate) fn place(&mut self, keys: &[BlockKey], slot: ReplicaSlot, now: Instant) -> Placed {
        self.expire(now);
        let found = self.continues(keys);
        self.place_found(keys, found, slot, now)
    }

    /// [`Conversations::place`] with the conversation it continues already
    /// looked up (`found`, by [`Conversations::continues`] under the same
    /// hold, nothing placed since): a Pick looks once.
    pub(crate) fn place_found(
        &mut self,
        keys: &[BlockKey],
        found: Option<Continues>,
        slot: ReplicaSlot,
        now: Instant,
    ) -> Placed {
        let Some(tip) = keys.last().copied() else {
            return Placed::New;
        };
        let (placed, moved_at) = match found {
            Some(c) => {
                let from = self.leave(c.key, slot).unwrap_or(c.slot);
                let moved_at = if from == slot { c.moved_at } else { Some(now) };
                (Placed::Continued(from), moved_at)
            }
            None => (Placed::New, None),
        };
        // The same prompt again (a retry) continued itself above; a first
        // turn whose tip others share (a shared prompt's last block) joins
        // them.
        match self.tips.get_mut(&tip) {
            Some(t) => {
                t.slots.push(slot);
                t.at = now;
                t.moved_at = moved_at.or(t.moved_at);
            }
            None => {
                let t = Tip {
                    slots: smallvec::smallvec![slot],
                    at: now,
                    moved_at,
                };
                self.tips.insert(tip, t);
            }
        }
        mark(&mut self.filter, tip);
        self.order.push_back((tip, now));
        *self.per_slot.entry(slot).or_default() += 1;
        placed
    }

    /// [`Conversations::continues`] as of `now` (idle conversations
    /// forgotten first), for a placement to follow
    /// ([`Conversations::place_found`]).
    pub(crate) fn continues_at(&mut self, keys: &[BlockKey], now: Instant) -> Option<Continues> {
        self.expire(now);
        self.continues(keys)
    }

    /// The replica of the conversation the prompt with `keys` continues, if
    /// it continues one ([`Conversations::place`] without placing it).
    pub(crate) fn continues(&self, keys: &[BlockKey]) -> Option<Continues> {
        keys.iter()
            .rev()
            .take(LOOKBACK)
            .filter(|k| self.maybe_tip(**k))
            .find_map(|k| {
                let t = self.tips.get(k)?;
                Some(Continues {
                    key: *k,
                    slot: *t.slots.first()?,
                    moved_at: t.moved_at,
                })
            })
    }

    /// Each replica's conversations (those whose latest turn went there)
    /// as of `now`; a replica without any is absent.
    pub(crate) fn counts(&mut self, now: Instant) -> &FastMap<ReplicaSlot, usize> {
        self.expire(now);
        &self.per_slot
    }

    /// The conversations whose latest turn went to `slot`, as of `now`.
    #[cfg(test)]
    pub(crate) fn on(&mut self, slot: ReplicaSlot, now: Instant) -> usize {
        self.counts(now).get(&slot).copied().unwrap_or(0)
    }

    /// Conversations tracked.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.tips.len()
    }

    fn maybe_tip(&self, key: BlockKey) -> bool {
        let (word, mask) = bit(key);
        self.filter.get(word).is_some_and(|w| w & mask != 0)
    }

    /// Forgets every conversation whose tip is `key`.
    fn forget(&mut self, key: BlockKey) {
        if let Some(t) = self.tips.remove(&key) {
            for slot in t.slots {
                self.uncount(slot);
            }
            self.stale_bits += 1;
        }
    }

    /// Takes one conversation off the tip `key`, the one on `slot` if any
    /// is (it stays there), else the first; where it was.
    fn leave(&mut self, key: BlockKey, slot: ReplicaSlot) -> Option<ReplicaSlot> {
        let t = self.tips.get_mut(&key)?;
        let at = t.slots.iter().position(|s| *s == slot).unwrap_or(0);
        if at >= t.slots.len() {
            return None;
        }
        let from = t.slots.remove(at);
        if t.slots.is_empty() {
            self.tips.remove(&key);
            self.stale_bits += 1;
        }
        self.uncount(from);
        Some(from)
    }

    /// Clears the bits of forgotten tips once there are more of them than
    /// live ones (amortized O(1) per tip).
    fn refilter(&mut self) {
        if self.stale_bits <= self.tips.len().max(1_024) {
            return;
        }
        self.filter.fill(0);
        for key in self.tips.keys() {
            mark(&mut self.filter, *key);
        }
        self.stale_bits = 0;
    }

    fn uncount(&mut self, slot: ReplicaSlot) {
        if let Some(n) = self.per_slot.get_mut(&slot) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_slot.remove(&slot);
            }
        }
    }

    /// Drops conversations idle for [`IDLE`], and the least recent beyond
    /// [`MAX_CONVERSATIONS`]; the order's stale entries go on the way.
    fn expire(&mut self, now: Instant) {
        while let Some(&(key, at)) = self.order.front() {
            let current = self.tips.get(&key).is_some_and(|t| t.at == at);
            let over =
                self.tips.len() > MAX_CONVERSATIONS || self.order.len() > 2 * MAX_CONVERSATIONS;
            if current && !over && now.saturating_duration_since(at) < IDLE {
                break;
            }
            self.order.pop_front();
            if current {
                self.forget(key);
            }
        }
        if self.tips.is_empty() {
            self.order.clear();
        }
        self.refilter();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(range: std::ops::Range<u64>) -> Vec<BlockKey> {
        range.map(BlockKey::from_u64).collect()
    }

    const A: ReplicaSlot = ReplicaSlot(0);
    const B: ReplicaSlot = ReplicaSlot(1);

    #[test]
    fn a_turn_continues_the_conversation_whose_tip_it_holds() {
        let t0 = Instant::now();
        let mut c = Conversations::default();
        // Two conversations sharing a 12-block system prompt.
        let x: Vec<_> = keys(0..12).into_iter().chain(keys(100..104)).collect();
        let y: Vec<_> = keys(0..12).into_iter().chain(keys(200..203)).collect();
        assert_eq!(c.place(&x, A, t0), Placed::New);
        assert_eq!(
            c.place(&y, A, t0),
            Placed::New,
            "the shared prompt is no tip"
        );
        assert_eq!(c.on(A, t0), 2);
        // x's next turn: its prompt, the answer and a tool result.
        let x2: Vec<_> = x.iter().copied().chain(keys(105..130)).collect();
        assert_eq!(c.place(&x2, A, t0), Placed::Continued(A));
        assert_eq!((c.on(A, t0), c.on(B, t0)), (2, 0));
        // y moves to B.
        let y2: Vec<_> = y.iter().copied().chain(keys(205..210)).collect();
        assert_eq!(c.place(&y2, B, t0), Placed::Continued(A));
        assert_eq!((c.on(A, t0), c.on(B, t0)), (1, 1));
        assert_eq!(c.len(), 2);
        // A retry of the same prompt continues itself.
        assert_eq!(c.place(&y2, B, t0), Placed::Continued(B));
        assert_eq!((c.on(A, t0), c.on(B, t0)), (1, 1));
    }

    #[test]
    fn first_turns_sharing_a_tip_are_counted_apart_and_continue_apart() {
        let t0 = Instant::now();
        let mut c = Conversations::default();
        // Two short tasks behind one 12-block prompt, known to be first
        // turns (their bodies say so): both end at the prompt's last block.
        let shared = keys(0..12);
        assert_eq!(c.place_found(&shared, None, A, t0), Placed::New);
        assert_eq!(c.place_found(&shared, None, B, t0), Placed::New);
        assert_eq!((c.on(A, t0), c.on(B, t0)), (1, 1));
        assert_eq!(c.len(), 1, "one tip, two conversations");
        // B's conversation goes on at B: it stays, A's is still counted.
        let b2: Vec<_> = shared.iter().copied().chain(keys(500..510)).collect();
        assert_eq!(c.place(&b2, B, t0), Placed::Continued(B));
        assert_eq!((c.on(A, t0), c.on(B, t0)), (1, 1));
        // A's goes on at A.
        let a2: Vec<_> = shared.iter().copied().chain(keys(600..610)).collect();
        assert_eq!(c.place(&a2, A, t0), Placed::Continued(A));
        assert_eq!((c.on(A, t0), c.on(B, t0)), (1, 1));
        assert_eq!(c.len(), 2, "each its own tip now");
        // Forgotten when idle, both.
        assert_eq!(c.on(A, t0 + IDLE) + c.on(B, t0 + IDLE), 0);
    }

    #[test]
    fn idle_conversations_are_forgotten() {
        let t0 = Instant::now();
        let mut c = Conversations::default();
        c.place(&keys(0..4), A, t0);
        c.place(&keys(10..14), B, t0 + IDLE / 2);
        assert_eq!(c.on(A, t0 + IDLE), 0);
        assert_eq!(c.on(B, t0 + IDLE), 1);
        // A turn after its conversation was forgotten starts a new one.
        let later: Vec<_> = keys(0..8);
        assert_eq!(c.place(&later, A, t0 + IDLE), Placed::New);
        assert_eq!(c.on(A, t0 + IDLE), 1);
    }

    #[test]
    fn the_count_is_bounded_and_stays_consistent() {
        let t0 = Instant::now();
        let mut c = Conversations::default();
        let n = u64::try_from(MAX_CONVERSATIONS).expect("fits") + 10;
        for i in 0..n {
            let slot = if i % 2 == 0 { A } else { B };
            c.place(&[BlockKey::from_u64(i)], slot, t0);
        }
        assert!(c.len() <= MAX_CONVERSATIONS + 1, "{}", c.len());
        assert_eq!(c.on(A, t0) + c.on(B, t0), c.len());
        assert!(c.order.len() <= 2 * MAX_CONVERSATIONS + 1);
    }

    #[test]
    fn the_filter_never_hides_a_tip_and_forgets_stale_bits() {
        let t0 = Instant::now();
        let mut c = Conversations::default();
        // Many conversations, each continued once (its first tip forgotten).
        for i in 0..5_000u64 {
            let first = [BlockKey::from_u64(i * 1_000_003)];
            c.place(&first, A, t0);
            let next = [first[0], BlockKey::from_u64(i * 1_000_003 + 1)];
            assert_eq!(c.place(&next, B, t0), Placed::Continued(A), "{i}");
        }
        assert_eq!(c.on(B, t0), 5_000);
        // Stale bits were cleared along the way: at most as many as the
        // live tips (or the floor) are left.
        assert!(c.stale_bits <= 5_000, "{}", c.stale_bits);
        let set: u32 = c.filter.iter().map(|w| w.count_ones()).sum();
        assert!(set as usize <= 5_000 + c.stale_bits, "{set}");
    }

    #[test]
    fn an_empty_prompt_is_no_conversation() {
        let mut c = Conversations::default();
        assert_eq!(c.place(&[], A, Instant::now()), Placed::New);
        assert_eq!(c.len(), 0);
    }

    #[test]
    fn a_conversation_remembers_when_it_last_changed_replica() {
        let mut c = Conversations::default();
        let t0 = Instant::now();
        let first = keys(0..4);
        c.place(&first, ReplicaSlot(0), t0);
        assert_eq!(
            c.continues(&keys(0..6)),
            Some(Continues {
                key: first[3],
                slot: ReplicaSlot(0),
                moved_at: None
            })
        );
        // Its next turn goes elsewhere: it moved then.
        let t1 = t0 + Duration::from_secs(1);
        c.place(&keys(0..6), ReplicaSlot(1), t1);
        let moved = c.continues(&keys(0..8)).map(|k| k.moved_at);
        assert_eq!(moved, Some(Some(t1)));
        // It stays: the time of its move stays with it.
        c.place(&keys(0..8), ReplicaSlot(1), t1 + Duration::from_secs(1));
        assert_eq!(
            c.continues(&keys(0..10)).map(|k| k.moved_at),
            Some(Some(t1))
        );
        assert_eq!(c.continues(&keys(100..104)), None, "a new conversation");
    }
}
