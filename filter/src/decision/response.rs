//! The response side of a [`Flow`]: the decision header, the pick's
//! completion, and Observe.
//!
//! - A picked request's first response byte means the replica's prefill is
//!   done: its pick no longer stands for queued work. The id goes into a
//!   list in shared data and the next Pick of any worker carries it to
//!   indexd (`completed_request_ids`, see [`crate::completed`]): no call is
//!   made for it.
//! - A Responses API answer carries a response id that a continuation
//!   (`previous_response_id`) must find: the first chunks are scanned for it
//!   (JSON body or the SSE `response.created` event), and the chunks up to
//!   the one holding it are held until indexd has answered Observe. A held
//!   call always ends in an answer or Envoy's timeout, so the SDK's token
//!   table does not grow (a client that aborts during the hold, at most
//!   `index_timeout_ms`, leaves one entry).

use kvroute_proto::grpc_path;
use kvroute_proto::v1::{ObserveRequest, Outcome};
use prost::Message;

use super::{Action, Flow, header_string, now_ms};
use crate::breaker::{self, Breaker};
use crate::completed;
use crate::config::Api;
use crate::host::Host;
use crate::memo;
use crate::metrics::Counter;
use crate::observe::{IdScanner, Scan};

/// Where the response side stands.
#[derive(Debug)]
pub(super) enum ResponseStage {
    Idle,
    /// A picked request before its first response byte.
    AwaitingFirstByte,
    Scanning {
        scanner: Box<IdScanner>,
        endpoint: String,
        status: u32,
        /// Body bytes already fed to the scanner. Chunks are kept (paused)
        /// while scanning, so Envoy hands over the whole buffer each time.
        seen: usize,
    },
    Holding {
        token: u32,
    },
    Done,
}

impl Flow {
    /// Response headers: the decision header, then wait for the first byte
    /// (or start scanning a Responses answer for its id).
    pub fn on_response_headers(&mut self, host: &mut dyn Host, end_of_stream: bool) -> Action {
        let Some(decision) = self.decision() else {
            return Action::Continue;
        };
        let (reason, api) = (
            decision.reason,
            decision.routed.as_ref().map(|r| r.route.api),
        );
        if let Some(name) = &self.cfg.decision_header {
            let name = name.clone();
            host.set_response_header(&name, reason.label());
        }
        self.remember(host);
        if !self.cfg.observe || !matches!(self.response, ResponseStage::Idle) {
            return Action::Continue;
        }
        self.response = ResponseStage::Done;
        let picked = reason.routed();
        let status = header_string(host.response_header(":status"))
            .and_then(|s| s.parse::<u32>().ok())
            .unwrap_or(0);
        let wants_id = api == Some(Api::Responses)
            && (200..300).contains(&status)
            && !end_of_stream
            && !breaker::is_open(host, Breaker::Index, now_ms(host));
        let endpoint = if wants_id {
            host.property(&["upstream", "address"])
                .and_then(|v| String::from_utf8(v).ok())
                .filter(|a| !a.is_empty())
        } else {
            None
        };
        if let Some(endpoint) = endpoint {
            let sse = header_string(host.response_header("content-type"))
                .is_some_and(|c| c.contains("text/event-stream"));
            self.response = ResponseStage::Scanning {
                scanner: Box::new(IdScanner::new(self.cfg.response_scan_bytes, sse)),
                endpoint,
                status,
                seen: 0,
            };
        } else if picked && end_of_stream {
            completed::push(host, &self.id);
        } else if picked {
            self.response = ResponseStage::AwaitingFirstByte;
        }
        Action::Continue
    }

    /// Response body chunks: the first byte completes the pick; a Responses
    /// answer is scanned for its id.
    pub fn on_response_body(
        &mut self,
        host: &mut dyn Host,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        let (scanner, seen) = match &mut self.response {
            ResponseStage::Scanning { scanner, seen, .. } => (scanner, seen),
            ResponseStage::AwaitingFirstByte => {
                completed::push(host, &self.id);
                self.response = ResponseStage::Done;
                return Action::Continue;
            }
            // Later chunks wait behind the held one: a Continue here would
            // release the whole buffered body before indexd knows the id.
            ResponseStage::Holding { .. } => return Action::Pause,
            ResponseStage::Idle | ResponseStage::Done => return Action::Continue,
        };
        let fresh = body_size.saturating_sub(*seen);
        let chunk = host.response_body(*seen, fresh).unwrap_or_default();
        *seen = body_size;
        let scan = scanner.push(&chunk, end_of_stream);
        let (endpoint, status) = match &self.response {
            ResponseStage::Scanning {
                endpoint, status, ..
            } => (endpoint.clone(), *status),
            _ => return Action::Continue,
        };
        match scan {
            // Keep the chunks seen so far: released now, they could carry the
            // whole answer to the client before indexd knows its id (an id
            // that is not the first key is found only at the end of the body).
            // The scan is bounded by `response_scan_bytes`.
            Scan::NeedMore => Action::Pause,
            Scan::GiveUp => {
                self.response = ResponseStage::Done;
                self.complete_pick(host);
                Action::Continue
            }
            Scan::Found(id) => {
                self.response = ResponseStage::Done;
                // Hold the response until indexd knows the id, so that a
                // client continuing at once finds its replica.
                match self.observe(host, endpoint, status, id) {
                    Some(token) => {
                        self.response = ResponseStage::Holding { token };
                        Action::Pause
                    }
                    None => {
                        self.complete_pick(host);
                        Action::Continue
                    }
                }
            }
        }
    }

    /// Remembers which replica answered a parsed request (2xx), whatever
    /// routed it: its conversation's next turn goes there too should indexd
    /// not answer ([`crate::memo`]).
    fn remember(&self, host: &mut dyn Host) {
        let Some(decision) = self.decision() else {
            return;
        };
        let Some(last) = decision.routed.as_ref().and_then(|r| r.prints.last()) else {
            return;
        };
        let ok = header_string(host.response_header(":status")).is_some_and(|s| s.starts_with('2'));
        let served = host
            .property(&["upstream", "address"])
            .and_then(|v| String::from_utf8(v).ok())
            .filter(|a| !a.is_empty());
        if let (true, Some(served)) = (ok, served) {
            // The rank only if the replica is the one indexd named.
            let rank = decision.rank;
            memo::remember(host, *last, &served, rank, decision.local_turns);
        }
    }

    /// Queues this request's pick as completed, if it was picked.
    fn complete_pick(&self, host: &mut dyn Host) {
        if self.decision().is_some_and(|d| d.reason.routed()) {
            completed::push(host, &self.id);
        }
    }

    fn observe(
        &mut self,
        host: &mut dyn Host,
        endpoint: String,
        status: u32,
        response_id: String,
    ) -> Option<u32> {
        let decision = self.decision()?;
        let outcome = match status {
            200..=299 => Outcome::Ok,
            400..=499 => Outcome::ClientError,
            500..=599 => Outcome::ServerError,
            _ => Outcome::Unspecified,
        };
        let msg = ObserveRequest {
            model: decision
                .routed
                .as_ref()
                .map(|r| r.model.clone())
                .unwrap_or_default(),
            endpoint,
            data_parallel_rank: decision.rank,
            response_id,
            outcome: outcome.into(),
            http_status: status,
            request_id: self.id.clone(),
        };
        match host.dispatch_grpc(
            &self.cfg.index_cluster,
            grpc_path::SERVICE,
            grpc_path::OBSERVE,
            &self.cfg.index_metadata(),
            &msg.encode_to_vec(),
            self.cfg.index_timeout,
        ) {
            Ok(token) => {
                host.count(Counter::ObserveSent);
                Some(token)
            }
            Err(e) => {
                log::debug!("Observe not dispatched: {}", e.0);
                host.count(Counter::ObserveFailed);
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use kvroute_proto::v1::{DecisionKind, ObserveRequest, Outcome};
    use prost::Message;

    use crate::decision::Action;
    use crate::decision::tests::{CHAT, Harness, answer, tokens_json};
    use crate::metrics::Counter;

    #[test]
    fn decision_header_only_when_configured() {
        let mut h = Harness::new(r#""decision_header":"x-kvroute-decision""#);
        h.post("/v1/chat/completions", CHAT);
        h.tokenizer_answers(Some("503"), b"");
        h.respond("200", "application/json", false);
        assert_eq!(
            h.host.response_header_str("x-kvroute-decision").as_deref(),
            Some("tokenize_failed")
        );
        let mut h = Harness::new("");
        h.post("/v1/chat/completions", CHAT);
        h.tokenizer_answers(Some("503"), b"");
        h.respond("200", "application/json", false);
        assert_eq!(h.host.response_header_str("x-kvroute-decision"), None);
    }

    fn observed(h: &Harness) -> ObserveRequest {
        let call = h.host.grpc_calls.last().unwrap();
        assert_eq!(call.method, "Observe");
        ObserveRequest::decode(call.message.as_slice()).unwrap()
    }

    #[test]
    fn a_pick_completes_at_the_first_response_byte_and_rides_the_next_pick() {
        let mut h = Harness::new("");
        h.post("/v1/chat/completions", CHAT);
        h.tokenizer_answers(Some("200"), tokens_json(64).as_bytes());
        h.index_answers(
            0,
            &answer(DecisionKind::Precise, &["10.0.0.2:8000"], Some(2)),
        );
        let first = h.pick_request().request_id;
        let calls = h.host.grpc_calls.len();
        // Headers of a streamed answer come before the prefill: not yet.
        assert_eq!(
            h.respond("200", "text/event-stream", false),
            Action::Continue
        );
        assert_eq!(h.response_chunk(b"data: {}", false), Action::Continue);
        assert_eq!(h.response_chunk(b"data: {}", true), Action::Continue);
        assert_eq!(h.host.grpc_calls.len(), calls, "no call of its own");
        assert_eq!(h.host.count_of(Counter::ObserveSent), 0);

        // The next stream's Pick carries it, once.
        h.next_stream();
        h.post("/v1/chat/completions", CHAT);
        h.tokenizer_answers(Some("200"), tokens_json(64).as_bytes());
        let pick = h.pick_request();
        assert_ne!(pick.request_id, first);
        assert_eq!(pick.completed_request_ids, vec![first]);
        h.index_answers(0, &answer(DecisionKind::Load, &["10.0.0.3:8000"], None));
        h.respond("500", "application/json", true);
        h.next_stream();
        h.post("/v1/chat/completions", CHAT);
        h.tokenizer_answers(Some("200"), tokens_json(64).as_bytes());
        assert_eq!(
            h.pick_request().completed_request_ids.len(),
            1,
            "the error answer completed its pick too; the first went already"
        );
    }

    #[test]
    fn unrouted_requests_complete_nothing() {
        let mut h = Harness::new("");
        h.post("/v1/chat/completions", CHAT);
        h.tokenizer_answers(Some("503"), b"");
        h.respond("200", "application/json", false);
        h.response_chunk(b"{}", true);
        h.next_stream();
        h.post("/v1/chat/completions", CHAT);
        h.tokenizer_answers(Some("200"), tokens_json(64).as_bytes());
        assert!(h.pick_request().completed_request_ids.is_empty());
    }

    #[test]
    fn responses_id_from_json_is_observed_before_the_body_is_released() {
        let mut h = Harness::new("");
        h.post(
            "/v1/responses",
            r#"{"model":"m","input":"x","previous_response_id":"resp_0"}"#,
        );
        h.index_answers(0, &answer(DecisionKind::Affinity, &["10.0.0.2:8000"], None));
        assert_eq!(
            h.respond("200", "application/json", false),
            Action::Continue
        );
        let picks = h.host.grpc_calls.len();
        assert_eq!(
            h.response_chunk(br#"{"id":"resp_1","object":"response","#, false),
            Action::Pause
        );
        assert_eq!(h.host.grpc_calls.len(), picks + 1);
        assert_eq!(
            h.response_chunk(b"", true),
            Action::Pause,
            "later chunks wait too"
        );
        let o = observed(&h);
        assert_eq!(o.response_id, "resp_1");
        assert_eq!(o.outcome, i32::from(Outcome::Ok));
        assert_eq!(o.endpoint, "10.0.0.2:8000");
        assert_eq!(o.model, "m");
        assert_eq!(o.request_id, "000000000000feed-1");
        h.index_answers(0, b"");
        assert_eq!(h.host.response_resumes, 1);
        assert_eq!(h.response_chunk(b"", true), Action::Continue);
        assert_eq!(h.host.grpc_calls.len(), picks + 1);
    }

    #[test]
    fn the_index_token_rides_every_pick_and_observe() {
        let token = "kvroute-test-token-0123456789";
        let metadata = |extra: &str| {
            let mut h = Harness::new(extra);
            h.post(
                "/v1/responses",
                r#"{"model":"m","input":"x","previous_response_id":"resp_0"}"#,
            );
            h.index_answers(0, &answer(DecisionKind::Affinity, &["10.0.0.2:8000"], None));
            h.respond("200", "application/json", false);
            h.response_chunk(br#"{"id":"resp_1","object":"response","#, false);
            assert_eq!(observed(&h).response_id, "resp_1");
            let calls: Vec<_> = h
                .host
                .grpc_calls
                .iter()
                .map(|c| c.metadata.clone())
                .collect();
            assert_eq!(calls.len(), 2, "a Pick and an Observe");
            calls
        };
        let bearer = vec![(
            "authorization".to_owned(),
            format!("Bearer {token}").into_bytes(),
        )];
        for sent in metadata(&format!(r#""index_token":"{token}""#)) {
            assert_eq!(sent, bearer);
        }
        for sent in metadata("") {
            assert!(sent.is_empty());
        }
    }

    #[test]
    fn a_json_id_after_other_keys_keeps_every_chunk_until_indexd_knows_it() {
        let mut h = Harness::new("");
        h.post(
            "/v1/responses",
            r#"{"model":"m","previous_response_id":"resp_0"}"#,
        );
        h.index_answers(0, &answer(DecisionKind::Affinity, &["10.0.0.2:8000"], None));
        h.respond("200", "application/json", false);
        let calls = h.host.grpc_calls.len();
        // Serialisers that sort keys put "id" after "created_at": the whole
        // body may pass before the id is seen. Nothing is released meanwhile.
        assert_eq!(
            h.response_chunk(br#"{"created_at":1,"id":"resp_k","obj"#, false),
            Action::Pause
        );
        assert_eq!(h.host.grpc_calls.len(), calls, "no Observe before the id");
        assert_eq!(
            h.response_chunk(br#"ect":"response"}"#, true),
            Action::Pause
        );
        assert_eq!(observed(&h).response_id, "resp_k");
        assert_eq!(h.host.response_resumes, 0);
        h.index_answers(0, b"");
        assert_eq!(h.host.response_resumes, 1);
    }

    #[test]
    fn responses_id_from_sse_and_failed_observe_releases_too() {
        let mut h = Harness::new("");
        h.post(
            "/v1/responses",
            r#"{"model":"m","previous_response_id":"resp_0"}"#,
        );
        h.index_answers(0, &answer(DecisionKind::Affinity, &["10.0.0.2:8000"], None));
        h.respond("200", "text/event-stream; charset=utf-8", false);
        // The first chunk is kept while the id is still being looked for.
        assert_eq!(
            h.response_chunk(
                b"event: response.created\ndata: {\"type\":\"response.",
                false
            ),
            Action::Pause
        );
        assert_eq!(
            h.response_chunk(b"created\",\"response\":{\"id\":\"resp_s\"}}\n\n", false),
            Action::Pause
        );
        assert_eq!(observed(&h).response_id, "resp_s");
        h.index_answers(14, b"");
        assert_eq!(h.host.response_resumes, 1);
        assert_eq!(h.host.count_of(Counter::ObserveFailed), 1);
    }

    #[test]
    fn responses_without_id_or_with_errors_complete_without_observe() {
        let mut h = Harness::new("");
        h.post(
            "/v1/responses",
            r#"{"model":"m","previous_response_id":"resp_0"}"#,
        );
        h.index_answers(0, &answer(DecisionKind::Affinity, &["10.0.0.2:8000"], None));
        let calls = h.host.grpc_calls.len();
        h.respond("200", "application/json", false);
        assert_eq!(
            h.response_chunk(br#"{"object":"response"}"#, true),
            Action::Continue
        );
        assert_eq!(h.host.grpc_calls.len(), calls, "no Observe without an id");
        // An error answer carries no id to look for.
        h.next_stream();
        h.post(
            "/v1/responses",
            r#"{"model":"m","previous_response_id":"resp_0"}"#,
        );
        assert_eq!(h.pick_request().completed_request_ids.len(), 1);
        h.index_answers(0, &answer(DecisionKind::Affinity, &["10.0.0.2:8000"], None));
        assert_eq!(
            h.respond("404", "application/json", false),
            Action::Continue
        );
        assert_eq!(h.response_chunk(b"{}", true), Action::Continue);
        assert_eq!(h.host.grpc_calls.len(), 1, "only the second Pick");
        assert_eq!(h.host.count_of(Counter::ObserveSent), 0);
        h.next_stream();
        h.post("/v1/chat/completions", CHAT);
        h.tokenizer_answers(Some("200"), tokens_json(64).as_bytes());
        assert_eq!(h.pick_request().completed_request_ids.len(), 1);
    }

    #[test]
    fn no_observe_when_disabled_unparsed_or_breaker_open() {
        let mut h = Harness::new(r#""observe":false"#);
        h.post("/v1/chat/completions", CHAT);
        h.tokenizer_answers(Some("503"), b"");
        h.respond("200", "application/json", true);
        assert!(h.host.grpc_calls.is_empty());
        let mut h = Harness::new("");
        h.post("/v1/chat/completions", "{");
        h.respond("200", "application/json", true);
        assert!(h.host.grpc_calls.is_empty());
        let mut h = Harness::new("");
        h.headers("GET", "/v1/models", &[], true);
        h.respond("200", "application/json", true);
        assert!(h.host.grpc_calls.is_empty());
    }
}
