//! The state machine driven end to end through the fake host: one test (or
//! more) per row of the failure table (filter/README.md).

use std::rc::Rc;

use kvroute_proto::v1::{
    Api as WireApi, BusyReplica, Candidate, DecisionKind, Mode as WireMode, PickRequest,
    PickResponse,
};
use kvroute_proto::{BlockSize, block_keys};
use prost::Message;

use super::*;
use crate::fake::FakeHost;

const BASE: &str =
    r#""index_cluster":"indexd","tokenizer_cluster":"tok","tokenizer_authority":"tok.local""#;

pub(crate) struct Harness {
    pub host: FakeHost,
    pub flow: Flow,
    cfg: Rc<Config>,
    context_id: u32,
    /// The last response body callback paused: Envoy keeps the chunk and the
    /// next callback sees the whole buffer, old bytes first.
    response_kept: bool,
    resumes_seen: u32,
}

pub(crate) fn config(extra: &str) -> Rc<Config> {
    let json = if extra.is_empty() {
        format!("{{{BASE}}}")
    } else {
        format!("{{{BASE},{extra}}}")
    };
    Rc::new(Config::parse(json.as_bytes()).unwrap())
}

impl Harness {
    pub fn new(extra: &str) -> Self {
        let cfg = config(extra);
        Self {
            host: FakeHost::default(),
            flow: Flow::new(cfg.clone(), request_id(0xfeed, 1)),
            cfg,
            context_id: 1,
            response_kept: false,
            resumes_seen: 0,
        }
    }

    /// A new stream sharing this one's host (shared data, metrics, clock).
    pub fn next_stream(&mut self) {
        self.context_id += 1;
        self.flow = Flow::new(self.cfg.clone(), request_id(0xfeed, self.context_id));
        let host = std::mem::take(&mut self.host);
        self.host = FakeHost {
            shared: host.shared,
            counters: host.counters,
            now_us: host.now_us,
            ..FakeHost::default()
        };
    }

    pub fn headers(
        &mut self,
        method: &str,
        path: &str,
        extra: &[(&str, &str)],
        eos: bool,
    ) -> Action {
        self.host.request_headers = vec![
            (":method".into(), method.as_bytes().to_vec()),
            (":path".into(), path.as_bytes().to_vec()),
            (":authority".into(), b"gw".to_vec()),
            ("x-request-id".into(), b"req-1".to_vec()),
        ];
        for (k, v) in extra {
            self.host
                .request_headers
                .push(((*k).to_owned(), v.as_bytes().to_vec()));
        }
        self.host.in_request_callback = true;
        let a = self.flow.on_request_headers(&mut self.host, eos);
        self.host.in_request_callback = false;
        self.host.request_paused = a == Action::Pause;
        a
    }

    pub fn body(&mut self, body: &[u8], eos: bool) -> Action {
        self.host.request_body.extend_from_slice(body);
        self.host.in_request_callback = true;
        let size = self.host.request_body.len();
        let a = self.flow.on_request_body(&mut self.host, size, eos);
        self.host.in_request_callback = false;
        self.host.request_paused = a == Action::Pause;
        a
    }

    /// POST `body` to `path` in one chunk; returns the body callback's action.
    pub fn post(&mut self, path: &str, body: &str) -> Action {
        assert_eq!(self.headers("POST", path, &[], false), Action::Pause);
        self.body(body.as_bytes(), true)
    }

    pub fn tokenizer_answers(&mut self, status: Option<&str>, body: &[u8]) {
        let token = self.host.http_calls.last().unwrap().token;
        self.host.http_answer_headers = status
            .map(|s| vec![(":status".to_owned(), s.as_bytes().to_vec())])
            .unwrap_or_default();
        self.host.http_answer_body = body.to_vec();
        self.host.now_us += 3_000;
        let headers = self.host.http_answer_headers.len();
        self.flow
            .on_http_call_response(&mut self.host, token, headers, body.len());
    }

    pub fn index_answers(&mut self, status: u32, body: &[u8]) {
        let token = self.host.grpc_calls.last().unwrap().token;
        self.host.grpc_answer_body = body.to_vec();
        self.host.now_us += 500;
        self.flow
            .on_grpc_call_response(&mut self.host, token, status, body.len());
    }

    pub fn pick_request(&self) -> PickRequest {
        let call = self.host.grpc_calls.last().unwrap();
        assert_eq!(call.cluster, "indexd");
        assert_eq!(call.service, "kvroute.v1.Index");
        assert_eq!(call.method, "Pick");
        PickRequest::decode(call.message.as_slice()).unwrap()
    }

    pub fn override_header(&self) -> Option<String> {
        self.host.header("x-gateway-destination-endpoint")
    }

    pub fn respond(&mut self, status: &str, content_type: &str, eos: bool) -> Action {
        self.host.response_headers = vec![
            (":status".into(), status.as_bytes().to_vec()),
            ("content-type".into(), content_type.as_bytes().to_vec()),
        ];
        self.host
            .properties
            .insert("upstream.address".into(), b"10.0.0.2:8000".to_vec());
        self.flow.on_response_headers(&mut self.host, eos)
    }

    /// Delivers a response body chunk the way Envoy does: after a paused
    /// callback (and no resume since), the body buffer holds every kept chunk
    /// and `body_size` is its whole length.
    pub fn response_chunk(&mut self, chunk: &[u8], eos: bool) -> Action {
        if self.response_kept && self.host.response_resumes == self.resumes_seen {
            self.host.response_chunk.extend_from_slice(chunk);
        } else {
            self.host.response_chunk = chunk.to_vec();
        }
        self.resumes_seen = self.host.response_resumes;
        let size = self.host.response_chunk.len();
        let action = self.flow.on_response_body(&mut self.host, size, eos);
        self.response_kept = action == Action::Pause;
        action
    }
}

pub(crate) fn tokens_json(n: u32) -> String {
    let ids: Vec<String> = (0..n).map(|i| (i + 1).to_string()).collect();
    format!(
        r#"{{"count":{n},"max_model_len":4096,"tokens":[{}]}}"#,
        ids.join(",")
    )
}

pub(crate) fn answer(kind: DecisionKind, addrs: &[&str], rank: Option<u32>) -> Vec<u8> {
    PickResponse {
        candidates: addrs
            .iter()
            .enumerate()
            .map(|(i, a)| Candidate {
                address: (*a).to_owned(),
                data_parallel_rank: if i == 0 { rank } else { None },
                ..Candidate::default()
            })
            .collect(),
        decision: kind.into(),
        // As indexd answers: ranked answers say which replicas are busy.
        busy_known: matches!(
            kind,
            DecisionKind::Precise | DecisionKind::Approximate | DecisionKind::Load
        ),
        ..PickResponse::default()
    }
    .encode_to_vec()
}

pub(crate) const CHAT: &str =
    r#"{"model":"m","messages":[{"role":"user","content":"hello"}],"cache_salt":"tenant-a"}"#;

fn assert_unrouted(h: &Harness, reason: Reason) {
    assert_eq!(h.flow.reason(), Some(reason));
    assert_eq!(h.override_header(), None);
    assert_eq!(h.host.header("x-data-parallel-rank"), None);
    assert_eq!(h.host.count_of(Counter::Decision(reason)), 1);
    assert!(!h.host.request_paused, "request left paused");
}

#[test]
fn precise_decision_sets_the_ordered_override_list_and_rank() {
    let mut h = Harness::new("");
    assert_eq!(h.post("/v1/chat/completions", CHAT), Action::Pause);
    let call = h.host.http_calls.last().unwrap().clone();
    assert_eq!(call.cluster, "tok");
    assert_eq!(call.timeout, std::time::Duration::from_millis(500));
    let hdr = |n: &str| {
        call.headers
            .iter()
            .find(|(k, _)| k == n)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(hdr(":method").as_deref(), Some("POST"));
    assert_eq!(hdr(":path").as_deref(), Some("/tokenize"));
    assert_eq!(hdr(":authority").as_deref(), Some("tok.local"));
    assert_eq!(hdr("content-type").as_deref(), Some("application/json"));
    let sent: serde_json::Value = serde_json::from_slice(&call.body).unwrap();
    assert_eq!(sent["messages"][0]["content"], "hello");
    assert!(sent.get("cache_salt").is_none());

    h.tokenizer_answers(Some("200"), tokens_json(200).as_bytes());
    let pick = h.pick_request();
    let ids: Vec<u32> = (1..=200).collect();
    let want: Vec<u64> = block_keys(&ids, BlockSize::new(64).unwrap(), Some("tenant-a"))
        .iter()
        .map(|k| k.as_u64())
        .collect();
    assert_eq!(pick.block_keys, want);
    assert!(
        !pick.want_busy,
        "no local_continuations: no busy list asked for"
    );
    assert_eq!(pick.block_keys.len(), 3);
    assert_eq!(pick.model, "m");
    assert_eq!(pick.block_size, 64);
    assert_eq!(pick.prompt_tokens, 200);
    assert_eq!(pick.mode, i32::from(WireMode::Precise));
    assert_eq!(
        pick.request_id, "000000000000feed-1",
        "the filter's own id, not the client's x-request-id"
    );
    assert_eq!(
        h.host.grpc_calls[0].timeout,
        std::time::Duration::from_millis(50)
    );
    assert_eq!(h.host.request_resumes, 0, "still paused during Pick");

    h.index_answers(
        0,
        &answer(
            DecisionKind::Precise,
            &["10.0.0.2:8000", "10.0.0.3:8000"],
            Some(1),
        ),
    );
    assert_eq!(h.flow.reason(), Some(Reason::Precise));
    assert_eq!(
        h.override_header().as_deref(),
        Some("10.0.0.2:8000,10.0.0.3:8000")
    );
    assert_eq!(h.host.header("x-data-parallel-rank").as_deref(), Some("1"));
    assert_eq!(h.host.request_resumes, 1);
    assert_eq!(h.host.count_of(Counter::Decision(Reason::Precise)), 1);
    let kinds: Vec<Histogram> = h.host.histograms.iter().map(|(k, _)| *k).collect();
    assert!(kinds.contains(&Histogram::TokenizerCall));
    assert!(kinds.contains(&Histogram::IndexCall));
    assert!(h.host.histograms.contains(&(Histogram::FilterTime, 3_500)));
}

#[test]
fn load_and_salt_free_requests() {
    let mut h = Harness::new("");
    h.post("/v1/completions", r#"{"model":"m","prompt":"hi"}"#);
    let sent: serde_json::Value = serde_json::from_slice(&h.host.http_calls[0].body).unwrap();
    assert_eq!(sent, serde_json::json!({"model":"m","prompt":"hi"}));
    h.tokenizer_answers(Some("200"), tokens_json(64).as_bytes());
    let ids: Vec<u32> = (1..=64).collect();
    let want = block_keys(&ids, BlockSize::new(64).unwrap(), None)[0].as_u64();
    assert_eq!(h.pick_request().block_keys, vec![want]);
    h.index_answers(0, &answer(DecisionKind::Load, &["[fd00::1]:8000"], None));
    assert_eq!(h.flow.reason(), Some(Reason::Load));
    assert_eq!(h.override_header().as_deref(), Some("[fd00::1]:8000"));
    assert_eq!(h.host.header("x-data-parallel-rank"), None);
}

#[test]
fn previous_response_id_picks_by_id_without_tokenizing() {
    let mut h = Harness::new("");
    let a = h.post(
        "/v1/responses",
        r#"{"model":"m","input":"more","previous_response_id":"resp_7"}"#,
    );
    assert_eq!(a, Action::Pause);
    assert!(h.host.http_calls.is_empty());
    let pick = h.pick_request();
    assert_eq!(pick.previous_response_id, "resp_7");
    assert!(pick.block_keys.is_empty());
    h.index_answers(0, &answer(DecisionKind::Affinity, &["10.0.0.9:8000"], None));
    assert_eq!(h.flow.reason(), Some(Reason::Affinity));
    assert_eq!(h.override_header().as_deref(), Some("10.0.0.9:8000"));
}

#[test]
fn responses_go_to_render_with_the_body_unchanged() {
    let mut h = Harness::new("");
    let body = r#"{"model":"m","input":"hi","instructions":"sys","stream":true}"#;
    h.post("/v1/responses", body);
    let call = &h.host.http_calls[0];
    assert!(
        call.headers
            .contains(&(":path".into(), "/v1/responses/render".into()))
    );
    assert_eq!(call.body, body.as_bytes());
    h.tokenizer_answers(Some("200"), br#"{"token_ids":[1,2,3]}"#);
    assert_unrouted(&h, Reason::ShortPrompt);
    assert_eq!(h.host.request_resumes, 1);
}

#[test]
fn approximate_mode_keys_text_without_a_tokenizer() {
    let mut h = Harness::new(r#""mode":"approximate","approximate_chunk_bytes":16"#);
    let prompt = "a".repeat(100);
    h.post(
        "/v1/completions",
        &format!(r#"{{"model":"m","prompt":"{prompt}"}}"#),
    );
    assert!(h.host.http_calls.is_empty());
    let pick = h.pick_request();
    assert_eq!(pick.mode, i32::from(WireMode::Approximate));
    assert_eq!(pick.block_size, 16);
    assert_eq!(pick.block_keys.len(), 101 / 16);
    h.index_answers(0, &answer(DecisionKind::Approximate, &["10.0.0.1:1"], None));
    assert_eq!(h.flow.reason(), Some(Reason::Approximate));
    let mut short = Harness::new(r#""mode":"approximate""#);
    assert_eq!(
        short.post("/v1/completions", r#"{"model":"m","prompt":"hi"}"#),
        Action::Continue
    );
    assert_unrouted(&short, Reason::ShortPrompt);
}

#[test]
fn every_pick_says_whether_its_body_continues_a_conversation() {
    let first = r#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":"hello there, a first turn"}]}"#;
    let next = r#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":"hello there, a first turn"},{"role":"assistant","content":"hi"},{"role":"user","content":"more"}]}"#;
    let text =
        r#"{"model":"m","prompt":"a prompt of text, long enough for a block or two of keys"}"#;
    // (config, path, body, what the Pick says)
    let cases = [
        ("", "/v1/chat/completions", first, Some(false)),
        ("", "/v1/chat/completions", next, Some(true)),
        (
            r#""remember":false"#,
            "/v1/chat/completions",
            next,
            Some(true),
        ),
        (
            r#""mode":"approximate","approximate_chunk_bytes":16"#,
            "/v1/chat/completions",
            next,
            Some(true),
        ),
        (
            r#""mode":"approximate","approximate_chunk_bytes":16"#,
            "/v1/chat/completions",
            first,
            Some(false),
        ),
        (
            r#""mode":"approximate","approximate_chunk_bytes":16"#,
            "/v1/completions",
            text,
            None,
        ),
        (
            r#""tokenize_at":"indexd""#,
            "/v1/chat/completions",
            next,
            Some(true),
        ),
        (
            "",
            "/v1/completions",
            r#"{"model":"m","prompt":[5,6,7,8,9,10,11,12]}"#,
            None,
        ),
        (
            "",
            "/v1/responses",
            r#"{"model":"m","input":"more","previous_response_id":"resp_7"}"#,
            Some(true),
        ),
    ];
    for (extra, path, body, want) in cases {
        let mut h = Harness::new(&format!(
            r#"{extra}{}"block_size":2"#,
            if extra.is_empty() { "" } else { "," }
        ));
        assert_eq!(h.post(path, body), Action::Pause, "{extra} {body}");
        if h.host.grpc_calls.is_empty() {
            h.tokenizer_answers(Some("200"), tokens_json(8).as_bytes());
        }
        assert_eq!(h.pick_request().continuation, want, "{extra} {body}");
    }
}

#[test]
fn token_id_prompts_skip_the_tokenizer() {
    let mut h = Harness::new(r#""block_size":2"#);
    h.post("/v1/completions", r#"{"model":"m","prompt":[5,6,7,8,9]}"#);
    assert!(h.host.http_calls.is_empty());
    let pick = h.pick_request();
    assert_eq!(pick.block_keys.len(), 2);
    assert_eq!(pick.prompt_tokens, 5);
}

#[test]
fn unrouted_methods_and_paths_pass_untouched() {
    for (method, path) in [
        ("GET", "/v1/chat/completions"),
        ("POST", "/v1/models"),
        ("POST", "/other"),
    ] {
        let mut h = Harness::new("");
        assert_eq!(h.headers(method, path, &[], false), Action::Continue);
        assert_eq!(h.flow.reason(), None);
        assert!(h.host.counters.is_empty());
        assert_eq!(
            h.flow.on_request_body(&mut h.host, 10, true),
            Action::Continue
        );
        assert!(h.host.http_calls.is_empty() && h.host.grpc_calls.is_empty());
    }
}

#[test]
fn client_pins_are_always_stripped() {
    let pins = [
        ("x-gateway-destination-endpoint", "6.6.6.6:80"),
        ("x-data-parallel-rank", "3"),
        ("x-kvroute-decision", "precise"),
        ("X-KVRoute-Anything", "1"),
        ("x-custom-pin", "7.7.7.7:80"),
        ("x-keep", "yes"),
    ];
    for path in ["/v1/chat/completions", "/v1/models"] {
        let mut h = Harness::new(r#""override_header":"x-custom-pin""#);
        h.headers("POST", path, &pins, false);
        let names = h.host.request_header_names();
        assert!(names.contains(&"x-keep".to_owned()));
        for (pin, _) in &pins[..5] {
            assert!(h.host.header(pin).is_none(), "{pin} kept on {path}");
        }
    }
}

#[test]
fn body_too_large_continues_without_buffering_more() {
    let mut h = Harness::new(r#""max_body_bytes":100"#);
    assert_eq!(
        h.headers("POST", "/v1/completions", &[], false),
        Action::Pause
    );
    assert_eq!(h.body(&[b' '; 60], false), Action::Pause);
    assert_eq!(h.body(&[b' '; 60], false), Action::Continue);
    assert_unrouted(&h, Reason::BodyTooLarge);
    assert_eq!(h.body(&[b' '; 60], true), Action::Continue);
    assert!(h.host.http_calls.is_empty());
    assert_eq!(h.host.request_resumes, 0);
}

#[test]
fn body_announced_too_large_is_never_paused() {
    let mut h = Harness::new(r#""max_body_bytes":100"#);
    let a = h.headers(
        "POST",
        "/v1/completions",
        &[("content-length", "101")],
        false,
    );
    assert_eq!(a, Action::Continue);
    assert_unrouted(&h, Reason::BodyTooLarge);
    let mut h = Harness::new(r#""max_body_bytes":100"#);
    let a = h.headers(
        "POST",
        "/v1/completions",
        &[("content-length", "100")],
        false,
    );
    assert_eq!(a, Action::Pause);
}

#[test]
fn chunked_body_is_buffered_to_the_end() {
    let mut h = Harness::new("");
    h.headers("POST", "/v1/chat/completions", &[], false);
    let (a, b) = CHAT.split_at(20);
    assert_eq!(h.body(a.as_bytes(), false), Action::Pause);
    assert!(h.host.http_calls.is_empty());
    assert_eq!(h.body(b.as_bytes(), true), Action::Pause);
    assert_eq!(h.host.http_calls.len(), 1);
}

#[test]
fn unparseable_bodies_and_missing_models() {
    for body in [
        "{",
        "[]",
        r#"{"messages":[{"role":"user","content":"x"}]}"#,
        "\u{0}",
    ] {
        let mut h = Harness::new("");
        assert_eq!(h.post("/v1/chat/completions", body), Action::Continue);
        assert_unrouted(&h, Reason::Unparseable);
        assert_eq!(h.host.request_resumes, 0, "continued, not resumed");
    }
    let mut h = Harness::new("");
    h.headers("POST", "/v1/chat/completions", &[], false);
    h.host.request_body = vec![0xff, 0xfe, 0x00];
    h.host.in_request_callback = true;
    assert_eq!(
        h.flow.on_request_body(&mut h.host, 3, true),
        Action::Continue
    );
    assert_eq!(h.flow.reason(), Some(Reason::Unparseable));
    // A fallback model makes a model-less body routable.
    let mut h = Harness::new(r#""model_fallback":"base""#);
    assert_eq!(
        h.post(
            "/v1/chat/completions",
            r#"{"messages":[{"role":"user","content":"x"}]}"#
        ),
        Action::Pause
    );
    let sent: serde_json::Value = serde_json::from_slice(&h.host.http_calls[0].body).unwrap();
    assert_eq!(sent["model"], "base");
}

#[test]
fn headers_only_posts_and_trailers_are_unparseable() {
    let mut h = Harness::new("");
    assert_eq!(
        h.headers("POST", "/v1/completions", &[], true),
        Action::Continue
    );
    assert_unrouted(&h, Reason::Unparseable);
    let mut h = Harness::new("");
    h.headers("POST", "/v1/completions", &[], false);
    h.body(b"{\"prompt\":", false);
    h.host.in_request_callback = true;
    assert_eq!(h.flow.on_request_trailers(&mut h.host), Action::Continue);
    h.host.in_request_callback = false;
    h.host.request_paused = false;
    assert_unrouted(&h, Reason::Unparseable);
}

#[test]
fn media_is_incomplete_identity() {
    let mut h = Harness::new("");
    let body = r#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}"#;
    assert_eq!(h.post("/v1/chat/completions", body), Action::Continue);
    assert_unrouted(&h, Reason::IncompleteIdentity);
    assert!(h.host.http_calls.is_empty());
}

#[test]
fn tokenizer_failures_resume_unrouted() {
    let cases: [(Option<&str>, &[u8]); 6] = [
        (Some("504"), b"upstream request timeout"),
        (Some("503"), b"no healthy upstream"),
        (Some("400"), br#"{"error":"bad"}"#),
        (Some("200"), b"not json"),
        (Some("200"), br#"{"tokens":["a"]}"#),
        (None, b""),
    ];
    for (status, body) in cases {
        let mut h = Harness::new("");
        h.post("/v1/chat/completions", CHAT);
        h.tokenizer_answers(status, body);
        assert_unrouted(&h, Reason::TokenizeFailed);
        assert_eq!(h.host.request_resumes, 1);
        assert!(h.host.grpc_calls.is_empty());
    }
    let mut h = Harness::new(r#""max_tokenizer_response_bytes":10"#);
    h.post("/v1/chat/completions", CHAT);
    h.tokenizer_answers(Some("200"), tokens_json(100).as_bytes());
    assert_unrouted(&h, Reason::TokenizeFailed);
}

#[test]
fn tokenizer_dispatch_failure_continues_at_once() {
    let mut h = Harness::new("");
    h.host.fail_http_dispatch = true;
    assert_eq!(h.post("/v1/chat/completions", CHAT), Action::Continue);
    assert_unrouted(&h, Reason::TokenizeFailed);
    assert_eq!(h.host.request_resumes, 0);
}

#[test]
fn short_prompt_skips_the_index() {
    let mut h = Harness::new("");
    h.post("/v1/chat/completions", CHAT);
    h.tokenizer_answers(Some("200"), tokens_json(63).as_bytes());
    assert_unrouted(&h, Reason::ShortPrompt);
    assert!(h.host.grpc_calls.is_empty());
}

fn index_failure(status: u32, body: &[u8]) -> Harness {
    let mut h = Harness::new("");
    h.post("/v1/chat/completions", CHAT);
    h.tokenizer_answers(Some("200"), tokens_json(64).as_bytes());
    h.index_answers(status, body);
    h
}

#[test]
fn index_failures_resume_unrouted() {
    let ok = answer(DecisionKind::Precise, &["10.0.0.1:80"], None);
    let cases: Vec<(u32, Vec<u8>)> = vec![
        (14, vec![]),
        (4, vec![]),
        (2, ok.clone()),
        (0, vec![0xff, 0xff, 0xff]),
        (0, answer(DecisionKind::Unspecified, &["10.0.0.1:80"], None)),
        (0, answer(DecisionKind::Precise, &[], None)),
        (
            0,
            answer(DecisionKind::Precise, &["10.0.0.1:80\r\nx-evil: 1"], None),
        ),
        (
            0,
            answer(DecisionKind::Load, &["10.0.0.1:80,10.0.0.2:80"], None),
        ),
        (0, answer(DecisionKind::Load, &["nonsense"], None)),
        (0, vec![]),
        (
            0,
            PickResponse {
                decision: 99,
                ..PickResponse::default()
            }
            .encode_to_vec(),
        ),
    ];
    for (status, body) in cases {
        let h = index_failure(status, &body);
        assert_unrouted(&h, Reason::IndexUnavailable);
        assert_eq!(h.host.request_resumes, 1);
    }
    let mut h = Harness::new("");
    h.host.fail_grpc_dispatch = true;
    h.post("/v1/chat/completions", CHAT);
    h.tokenizer_answers(Some("200"), tokens_json(64).as_bytes());
    assert_unrouted(&h, Reason::IndexUnavailable);
    assert_eq!(h.host.request_resumes, 1);
}

#[test]
fn a_pick_envoy_refuses_at_once_goes_on_unrouted_without_opening_the_breaker() {
    let mut h = Harness::new(r#""breaker":{"failures":2,"window_ms":1000,"cooldown_ms":2000}"#);
    for _ in 0..5 {
        h.host.overflow_grpc_dispatch = true;
        h.post("/v1/chat/completions", CHAT);
        h.tokenizer_answers(Some("200"), tokens_json(64).as_bytes());
        assert_eq!(h.flow.reason(), Some(Reason::IndexBusy));
        assert_eq!(h.override_header(), None);
        assert_eq!(h.host.request_resumes, 1);
        h.next_stream();
    }
    assert_eq!(h.host.count_of(Counter::BreakerOpened), 0);
    // With the cluster free again, the next request is picked.
    h.post("/v1/chat/completions", CHAT);
    h.tokenizer_answers(Some("200"), tokens_json(64).as_bytes());
    assert_eq!(h.host.grpc_calls.len(), 1, "a Pick was sent");
    // The same refusals counted as failures would have opened it.
    let mut h = Harness::new(r#""breaker":{"failures":2,"window_ms":1000,"cooldown_ms":2000}"#);
    for _ in 0..2 {
        h.host.fail_grpc_dispatch = true;
        h.post("/v1/chat/completions", CHAT);
        h.tokenizer_answers(Some("200"), tokens_json(64).as_bytes());
        h.next_stream();
    }
    assert_eq!(h.host.count_of(Counter::BreakerOpened), 1);
}

#[test]
fn stale_index_does_not_override() {
    let h = index_failure(0, &answer(DecisionKind::Stale, &[], None));
    assert_unrouted(&h, Reason::IndexStale);
    assert_eq!(h.host.request_resumes, 1);
}

#[test]
fn answers_to_other_tokens_are_ignored() {
    let mut h = Harness::new("");
    h.post("/v1/chat/completions", CHAT);
    h.flow.on_http_call_response(&mut h.host, 999, 1, 0);
    h.flow.on_grpc_call_response(&mut h.host, 999, 0, 0);
    assert_eq!(h.host.request_resumes, 0);
    assert_eq!(h.flow.reason(), None);
}

#[test]
fn breaker_opens_skips_the_index_and_closes_again() {
    let mut h = Harness::new(r#""breaker":{"failures":2,"window_ms":1000,"cooldown_ms":2000}"#);
    for _ in 0..2 {
        h.post("/v1/chat/completions", CHAT);
        h.tokenizer_answers(Some("200"), tokens_json(64).as_bytes());
        h.index_answers(14, b"");
        assert_eq!(h.flow.reason(), Some(Reason::IndexUnavailable));
        h.next_stream();
    }
    assert_eq!(h.host.count_of(Counter::BreakerOpened), 1);
    // Open: the body is read (for the conversation memory) but no call is
    // made; nothing answered yet, so nothing is remembered.
    assert_eq!(h.post("/v1/chat/completions", CHAT), Action::Continue);
    assert_unrouted(&h, Reason::BreakerOpen);
    assert!(h.host.http_calls.is_empty());
    assert!(h.host.grpc_calls.is_empty());
    // After the cool-down the index is tried again; success closes.
    h.next_stream();
    h.host.now_us += 2_100_000;
    assert_eq!(h.post("/v1/chat/completions", CHAT), Action::Pause);
    h.tokenizer_answers(Some("200"), tokens_json(64).as_bytes());
    h.index_answers(0, &answer(DecisionKind::Load, &["10.0.0.1:80"], None));
    assert_eq!(h.flow.reason(), Some(Reason::Load));
    h.next_stream();
    h.post("/v1/chat/completions", CHAT);
    h.tokenizer_answers(Some("200"), tokens_json(64).as_bytes());
    h.index_answers(14, b"");
    h.next_stream();
    assert_eq!(
        h.post("/v1/chat/completions", CHAT),
        Action::Pause,
        "one failure after closing does not re-open"
    );
}

#[test]
fn block_size_mismatch_is_counted_and_the_pick_still_used() {
    let mut h = Harness::new("");
    h.post("/v1/chat/completions", CHAT);
    h.tokenizer_answers(Some("200"), tokens_json(64).as_bytes());
    let mut a = PickResponse::decode(answer(DecisionKind::Load, &["10.0.0.1:80"], None).as_slice())
        .unwrap();
    a.block_size_mismatch = true;
    a.index_block_size = 16;
    h.index_answers(0, &a.encode_to_vec());
    assert_eq!(h.host.count_of(Counter::BlockSizeMismatch), 1);
    assert_eq!(h.flow.reason(), Some(Reason::Load));
}

#[test]
fn picks_name_their_key_scheme_and_a_mismatch_is_counted() {
    let mut h = Harness::new("");
    h.post("/v1/chat/completions", CHAT);
    h.tokenizer_answers(Some("200"), tokens_json(64).as_bytes());
    assert_eq!(h.pick_request().key_scheme, kvroute_proto::SCHEME_VERSION);
    let mut a = PickResponse::decode(answer(DecisionKind::Load, &["10.0.0.1:80"], None).as_slice())
        .unwrap();
    a.key_scheme_mismatch = true;
    a.reason = "key_scheme_mismatch".into();
    h.index_answers(0, &a.encode_to_vec());
    assert_eq!(h.host.count_of(Counter::KeySchemeMismatch), 1);
    assert_eq!(h.host.count_of(Counter::BlockSizeMismatch), 0);
    assert_eq!(h.flow.reason(), Some(Reason::Load));
    assert_eq!(
        h.override_header().as_deref(),
        Some("10.0.0.1:80"),
        "the load ranking is still followed"
    );
}

#[test]
fn a_callout_without_headers_is_a_failed_tokenization() {
    // Envoy reports a callout that broke after it started (reset, stall,
    // broken framing) with no headers, whatever arrived of the body.
    let mut h = Harness::new("");
    h.post("/v1/chat/completions", CHAT);
    h.tokenizer_answers(None, tokens_json(64).as_bytes());
    assert_unrouted(&h, Reason::TokenizeFailed);
    assert_eq!(h.host.request_resumes, 1);
    assert!(h.host.grpc_calls.is_empty(), "no Pick without tokens");
}

#[test]
fn requests_indexd_refuses_do_not_count_toward_the_breaker() {
    let mut h = Harness::new(r#""breaker":{"failures":2,"window_ms":1000,"cooldown_ms":2000}"#);
    for status in [3, 11, 3, 3] {
        h.post("/v1/chat/completions", CHAT);
        h.tokenizer_answers(Some("200"), tokens_json(64).as_bytes());
        h.index_answers(status, b"");
        assert_eq!(h.flow.reason(), Some(Reason::IndexRejected));
        assert_eq!(h.override_header(), None);
        assert_eq!(h.host.request_resumes, 1);
        h.next_stream();
    }
    assert_eq!(h.host.count_of(Counter::BreakerOpened), 0);
    assert_eq!(h.post("/v1/chat/completions", CHAT), Action::Pause);
}

#[test]
fn keys_are_capped_at_max_pick_keys_keeping_the_prefix() {
    let mut h = Harness::new(r#""max_pick_keys":2,"block_size":4"#);
    h.post("/v1/chat/completions", CHAT);
    h.tokenizer_answers(Some("200"), tokens_json(40).as_bytes());
    let pick = h.pick_request();
    let ids: Vec<u32> = (1..=40).collect();
    let all = block_keys(&ids, BlockSize::new(4).unwrap(), Some("tenant-a"));
    let want: Vec<u64> = all.iter().take(2).map(|k| k.as_u64()).collect();
    assert_eq!(pick.block_keys, want);
    assert!(
        !pick.want_busy,
        "no local_continuations: no busy list asked for"
    );
    assert_eq!(pick.prompt_tokens, 40, "the whole prompt still counts");
}

#[test]
fn the_tokenizer_breaker_skips_only_the_tokenizer() {
    let mut h =
        Harness::new(r#""tokenizer_breaker":{"failures":2,"window_ms":1000,"cooldown_ms":2000}"#);
    // A refusal (4xx) is the request's fault: it does not count.
    for status in ["400", "404", "503", "504"] {
        h.post("/v1/chat/completions", CHAT);
        h.tokenizer_answers(Some(status), b"");
        assert_eq!(h.flow.reason(), Some(Reason::TokenizeFailed));
        assert_eq!(h.host.request_resumes, 1);
        h.next_stream();
    }
    assert_eq!(h.host.count_of(Counter::TokenizerBreakerOpened), 1);
    // Open: requests that need the tokenizer go on at once, unrouted.
    assert_eq!(h.post("/v1/chat/completions", CHAT), Action::Continue);
    assert_eq!(h.flow.reason(), Some(Reason::TokenizerBreakerOpen));
    assert!(h.host.http_calls.is_empty());
    // Those that do not still reach indexd.
    h.next_stream();
    let ids: Vec<String> = (1..=64).map(|i| i.to_string()).collect();
    let prompt = format!(r#"{{"model":"m","prompt":[[{}]]}}"#, ids.join(","));
    assert_eq!(h.post("/v1/completions", &prompt), Action::Pause);
    assert_eq!(h.pick_request().block_keys.len(), 1);
    h.next_stream();
    h.post(
        "/v1/responses",
        r#"{"model":"m","input":"x","previous_response_id":"resp_0"}"#,
    );
    assert_eq!(h.pick_request().previous_response_id, "resp_0");
    // After the cool-down a success closes it.
    h.next_stream();
    h.host.now_us += 2_100_000;
    assert_eq!(h.post("/v1/chat/completions", CHAT), Action::Pause);
    h.tokenizer_answers(Some("200"), tokens_json(64).as_bytes());
    h.index_answers(0, &answer(DecisionKind::Load, &["10.0.0.1:80"], None));
    h.next_stream();
    h.post("/v1/chat/completions", CHAT);
    h.tokenizer_answers(Some("503"), b"");
    h.next_stream();
    assert_eq!(
        h.post("/v1/chat/completions", CHAT),
        Action::Pause,
        "one failure after closing does not re-open"
    );
}

#[test]
fn client_request_ids_are_capped_and_never_reach_indexd() {
    let long = "r".repeat(4096);
    let mut h = Harness::new("");
    h.flow = Flow::new(h.cfg.clone(), request_id(0xfeed, 7));
    h.host.request_headers = vec![
        (":method".into(), b"POST".to_vec()),
        (":path".into(), b"/v1/chat/completions".to_vec()),
        ("x-request-id".into(), long.as_bytes().to_vec()),
    ];
    h.host.in_request_callback = true;
    assert_eq!(h.flow.on_request_headers(&mut h.host, false), Action::Pause);
    h.host.in_request_callback = false;
    h.body(CHAT.as_bytes(), true);
    let call = h.host.http_calls.last().unwrap();
    let sent = call
        .headers
        .iter()
        .find(|(k, _)| k == "x-request-id")
        .map(|(_, v)| v.len());
    assert_eq!(sent, Some(MAX_CLIENT_ID_BYTES));
    h.tokenizer_answers(Some("200"), tokens_json(64).as_bytes());
    let pick = h.pick_request();
    assert_eq!(pick.request_id, "000000000000feed-7");
    assert!(!pick.request_id.contains('r'));
}

#[test]
fn with_tokenize_at_indexd_one_pick_carries_the_body() {
    let mut h = Harness::new(r#""tokenize_at":"indexd","tokenizer_timeout_ms":300"#);
    assert_eq!(h.post("/v1/chat/completions", CHAT), Action::Pause);
    assert!(h.host.http_calls.is_empty(), "no tokenizer call");
    let pick = h.pick_request();
    assert_eq!(pick.body, CHAT.as_bytes());
    assert_eq!(pick.api, i32::from(WireApi::Chat));
    assert_eq!(pick.mode, i32::from(WireMode::Precise));
    assert!(pick.block_keys.is_empty());
    assert_eq!(pick.model, "m");
    assert_eq!(pick.request_id, "000000000000feed-1");
    assert_eq!(
        h.host.grpc_calls[0].timeout,
        std::time::Duration::from_millis(350),
        "a tokenizer's time plus indexd's"
    );
    h.index_answers(0, &answer(DecisionKind::Precise, &["10.0.0.9:8000"], None));
    assert_eq!(h.flow.reason(), Some(Reason::Precise));
    assert_eq!(h.override_header().as_deref(), Some("10.0.0.9:8000"));
    assert_eq!(h.host.request_resumes, 1);
}

#[test]
fn a_messages_body_goes_to_indexd_in_its_pick_whatever_tokenize_at_says() {
    const MESSAGES: &str = r#"{"model":"m","max_tokens":16,"system":"be brief","messages":[{"role":"user","content":"hi"}]}"#;
    for extra in [r#""tokenize_at":"indexd""#, r#""tokenize_at":"cluster""#] {
        let mut h = Harness::new(extra);
        h.post("/v1/messages", MESSAGES);
        assert!(
            h.host.http_calls.is_empty(),
            "{extra}: vLLM has no tokenizer endpoint for Messages"
        );
        let pick = h.pick_request();
        assert_eq!(pick.body, MESSAGES.as_bytes(), "{extra}");
        assert_eq!(pick.api, i32::from(WireApi::Messages), "{extra}");
        assert!(pick.block_keys.is_empty());
        h.index_answers(0, &answer(DecisionKind::Precise, &["10.0.0.9:8000"], None));
        assert_eq!(h.flow.reason(), Some(Reason::Precise), "{extra}");
        assert_eq!(h.override_header().as_deref(), Some("10.0.0.9:8000"));
    }
    // Counting tokens is not inference: not routed.
    let mut h = Harness::new("");
    assert_eq!(
        h.headers("POST", "/v1/messages/count_tokens", &[], false),
        Action::Continue
    );
    assert!(h.host.grpc_calls.is_empty());
    assert_eq!(h.override_header(), None);
}

#[test]
fn with_tokenize_at_indexd_an_untokenized_body_goes_on_unrouted() {
    let mut h = Harness::new(
        r#""tokenize_at":"indexd","breaker":{"failures":1,"window_ms":1000,"cooldown_ms":1000}"#,
    );
    for _ in 0..3 {
        h.post("/v1/responses", r#"{"model":"m","input":"x"}"#);
        assert_eq!(h.pick_request().api, i32::from(WireApi::Responses));
        h.index_answers(0, &answer(DecisionKind::Untokenized, &[], None));
        assert_eq!(h.flow.reason(), Some(Reason::TokenizeFailed));
        assert_eq!(h.override_header(), None);
        assert_eq!(h.host.request_resumes, 1);
        h.next_stream();
    }
    assert_eq!(
        h.host.count_of(Counter::BreakerOpened),
        0,
        "indexd answered: it is well"
    );
    // Token-id prompts and continuations are keyed as before, without a body.
    let ids: Vec<String> = (1..=64).map(|i| i.to_string()).collect();
    h.post(
        "/v1/completions",
        &format!(r#"{{"model":"m","prompt":[{}]}}"#, ids.join(",")),
    );
    let pick = h.pick_request();
    assert!(pick.body.is_empty());
    assert_eq!(pick.block_keys.len(), 1);
}

#[test]
fn while_indexd_cannot_answer_a_conversation_goes_where_its_last_turn_went() {
    let mut h = Harness::new(
        r#""tokenize_at":"indexd","breaker":{"failures":1,"window_ms":1000,"cooldown_ms":60000,"probe_ms":0}"#,
    );
    let turn = |n: usize| {
        let mut messages = vec![r#"{"role":"system","content":"shared"}"#.to_owned()];
        for i in 0..n {
            messages.push(format!(r#"{{"role":"user","content":"q{i}"}}"#));
            messages.push(format!(r#"{{"role":"assistant","content":"a{i}"}}"#));
        }
        messages.push(format!(r#"{{"role":"user","content":"q{n}"}}"#));
        format!(r#"{{"model":"m","messages":[{}]}}"#, messages.join(","))
    };
    // Turn 0 is routed by indexd and answered by 10.0.0.2:8000 (the
    // harness's upstream).
    h.post("/v1/chat/completions", &turn(0));
    h.index_answers(
        0,
        &answer(DecisionKind::Precise, &["10.0.0.2:8000"], Some(1)),
    );
    h.respond("200", "application/json", true);
    // Turn 1: indexd fails; the memory sends it to turn 0's replica.
    h.next_stream();
    h.post("/v1/chat/completions", &turn(1));
    h.index_answers(14, b"");
    assert_eq!(h.flow.reason(), Some(Reason::Remembered));
    assert_eq!(h.override_header().as_deref(), Some("10.0.0.2:8000"));
    assert_eq!(h.host.header("x-data-parallel-rank").as_deref(), Some("1"));
    assert_eq!(h.host.request_resumes, 1);
    h.respond("200", "application/json", true);
    // Turn 2, breaker open: no call at all, still its replica.
    h.next_stream();
    h.post("/v1/chat/completions", &turn(2));
    assert!(h.host.grpc_calls.is_empty());
    assert_eq!(h.flow.reason(), Some(Reason::Remembered));
    assert_eq!(h.override_header().as_deref(), Some("10.0.0.2:8000"));
    // Another conversation is unknown: Envoy chooses.
    h.next_stream();
    h.post(
        "/v1/chat/completions",
        r#"{"model":"m","messages":[{"role":"user","content":"new"}]}"#,
    );
    assert_eq!(h.flow.reason(), Some(Reason::BreakerOpen));
    assert_eq!(h.override_header(), None);
    // A failed answer is not remembered.
    let mut f = Harness::new(r#""tokenize_at":"indexd","remember":true"#);
    f.post("/v1/chat/completions", &turn(0));
    f.index_answers(0, &answer(DecisionKind::Precise, &["10.0.0.2:8000"], None));
    f.respond("503", "application/json", true);
    f.next_stream();
    f.post("/v1/chat/completions", &turn(1));
    f.index_answers(14, b"");
    assert_eq!(f.flow.reason(), Some(Reason::IndexUnavailable));
}

/// A chat conversation's request at turn `n` (tool loops: the model's answer
/// then the client's tool result).
fn tool_turn(n: usize) -> String {
    let mut messages = vec![
        r#"{"role":"system","content":"shared"}"#.to_owned(),
        r#"{"role":"user","content":"task"}"#.to_owned(),
    ];
    for i in 0..n {
        messages.push(format!(
            r#"{{"role":"assistant","content":null,"tool_calls":[{{"id":"c{i}","type":"function","function":{{"name":"f","arguments":"{{}}"}}}}]}}"#
        ));
        messages.push(format!(
            r#"{{"role":"tool","tool_call_id":"c{i}","content":"r{i}"}}"#
        ));
    }
    format!(r#"{{"model":"m","messages":[{}]}}"#, messages.join(","))
}

#[test]
fn local_continuations_skip_the_pick_for_that_many_turns_in_a_row() {
    let mut h = Harness::new(r#""tokenize_at":"indexd","local_continuations":2"#);
    // Turn 0: indexd picks 10.0.0.2:8000 (the harness's upstream), rank 1.
    h.post("/v1/chat/completions", &tool_turn(0));
    h.index_answers(
        0,
        &answer(DecisionKind::Precise, &["10.0.0.2:8000"], Some(1)),
    );
    h.respond("200", "application/json", true);
    // Turns 1 and 2 go there from the memory: no call, no pause.
    for n in 1..=2 {
        h.next_stream();
        let action = h.post("/v1/chat/completions", &tool_turn(n));
        assert_eq!(action, Action::Continue, "turn {n}");
        assert!(h.host.grpc_calls.is_empty(), "turn {n}");
        assert_eq!(h.flow.reason(), Some(Reason::Continued), "turn {n}");
        assert_eq!(h.override_header().as_deref(), Some("10.0.0.2:8000"));
        assert_eq!(h.host.header("x-data-parallel-rank").as_deref(), Some("1"));
        h.respond("200", "application/json", true);
    }
    assert_eq!(h.host.count_of(Counter::Decision(Reason::Continued)), 2);
    // Turn 3: two in a row already, so indexd checks again.
    h.next_stream();
    assert_eq!(h.post("/v1/chat/completions", &tool_turn(3)), Action::Pause);
    assert_eq!(h.host.grpc_calls.len(), 1);
    // That Pick tells indexd of the two: where they went, when, what they
    // add; and that they (and turn 0) were answered.
    let pick = h.pick_request();
    assert!(
        pick.want_busy,
        "routing from the memory needs the busy list"
    );
    assert_eq!(pick.continued.len(), 2);
    for (c, turn) in pick.continued.iter().zip(1..) {
        assert_eq!(c.address, "10.0.0.2:8000");
        assert_eq!(c.data_parallel_rank, Some(1));
        assert!(c.new_tokens > 10, "turn {turn}: {}", c.new_tokens);
        assert_eq!(c.request_id, request_id(0xfeed, turn + 1));
    }
    assert_eq!(pick.completed_request_ids.len(), 3);
    h.index_answers(0, &answer(DecisionKind::Precise, &["10.0.0.3:8000"], None));
    assert_eq!(h.flow.reason(), Some(Reason::Precise));
    h.respond("200", "application/json", true);
    // ... and the count starts again.
    h.next_stream();
    h.post("/v1/chat/completions", &tool_turn(4));
    assert_eq!(h.flow.reason(), Some(Reason::Continued));
}

#[test]
fn local_continuations_ask_again_where_indexd_saw_a_lasting_queue_or_saw_nothing_lately() {
    let mut h = Harness::new(r#""tokenize_at":"indexd","local_continuations":8"#);
    // Turn 0 goes to 10.0.0.2:8000 (rank 1), which the answer calls busy.
    h.post("/v1/chat/completions", &tool_turn(0));
    let mut a =
        PickResponse::decode(answer(DecisionKind::Precise, &["10.0.0.2:8000"], Some(1)).as_slice())
            .unwrap();
    a.busy = vec![BusyReplica {
        address: "10.0.0.2:8000".into(),
        data_parallel_rank: Some(1),
    }];
    h.index_answers(0, &a.encode_to_vec());
    h.respond("200", "application/json", true);
    // Turn 1: a Pick, which may move it.
    h.next_stream();
    assert_eq!(h.post("/v1/chat/completions", &tool_turn(1)), Action::Pause);
    assert_eq!(h.host.grpc_calls.len(), 1);
    assert_eq!(h.host.count_of(Counter::ContinuationBusy), 1);
    // The answer keeps it there and calls no replica busy.
    h.index_answers(
        0,
        &answer(DecisionKind::Precise, &["10.0.0.2:8000"], Some(1)),
    );
    h.respond("200", "application/json", true);
    // Turn 2 follows turn 1 with no call.
    h.next_stream();
    assert_eq!(
        h.post("/v1/chat/completions", &tool_turn(2)),
        Action::Continue
    );
    assert_eq!(h.flow.reason(), Some(Reason::Continued));
    assert!(h.host.grpc_calls.is_empty());
    h.respond("200", "application/json", true);
    // More than a second without an answer: the load is unknown, so turn 3
    // asks, and its answer (an affinity answer says nothing of load) ...
    h.host.now_us += (crate::config::defaults::CONTINUATION_LOAD_MS + 1) * 1_000;
    h.next_stream();
    assert_eq!(h.post("/v1/chat/completions", &tool_turn(3)), Action::Pause);
    assert_eq!(h.host.count_of(Counter::ContinuationUnknownLoad), 1);
    h.index_answers(
        0,
        &answer(DecisionKind::Affinity, &["10.0.0.2:8000"], Some(1)),
    );
    h.respond("200", "application/json", true);
    // ... leaves it unknown for turn 4.
    h.next_stream();
    assert_eq!(h.post("/v1/chat/completions", &tool_turn(4)), Action::Pause);
    assert_eq!(h.host.count_of(Counter::ContinuationUnknownLoad), 2);
}

#[test]
fn local_continuations_need_this_exact_previous_turn() {
    let mut h = Harness::new(r#""tokenize_at":"indexd","local_continuations":8"#);
    h.post("/v1/chat/completions", &tool_turn(0));
    h.index_answers(0, &answer(DecisionKind::Precise, &["10.0.0.2:8000"], None));
    h.respond("200", "application/json", true);
    // Turn 2 skips turn 1 (another gateway routed it): turn 0 is an older
    // prefix, not the previous turn, so indexd decides.
    h.next_stream();
    h.post("/v1/chat/completions", &tool_turn(2));
    assert_eq!(h.host.grpc_calls.len(), 1);
    // A failed answer is not remembered: its next turn asks indexd.
    let mut f = Harness::new(r#""tokenize_at":"indexd","local_continuations":8"#);
    f.post("/v1/chat/completions", &tool_turn(0));
    f.index_answers(0, &answer(DecisionKind::Precise, &["10.0.0.2:8000"], None));
    f.respond("503", "application/json", true);
    f.next_stream();
    f.post("/v1/chat/completions", &tool_turn(1));
    assert_eq!(f.host.grpc_calls.len(), 1);
    // Off by default.
    let mut d = Harness::new(r#""tokenize_at":"indexd""#);
    d.post("/v1/chat/completions", &tool_turn(0));
    d.index_answers(0, &answer(DecisionKind::Precise, &["10.0.0.2:8000"], None));
    d.respond("200", "application/json", true);
    d.next_stream();
    d.post("/v1/chat/completions", &tool_turn(1));
    assert_eq!(d.host.grpc_calls.len(), 1);
}

#[test]
fn large_picks_that_fail_do_not_open_the_breaker_for_everyone() {
    // A client's 2 MB bodies time out at indexd (14: UNAVAILABLE): each goes
    // on unrouted, counted, and the breaker stays closed for the others.
    let mut h = Harness::new(
        r#""tokenize_at":"indexd","max_body_bytes":4000000,"breaker":{"failures":2,"window_ms":1000,"cooldown_ms":2000}"#,
    );
    let big = format!(
        r#"{{"model":"m","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x".repeat(2 << 20)
    );
    for _ in 0..3 {
        h.post("/v1/chat/completions", &big);
        assert!(h.pick_request().body.len() > 2 << 20);
        h.index_answers(14, b"");
        assert_eq!(h.flow.reason(), Some(Reason::IndexUnavailable));
        assert_eq!(h.override_header(), None);
        h.next_stream();
    }
    assert_eq!(h.host.count_of(Counter::LargePickFailed), 3);
    assert_eq!(h.host.count_of(Counter::BreakerOpened), 0);
    // An ordinary request is still picked; ordinary failures still count.
    for _ in 0..2 {
        h.post("/v1/chat/completions", CHAT);
        assert!(!h.host.grpc_calls.is_empty(), "a Pick was sent");
        h.index_answers(14, b"");
        h.next_stream();
    }
    assert_eq!(h.host.count_of(Counter::BreakerOpened), 1);
}
