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

use crate::cache::{CacheStats, SegmentCache};
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
            let got = self.encode_segmented(probe)?;
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
        let mut ids = match self.mode {
            Mode::Segmented(_) => self.encode_segmented(text)?,
            Mode::Whole(_) => self
                .tokenizer
                .encode(text, false)
                .map_err(err)?
                .get_ids()
                .to_vec(),
        };
        let (prefix, suffix): (&[u32], &[u32]) = if add_special_tokens {
            (&self.prefix, &self.suffix)
        } else {
            (&[], &[])
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
        if prefix.is_empty() && suffix.is_empty() {
            return Ok(ids);
        }
        let mut out = Vec::with_capacity(prefix.len() + ids.len() + suffix.len());
        out.extend_from_slice(prefix);
        out.extend(ids);
        out.extend_from_slice(suffix);
        Ok(out)
    }

    fn encode_segmented(&self, text: &str) -> Result<Vec<u32>, String> {
        // About four bytes a token: one allocation instead of a dozen
        // doublings, each copying what came before.
        let mut ids = Vec::with_capacity(text.len() / 4 + 16);
        for piece in self.splitter.split(text) {
            if let Some(id) = piece.added {
                ids.push(id);
                continue;
            }
            let body = text.get(piece.start..piece.end).unwrap_or_default();
            let mut from = 0usize;
            let cuts = self.boundaries.cuts(body);
            for (i, to) in cuts.iter().copied().chain([body.len()]).enumerate() {
                let seg = body.get(from..to).unwrap_or_default();
                let first = i == 0 && piece.start == 0;
                ids.extend_from_slice(&self.segment(seg, first)?);
                from = to;
            }
        }
        Ok(ids)
    }

    /// One segment's ids, from the cache or encoded (outside any lock).
    fn segment(&self, text: &str, first: bool) -> Result<Arc<[u32]>, String> {
        if let Some(ids) = self.cache.get(text, first) {
            return Ok(ids);
        }
        let model = self.tokenizer.get_model();
        let direct = match (&self.metaspace, &self.fast_pre) {
            (Some(m), _) => Some(metaspace_ids(m, text, first, model)),
            (None, Some(f)) => f.encode(text, model),
            (None, None) => None,
        };
        if let Some(direct) = direct {
            let ids: Arc<[u32]> = Arc::from(direct.map_err(err)?);
            self.cache.insert(text, first, Arc::clone(&ids));
            return Ok(ids);
        }
        let mut pretok = PreTokenizedString::from(text);
        if let Some(fast) = &self.fast_pre {
            fast.pre_tokenize(&mut pretok).map_err(err)?;
        } else {
            let pre = match (&self.pre_not_first, first) {
                (Some(not_first), false) => Some(not_first),
                _ => self.tokenizer.get_pre_tokenizer(),
            };
            if let Some(pre) = pre {
                pre.pre_tokenize(&mut pretok).map_err(err)?;
            }
        }
        pretok.tokenize(|n| model.tokenize(n.get())).map_err(err)?;
        let enc = pretok
            .into_encoding(None, 0, OffsetType::None)
            .map_err(err)?;
        let ids: Arc<[u32]> = Arc::from(enc.get_ids());
        self.cache.insert(text, first, Arc::clone(&ids));
        Ok(ids)
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
/// replacement. Empty text has no tokens.
fn metaspace_ids(
    m: &Metaspace,
    text: &str,
    first: bool,
    model: &impl Model,
) -> tokenizers::Result<Vec<u32>> {
    if text.is_empty() {
        return Ok(Vec::new());
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
    let mut push = |word: &str| -> tokenizers::Result<()> {
        ids.extend(model.tokenize(word)?.iter().map(|t| t.id));
        Ok(())
    };
    if m.get_split() {
        let mut start = 0;
        for (i, c) in s.char_indices() {
            if c == r && i > start {
                push(s.get(start..i).unwrap_or_default())?;
                start = i;
            }
        }
        push(s.get(start..).unwrap_or_default())?;
    } else {
        push(&s)?;
    }
    Ok(ids)
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
