use std::collections::{BTreeSet, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::time::{Duration, Instant};

use kvroute_proto::keys::{BlockKey, BlockSize, Chain, KeyChain, block_keys};
use proptest::prelude::*;

use super::*;
use crate::wire::{BlockRemoved, BlockStored, EngineHash, ExtraKeys, KvEvent};

const R0: ReplicaSlot = ReplicaSlot(0);
const R1: ReplicaSlot = ReplicaSlot(1);

pub(crate) fn bs(n: u32) -> BlockSize {
    BlockSize::new(n).unwrap()
}

fn store(
    hashes: &[u64],
    parent: Option<u64>,
    tokens: Vec<u32>,
    block_size: u32,
    salt: Option<&str>,
) -> KvEvent {
    let mut extra = vec![ExtraKeys::None; hashes.len()];
    if let (Some(salt), Some(first)) = (salt, extra.first_mut()) {
        *first = ExtraKeys::Salt(salt.into());
    }
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes.iter().copied().map(EngineHash).collect(),
        parent: parent.map(EngineHash),
        token_ids: tokens,
        block_size,
        tier: Tier::Gpu,
        lora_name: None,
        extra_keys: extra,
        group_idx: 0,
    })
}

fn removed(hashes: &[u64], tier: Tier) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: hashes.iter().copied().map(EngineHash).collect(),
        tier,
        group_idx: 0,
    })
}

fn matched(index: &Index, model: &str, keys: &[BlockKey], slots: &[ReplicaSlot]) -> Vec<u32> {
    index
        .match_prefix(index.partition(model), keys, slots, Instant::now())
        .iter()
        .map(|m| m.blocks)
        .collect()
}

fn toks(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| i.wrapping_mul(2_654_435_761).wrapping_add(seed) % 32_000)
        .collect()
}

#[test]
fn keys_from_events_equal_proto_keys_across_parent_links() {
    let mut ix = Index::new(1000, 100);
    let mut st = ApplyStats::default();
    let tokens = toks(5 * 16, 7);
    ix.apply(
        R0,
        "m",
        &store(&[1, 2], None, tokens[..32].to_vec(), 16, Some("t")),
        &mut st,
    );
    ix.apply(
        R0,
        "m",
        &store(&[3, 4, 5], Some(2), tokens[32..].to_vec(), 16, None),
        &mut st,
    );
    assert_eq!(st.stored, 5);
    let keys = block_keys(&tokens, bs(16), Some("t"));
    assert_eq!(matched(&ix, "m", &keys, &[R0, R1]), vec![5, 0]);
    // Unsalted and other-tenant keys never match.
    assert_eq!(
        matched(&ix, "m", &block_keys(&tokens, bs(16), None), &[R0]),
        vec![0]
    );
    assert_eq!(
        matched(&ix, "m", &block_keys(&tokens, bs(16), Some("u")), &[R0]),
        vec![0]
    );
    // Another model's partition never matches.
    assert_eq!(matched(&ix, "other", &keys, &[R0]), vec![0]);
}

#[test]
fn the_salt_fixture_keys_like_the_filter() {
    let raw = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/vllm-0.32-events/blockstored_8blk_bs64_salt_A.f2_payload.msgpack"
    ))
    .unwrap();
    let batch = crate::wire::decode_batch(&raw, &crate::wire::Limits::default()).unwrap();
    let KvEvent::BlockStored(s) = &batch.events[0] else {
        panic!()
    };
    let mut ix = Index::new(1000, 100);
    let mut st = ApplyStats::default();
    ix.apply(R0, "m", &batch.events[0], &mut st);
    let keys = block_keys(&s.token_ids, bs(64), Some("A"));
    assert_eq!(keys.len(), 8);
    assert_eq!(matched(&ix, "m", &keys, &[R0]), vec![8]);
    assert_eq!(
        matched(
            &ix,
            "m",
            &block_keys(&s.token_ids, bs(64), Some("B")),
            &[R0]
        ),
        vec![0]
    );
}

#[test]
fn unknown_parent_unkeyable_and_other_groups_are_skipped_with_descendants() {
    let mut ix = Index::new(1000, 100);
    let mut st = ApplyStats::default();
    ix.apply(
        R0,
        "m",
        &store(&[10], Some(999), toks(4, 1), 4, None),
        &mut st,
    );
    assert_eq!((st.skipped_unknown_parent, ix.entries()), (1, 0));

    let tokens = toks(12, 2);
    let KvEvent::BlockStored(mut s) = store(&[1, 2, 3], None, tokens.clone(), 4, None) else {
        panic!()
    };
    s.extra_keys[1] = ExtraKeys::Unkeyable;
    ix.apply(R0, "m", &KvEvent::BlockStored(s.clone()), &mut st);
    assert_eq!((st.stored, st.skipped_unkeyable), (1, 2));
    // A child of a skipped block has no known parent.
    ix.apply(R0, "m", &store(&[4], Some(3), toks(4, 3), 4, None), &mut st);
    assert_eq!(st.skipped_unknown_parent, 2);

    s.group_idx = 1;
    s.extra_keys = vec![ExtraKeys::None; 3];
    s.block_hashes = vec![EngineHash(21), EngineHash(22), EngineHash(23)];
    ix.apply(R0, "m", &KvEvent::BlockStored(s), &mut st);
    assert_eq!(st.skipped_group, 3);
    // Wrong token count.
    ix.apply(
        R0,
        "m",
        &store(&[30, 31], None, toks(7, 4), 4, None),
        &mut st,
    );
    assert_eq!(st.skipped_bad_length, 2);
    assert_eq!(ix.entries(), 1);
}

#[test]
fn tiers_move_and_removal_is_per_tier() {
    let mut ix = Index::new(1000, 100);
    let mut st = ApplyStats::default();
    let tokens = toks(8, 5);
    ix.apply(
        R0,
        "m",
        &store(&[1, 2], None, tokens.clone(), 4, None),
        &mut st,
    );
    let keys = block_keys(&tokens, bs(4), None);
    let tier = |ix: &Index| ix.match_prefix(ix.partition("m"), &keys, &[R0], Instant::now())[0];
    assert_eq!(tier(&ix).per_tier, [2, 0, 0]);
    // Re-announce block 2 in CPU (no tokens), then evict it from GPU.
    let KvEvent::BlockStored(mut mv) = store(&[2], None, vec![], 4, None) else {
        panic!()
    };
    mv.tier = Tier::Cpu;
    ix.apply(R0, "m", &KvEvent::BlockStored(mv), &mut st);
    assert_eq!(st.tier_moves, 1);
    ix.apply(R0, "m", &removed(&[2], Tier::Gpu), &mut st);
    let m = tier(&ix);
    assert_eq!(
        (m.blocks, m.per_tier, m.slowest_tier()),
        (2, [1, 1, 0], Some(Tier::Cpu))
    );
    ix.apply(R0, "m", &removed(&[2], Tier::Cpu), &mut st);
    assert_eq!(tier(&ix).blocks, 1);
    assert_eq!(ix.entries(), 1);
}

#[test]
fn clear_purges_one_replica_only_and_prefix_stops_at_first_gap() {
    let mut ix = Index::new(1000, 100);
    let mut st = ApplyStats::default();
    let tokens = toks(16, 9);
    let keys = block_keys(&tokens, bs(4), None);
    ix.apply(
        R0,
        "m",
        &store(&[1, 2, 3, 4], None, tokens.clone(), 4, None),
        &mut st,
    );
    ix.apply(
        R1,
        "m",
        &store(&[1, 2], None, tokens[..8].to_vec(), 4, None),
        &mut st,
    );
    assert_eq!(matched(&ix, "m", &keys, &[R0, R1]), vec![4, 2]);
    // Evicting R0's block 2 (index 1) cuts its usable prefix to 1.
    ix.apply(R0, "m", &removed(&[2], Tier::Gpu), &mut st);
    assert_eq!(matched(&ix, "m", &keys, &[R0, R1]), vec![1, 2]);
    ix.apply(R1, "m", &KvEvent::AllBlocksCleared, &mut st);
    assert_eq!(matched(&ix, "m", &keys, &[R0, R1]), vec![1, 0]);
    assert_eq!(ix.entries(), 3);
    ix.purge(R0);
    assert_eq!((ix.entries(), ix.distinct_keys()), (0, 0));
}

#[test]
fn lora_events_go_to_the_adapter_partition() {
    let mut ix = Index::new(1000, 100);
    let mut st = ApplyStats::default();
    let tokens = toks(4, 1);
    let KvEvent::BlockStored(mut s) = store(&[1], None, tokens.clone(), 4, None) else {
        panic!()
    };
    s.lora_name = Some("adapter".into());
    ix.apply(R0, "base", &KvEvent::BlockStored(s), &mut st);
    let keys = block_keys(&tokens, bs(4), None);
    assert_eq!(matched(&ix, "adapter", &keys, &[R0]), vec![1]);
    assert_eq!(matched(&ix, "base", &keys, &[R0]), vec![0]);
}

#[test]
fn the_memory_bound_evicts_oldest_first() {
    let mut ix = Index::new(10, 100);
    let mut st = ApplyStats::default();
    let tokens = toks(15 * 4, 3);
    let hashes: Vec<u64> = (1..=15).collect();
    ix.apply(
        R0,
        "m",
        &store(&hashes, None, tokens.clone(), 4, None),
        &mut st,
    );
    assert_eq!((ix.entries(), st.evicted), (10, 5));
    let keys = block_keys(&tokens, bs(4), None);
    // The prompt's first blocks went first, so the prefix no longer matches.
    assert_eq!(matched(&ix, "m", &keys, &[R0]), vec![0]);
    // The newest ten survive.
    assert_eq!(matched(&ix, "m", &keys[5..], &[R0]), vec![10]);
    assert!(ix.approx_bytes() > 0);
    // Removal of evicted blocks is harmless.
    ix.apply(R0, "m", &removed(&[1, 2], Tier::Gpu), &mut st);
    assert_eq!(ix.entries(), 10);
}

#[test]
fn speculative_entries_expire_and_are_bounded() {
    let mut ix = Index::new(100, 3);
    let now = Instant::now();
    let p = ix.partition_or_insert("m").unwrap();
    let keys: Vec<BlockKey> = (1..=4).map(BlockKey::from_u64).collect();
    ix.speculate(p, &keys[..2], R1, now, now + Duration::from_secs(5));
    let m = ix.match_prefix(Some(p), &keys, &[R0, R1], now);
    assert_eq!((m[0].blocks, m[1].blocks), (0, 2));
    assert_eq!(
        ix.match_prefix(Some(p), &keys, &[R1], now + Duration::from_secs(6))[0].blocks,
        0
    );
    ix.speculate(p, &keys, R0, now, now + Duration::from_secs(5));
    assert!(ix.speculative_entries() <= 3);
    ix.purge(R0);
    assert_eq!(ix.match_prefix(Some(p), &keys, &[R0], now)[0].blocks, 0);
}

#[test]
fn speculation_resumes_where_partly_arrived_events_stop() {
    let mut ix = Index::new(100, 100);
    let mut st = ApplyStats::default();
    let now = Instant::now();
    let tokens = toks(16, 11);
    let keys = block_keys(&tokens, bs(4), None);
    let p = ix.partition_or_insert("m").unwrap();
    ix.speculate(p, &keys, R0, now, now + Duration::from_secs(5));
    // The first two blocks' events arrive; the walk goes on over the credit.
    ix.apply(
        R0,
        "m",
        &store(&[1, 2], None, tokens[..8].to_vec(), 4, None),
        &mut st,
    );
    let m = ix.match_prefix(Some(p), &keys, &[R0, R1], now);
    assert_eq!((m[0].blocks, m[1].blocks), (4, 0));
    // A sibling diverging after block 3 matches 3.
    let mut other = tokens.clone();
    other[13] += 1;
    let m = ix.match_prefix(Some(p), &block_keys(&other, bs(4), None), &[R0], now);
    assert_eq!(m[0].blocks, 3);
}

// ---- Differential test against a naive model ----

/// One stored block in the naive model: partition, key, chain, tiers.
type NaiveBlock = (String, BlockKey, Chain, BTreeSet<Tier>);

/// A naive reference: per replica, a flat map of stored blocks.
#[derive(Default)]
pub(crate) struct Naive {
    pub(crate) replicas: HashMap<u32, HashMap<u64, NaiveBlock>>,
}

impl Naive {
    pub(crate) fn apply(&mut self, slot: u32, model: &str, ev: &KvEvent) {
        let rep = self.replicas.entry(slot).or_default();
        match ev {
            KvEvent::AllBlocksCleared => rep.clear(),
            KvEvent::Unknown => {}
            KvEvent::BlockRemoved(r) => {
                if r.group_idx != 0 {
                    return;
                }
                for h in &r.block_hashes {
                    if let Some(e) = rep.get_mut(&h.0) {
                        e.3.remove(&r.tier);
                        if e.3.is_empty() {
                            rep.remove(&h.0);
                        }
                    }
                }
            }
            KvEvent::BlockStored(s) => {
                if s.group_idx != 0 {
                    return;
                }
                if s.token_ids.is_empty() {
                    for h in &s.block_hashes {
                        if let Some(e) = rep.get_mut(&h.0) {
                            e.3.insert(s.tier);
                        }
                    }
                    return;
                }
                let n = s.block_size as usize;
                if s.token_ids.len() != s.block_hashes.len() * n {
                    return;
                }
                let root = match (s.parent, s.extra_keys.first()) {
                    (None, None | Some(ExtraKeys::None)) => Chain::root(None),
                    (None, Some(ExtraKeys::Salt(salt))) => Chain::root(Some(salt)),
                    (Some(p), None | Some(ExtraKeys::None)) => match rep.get(&p.0) {
                        Some(e) => e.2,
                        None => return,
                    },
                    _ => return,
                };
                let part = s.lora_name.clone().unwrap_or_else(|| model.to_owned());
                let mut chain = KeyChain::from_parent(bs(s.block_size), root);
                for (i, h) in s.block_hashes.iter().enumerate() {
                    if i > 0 && !matches!(s.extra_keys.get(i), None | Some(ExtraKeys::None)) {
                        return;
                    }
                    let c = chain.push_block(&s.token_ids[i * n..(i + 1) * n]).unwrap();
                    match rep.get_mut(&h.0) {
                        Some(e) if e.0 == part && e.1 == c.key() => {
                            e.3.insert(s.tier);
                        }
                        _ => {
                            rep.insert(h.0, (part.clone(), c.key(), c, BTreeSet::from([s.tier])));
                        }
                    }
                }
            }
        }
    }

    pub(crate) fn matched(&self, slot: u32, model: &str, keys: &[BlockKey]) -> (u32, [u32; 3]) {
        let mut per_tier = [0; 3];
        let mut n = 0;
        let empty = HashMap::new();
        let rep = self.replicas.get(&slot).unwrap_or(&empty);
        for k in keys {
            let best = rep
                .values()
                .filter(|e| e.0 == model && e.1 == *k)
                .flat_map(|e| e.3.iter().copied())
                .min();
            match best {
                Some(t) => {
                    per_tier[t as usize] += 1;
                    n += 1;
                }
                None => break,
            }
        }
        (n, per_tier)
    }
}

pub(crate) const BLOCK: u32 = 2;

/// A prompt: salt, adapter, and a path of block ids (each id is a fixed
/// token block, so prompts share prefixes).
#[derive(Clone, Debug)]
pub(crate) struct Prompt {
    pub(crate) salt: Option<&'static str>,
    pub(crate) lora: Option<&'static str>,
    pub(crate) ids: Vec<u8>,
}

impl Prompt {
    pub(crate) fn tokens(&self, range: std::ops::Range<usize>) -> Vec<u32> {
        self.ids[range]
            .iter()
            .flat_map(|id| [u32::from(*id) * 10, u32::from(*id) * 10 + 1])
            .collect()
    }

    /// The engine's hash of block `i`: a function of everything before it.
    fn hash(&self, i: usize) -> u64 {
        let mut h = DefaultHasher::new();
        (self.salt, self.lora, &self.ids[..=i]).hash(&mut h);
        h.finish()
    }

    pub(crate) fn model(&self) -> &'static str {
        self.lora.unwrap_or("m")
    }
}

#[derive(Clone, Debug)]
pub(crate) enum Op {
    Store {
        slot: u32,
        p: Prompt,
        start: usize,
        tier: Tier,
        group: u32,
        unkeyable_at: Option<usize>,
    },
    Move {
        slot: u32,
        p: Prompt,
        start: usize,
        tier: Tier,
    },
    Remove {
        slot: u32,
        p: Prompt,
        at: usize,
        tier: Tier,
    },
    Clear {
        slot: u32,
    },
    Purge {
        slot: u32,
    },
    Query {
        p: Prompt,
    },
}

pub(crate) fn prompt() -> impl Strategy<Value = Prompt> {
    (
        prop::sample::select(vec![None, Some("a"), Some("b")]),
        prop::sample::select(vec![None, None, Some("L")]),
        prop::collection::vec(0u8..3, 1..6),
    )
        .prop_map(|(salt, lora, ids)| Prompt { salt, lora, ids })
}

fn tier() -> impl Strategy<Value = Tier> {
    prop::sample::select(vec![Tier::Gpu, Tier::Gpu, Tier::Cpu, Tier::Storage])
}

pub(crate) fn op() -> impl Strategy<Value = Op> {
    let slot = 0u32..3;
    prop_oneof![
        6 => (slot.clone(), prompt(), any::<prop::sample::Index>(), tier(), prop::sample::select(vec![0u32, 0, 0, 1]), prop::option::weighted(0.1, 0usize..5))
            .prop_map(|(slot, p, s, tier, group, unkeyable_at)| {
                let start = s.index(p.ids.len());
                Op::Store { slot, p, start, tier, group, unkeyable_at }
            }),
        1 => (slot.clone(), prompt(), any::<prop::sample::Index>(), tier())
            .prop_map(|(slot, p, s, tier)| { let start = s.index(p.ids.len()); Op::Move { slot, p, start, tier } }),
        3 => (slot.clone(), prompt(), any::<prop::sample::Index>(), tier())
            .prop_map(|(slot, p, s, tier)| { let at = s.index(p.ids.len()); Op::Remove { slot, p, at, tier } }),
        1 => slot.clone().prop_map(|slot| Op::Clear { slot }),
        1 => slot.prop_map(|slot| Op::Purge { slot }),
        4 => prompt().prop_map(|p| Op::Query { p }),
    ]
}

pub(crate) fn event(op: &Op) -> Option<(u32, KvEvent)> {
    match op {
        Op::Store {
            slot,
            p,
            start,
            tier,
            group,
            unkeyable_at,
        } => {
            let n = p.ids.len();
            let mut extra: Vec<ExtraKeys> = (*start..n)
                .map(|i| match (i, p.salt) {
                    (0, Some(s)) => ExtraKeys::Salt(s.into()),
                    _ => ExtraKeys::None,
                })
                .collect();
            if let Some(u) = unkeyable_at
                && let Some(e) = extra.get_mut(*u)
            {
                *e = ExtraKeys::Unkeyable;
            }
            Some((
                *slot,
                KvEvent::BlockStored(BlockStored {
                    block_hashes: (*start..n).map(|i| EngineHash(p.hash(i))).collect(),
                    parent: (*start > 0).then(|| EngineHash(p.hash(start - 1))),
                    token_ids: p.tokens(*start..n),
                    block_size: BLOCK,
                    tier: *tier,
                    lora_name: p.lora.map(str::to_owned),
                    extra_keys: extra,
                    group_idx: *group,
                }),
            ))
        }
        Op::Move {
            slot,
            p,
            start,
            tier,
        } => Some((
            *slot,
            KvEvent::BlockStored(BlockStored {
                block_hashes: (*start..p.ids.len())
                    .map(|i| EngineHash(p.hash(i)))
                    .collect(),
                parent: None,
                token_ids: vec![],
                block_size: BLOCK,
                tier: *tier,
                lora_name: p.lora.map(str::to_owned),
                extra_keys: vec![],
                group_idx: 0,
            }),
        )),
        Op::Remove { slot, p, at, tier } => Some((*slot, removed(&[p.hash(*at)], *tier))),
        Op::Clear { slot } => Some((*slot, KvEvent::AllBlocksCleared)),
        Op::Purge { .. } | Op::Query { .. } => None,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn index_agrees_with_the_naive_model(ops in prop::collection::vec(op(), 1..80)) {
        let mut ix = Index::new(1 << 20, 1 << 10);
        let mut naive = Naive::default();
        let mut stats = ApplyStats::default();
        let slots = [ReplicaSlot(0), ReplicaSlot(1), ReplicaSlot(2)];
        let check = |ix: &Index, naive: &Naive, p: &Prompt| {
            let keys = block_keys(&p.tokens(0..p.ids.len()), bs(BLOCK), p.salt);
            let got = ix.match_prefix(ix.partition(p.model()), &keys, &slots, Instant::now());
            for (i, g) in got.iter().enumerate() {
                let want = naive.matched(i as u32, p.model(), &keys);
                prop_assert_eq!((g.blocks, g.per_tier), want, "replica {} prompt {:?}", i, p);
            }
            Ok(())
        };
        for op in &ops {
            match op {
                Op::Purge { slot } => {
                    ix.purge(ReplicaSlot(*slot));
                    naive.replicas.remove(slot);
                }
                Op::Query { p } => check(&ix, &naive, p)?,
                _ => {
                    if let Some((slot, ev)) = event(op) {
                        ix.apply(ReplicaSlot(slot), "m", &ev, &mut stats);
                        naive.apply(slot, "m", &ev);
                    }
                }
            }
            let naive_entries: usize = naive.replicas.values().map(HashMap::len).sum();
            prop_assert_eq!(ix.entries(), naive_entries);
        }
        // Every prompt the stream touched agrees at the end.
        for op in &ops {
            if let Op::Store { p, .. } | Op::Remove { p, .. } | Op::Query { p } | Op::Move { p, .. } = op {
                check(&ix, &naive, p)?;
            }
        }
    }
}
