//! indexd's Pick: the request every routed path ends in (block keys, a
//! Responses id, or the body for indexd to tokenize), its dispatch through
//! Envoy, and its answer applied: the override list and rank, or the index
//! rows of the failure table (`index_busy`, `index_rejected`,
//! `index_unavailable`, `index_stale`).

use std::sync::atomic::{AtomicBool, Ordering};

use kvroute_proto::v1::{
    Api as WireApi, DecisionKind, Mode as WireMode, PickRequest, PickResponse,
};
use kvroute_proto::{SCHEME_VERSION, block_keys, grpc_path};
use prost::Message;

use super::response::ResponseStage;
use super::{Action, Flow, Routed, Stage, Via, now_ms, valid_address};
use crate::breaker::{self, Breaker};
use crate::busy;
use crate::completed;
use crate::config::{Api, Mode};
use crate::host::Host;
use crate::metrics::{Counter, Histogram, Reason};

/// Upper bound on hosts in the override list.
const MAX_HOSTS: usize = 16;
/// A Pick larger than this (a body of a MiB or more) that fails does not
/// count toward the index breaker ([`Counter::LargePickFailed`]).
const LARGE_PICK_BYTES: usize = 1 << 20;
/// Largest Pick answer read.
const MAX_PICK_BYTES: usize = 64 * 1024;
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

impl Flow {
    /// The Pick request every path starts from (it carries the completed
    /// picks and the continued requests waiting in shared data).
    pub(super) fn pick_request(&self, host: &mut dyn Host, routed: &Routed) -> PickRequest {
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
            continuation: routed.continuation,
            ..PickRequest::default()
        }
    }

    pub(super) fn pick_tokens(
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

    pub(super) fn pick(
        &mut self,
        host: &mut dyn Host,
        routed: Routed,
        pick: PickRequest,
        via: Via,
    ) -> Action {
        let timeout = self.cfg.index_timeout;
        self.dispatch_pick(host, routed, &pick.encode_to_vec(), timeout, via)
    }

    pub(super) fn dispatch_pick(
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
                    bytes: message.len(),
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
            routed,
            sent_us,
            bytes,
            ..
        } = std::mem::replace(&mut self.stage, Stage::Idle)
        else {
            return;
        };
        host.record(Histogram::IndexCall, host.now_us().saturating_sub(sent_us));
        if status_code != 0 {
            log::debug!("{}: Pick failed with gRPC status {status_code}", self.id);
            if refused(status_code) {
                self.conclude_routed(host, routed, Reason::IndexRejected, Via::Callout);
            } else if bytes > LARGE_PICK_BYTES {
                // Charged to its body, not to indexd: a client sending
                // bodies that take indexd long to receive and refuse would
                // otherwise open the breaker for every other request.
                host.count(Counter::LargePickFailed);
                self.unrouted(host, routed, Reason::IndexUnavailable, Via::Callout);
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

    fn index_failed(&mut self, host: &mut dyn Host, routed: Routed, via: Via) -> Action {
        let cfg = self.cfg.breaker;
        let now = now_ms(host);
        if breaker::record_failure(host, Breaker::Index, &cfg, now) {
            host.count(Counter::BreakerOpened);
            log::warn!("indexd failing, breaker open for {} ms", cfg.cooldown_ms);
        }
        self.unrouted(host, routed, Reason::IndexUnavailable, via)
    }
}

pub(super) fn wire_api(api: Api) -> WireApi {
    match api {
        Api::Completions => WireApi::Completions,
        Api::Chat => WireApi::Chat,
        Api::Responses => WireApi::Responses,
        Api::Messages => WireApi::Messages,
    }
}

/// `pick` encoded with `body` as its `body` field, copying the body once.
pub(super) fn with_body(pick: &PickRequest, body: &[u8]) -> Vec<u8> {
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

/// gRPC statuses by which indexd refuses one request (InvalidArgument,
/// OutOfRange): the request's fault, not indexd's, so no breaker count.
fn refused(status: u32) -> bool {
    matches!(status, 3 | 11)
}
