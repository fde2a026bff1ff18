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
//!
//! The steps live in submodules: `tokenizing` the tokenizer callout,
//! `picking` indexd's Pick and its answer, `memory` the routes taken from
//! the gateway's memory, `response` the response side, which completes the
//! pick and observes Responses ids.

use std::rc::Rc;

use crate::approximate;
use crate::breaker::{self, Breaker};
use crate::config::{Api, Config, Mode, Route, TokenizeAt};
use crate::host::Host;
use crate::memo;
use crate::metrics::{Counter, Histogram, Reason};
use crate::request::{self, Rejection};

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
    /// Whether its body continues a conversation ([`memo::continues`]).
    continuation: Option<bool>,
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
        /// The Pick's size (its body included, when it carries one).
        bytes: usize,
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
        let items = memo::items(&req);
        let continuation = memo::continues(&req, &items);
        let items = if self.cfg.remember { items } else { Vec::new() };
        let routed = Routed {
            prints: memo::fingerprints(&req, &items, &model),
            route,
            model,
            started_us,
            continuation,
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
        // Messages bodies only indexd can tokenize (`Api::Messages`).
        if self.cfg.tokenize_at == TokenizeAt::Indexd || routed.route.api == Api::Messages {
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
        self.call_tokenizer(host, routed, req, body)
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

fn now_ms(host: &dyn Host) -> u64 {
    host.now_us() / 1000
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

mod memory;
mod picking;
mod response;
mod tokenizing;

use picking::{wire_api, with_body};
use response::ResponseStage;

#[cfg(test)]
pub(crate) mod tests;
