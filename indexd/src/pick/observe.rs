//! Observe: the filter reports an answered request; its pick stops standing
//! for queued work, and its response id is recorded for affinity.

use std::time::Instant;

use kvroute_proto::v1::{ObserveRequest, Outcome};

use super::{MAX_REQUEST_ID_BYTES, MAX_RESPONSE_ID_BYTES, bounded, complete_pick};
use crate::error::RequestError;
use crate::ids::EndpointId;
use crate::state::Shared;
use crate::sync::{lock, read};

/// Records which replica served a request (feeds response-id affinity).
///
/// Nothing a caller sends is trusted: the call is refused, and changes
/// nothing, when it is over the rate limit (`RESOURCE_EXHAUSTED`); when an
/// id is too long or its endpoint is not a registered replica serving the
/// Observe's model (`INVALID_ARGUMENT`); or when its response id is recorded
/// already for another replica or model (`ALREADY_EXISTS`). Each refusal is
/// counted in `indexd_observes_total{result}`.
pub fn observe(shared: &Shared, req: &ObserveRequest, now: Instant) -> Result<(), RequestError> {
    let metrics = &shared.metrics;
    if !lock(&shared.observe_bucket).take(now) {
        metrics.observes.inc(["rate_limited"]);
        return Err(RequestError::RateLimited);
    }
    let valid = bounded("request_id", &req.request_id, MAX_REQUEST_ID_BYTES)
        .and_then(|()| bounded("response_id", &req.response_id, MAX_RESPONSE_ID_BYTES))
        .and_then(|()| {
            req.endpoint
                .parse()
                .map_err(|_| RequestError::BadEndpoint(req.endpoint.clone()))
        });
    let address = match valid {
        Ok(a) => a,
        Err(e) => {
            metrics.observes.inc(["invalid"]);
            return Err(e);
        }
    };
    let id = EndpointId {
        address,
        rank: req.data_parallel_rank,
    };
    let Some(replica) = read(&shared.registry).observed(&id) else {
        metrics.observes.inc(["unknown_endpoint"]);
        return Err(RequestError::UnknownEndpoint(id.to_string()));
    };
    if !replica.serves(&req.model) {
        metrics.observes.inc(["model_not_served"]);
        return Err(RequestError::ModelNotServed {
            endpoint: id.to_string(),
            model: req.model.clone(),
        });
    }
    // The request was answered: its pick no longer stands for queued work.
    complete_pick(shared, &req.request_id, now);
    if req.response_id.is_empty() {
        metrics.observes.inc(["no_response_id"]);
        return Ok(());
    }
    let ok = req.outcome == Outcome::Ok as i32 || req.outcome == Outcome::Unspecified as i32;
    if !ok {
        metrics.observes.inc(["failed_request"]);
        return Ok(());
    }
    let mut affinity = lock(&shared.affinity);
    // A response id is recorded once: vLLM never serves one id twice, so
    // another endpoint or model for a known id is a conflict, not news.
    if let Some((held, model)) = affinity.get(&req.response_id, now)
        && (*held != id || model != req.model)
    {
        drop(affinity);
        metrics.observes.inc(["conflict"]);
        return Err(RequestError::ResponseIdTaken);
    }
    let recorded = affinity.insert(&req.response_id, id, &req.model, now);
    drop(affinity);
    metrics
        .observes
        .inc([if recorded { "recorded" } else { "rejected" }]);
    Ok(())
}
