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
//! | `GET /admin/state` | — | seq, blocks, controls (top level: the first rank; `ranks`: all) |
//!
//! Every POST takes an optional data-parallel `rank`, as a query parameter (`?rank=1`) or a JSON
//! field (`{"rank": 1}`; both must agree). Faults without it apply to every rank (a restart of all
//! ranks also forgets stored responses; of one rank, only its cache and event seq); the probe
//! without it asks the first rank (rank 0).

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{RawQuery, State};
use axum::routing::{get, post};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use crate::engine::{Job, Replica};
use crate::error::{ApiError, validate_cache_salt};
use crate::publisher::Publisher;
use crate::rank::Engine;

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

/// A body that may be absent: empty or `null` is `T::default()`, otherwise a JSON object.
fn optional_body<T: DeserializeOwned + Default>(body: &[u8]) -> Result<T, ApiError> {
    if body.trim_ascii().is_empty() {
        return Ok(T::default());
    }
    let invalid =
        |e: serde_json::Error| ApiError::bad_request(format!("Invalid request body: {e}"));
    match serde_json::from_slice::<Value>(body).map_err(invalid)? {
        Value::Null => Ok(T::default()),
        v => serde_json::from_value(v).map_err(invalid),
    }
}

/// `rank` from the query string and the body (they must agree).
fn rank_param(query: Option<&str>, body: Option<u32>) -> Result<Option<u32>, ApiError> {
    let mut from_query = None;
    for pair in query.unwrap_or_default().split('&') {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        if key == "rank" {
            let rank = value.parse::<u32>().map_err(|_| {
                ApiError::bad_request(format!(
                    "Invalid query parameter rank=`{value}`: expected a data-parallel rank"
                ))
                .with_param("rank")
            })?;
            from_query = Some(rank);
        }
    }
    match (from_query, body) {
        (Some(q), Some(b)) if q != b => Err(ApiError::bad_request(format!(
            "rank {q} in the query and {b} in the body disagree"
        ))
        .with_param("rank")),
        (q, b) => Ok(q.or(b)),
    }
}

/// The engines a fault applies to: the named rank, or all of them.
fn targets(r: &Replica, rank: Option<u32>) -> Result<Vec<&Arc<Engine>>, ApiError> {
    match rank {
        Some(rank) => Ok(vec![r.engine_by_rank(rank)?]),
        None => Ok(r.engines().iter().collect()),
    }
}

fn publishers<'a>(engines: &[&'a Arc<Engine>]) -> Result<Vec<&'a Publisher>, ApiError> {
    engines
        .iter()
        .map(|e| {
            e.publisher
                .as_ref()
                .ok_or_else(|| ApiError::bad_request("KV events are disabled on this replica"))
        })
        .collect()
}

fn events_json(p: &Publisher) -> Value {
    json!({
        "endpoint": p.endpoint(),
        "replay_endpoint": p.replay_endpoint(),
        "next_seq": p.next_seq(),
        "paused": p.controls().paused(),
        "delay_ms": p.controls().delay().as_millis() as u64,
        "pending_drops": p.controls().pending_drops(),
    })
}

fn rank_json(e: &Engine) -> Value {
    use std::sync::atomic::Ordering::Relaxed;
    json!({
        "rank": e.rank,
        "cached_blocks": e.cached_blocks(),
        "waiting": e.metrics.waiting.load(Relaxed),
        "running": e.metrics.running.load(Relaxed),
        "events": e.publisher.as_ref().map(events_json),
    })
}

fn state_json(replica: &Replica) -> Json<Value> {
    let first = replica.engines().first();
    Json(json!({
        "name": replica.name,
        "data_parallel_size": replica.engines().len(),
        "cached_blocks": first.map(|e| e.cached_blocks()),
        "capacity_blocks": replica.config.num_gpu_blocks,
        "stored_responses": replica.stored_responses(),
        "events": first.and_then(|e| e.publisher.as_ref()).map(events_json),
        "ranks": replica.engines().iter().map(|e| rank_json(e)).collect::<Vec<_>>(),
    }))
}

/// A body whose only field is the optional rank.
#[derive(Debug, Default, Deserialize)]
struct RankBody {
    rank: Option<u32>,
}

/// The rank of a route whose body is only `{"rank"?}`.
fn bare_rank(query: Option<&str>, body: &[u8]) -> Result<Option<u32>, ApiError> {
    let body: RankBody = optional_body(body)?;
    rank_param(query, body.rank)
}

async fn restart(
    State(r): State<Arc<Replica>>,
    RawQuery(q): RawQuery,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    match bare_rank(q.as_deref(), &body)? {
        Some(rank) => r.engine_by_rank(rank)?.restart(),
        None => r.restart(),
    }
    Ok(state_json(&r))
}

fn set_paused(r: &Replica, q: Option<&str>, body: &[u8], paused: bool) -> Result<(), ApiError> {
    let engines = targets(r, bare_rank(q, body)?)?;
    for p in publishers(&engines)? {
        p.controls().set_paused(paused);
    }
    Ok(())
}

async fn pause(
    State(r): State<Arc<Replica>>,
    RawQuery(q): RawQuery,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    set_paused(&r, q.as_deref(), &body, true)?;
    Ok(state_json(&r))
}

async fn resume(
    State(r): State<Arc<Replica>>,
    RawQuery(q): RawQuery,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    set_paused(&r, q.as_deref(), &body, false)?;
    Ok(state_json(&r))
}

#[derive(Debug, Deserialize)]
struct DelayBody {
    ms: u64,
    rank: Option<u32>,
}

async fn delay(
    State(r): State<Arc<Replica>>,
    RawQuery(q): RawQuery,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let body: DelayBody = crate::error::parse_json(&body)?;
    let engines = targets(&r, rank_param(q.as_deref(), body.rank)?)?;
    for p in publishers(&engines)? {
        p.controls().set_delay(Duration::from_millis(body.ms));
    }
    Ok(state_json(&r))
}

#[derive(Debug, Deserialize)]
struct DropBody {
    batches: u64,
    rank: Option<u32>,
}

async fn drop_batches(
    State(r): State<Arc<Replica>>,
    RawQuery(q): RawQuery,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let body: DropBody = crate::error::parse_json(&body)?;
    let engines = targets(&r, rank_param(q.as_deref(), body.rank)?)?;
    for p in publishers(&engines)? {
        p.controls().drop_next(body.batches);
    }
    Ok(state_json(&r))
}

async fn reset(
    State(r): State<Arc<Replica>>,
    RawQuery(q): RawQuery,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    for e in targets(&r, bare_rank(q.as_deref(), &body)?)? {
        e.reset_prefix_cache();
    }
    Ok(state_json(&r))
}

#[derive(Debug, Deserialize)]
struct ProbeBody {
    model: Option<String>,
    cache_salt: Option<String>,
    token_ids: Vec<u32>,
    rank: Option<u32>,
}

async fn probe(
    State(r): State<Arc<Replica>>,
    RawQuery(q): RawQuery,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let body: ProbeBody = crate::error::parse_json(&body)?;
    validate_cache_salt(body.cache_salt.as_deref())?;
    let engine = match rank_param(q.as_deref(), body.rank)? {
        Some(rank) => r.engine_by_rank(rank)?,
        None => r.first_engine()?,
    };
    let job = Job {
        model: r.resolve_model(body.model.as_deref())?,
        prompt: body.token_ids,
        cache_salt: body.cache_salt,
    };
    let (held, hit) = engine.probe(&job);
    Ok(Json(json!({
        "rank": engine.rank,
        "prompt_tokens": job.prompt.len(),
        "cached_tokens": held,
        "hit_tokens": hit,
    })))
}

async fn state(State(r): State<Arc<Replica>>) -> Json<Value> {
    state_json(&r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_from_query_or_body() {
        assert_eq!(rank_param(None, None).unwrap(), None);
        assert_eq!(rank_param(Some("rank=1"), None).unwrap(), Some(1));
        assert_eq!(rank_param(Some("x=2&rank=1"), Some(1)).unwrap(), Some(1));
        assert_eq!(rank_param(Some(""), Some(3)).unwrap(), Some(3));
        assert!(rank_param(Some("rank=1"), Some(2)).is_err());
        assert!(rank_param(Some("rank=-1"), None).is_err());
        assert!(rank_param(Some("rank="), None).is_err());
    }

    #[test]
    fn bodies_may_be_absent() {
        assert_eq!(bare_rank(None, b"").unwrap(), None);
        assert_eq!(bare_rank(None, b"null").unwrap(), None);
        assert_eq!(bare_rank(None, b"{}").unwrap(), None);
        assert_eq!(bare_rank(None, br#"{"rank": 1}"#).unwrap(), Some(1));
        assert!(bare_rank(None, b"{").is_err());
        assert!(bare_rank(None, br#"{"rank": "x"}"#).is_err());
    }
}
