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
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use kvroute_proto::keys::BlockKey;
use smallvec::SmallVec;

use super::PrefixMatch;
use super::layout::{Layout, Rule};
use super::store::{MASK_IDS, PARTITION_BITS, Store};
use crate::credits::Credits;
use crate::event::Tier;
use crate::ids::{PartitionId, ReplicaSlot};
use crate::sync::{lock, read, write};

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

    /// [`Lookup::match_prefix`] on a held store guard: the leading run of
    /// each candidate in `plane` (keys of `partition` keyed in one of its
    /// KV cache groups), credit read under `partition`.
    fn walk_leading(
        &self,
        store: &Store,
        plane: PartitionId,
        partition: PartitionId,
        keys: &[BlockKey],
        candidates: &[ReplicaSlot],
        now: Instant,
    ) -> Vec<PrefixMatch> {
        let out = vec![PrefixMatch::default(); candidates.len()];
        let Ok(part) = u16::try_from(plane.get()) else {
            return out;
        };
        let n = candidates.len();
        let mut alive = Bits::new(n);
        let mut held = Bits::new(n);
        // Per candidate: held speculatively up to (excluding) this position.
        let mut credited_until: SmallVec<[usize; 16]> = SmallVec::from_elem(0, n);
        // Per candidate: blocks by best tier (GPU, CPU, storage), then
        // speculative ones (counted as GPU too).
        let mut counts: SmallVec<[[u32; 4]; 16]> = SmallVec::from_elem([0; 4], n);
        // Candidate by local id, while it still matches (`NONE` once it
        // stops); a slot listed twice is walked once and copied. A replica
        // the index has never seen holds nothing indexed but may hold
        // credit.
        let mut live: SmallVec<[u32; 64]> = SmallVec::new();
        let mut local_of: SmallVec<[u32; 16]> = SmallVec::from_elem(NONE, n);
        let mut first_of: SmallVec<[u32; 16]> = SmallVec::from_elem(NONE, n);
        let mut alive_n = 0usize;
        for (i, slot) in candidates.iter().enumerate() {
            let first = match store.locals.get(slot) {
                Some(&local) => {
                    let local = usize::from(local);
                    if live.len() <= local {
                        live.resize(local + 1, NONE);
                    }
                    match live.get_mut(local) {
                        Some(c) if *c == NONE => {
                            *c = i as u32;
                            if let Some(l) = local_of.get_mut(i) {
                                *l = local as u32;
                            }
                            i as u32
                        }
                        Some(c) => *c,
                        None => NONE,
                    }
                }
                None => candidates
                    .iter()
                    .position(|s| s == slot)
                    .map_or(NONE, |f| f as u32),
            };
            if let Some(f) = first_of.get_mut(i) {
                *f = first;
            }
            if first == i as u32 {
                alive.set(i);
                alive_n += 1;
            }
        }
        let credits = lock(&self.credits);
        // At most 64 replicas' worth of local ids among the candidates: the
        // walk by masks.
        let narrow = local_of
            .iter()
            .zip(&first_of)
            .enumerate()
            .all(|(i, (l, f))| *f != i as u32 || *l < u32::from(MASK_IDS) || *l == NONE);
        if narrow {
            let mut spec = Speculation {
                credits: &credits,
                partition,
                keys,
                now,
                candidates,
                until: &mut credited_until,
            };
            walk_masks(
                store,
                part,
                keys,
                &local_of,
                &first_of,
                &mut spec,
                &mut counts,
            );
            drop(credits);
            return finish(out, &counts, &first_of);
        }
        // Plain slices for the walk (a `SmallVec` checks where its items are
        // on every access).
        let live = live.as_mut_slice();
        let counts = counts.as_mut_slice();
        let held = held.0.as_mut_slice();
        for (pos, key) in keys.iter().enumerate() {
            held.fill(0);
            let mut held_n = 0;
            store.for_each_holder((part, key.as_u64()), |replica, tiers| {
                let Some(&i) = live.get(usize::from(replica)) else {
                    return;
                };
                let tier = BEST_TIER[usize::from(tiers & 0b111)];
                if let Some(c) = counts.get_mut(i as usize)
                    && let Some(c) = c.get_mut(usize::from(tier))
                    && let Some(w) = held.get_mut(i as usize / 64)
                {
                    *c += 1;
                    *w |= 1 << (i % 64);
                    held_n += 1;
                }
            });
            if held_n < alive_n {
                // The rest may hold it speculatively.
                for i in alive.and_not(held) {
                    let (Some(slot), Some(until), Some(c)) = (
                        candidates.get(i),
                        credited_until.get_mut(i),
                        counts.get_mut(i),
                    ) else {
                        continue;
                    };
                    if pos >= *until {
                        *until = pos + credits.extend(partition, *slot, keys, pos, now);
                    }
                    if pos < *until {
                        c[0] += 1;
                        c[3] += 1;
                        continue;
                    }
                    alive.unset(i);
                    alive_n -= 1;
                    if let Some(l) = local_of.get(i)
                        && let Some(c) = live.get_mut(*l as usize)
                    {
                        *c = NONE;
                    }
                }
            }
            if alive_n == 0 {
                break;
            }
        }
        drop(credits);
        finish(out, counts, &first_of)
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

/// Per candidate, its counts as a [`PrefixMatch`]; a slot listed twice
/// copies its first listing's.
fn finish(mut out: Vec<PrefixMatch>, counts: &[[u32; 4]], first_of: &[u32]) -> Vec<PrefixMatch> {
    for (m, c) in out.iter_mut().zip(counts.iter()) {
        let [gpu, cpu, storage, speculative] = *c;
        *m = PrefixMatch {
            blocks: gpu + cpu + storage,
            per_tier: [gpu, cpu, storage],
            speculative,
            unmodelled: false,
        };
    }
    for (i, first) in first_of.iter().enumerate() {
        let first = *first as usize;
        if first != i
            && let Some(m) = out.get(first).copied()
            && let Some(dst) = out.get_mut(i)
        {
            *dst = m;
        }
    }
    out
}

/// What a candidate that does not hold a key may still hold: credit.
struct Speculation<'a> {
    credits: &'a Credits,
    partition: PartitionId,
    keys: &'a [BlockKey],
    now: Instant,
    candidates: &'a [ReplicaSlot],
    /// Per candidate: credited up to (excluding) this position.
    until: &'a mut [usize],
}

impl Speculation<'_> {
    /// Whether candidate `i` holds the key at `pos` speculatively.
    fn holds(&mut self, i: usize, pos: usize) -> bool {
        let (Some(slot), Some(until)) = (self.candidates.get(i), self.until.get_mut(i)) else {
            return false;
        };
        if pos >= *until {
            *until = pos
                + self
                    .credits
                    .extend(self.partition, *slot, self.keys, pos, self.now);
        }
        pos < *until
    }
}

/// Bit-sliced counters, one per local id below 64: plane `j` holds bit `j`
/// of every counter, so adding a mask is a ripple carry (two steps on
/// average) whatever the number of bits set.
struct Counters([u64; 32]);

impl Counters {
    /// Adds `times` to every counter whose bit `mask` sets: plane by plane
    /// of `times`, a ripple carry from that plane up.
    fn add_times(&mut self, mask: u64, times: u32) {
        if mask == 0 {
            return;
        }
        let mut rest = times;
        while rest != 0 {
            let from = rest.trailing_zeros() as usize;
            rest &= rest - 1;
            let mut carry = mask;
            for plane in self.0.iter_mut().skip(from) {
                if carry == 0 {
                    break;
                }
                let next = *plane & carry;
                *plane ^= carry;
                carry = next;
            }
        }
    }

    /// The counter of `bit`, from its lowest `planes` planes (the higher
    /// ones are zero when no counter reaches `1 << planes`).
    fn get(&self, bit: u32, planes: usize) -> u32 {
        self.0
            .iter()
            .take(planes)
            .enumerate()
            .map(|(j, plane)| ((plane >> bit) as u32 & 1) << j)
            .sum()
    }
}

/// The walk when every candidate's local id is below 64: per key, the
/// holders' masks by best tier (one read: an entry's bit, or a group's
/// masks) against the candidates still matching, added to bit-sliced
/// counters; a candidate's list of holders is never walked.
fn walk_masks(
    store: &Store,
    part: u16,
    keys: &[BlockKey],
    local_of: &[u32],
    first_of: &[u32],
    spec: &mut Speculation<'_>,
    counts: &mut [[u32; 4]],
) {
    let mut candidate_of = [NONE; MASK_IDS as usize];
    let mut alive = 0u64;
    // Candidates the index has never seen: they may hold credit only.
    let mut unseen: SmallVec<[usize; 4]> = SmallVec::new();
    for (i, (l, f)) in local_of.iter().zip(first_of).enumerate() {
        if *f != i as u32 {
            continue;
        }
        match candidate_of.get_mut(*l as usize) {
            Some(c) => {
                *c = i as u32;
                alive |= 1 << l;
            }
            None => unseen.push(i),
        }
    }
    let mut tiers = [Counters([0; 32]), Counters([0; 32]), Counters([0; 32])];
    // Consecutive keys held alike (the same candidates, in the same tiers:
    // most of a prompt) are counted once per run, not once per key.
    // (Scalars, not an array: comparing a just-stored array as a whole
    // stalls on store forwarding.)
    let (mut run_gpu, mut run_cpu, mut run_storage) = (0u64, 0u64, 0u64);
    let mut run_len = 0u32;
    for (pos, key) in keys.iter().enumerate() {
        let [gpu, cpu, storage] = store.holder_masks((part, key.as_u64()));
        let (gpu, cpu, storage) = (gpu & alive, cpu & alive, storage & alive);
        if (gpu ^ run_gpu) | (cpu ^ run_cpu) | (storage ^ run_storage) != 0 {
            for (counter, mask) in tiers.iter_mut().zip([run_gpu, run_cpu, run_storage]) {
                counter.add_times(mask, run_len);
            }
            (run_gpu, run_cpu, run_storage) = (gpu, cpu, storage);
            run_len = 0;
        }
        run_len += 1;
        let held = gpu | cpu | storage;
        let mut missing = alive & !held;
        while missing != 0 {
            let bit = missing.trailing_zeros();
            missing &= missing - 1;
            let i = candidate_of.get(bit as usize).map_or(NONE, |c| *c) as usize;
            if spec.holds(i, pos)
                && let Some(c) = counts.get_mut(i)
            {
                c[0] += 1;
                c[3] += 1;
            } else {
                alive &= !(1 << bit);
            }
        }
        if !unseen.is_empty() {
            unseen.retain(|i| {
                let credited = spec.holds(*i, pos);
                if credited && let Some(c) = counts.get_mut(*i) {
                    c[0] += 1;
                    c[3] += 1;
                }
                credited
            });
        }
        if alive == 0 && unseen.is_empty() {
            break;
        }
    }
    for (counter, mask) in tiers.iter_mut().zip([run_gpu, run_cpu, run_storage]) {
        counter.add_times(mask, run_len);
    }
    // No counter exceeds the number of keys: planes above its bit length
    // are zero.
    let planes = (usize::BITS - keys.len().leading_zeros()) as usize;
    for (bit, i) in candidate_of.iter().enumerate() {
        if let Some(c) = counts.get_mut(*i as usize) {
            for (t, counter) in tiers.iter().enumerate() {
                if let Some(n) = c.get_mut(t) {
                    *n += counter.get(bit as u32, planes);
                }
            }
        }
    }
}

/// No candidate for this local id.
const NONE: u32 = u32::MAX;

/// A tier mask's best tier, as an index into a candidate's counts (masks
/// without a tier have none: the walk skips them).
const BEST_TIER: [u8; 8] = [
    u8::MAX,
    Tier::Gpu as u8,
    Tier::Cpu as u8,
    Tier::Gpu as u8,
    Tier::Storage as u8,
    Tier::Gpu as u8,
    Tier::Cpu as u8,
    Tier::Gpu as u8,
];

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

    /// The members of `self` not in `other`, as a list (the caller changes
    /// `self` while going through it).
    fn and_not(&self, other: &[u64]) -> SmallVec<[usize; 16]> {
        let mut list = SmallVec::new();
        for (at, (a, b)) in self.0.iter().zip(other).enumerate() {
            let mut w = a & !b;
            while w != 0 {
                list.push(at * 64 + w.trailing_zeros() as usize);
                w &= w - 1;
            }
        }
        list
    }
}
