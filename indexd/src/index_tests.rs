use std::time::{Duration, Instant};

use kvroute_proto::keys::{BlockKey, block_keys};

use super::model::bs;
use super::*;
use crate::event::{BlockRemoved, BlockStored, EngineHash, ExtraKeys, KvEvent};

const R0: ReplicaSlot = ReplicaSlot(0);
const R1: ReplicaSlot = ReplicaSlot(1);

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
        extra_keys: Some(extra),
        group_idx: 0,
        kind: None,
        sliding_window: None,
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
    s.extra_keys.as_mut().unwrap()[1] = ExtraKeys::Unkeyable;
    ix.apply(R0, "m", &KvEvent::BlockStored(s.clone()), &mut st);
    assert_eq!((st.stored, st.skipped_unkeyable), (1, 2));
    // A child of a skipped block has no known parent.
    ix.apply(R0, "m", &store(&[4], Some(3), toks(4, 3), 4, None), &mut st);
    assert_eq!(st.skipped_unknown_parent, 2);

    s.group_idx = super::layout::MAX_GROUPS;
    s.extra_keys = Some(vec![ExtraKeys::None; 3]);
    s.block_hashes = vec![EngineHash(21), EngineHash(22), EngineHash(23)];
    ix.apply(R0, "m", &KvEvent::BlockStored(s), &mut st);
    assert_eq!(st.skipped_group, 3);
    // Wrong token count: not whole blocks, or more hashes than blocks.
    ix.apply(
        R0,
        "m",
        &store(&[30, 31], None, toks(7, 4), 4, None),
        &mut st,
    );
    ix.apply(
        R0,
        "m",
        &store(&[32, 33], None, toks(4, 4), 4, None),
        &mut st,
    );
    assert_eq!(st.skipped_bad_length, 4);
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
fn after_a_purge_the_bound_still_evicts_the_oldest_live_entries() {
    // The purged replica's places in the insertion order stay behind as
    // stale items (swept later, not at the purge): eviction skips them.
    let mut ix = Index::new(10, 100);
    let mut st = ApplyStats::default();
    let a = toks(6 * 4, 5);
    let b = toks(10 * 4, 6);
    ix.apply(
        R0,
        "m",
        &store(&[1, 2, 3, 4, 5, 6], None, a.clone(), 4, None),
        &mut st,
    );
    ix.apply(
        R1,
        "m",
        &store(&[11, 12, 13, 14], None, b[..16].to_vec(), 4, None),
        &mut st,
    );
    ix.purge(R0);
    assert_eq!(ix.entries(), 4);
    ix.apply(
        R1,
        "m",
        &store(
            &[15, 16, 17, 18, 19, 20],
            Some(14),
            b[16..].to_vec(),
            4,
            None,
        ),
        &mut st,
    );
    assert_eq!((ix.entries(), st.evicted), (10, 0));
    // Re-storing R0's prompt evicts R1's oldest blocks, not the new ones.
    ix.apply(
        R0,
        "m",
        &store(&[1, 2], None, a[..8].to_vec(), 4, None),
        &mut st,
    );
    assert_eq!((ix.entries(), st.evicted), (10, 2));
    let kb = block_keys(&b, bs(4), None);
    assert_eq!(matched(&ix, "m", &kb, &[R1]), vec![0]);
    assert_eq!(matched(&ix, "m", &kb[2..], &[R1]), vec![8]);
    assert_eq!(
        matched(&ix, "m", &block_keys(&a, bs(4), None), &[R0]),
        vec![2]
    );
}

#[test]
fn speculative_entries_expire_and_are_bounded() {
    let mut ix = Index::new(100, 3);
    let now = Instant::now();
    let p = ix.partition_or_insert("m").unwrap();
    let keys: Vec<BlockKey> = (1..=4).map(BlockKey::from_u64).collect();
    ix.lookup()
        .speculate(p, &keys[..2], R1, now, now + Duration::from_secs(5));
    let m = ix.match_prefix(Some(p), &keys, &[R0, R1], now);
    assert_eq!((m[0].blocks, m[1].blocks), (0, 2));
    assert_eq!(m[1].speculative, 2, "credited, not seen in events");
    assert_eq!(
        ix.match_prefix(Some(p), &keys, &[R1], now + Duration::from_secs(6))[0].blocks,
        0
    );
    ix.lookup()
        .speculate(p, &keys, R0, now, now + Duration::from_secs(5));
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
    ix.lookup()
        .speculate(p, &keys, R0, now, now + Duration::from_secs(5));
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

#[test]
fn many_candidates_in_any_order_and_a_slot_listed_twice() {
    // 130 replicas (three words of candidates); replica r holds the first
    // r % 7 blocks of one prompt.
    let mut ix = Index::new(1 << 16, 0);
    let mut st = ApplyStats::default();
    let tokens = toks(6 * 4, 3);
    for r in 0..130u32 {
        let n = (r % 7) as usize;
        if n == 0 {
            continue;
        }
        let hashes: Vec<u64> = (0..n as u64).map(|i| u64::from(r) << 32 | i).collect();
        let ev = store(&hashes, None, tokens[..n * 4].to_vec(), 4, None);
        ix.apply(ReplicaSlot(r), "m", &ev, &mut st);
    }
    let keys = block_keys(&tokens, bs(4), None);
    let mut slots: Vec<ReplicaSlot> = (0..130u32).rev().map(ReplicaSlot).collect();
    slots.push(ReplicaSlot(13));
    slots.push(ReplicaSlot(500));
    let want: Vec<u32> = slots
        .iter()
        .map(|s| if s.0 < 130 { (s.0 % 7).min(6) } else { 0 })
        .collect();
    assert_eq!(matched(&ix, "m", &keys, &slots), want);
    // Slots far apart (replicas come and go, slots are never reused): the
    // same answers through the sparse slot index.
    slots.push(ReplicaSlot(4_000_000));
    let mut want = want;
    want.push(0);
    assert_eq!(matched(&ix, "m", &keys, &slots), want);
}

#[test]
fn readers_walk_while_the_writer_applies_evicts_and_purges() {
    // Two readers walk the one copy while the writer stores, evicts at the
    // bound and purges; every answer is a prefix of the prompt, and once the
    // writer is done the readers see its final state.
    let mut ix = Index::new(3_000, 0);
    let lookup = ix.lookup();
    let p = ix.partition_or_insert("m").unwrap();
    let tokens = toks(256 * 4, 21);
    let keys = block_keys(&tokens, bs(4), None);
    let done = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        for _ in 0..2 {
            scope.spawn(|| {
                let mut walks = 0u32;
                while !done.load(std::sync::atomic::Ordering::Relaxed) || walks == 0 {
                    let m = lookup.match_prefix(Some(p), &keys, &[R0, R1], Instant::now());
                    assert!(m.iter().all(|m| m.blocks as usize <= keys.len()));
                    walks += 1;
                }
            });
        }
        let mut st = ApplyStats::default();
        for round in 0..40u64 {
            let slot = ReplicaSlot((round % 2) as u32);
            let hashes: Vec<u64> = (0..256).map(|i| round << 32 | i).collect();
            ix.apply(
                slot,
                "m",
                &store(&hashes, None, tokens.clone(), 4, None),
                &mut st,
            );
            if round % 7 == 6 {
                ix.purge(slot);
            }
        }
        done.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    assert!(ix.entries() <= 3_000);
    // Round 39 went to R1 last (256 blocks); R0's round 38 may have lost
    // its oldest blocks to the bound but not its newest.
    let m = lookup.match_prefix(Some(p), &keys, &[R0, R1], Instant::now());
    assert_eq!(m[1].blocks, 256);
    assert_eq!(ix.all_blocks().len(), ix.entries());
}

#[test]
fn a_key_moves_between_one_holder_and_a_group() {
    // One replica holds a block (the key names its entry); a second one
    // joins (a group); the first goes (a group of one); the second goes
    // (nothing left); the memory estimate follows.
    let mut ix = Index::new(1000, 0);
    let mut st = ApplyStats::default();
    let tokens = toks(8, 4);
    let keys = block_keys(&tokens, bs(4), None);
    ix.apply(
        R0,
        "m",
        &store(&[1, 2], None, tokens.clone(), 4, None),
        &mut st,
    );
    ix.apply(
        R1,
        "m",
        &store(&[1, 2], None, tokens.clone(), 4, None),
        &mut st,
    );
    assert_eq!((ix.entries(), ix.distinct_keys()), (4, 2));
    assert_eq!(matched(&ix, "m", &keys, &[R0, R1]), vec![2, 2]);
    ix.apply(R0, "m", &removed(&[2], Tier::Gpu), &mut st);
    assert_eq!(matched(&ix, "m", &keys, &[R0, R1]), vec![1, 2]);
    // A tier for R1 in its group; R0's entry for block 1 still there.
    let KvEvent::BlockStored(mut mv) = store(&[1], None, vec![], 4, None) else {
        panic!()
    };
    mv.tier = Tier::Cpu;
    ix.apply(R1, "m", &KvEvent::BlockStored(mv), &mut st);
    ix.apply(R1, "m", &removed(&[1], Tier::Gpu), &mut st);
    let m = ix.match_prefix(ix.partition("m"), &keys, &[R0, R1], Instant::now());
    assert_eq!((m[0].per_tier, m[1].per_tier), ([1, 0, 0], [1, 1, 0]));
    ix.remove_replica(R0);
    assert_eq!(matched(&ix, "m", &keys, &[R0, R1]), vec![0, 2]);
    ix.purge(R1);
    assert_eq!((ix.entries(), ix.distinct_keys()), (0, 0));
    // A removed replica's local id goes to the next one.
    let r2 = ReplicaSlot(2);
    ix.apply(
        r2,
        "m",
        &store(&[1, 2], None, tokens.clone(), 4, None),
        &mut st,
    );
    assert_eq!(matched(&ix, "m", &keys, &[R0, R1, r2]), vec![0, 0, 2]);
}
