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
use super::{FastMap, PrefixMatch, best_tier};
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
    ///
    /// One key-map lookup per block, then one pass over that key's holders:
    /// the candidates still matching are a bitset, and a holder finds its
    /// candidate through a [`SlotIndex`], so a block costs one pass over its
    /// holders whether 8 candidates are still matching or 256.
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
        // Candidate by slot; a slot listed twice is walked once and copied.
        let candidate_of = SlotIndex::new(candidates);
        let mut alive = Bits::new(candidates.len());
        for (i, slot) in candidates.iter().enumerate() {
            if candidate_of.get(*slot) == Some(i) {
                alive.set(i);
            }
        }
        let mut held = Bits::new(candidates.len());
        // Per candidate: held speculatively up to (excluding) this position.
        let mut credited_until: SmallVec<[usize; 16]> = SmallVec::from_elem(0, candidates.len());
        let credits = lock(&self.credits);
        self.with_keys(|map| {
            for (pos, key) in keys.iter().enumerate() {
                held.clear();
                if let Some(holders) = map.and_then(|m| m.get(&(partition, *key))) {
                    for h in holders {
                        let Some(i) = candidate_of.get(h.slot) else {
                            continue;
                        };
                        if !alive.get(i) {
                            continue;
                        }
                        if let (Some(tier), Some(m)) = (best_tier(h.tiers), out.get_mut(i)) {
                            m.push(tier);
                            held.set(i);
                        }
                    }
                }
                // The rest may hold it speculatively.
                for i in alive.and_not(&held) {
                    let (Some(slot), Some(until), Some(m)) =
                        (candidates.get(i), credited_until.get_mut(i), out.get_mut(i))
                    else {
                        alive.unset(i);
                        continue;
                    };
                    if pos >= *until {
                        *until = pos + credits.extend(partition, *slot, keys, pos, now);
                    }
                    if pos < *until {
                        m.push(Tier::Gpu);
                        m.speculative += 1;
                    } else {
                        alive.unset(i);
                    }
                }
                if alive.is_empty() {
                    break;
                }
            }
        });
        drop(credits);
        for (i, slot) in candidates.iter().enumerate() {
            let Some(first) = candidate_of.get(*slot) else {
                continue;
            };
            if first != i
                && let Some(m) = out.get(first).copied()
                && let Some(dst) = out.get_mut(i)
            {
                *dst = m;
            }
        }
        out
    }
}

/// No candidate for this slot.
const NONE: u32 = u32::MAX;

/// A slot's candidate (the first listing it). Slots are handed out in
/// order and never reused, so the live ones are usually a dense range: a
/// table over that range. A fleet whose pods come and go leaves gaps (an old
/// replica's slot far below the new ones'): a hash map then.
enum SlotIndex {
    Dense { first: u32, table: Vec<u32> },
    Sparse(FastMap<u32, u32>),
}

impl SlotIndex {
    fn new(candidates: &[ReplicaSlot]) -> Self {
        let lo = candidates.iter().map(|s| s.0).min().unwrap_or(0);
        let hi = candidates.iter().map(|s| s.0).max().unwrap_or(0);
        let span = (hi - lo) as usize + 1;
        if span <= 4 * candidates.len() + 256 {
            let mut table = vec![NONE; span];
            for (i, slot) in candidates.iter().enumerate() {
                if let Some(c) = table.get_mut((slot.0 - lo) as usize)
                    && *c == NONE
                {
                    *c = i as u32;
                }
            }
            Self::Dense { first: lo, table }
        } else {
            let mut map = FastMap::default();
            for (i, slot) in candidates.iter().enumerate() {
                map.entry(slot.0).or_insert(i as u32);
            }
            Self::Sparse(map)
        }
    }

    fn get(&self, slot: ReplicaSlot) -> Option<usize> {
        let i = match self {
            Self::Dense { first, table } => *table.get(slot.0.checked_sub(*first)? as usize)?,
            Self::Sparse(map) => *map.get(&slot.0)?,
        };
        (i != NONE).then_some(i as usize)
    }
}

/// A set of candidate indices.
struct Bits(SmallVec<[u64; 4]>);

impl Bits {
    fn new(n: usize) -> Self {
        Self(SmallVec::from_elem(0, n.div_ceil(64)))
    }

    fn set(&mut self, i: usize) {
        if let Some(w) = self.0.get_mut(i / 64) {
            *w |= 1 << (i % 64);
        }
    }

    fn unset(&mut self, i: usize) {
        if let Some(w) = self.0.get_mut(i / 64) {
            *w &= !(1 << (i % 64));
        }
    }

    fn get(&self, i: usize) -> bool {
        self.0.get(i / 64).is_some_and(|w| w & (1 << (i % 64)) != 0)
    }

    fn clear(&mut self) {
        self.0.iter_mut().for_each(|w| *w = 0);
    }

    fn is_empty(&self) -> bool {
        self.0.iter().all(|w| *w == 0)
    }

    /// The members of `self` not in `other`, as a list (the caller changes
    /// `self` while going through it).
    fn and_not(&self, other: &Self) -> SmallVec<[usize; 16]> {
        let mut list = SmallVec::new();
        for (at, (a, b)) in self.0.iter().zip(&other.0).enumerate() {
            let mut w = a & !b;
            while w != 0 {
                list.push(at * 64 + w.trailing_zeros() as usize);
                w &= w - 1;
            }
        }
        list
    }
}
