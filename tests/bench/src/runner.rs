//! Runs one workload under one profile, one [`Sample`] per request, the
//! conversations driven by a bounded pool of client threads.
//!
//! On the mock ([`Target::Mock`]) every profile gets a fresh stack: new
//! replicas, so every profile starts from empty caches. On real vLLM
//! ([`Target::Vllm`]) the replicas are the fleet's, shared by the profiles run
//! one after another; each profile gets fresh gateways (Envoys, indexds, peer
//! routers) and its own nonce at the head of every conversation, so that no
//! profile finds blocks another one left.
//!
//! `stack` starts a profile's stack, `conversation` drives one
//! conversation, `fault` injects the workload's faults.

mod conversation;
mod fault;
mod stack;

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use clap::ValueEnum;
use indicatif::ProgressBar;
use kvroute_e2e::{Routing, Stack, StackOptions};

use crate::added::{self, AddedRow};
use crate::client;
use crate::fleet::{self, Fleet};
use crate::histogram::{PICK_LATENCY, TOKENIZE_LOCAL, parse_prometheus_seconds};
use crate::indexd_metrics::IndexdRow;
use crate::peers::{self, Peer};
use crate::sample::{STICKY_ORACLE, Sample};
use crate::workload::Workload;
use crate::{BenchError, load_cpu, procfs};
use conversation::run_conversation;
use stack::{fleet_stack, mock_stack};

/// A routing profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Profile {
    /// Envoy's least-request alone (no filter): the baseline.
    LeastRequest,
    /// kvroute, approximate mode: text-chunk keys learned from its own picks.
    Approximate,
    /// kvroute, precise mode: exact token-block keys from vLLM's KV events.
    Precise,
    /// kvroute, precise mode, the filter sending up to [`LOCAL_TURNS`]
    /// continuations in a row where their previous turn went without a Pick
    /// (`local_continuations`).
    PreciseLocal,
    /// kvroute, precise mode, without the speculative credit
    /// (`speculative_ttl: 0`): a new conversation is not drawn to the
    /// replica a burst's earlier picks just sent the same shared prompt to
    /// (co-location by prefix), only to blocks the replicas' events show;
    /// a burst spreads by load. The other side of precise's choice,
    /// measured beside it.
    PreciseSpread,
    /// kvroute, precise mode, a replica also tokenizing up to one live Pick
    /// a second beside it (`shadow_per_second: 1`, the earlier default, ten
    /// times today's): what the exactness gate's live checks cost the
    /// replicas, measured beside precise.
    PreciseChecked,
    /// kvroute, precise mode, new conversations placed by their first
    /// turn's cost alone (`weights.balance_margin: 0`): without spreading
    /// near ties by number, measured beside precise.
    PreciseByCost,
    /// vllm-router 0.1.17, `cache_aware` (a separate process; bench venv).
    VllmRouterCacheAware,
    /// vllm-router 0.1.17, `kv_aware` subscribed to the replicas' KV events.
    VllmRouterKvAware,
    /// sglang-router 0.3.2, `cache_aware`.
    SglangRouterCacheAware,
    /// Client-side affinity, the latency reference: conversation `c` pinned
    /// to replica `c mod n` (conversations split evenly), sent through the
    /// gateway's Envoy without the filter, the host named by the client in
    /// Envoy's override header.
    StickyOracle,
    /// The sticky oracle with every request held first at the client for a
    /// random time shaped like kvroute's filter hold on real replicas
    /// (2.5 ms plus an exponential of mean 1.1 ms: p50 ≈ 3.3 ms, p99 ≈
    /// 7.6 ms): a diagnostic, not a router. Holding every request a constant
    /// 3.3 ms changed nothing; this asks whether the hold's spread does,
    /// by breaking up requests that would reach a replica together (and be
    /// prefilled in one step).
    StickyOracleHeld,
}

impl Profile {
    /// The name in samples.
    pub fn name(self) -> &'static str {
        match self {
            Self::LeastRequest => "least-request",
            Self::Approximate => "kvroute-approximate",
            Self::Precise => "kvroute-precise",
            Self::PreciseLocal => "kvroute-precise-local",
            Self::PreciseSpread => "kvroute-precise-spread",
            Self::PreciseChecked => "kvroute-precise-checked",
            Self::PreciseByCost => "kvroute-precise-by-cost",
            Self::VllmRouterCacheAware => "vllm-router-cache-aware",
            Self::VllmRouterKvAware => "vllm-router-kv-aware",
            Self::SglangRouterCacheAware => "sglang-router-cache-aware",
            Self::StickyOracle => STICKY_ORACLE,
            Self::StickyOracleHeld => "sticky-oracle-held",
        }
    }

    /// Envoy's routing; peers run behind no filter (Envoy is started but unused).
    fn routing(self) -> Routing {
        match self {
            Self::Approximate => Routing::Approximate,
            Self::Precise
            | Self::PreciseLocal
            | Self::PreciseSpread
            | Self::PreciseChecked
            | Self::PreciseByCost => Routing::Precise,
            _ => Routing::LeastRequest,
        }
    }

    /// The filter's configuration over the stack's (`defaults`).
    fn filter_overrides(self, defaults: &StackOptions) -> serde_json::Value {
        let mut overrides = defaults.filter_overrides.clone();
        if self == Self::PreciseLocal
            && let Some(map) = overrides.as_object_mut()
        {
            map.insert("local_continuations".into(), LOCAL_TURNS.into());
        }
        overrides
    }

    /// indexd's `speculative_ttl` under this profile (None: its default).
    fn speculative_ttl(self) -> Option<Duration> {
        (self == Self::PreciseSpread).then_some(Duration::ZERO)
    }

    /// indexd's `shadow_per_second` under this profile (None: its default).
    fn shadow_per_second(self) -> Option<f64> {
        (self == Self::PreciseChecked).then_some(1.0)
    }

    /// indexd's `weights.balance_margin` under this profile (None: its
    /// default).
    fn balance_margin(self) -> Option<f64> {
        (self == Self::PreciseByCost).then_some(0.0)
    }

    /// The peer router this profile puts in front of the replicas, if any.
    pub fn peer(self) -> Option<Peer> {
        match self {
            Self::VllmRouterCacheAware => Some(Peer::VllmCacheAware),
            Self::VllmRouterKvAware => Some(Peer::VllmKvAware),
            Self::SglangRouterCacheAware => Some(Peer::SglangCacheAware),
            _ => None,
        }
    }
}

/// The filter's `local_continuations` under [`Profile::PreciseLocal`].
pub const LOCAL_TURNS: u32 = 8;

/// Knobs of a run that are not part of the workload script.
#[derive(Debug, Clone, Copy)]
pub struct RunOptions {
    /// Replaces each workload's own latency-model speed when set.
    pub time_scale: Option<f64>,
    /// No new request starts after this long within one profile.
    pub budget: Duration,
    /// indexd's tie-breaking seed.
    pub seed: u64,
    /// indexd's `scrape_interval` on real replicas (None: the test stack's).
    pub scrape_interval: Option<Duration>,
    /// Envoy reaches indexd on a Unix socket (as the deploy files do)
    /// instead of TCP on loopback.
    pub indexd_unix_socket: bool,
}

/// What the profiles run against.
#[derive(Debug, Clone, Copy)]
pub enum Target<'a> {
    /// Fresh mock replicas per profile, in the bench process.
    Mock,
    /// A real vLLM fleet shared by the profiles; `nonce` (unique per
    /// workload × profile) heads every conversation's first message.
    Vllm {
        /// The fleet.
        fleet: &'a Fleet,
        /// The nonce, e.g. `Run 007.`
        nonce: &'a str,
    },
}

/// Per-request timeout (the mock at full scale serves a 26k-token cold prompt in ≈ 5 s).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);
/// The mock's model name (the fleet serves the same).
const MODEL: &str = fleet::MODEL;

/// One replica as the runner sees it.
struct ReplicaRef {
    /// `r0`, `r1`, …
    name: String,
    /// `ip:port` of its OpenAI API (the name Envoy's cluster gives it).
    http: String,
    /// `ip:port` of the mock's admin API (None on real vLLM).
    admin: Option<String>,
}

struct Ctx<'a> {
    workload: &'a Workload,
    profile: Profile,
    target: Target<'a>,
    seed: u64,
    /// One per gateway (Envoy, or a peer router process).
    urls: Vec<String>,
    /// `ip:port` → `r{i}`.
    names: HashMap<String, String>,
    replicas: Vec<ReplicaRef>,
    started: Instant,
    deadline: Instant,
    agent: ureq::Agent,
    progress: &'a ProgressBar,
    /// Requests sent so far (the clock of the fault script).
    sent: AtomicUsize,
    /// The label of the last fault injected.
    phase: Mutex<&'static str>,
    /// The stack, for faults that stop and start its parts.
    stack: &'a Mutex<Stack>,
    /// Faults that could not be injected.
    fault_errors: Mutex<Vec<String>>,
}

/// Runs `workload` under `profile` on `target`.
pub fn run(
    workload: &Workload,
    profile: Profile,
    target: Target<'_>,
    options: RunOptions,
    progress: &ProgressBar,
) -> Result<Outcome, BenchError> {
    let (stack, replicas, workers) = match target {
        Target::Mock => mock_stack(workload, profile, options)?,
        Target::Vllm { fleet, .. } => fleet_stack(fleet, workload, profile, options)?,
    };
    // Peers: one router process per gateway, each with its own state.
    let mut routers = Vec::new();
    if let Some(p) = profile.peer() {
        for i in 0..workload.gateways.max(1) {
            routers.push(peers::start(p, &workers, workload.block_size, MODEL, i)?);
        }
    }
    let urls = if routers.is_empty() {
        stack.gateway_urls()?
    } else {
        routers.iter().map(|r| r.url().to_owned()).collect()
    };
    // On the fleet, the CPU of the run's load is read (see [`load_cpu`]).
    let probe = match target {
        Target::Vllm { fleet, .. } => Some(load_cpu::Probe {
            gateways: if routers.is_empty() {
                stack.gateway_envoys().iter().map(|e| e.pid()).collect()
            } else {
                routers.iter().map(peers::PeerRouter::pid).collect()
            },
            replicas: fleet.server_pids(),
        }),
        Target::Mock => None,
    };
    let stack = Mutex::new(stack);
    let cpu_start = probe.as_ref().map(load_cpu::Probe::mark);
    let started = Instant::now();
    let ctx = Ctx {
        workload,
        profile,
        target,
        seed: options.seed,
        urls,
        names: replicas
            .iter()
            .map(|r| (r.http.clone(), r.name.clone()))
            .collect(),
        replicas,
        started,
        deadline: started + options.budget,
        agent: client::agent(REQUEST_TIMEOUT),
        progress,
        sent: AtomicUsize::new(0),
        phase: Mutex::new(""),
        stack: &stack,
        fault_errors: Mutex::new(Vec::new()),
    };
    progress.set_message(format!("{} / {}", workload.name, profile.name()));
    let next = Mutex::new(0usize);
    let samples = Mutex::new(Vec::with_capacity(workload.requests()));
    let clients_ns = AtomicU64::new(0);
    std::thread::scope(|scope| {
        for _ in 0..workload.concurrency.max(1) {
            scope.spawn(|| {
                loop {
                    let index = match next.lock() {
                        Ok(mut n) => {
                            let i = *n;
                            *n += 1;
                            i
                        }
                        Err(_) => break,
                    };
                    let Some(conversation) = workload.conversations.get(index) else {
                        break;
                    };
                    if Instant::now() >= ctx.deadline {
                        progress.inc(conversation.requests() as u64);
                        continue;
                    }
                    let mut done = run_conversation(&ctx, conversation);
                    if let Ok(mut all) = samples.lock() {
                        all.append(&mut done);
                    }
                }
                // Its whole life falls within the run's load.
                clients_ns.fetch_add(procfs::this_thread_cpu_ns().unwrap_or(0), Ordering::Relaxed);
            });
        }
    });
    let cpu_end = probe.as_ref().map(load_cpu::Probe::mark);
    let fault_errors = ctx.fault_errors.into_inner().unwrap_or_default();
    let samples = samples.into_inner().unwrap_or_default();
    let cpu = cpu_start.zip(cpu_end).map(|(start, end)| {
        let answered = samples.iter().filter(|s| s.ok()).count() as u64;
        load_cpu::CpuRow::between(
            &workload.name,
            profile.name(),
            answered,
            clients_ns.load(Ordering::Relaxed) / 1_000_000,
            &start,
            &end,
        )
    });
    let kvroute = profile.routing() != Routing::LeastRequest;
    let (added, indexd) = {
        let stack = stack
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let added = match target {
            Target::Vllm { .. } if kvroute => {
                filter_histograms(&stack, workload, profile, &samples, progress)
            }
            _ => Vec::new(),
        };
        let indexd = if kvroute {
            indexd_readings(&stack, workload, profile)
        } else {
            Vec::new()
        };
        (added, indexd)
    };
    drop(routers);
    drop(stack);
    if !fault_errors.is_empty() {
        return Err(BenchError::Fault(format!(
            "{} / {}: {}",
            workload.name,
            profile.name(),
            fault_errors.join("; ")
        )));
    }
    if samples.len() < workload.requests() {
        progress.println(format!(
            "{} / {}: {} of {} requests sent (budget of {:?} reached or a conversation failed)",
            workload.name,
            profile.name(),
            samples.len(),
            workload.requests(),
            options.budget
        ));
    }
    Ok(Outcome {
        samples,
        added,
        cpu,
        indexd,
    })
}

/// What one workload × profile produced.
#[derive(Debug, Default)]
pub struct Outcome {
    /// One per request.
    pub samples: Vec<Sample>,
    /// kvroute on real replicas: each gateway's filter histograms.
    pub added: Vec<AddedRow>,
    /// On real replicas: the CPU of the load.
    pub cpu: Option<load_cpu::CpuRow>,
    /// kvroute: each gateway's indexd at the end of the run.
    pub indexd: Vec<IndexdRow>,
}

/// Each gateway's indexd as its `/metrics` page reads at the end of the run
/// (gateway i's indexd is the stack's i-th; after an indexd restart, the
/// restarted one's).
fn indexd_readings(stack: &Stack, workload: &Workload, profile: Profile) -> Vec<IndexdRow> {
    (0u32..)
        .zip(stack.indexd_handles())
        .map(|(gateway, h)| {
            IndexdRow::parse(&h.metrics_text()).of_run(&workload.name, profile.name(), gateway)
        })
        .collect()
}

/// Each gateway's filter histograms once its Envoy has merged the requests
/// sent through it (a failure is reported and leaves them out).
fn filter_histograms(
    stack: &Stack,
    workload: &Workload,
    profile: Profile,
    samples: &[Sample],
    progress: &ProgressBar,
) -> Vec<AddedRow> {
    let mut out = Vec::new();
    let indexds = stack.indexd_handles();
    for (gateway, envoy) in (0u32..).zip(stack.gateway_envoys()) {
        let sent = samples.iter().filter(|s| s.gateway == gateway).count() as u64;
        match crate::histogram::envoy_histograms(envoy, sent) {
            Ok(mut hists) => {
                // Gateway i's own indexd (the stack starts them in order).
                if let Some(h) = indexds.get(gateway as usize) {
                    let text = h.metrics_text();
                    for name in [PICK_LATENCY, TOKENIZE_LOCAL] {
                        if let Some(hist) = parse_prometheus_seconds(&text, name) {
                            hists.insert(name.to_owned(), hist);
                        }
                    }
                }
                out.extend(added::rows(&workload.name, profile.name(), gateway, &hists));
            }
            Err(e) => progress.println(format!(
                "{} / {}: gateway {gateway}'s filter histograms not read: {e}",
                workload.name,
                profile.name()
            )),
        }
    }
    out
}
