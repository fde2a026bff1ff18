use super::*;

fn parse(json: &str) -> Result<Config, ConfigError> {
    Config::parse(json.as_bytes())
}

fn err_field(json: &str) -> String {
    parse(json).unwrap_err().field
}

#[test]
fn minimal_config_gets_defaults() {
    let c = parse(r#"{"index_cluster":"indexd"}"#).unwrap();
    assert_eq!(c.tokenize_at, TokenizeAt::Indexd);
    assert_eq!(c.tokenizer_cluster, "");
    let c = parse(r#"{"index_cluster":"indexd","tokenizer_cluster":"vllm"}"#).unwrap();
    assert_eq!(
        c.tokenize_at,
        TokenizeAt::Cluster,
        "a cluster alone: two calls"
    );
    assert_eq!(c.tokenizer_authority, "vllm");
    assert_eq!(c.block_size.get(), 64);
    assert_eq!(c.override_header, "x-gateway-destination-endpoint");
    assert_eq!(c.rank_header, "x-data-parallel-rank");
    assert_eq!(c.decision_header, None);
    assert_eq!(c.mode, Mode::Precise);
    assert_eq!(c.routes.len(), 4);
    assert_eq!(c.route("/v1/messages").unwrap().api, Api::Messages);
    assert!(
        c.route("/v1/messages/count_tokens").is_none(),
        "counting tokens is not inference"
    );
    assert_eq!(c.index_timeout, Duration::from_millis(50));
    let r = c.route("/v1/responses?x=1").unwrap();
    assert_eq!(r.call, TokenizerCall::Render);
    assert_eq!(r.tokenizer_path, "/v1/responses/render");
    assert_eq!(
        c.route("/v1/chat/completions").unwrap().tokenizer_path,
        "/tokenize"
    );
    assert!(c.route("/v1/models").is_none());
    assert!(c.observe);
}

#[test]
fn full_config_round_trips() {
    let c = parse(
        r#"{"tokenizer_cluster":"t","tokenizer_authority":"tok.local","index_cluster":"i",
            "tokenizer_timeout_ms":100,"index_timeout_ms":20,
            "routes":[{"path":"/v1/chat/completions","api":"chat","tokenizer":"render"},
                      {"path":"/x","api":"completions","tokenizer_path":"/tok"}],
            "block_size":16,"max_body_bytes":1000,"override_header":"x-o","rank_header":"x-r",
            "decision_header":"x-kvroute-decision","breaker":{"failures":2,"window_ms":100,"cooldown_ms":300},
            "mode":"approximate","approximate_chunk_bytes":128,"model_fallback":"m","max_candidates":3,
            "observe":false,"response_scan_bytes":4096,"max_tokenizer_response_bytes":10000}"#,
    )
    .unwrap();
    assert_eq!(c.routes[0].tokenizer_path, "/v1/chat/completions/render");
    assert_eq!(c.routes[1].tokenizer_path, "/tok");
    assert_eq!(c.breaker.failures, 2);
    assert_eq!(c.mode, Mode::Approximate);
    assert_eq!(c.decision_header.as_deref(), Some("x-kvroute-decision"));
    assert_eq!(c.max_body_bytes, 1000);
    assert!(!c.observe);
}

#[test]
fn errors_name_the_field() {
    assert_eq!(err_field(r#"{"tokenizer_cluster":"t"}"#), "index_cluster");
    assert_eq!(
        err_field(r#"{"index_cluster":"i","tokenize_at":"cluster"}"#),
        "tokenizer_cluster"
    );
    assert_eq!(err_field(""), "index_cluster");
    let base = r#""index_cluster":"i","tokenizer_cluster":"t""#;
    let cases = [
        (r#""block_size":0"#, "block_size"),
        (r#""tokenizer_timeout_ms":0"#, "tokenizer_timeout_ms"),
        (r#""index_timeout_ms":999999"#, "index_timeout_ms"),
        (r#""max_body_bytes":0"#, "max_body_bytes"),
        (r#""override_header":"X-Upper""#, "override_header"),
        (
            r#""rank_header":"x-gateway-destination-endpoint""#,
            "rank_header",
        ),
        (r#""decision_header":"""#, "decision_header"),
        (r#""breaker":{"failures":0}"#, "breaker.failures"),
        (r#""breaker":{"cooldown_ms":0}"#, "breaker.cooldown_ms"),
        (r#""routes":[]"#, "routes"),
        (r#""routes":[{"path":"v1","api":"chat"}]"#, "routes[0].path"),
        (
            r#""routes":[{"path":"/a","api":"chat"},{"path":"/a","api":"chat"}]"#,
            "routes[1].path",
        ),
        (
            r#""routes":[{"path":"/r","api":"responses","tokenizer":"tokenize"}]"#,
            "routes[0].tokenizer",
        ),
        (
            r#""routes":[{"path":"/m","api":"messages","tokenizer":"render"}]"#,
            "routes[0].tokenizer",
        ),
        (
            r#""routes":[{"path":"/m","api":"messages","tokenizer_path":"/x"}]"#,
            "routes[0].tokenizer",
        ),
        (r#""index_cluster":"""#, "index_cluster"),
        (r#""model_fallback":" ""#, "model_fallback"),
    ];
    for (extra, field) in cases {
        let json = if extra.starts_with(r#""index_cluster""#) {
            format!(r#"{{{extra},"tokenizer_cluster":"t"}}"#)
        } else {
            format!("{{{base},{extra}}}")
        };
        assert_eq!(err_field(&json), field, "{json}");
    }
}

#[test]
fn unknown_fields_and_bad_types_are_refused_by_name() {
    let e = parse(r#"{"index_cluster":"i","tokenizer_cluster":"t","blok_size":3}"#).unwrap_err();
    assert!(e.message.contains("blok_size"), "{e}");
    let e = parse(r#"{"index_cluster":"i","tokenizer_cluster":"t","mode":"fast"}"#).unwrap_err();
    assert!(e.message.contains("fast"), "{e}");
    let e =
        parse(r#"{"index_cluster":"i","tokenizer_cluster":"t","breaker":{"x":1}}"#).unwrap_err();
    assert!(e.message.contains('x'), "{e}");
    assert!(parse("[1,2]").is_err());
    assert!(Config::parse(&[0xff, 0xfe]).is_err());
}

#[test]
fn approximate_mode_needs_no_tokenizer() {
    let c = parse(r#"{"index_cluster":"i","mode":"approximate"}"#).unwrap();
    assert_eq!(c.mode, Mode::Approximate);
    assert_eq!(c.approximate_chunk_bytes.get(), 256);
}

#[test]
fn index_token_is_checked_and_never_printed() {
    let c = parse(r#"{"index_cluster":"indexd","index_token":" kvroute-test-token-0123456789\n"}"#)
        .unwrap();
    let token = c.index_token.as_ref().unwrap();
    assert_eq!(
        token.authorization(),
        "Bearer kvroute-test-token-0123456789"
    );
    assert!(!format!("{c:?}").contains("kvroute-test-token"));
    assert_eq!(
        parse(r#"{"index_cluster":"indexd"}"#).unwrap().index_token,
        None
    );
    for bad in ["short", "has spaces inside the token", ""] {
        let json = format!(r#"{{"index_cluster":"indexd","index_token":"{bad}"}}"#);
        assert_eq!(err_field(&json), "index_token", "{bad}");
    }
}

#[test]
fn local_continuations_are_off_by_default_and_need_the_memory() {
    let c = parse(r#"{"index_cluster":"indexd"}"#).unwrap();
    assert_eq!(c.local_continuations, 0);
    let c = parse(r#"{"index_cluster":"indexd","local_continuations":4}"#).unwrap();
    assert_eq!(c.local_continuations, 4);
    assert_eq!(
        err_field(r#"{"index_cluster":"indexd","local_continuations":4,"remember":false}"#),
        "local_continuations"
    );
    assert!(parse(r#"{"index_cluster":"indexd","local_continuations":-1}"#).is_err());
    // How fresh indexd's load must be: 1 s unless set, 1 ms to 60 s.
    assert_eq!(c.continuation_load, std::time::Duration::from_secs(1));
    let c = parse(r#"{"index_cluster":"indexd","continuation_load_ms":5000}"#).unwrap();
    assert_eq!(c.continuation_load, std::time::Duration::from_secs(5));
    for bad in ["0", "60001"] {
        let json = format!(r#"{{"index_cluster":"indexd","continuation_load_ms":{bad}}}"#);
        assert_eq!(err_field(&json), "continuation_load_ms", "{bad}");
    }
}
