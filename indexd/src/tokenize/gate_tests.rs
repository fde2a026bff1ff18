use std::time::{Duration, Instant};

use super::*;

fn rules() -> GateRules {
    GateRules {
        interval: Duration::from_secs(600),
        shadow_per_second: 1.0,
        close_after_mismatches: 3,
        mismatch_window: Duration::from_secs(60),
        reopen_after_rounds: 2,
        reopen_backoff: Duration::from_secs(30),
    }
}

fn open_gate() -> Gate {
    open_gate_at(Instant::now())
}

/// A gate opened by a clean probe round at `at`.
fn open_gate_at(at: Instant) -> Gate {
    let g = Gate::new("m", rules());
    assert_eq!(g.state(), GateState::Pending);
    let t = g.probe_round(&Verdict::Agree, at).unwrap();
    assert_eq!(
        (t.from, t.to, t.why),
        (GateState::Pending, GateState::Open, Why::ProbesAgree)
    );
    g
}

fn mismatch() -> Verdict {
    Verdict::Mismatch("ids differ at position 3".to_owned())
}

#[test]
fn one_body_cannot_close_the_gate_however_often_it_comes() {
    let g = open_gate();
    let now = Instant::now();
    for i in 0..50 {
        assert_eq!(
            g.shadow_mismatch(7, "x", now + Duration::from_millis(i)),
            None
        );
    }
    assert_eq!(g.state(), GateState::Open);
    // A second distinct body: still open (three are needed).
    assert_eq!(g.shadow_mismatch(8, "x", now), None);
    assert_eq!(g.state(), GateState::Open);
}

#[test]
fn distinct_bodies_within_the_window_close_it_and_old_ones_expire() {
    let g = open_gate();
    let t0 = Instant::now();
    assert_eq!(g.shadow_mismatch(1, "a", t0), None);
    assert_eq!(
        g.shadow_mismatch(2, "b", t0 + Duration::from_secs(10)),
        None
    );
    // Body 1 is out of the 60 s window by now: two distinct in it.
    assert_eq!(
        g.shadow_mismatch(3, "c", t0 + Duration::from_secs(65)),
        None
    );
    assert_eq!(g.state(), GateState::Open);
    let t = g
        .shadow_mismatch(4, "d", t0 + Duration::from_secs(66))
        .unwrap();
    assert_eq!(
        (t.from, t.to, t.why),
        (GateState::Open, GateState::Closed, Why::ShadowMismatches)
    );
    assert!(g.detail().contains("3 distinct bodies"), "{}", g.detail());
    assert!(g.describe().starts_with("closed ("), "{}", g.describe());
}

#[test]
fn a_probe_mismatch_closes_it_and_clean_rounds_reopen_it() {
    let g = open_gate();
    let now = Instant::now();
    let t = g.probe_round(&mismatch(), now).unwrap();
    assert_eq!((t.to, t.why), (GateState::Closed, Why::ProbeMismatch));
    assert!(g.detail().contains("position 3"));
    // Live mismatches while closed change nothing.
    assert_eq!(g.shadow_mismatch(1, "a", now), None);
    // Inconclusive and refused rounds neither count nor reset.
    assert_eq!(g.probe_round(&Verdict::Agree, now), None);
    assert_eq!(
        g.probe_round(&Verdict::Inconclusive("down".into()), now),
        None
    );
    let t = g.probe_round(&Verdict::Agree, now).unwrap();
    assert_eq!(
        (t.from, t.to, t.why),
        (GateState::Closed, GateState::Open, Why::ProbesClean)
    );
    assert_eq!(g.detail(), "");
    // A mismatching round in between starts the count again.
    g.probe_round(&mismatch(), now).unwrap();
    assert_eq!(g.probe_round(&Verdict::Agree, now), None);
    assert_eq!(g.probe_round(&mismatch(), now), None);
    assert_eq!(g.probe_round(&Verdict::Agree, now), None);
    assert_eq!(g.state(), GateState::Closed);
    assert!(g.probe_round(&Verdict::Agree, now).is_some());
    let counted: Vec<_> = g.transitions();
    assert!(counted.contains(&((GateState::Open, GateState::Closed, Why::ProbeMismatch), 2)));
    assert!(counted.contains(&((GateState::Closed, GateState::Open, Why::ProbesClean), 2)));
}

#[test]
fn a_closed_gate_backs_off_and_strikes_are_forgiven_after_a_clean_interval() {
    let g = open_gate();
    let now = Instant::now();
    let retry = Duration::from_secs(2);
    assert_eq!(g.pause(false, retry), Duration::from_secs(600));
    assert_eq!(g.pause(true, retry), retry);
    g.probe_round(&mismatch(), now);
    assert_eq!(g.pause(false, retry), Duration::from_secs(30));
    g.probe_round(&mismatch(), now);
    assert_eq!(g.pause(false, retry), Duration::from_secs(60));
    for _ in 0..10 {
        g.probe_round(&mismatch(), now);
    }
    assert_eq!(
        g.pause(false, retry),
        Duration::from_secs(600),
        "capped at the interval"
    );
    g.probe_round(&Verdict::Agree, now);
    g.probe_round(&Verdict::Agree, now);
    assert_eq!(g.state(), GateState::Open);
    // A clean periodic round while open forgives the strikes.
    g.probe_round(&Verdict::Agree, now);
    g.probe_round(&mismatch(), now);
    assert_eq!(g.pause(false, retry), Duration::from_secs(30));
}

#[test]
fn a_clean_probe_round_counts_as_the_last_live_check() {
    let g = Gate::new("m", rules());
    let at = Instant::now();
    g.probe_round(&Verdict::Agree, at);
    assert_eq!(g.state(), GateState::Open);
    let last = *lock(&g.last_shadow);
    assert!(
        !g.shadow_due_at(&last, at + Duration::from_millis(999)),
        "no live check on the Picks the opening lets through"
    );
    assert!(g.shadow_due_at(&last, at + Duration::from_secs(1)));
    // A periodic clean round while open defers the next one again.
    let later = at + Duration::from_secs(5);
    g.probe_round(&Verdict::Agree, later);
    let last = *lock(&g.last_shadow);
    assert!(!g.shadow_due_at(&last, later + Duration::from_millis(500)));
    // A round that found a difference or could not decide is no evidence.
    let g = open_gate_at(at);
    g.probe_round(&mismatch(), at + Duration::from_secs(5));
    g.probe_round(
        &Verdict::Inconclusive("timeout".to_owned()),
        at + Duration::from_secs(6),
    );
    let last = *lock(&g.last_shadow);
    assert_eq!(last, Some(at));
}

#[test]
fn shadow_slots_are_rate_limited_and_one_at_a_time() {
    let g = open_gate_at(Instant::now() - Duration::from_secs(2));
    assert!(
        g.shadow_due(),
        "the first live Pick a second after the round is checked"
    );
    let slot = g.take_shadow_slot();
    assert!(slot.is_some());
    assert!(!g.shadow_due());
    assert!(g.take_shadow_slot().is_none(), "one at a time");
    drop(slot);
    assert!(!g.shadow_due());
    assert!(g.take_shadow_slot().is_none(), "at most one a second");
    let none = Gate::new(
        "m",
        GateRules {
            shadow_per_second: 0.0,
            ..rules()
        },
    );
    assert!(!none.shadow_due());
    assert!(none.take_shadow_slot().is_none());
    // Whether one is due takes nothing: a check is given when it comes.
    let often = Gate::new(
        "m",
        GateRules {
            shadow_per_second: 1e6,
            ..rules()
        },
    );
    assert!(often.shadow_due() && often.shadow_due());
    let slot = often.take_shadow_slot();
    assert!(slot.is_some());
    assert!(!often.shadow_due(), "one in flight");
    drop(slot);
    std::thread::sleep(Duration::from_millis(1));
    assert!(often.shadow_due());
}
