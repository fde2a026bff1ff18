//! A deterministic, fast stand-in for a SentencePiece tokenizer (vocab 32,000, BOS 1).
//!
//! Text splits into pieces: special markers (`<s>`, `<|user|>`, …) become their reserved ids;
//! a run of letters/digits (with at most one leading space) becomes pieces of at most
//! [`MAX_PIECE_CHARS`] characters; any other character is a piece of its own. A piece's id is
//! FNV-1a-64 of its bytes mapped into `FIRST_REGULAR_ID..VOCAB_SIZE`, so ids are the same in every
//! process (no `RandomState`).

/// Vocabulary size of the simulated model.
pub const VOCAB_SIZE: u32 = 32_000;
/// Beginning-of-sequence id (Llama/Mistral).
pub const BOS_ID: u32 = 1;
/// End-of-sequence id.
pub const EOS_ID: u32 = 2;
/// Ids below this are reserved for special tokens.
pub const FIRST_REGULAR_ID: u32 = 16;
/// Longest regular piece, in characters (a leading space not counted).
pub const MAX_PIECE_CHARS: usize = 6;

/// Special tokens, recognised in text as single ids.
pub const SPECIAL_TOKENS: &[(&str, u32)] = &[
    ("<unk>", 0),
    ("<s>", BOS_ID),
    ("</s>", EOS_ID),
    ("<|system|>", 3),
    ("<|user|>", 4),
    ("<|assistant|>", 5),
    ("<|tool|>", 6),
    ("<|end|>", 7),
    ("<think>", 8),
    ("</think>", 9),
    ("<|tools|>", 10),
    ("<|tool_call|>", 11),
    ("<|developer|>", 12),
    ("<image>", 13),
];

/// The tokenizer (stateless; cheap to copy).
#[derive(Debug, Clone, Copy, Default)]
pub struct Tokenizer;

/// A token and the text piece it stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    pub id: u32,
    pub text: String,
}

impl Tokenizer {
    /// Token ids of `text`, with BOS first when `add_special_tokens`.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Vec<u32> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 1);
        if add_special_tokens {
            ids.push(BOS_ID);
        }
        for_each_piece(text, |piece, special| {
            ids.push(special.unwrap_or_else(|| piece_id(piece)))
        });
        ids
    }

    /// Ids and piece strings (SentencePiece style: a leading space shows as `▁`).
    pub fn encode_pieces(&self, text: &str, add_special_tokens: bool) -> Vec<Piece> {
        let mut out = Vec::new();
        if add_special_tokens {
            out.push(Piece {
                id: BOS_ID,
                text: "<s>".to_owned(),
            });
        }
        for_each_piece(text, |piece, special| {
            out.push(Piece {
                id: special.unwrap_or_else(|| piece_id(piece)),
                text: piece.replace(' ', "\u{2581}"),
            })
        });
        out
    }

    /// The piece strings for `ids` produced by this tokenizer from `text` (used for
    /// `return_token_strs`).
    pub fn token_strs(&self, text: &str, add_special_tokens: bool) -> Vec<String> {
        self.encode_pieces(text, add_special_tokens)
            .into_iter()
            .map(|p| p.text)
            .collect()
    }
}

/// Id of a regular piece.
pub fn piece_id(piece: &str) -> u32 {
    let span = u64::from(VOCAB_SIZE - FIRST_REGULAR_ID);
    let id = fnv1a64(piece.as_bytes()) % span;
    // `id < span < u32::MAX`, so the conversion cannot fail.
    FIRST_REGULAR_ID + u32::try_from(id).unwrap_or(0)
}

fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn special_at(text: &str) -> Option<(&'static str, u32)> {
    if !text.starts_with('<') {
        return None;
    }
    SPECIAL_TOKENS
        .iter()
        .find(|(s, _)| text.starts_with(s))
        .copied()
}

/// Walks `text` piece by piece; `f(piece, Some(id))` for special tokens.
fn for_each_piece(text: &str, mut f: impl FnMut(&str, Option<u32>)) {
    let mut rest = text;
    while !rest.is_empty() {
        if let Some((s, id)) = special_at(rest) {
            f(s, Some(id));
            rest = &rest[s.len()..];
            continue;
        }
        let len = next_piece_len(rest);
        let (piece, tail) = rest.split_at(len);
        f(piece, None);
        rest = tail;
    }
}

/// Byte length of the regular piece at the start of `s` (non-empty `s`, at least one char).
fn next_piece_len(s: &str) -> usize {
    let mut chars = s.char_indices().peekable();
    let mut start_word = 0;
    if let Some((_, ' ')) = chars.peek().copied() {
        // A single space attaches to a following word.
        let mut look = s[1..].chars();
        match look.next() {
            Some(c) if c.is_alphanumeric() => {
                chars.next();
                start_word = 1;
            }
            _ => return 1,
        }
    }
    let mut count = 0;
    let mut end = start_word;
    for (i, c) in chars {
        if !c.is_alphanumeric() || count == MAX_PIECE_CHARS {
            break;
        }
        count += 1;
        end = i + c.len_utf8();
    }
    if count == 0 {
        // A lone non-word character (including whitespace other than a word's leading space).
        s.chars().next().map_or(1, char::len_utf8)
    } else {
        end
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn words_punctuation_and_specials() {
        let t = Tokenizer;
        let pieces = t.encode_pieces("<s>Hello, world!\n<|user|>", false);
        let texts: Vec<_> = pieces.iter().map(|p| p.text.as_str()).collect();
        assert_eq!(
            texts,
            ["<s>", "Hello", ",", "\u{2581}world", "!", "\n", "<|user|>"]
        );
        assert_eq!(pieces[0].id, BOS_ID);
        assert_eq!(pieces[6].id, 4);
    }

    #[test]
    fn bos_only_with_special_tokens() {
        let t = Tokenizer;
        assert_eq!(t.encode("hi", true)[0], BOS_ID);
        assert_ne!(t.encode("hi", false)[0], BOS_ID);
        assert_eq!(t.encode("", true), vec![BOS_ID]);
    }

    #[test]
    fn long_words_split_into_short_pieces() {
        let t = Tokenizer;
        let p = t.token_strs(" internationalization", false);
        assert_eq!(p, ["\u{2581}intern", "ationa", "lizati", "on"]);
    }

    #[test]
    fn ids_are_pinned_across_processes() {
        // Values computed independently (FNV-1a 64 in Python); they must never change, or every
        // client-side tokenization and recorded fixture drifts.
        assert_eq!(piece_id("hello"), 14_315);
        assert_eq!(piece_id(" world"), 29_661);
        assert_eq!(
            Tokenizer.encode("Hello world", true),
            vec![1, 23_115, 29_661]
        );
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn unicode_is_handled() {
        let t = Tokenizer;
        let ids = t.encode("café — naïve 日本語", false);
        assert!(!ids.is_empty());
        assert!(ids.iter().all(|&id| id < VOCAB_SIZE));
    }

    proptest! {
        #[test]
        fn ids_in_range_and_pieces_cover_text(s in "\\PC{0,200}") {
            let t = Tokenizer;
            let pieces = t.encode_pieces(&s, false);
            let rebuilt: String = pieces.iter().map(|p| p.text.replace('\u{2581}', " ")).collect();
            prop_assert_eq!(rebuilt, s.replace('\u{2581}', " "));
            for p in &pieces {
                prop_assert!(p.id < VOCAB_SIZE);
            }
            prop_assert_eq!(t.encode(&s, false), pieces.iter().map(|p| p.id).collect::<Vec<_>>());
        }
    }
}
