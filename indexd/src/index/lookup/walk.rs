//! The walk of one plane's keys for a Pick ([`Lookup`]'s `walk_leading`):
//! each candidate's leading run of held (or credited) blocks, by tier, read
//! under the store's read lock. When every candidate's local id is below 64
//! the holders' masks feed bit-sliced counters ([`walk_masks`]); otherwise
//! candidates still matching are tracked as a bit set ([`Bits`]).

use std::time::Instant;

use kvroute_proto::keys::BlockKey;
use smallvec::SmallVec;

use super::super::PrefixMatch;
use super::super::store::{MASK_IDS, Store};
use super::Lookup;
use crate::credits::Credits;
use crate::event::Tier;
use crate::ids::{PartitionId, ReplicaSlot};
use crate::sync::lock;

impl Lookup {
    /// [`Lookup::match_prefix`] on a held store guard: the leading run of
    /// each candidate in `plane` (keys of `partition` keyed in one of its
    /// KV cache groups), credit read under `partition`.
    pub(super) fn walk_leading(
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
        let mut w = Walkers::of(store, candidates);
        // Per candidate: held speculatively up to (excluding) this position.
        let mut credited_until: SmallVec<[usize; 16]> = SmallVec::from_elem(0, n);
        // Per candidate: blocks by best tier (GPU, CPU, storage), then
        // speculative ones (counted as GPU too).
        let mut counts: SmallVec<[[u32; 4]; 16]> = SmallVec::from_elem([0; 4], n);
        let credits = lock(&self.credits);
        let mut spec = Speculation {
            credits: &credits,
            partition,
            keys,
            now,
            candidates,
            until: &mut credited_until,
        };
        // At most 64 replicas' worth of local ids among the candidates: the
        // walk by masks.
        let narrow = w
            .local_of
            .iter()
            .zip(&w.first_of)
            .enumerate()
            .all(|(i, (l, f))| *f != i as u32 || *l < u32::from(MASK_IDS) || *l == NONE);
        if narrow {
            walk_masks(
                store,
                part,
                keys,
                &w.local_of,
                &w.first_of,
                &mut spec,
                &mut counts,
            );
        } else {
            walk_bits(store, part, keys, &mut w, &mut spec, &mut counts);
        }
        drop(credits);
        finish(out, &counts, &w.first_of)
    }
}

/// The walk when some candidate's local id is 64 or more: per key, each
/// holder's best tier counted for the candidates still matching, then the
/// ones that do not hold it tried for credit; a candidate with neither stops.
fn walk_bits(
    store: &Store,
    part: u16,
    keys: &[BlockKey],
    w: &mut Walkers,
    spec: &mut Speculation<'_>,
    counts: &mut [[u32; 4]],
) {
    // Plain slices for the walk (a `SmallVec` checks where its items are
    // on every access).
    let live = w.live.as_mut_slice();
    let mut held = Bits::new(counts.len());
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
        if held_n < w.alive_n {
            // The rest may hold it speculatively.
            for i in w.alive.and_not(held) {
                let Some(c) = counts.get_mut(i) else {
                    continue;
                };
                if spec.holds(i, pos) {
                    c[0] += 1;
                    c[3] += 1;
                    continue;
                }
                w.alive.unset(i);
                w.alive_n -= 1;
                if let Some(l) = w.local_of.get(i)
                    && let Some(c) = live.get_mut(*l as usize)
                {
                    *c = NONE;
                }
            }
        }
        if w.alive_n == 0 {
            break;
        }
    }
}

/// The candidates of a walk by local id. A slot listed twice is walked once
/// and copied; a replica the index has never seen holds nothing indexed but
/// may hold credit.
struct Walkers {
    /// Candidate by local id, while it still matches (`NONE` once it stops).
    live: SmallVec<[u32; 64]>,
    /// Per candidate, its local id (`NONE`: none, or listed before).
    local_of: SmallVec<[u32; 16]>,
    /// Per candidate, the index of its slot's first listing.
    first_of: SmallVec<[u32; 16]>,
    /// The candidates still matching (first listings only).
    alive: Bits,
    /// How many.
    alive_n: usize,
}

impl Walkers {
    fn of(store: &Store, candidates: &[ReplicaSlot]) -> Self {
        let n = candidates.len();
        let mut w = Self {
            live: SmallVec::new(),
            local_of: SmallVec::from_elem(NONE, n),
            first_of: SmallVec::from_elem(NONE, n),
            alive: Bits::new(n),
            alive_n: 0,
        };
        for (i, slot) in candidates.iter().enumerate() {
            let first = match store.locals.get(slot) {
                Some(&local) => {
                    let local = usize::from(local);
                    if w.live.len() <= local {
                        w.live.resize(local + 1, NONE);
                    }
                    match w.live.get_mut(local) {
                        Some(c) if *c == NONE => {
                            *c = i as u32;
                            if let Some(l) = w.local_of.get_mut(i) {
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
            if let Some(f) = w.first_of.get_mut(i) {
                *f = first;
            }
            if first == i as u32 {
                w.alive.set(i);
                w.alive_n += 1;
            }
        }
        w
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
