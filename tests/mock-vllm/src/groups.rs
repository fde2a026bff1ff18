//! What each kind of KV cache group can reuse and what it keeps: vLLM 0.32's single-type managers
//! (`vllm/v1/core/single_type_kv_cache_manager.py`) as pure functions over "is block `i` cached".
//!
//! Every group uses the replica's block size `B`, which is also the hit alignment (no EAGLE, no
//! fine-grained partial hits, no DCP/PCP). Hits, in tokens, never exceed `max_length`:
//!
//! | kind | hit (`find_longest_cache_hit`) | blocks cached (`reachable_block_mask`) |
//! |---|---|---|
//! | full attention | the run of cached blocks from block 0 | all |
//! | sliding window W | scanning right to left, the first `cdiv(W − 1, B)` contiguous cached blocks; their end is the hit (without such a run: the run from block 0) | retention 0: the `cdiv(W − 1, B)` blocks ending at each reachable boundary; `n`: also the tail of every `n`-token segment; dense: all |
//! | chunked local C | blocks before the chunk holding `max_length` count as hit (nulls), then the run of cached blocks from there | all |
//! | Mamba | the rightmost cached block | retention 0: the block ending at each reachable boundary; `n`: also each `n`-token segment's last; dense: all (the coordinator keeps only blocks holding a state) |
//!
//! While a request runs, each kind frees the blocks its attention no longer reads
//! ([`skipped_tokens`]): none for full attention, those before the window or the current chunk,
//! all but the last state for Mamba.
//!
//! A reachable boundary is a token position a later request can resume at: the replay boundary
//! `num_prompt_tokens − 1` and a shared-prefix junction, floored to `B`.

use crate::layout::KvCacheSpec;

/// Tokens of the longest prefix `spec`'s manager reuses, at most `max_length`, given which of
/// the request's blocks are cached in this group (`cached(i)`, only asked for
/// `i < max_length / block_size`).
pub fn longest_hit(
    spec: KvCacheSpec,
    block_size: usize,
    max_length: usize,
    cached: impl Fn(usize) -> bool,
) -> usize {
    let bs = block_size.max(1);
    let max_blocks = max_length / bs;
    let blocks = match spec {
        KvCacheSpec::FullAttention => (0..max_blocks).take_while(|i| cached(*i)).count(),
        KvCacheSpec::SlidingWindow { window } => {
            sliding_window_hit(KvCacheSpec::window_blocks(window, bs), max_blocks, cached)
        }
        KvCacheSpec::ChunkedLocalAttention { chunk } => {
            // Blocks wholly before the attention chunk of the next token are "computed" (null).
            let chunk = (chunk as usize).max(1);
            let first = max_length / chunk * chunk / bs;
            first + (first..max_blocks).take_while(|i| cached(*i)).count()
        }
        KvCacheSpec::Mamba => (0..max_blocks)
            .rev()
            .find(|i| cached(*i))
            .map_or(0, |i| i + 1),
    };
    blocks * bs
}

/// `SlidingWindowManager.find_longest_cache_hit`: right to left, stop at the first run of
/// `need` contiguous cached blocks; the run reaching block 0 counts even when shorter.
fn sliding_window_hit(need: usize, max_blocks: usize, cached: impl Fn(usize) -> bool) -> usize {
    let mut run = 0;
    for i in (0..max_blocks).rev() {
        if cached(i) {
            run += 1;
            if run >= need {
                return i + run;
            }
        } else {
            run = 0;
        }
    }
    run
}

/// Tokens at the front of a request that `spec`'s attention no longer reads once
/// `num_computed_tokens` are computed (vLLM's `get_num_skipped_tokens`): their blocks are freed
/// while the request runs, and a prefix hit does not hold them.
pub fn skipped_tokens(spec: KvCacheSpec, num_computed_tokens: usize) -> usize {
    match spec {
        KvCacheSpec::FullAttention => 0,
        KvCacheSpec::SlidingWindow { window } => {
            (num_computed_tokens + 1).saturating_sub(window as usize)
        }
        KvCacheSpec::ChunkedLocalAttention { chunk } => {
            let chunk = (chunk as usize).max(1);
            num_computed_tokens / chunk * chunk
        }
        // Only the state after the last computed token is needed.
        KvCacheSpec::Mamba => num_computed_tokens.saturating_sub(1),
    }
}

/// How densely sparse groups keep checkpoints (vLLM `prefix_cache_retention_interval`): `Some(0)`
/// only at reachable boundaries, `Some(n)` also every `n` tokens, `None` every block. Parses from
/// a token count or `none`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention(pub Option<u32>);

impl std::str::FromStr for Retention {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.trim().eq_ignore_ascii_case("none") {
            return Ok(Self(None));
        }
        s.trim()
            .parse()
            .map(|n| Self(Some(n)))
            .map_err(|_| format!("`{s}`: expected a number of tokens or `none`"))
    }
}

/// Which blocks of `[start, end)` group `spec` caches (`None`: all of them), for a request whose
/// reachable boundaries (token positions) are `boundaries`.
pub fn reachable_mask(
    spec: KvCacheSpec,
    block_size: usize,
    start: usize,
    end: usize,
    retention: Retention,
    boundaries: &[usize],
) -> Option<Vec<bool>> {
    let bs = block_size.max(1);
    let len = end.saturating_sub(start);
    match spec {
        KvCacheSpec::FullAttention | KvCacheSpec::ChunkedLocalAttention { .. } => None,
        KvCacheSpec::SlidingWindow { window } => {
            let need = KvCacheSpec::window_blocks(window, bs);
            let mut mask = vec![false; len];
            // (1) Segment tails: dense → one per block (alignment), 0 → none, n → per n tokens.
            let segment = match retention.0 {
                None => Some(bs),
                Some(0) => None,
                Some(n) => Some(n as usize),
            };
            if let Some(segment) = segment {
                let per_segment = (segment / bs).max(1);
                if need >= per_segment {
                    return None;
                }
                for (i, m) in (start..end).zip(mask.iter_mut()) {
                    *m = i % per_segment >= per_segment - need;
                }
            }
            // (2) The tail ending at each reachable boundary (sparse retention only).
            if retention.0.is_some() {
                for b in boundaries {
                    let stop = b / bs;
                    for j in start.max(stop.saturating_sub(need))..end.min(stop) {
                        if let Some(m) = mask.get_mut(j - start) {
                            *m = true;
                        }
                    }
                }
            }
            Some(mask)
        }
        KvCacheSpec::Mamba => {
            let mut mask = vec![false; len];
            let segment = match retention.0 {
                None => return None,
                Some(0) => None,
                Some(n) => Some(n as usize / bs),
            };
            if let Some(per_segment) = segment {
                if per_segment <= 1 {
                    return None;
                }
                // Block i holds the state after (i + 1) × B tokens.
                let first = (start + per_segment) / per_segment * per_segment - 1;
                for i in (first..end).step_by(per_segment) {
                    if let Some(m) = mask.get_mut(i - start) {
                        *m = true;
                    }
                }
            }
            for b in boundaries {
                if let Some(i) = (b / bs).checked_sub(1)
                    && (start..end).contains(&i)
                    && let Some(m) = mask.get_mut(i - start)
                {
                    *m = true;
                }
            }
            Some(mask)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SW256: KvCacheSpec = KvCacheSpec::SlidingWindow { window: 256 };
    const ZERO: Retention = Retention(Some(0));

    fn set(blocks: &[usize]) -> impl Fn(usize) -> bool + '_ {
        move |i| blocks.contains(&i)
    }

    #[test]
    fn full_attention_takes_the_leading_run() {
        let f = KvCacheSpec::FullAttention;
        assert_eq!(
            longest_hit(f, 64, 6_652, set(&(0..200).collect::<Vec<_>>())),
            6_592
        );
        assert_eq!(longest_hit(f, 64, 1_000, set(&[0, 1, 3])), 128);
        assert_eq!(longest_hit(f, 64, 63, set(&[0])), 0);
    }

    #[test]
    fn sliding_window_needs_the_contiguous_tail() {
        // Window 256, blocks of 64: 4 contiguous blocks.
        let tail = [46, 47, 48, 49];
        assert_eq!(longest_hit(SW256, 64, 3_209, set(&tail)), 3_200);
        // Three of the four: no hit (the run does not reach block 0).
        assert_eq!(longest_hit(SW256, 64, 3_209, set(&tail[1..])), 0);
        // The rightmost qualifying run wins; blocks after it are dropped.
        assert_eq!(
            longest_hit(SW256, 64, 3_209, set(&[10, 11, 12, 13, 30, 31, 32])),
            14 * 64
        );
        // The hit cannot pass max_length: block 49 ends past 3,150.
        assert_eq!(longest_hit(SW256, 64, 3_150, set(&tail)), 0);
        // A short prompt: the run from block 0 counts although shorter than the window.
        assert_eq!(longest_hit(SW256, 64, 199, set(&[0, 1, 2])), 192);
    }

    #[test]
    fn chunked_local_skips_earlier_chunks() {
        let c = KvCacheSpec::ChunkedLocalAttention { chunk: 256 };
        // max_length 700: the next token's chunk starts at 512 (block 8); blocks 0..8 are not
        // needed, blocks 8 and 9 are looked up.
        assert_eq!(longest_hit(c, 64, 700, set(&[8, 9])), 640);
        assert_eq!(longest_hit(c, 64, 700, set(&[9])), 512);
        assert_eq!(longest_hit(c, 64, 700, set(&[])), 512);
        // Inside the first chunk it is a plain leading run.
        assert_eq!(longest_hit(c, 64, 200, set(&[0, 1, 2])), 192);
        assert_eq!(longest_hit(c, 64, 200, set(&[1, 2])), 0);
    }

    #[test]
    fn mamba_takes_the_rightmost_cached_block() {
        let m = KvCacheSpec::Mamba;
        assert_eq!(longest_hit(m, 64, 7 * 64, set(&[2, 5])), 6 * 64);
        assert_eq!(longest_hit(m, 64, 5 * 64, set(&[2, 5])), 3 * 64);
        assert_eq!(longest_hit(m, 64, 5 * 64, set(&[])), 0);
    }

    #[test]
    fn sliding_keeps_the_tail_at_each_boundary() {
        // The captured prompt: 2,701 tokens, replay boundary 2,700 → blocks 38..42.
        let first = reachable_mask(SW256, 64, 0, 32, ZERO, &[2_700]).unwrap();
        assert!(
            first.iter().all(|m| !m),
            "the first 2,048-token chunk keeps nothing"
        );
        let second = reachable_mask(SW256, 64, 32, 42, ZERO, &[2_700]).unwrap();
        let kept: Vec<usize> = (32..42).filter(|i| second[i - 32]).collect();
        assert_eq!(kept, [38, 39, 40, 41]);
        // A junction adds its own tail.
        let both = reachable_mask(SW256, 64, 0, 42, ZERO, &[2_700, 1_024]).unwrap();
        let kept: Vec<usize> = (0..42).filter(|i| both[*i]).collect();
        assert_eq!(kept, [12, 13, 14, 15, 38, 39, 40, 41]);
        // Decode-filled blocks past the boundary: none.
        let decode = reachable_mask(SW256, 64, 50, 51, ZERO, &[3_209]).unwrap();
        assert_eq!(decode, [false]);
    }

    #[test]
    fn sliding_retention_intervals() {
        // Dense: every block (4 contiguous ≥ 1 per segment).
        assert_eq!(reachable_mask(SW256, 64, 0, 8, Retention(None), &[]), None);
        // Every 512 tokens (8 blocks): the last 4 of each segment, plus the boundary tail.
        let m = reachable_mask(SW256, 64, 0, 16, Retention(Some(512)), &[640]).unwrap();
        let kept: Vec<usize> = (0..16).filter(|i| m[*i]).collect();
        assert_eq!(kept, [4, 5, 6, 7, 8, 9, 12, 13, 14, 15]);
        assert_eq!(
            reachable_mask(KvCacheSpec::FullAttention, 64, 0, 8, ZERO, &[100]),
            None
        );
    }

    #[test]
    fn skipped_tokens_per_kind() {
        assert_eq!(skipped_tokens(KvCacheSpec::FullAttention, 5_000), 0);
        // vLLM's docstring examples: window 4 at 7 computed tokens skips 4; chunk 8 at 13 skips 8.
        let sw4 = KvCacheSpec::SlidingWindow { window: 4 };
        assert_eq!(skipped_tokens(sw4, 7), 4);
        assert_eq!(skipped_tokens(sw4, 2), 0);
        let c8 = KvCacheSpec::ChunkedLocalAttention { chunk: 8 };
        assert_eq!(skipped_tokens(c8, 13), 8);
        assert_eq!(skipped_tokens(c8, 7), 0);
        assert_eq!(skipped_tokens(KvCacheSpec::Mamba, 960), 959);
        assert_eq!(skipped_tokens(KvCacheSpec::Mamba, 0), 0);
    }

    #[test]
    fn mamba_keeps_the_boundary_state() {
        let m = reachable_mask(KvCacheSpec::Mamba, 64, 0, 42, ZERO, &[2_700, 1_024]).unwrap();
        let kept: Vec<usize> = (0..42).filter(|i| m[*i]).collect();
        assert_eq!(kept, [15, 41]);
        let every =
            reachable_mask(KvCacheSpec::Mamba, 64, 3, 20, Retention(Some(256)), &[]).unwrap();
        let kept: Vec<usize> = (3..20).filter(|i| every[i - 3]).collect();
        assert_eq!(kept, [3, 7, 11, 15, 19]);
        assert_eq!(
            reachable_mask(KvCacheSpec::Mamba, 64, 0, 4, Retention(None), &[]),
            None
        );
    }
}
