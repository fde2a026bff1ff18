//! The per-request state machine (the failure table of filter/README.md), host-independent.
//!
//! ```text
//! headers ── strip client override/rank/x-kvroute-* headers
//!   │ not a routed POST ───────────────────────────────► pass (no reason)
//!   │ index breaker open ──────────────────────────────► breaker_open
//!   ▼ Pause
//! body (buffer to end) ── over max_body_bytes ─────────► body_too_large
//!   │ parse ── bad JSON / no model ────────────────────► unparseable
//!   │       ── media, embeds ──────────────────────────► incomplete_identity
//!   │ previous_response_id ──────────────┐
//!   │ approximate: text chunks ──────────┤ (none: short_prompt)
//!   │ token-id prompt ───────────────────┤
//!   │ tokenizer breaker open ─────────────────────────► tokenizer_breaker_open
//!   ▼ tokenizer callout                  │
//! http answer ── no headers/5xx/garbage ───────────────► tokenize_failed (+breaker)
//!             ── 4xx (the request's fault) ────────────► tokenize_failed
//!   │ block keys, capped (none: short_prompt)
//!   ▼ Pick (gRPC) ◄──────────────────────┘ dispatch error ► index_unavailable (+breaker)
//!   │                    refused at once (cluster overflow) ► index_busy
//! grpc answer ── InvalidArgument/OutOfRange ───────────► index_rejected
//!             ── other status≠0, garbage ──────────────► index_unavailable (+breaker)
//!   │ STALE ────────────────────────────────────────────► index_stale
//!   ▼ set override list (+rank), resume ────────────────► precise|affinity|approximate|load
//! ```
//! Every terminal arrow resumes the request; only the last sets headers.
//! The state ([`Stage`]) holds what each step knows and nothing more: a
//! parsed request's route and model are set once, when the body parses.
//! The response side (`response`) completes the pick and observes
//! Responses ids.

use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};

use kvroute_proto::v1::{
    Api as WireApi, DecisionKind, Mode as WireMode, PickRequest, PickResponse,
};
use kvroute_proto::{SCHEME_VERSION, block_keys, grpc_path};
use prost::Message;

use crate::approximate;
use crate::breaker::{self, Breaker};
use crate::busy;
use crate::completed;
use crate::config::{Api, Config, Mode, Route, TokenizeAt};
use crate::host::Host;
use crate::memo;
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
/// Whether a key-scheme mismatch was already logged as a warning.
static SCHEME_WARNED: AtomicBool = AtomicBool::new(false);
/// Whether a Pick refused by Envoy at once was logged at warn level.
static BUSY_WARNED: AtomicBool = AtomicBool::new(false);

/// A warning's level: loud the first time per VM (`warned` still clear),
/// debug after; the counters keep counting.
fn loud_once(warned: &AtomicBool) -> log::Level {
    if warned.swap(true, Ordering::Relaxed) {
        log::Level::Debug
    } else {
        log::Level::Warn
    }
}
/// Bytes of request JSON per token, for a continuation's estimate of what
/// it adds (indexd weighs it as prefill work).
const BYTES_PER_TOKEN: usize = 4;
/// Largest Pick answer read.
const MAX_PICK_BYTES: usize = 64 * 1024;
/// The longest client `x-request-id` passed on (to the tokenizer, in logs).
pub const MAX_CLIENT_ID_BYTES: usize = 128;
/// The filter's own id of stream `context_id` in a VM whose random value
/// is `nonce`: ids differ across workers and gateways, and clients can
/// neither choose nor guess them.
pub fn request_id(nonce: u64, context_id: u32) -> String {
    format!("{nonce:016x}-{context_id:x}")
}

/// Where a conclusion is reached: inside a request callback (answer with
/// [`Action::Continue`]) or in a callout answer (resume explicitly).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Via {
    Callback,
    Callout,
}

/// What is known of a routed request once its body parsed; set once.
#[derive(Clone, Debug)]
struct Routed {
    route: Route,
    model: String,
    started_us: u64,
    /// The fingerprints of its item prefixes ([`memo`]).
    prints: Vec<u64>,
}

/// How a request ended on the request side.
#[derive(Clone, Debug)]
struct Decision {
    reason: Reason,
    /// Set when the body parsed (the response side observes only those).
    routed: Option<Routed>,
    /// The first candidate's data-parallel rank.
    rank: Option<u32>,
    /// Turns in a row routed from the memory alone, this one included (0:
    /// not [`Reason::Continued`]).
    local_turns: u32,
}

/// Where the request side of a stream stands.
#[derive(Debug)]
enum Stage {
    /// Before the request headers, or not a routed POST.
    Idle,
    /// A routed POST whose body is being buffered.
    Buffering { route: Route, started_us: u64 },
    /// Waiting for the tokenizer.
    Tokenizing {
        routed: Routed,
        token: u32,
        sent_us: u64,
        salt: Option<String>,
    },
    /// Waiting for indexd's Pick.
    Picking {
        routed: Routed,
        token: u32,
        sent_us: u64,
    },
    /// Decided, routed or not.
    Done(Decision),
}

/// The filter state of one HTTP stream.
#[derive(Debug)]
pub struct Flow {
    cfg: Rc<Config>,
    /// The filter's own id of this request ([`request_id`]).
    id: String,
    /// The client's `x-request-id`, capped, for the tokenizer call and logs.
    client_id: String,
    stage: Stage,
    response: ResponseStage,
}

impl Flow {
    /// A fresh stream under `cfg`, known to indexd as `id` ([`request_id`]).
    pub fn new(cfg: Rc<Config>, id: String) -> Self {
        Self {
            id,
            cfg,
            client_id: String::new(),
            stage: Stage::Idle,
            response: ResponseStage::Idle,
        }
    }

    /// The decision, once reached.
    pub fn reason(&self) -> Option<Reason> {
        match &self.stage {
            Stage::Done(d) => Some(d.reason),
            _ => None,
        }
    }

    fn decision(&self) -> Option<&Decision> {
        match &self.stage {
            Stage::Done(d) => Some(d),
            _ => None,
        }
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
        self.client_id = header_string(host.request_header("x-request-id"))
            .map(|id| capped(id, MAX_CLIENT_ID_BYTES))
            .unwrap_or_default();
        self.stage = Stage::Buffering {
            route,
            started_us: host.now_us(),
        };
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
        Action::Pause
    }

    /// Request body: buffer to end of stream, then start the lookup.
    pub fn on_request_body(
        &mut self,
        host: &mut dyn Host,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        let Stage::Buffering { route, started_us } = &self.stage else {
            return Action::Continue;
        };
        if body_size > self.cfg.max_body_bytes {
            return self.conclude(host, Reason::BodyTooLarge, Via::Callback);
        }
        if !end_of_stream {
            return Action::Pause;
        }
        let (route, started_us) = (route.clone(), *started_us);
        let work_us = host.now_us();
        let body = host.request_body(0, body_size).unwrap_or_default();
        let action = self.start(host, route, started_us, &body);
        host.record(
            Histogram::RequestWork,
            host.now_us().saturating_sub(work_us),
        );
        action
    }

    /// Request trailers end a body without `end_of_stream` on a body chunk.
    pub fn on_request_trailers(&mut self, host: &mut dyn Host) -> Action {
        if matches!(self.stage, Stage::Buffering { .. }) {
            return self.conclude(host, Reason::Unparseable, Via::Callback);
        }
        Action::Continue
    }

    fn start(&mut self, host: &mut dyn Host, route: Route, started_us: u64, body: &[u8]) -> Action {
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
        let items = if self.cfg.remember {
            memo::items(&req)
        } else {
            Vec::new()
        };
        let routed = Routed {
            prints: memo::fingerprints(&req, &items, &model),
            route,
            model,
            started_us,
        };
        let routed = match self.continue_locally(host, &req, &items, routed) {
            Ok(action) => return action,
            Err(routed) => routed,
        };
        // While indexd's breaker is open, only its probes reach it; the
        // others go where their conversation went before, if known.
        let now = now_ms(host);
        if !breaker::admits(host, Breaker::Index, &self.cfg.breaker, now) {
            return self.unrouted(host, routed, Reason::BreakerOpen, Via::Callback);
        }
        if let Some(prev) = &req.previous_response_id {
            let mut pick = self.pick_request(host, &routed);
            pick.previous_response_id.clone_from(prev);
            return self.pick(host, routed, pick, Via::Callback);
        }
        if self.cfg.mode == Mode::Approximate {
            let (keys, _) = approximate::text_keys(&req, self.cfg.approximate_chunk_bytes);
            if keys.is_empty() {
                return self.conclude_routed(host, routed, Reason::ShortPrompt, Via::Callback);
            }
            let mut pick = self.pick_request(host, &routed);
            pick.block_keys = keys.iter().map(|k| k.as_u64()).collect();
            return self.pick(host, routed, pick, Via::Callback);
        }
        if let Some(ids) = &req.prompt_ids {
            let salt = req.cache_salt.as_deref();
            return self.pick_tokens(host, routed, ids, salt, Via::Callback);
        }
        if self.cfg.tokenize_at == TokenizeAt::Indexd {
            let mut pick = self.pick_request(host, &routed);
            pick.api = wire_api(routed.route.api).into();
            let message = with_body(&pick, body);
            // indexd may ask a replica's tokenizer: the call may take as
            // long as a tokenizer call.
            let timeout = self
                .cfg
                .tokenizer_timeout
                .saturating_add(self.cfg.index_timeout);
            return self.dispatch_pick(host, routed, &message, timeout, Via::Callback);
        }
        let now = now_ms(host);
        if !breaker::admits(host, Breaker::Tokenizer, &self.cfg.tokenizer_breaker, now) {
            return self.conclude_routed(host, routed, Reason::TokenizerBreakerOpen, Via::Callback);
        }
        let tok_body = tokenize::request_body(routed.route.call, &req, &routed.model, body);
        let mut headers = vec![
            (":method", "POST"),
            (":path", routed.route.tokenizer_path.as_str()),
            (":authority", self.cfg.tokenizer_authority.as_str()),
            ("content-type", "application/json"),
        ];
        if !self.client_id.is_empty() {
            headers.push(("x-request-id", self.client_id.as_str()));
        }
        let sent_us = host.now_us();
        let dispatched = host.dispatch_http(
            &self.cfg.tokenizer_cluster,
            &headers,
            &tok_body,
            self.cfg.tokenizer_timeout,
        );
        match dispatched {
            Ok(token) => {
                self.stage = Stage::Tokenizing {
                    routed,
                    token,
                    sent_us,
                    salt: req.cache_salt,
                };
                Action::Pause
            }
            Err(e) => {
                log::warn!("tokenizer call not dispatched: {}", e.0);
                self.tokenizer_failed(host, routed, Via::Callback)
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
        match &self.stage {
            Stage::Tokenizing { token: t, .. } if *t == token => {}
            _ => return,
        }
        let Stage::Tokenizing {
            routed,
            sent_us,
            salt,
            ..
        } = std::mem::replace(&mut self.stage, Stage::Idle)
        else {
            return;
        };
        let work_us = host.now_us();
        host.record(Histogram::TokenizerCall, work_us.saturating_sub(sent_us));
        self.on_tokenizer_answer(host, routed, salt, num_headers, body_size);
        host.record(Histogram::AnswerWork, host.now_us().saturating_sub(work_us));
    }

    fn on_tokenizer_answer(
        &mut self,
        host: &mut dyn Host,
        routed: Routed,
        salt: Option<String>,
        num_headers: usize,
        body_size: usize,
    ) {
        if num_headers == 0 {
            log::debug!("{}: tokenizer call failed (no answer headers)", self.id);
            self.tokenizer_failed(host, routed, Via::Callout);
            return;
        }
        let status = header_string(host.http_call_response_header(":status"));
        let code = status.as_deref().and_then(|s| s.parse::<u16>().ok());
        match code {
            Some(200) => {}
            // The tokenizer refused this request (bad shape, unknown model):
            // not a failure of the tokenizer.
            Some(c) if (400..500).contains(&c) && c != 408 && c != 429 => {
                log::debug!("{}: tokenizer refused the request ({c})", self.id);
                self.conclude_routed(host, routed, Reason::TokenizeFailed, Via::Callout);
                return;
            }
            _ => {
                log::debug!("{}: tokenizer answered {status:?}", self.id);
                self.tokenizer_failed(host, routed, Via::Callout);
                return;
            }
        }
        let body = if body_size == 0 || body_size > self.cfg.max_tokenizer_response_bytes {
            Vec::new()
        } else {
            host.http_call_response_body(0, body_size)
                .unwrap_or_default()
        };
        let ids = match tokenize::parse_token_ids(&body) {
            Ok(ids) => ids,
            Err(e) => {
                log::debug!("{}: tokenizer answer unusable: {}", self.id, e.0);
                self.tokenizer_failed(host, routed, Via::Callout);
                return;
            }
        };
        let now = now_ms(host);
        breaker::record_success(host, Breaker::Tokenizer, now);
        self.pick_tokens(host, routed, &ids, salt.as_deref(), Via::Callout);
    }

    /// The Pick request every path starts from (it carries the completed
    /// picks and the continued requests waiting in shared data).
    fn pick_request(&self, host: &mut dyn Host, routed: &Routed) -> PickRequest {
        let (mode, block_size) = match self.cfg.mode {
            Mode::Precise => (WireMode::Precise, self.cfg.block_size),
            Mode::Approximate => (WireMode::Approximate, self.cfg.approximate_chunk_bytes),
        };
        // Completions first ([`completed`]).
        let completed_request_ids = completed::take(host);
        let continued = if self.cfg.local_continuations > 0 {
            let now = now_ms(host);
            completed::take_continued(host, now)
        } else {
            Vec::new()
        };
        PickRequest {
            model: routed.model.clone(),
            block_size: block_size.get(),
            mode: mode.into(),
            request_id: self.id.clone(),
            max_candidates: self.cfg.max_candidates,
            completed_request_ids,
            continued,
            key_scheme: SCHEME_VERSION.to_owned(),
            // Only continuations routed from the memory need them ([`busy`]).
            want_busy: self.cfg.local_continuations > 0,
            ..PickRequest::default()
        }
    }

    fn pick_tokens(
        &mut self,
        host: &mut dyn Host,
        routed: Routed,
        ids: &[u32],
        salt: Option<&str>,
        via: Via,
    ) -> Action {
        // Keys past the cap are dropped from the end: the prefix is what
        // indexd matches.
        let capped = ids
            .get(
                ..self
                    .cfg
                    .max_pick_keys
                    .saturating_mul(self.cfg.block_size.get() as usize),
            )
            .unwrap_or(ids);
        let keys = block_keys(capped, self.cfg.block_size, salt);
        if keys.is_empty() {
            return self.conclude_routed(host, routed, Reason::ShortPrompt, via);
        }
        let mut pick = self.pick_request(host, &routed);
        pick.mode = WireMode::Precise.into();
        pick.block_size = self.cfg.block_size.get();
        pick.block_keys = keys.iter().map(|k| k.as_u64()).collect();
        pick.prompt_tokens = u32::try_from(ids.len()).unwrap_or(u32::MAX);
        self.pick(host, routed, pick, via)
    }

    fn pick(&mut self, host: &mut dyn Host, routed: Routed, pick: PickRequest, via: Via) -> Action {
        let timeout = self.cfg.index_timeout;
        self.dispatch_pick(host, routed, &pick.encode_to_vec(), timeout, via)
    }

    fn dispatch_pick(
        &mut self,
        host: &mut dyn Host,
        routed: Routed,
        message: &[u8],
        timeout: std::time::Duration,
        via: Via,
    ) -> Action {
        let sent_us = host.now_us();
        match host.dispatch_grpc(
            &self.cfg.index_cluster,
            grpc_path::SERVICE,
            grpc_path::PICK,
            &self.cfg.index_metadata(),
            message,
            timeout,
        ) {
            Ok(token) => {
                self.stage = Stage::Picking {
                    routed,
                    token,
                    sent_us,
                };
                Action::Pause
            }
            // Envoy's circuit breaker on the indexd cluster is full: indexd
            // is busy, not failing, and the refusal cost no wait, so the
            // breaker (which spares requests a timeout each) does not count
            // it.
            Err(e) if e.refused_at_once() => {
                log::log!(
                    loud_once(&BUSY_WARNED),
                    "Pick refused by Envoy at once (the indexd cluster's circuit breaker is full): \
                     going on unrouted (kvroute_decisions_index_busy counts these)"
                );
                self.unrouted(host, routed, Reason::IndexBusy, via)
            }
            Err(e) => {
                log::warn!("Pick not dispatched: {}", e.0);
                self.index_failed(host, routed, via)
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
        match &self.stage {
            Stage::Picking { token: t, .. } if *t == token => {}
            _ => return,
        }
        let Stage::Picking {
            routed, sent_us, ..
        } = std::mem::replace(&mut self.stage, Stage::Idle)
        else {
            return;
        };
        host.record(Histogram::IndexCall, host.now_us().saturating_sub(sent_us));
        if status_code != 0 {
            log::debug!("{}: Pick failed with gRPC status {status_code}", self.id);
            if refused(status_code) {
                self.conclude_routed(host, routed, Reason::IndexRejected, Via::Callout);
            } else {
                self.index_failed(host, routed, Via::Callout);
            }
            return;
        }
        let body = if size == 0 || size > MAX_PICK_BYTES {
            Vec::new()
        } else {
            host.grpc_call_response_body(0, size).unwrap_or_default()
        };
        match PickResponse::decode(body.as_slice()) {
            Ok(answer) => self.apply(host, routed, &answer),
            Err(e) => {
                log::debug!("{}: undecodable Pick answer: {e}", self.id);
                self.index_failed(host, routed, Via::Callout);
            }
        }
    }

    fn apply(&mut self, host: &mut dyn Host, routed: Routed, answer: &PickResponse) {
        if answer.block_size_mismatch {
            host.count(Counter::BlockSizeMismatch);
            log::log!(
                loud_once(&MISMATCH_WARNED),
                "block_size {} differs from indexd's {}",
                self.cfg.block_size.get(),
                answer.index_block_size
            );
        }
        if answer.key_scheme_mismatch {
            host.count(Counter::KeySchemeMismatch);
            log::log!(
                loud_once(&SCHEME_WARNED),
                "indexd keys blocks with another scheme than this filter's {SCHEME_VERSION}: \
                 upgrade the filter and indexd together"
            );
        }
        let reason = match DecisionKind::try_from(answer.decision) {
            Ok(DecisionKind::Precise) => Reason::Precise,
            Ok(DecisionKind::Affinity) => Reason::Affinity,
            Ok(DecisionKind::Approximate) => Reason::Approximate,
            Ok(DecisionKind::Load) => Reason::Load,
            Ok(DecisionKind::Stale) => {
                let now = now_ms(host);
                breaker::record_success(host, Breaker::Index, now);
                self.unrouted(host, routed, Reason::IndexStale, Via::Callout);
                return;
            }
            Ok(DecisionKind::Untokenized) => {
                let now = now_ms(host);
                breaker::record_success(host, Breaker::Index, now);
                log::debug!("{}: indexd could not tokenize: {}", self.id, answer.reason);
                self.conclude_routed(host, routed, Reason::TokenizeFailed, Via::Callout);
                return;
            }
            Ok(DecisionKind::Unspecified) | Err(_) => {
                self.index_failed(host, routed, Via::Callout);
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
            log::debug!("{}: Pick answer without usable candidates", self.id);
            self.index_failed(host, routed, Via::Callout);
            return;
        }
        let now = now_ms(host);
        breaker::record_success(host, Breaker::Index, now);
        if answer.busy_known && self.cfg.local_continuations > 0 {
            busy::record(host, &answer.busy, now);
        }
        let list = hosts.join(",");
        let rank = answer.candidates.first().and_then(|c| c.data_parallel_rank);
        self.pin(host, &list, rank);
        log::debug!(
            "{} ({}) -> {list} ({})",
            self.id,
            self.client_id,
            reason.label()
        );
        self.finish(host, reason, Some(routed), rank, Via::Callout);
    }

    fn tokenizer_failed(&mut self, host: &mut dyn Host, routed: Routed, via: Via) -> Action {
        let cfg = self.cfg.tokenizer_breaker;
        let now = now_ms(host);
        if breaker::record_failure(host, Breaker::Tokenizer, &cfg, now) {
            host.count(Counter::TokenizerBreakerOpened);
            log::warn!("tokenizer failing, breaker open for {} ms", cfg.cooldown_ms);
        }
        self.conclude_routed(host, routed, Reason::TokenizeFailed, via)
    }

    fn index_failed(&mut self, host: &mut dyn Host, routed: Routed, via: Via) -> Action {
        let cfg = self.cfg.breaker;
        let now = now_ms(host);
        if breaker::record_failure(host, Breaker::Index, &cfg, now) {
            host.count(Counter::BreakerOpened);
            log::warn!("indexd failing, breaker open for {} ms", cfg.cooldown_ms);
        }
        self.unrouted(host, routed, Reason::IndexUnavailable, via)
    }

    /// A continuation whose previous turn this gateway saw answered goes
    /// where that turn went, without a Pick, unless the memory has already
    /// sent `local_continuations` turns in a row there (then indexd checks
    /// the replica's load and the conversation's blocks again). `Err` hands
    /// the request back for a Pick.
    fn continue_locally(
        &mut self,
        host: &mut dyn Host,
        req: &request::ParsedRequest<'_>,
        items: &[&serde_json::value::RawValue],
        routed: Routed,
    ) -> Result<Action, Routed> {
        let limit = self.cfg.local_continuations;
        if limit == 0 || req.previous_response_id.is_some() {
            return Err(routed);
        }
        let Some(turn) = memo::previous_turn(items) else {
            return Err(routed);
        };
        let recalled = routed
            .prints
            .get(turn.items.wrapping_sub(1))
            .and_then(|print| memo::recall_turn(host, *print))
            .filter(|r| r.local_turns < limit && valid_address(&r.host));
        let Some(recalled) = recalled else {
            return Err(routed);
        };
        // Its replica's load: a Pick when indexd's latest answer called it
        // busy, or when no answer is recent enough to say
        // (`continuation_load_ms`).
        let fresh_ms = u64::try_from(self.cfg.continuation_load.as_millis()).unwrap_or(u64::MAX);
        match busy::load_of(host, &recalled.host, recalled.rank, now_ms(host), fresh_ms) {
            busy::Load::Free => {}
            busy::Load::Busy => {
                host.count(Counter::ContinuationBusy);
                return Err(routed);
            }
            busy::Load::Unknown => {
                host.count(Counter::ContinuationUnknownLoad);
                return Err(routed);
            }
        }
        log::debug!(
            "{} ({}) -> {} (continued, turn {} in a row)",
            self.id,
            self.client_id,
            recalled.host,
            recalled.local_turns.saturating_add(1)
        );
        self.pin(host, &recalled.host, recalled.rank);
        // The next Pick tells indexd, so that it counts this request as
        // queued work there (≈ 4 bytes of JSON per token: an estimate).
        let new_tokens = u32::try_from(turn.new_bytes / BYTES_PER_TOKEN).unwrap_or(u32::MAX);
        let now = now_ms(host);
        completed::push_continued(
            host,
            &self.id,
            &recalled.host,
            recalled.rank,
            new_tokens,
            now,
        );
        Ok(self.finish_turn(
            host,
            Reason::Continued,
            Some(routed),
            recalled.rank,
            Via::Callback,
            recalled.local_turns.saturating_add(1),
        ))
    }

    /// indexd could not route this request (`reason`): send it where its
    /// conversation went before, if the memory knows ([`memo`]), else let
    /// Envoy choose.
    fn unrouted(
        &mut self,
        host: &mut dyn Host,
        routed: Routed,
        reason: Reason,
        via: Via,
    ) -> Action {
        if let Some((target, rank)) = memo::recall(host, &routed.prints)
            && valid_address(&target)
        {
            log::debug!("{}: {} -> {target} (remembered)", self.id, reason.label());
            self.pin(host, &target, rank);
            return self.finish(host, Reason::Remembered, Some(routed), rank, via);
        }
        self.conclude_routed(host, routed, reason, via)
    }

    /// Sets the override list (`ip:port,…`) and the first host's rank.
    fn pin(&self, host: &mut dyn Host, list: &str, rank: Option<u32>) {
        host.set_request_header(&self.cfg.override_header, Some(list));
        if let Some(rank) = rank {
            host.set_request_header(&self.cfg.rank_header, Some(&rank.to_string()));
        }
    }

    /// Ends the request side before the body parsed (no model known).
    fn conclude(&mut self, host: &mut dyn Host, reason: Reason, via: Via) -> Action {
        self.finish(host, reason, None, None, via)
    }

    /// Ends the request side of a parsed request without an override.
    fn conclude_routed(
        &mut self,
        host: &mut dyn Host,
        routed: Routed,
        reason: Reason,
        via: Via,
    ) -> Action {
        self.finish(host, reason, Some(routed), None, via)
    }

    fn finish(
        &mut self,
        host: &mut dyn Host,
        reason: Reason,
        routed: Option<Routed>,
        rank: Option<u32>,
        via: Via,
    ) -> Action {
        self.finish_turn(host, reason, routed, rank, via, 0)
    }

    /// [`Self::finish`] for a request that is the `local_turns`-th in a row
    /// its conversation's memory routed without a Pick.
    fn finish_turn(
        &mut self,
        host: &mut dyn Host,
        reason: Reason,
        routed: Option<Routed>,
        rank: Option<u32>,
        via: Via,
        local_turns: u32,
    ) -> Action {
        let started_us = match (&routed, &self.stage) {
            (Some(r), _) => Some(r.started_us),
            (None, Stage::Buffering { started_us, .. }) => Some(*started_us),
            (None, _) => None,
        };
        self.stage = Stage::Done(Decision {
            reason,
            routed,
            rank,
            local_turns,
        });
        host.count(Counter::Decision(reason));
        if let Some(started_us) = started_us {
            host.record(
                Histogram::FilterTime,
                host.now_us().saturating_sub(started_us),
            );
        }
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
}

fn wire_api(api: Api) -> WireApi {
    match api {
        Api::Completions => WireApi::Completions,
        Api::Chat => WireApi::Chat,
        Api::Responses => WireApi::Responses,
    }
}

/// `pick` encoded with `body` as its `body` field, copying the body once.
fn with_body(pick: &PickRequest, body: &[u8]) -> Vec<u8> {
    /// `PickRequest.body`: field 10, length-delimited.
    const BODY_KEY: u64 = (10 << 3) | 2;
    let mut out = Vec::with_capacity(
        pick.encoded_len()
            .saturating_add(body.len())
            .saturating_add(16),
    );
    // Encoding into a Vec cannot run out of room.
    let _ = pick.encode(&mut out);
    prost::encoding::encode_varint(BODY_KEY, &mut out);
    prost::encoding::encode_varint(body.len() as u64, &mut out);
    out.extend_from_slice(body);
    out
}

fn now_ms(host: &dyn Host) -> u64 {
    host.now_us() / 1000
}

/// gRPC statuses by which indexd refuses one request (InvalidArgument,
/// OutOfRange): the request's fault, not indexd's, so no breaker count.
fn refused(status: u32) -> bool {
    matches!(status, 3 | 11)
}

/// `value` cut to at most `max` bytes, at a character boundary.
fn capped(mut value: String, max: usize) -> String {
    if value.len() > max {
        let mut end = max;
        while !value.is_char_boundary(end) {
            end = end.saturating_sub(1);
        }
        value.truncate(end);
    }
    value
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
