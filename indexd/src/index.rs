//! The block index: which replica holds which block, in which tier.
//!
//! - Partitioned by model/adapter: a block key is looked up as
//!   `(PartitionId, BlockKey)`; the partition is the event's `lora_name`, else
//!   the endpoint's model.
//! - `key → holders`: every replica holding the block, with its tiers.
//! - Per replica, `engine hash → entry` (its chain, partition, tiers): how a
//!   later `BlockStored` naming a block as its parent is keyed (via
//!   `kvroute_proto::keys`), and how a `BlockRemoved` finds the key to drop.
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
//! # Layout and concurrency
//!
//! One copy of everything ([`store`]): a slab of 40-byte entries, a key
//! table whose slot names the entry holding a key (or, for a key several
//! entries hold, a group listing them), the eviction order threaded through
//! the entries. Per replica, `engine hash → entry` is a table of `u32` that
//! the writer keeps to itself. About 60 B per `(block, replica)` entry,
//! where the key map kept twice (`left-right`) beside per-replica maps of
//! chains cost ≈ 240 B.
//!
//! The index has a single owner (a `Mutex` in [`crate::state`]); every method
//! here is synchronous and allocation-bounded. Picks do not take that lock:
//! they read the one copy under a `parking_lot` read lock ([`Lookup`]), and
//! the index takes the write lock only in [`Index::publish`], only to apply
//! changes:
//! - A batch is queued by [`Index::apply_unpublished`] and applied at its
//!   publish, event by event: nothing of it shows before, and a writer
//!   stalled mid-batch holds back no Pick.
//! - Per event, what costs (XXH3 of each block's tokens, room in the
//!   replica's table) is done under the read lock, beside the Picks; the
//!   write lock covers the slab and table updates, tens of nanoseconds per
//!   block.
//! - The write lock is yielded to waiting readers after every block
//!   (`RwLockWriteGuard::bump`, a fair handover), so a Pick waits for one
//!   block's changes, never for a whole batch, a replica's purge or a run of
//!   evictions. Between two yields a Pick may see a batch partly applied:
//!   the replica's cache was in that state too, a moment before.
//! - A key-table shard that an event's new keys would make grow is grown
//!   (a copy, rehashed) under the read lock and swapped in under the write
//!   lock (`Store::grow_for`): a rehash reads every slot's key
//!   from the entry it names, a cache miss each, too long to hold Picks.
//!
//! Why a read lock rather than a seqlock or epochs over the slab: a Pick
//! reads 1,024 keys and their holders; retrying that walk, or holding back
//! every slab reuse until readers move on, buys little over a read lock the
//! writer never holds for more than a block, and needs `unsafe` code. Why
//! not a lock per shard: a Pick would take 1,024 of them.

use std::collections::HashMap;
use std::sync::Arc;

use hashbrown::HashTable;
use kvroute_proto::keys::Chain;
use parking_lot::RwLock;

pub use apply::ApplyStats;
pub use layout::{KvGroup, Layout};
pub use lookup::{Lookup, Query};
pub(crate) use saved::{Applied, SavedBlock};
pub use shared::{SharedIndex, Totals};

use store::{Entry, Store, table_bytes};
use txn::Txn;

use crate::event::{EngineHash, KvEvent, Tier};
use crate::ids::{PartitionId, ReplicaSlot};

use crate::ids::FastMap;

/// A tier's bit in a tier mask.
const fn tier_bit(tier: Tier) -> u8 {
    match tier {
        Tier::Gpu => 1,
        Tier::Cpu => 2,
        Tier::Storage => 4,
    }
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
    /// The replica's KV cache layout has a group indexd does not model:
    /// `blocks` is what the other groups accept, an upper bound.
    pub unmodelled: bool,
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
}

/// A change queued until [`Index::publish`].
#[derive(Debug)]
enum Pending {
    Event {
        slot: ReplicaSlot,
        model: String,
        event: KvEvent,
    },
    Applied {
        slot: ReplicaSlot,
        applied: Applied,
    },
}

/// One replica's blocks: `(engine hash, group) → entry`.
#[derive(Debug, Default)]
struct ReplicaBlocks {
    table: HashTable<u32>,
}

/// The writer's own state, outside the lock.
#[derive(Debug)]
struct Writer {
    /// By local id.
    replicas: Vec<Option<ReplicaBlocks>>,
    locals: FastMap<ReplicaSlot, u16>,
    free_locals: Vec<u16>,
    /// Per replica, the last batch applied (None after a purge, until the
    /// next batch).
    applied: HashMap<ReplicaSlot, Applied>,
    /// Engine hashes' hasher (they are vLLM's; seeded per process).
    hasher: foldhash::fast::RandomState,
    next_seq: u32,
    entries: usize,
    max_entries: usize,
    /// Per plane id (a partition's or a group's, see [`Lookup`]), its KV
    /// cache group (0 for a partition's own).
    plane_group: Vec<u8>,
    /// Sparse groups' blocks waiting for their chain ([`parked`]).
    parked: parked::Parked,
    /// Entries whose block the replica holds in more than one physical GPU
    /// block: the copies beyond the first (see [`Txn::stored_again`]).
    copies: FastMap<u32, u16>,
}

/// A block's place in its replica's table: its engine hash and its KV cache
/// group (each group holds the same hashes apart).
fn engine_hash(hasher: &foldhash::fast::RandomState, hash: EngineHash, group: u8) -> u64 {
    use std::hash::BuildHasher;
    if group == 0 {
        hasher.hash_one(hash.0)
    } else {
        hasher.hash_one((hash.0, group))
    }
}

/// The group of a plane (see [`Writer::plane_group`]).
fn group_of(plane_group: &[u8], plane: u16) -> u8 {
    plane_group.get(usize::from(plane)).copied().unwrap_or(0)
}

/// An entry's place in its replica's table.
fn entry_hash(hasher: &foldhash::fast::RandomState, plane_group: &[u8], e: &Entry) -> u64 {
    engine_hash(hasher, e.hash(), group_of(plane_group, e.partition()))
}

impl Writer {
    fn blocks(&self, local: u16) -> Option<&ReplicaBlocks> {
        self.replicas.get(usize::from(local))?.as_ref()
    }

    /// The entry `local` holds for `hash` in KV cache group `group`.
    fn find(&self, store: &Store, local: u16, hash: EngineHash, group: u8) -> Option<u32> {
        let plane_group = &self.plane_group;
        self.blocks(local)?
            .table
            .find(engine_hash(&self.hasher, hash, group), |e| {
                store.entry(*e).is_some_and(|x| {
                    x.hash() == hash && group_of(plane_group, x.partition()) == group
                })
            })
            .copied()
    }

    /// An entry `local` holds for `hash` in any group: the block's chain and
    /// partition do not depend on the group (vLLM hashes a block alike in
    /// every group of its block size).
    fn find_any(&self, store: &Store, local: u16, hash: EngineHash) -> Option<u32> {
        let groups = store.layout(local).map_or(1, |l| l.width());
        (0..groups).find_map(|g| self.find(store, local, hash, g))
    }

    /// Room for `additional` more entries in `local`'s table (rehashing, if
    /// needed, under the read lock rather than the write lock).
    fn reserve(&mut self, store: &Store, local: u16, additional: usize) {
        let (hasher, plane_group) = (&self.hasher, &self.plane_group);
        if let Some(Some(r)) = self.replicas.get_mut(usize::from(local)) {
            r.table.reserve(additional, |e| {
                store
                    .entry(*e)
                    .map_or(0, |x| entry_hash(hasher, plane_group, x))
            });
        }
    }

    /// Gives memory back from `local`'s table if it emptied out: below a
    /// fifth of its capacity it is rehashed to twice its length (amortized
    /// O(1); not sooner, or a churning table would rehash twice as often).
    fn shrink_if_sparse(&mut self, store: &Store, local: u16) {
        let (hasher, plane_group) = (&self.hasher, &self.plane_group);
        if let Some(Some(r)) = self.replicas.get_mut(usize::from(local)) {
            let (len, cap) = (r.table.len(), r.table.capacity());
            if cap > 1024 && len.saturating_mul(5) < cap {
                r.table.shrink_to(len.saturating_mul(2), |e| {
                    store
                        .entry(*e)
                        .map_or(0, |x| entry_hash(hasher, plane_group, x))
                });
            }
        }
    }
}

/// The block index. See the module docs.
#[derive(Debug)]
pub struct Index {
    store: Arc<RwLock<Store>>,
    lookup: Arc<Lookup>,
    w: Writer,
    pending: Vec<Pending>,
    /// Per block of the event being applied: its parent's chain and its
    /// own, computed before the write lock.
    chains: Vec<(Chain, Chain)>,
}

impl Index {
    /// An empty index holding at most `max_entries` `(block, replica)`
    /// entries and `max_speculative` speculative ones.
    pub fn new(max_entries: usize, max_speculative: usize) -> Self {
        let store = Arc::new(RwLock::new(Store::default()));
        Self {
            lookup: Arc::new(Lookup::new(Arc::clone(&store), max_speculative)),
            store,
            w: Writer {
                replicas: Vec::new(),
                locals: FastMap::default(),
                free_locals: Vec::new(),
                applied: HashMap::new(),
                hasher: foldhash::fast::RandomState::default(),
                next_seq: 0,
                entries: 0,
                max_entries: max_entries.clamp(1, store::MAX_RECORDS as usize),
                plane_group: Vec::new(),
                parked: parked::Parked::default(),
                copies: FastMap::default(),
            },
            pending: Vec::new(),
            chains: Vec::new(),
        }
    }

    /// What Picks read, shared: it follows this index's publishes.
    pub fn lookup(&self) -> Arc<Lookup> {
        Arc::clone(&self.lookup)
    }

    /// `(block, replica)` entries currently indexed.
    pub fn entries(&self) -> usize {
        self.w.entries
    }

    /// Distinct `(partition, key)` pairs.
    pub fn distinct_keys(&self) -> usize {
        self.store.read().distinct_keys()
    }

    /// The KV cache groups `slot`'s events have shown since its last purge.
    pub fn layout(&self, slot: ReplicaSlot) -> Option<Arc<Layout>> {
        let local = self.w.locals.get(&slot)?;
        self.store.read().layout(*local).cloned()
    }

    /// Sparse groups' blocks waiting for their chain.
    pub fn parked(&self) -> usize {
        self.w.parked.len()
    }

    /// Entries held by one replica.
    pub fn replica_entries(&self, slot: ReplicaSlot) -> usize {
        self.w
            .locals
            .get(&slot)
            .and_then(|l| self.w.blocks(*l))
            .map_or(0, |r| r.table.len())
    }

    /// Live speculative entries (expired ones may linger until the next
    /// insertion).
    pub fn speculative_entries(&self) -> usize {
        self.lookup.speculative_entries()
    }

    /// An estimate of the heap bytes the index holds (capacity-based: the
    /// slab's chunks, every table's buckets, spilled holder lists, the
    /// speculative credits).
    pub fn approx_bytes(&self) -> usize {
        let replica_tables: usize = self
            .w
            .replicas
            .iter()
            .flatten()
            .map(|r| table_bytes(r.table.capacity()))
            .sum();
        self.store.read().heap_bytes()
            + replica_tables
            + self.lookup.credit_bytes()
            + self.w.parked.approx_bytes()
            + self.w.copies.capacity() * (std::mem::size_of::<(u32, u16)>() + 1)
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

    /// Applies everything queued (see [`Index::apply_unpublished`]), adding
    /// what it did to `stats`. Readers see each event as it is applied.
    pub fn publish(&mut self, stats: &mut ApplyStats) {
        let mut pending = std::mem::take(&mut self.pending);
        for p in pending.drain(..) {
            match p {
                Pending::Event { slot, model, event } => {
                    self.apply_now(slot, &model, &event, stats);
                }
                Pending::Applied { slot, applied } => {
                    self.w.applied.insert(slot, applied);
                }
            }
        }
        // Keeps the queue's allocation.
        self.pending = pending;
    }

    /// Applies one event: its chains, room in the replica's table and in the
    /// key table under the read lock, then the changes under the write lock.
    fn apply_now(
        &mut self,
        slot: ReplicaSlot,
        model: &str,
        event: &KvEvent,
        stats: &mut ApplyStats,
    ) {
        self.chains.clear();
        let mut grown = Vec::new();
        if let KvEvent::BlockStored(stored) = event {
            let store = self.store.read();
            let local = self.w.locals.get(&slot).copied();
            if let Some(local) = local
                && !stored.token_ids.is_empty()
            {
                self.w
                    .reserve(&store, local, stored.block_hashes.len().saturating_mul(2));
            }
            apply::prepare_chains(&store, &self.w, local, stored, &mut self.chains);
            grown = store.grow_for(self.chains.iter().map(|(_, c)| c.key().as_u64()));
        }
        let mut txn = self.txn();
        txn.store.install_grown(grown);
        txn.apply_event(slot, model, event, stats);
        drop(txn);
        if let Some(local) = self.w.locals.get(&slot).copied() {
            let store = self.store.read();
            self.w.shrink_if_sparse(&store, local);
        }
    }

    fn txn(&mut self) -> Txn<'_> {
        Txn {
            store: self.store.write(),
            w: &mut self.w,
            lookup: &self.lookup,
            chains: &self.chains,
        }
    }

    /// Forgets everything `slot` holds (restart, AllBlocksCleared, an
    /// unrecoverable gap). Speculative credit for it is dropped too. Queued
    /// changes are applied first.
    pub fn purge(&mut self, slot: ReplicaSlot) {
        self.publish(&mut ApplyStats::default());
        self.chains.clear();
        self.txn().purge(slot);
    }

    /// Purges `slot` and forgets it entirely (endpoint removed); its local
    /// id is free for another replica.
    pub fn remove_replica(&mut self, slot: ReplicaSlot) {
        self.purge(slot);
        let Some(local) = self.w.locals.remove(&slot) else {
            return;
        };
        self.store.write().locals.remove(&slot);
        if let Some(r) = self.w.replicas.get_mut(usize::from(local)) {
            *r = None;
        }
        self.w.free_locals.push(local);
    }

    /// [`Lookup::match_prefix`] on what this index last published (tests;
    /// Picks go through the shared [`Lookup`]).
    #[cfg(test)]
    pub(crate) fn match_prefix(
        &self,
        partition: Option<PartitionId>,
        keys: &[kvroute_proto::keys::BlockKey],
        candidates: &[ReplicaSlot],
        now: std::time::Instant,
    ) -> Vec<PrefixMatch> {
        self.lookup.match_prefix(partition, keys, candidates, now)
    }

    /// Every entry as `(slot, engine hash, partition, chain)` (tests).
    #[cfg(test)]
    pub(crate) fn all_blocks(&self) -> Vec<(ReplicaSlot, EngineHash, PartitionId, Chain)> {
        let store = self.store.read();
        let mut out = Vec::new();
        for (slot, local) in &self.w.locals {
            for e in self
                .w
                .blocks(*local)
                .into_iter()
                .flat_map(|r| r.table.iter())
            {
                if let Some(x) = store.entry(*e) {
                    let plane = PartitionId::new(u32::from(x.partition()));
                    let partition = self.lookup.plane_of(plane).map_or(plane, |(p, _)| p);
                    out.push((*slot, x.hash(), partition, x.chain));
                }
            }
        }
        assert_eq!(store.slab_len(), self.w.entries, "slab and count agree");
        out
    }
}

mod apply;
pub mod layout;
mod lookup;
mod parked;
mod saved;
mod shared;
mod slab;
mod store;
mod txn;

#[cfg(test)]
#[path = "index_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "index_model_tests.rs"]
pub(crate) mod model;

#[cfg(test)]
#[path = "index/hybrid_tests.rs"]
mod hybrid_tests;

#[cfg(test)]
#[path = "index/replay_tests.rs"]
mod replay_tests;
