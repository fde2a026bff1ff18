//! The HTTP surface: cache table, tokenizer endpoints, errors, models, Responses store, SSE.

use mock_vllm::{Config, REPLICA_HEADER};
use serde_json::{Value, json};

use crate::support::*;

#[tokio::test]
async fn real_vllm_cache_table_reproduces_on_every_endpoint() {
    let h = start(test_config()).await;
    let a = h.http_addr();
    let long = text("w", 300);
    let cases: [(&str, Value); 3] = [
        ("/v1/completions", json!({"prompt": long, "max_tokens": 4})),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "system", "content": long}, {"role": "user", "content": "hi"}], "max_tokens": 4}),
        ),
        (
            "/v1/responses",
            json!({"instructions": long, "input": "hi", "max_output_tokens": 4}),
        ),
    ];
    for (path, body) in cases {
        let salted = |s: &str| {
            let mut b = body.clone();
            b["cache_salt"] = json!(s);
            b
        };
        let (n, first) = cached_of(a, path, body.clone()).await;
        assert!(n > 4 * BS, "{path}: long prompt");
        assert_eq!(first, 0, "{path}: cold");
        assert_eq!(
            cached_of(a, path, body.clone()).await.1,
            hit(n),
            "{path}: repeat hits"
        );
        assert_eq!(cached_of(a, path, salted("A")).await.1, 0, "{path}: salt A");
        assert_eq!(cached_of(a, path, salted("B")).await.1, 0, "{path}: salt B");
        assert_eq!(
            cached_of(a, path, salted("B")).await.1,
            hit(n),
            "{path}: salt B again"
        );
        assert_eq!(
            cached_of(a, path, body.clone()).await.1,
            hit(n),
            "{path}: unsalted after salted"
        );
    }
    let m = get(a, "/metrics").await.text();
    assert!(m.contains("vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"mock-model\"}"));
    assert!(m.contains("vllm:num_requests_running{"));
    assert!(m.contains("vllm:num_requests_waiting{"));
    assert!(m.contains("vllm:kv_cache_usage_perc{"));
}

#[tokio::test]
async fn tokenize_and_render_match_what_requests_use() {
    let h = start(test_config()).await;
    let a = h.http_addr();
    let messages = json!([{"role": "user", "content": "Hello there, how are you?"}]);
    let tok = post(
        a,
        "/tokenize",
        json!({"model": "mock-model", "messages": messages}),
    )
    .await
    .json();
    let chat = post(
        a,
        "/v1/chat/completions",
        json!({"messages": messages, "max_tokens": 2}),
    )
    .await;
    assert_eq!(chat.header(REPLICA_HEADER), Some(h.name()));
    assert_eq!(tok["count"], chat.json()["usage"]["prompt_tokens"]);
    assert_eq!(tok["tokens"][0], 1);
    assert!(tok["token_strs"].is_null());
    let render = post(
        a,
        "/v1/chat/completions/render",
        json!({"messages": messages}),
    )
    .await
    .json();
    assert_eq!(render["token_ids"], tok["tokens"]);

    let comp = post(
        a,
        "/tokenize",
        json!({"prompt": "Hello world", "return_token_strs": true}),
    )
    .await
    .json();
    assert_eq!(comp["tokens"][0], 1);
    assert_eq!(comp["count"], 3);
    assert_eq!(comp["max_model_len"], 32_768);
    assert_eq!(comp["token_strs"], json!(["<s>", "Hello", "\u{2581}world"]));
    let no_bos = post(
        a,
        "/tokenize",
        json!({"prompt": "Hello world", "add_special_tokens": false}),
    )
    .await
    .json();
    assert_eq!(no_bos["count"], 2);
    let r = post(
        a,
        "/v1/completions/render",
        json!({"prompt": "Hello world"}),
    )
    .await
    .json();
    assert_eq!(r["token_ids"], comp["tokens"]);

    // Responses: /tokenize refuses the body; render adds the second BOS.
    let resp_body = json!({"model": "mock-model", "input": "Hello there, how are you?"});
    let bad = post(a, "/tokenize", resp_body.clone()).await;
    assert_eq!(bad.status, 400);
    assert_eq!(bad.json()["error"]["code"], 400);
    let rr = post(a, "/v1/responses/render", resp_body.clone())
        .await
        .json();
    let ids = rr["token_ids"].as_array().unwrap();
    assert_eq!(&ids[..2], &[json!(1), json!(1)]);
    assert_eq!(&ids[1..], tok["tokens"].as_array().unwrap().as_slice());
    let resp = post(a, "/v1/responses", resp_body).await.json();
    assert_eq!(
        resp["usage"]["input_tokens"].as_u64().unwrap() as usize,
        ids.len()
    );
}

#[tokio::test]
async fn bad_requests_get_vllm_errors() {
    let h = start(test_config()).await;
    let a = h.http_addr();
    for salt in [
        json!(""),
        json!("x".repeat(129)),
        json!("a@b"),
        json!("a/b"),
        json!("a\\b"),
        json!("a\u{0}b"),
    ] {
        for (path, mut body) in [
            ("/v1/completions", json!({"prompt": "hi"})),
            (
                "/v1/chat/completions",
                json!({"messages": [{"role": "user", "content": "hi"}]}),
            ),
            ("/v1/responses", json!({"input": "hi"})),
        ] {
            body["cache_salt"] = salt.clone();
            let r = post(a, path, body).await;
            assert_eq!(r.status, 400, "{path} salt {salt}");
            assert_eq!(r.json()["error"]["type"], "BadRequestError");
        }
    }
    let r = post(
        a,
        "/v1/completions",
        json!({"model": "nope", "prompt": "hi"}),
    )
    .await;
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["code"], 404);
    let r = request(a, "POST", "/v1/chat/completions", None).await;
    assert_eq!(r.status, 400);
    let r = post(
        a,
        "/v1/completions",
        json!({"prompt": "hi", "max_tokens": 40_000}),
    )
    .await;
    assert_eq!(r.status, 400);
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("maximum context length")
    );
    let r = post(
        a,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hi"}], "n": 2}),
    )
    .await;
    assert_eq!(r.status, 400);
    for empty in [json!(""), json!([])] {
        let body = json!({"prompt": empty, "add_special_tokens": false});
        assert_eq!(post(a, "/v1/completions", body).await.status, 400);
    }
    assert_eq!(get(a, "/health").await.status, 200);
    assert_eq!(get(a, "/version").await.json()["version"], "0.32.0");
    // Bodies beyond axum's 2 MB default are accepted (vLLM has no limit).
    let big = "word ".repeat(600_000);
    let r = post(
        a,
        "/tokenize",
        json!({"prompt": big, "add_special_tokens": false}),
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.json()["count"],
        600_001,
        "\"word\", 599,999 × \" word\", a trailing \" \""
    );
}

#[tokio::test]
async fn served_names_and_lora_adapters() {
    let h = start(Config {
        served_model_names: vec!["base".into(), "alias".into()],
        lora_modules: vec!["sql".into()],
        ..test_config()
    })
    .await;
    let a = h.http_addr();
    let models = get(a, "/v1/models").await.json();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["base", "alias", "sql"]);
    assert_eq!(models["data"][2]["parent"], "base");
    let prompt = text("p", 100);
    let tokens: Vec<u32> = post(a, "/tokenize", json!({"prompt": prompt})).await.json()["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let (n, c) = cached_of(
        a,
        "/v1/completions",
        json!({"model": "base", "prompt": prompt}),
    )
    .await;
    assert_eq!((n, c), (tokens.len(), 0));
    // Served names share the base model's blocks; the adapter does not.
    assert_eq!(
        cached_of(
            a,
            "/v1/completions",
            json!({"model": "alias", "prompt": prompt})
        )
        .await
        .1,
        hit(n)
    );
    assert_eq!(
        cached_of(
            a,
            "/v1/completions",
            json!({"model": "sql", "prompt": prompt})
        )
        .await
        .1,
        0
    );
    assert_eq!(
        cached_of(
            a,
            "/v1/completions",
            json!({"model": "sql", "prompt": prompt})
        )
        .await
        .1,
        hit(n)
    );
    // Oracle probe agrees.
    assert_eq!(
        h.cached_prefix_tokens(Some("sql"), None, &tokens),
        tokens.len() / BS * BS
    );
    let p = post(
        h.admin_addr(),
        "/admin/probe",
        json!({"token_ids": tokens, "cache_salt": "zz"}),
    )
    .await
    .json();
    assert_eq!(p["cached_tokens"], 0);
    let p = post(h.admin_addr(), "/admin/probe", json!({"token_ids": tokens}))
        .await
        .json();
    assert_eq!(
        p["cached_tokens"].as_u64().unwrap() as usize,
        tokens.len() / BS * BS
    );
    assert_eq!(p["hit_tokens"].as_u64().unwrap() as usize, hit(n));
}

#[tokio::test]
async fn previous_response_id_resolves_only_where_stored() {
    let one = start(test_config()).await;
    let two = start(test_config()).await;
    let first = post(
        one.http_addr(),
        "/v1/responses",
        json!({"input": text("conv", 80), "max_output_tokens": 8}),
    )
    .await;
    assert_eq!(first.header(REPLICA_HEADER), Some(one.name()));
    let first = first.json();
    assert_eq!(first["status"], "completed");
    let id = first["id"].as_str().unwrap();
    let first_prompt = first["usage"]["input_tokens"].as_u64().unwrap() as usize;
    let follow = json!({"input": "and then?", "previous_response_id": id, "max_output_tokens": 4});
    let here = post(one.http_addr(), "/v1/responses", follow.clone()).await;
    assert_eq!(here.status, 200);
    let u = &here.json()["usage"];
    let cached = u["input_tokens_details"]["cached_tokens"].as_u64().unwrap() as usize;
    assert!(
        cached >= first_prompt / BS * BS && cached > 0,
        "continuation hits the stored turn: {u}"
    );
    let there = post(two.http_addr(), "/v1/responses", follow).await;
    assert_eq!(there.status, 404);
    assert_eq!(there.json()["error"]["type"], "NotFoundError");
    assert_eq!(
        get(one.http_addr(), &format!("/v1/responses/{id}"))
            .await
            .status,
        200
    );
    assert_eq!(
        get(two.http_addr(), &format!("/v1/responses/{id}"))
            .await
            .status,
        404
    );
}

#[tokio::test]
async fn streaming_completions_and_chat() {
    let h = start(test_config()).await;
    let a = h.http_addr();
    let r = post(
        a,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": true, "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_eq!(r.status, 200);
    assert!(
        r.header("content-type")
            .unwrap()
            .starts_with("text/event-stream")
    );
    let events = r.sse();
    assert_eq!(events.last().unwrap().1, "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|(_, d)| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    let content: String = chunks[1..6]
        .iter()
        .map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap())
        .collect();
    assert_eq!(chunks[5]["choices"][0]["finish_reason"], "length");
    let usage = &chunks[6]["usage"];
    assert_eq!(usage["completion_tokens"], 5);
    assert_eq!(chunks[6]["choices"], json!([]));
    // Non-streaming gives the same text for the same prompt.
    let plain = post(
        a,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}),
    )
    .await
    .json();
    assert_eq!(plain["choices"][0]["message"]["content"], content);

    let r = post(
        a,
        "/v1/completions",
        json!({"prompt": "once upon", "max_tokens": 3, "stream": true}),
    )
    .await;
    let events = r.sse();
    assert_eq!(
        events.len(),
        4,
        "3 tokens then [DONE], no usage chunk unless asked"
    );
    assert_eq!(events[3].1, "[DONE]");
}

#[tokio::test]
async fn streaming_responses_events() {
    let h = start(test_config()).await;
    let r = post(
        h.http_addr(),
        "/v1/responses",
        json!({"input": "hi", "max_output_tokens": 3, "stream": true}),
    )
    .await;
    assert_eq!(r.status, 200);
    let events = r.sse();
    let kinds: Vec<&str> = events.iter().map(|(e, _)| e.as_deref().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    let datas: Vec<Value> = events
        .iter()
        .map(|(_, d)| serde_json::from_str(d).unwrap())
        .collect();
    for (i, d) in datas.iter().enumerate() {
        assert_eq!(d["sequence_number"], i);
        assert_eq!(d["type"], kinds[i]);
    }
    let done = &datas[10]["response"];
    assert_eq!(done["usage"]["output_tokens"], 3);
    let id = done["id"].as_str().unwrap();
    // A streamed response is stored too.
    let follow = post(
        h.http_addr(),
        "/v1/responses",
        json!({"input": "more", "previous_response_id": id}),
    )
    .await;
    assert_eq!(follow.status, 200);
}

#[tokio::test]
async fn pause_holds_batches_until_resume() {
    let h = start(test_config()).await;
    let admin = h.admin_addr();
    post(admin, "/admin/events/pause", json!({})).await;
    post(
        h.http_addr(),
        "/v1/completions",
        json!({"prompt": text("p", 30), "max_tokens": 1}),
    )
    .await;
    let ep = h.replay_endpoint().unwrap();
    // While paused no batch is numbered (a completed round trip on the admin API and a replay
    // after the request proves the batch is queued, not published).
    assert!(replay(ep, 0).await.0.is_empty());
    assert_eq!(
        get(admin, "/admin/state").await.json()["events"]["paused"],
        true
    );
    post(admin, "/admin/events/resume", json!({})).await;
    h.flush_events().await;
    let (got, _) = replay(ep, 0).await;
    assert_eq!(seq(&got[0]), 0);
}

#[tokio::test]
async fn binary_prints_bound_addresses_and_serves() {
    use tokio::io::AsyncBufReadExt;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_mock-vllm"))
        .args([
            "--served-model-name",
            "m1",
            "--time-scale",
            "0",
            "--kv-events-topic",
            "kv@b@m1",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let line = tokio::time::timeout(STEP, lines.next_line())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let addrs: Value = serde_json::from_str(&line).unwrap();
    let http: std::net::SocketAddr = addrs["http"].as_str().unwrap().parse().unwrap();
    assert_ne!(http.port(), 0);
    assert!(
        addrs["kv_events"]
            .as_str()
            .unwrap()
            .starts_with("tcp://127.0.0.1:")
    );
    assert_eq!(addrs["kv_events_mode"], "bind");
    assert!(
        addrs["replay"]
            .as_str()
            .unwrap()
            .starts_with("tcp://127.0.0.1:")
    );
    let models = get(http, "/v1/models").await.json();
    assert_eq!(models["data"][0]["id"], "m1");
    child.start_kill().unwrap();
    let _ = tokio::time::timeout(STEP, child.wait()).await;
}

#[tokio::test]
async fn reasoning_turns_are_append_only_unless_the_template_drops_them() {
    use mock_vllm::ChatTemplate;
    for template in [ChatTemplate::RoleMarkers, ChatTemplate::DropReasoning] {
        let h = start(Config {
            reasoning_tokens: 6,
            chat_template: template,
            ..test_config()
        })
        .await;
        let a = h.http_addr();
        let turn1 = json!([{"role": "user", "content": text("u", 40)}]);
        let r1 = post(
            a,
            "/v1/chat/completions",
            json!({"messages": turn1, "max_tokens": 30}),
        )
        .await
        .json();
        let msg = &r1["choices"][0]["message"];
        let reasoning = msg["reasoning_content"].as_str().unwrap();
        assert_eq!(reasoning.split(' ').count(), 6);
        assert!(!msg["content"].as_str().unwrap().is_empty());
        let n1 = r1["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
        let mut turn2 = turn1.as_array().unwrap().clone();
        turn2.push(
            json!({"role": "assistant", "content": msg["content"], "reasoning_content": reasoning}),
        );
        turn2.push(json!({"role": "user", "content": "and next?"}));
        let (_, cached) = cached_of(
            a,
            "/v1/chat/completions",
            json!({"messages": turn2, "max_tokens": 2}),
        )
        .await;
        let expected = match template {
            // The rendered history equals prompt + generated tokens: decode-filled blocks hit.
            ChatTemplate::RoleMarkers => (n1 + 29) / BS * BS,
            // Reasoning dropped from history: only the turn-1 prompt's blocks match.
            ChatTemplate::DropReasoning => n1 / BS * BS,
        };
        assert_eq!(cached, expected, "{template:?}");
        assert!(
            (n1 + 29) / BS > n1 / BS,
            "the test distinguishes the templates"
        );
    }
}

#[tokio::test]
async fn streaming_responses_with_reasoning() {
    let h = start(Config {
        reasoning_tokens: 2,
        ..test_config()
    })
    .await;
    let r = post(
        h.http_addr(),
        "/v1/responses",
        json!({"input": "hi", "max_output_tokens": 6, "stream": true}),
    )
    .await;
    let events = r.sse();
    let kinds: Vec<&str> = events.iter().map(|(e, _)| e.as_deref().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.reasoning_text.delta",
            "response.reasoning_text.delta",
            "response.reasoning_text.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    let done: Value = serde_json::from_str(&events.last().unwrap().1).unwrap();
    let output = done["response"]["output"].as_array().unwrap();
    assert_eq!(output[0]["type"], "reasoning");
    assert_eq!(output[1]["type"], "message");
    assert_eq!(done["response"]["usage"]["output_tokens"], 6);
    assert_eq!(
        done["response"]["usage"]["output_tokens_details"]["reasoning_tokens"],
        2
    );
}

#[tokio::test]
async fn generation_responses_carry_the_prompt_digest() {
    let h = start(test_config()).await;
    let a = h.http_addr();
    let messages =
        json!([{"role": "system", "content": text("d", 80)}, {"role": "user", "content": "hi"}]);
    let tokens: Vec<u32> = serde_json::from_value(
        post(a, "/tokenize", json!({"messages": messages}))
            .await
            .json()["tokens"]
            .clone(),
    )
    .unwrap();
    for (salt, stream) in [
        (None, false),
        (Some("tenant-a"), false),
        (Some("tenant-a"), true),
    ] {
        let mut body = json!({"messages": messages, "max_tokens": 2, "stream": stream});
        if let Some(s) = salt {
            body["cache_salt"] = json!(s);
        }
        let r = post(a, "/v1/chat/completions", body).await;
        assert_eq!(
            r.header(mock_vllm::PROMPT_DIGEST_HEADER),
            Some(mock_vllm::prompt_digest(salt, &tokens).as_str()),
            "salt {salt:?}, stream {stream}"
        );
    }
    assert_ne!(
        mock_vllm::prompt_digest(None, &tokens),
        mock_vllm::prompt_digest(Some(""), &tokens)
    );
    assert_ne!(
        mock_vllm::prompt_digest(None, &tokens),
        mock_vllm::prompt_digest(None, &tokens[1..])
    );
    let rendered = post(
        a,
        "/v1/responses/render",
        json!({"input": "hi", "instructions": text("d", 80)}),
    )
    .await
    .json();
    let ids: Vec<u32> = serde_json::from_value(rendered["token_ids"].clone()).unwrap();
    let r = post(
        a,
        "/v1/responses",
        json!({"input": "hi", "instructions": text("d", 80), "max_output_tokens": 2}),
    )
    .await;
    assert_eq!(
        r.header(mock_vllm::PROMPT_DIGEST_HEADER),
        Some(mock_vllm::prompt_digest(None, &ids).as_str())
    );
    // Not on non-generation routes.
    assert_eq!(
        get(a, "/v1/models")
            .await
            .header(mock_vllm::PROMPT_DIGEST_HEADER),
        None
    );
}
