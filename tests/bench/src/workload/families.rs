//! The workload families as seeded scripts: W1's salted pairs, W2's
//! agentic conversations, and W3, W4 and W5 built on W2's scripts (a small
//! cache, three gateways, faults mid-run).

use mock_vllm::KvCacheLayout;
use serde_json::{Value, json};

use super::{Api, Conversation, Fault, FaultKind, GatewayChoice, Scale, Step, Workload};
use crate::rng::Rng;

/// W4: W2's scripts through three gateways.
pub(super) fn w4(scale: Scale, seed: u64) -> Workload {
    let mut w = w2(scale, seed);
    w.name = "w4".into();
    w.gateways = 3;
    w
}

/// W5: W2's scripts with four faults, at 15%, 35%, 55% and 75% of the requests.
pub(super) fn w5(scale: Scale, seed: u64) -> Workload {
    let mut w = w2(scale, seed);
    w.name = "w5".into();
    let n = w.requests();
    let at = |percent: usize| n * percent / 100;
    let last = w.replicas.saturating_sub(1);
    w.faults = vec![
        Fault {
            at_request: at(15),
            kind: FaultKind::ReplicaRestart {
                replica: 1.min(last),
            },
        },
        Fault {
            at_request: at(35),
            kind: FaultKind::EventDelay { ms: 1_500 },
        },
        Fault {
            at_request: at(55),
            kind: FaultKind::LostBatches {
                first: 2.min(last),
                replicas: 2,
                batches: 4,
            },
        },
        Fault {
            at_request: at(75),
            kind: FaultKind::IndexdRestart { down_ms: 2_000 },
        },
    ];
    w
}

/// Prefix-cache blocks per replica for W1 and W2: enough that W2's working set fits with affinity.
const ROOMY_GPU_BLOCKS: usize = 32_768;

/// W3: W2's scripts with each replica's cache at 2,048 blocks (32k tokens at block size 16), far
/// below W2's working set (64 conversations of up to 26k tokens over 8 replicas): blocks are evicted
/// all the time, so a router that pins conversations to a few replicas evicts its own history.
pub(super) fn w3(scale: Scale, seed: u64) -> Workload {
    let mut w = w2(scale, seed);
    w.name = "w3".into();
    w.gpu_blocks = match scale {
        Scale::Full => 2_048,
        Scale::Smoke => 256,
    };
    w
}

/// A tool call of one of `tool_names` and its result of `result_words`
/// (low, high) words.
pub(crate) fn tool_step(rng: &mut Rng, tool_names: &[&str], result_words: (usize, usize)) -> Step {
    let name = tool_names
        .get(rng.range(0, tool_names.len().saturating_sub(1)))
        .copied()
        .unwrap_or("search");
    let words = rng.range(result_words.0, result_words.1);
    Step::Tool {
        name: name.to_owned(),
        arguments: json!({"arg": rng.words(3)}).to_string(),
        result: rng.words(words),
    }
}

/// Words of W1's document: with markers and the follow-up, the continuation
/// prompt is ≈ 6,650 tokens, as in the published figure (6,653).
const W1_DOCUMENT_WORDS: usize = 6_560;

/// W1's pair `i`: a document, then one follow-up question of `question_words`.
pub(crate) fn w1_pair(
    rng: &mut Rng,
    i: usize,
    api: Api,
    doc_words: usize,
    question_words: usize,
) -> Conversation {
    Conversation {
        id: i as u32,
        api,
        // A fresh salt per pair: nothing is shared across pairs.
        salt: Some(format!("w1-pair{i}-{}", rng.tag())),
        system: None,
        tools: None,
        first: format!("Read this document. {}", rng.words(doc_words)),
        steps: vec![Step::User(format!(
            "Now answer the follow-up question. {}",
            rng.words(question_words)
        ))],
        max_tokens: 4,
        start_ms: 0,
    }
}

pub(super) fn w1(api: Api, scale: Scale, seed: u64) -> Workload {
    let (pairs, doc_words) = match scale {
        Scale::Full => (12, W1_DOCUMENT_WORDS),
        Scale::Smoke => (3, 600),
    };
    let api_tag: u64 = if api == Api::Chat { 1 } else { 2 };
    let conversations = (0..pairs)
        .map(|i| {
            let mut rng = Rng::new(seed, (api_tag << 32) | i as u64);
            w1_pair(&mut rng, i, api, doc_words, 60)
        })
        .collect();
    Workload {
        name: if api == Api::Chat {
            "w1-chat".into()
        } else {
            "w1-responses".into()
        },
        replicas: 2,
        concurrency: 1,
        time_scale: 1.0,
        gpu_blocks: ROOMY_GPU_BLOCKS,
        block_size: 16,
        reasoning_tokens: 0,
        conversations,
        gateways: 1,
        gateway_choice: GatewayChoice::Drawn,
        faults: Vec::new(),
        kv_cache_layout: KvCacheLayout::default(),
        max_num_batched_tokens: None,
    }
}

/// W2's size at a scale.
struct W2Shape {
    replicas: usize,
    conversations: usize,
    concurrency: usize,
    max_context: usize,
    result_words: (usize, usize),
    steps: (usize, usize),
}

pub(super) fn w2(scale: Scale, seed: u64) -> Workload {
    let shape = match scale {
        Scale::Full => W2Shape {
            replicas: 8,
            conversations: 64,
            concurrency: 16,
            max_context: 26_000,
            result_words: (800, 4_000),
            steps: (5, 9),
        },
        Scale::Smoke => W2Shape {
            replicas: 3,
            conversations: 6,
            concurrency: 3,
            max_context: 4_000,
            result_words: (100, 400),
            steps: (2, 4),
        },
    };
    let mut shared = Rng::new(seed, 0x5eed_0002);
    let system = format!(
        "You are a coding agent working in a large repository. Follow the policy. {}",
        shared.words(800)
    );
    let tool_names = [
        "read_file",
        "search",
        "run_tests",
        "edit_file",
        "list_dir",
        "git_diff",
        "build",
        "web_fetch",
    ];
    let tools: Vec<Value> = tool_names
        .iter()
        .map(|name| {
            json!({"type": "function", "function": {
                "name": name,
                "description": shared.words(100),
                "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}},
            }})
        })
        .collect();
    let tools = Value::Array(tools);
    // Shared prefix ≈ 800 system + ≈ 1,500 tool tokens; each reply ≈ 16.
    let base_tokens = 2_300;
    let reply_tokens = 24;
    let conversations = (0..shape.conversations)
        .map(|c| {
            let mut rng = Rng::new(seed, (3u64 << 32) | c as u64);
            // Four tenants: three salted, one not.
            let tenant = c % 4;
            let salt = (tenant != 0).then(|| format!("tenant-{tenant}"));
            let first_words = rng.range(150, 400);
            let first = format!("Task {c}: {}", rng.words(first_words));
            let mut context = base_tokens + first_words;
            let mut steps = Vec::new();
            let wanted = rng.range(shape.steps.0, shape.steps.1);
            let mut last_was_retry = true;
            for _ in 0..wanted {
                let roll = rng.unit();
                let step = if roll < 0.12 && !last_was_retry {
                    let words = rng.range(shape.result_words.0, shape.result_words.1);
                    Step::Retry(format!("retried output: {}", rng.words(words)))
                } else if roll < 0.32 {
                    let words = rng.range(30, 150);
                    Step::User(rng.words(words))
                } else {
                    tool_step(&mut rng, &tool_names, shape.result_words)
                };
                let added = match &step {
                    Step::Tool { result, .. } => result.split(' ').count() + reply_tokens + 20,
                    Step::User(text) => text.split(' ').count() + reply_tokens,
                    // A retry replaces an input of about the same size.
                    Step::Retry(text) => text.split(' ').count() / 4,
                };
                if context + added > shape.max_context {
                    break;
                }
                context += added;
                last_was_retry = matches!(step, Step::Retry(_));
                steps.push(step);
            }
            Conversation {
                id: c as u32,
                api: Api::Chat,
                salt,
                system: Some(system.clone()),
                tools: Some(tools.clone()),
                first,
                steps,
                max_tokens: 16,
                start_ms: 0,
            }
        })
        .collect();
    Workload {
        name: "w2".into(),
        replicas: shape.replicas,
        concurrency: shape.concurrency,
        time_scale: 0.5,
        gpu_blocks: ROOMY_GPU_BLOCKS,
        block_size: 16,
        reasoning_tokens: 6,
        conversations,
        gateways: 1,
        gateway_choice: GatewayChoice::Drawn,
        faults: Vec::new(),
        kv_cache_layout: KvCacheLayout::default(),
        max_num_batched_tokens: None,
    }
}

#[cfg(test)]
mod tests {
    use crate::workload::{Scale, Step, Workload, WorkloadKind, build};

    #[test]
    fn workloads_are_reproducible_from_the_seed() {
        let a = build(WorkloadKind::W2, Scale::Full, 42);
        let b = build(WorkloadKind::W2, Scale::Full, 42);
        let c = build(WorkloadKind::W2, Scale::Full, 43);
        let script = |w: &[Workload]| {
            w.iter()
                .flat_map(|w| w.conversations.iter())
                .map(|c| format!("{:?}{}{:?}", c.salt, c.first, c.steps))
                .collect::<Vec<_>>()
        };
        assert_eq!(script(&a), script(&b));
        assert_ne!(script(&a), script(&c));
    }

    #[test]
    fn w1_has_the_published_shape() {
        let w = build(WorkloadKind::W1, Scale::Full, 1);
        assert_eq!(w.len(), 2);
        for w in &w {
            assert_eq!(w.replicas, 2);
            assert_eq!(w.conversations.len(), 12);
            assert_eq!(w.requests(), 24);
            let salts: std::collections::HashSet<_> =
                w.conversations.iter().map(|c| c.salt.clone()).collect();
            assert_eq!(salts.len(), 12, "a fresh salt per pair");
        }
    }

    #[test]
    fn w5_injects_every_fault_kind_in_order() {
        let w = &build(WorkloadKind::W5, Scale::Full, 42)[0];
        let labels: Vec<&str> = w.faults.iter().map(|f| f.kind.label()).collect();
        assert_eq!(
            labels,
            [
                "replica-restart",
                "event-delay",
                "lost-batches",
                "indexd-restart"
            ]
        );
        assert!(
            w.faults
                .windows(2)
                .all(|p| p[0].at_request < p[1].at_request)
        );
        assert!(
            w.faults
                .iter()
                .all(|f| f.at_request > 0 && f.at_request < w.requests())
        );
    }

    #[test]
    fn w2_is_concurrent_agentic_traffic() {
        let w = build(WorkloadKind::W2, Scale::Full, 1);
        let w = &w[0];
        assert!(w.replicas >= 8 && w.conversations.len() >= 64);
        let steps: Vec<&Step> = w.conversations.iter().flat_map(|c| &c.steps).collect();
        assert!(steps.iter().any(|s| matches!(s, Step::Retry(_))));
        assert!(steps.iter().any(|s| matches!(s, Step::User(_))));
        assert!(
            steps
                .iter()
                .filter(|s| matches!(s, Step::Tool { .. }))
                .count()
                > 100
        );
        assert!(w.conversations.iter().any(|c| c.salt.is_none()));
        assert!(w.conversations.iter().any(|c| c.salt.is_some()));
        assert!(w.reasoning_tokens > 0);
    }
}
