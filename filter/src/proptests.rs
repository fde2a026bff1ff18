//! Property tests: arbitrary bytes anywhere the outside world speaks (the
//! configuration, request bodies, tokenizer and index answers, response
//! chunks) never panic, never leave a request paused, and never set an
//! override without a routing decision.

use proptest::prelude::*;

use crate::config::{Api, Config};
use crate::decision::Action;
use crate::decision::tests::{Harness, answer, tokens_json};
use crate::observe::IdScanner;
use crate::{request, tokenize};
use kvroute_proto::v1::DecisionKind;

fn path() -> impl Strategy<Value = &'static str> {
    prop_oneof![
        Just("/v1/completions"),
        Just("/v1/chat/completions"),
        Just("/v1/responses"),
    ]
}

/// Bodies that are sometimes valid: templates with arbitrary text inside.
fn body() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..512),
        ".*".prop_map(|s: String| {
            serde_json::json!({"model": "m", "prompt": s, "messages": [{"role": "user", "content": s}], "input": s})
                .to_string()
                .into_bytes()
        }),
        (".*", any::<bool>()).prop_map(|(s, prev): (String, bool)| {
            let mut v = serde_json::json!({"model": "m", "input": [{"role": "user", "content": s}], "cache_salt": s});
            if prev {
                v["previous_response_id"] = serde_json::Value::String(s);
            }
            v.to_string().into_bytes()
        }),
    ]
}

fn tokenizer_answer() -> impl Strategy<Value = (Option<String>, Vec<u8>)> {
    (
        proptest::option::of(prop_oneof![Just("200".to_owned()), "[0-9]{1,4}", ".*"]),
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..256),
            (0u32..300).prop_map(|n| tokens_json(n).into_bytes()),
        ],
    )
}

fn index_answer() -> impl Strategy<Value = (u32, Vec<u8>)> {
    (
        prop_oneof![Just(0u32), 0u32..20],
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..256),
            (
                0i32..7,
                proptest::collection::vec("[0-9a-z.:\\[\\], ]{0,24}", 0..4),
                proptest::option::of(any::<u32>())
            )
                .prop_map(|(k, addrs, rank)| {
                    let kind = DecisionKind::try_from(k).unwrap_or(DecisionKind::Unspecified);
                    let refs: Vec<&str> = addrs.iter().map(String::as_str).collect();
                    answer(kind, &refs, rank)
                }),
        ],
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn config_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256), text in ".*") {
        let _ = Config::parse(&bytes);
        let _ = Config::parse(text.as_bytes());
        let _ = Config::parse(format!(r#"{{"index_cluster":"i","tokenizer_cluster":{text:?}}}"#).as_bytes());
    }

    #[test]
    fn parsers_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        for api in [Api::Completions, Api::Chat, Api::Responses] {
            let _ = request::parse(api, &bytes);
        }
        let _ = tokenize::parse_token_ids(&bytes);
        let mut s = IdScanner::new(128, true);
        let _ = s.push(&bytes, false);
        let _ = s.push(&bytes, true);
        let mut j = IdScanner::new(128, false);
        let _ = j.push(&bytes, true);
    }

    #[test]
    fn any_exchange_resumes_and_only_decisions_override(
        path in path(),
        approximate in any::<bool>(),
        body in body(),
        tok in tokenizer_answer(),
        idx in index_answer(),
        chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 0..4),
        status in prop_oneof![Just("200"), Just("404"), Just("garbage")],
    ) {
        let mut h = Harness::new(if approximate { r#""mode":"approximate","approximate_chunk_bytes":8,"decision_header":"x-d""# } else { r#""decision_header":"x-d""# });
        let a = h.post(path, &String::from_utf8_lossy(&body));
        if a == Action::Pause && !h.host.http_calls.is_empty() {
            h.tokenizer_answers(tok.0.as_deref(), &tok.1);
        }
        if h.host.request_paused && !h.host.grpc_calls.is_empty() {
            h.index_answers(idx.0, &idx.1);
        }
        prop_assert!(!h.host.request_paused, "request left paused");
        prop_assert!(h.host.request_resumes <= 1);
        let reason = h.flow.reason();
        prop_assert!(reason.is_some());
        let routed = reason.is_some_and(|r| r.routed());
        prop_assert_eq!(h.override_header().is_some(), routed);
        h.respond(status, "text/event-stream", false);
        let shown = h.host.response_header_str("x-d");
        prop_assert_eq!(shown.as_deref(), reason.map(|r| r.label()));
        let n = chunks.len();
        for (i, c) in chunks.iter().enumerate() {
            let before = h.host.grpc_calls.len();
            // Pause alone is the scan keeping chunks; Pause with a new
            // Observe is a hold that the answer releases.
            if h.response_chunk(c, i + 1 == n) == Action::Pause && h.host.grpc_calls.len() > before {
                h.index_answers(0, b"");
            }
        }
    }
}
