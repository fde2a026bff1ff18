//! The per-request state machine (the failure table of filter/README.md), host-independent.
//!
//! ```text
//! headers ── strip client override/rank/x-kvroute-* headers
//!   │ not a routed POST ───────────────────────────────► pass (no reason)
//!   │ breaker open ────────────────────────────────────► breaker_open
//!   ▼ Pause
//! body (buffer to end) ── over max_body_bytes ─────────► body_too_large
//!   │ parse ── bad JSON / no model ────────────────────► unparseable
//!   │       ── media, embeds ──────────────────────────► incomplete_identity
//!   │ previous_response_id ──────────────┐
//!   │ approximate: text chunks ──────────┤ (none: short_prompt)
//!   ▼ tokenizer callout                  │
//! http answer ── error/non-200/garbage ─────────────────► tokenize_failed
//!   │ block keys (none: short_prompt)    │
//!   ▼ Pick (gRPC) ◄──────────────────────┘ dispatch error ► index_unavailable
//! grpc answer ── status≠0, garbage ─────────────────────► index_unavailable (+breaker)
//!   │ STALE ────────────────────────────────────────────► index_stale
//!   ▼ set override list (+rank), resume ────────────────► precise|affinity|approximate|load
//! ```
//! Every terminal arrow resumes the request; only the last sets headers.
//! On the response, Observe reports the served host (and a Responses id).

use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};

use kvroute_proto::v1::{DecisionKind, Mode as WireMode, PickRequest, PickResponse};
use kvroute_proto::{block_keys, grpc_path};
use prost::Message;

use crate::approximate;
use crate::breaker;
use crate::config::{Config, Mode, Route};
use crate::host::Host;
use crate::metrics::{Counter, Histogram, Reason};
use crate::request::{self, Rejection};
use crate::tokenize;

/// What the filter tells Envoy after a callback.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Let the stream go on.
    Continue,
    /// Hold it (headers/body are buffered until resumed).
    Pause,
}

/// Client headers that could pin a host and are always removed.
const ALWAYS_STRIPPED: &[&str] = &["x-gateway-destination-endpoint", "x-data-parallel-rank"];
const STRIPPED_PREFIX: &str = "x-kvroute-";
/// Upper bound on hosts in the override list.
const MAX_HOSTS: usize = 16;
/// Whether a block-size mismatch was already logged as a warning.
static MISMATCH_WARNED: AtomicBool = AtomicBool::new(false);
/// Largest Pick answer read.
const MAX_PICK_BYTES: usize = 64 * 1024;

/// Where a conclusion is reached: inside a request callback (answer with
/// [`Action::Continue`]) or in a callout answer (resume explicitly).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Via {
    Callback,
    Callout,
}

#[derive(Debug)]
enum Stage {
    Idle,
    Buffering,
    Tokenizing { token: u32, salt: Option<String> },
    Picking { token: u32 },
    Done,
}

/// The filter state of one HTTP stream.
#[derive(Debug)]
pub struct Flow {
    cfg: Rc<Config>,
    stage: Stage,
    response: ResponseStage,
    route: Option<Route>,
    started_us: u64,
    call_started_us: u64,
    request_id: String,
    model: Option<String>,
    reason: Option<Reason>,
    rank: Option<u32>,
}

impl Flow {
    /// A fresh stream under `cfg`.
    pub fn new(cfg: Rc<Config>) -> Self {
        Self {
            cfg,
            stage: Stage::Idle,
            response: ResponseStage::Idle,
            route: None,
            started_us: 0,
            call_started_us: 0,
            request_id: String::new(),
            model: None,
            reason: None,
            rank: None,
        }
    }

    /// The decision, once reached.
    pub fn reason(&self) -> Option<Reason> {
        self.reason
    }

    /// Request headers: strip client pins, then decide whether to buffer.
    pub fn on_request_headers(&mut self, host: &mut dyn Host, end_of_stream: bool) -> Action {
        self.strip_client_headers(host);
        let method = header_string(host.request_header(":method"));
        let path = header_string(host.request_header(":path"));
        let route = match (method.as_deref(), path) {
            (Some("POST"), Some(path)) => self.cfg.route(&path).cloned(),
            _ => None,
        };
        let Some(route) = route else {
            return Action::Continue;
        };
        self.route = Some(route);
        self.started_us = host.now_us();
        self.request_id = header_string(host.request_header("x-request-id")).unwrap_or_default();
        if breaker::is_open(host, self.now_ms(host)) {
            return self.conclude(host, Reason::BreakerOpen, Via::Callback);
        }
        if end_of_stream {
            return self.conclude(host, Reason::Unparseable, Via::Callback);
        }
        // Never start buffering a body announced too large: once buffered
        // past Envoy's limit, Envoy answers 413 whatever the filter does next.
        let declared = header_string(host.request_header("content-length"))
            .and_then(|v| v.trim().parse::<u64>().ok());
        if declared.is_some_and(|n| n > self.cfg.max_body_bytes as u64) {
            return self.conclude(host, Reason::BodyTooLarge, Via::Callback);
        }
        self.stage = Stage::Buffering;
        Action::Pause
    }

    /// Request body: buffer to end of stream, then start the lookup.
    pub fn on_request_body(
        &mut self,
        host: &mut dyn Host,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        if !matches!(self.stage, Stage::Buffering) {
            return Action::Continue;
        }
        if body_size > self.cfg.max_body_bytes {
            return self.conclude(host, Reason::BodyTooLarge, Via::Callback);
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let body = host.request_body(0, body_size).unwrap_or_default();
        self.start(host, &body)
    }

    /// Request trailers end a body without `end_of_stream` on a body chunk.
    pub fn on_request_trailers(&mut self, host: &mut dyn Host) -> Action {
        if matches!(self.stage, Stage::Buffering) {
            return self.conclude(host, Reason::Unparseable, Via::Callback);
        }
        Action::Continue
    }

    fn start(&mut self, host: &mut dyn Host, body: &[u8]) -> Action {
        let Some(route) = self.route.clone() else {
            return self.conclude(host, Reason::Unparseable, Via::Callback);
        };
        let req = match request::parse(route.api, body) {
            Ok(req) => req,
            Err(Rejection::Unparseable(why)) => {
                log::debug!("unparseable body: {why}");
                return self.conclude(host, Reason::Unparseable, Via::Callback);
            }
            Err(Rejection::IncompleteIdentity(why)) => {
                log::debug!("incomplete identity: {why}");
                return self.conclude(host, Reason::IncompleteIdentity, Via::Callback);
            }
        };
        let Some(model) = req
            .model
            .clone()
            .or_else(|| self.cfg.model_fallback.clone())
        else {
            return self.conclude(host, Reason::Unparseable, Via::Callback);
        };
        self.model = Some(model.clone());
        let mode = match self.cfg.mode {
            Mode::Precise => WireMode::Precise,
            Mode::Approximate => WireMode::Approximate,
        };
        let block_size = match self.cfg.mode {
            Mode::Precise => self.cfg.block_size,
            Mode::Approximate => self.cfg.approximate_chunk_bytes,
        };
        let mut pick = PickRequest {
            model: model.clone(),
            block_size: block_size.get(),
            mode: mode.into(),
            request_id: self.request_id.clone(),
            max_candidates: self.cfg.max_candidates,
            ..PickRequest::default()
        };
        if let Some(prev) = req.previous_response_id.clone() {
            pick.previous_response_id = prev;
            return self.pick(host, &pick, Via::Callback);
        }
        if self.cfg.mode == Mode::Approximate {
            let (keys, _) = approximate::text_keys(&req, self.cfg.approximate_chunk_bytes);
            if keys.is_empty() {
                return self.conclude(host, Reason::ShortPrompt, Via::Callback);
            }
            pick.block_keys = keys.iter().map(|k| k.as_u64()).collect();
            return self.pick(host, &pick, Via::Callback);
        }
        if let Some(ids) = &req.prompt_ids {
            return self.pick_tokens(host, pick, ids, req.cache_salt.as_deref(), Via::Callback);
        }
        let tok_body = tokenize::request_body(route.call, &req, &model, body);
        let mut headers = vec![
            (":method", "POST"),
            (":path", route.tokenizer_path.as_str()),
            (":authority", self.cfg.tokenizer_authority.as_str()),
            ("content-type", "application/json"),
        ];
        if !self.request_id.is_empty() {
            headers.push(("x-request-id", self.request_id.as_str()));
        }
        self.call_started_us = host.now_us();
        match host.dispatch_http(
            &self.cfg.tokenizer_cluster,
            &headers,
            &tok_body,
            self.cfg.tokenizer_timeout,
        ) {
            Ok(token) => {
                self.stage = Stage::Tokenizing {
                    token,
                    salt: req.cache_salt,
                };
                Action::Pause
            }
            Err(e) => {
                log::warn!("tokenizer call not dispatched: {}", e.0);
                self.conclude(host, Reason::TokenizeFailed, Via::Callback)
            }
        }
    }

    /// The tokenizer's answer (Envoy's synthetic 504 on timeout included).
    /// A call that failed after it started (reset, stall, broken framing)
    /// arrives with no headers: a failed call, read no further.
    pub fn on_http_call_response(
        &mut self,
        host: &mut dyn Host,
        token: u32,
        num_headers: usize,
        body_size: usize,
    ) {
        let Stage::Tokenizing {
            token: expected,
            salt,
        } = &self.stage
        else {
            return;
        };
        if *expected != token {
            return;
        }
        let salt = salt.clone();
        let elapsed = host.now_us().saturating_sub(self.call_started_us);
        host.record(Histogram::TokenizerCall, elapsed);
        if num_headers == 0 {
            log::debug!("tokenizer call failed (no answer headers)");
            self.conclude(host, Reason::TokenizeFailed, Via::Callout);
            return;
        }
        let status = header_string(host.http_call_response_header(":status"));
        if status.as_deref() != Some("200") {
            log::debug!("tokenizer answered {status:?}");
            self.conclude(host, Reason::TokenizeFailed, Via::Callout);
            return;
        }
        if body_size > self.cfg.max_tokenizer_response_bytes {
            self.conclude(host, Reason::TokenizeFailed, Via::Callout);
            return;
        }
        let body = host
            .http_call_response_body(0, body_size)
            .unwrap_or_default();
        let ids = match tokenize::parse_token_ids(&body) {
            Ok(ids) => ids,
            Err(e) => {
                log::debug!("tokenizer answer unusable: {}", e.0);
                self.conclude(host, Reason::TokenizeFailed, Via::Callout);
                return;
            }
        };
        let Some(model) = self.model.clone() else {
            self.conclude(host, Reason::Unparseable, Via::Callout);
            return;
        };
        let mode: i32 = WireMode::Precise.into();
        let pick = PickRequest {
            model,
            block_size: self.cfg.block_size.get(),
            mode,
            request_id: self.request_id.clone(),
            max_candidates: self.cfg.max_candidates,
            ..PickRequest::default()
        };
        self.pick_tokens(host, pick, &ids, salt.as_deref(), Via::Callout);
    }

    fn pick_tokens(
        &mut self,
        host: &mut dyn Host,
        mut pick: PickRequest,
        ids: &[u32],
        salt: Option<&str>,
        via: Via,
    ) -> Action {
        let keys = block_keys(ids, self.cfg.block_size, salt);
        if keys.is_empty() {
            return self.conclude(host, Reason::ShortPrompt, via);
        }
        pick.block_keys = keys.iter().map(|k| k.as_u64()).collect();
        pick.prompt_tokens = u32::try_from(ids.len()).unwrap_or(u32::MAX);
        self.pick(host, &pick, via)
    }

    fn pick(&mut self, host: &mut dyn Host, pick: &PickRequest, via: Via) -> Action {
        self.call_started_us = host.now_us();
        match host.dispatch_grpc(
            &self.cfg.index_cluster,
            grpc_path::SERVICE,
            grpc_path::PICK,
            &pick.encode_to_vec(),
            self.cfg.index_timeout,
        ) {
            Ok(token) => {
                self.stage = Stage::Picking { token };
                Action::Pause
            }
            Err(e) => {
                log::warn!("Pick not dispatched: {}", e.0);
                self.index_failed(host, via)
            }
        }
    }

    /// A gRPC answer: the Pick, or the Observe a response is held for.
    pub fn on_grpc_call_response(
        &mut self,
        host: &mut dyn Host,
        token: u32,
        status_code: u32,
        size: usize,
    ) {
        if let ResponseStage::Holding { token: held } = self.response
            && held == token
        {
            if status_code != 0 {
                host.count(Counter::ObserveFailed);
            }
            self.response = ResponseStage::Done;
            host.resume_response();
            return;
        }
        match self.stage {
            Stage::Picking { token: expected } if expected == token => {}
            _ => return,
        }
        let elapsed = host.now_us().saturating_sub(self.call_started_us);
        host.record(Histogram::IndexCall, elapsed);
        if status_code != 0 {
            log::debug!("Pick failed with gRPC status {status_code}");
            self.index_failed(host, Via::Callout);
            return;
        }
        let body = if size == 0 || size > MAX_PICK_BYTES {
            Vec::new()
        } else {
            host.grpc_call_response_body(0, size).unwrap_or_default()
        };
        let answer = match PickResponse::decode(body.as_slice()) {
            Ok(a) => a,
            Err(e) => {
                log::debug!("undecodable Pick answer: {e}");
                self.index_failed(host, Via::Callout);
                return;
            }
        };
        self.apply(host, &answer);
    }

    fn apply(&mut self, host: &mut dyn Host, answer: &PickResponse) {
        if answer.block_size_mismatch {
            host.count(Counter::BlockSizeMismatch);
            // Loud once per VM; the counter keeps counting.
            let level = if MISMATCH_WARNED.swap(true, Ordering::Relaxed) {
                log::Level::Debug
            } else {
                log::Level::Warn
            };
            log::log!(
                level,
                "block_size {} differs from indexd's {}",
                self.cfg.block_size.get(),
                answer.index_block_size
            );
        }
        let reason = match DecisionKind::try_from(answer.decision) {
            Ok(DecisionKind::Precise) => Reason::Precise,
            Ok(DecisionKind::Affinity) => Reason::Affinity,
            Ok(DecisionKind::Approximate) => Reason::Approximate,
            Ok(DecisionKind::Load) => Reason::Load,
            Ok(DecisionKind::Stale) => {
                let now = self.now_ms(host);
                breaker::record_success(host, now);
                self.conclude(host, Reason::IndexStale, Via::Callout);
                return;
            }
            Ok(DecisionKind::Unspecified) | Err(_) => {
                self.index_failed(host, Via::Callout);
                return;
            }
        };
        let hosts: Vec<&str> = answer
            .candidates
            .iter()
            .take(MAX_HOSTS)
            .map(|c| c.address.as_str())
            .collect();
        if hosts.is_empty() || !hosts.iter().all(|h| valid_address(h)) {
            log::debug!("Pick answer without usable candidates");
            self.index_failed(host, Via::Callout);
            return;
        }
        let now = self.now_ms(host);
        breaker::record_success(host, now);
        let list = hosts.join(",");
        host.set_request_header(&self.cfg.override_header, Some(&list));
        self.rank = answer.candidates.first().and_then(|c| c.data_parallel_rank);
        if let Some(rank) = self.rank {
            host.set_request_header(&self.cfg.rank_header, Some(&rank.to_string()));
        }
        log::debug!("{} -> {list} ({})", self.request_id, reason.label());
        self.conclude(host, reason, Via::Callout);
    }

    fn index_failed(&mut self, host: &mut dyn Host, via: Via) -> Action {
        let now = self.now_ms(host);
        if breaker::record_failure(host, &self.cfg.breaker, now) {
            host.count(Counter::BreakerOpened);
            log::warn!(
                "indexd failing, breaker open for {} ms",
                self.cfg.breaker.cooldown_ms
            );
        }
        self.conclude(host, Reason::IndexUnavailable, via)
    }

    fn conclude(&mut self, host: &mut dyn Host, reason: Reason, via: Via) -> Action {
        self.stage = Stage::Done;
        self.reason = Some(reason);
        host.count(Counter::Decision(reason));
        let elapsed = host.now_us().saturating_sub(self.started_us);
        host.record(Histogram::FilterTime, elapsed);
        if via == Via::Callout {
            host.resume_request();
        }
        Action::Continue
    }

    fn strip_client_headers(&self, host: &mut dyn Host) {
        for name in host.request_header_names() {
            let strip = name.eq_ignore_ascii_case(&self.cfg.override_header)
                || name.eq_ignore_ascii_case(&self.cfg.rank_header)
                || ALWAYS_STRIPPED.iter().any(|h| name.eq_ignore_ascii_case(h))
                || name
                    .get(..STRIPPED_PREFIX.len())
                    .is_some_and(|p| p.eq_ignore_ascii_case(STRIPPED_PREFIX));
            if strip {
                host.set_request_header(&name, None);
            }
        }
    }

    fn now_ms(&self, host: &dyn Host) -> u64 {
        host.now_us() / 1000
    }
}

fn header_string(value: Option<Vec<u8>>) -> Option<String> {
    value.and_then(|v| String::from_utf8(v).ok())
}

/// `ip:port` or `[v6]:port` (or a host name): safe as a header list member.
fn valid_address(addr: &str) -> bool {
    !addr.is_empty()
        && addr.len() <= 255
        && addr.contains(':')
        && addr.bytes().all(|b| {
            b.is_ascii_alphanumeric() || matches!(b, b'.' | b':' | b'[' | b']' | b'-' | b'_' | b'%')
        })
}

mod response;

use response::ResponseStage;

#[cfg(test)]
pub(crate) mod tests;
