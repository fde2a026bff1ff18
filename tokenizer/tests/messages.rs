//! Anthropic Messages bodies: the conversion vLLM's server decides from the
//! template, the chat body handed to callers without a tokenizer, the
//! count_tokens shape, the caps, and no panic on any body.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use kvroute_tokenizer::{
    Budget, Cap, Caps, LoadOptions, MessagesConversion, MessagesRequest, RequestError,
    TokenizeRequest, Tokenizer,
};
use proptest::prelude::*;

const CONVERSATION: &str = r#"{"model": "m", "max_tokens": 4096, "system": "Be brief.",
    "tools": [{"name": "read_file", "description": "Reads.", "input_schema": {"properties": {"path": {"type": "string"}}}}],
    "messages": [{"role": "user", "content": "Open a.txt"},
                 {"role": "assistant", "content": [{"type": "thinking", "thinking": "use the tool"}, {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "a.txt"}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "héllo"}], "is_error": false}, {"type": "text", "text": "Summarise it."}]}],
    "thinking": {"type": "disabled"}}"#;

fn request(body: &str) -> MessagesRequest {
    MessagesRequest::from_json(body.as_bytes()).unwrap()
}

#[test]
fn the_test_models_neither_merge_nor_honour_none() {
    for (family, dir) in common::families() {
        let tok = common::load(&dir);
        assert_eq!(
            tok.messages_conversion(),
            MessagesConversion {
                merge_inline_system: false,
                disabled_thinking_effort: "low".into(),
            },
            "{family}"
        );
    }
}

#[test]
fn a_first_system_template_merges_and_the_option_names_the_effort() {
    let template = "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}{{ raise_exception('System message must be at the beginning.') }}{% endif %}{{ m['content'] }}{% endfor %}{% if reasoning_effort is defined %}{{ reasoning_effort }}{% endif %}";
    let load = |effort: Option<&str>| {
        let opts = LoadOptions {
            chat_template: Some(template.into()),
            anthropic_disabled_thinking_effort: effort.map(str::to_owned),
            ..LoadOptions::default()
        };
        Tokenizer::load(&common::tiny_llama(), "t", opts).unwrap()
    };
    let probed = load(None).messages_conversion();
    assert!(probed.merge_inline_system);
    assert_eq!(probed.disabled_thinking_effort, "none");
    assert_eq!(
        load(Some("max"))
            .messages_conversion()
            .disabled_thinking_effort,
        "max"
    );
}

/// The chat body a replica's `/tokenize` gets has the Messages prompt's ids.
#[test]
fn the_chat_body_tokenizes_to_the_same_ids() {
    for (family, dir) in common::families() {
        let tok = common::load(&dir);
        let req = request(CONVERSATION);
        let ids = tok.tokenize_messages(&req).unwrap();
        let chat = tok.messages_chat_request(&req).unwrap();
        let json = chat.to_json().unwrap();
        let again = TokenizeRequest::from_json(json.as_bytes()).unwrap();
        assert_eq!(tok.tokenize(&again).unwrap().tokens, ids, "{family}");
        assert!(json.contains(r#""reasoning_effort": "low""#), "{json}");
        let count = request(CONVERSATION).for_count_tokens();
        assert_eq!(tok.tokenize_messages(&count).unwrap(), ids, "{family}");
    }
}

#[test]
fn count_tokens_needs_no_max_tokens() {
    let tok = common::shared("tiny-llama");
    let body = r#"{"model": "m", "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "enabled", "budget_tokens": 5000}}"#;
    assert!(tok.tokenize_messages(&request(body)).is_err());
    assert!(
        tok.tokenize_messages(&request(body).for_count_tokens())
            .is_ok()
    );
}

#[test]
fn images_are_left_to_a_replica_as_in_chat() {
    let tok = common::shared("tiny-llama");
    let body = r#"{"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}]}"#;
    let err = tok.tokenize_messages(&request(body)).unwrap_err();
    assert!(matches!(err, RequestError::Unsupported(_)), "{err:?}");
}

#[test]
fn the_caps_hold_for_the_converted_conversation() {
    let tok = common::shared("tiny-llama");
    // Three tool results in one user message become three messages.
    let body = r#"{"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": "1"}, {"type": "tool_result", "tool_use_id": "b", "content": "2"}, {"type": "tool_result", "tool_use_id": "c", "content": "3"}]}]}"#;
    let budget = Budget::with_caps(Caps {
        messages: 2,
        ..Caps::UNBOUNDED
    });
    let err = tok
        .tokenize_messages_with(&request(body), &budget)
        .unwrap_err();
    assert!(
        matches!(
            err,
            RequestError::OverCap {
                cap: Cap::Messages,
                ..
            }
        ),
        "{err:?}"
    );
    let small = Caps {
        text_bytes: 64,
        ..Caps::UNBOUNDED
    };
    assert!(MessagesRequest::from_json_within(CONVERSATION.as_bytes(), &small).is_err());
}

fn arb_json() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::{Value, json};
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        (-3i64..5000).prop_map(Value::from),
        Just(json!(1.5)),
        prop::sample::select(vec![
            "",
            "text",
            "image",
            "tool_use",
            "tool_result",
            "tool_reference",
            "thinking",
            "redacted_thinking",
            "tool_addition",
            "tool_removal",
            "tool_definition",
            "user",
            "assistant",
            "system",
            "disabled",
            "enabled",
            "adaptive",
            "auto",
            "any",
            "tool",
            "none",
            "url",
            "base64",
            "x-anthropic-billing-header: a\nb",
            "hé",
        ])
        .prop_map(Value::from),
    ];
    leaf.prop_recursive(5, 64, 6, |inner| {
        let keys = prop::sample::select(vec![
            "model",
            "max_tokens",
            "messages",
            "role",
            "content",
            "type",
            "text",
            "system",
            "tools",
            "tool_choice",
            "name",
            "input_schema",
            "input",
            "id",
            "tool_use_id",
            "source",
            "url",
            "thinking",
            "budget_tokens",
            "output_config",
            "effort",
            "tool",
            "definition",
            "tool_name",
            "chat_template_kwargs",
            "data",
            "media_type",
        ]);
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::from),
            prop::collection::vec((keys, inner), 0..6).prop_map(|kv| Value::Object(
                kv.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()
            )),
        ]
    })
}

/// Messages of blocks whose fields are anything: past the shape checks,
/// into the conversion.
fn arb_messages() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::Value;
    let kinds = prop::sample::select(vec![
        "text",
        "image",
        "tool_use",
        "tool_result",
        "thinking",
        "redacted_thinking",
        "tool_addition",
        "tool_removal",
        "tool_reference",
    ]);
    let block = (kinds, arb_json()).prop_map(|(kind, fields)| {
        let mut m = match fields {
            Value::Object(m) => m,
            _ => serde_json::Map::new(),
        };
        m.insert("type".into(), Value::from(kind));
        Value::Object(m)
    });
    let role = prop::sample::select(vec!["user", "assistant", "system"]);
    let message = (role, prop::collection::vec(block, 0..4))
        .prop_map(|(role, blocks)| serde_json::json!({"role": role, "content": blocks}));
    prop::collection::vec(message, 0..5).prop_map(Value::from)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3_000))]
    /// Any body is converted or refused, never a panic; a converted one
    /// is a chat body the tokenizer takes or refuses the same way.
    #[test]
    fn no_body_panics(messages in prop_oneof![arb_json(), arb_messages()], rest in arb_json()) {
        let mut body = serde_json::json!({"model": "m", "max_tokens": 100000, "messages": messages});
        if let (Some(b), serde_json::Value::Object(extra)) = (body.as_object_mut(), rest) {
            for (k, v) in extra {
                b.entry(k).or_insert(v);
            }
        }
        let tok = common::shared("tiny-llama");
        if let Ok(req) = MessagesRequest::from_json(body.to_string().as_bytes()) {
            let _ = tok.tokenize_messages(&req);
            let _ = req.to_chat(&MessagesConversion { merge_inline_system: true, ..MessagesConversion::default() });
        }
    }
}
