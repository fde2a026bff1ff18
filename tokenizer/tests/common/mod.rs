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
