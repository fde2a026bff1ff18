//! vLLM's KV-event wire format (msgpack), as captured from vLLM 0.32.
//!
//! A batch payload is `[ts: f64, events: [...], data_parallel_rank]`. Events are maps tagged by
//! `"type"` with vLLM's field order, or (legacy) arrays tag first with the same fields in the same
//! order:
//!
//! | event | fields |
//! |---|---|
//! | BlockStored | block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind |
//! | BlockRemoved | block_hashes, medium, group_idx |
//! | AllBlocksCleared | — |
//!
//! Hashes are u64 (the last 8 bytes of the 32-byte hash, big-endian) or 32-byte bin.

use rmpv::Value;

use crate::cache::BlockHash;
use crate::config::{EventEncoding, HashForm};

/// The storage tier every mock block lives in.
pub const MEDIUM_GPU: &str = "GPU";
/// `kv_cache_spec_kind` of a plain decoder model.
pub const FULL_ATTENTION: &str = "full_attention";
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
        extra_keys: Vec<Option<Vec<String>>>,
    },
    BlockRemoved {
        block_hashes: Vec<BlockHash>,
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
    /// `(tag, [(field, value)])` in vLLM's declaration order.
    fn fields(&self, form: HashForm) -> (&'static str, Vec<(&'static str, Value)>) {
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
            } => (
                "BlockStored",
                vec![
                    ("block_hashes", hashes(block_hashes)),
                    (
                        "parent_block_hash",
                        opt(parent_block_hash.as_ref(), |h| hash_value(h, form)),
                    ),
                    (
                        "token_ids",
                        Value::Array(token_ids.iter().map(|t| Value::from(*t)).collect()),
                    ),
                    ("block_size", Value::from(*block_size)),
                    ("lora_id", opt(*lora_id, Value::from)),
                    ("medium", s(MEDIUM_GPU)),
                    ("lora_name", opt(lora_name.as_deref(), s)),
                    (
                        "extra_keys",
                        Value::Array(
                            extra_keys
                                .iter()
                                .map(|k| {
                                    opt(k.as_ref(), |k| {
                                        Value::Array(k.iter().map(|x| s(x)).collect())
                                    })
                                })
                                .collect(),
                        ),
                    ),
                    ("group_idx", Value::from(0)),
                    ("kv_cache_spec_kind", s(FULL_ATTENTION)),
                ],
            ),
            KvEvent::BlockRemoved { block_hashes } => (
                "BlockRemoved",
                vec![
                    ("block_hashes", hashes(block_hashes)),
                    ("medium", s(MEDIUM_GPU)),
                    ("group_idx", Value::from(0)),
                ],
            ),
            KvEvent::AllBlocksCleared => ("AllBlocksCleared", Vec::new()),
        }
    }

    /// The event as a msgpack value in the chosen encoding.
    pub fn to_value(&self, encoding: EventEncoding, form: HashForm) -> Value {
        let (tag, fields) = self.fields(form);
        match encoding {
            EventEncoding::Tagged => {
                let mut map = Vec::with_capacity(fields.len() + 1);
                map.push((s("type"), s(tag)));
                map.extend(fields.into_iter().map(|(k, v)| (s(k), v)));
                Value::Map(map)
            }
            EventEncoding::Legacy => {
                let mut arr = Vec::with_capacity(fields.len() + 1);
                arr.push(s(tag));
                arr.extend(fields.into_iter().map(|(_, v)| v));
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
        }
    }

    #[test]
    fn tagged_map_has_vllm_field_order() {
        let v = stored().to_value(EventEncoding::Tagged, HashForm::Int);
        let keys: Vec<_> = v
            .as_map()
            .unwrap()
            .iter()
            .map(|(k, _)| k.as_str().unwrap().to_owned())
            .collect();
        assert_eq!(
            keys,
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
