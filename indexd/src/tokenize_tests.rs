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
