use rand::SeedableRng;
use rand::rngs::StdRng;

use super::*;

/// [`rank`] with 64-token blocks and the RNG seeded with 1.
fn seeded(inputs: &[Input], prompt_tokens: u32, w: &Weights) -> Ranking {
    rank(inputs, prompt_tokens, 64, w, &mut StdRng::seed_from_u64(1))
}

fn input(gpu: u32, cpu: u32, running: f64, waiting: f64) -> Input {
    Input {
        matched: PrefixMatch {
            blocks: gpu + cpu,
            per_tier: [gpu, cpu, 0],
            speculative: 0,
            unmodelled: false,
        },
        load: Load {
            running,
            // A queue seen in two scrapes.
            waiting,
            waiting_before: waiting,
            cache_available: true,
            ..Load::default()
        },
    }
}

#[test]
fn more_cached_tokens_win_at_equal_load() {
    let w = Weights::default();
    let r = seeded(
        &[input(1, 0, 0.0, 0.0), input(10, 0, 0.0, 0.0)],
        64 * 12,
        &w,
    )
    .ranked;
    assert_eq!(r[0].input, 1);
    assert!(r[0].cost < r[1].cost);
}

#[test]
fn gpu_beats_cpu_for_the_same_prefix() {
    let w = Weights::default();
    let r = seeded(&[input(0, 8, 0.0, 0.0), input(8, 0, 0.0, 0.0)], 64 * 8, &w).ranked;
    assert_eq!(r[0].input, 1);
}

#[test]
fn a_long_queue_outweighs_a_small_match() {
    let w = Weights::default();
    // 2 blocks cached but 20 waiting vs nothing cached and idle.
    let r = seeded(&[input(2, 0, 0.0, 20.0), input(0, 0, 0.0, 0.0)], 64 * 4, &w).ranked;
    assert_eq!(r[0].input, 1);
}

#[test]
fn shared_prefix_everywhere_leaves_load_to_decide() {
    let w = Weights::default();
    let r = seeded(&[input(4, 0, 3.0, 0.0), input(4, 0, 1.0, 0.0)], 64 * 8, &w).ranked;
    assert_eq!(r[0].input, 1);
}

#[test]
fn ties_go_to_fewer_in_flight_then_seeded_random() {
    let w = Weights {
        running_penalty_seconds: 0.0,
        ..Weights::default()
    };
    // Equal cost (running is free), different in-flight.
    let r = seeded(&[input(0, 0, 5.0, 0.0), input(0, 0, 1.0, 0.0)], 64, &w).ranked;
    assert_eq!(r[0].input, 1);
    // Full tie: the seed decides, reproducibly, and both orders occur.
    let tie = [input(0, 0, 0.0, 0.0), input(0, 0, 0.0, 0.0)];
    let firsts: std::collections::HashSet<usize> = (0..32)
        .map(|seed| rank(&tie, 64, 64, &w, &mut StdRng::seed_from_u64(seed)).ranked[0].input)
        .collect();
    assert_eq!(firsts.len(), 2);
    let a = rank(&tie, 64, 64, &w, &mut StdRng::seed_from_u64(7)).ranked;
    let b = rank(&tie, 64, 64, &w, &mut StdRng::seed_from_u64(7)).ranked;
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

/// A conversation of `held` blocks on replica 0, waiting `queue` requests
/// there; replica 1 holds nothing and is idle. Replica 1's fitted speed is
/// `cold_rate` (None: the prior).
/// The move rule's verdict and the first candidate, default weights.
fn verdict(inputs: &[Input], prompt_tokens: u32) -> (Move, usize) {
    let r = rank(
        inputs,
        prompt_tokens,
        64,
        &Weights::default(),
        &mut StdRng::seed_from_u64(1),
    );
    (r.moved, r.ranked[0].input)
}

fn warm_and_cold(held: u32, queue: f64, cold_rate: Option<f64>) -> [Input; 2] {
    let mut cold = input(0, 0, 0.0, 0.0);
    cold.load.prefill_tokens_per_second = cold_rate;
    [input(held, 0, 0.0, queue), cold]
}

#[test]
fn a_move_that_saves_less_than_its_reprefill_is_held() {
    let w = Weights::default();
    // 3,200 tokens held; 2 waiting there (2,048 tokens of queue, 0.26 s at
    // 8,000/s) vs re-prefilling 3,200 tokens elsewhere (0.4 s): the
    // cheapest is the cold replica by cost, but the move does not pay.
    let inputs = warm_and_cold(50, 2.0, None);
    let by_cost_alone = by_cost(&inputs, 64 * 52, 64, &w, &mut StdRng::seed_from_u64(1));
    let ranking = seeded(&inputs, 64 * 52, &w);
    let costs: Vec<f64> = by_cost_alone.iter().map(|r| r.cost).collect();
    assert_eq!(by_cost_alone[0].input, 0, "{costs:?}");
    assert_eq!(ranking.moved, Move::None);

    let inputs = warm_and_cold(50, 4.0, None);
    let ranking = seeded(&inputs, 64 * 52, &w);
    let cheapest = by_cost(&inputs, 64 * 52, 64, &w, &mut StdRng::seed_from_u64(1))[0].input;
    assert_eq!(cheapest, 1, "4 waiting make the cold replica cheaper");
    assert_eq!(ranking.moved, Move::Held);
    assert_eq!(ranking.ranked[0].input, 0, "the warm replica stays first");
    assert_eq!(ranking.ranked.len(), 2);

    let inputs = warm_and_cold(50, 12.0, None);
    let ranking = seeded(&inputs, 64 * 52, &w);
    assert_eq!(ranking.moved, Move::Moved);
    assert_eq!(ranking.ranked[0].input, 1, "a long queue pays for the move");
}

#[test]
fn the_targets_measured_speed_prices_the_reprefill() {
    let w = Weights::default();
    // At the prior's 8,000 tokens/s on both, 12 waiting on the warm
    // replica (12,288 tokens) pay for re-prefilling 3,200 tokens on the
    // cold one; measured at 2,000/s, the cold one's re-prefill (1.66 s)
    // costs more than the warm queue (1.55 s).
    let fast = warm_and_cold(50, 12.0, None);
    let ranking = seeded(&fast, 64 * 52, &w);
    assert_eq!(ranking.moved, Move::Moved);
    assert_eq!(ranking.ranked[0].input, 1);
    let slow = warm_and_cold(50, 12.0, Some(2_000.0));
    let ranking = seeded(&slow, 64 * 52, &w);
    assert_eq!(ranking.moved, Move::None);
    assert_eq!(ranking.ranked[0].input, 0);
    assert!((ranking.ranked[1].cost - 3_328.0 / 2_000.0).abs() < 1e-9);
}

#[test]
fn a_warm_replica_that_only_looks_slower_is_not_left() {
    let w = Weights::default();
    // Two identical replicas; the warm one's fit says 1,000 tokens/s, the
    // cold one's 20,000. The warm one lacks 448 of 3,328 tokens, the cold
    // one 2,560 of them (shared prefix): at their own speeds the cold one
    // is cheaper by 0.32 s while its re-prefill (2,112 tokens) looks like
    // 0.11 s. At one speed the move saves nothing.
    let mut warm = input(45, 0, 0.0, 0.0);
    warm.load.prefill_tokens_per_second = Some(1_000.0);
    let mut cold = input(12, 0, 0.0, 0.0);
    cold.load.prefill_tokens_per_second = Some(20_000.0);
    let inputs = [warm, cold];
    let by_cost_alone = by_cost(&inputs, 64 * 52, 64, &w, &mut StdRng::seed_from_u64(1));
    assert_eq!(by_cost_alone[0].input, 1);
    assert_eq!(verdict(&inputs, 64 * 52), (Move::Held, 0));
}

#[test]
fn speculative_blocks_count_as_cached_but_earn_no_hold() {
    // The shared prompt (12 blocks) was just sent to replica 0 with a
    // first conversation, whose prefill is queued there; a second
    // conversation lacks 3 blocks there, 15 on the idle replica.
    let mut first = input(12, 0, 0.0, 0.0);
    first.load.queued_seconds = 0.15;
    let idle = input(0, 0, 0.0, 0.0);
    assert_eq!(
        verdict(&[first, idle], 64 * 15),
        (Move::Held, 0),
        "in its events: defended"
    );
    first.matched.speculative = 12;
    assert_eq!(
        verdict(&[first, idle], 64 * 15),
        (Move::None, 1),
        "only credited: the cheaper replica"
    );
}

#[test]
fn a_reprefill_costs_no_less_than_the_prior_says() {
    // Both fitted at 100,000 tokens/s (short batched prefills); the warm
    // one has 50 ms queued. Re-prefilling 2,048 tokens "takes" 20 ms at
    // the fit, 256 ms at the prior: held.
    let mut warm = input(44, 0, 0.0, 0.0);
    warm.load.prefill_tokens_per_second = Some(100_000.0);
    warm.load.queued_seconds = 0.05;
    let mut cold = input(12, 0, 0.0, 0.0);
    cold.load.prefill_tokens_per_second = Some(100_000.0);
    assert_eq!(verdict(&[warm, cold], 64 * 52), (Move::Held, 0));
}

#[test]
fn a_passing_queue_moves_nothing_a_lasting_imbalance_does() {
    // 1 s of this indexd's prefill queued on the warm replica, nothing
    // waiting in vLLM's metrics: the move would save 1 s for 0.4 s of
    // re-prefill, but both replicas hold as many conversations.
    let mut warm = input(50, 0, 0.0, 0.0);
    warm.load.queued_seconds = 1.0;
    warm.load.conversations = 4.0;
    let mut cold = input(0, 0, 0.0, 0.0);
    cold.load.conversations = 4.0;
    assert_eq!(verdict(&[warm, cold], 64 * 52), (Move::Held, 0));
    // One more there: a move would only invert the gap.
    warm.load.conversations = 5.0;
    cold.load.conversations = 4.0;
    assert_eq!(verdict(&[warm, cold], 64 * 52), (Move::Held, 0));
    // Five against three here, but the replicas' metrics show as many in
    // flight on both (other gateways' conversations): held.
    cold.load.conversations = 3.0;
    warm.load.running = 4.0;
    cold.load.running = 4.0;
    assert_eq!(verdict(&[warm, cold], 64 * 52), (Move::Held, 0));
    // They show more on the warm one too: the move evens them.
    warm.load.running = 5.0;
    cold.load.running = 3.0;
    assert_eq!(verdict(&[warm, cold], 64 * 52), (Move::Moved, 1));
    // Two more but not a quarter more (many conversations): held.
    warm.load.conversations = 10.0;
    cold.load.conversations = 8.0;
    assert_eq!(verdict(&[warm, cold], 64 * 52), (Move::Held, 0));
    // vLLM reports requests waiting there in one scrape: a burst of the
    // moment (conversations starting together), held.
    warm.load.waiting = 1.0;
    assert_eq!(verdict(&[warm, cold], 64 * 52), (Move::Held, 0));
    // In two scrapes in a row: that is every gateway's lasting load.
    warm.load.waiting_before = 2.0;
    assert_eq!(verdict(&[warm, cold], 64 * 52).0, Move::Moved);
    // Gone from the latest scrape: held again.
    warm.load.waiting = 0.0;
    assert_eq!(verdict(&[warm, cold], 64 * 52), (Move::Held, 0));
}

#[test]
fn busy_replicas_are_those_the_move_rule_could_leave() {
    let w = Weights::default();
    let mut a = input(0, 0, 4.0, 0.0);
    let mut b = input(0, 0, 4.0, 0.0);
    let mut c = input(0, 0, 2.0, 0.0);
    a.load.conversations = 4.0;
    b.load.conversations = 4.0;
    c.load.conversations = 4.0;
    assert!(busy(&[a, b], &w).is_empty(), "even: none");
    // A queue in one scrape: a burst of the moment.
    a.load.waiting = 2.0;
    assert!(busy(&[a, b], &w).is_empty());
    // In two scrapes in a row: busy, whatever the others.
    a.load.waiting_before = 1.0;
    assert_eq!(busy(&[a, b], &w), vec![0]);
    // A lasting imbalance against any one replica, confirmed by the
    // replicas' own counts.
    (a.load.waiting, a.load.waiting_before) = (0.0, 0.0);
    b.load.conversations = 7.0;
    assert!(
        busy(&[a, b], &w).is_empty(),
        "7 against 4, as many in flight"
    );
    b.load.running = 5.0;
    assert_eq!(busy(&[a, b, c], &w), vec![1], "more in flight than both");
    b.load.running = 3.0;
    assert_eq!(busy(&[a, b, c], &w), vec![1], "more than the idle one");
    // A lone replica has nowhere to move to.
    (a.load.waiting, a.load.waiting_before) = (3.0, 3.0);
    assert!(busy(&[a], &w).is_empty());
}

proptest::proptest! {
    /// [`busy`]'s sorted prefix search says what the pairwise rule says.
    #[test]
    fn busy_agrees_with_the_pairwise_rule(
        loads in proptest::collection::vec((0u8..9, 0u8..5, 0u8..3, 0u8..3), 0..10),
        imbalance in proptest::sample::select(vec![0.0, 0.25, 1.0]),
    ) {
        let w = Weights { move_imbalance: imbalance, ..Weights::default() };
        let inputs: Vec<Input> = loads
            .iter()
            .map(|&(conversations, running, waiting, before)| {
                let mut i = input(0, 0, f64::from(running), f64::from(waiting));
                i.load.waiting_before = f64::from(before);
                i.load.conversations = f64::from(conversations);
                i
            })
            .collect();
        let pairwise: Vec<usize> = (0..inputs.len())
            .filter(|&i| {
                (0..inputs.len())
                    .any(|j| j != i && lasting(&inputs[i].load, &inputs[j].load, &w))
            })
            .collect();
        proptest::prop_assert_eq!(busy(&inputs, &w), pairwise);
    }
}

#[test]
fn a_zero_margin_leaves_the_cheapest_first() {
    let w = Weights {
        move_margin: 0.0,
        ..Weights::default()
    };
    let inputs = warm_and_cold(50, 4.0, None);
    let ranking = seeded(&inputs, 64 * 52, &w);
    assert_eq!(ranking.moved, Move::Moved);
    assert_eq!(ranking.ranked[0].input, 1);
}

#[test]
fn the_held_replica_moves_to_the_front_keeping_the_rest_in_order() {
    let w = Weights::default();
    let mut inputs = vec![input(0, 0, 0.0, 0.0), input(0, 0, 1.0, 0.0)];
    inputs.push(input(50, 0, 0.0, 4.0));
    let ranking = seeded(&inputs, 64 * 52, &w);
    assert_eq!(ranking.moved, Move::Held);
    let order: Vec<usize> = ranking.ranked.iter().map(|r| r.input).collect();
    assert_eq!(order, vec![2, 0, 1]);
}

#[test]
fn each_waiting_request_pays_the_fitted_overhead() {
    let w = Weights::default();
    let mut i = input(0, 0, 0.0, 3.0);
    let unfitted = cost(&i, 640, 64, &w);
    i.load.prefill_tokens_per_second = Some(8_000.0);
    i.load.prefill_overhead_seconds = 0.1;
    let fitted = cost(&i, 640, 64, &w);
    assert!(
        (fitted - unfitted - 0.3).abs() < 1e-9,
        "{fitted} vs {unfitted}"
    );
}

#[test]
fn the_larger_of_the_own_queue_and_the_scraped_one_stands() {
    let w = Weights::default();
    let idle = cost(&input(0, 0, 0.0, 0.0), 640, 64, &w);
    // Two waiting at the prior: 2 × 1,024 tokens at 8,000 tokens/s.
    let mut i = input(0, 0, 0.0, 2.0);
    let scraped = 2.0 * 1_024.0 / 8_000.0;
    i.load.queued_seconds = 0.1;
    assert!((cost(&i, 640, 64, &w) - idle - scraped).abs() < 1e-9);
    i.load.queued_seconds = 0.5;
    assert!((cost(&i, 640, 64, &w) - idle - 0.5).abs() < 1e-9);
}

/// A replica of `cache` blocks at `usage`, its unanswered picks
/// allocating `demand` blocks.
fn pressed(cache: f64, usage: f64, demand: f64) -> Load {
    Load {
        cache_blocks: Some(cache),
        kv_usage: usage,
        demand_blocks: demand,
        cache_available: true,
        ..Load::default()
    }
}

fn gpu(blocks: u32) -> PrefixMatch {
    PrefixMatch {
        blocks,
        per_tier: [blocks, 0, 0],
        speculative: 0,
        unmodelled: false,
    }
}

#[test]
fn blocks_the_queue_ahead_evicts_are_not_credited() {
    let w = Weights::default();
    // 86 blocks, half in use: 43 free or evictable, 25 of them the
    // conversation's. The queue ahead needs 30: the 18 older ones go
    // first, then 12 of the conversation's, its last ones.
    let m = surviving(gpu(25), &pressed(86.0, 0.5, 30.0), 64, &w);
    assert_eq!(m, gpu(13));
    // Needing no more than the older free blocks: nothing lost.
    assert_eq!(
        surviving(gpu(25), &pressed(86.0, 0.5, 18.0), 64, &w),
        gpu(25)
    );
    // Needing the whole cache: nothing left; speculative blocks too.
    let spec = PrefixMatch {
        speculative: 5,
        ..gpu(25)
    };
    assert_eq!(surviving(spec, &pressed(86.0, 0.5, 200.0), 64, &w), gpu(0));
    // vLLM's waiting requests stand for the prior's tokens each (4 ×
    // 1,024 tokens = 64 blocks) when this indexd's picks are fewer.
    let mut waiting = pressed(86.0, 0.5, 0.0);
    waiting.waiting = 4.0;
    assert_eq!(surviving(gpu(25), &waiting, 64, &w), gpu(0));
}

#[test]
fn nothing_is_discounted_with_room_offloading_no_size_or_the_setting_off() {
    let w = Weights::default();
    // A roomy cache: 16,384 blocks, 90% in use, a long queue ahead.
    assert_eq!(
        surviving(gpu(40), &pressed(16_384.0, 0.9, 500.0), 64, &w),
        gpu(40)
    );
    let overfull = pressed(86.0, 0.9, 200.0);
    // Lower tiers: evicted blocks are offloaded, not lost.
    let tiered = PrefixMatch {
        blocks: 30,
        per_tier: [20, 10, 0],
        speculative: 0,
        unmodelled: false,
    };
    assert_eq!(surviving(tiered, &overfull, 64, &w), tiered);
    // The replica's metrics do not give its size.
    let unknown = Load {
        cache_blocks: None,
        ..overfull
    };
    assert_eq!(surviving(gpu(25), &unknown, 64, &w), gpu(25));
    let off = Weights {
        predict_eviction: false,
        ..Weights::default()
    };
    assert_eq!(surviving(gpu(25), &overfull, 64, &off), gpu(25));
}

#[test]
fn a_conversation_whose_history_will_be_evicted_goes_where_it_starts_soonest() {
    let w = Weights::default();
    let prompt = 50 * 64;
    // The warm replica holds 40 of the prompt's 50 blocks, but its
    // queue ahead will evict them; the other holds the 12 shared ones
    // with a shorter queue.
    let mut warm = Input {
        matched: gpu(40),
        load: pressed(86.0, 0.6, 120.0),
    };
    warm.load.queued_seconds = 0.4;
    let mut cold = Input {
        matched: gpu(12),
        load: pressed(86.0, 0.6, 10.0),
    };
    cold.load.queued_seconds = 0.1;
    let adjusted = |i: &Input| Input {
        matched: surviving(i.matched, &i.load, 64, &w),
        load: i.load,
    };
    let inputs = [adjusted(&warm), adjusted(&cold)];
    assert_eq!(inputs[0].matched.blocks, 0);
    assert_eq!(inputs[1].matched.blocks, 12);
    let r = seeded(&inputs, prompt, &w);
    assert_eq!(r.ranked[0].input, 1);
    assert_eq!(r.moved, Move::None, "nothing left to hold it");
    // As the blocks stand now, the move rule keeps it warm.
    let r = seeded(&[warm, cold], prompt, &w);
    assert_eq!((r.ranked[0].input, r.moved), (0, Move::Held));
}

proptest::proptest! {
    /// Survivors are a prefix of the match, fewer as the queue ahead
    /// grows, and all of it while the other free blocks suffice.
    #[test]
    fn survivors_shrink_with_the_queue_ahead(
        matched in 0u32..100,
        cache in 1u32..400,
        usage in 0.0f64..=1.0,
        demand in 0u32..500,
        more in 0u32..100,
    ) {
        let w = Weights::default();
        let at = |d: u32| surviving(gpu(matched), &pressed(f64::from(cache), usage, f64::from(d)), 64, &w);
        let (a, b) = (at(demand), at(demand + more));
        proptest::prop_assert!(a.blocks <= matched);
        proptest::prop_assert_eq!(a.per_tier[0], a.blocks);
        proptest::prop_assert!(b.blocks <= a.blocks);
        let free = f64::from(cache) * (1.0 - usage);
        if f64::from(demand) + 0.5 <= free - f64::from(matched) {
            proptest::prop_assert_eq!(a.blocks, matched);
        }
    }
}

#[test]
fn a_move_goes_only_where_may_move_admits() {
    let w = Weights::default();
    // A queue long enough to pay for a move (as above), to a target that
    // may not take one: the warm replica stays first.
    let inputs = warm_and_cold(50, 12.0, None);
    let ranking = rank_with(
        &inputs,
        64 * 52,
        64,
        &w,
        &mut StdRng::seed_from_u64(1),
        |i| i != 1,
    );
    assert_eq!(ranking.moved, Move::Barred);
    assert_eq!(ranking.ranked[0].input, 0);
    let ranking = rank_with(
        &inputs,
        64 * 52,
        64,
        &w,
        &mut StdRng::seed_from_u64(1),
        |_| true,
    );
    assert_eq!(ranking.moved, Move::Moved);
}
