//! Circuit breakers for the two callouts (indexd and the tokenizer), kept in
//! proxy-wasm shared data so that every worker of the VM sees the same state.
//! Each [`Breaker`] has its own key and thresholds; only failures of the peer
//! count (a request the peer refuses, such as indexd's InvalidArgument or a
//! tokenizer's 400, does not).
//!
//! - Closed: failures count up; a success resets the count, and a
//!   failure more than `window_ms` after the previous one starts over.
//!   `failures` consecutive failures open the breaker.
//! - Open for `cooldown_ms`: requests skip the peer (`breaker_open`,
//!   `tokenizer_breaker_open`) — but one request every `probe_ms` (0: none)
//!   still goes, so a peer that is back (an indexd restarted in a second) is
//!   seen within `probe_ms`, not at the end of the cool-down. A probe's
//!   success closes the breaker; its failure leaves it open.
//! - Half-open after the cool-down: requests go to the peer again; the first
//!   failure re-opens at once, the first success closes.
//!
//! Writes use compare-and-swap with a few retries; a lost race only delays
//! the count by one request, it never blocks one.

use crate::config::BreakerConfig;
use crate::host::{SharedData, SharedError};

/// Which breaker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Breaker {
    /// indexd's Pick calls.
    Index,
    /// The tokenizer calls.
    Tokenizer,
}

impl Breaker {
    /// Its shared-data key.
    pub const fn key(self) -> &'static str {
        match self {
            Self::Index => "kvroute.breaker.v1",
            Self::Tokenizer => "kvroute.tokenizer_breaker.v1",
        }
    }
}
const ATTEMPTS: usize = 4;
const LEN: usize = 29;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct State {
    failures: u32,
    last_failure_ms: u64,
    open_until_ms: u64,
    half_open: bool,
    /// While open: when the next probe may go.
    next_probe_ms: u64,
}

impl State {
    fn encode(self) -> [u8; LEN] {
        let mut out = [0u8; LEN];
        let parts = self
            .failures
            .to_le_bytes()
            .into_iter()
            .chain(self.last_failure_ms.to_le_bytes())
            .chain(self.open_until_ms.to_le_bytes())
            .chain([u8::from(self.half_open)])
            .chain(self.next_probe_ms.to_le_bytes());
        for (dst, src) in out.iter_mut().zip(parts) {
            *dst = src;
        }
        out
    }

    fn decode(bytes: &[u8]) -> Option<Self> {
        let failures = u32::from_le_bytes(bytes.get(0..4)?.try_into().ok()?);
        let last_failure_ms = u64::from_le_bytes(bytes.get(4..12)?.try_into().ok()?);
        let open_until_ms = u64::from_le_bytes(bytes.get(12..20)?.try_into().ok()?);
        let half_open = *bytes.get(20)? != 0;
        let next_probe_ms = u64::from_le_bytes(bytes.get(21..29)?.try_into().ok()?);
        (bytes.len() == LEN).then_some(Self {
            failures,
            last_failure_ms,
            open_until_ms,
            half_open,
            next_probe_ms,
        })
    }
}

fn read(store: &dyn SharedData, which: Breaker) -> (State, Option<u32>) {
    let (value, cas) = store.get_shared(which.key());
    let state = value.as_deref().and_then(State::decode).unwrap_or_default();
    (state, cas)
}

/// Whether requests must skip the peer now.
pub fn is_open(store: &dyn SharedData, which: Breaker, now_ms: u64) -> bool {
    now_ms < read(store, which).0.open_until_ms
}

/// Whether this request may call the peer: the breaker is closed, or it is
/// open and this request is the next probe (at most one per `probe_ms`
/// across the workers).
pub fn admits(
    store: &mut dyn SharedData,
    which: Breaker,
    cfg: &BreakerConfig,
    now_ms: u64,
) -> bool {
    for _ in 0..ATTEMPTS {
        let (mut state, cas) = read(store, which);
        if now_ms >= state.open_until_ms {
            return true;
        }
        if cfg.probe_ms == 0 || now_ms < state.next_probe_ms {
            return false;
        }
        state.next_probe_ms = now_ms.saturating_add(cfg.probe_ms);
        match store.set_shared(which.key(), &state.encode(), cas) {
            Ok(()) => return true,
            // Another worker took this probe.
            Err(SharedError::CasMismatch) => {}
            Err(SharedError::Failed) => return false,
        }
    }
    false
}

/// Counts a failure; returns true if this failure opened the breaker.
pub fn record_failure(
    store: &mut dyn SharedData,
    which: Breaker,
    cfg: &BreakerConfig,
    now_ms: u64,
) -> bool {
    for _ in 0..ATTEMPTS {
        let (mut state, cas) = read(store, which);
        if now_ms < state.open_until_ms {
            return false; // already open: a straggler from before it opened
        }
        let opened = if state.half_open {
            true
        } else {
            if now_ms.saturating_sub(state.last_failure_ms) > cfg.window_ms {
                state.failures = 0;
            }
            state.failures = state.failures.saturating_add(1);
            state.failures >= cfg.failures
        };
        state.last_failure_ms = now_ms;
        if opened {
            state.failures = 0;
            state.open_until_ms = now_ms.saturating_add(cfg.cooldown_ms);
            state.next_probe_ms = now_ms.saturating_add(cfg.probe_ms);
            state.half_open = true;
        }
        match store.set_shared(which.key(), &state.encode(), cas) {
            Ok(()) => return opened,
            Err(SharedError::CasMismatch) => {}
            Err(SharedError::Failed) => return false,
        }
    }
    false
}

/// Counts a success: closes an open (a probe answered) or half-open
/// breaker, resets the count.
pub fn record_success(store: &mut dyn SharedData, which: Breaker, now_ms: u64) {
    for _ in 0..ATTEMPTS {
        let (state, cas) = read(store, which);
        let open = now_ms < state.open_until_ms;
        if state.failures == 0 && !state.half_open && !open {
            return;
        }
        let closed = State {
            failures: 0,
            half_open: false,
            open_until_ms: 0,
            ..state
        };
        match store.set_shared(which.key(), &closed.encode(), cas) {
            Ok(()) | Err(SharedError::Failed) => return,
            Err(SharedError::CasMismatch) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::FakeHost;

    const I: Breaker = Breaker::Index;
    const CFG: BreakerConfig = BreakerConfig {
        failures: 3,
        window_ms: 1_000,
        cooldown_ms: 5_000,
        probe_ms: 0,
    };

    #[test]
    fn opens_after_consecutive_failures_and_half_opens() {
        let mut h = FakeHost::default();
        assert!(!is_open(&h, I, 0));
        assert!(!record_failure(&mut h, I, &CFG, 100));
        assert!(!record_failure(&mut h, I, &CFG, 200));
        assert!(record_failure(&mut h, I, &CFG, 300));
        assert!(is_open(&h, I, 301));
        assert!(is_open(&h, I, 5_299));
        assert!(
            !record_failure(&mut h, I, &CFG, 400),
            "stragglers do not re-open"
        );
        assert!(!is_open(&h, I, 5_300));
        // Half-open: one failure re-opens.
        assert!(record_failure(&mut h, I, &CFG, 5_400));
        assert!(is_open(&h, I, 5_401));
        // After the next cool-down, a success closes for good.
        record_success(&mut h, I, 10_500);
        assert!(!record_failure(&mut h, I, &CFG, 10_600));
        assert!(!is_open(&h, I, 10_601));
    }

    #[test]
    fn success_and_window_reset_the_count() {
        let mut h = FakeHost::default();
        record_failure(&mut h, I, &CFG, 0);
        record_failure(&mut h, I, &CFG, 10);
        record_success(&mut h, I, 20);
        assert!(!record_failure(&mut h, I, &CFG, 30));
        assert!(!record_failure(&mut h, I, &CFG, 40));
        // Third failure, but far outside the window of the second.
        assert!(!record_failure(&mut h, I, &CFG, 5_000));
        assert!(!is_open(&h, I, 5_001));
    }

    #[test]
    fn cas_races_retry_and_garbage_state_is_ignored() {
        let mut h = FakeHost {
            shared_conflicts: 2,
            ..FakeHost::default()
        };
        record_failure(&mut h, I, &CFG, 0);
        record_failure(&mut h, I, &CFG, 1);
        assert!(record_failure(&mut h, I, &CFG, 2));
        let mut g = FakeHost::default();
        g.set_shared(I.key(), b"garbage", None).unwrap();
        assert!(!is_open(&g, I, 0));
        assert!(!record_failure(&mut g, I, &CFG, 0));
    }

    #[test]
    fn an_open_breaker_lets_one_probe_through_per_interval_and_a_success_closes_it() {
        let cfg = BreakerConfig {
            probe_ms: 200,
            ..CFG
        };
        let mut h = FakeHost::default();
        for t in 0..3 {
            record_failure(&mut h, I, &cfg, t);
        }
        assert!(is_open(&h, I, 10));
        assert!(!admits(&mut h, I, &cfg, 10), "no probe at once");
        assert!(admits(&mut h, I, &cfg, 202), "the first probe");
        assert!(!admits(&mut h, I, &cfg, 203), "one per interval");
        assert!(
            !record_failure(&mut h, I, &cfg, 210),
            "a failed probe keeps it open"
        );
        assert!(is_open(&h, I, 300));
        assert!(admits(&mut h, I, &cfg, 402), "the next probe");
        record_success(&mut h, I, 410);
        assert!(!is_open(&h, I, 411), "its success closes the breaker");
        assert!(admits(&mut h, I, &cfg, 412));
        // Without probing, nothing goes until the cool-down ends.
        let mut n = FakeHost::default();
        for t in 0..3 {
            record_failure(&mut n, I, &CFG, t);
        }
        assert!(!admits(&mut n, I, &CFG, 4_000));
        assert!(admits(&mut n, I, &CFG, 5_003));
    }

    #[test]
    fn the_two_breakers_are_independent() {
        let mut h = FakeHost::default();
        for t in 0..3 {
            record_failure(&mut h, Breaker::Tokenizer, &CFG, t);
        }
        assert!(is_open(&h, Breaker::Tokenizer, 10));
        assert!(!is_open(&h, Breaker::Index, 10));
        record_success(&mut h, Breaker::Index, 20);
        assert!(is_open(&h, Breaker::Tokenizer, 20));
    }

    #[test]
    fn state_round_trips() {
        let s = State {
            failures: 7,
            last_failure_ms: u64::MAX,
            open_until_ms: 42,
            half_open: true,
            next_probe_ms: 9,
        };
        assert_eq!(State::decode(&s.encode()), Some(s));
        assert_eq!(State::decode(&s.encode()[..28]), None);
    }
}
