//! Automatic prefix caching, vLLM style: block hashes and the block pool's residency.
//!
//! - Only full blocks of `block_size` tokens are hashed: `h_i = SHA-256(h_{i-1} ‖ tokens_i ‖ extra_i)`
//!   with `h_{-1}` a per-process root (vLLM's `NONE_HASH`, seeded like `PYTHONHASHSEED`). A block
//!   has the same hash in every KV cache group.
//! - Extra keys: the LoRA name on every block, the `cache_salt` on block 0 only (vLLM's order:
//!   LoRA, then salt), so salts and adapters never share blocks while the chain carries them on.
//! - Residency is per `(hash, group)` (vLLM's `get_cached_block(hash, group_ids)`): each KV cache
//!   group caches its own blocks of the one shared pool ([`crate::pool`]), possibly several
//!   copies of one hash. Which blocks a request reuses, holds and caches is the coordinator's
//!   business (`coordinator.rs`).

use sha2::{Digest, Sha256};

use crate::pool::BlockPool;
pub use crate::pool::{BlockHash, GroupBlock};

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

/// The prefix cache of one replica: one block pool shared by its KV cache groups.
#[derive(Debug)]
pub struct PrefixCache {
    block_size: usize,
    root: [u8; 32],
    pool: BlockPool,
}

impl PrefixCache {
    /// An empty cache; `seed` plays `PYTHONHASHSEED` (same seed, same hashes).
    pub fn new(block_size: usize, capacity: usize, seed: &str) -> Self {
        let root: [u8; 32] =
            Sha256::digest(format!("mock-vllm/none-hash\0{seed}").as_bytes()).into();
        Self {
            block_size: block_size.max(1),
            root,
            pool: BlockPool::new(capacity),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn capacity(&self) -> usize {
        self.pool.capacity()
    }

    /// Cached blocks now (physical copies), over all groups.
    pub fn len(&self) -> usize {
        self.pool.cached_blocks()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The block pool.
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn pool_mut(&mut self) -> &mut BlockPool {
        &mut self.pool
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

    /// Whether `group` holds some copy of the block `hash` (no LRU update).
    pub fn holds(&self, hash: &BlockHash, group: u32) -> bool {
        self.pool.holds(&(*hash, group))
    }

    /// Drops every block's hash (prefix-cache reset).
    pub fn clear(&mut self) {
        self.pool.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(n: u32, offset: u32) -> Vec<u32> {
        (0..n).map(|i| 100 + i + offset).collect()
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
}
