//! vLLM 0.32's KV cache coordinator for the mock: the hit a request gets across the KV cache
//! groups, and what each group caches (and announces) as the request's blocks fill.
//!
//! **The hit** (`HybridKVCacheCoordinator.find_longest_cache_hit`): groups with identical specs
//! are looked up together (a block counts only when every one of them holds it), full attention
//! first. Starting from `max_length` (`num_tokens − 1` for a request), each group's rule
//! ([`crate::groups::longest_hit`]) accepts or shortens the candidate, until a pass over all of
//! them changes nothing (one pass for a "simple hybrid": full attention plus one other kind).
//! When a group held a longer prefix than the reconciled hit, the difference is an uncached
//! shared prefix and `hit + difference` the request's *shared-prefix junction*.
//!
//! **Blocks** (`allocate_slots`, `BlockPool.cache_full_blocks`): an admitted request holds its
//! hit's blocks ([`BlockTable::admit`]). Each engine step first frees what the groups' attention
//! no longer reads, then takes new physical blocks for the step's tokens (evicting least
//! recently used cached blocks), then each group in `group_idx` order caches the blocks
//! `[num_cached, num_tokens / B)` the request computed, keeping only the blocks its
//! [`crate::groups::reachable_mask`] allows for the boundaries `num_prompt_tokens − 1` and the
//! junction, and never a null block (a Mamba group holds only its last state). The blocks are the
//! request's own: one whose hash the group caches already becomes a second copy, and is
//! announced like any other. Each group's BlockStored covers the whole token range, lists the
//! kept blocks' hashes and extra keys, and names its parent, the block before the range (whether
//! or not that group holds it). The step's evictions come first in the batch. A finished
//! request frees its blocks ([`Coordinator::free`]).

use crate::cache::{Block, BlockHash, GroupBlock, PrefixCache};
use crate::events::KvEvent;
use crate::groups::{Retention, longest_hit, reachable_mask};
use crate::layout::{KvCacheLayout, KvCacheSpec};
use crate::table::BlockTable;

/// Groups sharing one spec, looked up together (vLLM's `SpecGroup`).
#[derive(Debug, Clone)]
struct AttentionGroup {
    spec: KvCacheSpec,
    group_ids: Vec<u32>,
}

/// The prefix hit of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Hit {
    /// Tokens reused (a multiple of the block size).
    pub tokens: usize,
    /// Tokens some group held beyond the hit (vLLM's `num_uncached_common_prefix_tokens`).
    pub uncached_shared: usize,
}

impl Hit {
    /// vLLM's `shared_prefix_boundary`: `tokens + uncached_shared`, or 0 when nothing is uncached.
    pub fn shared_prefix_boundary(&self) -> usize {
        if self.uncached_shared > 0 {
            self.tokens + self.uncached_shared
        } else {
            0
        }
    }
}

/// One request's blocks as a store sees them.
#[derive(Debug, Clone, Copy)]
pub struct RequestBlocks<'a> {
    /// Every token so far (prompt, then decoded tokens).
    pub tokens: &'a [u32],
    /// Hashes of the full blocks of `tokens`.
    pub blocks: &'a [Block],
    pub num_prompt_tokens: usize,
    /// vLLM's `shared_prefix_boundary` (0: none).
    pub shared_prefix_boundary: usize,
    /// LoRA adapter `(name, id)` the request runs under.
    pub lora: Option<(&'a str, u32)>,
}

/// The coordinator of one replica's KV cache groups.
#[derive(Debug, Clone)]
pub struct Coordinator {
    layout: KvCacheLayout,
    attention: Vec<AttentionGroup>,
    block_size: usize,
    retention: Retention,
}

impl Coordinator {
    pub fn new(layout: &KvCacheLayout, block_size: usize, retention: Option<u32>) -> Self {
        let mut attention: Vec<AttentionGroup> = Vec::new();
        for (id, spec) in layout.indexed() {
            match attention.iter_mut().find(|g| g.spec == spec) {
                Some(g) => g.group_ids.push(id),
                None => attention.push(AttentionGroup {
                    spec,
                    group_ids: vec![id],
                }),
            }
        }
        // Full attention first (a stable sort keeps the others in group order).
        attention.sort_by_key(|g| !g.spec.is_full_attention());
        Self {
            layout: layout.clone(),
            attention,
            block_size: block_size.max(1),
            retention: Retention(retention),
        }
    }

    pub fn layout(&self) -> &KvCacheLayout {
        &self.layout
    }

    fn held_by_all(cache: &PrefixCache, hash: &BlockHash, ids: &[u32]) -> bool {
        ids.iter().all(|g| cache.holds(hash, *g))
    }

    /// The fixed point of the groups' hits for `blocks`, at most `max_length` tokens.
    pub fn longest_hit(&self, cache: &PrefixCache, blocks: &[Block], max_length: usize) -> Hit {
        let bs = self.block_size;
        let simple_hybrid =
            self.attention.len() == 2 && self.attention.iter().any(|g| g.spec.is_full_attention());
        let mut hit = max_length;
        let mut longest = 0;
        let mut full_hits: Vec<Option<usize>> = vec![None; self.attention.len()];
        loop {
            let mut curr = hit;
            for (g, full_hit) in self.attention.iter().zip(full_hits.iter_mut()) {
                if let Some(h) = full_hit {
                    // Downward-closed: trim, no second lookup.
                    curr = curr.min(*h);
                    continue;
                }
                let cached = |i: usize| {
                    blocks
                        .get(i)
                        .is_some_and(|b| Self::held_by_all(cache, &b.hash, &g.group_ids))
                };
                curr = longest_hit(g.spec, bs, curr, cached);
                if g.spec.is_full_attention() {
                    *full_hit = Some(curr);
                }
                longest = longest.max(curr);
            }
            if curr >= hit {
                break;
            }
            hit = curr;
            if simple_hybrid {
                break;
            }
        }
        Hit {
            tokens: hit,
            uncached_shared: longest.saturating_sub(hit),
        }
    }

    /// Admits a request whose hit is `hit`: it holds the hit's blocks (see [`BlockTable`]).
    pub fn admit(&self, cache: &mut PrefixCache, blocks: &[Block], hit: Hit) -> BlockTable {
        BlockTable::admit(
            self.layout.groups(),
            self.block_size,
            cache.pool_mut(),
            blocks,
            hit.tokens,
        )
    }

    /// One engine step of the request, computing up to `num_tokens` (vLLM's `allocate_slots`
    /// then `cache_blocks`): frees skipped blocks, takes blocks for the new tokens and caches
    /// the full blocks computed since the last store. Returns the batch: BlockRemoved for the
    /// evictions, then one BlockStored per group when some block filled (empty: nothing to
    /// announce).
    pub fn cache_blocks(
        &self,
        cache: &mut PrefixCache,
        table: &mut BlockTable,
        req: RequestBlocks<'_>,
        num_tokens: usize,
    ) -> Vec<KvEvent> {
        let bs = self.block_size;
        let specs = self.layout.groups();
        let mut evicted = Vec::new();
        let pool = cache.pool_mut();
        table.remove_skipped(specs, bs, pool, &mut evicted);
        table.allocate(specs, bs, num_tokens, pool, &mut evicted);
        table.num_computed = table.num_computed.max(num_tokens);
        let mut events = removed(evicted);
        let start = table.num_cached;
        let full = (num_tokens / bs).min(req.blocks.len());
        if start >= full {
            return events;
        }
        table.num_cached = full;
        let mut boundaries = vec![req.num_prompt_tokens.saturating_sub(1)];
        if req.shared_prefix_boundary > 0 {
            boundaries.push(req.shared_prefix_boundary);
        }
        let token_ids = req
            .tokens
            .get(start * bs..full * bs)
            .unwrap_or_default()
            .to_vec();
        let parent = start
            .checked_sub(1)
            .and_then(|i| req.blocks.get(i))
            .map(|b| b.hash);
        for (group_idx, spec) in self.layout.indexed() {
            let mask = reachable_mask(spec, bs, start, full, self.retention, &boundaries);
            let mut listed: Vec<&Block> = Vec::new();
            for (i, b) in req.blocks.iter().enumerate().take(full).skip(start) {
                let allowed = mask
                    .as_ref()
                    .is_none_or(|m| m.get(i - start) == Some(&true));
                if let Some(id) = table.block(group_idx as usize, i)
                    && allowed
                {
                    pool.cache(id, (b.hash, group_idx));
                    listed.push(b);
                }
            }
            events.push(KvEvent::BlockStored {
                block_hashes: listed.iter().map(|b| b.hash).collect(),
                parent_block_hash: parent,
                token_ids: token_ids.clone(),
                block_size: u32::try_from(bs).unwrap_or(u32::MAX),
                lora_id: req.lora.map(|(_, id)| id),
                lora_name: req.lora.map(|(name, _)| name.to_owned()),
                extra_keys: listed.iter().map(|b| b.extra_keys.clone()).collect(),
                group_idx,
                spec,
            });
        }
        events
    }

    /// The request finished (or went away): frees its blocks. Returns BlockRemoved for blocks
    /// the pool lent beyond capacity and took back (empty unless every block was held).
    pub fn free(&self, cache: &mut PrefixCache, table: BlockTable) -> Vec<KvEvent> {
        let mut evicted = Vec::new();
        table.free(cache.pool_mut(), &mut evicted);
        removed(evicted)
    }
}

fn removed(evicted: Vec<GroupBlock>) -> Vec<KvEvent> {
    evicted
        .into_iter()
        .map(|(hash, group_idx)| KvEvent::BlockRemoved {
            block_hashes: vec![hash],
            group_idx,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::BlockScope;

    const BS: usize = 64;

    fn coordinator(layout: &str) -> Coordinator {
        Coordinator::new(&layout.parse().unwrap(), BS, Some(0))
    }

    /// One request: hit, prefill steps (`budget`), then `output` decoded tokens (the last one
    /// sampled is never cached). Returns the hit and every batch.
    struct Run {
        hit: Hit,
        batches: Vec<Vec<KvEvent>>,
    }

    fn run(
        c: &Coordinator,
        cache: &mut PrefixCache,
        prompt: &[u32],
        output: &[u32],
        budget: Option<usize>,
    ) -> Run {
        let blocks = cache.blocks(prompt, BlockScope::default());
        let hit = c.longest_hit(cache, &blocks, prompt.len() - 1);
        let req = RequestBlocks {
            tokens: prompt,
            blocks: &blocks,
            num_prompt_tokens: prompt.len(),
            shared_prefix_boundary: hit.shared_prefix_boundary(),
            lora: None,
        };
        let mut table = c.admit(cache, &blocks, hit);
        let mut batches = Vec::new();
        let steps = crate::schedule::prefill_steps(
            hit.tokens,
            prompt.len(),
            budget,
            BS,
            c.layout().has_mamba(),
            req.shared_prefix_boundary,
        );
        for end in steps {
            batches.push(c.cache_blocks(cache, &mut table, req, end));
        }
        let mut all = prompt.to_vec();
        all.extend_from_slice(&output[..output.len().saturating_sub(1)]);
        let all_blocks = cache.blocks(&all, BlockScope::default());
        let req = RequestBlocks {
            tokens: &all,
            blocks: &all_blocks,
            ..req
        };
        // One decode step per token; their events as one batch.
        let mut decode = Vec::new();
        for end in prompt.len() + 1..=all.len() {
            decode.extend(c.cache_blocks(cache, &mut table, req, end));
        }
        batches.push(decode);
        batches.push(c.free(cache, table));
        batches.retain(|b| !b.is_empty());
        Run { hit, batches }
    }

    /// `(group_idx, listed block positions, token count, parent position)` of each BlockStored.
    fn stores(batch: &[KvEvent], blocks: &[Block]) -> Vec<(u32, Vec<usize>, usize, Option<usize>)> {
        let pos = |h: &BlockHash| blocks.iter().position(|b| b.hash == *h).unwrap();
        batch
            .iter()
            .filter_map(|e| match e {
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    group_idx,
                    ..
                } => Some((
                    *group_idx,
                    block_hashes.iter().map(pos).collect(),
                    token_ids.len(),
                    parent_block_hash.as_ref().map(pos),
                )),
                _ => None,
            })
            .collect()
    }

    fn tokens(n: usize, seed: u32) -> Vec<u32> {
        (0..n as u32).map(|i| 1_000 + seed * 100_000 + i).collect()
    }

    /// Caches a copy of `hash` in `group`, free (evictable).
    fn hold(cache: &mut PrefixCache, hash: BlockHash, group: u32) {
        let pool = cache.pool_mut();
        let mut evicted = Vec::new();
        let id = pool.allocate(&mut evicted);
        pool.cache(id, (hash, group));
        pool.free([id], &mut evicted);
        assert!(evicted.is_empty());
    }

    fn new_cache() -> PrefixCache {
        PrefixCache::new(BS, 100_000, "t")
    }

    #[test]
    fn one_full_group_is_a_leading_run() {
        let c = coordinator("full_attention");
        let mut cache = new_cache();
        let p = tokens(700, 0);
        let first = run(&c, &mut cache, &p, &[], None);
        assert_eq!(first.hit.tokens, 0);
        let blocks = cache.blocks(&p, BlockScope::default());
        assert_eq!(
            stores(&first.batches[0], &blocks),
            [(0, (0..10).collect(), 640, None)]
        );
        let again = run(&c, &mut cache, &p, &[], None);
        assert_eq!(
            again.hit,
            Hit {
                tokens: 640,
                uncached_shared: 0
            }
        );
        assert!(again.batches.is_empty());
        // A block-aligned prompt resent whole: the hit stops one block short (n − 1 tokens), so
        // the last block is computed again into a block of its own and announced: a copy.
        let aligned = tokens(640, 0);
        let resend = run(&c, &mut cache, &aligned, &[], None);
        assert_eq!(resend.hit.tokens, 576);
        assert_eq!(
            stores(&resend.batches[0], &blocks),
            [(0, vec![9], 64, Some(8))]
        );
        assert_eq!(cache.pool().copies_of(&(blocks[9].hash, 0)), 2);
        assert_eq!(cache.len(), 11);
    }

    /// `BlockRemoved` of one event per (hash, group) in a batch.
    fn removed_positions(batches: &[Vec<KvEvent>], blocks: &[Block]) -> Vec<(u32, usize)> {
        batches
            .iter()
            .flatten()
            .filter_map(|e| match e {
                KvEvent::BlockRemoved {
                    block_hashes,
                    group_idx,
                } => Some((
                    *group_idx,
                    blocks
                        .iter()
                        .position(|x| x.hash == block_hashes[0])
                        .unwrap(),
                )),
                _ => None,
            })
            .collect()
    }

    /// Two copies of one block: each is evicted on its own with its own BlockRemoved, and the
    /// block stays a hit until the second goes.
    #[test]
    fn copies_are_evicted_one_by_one() {
        let c = coordinator("full_attention");
        // Exactly the 10 blocks of the prompt plus the copy.
        let mut cache = PrefixCache::new(BS, 11, "t");
        let p = tokens(640, 0);
        let blocks = cache.blocks(&p, BlockScope::default());
        run(&c, &mut cache, &p, &[], None);
        let resend = run(&c, &mut cache, &p, &[], None);
        assert_eq!(resend.hit.tokens, 576);
        assert_eq!(stores(&resend.batches[0], &blocks)[0].1, [9]);
        let longer = [p.clone(), tokens(10, 1)].concat();
        let held = |cache: &PrefixCache| c.longest_hit(cache, &blocks, longer.len()).tokens;
        assert_eq!(held(&cache), 640);
        // The resend freed its blocks tail first after the first request's: the first
        // request's copy of block 9 is the least recently used block.
        let evict_one = |cache: &mut PrefixCache, seed: u32| {
            let r = run(&c, cache, &tokens(64, seed), &[], None);
            removed_positions(&r.batches, &blocks)
        };
        assert_eq!(evict_one(&mut cache, 2), [(0, 9)]);
        assert_eq!(cache.pool().copies_of(&(blocks[9].hash, 0)), 1);
        assert_eq!(held(&cache), 640, "the other copy still serves the hit");
        assert_eq!(evict_one(&mut cache, 3), [(0, 9)]);
        assert!(!cache.holds(&blocks[9].hash, 0));
        assert_eq!(held(&cache), 576);
    }

    /// The captured prompt's shape: 2,701 tokens, chunks of 2,048, window 256 in 64-token blocks.
    #[test]
    fn sliding_group_keeps_only_the_boundary_tail() {
        let c = coordinator("sliding_window:256,full_attention");
        let mut cache = new_cache();
        let p = tokens(2_701, 0);
        let blocks = cache.blocks(&p, BlockScope::default());
        let r = run(&c, &mut cache, &p, &[], Some(2_048));
        assert_eq!(r.batches.len(), 2);
        assert_eq!(
            stores(&r.batches[0], &blocks),
            [
                (0, vec![], 2_048, None),
                (1, (0..32).collect(), 2_048, None)
            ]
        );
        assert_eq!(
            stores(&r.batches[1], &blocks),
            [
                (0, (38..42).collect(), 640, Some(31)),
                (1, (32..42).collect(), 640, Some(31))
            ]
        );
        if let KvEvent::BlockStored { extra_keys, .. } = &r.batches[0][0] {
            assert!(extra_keys.is_empty());
        }
        assert_eq!(cache.len(), 4 + 42);
        // The same prompt again: the tail serves the whole hit.
        assert_eq!(
            c.longest_hit(&cache, &blocks, 2_700),
            Hit {
                tokens: 2_688,
                uncached_shared: 0
            }
        );
    }

    /// vLLM on the tiny Gemma-3-style model, one conversation: each turn hits the previous
    /// prompt's boundary (3,200, then 3,264, then 3,392), never the decode-filled blocks that only
    /// the full group caches.
    #[test]
    fn multi_turn_hits_land_on_the_previous_prompt_boundary() {
        let c = coordinator("sliding_window:256,full_attention");
        let mut cache = new_cache();
        let mut prompt = tokens(3_210, 0);
        let mut hits = Vec::new();
        for turn in 0..4u32 {
            let output = tokens(40, 10 + turn);
            let r = run(&c, &mut cache, &prompt, &output, None);
            hits.push(r.hit.tokens);
            let mut all = prompt.clone();
            all.extend_from_slice(&output[..39]);
            let blocks = cache.blocks(&all, BlockScope::default());
            let decode = r.batches.last().unwrap();
            if turn == 0 {
                // Prompt: sliding caches 46..50 only; decode adds no full block (3,249 tokens).
                assert_eq!(
                    stores(&r.batches[0], &blocks)[0].1,
                    (46..50).collect::<Vec<_>>()
                );
                assert_eq!(r.batches.len(), 1);
            }
            if turn == 1 {
                // Prompt 3,320: block 50 in both groups (the tail of its own boundary 51).
                assert_eq!(
                    stores(&r.batches[0], &blocks),
                    [(0, vec![50], 64, Some(49)), (1, vec![50], 64, Some(49))]
                );
                // Decode-filled block 51: the full group only.
                assert_eq!(
                    stores(decode, &blocks),
                    [(0, vec![], 64, Some(50)), (1, vec![51], 64, Some(50))]
                );
            }
            prompt = [prompt.clone(), output, tokens(70, 20 + turn)].concat();
        }
        assert_eq!(hits, [0, 3_200, 3_264, 3_392]);
    }

    /// A system prompt cached by one request is no hit for the next on a sliding model (only
    /// the full group holds its blocks), but the junction makes that request retain the tail, so
    /// the third one hits.
    #[test]
    fn shared_prefix_junction_is_retained() {
        let c = coordinator("sliding_window:256,full_attention");
        let mut cache = new_cache();
        let system = tokens(1_024, 0);
        let ask = |i: u32| [system.clone(), tokens(500, 1 + i)].concat();
        let a = run(&c, &mut cache, &ask(0), &[], None);
        assert_eq!(a.hit.tokens, 0);
        let b = run(&c, &mut cache, &ask(1), &[], None);
        assert_eq!(
            b.hit,
            Hit {
                tokens: 0,
                uncached_shared: 1_024
            }
        );
        let blocks = cache.blocks(&ask(1), BlockScope::default());
        let kept = &stores(&b.batches[0], &blocks)[0].1;
        assert_eq!(kept, &[12, 13, 14, 15, 19, 20, 21, 22]);
        let third = run(&c, &mut cache, &ask(2), &[], None);
        assert_eq!(third.hit.tokens, 1_024);
    }

    #[test]
    fn mamba_hits_the_rightmost_state() {
        let c = coordinator("mamba,full_attention");
        let mut cache = new_cache();
        let p = tokens(1_000, 0);
        let blocks = cache.blocks(&p, BlockScope::default());
        let r = run(&c, &mut cache, &p, &[], None);
        // One step up to ⌊999 / 64⌋ × 64 = 960: the state of block 14 is kept.
        assert_eq!(
            stores(&r.batches[0], &blocks),
            [(0, vec![14], 960, None), (1, (0..15).collect(), 960, None)]
        );
        let longer = [p[..960].to_vec(), tokens(200, 1)].concat();
        assert_eq!(run(&c, &mut cache, &longer, &[], None).hit.tokens, 960);
        // Diverging inside block 14: the full group holds 14 blocks, Mamba no state before 15.
        let shorter = [p[..900].to_vec(), tokens(200, 2)].concat();
        let s = run(&c, &mut cache, &shorter, &[], None);
        assert_eq!(
            s.hit,
            Hit {
                tokens: 0,
                uncached_shared: 896
            }
        );
        // Its prefill stopped at the junction, so the state there is kept: the next one hits.
        let next = [p[..900].to_vec(), tokens(200, 3)].concat();
        assert_eq!(run(&c, &mut cache, &next, &[], None).hit.tokens, 896);
    }

    #[test]
    fn chunked_local_and_merged_groups() {
        // Chunked local caches densely: with full attention it hits what full attention hits.
        let c = coordinator("chunked_local_attention:256,full_attention");
        let mut cache = new_cache();
        let p = tokens(700, 0);
        run(&c, &mut cache, &p, &[], None);
        assert_eq!(run(&c, &mut cache, &p, &[], None).hit.tokens, 640);
        // Identical sliding groups are looked up together: a block both hold.
        let c = coordinator("sliding_window:128,sliding_window:128,full_attention");
        let mut cache = new_cache();
        let p = tokens(1_000, 0);
        let blocks = cache.blocks(&p, BlockScope::default());
        run(&c, &mut cache, &p, &[], None);
        assert_eq!(c.longest_hit(&cache, &blocks, 999).tokens, 960);
        cache.clear();
        for b in &blocks[..15] {
            hold(&mut cache, b.hash, 0);
            hold(&mut cache, b.hash, 2);
        }
        assert_eq!(
            c.longest_hit(&cache, &blocks, 999).tokens,
            0,
            "group 1 holds nothing"
        );
    }

    #[test]
    fn evictions_name_their_group_tail_first() {
        let c = coordinator("sliding_window:128,full_attention");
        // A 640-token request holds 10 blocks in each group while it runs.
        let mut cache = PrefixCache::new(BS, 20, "t");
        let a = tokens(640, 0);
        let a_blocks = cache.blocks(&a, BlockScope::default());
        run(&c, &mut cache, &a, &[], None);
        // Cached: the sliding tail at the boundary 639 (blocks 7, 8) and every full block.
        assert_eq!(cache.len(), 2 + 10);
        // B takes 7 blocks per group: the 8 uncached free blocks first, then the least recently
        // used. A freed group 0 first, each group tail first.
        let b = run(&c, &mut cache, &tokens(400, 1), &[], None);
        assert_eq!(
            removed_positions(&b.batches, &a_blocks),
            [(0, 8), (0, 7), (1, 9), (1, 8), (1, 7), (1, 6)]
        );
        // B cached its sliding tail (blocks 4, 5) and its 6 full blocks.
        assert_eq!(cache.len(), 6 + 8);
    }

    /// A running request's blocks are not evicted: the pool lends one beyond capacity and takes
    /// it back when blocks are freed.
    #[test]
    fn running_requests_keep_their_blocks() {
        let c = coordinator("full_attention");
        let mut cache = PrefixCache::new(BS, 4, "t");
        let a = tokens(256, 0);
        let a_blocks = cache.blocks(&a, BlockScope::default());
        let hit = c.longest_hit(&cache, &a_blocks, 255);
        let mut a_table = c.admit(&mut cache, &a_blocks, hit);
        let a_req = RequestBlocks {
            tokens: &a,
            blocks: &a_blocks,
            num_prompt_tokens: 256,
            shared_prefix_boundary: 0,
            lora: None,
        };
        let stored = c.cache_blocks(&mut cache, &mut a_table, a_req, 256);
        assert_eq!(
            stores(&stored, &a_blocks),
            [(0, (0..4).collect(), 256, None)]
        );
        // A still runs: B gets a block beyond capacity, nothing of A's is evicted. When B
        // finishes the pool takes that block back, evicting the least recently used cached
        // block: B's own.
        let b_prompt = tokens(64, 1);
        let b_blocks = cache.blocks(&b_prompt, BlockScope::default());
        let b = run(&c, &mut cache, &b_prompt, &[], None);
        assert_eq!(stores(&b.batches[0], &b_blocks), [(0, vec![0], 64, None)]);
        assert_eq!(removed_positions(&b.batches[1..], &b_blocks), [(0, 0)]);
        assert!(a_blocks.iter().all(|x| cache.holds(&x.hash, 0)));
        assert_eq!(cache.len(), 4);
        assert!(c.free(&mut cache, a_table).is_empty());
        assert_eq!(cache.pool().used_blocks(), 0);
    }
}
