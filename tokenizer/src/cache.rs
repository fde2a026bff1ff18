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

/// Which map a segment is in: its namespace (requests under different
/// `cache_salt`s never share an entry) and whether Metaspace would prepend
/// to it.
type Space = (u64, bool);

/// A segment's identity: its map and its text.
type Key = (Space, Arc<str>);

#[derive(Debug)]
struct Entry {
    ids: Arc<[u32]>,
    /// The entry's place in [`Inner::order`].
    tick: u64,
    bytes: usize,
}

#[derive(Debug, Default)]
struct Inner {
    /// Entries by map, then by text. A map is dropped with its last entry,
    /// so there are never more maps than entries.
    maps: HashMap<Space, HashMap<Arc<str>, Entry>>,
    /// Every entry by its last use, least recent first: exactly one item
    /// per entry, so a hit costs one hash of its text and two small
    /// tree operations, and nothing ever needs compacting.
    order: BTreeMap<u64, Key>,
    tick: u64,
    bytes: usize,
    live: usize,
}

impl Inner {
    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    fn remove(&mut self, space: Space, text: &str) -> Option<Entry> {
        let map = self.maps.get_mut(&space)?;
        let e = map.remove(text)?;
        if map.is_empty() {
            self.maps.remove(&space);
        }
        self.live -= 1;
        Some(e)
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

    /// The ids of `text` in `namespace`, counting a hit or a miss.
    pub fn get(&self, namespace: u64, text: &str, first: bool) -> Option<Arc<[u32]>> {
        if self.capacity == 0 {
            self.misses.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let mut guard = self.lock();
        let inner = &mut *guard;
        let tick = inner.next_tick();
        let Some(entry) = inner
            .maps
            .get_mut(&(namespace, first))
            .and_then(|m| m.get_mut(text))
        else {
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

    /// Stores the ids of `text` in `namespace`, evicting the least recently
    /// used entries beyond the bound. Entries larger than the whole bound
    /// are not kept.
    pub fn insert(&self, namespace: u64, text: &str, first: bool, ids: Arc<[u32]>) {
        let bytes = text.len() + ids.len() * 4 + OVERHEAD;
        if bytes > self.capacity {
            return;
        }
        let text: Arc<str> = Arc::from(text);
        let mut inner = self.lock();
        let tick = inner.next_tick();
        let space = (namespace, first);
        match inner
            .maps
            .entry(space)
            .or_default()
            .insert(Arc::clone(&text), Entry { ids, tick, bytes })
        {
            Some(old) => {
                inner.bytes = inner.bytes.saturating_sub(old.bytes);
                inner.order.remove(&old.tick);
            }
            None => inner.live += 1,
        }
        inner.bytes += bytes;
        inner.order.insert(tick, (space, text));
        let mut evicted = 0u64;
        while inner.bytes > self.capacity {
            let Some((_, (space, k))) = inner.order.pop_first() else {
                break;
            };
            if let Some(e) = inner.remove(space, &k) {
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
            entries: inner.live as u64,
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
            cache.insert(0, t, false, Arc::clone(&ids));
        }
        assert!(cache.get(0, "aaaaaaaaaa", false).is_some()); // a is now the most recent
        cache.insert(0, "dddddddddd", false, Arc::clone(&ids)); // evicts b
        assert!(cache.get(0, "bbbbbbbbbb", false).is_none());
        assert!(cache.get(0, "aaaaaaaaaa", false).is_some());
        assert!(
            cache.get(0, "aaaaaaaaaa", true).is_none(),
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
        cache.insert(0, "x", false, Arc::from(vec![1]));
        cache.insert(0, "x", true, Arc::from(vec![2]));
        cache.insert(0, "x", false, Arc::from(vec![3])); // replaces
        cache.insert(7, "x", false, Arc::from(vec![4]));
        for _ in 0..10_000 {
            assert!(cache.get(0, "x", false).is_some());
        }
        let inner = cache.lock();
        assert_eq!(inner.order.len(), 3);
        assert_eq!(inner.live, 3);
        assert_eq!(inner.maps.len(), 3);
        assert_eq!(inner.bytes, 3 * (1 + 4 + OVERHEAD));
    }

    /// The cache against a plain list kept in recency order.
    #[derive(Default)]
    struct Model {
        /// ((namespace, first), text, ids), least recent first.
        items: Vec<(Space, String, Vec<u32>)>,
        evictions: u64,
    }

    impl Model {
        fn bytes(&self) -> usize {
            self.items
                .iter()
                .map(|(_, t, ids)| t.len() + ids.len() * 4 + OVERHEAD)
                .sum()
        }

        fn get(&mut self, text: &str, space: Space) -> Option<Vec<u32>> {
            let at = self
                .items
                .iter()
                .position(|(f, t, _)| *f == space && t == text)?;
            let item = self.items.remove(at);
            let ids = item.2.clone();
            self.items.push(item);
            Some(ids)
        }

        fn insert(&mut self, text: &str, space: Space, ids: Vec<u32>, capacity: usize) {
            if text.len() + ids.len() * 4 + OVERHEAD > capacity {
                return;
            }
            self.items.retain(|(f, t, _)| !(*f == space && t == text));
            self.items.push((space, text.to_owned(), ids));
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
            ops in proptest::collection::vec((0u8..3, 0usize..12, proptest::bool::ANY, 0u64..3, 0usize..40), 0..300),
        ) {
            let cache = SegmentCache::new(capacity);
            let mut model = Model::default();
            for (op, key, first, ns, len) in ops {
                let text = format!("segment-{key}");
                if op == 0 {
                    let ids: Vec<u32> = (0..len as u32).collect();
                    cache.insert(ns, &text, first, Arc::from(ids.clone()));
                    model.insert(&text, (ns, first), ids, capacity);
                } else {
                    let got = cache.get(ns, &text, first).map(|ids| ids.to_vec());
                    let want = if capacity == 0 { None } else { model.get(&text, (ns, first)) };
                    proptest::prop_assert_eq!(got, want);
                }
                let s = cache.stats();
                proptest::prop_assert_eq!(s.bytes as usize, model.bytes());
                proptest::prop_assert_eq!(s.entries as usize, model.items.len());
                proptest::prop_assert_eq!(s.evictions, model.evictions);
                let inner = cache.lock();
                proptest::prop_assert_eq!(inner.order.len(), model.items.len());
                proptest::prop_assert!(inner.maps.len() <= model.items.len());
            }
        }
    }

    #[test]
    fn a_namespace_never_sees_another_namespaces_entries() {
        let cache = SegmentCache::new(1 << 20);
        let ids: Arc<[u32]> = Arc::from(vec![1, 2, 3]);
        assert!(cache.get(1, "same text", false).is_none());
        cache.insert(1, "same text", false, Arc::clone(&ids));
        assert!(
            cache.get(2, "same text", false).is_none(),
            "another salt: a miss"
        );
        assert_eq!(
            cache.get(1, "same text", false).as_deref(),
            Some(&[1, 2, 3][..])
        );
        let s = cache.stats();
        assert_eq!((s.hits, s.misses), (1, 2));
    }
}
