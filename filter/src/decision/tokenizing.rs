//! The tokenizer callout: the call (unless the tokenizer's breaker is
//! open), its answer read into token ids for a Pick, and the tokenizer
//! breaker's count of the calls that failed (`tokenize_failed`,
//! `tokenizer_breaker_open`).

use super::{Action, Flow, Routed, Stage, Via, header_string, now_ms};
use crate::breaker::{self, Breaker};
use crate::host::Host;
use crate::metrics::{Counter, Histogram, Reason};
use crate::request;
use crate::tokenize;

impl Flow {
    /// Sends the parsed request (`req`, read from `body`) to the tokenizer,
    /// whose answer goes on to a Pick ([`Self::on_http_call_response`]).
    pub(super) fn call_tokenizer(
        &mut self,
        host: &mut dyn Host,
        routed: Routed,
        req: request::ParsedRequest<'_>,
        body: &[u8],
    ) -> Action {
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

    fn tokenizer_failed(&mut self, host: &mut dyn Host, routed: Routed, via: Via) -> Action {
        let cfg = self.cfg.tokenizer_breaker;
        let now = now_ms(host);
        if breaker::record_failure(host, Breaker::Tokenizer, &cfg, now) {
            host.count(Counter::TokenizerBreakerOpened);
            log::warn!("tokenizer failing, breaker open for {} ms", cfg.cooldown_ms);
        }
        self.conclude_routed(host, routed, Reason::TokenizeFailed, via)
    }
}
