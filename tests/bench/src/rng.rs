//! The workloads' seeded randomness: ChaCha8 (`rand_chacha`), whose output
//! for a seed is fixed by its specification, so the same seed gives the same
//! workload on every machine and with every version of the crate.

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A seeded generator with the few draws the workloads need.
#[derive(Debug, Clone)]
pub struct Rng(ChaCha8Rng);

impl Rng {
    /// A generator for `seed`; `stream` separates independent sequences
    /// (one per conversation) drawn from one seed.
    pub fn new(seed: u64, stream: u64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(stream);
        Self(rng)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in `lo..=hi` (`lo` when `hi <= lo`).
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        if hi <= lo {
            return lo;
        }
        let span = (hi - lo) as u64 + 1;
        lo + (self.next_u64() % span) as usize
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// `true` with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }

    /// Lowercase text of `words` words of 2 to 5 letters: one token per word
    /// in the mock's tokenizer (a leading space attaches to its word).
    pub fn words(&mut self, words: usize) -> String {
        let mut out = String::with_capacity(words * 5);
        for i in 0..words {
            if i > 0 {
                out.push(' ');
            }
            let len = self.range(2, 5);
            for _ in 0..len {
                let letter = b'a' + (self.next_u64() % 26) as u8;
                out.push(char::from(letter));
            }
        }
        out
    }

    /// A short hex tag (for salts and ids).
    pub fn tag(&mut self) -> String {
        format!("{:012x}", self.next_u64() >> 16)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_sequence_streams_differ() {
        let a: Vec<u64> = (0..4).map(|_| Rng::new(7, 1).next_u64()).collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]));
        let mut x = Rng::new(7, 1);
        let mut y = Rng::new(7, 2);
        assert_ne!(x.next_u64(), y.next_u64());
        assert_eq!(Rng::new(3, 0).words(50), Rng::new(3, 0).words(50));
        assert_eq!(Rng::new(3, 0).words(50).split(' ').count(), 50);
    }

    #[test]
    fn range_and_unit_stay_in_bounds() {
        let mut r = Rng::new(1, 0);
        for _ in 0..1_000 {
            let v = r.range(3, 7);
            assert!((3..=7).contains(&v));
            let u = r.unit();
            assert!((0.0..1.0).contains(&u));
        }
        assert_eq!(r.range(5, 5), 5);
    }
}
