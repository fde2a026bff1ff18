//! The real-vLLM tier's differential test (`make test-vllm`): the native
//! tokenizer against live vLLM 0.32 itself, on both model families, for the
//! generated requests of tests/reference/gen_requests.py (chat with system
//! prompts, tools, tool calls and results, content parts and reasoning;
//! completions; Responses input items and instructions; unicode and
//! whitespace edge cases; conversations past 30k tokens). vLLM runs as its
//! GPU-less render server (tests/vllm/render_server.py: `/tokenize` and the
//! render endpoints, no engine), one per model. Every token id must match,
//! and every refusal must be a refusal on both sides. Anthropic Messages
//! bodies, for which vLLM serves no ids: vLLM's own conversion to chat
//! (run offline in its venv, tests/reference/vllm_messages.py), tokenized
//! by the live server's `/tokenize`, against the native tokenizer's ids of
//! the Messages body; and vLLM's conversion against the reference's
//! transcription of it, which tests/differential.rs checks the native
//! tokenizer against.
//!
//! Ignored by default: it needs the vLLM venv (tests/vllm/install.sh).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvroute_tokenizer::{MessagesRequest, ResponsesRequest, TokenizeRequest, Tokenizer};
use serde_json::Value;

/// How long a render server may take to start.
const START: Duration = Duration::from_secs(180);

fn vllm_python() -> PathBuf {
    let venv = std::env::var_os("KVROUTE_VLLM_VENV").map_or_else(
        || {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/kvroute/vllm-venv")
        },
        PathBuf::from,
    );
    let python = venv.join("bin/python");
    assert!(
        python.is_file(),
        "no vLLM venv at {} (bash tests/vllm/install.sh)",
        venv.display()
    );
    python
}

/// A render server, killed (with its process group) on drop.
struct RenderServer {
    child: Child,
    url: String,
    log: PathBuf,
}

impl Drop for RenderServer {
    fn drop(&mut self) {
        // SIGKILL to the group: the server's workers die with it. The `--`
        // matters: procps-ng 4.0's kill reads `-9 -PID` as `-9 -N`, N the
        // PID's first digit, and a PID starting with 1 becomes kill(-1),
        // every process on the machine.
        let pid = self.child.id();
        let _ = Command::new("kill")
            .args(["-s", "KILL", "--", &format!("-{pid}")])
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn post(url: &str, body: &str) -> (u16, Value) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(300)))
        .http_status_as_error(false)
        .build()
        .into();
    let mut r = agent
        .post(url)
        .header("content-type", "application/json")
        .send(body.as_bytes())
        .unwrap_or_else(|e| panic!("{url}: {e}"));
    let status = r.status().as_u16();
    let text = r.body_mut().read_to_string().unwrap_or_default();
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

fn start(model_dir: &Path, scratch: &Path, name: &str) -> RenderServer {
    start_with(model_dir, scratch, name, &[])
}

/// A render server with `extra` vLLM flags.
fn start_with(model_dir: &Path, scratch: &Path, name: &str, extra: &[&str]) -> RenderServer {
    use std::os::unix::process::CommandExt;
    // The server binds port 0 and writes the port it got: a port chosen
    // here and released could be taken by another process meanwhile.
    // The scratch directory outlives a run: a port file left by one would
    // point this one at a server that is gone.
    let port_file = scratch.join(format!("render-{name}.port"));
    match std::fs::remove_file(&port_file) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            panic!("remove {}: {e}", port_file.display())
        }
        _ => {}
    }
    let log = scratch.join(format!("render-{name}.log"));
    let out = std::fs::File::create(&log).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/vllm/render_server.py");
    let mut cmd = Command::new(vllm_python());
    cmd.arg(script)
        .arg("--port-file")
        .arg(&port_file)
        .arg("--model")
        .arg(model_dir)
        .args([
            "--served-model-name",
            "test",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
        ])
        .args(extra)
        .env("HF_HUB_OFFLINE", "1")
        .env("VLLM_LOGGING_LEVEL", "WARNING")
        .stdout(Stdio::from(out.try_clone().unwrap()))
        .stderr(Stdio::from(out))
        .process_group(0);
    let child = cmd.spawn().expect("start the render server");
    // Its URL is known once the port file is written.
    let mut server = RenderServer {
        child,
        url: String::new(),
        log,
    };
    let started = Instant::now();
    loop {
        if server.url.is_empty()
            && let Some(port) = std::fs::read_to_string(&port_file)
                .ok()
                .and_then(|text| text.trim().parse::<u16>().ok())
        {
            server.url = format!("http://127.0.0.1:{port}");
        }
        if !server.url.is_empty() {
            let probe = ureq::get(&format!("{}/health", server.url)).call();
            if probe.is_ok_and(|r| r.status() == 200) {
                return server;
            }
        }
        if started.elapsed() > START {
            let mut text = String::new();
            let _ = std::fs::File::open(&server.log).and_then(|mut f| f.read_to_string(&mut text));
            panic!("the render server for {name} did not start:\n{text}");
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The body's JSON text as written (key order reaches the template).
fn raw_body(line: &str) -> &str {
    let start = line.find("\"body\": ").expect("a body") + "\"body\": ".len();
    line[start..]
        .trim_end()
        .strip_suffix('}')
        .expect("a closing brace")
}

/// The body with `"model": "test"` first (the server's name for it).
fn with_model(body: &str) -> String {
    let rest = body.trim_start().strip_prefix('{').expect("an object");
    if rest.trim_start().starts_with('}') {
        "{\"model\":\"test\"}".to_owned()
    } else {
        format!("{{\"model\":\"test\",{rest}")
    }
}

fn local(tok: &Tokenizer, endpoint: &str, body: &str) -> Result<Vec<u32>, String> {
    if endpoint == "tokenize" {
        TokenizeRequest::from_json(body.as_bytes())
            .and_then(|r| tok.tokenize(&r))
            .map(|r| r.tokens)
            .map_err(|e| e.to_string())
    } else {
        ResponsesRequest::from_json(body.as_bytes())
            .and_then(|r| tok.render_responses(&r))
            .map(|r| r.token_ids)
            .map_err(|e| e.to_string())
    }
}

fn live_ids(answer: &Value) -> Option<Vec<u32>> {
    let v = match answer {
        Value::Array(items) if items.len() == 1 => &items[0],
        other => other,
    };
    let ids = v.get("tokens").or_else(|| v.get("token_ids"))?;
    serde_json::from_value(ids.clone()).ok()
}

#[test]
#[ignore = "needs real vLLM: make test-vllm"]
fn every_generated_request_matches_live_vllm() {
    let scratch = common::scratch("live-vllm");
    let requests = scratch.join("requests.jsonl");
    common::run(&common::reference_python(), "gen_requests.py", &[&requests]);
    let text = std::fs::read_to_string(&requests).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines.len() >= 1000, "only {} requests", lines.len());

    let mut checked = 0usize;
    let mut longest = 0usize;
    for (family, dir) in common::families() {
        let server = start(&dir, &scratch, family);
        let tok = common::load(&dir);
        let mut mismatches = Vec::new();
        for line in &lines {
            let req: Value = serde_json::from_str(line).unwrap();
            let id = req["id"].as_u64().unwrap();
            let endpoint = req["endpoint"].as_str().unwrap();
            let body = with_model(raw_body(line));
            let path = if endpoint == "tokenize" {
                "/tokenize"
            } else {
                "/v1/responses/render"
            };
            let (status, answer) = post(&format!("{}{path}", server.url), &body);
            assert!(
                status < 500,
                "{family} #{id}: vLLM answered {status}: {answer}"
            );
            let theirs = (status == 200).then(|| live_ids(&answer)).flatten();
            let mine = local(&tok, endpoint, &body);
            match (theirs, mine) {
                (Some(w), Ok(g)) => {
                    longest = longest.max(w.len());
                    if w != g {
                        let at = w
                            .iter()
                            .zip(&g)
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
                (Some(_), Err(e)) => {
                    mismatches.push(format!("{family} #{id}: vLLM took it, we refused: {e}"))
                }
                (None, Ok(_)) => mismatches.push(format!(
                    "{family} #{id}: vLLM refused ({status}: {answer}), we took it"
                )),
            }
            checked += 1;
        }
        assert!(
            mismatches.is_empty(),
            "{} token-id mismatches against live vLLM on {family}:\n{}",
            mismatches.len(),
            mismatches
                .iter()
                .take(20)
                .cloned()
                .collect::<Vec<_>>()
                .join("\n")
        );
        eprintln!(
            "{family}: {} requests, 0 mismatches against live vLLM",
            lines.len()
        );
    }
    assert!(
        longest > 30_000,
        "the longest prompt has only {longest} tokens"
    );
    eprintln!("{checked} requests matched live vLLM, the longest {longest} tokens");
}

/// The divergence corpus (tests/reference/gen_divergence.py) against live
/// vLLM, which trusts request chat templates here: numbers as Python reads
/// and prints them, `truncate_prompt_tokens` (`/tokenize` ignores it, the
/// chat completion's render applies it), Python's Unicode case mapping and
/// whitespace. Every request matches vLLM's ids (or both refuse), or is one
/// the corpus allows the native tokenizer to decline locally, so that a
/// replica tokenizes it.
#[test]
#[ignore = "needs real vLLM: make test-vllm"]
fn every_divergence_request_matches_live_vllm_or_falls_back() {
    let scratch = common::scratch("live-divergence");
    let requests = scratch.join("divergence.jsonl");
    common::run(
        &common::reference_python(),
        "gen_divergence.py",
        &[&requests],
    );
    let cases = common::divergence_cases(&requests);
    assert!(cases.len() >= 500, "only {} requests", cases.len());
    for (family, dir) in common::families() {
        let server = start_with(
            &dir,
            &scratch,
            &format!("{family}-trusting"),
            &["--trust-request-chat-template"],
        );
        let tok = common::load_trusting(&dir);
        let mut wrong = Vec::new();
        let mut fallbacks = 0usize;
        for case in &cases {
            let path = match case.endpoint.as_str() {
                "tokenize" => "/tokenize",
                "chat_render" => "/v1/chat/completions/render",
                _ => "/v1/responses/render",
            };
            let (status, answer) = post(&format!("{}{path}", server.url), &with_model(&case.body));
            assert!(
                status < 500,
                "{family} #{}: vLLM answered {status}: {answer}",
                case.id
            );
            let theirs = (status == 200).then(|| live_ids(&answer)).flatten();
            let refusal = format!("{status}: {answer}");
            let reference = match &theirs {
                Some(ids) => Ok(ids.as_slice()),
                None => Err(refusal.as_str()),
            };
            let native = common::native_ids(&tok, &case.endpoint, &case.body);
            if let Some(why) = common::judge(case, reference, &native, &mut fallbacks) {
                wrong.push(format!("{family} {why}"));
            }
        }
        assert!(
            wrong.is_empty(),
            "{} of {} requests differ from live vLLM on {family}:\n{}",
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
            "{family}: {} divergence requests matched live vLLM, {fallbacks} declined locally",
            cases.len()
        );
    }
}

/// Writes `count` generated Messages bodies (and nothing else) from `seed`.
fn messages_corpus(requests: &Path, count: u32, seed: u64) {
    let (count, seed) = (count.to_string(), seed.to_string());
    let args = [
        "--count",
        "0",
        "--long",
        "0",
        "--messages",
        &count,
        "--seed",
        &seed,
    ];
    let mut argv: Vec<&Path> = vec![requests];
    argv.extend(args.iter().map(Path::new));
    common::run(&common::reference_python(), "gen_requests.py", &argv);
}

/// vLLM's own Messages → chat conversion (`to_chat_completion_request`,
/// imported from the vLLM venv, no server) agrees with expected.py's
/// transcription on every generated Messages body, with and without the
/// inline-system merge, refusals included.
#[test]
#[ignore = "needs real vLLM: make test-vllm"]
fn messages_conversion_matches_vllm() {
    let scratch = common::scratch("live-messages");
    let requests = scratch.join("messages.jsonl");
    messages_corpus(&requests, 1200, 7);
    let (llama, deepseek) = (common::tiny_llama(), common::tiny_deepseek());
    common::run(
        &vllm_python(),
        "vllm_messages.py",
        &[&requests, &llama, &deepseek],
    );
}

/// Messages bodies against live vLLM: each body's chat as vLLM converts it
/// for the model (its inline-system merge detected on the model's template),
/// tokenized by the live `/tokenize`, must give the native tokenizer's ids
/// of the Messages body; what vLLM's conversion refuses, the native one
/// refuses. Bodies whose ids hang on the chat completion's extra template
/// argument (`reasoning_effort`) or on the clock (a stamped tool_use id) are
/// left out; at least 1,000 a model are compared.
#[test]
#[ignore = "needs real vLLM: make test-vllm"]
fn every_messages_body_matches_live_vllm() {
    let scratch = common::scratch("live-messages-ids");
    let requests = scratch.join("messages.jsonl");
    messages_corpus(&requests, 2000, 11);
    let text = std::fs::read_to_string(&requests).unwrap();
    let bodies: std::collections::HashMap<u64, &str> = text
        .lines()
        .map(|line| {
            let req: Value = serde_json::from_str(line).unwrap();
            (req["id"].as_u64().unwrap(), raw_body(line))
        })
        .collect();
    for (family, dir) in common::families() {
        let converted = scratch.join(format!("converted-{family}.jsonl"));
        common::run(
            &vllm_python(),
            "vllm_messages.py",
            &[&requests, Path::new("--emit"), &dir, &converted],
        );
        let server = start(&dir, &scratch, family);
        let tok = common::load(&dir);
        let (mut compared, mut refused, mut mismatches) = (0usize, 0usize, Vec::new());
        for line in std::fs::read_to_string(&converted).unwrap().lines() {
            let rec: Value = serde_json::from_str(line).unwrap();
            let id = rec["id"].as_u64().unwrap();
            let body = bodies[&id];
            let mine =
                MessagesRequest::from_json(body.as_bytes()).and_then(|r| tok.tokenize_messages(&r));
            if rec.get("error").is_some() {
                refused += 1;
                if let Ok(ids) = mine {
                    mismatches.push(format!(
                        "#{id}: vLLM refused ({}), native gave {} ids",
                        rec["error"],
                        ids.len()
                    ));
                }
                continue;
            }
            if rec.get("tokenize").is_none() {
                continue;
            }
            // The request as written: key order reaches the template (tojson).
            let chat = line
                .split_once("\"tokenize\": ")
                .and_then(|(_, rest)| rest.trim_end().strip_suffix('}'))
                .unwrap();
            let (status, answer) = post(&format!("{}/tokenize", server.url), chat);
            assert!(
                status < 500,
                "{family} #{id}: vLLM answered {status}: {answer}"
            );
            let theirs = (status == 200).then(|| live_ids(&answer)).flatten();
            match (theirs, mine) {
                (Some(w), Ok(g)) if w == g => compared += 1,
                (Some(w), Ok(g)) => mismatches.push(format!(
                    "#{id}: ids differ (vLLM {} ids, native {})",
                    w.len(),
                    g.len()
                )),
                (None, Err(_)) => refused += 1,
                (w, g) => mismatches.push(format!(
                    "#{id}: vLLM {:?}, native {:?}",
                    w.map(|v| v.len()),
                    g.map(|v| v.len())
                )),
            }
        }
        drop(server);
        eprintln!(
            "{family}: {compared} Messages bodies matched live vLLM's ids, {refused} refused by both, {} mismatches",
            mismatches.len()
        );
        assert!(
            mismatches.is_empty(),
            "{family}: {} Messages mismatches:\n{}",
            mismatches.len(),
            mismatches
                .iter()
                .take(20)
                .cloned()
                .collect::<Vec<_>>()
                .join("\n")
        );
        assert!(compared >= 1000, "{family}: only {compared} compared");
    }
}
