//! Runs one workload under one profile: a fresh stack (new replicas, so every
//! profile starts from empty caches), the conversations driven by a bounded
//! pool of client threads, one [`Sample`] per request.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use clap::ValueEnum;
use indicatif::ProgressBar;
use kvroute_e2e::{Routing, Stack, StackOptions};
use serde_json::{Value, json};

use crate::BenchError;
use crate::client::{self, Reply};
use crate::peers::{self, Peer};
use crate::sample::{Sample, millis};
use crate::workload::{Api, Conversation, Fault, FaultKind, Step, Workload};

/// A routing profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Profile {
    /// Envoy's least-request alone (no filter): the baseline.
    LeastRequest,
    /// kvroute, approximate mode: text-chunk keys learned from its own picks.
    Approximate,
    /// kvroute, precise mode: exact token-block keys from vLLM's KV events.
    Precise,
    /// vllm-router 0.1.17, `cache_aware` (a separate process; bench venv).
    VllmRouterCacheAware,
    /// vllm-router 0.1.17, `kv_aware` subscribed to the replicas' KV events.
    VllmRouterKvAware,
    /// sglang-router 0.3.2, `cache_aware`.
    SglangRouterCacheAware,
}

impl Profile {
    /// The name in samples.
    pub fn name(self) -> &'static str {
        match self {
            Self::LeastRequest => "least-request",
            Self::Approximate => "kvroute-approximate",
            Self::Precise => "kvroute-precise",
            Self::VllmRouterCacheAware => "vllm-router-cache-aware",
            Self::VllmRouterKvAware => "vllm-router-kv-aware",
            Self::SglangRouterCacheAware => "sglang-router-cache-aware",
        }
    }

    /// Envoy's routing; peers run behind no filter (Envoy is started but unused).
    fn routing(self) -> Routing {
        match self {
            Self::Approximate => Routing::Approximate,
            Self::Precise => Routing::Precise,
            _ => Routing::LeastRequest,
        }
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

/// Knobs of a run that are not part of the workload script.
#[derive(Debug, Clone, Copy)]
pub struct RunOptions {
    /// Replaces each workload's own latency-model speed when set.
    pub time_scale: Option<f64>,
    /// No new request starts after this long within one profile.
    pub budget: Duration,
    /// indexd's tie-breaking seed.
    pub seed: u64,
}

/// Per-request timeout (the mock at full scale serves a 26k-token cold prompt in ≈ 5 s).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);
/// The mock's model name.
const MODEL: &str = "tiny";

struct Ctx<'a> {
    workload: &'a Workload,
    profile: Profile,
    seed: u64,
    /// One per gateway (Envoy, or a peer router process).
    urls: Vec<String>,
    /// `ip:port` → `r{i}`.
    names: HashMap<String, String>,
    /// `(name, http, admin)` per replica.
    replicas: Vec<(String, String, String)>,
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

/// Runs `workload` under `profile` on a fresh stack.
pub fn run(
    workload: &Workload,
    profile: Profile,
    options: RunOptions,
    progress: &ProgressBar,
) -> Result<Vec<Sample>, BenchError> {
    let drop_reasoning = workload.reasoning_tokens > 0;
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
        ..StackOptions::default()
    })?;
    // Peers: one router process per gateway, each with its own state.
    let mut routers = Vec::new();
    if let Some(p) = profile.peer() {
        for i in 0..workload.gateways.max(1) {
            routers.push(peers::start(p, &stack, workload.block_size, MODEL, i)?);
        }
    }
    let urls = if routers.is_empty() {
        stack.gateway_urls()?
    } else {
        routers.iter().map(|r| r.url().to_owned()).collect()
    };
    let replicas: Vec<(String, String, String)> = stack
        .replicas()
        .iter()
        .enumerate()
        .map(|(i, r)| {
            (
                format!("r{i}"),
                r.http_addr().to_string(),
                r.admin_addr().to_string(),
            )
        })
        .collect();
    let stack = Mutex::new(stack);
    let started = Instant::now();
    let ctx = Ctx {
        workload,
        profile,
        seed: options.seed,
        urls,
        names: replicas
            .iter()
            .map(|(name, http, _)| (http.clone(), name.clone()))
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
                        Err(_) => return,
                    };
                    let Some(conversation) = workload.conversations.get(index) else {
                        return;
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
            });
        }
    });
    let fault_errors = ctx.fault_errors.into_inner().unwrap_or_default();
    drop(routers);
    drop(stack);
    let samples = samples.into_inner().unwrap_or_default();
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
    Ok(samples)
}

/// One message of the history, rendered per API.
#[derive(Debug, Clone)]
enum Msg {
    System(String),
    User(String),
    Assistant {
        content: String,
        reasoning: String,
        call: Option<(String, String, String)>,
    },
    Tool {
        call_id: String,
        content: String,
    },
}

fn chat_messages(history: &[Msg]) -> Value {
    Value::Array(
        history
            .iter()
            .map(|m| match m {
                Msg::System(t) => json!({"role": "system", "content": t}),
                Msg::User(t) => json!({"role": "user", "content": t}),
                Msg::Assistant {
                    content,
                    reasoning,
                    call,
                } => {
                    let mut v = json!({"role": "assistant", "content": content});
                    if !reasoning.is_empty() {
                        v["reasoning_content"] = json!(reasoning);
                    }
                    if let Some((id, name, arguments)) = call {
                        v["tool_calls"] = json!([{"id": id, "type": "function",
                            "function": {"name": name, "arguments": arguments}}]);
                    }
                    v
                }
                Msg::Tool { call_id, content } => {
                    json!({"role": "tool", "tool_call_id": call_id, "content": content})
                }
            })
            .collect(),
    )
}

fn responses_input(history: &[Msg]) -> Value {
    let mut items = Vec::new();
    for m in history {
        match m {
            Msg::System(t) => {
                items.push(json!({"type": "message", "role": "system", "content": t}))
            }
            Msg::User(t) => items.push(json!({"type": "message", "role": "user", "content": t})),
            Msg::Assistant {
                content,
                reasoning,
                call,
            } => {
                if !reasoning.is_empty() {
                    items.push(json!({"type": "reasoning", "summary": [],
                        "content": [{"type": "reasoning_text", "text": reasoning}]}));
                }
                items.push(json!({"type": "message", "role": "assistant",
                    "content": [{"type": "output_text", "text": content}]}));
                if let Some((id, name, arguments)) = call {
                    items.push(json!({"type": "function_call", "call_id": id,
                        "name": name, "arguments": arguments}));
                }
            }
            Msg::Tool { call_id, content } => items.push(
                json!({"type": "function_call_output", "call_id": call_id, "output": content}),
            ),
        }
    }
    Value::Array(items)
}

fn request_body(conversation: &Conversation, history: &[Msg]) -> Value {
    let mut body = match conversation.api {
        Api::Chat => json!({
            "model": MODEL,
            "messages": chat_messages(history),
            "max_tokens": conversation.max_tokens,
        }),
        Api::Responses => json!({
            "model": MODEL,
            "input": responses_input(history),
            "max_output_tokens": conversation.max_tokens,
            "store": false,
        }),
    };
    if let Some(tools) = &conversation.tools {
        body["tools"] = match conversation.api {
            Api::Chat => tools.clone(),
            // Responses declares function tools flat.
            Api::Responses => Value::Array(
                tools
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|t| {
                        let mut f = t["function"].clone();
                        f["type"] = json!("function");
                        f
                    })
                    .collect(),
            ),
        };
    }
    if let Some(salt) = &conversation.salt {
        body["cache_salt"] = json!(salt);
    }
    body
}

fn run_conversation(ctx: &Ctx<'_>, conversation: &Conversation) -> Vec<Sample> {
    let mut history = Vec::new();
    if let Some(system) = &conversation.system {
        history.push(Msg::System(system.clone()));
    }
    history.push(Msg::User(conversation.first.clone()));
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

/// Adds what the script says after the last reply.
fn apply(step: &Step, history: &mut Vec<Msg>, last: &Reply, conversation: u32, turn: usize) {
    let reply = |call| Msg::Assistant {
        content: last.content.clone(),
        reasoning: last.reasoning.clone(),
        call,
    };
    match step {
        Step::Tool {
            name,
            arguments,
            result,
        } => {
            let id = format!("call_{conversation}_{turn}");
            history.push(reply(Some((id.clone(), name.clone(), arguments.clone()))));
            history.push(Msg::Tool {
                call_id: id,
                content: result.clone(),
            });
        }
        Step::User(text) => {
            history.push(reply(None));
            history.push(Msg::User(text.clone()));
        }
        Step::Retry(text) => match history.last_mut() {
            Some(Msg::Tool { content, .. } | Msg::User(content)) => content.clone_from(text),
            _ => history.push(Msg::User(text.clone())),
        },
    }
}

fn send(
    ctx: &Ctx<'_>,
    conversation: &Conversation,
    history: &[Msg],
    turn: usize,
    kind: &str,
    prev_replica: &str,
) -> (Sample, Reply) {
    let body = request_body(conversation, history);
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
                Some(mock_vllm::prompt_digest(salt, &ids)),
                None,
            ),
            Err(e) => (0, String::new(), None, Some(format!("oracle: {e}"))),
        };
    let gateway = ctx.workload.gateway(ctx.seed, conversation.id, turn);
    let url = ctx.urls.get(gateway).or(ctx.urls.first());
    let start = ctx.started.elapsed();
    let reply = match url {
        Some(url) => client::stream(&ctx.agent, url, conversation.api, &body),
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
        ttft_ms: millis(reply.ttft.unwrap_or(reply.latency)),
        latency_ms: millis(reply.latency),
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
    let admin = |replica: &(String, String, String), path: &str, body: Value| {
        let url = format!("http://{}{path}", replica.2);
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
/// (empty when none holds any), and the request's prompt token ids.
fn oracle(
    ctx: &Ctx<'_>,
    api: Api,
    body: &Value,
    salt: Option<&str>,
) -> Result<(u64, String, Vec<u32>), String> {
    let (_, http, _) = ctx
        .replicas
        .first()
        .ok_or_else(|| "no replica".to_owned())?;
    let ids = client::tokenize(&ctx.agent, http, api, body)?;
    let mut best = (0u64, String::new());
    for (name, _, admin) in &ctx.replicas {
        let hit = client::probe(&ctx.agent, admin, MODEL, salt, &ids)?;
        if hit > best.0 {
            best = (hit, name.clone());
        }
    }
    Ok((best.0, best.1, ids))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_replaces_the_last_input_and_tool_calls_render() {
        let last = Reply {
            content: "ok".into(),
            reasoning: "think".into(),
            ..Reply::default()
        };
        let mut h = vec![Msg::User("task".into())];
        let tool = Step::Tool {
            name: "search".into(),
            arguments: "{}".into(),
            result: "found".into(),
        };
        apply(&tool, &mut h, &last, 1, 1);
        apply(&Step::Retry("found again".into()), &mut h, &last, 1, 2);
        assert_eq!(h.len(), 3);
        let chat = chat_messages(&h);
        assert_eq!(chat[1]["tool_calls"][0]["id"], "call_1_1");
        assert_eq!(chat[1]["reasoning_content"], "think");
        assert_eq!(chat[2]["content"], "found again");
        let items = responses_input(&h);
        let kinds: Vec<&str> = items
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["type"].as_str().unwrap())
            .collect();
        assert_eq!(
            kinds,
            [
                "message",
                "reasoning",
                "message",
                "function_call",
                "function_call_output"
            ]
        );
    }
}
