//! vLLM 0.32's block pool (`vllm/v1/core/block_pool.py`) for the mock: physical blocks, shared by
//! every KV cache group, each cached under at most one `(hash, group)`.
//!
//! - **Copies.** vLLM never de-duplicates (`BlockHashToBlockMap`): a request computes its new
//!   blocks into blocks of its own, and caching one whose `(hash, group)` is cached already makes
//!   a second *copy*. A lookup takes the oldest copy still cached; each copy is evicted on its own
//!   (one `BlockRemoved` each), and the hash stays cached while any copy remains.
//! - **Reference counts.** Blocks a running request holds (its hits, touched at admission, and
//!   the blocks it computes) are not evictable. A freed block without a hash is reused first; a
//!   freed cached block joins the tail of the eviction queue, so a finished request's blocks,
//!   freed tail first and group by group, are evicted in that order (LRU).
//! - **Lazy eviction.** A cached block is evicted only when the pool hands it out again
//!   (`get_new_blocks`): evictions come in the batch of the step that allocated.
//! - **Capacity** counts physical blocks (cached, free or held by running requests). vLLM's
//!   scheduler never allocates past it (a request waits); the mock has no such queue, so when
//!   every block is held it hands out a block beyond capacity and gives one back (evicting, if it
//!   must, the least recently used) as soon as blocks are freed.

use std::collections::{BTreeMap, HashMap};

/// A vLLM block hash: 32 bytes; the u64 wire form is its last 8 bytes, big-endian.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub [u8; 32]);

impl BlockHash {
    /// vLLM's `ExternalBlockHash` int form.
    pub fn as_u64(&self) -> u64 {
        let mut tail = [0u8; 8];
        tail.copy_from_slice(&self.0[24..]);
        u64::from_be_bytes(tail)
    }
}

/// A block hash in one KV cache group: the key a copy is cached under.
pub type GroupBlock = (BlockHash, u32);

/// A physical block's index in the pool.
pub type BlockId = usize;

#[derive(Debug, Clone, Default)]
struct Slot {
    /// The `(hash, group)` the block is cached under.
    hash: Option<GroupBlock>,
    /// Running requests holding the block.
    refs: u32,
    /// Its place in the eviction queue, while it is free and cached.
    stamp: Option<u64>,
}

/// One rank's block pool.
#[derive(Debug)]
pub struct BlockPool {
    capacity: usize,
    slots: Vec<Slot>,
    /// Blocks never handed out yet.
    unused: usize,
    /// Free blocks without a hash (reused first; their order does not show).
    spare: Vec<BlockId>,
    /// Free cached blocks in eviction order: vLLM's free queue after its uncached blocks.
    lru: BTreeMap<u64, BlockId>,
    next_stamp: u64,
    /// The copies of each cached `(hash, group)`, oldest first.
    cached: HashMap<GroupBlock, Vec<BlockId>>,
    /// Cached copies over all `(hash, group)`.
    copies: usize,
    /// Blocks handed out beyond capacity, given back as blocks are freed.
    debt: usize,
    /// Slots given back (reused before new ones are added).
    retired: Vec<BlockId>,
}

impl BlockPool {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            slots: Vec::new(),
            unused: capacity,
            spare: Vec::new(),
            lru: BTreeMap::new(),
            next_stamp: 0,
            cached: HashMap::new(),
            copies: 0,
            debt: 0,
            retired: Vec::new(),
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Whether some copy of `key` is cached.
    pub fn holds(&self, key: &GroupBlock) -> bool {
        self.cached.contains_key(key)
    }

    /// Cached copies of `key`.
    pub fn copies_of(&self, key: &GroupBlock) -> usize {
        self.cached.get(key).map_or(0, Vec::len)
    }

    /// The copy a lookup takes (vLLM's `get_one_block`: the oldest one still cached).
    pub fn lookup(&self, key: &GroupBlock) -> Option<BlockId> {
        self.cached.get(key).and_then(|ids| ids.first()).copied()
    }

    /// Cached copies over all keys.
    pub fn cached_blocks(&self) -> usize {
        self.copies
    }

    /// Blocks held by running requests.
    pub fn used_blocks(&self) -> usize {
        self.slots.iter().filter(|s| s.refs > 0).count()
    }

    /// A running request takes a cached block (a prefix hit): it leaves the eviction queue.
    pub fn touch(&mut self, id: BlockId) {
        if let Some(slot) = self.slots.get_mut(id) {
            if let Some(stamp) = slot.stamp.take() {
                self.lru.remove(&stamp);
            }
            slot.refs += 1;
        }
    }

    /// Hands out a free block (vLLM's `get_new_blocks`): an uncached one if any, else the least
    /// recently used cached one, whose eviction is pushed to `evicted`.
    pub fn allocate(&mut self, evicted: &mut Vec<GroupBlock>) -> BlockId {
        let id = if let Some(id) = self.spare.pop() {
            id
        } else if self.unused > 0 {
            self.unused -= 1;
            self.new_slot()
        } else if let Some((_, id)) = self.lru.pop_first() {
            self.evict(id, evicted);
            id
        } else {
            self.debt += 1;
            self.new_slot()
        };
        if let Some(slot) = self.slots.get_mut(id) {
            slot.refs = 1;
            slot.stamp = None;
        }
        id
    }

    fn new_slot(&mut self) -> BlockId {
        if let Some(id) = self.retired.pop() {
            return id;
        }
        self.slots.push(Slot::default());
        self.slots.len() - 1
    }

    /// Drops the block's hash (it stays in the pool, uncached).
    fn evict(&mut self, id: BlockId, evicted: &mut Vec<GroupBlock>) {
        let Some(key) = self.slots.get_mut(id).and_then(|s| s.hash.take()) else {
            return;
        };
        if let Some(ids) = self.cached.get_mut(&key) {
            ids.retain(|x| *x != id);
            if ids.is_empty() {
                self.cached.remove(&key);
            }
        }
        self.copies -= 1;
        evicted.push(key);
    }

    /// Caches a block a request computed under `key`: one more copy when `key` is cached already.
    pub fn cache(&mut self, id: BlockId, key: GroupBlock) {
        let Some(slot) = self.slots.get_mut(id) else {
            return;
        };
        if slot.hash.is_some() {
            return;
        }
        slot.hash = Some(key);
        self.cached.entry(key).or_default().push(id);
        self.copies += 1;
    }

    /// A request lets go of `ids`, in eviction order (vLLM's `free_blocks`): a block nobody holds
    /// any more becomes free, cached ones at the tail of the eviction queue. Blocks owed beyond
    /// capacity are given back, evicting as needed (pushed to `evicted`).
    pub fn free(&mut self, ids: impl IntoIterator<Item = BlockId>, evicted: &mut Vec<GroupBlock>) {
        for id in ids {
            let Some(slot) = self.slots.get_mut(id) else {
                continue;
            };
            slot.refs = slot.refs.saturating_sub(1);
            if slot.refs > 0 {
                continue;
            }
            if slot.hash.is_some() {
                let stamp = self.next_stamp;
                self.next_stamp += 1;
                slot.stamp = Some(stamp);
                self.lru.insert(stamp, id);
            } else {
                self.spare.push(id);
            }
        }
        while self.debt > 0 {
            let id = if let Some(id) = self.spare.pop() {
                id
            } else if let Some((_, id)) = self.lru.pop_first() {
                self.evict(id, evicted);
                id
            } else {
                break;
            };
            if let Some(slot) = self.slots.get_mut(id) {
                *slot = Slot::default();
            }
            self.retired.push(id);
            self.debt -= 1;
        }
    }

    /// Forgets every hash (prefix-cache reset); blocks held by running requests stay theirs.
    pub fn clear(&mut self) {
        for (id, slot) in self.slots.iter_mut().enumerate() {
            if slot.hash.take().is_some() && slot.stamp.take().is_some() {
                self.spare.push(id);
            }
        }
        self.lru.clear();
        self.cached.clear();
        self.copies = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::BlockHash;

    fn key(n: u8, group: u32) -> GroupBlock {
        (BlockHash([n; 32]), group)
    }

    #[test]
    fn a_second_copy_keeps_the_hash_cached_until_both_are_evicted() {
        let mut pool = BlockPool::new(3);
        let mut evicted = Vec::new();
        let a = pool.allocate(&mut evicted);
        pool.cache(a, key(1, 0));
        let b = pool.allocate(&mut evicted);
        pool.cache(b, key(1, 0));
        assert_eq!(pool.copies_of(&key(1, 0)), 2);
        assert_eq!(pool.lookup(&key(1, 0)), Some(a), "the oldest copy");
        pool.free([a], &mut evicted);
        pool.free([b], &mut evicted);
        // One block never used, then the copies in the order they were freed.
        let _ = pool.allocate(&mut evicted);
        assert!(evicted.is_empty());
        let _ = pool.allocate(&mut evicted);
        assert_eq!(evicted, [key(1, 0)]);
        assert!(pool.holds(&key(1, 0)), "copy b remains");
        assert_eq!(pool.lookup(&key(1, 0)), Some(b));
        let _ = pool.allocate(&mut evicted);
        assert_eq!(evicted, [key(1, 0), key(1, 0)]);
        assert!(!pool.holds(&key(1, 0)));
        assert_eq!(pool.cached_blocks(), 0);
    }

    #[test]
    fn held_blocks_are_not_evicted_and_touch_takes_a_block_off_the_queue() {
        let mut pool = BlockPool::new(2);
        let mut evicted = Vec::new();
        let a = pool.allocate(&mut evicted);
        pool.cache(a, key(1, 0));
        let b = pool.allocate(&mut evicted);
        pool.cache(b, key(2, 0));
        pool.free([b, a], &mut evicted);
        // A hit on `a` holds it again: the next allocation takes `b`.
        pool.touch(a);
        assert_eq!(pool.allocate(&mut evicted), b);
        assert_eq!(evicted, [key(2, 0)]);
        assert_eq!(pool.used_blocks(), 2);
        // Everything held: the pool lends a block beyond capacity and takes one back when
        // blocks are freed, evicting the least recently used.
        let c = pool.allocate(&mut evicted);
        assert_eq!(evicted, [key(2, 0)]);
        pool.cache(c, key(3, 0));
        pool.free([c, a], &mut evicted);
        assert_eq!(evicted, [key(2, 0), key(3, 0)]);
        assert!(pool.holds(&key(1, 0)));
        assert_eq!(pool.cached_blocks(), 1);
    }

    #[test]
    fn uncached_free_blocks_are_reused_before_cached_ones() {
        let mut pool = BlockPool::new(2);
        let mut evicted = Vec::new();
        let a = pool.allocate(&mut evicted);
        pool.cache(a, key(1, 0));
        let b = pool.allocate(&mut evicted);
        pool.free([b, a], &mut evicted);
        assert_eq!(pool.allocate(&mut evicted), b);
        assert!(evicted.is_empty());
        pool.clear();
        assert!(!pool.holds(&key(1, 0)));
        assert_eq!(pool.allocate(&mut evicted), a);
        assert!(evicted.is_empty(), "a reset forgets hashes silently");
    }
}
