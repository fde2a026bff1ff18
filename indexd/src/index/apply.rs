//! Applying KV events to the index: keys from token ids and chains, salts
//! and partitions, tiers. See the parent module's docs for the rules.

use kvroute_proto::keys::{BlockSize, Chain, KeyChain};

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
    /// Blocks skipped because `group_idx` ≠ 0.
    pub skipped_group: u64,
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
    if ev.group_idx != 0 || ev.token_ids.is_empty() {
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
            .and_then(|l| w.find(store, l, parent))
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

    fn store_blocks(
        &mut self,
        slot: ReplicaSlot,
        model: &str,
        ev: &BlockStored,
        stats: &mut ApplyStats,
    ) {
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
        let Some(local) = self.local_or_insert(slot) else {
            // Every local id is taken by a live replica.
            stats.skipped_unkeyable += n;
            return;
        };
        let tier = tier_bit(ev.tier);
        let mut claimed: Option<Option<PartitionId>> = None;
        // What each block continues: the parent's chain and partition for the
        // first block, then the previous block's; `Err` when unknown.
        let mut link = match ev.parent {
            Some(parent) => self
                .entry(local, parent)
                .map(|e| (e.chain, PartitionId::new(u32::from(e.partition()))))
                .ok_or(Skip::UnknownParent),
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
                && let Some(known) = self.retier(local, *hash, tier)
            {
                // The engine hash covers the salt, the adapter and every
                // earlier token: the entry already says what this block is.
                link = Ok(known);
                stats.stored += 1;
                continue;
            }
            if is_root {
                let salt = match carried {
                    Some(ExtraKeys::Salt(salt)) => Some(salt.as_str()),
                    Some(_) => None,
                    None => {
                        // A prompt's first block without its extra keys: it
                        // may have been salted. Not indexed.
                        link = Err(Skip::SaltUnknown);
                        stats.skipped_salt_unknown += 1;
                        continue;
                    }
                };
                let named = ev.lora_name.as_deref().unwrap_or(model);
                let Some(partition) = self.lookup.partition_or_insert(named) else {
                    stats.skipped_unkeyable += rest;
                    return;
                };
                // The root as computed before the lock, for the same salt.
                let root = match self.chains.first() {
                    Some((root, _)) => *root,
                    None => Chain::root(salt),
                };
                link = Ok((root, partition));
            } else if let Ok((_, parent_partition)) = link {
                // A chain stays in its partition (the engine hash covers the
                // adapter). The event's own claim, if it makes one, must agree:
                // its LoRA name, or the endpoint's model when it carries extra
                // keys (which would list an adapter) but no LoRA name.
                let claim = match (ev.lora_name.as_deref(), carried) {
                    (Some(lora), _) => Some(lora),
                    (None, Some(_)) => Some(model),
                    (None, None) => None,
                };
                // Looked up once per event (the claim is the same for every
                // block that makes one).
                if let Some(claim) = claim
                    && *claimed.get_or_insert_with(|| self.lookup.partition(claim))
                        != Some(parent_partition)
                {
                    stats.skipped_partition_conflict += rest;
                    return;
                }
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
            self.insert(local, *hash, chain, partition, tier, stats);
            stats.stored += 1;
            link = Ok((chain, partition));
        }
    }

    /// Adds `tier` to a block `local` already holds; returns its chain and
    /// partition (`None` if unknown).
    fn retier(&mut self, local: u16, hash: EngineHash, tier: u8) -> Option<(Chain, PartitionId)> {
        let e = self.find(local, hash)?;
        let x = self.store.entry_mut(e)?;
        x.set_tiers(x.tiers() | tier);
        let (chain, partition) = (x.chain, x.partition());
        self.store.add_tiers(e);
        Some((chain, PartitionId::new(u32::from(partition))))
    }

    fn tier_move(&mut self, slot: ReplicaSlot, ev: &BlockStored, stats: &mut ApplyStats) {
        let local = self.local(slot);
        for hash in &ev.block_hashes {
            let Some(e) = local.and_then(|l| self.find(l, *hash)) else {
                stats.skipped_unknown_parent += 1;
                continue;
            };
            if let Some(x) = self.store.entry_mut(e) {
                x.set_tiers(x.tiers() | tier_bit(ev.tier));
            }
            self.store.add_tiers(e);
            stats.tier_moves += 1;
            self.yield_to_readers();
        }
    }

    fn remove(&mut self, slot: ReplicaSlot, ev: &BlockRemoved, stats: &mut ApplyStats) {
        if ev.group_idx != 0 {
            return;
        }
        let Some(local) = self.local(slot) else {
            return;
        };
        for hash in &ev.block_hashes {
            let Some(e) = self.find(local, *hash) else {
                continue;
            };
            let Some(x) = self.store.entry_mut(e) else {
                continue;
            };
            let tiers = x.tiers() & !tier_bit(ev.tier);
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
