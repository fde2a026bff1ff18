//! Tests of `kvroute-bench vllm`'s schedule, rounds and repeats.

use super::*;

#[test]
fn every_profile_rotates_then_the_pair_goes_on_alone() {
    let (lr, precise, sticky) = (
        Profile::LeastRequest,
        Profile::Precise,
        Profile::StickyOracle,
    );
    let pair = [precise, sticky];
    let runs = schedule(&[lr, precise, sticky], 2, Some((4, pair)));
    assert_eq!(
        runs,
        vec![
            (1, lr),
            (1, precise),
            (1, sticky),
            (2, precise),
            (2, sticky),
            (2, lr),
            (3, precise),
            (3, sticky),
            (4, sticky),
            (4, precise),
        ]
    );
    // No more rounds than the profiles' own: nothing added.
    assert_eq!(
        schedule(&[lr, precise, sticky], 2, Some((2, pair))).len(),
        6
    );
    assert_eq!(
        schedule(&[lr, precise, sticky], 3, Some((1, pair))).len(),
        9
    );
    assert_eq!(schedule(&[lr], 2, None), vec![(1, lr), (2, lr)]);
}

#[test]
fn only_one_gateway_workloads_with_both_of_the_pair_get_reference_rounds() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }
    let all = Cli::parse_from(["t"]).args;
    assert_eq!(all.schedule(LiteKind::W2).len(), 6 * 7 + 14 * 2);
    assert_eq!(all.schedule(LiteKind::W2Salted).len(), 6 * 7 + 14 * 2);
    assert_eq!(all.schedule(LiteKind::W3).len(), 16 * 7);
    assert_eq!(all.schedule(LiteKind::W4).len(), 3 * 7);
    let no_oracle = Cli::parse_from(["t", "--profile", "precise,least-request"]).args;
    assert_eq!(no_oracle.schedule(LiteKind::W2).len(), 6 * 2);
    let fewer = Cli::parse_from(["t", "--reference-rounds", "3"]).args;
    assert_eq!(fewer.schedule(LiteKind::W2).len(), 6 * 7);
}

#[test]
fn the_burst_runs_its_own_profiles_for_its_own_rounds_on_the_roomy_fleet() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }
    let all = Cli::parse_from(["t"]).args;
    assert!(all.workloads.contains(&LiteKind::W6Burst));
    let (lr, precise, sticky) = (
        Profile::LeastRequest,
        Profile::Precise,
        Profile::StickyOracle,
    );
    // 20 rounds of 5 runs each of the pair, which goes first
    // alternating run by run; a round's runs one after the other.
    let runs = all.schedule(LiteKind::W6Burst);
    assert_eq!(runs.len(), 20 * 5 * 2);
    assert_eq!(
        &runs[..4],
        &[(1, precise), (1, sticky), (2, sticky), (2, precise)]
    );
    assert_eq!(runs.last(), Some(&(100, precise)));
    assert_eq!(all.round_of_run(LiteKind::W6Burst, 1), (1, 0));
    assert_eq!(all.round_of_run(LiteKind::W6Burst, 5), (1, 4));
    assert_eq!(all.round_of_run(LiteKind::W6Burst, 6), (2, 0));
    assert_eq!(all.round_of_run(LiteKind::W6Burst, 100), (20, 4));
    assert_eq!(all.round_of_run(LiteKind::W2, 4), (4, 0));
    let more = Cli::parse_from([
        "t",
        "--burst-rounds",
        "24",
        "--burst-repeats",
        "1",
        "--burst-profile",
        "least-request,precise,sticky-oracle",
        "--profile",
        "precise",
    ])
    .args;
    assert_eq!(more.schedule(LiteKind::W6Burst).len(), 24 * 3);
    assert!(more.schedule(LiteKind::W6Burst).contains(&(24, lr)));
    assert_eq!(more.schedule(LiteKind::W2).len(), 6);
    // On the roomy tiny-llama fleet, with W1, W2 and W4.
    let built = lite::build(&all.workloads, all.scale, all.seed);
    let burst = built.iter().find(|r| r.kind == LiteKind::W6Burst).unwrap();
    assert_eq!(burst.fleet, lite::roomy());
}

#[test]
fn hybrid_variants_run_their_own_profiles_and_rounds_on_two_more_fleets() {
    use crate::fleet::FleetModel::{self, Gemma3, Llama};
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }
    let all = Cli::parse_from(["t"]).args;
    let (lr, precise, sticky) = (
        Profile::LeastRequest,
        Profile::Precise,
        Profile::StickyOracle,
    );
    // Three profiles, rotated: each in each position twice in six rounds.
    let w2 = all.schedule(LiteKind::W2Hybrid);
    assert_eq!(w2.len(), 6 * 3, "no reference rounds: {w2:?}");
    assert_eq!(
        &w2[..6],
        &[
            (1, lr),
            (1, precise),
            (1, sticky),
            (2, precise),
            (2, sticky),
            (2, lr)
        ]
    );
    for p in [lr, precise, sticky] {
        let firsts = w2.chunks(3).filter(|round| round[0].1 == p).count();
        assert_eq!(firsts, 2, "{p:?}");
    }
    assert_eq!(all.schedule(LiteKind::W4Hybrid).len(), 6 * 3);
    assert_eq!(all.schedule(LiteKind::W3Hybrid).len(), 10 * 3);
    // --profile leaves them alone; --hybrid-profile and the rounds' flags do not.
    let narrow = Cli::parse_from([
        "t",
        "--profile",
        "precise",
        "--hybrid-profile",
        "precise,sticky-oracle,vllm-router-cache-aware",
        "--hybrid-rounds",
        "2",
        "--hybrid-pressure-rounds",
        "4",
    ])
    .args;
    assert_eq!(narrow.schedule(LiteKind::W2).len(), 6);
    assert_eq!(narrow.schedule(LiteKind::W2Hybrid).len(), 2 * 3);
    assert_eq!(narrow.schedule(LiteKind::W3Hybrid).len(), 4 * 3);
    assert!(
        narrow
            .schedule(LiteKind::W4Hybrid)
            .contains(&(2, Profile::VllmRouterCacheAware))
    );
    // By default the hybrid variants come last, on two fleets of their own
    // (roomy, then pressure), each started once.
    let runs = lite::build(&all.workloads, all.scale, all.seed);
    let mut fleets: Vec<FleetOptions> = Vec::new();
    for r in &runs {
        if !fleets.contains(&r.fleet) {
            fleets.push(r.fleet);
        }
    }
    let models: Vec<(FleetModel, bool)> = fleets
        .iter()
        .map(|f| (f.model, f.num_gpu_blocks.is_some()))
        .collect();
    assert_eq!(
        models,
        [
            (Llama, false),
            (Llama, true),
            (Gemma3, false),
            (Gemma3, true)
        ]
    );
    let hybrid: Vec<&str> = runs
        .iter()
        .filter(|r| r.kind.is_hybrid())
        .map(|r| r.workload.name.as_str())
        .collect();
    assert_eq!(
        hybrid,
        ["w2-lite-hybrid", "w4-lite-3gw-hybrid", "w3-lite-hybrid"]
    );
}
