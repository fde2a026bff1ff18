//! vLLM's KV-event wire format (msgpack), as captured from vLLM 0.32.
//!
//! A batch payload is `[ts: f64, events: [...], data_parallel_rank]`. Events are maps tagged by
//! `"type"` with vLLM's field order, or (legacy) arrays tag first with the same fields in the same
//! order:
//!
//! | event | fields |
//! |---|---|
//! | BlockStored | block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window |
//! | BlockRemoved | block_hashes, medium, group_idx |
//! | AllBlocksCleared | — |
//!
//! vLLM encodes with msgspec's `omit_defaults`: a field at its default (`None`) is left out of a
//! map, and out of an array when it trails. So `extra_keys` is absent when the event lists no
//! block (vLLM's `to_event_extra_keys` turns an empty list into `None`; a legacy array carries nil
//! there), and `kv_cache_spec_sliding_window` appears for sliding-window groups only.
//!
//! Hashes are u64 (the last 8 bytes of the 32-byte hash, big-endian) or 32-byte bin.

use rmpv::Value;

use crate::cache::BlockHash;
use crate::config::{EventEncoding, HashForm};
use crate::layout::KvCacheSpec;

/// The storage tier every mock block lives in.
pub const MEDIUM_GPU: &str = "GPU";
/// Replay end-of-sequence marker (`-1` as 8 bytes).
pub const END_SEQ: [u8; 8] = [0xff; 8];

/// One KV-cache event in the mock's own terms.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    BlockStored {
        block_hashes: Vec<BlockHash>,
        parent_block_hash: Option<BlockHash>,
        token_ids: Vec<u32>,
        block_size: u32,
        lora_id: Option<u32>,
        lora_name: Option<String>,
        /// One entry per listed block (left out on the wire when there is none).
        extra_keys: Vec<Option<Vec<String>>>,
        /// The KV cache group, and its spec (`kv_cache_spec_kind`, `kv_cache_spec_sliding_window`).
        group_idx: u32,
        spec: KvCacheSpec,
    },
    BlockRemoved {
        block_hashes: Vec<BlockHash>,
        group_idx: u32,
    },
    AllBlocksCleared,
}

/// How a batch goes on the wire.
#[derive(Debug, Clone, Copy)]
pub struct WireFormat {
    pub encoding: EventEncoding,
    pub hash_form: HashForm,
    /// `None` leaves the rank out of the payload.
    pub data_parallel_rank: Option<u32>,
    /// `{ts, events, data_parallel_rank}` instead of an array.
    pub batch_as_map: bool,
}

fn s(v: &str) -> Value {
    Value::from(v)
}

fn hash_value(h: &BlockHash, form: HashForm) -> Value {
    match form {
        HashForm::Int => Value::from(h.as_u64()),
        HashForm::Bytes => Value::Binary(h.0.to_vec()),
    }
}

fn opt<T>(v: Option<T>, f: impl FnOnce(T) -> Value) -> Value {
    v.map_or(Value::Nil, f)
}

impl KvEvent {
    /// `(tag, [(field, value)])` in vLLM's declaration order; `None` is a field at its default,
    /// which msgspec omits.
    fn fields(&self, form: HashForm) -> (&'static str, Vec<(&'static str, Option<Value>)>) {
        let hashes =
            |hs: &[BlockHash]| Value::Array(hs.iter().map(|h| hash_value(h, form)).collect());
        match self {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                lora_name,
                extra_keys,
                group_idx,
                spec,
            } => (
                "BlockStored",
                vec![
                    ("block_hashes", Some(hashes(block_hashes))),
                    (
                        "parent_block_hash",
                        Some(opt(parent_block_hash.as_ref(), |h| hash_value(h, form))),
                    ),
                    (
                        "token_ids",
                        Some(Value::Array(
                            token_ids.iter().map(|t| Value::from(*t)).collect(),
                        )),
                    ),
                    ("block_size", Some(Value::from(*block_size))),
                    ("lora_id", Some(opt(*lora_id, Value::from))),
                    ("medium", Some(s(MEDIUM_GPU))),
                    ("lora_name", Some(opt(lora_name.as_deref(), s))),
                    (
                        "extra_keys",
                        (!extra_keys.is_empty()).then(|| {
                            Value::Array(
                                extra_keys
                                    .iter()
                                    .map(|k| {
                                        opt(k.as_ref(), |k| {
                                            Value::Array(k.iter().map(|x| s(x)).collect())
                                        })
                                    })
                                    .collect(),
                            )
                        }),
                    ),
                    ("group_idx", Some(Value::from(*group_idx))),
                    ("kv_cache_spec_kind", Some(s(spec.kind()))),
                    (
                        "kv_cache_spec_sliding_window",
                        spec.sliding_window().map(Value::from),
                    ),
                ],
            ),
            KvEvent::BlockRemoved {
                block_hashes,
                group_idx,
            } => (
                "BlockRemoved",
                vec![
                    ("block_hashes", Some(hashes(block_hashes))),
                    ("medium", Some(s(MEDIUM_GPU))),
                    ("group_idx", Some(Value::from(*group_idx))),
                ],
            ),
            KvEvent::AllBlocksCleared => ("AllBlocksCleared", Vec::new()),
        }
    }

    /// The event as a msgpack value in the chosen encoding.
    pub fn to_value(&self, encoding: EventEncoding, form: HashForm) -> Value {
        let (tag, mut fields) = self.fields(form);
        match encoding {
            EventEncoding::Tagged => {
                let mut map = Vec::with_capacity(fields.len() + 1);
                map.push((s("type"), s(tag)));
                map.extend(fields.into_iter().filter_map(|(k, v)| Some((s(k), v?))));
                Value::Map(map)
            }
            EventEncoding::Legacy => {
                while fields.last().is_some_and(|(_, v)| v.is_none()) {
                    fields.pop();
                }
                let mut arr = Vec::with_capacity(fields.len() + 1);
                arr.push(s(tag));
                arr.extend(fields.into_iter().map(|(_, v)| v.unwrap_or(Value::Nil)));
                Value::Array(arr)
            }
        }
    }
}

/// Encodes one batch payload.
pub fn encode_batch(ts: f64, events: &[KvEvent], format: WireFormat) -> Vec<u8> {
    let events = Value::Array(
        events
            .iter()
            .map(|e| e.to_value(format.encoding, format.hash_form))
            .collect(),
    );
    let mut fields = vec![("ts", Value::F64(ts)), ("events", events)];
    if let Some(rank) = format.data_parallel_rank {
        fields.push(("data_parallel_rank", Value::from(rank)));
    }
    let batch = if format.batch_as_map {
        Value::Map(fields.into_iter().map(|(k, v)| (s(k), v)).collect())
    } else {
        Value::Array(fields.into_iter().map(|(_, v)| v).collect())
    };
    let mut buf = Vec::with_capacity(256);
    // Writing into a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut buf, &batch);
    buf
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored() -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: vec![BlockHash([7; 32])],
            parent_block_hash: None,
            token_ids: vec![1, 2, 3, 4],
            block_size: 4,
            lora_id: None,
            lora_name: None,
            extra_keys: vec![Some(vec!["tenant-1".to_owned()])],
            group_idx: 0,
            spec: KvCacheSpec::FullAttention,
        }
    }

    fn keys_of(v: &Value) -> Vec<String> {
        v.as_map()
            .unwrap()
            .iter()
            .map(|(k, _)| k.as_str().unwrap().to_owned())
            .collect()
    }

    #[test]
    fn tagged_map_has_vllm_field_order() {
        let v = stored().to_value(EventEncoding::Tagged, HashForm::Int);
        assert_eq!(
            keys_of(&v),
            [
                "type",
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
                "lora_name",
                "extra_keys",
                "group_idx",
                "kv_cache_spec_kind"
            ]
        );
    }

    #[test]
    fn legacy_array_is_tag_first() {
        let v = stored().to_value(EventEncoding::Legacy, HashForm::Bytes);
        let a = v.as_array().unwrap();
        assert_eq!(a[0].as_str(), Some("BlockStored"));
        assert_eq!(a[1].as_array().unwrap()[0], Value::Binary(vec![7; 32]));
        assert_eq!(a.len(), 11);
        let cleared = KvEvent::AllBlocksCleared.to_value(EventEncoding::Legacy, HashForm::Int);
        assert_eq!(cleared, Value::Array(vec![Value::from("AllBlocksCleared")]));
    }

    /// The captured sliding group's first event: no block listed, so no `extra_keys`; the window
    /// last.
    #[test]
    fn sliding_group_with_nothing_listed_omits_extra_keys() {
        let ev = KvEvent::BlockStored {
            block_hashes: vec![],
            parent_block_hash: None,
            token_ids: vec![1, 2, 3, 4],
            block_size: 4,
            lora_id: None,
            lora_name: None,
            extra_keys: vec![],
            group_idx: 0,
            spec: KvCacheSpec::SlidingWindow { window: 256 },
        };
        let v = ev.to_value(EventEncoding::Tagged, HashForm::Int);
        assert_eq!(
            keys_of(&v),
            [
                "type",
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
                "lora_name",
                "group_idx",
                "kv_cache_spec_kind",
                "kv_cache_spec_sliding_window"
            ]
        );
        let map = v.as_map().unwrap();
        assert_eq!(map[9].1.as_str(), Some("sliding_window"));
        assert_eq!(map[10].1.as_u64(), Some(256));
        // Legacy: nil holds extra_keys' place, the window trails.
        let a = ev.to_value(EventEncoding::Legacy, HashForm::Int);
        let a = a.as_array().unwrap();
        assert_eq!(a.len(), 12);
        assert!(a[8].is_nil());
        assert_eq!(a[9].as_u64(), Some(0));
        assert_eq!(a[11].as_u64(), Some(256));
        let removed = KvEvent::BlockRemoved {
            block_hashes: vec![BlockHash([1; 32])],
            group_idx: 1,
        };
        let v = removed.to_value(EventEncoding::Tagged, HashForm::Int);
        assert_eq!(keys_of(&v), ["type", "block_hashes", "medium", "group_idx"]);
        assert_eq!(v.as_map().unwrap()[3].1.as_u64(), Some(1));
    }

    #[test]
    fn int_hash_is_last_eight_bytes_big_endian() {
        let mut h = [0u8; 32];
        h[24..].copy_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
        let v = hash_value(&BlockHash(h), HashForm::Int);
        assert_eq!(v.as_u64(), Some(0x0102_0304_0506_0708));
    }

    #[test]
    fn batch_payload_shape() {
        let fmt = WireFormat {
            encoding: EventEncoding::Tagged,
            hash_form: HashForm::Int,
            data_parallel_rank: Some(0),
            batch_as_map: false,
        };
        let bytes = encode_batch(1.5, &[KvEvent::AllBlocksCleared], fmt);
        let v = rmpv::decode::read_value(&mut bytes.as_slice()).unwrap();
        let a = v.as_array().unwrap();
        assert_eq!(a.len(), 3);
        assert_eq!(a[0], Value::F64(1.5));
        assert_eq!(a[2].as_u64(), Some(0));
        let no_rank = encode_batch(
            1.5,
            &[],
            WireFormat {
                data_parallel_rank: None,
                ..fmt
            },
        );
        let v = rmpv::decode::read_value(&mut no_rank.as_slice()).unwrap();
        assert_eq!(v.as_array().unwrap().len(), 2);
        let map = encode_batch(
            1.5,
            &[],
            WireFormat {
                batch_as_map: true,
                ..fmt
            },
        );
        let v = rmpv::decode::read_value(&mut map.as_slice()).unwrap();
        let keys: Vec<_> = v
            .as_map()
            .unwrap()
            .iter()
            .map(|(k, _)| k.as_str().unwrap())
            .collect();
        assert_eq!(keys, ["ts", "events", "data_parallel_rank"]);
    }
}
