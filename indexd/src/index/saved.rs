//! What a snapshot saves of the index and restores into it: each replica's
//! blocks (engine hash, chain, partition, KV cache group, tiers), its KV
//! cache layout, and the last batch applied.

use kvroute_proto::keys::Chain;

use std::sync::Arc;

use super::layout::{Layout, MAX_GROUPS};
use super::{Index, Pending};
use crate::event::EngineHash;
use crate::ids::{PartitionId, ReplicaSlot};

/// The last batch applied from a replica's publisher: its seq and a digest of
/// its payload. Replaying from `seq` and finding the same digest there proves
/// the publisher is the same process and nothing was missed since.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Applied {
    /// The batch's seq.
    pub seq: u64,
    /// [`crate::subscriber::digest`] of its payload.
    pub digest: u64,
}

/// One indexed block, as saved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SavedBlock {
    /// The engine's hash.
    pub hash: EngineHash,
    /// Its chain value (its key is the chain's).
    pub chain: Chain,
    /// Its partition.
    pub partition: PartitionId,
    /// Its KV cache group.
    pub group: u32,
    /// Its tiers, as a mask (GPU 1, CPU 2, storage 4).
    pub tiers: u8,
    /// Insertion order (oldest first), so a restore keeps eviction order.
    pub order: u64,
}

/// Every tier bit.
const TIER_MASK: u8 = 0b111;

impl Index {
    /// The last batch applied from `slot` (None: none since the last purge).
    pub(crate) fn applied(&self, slot: ReplicaSlot) -> Option<Applied> {
        self.w.applied.get(&slot).copied()
    }

    /// Records that `slot`'s blocks reflect every batch up to `applied`
    /// (queued behind any events not yet published).
    pub(crate) fn set_applied(&mut self, slot: ReplicaSlot, applied: Applied) {
        if self.pending.is_empty() {
            self.w.applied.insert(slot, applied);
        } else {
            self.pending.push(Pending::Applied { slot, applied });
        }
    }

    /// The name of a partition.
    pub(crate) fn partition_name(&self, id: PartitionId) -> Option<String> {
        self.lookup.partition_name(id)
    }

    /// Every block `slot` holds, in no particular order.
    pub(crate) fn saved_blocks(&self, slot: ReplicaSlot) -> impl Iterator<Item = SavedBlock> + '_ {
        let store = self.store.read();
        let next = self.w.next_seq;
        let blocks: Vec<SavedBlock> = self
            .w
            .locals
            .get(&slot)
            .and_then(|l| self.w.blocks(*l))
            .into_iter()
            .flat_map(|r| r.table.iter())
            .filter_map(|e| store.entry(*e))
            .filter_map(|e| {
                let plane = PartitionId::new(u32::from(e.partition()));
                let (partition, group) = self.lookup.plane_of(plane)?;
                Some(SavedBlock {
                    hash: e.hash(),
                    chain: e.chain,
                    partition,
                    group,
                    tiers: e.tiers(),
                    // Oldest first: by age in insertions (counted mod 2^32).
                    order: u64::from(u32::MAX - next.wrapping_sub(e.seq)),
                })
            })
            .collect();
        blocks.into_iter()
    }

    /// Replaces what `slot` holds by saved blocks (oldest first) whose
    /// partitions are named by `partition`, with its saved `layout`, and
    /// records `applied`. Blocks with no tier, a group beyond those indexed,
    /// or whose partition cannot be had, are skipped. Returns the blocks
    /// restored (the entry bound may evict some of them again).
    pub(crate) fn restore<'a>(
        &mut self,
        slot: ReplicaSlot,
        applied: Applied,
        layout: Option<Layout>,
        blocks: impl IntoIterator<Item = (EngineHash, Chain, &'a str, u32, u8)>,
    ) -> usize {
        self.purge(slot);
        let mut stats = super::ApplyStats::default();
        let mut restored = 0;
        let lookup = Arc::clone(&self.lookup);
        let mut txn = self.txn();
        let Some(local) = txn.local_or_insert(slot) else {
            return 0;
        };
        txn.store
            .set_layout(local, layout.filter(|l| !l.is_empty()).map(Arc::new));
        for (hash, chain, partition, group, tiers) in blocks {
            let tiers = tiers & TIER_MASK;
            let Ok(group) = u8::try_from(group) else {
                continue;
            };
            if tiers == 0 || u32::from(group) >= MAX_GROUPS {
                continue;
            }
            let Some(plane) = lookup
                .partition_or_insert(partition)
                .and_then(|p| txn.plane(p, group))
            else {
                continue;
            };
            txn.insert(local, hash, chain, plane, tiers, &mut stats);
            restored += 1;
        }
        drop(txn);
        self.w.applied.insert(slot, applied);
        restored
    }
}
