//! Each replica's KV cache groups, learned from its events, and the prefix
//! hit vLLM 0.32 computes over them.
//!
//! A model with one kind of attention has one KV cache group. A hybrid model
//! (sliding window and full attention: gpt-oss, Gemma 2/3; chunked local:
//! Llama 4; Mamba hybrids) has several, each with its own residency in one
//! block pool: a block hit needs the block in the group
//! (`BlockPool.get_cached_block` is per `(hash, group)`). Every `BlockStored`
//! names its group (`group_idx`), the group's kind (`kv_cache_spec_kind`),
//! its sliding window and its block size: the layout is learned from them,
//! with no configuration, and learned afresh after a purge.
//!
//! # The hit
//!
//! vLLM's `HybridKVCacheCoordinator.find_longest_cache_hit`
//! (`vllm/v1/core/kv_cache_coordinator.py`) asks each kind's manager
//! (`single_type_kv_cache_manager.py`) for the longest hit not past a bound,
//! full attention first, and lowers the bound until every manager accepts
//! it. With `max = ⌊(prompt tokens − 1) / B⌋` blocks:
//!
//! | kind | the manager accepts a hit of `L` blocks when |
//! |---|---|
//! | full attention | blocks `0..L` are cached |
//! | sliding window `W` | the `n = ⌈(W − 1) / B⌉` blocks `L−n..L` are cached, or `L < n` and blocks `0..L` are |
//! | chunked local, chunk `C` | blocks `⌊L·B / C⌋·C/B .. L` are cached (earlier ones are outside the window) |
//! | Mamba | block `L − 1` is cached (its state at the boundary), or `L = 0` |
//!
//! Each manager returns the largest `L` at or below its bound that it
//! accepts (the sliding manager scans right to left, Mamba's too; the
//! chunked one runs on from its chunk's start), so the loop ends at the
//! largest `L ≤ max` every group accepts: [`Plan`] computes that. Groups
//! with equal specs are looked up together in vLLM (a block counts when
//! every one of them holds it); here each group is a condition of its own,
//! which accepts the same `L`s.
//!
//! Modelled: groups of the index's block size whose kind is one of the
//! above (MLA and attention-sink layers are full attention to the cache,
//! sliding-window MLA is a sliding window), a chunked-local group when its
//! chunk size is configured (`attention_chunk_size`: events do not carry
//! it). Not modelled, and reported
//! (metric, log, `/readyz`): any other kind, a chunked-local group of
//! unknown chunk, a group with another block size (vLLM then hashes at a
//! finer size and may hit inside a block), EAGLE's dropped block. Such a
//! group is left out of the rule: the hit is what the other groups accept,
//! an upper bound, and Picks say so (decision `approximate`).

use smallvec::SmallVec;

use crate::event::GroupKind;

/// The most KV cache groups per replica indexed (`group_idx` below this).
pub const MAX_GROUPS: u32 = 16;

/// One KV cache group as a replica's events describe it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvGroup {
    /// Its attention kind.
    pub kind: GroupKind,
    /// Its sliding window in tokens (sliding groups).
    pub sliding_window: Option<u32>,
    /// Its block size in tokens.
    pub block_size: u32,
}

/// A replica's KV cache groups by `group_idx`, as far as its events have
/// shown them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Layout {
    groups: SmallVec<[Option<KvGroup>; 2]>,
}

/// What learning one event's group did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Learned {
    /// The group was known as described.
    Same,
    /// A group seen for the first time (or with a larger block size: a
    /// group's partial blocks, vLLM's `cache_partial_block`, name the finer
    /// hash block size; the group's is the largest seen).
    New,
    /// The group was known with another kind, window or block size (the
    /// replica restarted with another model or configuration).
    Changed,
    /// `group_idx` is at or beyond [`MAX_GROUPS`]: not kept.
    Beyond,
}

/// Why a layout's hit cannot be computed exactly.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unmodelled {
    /// The first group not modelled.
    pub group: u32,
    /// Its kind's label (`chunked_local_attention`, `unknown`, …).
    pub kind: String,
    /// Why.
    pub reason: &'static str,
}

impl Layout {
    /// Records what a `BlockStored` says of its group. An event without
    /// `kv_cache_spec_kind` (vLLM before mid-2026) describes a model with one
    /// full-attention group when its group is 0.
    pub fn learn(
        &mut self,
        group: u32,
        kind: Option<&GroupKind>,
        sliding_window: Option<u32>,
        block_size: u32,
    ) -> Learned {
        if group >= MAX_GROUPS {
            return Learned::Beyond;
        }
        let kind = match kind {
            Some(k) => k.clone(),
            None if group == 0 => GroupKind::FullAttention(crate::event::FullLabel::Full),
            None => GroupKind::Other("unspecified".to_owned()),
        };
        let seen = KvGroup {
            kind,
            sliding_window,
            block_size,
        };
        let i = group as usize;
        if self.groups.len() <= i {
            self.groups.resize(i + 1, None);
        }
        let Some(slot) = self.groups.get_mut(i) else {
            return Learned::Beyond;
        };
        match slot {
            Some(known) if known.kind == seen.kind && known.sliding_window == sliding_window => {
                if block_size > known.block_size {
                    known.block_size = block_size;
                    Learned::New
                } else {
                    Learned::Same
                }
            }
            Some(known) => {
                *known = seen;
                Learned::Changed
            }
            None => {
                *slot = Some(seen);
                Learned::New
            }
        }
    }

    /// True when learning this would change nothing (a quick test before
    /// copying the layout).
    pub fn knows(
        &self,
        group: u32,
        kind: Option<&GroupKind>,
        sliding_window: Option<u32>,
        block_size: u32,
    ) -> bool {
        let Some(Some(known)) = self.groups.get(group as usize) else {
            return false;
        };
        let kind_same = match kind {
            Some(k) => known.kind == *k,
            None if group == 0 => {
                known.kind == GroupKind::FullAttention(crate::event::FullLabel::Full)
            }
            None => matches!(&known.kind, GroupKind::Other(l) if l == "unspecified"),
        };
        kind_same && known.sliding_window == sliding_window && block_size <= known.block_size
    }

    /// One more than the highest `group_idx` seen (0 when none).
    pub fn width(&self) -> u8 {
        self.groups.len() as u8
    }

    /// The groups seen, by `group_idx`.
    pub fn groups(&self) -> impl Iterator<Item = (u32, &KvGroup)> {
        self.groups
            .iter()
            .enumerate()
            .filter_map(|(i, g)| Some((i as u32, g.as_ref()?)))
    }

    /// Groups seen.
    pub fn len(&self) -> usize {
        self.groups.iter().flatten().count()
    }

    /// True when no group has been seen.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True when the hit is the leading run of group 0: nothing seen yet, or
    /// one full-attention group, group 0 (every model with one kind of
    /// attention but a sliding window or Mamba).
    pub fn is_plain(&self) -> bool {
        let mut groups = self.groups();
        match (groups.next(), groups.next()) {
            (None, _) => true,
            (Some((0, g)), None) => matches!(g.kind, GroupKind::FullAttention(_)),
            _ => false,
        }
    }

    /// The hit rule for blocks of `block_size` tokens; `chunk_tokens` is the
    /// chunked-local attention's chunk, when known. A group it cannot model
    /// is left out of the rule (the hit is then an upper bound: what the
    /// other groups accept) and reported, the first one; with no group left,
    /// group 0's blocks are taken as full attention's.
    pub fn plan(&self, block_size: u32, chunk_tokens: Option<u32>) -> (Plan, Option<Unmodelled>) {
        let mut plan = Plan::default();
        let mut unmodelled = None;
        for (i, g) in self.groups() {
            let mut report = |reason| {
                unmodelled.get_or_insert_with(|| Unmodelled {
                    group: i,
                    kind: g.kind.label().to_owned(),
                    reason,
                });
            };
            if g.block_size != block_size {
                report("block_size");
                continue;
            }
            let rule = match &g.kind {
                GroupKind::FullAttention(_) => Rule::Full,
                GroupKind::SlidingWindow { .. } => match g.sliding_window {
                    Some(w) if w > 0 => Rule::Sliding {
                        need: (w - 1).div_ceil(block_size),
                    },
                    _ => {
                        report("no_window");
                        continue;
                    }
                },
                GroupKind::ChunkedLocal => match chunk_tokens {
                    Some(c) if c > 0 && c % block_size == 0 => Rule::Chunked {
                        chunk_blocks: c / block_size,
                    },
                    Some(_) => {
                        report("chunk_not_block_multiple");
                        continue;
                    }
                    None => {
                        report("chunk_size_unknown");
                        continue;
                    }
                },
                GroupKind::Mamba => Rule::Mamba,
                GroupKind::Other(_) => {
                    report("kind");
                    continue;
                }
            };
            plan.groups.push((i, rule));
        }
        if plan.groups.is_empty() {
            plan.groups.push((0, Rule::Full));
        }
        // Full attention first, as vLLM sorts it: its leading run bounds the
        // rest.
        plan.groups
            .sort_by_key(|(i, rule)| (!matches!(rule, Rule::Full), *i));
        (plan, unmodelled)
    }

    /// The first group not modelled, if any (see [`Layout::plan`]).
    pub fn unmodelled(&self, block_size: u32, chunk_tokens: Option<u32>) -> Option<Unmodelled> {
        self.plan(block_size, chunk_tokens).1
    }
}

/// What one group's manager accepts (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// Every block before the hit.
    Full,
    /// The `need` blocks just before the hit.
    Sliding {
        /// `⌈(window − 1) / block size⌉`.
        need: u32,
    },
    /// The blocks from the hit's chunk start to the hit.
    Chunked {
        /// The chunk in blocks.
        chunk_blocks: u32,
    },
    /// The block just before the hit.
    Mamba,
}

/// The groups' rules, full attention first.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// `(group_idx, rule)`.
    pub groups: SmallVec<[(u32, Rule); 2]>,
}

impl Plan {
    /// The largest hit of at most `max` blocks every group accepts, where
    /// `held(group, block)` says whether the group holds block `block`.
    /// Each manager's question is asked as vLLM asks it, under a bound that
    /// only falls; the answer is the same as vLLM's loop's.
    pub fn hit(&self, max: u32, held: impl FnMut(u32, u32) -> bool) -> u32 {
        self.hit_from(max, None, held)
    }

    /// [`Plan::hit`] from a `bound` that group `accepted` (if any) accepts
    /// already: a full-attention group whose leading run is `bound` accepts
    /// every hit up to it, and is not asked again.
    pub fn hit_from(
        &self,
        bound: u32,
        accepted: Option<u32>,
        mut held: impl FnMut(u32, u32) -> bool,
    ) -> u32 {
        let mut bound = bound;
        loop {
            let before = bound;
            for (group, rule) in &self.groups {
                if Some(*group) == accepted {
                    continue;
                }
                if bound == 0 {
                    return 0;
                }
                bound = rule.longest(bound, |b| held(*group, b));
            }
            if bound == before {
                return bound;
            }
        }
    }
}

impl Rule {
    /// The largest hit of at most `max` blocks this group accepts.
    pub fn longest(self, max: u32, mut held: impl FnMut(u32) -> bool) -> u32 {
        match self {
            Rule::Full => (0..max).find(|b| !held(*b)).unwrap_or(max),
            Rule::Sliding { need } => sliding(max, need, held),
            Rule::Chunked { chunk_blocks } => {
                let start = max / chunk_blocks * chunk_blocks;
                (start..max).find(|b| !held(*b)).unwrap_or(max)
            }
            Rule::Mamba => (0..max).rev().find(|b| held(*b)).map_or(0, |b| b + 1),
        }
    }
}

/// The sliding manager's scan: the rightmost run of `need` held blocks
/// ending at or before `max`, its end; else the run of held blocks from
/// block 0. A block missing at `b` rules out every run through it, so the
/// scan tests the first block of the next candidate run, `need` to the left,
/// and walks right only from a held one: about `max / need` tests when
/// little is held, where vLLM's loop tests every block.
fn sliding(max: u32, need: u32, mut held: impl FnMut(u32) -> bool) -> u32 {
    // A window of one token needs no block before the hit; vLLM then takes
    // the rightmost held block, as with a need of one.
    let need = need.max(1);
    // Candidate run: blocks `end - need .. end`. Its first block missing
    // rules out every run ending before `end` too (they all hold it).
    let mut end = max;
    while end >= need {
        let start = end - need;
        if !held(start) {
            end = start;
            continue;
        }
        match (start + 1..end).rev().find(|b| !held(*b)) {
            None => return end,
            Some(missing) => end = missing,
        }
    }
    // No full run: the held blocks from 0 (fewer than `need`).
    (0..end).find(|b| !held(*b)).unwrap_or(end)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::FullLabel;

    fn layout(groups: &[(GroupKind, Option<u32>)]) -> Layout {
        let mut l = Layout::default();
        for (i, (k, w)) in groups.iter().enumerate() {
            assert_eq!(l.learn(i as u32, Some(k), *w, 64), Learned::New);
        }
        l
    }

    fn full() -> GroupKind {
        GroupKind::FullAttention(FullLabel::Full)
    }

    fn swa() -> GroupKind {
        GroupKind::SlidingWindow { mla: false }
    }

    /// vLLM's sliding scan as written (every block tested), for `sliding`.
    fn sliding_as_vllm(max: u32, need: u32, held: &dyn Fn(u32) -> bool) -> u32 {
        let mut run = 0;
        for i in (0..max).rev() {
            if held(i) {
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

    #[test]
    fn the_sliding_scan_skips_and_agrees_with_vllms() {
        // Every held-set over 12 blocks, every bound, needs 1..5.
        for bits in 0u32..(1 << 12) {
            let held = |b: u32| bits >> b & 1 == 1;
            for need in 1..5 {
                for max in 0..=12 {
                    assert_eq!(
                        sliding(max, need, held),
                        sliding_as_vllm(max, need, &held),
                        "bits {bits:b} need {need} max {max}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_sliding_scan_tests_a_block_in_need_when_nothing_is_held() {
        let mut tests = 0;
        assert_eq!(
            sliding(1024, 4, |_| {
                tests += 1;
                false
            }),
            0
        );
        assert!(tests <= 1024 / 4 + 4, "{tests} tests");
    }

    #[test]
    fn a_gemma3_layout_hits_at_the_windows_tail() {
        // Group 0 sliding (256 tokens: 4 blocks of 64), group 1 full.
        let l = layout(&[(swa(), Some(256)), (full(), None)]);
        assert!(!l.is_plain());
        let (plan, unmodelled) = l.plan(64, None);
        assert_eq!(unmodelled, None);
        assert_eq!(
            plan.groups.as_slice(),
            &[(1, Rule::Full), (0, Rule::Sliding { need: 4 })]
        );
        // Full holds 0..52, sliding 46..50 (the previous prompt's tail).
        let held = |g: u32, b: u32| {
            if g == 1 {
                b < 52
            } else {
                (46..50).contains(&b)
            }
        };
        assert_eq!(plan.hit(60, held), 50);
        // A shared prefix held only by full attention: no hit.
        let held = |g: u32, b: u32| g == 1 && b < 32;
        assert_eq!(plan.hit(60, held), 0);
        // The sliding tail beyond the full run does not count.
        let held = |g: u32, b: u32| {
            if g == 1 {
                b < 40
            } else {
                (46..50).contains(&b)
            }
        };
        assert_eq!(plan.hit(60, held), 0);
    }

    #[test]
    fn mamba_and_chunked_rules() {
        let held = |b: u32| b == 3 || b == 9;
        assert_eq!(Rule::Mamba.longest(12, held), 10);
        assert_eq!(Rule::Mamba.longest(9, held), 4);
        assert_eq!(Rule::Mamba.longest(3, held), 0);
        // Chunks of 4 blocks: from 8 on, blocks 8, 9 held, 10 missing.
        let held = |b: u32| b == 8 || b == 9;
        assert_eq!(Rule::Chunked { chunk_blocks: 4 }.longest(11, held), 10);
        // At exactly a chunk's start nothing needs to be held.
        assert_eq!(Rule::Chunked { chunk_blocks: 4 }.longest(8, held), 8);
        assert_eq!(Rule::Chunked { chunk_blocks: 4 }.longest(7, held), 4);
    }

    #[test]
    fn layouts_learn_change_and_report_what_is_not_modelled() {
        let mut l = Layout::default();
        assert!(l.is_plain());
        assert_eq!(l.learn(0, None, None, 64), Learned::New);
        assert!(l.is_plain());
        assert_eq!(l.learn(0, Some(&full()), None, 64), Learned::Same);
        assert!(l.knows(0, None, None, 64));
        assert!(l.knows(0, Some(&full()), None, 32));
        assert!(!l.knows(0, Some(&full()), None, 128));
        assert!(!l.knows(1, Some(&full()), None, 64));
        assert_eq!(l.learn(0, Some(&swa()), Some(128), 64), Learned::Changed);
        assert!(!l.is_plain());
        assert_eq!(
            l.learn(MAX_GROUPS, Some(&full()), None, 64),
            Learned::Beyond
        );
        assert_eq!(l.learn(1, Some(&GroupKind::Mamba), None, 128), Learned::New);
        let e = l.unmodelled(64, None).unwrap();
        assert_eq!(
            (e.group, e.kind.as_str(), e.reason),
            (1, "mamba", "block_size")
        );
        // Group 0 is modelled (sliding, 128); the Mamba group is left out.
        let (plan, _) = l.plan(64, None);
        assert_eq!(plan.groups.as_slice(), &[(0, Rule::Sliding { need: 2 })]);
        let l = layout(&[(full(), None), (GroupKind::ChunkedLocal, None)]);
        assert_eq!(l.unmodelled(64, None).unwrap().reason, "chunk_size_unknown");
        let (plan, unmodelled) = l.plan(64, Some(8192));
        assert_eq!(unmodelled, None);
        assert_eq!(
            plan.groups.as_slice(),
            &[(0, Rule::Full), (1, Rule::Chunked { chunk_blocks: 128 })]
        );
        let l = layout(&[
            (full(), None),
            (GroupKind::from_label("hisparse_hot"), None),
        ]);
        let e = l.unmodelled(64, None).unwrap();
        assert_eq!((e.kind.as_str(), e.reason), ("hisparse_hot", "kind"));
        // Nothing modelled: group 0's blocks as full attention's.
        let l = layout(&[(GroupKind::from_label("unknown"), None)]);
        assert_eq!(l.plan(64, None).0.groups.as_slice(), &[(0, Rule::Full)]);
    }
}
