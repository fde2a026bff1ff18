//! indexd's own KV-event types: what [`crate::wire`] decodes vLLM's msgpack
//! into and what [`crate::index`] applies. A leaf module: it imports nothing
//! from the rest of the crate.

use std::fmt;

/// vLLM's engine-side block hash (`ExternalBlockHash`), as a u64.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineHash(pub u64);

impl fmt::Debug for EngineHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "EngineHash({:016x})", self.0)
    }
}

/// A storage tier, best first (an event's `medium`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// Device memory.
    Gpu,
    /// Host memory (offloaded).
    Cpu,
    /// Disk or remote storage.
    Storage,
}

impl Tier {
    /// All tiers, best first.
    pub const ALL: [Tier; 3] = [Tier::Gpu, Tier::Cpu, Tier::Storage];

    /// The label used in metrics and logs.
    pub const fn label(self) -> &'static str {
        match self {
            Tier::Gpu => "gpu",
            Tier::Cpu => "cpu",
            Tier::Storage => "storage",
        }
    }
}

/// One decoded payload.
#[derive(Clone, Debug, PartialEq)]
pub struct EventBatch {
    /// The publisher's wall-clock timestamp (seconds).
    pub ts: f64,
    /// The events, in order.
    pub events: Vec<KvEvent>,
    /// The data-parallel rank the batch names, if any.
    pub data_parallel_rank: Option<u32>,
}

/// One KV-cache event.
#[derive(Clone, Debug, PartialEq)]
pub enum KvEvent {
    /// Blocks were stored (with tokens) or re-announced in another tier
    /// (without tokens).
    BlockStored(BlockStored),
    /// Blocks were evicted from a tier.
    BlockRemoved(BlockRemoved),
    /// The whole prefix cache was reset.
    AllBlocksCleared,
    /// An event type this decoder does not know (skipped, counted).
    Unknown,
}

/// Keyability of one block's `extra_keys`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExtraKeys {
    /// Nothing besides tokens (and the LoRA name, which partitions the index).
    None,
    /// The `cache_salt` (block 0 only).
    Salt(String),
    /// Media, embeddings or anything else the router cannot compute.
    Unkeyable,
}

/// `BlockStored`, reduced to what indexd uses.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockStored {
    /// One hash per block, in prompt order.
    pub block_hashes: Vec<EngineHash>,
    /// The block before the first one (`None` for a prompt's first block).
    pub parent: Option<EngineHash>,
    /// `block_hashes.len() × block_size` tokens, or none for a tier move.
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// Where the blocks now live.
    pub tier: Tier,
    /// The LoRA adapter, if any.
    pub lora_name: Option<String>,
    /// Per block. `None` when the event carries no `extra_keys` (older vLLM,
    /// offloading connectors): then a prompt's first block may have been
    /// salted, and only the engine hash (or a known parent) says what it is.
    pub extra_keys: Option<Vec<ExtraKeys>>,
    /// The KV-cache group.
    pub group_idx: u32,
    /// The group's attention kind (`kv_cache_spec_kind`; `None` from vLLM
    /// releases that do not say).
    pub kind: Option<GroupKind>,
    /// The group's sliding window in tokens (`kv_cache_spec_sliding_window`,
    /// sliding groups only).
    pub sliding_window: Option<u32>,
}

/// A KV cache group's attention kind, as vLLM's events name it
/// (`KVCacheSpecKind`). Kinds whose prefix-cache hit follows the same
/// manager share a variant: MLA and attention-sink layers are full attention
/// to the cache (`FullAttentionManager`), sliding-window MLA is a sliding
/// window (`SlidingWindowManager`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum GroupKind {
    /// `full_attention`, `mla_attention`, `sink_full_attention`.
    FullAttention(FullLabel),
    /// `sliding_window`, `sliding_window_mla`.
    SlidingWindow {
        /// `sliding_window_mla`.
        mla: bool,
    },
    /// `chunked_local_attention`.
    ChunkedLocal,
    /// `mamba`.
    Mamba,
    /// Any other kind (its label, at most [`GroupKind::MAX_LABEL`] bytes).
    Other(String),
}

/// Which full-attention label an event used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FullLabel {
    /// `full_attention`.
    Full,
    /// `mla_attention`.
    Mla,
    /// `sink_full_attention`.
    Sink,
}

impl GroupKind {
    /// The longest label kept for an unknown kind.
    pub const MAX_LABEL: usize = 64;

    /// The kind an event's `kv_cache_spec_kind` names.
    pub fn from_label(label: &str) -> Self {
        match label {
            "full_attention" => Self::FullAttention(FullLabel::Full),
            "mla_attention" => Self::FullAttention(FullLabel::Mla),
            "sink_full_attention" => Self::FullAttention(FullLabel::Sink),
            "sliding_window" => Self::SlidingWindow { mla: false },
            "sliding_window_mla" => Self::SlidingWindow { mla: true },
            "chunked_local_attention" => Self::ChunkedLocal,
            "mamba" => Self::Mamba,
            other => {
                let mut end = other.len().min(Self::MAX_LABEL);
                while !other.is_char_boundary(end) {
                    end -= 1;
                }
                Self::Other(other.get(..end).unwrap_or_default().to_owned())
            }
        }
    }

    /// vLLM's label for this kind (metrics, logs, `/readyz`).
    pub fn label(&self) -> &str {
        match self {
            Self::FullAttention(FullLabel::Full) => "full_attention",
            Self::FullAttention(FullLabel::Mla) => "mla_attention",
            Self::FullAttention(FullLabel::Sink) => "sink_full_attention",
            Self::SlidingWindow { mla: false } => "sliding_window",
            Self::SlidingWindow { mla: true } => "sliding_window_mla",
            Self::ChunkedLocal => "chunked_local_attention",
            Self::Mamba => "mamba",
            Self::Other(label) => label,
        }
    }
}

/// `BlockRemoved`.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockRemoved {
    /// The evicted blocks.
    pub block_hashes: Vec<EngineHash>,
    /// The tier they left.
    pub tier: Tier,
    /// The KV-cache group they left.
    pub group_idx: u32,
}
