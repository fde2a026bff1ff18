//! Runs one workload under one profile, one [`Sample`] per request, the
//! conversations driven by a bounded pool of client threads.
//!
//! On the mock ([`Target::Mock`]) every profile gets a fresh stack: new
//! replicas, so every profile starts from empty caches. On real vLLM
//! ([`Target::Vllm`]) the replicas are the fleet's, shared by the profiles run
//! one after another; each profile gets fresh gateways (Envoys, indexds, peer
//! routers) and its own nonce at the head of every conversation, so that no
//! profile finds blocks another one left.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use clap::ValueEnum;
use indicatif::ProgressBar;
use kvroute_e2e::stack::OVERRIDE_HEADER;
use kvroute_e2e::{Routing, Stack, StackOptions};
use serde_json::{Value, json};

use crate::added::{self, AddedRow};
use crate::client::{self, Reply};
use crate::fleet::{self, Fleet};
use crate::histogram::{PICK_LATENCY, TOKENIZE_LOCAL, parse_prometheus_seconds};
use crate::history::{Msg, apply, request_body};
use crate::indexd_metrics::IndexdRow;
use crate::peers::{self, Peer, Worker};
use crate::sample::{STICKY_ORACLE, Sample, millis};
use crate::workload::{Api, Conversation, Fault, FaultKind, Step, Workload};
use crate::{BenchError, load_cpu, procfs};

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
            Self::Precise | Self::PreciseLocal => Routing::Precise,
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

/// Starts the profile's stack on the mock: replicas, gateways, and the
/// replicas as peers and the runner reach them.
fn mock_stack(
    workload: &Workload,
    profile: Profile,
    options: RunOptions,
) -> Result<(Stack, Vec<ReplicaRef>, Vec<Worker>), BenchError> {
    let drop_reasoning = workload.reasoning_tokens > 0;
    let defaults = StackOptions::default();
    let stack = Stack::start(StackOptions {
        replicas: workload.replicas,
        model: MODEL.into(),
        block_size: workload.block_size,
        num_gpu_blocks: workload.gpu_blocks,
        time_scale: options.time_scale.unwrap_or(workload.time_scale),
        routing: profile.routing(),
        seed: options.seed,
        chat_template: if drop_reasoning {
            mock_vllm::ChatTemplate::DropReasoning
        } else {
            mock_vllm::ChatTemplate::RoleMarkers
        },
        reasoning_tokens: workload.reasoning_tokens,
        gateways: workload.gateways.max(1),
        filter_overrides: profile.filter_overrides(&defaults),
        kv_cache_layout: workload.kv_cache_layout.clone(),
        max_num_batched_tokens: workload.max_num_batched_tokens,
        max_model_len: workload.mock_max_model_len(defaults.max_model_len),
        ..defaults
    })?;
    let replicas = stack
        .replicas()
        .iter()
        .enumerate()
        .map(|(i, r)| ReplicaRef {
            name: format!("r{i}"),
            http: r.http_addr().to_string(),
            admin: Some(r.admin_addr().to_string()),
        })
        .collect();
    let workers = stack
        .replicas()
        .iter()
        .map(|r| Worker {
            url: format!("http://{}", r.http_addr()),
            events: r.events_endpoint().map(str::to_owned),
            replay: r.replay_endpoint().map(str::to_owned),
        })
        .collect();
    Ok((stack, replicas, workers))
}

/// Starts the profile's gateways in front of the fleet; the peers reach each
/// replica through its tap (which names the replica in its answers).
fn fleet_stack(
    fleet: &Fleet,
    workload: &Workload,
    profile: Profile,
    options: RunOptions,
) -> Result<(Stack, Vec<ReplicaRef>, Vec<Worker>), BenchError> {
    let routing = profile.routing();
    let defaults = StackOptions::default();
    let filter_overrides = profile.filter_overrides(&defaults);
    let stack = Stack::start_external(
        StackOptions {
            replicas: fleet.replicas().len(),
            model: MODEL.into(),
            block_size: fleet.options().block_size,
            routing,
            seed: options.seed,
            gateways: workload.gateways.max(1),
            tokenizers: fleet::tokenizers(fleet.options().model),
            thread_label: Some(load_cpu::THREAD_LABEL.to_owned()),
            indexd_unix_socket: options.indexd_unix_socket,
            scrape_interval: options.scrape_interval.unwrap_or(defaults.scrape_interval),
            filter_overrides,
            ..defaults
        },
        fleet.external(),
    )?;
    if routing != Routing::LeastRequest {
        // kvroute tokenizes with its own tokenizer once it agrees with vLLM.
        fleet::wait_ready(&stack.indexd_handles(), fleet.external())?;
    }
    let replicas = fleet
        .replicas()
        .iter()
        .map(|r| ReplicaRef {
            name: r.name.clone(),
            http: r.http.to_string(),
            admin: None,
        })
        .collect();
    let workers = fleet
        .replicas()
        .iter()
        .map(|r| Worker {
            url: r.tap.clone(),
            events: None,
            replay: None,
        })
        .collect();
    Ok((stack, replicas, workers))
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

fn run_conversation(ctx: &Ctx<'_>, conversation: &Conversation) -> Vec<Sample> {
    // On a shared fleet the nonce heads the first message: nothing of this
    // run matches a block another profile left.
    let nonce = |text: &str| match ctx.target {
        Target::Vllm { nonce, .. } => format!("{nonce} {text}"),
        Target::Mock => text.to_owned(),
    };
    let mut history = Vec::new();
    match &conversation.system {
        Some(system) => {
            history.push(Msg::System(nonce(system)));
            history.push(Msg::User(conversation.first.clone()));
        }
        None => history.push(Msg::User(nonce(&conversation.first))),
    }
    let mut samples: Vec<Sample> = Vec::with_capacity(conversation.requests());
    let mut last = Reply::default();
    let mut prev_replica = String::new();
    for turn in 0..conversation.requests() {
        if turn > 0 {
            if Instant::now() >= ctx.deadline {
                break;
            }
            let Some(step) = conversation.steps.get(turn - 1) else {
                break;
            };
            apply(step, &mut history, &last, conversation.id, turn);
        }
        let kind = if turn == 0 {
            "first"
        } else {
            conversation.steps.get(turn - 1).map_or("first", Step::kind)
        };
        let (sample, reply) = send(ctx, conversation, &history, turn, kind, &prev_replica);
        ctx.progress.inc(1);
        let failed = !sample.ok();
        prev_replica = sample.replica.clone();
        samples.push(sample);
        last = reply;
        if failed {
            // The history needs the reply: the conversation cannot go on.
            ctx.progress
                .inc((conversation.requests() - turn - 1) as u64);
            break;
        }
    }
    samples
}

/// How long [`Profile::StickyOracleHeld`] holds turn `turn` of
/// conversation `id`: 2.5 ms plus an exponential of mean 1.1 ms, drawn from
/// the run's seed (a round numbers its conversations apart, so each round
/// draws its own holds; a rerun with the seed draws the same).
fn held(seed: u64, id: u32, turn: usize) -> Duration {
    let mut rng = crate::rng::Rng::new(seed ^ 0x6865_6c64, u64::from(id) << 8 | turn as u64);
    let exp = -(1.0 - rng.unit()).ln() * 1.1;
    Duration::from_secs_f64((2.5 + exp.min(50.0)) / 1000.0)
}

fn send(
    ctx: &Ctx<'_>,
    conversation: &Conversation,
    history: &[Msg],
    turn: usize,
    kind: &str,
    prev_replica: &str,
) -> (Sample, Reply) {
    let body = request_body(conversation, history, MODEL);
    let salt = conversation.salt.as_deref();
    let index = ctx.sent.fetch_add(1, Ordering::SeqCst);
    for fault in ctx.workload.faults.iter().filter(|f| f.at_request == index) {
        inject(ctx, fault);
    }
    let phase = ctx.phase.lock().map(|p| *p).unwrap_or_default();
    let (oracle, oracle_replica, expected, oracle_error) =
        match oracle(ctx, conversation.api, &body, salt) {
            Ok((tokens, replica, ids)) => (
                tokens,
                replica,
                ids.map(|ids| mock_vllm::prompt_digest(salt, &ids)),
                None,
            ),
            Err(e) => (0, String::new(), None, Some(format!("oracle: {e}"))),
        };
    let gateway = ctx.workload.gateway(ctx.seed, conversation.id, turn);
    let url = ctx.urls.get(gateway).or(ctx.urls.first());
    // The sticky oracle names the conversation's replica itself.
    let pin: Vec<(&str, String)> = match ctx.profile {
        Profile::StickyOracle | Profile::StickyOracleHeld => ctx
            .replicas
            .get(conversation.id as usize % ctx.replicas.len().max(1))
            .map(|r| (OVERRIDE_HEADER, r.http.clone()))
            .into_iter()
            .collect(),
        _ => Vec::new(),
    };
    let start = ctx.started.elapsed();
    // The hold counts in the held oracle's latency, as the filter's does in
    // kvroute's.
    let hold = match ctx.profile {
        Profile::StickyOracleHeld => held(ctx.seed, conversation.id, turn),
        _ => Duration::ZERO,
    };
    std::thread::sleep(hold);
    let reply = match url {
        Some(url) => client::stream(&ctx.agent, url, conversation.api, &body, &pin),
        None => Reply {
            error: Some("no gateway".into()),
            ..Reply::default()
        },
    };
    let intact = match (&expected, &reply.digest) {
        (Some(sent), Some(ran)) if sent == ran => "yes",
        (Some(_), Some(_)) => "no",
        _ => "",
    };
    let replica = reply
        .replica
        .as_ref()
        .map(|a| ctx.names.get(a).cloned().unwrap_or_else(|| a.clone()))
        .unwrap_or_default();
    let sample = Sample {
        workload: ctx.workload.name.clone(),
        profile: ctx.profile.name().to_owned(),
        conversation: conversation.id,
        turn: turn as u32,
        kind: kind.to_owned(),
        salt: salt.unwrap_or_default().to_owned(),
        replica,
        prev_replica: if turn == 0 {
            String::new()
        } else {
            prev_replica.to_owned()
        },
        oracle_replica,
        prompt_tokens: reply.prompt_tokens,
        cached_tokens: reply.cached_tokens,
        oracle_cached_tokens: oracle,
        ttft_ms: millis(hold + reply.ttft.unwrap_or(reply.latency)),
        latency_ms: millis(hold + reply.latency),
        start_ms: millis(start),
        decision: reply.decision.clone().unwrap_or_default(),
        status: reply.status,
        error: reply.error.clone().or(oracle_error).unwrap_or_default(),
        gateway: gateway as u32,
        phase: phase.to_owned(),
        intact: intact.to_owned(),
    };
    (sample, reply)
}

/// Injects `fault` (on the sending client's thread: its own conversation
/// waits, the others go on). Requests sent from now on belong to its phase,
/// including those sent while it is under way (an indexd outage).
/// Failures are collected and fail the run.
fn inject(ctx: &Ctx<'_>, fault: &Fault) {
    if let Ok(mut phase) = ctx.phase.lock() {
        *phase = fault.kind.label();
    }
    ctx.progress.println(format!(
        "{} / {}: {} at request {}",
        ctx.workload.name,
        ctx.profile.name(),
        fault.kind.label(),
        fault.at_request
    ));
    let admin = |replica: &ReplicaRef, path: &str, body: Value| {
        let admin = replica
            .admin
            .as_ref()
            .ok_or_else(|| format!("{}: no admin API (not a mock replica)", replica.name))?;
        let url = format!("http://{admin}{path}");
        client::post_json(&ctx.agent, &url, &body).map(|_| ())
    };
    let result: Result<(), String> = match fault.kind {
        FaultKind::ReplicaRestart { replica } => ctx
            .replicas
            .get(replica)
            .ok_or_else(|| format!("no replica {replica}"))
            .and_then(|r| admin(r, "/admin/restart", json!({}))),
        FaultKind::EventDelay { ms } => ctx
            .replicas
            .iter()
            .try_for_each(|r| admin(r, "/admin/events/delay", json!({ "ms": ms }))),
        FaultKind::LostBatches {
            first,
            replicas,
            batches,
        } => ctx
            .replicas
            .iter()
            .try_for_each(|r| admin(r, "/admin/events/delay", json!({ "ms": 0 })))
            .and_then(|()| {
                ctx.replicas
                    .iter()
                    .skip(first)
                    .take(replicas)
                    .try_for_each(|r| admin(r, "/admin/events/drop", json!({ "batches": batches })))
            }),
        FaultKind::IndexdRestart { down_ms } => match ctx.stack.lock() {
            Ok(mut stack) => {
                stack.stop_indexd();
                std::thread::sleep(Duration::from_millis(down_ms));
                stack.start_indexd().map_err(|e| e.to_string())
            }
            Err(_) => Err("stack lock poisoned".into()),
        },
    };
    if let Err(e) = result
        && let Ok(mut errors) = ctx.fault_errors.lock()
    {
        errors.push(format!("{}: {e}", fault.kind.label()));
    }
}

/// The best prefix any replica holds for this request now: tokens and replica
/// (empty when none holds any), and, on the mock, the request's prompt token
/// ids (for the digest of what the replica must run).
fn oracle(
    ctx: &Ctx<'_>,
    api: Api,
    body: &Value,
    salt: Option<&str>,
) -> Result<(u64, String, Option<Vec<u32>>), String> {
    if let Target::Vllm { fleet, .. } = ctx.target {
        let (tokens, replica) = fleet.oracle(api, body)?;
        return Ok((tokens, replica, None));
    }
    let first = ctx
        .replicas
        .first()
        .ok_or_else(|| "no replica".to_owned())?;
    let ids = client::tokenize(&ctx.agent, &first.http, api, body)?;
    let mut best = (0u64, String::new());
    for r in &ctx.replicas {
        let admin = r
            .admin
            .as_ref()
            .ok_or_else(|| format!("{}: no admin API", r.name))?;
        let hit = client::probe(&ctx.agent, admin, MODEL, salt, &ids)?;
        if hit > best.0 {
            best = (hit, r.name.clone());
        }
    }
    Ok((best.0, best.1, Some(ids)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_held_oracle_holds_like_the_filter() {
        let draws: Vec<f64> = (0..2_000u32)
            .flat_map(|c| (0..6).map(move |t| held(42, c, t).as_secs_f64() * 1000.0))
            .collect();
        let mean = draws.iter().sum::<f64>() / draws.len() as f64;
        let mut sorted = draws.clone();
        sorted.sort_by(f64::total_cmp);
        let p50 = sorted[sorted.len() / 2];
        let p99 = sorted[sorted.len() * 99 / 100];
        assert!(sorted[0] >= 2.5, "never under its base: {}", sorted[0]);
        assert!((3.45..3.75).contains(&mean), "mean {mean}");
        assert!((3.1..3.5).contains(&p50), "p50 {p50}");
        assert!((6.5..9.0).contains(&p99), "p99 {p99}");
        // The same turn of the same conversation holds the same in every
        // run of a seed; another turn, another hold.
        assert_eq!(held(42, 7, 3), held(42, 7, 3));
        assert_ne!(held(42, 7, 3), held(42, 7, 4));
    }
}
