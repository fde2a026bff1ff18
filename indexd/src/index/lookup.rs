//! What a Pick reads: the published key map, the partition names and the
//! speculative credits, none of them behind the index's writer.
//!
//! - the key map: a per-thread `left-right` read handle ([`super::keymap`]);
//!   entering it never blocks.
//! - partitions: an `RwLock` written only when a model or adapter name is
//!   seen for the first time (a map insert), read once per Pick.
//! - credits: a `Mutex` taken by Picks (walk, then credit) and by a purge of
//!   the index (dropping a replica's credit); never with the key map's
//!   writer waiting on it.

use std::collections::HashMap;
use std::sync::{Mutex, RwLock};
use std::time::Instant;

use kvroute_proto::keys::BlockKey;
use left_right::{ReadHandle, ReadHandleFactory};
use smallvec::SmallVec;
use thread_local::ThreadLocal;

use super::keymap::KeyMap;
use super::{PrefixMatch, best_tier};
use crate::credits::Credits;
use crate::event::Tier;
use crate::ids::{PartitionId, ReplicaSlot};
use crate::state::{lock, read, write};

/// The read side of the index. See the module docs.
pub struct Lookup {
    factory: ReadHandleFactory<KeyMap>,
    handles: ThreadLocal<ReadHandle<KeyMap>>,
    partitions: RwLock<HashMap<String, PartitionId>>,
    max_partitions: usize,
    credits: Mutex<Credits>,
}

impl std::fmt::Debug for Lookup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lookup")
            .field("partitions", &read(&self.partitions).len())
            .field("credits", &lock(&self.credits).len())
            .finish_non_exhaustive()
    }
}

impl Lookup {
    pub(super) fn new(factory: ReadHandleFactory<KeyMap>, max_speculative: usize) -> Self {
        Self {
            factory,
            handles: ThreadLocal::new(),
            partitions: RwLock::new(HashMap::new()),
            max_partitions: 4096,
            credits: Mutex::new(Credits::new(max_speculative)),
        }
    }

    /// Runs `f` on the published key map (`None` once the index is gone).
    pub(super) fn with_keys<R>(&self, f: impl FnOnce(Option<&KeyMap>) -> R) -> R {
        let handle = self.handles.get_or(|| self.factory.handle());
        let guard = handle.enter();
        f(guard.as_deref())
    }

    /// The partition of `model`, if any event or pick has named it.
    pub fn partition(&self, model: &str) -> Option<PartitionId> {
        read(&self.partitions).get(model).copied()
    }

    /// The partition of `model`, created on first use (`None` once the
    /// partition table is full).
    pub fn partition_or_insert(&self, model: &str) -> Option<PartitionId> {
        if let Some(p) = self.partition(model) {
            return Some(p);
        }
        let mut partitions = write(&self.partitions);
        if let Some(p) = partitions.get(model) {
            return Some(*p);
        }
        if partitions.len() >= self.max_partitions {
            return None;
        }
        let id = PartitionId::new(u32::try_from(partitions.len()).ok()?);
        partitions.insert(model.to_owned(), id);
        Some(id)
    }

    /// The name of a partition.
    pub(crate) fn partition_name(&self, id: PartitionId) -> Option<String> {
        read(&self.partitions)
            .iter()
            .find(|(_, p)| **p == id)
            .map(|(name, _)| name.clone())
    }

    /// Live speculative entries (expired ones may linger until the next
    /// insertion).
    pub fn speculative_entries(&self) -> usize {
        lock(&self.credits).len()
    }

    /// An estimate of the credits' heap bytes.
    pub(super) fn credit_bytes(&self) -> usize {
        lock(&self.credits).approx_bytes()
    }

    /// Drops `slot`'s speculative credit.
    pub(super) fn forget_credits(&self, slot: ReplicaSlot) {
        lock(&self.credits).forget_replica(slot);
    }

    /// Credits `slot` with `keys` until `expires` (speculative entries after
    /// a pick, before its events arrive).
    pub fn speculate(
        &self,
        partition: PartitionId,
        keys: &[BlockKey],
        slot: ReplicaSlot,
        now: Instant,
        expires: Instant,
    ) {
        lock(&self.credits).credit(partition, keys, slot, now, expires);
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
        let credits = lock(&self.credits);
        self.with_keys(|map| {
            let mut alive: SmallVec<[usize; 16]> = (0..candidates.len()).collect();
            // Per candidate: held speculatively up to (excluding) this position.
            let mut credited_until: SmallVec<[usize; 16]> =
                SmallVec::from_elem(0, candidates.len());
            for (pos, key) in keys.iter().enumerate() {
                let holders = map.and_then(|m| m.get(&(partition, *key)));
                alive.retain(|i| {
                    let (Some(slot), Some(until)) =
                        (candidates.get(*i), credited_until.get_mut(*i))
                    else {
                        return false;
                    };
                    let indexed = holders
                        .and_then(|hs| hs.iter().find(|h| h.slot == *slot))
                        .and_then(|h| best_tier(h.tiers));
                    let tier = indexed.or_else(|| {
                        if pos < *until {
                            return Some(Tier::Gpu);
                        }
                        let n = credits.extend(partition, *slot, keys, pos, now);
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
        });
        out
    }
}
