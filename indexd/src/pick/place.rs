//! Phase 3 of a Pick, placement: each candidate's load and surviving match,
//! the cost model's order under the move rules (no move within
//! `move_cooldown`, none to a replica still filling after it joined), new
//! conversations spread by number where their costs nearly tie, the
//! exploration of a replica its speed estimate alone kept from new
//! conversations, the chosen replica's note and its speculative credit, all
//! under the conversations' lock (and the prefix match again there, when
//! another Pick credited blocks since it was taken).

use std::time::Instant;

use kvroute_proto::v1::PickRequest;

use super::{Snapshot, credit, note, rematch_if_credited};
use crate::score::{self, Input, Move, Ranking};
use crate::state::Shared;
use crate::sync::lock;

/// Phase 3 and 4: the loads, the order, the chosen replica's note and its
/// speculative credit, at once.
///
/// Under the conversations' lock, so that Picks place one after the other:
/// two Picks reading the loads at the same moment (requests starting
/// together, on Envoy's several workers) would both see the same idle
/// replica and both go there, neither seeing the prefill the other queued.
/// The prefix match stays outside (the lock's hold is a few µs); a Pick
/// whose match another Pick's credit has overtaken takes it again here,
/// and the credit is given before the lock is let go, so the next Pick
/// placed sees it.
pub(super) fn place(
    shared: &Shared,
    req: &PickRequest,
    snap: &mut Snapshot,
    now: Instant,
) -> Ranking {
    let cfg = &shared.config;
    let mut conversations = lock(&shared.conversations);
    rematch_if_credited(shared, req, snap, now);
    let counts = conversations.counts(now);
    snap.inputs = snap
        .eligible
        .iter()
        .zip(&snap.matches)
        .map(|(r, m)| {
            let on = counts.get(&r.slot).copied().unwrap_or(0);
            let load = r.load(now, cfg.pending_pick_ttl, on);
            let matched = score::surviving(*m, &load, req.block_size, &cfg.weights);
            if matched.blocks < m.blocks {
                shared.metrics.eviction_discounts.inc();
            }
            Input { matched, load }
        })
        .collect();
    // A first turn by its body continues nothing, even where its prompt
    // holds another conversation's tip (a short task behind a shared
    // system prompt: no full block of its own).
    let continues = match req.continuation {
        Some(false) => None,
        _ => conversations.continues_at(&snap.keys, now),
    };
    // A conversation that changed replica a moment ago stays (no thrash), and
    // none moves to a replica still filling with new conversations.
    let settled = continues
        .and_then(|c| c.moved_at)
        .is_some_and(|at| now.saturating_duration_since(at) < cfg.move_cooldown);
    let mut ranking = rank(shared, req, snap, |i| {
        !settled && snap.eligible.get(i).is_some_and(|r| !r.filling(now))
    });
    if ranking.moved == Move::Barred {
        let reason = if settled { "cooldown" } else { "joining" };
        shared.metrics.moves_barred.inc([reason]);
        tracing::debug!(
            request_id = %req.request_id,
            reason,
            "pick: a move that would pay was not made (move_cooldown, join_warmup)"
        );
    }
    // A new conversation is spread; a continuation indexd does not follow
    // (its body tells) goes where its prefix is, as one it follows does.
    if continues.is_none() && req.continuation != Some(true) {
        balance(shared, req, snap, &mut ranking);
        explore(shared, req, snap, &mut ranking, now);
    }
    if let Some(limit) = snap.over_length {
        // vLLM answers it 400 at once: nothing is queued or held there.
        tracing::debug!(
            request_id = %req.request_id,
            model = %req.model,
            prompt_tokens = req.prompt_tokens,
            max_model_len = limit,
            "pick: a prompt longer than the model's context, which vLLM refuses; routed by load, \
             noted nowhere (indexd_decisions_total reason over_max_model_len)"
        );
        return ranking;
    }
    note(
        shared,
        req,
        snap,
        &ranking,
        &mut conversations,
        continues,
        now,
    );
    credit(shared, req, snap, &ranking, now);
    drop(conversations);
    ranking
}

/// The prompt's length in tokens, at least its keyed blocks'.
fn prompt_tokens(req: &PickRequest, snap: &Snapshot) -> u32 {
    let keyed_tokens = u32::try_from(snap.keys.len())
        .unwrap_or(u32::MAX)
        .saturating_mul(req.block_size);
    req.prompt_tokens.max(keyed_tokens)
}

/// Conversations spread by number, where their first turn's cost allows: a
/// new conversation goes to the replica with the fewest of this indexd's
/// conversations among those costing at most `balance_margin` more than the
/// cheapest (and 5 ms, for costs near zero). The cost prices its first turn
/// only, while every later turn loads the replica it joins: conversations
/// starting together behind one shared prompt cost nearly alike everywhere
/// (one replica's prefill of the prompt against the other's queue behind
/// it), and by cost alone eight of them split five to three as often as
/// four to four. Only among replicas whose events show as much of the
/// prompt as the cheapest's (a conversation this indexd has not seen keeps
/// its history), and while none shows more (the move rule's case). Counted.
fn balance(shared: &Shared, req: &PickRequest, snap: &Snapshot, ranking: &mut Ranking) {
    let margin = shared.config.weights.balance_margin;
    if margin <= 0.0 || ranking.moved != Move::None || snap.mismatch.is_some() {
        return;
    }
    let Some(best) = ranking.ranked.first().copied() else {
        return;
    };
    let within = best.cost + (best.cost * margin).max(BALANCE_FLOOR_SECONDS);
    let on = |input: usize| {
        snap.inputs
            .get(input)
            .map_or(f64::MAX, |i| i.load.conversations)
    };
    // Blocks the replica's events show: a candidate holding fewer than the
    // cheapest is left out, so that a conversation this indexd has not seen
    // (its earlier turns sent through another gateway) is never balanced
    // away from its history; blocks only credited speculatively (a burst's
    // shared prompt, sent a moment ago) are no reason to stay.
    let confirmed = |input: usize| {
        snap.inputs.get(input).map_or(0, |i| {
            i.matched
                .blocks
                .saturating_sub(i.matched.speculative.min(i.matched.blocks))
        })
    };
    let floor = confirmed(best.input);
    let fewest = ranking
        .ranked
        .iter()
        .enumerate()
        .take_while(|(_, r)| r.cost <= within)
        .filter(|(_, r)| confirmed(r.input) >= floor)
        .min_by(|(_, a), (_, b)| on(a.input).total_cmp(&on(b.input)))
        .map(|(at, _)| at);
    let fewer = |at: &usize| {
        *at > 0
            && ranking
                .ranked
                .get(*at)
                .is_some_and(|r| on(r.input) < on(best.input))
    };
    let Some(at) = fewest.filter(fewer) else {
        return;
    };
    let chosen = ranking.ranked.remove(at);
    ranking.ranked.insert(0, chosen);
    shared.metrics.balanced.inc();
    tracing::debug!(
        request_id = %req.request_id,
        cost = chosen.cost,
        cheapest = best.cost,
        "pick: a new conversation sent to a replica with fewer conversations at a near-equal cost \
         (balance_margin; indexd_balanced_total)"
    );
}

/// [`balance`]'s margin at least, in seconds.
const BALANCE_FLOOR_SECONDS: f64 = 0.005;

/// No replica starved by an estimate: a new conversation goes instead to a
/// replica that has had none for `starve_after` while the first choice had
/// one within it, where vLLM reports no request waiting and where, at the
/// first choice's prefill speed, it would cost no more. Its speed estimate
/// alone kept it out, and only work sent there can correct that estimate.
/// A replica that joined the fleet (still filling, `join_warmup`) is taken
/// so even when what kept it out is the shared prompt the others hold: a
/// new conversation holds nothing of its own anywhere, the joiner pays that
/// prompt's prefill once, and then holds it too; without this, a lightly
/// loaded fleet whose conversations share a long prompt would never send
/// the joiner one. A joiner that has had no new conversation yet is taken
/// at once, without waiting `starve_after`: it is the fleet's newest
/// capacity, and waiting only leaves it idle while the others queue (the
/// first conversation there also starts its prefill-speed fit). Among
/// several, the longest without one. Counted and logged.
fn explore(
    shared: &Shared,
    req: &PickRequest,
    snap: &Snapshot,
    ranking: &mut Ranking,
    now: Instant,
) {
    let after = shared.config.starve_after;
    if after.is_zero() || snap.keys.is_empty() || snap.mismatch.is_some() {
        return;
    }
    let Some(first) = ranking.ranked.first().map(|r| r.input) else {
        return;
    };
    let (Some(chosen), Some(chosen_input)) = (snap.eligible.get(first), snap.inputs.get(first))
    else {
        return;
    };
    // The first choice has had a new conversation within `starve_after`:
    // others that had none since are starved; else only fresh joiners are.
    let first_busy = chosen.without_new_conversation(now) < after;
    let prompt = prompt_tokens(req, snap);
    let w = &shared.config.weights;
    // The costs only where the cheap conditions hold (rarely).
    let starved = ranking
        .ranked
        .iter()
        .enumerate()
        .skip(1)
        .filter_map(|(at, r)| {
            let replica = snap.eligible.get(r.input)?;
            let input = snap.inputs.get(r.input)?;
            let without = replica.without_new_conversation(now);
            let joined = replica.filling(now);
            let fresh_joiner = joined && !replica.had_new_conversation();
            ((fresh_joiner || (first_busy && without >= after)) && input.load.waiting <= 0.0)
                .then_some((at, input, without, joined))
        })
        .filter(|(_, input, _, joined)| {
            *joined || score::behind_on_speed_alone(input, chosen_input, prompt, req.block_size, w)
        })
        .map(|(at, _, without, _)| (at, without))
        .max_by_key(|(_, without)| *without);
    let Some((at, without)) = starved else {
        return;
    };
    let explored = ranking.ranked.remove(at);
    ranking.ranked.insert(0, explored);
    shared.metrics.explorations.inc();
    if let Some(replica) = snap.eligible.get(explored.input) {
        tracing::info!(
            endpoint = %replica.id(),
            instead_of = %chosen.id(),
            model = %req.model,
            without_new_conversation = ?without,
            joined = replica.filling(now),
            "new conversation sent to a replica that joined the fleet and had none yet, or that \
             its prefill speed estimate, or the shared prompt the fleet it joined holds, kept \
             from new conversations (starve_after; indexd_explorations_total)"
        );
    }
}

/// The cost model's order ([`score::rank_with`]), moves allowed only to
/// the inputs `may_move` admits.
fn rank(
    shared: &Shared,
    req: &PickRequest,
    snap: &Snapshot,
    may_move: impl Fn(usize) -> bool,
) -> Ranking {
    let mut rng = lock(&shared.rng);
    score::rank_with(
        &snap.inputs,
        prompt_tokens(req, snap),
        req.block_size,
        &shared.config.weights,
        &mut *rng,
        may_move,
    )
}
