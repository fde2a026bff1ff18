//! The index's one copy: every `(block, replica)` entry, the key table that
//! Picks walk, and the eviction order. Picks read it under a read lock; the
//! index writes it under the write lock (see the parent module's docs).
//!
//! Layout (per entry, at most ≈ 60 B with its two table slots):
//! - [`Entry`], 40 B in a chunked [`Slab`]: its chain (the key is the
//!   chain's first 8 bytes), engine hash, replica (a local `u16` id, reused
//!   once a replica is removed), partition and tiers packed in 16 bits, its
//!   neighbours in the eviction order (an intrusive list: eviction and
//!   removal are O(1), nothing stale is kept), and its insertion count (what a
//!   snapshot orders blocks by).
//! - The key table: `(partition, key) →` a `u32`, in 256 shards (a shard
//!   rehashes a 256th of the keys, under the write lock). A key held by one
//!   entry names that entry: the entry itself says which replica holds it in
//!   which tiers, so a key held once costs its table slot and nothing more.
//!   A key held by several entries names a [`Group`] (64 B): the key, its
//!   partition, its holders `(replica, tiers, refs)` side by side (three
//!   inline), and the holders whose local id is below 64 as three masks by
//!   best tier, so a Pick over at most 64 replicas reads a key's holders as
//!   one word per tier, whatever their number.
//! - Per replica, `engine hash → entry` lives with the writer, outside this
//!   lock ([`super::Index`]): only ingest reads it.

use std::sync::Arc;

use hashbrown::HashTable;
use kvroute_proto::keys::Chain;
use smallvec::SmallVec;

use super::layout::Layout;
use super::slab::Slab;
use crate::event::EngineHash;
use crate::ids::FastMap;
use crate::ids::ReplicaSlot;

/// No entry (the ends of the eviction order).
pub(super) const NIL: u32 = u32::MAX;
/// The key table's tag for a group (else an entry).
const GROUP: u32 = 1 << 31;
/// Entries and groups are numbered below this.
pub(super) const MAX_RECORDS: u32 = GROUP - 1;
const KEY_SHARDS: usize = 256;
/// Partition ids fit in 12 bits (the partition table holds at most 4,096).
pub(super) const PARTITION_BITS: u32 = 12;
const PARTITION_MASK: u16 = (1 << PARTITION_BITS) - 1;

/// A key as the table knows it: `(partition, key)`.
pub(super) type Key = (u16, u64);

/// One `(block, replica)` entry.
#[derive(Clone, Copy, Debug)]
pub(super) struct Entry {
    /// Its chain value; its key is the chain's first 8 bytes.
    pub(super) chain: Chain,
    /// The engine's hash, split so that the entry packs into 40 bytes.
    hash: [u32; 2],
    /// Its neighbours in the eviction order (older is evicted first).
    older: u32,
    newer: u32,
    /// Insertions before it (wrapping): a snapshot's order.
    pub(super) seq: u32,
    /// Its replica's local id.
    pub(super) replica: u16,
    /// Partition (low 12 bits) and tier mask (bits 12..15).
    meta: u16,
}

impl Entry {
    pub(super) fn new(
        chain: Chain,
        hash: EngineHash,
        replica: u16,
        partition: u16,
        tiers: u8,
        seq: u32,
    ) -> Self {
        let mut e = Self {
            chain,
            hash: [hash.0 as u32, (hash.0 >> 32) as u32],
            older: NIL,
            newer: NIL,
            seq,
            replica,
            meta: partition & PARTITION_MASK,
        };
        e.set_tiers(tiers);
        e
    }

    pub(super) fn hash(&self) -> EngineHash {
        EngineHash(u64::from(self.hash[0]) | u64::from(self.hash[1]) << 32)
    }

    pub(super) fn tiers(&self) -> u8 {
        (self.meta >> PARTITION_BITS) as u8 & 0b111
    }

    pub(super) fn set_tiers(&mut self, tiers: u8) {
        self.meta = self.meta & PARTITION_MASK | u16::from(tiers & 0b111) << PARTITION_BITS;
    }

    pub(super) fn partition(&self) -> u16 {
        self.meta & PARTITION_MASK
    }

    pub(super) fn key(&self) -> Key {
        (self.partition(), self.chain.key().as_u64())
    }
}

/// One replica holding a key held by several entries: its tiers, and how
/// many of its entries (engine hashes) carry the key (saturating).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Holder {
    pub(super) replica: u16,
    pub(super) tiers: u8,
    refs: u8,
}

/// A tier mask's best tier as an index (GPU 0, CPU 1, storage 2; a mask
/// without a tier has none, 3).
pub(super) const BEST_TIER: [u8; 8] = [3, 0, 1, 0, 2, 0, 1, 0];

/// Local ids below this are in holder masks (the Pick's fast walk).
pub(super) const MASK_IDS: u16 = 64;

/// A key held by several entries.
#[derive(Debug, Default)]
pub(super) struct Group {
    key: u64,
    partition: u16,
    holders: SmallVec<[Holder; 3]>,
    /// Holders with a local id below 64, by best tier: what a Pick over at
    /// most 64 replicas reads instead of the list.
    masks: [u64; 3],
}

impl Group {
    /// Recomputes the masks from the holders (after every change: a group
    /// lists a few holders, one per replica at most).
    fn refresh(&mut self) {
        let mut masks = [0u64; 3];
        for h in &self.holders {
            if h.replica < MASK_IDS
                && let Some(m) = masks.get_mut(usize::from(BEST_TIER[usize::from(h.tiers & 0b111)]))
            {
                *m |= 1 << h.replica;
            }
        }
        self.masks = masks;
    }

    fn hold(&mut self, replica: u16, tiers: u8) {
        match self.holders.iter_mut().find(|h| h.replica == replica) {
            Some(h) => {
                h.refs = h.refs.saturating_add(1);
                h.tiers |= tiers;
            }
            None => self.holders.push(Holder {
                replica,
                tiers,
                refs: 1,
            }),
        }
        self.refresh();
    }

    /// One entry of `replica` is gone; true when no holder is left.
    fn release(&mut self, replica: u16) -> bool {
        if let Some(pos) = self.holders.iter().position(|h| h.replica == replica)
            && let Some(h) = self.holders.get_mut(pos)
        {
            h.refs = h.refs.saturating_sub(1);
            if h.refs == 0 {
                self.holders.swap_remove(pos);
            }
        }
        self.refresh();
        self.holders.is_empty()
    }

    fn holder_mut(&mut self, replica: u16) -> Option<&mut Holder> {
        self.holders.iter_mut().find(|h| h.replica == replica)
    }

    fn heap_bytes(&self) -> usize {
        if self.holders.spilled() {
            self.holders.capacity() * std::mem::size_of::<Holder>()
        } else {
            0
        }
    }
}

/// Entries, groups, the key table and the eviction order. See the module
/// docs.
#[derive(Debug)]
pub(crate) struct Store {
    entries: Slab<Entry>,
    groups: Slab<Group>,
    /// Spilled holder lists' heap bytes.
    group_heap: usize,
    keys: Vec<HashTable<u32>>,
    /// This process's random seed of [`hash_key`].
    hasher: u64,
    /// The ends of the eviction order.
    oldest: u32,
    newest: u32,
    /// Each replica's local id, for Picks (the writer keeps its own copy).
    pub(super) locals: FastMap<ReplicaSlot, u16>,
    /// Each replica's KV cache groups by local id, as its events showed them
    /// since its last purge.
    layouts: Vec<Option<Arc<Layout>>>,
}

impl Default for Store {
    fn default() -> Self {
        Self {
            entries: Slab::new(MAX_RECORDS),
            groups: Slab::new(MAX_RECORDS),
            group_heap: 0,
            keys: (0..KEY_SHARDS).map(|_| HashTable::new()).collect(),
            hasher: {
                use std::hash::BuildHasher;
                foldhash::fast::RandomState::default().hash_one(0u64)
            },
            oldest: NIL,
            newest: NIL,
            locals: FastMap::default(),
            layouts: Vec::new(),
        }
    }
}

fn shard_of(key: u64) -> usize {
    // Keys are XXH3-128 digests: their low bits are uniform.
    (key % KEY_SHARDS as u64) as usize
}

/// What a key-table slot names: its key.
fn key_of(entries: &Slab<Entry>, groups: &Slab<Group>, r: u32) -> Option<Key> {
    if r & GROUP != 0 {
        groups.get(r & !GROUP).map(|g| (g.partition, g.key))
    } else {
        entries.get(r).map(Entry::key)
    }
}

/// A key's hash in its shard's table: one multiply of the key, its
/// partition and the process's seed. Keys are XXH3-128 digests of block
/// chains, uniform for any content, and the seed is the process's own, so a
/// mix this cheap spreads them; the rotation feeds the table's bucket bits
/// from the product's well-mixed high half, not from the low bits the shard
/// was chosen by.
#[inline]
fn hash_key(seed: &u64, key: Key) -> u64 {
    let (partition, key) = key;
    (key ^ seed ^ (u64::from(partition) << 48))
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .rotate_left(32)
}

/// Table bytes of a `hashbrown` table of `u32` with `capacity` (its buckets:
/// capacity is 7/8 of them, a power of two).
pub(super) fn table_bytes(capacity: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    let buckets = if capacity < 8 {
        (capacity + 1).next_power_of_two()
    } else {
        (capacity * 8 / 7).next_power_of_two()
    };
    buckets * (std::mem::size_of::<u32>() + 1) + 16
}

impl Store {
    /// The KV cache groups of the replica with local id `local`.
    pub(super) fn layout(&self, local: u16) -> Option<&Arc<Layout>> {
        self.layouts.get(usize::from(local))?.as_ref()
    }

    /// Sets (or, with `None`, forgets) `local`'s layout.
    pub(super) fn set_layout(&mut self, local: u16, layout: Option<Arc<Layout>>) {
        let i = usize::from(local);
        if self.layouts.len() <= i {
            if layout.is_none() {
                return;
            }
            self.layouts.resize(i + 1, None);
        }
        if let Some(slot) = self.layouts.get_mut(i) {
            *slot = layout;
        }
    }

    /// Whether the replica with local id `local` holds `key` (in any tier).
    /// Through the holder list, not [`Store::holder_masks`]: a second caller
    /// of that one made the compiler stop inlining its table probe into the
    /// Pick's walk.
    pub(super) fn holds(&self, key: Key, local: u16) -> bool {
        let mut held = false;
        self.for_each_holder(key, |replica, tiers| {
            held |= replica == local && tiers != 0;
        });
        held
    }

    pub(super) fn entry(&self, e: u32) -> Option<&Entry> {
        self.entries.get(e)
    }

    pub(super) fn entry_mut(&mut self, e: u32) -> Option<&mut Entry> {
        self.entries.get_mut(e)
    }

    /// Stores a new entry, newest in the eviction order; the caller then
    /// [`Store::hold`]s its key. `None` when the slab is full.
    pub(super) fn insert(&mut self, entry: Entry) -> Option<u32> {
        let e = self.entries.insert(entry)?;
        let older = self.newest;
        if let Some(new) = self.entries.get_mut(e) {
            new.older = older;
            new.newer = NIL;
        }
        match self.entries.get_mut(older) {
            Some(o) => o.newer = e,
            None => self.oldest = e,
        }
        self.newest = e;
        Some(e)
    }

    /// The oldest entry.
    pub(super) fn oldest(&self) -> Option<u32> {
        (self.oldest != NIL).then_some(self.oldest)
    }

    /// Forgets entry `e`: its key's holder, its place in the eviction order,
    /// its slab place.
    pub(super) fn remove(&mut self, e: u32) {
        let Some(entry) = self.entries.get(e).copied() else {
            return;
        };
        self.release(e, &entry);
        match self.entries.get_mut(entry.older) {
            Some(o) => o.newer = entry.newer,
            None => self.oldest = entry.newer,
        }
        match self.entries.get_mut(entry.newer) {
            Some(n) => n.older = entry.older,
            None => self.newest = entry.older,
        }
        self.entries.remove(e);
    }

    /// The key table slot of `key`, if any.
    #[inline]
    fn find(&self, key: Key) -> Option<u32> {
        let shard = self.keys.get(shard_of(key.1))?;
        let (entries, groups) = (&self.entries, &self.groups);
        shard
            .find(hash_key(&self.hasher, key), |r| {
                key_of(entries, groups, *r) == Some(key)
            })
            .copied()
    }

    /// The key-table shards that adding `keys` could make grow (or rehash
    /// away their tombstones), grown already, to install with
    /// [`Store::install_grown`]. Built under the read lock, so Picks go on
    /// meanwhile: a shard's rehash reads the key of every slot from the
    /// entry or group it names, a cache miss each, which under the write
    /// lock made Picks wait milliseconds. Only the writer changes the
    /// store, so no shard changes between this and the install.
    pub(super) fn grow_for(&self, keys: impl Iterator<Item = u64>) -> Vec<(usize, HashTable<u32>)> {
        // Keys per shard; then each shard touched, once (an event's blocks
        // touch a few of the 256).
        let keys: SmallVec<[usize; 64]> = keys.map(shard_of).collect();
        let mut adding = [0u16; KEY_SHARDS];
        for &i in &keys {
            if let Some(n) = adding.get_mut(i) {
                *n = n.saturating_add(1);
            }
        }
        let (entries, groups, seed) = (&self.entries, &self.groups, &self.hasher);
        let hash = |r: &u32| key_of(entries, groups, *r).map_or(0, |k| hash_key(seed, k));
        let mut grown = Vec::new();
        for &i in &keys {
            let (Some(n), Some(shard)) = (adding.get_mut(i), self.keys.get(i)) else {
                continue;
            };
            let n = usize::from(std::mem::take(n));
            if n == 0 || shard.capacity() - shard.len() >= n {
                continue;
            }
            // As the table itself would: at least one slot more than it can
            // hold now (doubling a full table).
            let mut table = HashTable::with_capacity((shard.len() + n).max(shard.capacity() + 1));
            for r in shard {
                table.insert_unique(hash(r), *r, hash);
            }
            grown.push((i, table));
        }
        grown
    }

    /// Installs shards [`Store::grow_for`] built (under the write lock).
    pub(super) fn install_grown(&mut self, grown: Vec<(usize, HashTable<u32>)>) {
        for (i, table) in grown {
            if let Some(shard) = self.keys.get_mut(i) {
                *shard = table;
            }
        }
    }

    /// Calls `f(replica, tiers)` for every holder of `key`.
    #[inline]
    pub(super) fn for_each_holder(&self, key: Key, mut f: impl FnMut(u16, u8)) {
        let Some(r) = self.find(key) else {
            return;
        };
        if r & GROUP != 0 {
            if let Some(g) = self.groups.get(r & !GROUP) {
                for h in &g.holders {
                    f(h.replica, h.tiers);
                }
            }
        } else if let Some(e) = self.entries.get(r) {
            f(e.replica, e.tiers());
        }
    }

    /// The holders of `key` with a local id below 64, by best tier. One
    /// probe: the record that matches the key gives its masks as it is
    /// compared (the Pick's walk calls this once per block, inlined).
    #[inline]
    pub(super) fn holder_masks(&self, key: Key) -> [u64; 3] {
        let mut masks = [0u64; 3];
        let Some(shard) = self.keys.get(shard_of(key.1)) else {
            return masks;
        };
        let (entries, groups) = (&self.entries, &self.groups);
        shard.find(hash_key(&self.hasher, key), |r| {
            if r & GROUP != 0 {
                match groups.get(r & !GROUP) {
                    Some(g) if (g.partition, g.key) == key => {
                        masks = g.masks;
                        true
                    }
                    _ => false,
                }
            } else {
                match entries.get(*r) {
                    Some(e) if e.key() == key => {
                        if e.replica < MASK_IDS
                            && let Some(m) =
                                masks.get_mut(usize::from(BEST_TIER[usize::from(e.tiers())]))
                        {
                            *m |= 1 << e.replica;
                        }
                        true
                    }
                    _ => false,
                }
            }
        });
        masks
    }

    /// Entry `e` (stored, with its tiers) carries its key.
    pub(super) fn hold(&mut self, e: u32) {
        let Some(entry) = self.entries.get(e).copied() else {
            return;
        };
        let key = entry.key();
        let hash = hash_key(&self.hasher, key);
        let Self {
            entries,
            groups,
            keys,
            hasher,
            group_heap,
            ..
        } = self;
        let Some(shard) = keys.get_mut(shard_of(key.1)) else {
            return;
        };
        let found = shard.find_mut(hash, |r| key_of(entries, groups, *r) == Some(key));
        let Some(slot) = found else {
            shard.insert_unique(hash, e, |r| {
                key_of(entries, groups, *r).map_or(0, |k| hash_key(hasher, k))
            });
            return;
        };
        if *slot & GROUP != 0 {
            if let Some(g) = groups.get_mut(*slot & !GROUP) {
                let before = g.heap_bytes();
                g.hold(entry.replica, entry.tiers());
                *group_heap = (*group_heap + g.heap_bytes()).saturating_sub(before);
            }
            return;
        }
        // A second entry: the key becomes a group of both.
        let mut g = Group {
            key: key.1,
            partition: key.0,
            ..Group::default()
        };
        if let Some(other) = entries.get(*slot) {
            g.hold(other.replica, other.tiers());
        }
        g.hold(entry.replica, entry.tiers());
        if let Some(gi) = groups.insert(g) {
            *slot = gi | GROUP;
        }
    }

    /// Entry `e`'s tiers grew: a group's holder gains them (an entry holding
    /// its key alone says its tiers itself).
    pub(super) fn add_tiers(&mut self, e: u32) {
        self.with_holder(e, |h, tiers| h.tiers |= tiers);
    }

    /// Entry `e`'s tiers shrank: a group's holder takes them if `e` is its
    /// replica's only entry carrying the key.
    pub(super) fn set_tiers_if_single(&mut self, e: u32) {
        self.with_holder(e, |h, tiers| {
            if h.refs == 1 {
                h.tiers = tiers;
            }
        });
    }

    fn with_holder(&mut self, e: u32, f: impl FnOnce(&mut Holder, u8)) {
        let Some(entry) = self.entries.get(e).copied() else {
            return;
        };
        let Some(r) = self.find(entry.key()) else {
            return;
        };
        if r & GROUP != 0
            && let Some(g) = self.groups.get_mut(r & !GROUP)
            && let Some(h) = g.holder_mut(entry.replica)
        {
            f(h, entry.tiers());
            g.refresh();
        }
    }

    /// Entry `e` no longer carries its key.
    fn release(&mut self, e: u32, entry: &Entry) {
        let key = entry.key();
        let hash = hash_key(&self.hasher, key);
        let Self {
            entries,
            groups,
            keys,
            hasher,
            group_heap,
            ..
        } = self;
        let Some(shard) = keys.get_mut(shard_of(key.1)) else {
            return;
        };
        let Ok(slot) = shard.find_entry(hash, |r| key_of(entries, groups, *r) == Some(key)) else {
            return;
        };
        let r = *slot.get();
        if r & GROUP != 0 {
            let Some(g) = groups.get_mut(r & !GROUP) else {
                return;
            };
            let before = g.heap_bytes();
            if g.release(entry.replica) {
                slot.remove();
                g.holders = SmallVec::new();
                groups.remove(r & !GROUP);
            }
            let after = groups.get(r & !GROUP).map_or(0, Group::heap_bytes);
            *group_heap = (*group_heap + after).saturating_sub(before);
        } else if r == e {
            slot.remove();
        } else {
            return;
        }
        // Memory back from a shard that emptied out (see `shrink_if_sparse`
        // in the parent module): rehashing a 256th of the keys.
        let (len, cap) = (shard.len(), shard.capacity());
        if cap > 1024 && len.saturating_mul(5) < cap {
            shard.shrink_to(len.saturating_mul(2), |r| {
                key_of(entries, groups, *r).map_or(0, |k| hash_key(hasher, k))
            });
        }
    }

    /// Distinct keys.
    pub(super) fn distinct_keys(&self) -> usize {
        self.keys.iter().map(HashTable::len).sum()
    }

    /// Heap bytes: entries and groups at capacity, spilled holder lists, the
    /// key table's buckets.
    pub(super) fn heap_bytes(&self) -> usize {
        self.entries.heap_bytes()
            + self.groups.heap_bytes()
            + self.group_heap
            + self
                .keys
                .iter()
                .map(|t| table_bytes(t.capacity()))
                .sum::<usize>()
    }

    /// Entries in the slab (tests: against the writer's count).
    #[cfg(test)]
    pub(super) fn slab_len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_keep_their_sizes() {
        // The per-entry arithmetic in the module docs and BENCHMARKS.md.
        assert_eq!(std::mem::size_of::<Entry>(), 40);
        assert_eq!(std::mem::size_of::<Group>(), 64);
        assert_eq!(table_bytes(7 * 1024), 8 * 1024 * 5 + 16);
    }
}
