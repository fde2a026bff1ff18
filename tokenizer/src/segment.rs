//! Safe boundaries inside a piece of text: positions where encoding the two
//! sides separately gives the same tokens as encoding the whole. Which rule
//! holds is decided once, from properties of `tokenizer.json` checked when it
//! loads; where none is proven, a piece is encoded whole.
//!
//! - **Metaspace** (SentencePiece-style BPE, e.g. tiny-llama): spaces become
//!   `▁` and BPE sees the piece whole (`split: false`) or split before each
//!   `▁`. Checked: no normalizer, BPE without dropout, `ignore_merges`,
//!   subword prefix or suffix, and every vocabulary token whose `▁` is not
//!   its first character is a pure `▁` run. Then no token can hold a
//!   non-`▁` character followed by `▁`, so no merge crosses the position
//!   before a `▁` (or space) that follows any other character: it is safe.
//!   The right side starts with `▁`, so Metaspace prepends nothing to it.
//! - **Newline** (byte-level BPE behind regex splits, e.g. DeepSeek): BPE
//!   never merges across pre-tokenizer splits, so a position is safe when
//!   the regexes always split there and never look past it. Checked: no
//!   normalizer, the pre-tokenizer is `Split` regexes from a list analysed
//!   below followed by `ByteLevel` without a prefix space (or `ByteLevel`'s
//!   own GPT-2 regex). For those regexes, a match containing a `\n` that is
//!   followed by an ASCII graphic character ends right after the `\n`, no
//!   alternative reads further than that character, and none looks behind:
//!   the position after such a `\n` is safe.

use serde_json::Value as Json;

/// Pieces are cut into segments of about this many bytes at safe
/// boundaries; segments are what the cache holds.
pub const SEGMENT_BYTES: usize = 384;

/// The boundary rule proven for a tokenizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Boundaries {
    /// Before a space or `▁` that follows another character.
    Metaspace,
    /// After a `\n` followed by an ASCII graphic character.
    Newline,
    /// No rule proven: pieces are encoded whole.
    Whole,
}

/// The regexes of DeepSeek V3/V4's pre-tokenizer: digits in threes, CJK
/// runs, then words, punctuation runs, newline runs and spaces.
const DEEPSEEK_REGEXES: [&str; 3] = [
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
];

/// Why the rule is what it is (for logs and `stats`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Analysis {
    /// The rule.
    pub boundaries: Boundaries,
    /// Why a stronger rule does not hold (empty when one does).
    pub reason: String,
}

fn whole(reason: impl Into<String>) -> Analysis {
    Analysis {
        boundaries: Boundaries::Whole,
        reason: reason.into(),
    }
}

/// Reads the rule off a parsed `tokenizer.json`.
pub fn analyse(tokenizer: &Json) -> Analysis {
    if !identity_normalizer(tokenizer.get("normalizer")) {
        return whole("the normalizer is not the identity");
    }
    let model = tokenizer.get("model").unwrap_or(&Json::Null);
    if model.get("type").and_then(Json::as_str) != Some("BPE") {
        return whole("the model is not BPE");
    }
    let set = |k: &str| !model.get(k).is_none_or(Json::is_null);
    if set("dropout") || set("continuing_subword_prefix") || set("end_of_word_suffix") {
        return whole("BPE has dropout or subword affixes");
    }
    if model.get("ignore_merges").and_then(Json::as_bool) == Some(true) {
        return whole("BPE ignores merges for whole words");
    }
    let pre = tokenizer.get("pre_tokenizer").unwrap_or(&Json::Null);
    match pre.get("type").and_then(Json::as_str) {
        Some("Metaspace") => metaspace(pre, model),
        Some("ByteLevel") => byte_level_last(pre, true),
        Some("Sequence") => {
            let items = pre
                .get("pretokenizers")
                .and_then(Json::as_array)
                .map(Vec::as_slice)
                .unwrap_or_default();
            let Some((last, splits)) = items.split_last() else {
                return whole("an empty pre-tokenizer sequence");
            };
            for split in splits {
                let ok = split.get("type").and_then(Json::as_str) == Some("Split")
                    && split.get("behavior").and_then(Json::as_str) == Some("Isolated")
                    && split.get("invert").and_then(Json::as_bool) != Some(true)
                    && split
                        .pointer("/pattern/Regex")
                        .and_then(Json::as_str)
                        .is_some_and(|r| DEEPSEEK_REGEXES.contains(&r));
                if !ok {
                    return whole("a pre-tokenizer split whose regex is not analysed");
                }
            }
            if last.get("type").and_then(Json::as_str) != Some("ByteLevel") {
                return whole("the pre-tokenizer sequence does not end in ByteLevel");
            }
            byte_level_last(last, splits.is_empty())
        }
        _ => whole("the pre-tokenizer is not Metaspace or regex splits with ByteLevel"),
    }
}

fn identity_normalizer(n: Option<&Json>) -> bool {
    match n {
        None | Some(Json::Null) => true,
        Some(n) => {
            n.get("type").and_then(Json::as_str) == Some("Sequence")
                && n.get("normalizers")
                    .and_then(Json::as_array)
                    .is_some_and(Vec::is_empty)
        }
    }
}

fn byte_level_last(bl: &Json, alone: bool) -> Analysis {
    if bl.get("add_prefix_space").and_then(Json::as_bool) == Some(true) {
        return whole("ByteLevel adds a prefix space to every piece");
    }
    let uses_regex = bl.get("use_regex").and_then(Json::as_bool).unwrap_or(true);
    if alone && !uses_regex {
        return whole("ByteLevel without any regex split");
    }
    Analysis {
        boundaries: Boundaries::Newline,
        reason: String::new(),
    }
}

fn metaspace(pre: &Json, model: &Json) -> Analysis {
    let replacement = pre.get("replacement").and_then(Json::as_str).unwrap_or("▁");
    let mut chars = replacement.chars();
    let (Some(r), None) = (chars.next(), chars.next()) else {
        return whole("the Metaspace replacement is not one character");
    };
    if r != '▁' {
        return whole("the Metaspace replacement is not ▁");
    }
    let Some(vocab) = model.get("vocab").and_then(Json::as_object) else {
        return whole("the BPE vocabulary is not a map");
    };
    for token in vocab.keys() {
        let inner_r = token.chars().skip(1).any(|c| c == r);
        if inner_r && !token.chars().all(|c| c == r) {
            return whole(format!(
                "the token {token:?} holds ▁ after another character"
            ));
        }
    }
    Analysis {
        boundaries: Boundaries::Metaspace,
        reason: String::new(),
    }
}

impl Boundaries {
    /// Byte positions where `text` is cut into segments of about
    /// [`SEGMENT_BYTES`]: safe boundaries, chosen greedily from the start so
    /// that equal prefixes give equal segments. Excludes 0 and `text.len()`.
    /// Each cut is the first safe boundary at least [`SEGMENT_BYTES`] past
    /// the previous one (and a quarter segment before the end), so only the
    /// bytes from there to it are looked at: memchr to the next candidate.
    pub fn cuts(self, text: &str) -> Vec<usize> {
        let mut cuts = Vec::new();
        if self == Self::Whole || text.len() < 2 * SEGMENT_BYTES {
            return cuts;
        }
        let last_allowed = text.len() - SEGMENT_BYTES / 4;
        let mut from = SEGMENT_BYTES;
        while from <= last_allowed {
            match self.next_safe(text, from) {
                Some(i) if i <= last_allowed => {
                    cuts.push(i);
                    from = i + SEGMENT_BYTES;
                }
                _ => break,
            }
        }
        cuts
    }

    /// The first safe boundary at or after byte `from` (≥ 1).
    fn next_safe(self, text: &str, from: usize) -> Option<usize> {
        let bytes = text.as_bytes();
        match self {
            // After a newline, before a printable ASCII character.
            Self::Newline => {
                let mut at = from.checked_sub(1)?;
                loop {
                    let nl = at + memchr::memchr(b'\n', bytes.get(at..)?)?;
                    let i = nl + 1;
                    if bytes.get(i).is_some_and(u8::is_ascii_graphic) {
                        return Some(i);
                    }
                    at = i;
                }
            }
            // A space or `▁` (E2 96 81) whose previous character is neither.
            Self::Metaspace => {
                let mut at = from;
                loop {
                    let i = at + memchr::memchr2(b' ', 0xE2, bytes.get(at..)?)?;
                    at = i + 1;
                    let here = text.get(i..)?;
                    if !(here.starts_with(' ') || here.starts_with('▁')) {
                        continue;
                    }
                    let prev = text.get(..i).and_then(|t| t.chars().next_back());
                    if prev.is_some_and(|p| p != ' ' && p != '▁') {
                        return Some(i);
                    }
                }
            }
            Self::Whole => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The char-by-char scan [`Boundaries::cuts`] must equal.
    fn cuts_reference(rule: Boundaries, text: &str) -> Vec<usize> {
        let mut cuts = Vec::new();
        if rule == Boundaries::Whole || text.len() < 2 * SEGMENT_BYTES {
            return cuts;
        }
        let bytes = text.as_bytes();
        let mut last = 0usize;
        let mut prev: Option<char> = None;
        for (i, c) in text.char_indices() {
            let safe = match rule {
                Boundaries::Metaspace => {
                    (c == ' ' || c == '▁') && prev.is_some_and(|p| p != ' ' && p != '▁')
                }
                Boundaries::Newline => {
                    prev == Some('\n') && bytes.get(i).is_some_and(u8::is_ascii_graphic)
                }
                Boundaries::Whole => false,
            };
            if safe && i >= last + SEGMENT_BYTES && text.len() - i >= SEGMENT_BYTES / 4 {
                cuts.push(i);
                last = i;
            }
            prev = Some(c);
        }
        cuts
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(3_000))]
        #[test]
        fn cuts_equal_the_char_by_char_scan(
            parts in proptest::collection::vec(
                proptest::sample::select(vec![
                    " ", "  ", "▁", "▁▁", "\n", "\n\n", "\n ", "word", "x", "é", "中", "🚀",
                    "\u{2581}x", "\t", "long-ish text run ",
                ]),
                0..1500,
            )
        ) {
            let text: String = parts.concat();
            for rule in [Boundaries::Metaspace, Boundaries::Newline, Boundaries::Whole] {
                proptest::prop_assert_eq!(rule.cuts(&text), cuts_reference(rule, &text));
            }
        }
    }

    #[test]
    fn metaspace_cuts_before_spaces_after_words() {
        let text = "word ".repeat(400);
        let cuts = Boundaries::Metaspace.cuts(&text);
        assert!(!cuts.is_empty());
        for c in cuts {
            assert_eq!(&text[c..=c], " ");
            assert_ne!(&text[c - 1..c], " ");
        }
    }

    #[test]
    fn newline_cuts_after_newlines_before_graphic_characters() {
        let text = "line of text\n".repeat(200) + "\n  indented\n";
        let cuts = Boundaries::Newline.cuts(&text);
        assert!(!cuts.is_empty());
        for c in cuts {
            assert_eq!(&text[c - 1..c], "\n");
            assert!(text.as_bytes()[c].is_ascii_graphic());
        }
    }

    #[test]
    fn a_token_with_an_inner_metaspace_defeats_the_rule() {
        let tok = serde_json::json!({
            "normalizer": null,
            "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false},
            "model": {"type": "BPE", "dropout": null, "vocab": {"a": 0, "▁": 1, "a▁b": 2}, "merges": []}
        });
        assert_eq!(analyse(&tok).boundaries, Boundaries::Whole);
        let ok = serde_json::json!({
            "normalizer": null,
            "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false},
            "model": {"type": "BPE", "dropout": null, "vocab": {"a": 0, "▁": 1, "▁▁": 2, "▁a": 3}, "merges": []}
        });
        assert_eq!(analyse(&ok).boundaries, Boundaries::Metaspace);
    }
}
