//! The index as the daemon's tasks share it ([`SharedIndex`]): the writer's
//! side behind a mutex that only this type takes. Every method takes the
//! lock and releases it before it returns, and none is async, so the lock is
//! never held across `.await` and no caller can nest another lock inside it.
//! Picks never take it: they read the [`Lookup`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kvroute_proto::keys::Chain;

use super::{Applied, ApplyStats, Index, Layout, Lookup, SavedBlock};
use crate::event::{EngineHash, KvEvent};
use crate::ids::{PartitionId, ReplicaSlot};
use crate::sync::lock;

/// The index behind its one mutex.
#[derive(Debug)]
pub struct SharedIndex(Mutex<Index>);

/// The index's sizes, read under one lock (`/metrics`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    /// `(block, replica)` entries.
    pub entries: usize,
    /// Distinct block keys.
    pub distinct_keys: usize,
    /// Approximate memory held.
    pub bytes: usize,
    /// Speculative entries.
    pub speculative: usize,
}

/// One replica's part of the index as a snapshot saves it.
#[derive(Debug)]
pub(crate) struct Captured {
    /// The last batch applied.
    pub applied: Applied,
    /// Its KV cache layout, if learned.
    pub layout: Option<Arc<Layout>>,
    /// Its blocks.
    pub blocks: Vec<SavedBlock>,
    /// The names of the partitions its blocks are in.
    pub names: HashMap<PartitionId, String>,
}

impl SharedIndex {
    /// Shares `index`.
    pub fn new(index: Index) -> Self {
        Self(Mutex::new(index))
    }

    /// What Picks read.
    pub fn lookup(&self) -> Arc<Lookup> {
        lock(&self.0).lookup()
    }

    /// Applies one batch of `slot`'s events (of `model`) and publishes it,
    /// recording `applied` as its last batch when given. Returns the
    /// replica's layout when the batch taught the index new KV cache groups.
    pub(crate) fn apply_batch(
        &self,
        slot: ReplicaSlot,
        model: &str,
        events: Vec<KvEvent>,
        applied: Option<Applied>,
        stats: &mut ApplyStats,
    ) -> Option<Arc<Layout>> {
        let mut index = lock(&self.0);
        for ev in events {
            index.apply_unpublished(slot, model, ev);
        }
        if let Some(applied) = applied {
            index.set_applied(slot, applied);
        }
        index.publish(stats);
        (stats.groups_learned > 0)
            .then(|| index.layout(slot))
            .flatten()
    }

    /// Records `applied` as `slot`'s last batch (a replay that found
    /// nothing to apply).
    pub(crate) fn set_applied(&self, slot: ReplicaSlot, applied: Applied) {
        lock(&self.0).set_applied(slot, applied);
    }

    /// Forgets what `slot` holds.
    pub fn purge(&self, slot: ReplicaSlot) {
        lock(&self.0).purge(slot);
    }

    /// Forgets `slot` altogether (its replica was removed).
    pub fn remove_replica(&self, slot: ReplicaSlot) {
        lock(&self.0).remove_replica(slot);
    }

    /// The entries `slot` holds.
    pub fn replica_entries(&self, slot: ReplicaSlot) -> usize {
        lock(&self.0).replica_entries(slot)
    }

    /// `slot`'s KV cache layout, if learned.
    pub fn layout(&self, slot: ReplicaSlot) -> Option<Arc<Layout>> {
        lock(&self.0).layout(slot)
    }

    /// The index's sizes.
    pub fn totals(&self) -> Totals {
        let index = lock(&self.0);
        Totals {
            entries: index.entries(),
            distinct_keys: index.distinct_keys(),
            bytes: index.approx_bytes(),
            speculative: index.speculative_entries(),
        }
    }

    /// What a snapshot saves of `slot`; None if it has applied nothing since
    /// its last purge (nothing to resume from).
    pub(crate) fn capture(&self, slot: ReplicaSlot) -> Option<Captured> {
        let index = lock(&self.0);
        let applied = index.applied(slot)?;
        let layout = index.layout(slot);
        let blocks: Vec<SavedBlock> = index.saved_blocks(slot).collect();
        let mut names: HashMap<PartitionId, String> = HashMap::new();
        for b in &blocks {
            if !names.contains_key(&b.partition)
                && let Some(name) = index.partition_name(b.partition)
            {
                names.insert(b.partition, name);
            }
        }
        Some(Captured {
            applied,
            layout,
            blocks,
            names,
        })
    }

    /// Replaces what `slot` holds by a snapshot's blocks ([`Index`]'s
    /// `restore`); the blocks restored.
    pub(crate) fn restore<'a>(
        &self,
        slot: ReplicaSlot,
        applied: Applied,
        layout: Option<Layout>,
        blocks: impl IntoIterator<Item = (EngineHash, Chain, &'a str, u32, u8)>,
    ) -> usize {
        lock(&self.0).restore(slot, applied, layout, blocks)
    }

    /// The index itself, for tests that inspect it.
    #[cfg(test)]
    pub(crate) fn locked(&self) -> std::sync::MutexGuard<'_, Index> {
        lock(&self.0)
    }
}
