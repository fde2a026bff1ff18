//! Workloads as seeded scripts: every conversation's inputs are fixed by the
//! seed before the run; only the model's replies come from the replicas (the
//! mock's output is a function of the prompt, so they are the same under every
//! profile).
//!
//! - W1, the published pairs: two replicas, 12 sequential two-turn pairs, a
//!   fresh `cache_salt` per pair, a ≈ 6.6k-token continuation; once over Chat
//!   Completions (`w1-chat`) and once over Responses (`w1-responses`).
//! - W2, concurrent agentic traffic: 8 replicas, 64 conversations, 16 in
//!   flight; a shared system prompt and tool list, tool-call loops whose
//!   results grow the context toward 26k tokens, user turns (which make the
//!   reasoning-dropping template rewrite earlier turns), branching retries
//!   (the last tool result replaced and the request sent again) and mixed
//!   salts (four tenants, one of them unsalted).
//! - W3, cache pressure: W2 with each replica's cache far below the working set.
//! - W4, active-active: W2 through three gateways (Envoy + its own indexd
//!   each; peers: three router processes), every request of a conversation
//!   sent to a gateway drawn from the seed, as behind a plain L4 balancer.
//! - W5, faults mid-run: W2 with a replica restart, lagging KV events, lost
//!   event batches and an indexd restart, each injected when a fixed share
//!   of the requests has been sent.
//!
//! The scripts are built in `families`; this module holds their shapes.

mod families;

use clap::ValueEnum;
use mock_vllm::KvCacheLayout;
use serde_json::Value;

use crate::rng::Rng;
pub(crate) use families::{tool_step, w1_pair};
use families::{w1, w2, w3, w4, w5};

/// A workload family on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WorkloadKind {
    /// The published pairs: 2 replicas, 12 salted two-turn pairs, ≈ 6.6k-token continuation,
    /// Chat and Responses.
    W1,
    /// Concurrent agentic traffic: 8 replicas, 64 conversations, tool loops, growing contexts,
    /// retries, mixed salts, reasoning-dropping template.
    W2,
    /// Cache pressure: W2's conversations on replicas whose prefix caches hold a fraction of the
    /// working set (evictions all the time).
    W3,
    /// Active-active: W2 through three gateways (Envoy + indexd each), clients spread across them.
    W4,
    /// Faults mid-run: W2 with a replica restart, event delay, lost batches and an indexd restart.
    W5,
}

/// A fault injected during a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// `POST /admin/restart` on one replica: empty cache, event seq from 0.
    ReplicaRestart {
        /// Replica index.
        replica: usize,
    },
    /// Every replica publishes its KV events this late from now on (0: on time again).
    EventDelay {
        /// Milliseconds.
        ms: u64,
    },
    /// Events on time again, and these replicas each lose their next batches live
    /// (numbered, not sent: the subscriber sees a gap and must replay).
    LostBatches {
        /// First replica index.
        first: usize,
        /// How many replicas, from `first`.
        replicas: usize,
        /// Batches lost per replica.
        batches: u32,
    },
    /// indexd stops, stays down this long, and starts again with an empty index
    /// (kvroute profiles only; peers keep running).
    IndexdRestart {
        /// Downtime in milliseconds.
        down_ms: u64,
    },
}

impl FaultKind {
    /// The phase label in samples for requests sent after this fault.
    pub fn label(self) -> &'static str {
        match self {
            Self::ReplicaRestart { .. } => "replica-restart",
            Self::EventDelay { .. } => "event-delay",
            Self::LostBatches { .. } => "lost-batches",
            Self::IndexdRestart { .. } => "indexd-restart",
        }
    }
}

/// A fault and when it strikes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fault {
    /// Injected just before the request with this index (in send order, from 0) is sent.
    pub at_request: usize,
    /// What happens.
    pub kind: FaultKind,
}

/// How big a run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Scale {
    /// The published shape (`make bench`).
    Full,
    /// A few requests per workload, for tests and quick checks.
    Smoke,
}

/// The API a conversation speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/responses` with the full history as input items.
    Responses,
    /// `/v1/messages` (Anthropic's Messages): the system prompt apart, tool
    /// calls as `tool_use` blocks and their results as `tool_result` blocks.
    Messages,
}

/// What the client adds after a reply before the next request.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// The reply called a tool: keep it (with the call) and add the tool's result.
    Tool {
        /// Tool name.
        name: String,
        /// Call arguments (JSON text).
        arguments: String,
        /// The tool's output.
        result: String,
    },
    /// Keep the reply and add a user message.
    User(String),
    /// Drop the last request's reply and replace its last input (tool result
    /// or user message) by this text: a branch from the same prefix.
    Retry(String),
}

impl Step {
    /// The label recorded in samples.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Tool { .. } => "tool",
            Self::User(_) => "user",
            Self::Retry(_) => "retry",
        }
    }
}

/// One conversation's script.
#[derive(Debug, Clone)]
pub struct Conversation {
    /// Index within the workload.
    pub id: u32,
    /// API used for every request.
    pub api: Api,
    /// `cache_salt`, if any.
    pub salt: Option<String>,
    /// Shared system prompt, if any.
    pub system: Option<String>,
    /// Shared tool list, if any.
    pub tools: Option<Value>,
    /// The opening user message.
    pub first: String,
    /// Inputs after each reply; one request each.
    pub steps: Vec<Step>,
    /// `max_tokens` of every request.
    pub max_tokens: u32,
    /// Its first request is not sent before this many milliseconds after
    /// the run started (0: as soon as a client takes it; W6-burst's seeded
    /// offsets spread its conversations' starts over less than 100 ms).
    pub start_ms: u32,
}

impl Conversation {
    /// Requests this conversation sends.
    pub fn requests(&self) -> usize {
        1 + self.steps.len()
    }
}

/// How a request's gateway is chosen among several.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GatewayChoice {
    /// Drawn from the seed per request, as behind a plain L4 balancer (W4).
    Drawn,
    /// Turn `t` of conversation `c` goes to gateway `(c + t) mod n`: every
    /// continuation reaches another gateway than its previous turn.
    Alternate,
}

/// A workload instance: what to start and what to send.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Name in samples (`w1-chat`, `w1-responses`, `w2`).
    pub name: String,
    /// Mock replicas.
    pub replicas: usize,
    /// Conversations in flight at once.
    pub concurrency: usize,
    /// The mock's latency model speed (1.0 = GPU-calibrated real time).
    pub time_scale: f64,
    /// vLLM block size.
    pub block_size: u32,
    /// Prefix-cache capacity of each replica, in blocks.
    pub gpu_blocks: usize,
    /// Drop-reasoning chat template with this many reasoning tokens per reply (0: role markers, no reasoning).
    pub reasoning_tokens: u32,
    /// The scripts.
    pub conversations: Vec<Conversation>,
    /// Gateways the clients spread their requests over (1: one Envoy or router).
    pub gateways: usize,
    /// How each request's gateway is chosen when there are several.
    pub gateway_choice: GatewayChoice,
    /// Faults, in order of `at_request`.
    pub faults: Vec<Fault>,
    /// The mock replicas' KV cache groups (default: one full-attention
    /// group; `kvroute-bench run --kv-cache-layout`). Real replicas have
    /// their model's ([`crate::fleet::FleetModel`]).
    pub kv_cache_layout: KvCacheLayout,
    /// The mock replicas' prefill chunk, vLLM's `max_num_batched_tokens`
    /// (None: a prompt in one step).
    pub max_num_batched_tokens: Option<u32>,
}

/// What a workload's name gets on mock replicas of another KV cache layout
/// than one full-attention group.
pub const HYBRID_SUFFIX: &str = "-hybrid";

impl Workload {
    /// This workload on mock replicas with the KV cache groups `layout`,
    /// prefilling in steps of `chunk` tokens when set; named
    /// `<name>-hybrid` unless `layout` is one full-attention group (the
    /// samples of either then never mix under one name).
    ///
    /// The groups share each replica's pool, so the pool grows by what the
    /// groups other than full attention hold for the conversations a replica
    /// serves when they are split evenly (a sliding window's
    /// `cdiv(window − 1, block) + 1` blocks each, a Mamba state's one): the
    /// full-attention group keeps the pressure it has alone (W3: 2,048
    /// blocks for it, plus 8 × 17 for a 256-token window at block size 16),
    /// as `make bench-vllm`'s hybrid W3 is sized.
    #[must_use]
    pub fn on_mock_layout(mut self, layout: &KvCacheLayout, chunk: Option<u32>) -> Self {
        if *layout != KvCacheLayout::default() && !self.name.ends_with(HYBRID_SUFFIX) {
            self.name.push_str(HYBRID_SUFFIX);
        }
        if self.kv_cache_layout == KvCacheLayout::default() {
            let bs = self.block_size.max(1) as usize;
            // Long enough that every group other than full attention is at
            // its running bound.
            let long = 1usize << 24;
            let full = layout
                .groups()
                .iter()
                .filter(|g| g.is_full_attention())
                .count();
            let others = layout
                .blocks_held(long, bs)
                .saturating_sub(full * long.div_ceil(bs));
            let per_replica = self.conversations.len().div_ceil(self.replicas.max(1));
            self.gpu_blocks += per_replica * others;
        }
        self.kv_cache_layout = layout.clone();
        self.max_num_batched_tokens = chunk;
        self
    }

    /// The mock replicas' `max_model_len`: `ceiling`, or less when their
    /// pool (`gpu_blocks`, shared by the KV cache groups) cannot hold what
    /// one request that long leaves cached in every group (the mock refuses
    /// to start then, as vLLM does): W3's 2,048 blocks hold 32,768 tokens of
    /// one full-attention group, 32,256 beside a 256-token sliding window.
    /// A multiple of the block size (0 when not even one block fits).
    pub fn mock_max_model_len(&self, ceiling: u32) -> u32 {
        let bs = self.block_size.max(1);
        let mut len = ceiling / bs * bs;
        while len > 0
            && self
                .kv_cache_layout
                .max_cached_blocks(len as usize, bs as usize, true)
                > self.gpu_blocks
        {
            len -= bs;
        }
        len
    }

    /// Requests the workload sends.
    pub fn requests(&self) -> usize {
        self.conversations.iter().map(Conversation::requests).sum()
    }

    /// The gateway (index into the run's gateways) of request `turn` of
    /// `conversation`: drawn from the seed, independent of the profile.
    pub fn gateway(&self, seed: u64, conversation: u32, turn: usize) -> usize {
        if self.gateways <= 1 {
            return 0;
        }
        if self.gateway_choice == GatewayChoice::Alternate {
            return (conversation as usize + turn) % self.gateways;
        }
        let mut rng = Rng::new(
            seed,
            (5u64 << 40) | (u64::from(conversation) << 16) | turn as u64,
        );
        rng.range(0, self.gateways - 1)
    }
}

/// Builds the workloads of `kind` at `scale` from `seed`.
pub fn build(kind: WorkloadKind, scale: Scale, seed: u64) -> Vec<Workload> {
    match kind {
        WorkloadKind::W1 => vec![w1(Api::Chat, scale, seed), w1(Api::Responses, scale, seed)],
        WorkloadKind::W2 => vec![w2(scale, seed)],
        WorkloadKind::W3 => vec![w3(scale, seed)],
        WorkloadKind::W4 => vec![w4(scale, seed)],
        WorkloadKind::W5 => vec![w5(scale, seed)],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn w4_spreads_each_conversation_over_the_gateways() {
        let w = &build(WorkloadKind::W4, Scale::Full, 42)[0];
        assert_eq!(w.gateways, 3);
        let mut used = [0usize; 3];
        let mut moved = 0;
        for c in &w.conversations {
            let gateways: Vec<usize> = (0..c.requests()).map(|t| w.gateway(42, c.id, t)).collect();
            for g in &gateways {
                used[*g] += 1;
            }
            moved += usize::from(gateways.windows(2).any(|p| p[0] != p[1]));
            assert_eq!(
                gateways,
                (0..c.requests())
                    .map(|t| w.gateway(42, c.id, t))
                    .collect::<Vec<_>>()
            );
        }
        assert!(used.iter().all(|&n| n > w.requests() / 5), "{used:?}");
        assert!(moved > w.conversations.len() / 2);
        assert_eq!(
            build(WorkloadKind::W2, Scale::Full, 42)[0].gateway(42, 3, 2),
            0
        );
    }

    #[test]
    fn a_hybrid_mock_layout_renames_the_workload_and_keeps_its_script() {
        let w4 = build(WorkloadKind::W4, Scale::Smoke, 42).remove(0);
        let layout: KvCacheLayout = "sliding_window:256,full_attention".parse().unwrap();
        let hybrid = w4.clone().on_mock_layout(&layout, Some(2_048));
        assert_eq!(hybrid.name, "w4-hybrid");
        assert_eq!(hybrid.kv_cache_layout, layout);
        assert_eq!(hybrid.max_num_batched_tokens, Some(2_048));
        assert_eq!(hybrid.requests(), w4.requests());
        assert_eq!(hybrid.gateways, 3);
        // Applied twice, one suffix; the default layout keeps the name.
        assert_eq!(hybrid.on_mock_layout(&layout, None).name, "w4-hybrid");
        let plain = w4.on_mock_layout(&KvCacheLayout::default(), None);
        assert_eq!(plain.name, "w4");
        assert_eq!(plain.kv_cache_layout, KvCacheLayout::default());
    }

    #[test]
    fn the_mock_s_max_model_len_fits_its_pool_with_every_group() {
        let layout: KvCacheLayout = "sliding_window:256,full_attention".parse().unwrap();
        let w3 = build(WorkloadKind::W3, Scale::Full, 42).remove(0);
        assert_eq!(w3.mock_max_model_len(32_768), 32_768);
        // One full-attention group: the pool as it is.
        let plain = w3.clone().on_mock_layout(&KvCacheLayout::default(), None);
        assert_eq!(plain.gpu_blocks, 2_048);
        // 8 conversations per replica, each with a 256-token window of
        // 16-token blocks (16 + 1) beside W3's 2,048 full-attention blocks.
        let hybrid = w3.clone().on_mock_layout(&layout, None);
        assert_eq!(hybrid.gpu_blocks, 2_048 + 8 * 17);
        assert_eq!(hybrid.mock_max_model_len(32_768), 32_768);
        // Applied again, the pool does not grow again.
        let again = hybrid.clone().on_mock_layout(&layout, None);
        assert_eq!(again.gpu_blocks, hybrid.gpu_blocks);
        // A pool below what a 32k request leaves cached: max_model_len shrinks.
        let mut tight = hybrid;
        tight.gpu_blocks = 2_048;
        let len = tight.mock_max_model_len(32_768);
        assert_eq!(len, (2_048 - 32) * 16);
        let cached = |n: u32| {
            tight
                .kv_cache_layout
                .max_cached_blocks(n as usize, 16, true)
        };
        assert!(cached(len) <= 2_048 && cached(len + 16) > 2_048);
        // Smoke W3's 256 blocks: far below the 32k ceiling, yet above its
        // prompts, hybrid or not.
        let smoke = build(WorkloadKind::W3, Scale::Smoke, 42).remove(0);
        assert_eq!(smoke.mock_max_model_len(32_768), 256 * 16);
        let smoke_hybrid = smoke.on_mock_layout(&layout, None);
        assert!(smoke_hybrid.mock_max_model_len(32_768) >= 256 * 16);
        // A roomy pool leaves the ceiling.
        let w2 = build(WorkloadKind::W2, Scale::Full, 42).remove(0);
        assert_eq!(
            w2.on_mock_layout(&layout, None).mock_max_model_len(32_768),
            32_768
        );
    }
}
