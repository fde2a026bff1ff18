//! The index's insertion order, for evicting the oldest entry at the bound.
//!
//! A removed entry stays behind as a stale item (told apart by its entry's
//! seq when it is met). Stale items are swept out a few per index operation,
//! never all at once: sweeping a million items in one go holds the index's
//! write lock for tens of milliseconds, and every Pick waits that long.
//!
//! The order is `done ++ sweeping ++ tail`. A sweep takes `done` as
//! `sweeping` and moves its live items, oldest first, back to a fresh `done`;
//! items pushed meanwhile wait in `tail`, which is swept next. Each part is
//! a `VecDeque`, and `done` is allocated at its full size when a sweep
//! starts, so no push copies a large buffer either.

use std::collections::VecDeque;

use crate::event::EngineHash;
use crate::ids::ReplicaSlot;

/// One entry's place: its replica, its engine hash, its seq.
pub(crate) type Item = (ReplicaSlot, EngineHash, u64);

/// Items moved per sweep step. Each index operation adds at most one item
/// and takes one step, so a sweep of `n` items ends within `n / 7` pushes.
const STEP: usize = 8;

#[derive(Debug, Default)]
pub(crate) struct Fifo {
    done: VecDeque<Item>,
    sweeping: VecDeque<Item>,
    tail: VecDeque<Item>,
}

impl Fifo {
    /// Items held, stale ones included.
    pub fn len(&self) -> usize {
        self.done.len() + self.sweeping.len() + self.tail.len()
    }

    /// Items allocated for.
    pub fn capacity(&self) -> usize {
        self.done.capacity() + self.sweeping.capacity() + self.tail.capacity()
    }

    /// Appends the newest item.
    pub fn push(&mut self, item: Item) {
        if self.sweeping.is_empty() {
            self.done.push_back(item);
        } else {
            self.tail.push_back(item);
        }
    }

    /// Takes the oldest item (live or stale).
    pub fn pop_front(&mut self) -> Option<Item> {
        if let Some(item) = self.done.pop_front() {
            return Some(item);
        }
        let item = self.sweeping.pop_front().or_else(|| self.tail.pop_front());
        if self.sweeping.is_empty() {
            self.sweeping = std::mem::take(&mut self.tail);
        }
        item
    }

    /// One step of upkeep: continues a sweep, or starts one when more than
    /// half of the items (beyond a slack) are stale, `live` items of `live_n`.
    pub fn upkeep(&mut self, live_n: usize, live: impl Fn(&Item) -> bool) {
        if self.sweeping.is_empty() {
            if self.len() <= 2 * live_n + 1024 {
                return;
            }
            self.sweeping = std::mem::replace(
                &mut self.done,
                VecDeque::with_capacity(live_n.saturating_add(1024)),
            );
        }
        for _ in 0..STEP {
            let Some(item) = self.sweeping.pop_front() else {
                break;
            };
            if live(&item) {
                self.done.push_back(item);
            }
        }
        if self.sweeping.is_empty() {
            // Its items come after everything swept; sweep them next.
            self.sweeping = std::mem::take(&mut self.tail);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(n: u64) -> Item {
        (ReplicaSlot(0), EngineHash(n), n)
    }

    /// Pushes, pops and removals against a plain list: the live items come
    /// out oldest first, and the stale ones stay bounded.
    #[test]
    fn order_is_kept_and_stale_items_stay_bounded() {
        use std::cell::RefCell;
        use std::collections::BTreeSet;
        let live: RefCell<BTreeSet<u64>> = RefCell::default();
        let mut fifo = Fifo::default();
        let mut model: VecDeque<u64> = VecDeque::new();
        let mut rng = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = 0u64;
        let mut most = 0usize;
        for _ in 0..200_000 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            match rng % 10 {
                0..=4 => {
                    fifo.push(item(next));
                    model.push_back(next);
                    live.borrow_mut().insert(next);
                    next += 1;
                }
                5..=7 => {
                    // Remove a random live entry (it goes stale).
                    let n = live.borrow().len() as u64;
                    if n > 0 {
                        let at = usize::try_from((rng >> 20) % n).unwrap();
                        let pick = *live.borrow().iter().nth(at).unwrap();
                        live.borrow_mut().remove(&pick);
                        model.retain(|x| *x != pick);
                    }
                }
                _ => {
                    // Evict the oldest live entry.
                    let want = model.pop_front();
                    let got = loop {
                        match fifo.pop_front() {
                            Some((_, _, seq)) if live.borrow().contains(&seq) => break Some(seq),
                            Some(_) => {}
                            None => break None,
                        }
                    };
                    assert_eq!(got, want);
                    if let Some(g) = got {
                        live.borrow_mut().remove(&g);
                    }
                }
            }
            let n = live.borrow().len();
            fifo.upkeep(n, |(_, _, seq)| live.borrow().contains(seq));
            most = most.max(fifo.len().saturating_sub(3 * n));
        }
        assert!(most <= 1024 + 64, "stale items beyond the bound: {most}");
    }
}
