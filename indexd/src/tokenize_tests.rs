use super::*;

#[test]
fn salts_follow_vllm_rules() {
    assert_eq!(salt_of(br#"{"model":"m"}"#), Ok(None));
    assert_eq!(
        salt_of(br#"{"cache_salt":"tenant-a","messages":[]}"#),
        Ok(Some("tenant-a".to_owned()))
    );
    for bad in [
        r#"{"cache_salt":""}"#,
        r#"{"cache_salt":"a/b"}"#,
        r#"{"cache_salt":"a@b"}"#,
        r#"{"cache_salt":5}"#,
        "{",
    ] {
        assert!(
            matches!(
                salt_of(bad.as_bytes()),
                Err(TokenizeError::Refused { status: 400, .. })
            ),
            "{bad}"
        );
    }
    let long = format!(r#"{{"cache_salt":"{}"}}"#, "s".repeat(129));
    assert!(salt_of(long.as_bytes()).is_err());
}

#[test]
fn a_head_tells_a_continuation_as_the_tokenizer_does_and_never_refuses_for_it() {
    use kvroute_tokenizer::{MessagesRequest, ResponsesRequest, TokenizeRequest};
    let bodies = [
        (
            Api::Chat,
            r#"{"messages":[{"role":"system","content":"s"},{"role":"user","content":"hi"}]}"#,
            Some(false),
        ),
        (
            Api::Chat,
            r#"{"messages":[{"role":"user","content":"hi"},{"content":"x","role":"assistant"}]}"#,
            Some(true),
        ),
        (
            Api::Chat,
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]},{"role":"tool","content":"1"}]}"#,
            Some(true),
        ),
        (
            Api::Chat,
            r#"{"messages":[{"role":"user","content":{"role":"assistant"}}]}"#,
            Some(false),
        ),
        (
            Api::Chat,
            r#"{"messages":[1,null,"a",[{"role":"assistant"}],{"role":7,"type":{}}]}"#,
            Some(false),
        ),
        (
            Api::Chat,
            r#"{"messages":{"role":"assistant"}}"#,
            Some(false),
        ),
        (
            Api::Chat,
            r#"{"messages":[{"r\u006fle":"assistant"}]}"#,
            Some(true),
        ),
        (Api::Completions, r#"{"prompt":"Once upon a"}"#, None),
        (Api::Responses, r#"{"input":"hi"}"#, Some(false)),
        (
            Api::Responses,
            r#"{"input":"hi","previous_response_id":"resp_1"}"#,
            Some(true),
        ),
        (
            Api::Responses,
            r#"{"input":"hi","previous_response_id":""}"#,
            Some(false),
        ),
        (
            Api::Responses,
            r#"{"input":"hi","previous_response_id":5}"#,
            Some(false),
        ),
        (
            Api::Responses,
            r#"{"input":[{"role":"user","content":"hi"},{"type":"function_call_output","call_id":"c","output":"1"}]}"#,
            Some(true),
        ),
        (
            Api::Responses,
            r#"{"input":[{"type":"reasoning","summary":[]}]}"#,
            Some(true),
        ),
        (
            Api::Responses,
            r#"{"input":[{"type":"message","role":"user","content":"hi"}]}"#,
            Some(false),
        ),
        (
            Api::Messages,
            r#"{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}"#,
            Some(false),
        ),
        (
            Api::Messages,
            r#"{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"a"},{"role":"user","content":"b"}]}"#,
            Some(true),
        ),
    ];
    for (api, body, expected) in bodies {
        let head = head_of(body.as_bytes()).unwrap_or_else(|e| panic!("{body}: {e}"));
        assert_eq!(head.continuation, expected, "{body}");
        let local =
            match api {
                Api::Chat | Api::Completions => TokenizeRequest::from_json(body.as_bytes())
                    .map(|r| r.continues_a_conversation()),
                Api::Responses => ResponsesRequest::from_json(body.as_bytes())
                    .map(|r| r.continues_a_conversation()),
                Api::Messages => MessagesRequest::from_json(body.as_bytes())
                    .map(|r| r.continues_a_conversation()),
            };
        assert_eq!(
            local.ok(),
            Some(expected),
            "the tokenizer's reading of {body}"
        );
    }
    // Only the salt, or a body that is no JSON object, refuses.
    assert!(head_of(br#"{"messages":[{"role":"assistant"}],"cache_salt":"a/b"}"#).is_err());
    assert!(head_of(b"[1]").is_err());
}

#[test]
fn without_local_tokenizers_everything_goes_to_replicas() {
    let t = Tokenizers::none();
    assert!(t.local("m").is_none());
    assert_eq!(t.locals().count(), 0);
}

#[test]
fn a_missing_directory_names_the_model_and_the_path() {
    let err = Tokenizers::load(TokenizeConfig {
        tokenizers: vec![TokenizerSpec {
            model: "tiny".into(),
            dir: "/nonexistent/tiny".into(),
            max_model_len: None,
            chat_template: None,
            trust_request_chat_template: false,
        }],
        ..TokenizeConfig::default()
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("tiny") && err.contains("/nonexistent/tiny"),
        "{err}"
    );
}
