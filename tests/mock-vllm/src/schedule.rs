//! How a prompt's prefill is split into engine steps (vLLM 0.32's scheduler, one request alone).
//!
//! Each step ends where vLLM's `allocate_slots` caches blocks: the mock stores the blocks filled
//! so far and publishes one event batch per step.
//!
//! - Chunked prefill: a step computes at most `max_num_batched_tokens` tokens (vLLM's token
//!   budget; on CPU vLLM 0.32 uses 2,048). Without a budget the prompt is one step.
//! - Mamba "align" mode (`Scheduler._mamba_block_aligned_split`): a step that does not finish the
//!   prompt ends on a block boundary, and no step runs past the last block boundary a later
//!   request can resume at (`⌊(n − 1) / B⌋ × B`) nor past a shared-prefix junction, so the
//!   Mamba state there is written and can be cached.

/// End positions (tokens) of the prefill steps of an `n`-token prompt whose first `start` tokens
/// came from the cache; the last is `n`. Empty when there is nothing to compute.
pub fn prefill_steps(
    start: usize,
    n: usize,
    budget: Option<usize>,
    block_size: usize,
    mamba_align: bool,
    junction: usize,
) -> Vec<usize> {
    let bs = block_size.max(1);
    let budget = budget.unwrap_or(usize::MAX).max(1);
    let mut ends = Vec::new();
    let mut at = start;
    while at < n {
        let mut end = at.saturating_add(budget).min(n);
        if mamba_align {
            end = mamba_split(at, end, n, budget, bs, junction);
        }
        ends.push(end);
        at = end;
    }
    ends
}

/// `_mamba_block_aligned_split` without EAGLE, partial hash hits or internal checkpoints.
fn mamba_split(
    start: usize,
    end: usize,
    n: usize,
    budget: usize,
    bs: usize,
    junction: usize,
) -> usize {
    let mut end = end;
    if end < n {
        let aligned = end / bs * bs;
        if aligned > start || bs <= budget {
            end = aligned;
        }
    }
    let next_block = if !start.is_multiple_of(bs) {
        (start / bs + 1) * bs
    } else {
        0
    };
    let last_cache_position = n.saturating_sub(1) / bs * bs;
    let junction_stop = if start < junction && junction < end {
        start + (junction - start) / bs * bs
    } else {
        0
    };
    [next_block, last_cache_position, junction_stop]
        .into_iter()
        .filter(|s| start < *s && *s < end)
        .min()
        .unwrap_or(end)
        .max(start + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_step_without_a_budget() {
        assert_eq!(prefill_steps(0, 2_701, None, 64, false, 0), [2_701]);
        assert_eq!(prefill_steps(2_688, 2_701, None, 64, false, 0), [2_701]);
        assert!(prefill_steps(100, 100, None, 64, false, 0).is_empty());
    }

    #[test]
    fn chunks_of_the_budget_from_the_hit() {
        // The captured prompt: 2,048 then 653 tokens.
        assert_eq!(
            prefill_steps(0, 2_701, Some(2_048), 64, false, 0),
            [2_048, 2_701]
        );
        assert_eq!(
            prefill_steps(640, 5_000, Some(2_048), 64, false, 0),
            [2_688, 4_736, 5_000]
        );
    }

    #[test]
    fn mamba_steps_stop_at_the_resumable_boundary_and_the_junction() {
        // Without a budget: up to ⌊2700 / 64⌋ × 64 = 2,688, then the rest.
        assert_eq!(prefill_steps(0, 2_701, None, 64, true, 0), [2_688, 2_701]);
        // With a budget: 2,048 is aligned; then stop at 2,688.
        assert_eq!(
            prefill_steps(0, 2_701, Some(2_048), 64, true, 0),
            [2_048, 2_688, 2_701]
        );
        // A budget that is not a block multiple is floored to a block boundary.
        assert_eq!(
            prefill_steps(0, 300, Some(100), 64, true, 0),
            [64, 128, 192, 256, 300]
        );
        // A junction inside a step ends it.
        assert_eq!(
            prefill_steps(0, 2_701, None, 64, true, 1_024),
            [1_024, 2_688, 2_701]
        );
        // A block-aligned prompt: its last block is a step of its own.
        assert_eq!(prefill_steps(0, 256, None, 64, true, 0), [192, 256]);
    }
}
