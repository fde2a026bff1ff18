//! A write transaction on the index ([`Txn`]): the writer's state and the
//! store under its write lock, with the steps every change is made of
//! (insert, unpark, evict, purge), yielding the lock to waiting Picks
//! between blocks.

use kvroute_proto::keys::Chain;
use parking_lot::RwLockWriteGuard;

use super::store::{Entry, Store};
use super::{
    ApplyStats, Lookup, ReplicaBlocks, Writer, engine_hash, entry_hash, group_of, tier_bit,
};
use crate::event::{EngineHash, Tier};
use crate::ids::{PartitionId, ReplicaSlot};

/// The index under its write lock: the writer's state and the one copy.
pub(super) struct Txn<'a> {
    pub(super) store: RwLockWriteGuard<'a, Store>,
    pub(super) w: &'a mut Writer,
    pub(super) lookup: &'a Lookup,
    pub(super) chains: &'a [(Chain, Chain)],
}

impl Txn<'_> {
    /// Lets waiting readers in (fair), then takes the lock back.
    pub(super) fn yield_to_readers(&mut self) {
        RwLockWriteGuard::bump(&mut self.store);
    }

    pub(super) fn local(&self, slot: ReplicaSlot) -> Option<u16> {
        self.w.locals.get(&slot).copied()
    }

    /// `slot`'s local id, given on first use (`None` when all 65,536 are
    /// taken by live replicas).
    pub(super) fn local_or_insert(&mut self, slot: ReplicaSlot) -> Option<u16> {
        if let Some(l) = self.local(slot) {
            return Some(l);
        }
        let local = match self.w.free_locals.pop() {
            Some(l) => l,
            None => u16::try_from(self.w.replicas.len()).ok()?,
        };
        let i = usize::from(local);
        if self.w.replicas.len() <= i {
            self.w.replicas.resize_with(i + 1, || None);
        }
        if let Some(r) = self.w.replicas.get_mut(i) {
            *r = Some(ReplicaBlocks::default());
        }
        self.w.locals.insert(slot, local);
        self.store.locals.insert(slot, local);
        self.store.set_layout(local, None);
        Some(local)
    }

    /// The plane of `partition`'s KV cache group `group`, created on first
    /// use (`None` once the partition table is full).
    pub(super) fn plane(&mut self, partition: PartitionId, group: u8) -> Option<PartitionId> {
        let plane = self.lookup.plane_or_insert(partition, u32::from(group))?;
        let i = plane.get() as usize;
        if self.w.plane_group.len() <= i {
            self.w.plane_group.resize(i + 1, 0);
        }
        if let Some(g) = self.w.plane_group.get_mut(i) {
            *g = group;
        }
        Some(plane)
    }

    /// The entry `local` holds for `hash` in `group`.
    pub(super) fn find(&self, local: u16, hash: EngineHash, group: u8) -> Option<u32> {
        self.w.find(&self.store, local, hash, group)
    }

    /// An entry `local` holds for `hash` in any group: its chain and
    /// partition (the partition of its plane).
    pub(super) fn entry_any(&self, local: u16, hash: EngineHash) -> Option<(Chain, PartitionId)> {
        let e = self.w.find_any(&self.store, local, hash)?;
        let x = self.store.entry(e)?;
        let (partition, _) = self
            .lookup
            .plane_of(PartitionId::new(u32::from(x.partition())))?;
        Some((x.chain, partition))
    }

    /// Stores `(local, hash)` keyed by `chain` in `plane` with a tier (or
    /// adds the tier if it holds that key already), then gives any parked
    /// block of the same hash its chain.
    pub(super) fn insert(
        &mut self,
        local: u16,
        hash: EngineHash,
        chain: Chain,
        plane: PartitionId,
        tier_bit: u8,
        stats: &mut ApplyStats,
    ) {
        self.insert_one(local, hash, chain, plane, tier_bit, stats);
        if !self.w.parked.is_empty() {
            self.unpark(local, hash, chain, plane, stats);
        }
    }

    pub(super) fn insert_one(
        &mut self,
        local: u16,
        hash: EngineHash,
        chain: Chain,
        plane: PartitionId,
        tier_bit: u8,
        stats: &mut ApplyStats,
    ) {
        let Ok(part) = u16::try_from(plane.get()) else {
            return;
        };
        let group = group_of(&self.w.plane_group, part);
        if let Some(e) = self.find(local, hash, group) {
            if let Some(x) = self.store.entry_mut(e)
                && x.key() == (part, chain.key().as_u64())
            {
                let had = x.tiers();
                x.set_tiers(had | tier_bit);
                self.store.add_tiers(e);
                self.stored_again(e, had, tier_bit, stats);
                return;
            }
            self.drop_entry(local, e);
        }
        let seq = self.w.next_seq;
        self.w.next_seq = seq.wrapping_add(1);
        let Some(e) = self
            .store
            .insert(Entry::new(chain, hash, local, part, tier_bit, seq))
        else {
            return;
        };
        let (hasher, plane_group) = (&self.w.hasher, &self.w.plane_group);
        let store = &*self.store;
        let Some(Some(r)) = self.w.replicas.get_mut(usize::from(local)) else {
            self.store.remove(e);
            return;
        };
        r.table
            .insert_unique(engine_hash(hasher, hash, group), e, |i| {
                store
                    .entry(*i)
                    .map_or(0, |x| entry_hash(hasher, plane_group, x))
            });
        self.store.hold(e);
        self.w.entries += 1;
        while self.w.entries > self.w.max_entries {
            if !self.evict_oldest() {
                break;
            }
            stats.evicted += 1;
        }
        self.yield_to_readers();
    }

    /// Blocks of other groups parked under `hash` (they came before the
    /// block that gives their chain) are stored now, in their groups'
    /// planes of the same partition.
    pub(super) fn unpark(
        &mut self,
        local: u16,
        hash: EngineHash,
        chain: Chain,
        plane: PartitionId,
        stats: &mut ApplyStats,
    ) {
        let Some(groups) = self.w.parked.take(local, hash) else {
            return;
        };
        let Some((partition, _)) = self.lookup.plane_of(plane) else {
            return;
        };
        for (group, tiers) in groups {
            let Some(plane) = self.plane(partition, group) else {
                continue;
            };
            self.insert_one(local, hash, chain, plane, tiers, stats);
            stats.unparked += 1;
        }
    }

    /// A store of a block `e` holds already in `tier` (its tiers were
    /// `had`): in the GPU tier, another physical block of the same hash.
    /// vLLM's pool keeps every copy under the hash (`BlockHashToBlockMap`)
    /// and a request that missed a cached block (a hybrid model's sliding
    /// group had no tail there) computes it again into a new one; each copy
    /// is evicted on its own, with its own `BlockRemoved`. The entry stays
    /// until the last copy goes.
    pub(super) fn stored_again(&mut self, e: u32, had: u8, tier: u8, stats: &mut ApplyStats) {
        if tier == tier_bit(Tier::Gpu) && had & tier != 0 {
            let n = self.w.copies.entry(e).or_default();
            *n = n.saturating_add(1);
            stats.duplicates += 1;
        }
    }

    pub(super) fn evict_oldest(&mut self) -> bool {
        let Some(e) = self.store.oldest() else {
            return false;
        };
        let local = self.store.entry(e).map_or(0, |x| x.replica);
        self.drop_entry(local, e);
        true
    }

    /// Forgets entry `e` of `local`.
    pub(super) fn drop_entry(&mut self, local: u16, e: u32) {
        let Some(place) = self
            .store
            .entry(e)
            .map(|x| entry_hash(&self.w.hasher, &self.w.plane_group, x))
        else {
            return;
        };
        if let Some(Some(r)) = self.w.replicas.get_mut(usize::from(local))
            && let Ok(found) = r.table.find_entry(place, |i| *i == e)
        {
            found.remove();
        }
        self.w.copies.remove(&e);
        self.store.remove(e);
        self.w.entries = self.w.entries.saturating_sub(1);
    }

    /// Forgets everything `slot` holds, its parked blocks and its layout
    /// (relearned from its next events), yielding to readers every 64
    /// entries.
    pub(super) fn purge(&mut self, slot: ReplicaSlot) {
        self.lookup.forget_credits(slot);
        self.w.applied.remove(&slot);
        let Some(local) = self.local(slot) else {
            return;
        };
        self.w.parked.forget(local);
        self.store.set_layout(local, None);
        let Some(Some(r)) = self.w.replicas.get_mut(usize::from(local)) else {
            return;
        };
        let table = std::mem::take(&mut r.table);
        for (n, e) in table.into_iter().enumerate() {
            if !self.w.copies.is_empty() {
                self.w.copies.remove(&e);
            }
            self.store.remove(e);
            self.w.entries = self.w.entries.saturating_sub(1);
            if n % 64 == 63 {
                self.yield_to_readers();
            }
        }
    }
}
