//! The response side of a [`Flow`]: the decision header, and Observe.
//!
//! Observe reports the served upstream host (`upstream.address`), the status
//! and the data-parallel rank. For the Responses API it also carries the
//! response id, read from the first chunks (JSON body or the SSE
//! `response.created` event); the chunks up to the one holding the id are
//! held until indexd has answered, so a client continuing at once
//! (`previous_response_id`) finds its replica already known.

use kvroute_proto::grpc_path;
use kvroute_proto::v1::{ObserveRequest, Outcome};
use prost::Message;

use super::{Action, Flow, header_string};
use crate::breaker;
use crate::config::Api;
use crate::host::Host;
use crate::metrics::Counter;
use crate::observe::{IdScanner, Scan};

/// Where the response side stands.
#[derive(Debug)]
pub(super) enum ResponseStage {
    Idle,
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
    /// Response headers: the decision header, then Observe (or start
    /// scanning a Responses answer for its id).
    pub fn on_response_headers(&mut self, host: &mut dyn Host, end_of_stream: bool) -> Action {
        if let (Some(name), Some(reason)) = (&self.cfg.decision_header, self.reason) {
            let name = name.clone();
            host.set_response_header(&name, reason.label());
        }
        if !self.cfg.observe
            || self.model.is_none()
            || !matches!(self.response, ResponseStage::Idle)
        {
            return Action::Continue;
        }
        self.response = ResponseStage::Done;
        if breaker::is_open(host, self.now_ms(host)) {
            return Action::Continue;
        }
        let Some(endpoint) = host
            .property(&["upstream", "address"])
            .and_then(|v| String::from_utf8(v).ok())
            .filter(|a| !a.is_empty())
        else {
            return Action::Continue;
        };
        let status = header_string(host.response_header(":status"))
            .and_then(|s| s.parse::<u32>().ok())
            .unwrap_or(0);
        let responses = self.route.as_ref().is_some_and(|r| r.api == Api::Responses);
        if responses && (200..300).contains(&status) && !end_of_stream {
            let sse = header_string(host.response_header("content-type"))
                .is_some_and(|c| c.contains("text/event-stream"));
            self.response = ResponseStage::Scanning {
                scanner: Box::new(IdScanner::new(self.cfg.response_scan_bytes, sse)),
                endpoint,
                status,
                seen: 0,
            };
            return Action::Continue;
        }
        self.observe(host, endpoint, status, String::new());
        Action::Continue
    }

    /// Response body chunks: look for the Responses id in the first ones.
    pub fn on_response_body(
        &mut self,
        host: &mut dyn Host,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        let (scanner, seen) = match &mut self.response {
            ResponseStage::Scanning { scanner, seen, .. } => (scanner, seen),
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
                self.observe(host, endpoint, status, String::new());
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
                    None => Action::Continue,
                }
            }
        }
    }

    fn observe(
        &mut self,
        host: &mut dyn Host,
        endpoint: String,
        status: u32,
        response_id: String,
    ) -> Option<u32> {
        let outcome = match status {
            200..=299 => Outcome::Ok,
            400..=499 => Outcome::ClientError,
            500..=599 => Outcome::ServerError,
            _ => Outcome::Unspecified,
        };
        let msg = ObserveRequest {
            model: self.model.clone().unwrap_or_default(),
            endpoint,
            data_parallel_rank: self.rank,
            response_id,
            outcome: outcome.into(),
            http_status: status,
            request_id: self.request_id.clone(),
        };
        match host.dispatch_grpc(
            &self.cfg.index_cluster,
            grpc_path::SERVICE,
            grpc_path::OBSERVE,
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
    fn observe_reports_the_served_host_and_rank() {
        let mut h = Harness::new("");
        h.post("/v1/chat/completions", CHAT);
        h.tokenizer_answers(Some("200"), tokens_json(64).as_bytes());
        h.index_answers(
            0,
            &answer(DecisionKind::Precise, &["10.0.0.2:8000"], Some(2)),
        );
        assert_eq!(
            h.respond("500", "application/json", false),
            Action::Continue
        );
        let o = observed(&h);
        assert_eq!(o.endpoint, "10.0.0.2:8000");
        assert_eq!(o.data_parallel_rank, Some(2));
        assert_eq!(o.http_status, 500);
        assert_eq!(o.outcome, i32::from(Outcome::ServerError));
        assert_eq!(o.model, "m");
        assert_eq!(o.request_id, "req-1");
        assert_eq!(h.host.count_of(Counter::ObserveSent), 1);
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
        h.index_answers(0, b"");
        assert_eq!(h.host.response_resumes, 1);
        assert_eq!(h.response_chunk(b"", true), Action::Continue);
        assert_eq!(h.host.grpc_calls.len(), picks + 1);
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
    fn responses_without_id_observe_at_the_end_without_holding() {
        let mut h = Harness::new("");
        h.post(
            "/v1/responses",
            r#"{"model":"m","previous_response_id":"resp_0"}"#,
        );
        h.index_answers(0, &answer(DecisionKind::Affinity, &["10.0.0.2:8000"], None));
        h.respond("200", "application/json", false);
        assert_eq!(
            h.response_chunk(br#"{"object":"response"}"#, true),
            Action::Continue
        );
        assert_eq!(observed(&h).response_id, "");
        // Errors are observed at once.
        let mut e = Harness::new("");
        e.post(
            "/v1/responses",
            r#"{"model":"m","previous_response_id":"resp_0"}"#,
        );
        e.index_answers(0, &answer(DecisionKind::Affinity, &["10.0.0.2:8000"], None));
        e.respond("404", "application/json", false);
        assert_eq!(observed(&e).outcome, i32::from(Outcome::ClientError));
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
