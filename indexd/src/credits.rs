//! Credits: runs of block keys attributed to a replica for a while, without
//! engine hashes — the speculative entries after a pick (before its events
//! arrive) and the approximate mode's keys learned from picks.
//!
//! A pick that leaves the chosen replica short of the request's keys credits
//! it with the whole run, as one record `(slot, keys, expiry)` filed under
//! `(partition, first key, slot)`. Keys are chained: if a later request's key
//! at position `i` equals the record's, everything before `i` is shared too,
//! so a prefix walk that the index stops at `i` (events not arrived yet, or
//! only partly) resumes on the record with one comparison and then extends
//! over the common run. Inserting costs one map entry per pick, not one per
//! key. Bounded by the total of credited keys (oldest records out first) and
//! by records per `(first key, replica)`.

use std::collections::VecDeque;
use std::time::Instant;

use kvroute_proto::keys::BlockKey;
use smallvec::SmallVec;

use crate::ids::FastMap;
use crate::ids::{PartitionId, ReplicaSlot};

/// Records filed under one first key (oldest dropped beyond this).
const MAX_PER_START: usize = 64;

type Start = (PartitionId, BlockKey, ReplicaSlot);

#[derive(Debug)]
struct Record {
    partition: PartitionId,
    slot: ReplicaSlot,
    expires: Instant,
    keys: Box<[BlockKey]>,
}

/// The credit store. See the module docs.
#[derive(Debug)]
pub struct Credits {
    records: FastMap<u64, Record>,
    by_start: FastMap<Start, SmallVec<[u64; 2]>>,
    order: VecDeque<u64>,
    next_id: u64,
    keys: usize,
    max_keys: usize,
}

impl Credits {
    /// An empty store crediting at most `max_keys` keys in total.
    pub fn new(max_keys: usize) -> Self {
        Self {
            records: FastMap::default(),
            by_start: FastMap::default(),
            order: VecDeque::new(),
            next_id: 0,
            keys: 0,
            max_keys,
        }
    }

    /// Keys credited (expired ones until pruned).
    pub fn len(&self) -> usize {
        self.keys
    }

    /// True when nothing is credited.
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.keys == 0
    }

    /// An estimate of the heap bytes held.
    pub fn approx_bytes(&self) -> usize {
        use std::mem::size_of;
        self.records.capacity() * (size_of::<u64>() + size_of::<Record>() + 1)
            + self.keys * size_of::<BlockKey>()
            + self.by_start.capacity() * (size_of::<Start>() + size_of::<SmallVec<[u64; 2]>>() + 1)
            + self.order.capacity() * size_of::<u64>()
    }

    /// Credits `slot` with the run `keys` until `expires`.
    pub fn credit(
        &mut self,
        partition: PartitionId,
        keys: &[BlockKey],
        slot: ReplicaSlot,
        now: Instant,
        expires: Instant,
    ) {
        self.prune(now);
        let keys = keys
            .get(..keys.len().min(self.max_keys))
            .unwrap_or_default();
        let Some(first) = keys.first() else {
            return;
        };
        let id = self.next_id;
        self.next_id += 1;
        let ids = self.by_start.entry((partition, *first, slot)).or_default();
        ids.push(id);
        let crowded = (ids.len() > MAX_PER_START)
            .then(|| ids.first().copied())
            .flatten();
        self.records.insert(
            id,
            Record {
                partition,
                slot,
                expires,
                keys: keys.into(),
            },
        );
        self.keys += keys.len();
        self.order.push_back(id);
        if let Some(oldest) = crowded {
            self.remove(oldest);
        }
        while self.keys > self.max_keys {
            let Some(oldest) = self.order.pop_front() else {
                break;
            };
            self.remove(oldest);
        }
        if self.order.len() > 2 * self.records.len() + 1024 {
            let records = &self.records;
            self.order.retain(|id| records.contains_key(id));
        }
    }

    /// How many of `keys` from position `pos` on are credited to `slot`
    /// (0 if none). `keys` is the request's whole run.
    pub fn extend(
        &self,
        partition: PartitionId,
        slot: ReplicaSlot,
        keys: &[BlockKey],
        pos: usize,
        now: Instant,
    ) -> usize {
        let (Some(first), Some(at)) = (keys.first(), keys.get(pos)) else {
            return 0;
        };
        let Some(ids) = self.by_start.get(&(partition, *first, slot)) else {
            return 0;
        };
        let rest = keys.get(pos..).unwrap_or_default();
        ids.iter()
            .filter_map(|id| self.records.get(id))
            .filter(|r| r.expires > now && r.keys.get(pos) == Some(at))
            .map(|r| {
                let tail = r.keys.get(pos..).unwrap_or_default();
                tail.iter().zip(rest).take_while(|(a, b)| a == b).count()
            })
            .max()
            .unwrap_or(0)
    }

    /// Leading `keys` credited to `slot`, and where the credited prompts
    /// that `keys` contain whole end (a prompt's last blocks are where a
    /// sliding-window or Mamba group keeps what a later hit needs).
    pub fn run_and_ends(
        &self,
        partition: PartitionId,
        slot: ReplicaSlot,
        keys: &[BlockKey],
        now: Instant,
    ) -> (usize, SmallVec<[usize; 4]>) {
        let mut ends = SmallVec::new();
        let Some(first) = keys.first() else {
            return (0, ends);
        };
        let Some(ids) = self.by_start.get(&(partition, *first, slot)) else {
            return (0, ends);
        };
        let mut run = 0;
        for r in ids.iter().filter_map(|id| self.records.get(id)) {
            if r.expires <= now {
                continue;
            }
            let common = r.keys.iter().zip(keys).take_while(|(a, b)| a == b).count();
            run = run.max(common);
            if common == r.keys.len() && !ends.contains(&common) {
                ends.push(common);
            }
        }
        (run, ends)
    }

    /// Leading `keys` credited to `slot`.
    pub fn run(
        &self,
        partition: PartitionId,
        slot: ReplicaSlot,
        keys: &[BlockKey],
        now: Instant,
    ) -> usize {
        self.extend(partition, slot, keys, 0, now)
    }

    /// Drops records expired at `now` (they expire in insertion order when
    /// the TTL is fixed; a later-expiring record stops the sweep).
    pub fn prune(&mut self, now: Instant) {
        while let Some(id) = self.order.front().copied() {
            match self.records.get(&id) {
                Some(r) if r.expires > now => break,
                _ => {
                    self.order.pop_front();
                    self.remove(id);
                }
            }
        }
    }

    fn remove(&mut self, id: u64) {
        let Some(r) = self.records.remove(&id) else {
            return;
        };
        self.keys = self.keys.saturating_sub(r.keys.len());
        if let Some(first) = r.keys.first() {
            let start = (r.partition, *first, r.slot);
            if let Some(ids) = self.by_start.get_mut(&start) {
                ids.retain(|x| *x != id);
                if ids.is_empty() {
                    self.by_start.remove(&start);
                }
            }
        }
    }

    /// Forgets every credit of `slot`.
    pub fn forget_replica(&mut self, slot: ReplicaSlot) {
        let ids: Vec<u64> = self
            .records
            .iter()
            .filter(|(_, r)| r.slot == slot)
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            self.remove(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn k(v: &[u64]) -> Vec<BlockKey> {
        v.iter().map(|x| BlockKey::from_u64(*x)).collect()
    }

    #[test]
    fn runs_extend_over_the_common_prefix_and_expire() {
        let now = Instant::now();
        let later = now + Duration::from_secs(5);
        let (p, a, b) = (PartitionId::new(0), ReplicaSlot(0), ReplicaSlot(1));
        let mut c = Credits::new(100);
        c.credit(p, &k(&[1, 2, 3, 4]), a, now, later);
        assert_eq!(c.extend(p, a, &k(&[1, 2, 9]), 0, now), 2);
        // Resuming mid-run (the index held the first two).
        assert_eq!(c.extend(p, a, &k(&[1, 2, 3, 4, 5]), 2, now), 2);
        assert_eq!(
            c.extend(p, a, &k(&[1, 7, 9]), 2, now),
            0,
            "a different key at pos"
        );
        assert_eq!(c.extend(p, a, &k(&[2, 3]), 0, now), 0, "another first key");
        assert_eq!(c.extend(p, b, &k(&[1, 2]), 0, now), 0);
        assert_eq!(c.extend(PartitionId::new(1), a, &k(&[1]), 0, now), 0);
        c.credit(p, &k(&[1, 2, 3, 4, 5, 6]), a, now, later);
        assert_eq!(
            c.run(p, a, &k(&[1, 2, 3, 4, 5, 6, 7]), now),
            6,
            "the longest record wins"
        );
        assert_eq!(c.extend(p, a, &k(&[1]), 0, later), 0);
        c.prune(later);
        assert!(c.is_empty());
    }

    #[test]
    fn bounded_by_total_keys_and_records_per_start() {
        let now = Instant::now();
        let exp = now + Duration::from_secs(5);
        let p = PartitionId::new(0);
        let mut c = Credits::new(10);
        c.credit(p, &k(&[1, 2, 3, 4, 5, 6]), ReplicaSlot(0), now, exp);
        c.credit(p, &k(&[7, 8, 9, 10, 11, 12]), ReplicaSlot(0), now, exp);
        assert!(c.len() <= 10);
        assert_eq!(
            c.extend(p, ReplicaSlot(0), &k(&[1]), 0, now),
            0,
            "oldest evicted"
        );
        assert_eq!(c.extend(p, ReplicaSlot(0), &k(&[7, 8]), 0, now), 2);
        c.credit(
            p,
            &k(&(0..50).collect::<Vec<_>>()),
            ReplicaSlot(1),
            now,
            exp,
        );
        assert_eq!(c.len(), 10, "a long run is truncated to the bound");
        let mut c = Credits::new(1000);
        for i in 0..(MAX_PER_START as u64 + 3) {
            c.credit(p, &k(&[99, i]), ReplicaSlot(2), now, exp);
        }
        let start = (p, BlockKey::from_u64(99), ReplicaSlot(2));
        assert_eq!(c.by_start.get(&start).unwrap().len(), MAX_PER_START);
        assert_eq!(
            c.extend(p, ReplicaSlot(2), &k(&[99, 0]), 0, now),
            1,
            "the oldest of the crowd went"
        );
        assert_eq!(c.extend(p, ReplicaSlot(2), &k(&[99, 5]), 0, now), 2);
        c.forget_replica(ReplicaSlot(2));
        assert!(c.is_empty());
    }
}
