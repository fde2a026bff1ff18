//! Shared by the tokenizer's fuzz targets: the two test models, loaded once,
//! and turning fuzz bytes into request text.
#![allow(clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::sync::OnceLock;

use kvroute_tokenizer::{Budget, LoadOptions, Tokenizer};

fn dir(var: &str, default: &str) -> PathBuf {
    std::env::var_os(var).map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(default)
    })
}

/// A test model with its `tokenizers` reference: tiny-llama (`second`
/// false) or tiny-deepseek.
pub fn model(second: bool) -> &'static (Tokenizer, tokenizers::Tokenizer) {
    static LLAMA: OnceLock<(Tokenizer, tokenizers::Tokenizer)> = OnceLock::new();
    static DEEPSEEK: OnceLock<(Tokenizer, tokenizers::Tokenizer)> = OnceLock::new();
    let load = |var: &str, default: &str| {
        let d = dir(var, default);
        let tok = Tokenizer::load(&d, "fuzz", LoadOptions::default()).unwrap_or_else(|e| {
            panic!(
                "{}: {e} (run `bash .ci/deps.sh`, which builds the test models)",
                d.display()
            )
        });
        let reference =
            tokenizers::Tokenizer::from_file(d.join("tokenizer.json")).expect("tokenizer.json");
        (tok, reference)
    };
    if second {
        DEEPSEEK.get_or_init(|| load("KVROUTE_VLLM_MODEL2", ".cache/kvroute/tiny-deepseek"))
    } else {
        LLAMA.get_or_init(|| load("KVROUTE_VLLM_MODEL", ".cache/kvroute/tiny-llama"))
    }
}

/// The model's caps: what indexd serves requests under.
pub fn budget(tok: &Tokenizer) -> Budget {
    Budget::with_caps(tok.caps())
}

/// Fragments fuzz bytes splice in: the models' added tokens and template
/// syntax, so that inputs reach the splitter and the templates' branches.
pub const ATOMS: &[&str] = &[
    "<s>",
    "</s>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "<｜end▁of▁sentence｜>",
    "<｜tool▁calls▁begin｜>",
    "▁",
    "\r\n",
    "\u{1c}",
    "ΟΔΟΣ",
    "ß",
    "{{ x }}",
    "{% if %}",
    "  ",
];

/// Bytes as text: byte 0xFE followed by n inserts `ATOMS[n]`, other bytes
/// are read as UTF-8 (lossily).
pub fn text(bytes: &[u8]) -> String {
    let mut out = String::new();
    let mut plain = Vec::new();
    let mut it = bytes.iter();
    while let Some(&b) = it.next() {
        if b == 0xFE {
            out.push_str(&String::from_utf8_lossy(&plain));
            plain.clear();
            if let Some(&n) = it.next() {
                out.push_str(
                    ATOMS
                        .get(usize::from(n) % ATOMS.len())
                        .copied()
                        .unwrap_or(""),
                );
            }
        } else {
            plain.push(b);
        }
    }
    out.push_str(&String::from_utf8_lossy(&plain));
    out
}
