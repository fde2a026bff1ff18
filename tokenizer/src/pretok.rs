//! A faster run of `Split` regex pre-tokenizers (byte-level BPE models).
//!
//! `tokenizers` runs a split regex holding a look-ahead in fancy-regex's
//! backtracking engine, which costs most of a byte-level encode. The usual
//! tail `…|\s+(?!\S)|\s+` is the only look-ahead in the regexes of GPT-2,
//! GPT-4 and DeepSeek; it is replaced by `\s+` in the `regex` crate (whose
//! leftmost-first alternation picks the same match as a backtracking engine
//! for the same alternatives) and its effect restored after the fact:
//!
//! a match made only of whitespace and not ending in `\r`/`\n` can only come
//! from the `\s+` alternatives (an earlier `\s*[\r\n]+` alternative takes any
//! run holding a newline); `\s+(?!\S)` would have left out the run's last
//! character when the run has two or more and something follows it, and the
//! scan resumes at that character. Regexes without look-around run in the
//! `regex` crate as they are; anything else keeps `tokenizers`' own engine.
//!
//! When the splits are followed only by `ByteLevel` without a prefix space
//! or regex of its own (DeepSeek), [`FastPreTokenizer::encode`] goes further
//! and skips `tokenizers`' per-byte alignment bookkeeping: it cuts the text
//! into words with the regexes, maps each word's bytes to GPT-2's byte
//! characters and hands it to the BPE model, which is what `tokenizers` does
//! with the splits it keeps (it drops empty ones).
//!
//! The encoder's load-time self-check and the property tests compare the
//! result with `tokenizers`' own encoding.

use std::ops::ControlFlow;

use regex::Regex;
use serde_json::Value as Json;
use tokenizers::tokenizer::pattern::Pattern;
use tokenizers::{
    Model, ModelWrapper, Offsets, PreTokenizedString, PreTokenizer, PreTokenizerWrapper,
    SplitDelimiterBehavior,
};

/// The look-ahead tail handled here.
const LOOKAHEAD_TAIL: &str = r"|\s+(?!\S)|\s+";

/// One split regex, compiled for the `regex` crate.
#[derive(Debug, Clone)]
struct FastRegex {
    re: Regex,
    /// The source ended in [`LOOKAHEAD_TAIL`] (now `|\s+`).
    lookahead: bool,
}

#[derive(Debug, Clone)]
enum Stage {
    Split(FastRegex),
    Other(PreTokenizerWrapper),
}

/// `Split(…, Isolated)` stages in the `regex` crate, then the remaining
/// pre-tokenizers (ByteLevel) as `tokenizers` runs them.
#[derive(Debug, Clone)]
pub struct FastPreTokenizer {
    stages: Vec<Stage>,
    /// The splits, when a plain `ByteLevel` is all that follows them.
    byte_level_words: Option<Vec<FastRegex>>,
}

/// GPT-2's byte → character table (`bytes_char` in `tokenizers`).
fn byte_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let c = if printable {
            char::from(b)
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap_or('\0')
        };
        if let Some(slot) = table.get_mut(usize::from(b)) {
            *slot = c;
        }
    }
    table
}

static BYTE_CHARS: std::sync::LazyLock<[char; 256]> = std::sync::LazyLock::new(byte_chars);

fn fancy(pattern: &str) -> bool {
    [
        "(?=", "(?!", "(?<=", "(?<!", "\\1", "\\2", "(?>", "\\G", "\\K",
    ]
    .iter()
    .any(|f| pattern.contains(f))
}

impl FastPreTokenizer {
    /// Builds it from tokenizer.json's `pre_tokenizer`, if every split is
    /// an isolated, non-inverted regex this module handles.
    pub fn from_json(pre: &Json) -> Option<Self> {
        if pre.get("type").and_then(Json::as_str) != Some("Sequence") {
            return None;
        }
        let items = pre.get("pretokenizers").and_then(Json::as_array)?;
        let mut stages = Vec::with_capacity(items.len());
        let mut any_split = false;
        for item in items {
            if item.get("type").and_then(Json::as_str) == Some("Split") {
                let isolated = item.get("behavior").and_then(Json::as_str) == Some("Isolated");
                let inverted = item.get("invert").and_then(Json::as_bool) == Some(true);
                let pattern = item.pointer("/pattern/Regex").and_then(Json::as_str)?;
                if !isolated || inverted {
                    return None;
                }
                let (source, lookahead) = match pattern.strip_suffix(LOOKAHEAD_TAIL) {
                    Some(head) => (format!(r"{head}|\s+"), true),
                    None => (pattern.to_owned(), false),
                };
                if fancy(&source) {
                    return None;
                }
                let re = Regex::new(&source).ok()?;
                stages.push(Stage::Split(FastRegex { re, lookahead }));
                any_split = true;
            } else {
                let wrapper: PreTokenizerWrapper = serde_json::from_value(item.clone()).ok()?;
                stages.push(Stage::Other(wrapper));
            }
        }
        if !any_split {
            return None;
        }
        let byte_level_words = match stages.split_last() {
            Some((Stage::Other(PreTokenizerWrapper::ByteLevel(bl)), splits))
                if !bl.add_prefix_space && !bl.use_regex =>
            {
                splits
                    .iter()
                    .map(|s| match s {
                        Stage::Split(re) => Some(re.clone()),
                        Stage::Other(_) => None,
                    })
                    .collect()
            }
            _ => None,
        };
        Some(Self {
            stages,
            byte_level_words,
        })
    }

    /// Whether [`Self::encode`] applies.
    pub fn encodes_directly(&self) -> bool {
        self.byte_level_words.is_some()
    }

    /// The ids of `text` (one segment, no added tokens in it): words from
    /// the split regexes, byte-level mapped, through `model`. `None` when
    /// the pre-tokenizer is not splits + plain `ByteLevel`. `limit` bounds
    /// the work: a word over its cap is refused before BPE sees it, and
    /// encoding stops once there are more ids than its room (`false`: the
    /// ids are a prefix of the segment's).
    pub(crate) fn encode(
        &self,
        text: &str,
        model: &ModelWrapper,
        limit: crate::budget::Limit<'_>,
    ) -> Option<tokenizers::Result<(Vec<u32>, bool)>> {
        let splits = self.byte_level_words.as_ref()?;
        let table = &*BYTE_CHARS;
        let mut ids = Vec::new();
        let mut mapped = String::new();
        let mut n = 0usize;
        let mut failed: Option<tokenizers::Error> = None;
        // Words are produced one at a time (each regex splitting the pieces
        // of the one before, in order), so a stop costs only what came
        // before it.
        let flow = walk(splits, text, 0, text.len(), &mut |start, end| {
            let Some(word) = text.get(start..end).filter(|w| !w.is_empty()) else {
                return ControlFlow::Continue(());
            };
            let step = limit.word(word, n).and_then(|()| {
                mapped.clear();
                mapped.extend(
                    word.bytes()
                        .map(|b| table.get(usize::from(b)).copied().unwrap_or('\0')),
                );
                model.tokenize(&mapped)
            });
            n += 1;
            match step {
                Ok(tokens) => ids.extend(tokens.iter().map(|t| t.id)),
                Err(e) => {
                    failed = Some(e);
                    return ControlFlow::Break(());
                }
            }
            if limit.full(ids.len()) {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        });
        if let Some(e) = failed {
            return Some(Err(e));
        }
        Some(Ok((ids, flow.is_continue())))
    }
}

/// Calls `f` on every word of `text[start..end]` that the `splits` cut it
/// into, in order, until it breaks.
fn walk(
    splits: &[FastRegex],
    text: &str,
    start: usize,
    end: usize,
    f: &mut dyn FnMut(usize, usize) -> ControlFlow<()>,
) -> ControlFlow<()> {
    let Some((re, rest)) = splits.split_first() else {
        return f(start, end);
    };
    let piece = text.get(start..end).unwrap_or_default();
    re.each_split(piece, &mut |s, e, _| {
        walk(rest, text, start + s, start + e, f)
    })
}

impl FastRegex {
    /// The splits of `inside` as [`Pattern::find_matches`] gives them
    /// (matches, flagged, and the text between), one at a time, until `f`
    /// breaks.
    fn each_split(
        &self,
        inside: &str,
        f: &mut dyn FnMut(usize, usize, bool) -> ControlFlow<()>,
    ) -> ControlFlow<()> {
        if inside.is_empty() {
            return f(0, 0, false);
        }
        let mut prev = 0usize;
        let mut pos = 0usize;
        while pos < inside.len() {
            let Some(m) = self.re.find_at(inside, pos) else {
                break;
            };
            let (start, mut end) = (m.start(), m.end());
            if self.lookahead && end < inside.len() {
                let text = m.as_str();
                let spaces_only = text.chars().all(char::is_whitespace);
                let newline_end = text.ends_with(['\r', '\n']);
                if spaces_only
                    && !newline_end
                    && let Some((last, _)) = text.char_indices().last().filter(|(i, _)| *i > 0)
                {
                    end = start + last;
                }
            }
            if prev != start {
                f(prev, start, false)?;
            }
            f(start, end, true)?;
            prev = end;
            // Patterns here never match empty; guard anyway.
            pos = if end > start {
                end
            } else {
                end + inside
                    .get(end..)
                    .and_then(|r| r.chars().next())
                    .map_or(1, char::len_utf8)
            };
        }
        if prev != inside.len() {
            f(prev, inside.len(), false)?;
        }
        ControlFlow::Continue(())
    }
}

impl PreTokenizer for FastPreTokenizer {
    fn pre_tokenize(&self, pretokenized: &mut PreTokenizedString) -> tokenizers::Result<()> {
        for stage in &self.stages {
            match stage {
                Stage::Split(re) => pretokenized.split(|_, normalized| {
                    normalized.split(re, SplitDelimiterBehavior::Isolated)
                })?,
                Stage::Other(p) => p.pre_tokenize(pretokenized)?,
            }
        }
        Ok(())
    }
}

impl Pattern for &FastRegex {
    fn find_matches(&self, inside: &str) -> tokenizers::Result<Vec<(Offsets, bool)>> {
        let mut splits = Vec::new();
        let _ = self.each_split(inside, &mut |s, e, is_match| {
            splits.push(((s, e), is_match));
            ControlFlow::Continue(())
        });
        Ok(splits)
    }
}
