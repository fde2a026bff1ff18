//! Scoring: a pure function from a snapshot of candidates to an ordered list.
//!
//! The cost of sending the request to replica `r` is its estimated time to
//! first token, in seconds:
//!
//! ```text
//! credited_r = block_size × Σ_tier matched_blocks_r[tier] × credit[tier]
//! uncached_r = max(prompt_tokens − credited_r, 0)
//! scraped_r  = waiting_r × (queued_tokens_per_waiting / rate_r + overhead_r)
//! queue_r    = max(queued_seconds_r, scraped_r)
//! cost_r     = uncached_r / rate_r + queue_r
//!            + running_penalty_seconds   × running_r
//!            + kv_usage_penalty_seconds  × kv_usage_r
//!            + occupancy_penalty_seconds × occupancy_r        (capacity signal)
//! ```
//!
//! `rate_r` and `overhead_r` are the replica's prefill speed and fixed time
//! per request, fitted from its own metrics ([`crate::calibrate`]):
//! `prefill_tokens_per_second` and 0 until there is enough evidence (the
//! request's own overhead is the same everywhere and left out).
//! `queued_seconds_r` is the prefill this indexd's own picks queued there and
//! that is not done yet by their estimates: each pick's uncached tokens at
//! `rate_r` plus `overhead_r`, placed after the picks before it, draining as
//! time passes and shortened when the filter reports an answer. `scraped_r`
//! is what the replica's metrics say is waiting, which also counts other
//! gateways' requests; the larger of the two stands (the scrape shows this
//! indexd's picks too, so they are not added).
//!
//! `credit` is 1.0 for GPU, less for CPU and storage; with a capacity signal
//! saying `cache_available: false`, lower tiers earn nothing. Candidates are
//! ordered by cost (rounded to microseconds), then more matched blocks, then
//! fewer requests in flight (`running + waiting + pending`), then a random
//! draw from the caller's RNG (seeded in tests).
//!
//! **Moves pay or do not happen.** When the cheapest candidate holds less of
//! the prompt than the candidate holding the most (the conversation's warm
//! replica), going there re-prefills the difference, and that work delays
//! everything queued behind it on the target: a cost the request's own TTFT
//! does not show. Load figures are also partly stale (a scrape interval, and
//! other gateways' picks are not seen at all). So the warm replica stays
//! first unless the move saves more than `move_margin` times its re-prefill
//! time, both sides priced at the slower of the two replicas' speeds and the
//! re-prefill no faster than the prior `prefill_tokens_per_second`.
//!
//! A passing queue does not move a conversation either: unless vLLM reports
//! requests waiting on the warm replica in two scrapes in a row, the move
//! also needs this indexd to
//! have more conversations there than on the target: more than
//! `1 + move_imbalance` times as many, and two more
//! ([`crate::conversations`]: each conversation counts where its latest
//! turn went), and the replicas' own metrics to show more requests in
//! flight (running and waiting) on the warm replica than on the target
//! (with several gateways, this indexd's counts are only the turns sent
//! through it: three conversations against one here can be four against
//! four in the fleet). Moved conversations take their later turns along, so between
//! replicas with as many conversations each, moves would only trade them
//! back and forth; and the pace of picks is no measure, since conversations
//! on a faster replica take their turns faster.
//!
//! Only blocks the replica's events show are defended this way. Blocks held
//! speculatively (a pick just sent them there: the shared prompt of
//! conversations starting together) count as cached in the cost but earn no
//! hold: otherwise every new conversation would follow the first one to its
//! replica, and, conversations staying where they start, that pile-up would
//! last as long as they do.
//!
//! **Blocks count if they will still be there.** A replica's matched
//! blocks are what it holds now; the request is admitted only after the
//! requests queued ahead of it, and each of those allocates the blocks of
//! what it does not find cached, evicting the least recently used free
//! blocks first. vLLM frees a finished request's blocks as the most
//! recently used (its last block first in line), so a conversation's blocks
//! go once the queue ahead needs more than the cache's other free blocks:
//!
//! ```text
//! free_r   = cache_blocks_r × (1 − kv_usage_r)       (free or evictable)
//! demand_r = max(blocks of this indexd's unanswered picks there not
//!                admitted yet (all but the oldest running_r),
//!                waiting_r × queued_tokens_per_waiting / block_size)
//! lost_r   = clamp(demand_r − (free_r − matched_r), 0, matched_r)
//! ```
//!
//! and the last `lost_r` matched blocks are not credited
//! (`predict_eviction`; only for a prefix held in GPU memory alone: with
//! CPU or storage tiers, evicted blocks are offloaded, not lost). A cache
//! with room (every roomy replica) loses nothing; under pressure, a
//! conversation whose replica would evict its history before reaching it is
//! not held there by blocks it will not find, and goes where it starts
//! soonest. Without `vllm:cache_config_info` in the replica's metrics,
//! nothing is discounted.
//!
//! A shared prefix cached everywhere credits every replica alike, so load
//! decides; a conversation's own history cached on one replica is a strong
//! reason to go there, weighed against its queue.

use std::time::Duration;

use rand::Rng;

pub use crate::config::Weights;
pub(crate) use registry::Registry;
pub use replica::Replica;

pub mod registry;
pub mod replica;
use crate::event::Tier;
use crate::index::PrefixMatch;

/// A lasting imbalance is also this many more conversations on the warm
/// replica than on the target (one more is none: a move would invert it).
const MIN_CONVERSATION_GAP: f64 = 2.0;

/// The credit `w` gives a block matched in `tier`.
fn credit(w: &Weights, tier: Tier, lower_tiers_available: bool) -> f64 {
    match tier {
        Tier::Gpu => w.credit_gpu,
        Tier::Cpu if lower_tiers_available => w.credit_cpu,
        Tier::Storage if lower_tiers_available => w.credit_storage,
        _ => 0.0,
    }
}

/// Whether `other` would cost no more than `chosen` were its prefill as
/// fast as `chosen`'s is believed to be: what keeps it from `chosen`'s place
/// is then its speed estimate alone.
pub fn behind_on_speed_alone(
    other: &Input,
    chosen: &Input,
    prompt_tokens: u32,
    block_size: u32,
    w: &Weights,
) -> bool {
    let mut as_fast = *other;
    as_fast.load.prefill_tokens_per_second = chosen.load.prefill_tokens_per_second;
    as_fast.load.prefill_overhead_seconds = chosen.load.prefill_overhead_seconds;
    cost(&as_fast, prompt_tokens, block_size, w) <= cost(chosen, prompt_tokens, block_size, w)
}

/// Load as last seen for one replica.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Load {
    /// `vllm:num_requests_running`.
    pub running: f64,
    /// `vllm:num_requests_waiting`.
    pub waiting: f64,
    /// The same in the scrape before (0 before a second scrape): a queue
    /// that shows in both lasted at least a scrape interval.
    pub waiting_before: f64,
    /// `vllm:kv_cache_usage_perc` (0..1).
    pub kv_usage: f64,
    /// Picks not yet visible in the metrics (nor answered).
    pub pending_picks: f64,
    /// Seconds of prefill this indexd's picks queued there that are not done
    /// by their estimates (module docs).
    pub queued_seconds: f64,
    /// Capacity signal occupancy (0..1), if any.
    pub occupancy: Option<f64>,
    /// Capacity signal `cache_available` (true without a signal).
    pub cache_available: bool,
    /// Its prefill speed as fitted from its metrics (None: use the prior).
    pub prefill_tokens_per_second: Option<f64>,
    /// Its fitted fixed prefill time per request, in seconds (0 unfitted).
    pub prefill_overhead_seconds: f64,
    /// Conversations whose latest turn this indexd sent there
    /// ([`crate::conversations`]).
    pub conversations: f64,
    /// Its KV cache's size in blocks (`vllm:cache_config_info`), if known.
    pub cache_blocks: Option<f64>,
    /// Blocks this indexd's unanswered picks there will allocate.
    pub demand_blocks: f64,
}

impl Load {
    /// Requests in flight on the replica by its own metrics (running and
    /// waiting, every gateway's), not counting this indexd's pending picks.
    fn in_flight(&self) -> f64 {
        self.running.max(0.0) + self.waiting.max(0.0)
    }
}

/// One candidate as the scorer sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Input {
    /// The leading blocks it holds.
    pub matched: PrefixMatch,
    /// Its load.
    pub load: Load,
}

/// One ranked candidate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Ranked {
    /// Index into the input slice.
    pub input: usize,
    /// Estimated TTFT in seconds.
    pub cost: f64,
}

/// The order, and what the move rule did to it.
#[derive(Clone, Debug, PartialEq)]
pub struct Ranking {
    /// Best first.
    pub ranked: Vec<Ranked>,
    /// What happened to the warm replica (the one holding the most).
    pub moved: Move,
}

/// The move rule's verdict on one ranking.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Move {
    /// No candidate holds more than the cheapest (nothing to leave).
    None,
    /// The cheapest is elsewhere but the saving does not pay the re-prefill:
    /// the warm replica stays first.
    Held,
    /// The saving pays the re-prefill: the cheapest goes first.
    Moved,
    /// The saving pays the re-prefill, but the cheapest may not take the
    /// conversation now (`may_move`: it moved a moment ago, or the target
    /// is a replica still filling with new conversations): the warm replica
    /// stays first.
    Barred,
}

/// Of `matched`, what a replica with `load` will still hold when a request
/// sent now is admitted: the last blocks the queue ahead of it evicts are
/// taken off (module docs). `block_size` converts the per-waiting prior.
pub fn surviving(matched: PrefixMatch, load: &Load, block_size: u32, w: &Weights) -> PrefixMatch {
    let gpu = matched.per_tier[0];
    let lower = matched.per_tier[1].saturating_add(matched.per_tier[2]);
    let Some(cache) = load.cache_blocks.filter(|c| c.is_finite() && *c > 0.0) else {
        return matched;
    };
    if !w.predict_eviction || gpu == 0 || lower > 0 {
        return matched;
    }
    let free = cache * (1.0 - load.kv_usage.clamp(0.0, 1.0));
    let waiting =
        load.waiting.max(0.0) * w.queued_tokens_per_waiting / f64::from(block_size.max(1));
    let demand = load.demand_blocks.max(0.0).max(waiting);
    // Whole blocks (the usage is a fraction of the cache).
    let lost = (demand - (free - f64::from(gpu)))
        .clamp(0.0, f64::from(gpu))
        .round();
    if !lost.is_finite() || lost < 1.0 {
        return matched;
    }
    let lost = (lost as u32).min(gpu);
    let blocks = matched.blocks.saturating_sub(lost);
    PrefixMatch {
        blocks,
        per_tier: [gpu - lost, 0, 0],
        speculative: matched.speculative.min(blocks),
        unmodelled: matched.unmodelled,
    }
}

/// The prompt tokens `input` holds, credited by tier.
fn credited(input: &Input, block_size: u32, w: &Weights) -> f64 {
    let available = input.load.cache_available;
    Tier::ALL
        .into_iter()
        .zip(input.matched.per_tier)
        .map(|(tier, n)| f64::from(n) * f64::from(block_size) * credit(w, tier, available))
        .sum()
}

/// Of [`credited`], what its events show (speculative blocks count as GPU).
fn confirmed(input: &Input, block_size: u32, w: &Weights) -> f64 {
    let speculative = f64::from(input.matched.speculative.min(input.matched.per_tier[0]))
        * f64::from(block_size)
        * credit(w, Tier::Gpu, input.load.cache_available);
    (credited(input, block_size, w) - speculative).max(0.0)
}

/// Its prefill speed: fitted, else the prior.
fn rate(load: &Load, w: &Weights) -> f64 {
    load.prefill_tokens_per_second
        .filter(|r| r.is_finite() && *r > 0.0)
        .unwrap_or(w.prefill_tokens_per_second)
}

/// Its fitted fixed time per request (0 unfitted or nonsensical).
fn overhead(load: &Load) -> f64 {
    let o = load.prefill_overhead_seconds;
    if o.is_finite() && o > 0.0 { o } else { 0.0 }
}

/// The estimated time a replica with `load` takes to prefill `tokens` of a
/// request: at its fitted speed (else the prior), plus its fixed time per
/// request.
fn prefill_seconds(load: &Load, tokens: f64, w: &Weights) -> f64 {
    let s = tokens.max(0.0) / rate(load, w) + overhead(load);
    if s.is_finite() { s } else { 0.0 }
}

/// [`prefill_seconds`] as a duration, at most an hour.
pub fn prefill_time(load: &Load, tokens: f64, w: &Weights) -> Duration {
    Duration::try_from_secs_f64(prefill_seconds(load, tokens, w).min(3_600.0)).unwrap_or_default()
}

/// The cost of one candidate (see the module docs).
pub fn cost(input: &Input, prompt_tokens: u32, block_size: u32, w: &Weights) -> f64 {
    cost_at(input, prompt_tokens, block_size, w, rate(&input.load, w))
}

/// [`cost`] with the prompt's uncached tokens prefilled at `rate` (the queue
/// stays as the replica's own speed estimated it).
fn cost_at(input: &Input, prompt_tokens: u32, block_size: u32, w: &Weights, rate: f64) -> f64 {
    let load = &input.load;
    let credited = credited(input, block_size, w);
    let uncached = (f64::from(prompt_tokens) - credited).max(0.0);
    let scraped = load.waiting.max(0.0) * prefill_seconds(load, w.queued_tokens_per_waiting, w);
    let queue = load.queued_seconds.max(0.0).max(scraped);
    let mut c = uncached / rate
        + queue
        + w.running_penalty_seconds * load.running
        + w.kv_usage_penalty_seconds * load.kv_usage.clamp(0.0, 1.0);
    if let Some(occ) = load.occupancy {
        c += w.occupancy_penalty_seconds * occ.clamp(0.0, 1.0);
    }
    if c.is_finite() { c } else { f64::MAX }
}

/// Orders `inputs` best first, then applies the move rule (module docs).
/// `prompt_tokens` is at least the keyed tokens.
#[cfg(test)]
pub fn rank<R: Rng>(
    inputs: &[Input],
    prompt_tokens: u32,
    block_size: u32,
    w: &Weights,
    rng: &mut R,
) -> Ranking {
    rank_with(inputs, prompt_tokens, block_size, w, rng, |_| true)
}

/// [`rank`], where a move away from the warm replica may go to input `i`
/// only if `may_move(i)`: else the warm replica stays first (a conversation
/// moved a moment ago, or a replica still filling with new conversations).
pub fn rank_with<R: Rng>(
    inputs: &[Input],
    prompt_tokens: u32,
    block_size: u32,
    w: &Weights,
    rng: &mut R,
    may_move: impl Fn(usize) -> bool,
) -> Ranking {
    let mut ranked = by_cost(inputs, prompt_tokens, block_size, w, rng);
    let moved = apply_move_rule(inputs, &mut ranked, prompt_tokens, block_size, w, may_move);
    Ranking { ranked, moved }
}

/// Keeps the warm replica first unless leaving it pays (module docs).
///
/// The two sides are compared at one prefill speed, the slower of the two
/// replicas' estimates (the re-prefill also no faster than the prior): speeds are fitted from each replica's own traffic,
/// and a warm replica that serves mostly cached continuations (few computed
/// tokens, each waiting on its batch) can look several times slower than an
/// identical one serving cold prompts. Priced at their own speeds, that
/// error alone would move conversations off the replica holding them.
fn apply_move_rule(
    inputs: &[Input],
    ranked: &mut [Ranked],
    prompt_tokens: u32,
    block_size: u32,
    w: &Weights,
    may_move: impl Fn(usize) -> bool,
) -> Move {
    let Some(first) = ranked.first().copied() else {
        return Move::None;
    };
    let Some(cheapest) = inputs.get(first.input) else {
        return Move::None;
    };
    let held_by_cheapest = credited(cheapest, block_size, w);
    // The warm replica: the one whose events show the most (the first in
    // cost order among equals), if more than the cheapest holds.
    let mut warm: Option<(usize, f64, &Input)> = None;
    for (at, r) in ranked.iter().enumerate() {
        let Some(input) = inputs.get(r.input) else {
            continue;
        };
        let held = confirmed(input, block_size, w);
        if held > warm.map_or(held_by_cheapest, |(_, h, _)| h) {
            warm = Some((at, held, input));
        }
    }
    let Some((at, held, warm_input)) = warm else {
        return Move::None;
    };
    let common = rate(&cheapest.load, w).min(rate(&warm_input.load, w));
    let saving = cost_at(warm_input, prompt_tokens, block_size, w, common)
        - cost_at(cheapest, prompt_tokens, block_size, w, common);
    // The re-prefill is priced no cheaper than the prior says: a fit over
    // the fleet's own (short, batched) prefills can find a marginal speed far
    // above what a move's thousands of tokens take.
    let reprefill_seconds = (held - held_by_cheapest) / common.min(w.prefill_tokens_per_second);
    // A queue that comes and goes is no reason to move a conversation:
    // conversations stay where they go, so a move shifts all of its later
    // turns too, and two replicas with as many conversations each would only
    // trade them back and forth. vLLM's own requests waiting in two scrapes
    // in a row are (every gateway's load, and not the burst of a moment:
    // conversations starting together fill a queue that the next scrape no
    // longer shows); else this indexd's conversations must be uneven.
    // This indexd's counts are only its own share of the traffic when
    // several gateways route it (each sees the turns sent through it): the
    // replicas' own counts, every gateway's requests, must show more in
    // flight on the warm replica too.
    let pays =
        saving > w.move_margin * reprefill_seconds && lasting(&warm_input.load, &cheapest.load, w);
    if pays && may_move(first.input) {
        return Move::Moved;
    }
    if let Some(head) = ranked.get_mut(..=at) {
        head.rotate_right(1);
    }
    if pays { Move::Barred } else { Move::Held }
}

/// Whether the load on a conversation's `warm` replica is a lasting reason
/// to move it to `target` (the move rule's second condition, module docs):
/// vLLM reported requests waiting on `warm` in two scrapes in a row, or this
/// indexd holds a lasting imbalance of conversations there against
/// `target`, which the replicas' own in-flight counts confirm.
fn lasting(warm: &Load, target: &Load, w: &Weights) -> bool {
    queued(warm) || (outnumbers(warm, target, w) && warm.in_flight() > target.in_flight())
}

/// vLLM reported requests waiting in two scrapes in a row.
fn queued(load: &Load) -> bool {
    load.waiting.min(load.waiting_before) > 0.0
}

/// This indexd has more than `1 + move_imbalance` times as many
/// conversations on `warm` as on `target`, and two more.
fn outnumbers(warm: &Load, target: &Load, w: &Weights) -> bool {
    warm.conversations > target.conversations * (1.0 + w.move_imbalance)
        && warm.conversations - target.conversations >= MIN_CONVERSATION_GAP
}

/// The inputs (indices) whose load is a lasting reason to move a
/// conversation off them to some other input ([`lasting`]): where a
/// continuation should be ranked again rather than follow its previous turn
/// (the filter's `local_continuations`). Whether a move then pays is the
/// Pick's to say. O(n log n) in the inputs.
pub fn busy(inputs: &[Input], w: &Weights) -> Vec<usize> {
    if inputs.len() < 2 {
        return Vec::new();
    }
    // The targets by conversations, fewest first, and the fewest in flight
    // among each prefix: those a replica outnumbers are a prefix, and it
    // is busy if any of them has fewer requests in flight.
    let mut targets: Vec<&Load> = inputs.iter().map(|i| &i.load).collect();
    targets.sort_by(|a, b| a.conversations.total_cmp(&b.conversations));
    let fewest_in_flight: Vec<f64> = targets
        .iter()
        .scan(f64::INFINITY, |m, l| {
            *m = m.min(l.in_flight());
            Some(*m)
        })
        .collect();
    inputs
        .iter()
        .enumerate()
        .filter(|(_, input)| {
            let warm = &input.load;
            let outnumbered = targets.partition_point(|t| outnumbers(warm, t, w));
            queued(warm)
                || outnumbered
                    .checked_sub(1)
                    .and_then(|k| fewest_in_flight.get(k))
                    .is_some_and(|fewest| warm.in_flight() > *fewest)
        })
        .map(|(i, _)| i)
        .collect()
}

/// Orders `inputs` by cost, then more matched blocks, fewer in flight, and
/// a random draw.
fn by_cost<R: Rng>(
    inputs: &[Input],
    prompt_tokens: u32,
    block_size: u32,
    w: &Weights,
    rng: &mut R,
) -> Vec<Ranked> {
    let mut scored: Vec<(i64, u32, f64, u64, Ranked)> = inputs
        .iter()
        .enumerate()
        .map(|(i, input)| {
            let c = cost(input, prompt_tokens, block_size, w);
            let micros = (c * 1e6).round() as i64;
            let in_flight = input.load.in_flight() + input.load.pending_picks;
            (
                micros,
                input.matched.blocks,
                in_flight,
                rng.random::<u64>(),
                Ranked { input: i, cost: c },
            )
        })
        .collect();
    // Equal estimated TTFT: the replica that reuses more of the prompt saves
    // the fleet prefill work (and keeps a conversation together).
    scored.sort_by(|a, b| {
        a.0.cmp(&b.0)
            .then(b.1.cmp(&a.1))
            .then(a.2.total_cmp(&b.2))
            .then(a.3.cmp(&b.3))
    });
    scored.into_iter().map(|(.., r)| r).collect()
}

#[cfg(test)]
#[path = "score_tests.rs"]
mod tests;
