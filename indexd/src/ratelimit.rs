//! A token bucket: `rate` tokens a second, at most `burst` saved up. Observe
//! calls take one each (`observe_rate`, `observe_burst`); over the limit a
//! call is refused (`RESOURCE_EXHAUSTED`) before anything is parsed.

use std::num::NonZeroU32;
use std::time::Instant;

/// The bucket; starts full.
#[derive(Debug)]
pub(crate) struct TokenBucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Option<Instant>,
}

impl TokenBucket {
    pub(crate) fn new(rate: NonZeroU32, burst: NonZeroU32) -> Self {
        let burst = f64::from(burst.get());
        Self {
            rate: f64::from(rate.get()),
            burst,
            tokens: burst,
            last: None,
        }
    }

    /// Takes one token at `now`; false when none is left. Instants earlier
    /// than the last one add nothing.
    pub(crate) fn take(&mut self, now: Instant) -> bool {
        if let Some(last) = self.last {
            let elapsed = now.saturating_duration_since(last).as_secs_f64();
            self.tokens = (self.tokens + elapsed * self.rate).min(self.burst);
        }
        self.last = Some(self.last.map_or(now, |l| l.max(now)));
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn n(v: u32) -> NonZeroU32 {
        NonZeroU32::new(v).unwrap()
    }

    #[test]
    fn a_burst_then_the_rate() {
        let mut b = TokenBucket::new(n(10), n(5));
        let t0 = Instant::now();
        assert_eq!((0..8).filter(|_| b.take(t0)).count(), 5);
        // 10 a second: one token per 100 ms, never more than the burst.
        assert!(!b.take(t0 + Duration::from_millis(50)));
        assert!(b.take(t0 + Duration::from_millis(100)));
        assert!(!b.take(t0 + Duration::from_millis(100)));
        let later = t0 + Duration::from_secs(60);
        assert_eq!((0..8).filter(|_| b.take(later)).count(), 5);
        // A clock that goes back adds nothing.
        assert!(!b.take(t0));
    }
}
