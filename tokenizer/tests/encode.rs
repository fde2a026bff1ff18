//! Encoding: the split-segment-cache path equals `tokenizers`' own encode;
//! growing conversations re-use the cache and still equal a cold encode; the
//! cache stays within its bound; a tokenizer whose boundary property fails
//! falls back to whole pieces and stays exact.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use kvroute_tokenizer::{Boundaries, LoadOptions, Mode, TokenizeRequest, Tokenizer};
use proptest::prelude::*;

const ATOMS: &[&str] = &[
    "hello",
    "world",
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    "▁",
    "x▁y",
    "<s>",
    "</s>",
    "<unk>",
    "12345",
    "3.14",
    "日本語",
    "🚀",
    "é",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "<dsml:",
    "<｜end▁of▁sentence｜>",
    "<｜tool▁sep｜>",
    "{\"a\": 1}",
    "!!",
    "...",
    "  indented",
    "\r\n",
    "Word",
    "a",
    "ab",
    "'s",
    "don't",
];

fn text_strategy() -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(ATOMS), 0..400).prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn encode_equals_tokenizers_encode(text in text_strategy(), special in any::<bool>()) {
        for (family, _) in common::families() {
            let ours = common::shared(family);
            let theirs = common::reference(family);
            let want = theirs.encode(text.as_str(), special).unwrap().get_ids().to_vec();
            prop_assert_eq!(ours.encode(&text, special).unwrap(), want);
            // Twice: the second time from the cache.
            prop_assert_eq!(ours.encode(&text, special).unwrap(), theirs.encode(text.as_str(), special).unwrap().get_ids().to_vec());
        }
    }
}

#[test]
fn both_families_prove_a_boundary_rule() {
    for (family, dir) in common::families() {
        let tok = common::load(&dir);
        match tok.stats().encoder.mode {
            Mode::Segmented(a) => {
                let want = if family == "tiny-llama" {
                    Boundaries::Metaspace
                } else {
                    Boundaries::Newline
                };
                assert_eq!(a.boundaries, want, "{family}: {}", a.reason);
            }
            Mode::Whole(why) => panic!("{family} fell back: {why}"),
        }
    }
}

fn chat_body(messages: &[serde_json::Value]) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({ "messages": messages })).unwrap()
}

fn turn_text(turn: usize) -> String {
    let mut s = String::new();
    for line in 0..(5 + turn % 7) {
        s.push_str(&format!(
            "Turn {turn} line {line}: the replica holds the  prefix, token {} 日本 🚀\n",
            turn * 31 + line
        ));
    }
    s
}

#[test]
fn growing_conversations_equal_cold_encodes() {
    for (family, dir) in common::families() {
        let warm = common::load(&dir);
        let cold = Tokenizer::load(
            &dir,
            "cold",
            LoadOptions {
                cache_bytes: 0,
                ..LoadOptions::default()
            },
        )
        .unwrap();
        let mut messages =
            vec![serde_json::json!({"role": "system", "content": "You are a routing agent."})];
        for turn in 0..40 {
            let role = if turn % 2 == 0 { "user" } else { "assistant" };
            messages.push(serde_json::json!({"role": role, "content": turn_text(turn)}));
            let body = chat_body(&messages);
            let req = TokenizeRequest::from_json(&body).unwrap();
            let got = warm.tokenize(&req).unwrap().tokens;
            assert_eq!(
                got,
                cold.tokenize(&req).unwrap().tokens,
                "{family}, turn {turn}"
            );
        }
        let stats = warm.stats().encoder.cache;
        assert!(stats.hits > stats.misses, "{family}: {stats:?}");
    }
}

#[test]
fn the_cache_stays_within_its_bound() {
    for (family, dir) in common::families() {
        let bound = 64 << 10;
        let tok = Tokenizer::load(
            &dir,
            "small",
            LoadOptions {
                cache_bytes: bound,
                ..LoadOptions::default()
            },
        )
        .unwrap();
        let theirs = common::reference(family);
        for i in 0..60 {
            let text = turn_text(i).repeat(8);
            assert_eq!(
                tok.encode(&text, false).unwrap(),
                theirs
                    .encode(text.as_str(), false)
                    .unwrap()
                    .get_ids()
                    .to_vec()
            );
            let s = tok.stats().encoder.cache;
            assert!(s.bytes <= bound as u64, "{family}: {s:?}");
        }
        assert!(tok.stats().encoder.cache.evictions > 0, "{family}");
    }
}

#[test]
fn a_failed_boundary_property_falls_back_to_whole_pieces() {
    let dir = common::tiny_llama();
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("tokenizer.json")).unwrap()).unwrap();
    // A token holding ▁ after another character breaks the Metaspace rule.
    let vocab = json["model"]["vocab"].as_object_mut().unwrap();
    let id = vocab.len() as u64;
    vocab.insert("e▁t".to_owned(), serde_json::json!(id));
    let scratch = common::scratch("fallback");
    for f in [
        "tokenizer_config.json",
        "chat_template.jinja",
        "config.json",
    ] {
        std::fs::copy(dir.join(f), scratch.join(f)).unwrap();
    }
    std::fs::write(
        scratch.join("tokenizer.json"),
        serde_json::to_vec(&json).unwrap(),
    )
    .unwrap();
    let tok = common::load(&scratch);
    match tok.stats().encoder.mode {
        Mode::Segmented(a) => assert_eq!(a.boundaries, Boundaries::Whole, "{}", a.reason),
        Mode::Whole(_) => {}
    }
    let theirs = tokenizers::Tokenizer::from_file(scratch.join("tokenizer.json")).unwrap();
    let text = "the ▁token e t and more text ".repeat(100);
    assert_eq!(
        tok.encode(&text, true).unwrap(),
        theirs
            .encode(text.as_str(), true)
            .unwrap()
            .get_ids()
            .to_vec()
    );
}

#[test]
fn tokenizers_are_shared_across_threads() {
    let tok = common::shared("tiny-deepseek");
    let theirs = common::reference("tiny-deepseek");
    let want: Vec<Vec<u32>> = (0..8)
        .map(|i| {
            theirs
                .encode(turn_text(i).repeat(20).as_str(), false)
                .unwrap()
                .get_ids()
                .to_vec()
        })
        .collect();
    std::thread::scope(|s| {
        for t in 0..4 {
            let want = &want;
            s.spawn(move || {
                for round in 0..3 {
                    for k in 0..want.len() {
                        let i = (k + t + round) % want.len();
                        assert_eq!(
                            &tok.encode(&turn_text(i).repeat(20), false).unwrap(),
                            &want[i]
                        );
                    }
                }
            });
        }
    });
}

/// tiny-llama with added tokens using every flag `AddedVocabulary` knows.
fn flagged_model() -> &'static (kvroute_tokenizer::Tokenizer, tokenizers::Tokenizer) {
    static MODEL: std::sync::OnceLock<(kvroute_tokenizer::Tokenizer, tokenizers::Tokenizer)> =
        std::sync::OnceLock::new();
    MODEL.get_or_init(|| {
        let dir = common::tiny_llama();
        let mut json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("tokenizer.json")).unwrap()).unwrap();
        let added = json["added_tokens"].as_array_mut().unwrap();
        for (i, (content, single_word, lstrip, rstrip, normalized, special)) in [
            ("<mask>", false, true, false, false, true),
            ("[END]", false, false, true, false, true),
            ("word", true, false, false, true, false),
            ("<both>", false, true, true, true, false),
            ("ab", false, false, false, true, false),
        ]
        .into_iter()
        .enumerate()
        {
            added.push(serde_json::json!({
                "id": 32000 + i, "content": content, "single_word": single_word, "lstrip": lstrip,
                "rstrip": rstrip, "normalized": normalized, "special": special
            }));
        }
        let scratch = common::scratch("flagged");
        for f in [
            "tokenizer_config.json",
            "chat_template.jinja",
            "config.json",
        ] {
            std::fs::copy(dir.join(f), scratch.join(f)).unwrap();
        }
        std::fs::write(
            scratch.join("tokenizer.json"),
            serde_json::to_vec(&json).unwrap(),
        )
        .unwrap();
        let theirs = tokenizers::Tokenizer::from_file(scratch.join("tokenizer.json")).unwrap();
        (common::load(&scratch), theirs)
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn added_token_flags_split_as_tokenizers_does(
        parts in prop::collection::vec(prop::sample::select(vec![
            "<mask>", "[END]", "word", "words", "sword", "<both>", "ab", "abab", " ", "   ", "\n", "\t", "x", "hello",
            "<s>", "é", "▁", "_", "1",
        ]), 0..40)
    ) {
        let text = parts.concat();
        let (ours, theirs) = flagged_model();
        prop_assert!(matches!(ours.stats().encoder.mode, Mode::Segmented(_)), "the segmented path is under test");
        prop_assert_eq!(ours.encode(&text, true).unwrap(), theirs.encode(text.as_str(), true).unwrap().get_ids().to_vec());
    }
}

/// Characters around which pre-tokenizer regexes decide: whitespace kinds,
/// newlines, letters, marks, digits, punctuation, symbols, CJK, emoji.
const CHARS: &[char] = &[
    ' ', ' ', ' ', '\t', '\n', '\n', '\r', '\u{a0}', '\u{3000}', '\u{2028}', '\u{85}', 'a', 'b',
    'Z', 'é', '\u{301}', '1', '2', '٣', '.', '!', '$', '€', '日', 'ア', 'ー', '😀', '_', '\'', '-',
    '▁', '<', '>', '|', '｜',
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn pre_tokenizer_edge_characters_encode_as_tokenizers_does(
        chars in prop::collection::vec(prop::sample::select(CHARS), 0..1500),
        special in any::<bool>(),
    ) {
        let text: String = chars.into_iter().collect();
        for (family, _) in common::families() {
            let want = common::reference(family).encode(text.as_str(), special).unwrap().get_ids().to_vec();
            prop_assert_eq!(common::shared(family).encode(&text, special).unwrap(), want, "{}", family);
        }
    }
}
