//! Side tables learned from the filter: response-id affinity (Observe) and
//! the approximate mode's text-chunk keys (learned from indexd's own picks).

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use kvroute_proto::keys::BlockKey;

use crate::credits::Credits;
use crate::ids::EndpointId;
use crate::ids::{PartitionId, ReplicaSlot};
use crate::index::PrefixMatch;

/// `response id → (replica, model)`, bounded (oldest insertion out first)
/// with a TTL. The model is the request's (a base model or a LoRA adapter):
/// an entry answers only a Pick for that same model.
#[derive(Debug)]
pub struct Affinity {
    map: HashMap<String, Recorded>,
    order: VecDeque<(String, u64)>,
    next: u64,
    capacity: usize,
    ttl: Duration,
}

/// One recorded response: who served it, for which model, until when, and
/// its insertion generation.
#[derive(Debug)]
struct Recorded {
    endpoint: EndpointId,
    model: String,
    expires: Instant,
    generation: u64,
}

/// Longest model name recorded with a response id.
pub const MAX_MODEL: usize = 256;

/// Longest response id accepted (longer ones are not recorded).
pub const MAX_RESPONSE_ID: usize = 256;

impl Affinity {
    /// An empty table.
    pub fn new(capacity: usize, ttl: Duration) -> Self {
        Self {
            map: HashMap::new(),
            order: VecDeque::new(),
            next: 0,
            capacity,
            ttl,
        }
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Remembers that `response_id` was served by `endpoint` for a request
    /// naming `model`.
    pub fn insert(
        &mut self,
        response_id: &str,
        endpoint: EndpointId,
        model: &str,
        now: Instant,
    ) -> bool {
        if self.capacity == 0
            || response_id.is_empty()
            || response_id.len() > MAX_RESPONSE_ID
            || model.len() > MAX_MODEL
        {
            return false;
        }
        let generation = self.next;
        self.next += 1;
        self.map.insert(
            response_id.to_owned(),
            Recorded {
                endpoint,
                model: model.to_owned(),
                expires: now + self.ttl,
                generation,
            },
        );
        self.order.push_back((response_id.to_owned(), generation));
        while self.map.len() > self.capacity {
            self.pop_oldest();
        }
        if self.order.len() > 2 * self.capacity.max(1024) {
            let map = &self.map;
            self.order
                .retain(|(id, g)| map.get(id).is_some_and(|r| r.generation == *g));
        }
        true
    }

    fn pop_oldest(&mut self) {
        while let Some((id, g)) = self.order.pop_front() {
            if self.map.get(&id).is_some_and(|r| r.generation == g) {
                self.map.remove(&id);
                return;
            }
        }
    }

    /// The replica that served `response_id` and the model the request
    /// named, if known and unexpired.
    pub fn get(&self, response_id: &str, now: Instant) -> Option<(&EndpointId, &str)> {
        self.map
            .get(response_id)
            .filter(|r| r.expires > now)
            .map(|r| (&r.endpoint, r.model.as_str()))
    }
}

/// Approximate-mode keys: per model, `(key → replicas)` learned from picks.
#[derive(Debug)]
pub struct Approximate {
    models: HashMap<String, PartitionId>,
    learned: Credits,
}

const MAX_MODELS: usize = 4096;

impl Approximate {
    /// An empty table with at most `capacity` `(key, replica)` entries.
    pub fn new(capacity: usize) -> Self {
        Self {
            models: HashMap::new(),
            learned: Credits::new(capacity),
        }
    }

    /// `(key, replica)` entries held.
    pub fn len(&self) -> usize {
        self.learned.len()
    }

    /// Leading keys each candidate was credited with (all as GPU).
    pub fn match_prefix(
        &self,
        model: &str,
        keys: &[BlockKey],
        candidates: &[ReplicaSlot],
        now: Instant,
    ) -> Vec<PrefixMatch> {
        let mut out = vec![PrefixMatch::default(); candidates.len()];
        let Some(p) = self.models.get(model) else {
            return out;
        };
        for (slot, m) in candidates.iter().zip(out.iter_mut()) {
            let n = u32::try_from(self.learned.run(*p, *slot, keys, now)).unwrap_or(u32::MAX);
            m.blocks = n;
            m.per_tier[0] = n;
        }
        out
    }

    /// Credits `slot` with `keys` for `ttl`.
    pub fn learn(
        &mut self,
        model: &str,
        keys: &[BlockKey],
        slot: ReplicaSlot,
        now: Instant,
        ttl: Duration,
    ) {
        let next = self.models.len();
        let p = match self.models.get(model) {
            Some(p) => *p,
            None if next < MAX_MODELS => {
                let Ok(id) = u32::try_from(next) else {
                    return;
                };
                let p = PartitionId::new(id);
                self.models.insert(model.to_owned(), p);
                p
            }
            None => return,
        };
        self.learned.credit(p, keys, slot, now, now + ttl);
    }

    /// Forgets a removed replica.
    pub fn forget_replica(&mut self, slot: ReplicaSlot) {
        self.learned.forget_replica(slot);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(port: u16) -> EndpointId {
        EndpointId {
            address: ([127, 0, 0, 1], port).into(),
            rank: None,
        }
    }

    #[test]
    fn affinity_is_bounded_and_expires() {
        let now = Instant::now();
        let mut a = Affinity::new(2, Duration::from_secs(10));
        assert!(a.insert("r1", ep(1), "m", now));
        assert!(a.insert("r2", ep(2), "m", now));
        assert!(a.insert("r3", ep(3), "lora", now));
        assert_eq!(a.len(), 2);
        assert_eq!(a.get("r1", now), None);
        assert_eq!(a.get("r3", now), Some((&ep(3), "lora")));
        assert_eq!(a.get("r3", now + Duration::from_secs(11)), None);
        assert!(!a.insert("", ep(1), "m", now));
        assert!(!a.insert(&"x".repeat(MAX_RESPONSE_ID + 1), ep(1), "m", now));
        assert!(!a.insert("r4", ep(1), &"m".repeat(MAX_MODEL + 1), now));
        // Re-inserting refreshes instead of double counting.
        assert!(a.insert("r2", ep(4), "m", now));
        assert_eq!(a.len(), 2);
        assert_eq!(a.get("r2", now), Some((&ep(4), "m")));
    }

    #[test]
    fn approximate_learns_prefixes_with_ttl() {
        let now = Instant::now();
        let mut ap = Approximate::new(100);
        let keys: Vec<BlockKey> = (1..=4).map(BlockKey::from_u64).collect();
        ap.learn("m", &keys[..3], ReplicaSlot(1), now, Duration::from_secs(5));
        let m = ap.match_prefix("m", &keys, &[ReplicaSlot(0), ReplicaSlot(1)], now);
        assert_eq!((m[0].blocks, m[1].blocks), (0, 3));
        assert_eq!(
            ap.match_prefix("other", &keys, &[ReplicaSlot(1)], now)[0].blocks,
            0
        );
        let later = now + Duration::from_secs(6);
        assert_eq!(
            ap.match_prefix("m", &keys, &[ReplicaSlot(1)], later)[0].blocks,
            0
        );
    }
}
