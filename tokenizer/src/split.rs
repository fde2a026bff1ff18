//! Splitting text on added tokens exactly as `tokenizers`' `AddedVocabulary`
//! does (`extract_and_normalize` with an identity normalizer): first the
//! non-normalized tokens, leftmost-longest, then the normalized ones inside
//! what is left; `single_word`, `lstrip`, `rstrip` as there; special tokens
//! kept as text when `encode_special_tokens` is set. Only positions are
//! computed: no per-byte alignment tables, so splitting costs one scan.

use std::sync::LazyLock;

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use regex::Regex;
use tokenizers::AddedToken;

/// One piece of the text: an added token's id, or text for the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Byte range in the text.
    pub start: usize,
    /// End of the byte range.
    pub end: usize,
    /// The added token's id, `None` for model text.
    pub added: Option<u32>,
}

struct Trie {
    ac: AhoCorasick,
    ids: Vec<u32>,
}

/// The added vocabulary's two automata and the tokens' flags.
pub struct Splitter {
    plain: Option<Trie>,
    normalized: Option<Trie>,
    tokens: std::collections::HashMap<u32, AddedToken>,
    encode_special_tokens: bool,
}

impl std::fmt::Debug for Splitter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Splitter")
            .field("tokens", &self.tokens.len())
            .finish()
    }
}

static STARTS_WITH_WORD: LazyLock<Option<Regex>> = LazyLock::new(|| Regex::new(r"^\w").ok());
static ENDS_WITH_WORD: LazyLock<Option<Regex>> = LazyLock::new(|| Regex::new(r"\w$").ok());
static SPACE_AT_START: LazyLock<Option<Regex>> = LazyLock::new(|| Regex::new(r"^\s*").ok());
static SPACE_AT_END: LazyLock<Option<Regex>> = LazyLock::new(|| Regex::new(r"\s*$").ok());

fn is_match(re: &LazyLock<Option<Regex>>, s: &str) -> bool {
    re.as_ref().is_some_and(|r| r.is_match(s))
}

impl Splitter {
    /// Builds the automata from the added tokens (id → token).
    pub fn new(
        tokens: impl IntoIterator<Item = (u32, AddedToken)>,
        encode_special_tokens: bool,
    ) -> Result<Self, String> {
        let tokens: std::collections::HashMap<u32, AddedToken> = tokens.into_iter().collect();
        let mut sorted: Vec<(&u32, &AddedToken)> = tokens.iter().collect();
        sorted.sort_by_key(|(id, _)| **id);
        let build = |normalized: bool| -> Result<Option<Trie>, String> {
            let chosen: Vec<(u32, &str)> = sorted
                .iter()
                .filter(|(_, t)| t.normalized == normalized && !t.content.is_empty())
                .map(|(id, t)| (**id, t.content.as_str()))
                .collect();
            if chosen.is_empty() {
                return Ok(None);
            }
            let ac = AhoCorasickBuilder::new()
                .match_kind(MatchKind::LeftmostLongest)
                .kind(Some(aho_corasick::AhoCorasickKind::DFA))
                .build(chosen.iter().map(|(_, c)| *c))
                .map_err(|e| e.to_string())?;
            Ok(Some(Trie {
                ac,
                ids: chosen.iter().map(|(id, _)| *id).collect(),
            }))
        };
        Ok(Self {
            plain: build(false)?,
            normalized: build(true)?,
            tokens,
            encode_special_tokens,
        })
    }

    /// The pieces of `text`, in order, covering it (an empty text is one
    /// empty piece, as in `tokenizers`).
    pub fn split(&self, text: &str) -> Vec<Piece> {
        let mut first = Vec::new();
        self.find(text, 0, text.len(), self.plain.as_ref(), &mut first);
        let mut out = Vec::with_capacity(first.len());
        for piece in first {
            if piece.added.is_some() {
                out.push(piece);
            } else {
                self.find(
                    text,
                    piece.start,
                    piece.end,
                    self.normalized.as_ref(),
                    &mut out,
                );
            }
        }
        out
    }

    /// `AddedVocabulary::find_matches` on `text[start..end]`.
    fn find(
        &self,
        text: &str,
        start: usize,
        end: usize,
        trie: Option<&Trie>,
        out: &mut Vec<Piece>,
    ) {
        let sentence = text.get(start..end).unwrap_or_default();
        let Some(trie) = trie.filter(|_| !sentence.is_empty()) else {
            out.push(Piece {
                start,
                end,
                added: None,
            });
            return;
        };
        let mut offset = 0usize;
        for mat in trie.ac.find_iter(sentence) {
            let Some(&id) = trie.ids.get(mat.pattern().as_usize()) else {
                continue;
            };
            let Some(token) = self.tokens.get(&id) else {
                continue;
            };
            if self.encode_special_tokens && token.special {
                continue;
            }
            let (mut s, mut e) = (mat.start(), mat.end());
            let before = sentence.get(..s).unwrap_or_default();
            let after = sentence.get(e..).unwrap_or_default();
            if token.single_word {
                let start_space = s == 0 || !is_match(&ENDS_WITH_WORD, before);
                let stop_space = e == sentence.len() || !is_match(&STARTS_WITH_WORD, after);
                if !start_space || !stop_space {
                    continue;
                }
            }
            if token.lstrip {
                let new_start = SPACE_AT_END
                    .as_ref()
                    .and_then(|r| r.find(before))
                    .map_or(before.len(), |m| m.start());
                s = new_start.max(offset);
            }
            if token.rstrip {
                e += SPACE_AT_START
                    .as_ref()
                    .and_then(|r| r.find(after))
                    .map_or(0, |m| m.end());
            }
            if offset < s {
                out.push(Piece {
                    start: start + offset,
                    end: start + s,
                    added: None,
                });
            }
            out.push(Piece {
                start: start + s,
                end: start + e,
                added: Some(id),
            });
            offset = e;
        }
        if offset != sentence.len() {
            out.push(Piece {
                start: start + offset,
                end,
                added: None,
            });
        }
    }
}
