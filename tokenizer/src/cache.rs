//! A cache of encoded segments (text → token ids), bounded in bytes, least
//! recently used first out. Thread-safe: one short lock per lookup or insert;
//! nothing is encoded while it is held.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Segment texts come from requests: a keyed hash (ahash, randomly seeded)
/// keeps lookups fast and collisions unpredictable.
type HashMap<K, V> = ahash::AHashMap<K, V>;

/// Bytes charged per entry on top of its text and ids (map, queue, `Arc`s).
const OVERHEAD: usize = 96;

/// A segment's identity: its text and whether Metaspace would prepend to it
/// (which selects one of two maps).
type Key = (bool, Arc<str>);

#[derive(Debug)]
struct Entry {
    ids: Arc<[u32]>,
    tick: u64,
    bytes: usize,
}

#[derive(Debug, Default)]
struct Inner {
    /// Entries of segments at the start of the input, by text.
    first: HashMap<Arc<str>, Entry>,
    /// All other entries, by text.
    rest: HashMap<Arc<str>, Entry>,
    /// Touches in order; stale ones (whose tick is not the entry's) are
    /// skipped when evicting.
    queue: VecDeque<(u64, Key)>,
    tick: u64,
    bytes: usize,
}

impl Inner {
    fn map(&mut self, first: bool) -> &mut HashMap<Arc<str>, Entry> {
        if first {
            &mut self.first
        } else {
            &mut self.rest
        }
    }

    fn live(&self) -> usize {
        self.first.len() + self.rest.len()
    }
}

/// Counters for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Segments found in the cache.
    pub hits: u64,
    /// Segments encoded.
    pub misses: u64,
    /// Bytes held now.
    pub bytes: u64,
    /// Entries held now.
    pub entries: u64,
    /// Entries dropped to stay within the bound.
    pub evictions: u64,
    /// The bound.
    pub capacity_bytes: u64,
}

/// The segment cache.
#[derive(Debug)]
pub struct SegmentCache {
    inner: Mutex<Inner>,
    capacity: usize,
    hits: AtomicU64,
    misses: AtomicU64,
    evictions: AtomicU64,
}

impl SegmentCache {
    /// A cache holding at most `capacity` bytes (0 disables it).
    pub fn new(capacity: usize) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            capacity,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic elsewhere cannot leave the map inconsistent (each change
        // is completed before unlocking), so a poisoned lock is still usable.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The ids of `text`, counting a hit or a miss.
    pub fn get(&self, text: &str, first: bool) -> Option<Arc<[u32]>> {
        if self.capacity == 0 {
            self.misses.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let mut inner = self.lock();
        inner.tick += 1;
        let tick = inner.tick;
        let found = inner
            .map(first)
            .get_key_value(text)
            .map(|(k, e)| (Arc::clone(k), Arc::clone(&e.ids)));
        match found {
            Some((key, ids)) => {
                if let Some(e) = inner.map(first).get_mut(text) {
                    e.tick = tick;
                }
                inner.queue.push_back((tick, (first, key)));
                compact(&mut inner);
                drop(inner);
                self.hits.fetch_add(1, Ordering::Relaxed);
                Some(ids)
            }
            None => {
                drop(inner);
                self.misses.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// Stores the ids of `text`, evicting the least recently used entries
    /// beyond the bound. Entries larger than the whole bound are not kept.
    pub fn insert(&self, text: &str, first: bool, ids: Arc<[u32]>) {
        let bytes = text.len() + ids.len() * 4 + OVERHEAD;
        if bytes > self.capacity {
            return;
        }
        let text: Arc<str> = Arc::from(text);
        let mut inner = self.lock();
        inner.tick += 1;
        let tick = inner.tick;
        if let Some(old) = inner
            .map(first)
            .insert(Arc::clone(&text), Entry { ids, tick, bytes })
        {
            inner.bytes = inner.bytes.saturating_sub(old.bytes);
        }
        inner.bytes += bytes;
        inner.queue.push_back((tick, (first, text)));
        let mut evicted = 0u64;
        while inner.bytes > self.capacity {
            let Some((t, (first, k))) = inner.queue.pop_front() else {
                break;
            };
            let map = inner.map(first);
            if map.get(&k).is_some_and(|e| e.tick == t)
                && let Some(e) = map.remove(&k)
            {
                inner.bytes = inner.bytes.saturating_sub(e.bytes);
                evicted += 1;
            }
        }
        compact(&mut inner);
        drop(inner);
        if evicted > 0 {
            self.evictions.fetch_add(evicted, Ordering::Relaxed);
        }
    }

    /// Current counters.
    pub fn stats(&self) -> CacheStats {
        let inner = self.lock();
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            bytes: inner.bytes as u64,
            entries: inner.live() as u64,
            evictions: self.evictions.load(Ordering::Relaxed),
            capacity_bytes: self.capacity as u64,
        }
    }
}

/// Drops stale queue entries once they outnumber live ones: keeps the queue
/// within a constant factor of the map.
fn compact(inner: &mut Inner) {
    if inner.queue.len() <= 4 * inner.live() + 64 {
        return;
    }
    let (firsts, rest) = (&inner.first, &inner.rest);
    inner.queue.retain(|(t, (first, k))| {
        let map = if *first { firsts } else { rest };
        map.get(k).is_some_and(|e| e.tick == *t)
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_in_bytes_and_least_recent_goes_first() {
        let one = 10 + 4 * 2 + OVERHEAD;
        let cache = SegmentCache::new(3 * one);
        let ids: Arc<[u32]> = Arc::from(vec![1, 2]);
        for t in ["aaaaaaaaaa", "bbbbbbbbbb", "cccccccccc"] {
            cache.insert(t, false, Arc::clone(&ids));
        }
        assert!(cache.get("aaaaaaaaaa", false).is_some()); // a is now the most recent
        cache.insert("dddddddddd", false, Arc::clone(&ids)); // evicts b
        assert!(cache.get("bbbbbbbbbb", false).is_none());
        assert!(cache.get("aaaaaaaaaa", false).is_some());
        assert!(
            cache.get("aaaaaaaaaa", true).is_none(),
            "first-ness is part of the key"
        );
        let s = cache.stats();
        assert_eq!(s.evictions, 1);
        assert!(s.bytes <= s.capacity_bytes);
        assert_eq!(s.entries, 3);
    }

    #[test]
    fn many_hits_keep_the_queue_small() {
        let cache = SegmentCache::new(1 << 20);
        cache.insert("x", false, Arc::from(vec![1]));
        for _ in 0..10_000 {
            assert!(cache.get("x", false).is_some());
        }
        assert!(cache.lock().queue.len() < 200);
    }
}
