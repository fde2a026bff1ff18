//! The cost model's weights (`weights:`), checked at start.

use serde::Deserialize;

use crate::error::ConfigError;

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
    /// A move away from the replica holding the most of the prompt must save
    /// more than this many times its re-prefill time (0: cheapest wins).
    pub move_margin: f64,
    /// Unless vLLM reports requests waiting there, a move also needs the
    /// warm replica to hold more than `1 + move_imbalance` times the
    /// target's conversations (a lasting imbalance, not a passing queue).
    pub move_imbalance: f64,
    /// A new conversation goes to the replica with the fewest of this
    /// indexd's conversations among those costing at most this fraction
    /// more than the cheapest (0: the cheapest always).
    pub balance_margin: f64,
    /// Credit only the matched blocks expected to survive until the request
    /// is admitted (module docs).
    pub predict_eviction: bool,
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
            move_margin: 1.0,
            move_imbalance: 0.25,
            balance_margin: 0.2,
            predict_eviction: true,
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
            ("weights.move_margin", self.move_margin),
            ("weights.move_imbalance", self.move_imbalance),
            ("weights.balance_margin", self.balance_margin),
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
}
