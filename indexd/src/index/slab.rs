//! A slab of fixed-size records addressed by `u32`, in chunks of 4,096.
//!
//! Chunks, not one `Vec`: growing never copies what is stored (a `Vec` of a
//! million entries doubling would copy 40 MB under the index's write lock)
//! and capacity exceeds the peak by less than a chunk. Freed places are
//! reused, newest first; chunks are kept (the index's bound caps the peak).

/// Places per chunk (a power of two).
const CHUNK_BITS: u32 = 12;
const CHUNK: usize = 1 << CHUNK_BITS;

#[derive(Debug)]
pub(super) struct Slab<T> {
    chunks: Vec<Vec<T>>,
    free: Vec<u32>,
    /// Highest index + 1 ever handed out.
    used: usize,
    /// Indices at or above this are never handed out.
    limit: u32,
}

impl<T> Slab<T> {
    /// An empty slab handing out indices below `limit`.
    pub(super) fn new(limit: u32) -> Self {
        Self {
            chunks: Vec::new(),
            free: Vec::new(),
            used: 0,
            limit,
        }
    }

    /// Stores `value`; `None` when every index below the limit is taken.
    pub(super) fn insert(&mut self, value: T) -> Option<u32> {
        if let Some(i) = self.free.pop() {
            if let Some(place) = self.get_mut(i) {
                *place = value;
                return Some(i);
            }
            return None;
        }
        let i = u32::try_from(self.used).ok().filter(|i| *i < self.limit)?;
        let chunk = self.used >> CHUNK_BITS;
        if chunk == self.chunks.len() {
            self.chunks.push(Vec::with_capacity(CHUNK));
        }
        self.chunks.get_mut(chunk)?.push(value);
        self.used += 1;
        Some(i)
    }

    /// Marks `i` free (the caller no longer refers to it). What it holds
    /// stays until the place is reused.
    pub(super) fn remove(&mut self, i: u32) {
        if (i as usize) < self.used {
            self.free.push(i);
        }
    }

    pub(super) fn get(&self, i: u32) -> Option<&T> {
        let i = i as usize;
        self.chunks.get(i >> CHUNK_BITS)?.get(i & (CHUNK - 1))
    }

    pub(super) fn get_mut(&mut self, i: u32) -> Option<&mut T> {
        let i = i as usize;
        self.chunks
            .get_mut(i >> CHUNK_BITS)?
            .get_mut(i & (CHUNK - 1))
    }

    /// Places in use.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.used - self.free.len()
    }

    /// Heap bytes held (chunks at capacity, and the free list).
    pub(super) fn heap_bytes(&self) -> usize {
        self.chunks.len() * CHUNK * std::mem::size_of::<T>()
            + self.free.capacity() * std::mem::size_of::<u32>()
            + self.chunks.capacity() * std::mem::size_of::<Vec<T>>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_are_reused_and_the_limit_holds() {
        let mut s: Slab<u64> = Slab::new(5_000);
        let ids: Vec<u32> = (0..5_000).map(|v| s.insert(v).unwrap()).collect();
        assert_eq!(ids, (0..5_000).collect::<Vec<u32>>());
        assert_eq!(s.insert(9), None, "the limit");
        s.remove(4_100);
        s.remove(7);
        assert_eq!(s.len(), 4_998);
        assert_eq!(s.insert(70), Some(7));
        assert_eq!(s.insert(41), Some(4_100));
        assert_eq!(
            (s.get(7), s.get(4_100), s.get(5_000)),
            (Some(&70), Some(&41), None)
        );
        assert_eq!(s.heap_bytes() / 8 / CHUNK, 2);
    }
}
