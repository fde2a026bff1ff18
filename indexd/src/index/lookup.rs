//! What a Pick reads: the index's one copy ([`Store`], under a read lock),
//! the partition names and the speculative credits.
//!
//! - the index: a `parking_lot` read lock for the walk. The index takes the
//!   write lock only to apply a batch at its publish, and yields it to
//!   waiting Picks after every block or event (`bump`), so a Pick waits for
//!   one block's changes, not a batch (see the parent module's docs).
//! - partitions: an `RwLock` written only when a model or adapter name, or
//!   a KV cache group of one, is seen for the first time (a map insert),
//!   read once per Pick.
//!
//! A partition's KV cache groups other than group 0 each have a plane: a
//! partition id of their own, under which their blocks are keyed. A model
//! with one group has no plane but its partition.
//! - credits: a `Mutex` taken by Picks (walk, then credit) and by a purge of
//!   the index (dropping a replica's credit).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use kvroute_proto::keys::BlockKey;
use smallvec::SmallVec;

use super::PrefixMatch;
use super::layout::{Layout, Rule};
use super::store::{PARTITION_BITS, Store};
use crate::credits::Credits;
use crate::ids::{PartitionId, ReplicaSlot};
use crate::sync::{lock, read, write};

mod walk;

/// Partitions at most (their ids are packed in 12 bits).
const MAX_PARTITIONS: usize = 1 << PARTITION_BITS;

/// Partition and plane ids: one space of at most [`MAX_PARTITIONS`].
#[derive(Debug, Default)]
struct Partitions {
    by_name: HashMap<String, PartitionId>,
    /// `(partition, group ≥ 1) → plane`.
    planes: HashMap<(PartitionId, u32), PartitionId>,
    /// By id: the partition and group it keys (a partition's own: group 0).
    of: Vec<(PartitionId, u32)>,
}

/// The read side of the index. See the module docs.
pub struct Lookup {
    store: Arc<parking_lot::RwLock<Store>>,
    partitions: RwLock<Partitions>,
    max_partitions: usize,
    credits: Mutex<Credits>,
    /// Speculative credits given so far ([`Lookup::speculated`]).
    speculated: AtomicU64,
}

impl std::fmt::Debug for Lookup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lookup")
            .field("partitions", &read(&self.partitions).of.len())
            .field("credits", &lock(&self.credits).len())
            .finish_non_exhaustive()
    }
}

/// What a Pick asks of the index.
#[derive(Clone, Copy, Debug)]
pub struct Query<'a> {
    /// The request's partition (`None`: never seen, nothing held).
    pub partition: Option<PartitionId>,
    /// Its block keys.
    pub keys: &'a [BlockKey],
    /// Their block size in tokens.
    pub block_size: u32,
    /// The longest hit vLLM can give it, in blocks: its prompt tokens less
    /// one (the last is always computed), in full blocks.
    pub max_blocks: usize,
    /// The chunk of the model's chunked local attention in tokens, when
    /// configured.
    pub chunk_tokens: Option<u32>,
    /// The time speculative credit is read at.
    pub now: Instant,
}

impl Lookup {
    pub(super) fn new(store: Arc<parking_lot::RwLock<Store>>, max_speculative: usize) -> Self {
        Self {
            store,
            partitions: RwLock::new(Partitions::default()),
            max_partitions: MAX_PARTITIONS,
            credits: Mutex::new(Credits::new(max_speculative)),
            speculated: AtomicU64::new(0),
        }
    }

    /// The partition of `model`, if any event or pick has named it.
    pub fn partition(&self, model: &str) -> Option<PartitionId> {
        read(&self.partitions).by_name.get(model).copied()
    }

    /// The partition of `model`, created on first use (`None` once the
    /// partition table is full).
    pub fn partition_or_insert(&self, model: &str) -> Option<PartitionId> {
        if let Some(p) = self.partition(model) {
            return Some(p);
        }
        let mut partitions = write(&self.partitions);
        if let Some(p) = partitions.by_name.get(model) {
            return Some(*p);
        }
        let id = self.next_id(&partitions)?;
        partitions.by_name.insert(model.to_owned(), id);
        partitions.of.push((id, 0));
        Some(id)
    }

    fn next_id(&self, partitions: &Partitions) -> Option<PartitionId> {
        if partitions.of.len() >= self.max_partitions {
            return None;
        }
        Some(PartitionId::new(u32::try_from(partitions.of.len()).ok()?))
    }

    /// The plane of `partition`'s KV cache group `group` (the partition
    /// itself for group 0), if created.
    pub fn plane(&self, partition: PartitionId, group: u32) -> Option<PartitionId> {
        if group == 0 {
            return Some(partition);
        }
        read(&self.partitions)
            .planes
            .get(&(partition, group))
            .copied()
    }

    /// The plane of `partition`'s group `group`, created on first use
    /// (`None` once the table is full).
    pub(super) fn plane_or_insert(
        &self,
        partition: PartitionId,
        group: u32,
    ) -> Option<PartitionId> {
        if let Some(p) = self.plane(partition, group) {
            return Some(p);
        }
        let mut partitions = write(&self.partitions);
        if let Some(p) = partitions.planes.get(&(partition, group)) {
            return Some(*p);
        }
        let id = self.next_id(&partitions)?;
        partitions.planes.insert((partition, group), id);
        partitions.of.push((partition, group));
        Some(id)
    }

    /// The partition and group a plane keys.
    pub(crate) fn plane_of(&self, plane: PartitionId) -> Option<(PartitionId, u32)> {
        read(&self.partitions).of.get(plane.get() as usize).copied()
    }

    /// The name of a partition (`None` for a group's plane).
    pub(crate) fn partition_name(&self, id: PartitionId) -> Option<String> {
        read(&self.partitions)
            .by_name
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
        self.speculated.fetch_add(1, Ordering::AcqRel);
    }

    /// How many speculative credits were given so far: a match taken when
    /// this read `n` may lack every credit given since, once it reads more.
    pub fn speculated(&self) -> u64 {
        self.speculated.load(Ordering::Acquire)
    }

    /// Walks `keys` in order and returns, per candidate, the leading blocks
    /// it holds (indexed or speculative, unexpired at `now`). Stops at the
    /// first block no candidate still matching holds. For replicas of a
    /// hybrid model see [`Lookup::match_query`].
    pub fn match_prefix(
        &self,
        partition: Option<PartitionId>,
        keys: &[BlockKey],
        candidates: &[ReplicaSlot],
        now: Instant,
    ) -> Vec<PrefixMatch> {
        let Some(partition) = partition else {
            return vec![PrefixMatch::default(); candidates.len()];
        };
        let store = self.store.read();
        self.walk_leading(&store, partition, partition, keys, candidates, now)
    }

    /// What each candidate will get of the query's keys from its cache:
    /// for a model with one full-attention group the leading run held; for
    /// a hybrid model vLLM's hit over its KV cache groups ([`Plan::hit`]):
    /// the leading run of its full-attention group, then the bound each
    /// other group accepts. Candidates are grouped by their layout.
    pub fn match_query(&self, q: &Query<'_>, candidates: &[ReplicaSlot]) -> Vec<PrefixMatch> {
        let mut out = vec![PrefixMatch::default(); candidates.len()];
        let Some(partition) = q.partition else {
            return out;
        };
        let store = self.store.read();
        let layouts: SmallVec<[Option<Arc<Layout>>; 16]> = candidates
            .iter()
            .map(|slot| {
                let local = store.locals.get(slot)?;
                store.layout(*local).filter(|l| !l.is_plain()).cloned()
            })
            .collect();
        if layouts.iter().all(Option::is_none) {
            return self.walk_leading(&store, partition, partition, q.keys, candidates, q.now);
        }
        // The candidates of one layout at a time (a fleet has one, or two
        // while it rolls out another model).
        let mut done: SmallVec<[bool; 16]> = SmallVec::from_elem(false, candidates.len());
        for i in 0..candidates.len() {
            if done.get(i).copied().unwrap_or(true) {
                continue;
            }
            let layout = layouts.get(i).cloned().flatten();
            let members: SmallVec<[usize; 16]> = (i..candidates.len())
                .filter(|j| {
                    !done.get(*j).copied().unwrap_or(true)
                        && layouts.get(*j).map(|l| l.as_deref()) == Some(layout.as_deref())
                })
                .collect();
            let slots: SmallVec<[ReplicaSlot; 16]> = members
                .iter()
                .filter_map(|j| candidates.get(*j).copied())
                .collect();
            let matches = match &layout {
                None => self.walk_leading(&store, partition, partition, q.keys, &slots, q.now),
                Some(layout) => self.hybrid(&store, q, partition, layout, &slots),
            };
            for (j, m) in members.iter().zip(matches) {
                if let Some(o) = out.get_mut(*j) {
                    *o = m;
                }
                if let Some(d) = done.get_mut(*j) {
                    *d = true;
                }
            }
        }
        out
    }

    /// The hybrid path of [`Lookup::match_query`] for candidates sharing
    /// `layout`.
    fn hybrid(
        &self,
        store: &Store,
        q: &Query<'_>,
        partition: PartitionId,
        layout: &Layout,
        candidates: &[ReplicaSlot],
    ) -> Vec<PrefixMatch> {
        let (plan, unmodelled) = layout.plan(q.block_size, q.chunk_tokens);
        let unmodelled = unmodelled.is_some();
        let max = q.max_blocks.min(q.keys.len());
        let keys = q.keys.get(..max).unwrap_or_default();
        let planes: SmallVec<[(u32, Option<u16>); 4]> = plan
            .groups
            .iter()
            .map(|(g, _)| {
                let plane = self
                    .plane(partition, *g)
                    .and_then(|p| u16::try_from(p.get()).ok());
                (*g, plane)
            })
            .collect();
        let plane_of = |group: u32| {
            planes
                .iter()
                .find(|(g, _)| *g == group)
                .and_then(|(_, p)| *p)
        };
        let rule_of = |group: u32| {
            plan.groups
                .iter()
                .find(|(g, _)| *g == group)
                .map_or(Rule::Full, |(_, r)| *r)
        };
        // The leading run of the first full-attention group, by the walk
        // every Pick makes (speculative credit included); with none, every
        // block up to the bound.
        let first_full = plan
            .groups
            .iter()
            .find(|(_, r)| *r == Rule::Full)
            .map(|(g, _)| *g);
        let leading = match first_full.map(|g| (g, self.plane(partition, g))) {
            Some((_, Some(plane))) => {
                self.walk_leading(store, plane, partition, keys, candidates, q.now)
            }
            // The group has stored nothing of this partition yet: what
            // picks credited.
            Some((_, None)) => {
                let credits = lock(&self.credits);
                candidates
                    .iter()
                    .map(|slot| {
                        let run = credits.run(partition, *slot, keys, q.now);
                        let run = u32::try_from(run).unwrap_or(u32::MAX);
                        PrefixMatch {
                            blocks: run,
                            per_tier: [run, 0, 0],
                            speculative: run,
                            unmodelled: false,
                        }
                    })
                    .collect()
            }
            None => vec![
                PrefixMatch {
                    blocks: u32::try_from(max).unwrap_or(u32::MAX),
                    per_tier: [u32::try_from(max).unwrap_or(u32::MAX), 0, 0],
                    speculative: 0,
                    unmodelled: false,
                };
                candidates.len()
            ],
        };
        let credits = lock(&self.credits);
        let mut out = Vec::with_capacity(candidates.len());
        for (slot, lead) in candidates.iter().zip(leading) {
            let local = store.locals.get(slot).copied();
            let mut credited: Option<(usize, SmallVec<[usize; 4]>)> = None;
            let mut held = |group: u32, block: u32| -> bool {
                let b = block as usize;
                let (run, ends) = credited
                    .get_or_insert_with(|| credits.run_and_ends(partition, *slot, q.keys, q.now));
                if b < *run && credited_holds(rule_of(group), b, *run, ends) {
                    return true;
                }
                let (Some(local), Some(plane), Some(key)) = (local, plane_of(group), keys.get(b))
                else {
                    return false;
                };
                store.holds((plane, key.as_u64()), local)
            };
            let hit = plan.hit_from(lead.blocks, first_full, &mut held);
            out.push(clip(lead, hit, unmodelled));
        }
        out
    }
}

/// Whether picks' credit stands for block `b` of a group: what vLLM will
/// cache of the prompts they sent there (their events not seen yet). `run`:
/// the request's keys credited from the start; `ends`: where the credited
/// prompts it contains whole end. Full and chunked-local attention keep
/// every block; a sliding window only the tail it needs before a prompt's
/// end (`reachable_block_mask`: a sibling sharing only a prefix of a prompt
/// gets nothing from it there); Mamba the state at the end.
fn credited_holds(rule: Rule, b: usize, run: usize, ends: &[usize]) -> bool {
    match rule {
        Rule::Full | Rule::Chunked { .. } => b < run,
        Rule::Sliding { need } => ends.iter().any(|e| b < *e && b + need as usize >= *e),
        Rule::Mamba => ends.iter().any(|e| b + 1 == *e),
    }
}

/// A hybrid candidate's match: `hit` blocks of its leading run, their tiers
/// taken best first (the walk counts tiers over the whole run), flagged
/// when the layout is not modelled.
fn clip(lead: PrefixMatch, hit: u32, unmodelled: bool) -> PrefixMatch {
    let mut left = hit;
    let mut per_tier = [0; 3];
    for (t, n) in per_tier.iter_mut().zip(lead.per_tier) {
        *t = n.min(left);
        left -= *t;
    }
    // Blocks beyond the walk's run (a layout without full attention) are
    // counted as GPU.
    if let Some(gpu) = per_tier.first_mut() {
        *gpu += left;
    }
    PrefixMatch {
        blocks: hit,
        per_tier,
        speculative: lead.speculative.min(hit),
        unmodelled,
    }
}
