use rmpv::Value;

use super::*;

const FIXTURES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tests/fixtures/vllm-0.32-events/"
);

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(format!("{FIXTURES}{name}")).unwrap()
}

fn payload(name: &str) -> EventBatch {
    decode_batch(
        &fixture(&format!("{name}.f2_payload.msgpack")),
        &Limits::default(),
    )
    .unwrap()
}

fn stored(ev: &KvEvent) -> &BlockStored {
    match ev {
        KvEvent::BlockStored(s) => s,
        other => panic!("expected BlockStored, got {other:?}"),
    }
}

fn encode(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

fn s(x: &str) -> Value {
    Value::from(x)
}

fn map(pairs: Vec<(&str, Value)>) -> Value {
    Value::Map(pairs.into_iter().map(|(k, v)| (s(k), v)).collect())
}

fn tokens(n: u32) -> Value {
    Value::Array((0..n).map(Value::from).collect())
}

#[test]
fn every_fixture_payload_decodes() {
    let mut n = 0;
    for entry in std::fs::read_dir(FIXTURES).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        if name.ends_with(".msgpack") {
            let batch = decode_batch(&fixture(&name), &Limits::default())
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(!batch.events.is_empty(), "{name}");
            assert!(batch.ts > 1.7e9, "{name}");
            n += 1;
        }
    }
    assert_eq!(n, 6);
}

#[test]
fn cleared_then_salted_store() {
    let b = payload("allblockscleared_then_blockstored_salted");
    assert_eq!(b.data_parallel_rank, Some(0));
    assert_eq!(b.events[0], KvEvent::AllBlocksCleared);
    let st = stored(&b.events[1]);
    assert_eq!(st.block_hashes, vec![EngineHash(2_341_060_473_997_953_531)]);
    assert_eq!(st.parent, None);
    assert_eq!(st.block_size, 32);
    assert_eq!(st.token_ids.len(), 32);
    assert_eq!(st.tier, Tier::Gpu);
    assert_eq!(
        st.extra_keys,
        Some(vec![ExtraKeys::Salt("tenant-1".into())])
    );
    assert_eq!(st.group_idx, 0);
}

#[test]
fn removals_then_a_long_store() {
    let b = payload("blockremoved_x7_then_blockstored_53blk");
    assert_eq!(b.events.len(), 8);
    for ev in &b.events[..7] {
        let KvEvent::BlockRemoved(r) = ev else {
            panic!("{ev:?}")
        };
        assert_eq!(
            (r.block_hashes.len(), r.tier, r.group_idx),
            (1, Tier::Gpu, 0)
        );
    }
    let KvEvent::BlockRemoved(first) = &b.events[0] else {
        panic!()
    };
    assert_eq!(
        first.block_hashes[0],
        EngineHash(17_949_994_198_944_574_950)
    );
    let st = stored(&b.events[7]);
    assert_eq!(st.block_hashes.len(), 53);
    assert_eq!(st.token_ids.len(), 53 * 32);
    assert_eq!(st.extra_keys, Some(vec![ExtraKeys::None; 53]));
}

#[test]
fn parent_and_no_parent() {
    let a = payload("blockstored_1blk_bs32_noparent");
    assert_eq!(
        stored(&a.events[0]).block_hashes,
        vec![EngineHash(5_351_865_953_928_222_836)]
    );
    assert_eq!(stored(&a.events[0]).parent, None);
    let b = payload("blockstored_1blk_bs32_withparent");
    assert_eq!(
        stored(&b.events[0]).parent,
        Some(EngineHash(14_969_882_861_955_160_744))
    );
    assert_eq!(
        stored(&b.events[0]).block_hashes,
        vec![EngineHash(14_052_626_475_200_816_330)]
    );
}

#[test]
fn bytes_hashes_use_the_last_eight_bytes_big_endian() {
    let b = payload("blockstored_2blk_bs128_byteshashes_emptytopic");
    let st = stored(&b.events[0]);
    assert_eq!(st.block_size, 128);
    assert_eq!(
        st.block_hashes[0],
        EngineHash(u64::from_be_bytes([220, 76, 153, 66, 27, 88, 113, 0]))
    );
    assert_eq!(
        st.block_hashes[1],
        EngineHash(u64::from_be_bytes(
            [107, 108, 104, 149, 252, 114, 18, 224, 220, 159, 214, 80][4..]
                .try_into()
                .unwrap()
        ))
    );
    assert_eq!(
        fixture("blockstored_2blk_bs128_byteshashes_emptytopic.f0_topic.bin"),
        b""
    );
}

#[test]
fn salt_a_eight_blocks() {
    let b = payload("blockstored_8blk_bs64_salt_A");
    let st = stored(&b.events[0]);
    assert_eq!(
        (st.block_hashes.len(), st.block_size, st.token_ids.len()),
        (8, 64, 512)
    );
    let extra = st.extra_keys.as_ref().unwrap();
    assert_eq!(extra[0], ExtraKeys::Salt("A".into()));
    assert!(extra[1..].iter().all(|e| *e == ExtraKeys::None));
}

#[test]
fn seq_frames() {
    assert_eq!(
        decode_seq(&fixture(
            "blockremoved_x7_then_blockstored_53blk.f1_seq.bin"
        )),
        Some(1)
    );
    assert_eq!(
        decode_seq(&fixture(
            "allblockscleared_then_blockstored_salted.f1_seq.bin"
        )),
        Some(4)
    );
    assert_eq!(
        decode_seq(&fixture("replay_end_marker.f1.bin")),
        Some(REPLAY_END_SEQ)
    );
    assert_eq!(
        decode_seq(&fixture("replay_reply_seq4.f1_seq.bin")),
        Some(4)
    );
    assert_eq!(
        decode_seq(&fixture("replay_request_start_seq3.bin")),
        Some(3)
    );
    assert!(
        fixture("replay_end_marker.f0.bin").is_empty()
            && fixture("replay_end_marker.f2.bin").is_empty()
    );
    assert_eq!(decode_seq(b"short"), None);
}

#[test]
fn map_batch_and_legacy_array_events() {
    let legacy = Value::Array(vec![
        s("BlockStored"),
        Value::Array(vec![Value::from(7u8), Value::from(u64::MAX)]),
        Value::Nil,
        tokens(8),
        Value::from(4),
        Value::Nil,
        s("CPU"),
        s("my-lora"),
        Value::Array(vec![
            Value::Array(vec![s("my-lora"), s("salt")]),
            Value::Array(vec![s("my-lora")]),
        ]),
        Value::from(0),
        s("a newer trailing field"),
    ]);
    let removed = Value::Array(vec![
        s("BlockRemoved"),
        Value::Array(vec![Value::from(-3i64)]),
        s("STORAGE"),
    ]);
    let batch = map(vec![
        (
            "events",
            Value::Array(vec![
                legacy,
                removed,
                Value::Array(vec![s("AllBlocksCleared")]),
                Value::Array(vec![s("Novel")]),
            ]),
        ),
        ("ts", Value::from(1.5f32)),
        ("data_parallel_rank", Value::from(2)),
        (
            "unknown",
            map(vec![("nested", Value::Array(vec![Value::Nil]))]),
        ),
    ]);
    let b = decode_batch(&encode(&batch), &Limits::default()).unwrap();
    assert_eq!(b.ts, 1.5);
    assert_eq!(b.data_parallel_rank, Some(2));
    let st = stored(&b.events[0]);
    assert_eq!(st.block_hashes, vec![EngineHash(7), EngineHash(u64::MAX)]);
    assert_eq!(st.tier, Tier::Cpu);
    assert_eq!(st.lora_name.as_deref(), Some("my-lora"));
    assert_eq!(
        st.extra_keys,
        Some(vec![ExtraKeys::Salt("salt".into()), ExtraKeys::None])
    );
    let KvEvent::BlockRemoved(r) = &b.events[1] else {
        panic!()
    };
    assert_eq!(
        (r.block_hashes[0], r.tier),
        (EngineHash((-3i64) as u64), Tier::Storage)
    );
    assert_eq!(b.events[2], KvEvent::AllBlocksCleared);
    assert_eq!(b.events[3], KvEvent::Unknown);
}

#[test]
fn array_batch_without_rank_and_tagged_map_with_unknown_keys() {
    let ev = map(vec![
        ("future_field", map(vec![("a", Value::from(1))])),
        (
            "block_hashes",
            Value::Array(vec![Value::from(300u16), Value::from(70_000u32)]),
        ),
        ("type", s("BlockStored")),
        ("token_ids", tokens(4)),
        ("block_size", Value::from(2)),
        ("parent_block_hash", Value::Binary(vec![9; 32])),
        (
            "extra_keys",
            Value::Array(vec![
                Value::Nil,
                Value::Array(vec![s("img-hash"), Value::from(0)]),
            ]),
        ),
        ("group_idx", Value::from(1)),
        ("lookahead_token_ids", tokens(3)),
    ]);
    let b = decode_batch(
        &encode(&Value::Array(vec![Value::from(3), Value::Array(vec![ev])])),
        &Limits::default(),
    )
    .unwrap();
    assert_eq!(b.data_parallel_rank, None);
    let st = stored(&b.events[0]);
    assert_eq!(st.block_hashes, vec![EngineHash(300), EngineHash(70_000)]);
    assert_eq!(st.parent, Some(EngineHash(u64::from_be_bytes([9; 8]))));
    assert_eq!(
        st.extra_keys,
        Some(vec![ExtraKeys::None, ExtraKeys::Unkeyable])
    );
    assert_eq!(st.group_idx, 1);
}

#[test]
fn extra_keys_classification() {
    let classify = |v: Value, block: usize, lora: Option<&str>| {
        let ev = map(vec![
            ("type", s("BlockStored")),
            (
                "block_hashes",
                Value::Array(vec![Value::from(1); block + 1]),
            ),
            ("block_size", Value::from(1)),
            ("lora_name", lora.map_or(Value::Nil, s)),
            (
                "extra_keys",
                Value::Array(std::iter::repeat_n(Value::Nil, block).chain([v]).collect()),
            ),
        ]);
        let b = decode_batch(
            &encode(&Value::Array(vec![Value::from(0), Value::Array(vec![ev])])),
            &Limits::default(),
        )
        .unwrap();
        stored(&b.events[0]).extra_keys.clone().unwrap()[block].clone()
    };
    assert_eq!(classify(Value::Nil, 0, None), ExtraKeys::None);
    assert_eq!(classify(s("bare"), 0, None), ExtraKeys::Salt("bare".into()));
    assert_eq!(
        classify(Value::Array(vec![s("t")]), 0, None),
        ExtraKeys::Salt("t".into())
    );
    assert_eq!(
        classify(Value::Array(vec![s("t")]), 1, None),
        ExtraKeys::Unkeyable
    );
    assert_eq!(
        classify(Value::Array(vec![s("L")]), 3, Some("L")),
        ExtraKeys::None
    );
    assert_eq!(
        classify(Value::Array(vec![s("a"), s("b")]), 0, None),
        ExtraKeys::Unkeyable
    );
    assert_eq!(
        classify(Value::Array(vec![Value::Binary(vec![1, 2])]), 0, None),
        ExtraKeys::Unkeyable
    );
    assert_eq!(classify(Value::Array(vec![]), 0, None), ExtraKeys::None);
    assert_eq!(classify(Value::from(5), 0, None), ExtraKeys::Unkeyable);
}

#[test]
fn caps_are_enforced() {
    let limits = Limits {
        max_frame_bytes: 1 << 20,
        max_events_per_batch: 2,
        max_blocks_per_event: 3,
        max_tokens_per_event: 8,
        ..Limits::default()
    };
    let batch =
        |events: Vec<Value>| encode(&Value::Array(vec![Value::from(0), Value::Array(events)]));
    let ev = |blocks: usize, toks: u32| {
        map(vec![
            ("type", s("BlockStored")),
            ("block_hashes", Value::Array(vec![Value::from(1); blocks])),
            ("token_ids", tokens(toks)),
            ("block_size", Value::from(1)),
        ])
    };
    assert!(decode_batch(&batch(vec![ev(3, 8)]), &limits).is_ok());
    assert!(matches!(
        decode_batch(&batch(vec![ev(4, 1)]), &limits),
        Err(DecodeError::TooLarge { .. })
    ));
    assert!(matches!(
        decode_batch(&batch(vec![ev(1, 9)]), &limits),
        Err(DecodeError::TooLarge { .. })
    ));
    assert!(matches!(
        decode_batch(&batch(vec![ev(1, 1); 3]), &limits),
        Err(DecodeError::TooLarge { .. })
    ));
    let big = vec![0u8; (1 << 20) + 1];
    assert!(matches!(
        decode_batch(&big, &limits),
        Err(DecodeError::TooLarge { what: "frame", .. })
    ));
    // A length prefix claiming 2^32-1 tokens in a tiny frame allocates nothing.
    let mut lying = encode(&Value::Array(vec![Value::from(0), Value::Array(vec![])]));
    lying.truncate(2);
    lying[1] = 0x91; // events: array of one …
    lying.extend([0x81, 0xa9]); // … map with one key "token_ids"
    lying.extend(b"token_ids");
    lying.extend([0xdd, 0xff, 0xff, 0xff, 0xff]);
    assert!(decode_batch(&lying, &Limits::default()).is_err());
}

#[test]
fn deep_nesting_is_rejected_not_recursed() {
    let mut v = Value::Nil;
    for _ in 0..(MAX_DEPTH + 5) {
        v = Value::Array(vec![v]);
    }
    let batch = map(vec![
        ("junk", v),
        ("events", Value::Array(vec![])),
        ("ts", Value::from(0)),
    ]);
    assert_eq!(
        decode_batch(&encode(&batch), &Limits::default()),
        Err(DecodeError::TooDeep)
    );
}

#[test]
fn every_prefix_and_corruption_of_every_fixture_is_handled() {
    for entry in std::fs::read_dir(FIXTURES).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        if !name.ends_with(".msgpack") {
            continue;
        }
        let full = fixture(&name);
        for cut in 0..full.len() {
            assert!(
                decode_batch(&full[..cut], &Limits::default()).is_err(),
                "{name} cut at {cut}"
            );
        }
        for i in (0..full.len()).step_by(7) {
            let mut bad = full.clone();
            bad[i] ^= 0xa5;
            let _ = decode_batch(&bad, &Limits::default());
        }
        let mut trailing = full.clone();
        trailing.push(0xc0);
        assert_eq!(
            decode_batch(&trailing, &Limits::default()),
            Err(DecodeError::Trailing)
        );
    }
}

#[test]
fn wrong_types_are_errors() {
    let bad = |v: Value| decode_batch(&encode(&v), &Limits::default());
    assert!(bad(s("nope")).is_err());
    assert!(bad(Value::Array(vec![Value::from(0)])).is_err());
    assert!(
        bad(Value::Array(vec![
            Value::from(0),
            Value::Array(vec![Value::from(3)])
        ]))
        .is_err()
    );
    let no_type = map(vec![("block_hashes", Value::Array(vec![]))]);
    assert_eq!(
        bad(Value::Array(vec![
            Value::from(0),
            Value::Array(vec![no_type])
        ])),
        Err(DecodeError::Missing("type"))
    );
    let short_bin = map(vec![
        ("type", s("BlockRemoved")),
        (
            "block_hashes",
            Value::Array(vec![Value::Binary(vec![1, 2, 3])]),
        ),
    ]);
    assert!(
        bad(Value::Array(vec![
            Value::from(0),
            Value::Array(vec![short_bin])
        ]))
        .is_err()
    );
    let big_token = map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", Value::Array(vec![Value::from(1)])),
        (
            "token_ids",
            Value::Array(vec![Value::from(u64::from(u32::MAX) + 1)]),
        ),
        ("block_size", Value::from(1)),
    ]);
    assert!(
        bad(Value::Array(vec![
            Value::from(0),
            Value::Array(vec![big_token])
        ]))
        .is_err()
    );
}

/// One BlockStored whose `token_ids` array is `ids` written marker by marker,
/// so that every integer encoding (minimal or not) can be tried.
fn stored_with_raw_tokens(n: u32, ids: &[u8]) -> Vec<u8> {
    use rmp::encode::{write_array_len, write_map_len, write_str, write_uint};
    let mut out = Vec::new();
    write_array_len(&mut out, 2).unwrap();
    write_uint(&mut out, 0).unwrap();
    write_array_len(&mut out, 1).unwrap();
    write_map_len(&mut out, 4).unwrap();
    write_str(&mut out, "type").unwrap();
    write_str(&mut out, "BlockStored").unwrap();
    write_str(&mut out, "block_hashes").unwrap();
    write_array_len(&mut out, 1).unwrap();
    write_uint(&mut out, 7).unwrap();
    write_str(&mut out, "block_size").unwrap();
    write_uint(&mut out, u64::from(n)).unwrap();
    write_str(&mut out, "token_ids").unwrap();
    write_array_len(&mut out, n).unwrap();
    out.extend_from_slice(ids);
    out
}

#[test]
fn token_ids_decode_from_every_integer_encoding() {
    let ids: &[(&[u8], u32)] = &[
        (&[0x00], 0),
        (&[0x7f], 127),
        (&[0xcc, 0x80], 128),
        (&[0xcc, 0x05], 5),
        (&[0xcd, 0x01, 0x00], 256),
        (&[0xce, 0x00, 0x01, 0x00, 0x00], 65_536),
        (&[0xce, 0xff, 0xff, 0xff, 0xff], u32::MAX),
        // Encodings no msgpack writer picks for these values, still integers.
        (&[0xcf, 0, 0, 0, 0, 0, 0, 0, 9], 9),
        (&[0xd0, 0x0b], 11),
        (&[0xd1, 0x00, 0x0c], 12),
        (&[0xd2, 0x00, 0x00, 0x01, 0x00], 256),
    ];
    let raw: Vec<u8> = ids.iter().flat_map(|(b, _)| b.iter().copied()).collect();
    let n = u32::try_from(ids.len()).unwrap();
    let batch = decode_batch(&stored_with_raw_tokens(n, &raw), &Limits::default()).unwrap();
    let want: Vec<u32> = ids.iter().map(|(_, v)| *v).collect();
    assert_eq!(stored(&batch.events[0]).token_ids, want);
}

#[test]
fn token_ids_that_are_not_u32_are_errors() {
    let cases: &[(&[u8], DecodeError)] = &[
        (&[0xff], DecodeError::UnexpectedType("token_ids")),
        (&[0xd0, 0xff], DecodeError::UnexpectedType("token_ids")),
        (
            &[0xcf, 0, 0, 0, 1, 0, 0, 0, 0],
            DecodeError::UnexpectedType("token_ids"),
        ),
        (&[0xa1, b'x'], DecodeError::UnexpectedType("token_ids")),
        (&[0xc0], DecodeError::UnexpectedType("token_ids")),
        (&[0xce, 0x00, 0x01], DecodeError::Truncated),
        (&[0xcd, 0x01], DecodeError::Truncated),
        (&[0xcc], DecodeError::Truncated),
    ];
    for (raw, want) in cases {
        // Two tokens: a good one, then the bad one, which ends the frame.
        let mut ids = vec![0x01];
        ids.extend_from_slice(raw);
        let got = decode_batch(&stored_with_raw_tokens(2, &ids), &Limits::default());
        assert_eq!(got.as_ref().err(), Some(want), "token bytes {raw:02x?}");
    }
}

proptest::proptest! {
    /// Runs of ids of one width, of any length, back to back (where the
    /// eight-at-once read starts and stops), as msgpack writes them; and the
    /// same frame cut anywhere in its ids.
    #[test]
    fn token_id_runs_of_every_width_decode(
        runs in proptest::collection::vec((0u8..4, 1usize..20, proptest::prelude::any::<u32>()), 0..24),
        cut in proptest::prelude::any::<proptest::sample::Index>(),
    ) {
        let mut want = Vec::new();
        for (width, len, seed) in runs {
            for i in 0..len as u32 {
                let v = seed.wrapping_add(i.wrapping_mul(2_654_435_761));
                want.push(match width {
                    0 => v % 128,
                    1 => 128 + v % 128,
                    2 => 256 + v % (65_536 - 256),
                    _ => 65_536 + v % (u32::MAX - 65_536),
                });
            }
        }
        let mut raw = Vec::new();
        for id in &want {
            rmp::encode::write_uint(&mut raw, u64::from(*id)).unwrap();
        }
        let n = u32::try_from(want.len()).unwrap();
        let frame = stored_with_raw_tokens(n, &raw);
        let batch = decode_batch(&frame, &Limits::default()).unwrap();
        proptest::prop_assert_eq!(&stored(&batch.events[0]).token_ids, &want);
        if !raw.is_empty() {
            let short = frame.len() - raw.len() + cut.index(raw.len());
            proptest::prop_assert_eq!(
                decode_batch(&frame[..short], &Limits::default()).unwrap_err(),
                DecodeError::Truncated
            );
        }
    }
}

#[test]
fn kv_cache_group_kinds_and_windows_decode_in_both_shapes() {
    let map_ev = map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", Value::Array(vec![Value::from(1)])),
        ("parent_block_hash", Value::Nil),
        ("token_ids", tokens(4)),
        ("block_size", Value::from(4)),
        ("group_idx", Value::from(0)),
        ("kv_cache_spec_kind", s("sliding_window")),
        ("kv_cache_spec_sliding_window", Value::from(256)),
    ]);
    // Legacy arrays: kind and window after group_idx, in vLLM's field order.
    let array_ev = Value::Array(vec![
        s("BlockStored"),
        Value::Array(vec![Value::from(2)]),
        Value::Nil,
        tokens(4),
        Value::from(4),
        Value::Nil,
        s("GPU"),
        Value::Nil,
        Value::Nil,
        Value::from(1),
        s("mamba"),
        Value::Nil,
    ]);
    let long = "k".repeat(300);
    let unknown = map(vec![
        ("type", s("BlockStored")),
        ("block_hashes", Value::Array(vec![])),
        ("token_ids", tokens(4)),
        ("block_size", Value::from(4)),
        ("group_idx", Value::from(2)),
        ("kv_cache_spec_kind", s(&long)),
    ]);
    let b = decode_batch(
        &encode(&Value::Array(vec![
            Value::from(1.0),
            Value::Array(vec![map_ev, array_ev, unknown]),
        ])),
        &Limits::default(),
    )
    .unwrap();
    let st = stored(&b.events[0]);
    assert_eq!(
        (st.group_idx, st.kind.clone(), st.sliding_window),
        (0, Some(GroupKind::SlidingWindow { mla: false }), Some(256))
    );
    let st = stored(&b.events[1]);
    assert_eq!((st.group_idx, st.kind.clone()), (1, Some(GroupKind::Mamba)));
    let st = stored(&b.events[2]);
    // An unknown kind is kept by its label, bounded.
    assert_eq!(
        st.kind,
        Some(GroupKind::Other("k".repeat(GroupKind::MAX_LABEL)))
    );
    for (label, kind) in [
        (
            "mla_attention",
            GroupKind::FullAttention(crate::event::FullLabel::Mla),
        ),
        (
            "sink_full_attention",
            GroupKind::FullAttention(crate::event::FullLabel::Sink),
        ),
        ("sliding_window_mla", GroupKind::SlidingWindow { mla: true }),
        ("chunked_local_attention", GroupKind::ChunkedLocal),
    ] {
        assert_eq!(GroupKind::from_label(label), kind);
        assert_eq!(kind.label(), label);
    }
}
