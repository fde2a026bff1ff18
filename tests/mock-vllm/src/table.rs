//! A running request's blocks in every KV cache group (vLLM 0.32's `req_to_blocks` of each
//! single-type manager, `single_type_kv_cache_manager.py`): which physical blocks it holds, in
//! block-position order, `None` for vLLM's null block.
//!
//! - **Admission** (`add_local_computed_blocks`): the hit's blocks the group still reads are
//!   looked up (the oldest copy) and held; the ones before them ([`skipped_tokens`] of the hit)
//!   are null.
//! - **Each step** (`allocate_slots`): first the blocks the attention no longer reads are freed
//!   (`remove_skipped_blocks`, tail first), then new blocks give every
//!   group room for the step's tokens (`allocate_new_blocks`, group by group). A Mamba group
//!   ("align" mode) holds only the block of the last state: it pads with nulls and takes one
//!   block when the tokens reach a new block.
//! - **Finish** (`free`): group by group in `group_idx` order, each group's blocks tail first.

use crate::cache::{Block, GroupBlock};
use crate::groups::skipped_tokens;
use crate::layout::KvCacheSpec;
use crate::pool::{BlockId, BlockPool};

/// One request's blocks per group and how far it has cached and computed.
#[derive(Debug, Clone, Default)]
pub struct BlockTable {
    /// Per group (`group_idx` order), per block position.
    groups: Vec<Vec<Option<BlockId>>>,
    /// Per group: every block before this position is null (freed or never held).
    freed_to: Vec<usize>,
    /// Leading blocks already cached (vLLM's `num_cached_block`, equal in every group).
    pub num_cached: usize,
    /// Tokens computed (or reused from the cache) so far.
    pub num_computed: usize,
}

impl BlockTable {
    /// A request admitted with a hit of `hit_tokens` (a multiple of `block_size`) over `blocks`:
    /// holds the hit's blocks each group reads.
    pub fn admit(
        specs: &[KvCacheSpec],
        block_size: usize,
        pool: &mut BlockPool,
        blocks: &[Block],
        hit_tokens: usize,
    ) -> Self {
        let bs = block_size.max(1);
        let hit_blocks = (hit_tokens / bs).min(blocks.len());
        let freed_to: Vec<usize> = specs
            .iter()
            .map(|spec| (skipped_tokens(*spec, hit_tokens) / bs).min(hit_blocks))
            .collect();
        let groups = (0u32..)
            .zip(&freed_to)
            .map(|(group, skip)| {
                let skip = *skip;
                let row: Vec<Option<BlockId>> = blocks
                    .iter()
                    .take(hit_blocks)
                    .enumerate()
                    .map(|(i, b)| (i >= skip).then(|| pool.lookup(&(b.hash, group))).flatten())
                    .collect();
                for id in row.iter().flatten() {
                    pool.touch(*id);
                }
                row
            })
            .collect();
        Self {
            groups,
            freed_to,
            num_cached: hit_blocks,
            num_computed: hit_blocks * bs,
        }
    }

    /// The physical block at position `i` of `group`.
    pub fn block(&self, group: usize, i: usize) -> Option<BlockId> {
        self.groups.get(group).and_then(|row| row.get(i)).copied()?
    }

    /// Frees, in every group, the blocks its attention no longer reads with `num_computed`
    /// tokens computed.
    pub fn remove_skipped(
        &mut self,
        specs: &[KvCacheSpec],
        block_size: usize,
        pool: &mut BlockPool,
        evicted: &mut Vec<GroupBlock>,
    ) {
        let bs = block_size.max(1);
        for ((spec, row), freed_to) in specs.iter().zip(&mut self.groups).zip(&mut self.freed_to) {
            let skip = (skipped_tokens(*spec, self.num_computed) / bs).min(row.len());
            if skip <= *freed_to {
                continue;
            }
            // Tail first; a Mamba group has nulls between its states.
            let freed: Vec<BlockId> = row
                .get_mut(*freed_to..skip)
                .into_iter()
                .flatten()
                .rev()
                .filter_map(Option::take)
                .collect();
            *freed_to = skip;
            pool.free(freed, evicted);
        }
    }

    /// Gives every group blocks for `num_tokens` tokens, group by group; evictions are pushed to
    /// `evicted` in allocation order.
    pub fn allocate(
        &mut self,
        specs: &[KvCacheSpec],
        block_size: usize,
        num_tokens: usize,
        pool: &mut BlockPool,
        evicted: &mut Vec<GroupBlock>,
    ) {
        let need = num_tokens.div_ceil(block_size.max(1));
        for (spec, row) in specs.iter().zip(&mut self.groups) {
            if row.len() >= need {
                continue;
            }
            if *spec == KvCacheSpec::Mamba {
                row.resize(need - 1, None);
            }
            while row.len() < need {
                row.push(Some(pool.allocate(evicted)));
            }
        }
    }

    /// The request is done: frees its blocks group by group, each tail first.
    pub fn free(self, pool: &mut BlockPool, evicted: &mut Vec<GroupBlock>) {
        for row in self.groups {
            pool.free(row.into_iter().rev().flatten(), evicted);
        }
    }
}
