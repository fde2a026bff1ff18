//! The replica's KV cache layout: its KV cache groups, as vLLM 0.32 forms them for a model.
//!
//! A model with one attention kind has one group; a hybrid model has several, ordered as vLLM
//! orders them (by the model's layers: for gpt-oss and Gemma 3, group 0 is the sliding one). Every
//! group uses the replica's block size and lives in the replica's one block pool. Written on the
//! command line as a comma-separated list, one entry per group in `group_idx` order:
//!
//! | entry | vLLM spec | `kv_cache_spec_kind` |
//! |---|---|---|
//! | `full_attention` | `FullAttentionSpec` | `full_attention` |
//! | `sliding_window:W` | `SlidingWindowSpec`, window W tokens | `sliding_window` (+ `kv_cache_spec_sliding_window` W) |
//! | `chunked_local_attention:C` | `ChunkedLocalAttentionSpec`, chunk C tokens | `chunked_local_attention` |
//! | `mamba` | `MambaSpec`, `mamba_cache_mode` "align" (vLLM's default with prefix caching) | `mamba` |
//!
//! e.g. `sliding_window:256,full_attention` (the captured tiny Gemma-3-style model) or
//! `sliding_window:128,full_attention` (gpt-oss).

use std::fmt;
use std::str::FromStr;

/// One KV cache group's attention kind (its vLLM `KVCacheSpec`, block size aside).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvCacheSpec {
    /// Every token attends to every earlier token; caches every full block.
    FullAttention,
    /// Each token attends to the last `window` tokens (vLLM `SlidingWindowSpec.sliding_window`).
    SlidingWindow { window: u32 },
    /// Tokens attend within their `chunk`-token chunk (vLLM `attention_chunk_size`, Llama 4).
    ChunkedLocalAttention { chunk: u32 },
    /// A recurrent state per block boundary (Mamba / linear attention, "align" cache mode).
    Mamba,
}

impl KvCacheSpec {
    /// vLLM's `KVCacheSpecKind` value, as BlockStored's `kv_cache_spec_kind` carries it.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::FullAttention => "full_attention",
            Self::SlidingWindow { .. } => "sliding_window",
            Self::ChunkedLocalAttention { .. } => "chunked_local_attention",
            Self::Mamba => "mamba",
        }
    }

    /// BlockStored's `kv_cache_spec_sliding_window`: the window of a sliding group, else `None`.
    pub fn sliding_window(&self) -> Option<u32> {
        match self {
            Self::SlidingWindow { window } => Some(*window),
            _ => None,
        }
    }

    /// Full attention (vLLM's `FullAttentionSpec`): looked up first, downward-closed.
    pub fn is_full_attention(&self) -> bool {
        matches!(self, Self::FullAttention)
    }

    /// Groups whose cached blocks vLLM thins out with `prefix_cache_retention_interval`.
    pub fn is_sparse(&self) -> bool {
        matches!(self, Self::SlidingWindow { .. } | Self::Mamba)
    }

    /// Contiguous cached blocks a sliding-window hit needs: `cdiv(window − 1, block_size)`.
    pub(crate) fn window_blocks(window: u32, block_size: usize) -> usize {
        (window as usize)
            .saturating_sub(1)
            .div_ceil(block_size.max(1))
    }

    /// Upper bound of the blocks one request of `tokens` tokens leaves cached in this group:
    /// what [`KvCacheLayout::max_cached_blocks`] sums to size the pool.
    fn max_cached_blocks(&self, tokens: usize, block_size: usize, thin: bool) -> usize {
        let all = tokens.div_ceil(block_size.max(1));
        match self {
            // A tail at the replay boundary and one at a shared-prefix junction.
            Self::SlidingWindow { window } if thin => {
                all.min(2 * Self::window_blocks(*window, block_size).max(1))
            }
            Self::Mamba if thin => all.min(2),
            _ => all,
        }
    }
}

impl fmt::Display for KvCacheSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::SlidingWindow { window } => write!(f, "{}:{window}", self.kind()),
            Self::ChunkedLocalAttention { chunk } => write!(f, "{}:{chunk}", self.kind()),
            Self::FullAttention | Self::Mamba => f.write_str(self.kind()),
        }
    }
}

/// Why a layout string or group list was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct LayoutError(String);

fn positive(kind: &str, what: &str, value: &str) -> Result<u32, LayoutError> {
    match value.trim().parse::<u32>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(LayoutError(format!(
            "`{kind}:{value}`: the {what} must be a positive number of tokens"
        ))),
    }
}

impl FromStr for KvCacheSpec {
    type Err = LayoutError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let (kind, arg) = match s.split_once(':') {
            Some((k, a)) => (k.trim(), Some(a)),
            None => (s, None),
        };
        match (kind, arg) {
            ("full_attention", None) => Ok(Self::FullAttention),
            ("mamba", None) => Ok(Self::Mamba),
            ("sliding_window", Some(w)) => Ok(Self::SlidingWindow {
                window: positive(kind, "window", w)?,
            }),
            ("chunked_local_attention", Some(c)) => Ok(Self::ChunkedLocalAttention {
                chunk: positive(kind, "chunk size", c)?,
            }),
            ("sliding_window", None) => Err(LayoutError(
                "`sliding_window` needs its window in tokens, e.g. `sliding_window:256`".into(),
            )),
            ("chunked_local_attention", None) => Err(LayoutError(
                "`chunked_local_attention` needs its chunk size in tokens, e.g. `chunked_local_attention:8192`"
                    .into(),
            )),
            ("full_attention" | "mamba", Some(_)) => {
                Err(LayoutError(format!("`{s}`: `{kind}` takes no parameter")))
            }
            _ => Err(LayoutError(format!(
                "unknown KV cache group `{s}`; expected full_attention, sliding_window:W, chunked_local_attention:C or mamba"
            ))),
        }
    }
}

/// The KV cache groups of a replica, in `group_idx` order; never empty.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvCacheLayout {
    groups: Vec<KvCacheSpec>,
}

impl Default for KvCacheLayout {
    /// One full-attention group: a plain decoder model.
    fn default() -> Self {
        Self {
            groups: vec![KvCacheSpec::FullAttention],
        }
    }
}

impl KvCacheLayout {
    /// A layout of `groups` in `group_idx` order (at least one).
    pub fn new(groups: Vec<KvCacheSpec>) -> Result<Self, LayoutError> {
        if groups.is_empty() {
            return Err(LayoutError("at least one KV cache group is needed".into()));
        }
        for g in &groups {
            match g {
                KvCacheSpec::SlidingWindow { window: 0 } => {
                    return Err(LayoutError("a sliding window must be positive".into()));
                }
                KvCacheSpec::ChunkedLocalAttention { chunk: 0 } => {
                    return Err(LayoutError("an attention chunk must be positive".into()));
                }
                _ => {}
            }
        }
        Ok(Self { groups })
    }

    /// The groups; index = `group_idx`.
    pub fn groups(&self) -> &[KvCacheSpec] {
        &self.groups
    }

    /// `(group_idx, spec)` pairs.
    pub fn indexed(&self) -> impl Iterator<Item = (u32, KvCacheSpec)> + '_ {
        (0u32..).zip(self.groups.iter().copied())
    }

    /// Whether a group thins its cached blocks with the retention interval (sliding, Mamba).
    pub fn has_sparse_group(&self) -> bool {
        self.groups.iter().any(KvCacheSpec::is_sparse)
    }

    /// Whether a Mamba group makes the scheduler split prefills at block boundaries.
    pub fn has_mamba(&self) -> bool {
        self.groups.contains(&KvCacheSpec::Mamba)
    }

    /// Blocks a running request of `tokens` tokens holds across the groups (for
    /// `kv_cache_usage_perc`): every block in full-attention groups, the window's blocks in sliding
    /// ones, the current chunk's in chunked-local ones, one state block in a Mamba group.
    pub fn blocks_held(&self, tokens: usize, block_size: usize) -> usize {
        let bs = block_size.max(1);
        let all = tokens.div_ceil(bs);
        self.groups
            .iter()
            .map(|g| match g {
                KvCacheSpec::FullAttention => all,
                KvCacheSpec::SlidingWindow { window } => {
                    all.min(KvCacheSpec::window_blocks(*window, bs) + 1)
                }
                KvCacheSpec::ChunkedLocalAttention { chunk } => {
                    all.min((*chunk as usize).div_ceil(bs) + 1)
                }
                KvCacheSpec::Mamba => all.min(1),
            })
            .sum()
    }

    /// Upper bound of the pool entries one request of `tokens` tokens leaves cached, summed over
    /// the groups (`thin`: retention interval 0, vLLM's default).
    pub fn max_cached_blocks(&self, tokens: usize, block_size: usize, thin: bool) -> usize {
        self.groups
            .iter()
            .map(|g| g.max_cached_blocks(tokens, block_size, thin))
            .sum()
    }
}

impl fmt::Display for KvCacheLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, g) in self.groups.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{g}")?;
        }
        Ok(())
    }
}

impl FromStr for KvCacheLayout {
    type Err = LayoutError;

    /// `sliding_window:256,full_attention`: one entry per group, in `group_idx` order.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.trim().is_empty() {
            return Err(LayoutError(
                "empty layout; e.g. `full_attention` or `sliding_window:256,full_attention`".into(),
            ));
        }
        let groups = s
            .split(',')
            .map(str::parse)
            .collect::<Result<Vec<KvCacheSpec>, _>>()?;
        Self::new(groups)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_in_group_order_and_round_trips() {
        let l: KvCacheLayout = "sliding_window:256, full_attention".parse().unwrap();
        assert_eq!(
            l.groups(),
            [
                KvCacheSpec::SlidingWindow { window: 256 },
                KvCacheSpec::FullAttention
            ]
        );
        assert_eq!(l.to_string(), "sliding_window:256,full_attention");
        let all: KvCacheLayout = "mamba,chunked_local_attention:8192,full_attention"
            .parse()
            .unwrap();
        assert_eq!(
            all.to_string(),
            "mamba,chunked_local_attention:8192,full_attention"
        );
        assert!(all.has_mamba() && all.has_sparse_group());
        assert_eq!(KvCacheLayout::default().to_string(), "full_attention");
        assert!(!KvCacheLayout::default().has_sparse_group());
    }

    #[test]
    fn kinds_and_windows_as_vllm_names_them() {
        let sw = KvCacheSpec::SlidingWindow { window: 128 };
        assert_eq!(
            (sw.kind(), sw.sliding_window()),
            ("sliding_window", Some(128))
        );
        let cl = KvCacheSpec::ChunkedLocalAttention { chunk: 8192 };
        assert_eq!(
            (cl.kind(), cl.sliding_window()),
            ("chunked_local_attention", None)
        );
        assert_eq!(KvCacheSpec::Mamba.kind(), "mamba");
        assert_eq!(KvCacheSpec::FullAttention.sliding_window(), None);
        assert_eq!(KvCacheSpec::window_blocks(256, 64), 4);
        assert_eq!(KvCacheSpec::window_blocks(128, 16), 8);
    }

    #[test]
    fn bad_input_is_refused_with_a_reason() {
        let err = |s: &str| s.parse::<KvCacheLayout>().unwrap_err().to_string();
        assert!(
            err("sliding_window").contains("needs its window"),
            "{}",
            err("sliding_window")
        );
        assert!(err("sliding_window:0").contains("positive"));
        assert!(err("sliding_window:x").contains("positive"));
        assert!(err("chunked_local_attention").contains("chunk size"));
        assert!(err("full_attention:3").contains("takes no parameter"));
        assert!(err("linear").contains("unknown KV cache group `linear`"));
        assert!(err("full_attention,,mamba").contains("unknown"));
        assert!(err("").contains("empty layout"));
        assert!(KvCacheLayout::new(vec![]).is_err());
    }

    #[test]
    fn blocks_held_per_group() {
        let l: KvCacheLayout = "sliding_window:256,full_attention,mamba".parse().unwrap();
        // 2,701 tokens in 64-token blocks: 43 blocks; the window holds 4 + 1; Mamba 1.
        assert_eq!(l.blocks_held(2_701, 64), 5 + 43 + 1);
        assert_eq!(KvCacheLayout::default().blocks_held(2_701, 64), 43);
        assert_eq!(l.max_cached_blocks(2_701, 64, true), 8 + 43 + 2);
        assert_eq!(l.max_cached_blocks(2_701, 64, false), 3 * 43);
    }
}
