//! Salts and partitions are never confused: events that omit their extra
//! keys or their adapter, salts equal to an adapter's name, disk-tier events.

use std::net::SocketAddr;
use std::time::Instant;

use kvroute_proto::keys::{BlockKey, block_keys};
use rmpv::Value;
use tokio_util::sync::CancellationToken;

use super::super::model::bs;
use super::*;
use crate::config::{Config, EndpointConfig};
use crate::event::Tier;
use crate::state::Shared;
use crate::wire::{Limits, decode_batch};

const R0: ReplicaSlot = ReplicaSlot(0);
const BS: u32 = 4;

fn toks(blocks: usize, seed: u32) -> Vec<u32> {
    (0..(blocks * BS as usize) as u32)
        .map(|i| i.wrapping_mul(2_654_435_761).wrapping_add(seed) % 32_000)
        .collect()
}

/// A `BlockStored` of `hashes` with the given extra keys (`None`: the field
/// is absent) and adapter.
fn stored(
    hashes: &[u64],
    parent: Option<u64>,
    tokens: &[u32],
    tier: Tier,
    lora: Option<&str>,
    extra: Option<Vec<ExtraKeys>>,
) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes.iter().copied().map(EngineHash).collect(),
        parent: parent.map(EngineHash),
        token_ids: tokens.to_vec(),
        block_size: BS,
        tier,
        lora_name: lora.map(str::to_owned),
        extra_keys: extra,
        group_idx: 0,
        kind: None,
        sliding_window: None,
    })
}

fn salted(n: usize, salt: &str) -> Option<Vec<ExtraKeys>> {
    let mut extra = vec![ExtraKeys::None; n];
    extra[0] = ExtraKeys::Salt(salt.into());
    Some(extra)
}

fn matched(ix: &Index, model: &str, keys: &[BlockKey]) -> PrefixMatchView {
    let m = ix.match_prefix(ix.partition(model), keys, &[R0], Instant::now())[0];
    (m.blocks, m.per_tier)
}

type PrefixMatchView = (u32, [u32; 3]);

#[test]
fn a_first_block_without_extra_keys_is_not_indexed_as_unsalted() {
    // A disk-tier store from an offloading connector: tokens, no extra keys.
    // The request may have been salted: nothing is indexed, all counted.
    let mut ix = Index::new(100, 10);
    let mut st = ApplyStats::default();
    let t = toks(3, 1);
    ix.apply(
        R0,
        "m",
        &stored(&[1, 2, 3], None, &t, Tier::Storage, None, None),
        &mut st,
    );
    assert_eq!(
        (ix.entries(), st.skipped_salt_unknown, st.stored),
        (0, 3, 0)
    );
    assert_eq!(matched(&ix, "m", &block_keys(&t, bs(BS), None)).0, 0);
}

#[test]
fn a_known_block_reannounced_without_extra_keys_keeps_its_salted_key() {
    let mut ix = Index::new(100, 10);
    let mut st = ApplyStats::default();
    let t = toks(3, 2);
    ix.apply(
        R0,
        "m",
        &stored(&[1, 2, 3], None, &t, Tier::Gpu, None, salted(3, "tenant")),
        &mut st,
    );
    // The CPU copy of the first two blocks, as an offloading connector
    // announces it: same engine hashes, no extra keys.
    ix.apply(
        R0,
        "m",
        &stored(&[1, 2], None, &t[..8], Tier::Cpu, None, None),
        &mut st,
    );
    assert_eq!(
        (ix.entries(), st.stored, st.skipped_salt_unknown),
        (3, 5, 0)
    );
    let keys = block_keys(&t, bs(BS), Some("tenant"));
    assert_eq!(matched(&ix, "m", &keys), (3, [3, 0, 0]));
    assert_eq!(
        matched(&ix, "m", &block_keys(&t, bs(BS), None)).0,
        0,
        "never unsalted"
    );
    // Evicted from GPU, the first two still match from CPU.
    ix.apply(
        R0,
        "m",
        &KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![EngineHash(1), EngineHash(2), EngineHash(3)],
            tier: Tier::Gpu,
            group_idx: 0,
        }),
        &mut st,
    );
    assert_eq!(matched(&ix, "m", &keys), (2, [0, 2, 0]));
}

#[test]
fn a_child_without_extra_keys_continues_its_parents_salted_chain() {
    let mut ix = Index::new(100, 10);
    let mut st = ApplyStats::default();
    let t = toks(3, 3);
    ix.apply(
        R0,
        "m",
        &stored(&[1], None, &t[..4], Tier::Gpu, None, salted(1, "s")),
        &mut st,
    );
    // Its children, stored by a connector without extra keys (nor a LoRA
    // name): the parent's chain carries the salt.
    ix.apply(
        R0,
        "m",
        &stored(&[2, 3], Some(1), &t[4..], Tier::Cpu, None, None),
        &mut st,
    );
    let keys = block_keys(&t, bs(BS), Some("s"));
    assert_eq!(matched(&ix, "m", &keys), (3, [1, 2, 0]));
    assert_eq!(matched(&ix, "m", &block_keys(&t, bs(BS), None)).0, 0);
    // A child whose parent is unknown is never keyed, whatever it carries.
    for extra in [None, Some(vec![ExtraKeys::None; 2])] {
        let before = ix.entries();
        ix.apply(
            R0,
            "m",
            &stored(&[8, 9], Some(7), &toks(2, 4), Tier::Gpu, None, extra),
            &mut st,
        );
        assert_eq!(ix.entries(), before);
    }
    assert_eq!(st.skipped_unknown_parent, 4);
}

#[test]
fn a_child_stays_in_its_parents_partition() {
    let mut ix = Index::new(100, 10);
    let mut st = ApplyStats::default();
    let t = toks(3, 5);
    ix.apply(
        R0,
        "base",
        &stored(
            &[1],
            None,
            &t[..4],
            Tier::Gpu,
            Some("L"),
            Some(vec![ExtraKeys::None]),
        ),
        &mut st,
    );
    // A connector that drops both the extra keys and the LoRA name: the
    // child inherits the adapter's partition.
    ix.apply(
        R0,
        "base",
        &stored(&[2], Some(1), &t[4..8], Tier::Cpu, None, None),
        &mut st,
    );
    let keys = block_keys(&t, bs(BS), None);
    assert_eq!(matched(&ix, "L", &keys).0, 2);
    assert_eq!(matched(&ix, "base", &keys).0, 0);
    // An event naming another adapter (or, carrying extra keys without a
    // LoRA name, the base model) below it is skipped with its descendants.
    ix.apply(
        R0,
        "base",
        &stored(
            &[3],
            Some(2),
            &t[8..],
            Tier::Gpu,
            Some("X"),
            Some(vec![ExtraKeys::None]),
        ),
        &mut st,
    );
    ix.apply(
        R0,
        "base",
        &stored(
            &[3],
            Some(2),
            &t[8..],
            Tier::Gpu,
            None,
            Some(vec![ExtraKeys::None]),
        ),
        &mut st,
    );
    assert_eq!((st.skipped_partition_conflict, ix.entries()), (2, 2));
    assert_eq!(matched(&ix, "L", &keys).0, 2);
}

fn map(fields: Vec<(&str, Value)>) -> Value {
    Value::Map(
        fields
            .into_iter()
            .map(|(k, v)| (Value::from(k), v))
            .collect(),
    )
}

fn payload(events: Vec<Value>) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(
        &mut out,
        &Value::Array(vec![Value::from(1.0), Value::Array(events)]),
    )
    .unwrap();
    out
}

fn tokens_value(t: &[u32]) -> Value {
    Value::Array(t.iter().map(|x| Value::from(*x)).collect())
}

#[test]
fn a_salt_equal_to_the_adapters_name_stays_a_salt() {
    // vLLM lists the LoRA name first in every block's keys, then the salt on
    // block 0: `[["L", "L"], ["L"]]` is adapter L salted "L".
    let t = toks(2, 6);
    let ev = map(vec![
        ("type", "BlockStored".into()),
        ("block_hashes", Value::Array(vec![1.into(), 2.into()])),
        ("parent_block_hash", Value::Nil),
        ("token_ids", tokens_value(&t)),
        ("block_size", BS.into()),
        ("medium", "GPU".into()),
        ("lora_name", "L".into()),
        (
            "extra_keys",
            Value::Array(vec![
                Value::Array(vec!["L".into(), "L".into()]),
                Value::Array(vec!["L".into()]),
            ]),
        ),
    ]);
    let batch = decode_batch(&payload(vec![ev]), &Limits::default()).unwrap();
    let KvEvent::BlockStored(s) = &batch.events[0] else {
        panic!()
    };
    assert_eq!(
        s.extra_keys,
        Some(vec![ExtraKeys::Salt("L".into()), ExtraKeys::None])
    );
    let mut ix = Index::new(100, 10);
    let mut st = ApplyStats::default();
    ix.apply(R0, "L", &batch.events[0], &mut st);
    assert_eq!(matched(&ix, "L", &block_keys(&t, bs(BS), Some("L"))).0, 2);
    assert_eq!(
        matched(&ix, "L", &block_keys(&t, bs(BS), None)).0,
        0,
        "unsalted adapter"
    );
    // The unsalted adapter request: `[["L"], ["L"]]` is no salt at all.
    let ev = map(vec![
        ("type", "BlockStored".into()),
        ("block_hashes", Value::Array(vec![3.into()])),
        ("parent_block_hash", Value::Nil),
        ("token_ids", tokens_value(&t[..4])),
        ("block_size", BS.into()),
        ("lora_name", "L".into()),
        (
            "extra_keys",
            Value::Array(vec![Value::Array(vec!["L".into()])]),
        ),
    ]);
    let batch = decode_batch(&payload(vec![ev]), &Limits::default()).unwrap();
    let KvEvent::BlockStored(s) = &batch.events[0] else {
        panic!()
    };
    assert_eq!(s.extra_keys, Some(vec![ExtraKeys::None]));
}

#[test]
fn disk_tier_events_without_extra_keys_are_counted_not_indexed() {
    // The offloading connector's shape (vLLM 0.32): a STORAGE store with
    // tokens and no `extra_keys` field at all.
    let ep = EndpointConfig::new(SocketAddr::from(([10, 0, 0, 1], 8000)), "m");
    let shared = Shared::new(Config::new(vec![ep.clone()]), CancellationToken::new());
    let replica = shared.add_replica(ep).unwrap();
    let t = toks(2, 7);
    let ev = map(vec![
        ("type", "BlockStored".into()),
        ("block_hashes", Value::Array(vec![11.into(), 12.into()])),
        ("parent_block_hash", Value::Nil),
        ("token_ids", tokens_value(&t)),
        ("block_size", BS.into()),
        ("lora_id", Value::Nil),
        ("medium", "STORAGE".into()),
        ("lora_name", Value::Nil),
        ("group_idx", 0.into()),
    ]);
    let batch = decode_batch(&payload(vec![ev]), &Limits::default()).unwrap();
    shared.ingest(&replica, batch);
    assert_eq!(shared.metrics.blocks.get(["skipped_salt_unknown"]), 2);
    assert_eq!(shared.metrics.blocks.get(["stored"]), 0);
    assert_eq!(shared.index.locked().entries(), 0);
}
