//! `(partition, key) → holders`, kept twice with `left-right` so that Picks
//! never wait for ingest.
//!
//! The index (the writer, one at a time under its own lock) never reads
//! this map: it logs each change as a [`KeyOp`], and [`Index::publish`]
//! (once per batch) applies the log to the copy readers are not using,
//! swaps the copies, and applies it to the other one the next time. A Pick
//! enters the published copy through its thread's read handle (two atomic
//! stores, no lock) and walks its keys there; a writer that stalls mid-batch
//! (a page fault, a descheduled thread) delays the next publish, never a
//! reader. The cost: two copies of this map (not of the per-replica block
//! maps or the eviction order, which only the writer reads), every change
//! applied twice, and each publish waits for the readers still in the old
//! copy (one Pick's walk at most).
//!
//! [`Index::publish`]: super::Index::publish

use std::collections::HashMap;

use kvroute_proto::keys::BlockKey;
use smallvec::SmallVec;

use super::{FastMap, shrink_if_sparse};
use crate::ids::{PartitionId, ReplicaSlot};

pub(crate) type Key = (PartitionId, BlockKey);

/// One replica holding a key: its tiers, and how many of its block entries
/// (engine hashes) carry the key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Holder {
    pub(crate) slot: ReplicaSlot,
    pub(crate) tiers: u8,
    refs: u16,
}

pub(crate) type Holders = SmallVec<[Holder; 2]>;

/// A change to the map, logged by the writer and applied to both copies.
#[derive(Clone, Copy, Debug)]
pub(crate) enum KeyOp {
    /// One more entry of `slot` carries `key`, in `tiers`.
    Hold {
        key: Key,
        slot: ReplicaSlot,
        tiers: u8,
    },
    /// `slot` holds `key` in `tiers` too.
    AddTiers {
        key: Key,
        slot: ReplicaSlot,
        tiers: u8,
    },
    /// `slot`'s tiers for `key` are `tiers`, if a single entry carries it.
    SetTiersIfSingle {
        key: Key,
        slot: ReplicaSlot,
        tiers: u8,
    },
    /// One entry of `slot` carrying `key` is gone.
    Release { key: Key, slot: ReplicaSlot },
}

/// The map, in shards by key: a map of a million keys rehashing (growth, or
/// clearing tombstones) would stall the writer's publish for tens of
/// milliseconds; a shard takes a 64th of that.
#[derive(Clone, Debug)]
pub(crate) struct KeyMap {
    shards: Vec<FastMap<Key, Holders>>,
}

const KEY_SHARDS: usize = 64;

impl Default for KeyMap {
    fn default() -> Self {
        Self {
            shards: (0..KEY_SHARDS).map(|_| FastMap::default()).collect(),
        }
    }
}

impl KeyMap {
    fn index(key: &Key) -> usize {
        // Keys are SHA-256 prefixes: their low bits are uniform.
        (key.1.as_u64() % KEY_SHARDS as u64) as usize
    }

    pub(crate) fn get(&self, key: &Key) -> Option<&Holders> {
        self.shards.get(Self::index(key))?.get(key)
    }

    fn holder_mut(&mut self, key: &Key, slot: ReplicaSlot) -> Option<&mut Holder> {
        self.shards
            .get_mut(Self::index(key))?
            .get_mut(key)?
            .iter_mut()
            .find(|h| h.slot == slot)
    }

    pub(crate) fn len(&self) -> usize {
        self.shards.iter().map(HashMap::len).sum()
    }

    pub(crate) fn capacity(&self) -> usize {
        self.shards.iter().map(HashMap::capacity).sum()
    }

    /// Heap bytes per slot of capacity.
    pub(crate) const SLOT_BYTES: usize =
        std::mem::size_of::<Key>() + std::mem::size_of::<Holders>() + 1;

    fn apply(&mut self, op: &KeyOp) {
        match *op {
            KeyOp::Hold { key, slot, tiers } => {
                let Some(shard) = self.shards.get_mut(Self::index(&key)) else {
                    return;
                };
                let holders = shard.entry(key).or_default();
                match holders.iter_mut().find(|h| h.slot == slot) {
                    Some(h) => {
                        h.refs = h.refs.saturating_add(1);
                        h.tiers |= tiers;
                    }
                    None => holders.push(Holder {
                        slot,
                        tiers,
                        refs: 1,
                    }),
                }
            }
            KeyOp::AddTiers { key, slot, tiers } => {
                if let Some(h) = self.holder_mut(&key, slot) {
                    h.tiers |= tiers;
                }
            }
            KeyOp::SetTiersIfSingle { key, slot, tiers } => {
                if let Some(h) = self.holder_mut(&key, slot)
                    && h.refs == 1
                {
                    h.tiers = tiers;
                }
            }
            KeyOp::Release { key, slot } => {
                let Some(shard) = self.shards.get_mut(Self::index(&key)) else {
                    return;
                };
                let Some(holders) = shard.get_mut(&key) else {
                    return;
                };
                if let Some(pos) = holders.iter().position(|h| h.slot == slot)
                    && let Some(h) = holders.get_mut(pos)
                {
                    h.refs = h.refs.saturating_sub(1);
                    if h.refs == 0 {
                        holders.swap_remove(pos);
                    }
                }
                if holders.is_empty() {
                    shard.remove(&key);
                    shrink_if_sparse(shard);
                }
            }
        }
    }
}

impl left_right::Absorb<KeyOp> for KeyMap {
    fn absorb_first(&mut self, op: &mut KeyOp, _other: &Self) {
        self.apply(op);
    }

    fn absorb_second(&mut self, op: KeyOp, _other: &Self) {
        self.apply(&op);
    }

    fn sync_with(&mut self, first: &Self) {
        self.clone_from(first);
    }
}

#[cfg(test)]
mod tests {
    use left_right::Absorb;

    use super::*;

    fn key(k: u64) -> Key {
        (PartitionId::new(0), BlockKey::from_u64(k))
    }

    #[test]
    fn refs_count_entries_and_the_last_release_removes_the_key() {
        let mut m = KeyMap::default();
        let (k, s) = (key(7), ReplicaSlot(1));
        m.apply(&KeyOp::Hold {
            key: k,
            slot: s,
            tiers: 1,
        });
        m.apply(&KeyOp::Hold {
            key: k,
            slot: s,
            tiers: 2,
        });
        assert_eq!(m.get(&k).map(|h| h[0].tiers), Some(3));
        // Two entries carry it: a single entry's tiers do not overwrite.
        m.apply(&KeyOp::SetTiersIfSingle {
            key: k,
            slot: s,
            tiers: 4,
        });
        assert_eq!(m.get(&k).map(|h| h[0].tiers), Some(3));
        m.apply(&KeyOp::Release { key: k, slot: s });
        m.apply(&KeyOp::SetTiersIfSingle {
            key: k,
            slot: s,
            tiers: 4,
        });
        assert_eq!(m.get(&k).map(|h| h[0].tiers), Some(4));
        m.apply(&KeyOp::Release { key: k, slot: s });
        assert!(m.get(&k).is_none());
        assert_eq!(m.len(), 0);
    }

    #[test]
    fn both_copies_converge_and_readers_see_only_published_changes() {
        let (mut w, r) = left_right::new_from_empty::<KeyMap, KeyOp>(KeyMap::default());
        let (k, s) = (key(9), ReplicaSlot(0));
        w.append(KeyOp::Hold {
            key: k,
            slot: s,
            tiers: 1,
        });
        assert!(r.enter().is_some_and(|m| m.get(&k).is_none()));
        w.publish();
        assert!(r.enter().is_some_and(|m| m.get(&k).is_some()));
        w.append(KeyOp::AddTiers {
            key: k,
            slot: s,
            tiers: 2,
        });
        w.publish();
        w.append(KeyOp::Release { key: k, slot: s });
        w.publish();
        // Twice more: each copy has then absorbed every op.
        w.publish();
        w.publish();
        assert!(
            r.enter()
                .is_some_and(|m| m.get(&k).is_none() && m.len() == 0)
        );
        let mut other = KeyMap::default();
        other.sync_with(&KeyMap::default());
        assert_eq!(other.len(), 0);
    }
}
