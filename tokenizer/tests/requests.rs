//! Requests: vLLM's answers to bad input (messages as vLLM 0.32 words them),
//! the answer shapes, and no panic on arbitrary JSON.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use kvroute_tokenizer::{MAX_DEPTH, RequestError, ResponsesRequest, TokenizeRequest};
use proptest::prelude::*;
use serde_json::json;

fn tokenize(
    family: &str,
    body: &serde_json::Value,
) -> Result<kvroute_tokenizer::TokenizeResponse, RequestError> {
    let req = TokenizeRequest::from_json(&serde_json::to_vec(body).unwrap())?;
    common::shared(family).tokenize(&req)
}

fn render(
    family: &str,
    body: &serde_json::Value,
) -> Result<kvroute_tokenizer::RenderResponse, RequestError> {
    let req = ResponsesRequest::from_json(&serde_json::to_vec(body).unwrap())?;
    common::shared(family).render_responses(&req)
}

fn message(r: Result<impl std::fmt::Debug, RequestError>) -> String {
    r.expect_err("an error").to_string()
}

#[test]
fn vllm_refusals() {
    let hi = json!([{"role": "user", "content": "hi"}]);
    assert_eq!(
        message(tokenize(
            "tiny-llama",
            &json!({"messages": hi, "continue_final_message": true, "add_generation_prompt": true})
        )),
        "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
    );
    assert_eq!(
        message(tokenize(
            "tiny-llama",
            &json!({"messages": hi, "chat_template": "{{ 'x' }}"})
        )),
        "Chat template is passed with request, but --trust-request-chat-template is not set. Refused request with untrusted chat template."
    );
    assert_eq!(
        message(tokenize("tiny-llama", &json!({"messages": []}))),
        "Cannot apply chat template to an empty conversation. Provide at least one message."
    );
    assert_eq!(
        message(render(
            "tiny-llama",
            &json!({"input": "x", "previous_response_id": "resp_1"})
        )),
        "previous_response_id is not supported by the stateless render endpoint."
    );
    assert_eq!(
        message(tokenize(
            "tiny-deepseek",
            &json!({"messages": [{"role": "foo", "content": "x"}]})
        )),
        "Unknown role: foo"
    );
    for bad in [
        json!({"messages": [{"role": "user", "content": null}]}),
        json!({"messages": [{"role": "user", "content": 5}]}),
        json!({"messages": [{"role": "user", "content": ["a"]}]}),
        json!({"messages": [{"role": "user", "content": [{"type": "foo", "text": "a"}]}]}),
        json!({"messages": [{"content": "no role"}]}),
        json!({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]}),
        json!({"messages": "not a list"}),
        json!({"prompt": ["a", "b"]}),
        json!({"prompt": [1, 2]}),
        json!({}),
    ] {
        let err = tokenize("tiny-llama", &bad).expect_err(&bad.to_string());
        assert!(err.is_client_error(), "{bad}: {err:?}");
    }
    let image = json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]});
    assert!(
        !tokenize("tiny-llama", &image)
            .unwrap_err()
            .is_client_error(),
        "multimodal input is a local limitation"
    );
    assert!(matches!(
        TokenizeRequest::from_json(b"{not json"),
        Err(RequestError::InvalidJson(_))
    ));
    let deep = format!(
        "{{\"messages\": {}{}}}",
        "[".repeat(MAX_DEPTH + 1),
        "]".repeat(MAX_DEPTH + 1)
    );
    assert!(matches!(
        TokenizeRequest::from_json(deep.as_bytes()),
        Err(RequestError::TooDeep { .. })
    ));
}

#[test]
fn unknown_roles_pass_where_the_template_allows_them() {
    let r = tokenize(
        "tiny-llama",
        &json!({"messages": [{"role": "foo", "content": "hi"}]}),
    )
    .unwrap();
    assert_eq!(r.tokens.first(), Some(&1));
}

#[test]
fn answer_shapes_are_vllms() {
    let r = tokenize(
        "tiny-llama",
        &json!({"prompt": "hi", "return_token_strs": true}),
    )
    .unwrap();
    assert_eq!(
        serde_json::to_value(&r).unwrap(),
        json!({"count": 2, "max_model_len": 16384, "tokens": [1, 12014], "token_strs": ["<s>", "▁hi"]})
    );
    let r = tokenize(
        "tiny-llama",
        &json!({"messages": [{"role": "user", "content": "hi"}]}),
    )
    .unwrap();
    assert_eq!(
        r.tokens,
        vec![
            1, 28792, 11123, 28793, 12014, 13, 28792, 4816, 8048, 12738, 28793, 28705
        ]
    );
    assert_eq!(
        serde_json::to_value(&r).unwrap()["token_strs"],
        serde_json::Value::Null
    );
    // Responses: the template's BOS and the tokenizer's.
    let r = render(
        "tiny-llama",
        &json!({"model": "m", "input": "hi", "request_id": "resp_1"}),
    )
    .unwrap();
    assert_eq!(
        r.token_ids,
        vec![
            1, 1, 28792, 11123, 28793, 12014, 13, 28792, 4816, 8048, 12738, 28793, 28705
        ]
    );
    let v = serde_json::to_value(&r).unwrap();
    assert_eq!(v["sampling_params"]["max_tokens"], json!(16384 - 13));
    assert_eq!(v["request_id"], json!("resp_1"));
    assert_eq!(v["output_mode"], json!("tokens"));
    let ds = render("tiny-deepseek", &json!({"input": "hi"})).unwrap();
    assert_eq!(
        &ds.token_ids[..2],
        &[0, 0],
        "DeepSeek's Responses render also has two BOS"
    );
}

#[test]
fn responses_length_rules() {
    let long = "word ".repeat(20_000);
    let err = render("tiny-llama", &json!({"input": long})).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("This model's maximum context length is 16384 tokens."),
        "{err}"
    );
    let r = render(
        "tiny-llama",
        &json!({"input": long, "truncation": "auto", "max_output_tokens": 10}),
    )
    .unwrap();
    assert_eq!(r.token_ids.len(), 16383);
    assert!(
        render(
            "tiny-llama",
            &json!({"input": "x", "max_output_tokens": 20000})
        )
        .is_err()
    );
}

fn arb_json() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        (-1e9f64..1e9).prop_map(serde_json::Value::from),
        prop::sample::select(vec![
            "user",
            "assistant",
            "tool",
            "system",
            "developer",
            "text",
            "function",
            "message",
            "function_call",
            "reasoning",
            "",
            "<s>",
            "hi there"
        ])
        .prop_map(serde_json::Value::from),
    ];
    leaf.prop_recursive(6, 64, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(serde_json::Value::from),
            prop::collection::vec(
                (
                    prop::sample::select(vec![
                        "role",
                        "content",
                        "type",
                        "text",
                        "tool_calls",
                        "function",
                        "name",
                        "arguments",
                        "id",
                        "tool_call_id",
                        "reasoning",
                        "messages",
                        "prompt",
                        "input",
                        "instructions",
                        "tools",
                        "call_id",
                        "output",
                        "status",
                        "chat_template_kwargs",
                        "add_generation_prompt",
                        "continue_final_message",
                        "add_special_tokens",
                        "summary",
                    ]),
                    inner
                ),
                0..6
            )
            .prop_map(|kv| serde_json::Value::Object(
                kv.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()
            )),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_json_never_panics(body in arb_json(), family in prop::sample::select(vec!["tiny-llama", "tiny-deepseek"])) {
        let bytes = serde_json::to_vec(&body).unwrap();
        if let Ok(req) = TokenizeRequest::from_json(&bytes) {
            let _ = common::shared(family).tokenize(&req);
        }
        if let Ok(req) = ResponsesRequest::from_json(&bytes) {
            let _ = common::shared(family).render_responses(&req);
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = TokenizeRequest::from_json(&bytes);
        let _ = ResponsesRequest::from_json(&bytes);
    }
}

#[test]
fn edge_prompts_match_vllm() {
    // Answers of vLLM 0.32's /tokenize on tiny-llama and tiny-deepseek.
    for (prompt, with, without) in [
        ("", vec![1], vec![]),
        (" ", vec![1, 28705], vec![28705]),
        ("  hi", vec![1, 259, 5365], vec![259, 5365]),
        ("\n", vec![1, 28705, 13], vec![28705, 13]),
    ] {
        let got = tokenize("tiny-llama", &json!({"prompt": prompt}))
            .unwrap()
            .tokens;
        assert_eq!(got, with, "{prompt:?}");
        let got = tokenize(
            "tiny-llama",
            &json!({"prompt": prompt, "add_special_tokens": false}),
        )
        .unwrap()
        .tokens;
        assert_eq!(got, without, "{prompt:?}");
    }
    assert_eq!(
        tokenize("tiny-deepseek", &json!({"prompt": ""}))
            .unwrap()
            .tokens,
        vec![0]
    );
}

#[test]
fn chat_completions_also_render_documents_and_reasoning_effort() {
    // vLLM 0.32 (trusting request templates): /v1/chat/completions/render and
    // /tokenize of the same body.
    let tok = kvroute_tokenizer::Tokenizer::load(
        &common::tiny_llama(),
        "t",
        kvroute_tokenizer::LoadOptions {
            trust_request_chat_template: true,
            ..Default::default()
        },
    )
    .unwrap();
    // Raw text: key order reaches the template.
    let body = r#"{"messages": [{"role": "user", "content": "hi"}], "documents": [{"title": "t", "text": "x"}],
        "reasoning_effort": "low",
        "chat_template": "{{ documents | tojson }}|{{ reasoning_effort }}|{{ enable_thinking }}|{% for m in messages %}{{ m.content }}{% endfor %}"}"#;
    let req = TokenizeRequest::from_json(body.as_bytes()).unwrap();
    assert_eq!(
        tok.chat_completion_tokens(&req).unwrap(),
        vec![
            733, 6799, 3901, 1264, 345, 28707, 548, 345, 772, 1264, 345, 28744, 28739, 10157,
            28766, 9381, 28766, 4365, 28766, 5365
        ]
    );
    assert_eq!(
        tok.tokenize(&req).unwrap().tokens,
        vec![1241, 9173, 28766, 5365]
    );
}

#[test]
fn a_body_tells_whether_it_continues_a_conversation() {
    let chat = |body: serde_json::Value| {
        TokenizeRequest::from_json(&serde_json::to_vec(&body).unwrap())
            .unwrap()
            .continues_a_conversation()
            == Some(true)
    };
    let responses = |body: serde_json::Value| {
        ResponsesRequest::from_json(&serde_json::to_vec(&body).unwrap())
            .unwrap()
            .continues_a_conversation()
            == Some(true)
    };
    let messages = |body: serde_json::Value| {
        kvroute_tokenizer::MessagesRequest::from_json(&serde_json::to_vec(&body).unwrap())
            .unwrap()
            .continues_a_conversation()
            == Some(true)
    };
    // A first turn, even behind a long system prompt, continues nothing.
    let first = json!({"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}]});
    let first_turn = TokenizeRequest::from_json(&serde_json::to_vec(&first).unwrap()).unwrap();
    assert_eq!(first_turn.continues_a_conversation(), Some(false));
    assert!(!chat(first));
    // A completions prompt does not tell.
    let prompt = TokenizeRequest::from_json(br#"{"prompt": "Once upon a"}"#).unwrap();
    assert_eq!(prompt.continues_a_conversation(), None);
    assert!(!chat(json!({"messages": "not a list"})));
    assert!(!chat(json!({"messages": [1, null, {"role": 7}]})));
    for role in ["assistant", "tool", "function"] {
        let body = json!({"messages": [{"role": "user", "content": "hi"}, {"role": role, "content": "x"}]});
        assert!(chat(body), "{role}");
    }
    // Responses: a stored response, or an item a model or a tool produced.
    assert!(!responses(json!({"input": "hi"})));
    assert!(!responses(
        json!({"input": [{"role": "user", "content": "hi"}]})
    ));
    assert!(!responses(
        json!({"input": "hi", "previous_response_id": null})
    ));
    assert!(responses(
        json!({"input": "hi", "previous_response_id": "resp_1"})
    ));
    for item in [
        json!({"role": "assistant", "content": "x"}),
        json!({"type": "reasoning", "summary": []}),
        json!({"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}),
        json!({"type": "function_call_output", "call_id": "c", "output": "1"}),
    ] {
        let body = json!({"input": [{"role": "user", "content": "hi"}, item]});
        assert!(responses(body.clone()), "{body}");
    }
    // Messages: the assistant's turn (tool results follow one).
    let m = |msgs| json!({"model": "m", "max_tokens": 8, "messages": msgs});
    assert!(!messages(m(json!([{"role": "user", "content": "hi"}]))));
    assert!(messages(m(json!([
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "more"}
    ]))));
}
