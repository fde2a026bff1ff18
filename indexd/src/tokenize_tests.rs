use super::*;

#[test]
fn salts_follow_vllm_rules() {
    let salt_of = |body: &[u8]| head_of(body).map(|h| h.salt);
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
    // The golden bodies the filter reads too (`proto/testdata/turns.json`).
    let golden: serde_json::Value =
        serde_json::from_str(include_str!("../../proto/testdata/turns.json")).unwrap();
    let bodies = golden["cases"].as_array().unwrap().iter().map(|case| {
        let api = match case["api"].as_str().unwrap() {
            "chat" => Api::Chat,
            "completions" => Api::Completions,
            "responses" => Api::Responses,
            "messages" => Api::Messages,
            other => panic!("api {other}"),
        };
        (
            api,
            case["body"].as_str().unwrap(),
            case["continuation"].as_bool(),
        )
    });
    assert!(bodies.len() >= 20);
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
