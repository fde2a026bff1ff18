//! Faults injected mid-run (W5): replica restarts, lagging or lost KV
//! events on the mock's admin API, and an indexd restart.

use std::time::Duration;

use serde_json::{Value, json};

use super::{Ctx, ReplicaRef};
use crate::client;
use crate::workload::{Fault, FaultKind};

/// Injects `fault` (on the sending client's thread: its own conversation
/// waits, the others go on). Requests sent from now on belong to its phase,
/// including those sent while it is under way (an indexd outage).
/// Failures are collected and fail the run.
pub(super) fn inject(ctx: &Ctx<'_>, fault: &Fault) {
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
