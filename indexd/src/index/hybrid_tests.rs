//! The index on hybrid models against vLLM's own algorithm: random streams
//! of what vLLM 0.32 caches per KV cache group (dense full-attention
//! stores, sparse sliding-window and Mamba stores listing some blocks of
//! their range, removals per group, clears) go to the index as events and to
//! a ground truth of what each group holds; every query's hit, computed by
//! the index from the events, equals what a transcription of vLLM's
//! `HybridKVCacheCoordinator.find_longest_cache_hit` and its managers
//! computes from the ground truth.

use std::collections::{BTreeMap, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::time::Instant;

use kvroute_proto::keys::{BlockSize, block_keys};
use proptest::prelude::*;

use super::*;
use crate::event::{BlockRemoved, BlockStored, ExtraKeys, FullLabel, GroupKind};

/// Tokens per block.
const B: u32 = 4;

/// A KV cache group's spec, as the reference sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Spec {
    Full,
    /// Window in tokens.
    Sliding(u32),
    Mamba,
    /// Chunk in tokens.
    Chunked(u32),
}

impl Spec {
    fn kind(self) -> GroupKind {
        match self {
            Spec::Full => GroupKind::FullAttention(FullLabel::Full),
            Spec::Sliding(_) => GroupKind::SlidingWindow { mla: false },
            Spec::Mamba => GroupKind::Mamba,
            Spec::Chunked(_) => GroupKind::ChunkedLocal,
        }
    }

    fn chunk(self) -> Option<u32> {
        match self {
            Spec::Chunked(c) => Some(c),
            _ => None,
        }
    }

    fn window(self) -> Option<u32> {
        match self {
            Spec::Sliding(w) => Some(w),
            _ => None,
        }
    }
}

/// The layouts tried: gpt-oss / Gemma 3 (sliding first), full first,
/// Mamba hybrids, two sliding groups of one spec (looked up together in
/// vLLM), three kinds (no one-iteration shortcut), one sliding group,
/// Llama 4 (three chunked-local groups, then full), chunked and sliding.
fn layouts() -> Vec<Vec<Spec>> {
    vec![
        vec![Spec::Sliding(9), Spec::Full],
        vec![Spec::Sliding(5), Spec::Full],
        vec![Spec::Full, Spec::Sliding(13)],
        vec![Spec::Full, Spec::Mamba],
        vec![Spec::Sliding(9), Spec::Sliding(9), Spec::Full],
        vec![Spec::Full, Spec::Sliding(8), Spec::Mamba],
        vec![Spec::Sliding(9)],
        vec![
            Spec::Chunked(8),
            Spec::Chunked(8),
            Spec::Chunked(8),
            Spec::Full,
        ],
        vec![Spec::Chunked(12), Spec::Sliding(9), Spec::Full],
    ]
}

#[derive(Clone, Debug)]
struct Prompt {
    ids: Vec<u8>,
    /// Tokens past the last full block.
    tail: u32,
}

impl Prompt {
    fn tokens(&self) -> Vec<u32> {
        let mut t: Vec<u32> = self
            .ids
            .iter()
            .flat_map(|id| (0..B).map(move |j| u32::from(*id) * 10 + j))
            .collect();
        t.extend((0..self.tail).map(|j| 900 + j));
        t
    }

    fn block_tokens(&self, i: usize) -> Vec<u32> {
        let id = u32::from(self.ids[i]);
        (0..B).map(|j| id * 10 + j).collect()
    }

    /// The engine's hash of block `i`: a function of every block up to it
    /// (the same in every group).
    fn hash(&self, i: usize) -> u64 {
        let mut h = DefaultHasher::new();
        self.ids[..=i].hash(&mut h);
        h.finish()
    }
}

#[derive(Clone, Debug)]
enum Op {
    /// A request's `cache_blocks` over blocks `start..` of `p`: per group, a
    /// mask of the blocks a sparse group keeps.
    Store {
        slot: u32,
        p: Prompt,
        start: prop::sample::Index,
        masks: Vec<Vec<bool>>,
    },
    Remove {
        slot: u32,
        group: prop::sample::Index,
        p: Prompt,
        at: prop::sample::Index,
    },
    Clear {
        slot: u32,
    },
    Query {
        p: Prompt,
    },
}

fn prompt() -> impl Strategy<Value = Prompt> {
    (prop::collection::vec(0u8..3, 1..12), 0..B).prop_map(|(ids, tail)| Prompt { ids, tail })
}

fn op() -> impl Strategy<Value = Op> {
    let slot = 0u32..3;
    prop_oneof![
        6 => (
            slot.clone(),
            prompt(),
            any::<prop::sample::Index>(),
            prop::collection::vec(prop::collection::vec(prop::bool::weighted(0.35), 12), 3),
        )
            .prop_map(|(slot, p, start, masks)| Op::Store { slot, p, start, masks }),
        3 => (slot.clone(), any::<prop::sample::Index>(), prompt(), any::<prop::sample::Index>())
            .prop_map(|(slot, group, p, at)| Op::Remove { slot, group, p, at }),
        1 => slot.prop_map(|slot| Op::Clear { slot }),
        5 => prompt().prop_map(|p| Op::Query { p }),
    ]
}

/// What each replica's groups hold: per engine hash, its physical copies
/// (a request that missed a held block computes it into another).
type Truth = HashMap<u32, Vec<BTreeMap<u64, u32>>>;

/// vLLM 0.32's `find_longest_cache_hit`, transcribed from
/// `kv_cache_coordinator.py` and `single_type_kv_cache_manager.py` (no
/// EAGLE, one block size: alignment is the block size). `held(g, i)`: group
/// `g` caches block `i` of the request. Returns the hit in tokens.
fn vllm_hit(specs: &[Spec], max_cache_hit_length: u32, held: &dyn Fn(usize, usize) -> bool) -> u32 {
    // verify_and_split_kv_cache_groups: equal specs share one lookup; full
    // attention first (a stable sort).
    let mut attention_groups: Vec<(Spec, Vec<usize>)> = Vec::new();
    for (i, spec) in specs.iter().enumerate() {
        match attention_groups.iter_mut().find(|(s, _)| s == spec) {
            Some((_, ids)) => ids.push(i),
            None => attention_groups.push((*spec, vec![i])),
        }
    }
    attention_groups.sort_by_key(|(s, _)| *s != Spec::Full);
    // get_cached_block: a hit for every group of the lookup, or none.
    let cached = |ids: &[usize], i: usize| ids.iter().all(|g| held(*g, i));
    let find = |spec: Spec, ids: &[usize], max_length: u32| -> u32 {
        let max_num_blocks = (max_length / B) as usize;
        match spec {
            Spec::Full => {
                let mut n = 0;
                for i in 0..max_num_blocks {
                    if !cached(ids, i) {
                        break;
                    }
                    n += 1;
                }
                n * B
            }
            Spec::Sliding(window) => {
                let contiguous = (window - 1).div_ceil(B) as usize;
                let mut num_contiguous_blocks = 0;
                for i in (0..max_num_blocks).rev() {
                    if cached(ids, i) {
                        num_contiguous_blocks += 1;
                        if num_contiguous_blocks >= contiguous {
                            return (i + num_contiguous_blocks) as u32 * B;
                        }
                    } else {
                        num_contiguous_blocks = 0;
                    }
                }
                num_contiguous_blocks as u32 * B
            }
            Spec::Mamba => {
                for i in (0..max_num_blocks).rev() {
                    if cached(ids, i) {
                        return (i as u32 + 1) * B;
                    }
                }
                0
            }
            Spec::Chunked(attention_chunk_size) => {
                let local_attention_start_idx = if max_length > 0 {
                    max_length / attention_chunk_size * attention_chunk_size
                } else {
                    0
                };
                let start_block = (local_attention_start_idx / B) as usize;
                let mut n = start_block;
                for i in start_block..max_num_blocks {
                    if !cached(ids, i) {
                        break;
                    }
                    n += 1;
                }
                n as u32 * B
            }
        }
    };
    let num_groups = specs.len();
    let mut hit_length = max_cache_hit_length;
    let mut hit_blocks_by_group: Vec<bool> = vec![false; num_groups];
    let mut hit_length_by_group = vec![0u32; num_groups];
    let is_simple_hybrid = attention_groups.len() == 2 && attention_groups[0].0 == Spec::Full;
    loop {
        let mut curr_hit_length = hit_length;
        for (spec, group_ids) in &attention_groups {
            let first = group_ids[0];
            if *spec == Spec::Full && hit_blocks_by_group[first] {
                curr_hit_length = curr_hit_length.min(hit_length_by_group[first]);
                continue;
            }
            let new_hit_length = find(*spec, group_ids, curr_hit_length);
            curr_hit_length = new_hit_length;
            for g in group_ids {
                hit_blocks_by_group[*g] = true;
                hit_length_by_group[*g] = new_hit_length;
            }
        }
        if curr_hit_length >= hit_length {
            break;
        }
        hit_length = curr_hit_length;
        if is_simple_hybrid {
            break;
        }
    }
    hit_length
}

/// The events vLLM emits for one `cache_blocks` call: per group in order,
/// the range's tokens, the parent's hash, the hashes the group keeps.
fn store_events(
    specs: &[Spec],
    p: &Prompt,
    start: usize,
    masks: &[Vec<bool>],
) -> Vec<(usize, Vec<usize>, KvEvent)> {
    let n = p.ids.len();
    let tokens: Vec<u32> = (start..n).flat_map(|i| p.block_tokens(i)).collect();
    let mut out = Vec::new();
    for (g, spec) in specs.iter().enumerate() {
        // Full and chunked-local attention keep every block (no mask); a
        // lone group caches densely (the unitary coordinator sets no
        // alignment, so no mask).
        let dense = matches!(spec, Spec::Full | Spec::Chunked(_)) || specs.len() == 1;
        let kept: Vec<usize> = (start..n)
            .filter(|i| {
                dense
                    || masks
                        .get(g)
                        .and_then(|m| m.get(*i))
                        .copied()
                        .unwrap_or(false)
            })
            .collect();
        let ev = KvEvent::BlockStored(BlockStored {
            block_hashes: kept.iter().map(|i| EngineHash(p.hash(*i))).collect(),
            parent: (start > 0).then(|| EngineHash(p.hash(start - 1))),
            token_ids: tokens.clone(),
            block_size: B,
            tier: Tier::Gpu,
            lora_name: None,
            // vLLM omits the key when no block is kept.
            extra_keys: (!kept.is_empty()).then(|| vec![ExtraKeys::None; kept.len()]),
            group_idx: g as u32,
            kind: Some(spec.kind()),
            sliding_window: spec.window(),
        });
        out.push((g, kept, ev));
    }
    out
}

fn run(specs: &[Spec], ops: &[Op]) -> Result<(), TestCaseError> {
    let mut ix = Index::new(1 << 20, 1 << 10);
    let mut truth: Truth = HashMap::new();
    let mut stats = ApplyStats::default();
    let slots = [ReplicaSlot(0), ReplicaSlot(1), ReplicaSlot(2)];
    let lookup = ix.lookup();
    for op in ops {
        match op {
            Op::Store {
                slot,
                p,
                start,
                masks,
            } => {
                let held = truth
                    .entry(*slot)
                    .or_insert_with(|| vec![BTreeMap::new(); specs.len()]);
                // A range continues a block the replica holds (a running
                // request's blocks are never evicted under it).
                let mut start = start.index(p.ids.len());
                if start > 0 && !held.iter().any(|g| g.contains_key(&p.hash(start - 1))) {
                    start = 0;
                }
                for (g, kept, ev) in store_events(specs, p, start, masks) {
                    ix.apply(ReplicaSlot(*slot), "m", &ev, &mut stats);
                    if let Some(copies) = held.get_mut(g) {
                        for i in &kept {
                            *copies.entry(p.hash(*i)).or_default() += 1;
                        }
                    }
                }
            }
            Op::Remove { slot, group, p, at } => {
                let g = group.index(specs.len());
                let h = p.hash(at.index(p.ids.len()));
                ix.apply(
                    ReplicaSlot(*slot),
                    "m",
                    &KvEvent::BlockRemoved(BlockRemoved {
                        block_hashes: vec![EngineHash(h)],
                        tier: Tier::Gpu,
                        group_idx: g as u32,
                    }),
                    &mut stats,
                );
                // One physical copy is evicted.
                if let Some(copies) = truth.get_mut(slot).and_then(|t| t.get_mut(g))
                    && let Some(n) = copies.get_mut(&h)
                {
                    *n -= 1;
                    if *n == 0 {
                        copies.remove(&h);
                    }
                }
            }
            Op::Clear { slot } => {
                ix.apply(
                    ReplicaSlot(*slot),
                    "m",
                    &KvEvent::AllBlocksCleared,
                    &mut stats,
                );
                truth.remove(slot);
            }
            Op::Query { p } => {
                let tokens = p.tokens();
                let keys = block_keys(&tokens, BlockSize::new(B).unwrap(), None);
                let prompt_tokens = tokens.len() as u32;
                let max_blocks = ((prompt_tokens - 1) / B) as usize;
                let q = Query {
                    partition: lookup.partition("m"),
                    keys: &keys,
                    block_size: B,
                    max_blocks: max_blocks.min(keys.len()),
                    chunk_tokens: specs.iter().find_map(|s| s.chunk()),
                    now: Instant::now(),
                };
                let got = lookup.match_query(&q, &slots);
                for (i, m) in got.iter().enumerate() {
                    let empty = Vec::new();
                    let held = truth.get(&(i as u32)).unwrap_or(&empty);
                    let want = vllm_hit(specs, prompt_tokens - 1, &|g, b| {
                        b < p.ids.len() && held.get(g).is_some_and(|s| s.contains_key(&p.hash(b)))
                    }) / B;
                    prop_assert_eq!(m.blocks, want, "replica {} prompt {:?}", i, p);
                    prop_assert!(!m.unmodelled);
                }
            }
        }
        // Every kept block is indexed in its group, none waits.
        let truth_entries: usize = truth.values().flatten().map(BTreeMap::len).sum();
        prop_assert_eq!(ix.parked(), 0);
        prop_assert_eq!(ix.entries(), truth_entries);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn hybrid_hits_equal_vllms_on_random_streams(
        layout in prop::sample::select(layouts()),
        ops in prop::collection::vec(op(), 1..60),
    ) {
        run(&layout, &ops)?;
    }
}

#[test]
fn the_reference_is_vllms_loop_on_the_captured_turns() {
    // vLLM 0.32 on a Gemma-3-style model (window 256 tokens, blocks of 64:
    // 4 blocks needed), turn 2 of a conversation: a 3,430-token prompt, full
    // attention holding blocks 0..52, the sliding group the tails of turns
    // 0 and 1 (46..51). vLLM answered 3,264 cached tokens: 51 blocks. Here
    // in blocks of B tokens, the window scaled alike (4 blocks).
    let specs = [Spec::Sliding(4 * B + 1), Spec::Full];
    let held = |g: usize, i: usize| {
        if g == 1 {
            i < 52
        } else {
            (46..51).contains(&i)
        }
    };
    let max_blocks = (3_430 - 1) / 64;
    let hit = vllm_hit(&specs, max_blocks * B, &|g, i| held(g, i));
    assert_eq!(hit / B, 51);
    // And the plan agrees.
    let mut layout = Layout::default();
    for (g, s) in specs.iter().enumerate() {
        layout.learn(g as u32, Some(&s.kind()), s.window(), B);
    }
    let (plan, _) = layout.plan(B, None);
    assert_eq!(
        plan.hit(max_blocks, |g, i| held(g as usize, i as usize)),
        51
    );
}

#[test]
fn parked_sliding_blocks_take_their_chain_from_the_full_group() {
    // Gemma 3's order: the sliding group's event first, with the range's
    // last two of four blocks, then the full group's with all four.
    let specs = [Spec::Sliding(9), Spec::Full];
    let p = Prompt {
        ids: vec![0, 1, 2, 1],
        tail: 1,
    };
    let masks = vec![vec![false, false, true, true], vec![]];
    let mut ix = Index::new(1000, 10);
    let mut stats = ApplyStats::default();
    let events = store_events(&specs, &p, 0, &masks);
    let (_, _, sliding) = &events[0];
    ix.apply(ReplicaSlot(0), "m", sliding, &mut stats);
    assert_eq!((ix.entries(), ix.parked()), (0, 2));
    let (_, _, full) = &events[1];
    ix.apply(ReplicaSlot(0), "m", full, &mut stats);
    assert_eq!((ix.entries(), ix.parked()), (6, 0));
    assert_eq!((stats.parked, stats.unparked), (2, 2));
    let layout = ix.layout(ReplicaSlot(0)).unwrap();
    assert_eq!(layout.len(), 2);
    let keys = block_keys(&p.tokens(), BlockSize::new(B).unwrap(), None);
    let q = Query {
        partition: ix.partition("m"),
        keys: &keys,
        block_size: B,
        max_blocks: 4,
        chunk_tokens: None,
        now: Instant::now(),
    };
    // need 2: blocks 2, 3 held in the sliding group: a hit of 4.
    assert_eq!(ix.lookup().match_query(&q, &[ReplicaSlot(0)])[0].blocks, 4);
    // Removing sliding block 3 leaves a run ending at 3 only if 1..3 held:
    // block 1 is not, so no hit at all.
    ix.apply(
        ReplicaSlot(0),
        "m",
        &KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![EngineHash(p.hash(3))],
            tier: Tier::Gpu,
            group_idx: 0,
        }),
        &mut stats,
    );
    assert_eq!(ix.lookup().match_query(&q, &[ReplicaSlot(0)])[0].blocks, 0);
    // The full group still holds all four.
    assert_eq!(
        ix.match_prefix(
            ix.lookup().plane(ix.partition("m").unwrap(), 1),
            &keys,
            &[ReplicaSlot(0)],
            Instant::now()
        )[0]
        .blocks,
        4
    );
}

#[test]
fn a_picks_credit_on_a_sliding_model_stands_for_what_vllm_will_keep() {
    // A Gemma-3-style replica (its layout learned from another prompt).
    let specs = [Spec::Sliding(9), Spec::Full];
    let mut ix = Index::new(1000, 1000);
    let mut stats = ApplyStats::default();
    let other = Prompt {
        ids: vec![2, 2],
        tail: 0,
    };
    for (_, _, ev) in store_events(&specs, &other, 0, &[vec![true; 2], vec![]]) {
        ix.apply(ReplicaSlot(0), "m", &ev, &mut stats);
    }
    let lookup = ix.lookup();
    let partition = lookup.partition_or_insert("m").unwrap();
    let now = Instant::now();
    // A pick sent an 8-block prompt there; its events are not in yet.
    let first = Prompt {
        ids: vec![0, 1, 2, 0, 1, 2, 0, 1],
        tail: 1,
    };
    let keys = block_keys(&first.tokens(), BlockSize::new(B).unwrap(), None);
    lookup.speculate(
        partition,
        &keys,
        ReplicaSlot(0),
        now,
        now + std::time::Duration::from_secs(10),
    );
    let hit = |p: &Prompt| {
        let keys = block_keys(&p.tokens(), BlockSize::new(B).unwrap(), None);
        let q = Query {
            partition: Some(partition),
            keys: &keys,
            block_size: B,
            max_blocks: ((p.tokens().len() as u32 - 1) / B) as usize,
            chunk_tokens: None,
            now,
        };
        lookup.match_query(&q, &[ReplicaSlot(0)])[0].blocks
    };
    // Its next turn: the sliding group will keep the tail before the
    // prompt's end, so the hit is all eight blocks.
    let next = Prompt {
        ids: vec![0, 1, 2, 0, 1, 2, 0, 1, 1, 1],
        tail: 2,
    };
    assert_eq!(hit(&next), 8);
    // A sibling sharing only the first four blocks: vLLM keeps no sliding
    // tail there, so it gets nothing (the full-attention credit alone does
    // not make a hit).
    let sibling = Prompt {
        ids: vec![0, 1, 2, 0, 2, 2, 2],
        tail: 1,
    };
    assert_eq!(hit(&sibling), 0);
}
