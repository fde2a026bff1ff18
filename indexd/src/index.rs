//! The block index: which replica holds which block, in which tier.
//!
//! - Partitioned by model/adapter: a block key is looked up as
//!   `(PartitionId, BlockKey)`; the partition is the event's `lora_name`, else
//!   the endpoint's model.
//! - `key → holders`: every replica holding the block, with its tiers.
//! - Per replica, `engine hash → (Chain, key)`: how a later `BlockStored`
//!   naming a block as its parent is keyed (via `kvroute_proto::keys`), and how
//!   a `BlockRemoved` finds the key to drop.
//! - Salts and partitions are never guessed. The salt comes from block 0's
//!   `extra_keys` and travels down the chain; a child continues its parent's
//!   chain in its parent's partition (an event claiming another partition is
//!   skipped). An event without `extra_keys` (offloading connectors, the
//!   CPU/storage tiers, older vLLM) cannot say whether a prompt's first block
//!   was salted: such a block is indexed only if its engine hash is known
//!   already (then it gains the tier), never as unsalted. Its descendants in
//!   the event follow the same rule; with a known parent they are keyed from
//!   the parent's chain.
//! - A hard bound on `(block, replica)` entries: beyond it the oldest entries
//!   are evicted first (global FIFO; a parent goes before its children).
//! - Speculative entries ([`crate::credits::Credits`]): credit for a picked
//!   replica for a few seconds, bounded.
//!
//! - Per replica, the last batch applied (seq and payload digest), so that a
//!   snapshot of its blocks says where its event stream resumes
//!   ([`crate::snapshot`]).
//!
//! The index has a single owner (a `Mutex` in [`crate::state`]); every method
//! here is synchronous and allocation-bounded. Picks do not take that lock:
//! they read a [`Lookup`] (the key map as last published, the partitions,
//! the credits), which the index keeps current (see [`keymap`]).

use std::collections::HashMap;
use std::sync::Arc;

use kvroute_proto::keys::{BlockKey, Chain};
use left_right::WriteHandle;

pub use apply::ApplyStats;
pub use lookup::Lookup;
pub(crate) use saved::{Applied, SavedBlock};

use fifo::Fifo;
use keymap::{KeyMap, KeyOp};

use crate::event::{EngineHash, Tier};
use crate::ids::{PartitionId, ReplicaSlot};

/// Gives memory back from a map that emptied out: the bound is on entries,
/// and a map keeps the capacity of its peak otherwise (per-replica maps
/// ratchet up as the global FIFO moves entries between replicas). Below a
/// fifth of its capacity it is rehashed to twice its length: amortized
/// O(1). Not sooner: a churning map that doubles to clear its tombstones
/// lands just above a quarter full, and shrinking it back would only
/// rehash it twice as often.
fn shrink_if_sparse<K: std::hash::Hash + Eq, V, S: std::hash::BuildHasher>(
    map: &mut HashMap<K, V, S>,
) {
    let (len, cap) = (map.len(), map.capacity());
    if cap > 1024 && len.saturating_mul(5) < cap {
        map.shrink_to(len.saturating_mul(2));
    }
}

/// The index's hash maps: keys are SHA-256 prefixes and engine hashes, so a
/// fast hasher (foldhash, seeded per process) does; SipHash cost a third of
/// a Pick's walk.
pub(crate) type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// A tier's bit in a tier mask.
const fn tier_bit(tier: Tier) -> u8 {
    match tier {
        Tier::Gpu => 1,
        Tier::Cpu => 2,
        Tier::Storage => 4,
    }
}

/// The best tier in a non-empty mask.
fn best_tier(mask: u8) -> Option<Tier> {
    Tier::ALL.into_iter().find(|t| mask & tier_bit(*t) != 0)
}

/// Per-candidate result of a prefix walk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Leading request blocks held.
    pub blocks: u32,
    /// Of those, blocks whose best tier is GPU, CPU, storage.
    pub per_tier: [u32; 3],
    /// Of those, blocks credited speculatively (a pick sent them there; the
    /// replica's events do not show them yet).
    pub speculative: u32,
}

impl PrefixMatch {
    /// The slowest tier among the matched blocks.
    pub fn slowest_tier(&self) -> Option<Tier> {
        Tier::ALL
            .into_iter()
            .rev()
            .zip(self.per_tier.iter().rev())
            .find(|(_, n)| **n > 0)
            .map(|(t, _)| t)
    }

    fn push(&mut self, tier: Tier) {
        self.blocks += 1;
        if let Some(n) = self.per_tier.get_mut(tier as usize) {
            *n += 1;
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct BlockEntry {
    /// Its chain value; its key is the chain's first 8 bytes.
    chain: Chain,
    partition: PartitionId,
    tiers: u8,
    seq: u64,
}

impl BlockEntry {
    fn key(&self) -> (PartitionId, BlockKey) {
        (self.partition, self.chain.key())
    }
}

#[derive(Debug, Default)]
struct ReplicaBlocks {
    blocks: FastMap<EngineHash, BlockEntry>,
    /// The last batch whose events `blocks` reflects (None after a purge,
    /// until the next batch).
    applied: Option<Applied>,
}

/// The block index. See the module docs.
#[derive(Debug)]
pub struct Index {
    /// The key map's writer: changes are logged, and readers see them at
    /// [`Index::publish`].
    keys: WriteHandle<KeyMap, KeyOp>,
    lookup: Arc<Lookup>,
    replicas: HashMap<ReplicaSlot, ReplicaBlocks>,
    order: Fifo,
    next_seq: u64,
    entries: usize,
    max_entries: usize,
}

impl Index {
    /// An empty index holding at most `max_entries` `(block, replica)`
    /// entries and `max_speculative` speculative ones.
    pub fn new(max_entries: usize, max_speculative: usize) -> Self {
        let (mut keys, reader) = left_right::new_from_empty(KeyMap::default());
        // Published once empty: from here on changes are logged (before the
        // first publish they would go straight to the writer's copy, and
        // `flush` would see nothing to publish).
        keys.publish();
        Self {
            keys,
            lookup: Arc::new(Lookup::new(reader.factory(), max_speculative)),
            replicas: HashMap::new(),
            order: Fifo::default(),
            next_seq: 0,
            entries: 0,
            max_entries: max_entries.max(1),
        }
    }

    /// What Picks read, shared: it follows this index's publishes.
    pub fn lookup(&self) -> Arc<Lookup> {
        Arc::clone(&self.lookup)
    }

    /// Makes every change so far visible to readers (once per batch of
    /// events; the mutating methods other than [`Index::apply_unpublished`]
    /// call it themselves). Waits for readers still in the copy published
    /// before the last one.
    pub fn publish(&mut self) {
        self.keys.flush();
    }

    /// `(block, replica)` entries currently indexed.
    pub fn entries(&self) -> usize {
        self.entries
    }

    /// Distinct `(partition, key)` pairs.
    pub fn distinct_keys(&self) -> usize {
        self.lookup.with_keys(|m| m.map_or(0, KeyMap::len))
    }

    /// Entries held by one replica.
    pub fn replica_entries(&self, slot: ReplicaSlot) -> usize {
        self.replicas.get(&slot).map_or(0, |r| r.blocks.len())
    }

    /// Live speculative entries (expired ones may linger until the next
    /// insertion).
    pub fn speculative_entries(&self) -> usize {
        self.lookup.speculative_entries()
    }

    /// An estimate of the heap bytes the index holds (capacity-based; the
    /// key map counts twice, one copy for readers and one for the writer).
    pub fn approx_bytes(&self) -> usize {
        use std::mem::size_of;
        let key_map =
            2 * self.lookup.with_keys(|m| m.map_or(0, KeyMap::capacity)) * KeyMap::SLOT_BYTES;
        let replica_maps: usize = self
            .replicas
            .values()
            .map(|r| r.blocks.capacity() * (size_of::<EngineHash>() + size_of::<BlockEntry>() + 1))
            .sum();
        let order = self.order.capacity() * size_of::<fifo::Item>();
        key_map + replica_maps + order + self.lookup.credit_bytes()
    }

    /// The partition of `model`, if any event or pick has named it.
    pub fn partition(&self, model: &str) -> Option<PartitionId> {
        self.lookup.partition(model)
    }

    /// The partition of `model`, created on first use (`None` once the
    /// partition table is full).
    pub fn partition_or_insert(&mut self, model: &str) -> Option<PartitionId> {
        self.lookup.partition_or_insert(model)
    }

    fn insert(
        &mut self,
        slot: ReplicaSlot,
        hash: EngineHash,
        chain: Chain,
        partition: PartitionId,
        tier_bit: u8,
        stats: &mut ApplyStats,
    ) {
        let key = chain.key();
        let replica = self.replicas.entry(slot).or_default();
        if let Some(existing) = replica.blocks.get_mut(&hash) {
            if existing.key() == (partition, key) {
                existing.tiers |= tier_bit;
                let tiers = existing.tiers;
                self.keys.append(KeyOp::AddTiers {
                    key: (partition, key),
                    slot,
                    tiers,
                });
                return;
            }
            self.drop_entry(slot, hash);
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        let entry = BlockEntry {
            chain,
            partition,
            tiers: tier_bit,
            seq,
        };
        self.replicas
            .entry(slot)
            .or_default()
            .blocks
            .insert(hash, entry);
        self.keys.append(KeyOp::Hold {
            key: (partition, key),
            slot,
            tiers: tier_bit,
        });
        self.entries += 1;
        self.order.push((slot, hash, seq));
        while self.entries > self.max_entries {
            if !self.evict_oldest() {
                break;
            }
            stats.evicted += 1;
        }
        self.order_upkeep();
    }

    /// One step of sweeping stale items out of the insertion order.
    fn order_upkeep(&mut self) {
        let replicas = &self.replicas;
        self.order
            .upkeep(self.entries, |item| Self::is_live(replicas, item));
    }

    fn is_live(
        replicas: &HashMap<ReplicaSlot, ReplicaBlocks>,
        (slot, hash, seq): &fifo::Item,
    ) -> bool {
        replicas
            .get(slot)
            .and_then(|r| r.blocks.get(hash))
            .is_some_and(|e| e.seq == *seq)
    }

    fn evict_oldest(&mut self) -> bool {
        while let Some(item) = self.order.pop_front() {
            if Self::is_live(&self.replicas, &item) {
                self.drop_entry(item.0, item.1);
                return true;
            }
        }
        false
    }

    fn block(&self, slot: ReplicaSlot, hash: &EngineHash) -> Option<&BlockEntry> {
        self.replicas.get(&slot).and_then(|r| r.blocks.get(hash))
    }

    fn block_mut(&mut self, slot: ReplicaSlot, hash: &EngineHash) -> Option<&mut BlockEntry> {
        self.replicas
            .get_mut(&slot)
            .and_then(|r| r.blocks.get_mut(hash))
    }

    fn drop_entry(&mut self, slot: ReplicaSlot, hash: EngineHash) {
        let Some(replica) = self.replicas.get_mut(&slot) else {
            return;
        };
        let Some(entry) = replica.blocks.remove(&hash) else {
            return;
        };
        shrink_if_sparse(&mut replica.blocks);
        self.entries = self.entries.saturating_sub(1);
        self.release_holder(entry.key(), slot);
    }

    fn release_holder(&mut self, key: (PartitionId, BlockKey), slot: ReplicaSlot) {
        self.keys.append(KeyOp::Release { key, slot });
    }

    /// Forgets everything `slot` holds (restart, AllBlocksCleared, an
    /// unrecoverable gap). Speculative credit for it is dropped too.
    pub fn purge(&mut self, slot: ReplicaSlot) {
        self.purge_unpublished(slot);
        self.publish();
    }

    fn purge_unpublished(&mut self, slot: ReplicaSlot) {
        self.lookup.forget_credits(slot);
        let Some(replica) = self.replicas.get_mut(&slot) else {
            return;
        };
        replica.applied = None;
        let blocks = std::mem::take(&mut replica.blocks);
        for entry in blocks.values() {
            self.entries = self.entries.saturating_sub(1);
            self.release_holder(entry.key(), slot);
        }
        // The replica's items stay in the insertion order as stale ones, and
        // the sweep takes them out a few per later operation. Compacting the
        // whole order here cost O(every entry) per purge: in the fleet
        // simulation (4.6 M entries, 256 replicas restarting) each restart
        // held the index for a few hundred milliseconds, and ingest fell
        // from 131 k to 8–36 k blocks/s.
        self.order_upkeep();
    }

    /// Purges `slot` and forgets it entirely (endpoint removed).
    pub fn remove_replica(&mut self, slot: ReplicaSlot) {
        self.purge(slot);
        self.replicas.remove(&slot);
    }

    /// [`Lookup::match_prefix`] on what this index last published (tests;
    /// Picks go through the shared [`Lookup`]).
    #[cfg(test)]
    pub(crate) fn match_prefix(
        &self,
        partition: Option<PartitionId>,
        keys: &[BlockKey],
        candidates: &[ReplicaSlot],
        now: std::time::Instant,
    ) -> Vec<PrefixMatch> {
        self.lookup.match_prefix(partition, keys, candidates, now)
    }
}

mod apply;
mod fifo;
mod keymap;
mod lookup;
mod saved;

#[cfg(test)]
#[path = "index_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "index_model_tests.rs"]
pub(crate) mod model;
