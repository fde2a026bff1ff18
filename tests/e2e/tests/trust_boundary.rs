//! The trust boundary end to end: real Envoy + the built filter + indexd +
//! mock replicas, and a foreign gRPC client calling indexd directly.
//!
//! - Observe calls a pod could send — an unknown endpoint, a model the
//!   replica does not serve, a known response id pointed elsewhere, a flood
//!   past the rate limit — change no routing: a `previous_response_id`
//!   continuation still reaches the replica that stored the response.
//! - With a shared token, calls without it are refused while the filter,
//!   configured with the token, keeps routing.
//! - Envoy reaches indexd over its Unix socket (a `pipe` cluster).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

use std::os::unix::fs::PermissionsExt as _;
use std::time::{Duration, Instant};

use kvroute_e2e::client::{Outcome, chat_body, filler, message, post_json};
use kvroute_e2e::{Stack, StackOptions};
use kvroute_proto::v1::index_client::IndexClient;
use kvroute_proto::v1::{ObserveRequest, Outcome as WireOutcome, PickRequest};
use serde_json::{Value, json};
use tonic::transport::Channel;

const TOKEN: &str = "kvroute-e2e-token-3f9c1d2e8a7b6c5d";

/// One Responses turn through Envoy.
fn respond(stack: &Stack, seed: u64, previous: Option<&str>) -> Outcome {
    let mut body = json!({
        "model": stack.options().model,
        "input": filler(seed, 30),
        "max_output_tokens": 4,
    });
    if let Some(id) = previous {
        body["previous_response_id"] = json!(id);
    }
    let out = post_json(&stack.url().unwrap(), "/v1/responses", &body, &[]).unwrap();
    assert_eq!(out.status, 200, "{} ({:?})", out.body, out.decision);
    assert!(out.response_id.is_some(), "{}", out.body);
    out
}

/// A client of indexd that is not the filter.
fn foreign_client(stack: &Stack) -> IndexClient<Channel> {
    let uri = stack.indexd_grpc().grpc_uri();
    stack.block_on(IndexClient::connect(uri)).unwrap()
}

fn observe_req(stack: &Stack, endpoint: &str, response_id: &str) -> ObserveRequest {
    ObserveRequest {
        model: stack.options().model.clone(),
        endpoint: endpoint.into(),
        response_id: response_id.into(),
        outcome: WireOutcome::Ok as i32,
        http_status: 200,
        ..ObserveRequest::default()
    }
}

fn counter(stack: &Stack, series: &str) -> u64 {
    let text = stack.indexd().unwrap().metrics_text();
    text.lines()
        .filter(|l| l.starts_with(series))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

#[test]
fn foreign_observes_change_no_routing() {
    // A small limit, so that the flood runs past it quickly: 20 a second,
    // 40 at once.
    let stack = Stack::start(StackOptions {
        replicas: 3,
        observe_limit: Some((20, 40)),
        ..StackOptions::default()
    })
    .unwrap();
    let first = respond(&stack, 1, None);
    let stored = first.replica.clone().unwrap();
    let id = first.response_id.clone().unwrap();
    let other = stack
        .replica_addresses()
        .into_iter()
        .find(|a| *a != stored)
        .unwrap();
    let mut client = foreign_client(&stack);
    let code = |client: &mut IndexClient<Channel>, req: ObserveRequest| {
        stack
            .block_on(client.observe(req))
            .map(|_| ())
            .map_err(|s| s.code())
    };

    // The stored response pointed at a host that is no replica, at a replica
    // for a model it does not serve, and at another replica.
    let unknown = observe_req(&stack, "127.0.0.1:1", &id);
    assert_eq!(
        code(&mut client, unknown),
        Err(tonic::Code::InvalidArgument)
    );
    let mut wrong_model = observe_req(&stack, &other, &id);
    wrong_model.model = "not-served".into();
    assert_eq!(
        code(&mut client, wrong_model),
        Err(tonic::Code::InvalidArgument)
    );
    let moved = observe_req(&stack, &other, &id);
    assert_eq!(code(&mut client, moved), Err(tonic::Code::AlreadyExists));

    // A flood of well-formed Observes: the burst passes, the rest is refused.
    let started = Instant::now();
    let (mut admitted, mut refused) = (0u64, 0u64);
    for i in 0..400 {
        let flood = observe_req(&stack, &other, &format!("resp_flood_{i}"));
        match code(&mut client, flood) {
            Ok(()) => admitted += 1,
            Err(tonic::Code::ResourceExhausted) => refused += 1,
            Err(other) => panic!("flood call {i}: {other:?}"),
        }
    }
    let bound = 40 + (20.0 * started.elapsed().as_secs_f64()).ceil() as u64;
    assert!(admitted <= bound, "{admitted} admitted, at most {bound}");
    assert!(admitted >= 30, "only {admitted} admitted of a 40 burst");
    assert_eq!(admitted + refused, 400);
    assert_eq!(
        counter(&stack, "indexd_observes_total{result=\"rate_limited\"}"),
        refused
    );
    assert_eq!(
        counter(&stack, "indexd_observes_total{result=\"unknown_endpoint\"}"),
        1
    );
    assert_eq!(
        counter(&stack, "indexd_observes_total{result=\"model_not_served\"}"),
        1
    );
    assert_eq!(
        counter(&stack, "indexd_observes_total{result=\"conflict\"}"),
        1
    );

    // Routing is unchanged: the continuations reach the storing replica.
    // (The filter's own Observes share the limit: give it a few tokens.)
    std::thread::sleep(Duration::from_millis(300));
    let mut previous = id;
    for step in 0..2 {
        let next = respond(&stack, 10 + step, Some(&previous));
        assert_eq!(next.decision.as_deref(), Some("affinity"), "step {step}");
        assert_eq!(
            next.replica.as_deref(),
            Some(stored.as_str()),
            "step {step}"
        );
        previous = next.response_id.unwrap();
    }
}

#[test]
fn a_token_keeps_foreign_callers_out_and_the_filter_in() {
    let stack = Stack::start(StackOptions {
        indexd_token: Some(TOKEN.into()),
        ..StackOptions::default()
    })
    .unwrap();
    let first = respond(&stack, 2, None);
    let decision = first.decision.clone().unwrap();
    assert!(
        decision != "index_unavailable" && decision != "breaker_open",
        "the filter's Pick was refused: {decision}"
    );
    let stored = first.replica.clone().unwrap();
    let id = first.response_id.clone().unwrap();

    // Without the token nothing gets in, valid or not.
    let mut client = foreign_client(&stack);
    let other = stack
        .replica_addresses()
        .into_iter()
        .find(|a| *a != stored)
        .unwrap();
    let err = stack
        .block_on(client.observe(observe_req(&stack, &other, "resp_foreign")))
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
    let pick = PickRequest {
        model: stack.options().model.clone(),
        block_keys: vec![1, 2, 3],
        block_size: stack.options().block_size,
        key_scheme: kvroute_proto::SCHEME_VERSION.into(),
        ..PickRequest::default()
    };
    let err = stack.block_on(client.pick(pick)).unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
    assert_eq!(
        counter(&stack, "indexd_auth_failures_total{listener=\"grpc\"}"),
        2
    );

    // The filter sends it: its Observe was recorded, the continuation
    // follows the stored response.
    let next = respond(&stack, 3, Some(&id));
    assert_eq!(next.decision.as_deref(), Some("affinity"));
    assert_eq!(next.replica.as_deref(), Some(stored.as_str()));
    assert!(counter(&stack, "indexd_observes_total{result=\"recorded\"}") >= 1);
}

fn chat(stack: &Stack, messages: &[Value]) -> Outcome {
    let body = chat_body(&stack.options().model, messages, None);
    let out = post_json(&stack.url().unwrap(), "/v1/chat/completions", &body, &[]).unwrap();
    assert_eq!(out.status, 200, "{}", out.body);
    out
}

#[test]
fn envoy_reaches_indexd_over_a_unix_socket() {
    let mut stack = Stack::start(StackOptions {
        indexd_unix_socket: true,
        ..StackOptions::default()
    })
    .unwrap();
    let socket = stack.indexd_grpc().unix_path().unwrap().to_path_buf();
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o660);

    let mut messages = vec![
        message("system", &filler(1_000, 60)),
        message("user", &filler(4, 120)),
    ];
    let first = chat(&stack, &messages);
    let warm = first.replica.clone().unwrap();
    let served = stack
        .replica_addresses()
        .iter()
        .position(|a| *a == warm)
        .unwrap();
    let blocks = (first.prompt_tokens / u64::from(stack.options().block_size)) as usize;
    stack
        .wait_indexed(served, blocks, Duration::from_secs(10))
        .unwrap();
    messages.push(message("assistant", &first.text));
    messages.push(message("user", &filler(104, 40)));
    let second = chat(&stack, &messages);
    assert_eq!(second.decision.as_deref(), Some("precise"));
    assert_eq!(second.replica.as_deref(), Some(warm.as_str()));
    assert!(second.cached_tokens > 0);
    // Envoy's cluster really is the socket: no TCP listener to fall back to.
    let stats = stack.envoy().prometheus_stats().unwrap();
    assert!(
        stats.lines().any(|l| l.contains("kvroute_indexd")
            && l.contains("upstream_rq_total")
            && !l.ends_with(" 0")),
        "no requests on the indexd cluster"
    );
    // A stopped indexd takes its socket file with it.
    stack.stop_indexd();
    assert!(!socket.exists());
}
