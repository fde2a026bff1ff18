//! Deterministic "model output": short words picked from a hash of the prompt, one token each, so
//! the output text tokenizes back to exactly the generated ids (and a later turn that quotes it
//! reuses the decode-filled blocks).
//!
//! With reasoning on (chat and Responses), the output is `<think>` reasoning `</think>` content,
//! token for token what the role-marker template renders for an assistant turn with reasoning.

use crate::tokenizer::piece_id;

const WORDS: &[&str] = &[
    "the", "cache", "block", "token", "route", "model", "prefix", "reply", "fast", "event", "node",
    "query", "value", "mock", "vllm", "paged", "kv", "warm", "cold", "hit", "miss", "queue",
    "batch", "agent", "tool", "plan", "step", "done", "next", "data", "text", "chunk",
];

const THINK: &str = "<think>";
const END_THINK: &str = "</think>";

/// Generated output of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    /// Text of each token.
    pub pieces: Vec<String>,
    pub ids: Vec<u32>,
    pub finish_reason: &'static str,
    /// Token indices of the reasoning words (empty without reasoning); the think markers sit
    /// just outside this range.
    pub reasoning: std::ops::Range<usize>,
}

impl Output {
    /// The answer text (reasoning and markers excluded).
    pub fn text(&self) -> String {
        let start = if self.reasoning.is_empty() {
            0
        } else {
            self.reasoning.end + 1
        };
        self.pieces.get(start..).unwrap_or_default().concat()
    }

    /// The reasoning text, if any.
    pub fn reasoning_text(&self) -> Option<String> {
        (!self.reasoning.is_empty()).then(|| {
            self.pieces
                .get(self.reasoning.clone())
                .unwrap_or_default()
                .concat()
        })
    }

    /// What kind of text token `i` carries.
    pub fn kind(&self, i: usize) -> TokenKind {
        if self.reasoning.is_empty() {
            TokenKind::Content
        } else if self.reasoning.contains(&i) {
            TokenKind::Reasoning
        } else if i + 1 == self.reasoning.start || i == self.reasoning.end {
            TokenKind::Marker
        } else {
            TokenKind::Content
        }
    }
}

/// The role of one output token in the response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenKind {
    Content,
    Reasoning,
    /// `<think>` or `</think>`: counted, never shown.
    Marker,
}

fn mix(mut x: u64) -> u64 {
    // splitmix64 finaliser
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// `n` output tokens for `prompt`. The first word has a leading space when `leading_space`
/// (completions continue text; chat content starts fresh). Up to `reasoning` of them are
/// reasoning words between think markers, when `n` leaves room for at least one answer word.
pub fn generate(
    prompt: &[u32],
    n: usize,
    leading_space: bool,
    finish_reason: &'static str,
    reasoning: usize,
) -> Output {
    let seed = prompt
        .iter()
        .rev()
        .take(64)
        .fold(prompt.len() as u64, |acc, t| mix(acc ^ u64::from(*t)));
    let word = |i: usize, first: bool| {
        let w = WORDS
            .get((mix(seed ^ i as u64) % WORDS.len() as u64) as usize)
            .copied()
            .unwrap_or("the");
        if first && !leading_space {
            w.to_owned()
        } else {
            format!(" {w}")
        }
    };
    let r = if reasoning > 0 && n >= 4 {
        reasoning.min(n - 3)
    } else {
        0
    };
    let mut pieces = Vec::with_capacity(n);
    if r > 0 {
        pieces.push(THINK.to_owned());
        pieces.extend((0..r).map(|i| word(i, i == 0)));
        pieces.push(END_THINK.to_owned());
    }
    let start = pieces.len();
    pieces.extend((start..n).map(|i| word(i, i == start)));
    let ids = pieces
        .iter()
        .map(|p| match p.as_str() {
            THINK => 8,
            END_THINK => 9,
            other => piece_id(other),
        })
        .collect();
    Output {
        pieces,
        ids,
        finish_reason,
        reasoning: if r > 0 { 1..r + 1 } else { 0..0 },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::Tokenizer;

    #[test]
    fn output_tokenizes_back_to_its_ids() {
        for leading in [true, false] {
            let out = generate(&[1, 2, 3], 40, leading, "length", 0);
            assert_eq!(out.ids.len(), 40);
            assert_eq!(Tokenizer.encode(&out.text(), false), out.ids);
            assert_eq!(out.reasoning_text(), None);
        }
    }

    #[test]
    fn reasoning_renders_back_as_the_template_would() {
        let out = generate(&[1, 2, 3], 20, false, "length", 5);
        assert_eq!(out.ids.len(), 20);
        assert_eq!(out.reasoning, 1..6);
        let r = out.reasoning_text().unwrap();
        assert!(!r.starts_with(' '));
        assert!(!out.text().starts_with(' '));
        let rendered = format!("<think>{r}</think>{}", out.text());
        assert_eq!(Tokenizer.encode(&rendered, false), out.ids);
        assert_eq!(out.kind(0), TokenKind::Marker);
        assert_eq!(out.kind(1), TokenKind::Reasoning);
        assert_eq!(out.kind(6), TokenKind::Marker);
        assert_eq!(out.kind(7), TokenKind::Content);
        // Too short for reasoning plus an answer: plain content.
        assert_eq!(generate(&[1], 3, false, "length", 5).reasoning, 0..0);
    }

    #[test]
    fn deterministic_and_prompt_dependent() {
        let g = |p: &[u32]| generate(p, 8, true, "stop", 0);
        assert_eq!(g(&[5, 6]), g(&[5, 6]));
        assert_ne!(g(&[5, 6]).ids, g(&[5, 7]).ids);
    }
}
