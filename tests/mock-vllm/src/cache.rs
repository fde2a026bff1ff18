//! Automatic prefix caching, vLLM style.
//!
//! - Only full blocks of `block_size` tokens are hashed: `h_i = SHA-256(h_{i-1} ‖ tokens_i ‖ extra_i)`
//!   with `h_{-1}` a per-process root (vLLM's `NONE_HASH`, seeded like `PYTHONHASHSEED`).
//! - Extra keys: the LoRA name on every block, the `cache_salt` on block 0 only (vLLM's order:
//!   LoRA, then salt), so salts and adapters never share blocks while the chain carries them on.
//! - A request reuses the longest run of cached leading blocks, capped so at least one prompt
//!   token is computed: `min(run × B, ⌊(n−1)/B⌋ × B)`.
//! - Capacity is in blocks; least recently used blocks are evicted first, and within one request
//!   the tail block counts as older than the head (vLLM frees blocks tail first), so evictions come
//!   out tail first.

use std::collections::{BTreeMap, HashMap};

use sha2::{Digest, Sha256};

/// A vLLM block hash: 32 bytes; the u64 wire form is its last 8 bytes, big-endian.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub [u8; 32]);

impl BlockHash {
    /// vLLM's `ExternalBlockHash` int form.
    pub fn as_u64(&self) -> u64 {
        let mut tail = [0u8; 8];
        tail.copy_from_slice(&self.0[24..]);
        u64::from_be_bytes(tail)
    }
}

/// One full block of a prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    pub hash: BlockHash,
    /// Extra keys that went into the hash (`None` when empty).
    pub extra_keys: Option<Vec<String>>,
}

/// Which partition of the cache a prompt belongs to.
#[derive(Debug, Clone, Copy, Default)]
pub struct BlockScope<'a> {
    pub cache_salt: Option<&'a str>,
    pub lora_name: Option<&'a str>,
}

/// What storing a request's blocks did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct StoreOutcome {
    /// Index of the first block announced as stored (the ones before were already a cached run).
    pub first_new: usize,
    /// Evicted blocks, in eviction order (tail first).
    pub evicted: Vec<BlockHash>,
}

/// The prefix cache of one replica.
#[derive(Debug)]
pub struct PrefixCache {
    block_size: usize,
    capacity: usize,
    root: [u8; 32],
    stamps: HashMap<BlockHash, u64>,
    lru: BTreeMap<u64, BlockHash>,
    next_stamp: u64,
}

impl PrefixCache {
    /// An empty cache; `seed` plays `PYTHONHASHSEED` (same seed, same hashes).
    pub fn new(block_size: usize, capacity: usize, seed: &str) -> Self {
        let root: [u8; 32] =
            Sha256::digest(format!("mock-vllm/none-hash\0{seed}").as_bytes()).into();
        Self {
            block_size: block_size.max(1),
            capacity,
            root,
            stamps: HashMap::new(),
            lru: BTreeMap::new(),
            next_stamp: 0,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Blocks held now.
    pub fn len(&self) -> usize {
        self.stamps.len()
    }

    pub fn is_empty(&self) -> bool {
        self.stamps.is_empty()
    }

    /// Hashes of the full blocks of `tokens`.
    pub fn blocks(&self, tokens: &[u32], scope: BlockScope<'_>) -> Vec<Block> {
        let mut parent = self.root;
        tokens
            .chunks_exact(self.block_size)
            .enumerate()
            .map(|(i, chunk)| {
                let mut extra = Vec::new();
                if let Some(lora) = scope.lora_name {
                    extra.push(lora.to_owned());
                }
                if i == 0
                    && let Some(salt) = scope.cache_salt
                {
                    extra.push(salt.to_owned());
                }
                let mut h = Sha256::new();
                h.update(parent);
                for t in chunk {
                    h.update(t.to_le_bytes());
                }
                for key in &extra {
                    h.update((key.len() as u64).to_le_bytes());
                    h.update(key.as_bytes());
                }
                parent = h.finalize().into();
                Block {
                    hash: BlockHash(parent),
                    extra_keys: (!extra.is_empty()).then_some(extra),
                }
            })
            .collect()
    }

    /// How many leading blocks are cached now (no LRU update).
    pub fn cached_run(&self, blocks: &[Block]) -> usize {
        blocks
            .iter()
            .take_while(|b| self.stamps.contains_key(&b.hash))
            .count()
    }

    /// Tokens a request of `n_tokens` would reuse given `run` cached leading blocks.
    pub fn hit_tokens(&self, n_tokens: usize, run: usize) -> usize {
        let cap = n_tokens.saturating_sub(1) / self.block_size * self.block_size;
        (run * self.block_size).min(cap)
    }

    /// Stores a request's blocks: touches them (head most recent), adds the missing ones and
    /// evicts LRU blocks beyond capacity. Blocks beyond capacity are not stored.
    pub fn store(&mut self, blocks: &[Block]) -> StoreOutcome {
        let blocks = &blocks[..blocks.len().min(self.capacity)];
        let first_new = self.cached_run(blocks);
        for b in blocks.iter().rev() {
            let stamp = self.next_stamp;
            self.next_stamp += 1;
            if let Some(old) = self.stamps.insert(b.hash, stamp) {
                self.lru.remove(&old);
            }
            self.lru.insert(stamp, b.hash);
        }
        let mut evicted = Vec::new();
        while self.stamps.len() > self.capacity {
            let Some((_, hash)) = self.lru.pop_first() else {
                break;
            };
            self.stamps.remove(&hash);
            evicted.push(hash);
        }
        StoreOutcome { first_new, evicted }
    }

    /// Drops every block (prefix-cache reset).
    pub fn clear(&mut self) {
        self.stamps.clear();
        self.lru.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(n: u32, offset: u32) -> Vec<u32> {
        (0..n).map(|i| 100 + i + offset).collect()
    }

    #[test]
    fn full_block_hits_cap_at_n_minus_one() {
        let c = PrefixCache::new(64, 100, "s");
        assert_eq!(c.hit_tokens(6_653, 1_000), 6_592);
        assert_eq!(c.hit_tokens(128, 2), 64);
        assert_eq!(c.hit_tokens(129, 2), 128);
        assert_eq!(c.hit_tokens(63, 0), 0);
    }

    #[test]
    fn salt_scopes_block_zero_and_chain() {
        let c = PrefixCache::new(4, 100, "s");
        let t = toks(12, 0);
        let plain = c.blocks(&t, BlockScope::default());
        let salted = c.blocks(
            &t,
            BlockScope {
                cache_salt: Some("A"),
                lora_name: None,
            },
        );
        let salted_b = c.blocks(
            &t,
            BlockScope {
                cache_salt: Some("B"),
                lora_name: None,
            },
        );
        assert_eq!(plain.len(), 3);
        assert!(plain.iter().zip(&salted).all(|(a, b)| a.hash != b.hash));
        assert!(salted.iter().zip(&salted_b).all(|(a, b)| a.hash != b.hash));
        assert_eq!(salted[0].extra_keys, Some(vec!["A".to_owned()]));
        assert_eq!(salted[1].extra_keys, None);
        let lora = c.blocks(
            &t,
            BlockScope {
                cache_salt: Some("A"),
                lora_name: Some("sql"),
            },
        );
        assert_eq!(
            lora[0].extra_keys,
            Some(vec!["sql".to_owned(), "A".to_owned()])
        );
        assert_eq!(lora[2].extra_keys, Some(vec!["sql".to_owned()]));
    }

    #[test]
    fn same_seed_same_hashes_other_seed_differs() {
        let t = toks(8, 0);
        let a = PrefixCache::new(4, 10, "x").blocks(&t, BlockScope::default());
        let b = PrefixCache::new(4, 10, "x").blocks(&t, BlockScope::default());
        let c = PrefixCache::new(4, 10, "y").blocks(&t, BlockScope::default());
        assert_eq!(a, b);
        assert_ne!(a[0].hash, c[0].hash);
        assert_eq!(
            a[0].hash.as_u64(),
            u64::from_be_bytes(a[0].hash.0[24..].try_into().unwrap())
        );
    }

    #[test]
    fn store_then_hit_and_lru_evicts_tail_first() {
        let mut c = PrefixCache::new(4, 4, "s");
        let a = c.blocks(&toks(12, 0), BlockScope::default());
        let out = c.store(&a);
        assert_eq!(
            out,
            StoreOutcome {
                first_new: 0,
                evicted: vec![]
            }
        );
        assert_eq!(c.cached_run(&a), 3);
        let b = c.blocks(&toks(12, 1_000), BlockScope::default());
        let out = c.store(&b);
        // 3 + 3 > 4: the two oldest go, A's tail first.
        assert_eq!(out.evicted, vec![a[2].hash, a[1].hash]);
        assert_eq!(c.len(), 4);
        assert_eq!(c.cached_run(&a), 1);
        assert_eq!(c.cached_run(&b), 3);
        let again = c.store(&b);
        assert_eq!(again.first_new, 3);
        assert!(again.evicted.is_empty());
    }

    #[test]
    fn clear_empties() {
        let mut c = PrefixCache::new(4, 8, "s");
        let a = c.blocks(&toks(8, 0), BlockScope::default());
        c.store(&a);
        c.clear();
        assert!(c.is_empty());
        assert_eq!(c.cached_run(&a), 0);
    }
}
