//! vLLM's KV-event wire format (msgpack), decoded into indexd's own types at
//! the edge.
//!
//! A live message is `[topic, seq (u64 BE), payload]`. The payload is a batch
//! in one of three shapes, all accepted:
//!
//! - `[ts, events, data_parallel_rank?]` (vLLM's `array_like` batch),
//! - `{ts, events, data_parallel_rank}` (a batch declared without `array_like`),
//!
//! and each event is either a map tagged by `"type"` (current vLLM) or a
//! tag-first array (`["BlockStored", block_hashes, parent_block_hash,
//! token_ids, block_size, lora_id, medium, lora_name, extra_keys?,
//! group_idx?, …]`). Block hashes are msgpack ints of any width, or a 32-byte
//! bin whose last 8 bytes (big-endian) are the hash. Unknown keys and trailing
//! fields are skipped.
//!
//! The decoder is a small hand-written msgpack reader over the frame's bytes:
//! it never indexes out of bounds, never recurses deeper than [`MAX_DEPTH`],
//! and allocates only what the [`Limits`] allow (capacities are clamped to
//! them, never taken from a length prefix alone).
#![deny(clippy::indexing_slicing)]

use crate::event::{
    BlockRemoved, BlockStored, EngineHash, EventBatch, ExtraKeys, GroupKind, KvEvent, Tier,
};

mod msgpack;

use msgpack::{Kind, Reader};

/// How deep unknown values may nest before the frame is rejected.
pub const MAX_DEPTH: usize = 32;

/// Caps on what a peer's frames may make indexd allocate (transport and
/// payload decoder alike).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest payload frame accepted, in bytes. The ZMTP transport never
    /// buffers a longer frame: it discards it as it arrives and the batch
    /// counts as a decode error (`too_large`).
    pub max_frame_bytes: usize,
    /// Most events in one batch.
    pub max_events_per_batch: usize,
    /// Most block hashes in one event.
    pub max_blocks_per_event: usize,
    /// Most token ids in one `BlockStored`.
    pub max_tokens_per_event: usize,
    /// Largest ZMTP message (its frames' lengths summed, discarded ones
    /// included): a peer claiming more is disconnected. At least
    /// `max_frame_bytes`.
    pub max_message_bytes: usize,
    /// Most publishers connected at once to one bound (`events_bind`)
    /// endpoint; more are refused.
    pub max_publisher_connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_frame_bytes: 8 << 20,
            max_events_per_batch: 16_384,
            max_blocks_per_event: 8_192,
            max_tokens_per_event: 1 << 20,
            max_message_bytes: 16 << 20,
            max_publisher_connections: 16,
        }
    }
}

/// Why a payload could not be decoded. Each variant is a metric label.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The frame ended inside a value.
    #[error("truncated msgpack")]
    Truncated,
    /// A value had a type the field does not allow.
    #[error("unexpected msgpack type for {0}")]
    UnexpectedType(&'static str),
    /// A required field is missing.
    #[error("missing field {0}")]
    Missing(&'static str),
    /// A configured cap was exceeded.
    #[error("{what} exceeds the limit of {limit}")]
    TooLarge {
        /// What was too large.
        what: &'static str,
        /// The cap.
        limit: usize,
    },
    /// Unknown values nested deeper than [`MAX_DEPTH`].
    #[error("msgpack nests too deep")]
    TooDeep,
    /// A string was not UTF-8.
    #[error("invalid utf-8 in {0}")]
    Utf8(&'static str),
    /// Bytes left after the batch.
    #[error("trailing bytes after the batch")]
    Trailing,
}

impl DecodeError {
    /// A short label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Truncated => "truncated",
            Self::UnexpectedType(_) => "unexpected_type",
            Self::Missing(_) => "missing_field",
            Self::TooLarge { .. } => "too_large",
            Self::TooDeep => "too_deep",
            Self::Utf8(_) => "utf8",
            Self::Trailing => "trailing",
        }
    }
}

/// The reserved seq value of the replay end marker (`ff × 8`).
pub const REPLAY_END_SEQ: u64 = u64::MAX;

/// Reads a seq frame: exactly 8 bytes big-endian.
pub fn decode_seq(frame: &[u8]) -> Option<u64> {
    let bytes: [u8; 8] = frame.try_into().ok()?;
    Some(u64::from_be_bytes(bytes))
}

/// Decodes one payload frame.
pub fn decode_batch(payload: &[u8], limits: &Limits) -> Result<EventBatch, DecodeError> {
    if payload.len() > limits.max_frame_bytes {
        return Err(DecodeError::TooLarge {
            what: "frame",
            limit: limits.max_frame_bytes,
        });
    }
    let mut r = Reader { buf: payload };
    let batch = match r.peek()? {
        Kind::Array => decode_array_batch(&mut r, limits)?,
        Kind::Map => decode_map_batch(&mut r, limits)?,
        _ => return Err(DecodeError::UnexpectedType("batch")),
    };
    if !r.buf.is_empty() {
        return Err(DecodeError::Trailing);
    }
    Ok(batch)
}

fn decode_array_batch(r: &mut Reader<'_>, limits: &Limits) -> Result<EventBatch, DecodeError> {
    let len = r.array_len()?;
    if len < 2 {
        return Err(DecodeError::Missing("events"));
    }
    let ts = r.f64("ts")?;
    let events = decode_events(r, limits)?;
    let mut data_parallel_rank = None;
    if len >= 3 {
        data_parallel_rank = r.opt_u32("data_parallel_rank")?;
    }
    for _ in 3..len {
        r.skip(0)?;
    }
    Ok(EventBatch {
        ts,
        events,
        data_parallel_rank,
    })
}

fn decode_map_batch(r: &mut Reader<'_>, limits: &Limits) -> Result<EventBatch, DecodeError> {
    let len = r.map_len()?;
    let (mut ts, mut events, mut rank) = (0.0, None, None);
    for _ in 0..len {
        match r.key()? {
            Some(b"ts") => ts = r.f64("ts")?,
            Some(b"events") => events = Some(decode_events(r, limits)?),
            Some(b"data_parallel_rank") => rank = r.opt_u32("data_parallel_rank")?,
            _ => r.skip(0)?,
        }
    }
    Ok(EventBatch {
        ts,
        events: events.ok_or(DecodeError::Missing("events"))?,
        data_parallel_rank: rank,
    })
}

fn decode_events(r: &mut Reader<'_>, limits: &Limits) -> Result<Vec<KvEvent>, DecodeError> {
    let len = r.array_len()?;
    if len > limits.max_events_per_batch {
        return Err(DecodeError::TooLarge {
            what: "events per batch",
            limit: limits.max_events_per_batch,
        });
    }
    let mut events = Vec::with_capacity(len);
    for _ in 0..len {
        events.push(match r.peek()? {
            Kind::Map => decode_map_event(r, limits)?,
            Kind::Array => decode_array_event(r, limits)?,
            _ => return Err(DecodeError::UnexpectedType("event")),
        });
    }
    Ok(events)
}

/// The fields of any event, gathered before the type is known (a map's
/// `"type"` need not come first).
#[derive(Default)]
struct Fields {
    block_hashes: Option<Vec<EngineHash>>,
    parent: Option<EngineHash>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u32>,
    medium: Option<Tier>,
    lora_name: Option<String>,
    extra_keys: Option<Vec<RawExtra>>,
    group_idx: u32,
    kind: Option<GroupKind>,
    sliding_window: Option<u32>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum EventType {
    Stored,
    Removed,
    Cleared,
    Unknown,
}

fn event_type(tag: &[u8]) -> EventType {
    match tag {
        b"BlockStored" => EventType::Stored,
        b"BlockRemoved" => EventType::Removed,
        b"AllBlocksCleared" => EventType::Cleared,
        _ => EventType::Unknown,
    }
}

fn decode_map_event(r: &mut Reader<'_>, limits: &Limits) -> Result<KvEvent, DecodeError> {
    let len = r.map_len()?;
    let mut ty = None;
    let mut f = Fields::default();
    for _ in 0..len {
        match r.key()? {
            Some(b"type") => ty = Some(event_type(r.str_bytes("type")?)),
            Some(b"block_hashes") => f.block_hashes = Some(r.hashes(limits)?),
            Some(b"parent_block_hash") => f.parent = r.opt_hash("parent_block_hash")?,
            Some(b"token_ids") => f.token_ids = Some(r.tokens(limits)?),
            Some(b"block_size") => f.block_size = Some(r.u32("block_size")?),
            Some(b"medium") => f.medium = r.opt_medium()?,
            Some(b"lora_name") => f.lora_name = r.opt_string("lora_name")?,
            Some(b"extra_keys") => f.extra_keys = r.extra_keys(limits)?,
            Some(b"group_idx") => f.group_idx = r.opt_u32("group_idx")?.unwrap_or(0),
            Some(b"kv_cache_spec_kind") => f.kind = r.opt_kind()?,
            Some(b"kv_cache_spec_sliding_window") => {
                f.sliding_window = r.opt_u32("kv_cache_spec_sliding_window")?;
            }
            _ => r.skip(0)?,
        }
    }
    build_event(ty.ok_or(DecodeError::Missing("type"))?, f)
}

fn decode_array_event(r: &mut Reader<'_>, limits: &Limits) -> Result<KvEvent, DecodeError> {
    let len = r.array_len()?;
    if len == 0 {
        return Err(DecodeError::Missing("type"));
    }
    let ty = event_type(r.str_bytes("type")?);
    let mut f = Fields::default();
    for i in 1..len {
        match (ty, i) {
            (EventType::Stored | EventType::Removed, 1) => f.block_hashes = Some(r.hashes(limits)?),
            (EventType::Stored, 2) => f.parent = r.opt_hash("parent_block_hash")?,
            (EventType::Stored, 3) => f.token_ids = Some(r.tokens(limits)?),
            (EventType::Stored, 4) => f.block_size = Some(r.u32("block_size")?),
            (EventType::Stored, 6) | (EventType::Removed, 2) => f.medium = r.opt_medium()?,
            (EventType::Stored, 7) => f.lora_name = r.opt_string("lora_name")?,
            (EventType::Stored, 8) => f.extra_keys = r.extra_keys(limits)?,
            (EventType::Stored, 9) | (EventType::Removed, 3) => {
                f.group_idx = r.opt_u32("group_idx")?.unwrap_or(0);
            }
            (EventType::Stored, 10) => f.kind = r.opt_kind()?,
            (EventType::Stored, 11) => {
                f.sliding_window = r.opt_u32("kv_cache_spec_sliding_window")?;
            }
            _ => r.skip(0)?,
        }
    }
    build_event(ty, f)
}

fn build_event(ty: EventType, f: Fields) -> Result<KvEvent, DecodeError> {
    let tier = f.medium.unwrap_or(Tier::Gpu);
    match ty {
        EventType::Stored => {
            let block_hashes = f.block_hashes.ok_or(DecodeError::Missing("block_hashes"))?;
            let lora_name = f.lora_name.as_deref();
            let extra_keys = f.extra_keys.map(|raw| {
                raw.into_iter()
                    .enumerate()
                    .map(|(i, raw)| raw.classify(i, lora_name))
                    .collect()
            });
            Ok(KvEvent::BlockStored(BlockStored {
                block_hashes,
                parent: f.parent,
                token_ids: f.token_ids.unwrap_or_default(),
                block_size: f.block_size.ok_or(DecodeError::Missing("block_size"))?,
                tier,
                lora_name: f.lora_name,
                extra_keys,
                group_idx: f.group_idx,
                kind: f.kind,
                sliding_window: f.sliding_window,
            }))
        }
        EventType::Removed => Ok(KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: f.block_hashes.ok_or(DecodeError::Missing("block_hashes"))?,
            tier,
            group_idx: f.group_idx,
        })),
        EventType::Cleared => Ok(KvEvent::AllBlocksCleared),
        EventType::Unknown => Ok(KvEvent::Unknown),
    }
}

/// One block's extra keys before the LoRA name is known.
enum RawExtra {
    None,
    Strings(Vec<String>),
    Other,
}

impl RawExtra {
    /// The LoRA name (vLLM lists it first in every block's extra keys)
    /// partitions the index; the salt may only be on block 0; anything else
    /// (media hashes, embedding digests, non-string items) is not keyable.
    /// Only that one leading occurrence of the LoRA name is dropped: a salt
    /// equal to the adapter's name is still a salt.
    fn classify(self, block: usize, lora_name: Option<&str>) -> ExtraKeys {
        match self {
            Self::None => ExtraKeys::None,
            Self::Other => ExtraKeys::Unkeyable,
            Self::Strings(strings) => {
                let mut rest = strings.into_iter().peekable();
                if lora_name.is_some() && rest.peek().map(String::as_str) == lora_name {
                    rest.next();
                }
                match (rest.next(), rest.next()) {
                    (None, _) => ExtraKeys::None,
                    (Some(salt), None) if block == 0 => ExtraKeys::Salt(salt),
                    _ => ExtraKeys::Unkeyable,
                }
            }
        }
    }
}

/// The vLLM-specific fields, read with the generic [`Reader`].
impl Reader<'_> {
    fn opt_medium(&mut self) -> Result<Option<Tier>, DecodeError> {
        if self.nil()? {
            return Ok(None);
        }
        let bytes = self.str_bytes("medium")?;
        Ok(Some(if bytes.eq_ignore_ascii_case(b"GPU") {
            Tier::Gpu
        } else if bytes.eq_ignore_ascii_case(b"CPU") {
            Tier::Cpu
        } else {
            // STORAGE, DISK and any future lower tier.
            Tier::Storage
        }))
    }

    /// A hash: an int of any width, or a bin whose last 8 bytes are the hash
    /// (big-endian).
    fn hash(&mut self, field: &'static str) -> Result<EngineHash, DecodeError> {
        match self.peek()? {
            Kind::Int => self.int(field).map(EngineHash),
            Kind::Bin => {
                let bytes = self.bin_bytes(field)?;
                let tail = bytes
                    .len()
                    .checked_sub(8)
                    .and_then(|start| bytes.get(start..))
                    .ok_or(DecodeError::UnexpectedType(field))?;
                let arr: [u8; 8] = tail
                    .try_into()
                    .map_err(|_| DecodeError::UnexpectedType(field))?;
                Ok(EngineHash(u64::from_be_bytes(arr)))
            }
            _ => Err(DecodeError::UnexpectedType(field)),
        }
    }

    fn opt_hash(&mut self, field: &'static str) -> Result<Option<EngineHash>, DecodeError> {
        if self.nil()? {
            Ok(None)
        } else {
            self.hash(field).map(Some)
        }
    }

    fn hashes(&mut self, limits: &Limits) -> Result<Vec<EngineHash>, DecodeError> {
        let len = self.array_len()?;
        if len > limits.max_blocks_per_event {
            return Err(DecodeError::TooLarge {
                what: "blocks per event",
                limit: limits.max_blocks_per_event,
            });
        }
        let mut out = Vec::with_capacity(len);
        for _ in 0..len {
            out.push(self.hash("block_hashes")?);
        }
        Ok(out)
    }

    fn tokens(&mut self, limits: &Limits) -> Result<Vec<u32>, DecodeError> {
        if self.nil()? {
            return Ok(Vec::new());
        }
        let len = self.array_len()?;
        if len > limits.max_tokens_per_event {
            return Err(DecodeError::TooLarge {
                what: "tokens per event",
                limit: limits.max_tokens_per_event,
            });
        }
        self.token_array(len, "token_ids")
    }

    fn extra_keys(&mut self, limits: &Limits) -> Result<Option<Vec<RawExtra>>, DecodeError> {
        if self.nil()? {
            return Ok(None);
        }
        let len = self.array_len()?;
        if len > limits.max_blocks_per_event {
            return Err(DecodeError::TooLarge {
                what: "extra_keys per event",
                limit: limits.max_blocks_per_event,
            });
        }
        let mut out = Vec::with_capacity(len);
        for _ in 0..len {
            out.push(match self.peek()? {
                Kind::Nil => {
                    self.byte()?;
                    RawExtra::None
                }
                // A bare string (salt) instead of a one-element list.
                Kind::Str => match self.opt_string("extra_keys")? {
                    Some(s) => RawExtra::Strings(vec![s]),
                    None => RawExtra::None,
                },
                Kind::Array => self.extra_list()?,
                _ => {
                    self.skip(0)?;
                    RawExtra::Other
                }
            });
        }
        Ok(Some(out))
    }

    fn extra_list(&mut self) -> Result<RawExtra, DecodeError> {
        let len = self.array_len()?;
        let mut strings = Vec::new();
        let mut other = false;
        for _ in 0..len {
            if self.peek()? == Kind::Str && !other && strings.len() < 4 {
                if let Some(s) = self.opt_string("extra_keys")? {
                    strings.push(s);
                }
            } else {
                other = true;
                self.skip(0)?;
            }
        }
        Ok(if other {
            RawExtra::Other
        } else if strings.is_empty() {
            RawExtra::None
        } else {
            RawExtra::Strings(strings)
        })
    }
}

#[cfg(test)]
#[path = "wire_tests.rs"]
mod tests;
