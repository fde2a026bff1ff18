//! What one request may cost: caps on its size checked before anything is
//! encoded, a token count past which encoding stops (the ids are then a
//! prefix, flagged), a deadline and a cancellation flag checked between
//! segments, and the cache namespace its segments live in.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use minijinja::Value;
use minijinja::value::ValueKind;

use crate::error::{Cap, RequestError};

/// Size caps of one request, checked before anything is encoded (the
/// rendered prompt's once it is rendered). Over a cap the request is
/// refused with [`RequestError::OverCap`] (a local refusal: a replica may
/// still serve it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    /// Chat messages.
    pub messages: usize,
    /// Responses input items.
    pub items: usize,
    /// Tools.
    pub tools: usize,
    /// Bytes of all the request's strings, object keys included.
    pub text_bytes: usize,
    /// Bytes of the rendered prompt.
    pub prompt_bytes: usize,
    /// Bytes of one pre-token (a run the model's BPE sees whole, such as a
    /// word without spaces): BPE's time and memory grow with it, and no
    /// deadline can interrupt it.
    pub word_bytes: usize,
}

impl Caps {
    /// No caps.
    pub const UNBOUNDED: Caps = Caps {
        messages: usize::MAX,
        items: usize::MAX,
        tools: usize::MAX,
        text_bytes: usize::MAX,
        prompt_bytes: usize::MAX,
        word_bytes: usize::MAX,
    };

    /// Caps for a model with context `max_model_len` whose longest token
    /// is `longest_token_bytes` bytes (see `Tokenizer::caps`).
    ///
    /// - `messages`, `items`, `tools`: `max_model_len` each. Every message
    ///   or item a template renders costs at least one token (a role
    ///   marker, a separator), so a request with more cannot fit the
    ///   context; tools are rendered as JSON schemas of many tokens each.
    /// - `prompt_bytes`: `max_model_len × longest_token_bytes`, at most
    ///   [`Caps::MAX_BYTES`]. A prompt longer than that has more than
    ///   `max_model_len` tokens, which vLLM refuses.
    /// - `text_bytes`: `max_model_len × 64`, at least `prompt_bytes`, at
    ///   most [`Caps::MAX_BYTES`]. Request text may be dropped by the
    ///   template (older reasoning, unused tools) so it is not bounded by
    ///   the prompt; 64 bytes a token of context is generous.
    /// - `word_bytes`: `max_model_len × longest_token_bytes`, at most
    ///   [`Caps::MAX_WORD_BYTES`]. A pre-token that long encodes to more
    ///   than `max_model_len` tokens; the bound keeps one BPE call to tens
    ///   of milliseconds.
    pub fn for_model(max_model_len: usize, longest_token_bytes: usize) -> Caps {
        let longest = longest_token_bytes.max(1);
        let prompt_bytes = max_model_len.saturating_mul(longest).min(Self::MAX_BYTES);
        Caps {
            messages: max_model_len,
            items: max_model_len,
            tools: max_model_len,
            text_bytes: max_model_len
                .saturating_mul(64)
                .max(prompt_bytes)
                .min(Self::MAX_BYTES),
            prompt_bytes,
            word_bytes: max_model_len
                .saturating_mul(longest)
                .min(Self::MAX_WORD_BYTES),
        }
    }

    /// The largest text and prompt caps [`Caps::for_model`] gives.
    pub const MAX_BYTES: usize = 64 << 20;

    /// The largest pre-token cap [`Caps::for_model`] gives.
    pub const MAX_WORD_BYTES: usize = 256 << 10;

    /// Refuses `actual` over `cap`.
    pub(crate) fn check(cap: Cap, limit: usize, actual: usize) -> Result<(), RequestError> {
        if actual > limit {
            return Err(RequestError::OverCap { cap, limit, actual });
        }
        Ok(())
    }

    /// Checks the length of the list `v` (when it is one) against `limit`.
    pub(crate) fn check_len(cap: Cap, limit: usize, v: Option<&Value>) -> Result<(), RequestError> {
        match v {
            Some(v) if v.kind() == ValueKind::Seq => Self::check(cap, limit, v.len().unwrap_or(0)),
            _ => Ok(()),
        }
    }

    /// Checks the bytes of every string in `body` (keys included) against
    /// `text_bytes`, counting no further than the cap.
    pub(crate) fn check_text(&self, body: &Value) -> Result<(), RequestError> {
        if self.text_bytes == usize::MAX {
            return Ok(());
        }
        let mut total = 0usize;
        if text_bytes(body, self.text_bytes, &mut total) {
            return Err(RequestError::OverCap {
                cap: Cap::TextBytes,
                limit: self.text_bytes,
                actual: total,
            });
        }
        Ok(())
    }
}

/// Adds the string bytes of `v` to `total`; true once past `limit`. The
/// depth is bounded by the parser's [`crate::MAX_DEPTH`].
fn text_bytes(v: &Value, limit: usize, total: &mut usize) -> bool {
    match v.kind() {
        ValueKind::String => {
            *total = total.saturating_add(v.as_str().map_or(0, str::len));
        }
        ValueKind::Seq => {
            if let Ok(it) = v.try_iter() {
                for x in it {
                    if text_bytes(&x, limit, total) {
                        return true;
                    }
                }
            }
        }
        ValueKind::Map => {
            if let Ok(keys) = v.try_iter() {
                for k in keys {
                    let item = v.get_item(&k).unwrap_or_default();
                    if text_bytes(&k, limit, total) || text_bytes(&item, limit, total) {
                        return true;
                    }
                }
            }
        }
        _ => {}
    }
    *total > limit
}

impl Default for Caps {
    fn default() -> Self {
        Self::UNBOUNDED
    }
}

/// What one request may cost. [`Budget::default`] is unbounded: the
/// entry points without a budget use it.
#[derive(Debug, Clone, Default)]
pub struct Budget {
    /// Stop encoding once this many ids exist (special tokens included):
    /// the ids are then the first `max_tokens` of the full ids and
    /// [`Tokens::truncated`] is set. A router passes the most ids it
    /// looks at (`max_pick_keys × block_size`).
    pub max_tokens: Option<usize>,
    /// Checked between stages, messages and segments: past it, the request
    /// fails with [`RequestError::DeadlineExceeded`].
    pub deadline: Option<Instant>,
    /// Checked where the deadline is: once set, the request fails with
    /// [`RequestError::Cancelled`].
    pub cancelled: Option<Arc<AtomicBool>>,
    /// The segment-cache namespace: segments encoded under one namespace
    /// are never found under another. The caller derives it from the
    /// request's `cache_salt` (a hash; 0 without a salt), so that one
    /// tenant's text leaves no trace (timing) visible to another.
    pub namespace: u64,
    /// Size caps.
    pub caps: Caps,
}

impl Budget {
    /// No bound but `caps`.
    pub fn with_caps(caps: Caps) -> Self {
        Self {
            caps,
            ..Self::default()
        }
    }

    /// Fails when the deadline has passed or the request was cancelled.
    pub fn check(&self) -> Result<(), RequestError> {
        if self
            .cancelled
            .as_ref()
            .is_some_and(|c| c.load(Ordering::Relaxed))
        {
            return Err(RequestError::Cancelled);
        }
        if self.deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(RequestError::DeadlineExceeded);
        }
        Ok(())
    }

    /// Whether checks can ever fail (to skip the clock otherwise).
    pub(crate) fn interruptible(&self) -> bool {
        self.deadline.is_some() || self.cancelled.is_some()
    }
}

/// Token ids under a [`Budget`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tokens {
    /// The ids: all of them, or their first [`Budget::max_tokens`].
    pub ids: Vec<u32>,
    /// Encoding stopped at [`Budget::max_tokens`]: `ids` is a prefix of
    /// the full ids (which are longer). Checks that need the full length
    /// (vLLM's context-length refusal of Responses) were not made.
    pub truncated: bool,
}

/// A pre-token longer than the budget's word cap, carried through
/// `tokenizers`' error type out of the BPE call it refused.
#[derive(Debug)]
pub(crate) struct WordTooLong {
    /// The pre-token's bytes.
    pub len: usize,
}

impl std::fmt::Display for WordTooLong {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "a pre-token of {} bytes", self.len)
    }
}

impl std::error::Error for WordTooLong {}

/// The budget's deadline or cancellation, met inside a segment and carried
/// through `tokenizers`' error type.
#[derive(Debug)]
pub(crate) struct Interrupted(pub(crate) RequestError);

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for Interrupted {}

/// What bounds the encoding of one segment's words.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limit<'a> {
    /// The longest word BPE may see.
    pub word_cap: usize,
    /// The segment's encoding may stop once it has more ids than this
    /// (its ids so far are then a prefix of its full ids).
    pub room: usize,
    /// Checked every [`Limit::CHECK_EVERY`] words.
    pub budget: &'a Budget,
}

impl Limit<'_> {
    /// Words between two budget checks inside a segment.
    const CHECK_EVERY: usize = 64;

    /// Before BPE sees word number `n`: refuses it over the word cap, and
    /// checks the budget now and then.
    pub fn word(&self, word: &str, n: usize) -> tokenizers::Result<()> {
        if word.len() > self.word_cap {
            return Err(Box::new(WordTooLong { len: word.len() }));
        }
        if n.is_multiple_of(Self::CHECK_EVERY) && self.budget.interruptible() {
            self.budget
                .check()
                .map_err(|e| Box::new(Interrupted(e)) as tokenizers::Error)?;
        }
        Ok(())
    }

    /// Whether `ids` ids are enough to stop.
    pub fn full(&self, ids: usize) -> bool {
        ids > self.room
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn text_bytes_count_keys_and_nested_strings_and_stop_past_the_cap() {
        let body = crate::loads::parse(br#"{"ab": ["cde", {"f": "gh"}], "n": 1}"#).unwrap();
        let caps = |text_bytes| Caps {
            text_bytes,
            ..Caps::UNBOUNDED
        };
        // ab + cde + f + gh + n = 2 + 3 + 1 + 2 + 1
        assert!(caps(9).check_text(&body).is_ok());
        assert_eq!(
            caps(8).check_text(&body),
            Err(RequestError::OverCap {
                cap: Cap::TextBytes,
                limit: 8,
                actual: 9
            })
        );
        assert!(matches!(
            caps(2).check_text(&body),
            Err(RequestError::OverCap { actual: 5, .. })
        ));
    }

    #[test]
    fn model_caps_are_bounded() {
        let c = Caps::for_model(1 << 20, 128);
        assert_eq!(c.prompt_bytes, Caps::MAX_BYTES);
        assert_eq!(c.text_bytes, Caps::MAX_BYTES);
        assert_eq!(c.word_bytes, Caps::MAX_WORD_BYTES);
        let c = Caps::for_model(2048, 16);
        assert_eq!(c.messages, 2048);
        assert_eq!(c.prompt_bytes, 2048 * 16);
        assert_eq!(c.text_bytes, 2048 * 64);
        assert_eq!(c.word_bytes, 2048 * 16);
    }

    #[test]
    fn checks_cancellation_and_deadline() {
        let flag = Arc::new(AtomicBool::new(false));
        let b = Budget {
            cancelled: Some(Arc::clone(&flag)),
            ..Budget::default()
        };
        assert!(b.check().is_ok());
        flag.store(true, Ordering::Relaxed);
        assert_eq!(b.check(), Err(RequestError::Cancelled));
        let past = Budget {
            deadline: Some(Instant::now()),
            ..Budget::default()
        };
        assert_eq!(past.check(), Err(RequestError::DeadlineExceeded));
    }
}
