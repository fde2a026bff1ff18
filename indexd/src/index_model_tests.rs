//! The index against a naive model: random event streams (salts, adapters,
//! tiers, missing extra keys, confused adapters) applied to both, every query
//! answered alike; and a ground-truth check that no block is ever keyed under
//! another salt or partition than its own prompt's. The model and the stream
//! generator are shared with the subscriber's stream-level test.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::time::Instant;

use kvroute_proto::keys::{BlockKey, BlockSize, Chain, KeyChain, block_keys};
use proptest::prelude::*;

use super::*;
use crate::event::{BlockRemoved, BlockStored, EngineHash, ExtraKeys, KvEvent};

pub(crate) fn bs(n: u32) -> BlockSize {
    BlockSize::new(n).unwrap()
}

fn removed(hashes: &[u64], tier: Tier) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: hashes.iter().copied().map(EngineHash).collect(),
        tier,
        group_idx: 0,
    })
}

/// One stored block in the naive model: partition, key, chain, tiers, and
/// its GPU copies beyond the first (a GPU store of a block held in the GPU
/// tier is another physical block; each removal takes one).
type NaiveBlock = (String, BlockKey, Chain, BTreeSet<Tier>, u32);

/// `tier` stored again on `e`: a GPU copy more if it was in the GPU tier.
fn stored_again(e: &mut NaiveBlock, tier: Tier) {
    if tier == Tier::Gpu && e.3.contains(&Tier::Gpu) {
        e.4 += 1;
    }
    e.3.insert(tier);
}

/// A naive reference: per replica, a flat map of stored blocks by engine
/// hash and KV cache group (each group keeps its own; a block's chain is
/// the same in every group).
#[derive(Default)]
pub(crate) struct Naive {
    pub(crate) replicas: HashMap<u32, HashMap<(u64, u32), NaiveBlock>>,
    /// The entry bound, if any: beyond it the oldest entry goes.
    bound: Option<usize>,
    /// Each entry's insertion number, and the entries by it (stale ones
    /// are skipped when met).
    seq_of: HashMap<(u32, (u64, u32)), u64>,
    order: BTreeMap<u64, (u32, (u64, u32))>,
    next: u64,
}

/// A block of `rep` in any group.
fn any_group(rep: &HashMap<(u64, u32), NaiveBlock>, hash: u64) -> Option<&NaiveBlock> {
    (0..crate::index::layout::MAX_GROUPS).find_map(|g| rep.get(&(hash, g)))
}

impl Naive {
    fn bounded(bound: usize) -> Self {
        Self {
            bound: Some(bound),
            ..Self::default()
        }
    }

    /// A new entry `(slot, hash)` was stored: it is the newest, and the
    /// oldest ones go beyond the bound.
    fn inserted(&mut self, slot: u32, hash: (u64, u32)) {
        self.seq_of.insert((slot, hash), self.next);
        self.order.insert(self.next, (slot, hash));
        self.next += 1;
        let Some(bound) = self.bound else {
            return;
        };
        while self.replicas.values().map(HashMap::len).sum::<usize>() > bound {
            let Some((seq, (s, h))) = self.order.pop_first() else {
                break;
            };
            let live = self.seq_of.get(&(s, h)) == Some(&seq)
                && self.replicas.get(&s).is_some_and(|r| r.contains_key(&h));
            if live && let Some(r) = self.replicas.get_mut(&s) {
                r.remove(&h);
            }
        }
    }

    pub(crate) fn apply(&mut self, slot: u32, model: &str, ev: &KvEvent) {
        let rep = self.replicas.entry(slot).or_default();
        match ev {
            KvEvent::AllBlocksCleared => rep.clear(),
            KvEvent::Unknown => {}
            KvEvent::BlockRemoved(r) => {
                for h in &r.block_hashes {
                    let at = (h.0, r.group_idx);
                    if let Some(e) = rep.get_mut(&at) {
                        if r.tier == Tier::Gpu && e.4 > 0 {
                            e.4 -= 1;
                            continue;
                        }
                        e.3.remove(&r.tier);
                        if e.3.is_empty() {
                            rep.remove(&at);
                        }
                    }
                }
            }
            KvEvent::BlockStored(s) => {
                let g = s.group_idx;
                if g >= crate::index::layout::MAX_GROUPS {
                    return;
                }
                if s.token_ids.is_empty() {
                    for h in &s.block_hashes {
                        if let Some(e) = rep.get_mut(&(h.0, g)) {
                            e.3.insert(s.tier);
                        }
                    }
                    return;
                }
                let n = s.block_size as usize;
                if s.token_ids.len() != s.block_hashes.len() * n {
                    return;
                }
                let part_of =
                    |s: &BlockStored| s.lora_name.clone().unwrap_or_else(|| model.to_owned());
                // The chain and partition each block continues (None: unknown).
                let mut link: Option<(Chain, String)> = s
                    .parent
                    .and_then(|p| any_group(rep, p.0))
                    .map(|e| (e.2, e.0.clone()));
                for (i, h) in s.block_hashes.iter().enumerate() {
                    let root = i == 0 && s.parent.is_none();
                    let carried = s.extra_keys.as_ref().and_then(|e| e.get(i));
                    match carried {
                        Some(ExtraKeys::Unkeyable) => return,
                        Some(ExtraKeys::Salt(_)) if !root => return,
                        _ => {}
                    }
                    if carried.is_none() {
                        let rep = self.replicas.entry(slot).or_default();
                        if let Some(e) = rep.get_mut(&(h.0, g)) {
                            stored_again(e, s.tier);
                            link = Some((e.2, e.0.clone()));
                            continue;
                        }
                        // Known in another group: the same block.
                        if let Some(e) = any_group(rep, h.0).cloned() {
                            link = Some((e.2, e.0.clone()));
                            rep.insert((h.0, g), (e.0, e.1, e.2, BTreeSet::from([s.tier]), 0));
                            self.inserted(slot, (h.0, g));
                            continue;
                        }
                    }
                    if root {
                        link = match carried {
                            None => None,
                            Some(ExtraKeys::Salt(salt)) => {
                                Some((Chain::root(Some(salt)), part_of(s)))
                            }
                            Some(_) => Some((Chain::root(None), part_of(s))),
                        };
                    } else if let Some((_, parent_part)) = &link {
                        let claim = match (&s.lora_name, carried) {
                            (Some(l), _) => Some(l.clone()),
                            (None, Some(_)) => Some(model.to_owned()),
                            (None, None) => None,
                        };
                        if claim.is_some_and(|c| &c != parent_part) {
                            return;
                        }
                    }
                    let Some((parent, part)) = link.clone() else {
                        continue;
                    };
                    let c = KeyChain::from_parent(bs(s.block_size), parent)
                        .push_block(&s.token_ids[i * n..(i + 1) * n])
                        .unwrap();
                    let rep = self.replicas.entry(slot).or_default();
                    match rep.get_mut(&(h.0, g)) {
                        Some(e) if e.0 == part && e.1 == c.key() => {
                            stored_again(e, s.tier);
                        }
                        _ => {
                            rep.insert(
                                (h.0, g),
                                (part.clone(), c.key(), c, BTreeSet::from([s.tier]), 0),
                            );
                            self.inserted(slot, (h.0, g));
                        }
                    }
                    link = Some((c, part));
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
            // The walk over the partition's own plane: group 0.
            let best = rep
                .iter()
                .filter(|((_, g), e)| *g == 0 && e.0 == model && e.1 == *k)
                .flat_map(|(_, e)| e.3.iter().copied())
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

/// How a store event carries its extra keys and adapter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Extra {
    /// One entry per block and the LoRA name, as vLLM's GPU pool sends them.
    Full,
    /// No `extra_keys` (offloading connectors, the disk tier, older vLLM).
    Absent,
    /// No `extra_keys` and no `lora_name` (a connector that drops both).
    Bare,
    /// Full, but naming another adapter than the prompt's, below a parent (a
    /// confused publisher; at a prompt's start it is the same as `Full`).
    OtherLora,
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
        extra: Extra,
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
        // "L" is also the adapter's name: a salt equal to a LoRA name.
        prop::sample::select(vec![None, Some("a"), Some("b"), Some("L")]),
        prop::sample::select(vec![None, None, Some("L")]),
        prop::collection::vec(0u8..3, 1..6),
    )
        .prop_map(|(salt, lora, ids)| Prompt { salt, lora, ids })
}

fn extra() -> impl Strategy<Value = Extra> {
    prop::sample::select(vec![
        Extra::Full,
        Extra::Full,
        Extra::Full,
        Extra::Absent,
        Extra::Bare,
        Extra::OtherLora,
    ])
}

fn tier() -> impl Strategy<Value = Tier> {
    prop::sample::select(vec![Tier::Gpu, Tier::Gpu, Tier::Cpu, Tier::Storage])
}

pub(crate) fn op() -> impl Strategy<Value = Op> {
    let slot = 0u32..3;
    prop_oneof![
        6 => (slot.clone(), prompt(), any::<prop::sample::Index>(), tier(), prop::sample::select(vec![0u32, 0, 0, 1]), prop::option::weighted(0.1, 0usize..5), extra())
            .prop_map(|(slot, p, s, tier, group, unkeyable_at, extra)| {
                let start = s.index(p.ids.len());
                Op::Store { slot, p, start, tier, group, unkeyable_at, extra }
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
            extra: mode,
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
            let lora_name = match mode {
                Extra::Bare => None,
                Extra::OtherLora if *start > 0 => Some(if p.lora == Some("L") { "X" } else { "L" }),
                _ => p.lora,
            };
            let extra_keys = matches!(mode, Extra::Full | Extra::OtherLora).then_some(extra);
            Some((
                *slot,
                KvEvent::BlockStored(BlockStored {
                    block_hashes: (*start..n).map(|i| EngineHash(p.hash(i))).collect(),
                    parent: (*start > 0).then(|| EngineHash(p.hash(start - 1))),
                    token_ids: p.tokens(*start..n),
                    block_size: BLOCK,
                    tier: *tier,
                    lora_name: lora_name.map(str::to_owned),
                    extra_keys,
                    group_idx: *group,
                    kind: None,
                    sliding_window: None,
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
                extra_keys: None,
                group_idx: 0,
                kind: None,
                sliding_window: None,
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

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// The same, with a small entry bound (the oldest entries evicted, slab
    /// places reused, keys moving between one holder and a group) and the
    /// events applied in batches: published every few events, queries only
    /// between batches.
    #[test]
    fn bounded_batched_index_agrees_with_the_naive_model(
        ops in prop::collection::vec(op(), 1..120),
        bound in 1usize..24,
        batch in 1usize..6,
        wide in any::<bool>(),
    ) {
        let mut ix = Index::new(bound, 1 << 10);
        if wide {
            // 64 replicas seen (and purged) first: the three below get local
            // ids past 64, and Picks take the walk over holder lists rather
            // than the one over masks.
            for r in 100..164 {
                let ev = KvEvent::BlockStored(BlockStored {
                    block_hashes: vec![EngineHash(u64::from(r))],
                    parent: None,
                    token_ids: vec![9_000 + r, 9_001],
                    block_size: BLOCK,
                    tier: Tier::Gpu,
                    lora_name: None,
                    extra_keys: Some(vec![ExtraKeys::None]),
                    group_idx: 0,
                    kind: None,
                    sliding_window: None,
                });
                ix.apply(ReplicaSlot(r), "m", &ev, &mut ApplyStats::default());
                ix.purge(ReplicaSlot(r));
            }
        }
        let mut naive = Naive::bounded(bound);
        let mut stats = ApplyStats::default();
        let slots = [ReplicaSlot(0), ReplicaSlot(1), ReplicaSlot(2)];
        let mut queued = 0;
        for op in &ops {
            match op {
                Op::Purge { slot } => {
                    ix.purge(ReplicaSlot(*slot));
                    naive.replicas.remove(slot);
                    queued = 0;
                }
                Op::Query { p } => {
                    ix.publish(&mut stats);
                    queued = 0;
                    let keys = block_keys(&p.tokens(0..p.ids.len()), bs(BLOCK), p.salt);
                    let got = ix.match_prefix(ix.partition(p.model()), &keys, &slots, Instant::now());
                    for (i, g) in got.iter().enumerate() {
                        let want = naive.matched(i as u32, p.model(), &keys);
                        prop_assert_eq!((g.blocks, g.per_tier), want, "replica {} prompt {:?}", i, p);
                    }
                }
                _ => {
                    if let Some((slot, ev)) = event(op) {
                        ix.apply_unpublished(ReplicaSlot(slot), "m", ev.clone());
                        naive.apply(slot, "m", &ev);
                        queued += 1;
                        if queued >= batch {
                            ix.publish(&mut stats);
                            queued = 0;
                        }
                    }
                }
            }
            if queued == 0 {
                let naive_entries: usize = naive.replicas.values().map(HashMap::len).sum();
                prop_assert_eq!(ix.entries(), naive_entries);
                prop_assert!(ix.entries() <= bound);
                // Every entry is where its replica's table says.
                prop_assert_eq!(ix.all_blocks().len(), naive_entries);
            }
        }
    }
}

/// What each engine hash really is: the prompt block it names, keyed with
/// that prompt's own salt in its own partition.
fn truth(ops: &[Op]) -> HashMap<u64, (String, BlockKey)> {
    let mut out = HashMap::new();
    for op in ops {
        if let Op::Store { p, .. } | Op::Move { p, .. } | Op::Remove { p, .. } = op {
            let keys = block_keys(&p.tokens(0..p.ids.len()), bs(BLOCK), p.salt);
            for (i, k) in keys.iter().enumerate() {
                out.insert(p.hash(i), (p.model().to_owned(), *k));
            }
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Whatever the events omit (extra keys, the LoRA name) or get wrong (an
    /// adapter below a parent of another), every indexed block carries the
    /// key and partition its own prompt gives it: a salted block is never
    /// indexed as unsalted, nor under another salt or adapter.
    #[test]
    fn no_block_is_keyed_under_another_salt_or_partition(ops in prop::collection::vec(op(), 1..80)) {
        let truth = truth(&ops);
        let mut ix = Index::new(1 << 20, 1 << 10);
        let mut stats = ApplyStats::default();
        for op in &ops {
            if let Some((slot, ev)) = event(op) {
                ix.apply(ReplicaSlot(slot), "m", &ev, &mut stats);
            }
            for (slot, h, partition, chain) in ix.all_blocks() {
                prop_assert_eq!(
                    (ix.partition_name(partition), chain.key()),
                    truth.get(&h.0).map(|(m, k)| (Some(m.clone()), *k)).unwrap(),
                    "replica {:?} block {:?}", slot, h
                );
            }
        }
    }
}
