//! Shared by the integration tests: where the two test models and the
//! reference venv are, and running the reference scripts.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::Command;

use kvroute_tokenizer::{LoadOptions, Tokenizer};

fn home() -> PathBuf {
    PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
}

fn dir_from(var: &str, default: &str) -> PathBuf {
    std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| home().join(default))
}

fn require(dir: &Path, what: &str) -> PathBuf {
    assert!(
        dir.join("tokenizer.json").is_file() || dir.join("bin/python").is_file(),
        "{what} not found at {}: run `bash .ci/deps.sh` (it builds the test models and the reference venv)",
        dir.display()
    );
    dir.to_owned()
}

/// The tiny-llama model directory ($KVROUTE_VLLM_MODEL).
pub fn tiny_llama() -> PathBuf {
    require(
        &dir_from("KVROUTE_VLLM_MODEL", ".cache/kvroute/tiny-llama"),
        "tiny-llama",
    )
}

/// The tiny-deepseek model directory ($KVROUTE_VLLM_MODEL2).
pub fn tiny_deepseek() -> PathBuf {
    require(
        &dir_from("KVROUTE_VLLM_MODEL2", ".cache/kvroute/tiny-deepseek"),
        "tiny-deepseek",
    )
}

/// The reference venv's python ($KVROUTE_TOK_VENV).
pub fn reference_python() -> PathBuf {
    require(
        &dir_from("KVROUTE_TOK_VENV", ".cache/kvroute/tok-venv"),
        "the reference venv",
    )
    .join("bin/python")
}

/// Both families: (name, directory).
pub fn families() -> Vec<(&'static str, PathBuf)> {
    vec![
        ("tiny-llama", tiny_llama()),
        ("tiny-deepseek", tiny_deepseek()),
    ]
}

pub fn load(dir: &Path) -> Tokenizer {
    Tokenizer::load(dir, "test", LoadOptions::default()).expect("load")
}

/// One shared tokenizer per family for this test binary.
pub fn shared(family: &str) -> &'static Tokenizer {
    use std::sync::OnceLock;
    static LLAMA: OnceLock<Tokenizer> = OnceLock::new();
    static DEEPSEEK: OnceLock<Tokenizer> = OnceLock::new();
    match family {
        "tiny-llama" => LLAMA.get_or_init(|| load(&tiny_llama())),
        _ => DEEPSEEK.get_or_init(|| load(&tiny_deepseek())),
    }
}

/// The `tokenizers` reference of one family, loaded once.
pub fn reference(family: &str) -> &'static tokenizers::Tokenizer {
    use std::sync::OnceLock;
    static LLAMA: OnceLock<tokenizers::Tokenizer> = OnceLock::new();
    static DEEPSEEK: OnceLock<tokenizers::Tokenizer> = OnceLock::new();
    let file = |d: PathBuf| {
        tokenizers::Tokenizer::from_file(d.join("tokenizer.json")).expect("tokenizer.json")
    };
    match family {
        "tiny-llama" => LLAMA.get_or_init(|| file(tiny_llama())),
        _ => DEEPSEEK.get_or_init(|| file(tiny_deepseek())),
    }
}

pub fn reference_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/reference")
}

/// Runs `python script args…`, panicking with its stderr on failure.
pub fn run(python: &Path, script: &str, args: &[&Path]) {
    let out = Command::new(python)
        .arg(reference_dir().join(script))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", python.display()));
    assert!(
        out.status.success(),
        "{script} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A scratch directory for this test binary.
pub fn scratch(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::create_dir_all(&d).expect("scratch dir");
    d
}

/// One request of gen_divergence.py's corpus.
pub struct DivergenceCase {
    pub id: u64,
    pub endpoint: String,
    pub kind: String,
    pub may_fall_back: bool,
    /// The body's JSON text as written (it may hold `-0`, `1e400`, `NaN`).
    pub body: String,
}

/// Reads gen_divergence.py's output: the fields before `"body"` as JSON,
/// the body as text (a strict JSON reader refuses some of its numbers).
pub fn divergence_cases(path: &Path) -> Vec<DivergenceCase> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|line| {
            let at = line.find(", \"body\": ").expect("a body");
            let head: serde_json::Value =
                serde_json::from_str(&format!("{}}}", &line[..at])).expect("a head");
            let body = line[at + ", \"body\": ".len()..]
                .trim_end()
                .strip_suffix('}')
                .expect("a closing brace")
                .to_owned();
            DivergenceCase {
                id: head["id"].as_u64().unwrap(),
                endpoint: head["endpoint"].as_str().unwrap().to_owned(),
                kind: head["kind"].as_str().unwrap().to_owned(),
                may_fall_back: head["may_fall_back"].as_bool().unwrap(),
                body,
            }
        })
        .collect()
}

/// A family's tokenizer trusting request chat templates (as vLLM with
/// `--trust-request-chat-template`), for the divergence corpus.
pub fn load_trusting(dir: &Path) -> Tokenizer {
    Tokenizer::load(
        dir,
        "test",
        LoadOptions {
            trust_request_chat_template: true,
            ..LoadOptions::default()
        },
    )
    .expect("load")
}

/// The native tokenizer's ids for a corpus request: `/tokenize`,
/// `/v1/responses/render`, or what the chat completion renders
/// ("chat_render"). The error: its message, and whether it is a local
/// refusal (a replica would tokenize the request) rather than vLLM's.
pub fn native_ids(tok: &Tokenizer, endpoint: &str, body: &str) -> Result<Vec<u32>, (String, bool)> {
    use kvroute_tokenizer::{RequestError, ResponsesRequest, TokenizeRequest};
    let err = |e: RequestError| (e.to_string(), !e.is_client_error());
    let bytes = body.as_bytes();
    match endpoint {
        "tokenize" => TokenizeRequest::from_json(bytes)
            .and_then(|r| tok.tokenize(&r))
            .map(|r| r.tokens)
            .map_err(err),
        "chat_render" => TokenizeRequest::from_json(bytes)
            .and_then(|r| tok.chat_completion_tokens(&r))
            .map_err(err),
        _ => ResponsesRequest::from_json(bytes)
            .and_then(|r| tok.render_responses(&r))
            .map(|r| r.token_ids)
            .map_err(err),
    }
}

/// Judges one corpus request: `None` when the native tokenizer matches the
/// reference (ids, or a refusal on both sides) or, where the corpus allows
/// it, declines it locally; else what went wrong.
pub fn judge(
    case: &DivergenceCase,
    reference: Result<&[u32], &str>,
    native: &Result<Vec<u32>, (String, bool)>,
    fallbacks: &mut usize,
) -> Option<String> {
    let DivergenceCase { id, kind, .. } = case;
    match (reference, native) {
        (_, Err((_, true))) if case.may_fall_back => {
            *fallbacks += 1;
            None
        }
        (Ok(w), Ok(g)) if w == g.as_slice() => None,
        (Ok(w), Ok(g)) => {
            let at = w
                .iter()
                .zip(g)
                .position(|(a, b)| a != b)
                .unwrap_or(w.len().min(g.len()));
            Some(format!(
                "#{id} ({kind}): first difference at token {at} ({} vs {} tokens)",
                w.len(),
                g.len()
            ))
        }
        (Err(_), Err((_, false))) => None,
        (Ok(_), Err((e, local))) => Some(format!(
            "#{id} ({kind}): reference took it, native refused ({}): {e}",
            if *local { "locally" } else { "as vLLM would" }
        )),
        (Err(r), Err((e, true))) => Some(format!(
            "#{id} ({kind}): reference refused ({r}), native declined locally where it should refuse: {e}"
        )),
        (Err(r), Ok(_)) => Some(format!(
            "#{id} ({kind}): reference refused ({r}), native took it"
        )),
    }
}
