//! Scoring: a pure function from a snapshot of candidates to an ordered list.
//!
//! The cost of sending the request to replica `r` is its estimated time to
//! first token, in seconds:
//!
//! ```text
//! credited_r = block_size × Σ_tier matched_blocks_r[tier] × credit[tier]
//! uncached_r = max(prompt_tokens − credited_r, 0)
//! queued_r   = queued_tokens_per_waiting × waiting_r + pending_tokens_r
//! cost_r     = (uncached_r + queued_r) / prefill_tokens_per_second
//!            + running_penalty_seconds   × running_r
//!            + kv_usage_penalty_seconds  × kv_usage_r
//!            + occupancy_penalty_seconds × occupancy_r        (capacity signal)
//! ```
//!
//! `credit` is 1.0 for GPU, less for CPU and storage; with a capacity signal
//! saying `cache_available: false`, lower tiers earn nothing. Candidates are
//! ordered by cost (rounded to microseconds), then more matched blocks, then
//! fewer requests in flight (`running + waiting + pending`), then a random
//! draw from the caller's RNG (seeded in tests).
//!
//! `pending_tokens_r` is the prefill work of picks the replica's metrics do
//! not show yet: each pick adds the prompt tokens that replica had not cached,
//! until a later scrape sees it or the filter's Observe reports it answered.
//!
//! A shared prefix cached everywhere credits every replica alike, so load
//! decides; a conversation's own history cached on one replica is a strong
//! reason to go there, weighed against its queue.

use rand::Rng;
use serde::Deserialize;

use crate::error::ConfigError;
use crate::event::Tier;
use crate::index::PrefixMatch;

/// The cost model's weights (config `weights:`).
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Weights {
    /// Prefill throughput of one replica.
    pub prefill_tokens_per_second: f64,
    /// Prefill work assumed per waiting (or picked, unseen) request.
    pub queued_tokens_per_waiting: f64,
    /// Seconds added per running decode.
    pub running_penalty_seconds: f64,
    /// Seconds added at 100% KV-cache usage (preemption risk).
    pub kv_usage_penalty_seconds: f64,
    /// Seconds added at occupancy 1.0 of the capacity signal.
    pub occupancy_penalty_seconds: f64,
    /// Credit of a block matched in GPU memory.
    pub credit_gpu: f64,
    /// Credit of a block matched in CPU memory.
    pub credit_cpu: f64,
    /// Credit of a block matched in storage.
    pub credit_storage: f64,
}

impl Default for Weights {
    fn default() -> Self {
        Self {
            prefill_tokens_per_second: 8_000.0,
            queued_tokens_per_waiting: 1_024.0,
            running_penalty_seconds: 0.004,
            kv_usage_penalty_seconds: 0.05,
            occupancy_penalty_seconds: 0.05,
            credit_gpu: 1.0,
            credit_cpu: 0.8,
            credit_storage: 0.5,
        }
    }
}

impl Weights {
    /// Rejects weights that would make costs meaningless.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let fields = [
            (
                "weights.prefill_tokens_per_second",
                self.prefill_tokens_per_second,
            ),
            (
                "weights.queued_tokens_per_waiting",
                self.queued_tokens_per_waiting,
            ),
            (
                "weights.running_penalty_seconds",
                self.running_penalty_seconds,
            ),
            (
                "weights.kv_usage_penalty_seconds",
                self.kv_usage_penalty_seconds,
            ),
            (
                "weights.occupancy_penalty_seconds",
                self.occupancy_penalty_seconds,
            ),
            ("weights.credit_gpu", self.credit_gpu),
            ("weights.credit_cpu", self.credit_cpu),
            ("weights.credit_storage", self.credit_storage),
        ];
        for (field, v) in fields {
            if !v.is_finite() || v < 0.0 {
                return Err(ConfigError::field(
                    field,
                    "must be a finite, non-negative number",
                ));
            }
        }
        if self.prefill_tokens_per_second <= 0.0 {
            return Err(ConfigError::field(
                "weights.prefill_tokens_per_second",
                "must be positive",
            ));
        }
        Ok(())
    }

    fn credit(&self, tier: Tier, lower_tiers_available: bool) -> f64 {
        match tier {
            Tier::Gpu => self.credit_gpu,
            Tier::Cpu if lower_tiers_available => self.credit_cpu,
            Tier::Storage if lower_tiers_available => self.credit_storage,
            _ => 0.0,
        }
    }
}

/// Load as last seen for one replica.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Load {
    /// `vllm:num_requests_running`.
    pub running: f64,
    /// `vllm:num_requests_waiting`.
    pub waiting: f64,
    /// `vllm:kv_cache_usage_perc` (0..1).
    pub kv_usage: f64,
    /// Picks not yet visible in the metrics (nor answered).
    pub pending_picks: f64,
    /// Their estimated prefill work in tokens (uncached prompt tokens at pick
    /// time).
    pub pending_tokens: f64,
    /// Capacity signal occupancy (0..1), if any.
    pub occupancy: Option<f64>,
    /// Capacity signal `cache_available` (true without a signal).
    pub cache_available: bool,
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

/// The cost of one candidate (see the module docs).
pub fn cost(input: &Input, prompt_tokens: u32, block_size: u32, w: &Weights) -> f64 {
    let available = input.load.cache_available;
    let credited: f64 = Tier::ALL
        .into_iter()
        .zip(input.matched.per_tier)
        .map(|(tier, n)| f64::from(n) * f64::from(block_size) * w.credit(tier, available))
        .sum();
    let uncached = (f64::from(prompt_tokens) - credited).max(0.0);
    let queued = w.queued_tokens_per_waiting * input.load.waiting + input.load.pending_tokens;
    let mut c = (uncached + queued) / w.prefill_tokens_per_second
        + w.running_penalty_seconds * input.load.running
        + w.kv_usage_penalty_seconds * input.load.kv_usage.clamp(0.0, 1.0);
    if let Some(occ) = input.load.occupancy {
        c += w.occupancy_penalty_seconds * occ.clamp(0.0, 1.0);
    }
    if c.is_finite() { c } else { f64::MAX }
}

/// Orders `inputs` best first. `prompt_tokens` is at least the keyed tokens.
pub fn rank<R: Rng>(
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
            #[allow(clippy::cast_possible_truncation)]
            let micros = (c * 1e6).round() as i64;
            let in_flight = input.load.running + input.load.waiting + input.load.pending_picks;
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
mod tests {
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    use super::*;

    fn input(gpu: u32, cpu: u32, running: f64, waiting: f64) -> Input {
        Input {
            matched: PrefixMatch {
                blocks: gpu + cpu,
                per_tier: [gpu, cpu, 0],
            },
            load: Load {
                running,
                waiting,
                cache_available: true,
                ..Load::default()
            },
        }
    }

    #[test]
    fn more_cached_tokens_win_at_equal_load() {
        let w = Weights::default();
        let r = rank(
            &[input(1, 0, 0.0, 0.0), input(10, 0, 0.0, 0.0)],
            64 * 12,
            64,
            &w,
            &mut StdRng::seed_from_u64(1),
        );
        assert_eq!(r[0].input, 1);
        assert!(r[0].cost < r[1].cost);
    }

    #[test]
    fn gpu_beats_cpu_for_the_same_prefix() {
        let w = Weights::default();
        let r = rank(
            &[input(0, 8, 0.0, 0.0), input(8, 0, 0.0, 0.0)],
            64 * 8,
            64,
            &w,
            &mut StdRng::seed_from_u64(1),
        );
        assert_eq!(r[0].input, 1);
    }

    #[test]
    fn a_long_queue_outweighs_a_small_match() {
        let w = Weights::default();
        // 2 blocks cached but 20 waiting vs nothing cached and idle.
        let r = rank(
            &[input(2, 0, 0.0, 20.0), input(0, 0, 0.0, 0.0)],
            64 * 4,
            64,
            &w,
            &mut StdRng::seed_from_u64(1),
        );
        assert_eq!(r[0].input, 1);
    }

    #[test]
    fn shared_prefix_everywhere_leaves_load_to_decide() {
        let w = Weights::default();
        let r = rank(
            &[input(4, 0, 3.0, 0.0), input(4, 0, 1.0, 0.0)],
            64 * 8,
            64,
            &w,
            &mut StdRng::seed_from_u64(1),
        );
        assert_eq!(r[0].input, 1);
    }

    #[test]
    fn ties_go_to_fewer_in_flight_then_seeded_random() {
        let w = Weights {
            running_penalty_seconds: 0.0,
            ..Weights::default()
        };
        // Equal cost (running is free), different in-flight.
        let r = rank(
            &[input(0, 0, 5.0, 0.0), input(0, 0, 1.0, 0.0)],
            64,
            64,
            &w,
            &mut StdRng::seed_from_u64(1),
        );
        assert_eq!(r[0].input, 1);
        // Full tie: the seed decides, reproducibly, and both orders occur.
        let tie = [input(0, 0, 0.0, 0.0), input(0, 0, 0.0, 0.0)];
        let firsts: std::collections::HashSet<usize> = (0..32)
            .map(|seed| rank(&tie, 64, 64, &w, &mut StdRng::seed_from_u64(seed))[0].input)
            .collect();
        assert_eq!(firsts.len(), 2);
        let a = rank(&tie, 64, 64, &w, &mut StdRng::seed_from_u64(7));
        let b = rank(&tie, 64, 64, &w, &mut StdRng::seed_from_u64(7));
        assert_eq!(a, b);
    }

    #[test]
    fn unavailable_cache_earns_no_lower_tier_credit() {
        let w = Weights::default();
        let mut i = input(0, 8, 0.0, 0.0);
        let with = cost(&i, 512, 64, &w);
        i.load.cache_available = false;
        let without = cost(&i, 512, 64, &w);
        assert!(without > with);
    }

    #[test]
    fn invalid_weights_name_the_field() {
        let w = Weights {
            credit_cpu: f64::NAN,
            ..Weights::default()
        };
        assert!(
            w.validate()
                .unwrap_err()
                .to_string()
                .contains("weights.credit_cpu")
        );
    }
}
