//! The latency model: what a GPU replica would take, as durations the mock sleeps.
//!
//! ```text
//! TTFT  = queue wait + base + uncached_prompt_tokens × prefill_cost
//! total = TTFT + (output_tokens − 1) × decode_cost
//! ```
//! Prefills run one at a time through a per-rank FIFO queue ([`PrefillQueue`]): a request waits
//! for the prefills admitted before it. Decodes overlap freely. Every duration is multiplied by
//! `time_scale` (0.01 runs 100× faster, 0 never sleeps).
//!
//! Defaults are calibrated on published GPU figures: a 12,944-token prompt takes ≈ 2.6 s cold and
//! ≈ 0.28 s when all but the last partial block is cached.

use std::time::Duration;

use crate::error::ConfigError;

/// Parameters of the model, in milliseconds of simulated GPU time.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatencyConfig {
    pub base_ms: f64,
    pub prefill_ms_per_token: f64,
    pub decode_ms_per_token: f64,
    pub time_scale: f64,
}

/// 12,944 cold tokens → 2,600 ms; 16 uncached tokens (the rest cached) → 280 ms.
const CAL_COLD_TOKENS: f64 = 12_944.0;
const CAL_COLD_MS: f64 = 2_600.0;
const CAL_WARM_UNCACHED: f64 = 16.0;
const CAL_WARM_MS: f64 = 280.0;

impl Default for LatencyConfig {
    fn default() -> Self {
        let per_token = (CAL_COLD_MS - CAL_WARM_MS) / (CAL_COLD_TOKENS - CAL_WARM_UNCACHED);
        Self {
            base_ms: CAL_WARM_MS - CAL_WARM_UNCACHED * per_token,
            prefill_ms_per_token: per_token,
            decode_ms_per_token: 15.0,
            time_scale: 1.0,
        }
    }
}

impl LatencyConfig {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        let fields = [
            ("latency.base_ms", self.base_ms),
            ("latency.prefill_ms_per_token", self.prefill_ms_per_token),
            ("latency.decode_ms_per_token", self.decode_ms_per_token),
            ("latency.time_scale", self.time_scale),
        ];
        for (field, v) in fields {
            if !v.is_finite() || v < 0.0 {
                return Err(ConfigError {
                    field,
                    reason: format!("must be a finite number >= 0, got {v}"),
                });
            }
        }
        Ok(())
    }

    /// Simulated prefill time (base + uncached tokens), before scaling.
    pub fn prefill_ms(&self, prompt_tokens: usize, cached_tokens: usize) -> f64 {
        let uncached = prompt_tokens.saturating_sub(cached_tokens) as f64;
        self.base_ms + uncached * self.prefill_ms_per_token
    }

    /// Simulated decode time after the first token, before scaling.
    pub fn decode_ms(&self, output_tokens: usize) -> f64 {
        output_tokens.saturating_sub(1) as f64 * self.decode_ms_per_token
    }

    /// Time to first token with no queue, before scaling.
    pub fn ttft_ms(&self, prompt_tokens: usize, cached_tokens: usize) -> f64 {
        self.prefill_ms(prompt_tokens, cached_tokens)
    }

    /// A simulated duration in ms turned into the wall-clock time the mock sleeps.
    pub fn scaled(&self, ms: f64) -> Duration {
        let ms = ms * self.time_scale;
        if ms.is_finite() && ms > 0.0 {
            Duration::from_secs_f64(ms / 1000.0)
        } else {
            Duration::ZERO
        }
    }
}

/// The per-rank prefill queue: one prefill at a time, first come first served
/// (tokio's mutex is fair).
#[derive(Debug, Default)]
pub struct PrefillQueue {
    slot: tokio::sync::Mutex<()>,
}

impl PrefillQueue {
    /// Waits for this request's turn; the turn lasts while the guard lives.
    pub async fn turn(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.slot.lock().await
    }
}

/// Sleeps for `d` unless it is zero.
pub async fn pause(d: Duration) {
    if !d.is_zero() {
        tokio::time::sleep(d).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn within(actual: f64, expected: f64, tolerance: f64) -> bool {
        (actual - expected).abs() <= expected * tolerance
    }

    #[test]
    fn calibration_points_within_ten_percent() {
        let m = LatencyConfig::default();
        let block = 64;
        let n = 12_944;
        let cold = m.ttft_ms(n, 0);
        assert!(within(cold, 2_600.0, 0.10), "cold TTFT {cold} ms");
        let cached = (n - 1) / block * block;
        let warm = m.ttft_ms(n, cached);
        assert!(within(warm, 280.0, 0.10), "warm TTFT {warm} ms");
        // The same holds for vLLM's default block size.
        let warm16 = m.ttft_ms(n, (n - 1) / 16 * 16);
        assert!(within(warm16, 280.0, 0.10), "warm TTFT (B=16) {warm16} ms");
    }

    #[test]
    fn time_scale_shrinks_sleeps() {
        let m = LatencyConfig {
            time_scale: 0.01,
            ..LatencyConfig::default()
        };
        let d = m.scaled(m.ttft_ms(12_944, 0));
        assert!(
            d > Duration::from_millis(23) && d < Duration::from_millis(29),
            "{d:?}"
        );
        let z = LatencyConfig {
            time_scale: 0.0,
            ..LatencyConfig::default()
        };
        assert_eq!(z.scaled(1e6), Duration::ZERO);
    }

    #[test]
    fn decode_counts_tokens_after_the_first() {
        let m = LatencyConfig::default();
        assert_eq!(m.decode_ms(1), 0.0);
        assert_eq!(m.decode_ms(11), 10.0 * m.decode_ms_per_token);
    }

    #[test]
    fn negative_values_are_rejected() {
        let m = LatencyConfig {
            time_scale: -1.0,
            ..LatencyConfig::default()
        };
        assert_eq!(m.validate().unwrap_err().field, "latency.time_scale");
    }

    #[tokio::test]
    async fn queue_serialises_prefills() {
        let q = PrefillQueue::default();
        let first = q.turn().await;
        assert!(q.slot.try_lock().is_err());
        drop(first);
        assert!(q.slot.try_lock().is_ok());
    }
}
