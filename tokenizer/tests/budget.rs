//! Budgets on both model families: a token budget yields a flagged prefix
//! of the full ids; caps, a passed deadline and cancellation refuse before
//! or while encoding; cache namespaces keep salts apart.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use kvroute_tokenizer::{
    Budget, Cap, Caps, LoadOptions, RequestError, ResponsesRequest, TokenizeRequest, Tokenizer,
};
use proptest::prelude::*;
use serde_json::json;

fn long_text(lines: usize) -> String {
    (0..lines)
        .map(|i| {
            format!(
                "Line {i}: some text, with  spaces and 日本語 🚀 {}\n",
                i * 7
            )
        })
        .collect()
}

fn chat(n: usize) -> TokenizeRequest {
    let messages: Vec<serde_json::Value> = (0..n)
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            json!({"role": role, "content": long_text(3 + i % 5)})
        })
        .collect();
    TokenizeRequest::from_json(&serde_json::to_vec(&json!({ "messages": messages })).unwrap())
        .unwrap()
}

fn budget(max_tokens: Option<usize>) -> Budget {
    Budget {
        max_tokens,
        ..Budget::default()
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Whatever the budget, the ids are the first `max_tokens` of the full
    /// ids, flagged exactly when some were left out.
    #[test]
    fn a_token_budget_gives_a_flagged_prefix(max in 0usize..3_000, lines in 1usize..200, special in any::<bool>()) {
        let text = long_text(lines);
        for (family, _) in common::families() {
            let tok = common::shared(family);
            let full = tok.encode(&text, special).unwrap();
            let got = tok.encode_with(&text, special, &budget(Some(max))).unwrap();
            let n = full.len().min(max);
            prop_assert_eq!(&got.ids[..], &full[..n], "{}", family);
            prop_assert_eq!(got.truncated, full.len() > max, "{}", family);
        }
    }
}

#[test]
fn budgeted_entry_points_give_prefixes_of_the_unbudgeted_ids() {
    for (family, _) in common::families() {
        let tok = common::shared(family);
        let req = chat(12);
        let full = tok.chat_completion_tokens(&req).unwrap();
        for max in [1, 17, 500, full.len() - 1, full.len(), full.len() + 5] {
            let got = tok
                .chat_completion_tokens_with(&req, &budget(Some(max)))
                .unwrap();
            assert_eq!(got.ids, full[..full.len().min(max)], "{family} {max}");
            assert_eq!(got.truncated, full.len() > max, "{family} {max}");
            let completion = tok
                .completion_tokens_with(&req, &budget(Some(max)))
                .unwrap();
            let tokenized = tok.tokenize(&req).unwrap().tokens;
            assert_eq!(
                completion.ids,
                tokenized[..tokenized.len().min(max)],
                "{family} {max}"
            );
        }
        // The full answers ignore max_tokens.
        let answer = tok.tokenize_with(&req, &budget(Some(3))).unwrap();
        assert_eq!(answer.tokens, tok.tokenize(&req).unwrap().tokens);

        let body = json!({"input": [
            {"role": "user", "content": long_text(40)},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": long_text(30)},
        ]});
        let r = ResponsesRequest::from_json(&serde_json::to_vec(&body).unwrap()).unwrap();
        let full = tok.render_responses(&r).unwrap().token_ids;
        let got = tok.responses_tokens_with(&r, &budget(Some(100))).unwrap();
        assert_eq!(got.ids, full[..100], "{family}");
        assert!(got.truncated);
        let all = tok.responses_tokens_with(&r, &Budget::default()).unwrap();
        assert_eq!((all.ids, all.truncated), (full, false));
    }
}

#[test]
fn caps_refuse_before_encoding() {
    for (family, _) in common::families() {
        let tok = common::shared(family);
        let caps = tok.caps();
        assert_eq!(caps.messages, tok.max_model_len() as usize);
        let over = |c: Caps| Budget {
            caps: c,
            ..Budget::default()
        };
        let req = chat(6);
        let err = tok
            .chat_completion_tokens_with(
                &req,
                &over(Caps {
                    messages: 5,
                    ..Caps::UNBOUNDED
                }),
            )
            .unwrap_err();
        assert_eq!(
            err,
            RequestError::OverCap {
                cap: Cap::Messages,
                limit: 5,
                actual: 6
            }
        );
        assert!(!err.is_client_error());
        let err = tok
            .completion_tokens_with(
                &req,
                &over(Caps {
                    text_bytes: 100,
                    ..Caps::UNBOUNDED
                }),
            )
            .unwrap_err();
        assert!(
            matches!(
                err,
                RequestError::OverCap {
                    cap: Cap::TextBytes,
                    ..
                }
            ),
            "{err:?}"
        );
        let err = tok
            .chat_completion_tokens_with(
                &req,
                &over(Caps {
                    prompt_bytes: 100,
                    ..Caps::UNBOUNDED
                }),
            )
            .unwrap_err();
        assert!(
            matches!(
                err,
                RequestError::OverCap {
                    cap: Cap::PromptBytes,
                    ..
                }
            ),
            "{err:?}"
        );
        let items =
            json!({"input": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]});
        let r = ResponsesRequest::from_json(&serde_json::to_vec(&items).unwrap()).unwrap();
        let err = tok
            .responses_tokens_with(
                &r,
                &over(Caps {
                    items: 1,
                    ..Caps::UNBOUNDED
                }),
            )
            .unwrap_err();
        assert!(
            matches!(
                err,
                RequestError::OverCap {
                    cap: Cap::Items,
                    actual: 2,
                    ..
                }
            ),
            "{err:?}"
        );
    }
}

/// One word of 300k letters is one pre-token on both families: refused by
/// the word cap before BPE sees it, and encoded when not capped.
#[test]
fn a_giant_word_is_refused_by_the_word_cap() {
    let word: String = (0..300_000)
        .map(|i| char::from(b'a' + ((i * 7 + i / 13) % 26) as u8))
        .collect();
    for (family, _) in common::families() {
        let tok = common::shared(family);
        let b = Budget::with_caps(tok.caps());
        let err = tok.encode_with(&word, false, &b).unwrap_err();
        assert!(
            matches!(
                err,
                RequestError::OverCap {
                    cap: Cap::WordBytes,
                    ..
                }
            ),
            "{family}: {err:?}"
        );
        let small = &word[..1000];
        assert_eq!(
            tok.encode_with(small, false, &b).unwrap().ids,
            tok.encode(small, false).unwrap()
        );
    }
}

#[test]
fn a_passed_deadline_or_a_cancellation_stops_the_request() {
    for (family, _) in common::families() {
        let tok = common::shared(family);
        let req = chat(4);
        let late = Budget {
            deadline: Some(Instant::now()),
            ..Budget::default()
        };
        assert_eq!(
            tok.chat_completion_tokens_with(&req, &late),
            Err(RequestError::DeadlineExceeded),
            "{family}"
        );
        let cancelled = Budget {
            cancelled: Some(Arc::new(AtomicBool::new(true))),
            ..Budget::default()
        };
        assert_eq!(
            tok.encode_with("some text", true, &cancelled),
            Err(RequestError::Cancelled)
        );
        let running = Budget {
            cancelled: Some(Arc::new(AtomicBool::new(false))),
            deadline: Some(Instant::now() + std::time::Duration::from_secs(3600)),
            ..Budget::default()
        };
        assert_eq!(
            tok.chat_completion_tokens_with(&req, &running).unwrap().ids,
            tok.chat_completion_tokens(&req).unwrap()
        );
    }
}

/// The same text under another namespace (another `cache_salt`) is a miss;
/// under its own again, a hit.
#[test]
fn cache_namespaces_keep_salts_apart() {
    for (_, dir) in common::families() {
        let tok = Tokenizer::load(&dir, "ns", LoadOptions::default()).unwrap();
        let text = long_text(50);
        let under = |namespace| Budget {
            namespace,
            ..Budget::default()
        };
        let counts = || {
            let c = tok.stats().encoder.cache;
            (c.hits, c.misses)
        };
        let (h0, m0) = counts();
        let a = tok.encode_with(&text, false, &under(1)).unwrap();
        let (h1, m1) = counts();
        assert_eq!(h1, h0);
        let segments = m1 - m0;
        assert!(segments > 1, "the text spans several segments");
        let b = tok.encode_with(&text, false, &under(2)).unwrap();
        assert_eq!(counts(), (h1, m1 + segments), "namespace 2: all misses");
        let again = tok.encode_with(&text, false, &under(1)).unwrap();
        assert_eq!(
            counts(),
            (h1 + segments, m1 + segments),
            "namespace 1 again: all hits"
        );
        assert_eq!(a, b);
        assert_eq!(a, again);
    }
}

/// vLLM's chat and completions apply `truncate_prompt_tokens` (its /tokenize
/// ignores it): any non-null value is refused as not reproduced, so the
/// caller asks a replica; `null` is no truncation.
#[test]
fn truncate_prompt_tokens_is_refused_as_inexact() {
    let tok = common::shared("tiny-llama");
    for v in [json!(5), json!(-1), json!(0), json!(-2), json!("x")] {
        let chat =
            json!({"messages": [{"role": "user", "content": "hi"}], "truncate_prompt_tokens": v});
        let req = TokenizeRequest::from_json(&serde_json::to_vec(&chat).unwrap()).unwrap();
        let err = tok
            .chat_completion_tokens_with(&req, &Budget::default())
            .unwrap_err();
        assert!(
            matches!(
                err,
                RequestError::Inexact {
                    kind: kvroute_tokenizer::InexactKind::Truncation,
                    ..
                }
            ),
            "{v}: {err:?}"
        );
        assert!(!err.is_client_error());
        let prompt = json!({"prompt": "hello there", "truncate_prompt_tokens": v});
        let req = TokenizeRequest::from_json(&serde_json::to_vec(&prompt).unwrap()).unwrap();
        assert!(
            tok.completion_tokens_with(&req, &Budget::default())
                .is_err()
        );
        // /tokenize ignores the field.
        assert_eq!(
            tok.tokenize(&req).unwrap().tokens,
            tok.encode("hello there", true).unwrap()
        );
    }
    let none = json!({"prompt": "hello there", "truncate_prompt_tokens": null});
    let req = TokenizeRequest::from_json(&serde_json::to_vec(&none).unwrap()).unwrap();
    assert_eq!(
        tok.completion_tokens_with(&req, &Budget::default())
            .unwrap()
            .ids,
        tok.encode("hello there", true).unwrap()
    );
}
