//! Text → token ids, as `tokenizers` encodes, at the cost of what is new.
//!
//! `tokenizers` splits the text on added tokens, then pre-tokenizes and
//! encodes each remaining piece on its own. The encoder does the same
//! ([`Splitter`]), cuts each piece at safe boundaries ([`Boundaries`]) into
//! segments, and encodes every segment through the tokenizer's own
//! pre-tokenizer and model, looking it up first in a [`SegmentCache`]. A
//! conversation that grows by one message re-encodes only its last segments.
//! Post-processing (BOS/EOS) is applied once, on the whole.
//!
//! At load the encoder checks itself against `tokenizers`' own `encode` on
//! probe texts; if they differ it encodes through `tokenizers` whole.

use std::sync::Arc;

use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::{
    Model, OffsetType, PreTokenizedString, PreTokenizer, PreTokenizerWrapper, Tokenizer,
};

use crate::budget::{Budget, Interrupted, Limit, Tokens, WordTooLong};
use crate::cache::{CacheStats, SegmentCache};
use crate::error::{Cap, RequestError};
use crate::pretok::FastPreTokenizer;
use crate::segment::{Analysis, Boundaries};
use crate::split::Splitter;

/// Where truncation keeps tokens (vLLM sets `truncation_side="left"` for
/// generation models: the last tokens are kept).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Truncation {
    /// Longest result, special tokens included.
    pub max_len: usize,
    /// Keep the last tokens (true) or the first.
    pub keep_last: bool,
}

/// How the encoder works for this tokenizer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    /// Split, segment, cache.
    Segmented(Analysis),
    /// Everything through `tokenizers`' `encode` (the self-check failed).
    Whole(String),
}

/// What the encoder reports for metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncoderStats {
    /// The segment cache's counters.
    pub cache: CacheStats,
    /// The mode and boundary rule in force.
    pub mode: Mode,
}

/// The encoder of one tokenizer.
pub struct Encoder {
    tokenizer: Tokenizer,
    /// The pre-tokenizer for text not at the start of the input (Metaspace
    /// prepends `▁` only there).
    pre_not_first: Option<PreTokenizerWrapper>,
    /// The split regexes in the `regex` crate, when they allow it.
    fast_pre: Option<FastPreTokenizer>,
    /// The Metaspace pre-tokenizer, run directly when the boundary analysis
    /// proved the pipeline is Metaspace + BPE without normalizer.
    metaspace: Option<Metaspace>,
    splitter: Splitter,
    boundaries: Boundaries,
    mode: Mode,
    cache: SegmentCache,
    prefix: Vec<u32>,
    suffix: Vec<u32>,
}

impl std::fmt::Debug for Encoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Encoder")
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// A `tokenizers` error as a request error: [`RequestError::OverCap`] for
/// [`WordTooLong`], the budget's error for [`Interrupted`], else vLLM's
/// generic message.
fn request_error(e: &tokenizers::Error, cap: usize) -> RequestError {
    if let Some(w) = e.downcast_ref::<WordTooLong>() {
        return RequestError::OverCap {
            cap: Cap::WordBytes,
            limit: cap,
            actual: w.len,
        };
    }
    match e.downcast_ref::<Interrupted>() {
        Some(Interrupted(e)) => e.clone(),
        None => RequestError::message(e.to_string()),
    }
}

impl Encoder {
    /// Builds the encoder for `tokenizer` with the rule `analysis`, a cache
    /// of `cache_bytes`, and the faster split-regex pre-tokenizer if one
    /// applies.
    pub fn new(
        tokenizer: Tokenizer,
        analysis: Analysis,
        cache_bytes: usize,
        fast_pre: Option<FastPreTokenizer>,
    ) -> Result<Self, String> {
        let added = tokenizer.get_added_tokens_decoder();
        let splitter = Splitter::new(added, tokenizer.get_encode_special_tokens())?;
        let pre_not_first = match tokenizer.get_pre_tokenizer() {
            Some(PreTokenizerWrapper::Metaspace(m))
                if m.get_prepend_scheme() == PrependScheme::First =>
            {
                Some(PreTokenizerWrapper::Metaspace(Metaspace::new(
                    m.get_replacement(),
                    PrependScheme::Never,
                    m.get_split(),
                )))
            }
            _ => None,
        };
        let (prefix, suffix) = specials(&tokenizer)?;
        let metaspace = match (analysis.boundaries, tokenizer.get_pre_tokenizer()) {
            (Boundaries::Metaspace, Some(PreTokenizerWrapper::Metaspace(m))) => Some(m.clone()),
            _ => None,
        };
        let mut enc = Self {
            tokenizer,
            pre_not_first,
            fast_pre,
            metaspace,
            splitter,
            boundaries: analysis.boundaries,
            mode: Mode::Segmented(analysis),
            cache: SegmentCache::new(cache_bytes),
            prefix,
            suffix,
        };
        if let Err(why) = enc.self_check() {
            enc.mode = Mode::Whole(why);
        }
        Ok(enc)
    }

    /// Compares the segmented path with `tokenizers`' `encode` on probes
    /// made of the tokenizer's own added tokens and assorted text.
    fn self_check(&self) -> Result<(), String> {
        let mut added: Vec<(u32, String)> = self
            .tokenizer
            .get_added_tokens_decoder()
            .into_iter()
            .map(|(id, t)| (id, t.content))
            .collect();
        added.sort();
        let sample: String = added
            .iter()
            .take(8)
            .map(|(_, c)| c.as_str())
            .collect::<Vec<_>>()
            .join(" x");
        let long =
            "Some text, with  spaces\tand tabs.\n  Indented line 42 日本語 ▁▁ end\n".repeat(30);
        let probes = [
            "Hello world".to_owned(),
            " leading space and trailing ".to_owned(),
            format!("{sample} tail"),
            format!("{sample}{long}{sample}"),
            long.clone(),
            format!("x{long}"),
            String::new(),
        ];
        for probe in &probes {
            let want = self
                .tokenizer
                .encode(probe.as_str(), false)
                .map_err(err)?
                .get_ids()
                .to_vec();
            let got = self
                .encode_segmented(probe, &Budget::default(), None)
                .map_err(err)?
                .0;
            if got != want {
                return Err(format!(
                    "the segmented encoding differs from tokenizers' on {:?}",
                    probe.get(..40)
                ));
            }
        }
        Ok(())
    }

    /// The token ids of `text`; special tokens per the post-processor when
    /// `add_special_tokens`; truncated as `truncation` says.
    pub fn encode(
        &self,
        text: &str,
        add_special_tokens: bool,
        truncation: Option<Truncation>,
    ) -> Result<Vec<u32>, String> {
        self.encode_with(text, add_special_tokens, truncation, &Budget::default())
            .map(|t| t.ids)
            .map_err(|e| e.to_string())
    }

    /// [`Encoder::encode`] under `budget`: its deadline and cancellation
    /// checked before each segment, its word cap applied to every
    /// pre-token, its namespace selecting the cache entries, and encoding
    /// stopped once more than `max_tokens` ids exist (the result is then
    /// the first `max_tokens` ids of `encode`'s, flagged). With `truncation`
    /// keeping the last tokens, everything is encoded (the kept tokens are
    /// known only at the end) and then cut.
    pub fn encode_with(
        &self,
        text: &str,
        add_special_tokens: bool,
        truncation: Option<Truncation>,
        budget: &Budget,
    ) -> Result<Tokens, RequestError> {
        budget.check()?;
        let (prefix, suffix): (&[u32], &[u32]) = if add_special_tokens {
            (&self.prefix, &self.suffix)
        } else {
            (&[], &[])
        };
        let keep_last = truncation.is_some_and(|t| t.keep_last);
        // Encoding may stop once the body alone is longer than the room
        // left for it: then the full ids are surely longer than the cap.
        let stop = match budget.max_tokens {
            Some(max) if !keep_last => Some(max.saturating_sub(prefix.len())),
            _ => None,
        };
        let mut ids = match self.mode {
            Mode::Segmented(_) => self.encode_segmented(text, budget, stop)?.0,
            Mode::Whole(_) => {
                let cap = budget.caps.word_bytes;
                if cap != usize::MAX {
                    // Pre-tokens are not seen here: the longest run without
                    // whitespace stands for the longest one.
                    let longest = text
                        .split(|c: char| c.is_whitespace())
                        .map(str::len)
                        .max()
                        .unwrap_or(0);
                    crate::budget::Caps::check(Cap::WordBytes, cap, longest)?;
                }
                self.tokenizer
                    .encode(text, false)
                    .map_err(|e| request_error(&e, cap))?
                    .get_ids()
                    .to_vec()
            }
        };
        if let Some(t) = truncation {
            let room = t.max_len.saturating_sub(prefix.len() + suffix.len());
            if ids.len() > room {
                if t.keep_last {
                    ids.drain(..ids.len() - room);
                } else {
                    ids.truncate(room);
                }
            }
        }
        let mut out = if prefix.is_empty() && suffix.is_empty() {
            ids
        } else {
            let mut out = Vec::with_capacity(prefix.len() + ids.len() + suffix.len());
            out.extend_from_slice(prefix);
            out.extend(ids);
            out.extend_from_slice(suffix);
            out
        };
        let mut truncated = false;
        if let Some(max) = budget.max_tokens
            && out.len() > max
        {
            out.truncate(max);
            truncated = true;
        }
        Ok(Tokens {
            ids: out,
            truncated,
        })
    }

    /// The ids of `text` without special tokens, and whether encoding
    /// stopped early: once more than `stop` ids exist.
    fn encode_segmented(
        &self,
        text: &str,
        budget: &Budget,
        stop: Option<usize>,
    ) -> Result<(Vec<u32>, bool), RequestError> {
        let interruptible = budget.interruptible();
        let stop = stop.unwrap_or(usize::MAX);
        // About four bytes a token: one allocation instead of a dozen
        // doublings, each copying what came before.
        let mut ids = Vec::with_capacity((text.len() / 4 + 16).min(stop.saturating_add(1)));
        for piece in self.splitter.split(text) {
            if ids.len() > stop {
                return Ok((ids, true));
            }
            if let Some(id) = piece.added {
                ids.push(id);
                continue;
            }
            let body = text.get(piece.start..piece.end).unwrap_or_default();
            let mut from = 0usize;
            let cuts = self.boundaries.cuts(body);
            for (i, to) in cuts.iter().copied().chain([body.len()]).enumerate() {
                if ids.len() > stop {
                    return Ok((ids, true));
                }
                if interruptible {
                    budget.check()?;
                }
                let seg = body.get(from..to).unwrap_or_default();
                let first = i == 0 && piece.start == 0;
                let limit = Limit {
                    word_cap: budget.caps.word_bytes,
                    room: stop.saturating_sub(ids.len()),
                    budget,
                };
                let (seg_ids, complete) = self.segment(seg, first, budget.namespace, limit)?;
                ids.extend_from_slice(&seg_ids);
                if !complete {
                    return Ok((ids, true));
                }
                from = to;
            }
        }
        Ok((ids, false))
    }

    /// One segment's ids, from the cache or encoded (outside any lock), and
    /// whether they are all of them: the direct encoders stop once they
    /// have more than `limit.room` ids (a partial result is not cached).
    fn segment(
        &self,
        text: &str,
        first: bool,
        ns: u64,
        limit: Limit<'_>,
    ) -> Result<(Arc<[u32]>, bool), RequestError> {
        let cap = limit.word_cap;
        if let Some(ids) = self.cache.get(ns, text, first) {
            return Ok((ids, true));
        }
        let model = self.tokenizer.get_model();
        let direct = match (&self.metaspace, &self.fast_pre) {
            (Some(m), _) => Some(metaspace_ids(m, text, first, model, limit)),
            (None, Some(f)) => f.encode(text, model, limit),
            (None, None) => None,
        };
        if let Some(direct) = direct {
            let (ids, complete) = direct.map_err(|e| request_error(&e, cap))?;
            let ids: Arc<[u32]> = Arc::from(ids);
            if complete {
                self.cache.insert(ns, text, first, Arc::clone(&ids));
            }
            return Ok((ids, complete));
        }
        let fail = |e: tokenizers::Error| request_error(&e, cap);
        let mut pretok = PreTokenizedString::from(text);
        if let Some(fast) = &self.fast_pre {
            fast.pre_tokenize(&mut pretok).map_err(fail)?;
        } else {
            let pre = match (&self.pre_not_first, first) {
                (Some(not_first), false) => Some(not_first),
                _ => self.tokenizer.get_pre_tokenizer(),
            };
            if let Some(pre) = pre {
                pre.pre_tokenize(&mut pretok).map_err(fail)?;
            }
        }
        let n = std::cell::Cell::new(0usize);
        pretok
            .tokenize(|w| {
                limit.word(w.get(), n.get())?;
                n.set(n.get() + 1);
                model.tokenize(w.get())
            })
            .map_err(fail)?;
        let enc = pretok
            .into_encoding(None, 0, OffsetType::None)
            .map_err(fail)?;
        let ids: Arc<[u32]> = Arc::from(enc.get_ids());
        self.cache.insert(ns, text, first, Arc::clone(&ids));
        Ok((ids, true))
    }

    /// Token strings of `ids` (`convert_ids_to_tokens`).
    pub fn token_strs(&self, ids: &[u32]) -> Vec<String> {
        ids.iter()
            .map(|&id| self.tokenizer.id_to_token(id).unwrap_or_default())
            .collect()
    }

    /// The longest token in characters (vLLM's `max_chars_per_token`).
    pub fn max_chars_per_token(&self) -> usize {
        self.tokenizer
            .get_vocab(true)
            .keys()
            .map(|t| t.chars().count())
            .max()
            .unwrap_or(1)
    }

    /// Whether split regexes run in the `regex` crate.
    pub fn fast_pre_tokenizer(&self) -> bool {
        self.fast_pre.is_some()
    }

    /// Counters and mode.
    pub fn stats(&self) -> EncoderStats {
        EncoderStats {
            cache: self.cache.stats(),
            mode: self.mode.clone(),
        }
    }
}

/// Metaspace then the model, as `tokenizers` runs them on one split without
/// its alignment bookkeeping: spaces become the replacement, which is
/// prepended (per the scheme; "first" only at the start of the input) unless
/// the text starts with it, and with `split` the text is cut before each
/// replacement. Empty text has no tokens. Words over `word_cap` bytes are
/// refused ([`WordTooLong`]).
fn metaspace_ids(
    m: &Metaspace,
    text: &str,
    first: bool,
    model: &impl Model,
    limit: Limit<'_>,
) -> tokenizers::Result<(Vec<u32>, bool)> {
    if text.is_empty() {
        return Ok((Vec::new(), true));
    }
    let r = m.get_replacement();
    let mut s = String::with_capacity(text.len() + 4);
    let prepend = match m.get_prepend_scheme() {
        PrependScheme::Always => true,
        PrependScheme::First => first,
        PrependScheme::Never => false,
    };
    if prepend && !text.starts_with([' ', r]) {
        s.push(r);
    }
    s.extend(text.chars().map(|c| if c == ' ' { r } else { c }));
    let mut ids = Vec::with_capacity(s.len() / 3);
    let mut n = 0usize;
    // Each word's ids, until more than the room exists.
    let mut push = |word: &str| -> tokenizers::Result<bool> {
        limit.word(word, n)?;
        n += 1;
        ids.extend(model.tokenize(word)?.iter().map(|t| t.id));
        Ok(limit.full(ids.len()))
    };
    // Stopped early: words remain, the ids are a prefix.
    let mut stopped = false;
    if m.get_split() {
        let mut start = 0;
        for (i, c) in s.char_indices() {
            if c == r && i > start {
                if push(s.get(start..i).unwrap_or_default())? {
                    stopped = true;
                    break;
                }
                start = i;
            }
        }
        if !stopped {
            push(s.get(start..).unwrap_or_default())?;
        }
    } else {
        push(&s)?;
    }
    Ok((ids, !stopped))
}

/// The ids the post-processor puts before and after a single sequence,
/// checked to be a fixed prefix and suffix.
fn specials(tokenizer: &Tokenizer) -> Result<(Vec<u32>, Vec<u32>), String> {
    let mut found: Option<(Vec<u32>, Vec<u32>)> = None;
    for sample in ["a", "Hello world", "x y z\n1"] {
        let bare = tokenizer
            .encode(sample, false)
            .map_err(err)?
            .get_ids()
            .to_vec();
        let with = tokenizer
            .encode(sample, true)
            .map_err(err)?
            .get_ids()
            .to_vec();
        let pos = with
            .windows(bare.len().max(1))
            .position(|w| w == bare.as_slice())
            .ok_or("the post-processor changes the sequence itself")?;
        let prefix = with.get(..pos).unwrap_or_default().to_vec();
        let suffix = with.get(pos + bare.len()..).unwrap_or_default().to_vec();
        match &found {
            Some(f) if f != &(prefix.clone(), suffix.clone()) => {
                return Err("the post-processor adds different tokens to different texts".into());
            }
            _ => found = Some((prefix, suffix)),
        }
    }
    Ok(found.unwrap_or_default())
}
