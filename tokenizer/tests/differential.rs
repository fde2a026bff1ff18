//! The native tokenizer against transformers (tests/reference/expected.py,
//! itself checked against live vLLM 0.32 by tests/vllm/live_ids.py) on
//! generated requests: chat (system, tools, tool calls and results, content
//! parts, reasoning, developer roles, continue_final_message, kwargs),
//! completions and Responses (input items, instructions, tools), unicode and
//! whitespace edge cases, and conversations of 10k to 40k tokens, for both
//! model families. Every token id must match.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::collections::HashMap;

use kvroute_tokenizer::{ResponsesRequest, TokenizeRequest, Tokenizer};
use serde_json::Value;

/// The body's JSON text as written (key order matters: `serde_json::Value`
/// would sort keys). gen_requests.py writes `"body"` last.
fn raw_body(line: &str) -> &str {
    let start = line.find("\"body\": ").expect("a body") + "\"body\": ".len();
    line[start..]
        .trim_end()
        .strip_suffix('}')
        .expect("a closing brace")
}

fn ids_of(tok: &Tokenizer, endpoint: &str, body: &str) -> Result<Vec<u32>, String> {
    let bytes = body.as_bytes();
    if endpoint == "tokenize" {
        let req = TokenizeRequest::from_json(bytes).map_err(|e| e.to_string())?;
        tok.tokenize(&req)
            .map(|r| r.tokens)
            .map_err(|e| e.to_string())
    } else {
        let req = ResponsesRequest::from_json(bytes).map_err(|e| e.to_string())?;
        tok.render_responses(&req)
            .map(|r| r.token_ids)
            .map_err(|e| e.to_string())
    }
}

fn read_jsonl(path: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn every_generated_request_matches_transformers() {
    let scratch = common::scratch("differential");
    let python = common::reference_python();
    let requests = scratch.join("requests.jsonl");
    common::run(&python, "gen_requests.py", &[&requests]);
    let lines = std::fs::read_to_string(&requests).unwrap();
    let lines: Vec<&str> = lines.lines().collect();
    let reqs = read_jsonl(&requests);
    assert!(reqs.len() >= 1000);

    let mut total = 0usize;
    let mut longest = 0usize;
    for (family, dir) in common::families() {
        let expected_path = scratch.join(format!("expected-{family}.jsonl"));
        common::run(&python, "expected.py", &[&dir, &requests, &expected_path]);
        let expected: HashMap<u64, Value> = read_jsonl(&expected_path)
            .into_iter()
            .map(|e| (e["id"].as_u64().unwrap(), e))
            .collect();
        let tok = common::load(&dir);
        let mut mismatches = Vec::new();
        for (req, line) in reqs.iter().zip(&lines) {
            let id = req["id"].as_u64().unwrap();
            let want = &expected[&id];
            let got = ids_of(&tok, req["endpoint"].as_str().unwrap(), raw_body(line));
            match (want.get("tokens"), &got) {
                (Some(w), Ok(g)) => {
                    let w: Vec<u32> = serde_json::from_value(w.clone()).unwrap();
                    longest = longest.max(w.len());
                    if &w != g {
                        let at = w
                            .iter()
                            .zip(g)
                            .position(|(a, b)| a != b)
                            .unwrap_or(w.len().min(g.len()));
                        mismatches.push(format!(
                            "{family} #{id}: first difference at token {at} ({} vs {} tokens)",
                            w.len(),
                            g.len()
                        ));
                    }
                }
                (None, Err(_)) => {}
                (Some(_), Err(e)) => mismatches.push(format!("{family} #{id}: refused: {e}")),
                (None, Ok(_)) => mismatches.push(format!(
                    "{family} #{id}: accepted, reference refused: {}",
                    want["error"]
                )),
            }
            total += 1;
        }
        assert!(
            mismatches.is_empty(),
            "{} mismatches on {family}:\n{}",
            mismatches.len(),
            mismatches
                .iter()
                .take(20)
                .cloned()
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
    assert!(
        longest > 30_000,
        "the longest conversation has only {longest} tokens"
    );
    eprintln!("{total} requests matched, the longest {longest} tokens");
}

/// src/pystr/tables.rs is what gen_pycase.py writes from the reference
/// venv's Python 3.11 (vLLM 0.32's): the templates' string functions use
/// that Python's Unicode data, not Rust's.
#[test]
fn python_string_tables_are_regenerated_identically() {
    let python = common::reference_python();
    let out = common::scratch("pycase").join("tables.rs");
    common::run(&python, "gen_pycase.py", &[&out]);
    let generated = std::fs::read_to_string(&out).unwrap();
    let committed_path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/pystr/tables.rs");
    let committed = std::fs::read_to_string(&committed_path).unwrap();
    if generated != committed {
        let at = generated
            .lines()
            .zip(committed.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(generated.lines().count().min(committed.lines().count()));
        panic!(
            "{} differs from gen_pycase.py's output from line {} on: regenerate it with `{} tests/reference/gen_pycase.py src/pystr/tables.rs`",
            committed_path.display(),
            at + 1,
            python.display()
        );
    }
}

/// The divergence corpus (tests/reference/gen_divergence.py): numbers as
/// Python reads and prints them, `truncate_prompt_tokens`, and Python's
/// Unicode case mapping and whitespace in request templates. Every request
/// matches transformers, or (where the corpus allows it: integers past 128
/// bits, `str.split`, truncation in a chat completion) is declined locally
/// so that a replica tokenizes it.
#[test]
fn every_divergence_request_matches_transformers_or_falls_back() {
    let scratch = common::scratch("divergence");
    let python = common::reference_python();
    let requests = scratch.join("divergence.jsonl");
    common::run(&python, "gen_divergence.py", &[&requests]);
    let cases = common::divergence_cases(&requests);
    assert!(cases.len() >= 500, "only {} requests", cases.len());
    for (family, dir) in common::families() {
        let expected_path = scratch.join(format!("divergence-{family}.jsonl"));
        common::run(&python, "expected.py", &[&dir, &requests, &expected_path]);
        let expected: HashMap<u64, Value> = read_jsonl(&expected_path)
            .into_iter()
            .map(|e| (e["id"].as_u64().unwrap(), e))
            .collect();
        let tok = common::load_trusting(&dir);
        let mut wrong = Vec::new();
        let mut fallbacks = 0usize;
        let mut by_kind: HashMap<String, usize> = HashMap::new();
        for case in &cases {
            let want = &expected[&case.id];
            let ids: Option<Vec<u32>> = want
                .get("tokens")
                .map(|w| serde_json::from_value(w.clone()).unwrap());
            let reference = match &ids {
                Some(w) => Ok(w.as_slice()),
                None => Err(want["error"].as_str().unwrap_or("refused")),
            };
            let native = common::native_ids(&tok, &case.endpoint, &case.body);
            if let Some(why) = common::judge(case, reference, &native, &mut fallbacks) {
                wrong.push(format!("{family} {why}"));
            }
            *by_kind.entry(case.kind.clone()).or_default() += 1;
        }
        assert!(
            wrong.is_empty(),
            "{} of {} requests differ on {family}:\n{}",
            wrong.len(),
            cases.len(),
            wrong
                .iter()
                .take(20)
                .cloned()
                .collect::<Vec<_>>()
                .join("\n")
        );
        eprintln!(
            "{family}: {} requests ({by_kind:?}) matched, {fallbacks} declined locally",
            cases.len()
        );
    }
}

/// A template that, like Qwen's, refuses a system message after the first
/// (so vLLM merges inline system messages into the leading one) and prints
/// `enable_thinking` and `reasoning_effort` (so `thinking: disabled` maps
/// to `"none"`): the Messages conversion's other branch of each.
const FIRST_SYSTEM_TEMPLATE: &str = "{%- for message in messages %}{%- if message['role'] == 'system' and not loop.first %}{{ raise_exception('System message must be at the beginning.') }}{%- endif %}<|{{ message['role'] }}|>{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}{%- if message.get('reasoning') %}<think>{{ message['reasoning'] }}</think>{%- endif %}{%- for call in message.get('tool_calls') or [] %}<call>{{ call['function']['name'] }} {{ call['function']['arguments'] | tojson }}</call>{%- endfor %}{%- if message['role'] == 'tool' %}[{{ message.get('tool_call_id') }}]{%- endif %}\n{% endfor %}{%- if tools %}<tools>{{ tools | tojson }}</tools>{%- endif %}{%- if enable_thinking is defined %}<et>{{ enable_thinking }}</et>{%- endif %}{%- if reasoning_effort is defined %}<re>{{ reasoning_effort }}</re>{%- endif %}{%- if add_generation_prompt %}<|assistant|>{%- endif %}";

/// Anthropic Messages bodies (`gen_requests.py --messages`: system as a
/// string or blocks, multi-turn text, tool_use → tool_result loops, thinking
/// blocks, images, tools and tool_choice, thinking and output options,
/// unicode) converted as vLLM converts them for `/v1/messages`, on both
/// families and on tiny-llama served with a first-system-only template.
#[test]
fn every_generated_messages_request_matches_transformers() {
    use kvroute_tokenizer::{LoadOptions, MessagesRequest};
    let scratch = common::scratch("messages");
    let python = common::reference_python();
    let requests = scratch.join("messages.jsonl");
    let args = [
        "--count",
        "0",
        "--long",
        "0",
        "--messages",
        "1200",
        "--seed",
        "7",
    ];
    let mut argv: Vec<&std::path::Path> = vec![&requests];
    argv.extend(args.iter().map(std::path::Path::new));
    common::run(&python, "gen_requests.py", &argv);
    let template = scratch.join("first_system.jinja");
    std::fs::write(&template, FIRST_SYSTEM_TEMPLATE).unwrap();
    let lines = std::fs::read_to_string(&requests).unwrap();
    let lines: Vec<&str> = lines.lines().collect();
    let mut runs: Vec<(String, std::path::PathBuf, Option<&std::path::Path>)> = common::families()
        .into_iter()
        .map(|(f, d)| (f.to_owned(), d, None))
        .collect();
    runs.push((
        "tiny-llama+first-system".into(),
        common::tiny_llama(),
        Some(&template),
    ));
    for (family, dir, template) in runs {
        let expected_path = scratch.join(format!("expected-{family}.jsonl"));
        let mut argv: Vec<&std::path::Path> = vec![&dir, &requests, &expected_path];
        argv.extend(template);
        common::run(&python, "expected.py", &argv);
        let expected: HashMap<u64, Value> = read_jsonl(&expected_path)
            .into_iter()
            .map(|e| (e["id"].as_u64().unwrap(), e))
            .collect();
        let opts = LoadOptions {
            chat_template: template.map(|t| std::fs::read_to_string(t).unwrap()),
            ..LoadOptions::default()
        };
        let tok = Tokenizer::load(&dir, "test", opts).unwrap();
        let (mut matched, mut mismatches) = (0usize, Vec::new());
        for line in &lines {
            let id: u64 = serde_json::from_str::<Value>(line).unwrap()["id"]
                .as_u64()
                .unwrap();
            let got = MessagesRequest::from_json(raw_body(line).as_bytes())
                .and_then(|r| tok.tokenize_messages(&r))
                .map_err(|e| e.to_string());
            let want = &expected[&id];
            match (want.get("tokens"), got) {
                (Some(w), Ok(g)) if serde_json::from_value::<Vec<u32>>(w.clone()).unwrap() == g => {
                    matched += 1;
                }
                (Some(w), Ok(g)) => mismatches.push(format!(
                    "{family} #{id}: {} vs {} tokens",
                    w.as_array().map_or(0, Vec::len),
                    g.len()
                )),
                (None, Err(_)) => {}
                (Some(_), Err(e)) => mismatches.push(format!("{family} #{id}: refused: {e}")),
                (None, Ok(_)) => mismatches.push(format!(
                    "{family} #{id}: accepted, reference refused: {}",
                    want["error"]
                )),
            }
        }
        assert!(
            mismatches.is_empty(),
            "{} mismatches on {family}:\n{}",
            mismatches.len(),
            mismatches
                .iter()
                .take(20)
                .cloned()
                .collect::<Vec<_>>()
                .join("\n")
        );
        assert!(
            matched >= 1000,
            "{family}: only {matched} Messages requests tokenized"
        );
        eprintln!(
            "{family}: {matched} Messages requests matched, {} refused by both",
            lines.len() - matched
        );
    }
}
