//! Applying KV events to the index: keys from token ids and chains, salts
//! and partitions, tiers, KV cache groups. See the parent module's docs for
//! the rules.
//!
//! Each KV cache group of a replica keeps its own blocks (in its plane of
//! the partition, [`super::Lookup`]). A store that lists a hash for every
//! block of its token range is keyed block by block, from its parent's
//! chain (the parent may be held by another group only: a sliding group
//! does not cache most blocks it computes). A store that lists fewer hashes
//! than blocks (a sparse group's, `reachable_block_mask`) does not say
//! which blocks they are: each takes the chain of the entry another group
//! holds for the same hash, or waits for it ([`super::parked`]).

use std::sync::Arc;

use kvroute_proto::keys::{BlockSize, Chain, KeyChain};

use super::layout::{Layout, Learned, MAX_GROUPS};
use super::store::Store;
use super::{Index, Pending, Txn, Writer, tier_bit};
use crate::event::{BlockRemoved, BlockStored, EngineHash, ExtraKeys, KvEvent};
use crate::ids::{PartitionId, ReplicaSlot};

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
    /// Blocks skipped because their event carries no extra keys and they
    /// start a prompt: they may have been salted (unless the engine hash was
    /// known already, or a known parent carries the chain).
    pub skipped_salt_unknown: u64,
    /// Blocks skipped because their event names another model/adapter
    /// partition than their parent's (and their descendants in the event).
    pub skipped_partition_conflict: u64,
    /// Blocks skipped because their `group_idx` is beyond the groups indexed
    /// ([`MAX_GROUPS`]).
    pub skipped_group: u64,
    /// Sparse groups' blocks parked until another group's entry gives their
    /// chain ([`super::parked`]).
    pub parked: u64,
    /// Parked blocks stored once their chain came.
    pub unparked: u64,
    /// Parked blocks dropped by the bound before their chain came.
    pub parked_dropped: u64,
    /// Groups whose kind or window changed without a purge (the replica's
    /// blocks were dropped and its layout learned afresh).
    pub layout_changes: u64,
    /// Groups learned (new, grown or changed): the layout may need a look.
    pub groups_learned: u64,
    /// GPU stores of a block the replica held already: another physical
    /// copy, evicted on its own.
    pub duplicates: u64,
    /// Blocks skipped because `token_ids` ≠ blocks × block_size.
    pub skipped_bad_length: u64,
    /// Events of unknown type.
    pub unknown_events: u64,
    /// Entries evicted by the memory bound.
    pub evicted: u64,
}

/// Why a block in the middle of an event cannot be keyed: what its
/// predecessor's skip was.
#[derive(Clone, Copy, Debug)]
enum Skip {
    UnknownParent,
    SaltUnknown,
}

impl Skip {
    fn count(self, stats: &mut ApplyStats) {
        match self {
            Skip::UnknownParent => stats.skipped_unknown_parent += 1,
            Skip::SaltUnknown => stats.skipped_salt_unknown += 1,
        }
    }
}

/// Where a prompt's first block starts.
enum Rooted {
    /// Its root chain and partition.
    At((Chain, PartitionId)),
    /// Its extra keys are unsaid: it may have been salted.
    SaltUnknown,
    /// Its partition could not be had (all partition ids taken).
    NoPartition,
}

/// Computes, outside the write lock, the chains of a store's blocks as far
/// as its start is known (its parent's chain, or the root from block 0's
/// salt): `(parent chain, chain)` per block. The apply under the write lock
/// takes a block's chain from here when its parent's chain is the one
/// assumed, and hashes it itself otherwise.
pub(super) fn prepare_chains(
    store: &Store,
    w: &Writer,
    local: Option<u16>,
    ev: &BlockStored,
    out: &mut Vec<(Chain, Chain)>,
) {
    out.clear();
    if ev.group_idx >= MAX_GROUPS || ev.token_ids.is_empty() {
        return;
    }
    let Some(block_size) = BlockSize::new(ev.block_size) else {
        return;
    };
    let bs = ev.block_size as usize;
    if ev.token_ids.len() != ev.block_hashes.len().saturating_mul(bs) {
        return;
    }
    let mut prev = match ev.parent {
        Some(parent) => local
            .and_then(|l| w.find_any(store, l, parent))
            .and_then(|e| store.entry(e))
            .map(|e| e.chain),
        None => match ev.extra_keys.as_ref().and_then(|e| e.first()) {
            Some(ExtraKeys::Salt(salt)) => Some(Chain::root(Some(salt))),
            Some(ExtraKeys::Unkeyable) | None => None,
            Some(_) => Some(Chain::root(None)),
        },
    };
    for tokens in ev.token_ids.chunks_exact(bs) {
        let Some(parent) = prev else {
            return;
        };
        let Ok(chain) = KeyChain::from_parent(block_size, parent).push_block(tokens) else {
            return;
        };
        out.push((parent, chain));
        prev = Some(chain);
    }
}

impl Index {
    /// Applies one event from `slot`, whose configured model is `model`,
    /// and publishes it (with anything queued before it).
    pub fn apply(
        &mut self,
        slot: ReplicaSlot,
        model: &str,
        event: &KvEvent,
        stats: &mut ApplyStats,
    ) {
        // Anything queued goes first; this event is applied as it stands.
        self.publish(stats);
        self.apply_now(slot, model, event, stats);
    }

    /// Queues one event: readers see it, and its stats are counted, at the
    /// next [`Index::publish`] (ingest publishes once per batch).
    pub fn apply_unpublished(&mut self, slot: ReplicaSlot, model: &str, event: KvEvent) {
        self.pending.push(Pending::Event {
            slot,
            model: model.to_owned(),
            event,
        });
    }
}

impl Txn<'_> {
    pub(super) fn apply_event(
        &mut self,
        slot: ReplicaSlot,
        model: &str,
        event: &KvEvent,
        stats: &mut ApplyStats,
    ) {
        match event {
            KvEvent::BlockStored(stored) => self.store_blocks(slot, model, stored, stats),
            KvEvent::BlockRemoved(removed) => self.remove(slot, removed, stats),
            KvEvent::AllBlocksCleared => {
                self.purge(slot);
                stats.cleared += 1;
            }
            KvEvent::Unknown => stats.unknown_events += 1,
        }
    }

    /// Records the group an event describes in `local`'s layout. A group
    /// that changed kind or window without a purge means another model:
    /// the replica's blocks go and the layout is learned afresh.
    fn learn(&mut self, slot: ReplicaSlot, local: u16, ev: &BlockStored, stats: &mut ApplyStats) {
        let known = self.store.layout(local);
        if known.is_some_and(|l| {
            l.knows(
                ev.group_idx,
                ev.kind.as_ref(),
                ev.sliding_window,
                ev.block_size,
            )
        }) {
            return;
        }
        let mut layout = known.map(|l| Layout::clone(l)).unwrap_or_default();
        match layout.learn(
            ev.group_idx,
            ev.kind.as_ref(),
            ev.sliding_window,
            ev.block_size,
        ) {
            Learned::Same | Learned::Beyond => {}
            Learned::New => {
                stats.groups_learned += 1;
                self.store.set_layout(local, Some(Arc::new(layout)));
            }
            Learned::Changed => {
                stats.groups_learned += 1;
                stats.layout_changes += 1;
                self.purge(slot);
                let mut fresh = Layout::default();
                fresh.learn(
                    ev.group_idx,
                    ev.kind.as_ref(),
                    ev.sliding_window,
                    ev.block_size,
                );
                self.store.set_layout(local, Some(Arc::new(fresh)));
            }
        }
    }

    fn store_blocks(
        &mut self,
        slot: ReplicaSlot,
        model: &str,
        ev: &BlockStored,
        stats: &mut ApplyStats,
    ) {
        let n = ev.block_hashes.len() as u64;
        let Ok(group) = u8::try_from(ev.group_idx) else {
            stats.skipped_group += n;
            return;
        };
        if ev.group_idx >= MAX_GROUPS {
            stats.skipped_group += n;
            return;
        }
        if ev.token_ids.is_empty() {
            self.tier_move(slot, ev, group, stats);
            return;
        }
        let Some(block_size) = BlockSize::new(ev.block_size) else {
            stats.skipped_bad_length += n;
            return;
        };
        let bs = ev.block_size as usize;
        if !ev.token_ids.len().is_multiple_of(bs) || ev.token_ids.len() / bs < ev.block_hashes.len()
        {
            stats.skipped_bad_length += n;
            return;
        }
        let Some(local) = self.local_or_insert(slot) else {
            // Every local id is taken by a live replica.
            stats.skipped_unkeyable += n;
            return;
        };
        self.learn(slot, local, ev, stats);
        if ev.token_ids.len() / bs > ev.block_hashes.len() {
            self.store_sparse(local, model, ev, group, stats);
        } else {
            self.store_chain(local, model, ev, group, block_size, stats);
        }
    }

    /// A stored event of whole blocks, each the next of a chain: linked to
    /// its parent (or rooted at its salt), checked against the partition the
    /// event claims, keyed and inserted; the event stops at the first block
    /// that cannot be keyed.
    fn store_chain(
        &mut self,
        local: u16,
        model: &str,
        ev: &BlockStored,
        group: u8,
        block_size: BlockSize,
        stats: &mut ApplyStats,
    ) {
        let n = ev.block_hashes.len() as u64;
        let bs = block_size.get() as usize;
        let tier = tier_bit(ev.tier);
        let mut claimed: Option<Option<PartitionId>> = None;
        // What each block continues: the parent's chain and partition for the
        // first block, then the previous block's; `Err` when unknown.
        let mut link = match ev.parent {
            Some(parent) => self.entry_any(local, parent).ok_or(Skip::UnknownParent),
            None => Err(Skip::UnknownParent),
        };
        for (i, (hash, tokens)) in ev
            .block_hashes
            .iter()
            .zip(ev.token_ids.chunks_exact(bs))
            .enumerate()
        {
            let rest = n - i as u64;
            let is_root = i == 0 && ev.parent.is_none();
            // `None`: the event does not say (no `extra_keys`).
            let carried = ev.extra_keys.as_ref().and_then(|e| e.get(i));
            match carried {
                // Media or embedding identities, or a salt below a parent.
                Some(ExtraKeys::Unkeyable) => {
                    stats.skipped_unkeyable += rest;
                    return;
                }
                Some(ExtraKeys::Salt(_)) if !is_root => {
                    stats.skipped_unkeyable += rest;
                    return;
                }
                _ => {}
            }
            if carried.is_none()
                && let Some(known) = self.known(local, *hash, group, tier, stats)
            {
                // The engine hash covers the salt, the adapter and every
                // earlier token: the entry already says what this block is.
                link = Ok(known);
                stats.stored += 1;
                continue;
            }
            if is_root {
                match self.root_link(ev, model, carried) {
                    Rooted::At(root) => link = Ok(root),
                    Rooted::SaltUnknown => {
                        // A prompt's first block without its extra keys: it
                        // may have been salted. Not indexed.
                        link = Err(Skip::SaltUnknown);
                        stats.skipped_salt_unknown += 1;
                        continue;
                    }
                    Rooted::NoPartition => {
                        stats.skipped_unkeyable += rest;
                        return;
                    }
                }
            } else if let Ok((_, parent_partition)) = link
                && self.claims_another(ev, model, carried, parent_partition, &mut claimed)
            {
                stats.skipped_partition_conflict += rest;
                return;
            }
            let (parent, partition) = match link {
                Ok(l) => l,
                Err(skip) => {
                    skip.count(stats);
                    continue;
                }
            };
            let chain = match self.chains.get(i) {
                Some((assumed, chain)) if *assumed == parent => *chain,
                _ => match KeyChain::from_parent(block_size, parent).push_block(tokens) {
                    Ok(chain) => chain,
                    Err(_) => {
                        stats.skipped_bad_length += rest;
                        return;
                    }
                },
            };
            let Some(plane) = self.plane(partition, group) else {
                stats.skipped_unkeyable += rest;
                return;
            };
            self.insert(local, *hash, chain, plane, tier, stats);
            stats.stored += 1;
            link = Ok((chain, partition));
        }
    }

    /// The chain and partition a prompt's first block starts: its salt's
    /// root (as computed before the lock) in the partition of its adapter or
    /// model.
    fn root_link(&self, ev: &BlockStored, model: &str, carried: Option<&ExtraKeys>) -> Rooted {
        let salt = match carried {
            Some(ExtraKeys::Salt(salt)) => Some(salt.as_str()),
            Some(_) => None,
            None => return Rooted::SaltUnknown,
        };
        let named = ev.lora_name.as_deref().unwrap_or(model);
        let Some(partition) = self.lookup.partition_or_insert(named) else {
            return Rooted::NoPartition;
        };
        // The root as computed before the lock, for the same salt.
        let root = match self.chains.first() {
            Some((root, _)) => *root,
            None => Chain::root(salt),
        };
        Rooted::At((root, partition))
    }

    /// Whether the event claims a partition other than its parent's. A
    /// chain stays in its partition (the engine hash covers the adapter);
    /// the event's own claim, if it makes one, must agree: its LoRA name, or
    /// the endpoint's model when it carries extra keys (which would list an
    /// adapter) but no LoRA name. The claim is looked up once per event
    /// (`claimed`: it is the same for every block that makes one).
    fn claims_another(
        &self,
        ev: &BlockStored,
        model: &str,
        carried: Option<&ExtraKeys>,
        parent_partition: PartitionId,
        claimed: &mut Option<Option<PartitionId>>,
    ) -> bool {
        let claim = match (ev.lora_name.as_deref(), carried) {
            (Some(lora), _) => Some(lora),
            (None, Some(_)) => Some(model),
            (None, None) => None,
        };
        claim.is_some_and(|claim| {
            *claimed.get_or_insert_with(|| self.lookup.partition(claim)) != Some(parent_partition)
        })
    }

    /// A sparse group's store: hashes for some blocks of the range, which
    /// ones unsaid. Each block takes the chain of another group's entry of
    /// its hash, or is parked until one comes.
    fn store_sparse(
        &mut self,
        local: u16,
        model: &str,
        ev: &BlockStored,
        group: u8,
        stats: &mut ApplyStats,
    ) {
        let tier = tier_bit(ev.tier);
        let mut claimed: Option<Option<PartitionId>> = None;
        for (i, hash) in ev.block_hashes.iter().enumerate() {
            let carried = ev.extra_keys.as_ref().and_then(|e| e.get(i));
            if matches!(carried, Some(ExtraKeys::Unkeyable)) {
                stats.skipped_unkeyable += 1;
                continue;
            }
            if let Some(e) = self.find(local, *hash, group) {
                self.restore_tier(e, tier, stats);
                stats.stored += 1;
                continue;
            }
            let Some((chain, partition)) = self.entry_any(local, *hash) else {
                stats.parked += 1;
                stats.parked_dropped += self.w.parked.park(local, *hash, group, tier);
                continue;
            };
            let claim = match (ev.lora_name.as_deref(), carried) {
                (Some(lora), _) => Some(lora),
                (None, Some(_)) => Some(model),
                (None, None) => None,
            };
            if let Some(claim) = claim
                && *claimed.get_or_insert_with(|| self.lookup.partition(claim)) != Some(partition)
            {
                stats.skipped_partition_conflict += 1;
                continue;
            }
            let Some(plane) = self.plane(partition, group) else {
                stats.skipped_unkeyable += 1;
                continue;
            };
            self.insert(local, *hash, chain, plane, tier, stats);
            stats.stored += 1;
        }
    }

    /// What `local` knows of a block announced without extra keys: its
    /// entry in `group` gains `tier`; else another group's entry of the
    /// hash gives the chain and the block is stored in `group`. Its chain
    /// and partition, `None` if unknown.
    fn known(
        &mut self,
        local: u16,
        hash: EngineHash,
        group: u8,
        tier: u8,
        stats: &mut ApplyStats,
    ) -> Option<(Chain, PartitionId)> {
        if let Some(known) = self.retier(local, hash, group, tier, stats) {
            return Some(known);
        }
        let (chain, partition) = self.entry_any(local, hash)?;
        let plane = self.plane(partition, group)?;
        self.insert(local, hash, chain, plane, tier, stats);
        Some((chain, partition))
    }

    /// Adds `tier` to a block `local` already holds in `group` (a copy
    /// more if it held it there); returns its chain and partition (`None`
    /// if unknown).
    fn retier(
        &mut self,
        local: u16,
        hash: EngineHash,
        group: u8,
        tier: u8,
        stats: &mut ApplyStats,
    ) -> Option<(Chain, PartitionId)> {
        let e = self.find(local, hash, group)?;
        let (chain, plane) = self.restore_tier(e, tier, stats)?;
        let (partition, _) = self.lookup.plane_of(PartitionId::new(u32::from(plane)))?;
        Some((chain, partition))
    }

    /// Entry `e` is stored again in `tier`: the tier is added, a copy
    /// counted. Its chain and plane.
    fn restore_tier(&mut self, e: u32, tier: u8, stats: &mut ApplyStats) -> Option<(Chain, u16)> {
        let x = self.store.entry_mut(e)?;
        let had = x.tiers();
        x.set_tiers(had | tier);
        let (chain, plane) = (x.chain, x.partition());
        self.store.add_tiers(e);
        self.stored_again(e, had, tier, stats);
        Some((chain, plane))
    }

    fn tier_move(
        &mut self,
        slot: ReplicaSlot,
        ev: &BlockStored,
        group: u8,
        stats: &mut ApplyStats,
    ) {
        let local = self.local(slot);
        let tier = tier_bit(ev.tier);
        for hash in &ev.block_hashes {
            let Some(e) = local.and_then(|l| self.find(l, *hash, group)) else {
                if local.is_some_and(|l| self.w.parked.add_tiers(l, *hash, group, tier)) {
                    stats.tier_moves += 1;
                } else {
                    stats.skipped_unknown_parent += 1;
                }
                continue;
            };
            if let Some(x) = self.store.entry_mut(e) {
                x.set_tiers(x.tiers() | tier);
            }
            self.store.add_tiers(e);
            stats.tier_moves += 1;
            self.yield_to_readers();
        }
    }

    fn remove(&mut self, slot: ReplicaSlot, ev: &BlockRemoved, stats: &mut ApplyStats) {
        let Ok(group) = u8::try_from(ev.group_idx) else {
            return;
        };
        let Some(local) = self.local(slot) else {
            return;
        };
        let tier = tier_bit(ev.tier);
        for hash in &ev.block_hashes {
            let Some(e) = self.find(local, *hash, group) else {
                if self.w.parked.remove(local, *hash, group, tier) {
                    stats.removed += 1;
                }
                continue;
            };
            // One physical copy of several went.
            if tier == tier_bit(crate::event::Tier::Gpu)
                && let Some(n) = self.w.copies.get_mut(&e)
            {
                *n -= 1;
                if *n == 0 {
                    self.w.copies.remove(&e);
                }
                stats.removed += 1;
                continue;
            }
            let Some(x) = self.store.entry_mut(e) else {
                continue;
            };
            let tiers = x.tiers() & !tier;
            x.set_tiers(tiers);
            if tiers == 0 {
                self.drop_entry(local, e);
            } else {
                self.store.set_tiers_if_single(e);
            }
            stats.removed += 1;
            self.yield_to_readers();
        }
    }
}

#[cfg(test)]
#[path = "apply_tests.rs"]
mod tests;
