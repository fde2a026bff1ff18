//! Blocks of sparse KV cache groups waiting for their chain.
//!
//! A sliding-window or Mamba group caches only some blocks of what it
//! computes (vLLM's `reachable_block_mask`): its `BlockStored` carries the
//! whole token range but hashes for those blocks alone, and does not say
//! which blocks they are. A block's hash is the same in every group of its
//! block size, so its chain is the one another group's entry of that hash
//! has. In a batch vLLM lists the groups in order, and for gpt-oss and
//! Gemma 3 the sliding group (0) comes before the full-attention one that
//! stores the same blocks with all their hashes: until then the sliding
//! group's blocks wait here, by `(replica, hash)`, and are stored when an
//! entry of that hash arrives. Bounded: beyond [`MAX_PARKED`] the oldest
//! go (counted).

use std::collections::VecDeque;

use smallvec::SmallVec;

use crate::event::EngineHash;
use crate::ids::FastMap;

/// The most blocks parked at once (all replicas).
pub(super) const MAX_PARKED: usize = 1 << 16;

/// The groups waiting under one hash, with their tiers.
type Groups = SmallVec<[(u8, u8); 2]>;

/// Parked blocks: per `(replica, hash)`, its number (age) and the groups
/// waiting.
#[derive(Debug, Default)]
pub(super) struct Parked {
    by_hash: FastMap<(u16, EngineHash), (u64, Groups)>,
    /// Oldest first: `(replica, hash, its number)`; a number no longer in
    /// `by_hash` is stale and skipped.
    order: VecDeque<(u16, EngineHash, u64)>,
    next: u64,
}

impl Parked {
    pub(super) fn len(&self) -> usize {
        self.by_hash.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }

    /// An estimate of the heap bytes held.
    pub(super) fn approx_bytes(&self) -> usize {
        use std::mem::size_of;
        self.by_hash.capacity() * (size_of::<(u16, EngineHash)>() + 8 + 24 + 1)
            + self.order.capacity() * size_of::<(u16, EngineHash, u64)>()
    }

    /// Parks `hash` of `local` for `group` in `tiers`; returns how many
    /// parked blocks the bound dropped to make room.
    pub(super) fn park(&mut self, local: u16, hash: EngineHash, group: u8, tiers: u8) -> u64 {
        let key = (local, hash);
        if let Some((_, groups)) = self.by_hash.get_mut(&key) {
            match groups.iter_mut().find(|(g, _)| *g == group) {
                Some((_, t)) => *t |= tiers,
                None => groups.push((group, tiers)),
            }
            return 0;
        }
        let mut dropped = 0;
        while self.by_hash.len() >= MAX_PARKED {
            let Some((l, h, n)) = self.order.pop_front() else {
                break;
            };
            if self.by_hash.get(&(l, h)).is_some_and(|(m, _)| *m == n)
                && let Some((_, groups)) = self.by_hash.remove(&(l, h))
            {
                dropped += groups.len() as u64;
            }
        }
        let n = self.next;
        self.next += 1;
        let mut groups = SmallVec::new();
        groups.push((group, tiers));
        self.by_hash.insert(key, (n, groups));
        self.order.push_back((local, hash, n));
        // Stale numbers pile up as parked blocks are taken: sweep them
        // when they are most of the queue.
        if self.order.len() > 2 * self.by_hash.len() + 64 {
            let by_hash = &self.by_hash;
            self.order
                .retain(|(l, h, n)| by_hash.get(&(*l, *h)).is_some_and(|(m, _)| m == n));
        }
        dropped
    }

    /// The groups parked under `hash` of `local`, taken out.
    pub(super) fn take(&mut self, local: u16, hash: EngineHash) -> Option<Groups> {
        self.by_hash.remove(&(local, hash)).map(|(_, g)| g)
    }

    /// `tiers` leave `group`'s parked block of `hash` (a removal before
    /// the chain came); true if it was parked.
    pub(super) fn remove(&mut self, local: u16, hash: EngineHash, group: u8, tiers: u8) -> bool {
        let key = (local, hash);
        let Some((_, groups)) = self.by_hash.get_mut(&key) else {
            return false;
        };
        let Some(pos) = groups.iter().position(|(g, _)| *g == group) else {
            return false;
        };
        if let Some((_, t)) = groups.get_mut(pos) {
            *t &= !tiers;
            if *t == 0 {
                groups.swap_remove(pos);
            }
        }
        if groups.is_empty() {
            self.by_hash.remove(&key);
        }
        true
    }

    /// Adds `tiers` to `group`'s parked block of `hash`; true if parked.
    pub(super) fn add_tiers(&mut self, local: u16, hash: EngineHash, group: u8, tiers: u8) -> bool {
        match self.by_hash.get_mut(&(local, hash)) {
            Some((_, groups)) => match groups.iter_mut().find(|(g, _)| *g == group) {
                Some((_, t)) => {
                    *t |= tiers;
                    true
                }
                None => false,
            },
            None => false,
        }
    }

    /// Drops everything `local` has parked.
    pub(super) fn forget(&mut self, local: u16) {
        if self.by_hash.is_empty() {
            return;
        }
        self.by_hash.retain(|(l, _), _| *l != local);
        self.order.retain(|(l, _, _)| *l != local);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parked_blocks_are_taken_removed_and_bounded() {
        let mut p = Parked::default();
        let h = EngineHash(7);
        assert_eq!(p.park(0, h, 0, 1), 0);
        assert_eq!(p.park(0, h, 2, 1), 0);
        assert!(p.add_tiers(0, h, 2, 2));
        assert!(!p.add_tiers(0, h, 3, 2));
        assert!(p.remove(0, h, 0, 1));
        assert_eq!(p.take(0, h).unwrap().as_slice(), &[(2, 3)]);
        assert!(p.is_empty());
        for i in 0..MAX_PARKED as u64 + 10 {
            p.park(1, EngineHash(i), 0, 1);
        }
        assert_eq!(p.len(), MAX_PARKED);
        // The oldest went.
        assert!(p.take(1, EngineHash(0)).is_none());
        assert!(p.take(1, EngineHash(MAX_PARKED as u64 + 9)).is_some());
        p.forget(1);
        assert!(p.is_empty());
    }
}
