//! Pick and Observe: from a request to an ordered list of healthy, fresh
//! replicas (or a stale answer), using [`crate::score`] over a snapshot.
//!
//! Decision kinds (proto `DecisionKind`):
//! - `AFFINITY`: `previous_response_id` names a response recorded for the same
//!   model (base or adapter) on a replica that still serves it and is healthy
//!   and fresh: that replica alone (its response store is the only one
//!   holding the id). Any other case takes the paths below.
//! - `PRECISE` / `APPROXIMATE`: some candidate holds a prefix of the keys.
//! - `LOAD`: nobody holds anything (or the block size differs, reason
//!   `block_size_mismatch`, or the keys use another key scheme, reason
//!   `key_scheme_mismatch`): ranked by load alone.
//! - `STALE`: no healthy, fresh replica serves the model; no candidates.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_proto::SCHEME_VERSION;
use kvroute_proto::keys::BlockKey;
use kvroute_proto::v1::{BusyReplica, Candidate, DecisionKind, Mode, PickRequest, PickResponse};

use crate::conversations::{Continues, Conversations, Placed};
use crate::error::RequestError;
use crate::event::Tier;
use crate::ids::EndpointId;
use crate::ids::ReplicaSlot;
use crate::index::{PrefixMatch, Query};
use crate::score::{self, Input, Move, Ranking};
use crate::state::{Replica, Shared};
use crate::sync::{lock, read};

mod observe;
mod place;

pub use observe::observe;
use place::place;

fn proto_tier(t: Option<Tier>) -> i32 {
    use kvroute_proto::v1::Tier as P;
    (match t {
        None => P::Unspecified,
        Some(Tier::Gpu) => P::Gpu,
        Some(Tier::Cpu) => P::Cpu,
        Some(Tier::Storage) => P::Storage,
    }) as i32
}

fn decision_label(d: DecisionKind) -> &'static str {
    match d {
        DecisionKind::Unspecified => "unspecified",
        DecisionKind::Precise => "precise",
        DecisionKind::Affinity => "affinity",
        DecisionKind::Approximate => "approximate",
        DecisionKind::Load => "load",
        DecisionKind::Stale => "stale",
        DecisionKind::Untokenized => "untokenized",
    }
}

fn answer(
    shared: &Shared,
    decision: DecisionKind,
    reason: &'static str,
    candidates: Vec<Candidate>,
) -> PickResponse {
    shared
        .metrics
        .decisions
        .inc([decision_label(decision), reason]);
    PickResponse {
        candidates,
        decision: decision as i32,
        reason: reason.to_owned(),
        index_block_size: 0,
        block_size_mismatch: false,
        ..PickResponse::default()
    }
}

fn candidate(r: &Replica, m: &PrefixMatch, block_size: u32, cost: f64) -> Candidate {
    Candidate {
        address: r.address().to_owned(),
        data_parallel_rank: r.id().rank,
        matched_blocks: m.blocks,
        matched_tokens: m.blocks.saturating_mul(block_size),
        tier: proto_tier(m.slowest_tier()),
        cost,
    }
}

/// The longest request id (the filter makes 24-byte ids).
pub const MAX_REQUEST_ID_BYTES: usize = 64;
/// The longest response id (vLLM's are `resp_` and 32 hex digits).
pub const MAX_RESPONSE_ID_BYTES: usize = 256;
/// Most completed picks one Pick carries.
pub const MAX_COMPLETED_IDS: usize = 64;

fn bounded(field: &'static str, id: &str, max: usize) -> Result<(), RequestError> {
    if id.len() > max {
        return Err(RequestError::IdTooLong {
            field,
            len: id.len(),
            max,
        });
    }
    Ok(())
}

/// Forgets the pending pick of `request_id` on whichever replica noted it:
/// the replica answered, so its prefill no longer stands for queued work
/// (Envoy may have served it elsewhere after a retry).
fn complete_pick(shared: &Shared, request_id: &str, now: Instant) {
    if request_id.is_empty() {
        return;
    }
    for r in read(&shared.registry).all() {
        if r.complete_pick(now, request_id) {
            break;
        }
    }
}

/// The replica holding the stored response `previous_response_id` names, if
/// it may answer this Pick: recorded for this very model (the base model or
/// the LoRA adapter the request names), still registered and serving that
/// model, healthy and fresh, like every candidate of every other path.
/// Otherwise the miss's metric label.
fn affinity_target(
    shared: &Shared,
    req: &PickRequest,
    now: Instant,
) -> Result<Arc<Replica>, &'static str> {
    let (id, same_model) = {
        let affinity = lock(&shared.affinity);
        let (id, model) = affinity
            .get(&req.previous_response_id, now)
            .ok_or("unknown")?;
        (id.clone(), model == req.model)
    };
    if !same_model {
        return Err("model_mismatch");
    }
    let r = read(&shared.registry).find(&id).ok_or("replica_gone")?;
    if !r.serves(&req.model) {
        return Err("model_not_served");
    }
    if !r.is_healthy() {
        return Err("unhealthy");
    }
    if !r.is_fresh() {
        return Err("stale");
    }
    Ok(r)
}

/// Refuses a Pick whose fields pass their bounds.
fn validate(shared: &Shared, req: &PickRequest) -> Result<(), RequestError> {
    let max_keys = shared.config.max_pick_keys;
    if req.block_keys.len() > max_keys {
        return Err(RequestError::TooManyKeys {
            got: req.block_keys.len(),
            max: max_keys,
        });
    }
    bounded("request_id", &req.request_id, MAX_REQUEST_ID_BYTES)?;
    bounded(
        "previous_response_id",
        &req.previous_response_id,
        MAX_RESPONSE_ID_BYTES,
    )?;
    for (field, got) in [
        ("completed_request_ids", req.completed_request_ids.len()),
        ("continued requests", req.continued.len()),
    ] {
        if got > MAX_COMPLETED_IDS {
            return Err(RequestError::TooManyEntries {
                field,
                got,
                max: MAX_COMPLETED_IDS,
            });
        }
    }
    for id in &req.completed_request_ids {
        bounded("completed_request_ids", id, MAX_REQUEST_ID_BYTES)?;
    }
    Ok(())
}

/// The requests the filter routed without a Pick since its last one
/// (`local_continuations`), each noted on its replica as queued work: the
/// prefill of what it adds to its conversation, from when it was routed.
/// Noted before this Pick's completed ids are read, which may hold theirs.
/// An entry naming no known replica, or an id too long, is skipped, one
/// older than `pending_pick_ttl` expired; each counted
/// (`indexd_continued_total{result}`).
fn note_continued(shared: &Shared, req: &PickRequest, now: Instant) {
    let metrics = &shared.metrics;
    for c in &req.continued {
        let id = c.address.parse().ok().map(|address| EndpointId {
            address,
            rank: c.data_parallel_rank,
        });
        let replica = id
            .filter(|_| !c.request_id.is_empty() && c.request_id.len() <= MAX_REQUEST_ID_BYTES)
            .and_then(|id| read(&shared.registry).observed(&id));
        let Some(replica) = replica else {
            metrics.continued.inc(["skipped"]);
            continue;
        };
        let age = Duration::from_millis(u64::from(c.age_ms));
        if age >= shared.config.pending_pick_ttl {
            metrics.continued.inc(["expired"]);
            continue;
        }
        let load = replica.load(now, shared.config.pending_pick_ttl, 0);
        let prefill = score::prefill_time(&load, f64::from(c.new_tokens), &shared.config.weights);
        let at = now.checked_sub(age).unwrap_or(now);
        let blocks = c.new_tokens.div_ceil(shared.config.block_size.get());
        replica.note_continued(at, now, &c.request_id, prefill, blocks);
        metrics.continued.inc(["noted"]);
    }
}

/// The model's context length, if the request's prompt is longer than it
/// ([`crate::tokenize::Tokenizers::max_model_len`]): vLLM refuses it with a
/// 400 before it schedules anything. Without this, one body of a million
/// tokens (a client's mistake, or a hostile one) would be noted as a minute
/// of prefill and a cache's worth of blocks on the replica chosen for it,
/// and every conversation there would look evicted until it completed.
fn over_length(shared: &Shared, req: &PickRequest) -> Option<u32> {
    shared
        .tokenizers
        .max_model_len(&req.model)
        .filter(|limit| req.prompt_tokens > *limit)
}

/// The request's block keys.
fn block_keys(req: &PickRequest) -> Vec<BlockKey> {
    req.block_keys
        .iter()
        .map(|k| BlockKey::from_u64(*k))
        .collect()
}

/// Phase 1: `previous_response_id` names a response only one replica can
/// continue. The answer, when that replica may take it.
fn affinity_shortcut(shared: &Shared, req: &PickRequest, now: Instant) -> Option<PickResponse> {
    if req.previous_response_id.is_empty() {
        return None;
    }
    match affinity_target(shared, req, now) {
        Ok(r) => {
            shared.metrics.affinity_lookups.inc(["hit"]);
            // Its prefill: at most the whole prompt (the replica usually holds
            // most of it; the estimate errs on the busy side).
            // (Its conversation count does not enter a prefill estimate.)
            let mut conversations = lock(&shared.conversations);
            let load = r.load(now, shared.config.pending_pick_ttl, 0);
            let weights = &shared.config.weights;
            let prefill = score::prefill_time(&load, f64::from(req.prompt_tokens), weights);
            // What it adds to the stored response is unknown and usually a
            // turn's worth: no blocks are counted against the cache there.
            // A prompt vLLM refuses for its length queues nothing.
            if over_length(shared, req).is_none() {
                r.note_pick(now, &req.request_id, prefill, 0);
            }
            // The conversation goes on there: the move rule counts it.
            let keys = block_keys(req);
            let found = conversations.continues_at(&keys, now);
            let tip = tip_keys(req, &keys);
            track(shared, &mut conversations, req, tip, found, r.slot, now);
            drop(conversations);
            tracing::debug!(
                request_id = %req.request_id,
                endpoint = %r.id(),
                "pick: affinity to the replica holding previous_response_id"
            );
            let c = candidate(&r, &PrefixMatch::default(), req.block_size, 0.0);
            Some(answer(
                shared,
                DecisionKind::Affinity,
                "previous_response_id",
                vec![c],
            ))
        }
        Err(miss) => {
            shared.metrics.affinity_lookups.inc([miss]);
            None
        }
    }
}

/// What one Pick sees: the eligible replicas, what each holds of the
/// request's keys, and (from [`place`] on) their load.
struct Snapshot {
    eligible: Vec<Arc<Replica>>,
    keys: Vec<BlockKey>,
    matches: Vec<PrefixMatch>,
    /// Matches and loads, in `eligible`'s order (filled by [`place`]).
    inputs: Vec<Input>,
    approximate: bool,
    /// Why the request's keys cannot be matched, if they cannot.
    mismatch: Option<Mismatch>,
    /// The model's context length, when the prompt is longer: vLLM answers
    /// such a request 400 and allocates nothing, so it holds, queues and
    /// continues nothing anywhere ([`over_length`]).
    over_length: Option<u32>,
    index_block_size: u32,
    /// [`crate::index::Lookup::speculated`] when `matches` were taken.
    speculated: u64,
}

/// Keys indexd cannot match against its index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mismatch {
    /// Computed with another block size than the index's.
    BlockSize,
    /// Computed with another block-key scheme (`PickRequest.key_scheme`).
    KeyScheme,
}

impl Mismatch {
    const fn reason(self) -> &'static str {
        match self {
            Self::BlockSize => "block_size_mismatch",
            Self::KeyScheme => "key_scheme_mismatch",
        }
    }
}

/// The longest hit vLLM gives a prompt, in blocks: all its tokens but the
/// last (`max_cache_hit_length = num_tokens - 1`), in full blocks; the keys
/// when the prompt's length is not known.
fn max_blocks(req: &PickRequest, keys: usize) -> usize {
    match req.prompt_tokens.checked_sub(1) {
        Some(cap) if req.block_size > 0 => keys.min((cap / req.block_size) as usize),
        _ => keys,
    }
}

/// Phase 2: what the eligible replicas hold of the request's keys.
fn snapshot(
    shared: &Shared,
    req: &PickRequest,
    eligible: Vec<Arc<Replica>>,
    now: Instant,
) -> Snapshot {
    let cfg = &shared.config;
    let approximate = req.mode == Mode::Approximate as i32;
    let over_length = over_length(shared, req);
    let keys = if over_length.is_some() {
        Vec::new()
    } else {
        block_keys(req)
    };
    let index_block_size = eligible
        .iter()
        .map(|r| r.block_size_seen())
        .find(|b| *b != 0)
        .unwrap_or(0);
    let mut mismatch = None;
    if !approximate
        && (req.block_size != cfg.block_size.get()
            || (index_block_size != 0 && index_block_size != req.block_size))
    {
        mismatch = Some(Mismatch::BlockSize);
        shared.metrics.block_size_mismatch.inc(["pick"]);
        if shared.pick_warning.open() {
            tracing::warn!(
                request_block_size = req.block_size,
                index_block_size,
                configured = cfg.block_size.get(),
                "Pick block size differs from the index's: ranking by load only (further \
                 warnings for 10 s suppressed; see indexd_block_size_mismatch_total)"
            );
        }
    } else if !approximate && !keys.is_empty() && req.key_scheme != SCHEME_VERSION {
        mismatch = Some(Mismatch::KeyScheme);
        shared.metrics.key_scheme_mismatch.inc();
        if shared.pick_warning.open() {
            let request_scheme = match req.key_scheme.as_str() {
                "" => "kvroute/v1",
                s => s,
            };
            tracing::warn!(
                request_scheme,
                index_scheme = SCHEME_VERSION,
                "Pick block keys use another key scheme than indexd's (upgrade the filter and \
                 indexd together): ranking by load only (further warnings for 10 s suppressed; \
                 see indexd_key_scheme_mismatch_total)"
            );
        }
    }
    let mut snap = Snapshot {
        eligible,
        keys,
        matches: Vec::new(),
        inputs: Vec::new(),
        approximate,
        mismatch,
        over_length,
        index_block_size,
        speculated: 0,
    };
    match_keys(shared, req, &mut snap, now);
    snap
}

/// What the eligible replicas hold of the keys, into `snap.matches` (none
/// when they cannot be matched), with the speculative credits given before.
fn match_keys(shared: &Shared, req: &PickRequest, snap: &mut Snapshot, now: Instant) {
    let lookup = &shared.lookup;
    snap.speculated = lookup.speculated();
    let slots: Vec<_> = snap.eligible.iter().map(|r| r.slot).collect();
    snap.matches = if snap.mismatch.is_some() || snap.keys.is_empty() {
        vec![PrefixMatch::default(); slots.len()]
    } else if snap.approximate {
        lock(&shared.approximate).match_prefix(&req.model, &snap.keys, &slots, now)
    } else {
        let query = Query {
            partition: lookup.partition(&req.model),
            keys: &snap.keys,
            block_size: req.block_size,
            max_blocks: max_blocks(req, snap.keys.len()),
            chunk_tokens: snap
                .eligible
                .first()
                .and_then(|r| shared.config.chunk_tokens(&r.config.model)),
            now,
        };
        lookup.match_query(&query, &slots)
    };
}

/// Phase 3's first step, under the placement lock: a Pick whose match was
/// taken before another Pick's speculative credit takes it again. Picks of
/// conversations starting together run their matches at once; without
/// this, two of them could both find nothing held, and the second would
/// price a cold prefill of a shared prompt the first had just been sent.
/// Counted.
fn rematch_if_credited(shared: &Shared, req: &PickRequest, snap: &mut Snapshot, now: Instant) {
    if snap.approximate || snap.keys.is_empty() || snap.mismatch.is_some() {
        return;
    }
    if shared.lookup.speculated() == snap.speculated {
        return;
    }
    match_keys(shared, req, snap, now);
    shared.metrics.rematches.inc();
}

/// At debug level, every candidate's matched blocks, load and cost.
fn explain(req: &PickRequest, snap: &Snapshot, ranking: &Ranking) {
    if !tracing::enabled!(tracing::Level::DEBUG) {
        return;
    }
    for (place, r) in ranking.ranked.iter().enumerate() {
        let (Some(rep), Some(input)) = (snap.eligible.get(r.input), snap.inputs.get(r.input))
        else {
            continue;
        };
        tracing::debug!(
            request_id = %req.request_id,
            place,
            endpoint = %rep.id(),
            matched_blocks = snap.matches.get(r.input).map_or(0, |m| m.blocks),
            surviving_blocks = input.matched.blocks,
            of_blocks = snap.keys.len(),
            cache_blocks = input.load.cache_blocks,
            demand_blocks = input.load.demand_blocks,
            kv_usage = input.load.kv_usage,
            running = input.load.running,
            waiting = input.load.waiting,
            waiting_before = input.load.waiting_before,
            queued_seconds = input.load.queued_seconds,
            conversations = input.load.conversations,
            prefill_tokens_per_second = input.load.prefill_tokens_per_second,
            prefill_overhead_seconds = input.load.prefill_overhead_seconds,
            cost_seconds = r.cost,
            moved = ?ranking.moved,
            "pick: candidate"
        );
    }
}

/// The chosen replica: its place in the snapshot, and how many of the keys
/// it will still hold when the request is admitted ([`score::surviving`]).
fn chosen<'a>(snap: &'a Snapshot, ranking: &Ranking) -> Option<(usize, &'a Arc<Replica>, usize)> {
    let first = ranking.ranked.first()?.input;
    let chosen = snap.eligible.get(first)?;
    let held = snap
        .inputs
        .get(first)
        .map_or(0, |i| i.matched.blocks as usize);
    Some((first, chosen, held))
}

/// The chosen replica is noted with the pick's queued prefill work, and
/// the conversation with where it went ([`place`] holds `conversations`).
fn note(
    shared: &Shared,
    req: &PickRequest,
    snap: &Snapshot,
    ranking: &Ranking,
    conversations: &mut Conversations,
    found: Option<Continues>,
    now: Instant,
) {
    let Some((first, chosen, held)) = chosen(snap, ranking) else {
        return;
    };
    // The pick's queued prefill work: the full blocks it will add at the
    // chosen replica's speed, and its fixed time. A continuation credited
    // with these blocks (speculatively) then costs on this replica what a
    // cold replica costs: the overlap is not counted twice, and the tie goes
    // to the replica holding more.
    let added = snap.keys.len().saturating_sub(held);
    let queued = (added as f64) * f64::from(req.block_size);
    let load = snap.inputs.get(first).map(|i| i.load).unwrap_or_default();
    let prefill = score::prefill_time(&load, queued, &shared.config.weights);
    let blocks = u32::try_from(added).unwrap_or(u32::MAX);
    chosen.note_pick(now, &req.request_id, prefill, blocks);
    let tip = tip_keys(req, &snap.keys);
    let placed = track(shared, conversations, req, tip, found, chosen.slot, now);
    if placed == Some(Placed::New) && req.continuation != Some(true) {
        chosen.note_new_conversation(now);
    }
}

/// `keys` short of the block holding the prompt's last token
/// ([`max_blocks`]); the last is the conversation's tip ([`track`]). That
/// block is never part of a hit vLLM gives, and where a generation prompt
/// ends in a token the answer then merges into (a trailing space,
/// `[ASSISTANT] `), the next turn's prompt does not hold it: known by it,
/// a conversation would look new once in every `block_size` turns.
fn tip_keys<'k>(req: &PickRequest, keys: &'k [BlockKey]) -> &'k [BlockKey] {
    keys.get(..max_blocks(req, keys.len())).unwrap_or(keys)
}

/// Where conversations are (the move rule's lasting imbalance): `req`,
/// its keys up to its tip `keys` ([`tip_keys`]), went to `slot`.
fn track(
    shared: &Shared,
    conversations: &mut Conversations,
    req: &PickRequest,
    keys: &[BlockKey],
    found: Option<Continues>,
    slot: ReplicaSlot,
    now: Instant,
) -> Option<Placed> {
    if keys.is_empty() {
        return None;
    }
    let placed = conversations.place_found(keys, found, slot, now);
    let turn = match placed {
        // A turn of a conversation this indexd did not follow (another
        // gateway's, or idle past `conversations::IDLE`): followed now.
        Placed::New if req.continuation == Some(true) => "resumed",
        Placed::New => "new",
        Placed::Continued(from) if from == slot => "stayed",
        Placed::Continued(_) => "moved",
    };
    shared.metrics.conversation_turns.inc([turn]);
    Some(placed)
}

/// Phase 4: the chosen replica is credited, speculatively, with the keys it
/// will hold (unless it holds all of them already). Under the placement
/// lock ([`place`]), so that the next Pick placed sees it.
fn credit(shared: &Shared, req: &PickRequest, snap: &Snapshot, ranking: &Ranking, now: Instant) {
    let cfg = &shared.config;
    let Some((_, chosen, held)) = chosen(snap, ranking) else {
        return;
    };
    if snap.mismatch.is_some() || held >= snap.keys.len() {
        return;
    }
    if snap.approximate {
        lock(&shared.approximate).learn(
            &req.model,
            &snap.keys,
            chosen.slot,
            now,
            cfg.approximate_ttl,
        );
    } else if !cfg.speculative_ttl.is_zero() {
        let lookup = &shared.lookup;
        if let Some(p) = lookup.partition_or_insert(&req.model) {
            lookup.speculate(p, &snap.keys, chosen.slot, now, now + cfg.speculative_ttl);
        }
    }
}

/// Phase 5: the answer, its decision kind and reason, and the metrics.
fn classify(
    shared: &Shared,
    req: &PickRequest,
    snap: &Snapshot,
    ranking: &Ranking,
) -> PickResponse {
    let limit = match (req.max_candidates, shared.config.max_candidates) {
        (0, 0) => usize::MAX,
        (0, n) | (n, _) => n as usize,
    };
    let mut candidates = Vec::with_capacity(ranking.ranked.len().min(limit));
    let mut any_match = false;
    for r in ranking.ranked.iter().take(limit) {
        if let (Some(rep), Some(m)) = (snap.eligible.get(r.input), snap.matches.get(r.input)) {
            any_match |= m.blocks > 0;
            candidates.push(candidate(rep, m, req.block_size, r.cost));
        }
    }
    // A match over a KV cache layout indexd does not model is an upper
    // bound, not vLLM's hit: no precise claim.
    let unmodelled = snap.matches.iter().any(|m| m.blocks > 0 && m.unmodelled);
    match ranking.moved {
        Move::None => {}
        Move::Held => shared.metrics.moves.inc(["held"]),
        Move::Moved => shared.metrics.moves.inc(["moved"]),
        Move::Barred => shared.metrics.moves.inc(["barred"]),
    }
    let (decision, reason) = match (snap.mismatch, any_match, snap.approximate) {
        _ if snap.over_length.is_some() => (DecisionKind::Load, "over_max_model_len"),
        (Some(why), ..) => (DecisionKind::Load, why.reason()),
        (None, true, false) if unmodelled => (DecisionKind::Approximate, "unmodelled_kv_layout"),
        (None, true, false) => (DecisionKind::Precise, "prefix_match"),
        (None, true, true) => (DecisionKind::Approximate, "prefix_match"),
        (None, false, _) => (DecisionKind::Load, "no_match"),
    };
    if decision == DecisionKind::Precise
        && let Some(m) = ranking
            .ranked
            .first()
            .and_then(|r| snap.matches.get(r.input))
    {
        let metric = &shared.metrics.chosen_blocks;
        metric.add(
            ["indexed"],
            u64::from(m.blocks - m.speculative.min(m.blocks)),
        );
        metric.add(["speculative"], u64::from(m.speculative.min(m.blocks)));
    }
    let mut resp = answer(shared, decision, reason, candidates);
    if req.want_busy {
        resp.busy = score::busy(&snap.inputs, &shared.config.weights)
            .into_iter()
            .filter_map(|i| snap.eligible.get(i))
            .map(|r| BusyReplica {
                address: r.address().to_owned(),
                data_parallel_rank: r.id().rank,
            })
            .collect();
        resp.busy_known = true;
    }
    if !resp.busy.is_empty() && tracing::enabled!(tracing::Level::DEBUG) {
        let busy: Vec<&str> = resp.busy.iter().map(|b| b.address.as_str()).collect();
        tracing::debug!(request_id = %req.request_id, ?busy, "pick: busy replicas");
    }
    resp.index_block_size = snap.index_block_size;
    resp.block_size_mismatch = snap.mismatch == Some(Mismatch::BlockSize);
    resp.key_scheme_mismatch = snap.mismatch == Some(Mismatch::KeyScheme);
    resp
}

/// Answers one Pick at `now`: the affinity shortcut, else a snapshot of the
/// eligible replicas, placed (loads, ranked, the first noted), the first
/// credited, and the answer classified.
pub fn pick(
    shared: &Shared,
    req: &PickRequest,
    now: Instant,
) -> Result<PickResponse, RequestError> {
    validate(shared, req)?;
    note_continued(shared, req, now);
    for id in &req.completed_request_ids {
        complete_pick(shared, id, now);
    }
    if let Some(resp) = affinity_shortcut(shared, req, now) {
        return Ok(resp);
    }
    let (eligible, serving) = read(&shared.registry).eligible(&req.model);
    if eligible.is_empty() {
        let reason = if serving {
            "no_fresh_replica"
        } else {
            "unknown_model"
        };
        return Ok(answer(shared, DecisionKind::Stale, reason, Vec::new()));
    }
    let mut snap = snapshot(shared, req, eligible, now);
    // Placed and credited under one lock (place).
    let ranking = place(shared, req, &mut snap, now);
    explain(req, &snap, &ranking);
    Ok(classify(shared, req, &snap, &ranking))
}

#[cfg(test)]
#[path = "pick_tests.rs"]
mod tests;
