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
    /// The KV-cache group (only 0 is indexed).
    pub group_idx: u32,
}

/// `BlockRemoved`.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockRemoved {
    /// The evicted blocks.
    pub block_hashes: Vec<EngineHash>,
    /// The tier they left.
    pub tier: Tier,
    /// The KV-cache group.
    pub group_idx: u32,
}
