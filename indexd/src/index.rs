//! The block index: which replica holds which block, in which tier.
//!
//! - Partitioned by model/adapter: a block key is looked up as
//!   `(PartitionId, BlockKey)`; the partition is the event's `lora_name`, else
//!   the endpoint's model.
//! - `key → holders`: every replica holding the block, with its tiers.
//! - Per replica, `engine hash → (Chain, key)`: how a later `BlockStored`
//!   naming a block as its parent is keyed (via `kvroute_proto::keys`), and how
//!   a `BlockRemoved` finds the key to drop.
//! - A hard bound on `(block, replica)` entries: beyond it the oldest entries
//!   are evicted first (global FIFO; a parent goes before its children).
//! - Speculative entries ([`Credits`]): credit for a picked replica for a few
//!   seconds, bounded.
//!
//! The index has a single owner (`RwLock` in [`crate::state`]); every method
//! here is synchronous and allocation-bounded.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use kvroute_proto::keys::{BlockKey, BlockSize, Chain, KeyChain};
use smallvec::SmallVec;

use crate::credits::Credits;
use crate::wire::{BlockRemoved, BlockStored, EngineHash, ExtraKeys, KvEvent};

/// A storage tier, best first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// Device memory.
    Gpu,
    /// Host memory (offloaded).
    Cpu,
    /// Disk or remote storage.
    Storage,
}

impl Tier {
    /// All tiers, best first.
    pub const ALL: [Tier; 3] = [Tier::Gpu, Tier::Cpu, Tier::Storage];

    const fn bit(self) -> u8 {
        match self {
            Tier::Gpu => 1,
            Tier::Cpu => 2,
            Tier::Storage => 4,
        }
    }

    /// The best tier in a non-empty mask.
    fn best(mask: u8) -> Option<Tier> {
        Self::ALL.into_iter().find(|t| mask & t.bit() != 0)
    }

    /// The label used in metrics and logs.
    pub const fn label(self) -> &'static str {
        match self {
            Tier::Gpu => "gpu",
            Tier::Cpu => "cpu",
            Tier::Storage => "storage",
        }
    }
}

/// A replica's dense identity inside the index (never reused).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReplicaSlot(pub u32);

/// A model/adapter partition.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PartitionId(u32);

impl PartitionId {
    pub(crate) const fn new(id: u32) -> Self {
        Self(id)
    }
}

/// What applying events did, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ApplyStats {
    /// Blocks newly indexed (or re-stored).
    pub stored: u64,
    /// Blocks re-announced in another tier (no tokens).
    pub tier_moves: u64,
    /// Blocks removed from a tier.
    pub removed: u64,
    /// Purges (AllBlocksCleared).
    pub cleared: u64,
    /// Blocks skipped because the parent is unknown.
    pub skipped_unknown_parent: u64,
    /// Blocks skipped because their extra keys are not keyable (and their
    /// descendants in the event).
    pub skipped_unkeyable: u64,
    /// Blocks skipped because `group_idx` ≠ 0.
    pub skipped_group: u64,
    /// Blocks skipped because `token_ids` ≠ blocks × block_size.
    pub skipped_bad_length: u64,
    /// Events of unknown type.
    pub unknown_events: u64,
    /// Entries evicted by the memory bound.
    pub evicted: u64,
}

/// Per-candidate result of a prefix walk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Leading request blocks held.
    pub blocks: u32,
    /// Of those, blocks whose best tier is GPU, CPU, storage.
    pub per_tier: [u32; 3],
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
struct Holder {
    slot: ReplicaSlot,
    tiers: u8,
    refs: u16,
}

type Holders = SmallVec<[Holder; 2]>;

#[derive(Clone, Copy, Debug)]
struct BlockEntry {
    chain: Chain,
    key: BlockKey,
    partition: PartitionId,
    tiers: u8,
    seq: u64,
}

#[derive(Debug, Default)]
struct ReplicaBlocks {
    blocks: HashMap<EngineHash, BlockEntry>,
}

/// The block index. See the module docs.
#[derive(Debug)]
pub struct Index {
    partitions: HashMap<String, PartitionId>,
    max_partitions: usize,
    keys: HashMap<(PartitionId, BlockKey), Holders>,
    replicas: HashMap<ReplicaSlot, ReplicaBlocks>,
    order: VecDeque<(ReplicaSlot, EngineHash, u64)>,
    next_seq: u64,
    entries: usize,
    max_entries: usize,
    speculative: Credits,
}

impl Index {
    /// An empty index holding at most `max_entries` `(block, replica)`
    /// entries and `max_speculative` speculative ones.
    pub fn new(max_entries: usize, max_speculative: usize) -> Self {
        Self {
            partitions: HashMap::new(),
            max_partitions: 4096,
            keys: HashMap::new(),
            replicas: HashMap::new(),
            order: VecDeque::new(),
            next_seq: 0,
            entries: 0,
            max_entries: max_entries.max(1),
            speculative: Credits::new(max_speculative),
        }
    }

    /// `(block, replica)` entries currently indexed.
    pub fn entries(&self) -> usize {
        self.entries
    }

    /// Distinct `(partition, key)` pairs.
    pub fn distinct_keys(&self) -> usize {
        self.keys.len()
    }

    /// Entries held by one replica.
    pub fn replica_entries(&self, slot: ReplicaSlot) -> usize {
        self.replicas.get(&slot).map_or(0, |r| r.blocks.len())
    }

    /// Live speculative entries (expired ones may linger until the next
    /// insertion).
    pub fn speculative_entries(&self) -> usize {
        self.speculative.len()
    }

    /// An estimate of the heap bytes the index holds (capacity-based).
    pub fn approx_bytes(&self) -> usize {
        use std::mem::size_of;
        let key_map = self.keys.capacity()
            * (size_of::<(PartitionId, BlockKey)>() + size_of::<Holders>() + 1);
        let replica_maps: usize = self
            .replicas
            .values()
            .map(|r| r.blocks.capacity() * (size_of::<EngineHash>() + size_of::<BlockEntry>() + 1))
            .sum();
        let order = self.order.capacity() * size_of::<(ReplicaSlot, EngineHash, u64)>();
        key_map + replica_maps + order + self.speculative.approx_bytes()
    }

    /// The partition of `model`, if any event or pick has named it.
    pub fn partition(&self, model: &str) -> Option<PartitionId> {
        self.partitions.get(model).copied()
    }

    /// The partition of `model`, created on first use (`None` once the
    /// partition table is full).
    pub fn partition_or_insert(&mut self, model: &str) -> Option<PartitionId> {
        if let Some(p) = self.partitions.get(model) {
            return Some(*p);
        }
        if self.partitions.len() >= self.max_partitions {
            return None;
        }
        let id = PartitionId(u32::try_from(self.partitions.len()).ok()?);
        self.partitions.insert(model.to_owned(), id);
        Some(id)
    }

    /// Applies one event from `slot`, whose configured model is `model`.
    pub fn apply(
        &mut self,
        slot: ReplicaSlot,
        model: &str,
        event: &KvEvent,
        stats: &mut ApplyStats,
    ) {
        match event {
            KvEvent::BlockStored(stored) => self.store(slot, model, stored, stats),
            KvEvent::BlockRemoved(removed) => self.remove(slot, removed, stats),
            KvEvent::AllBlocksCleared => {
                self.purge(slot);
                stats.cleared += 1;
            }
            KvEvent::Unknown => stats.unknown_events += 1,
        }
    }

    fn store(&mut self, slot: ReplicaSlot, model: &str, ev: &BlockStored, stats: &mut ApplyStats) {
        let n = ev.block_hashes.len() as u64;
        if ev.group_idx != 0 {
            stats.skipped_group += n;
            return;
        }
        if ev.token_ids.is_empty() {
            self.tier_move(slot, ev, stats);
            return;
        }
        let Some(block_size) = BlockSize::new(ev.block_size) else {
            stats.skipped_bad_length += n;
            return;
        };
        let bs = ev.block_size as usize;
        if ev.token_ids.len() != ev.block_hashes.len().saturating_mul(bs) {
            stats.skipped_bad_length += n;
            return;
        }
        let first_extra = ev.extra_keys.first().unwrap_or(&ExtraKeys::None);
        let root = match (ev.parent, first_extra) {
            (None, ExtraKeys::None) => Chain::root(None),
            (None, ExtraKeys::Salt(salt)) => Chain::root(Some(salt)),
            (Some(parent), ExtraKeys::None) => {
                match self.replicas.get(&slot).and_then(|r| r.blocks.get(&parent)) {
                    Some(entry) => entry.chain,
                    None => {
                        stats.skipped_unknown_parent += n;
                        return;
                    }
                }
            }
            // A salt below a parent, or media/embedding identities.
            _ => {
                stats.skipped_unkeyable += n;
                return;
            }
        };
        let partition_name = ev.lora_name.as_deref().unwrap_or(model);
        let Some(partition) = self.partition_or_insert(partition_name) else {
            stats.skipped_unkeyable += n;
            return;
        };
        let mut chain = KeyChain::from_parent(block_size, root);
        for (i, (hash, tokens)) in ev
            .block_hashes
            .iter()
            .zip(ev.token_ids.chunks_exact(bs))
            .enumerate()
        {
            if i > 0 && !matches!(ev.extra_keys.get(i), None | Some(ExtraKeys::None)) {
                stats.skipped_unkeyable += n - i as u64;
                return;
            }
            let Ok(next) = chain.push_block(tokens) else {
                stats.skipped_bad_length += n - i as u64;
                return;
            };
            self.insert(slot, *hash, next, partition, ev.tier.bit(), stats);
            stats.stored += 1;
        }
    }

    fn tier_move(&mut self, slot: ReplicaSlot, ev: &BlockStored, stats: &mut ApplyStats) {
        for hash in &ev.block_hashes {
            let Some(entry) = self.block_mut(slot, hash) else {
                stats.skipped_unknown_parent += 1;
                continue;
            };
            entry.tiers |= ev.tier.bit();
            let (key, tiers) = ((entry.partition, entry.key), entry.tiers);
            if let Some(h) = self.holder_mut(key, slot) {
                h.tiers |= tiers;
            }
            stats.tier_moves += 1;
        }
    }

    fn remove(&mut self, slot: ReplicaSlot, ev: &BlockRemoved, stats: &mut ApplyStats) {
        if ev.group_idx != 0 {
            return;
        }
        for hash in &ev.block_hashes {
            let Some(entry) = self.block_mut(slot, hash) else {
                continue;
            };
            entry.tiers &= !ev.tier.bit();
            let (key, tiers) = ((entry.partition, entry.key), entry.tiers);
            if tiers == 0 {
                self.drop_entry(slot, *hash);
            } else if let Some(h) = self.holder_mut(key, slot)
                && h.refs == 1
            {
                h.tiers = tiers;
            }
            stats.removed += 1;
        }
    }

    fn holder_mut(
        &mut self,
        key: (PartitionId, BlockKey),
        slot: ReplicaSlot,
    ) -> Option<&mut Holder> {
        self.keys
            .get_mut(&key)
            .and_then(|hs| hs.iter_mut().find(|h| h.slot == slot))
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
            if existing.key == key && existing.partition == partition {
                existing.tiers |= tier_bit;
                let tiers = existing.tiers;
                if let Some(h) = self.holder_mut((partition, key), slot) {
                    h.tiers |= tiers;
                }
                return;
            }
            self.drop_entry(slot, hash);
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        let entry = BlockEntry {
            chain,
            key,
            partition,
            tiers: tier_bit,
            seq,
        };
        self.replicas
            .entry(slot)
            .or_default()
            .blocks
            .insert(hash, entry);
        let holders = self.keys.entry((partition, key)).or_default();
        match holders.iter_mut().find(|h| h.slot == slot) {
            Some(h) => {
                h.refs = h.refs.saturating_add(1);
                h.tiers |= tier_bit;
            }
            None => holders.push(Holder {
                slot,
                tiers: tier_bit,
                refs: 1,
            }),
        }
        self.entries += 1;
        self.order.push_back((slot, hash, seq));
        while self.entries > self.max_entries {
            if !self.evict_oldest() {
                break;
            }
            stats.evicted += 1;
        }
        if self.order.len() > 2 * self.entries + 1024 {
            self.compact_order();
        }
    }

    fn evict_oldest(&mut self) -> bool {
        while let Some((slot, hash, seq)) = self.order.pop_front() {
            let live = self
                .replicas
                .get(&slot)
                .and_then(|r| r.blocks.get(&hash))
                .is_some_and(|e| e.seq == seq);
            if live {
                self.drop_entry(slot, hash);
                return true;
            }
        }
        false
    }

    fn compact_order(&mut self) {
        let replicas = &self.replicas;
        self.order.retain(|(slot, hash, seq)| {
            replicas
                .get(slot)
                .and_then(|r| r.blocks.get(hash))
                .is_some_and(|e| e.seq == *seq)
        });
    }

    fn block_mut(&mut self, slot: ReplicaSlot, hash: &EngineHash) -> Option<&mut BlockEntry> {
        self.replicas
            .get_mut(&slot)
            .and_then(|r| r.blocks.get_mut(hash))
    }

    fn drop_entry(&mut self, slot: ReplicaSlot, hash: EngineHash) {
        let Some(entry) = self
            .replicas
            .get_mut(&slot)
            .and_then(|r| r.blocks.remove(&hash))
        else {
            return;
        };
        self.entries = self.entries.saturating_sub(1);
        self.release_holder((entry.partition, entry.key), slot);
    }

    fn release_holder(&mut self, key: (PartitionId, BlockKey), slot: ReplicaSlot) {
        if let Some(holders) = self.keys.get_mut(&key) {
            if let Some(pos) = holders.iter().position(|h| h.slot == slot)
                && let Some(h) = holders.get_mut(pos)
            {
                h.refs = h.refs.saturating_sub(1);
                if h.refs == 0 {
                    holders.swap_remove(pos);
                }
            }
            if holders.is_empty() {
                self.keys.remove(&key);
            }
        }
    }

    /// Forgets everything `slot` holds (restart, AllBlocksCleared, an
    /// unrecoverable gap). Speculative credit for it is dropped too.
    pub fn purge(&mut self, slot: ReplicaSlot) {
        self.speculative.forget_replica(slot);
        let Some(replica) = self.replicas.get_mut(&slot) else {
            return;
        };
        let blocks = std::mem::take(&mut replica.blocks);
        for entry in blocks.values() {
            self.entries = self.entries.saturating_sub(1);
            self.release_holder((entry.partition, entry.key), slot);
        }
        if self.order.len() > 2 * self.entries + 1024 {
            self.compact_order();
        }
    }

    /// Purges `slot` and forgets it entirely (endpoint removed).
    pub fn remove_replica(&mut self, slot: ReplicaSlot) {
        self.purge(slot);
        self.replicas.remove(&slot);
    }

    /// Walks `keys` in order and returns, per candidate, the leading blocks
    /// it holds (indexed or speculative, unexpired at `now`). Stops at the
    /// first block no candidate still matching holds.
    pub fn match_prefix(
        &self,
        partition: Option<PartitionId>,
        keys: &[BlockKey],
        candidates: &[ReplicaSlot],
        now: Instant,
    ) -> Vec<PrefixMatch> {
        let mut out = vec![PrefixMatch::default(); candidates.len()];
        let Some(partition) = partition else {
            return out;
        };
        let mut alive: SmallVec<[usize; 16]> = (0..candidates.len()).collect();
        // Per candidate: held speculatively up to (excluding) this position.
        let mut credited_until: SmallVec<[usize; 16]> = SmallVec::from_elem(0, candidates.len());
        for (pos, key) in keys.iter().enumerate() {
            let holders = self.keys.get(&(partition, *key));
            alive.retain(|i| {
                let (Some(slot), Some(until)) = (candidates.get(*i), credited_until.get_mut(*i))
                else {
                    return false;
                };
                let indexed = holders
                    .and_then(|hs| hs.iter().find(|h| h.slot == *slot))
                    .and_then(|h| Tier::best(h.tiers));
                let tier = indexed.or_else(|| {
                    if pos < *until {
                        return Some(Tier::Gpu);
                    }
                    let n = self.speculative.extend(partition, *slot, keys, pos, now);
                    *until = pos + n;
                    (n > 0).then_some(Tier::Gpu)
                });
                match (tier, out.get_mut(*i)) {
                    (Some(tier), Some(m)) => {
                        m.push(tier);
                        true
                    }
                    _ => false,
                }
            });
            if alive.is_empty() {
                break;
            }
        }
        out
    }

    /// Credits `slot` with `keys` until `expires` (speculative entries after
    /// a pick, before its events arrive).
    pub fn speculate(
        &mut self,
        partition: PartitionId,
        keys: &[BlockKey],
        slot: ReplicaSlot,
        now: Instant,
        expires: Instant,
    ) {
        self.speculative.credit(partition, keys, slot, now, expires);
    }
}

#[cfg(test)]
#[path = "index_tests.rs"]
pub(crate) mod tests;
