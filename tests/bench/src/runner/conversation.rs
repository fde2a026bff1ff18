//! One conversation driven turn by turn: each request built from the
//! history, held when the profile says so, sent to its gateway and
//! recorded as a [`Sample`] beside what the oracle read before it.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvroute_e2e::stack::OVERRIDE_HEADER;
use serde_json::Value;

use super::fault::inject;
use super::{Ctx, MODEL, Profile, Target};
use crate::client::{self, Reply};
use crate::history::{Msg, apply, request_body};
use crate::sample::{Sample, millis};
use crate::workload::{Api, Conversation, Step};

pub(super) fn run_conversation(ctx: &Ctx<'_>, conversation: &Conversation) -> Vec<Sample> {
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
    // A scripted start (W6-burst): not before its offset into the run.
    let at = ctx.started + Duration::from_millis(u64::from(conversation.start_ms));
    if let Some(wait) = at.checked_duration_since(Instant::now()) {
        std::thread::sleep(wait);
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
