//! Fault controls and the oracle probe, on a separate loopback port.
//!
//! | route | body | effect |
//! |---|---|---|
//! | `POST /admin/restart` | — | empty cache, event seq back to 0, responses forgotten |
//! | `POST /admin/events/pause` / `resume` | — | hold / release event batches |
//! | `POST /admin/events/delay` | `{"ms": N}` | publish every batch N ms after it was produced |
//! | `POST /admin/events/drop` | `{"batches": N}` | the next N batches are numbered but not sent live |
//! | `POST /admin/reset_prefix_cache` | — | empty cache, `AllBlocksCleared` |
//! | `POST /admin/probe` | `{"token_ids", "model"?, "cache_salt"?}` | prefix tokens held now |
//! | `GET /admin/state` | — | seq, blocks, controls |

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::engine::{Job, Replica};
use crate::error::{ApiError, parse_json, validate_cache_salt};
use crate::publisher::Publisher;

/// The admin router.
pub fn router(replica: Arc<Replica>) -> Router {
    Router::new()
        .route("/admin/restart", post(restart))
        .route("/admin/events/pause", post(pause))
        .route("/admin/events/resume", post(resume))
        .route("/admin/events/delay", post(delay))
        .route("/admin/events/drop", post(drop_batches))
        .route("/admin/reset_prefix_cache", post(reset))
        .route("/admin/probe", post(probe))
        .route("/admin/state", get(state))
        .with_state(replica)
}

fn publisher(replica: &Replica) -> Result<&Publisher, ApiError> {
    replica
        .publisher
        .as_ref()
        .ok_or_else(|| ApiError::bad_request("KV events are disabled on this replica"))
}

fn state_json(replica: &Replica) -> Json<Value> {
    let events = replica.publisher.as_ref().map(|p| {
        json!({
            "endpoint": p.endpoint(),
            "replay_endpoint": p.replay_endpoint(),
            "next_seq": p.next_seq(),
            "paused": p.controls().paused(),
            "delay_ms": p.controls().delay().as_millis() as u64,
            "pending_drops": p.controls().pending_drops(),
        })
    });
    Json(json!({
        "name": replica.name,
        "cached_blocks": replica.cached_blocks(),
        "capacity_blocks": replica.config.num_gpu_blocks,
        "stored_responses": replica.stored_responses(),
        "events": events,
    }))
}

async fn restart(State(r): State<Arc<Replica>>) -> Json<Value> {
    r.restart();
    state_json(&r)
}

async fn pause(State(r): State<Arc<Replica>>) -> Result<Json<Value>, ApiError> {
    publisher(&r)?.controls().set_paused(true);
    Ok(state_json(&r))
}

async fn resume(State(r): State<Arc<Replica>>) -> Result<Json<Value>, ApiError> {
    publisher(&r)?.controls().set_paused(false);
    Ok(state_json(&r))
}

#[derive(Debug, Deserialize)]
struct DelayBody {
    ms: u64,
}

async fn delay(State(r): State<Arc<Replica>>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let body: DelayBody = parse_json(&body)?;
    publisher(&r)?
        .controls()
        .set_delay(Duration::from_millis(body.ms));
    Ok(state_json(&r))
}

#[derive(Debug, Deserialize)]
struct DropBody {
    batches: u64,
}

async fn drop_batches(State(r): State<Arc<Replica>>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let body: DropBody = parse_json(&body)?;
    publisher(&r)?.controls().drop_next(body.batches);
    Ok(state_json(&r))
}

async fn reset(State(r): State<Arc<Replica>>) -> Json<Value> {
    r.reset_prefix_cache();
    state_json(&r)
}

#[derive(Debug, Deserialize)]
struct ProbeBody {
    model: Option<String>,
    cache_salt: Option<String>,
    token_ids: Vec<u32>,
}

async fn probe(State(r): State<Arc<Replica>>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let body: ProbeBody = parse_json(&body)?;
    validate_cache_salt(body.cache_salt.as_deref())?;
    let job = Job {
        model: r.resolve_model(body.model.as_deref())?,
        prompt: body.token_ids,
        cache_salt: body.cache_salt,
    };
    let (held, hit) = r.probe(&job);
    Ok(Json(json!({
        "prompt_tokens": job.prompt.len(),
        "cached_tokens": held,
        "hit_tokens": hit,
    })))
}

async fn state(State(r): State<Arc<Replica>>) -> Json<Value> {
    state_json(&r)
}
