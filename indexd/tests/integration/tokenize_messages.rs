//! Anthropic Messages bodies: a Pick carrying one is tokenized locally once
//! the gate (whose probe set has Messages probes, counted against the
//! replica's `count_tokens` too) is open; indexd's HTTP port answers
//! `/v1/messages/count_tokens` as vLLM does; without a local tokenizer, a
//! body that converts the same under every chat template goes to a
//! replica's `/tokenize` as the chat body it converts to, and one that
//! needs the template goes on untokenized.

use std::sync::atomic::Ordering;

use kvroute_proto::v1::{Api, DecisionKind, TokenizerSource};
use kvroute_tokenizer::{MessagesRequest, Tokenizer};

use super::tokenize::{
    MODEL, gate_open, get, model_dir, pick_body, start_indexd_with, start_replica, wait_for_gate,
};

/// A two-turn tool loop: a tool_use answered by a tool_result.
fn tool_loop(system: &str) -> Vec<u8> {
    serde_json::json!({
        "model": MODEL,
        "max_tokens": 32,
        "system": system,
        "messages": [
            {"role": "user", "content": "List the files."},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Listing."},
                {"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {"path": "."}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.rs\nb.rs"},
            ]},
        ],
        "cache_salt": "tenant-a",
    })
    .to_string()
    .into_bytes()
}

fn prompt_of(truth: &Tokenizer, body: &[u8]) -> Vec<u32> {
    truth
        .tokenize_messages(&MessagesRequest::from_json(body).unwrap())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_picks_and_count_tokens_are_answered_locally() {
    let dir = model_dir();
    let (replica, mut d, truth) = gate_open(&dir).await;
    let metrics = get(&format!("{}/metrics", d.http)).await;
    let probes = |result: &str| {
        let series = format!(
            "indexd_tokenizer_checks_total{{model=\"{MODEL}\",kind=\"probe\",result=\"{result}\"}} "
        );
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&series)?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    // Every probe agreed, the Messages ones (ids and count) among them.
    let messages_probes = indexd::tokenize::probe::probes(MODEL)
        .iter()
        .filter(|(api, _)| *api == indexd::tokenize::Api::Messages)
        .count();
    assert!(messages_probes >= 2);
    assert_eq!(probes("mismatch"), 0, "{metrics}");
    assert!(
        probes("agree") >= indexd::tokenize::probe::probes(MODEL).len() as u64,
        "{metrics}"
    );

    let body = tool_loop("You list files.");
    let want = prompt_of(&truth, &body);
    let calls = replica.calls.load(Ordering::Relaxed);
    let a = pick_body(&mut d, Api::Messages, body.clone()).await;
    assert_eq!(a.tokenizer, TokenizerSource::Local as i32);
    assert_eq!(a.prompt_tokens as usize, want.len());
    assert_ne!(a.decision, DecisionKind::Untokenized as i32);

    // count_tokens on indexd's HTTP port: vLLM's answer, locally.
    let http = reqwest::Client::new();
    let r = http
        .post(format!("{}/v1/messages/count_tokens", d.http))
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-kvroute-tokenizer"], "local");
    let v: serde_json::Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
    assert_eq!(v["input_tokens"], want.len());
    assert!(
        replica.calls.load(Ordering::Relaxed) - calls <= 1,
        "local tokenization called the replica (beyond one shadow check)"
    );

    // What vLLM refuses, in Anthropic's error shape.
    let r = http
        .post(format!("{}/v1/messages/count_tokens", d.http))
        .body(r#"{"model":"tiny","messages":"not a list"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let v: serde_json::Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
    assert_eq!(v["type"], "error", "{v}");
    assert!(v["error"]["message"].is_string(), "{v}");
    let a = pick_body(
        &mut d,
        Api::Messages,
        br#"{"model":"tiny","max_tokens":8,"messages":[]}"#.to_vec(),
    )
    .await;
    assert_eq!(a.decision, DecisionKind::Untokenized as i32);
    // The client's own error (vLLM answers it 400): no routing was lost.
    let ready = get(&format!("{}/readyz", d.http)).await;
    assert!(!ready.contains("untokenized Picks"), "{ready}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_local_tokenizer_only_template_free_messages_are_tokenized() {
    let dir = model_dir();
    let replica = start_replica(&dir).await;
    let mut d = start_indexd_with(replica.addr, None, |_| {}).await;
    let truth = Tokenizer::load(&dir, MODEL, kvroute_tokenizer::LoadOptions::default()).unwrap();

    // No inline system message, no thinking disabled: the same chat body
    // under every template, tokenized by the replica's /tokenize.
    let body = tool_loop("You list files.");
    let a = pick_body(&mut d, Api::Messages, body.clone()).await;
    assert_eq!(a.tokenizer, TokenizerSource::Replica as i32, "{a:?}");
    assert_eq!(a.prompt_tokens as usize, prompt_of(&truth, &body).len());

    // An inline system message: merged into the first or not by what the
    // template accepts, which indexd cannot read without it.
    let mut inline: serde_json::Value = serde_json::from_slice(&body).unwrap();
    inline["messages"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({"role": "system", "content": "Be brief."}));
    inline["messages"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({"role": "user", "content": "Go on."}));
    let a = pick_body(&mut d, Api::Messages, inline.to_string().into_bytes()).await;
    assert_eq!(a.decision, DecisionKind::Untokenized as i32, "{a:?}");
    assert!(a.reason.contains("chat template"), "{}", a.reason);
    // A fallback, so /readyz names it (the body vLLM refuses is not one).
    let ready = get(&format!("{}/readyz", d.http)).await;
    assert!(
        ready.contains("untokenized Picks: 1 since start went on by load with no ids")
            && ready.contains("model tiny: not reproduced locally")
            && ready.contains("chat template"),
        "{ready}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_messages_body_counted_otherwise_is_noted_beside_its_pick() {
    let dir = model_dir();
    let replica = start_replica(&dir).await;
    // Ten live checks a second (the default is one every 10 s).
    let mut d = start_indexd_with(replica.addr, Some(&dir), |c| {
        c.tokenize.gate.shadow_per_second = 10.0;
    })
    .await;
    wait_for_gate(&d, 1).await;
    let truth = Tokenizer::load(&dir, MODEL, kvroute_tokenizer::LoadOptions::default()).unwrap();
    // From now on the replica's count_tokens is one more than indexd's ids:
    // the shadow check beside the next live Messages Pick finds it.
    replica.count_skew.store(1, Ordering::Relaxed);
    let series = |result: &str| {
        format!(
            "indexd_tokenizer_checks_total{{model=\"{MODEL}\",kind=\"shadow\",result=\"{result}\"}} 1"
        )
    };
    let mut noted = false;
    for i in 0..40 {
        let body = tool_loop(&format!("Variant {i}."));
        let a = pick_body(&mut d, Api::Messages, body.clone()).await;
        // Routed on its local ids at once, whatever the check finds.
        assert_eq!(a.tokenizer, TokenizerSource::Local as i32, "{a:?}");
        assert_eq!(a.prompt_tokens as usize, prompt_of(&truth, &body).len());
        // The check ends after the Pick's answer; ten a second.
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        if get(&format!("{}/metrics", d.http))
            .await
            .contains(&series("mismatch"))
        {
            noted = true;
            break;
        }
    }
    assert!(noted, "a shadow check of a Messages Pick within 40 Picks");
    // One body does not close the gate.
    let metrics = get(&format!("{}/metrics", d.http)).await;
    assert!(
        metrics.contains(&format!("indexd_tokenizer_gate{{model=\"{MODEL}\"}} 1")),
        "{metrics}"
    );
}
