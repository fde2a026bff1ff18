//! vLLM-compatible `POST /tokenize`, `POST /v1/responses/render` and
//! `POST /v1/messages/count_tokens` (Anthropic's, with its error shape) on
//! indexd's HTTP port: answered locally for a model whose gate is open,
//! else passed to a healthy replica serving the model and its answer
//! returned as it came. The `x-kvroute-tokenizer` response header says which
//! (`local` or `replica`). Errors are vLLM's error objects: 400 for a body
//! vLLM would refuse, 404 for a model nobody serves, 413 for a body over
//! `max_body_bytes`, 503 when no tokenizer can answer, and 503 with
//! `Retry-After` for a body over the admission budget ([`crate::tokenize::admission`]).
//! A request carrying [`replica::HOP_HEADER`] (an indexd forwarded it) is
//! refused with 508: it is never forwarded again. A closed connection
//! cancels its body's work.

use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::Request;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::HeaderMap;
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use kvroute_tokenizer::{MessagesRequest, ResponsesRequest, TokenizeRequest};

use crate::state::Shared;
use crate::sync::read;
use crate::tokenize::admission::{Refusal, Via};
use crate::tokenize::{Api, GateState, Limits, LocalModel, Source, Tokenizers, replica};

/// The routes, with the body limit of the configuration. A request whose
/// `Content-Length` is over the limit is refused from its head, before any of
/// the body is read; a chunked one is cut off once it passes the limit.
pub fn routes(shared: &Shared) -> Router<Arc<Shared>> {
    let limit = shared.tokenizers.config().max_body_bytes;
    Router::new()
        .route("/tokenize", post(tokenize))
        .route("/v1/responses/render", post(render))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .layer(DefaultBodyLimit::max(limit))
        .layer(axum::middleware::from_fn(
            move |request: Request, next: Next| async move {
                match declared_length(&request) {
                    Some(n) if n > limit as u64 => error(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        &format!("request body of {n} bytes is over the limit of {limit}"),
                        None,
                    ),
                    _ => next.run(request).await,
                }
            },
        ))
}

/// The body length a request's head declares, if it declares a valid one.
fn declared_length(request: &Request) -> Option<u64> {
    request
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

/// A vLLM error object.
pub fn error(status: StatusCode, message: &str, param: Option<&str>) -> Response {
    let kind = match status.as_u16() {
        404 => "NotFoundError",
        413 => "RequestEntityTooLarge",
        503 => "ServiceUnavailableError",
        400..=499 => "BadRequestError",
        _ => "InternalServerError",
    };
    let body = serde_json::json!({
        "error": {"message": message, "type": kind, "param": param, "code": status.as_u16()}
    });
    (
        status,
        [("content-type", "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn with_source(mut response: Response, source: Source) -> Response {
    response.headers_mut().insert(
        "x-kvroute-tokenizer",
        HeaderValue::from_static(source.label()),
    );
    response
}

/// The model a body names, or the only one indexd knows.
fn model_of(shared: &Shared, body: &[u8]) -> Result<String, Box<Response>> {
    #[derive(serde::Deserialize)]
    struct Model {
        model: Option<String>,
    }
    let named = serde_json::from_slice::<Model>(body)
        .map_err(|e| {
            Box::new(error(
                StatusCode::BAD_REQUEST,
                &format!("invalid JSON body: {e}"),
                None,
            ))
        })?
        .model;
    if let Some(m) = named {
        return Ok(m);
    }
    let mut known: Vec<String> = shared.tokenizers.locals().map(|(m, _)| m.clone()).collect();
    for r in read(&shared.registry).all() {
        known.push(r.config.model.clone());
    }
    known.sort();
    known.dedup();
    match known.as_slice() {
        [only] => Ok(only.clone()),
        _ => Err(Box::new(error(
            StatusCode::BAD_REQUEST,
            "`model` is required: indexd serves several models",
            Some("model"),
        ))),
    }
}

async fn tokenize(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    #[derive(serde::Deserialize)]
    struct Shape {
        messages: Option<serde::de::IgnoredAny>,
    }
    let is_chat = serde_json::from_slice::<Shape>(&body).is_ok_and(|s| s.messages.is_some());
    let api = if is_chat { Api::Chat } else { Api::Completions };
    admitted(&shared, Via::Tokenize, &headers, api, body).await
}

async fn render(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    admitted(&shared, Via::Render, &headers, Api::Responses, body).await
}

/// Anthropic's `count_tokens`: `{"input_tokens": n, …}`, errors in
/// Anthropic's shape as vLLM answers them.
async fn count_tokens(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let response = admitted(&shared, Via::Tokenize, &headers, Api::Messages, body).await;
    anthropic_error(response).await
}

/// An error answer of indexd's own (vLLM's OpenAI error object) in the shape
/// vLLM's Anthropic routes answer: `{"type": "error", "error": {"type",
/// "message"}}`. A replica's answer, already in that shape, and a success
/// pass as they are.
async fn anthropic_error(response: Response) -> Response {
    if response.status().is_success() {
        return response;
    }
    let (parts, body) = response.into_parts();
    let bytes = axum::body::to_bytes(body, 1 << 20)
        .await
        .unwrap_or_default();
    let error = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|v| v.get("error").cloned())
        .filter(|e| e.get("code").is_some());
    let Some(error) = error else {
        return Response::from_parts(parts, axum::body::Body::from(bytes));
    };
    let body = serde_json::json!({
        "type": "error",
        "error": {"type": error.get("type"), "message": error.get("message")},
    });
    Response::from_parts(parts, axum::body::Body::from(body.to_string()))
}

/// Refuses a forwarded body and a body over the budget; serves the rest,
/// telling its work to stop if the connection closes first.
async fn admitted(
    shared: &Arc<Shared>,
    via: Via,
    headers: &HeaderMap,
    api: Api,
    body: Bytes,
) -> Response {
    let admission = &shared.tokenizers.admission;
    if headers.contains_key(replica::HOP_HEADER) {
        admission.count_refused(via, "loop");
        return error(
            StatusCode::LOOP_DETECTED,
            "this request was forwarded by an indexd already: indexd does not forward it again (is an endpoint's address indexd's own?)",
            None,
        );
    }
    let (ticket, caller) = match admission.try_admit(via, body.len()) {
        Ok(admitted) => admitted,
        Err(refusal) => return busy(refusal, admission.config().retry_after),
    };
    let response = serve(shared, api, body, ticket).await;
    caller.finish();
    response
}

/// 503 with `Retry-After` (whole seconds, at least 1).
fn busy(refusal: Refusal, retry_after: std::time::Duration) -> Response {
    let mut response = error(StatusCode::SERVICE_UNAVAILABLE, &refusal.to_string(), None);
    let secs = retry_after.as_secs().max(1);
    if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
        response
            .headers_mut()
            .insert(axum::http::header::RETRY_AFTER, v);
    }
    response
}

async fn serve(
    shared: &Arc<Shared>,
    api: Api,
    body: Bytes,
    ticket: crate::tokenize::admission::Ticket,
) -> Response {
    let model = match model_of(shared, &body) {
        Ok(m) => m,
        Err(response) => return *response,
    };
    let open = shared
        .tokenizers
        .local(&model)
        .filter(|local| local.gate.state() == GateState::Open);
    // The budget's share stays held while a replica answers, unless the
    // local attempt took it (it returns when that work stops).
    let ticket = match open {
        Some(local) => {
            if let Some(answer) = serve_locally(&shared.tokenizers, local, api, &body, ticket).await
            {
                return answer;
            }
            None
        }
        None => Some(ticket),
    };
    let answer = by_replica(shared, api, &model, &body).await;
    drop(ticket);
    answer
}

/// The local tokenizer's answer; None where a replica should answer
/// instead (not reproduced locally, over the local caps or time budget, or
/// the task failed).
async fn serve_locally(
    tokenizers: &Tokenizers,
    local: &LocalModel,
    api: Api,
    body: &Bytes,
    ticket: crate::tokenize::admission::Ticket,
) -> Option<Response> {
    let tokenizer = local.tokenizer.clone();
    let input = body.clone();
    let limits = Limits {
        cancel: ticket.cancel().clone(),
        deadline: std::time::Instant::now().checked_add(tokenizers.config().time_budget),
        max_tokens: None,
    };
    // The budget's share goes with the work: a closed connection sets
    // the cancel flag, and the share returns when the work stops. The
    // body is parsed once, no further than the text cap; an invalid
    // salt only costs the cache its namespace (vLLM's `/tokenize` and
    // render do not check it).
    let answer = tokenizers
        .off_worker(body.len(), move || {
            let _ticket = ticket;
            let caps = tokenizer.caps();
            let namespaced = |salt: Result<Option<String>, _>| {
                let salt = salt.ok().flatten();
                limits.budget(&tokenizer, salt.as_deref())
            };
            match api {
                Api::Responses => ResponsesRequest::from_json_within(&input, &caps)
                    .and_then(|r| tokenizer.render_responses_with(&r, &namespaced(r.cache_salt())))
                    .map(|r| serde_json::to_vec(&r)),
                Api::Chat | Api::Completions => TokenizeRequest::from_json_within(&input, &caps)
                    .and_then(|r| tokenizer.tokenize_with(&r, &namespaced(r.cache_salt())))
                    .map(|r| serde_json::to_vec(&r)),
                Api::Messages => MessagesRequest::from_json_within(&input, &caps)
                    .map(MessagesRequest::for_count_tokens)
                    .and_then(|r| tokenizer.tokenize_messages_with(&r, &namespaced(r.cache_salt())))
                    .map(|t| {
                        let n = t.ids.len();
                        serde_json::to_vec(&serde_json::json!({
                            "input_tokens": n,
                            "context_management": {"original_input_tokens": n},
                        }))
                    }),
            }
        })
        .await;
    match answer {
        Ok(Ok(Ok(json))) => {
            tokenizers.metrics.requests.inc(["local", "ok"]);
            Some(with_source(
                (StatusCode::OK, [("content-type", "application/json")], json).into_response(),
                Source::Local,
            ))
        }
        Ok(Err(e)) if e.is_client_error() => {
            tokenizers.metrics.requests.inc(["local", "refused"]);
            Some(with_source(
                error(StatusCode::BAD_REQUEST, &e.to_string(), e.param()),
                Source::Local,
            ))
        }
        _ => None,
    }
}

/// A healthy replica's answer, passed on as it came.
async fn by_replica(shared: &Shared, api: Api, model: &str, body: &Bytes) -> Response {
    let tokenizers = &shared.tokenizers;
    let Some(target) = tokenizers.replica_for(shared, model) else {
        let known = read(&shared.registry).all().iter().any(|r| r.serves(model))
            || tokenizers.local(model).is_some();
        return if known {
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                &format!("no healthy replica of {model} can tokenize right now"),
                None,
            )
        } else {
            error(
                StatusCode::NOT_FOUND,
                &format!("The model `{model}` does not exist."),
                Some("model"),
            )
        };
    };
    let path = match api {
        Api::Responses => "/v1/responses/render",
        Api::Chat | Api::Completions => "/tokenize",
        Api::Messages => "/v1/messages/count_tokens",
    };
    let timeout = tokenizers.config().replica_timeout;
    match replica::call(tokenizers.client(), target, path, body.to_vec(), timeout).await {
        Ok((status, answer)) => {
            let result = if status == 200 { "ok" } else { "refused" };
            tokenizers.metrics.requests.inc(["replica", result]);
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
            with_source(
                (status, [("content-type", "application/json")], answer).into_response(),
                Source::Replica,
            )
        }
        Err(e) => {
            tokenizers.metrics.requests.inc(["replica", "unavailable"]);
            error(StatusCode::SERVICE_UNAVAILABLE, &e.to_string(), None)
        }
    }
}
