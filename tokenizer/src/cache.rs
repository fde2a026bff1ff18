//! A cache of encoded segments (text → token ids), bounded in bytes, least
//! recently used first out. Thread-safe: one short lock per lookup or insert;
//! nothing is encoded while it is held.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Segment texts come from requests: a keyed hash (ahash, randomly seeded)
/// keeps lookups fast and collisions unpredictable.
type HashMap<K, V> = ahash::AHashMap<K, V>;

/// Bytes charged per entry on top of its text and ids (map, order, `Arc`s).
const OVERHEAD: usize = 96;

/// A segment's identity: whether Metaspace would prepend to it (which
/// selects one of two maps) and its text.
type Key = (bool, Arc<str>);

#[derive(Debug)]
struct Entry {
    ids: Arc<[u32]>,
    /// The entry's place in [`Inner::order`].
    tick: u64,
    bytes: usize,
}

#[derive(Debug, Default)]
struct Inner {
    /// Entries of segments at the start of the input, by text.
    first: HashMap<Arc<str>, Entry>,
    /// All other entries, by text.
    rest: HashMap<Arc<str>, Entry>,
    /// Every entry by its last use, least recent first: exactly one item
    /// per entry, so a hit costs one hash of its text and two small
    /// tree operations, and nothing ever needs compacting.
    order: BTreeMap<u64, Key>,
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

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
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
        let mut guard = self.lock();
        let inner = &mut *guard;
        let tick = inner.next_tick();
        let map = if first {
            &mut inner.first
        } else {
            &mut inner.rest
        };
        let Some(entry) = map.get_mut(text) else {
            drop(guard);
            self.misses.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        let ids = Arc::clone(&entry.ids);
        let was = std::mem::replace(&mut entry.tick, tick);
        if let Some(key) = inner.order.remove(&was) {
            inner.order.insert(tick, key);
        }
        drop(guard);
        self.hits.fetch_add(1, Ordering::Relaxed);
        Some(ids)
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
        let tick = inner.next_tick();
        if let Some(old) = inner
            .map(first)
            .insert(Arc::clone(&text), Entry { ids, tick, bytes })
        {
            inner.bytes = inner.bytes.saturating_sub(old.bytes);
            inner.order.remove(&old.tick);
        }
        inner.bytes += bytes;
        inner.order.insert(tick, (first, text));
        let mut evicted = 0u64;
        while inner.bytes > self.capacity {
            let Some((_, (first, k))) = inner.order.pop_first() else {
                break;
            };
            if let Some(e) = inner.map(first).remove(&k) {
                inner.bytes = inner.bytes.saturating_sub(e.bytes);
                evicted += 1;
            }
        }
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
    fn the_order_holds_one_item_per_entry() {
        let cache = SegmentCache::new(1 << 20);
        cache.insert("x", false, Arc::from(vec![1]));
        cache.insert("x", true, Arc::from(vec![2]));
        cache.insert("x", false, Arc::from(vec![3])); // replaces
        for _ in 0..10_000 {
            assert!(cache.get("x", false).is_some());
        }
        let inner = cache.lock();
        assert_eq!(inner.order.len(), 2);
        assert_eq!(inner.live(), 2);
        assert_eq!(inner.bytes, 2 * (1 + 4 + OVERHEAD));
    }

    /// The cache against a plain list kept in recency order.
    #[derive(Default)]
    struct Model {
        /// (first, text, ids), least recent first.
        items: Vec<(bool, String, Vec<u32>)>,
        evictions: u64,
    }

    impl Model {
        fn bytes(&self) -> usize {
            self.items
                .iter()
                .map(|(_, t, ids)| t.len() + ids.len() * 4 + OVERHEAD)
                .sum()
        }

        fn get(&mut self, text: &str, first: bool) -> Option<Vec<u32>> {
            let at = self
                .items
                .iter()
                .position(|(f, t, _)| *f == first && t == text)?;
            let item = self.items.remove(at);
            let ids = item.2.clone();
            self.items.push(item);
            Some(ids)
        }

        fn insert(&mut self, text: &str, first: bool, ids: Vec<u32>, capacity: usize) {
            if text.len() + ids.len() * 4 + OVERHEAD > capacity {
                return;
            }
            self.items.retain(|(f, t, _)| !(*f == first && t == text));
            self.items.push((first, text.to_owned(), ids));
            while self.bytes() > capacity {
                self.items.remove(0);
                self.evictions += 1;
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn behaves_as_a_least_recently_used_list(
            capacity in 0usize..1_200,
            ops in proptest::collection::vec((0u8..3, 0usize..12, proptest::bool::ANY, 0usize..40), 0..300),
        ) {
            let cache = SegmentCache::new(capacity);
            let mut model = Model::default();
            for (op, key, first, len) in ops {
                let text = format!("segment-{key}");
                if op == 0 {
                    let ids: Vec<u32> = (0..len as u32).collect();
                    cache.insert(&text, first, Arc::from(ids.clone()));
                    model.insert(&text, first, ids, capacity);
                } else {
                    let got = cache.get(&text, first).map(|ids| ids.to_vec());
                    let want = if capacity == 0 { None } else { model.get(&text, first) };
                    proptest::prop_assert_eq!(got, want);
                }
                let s = cache.stats();
                proptest::prop_assert_eq!(s.bytes as usize, model.bytes());
                proptest::prop_assert_eq!(s.entries as usize, model.items.len());
                proptest::prop_assert_eq!(s.evictions, model.evictions);
                proptest::prop_assert_eq!(cache.lock().order.len(), model.items.len());
            }
        }
    }
}
