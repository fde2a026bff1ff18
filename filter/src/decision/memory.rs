//! Routing from the gateway's memory ([`memo`]): a continuation sent where
//! its previous turn went without a Pick, and a request indexd could not
//! route sent where its conversation went before.

use super::{Action, Flow, Routed, Via, now_ms, valid_address};
use crate::busy;
use crate::completed;
use crate::host::Host;
use crate::memo;
use crate::metrics::{Counter, Reason};
use crate::request;

/// Bytes of request JSON per token, for a continuation's estimate of what
/// it adds (indexd weighs it as prefill work).
const BYTES_PER_TOKEN: usize = 4;

impl Flow {
    /// A continuation whose previous turn this gateway saw answered goes
    /// where that turn went, without a Pick, unless the memory has already
    /// sent `local_continuations` turns in a row there (then indexd checks
    /// the replica's load and the conversation's blocks again). `Err` hands
    /// the request back for a Pick.
    pub(super) fn continue_locally(
        &mut self,
        host: &mut dyn Host,
        req: &request::ParsedRequest<'_>,
        items: &[&serde_json::value::RawValue],
        routed: Routed,
    ) -> Result<Action, Routed> {
        let limit = self.cfg.local_continuations;
        if limit == 0 || req.previous_response_id.is_some() {
            return Err(routed);
        }
        let Some(turn) = memo::previous_turn(items) else {
            return Err(routed);
        };
        let recalled = routed
            .prints
            .get(turn.items.wrapping_sub(1))
            .and_then(|print| memo::recall_turn(host, *print))
            .filter(|r| r.local_turns < limit && valid_address(&r.host));
        let Some(recalled) = recalled else {
            return Err(routed);
        };
        // Its replica's load: a Pick when indexd's latest answer called it
        // busy, or when no answer is recent enough to say
        // (`continuation_load_ms`).
        let fresh_ms = u64::try_from(self.cfg.continuation_load.as_millis()).unwrap_or(u64::MAX);
        match busy::load_of(host, &recalled.host, recalled.rank, now_ms(host), fresh_ms) {
            busy::Load::Free => {}
            busy::Load::Busy => {
                host.count(Counter::ContinuationBusy);
                return Err(routed);
            }
            busy::Load::Unknown => {
                host.count(Counter::ContinuationUnknownLoad);
                return Err(routed);
            }
        }
        log::debug!(
            "{} ({}) -> {} (continued, turn {} in a row)",
            self.id,
            self.client_id,
            recalled.host,
            recalled.local_turns.saturating_add(1)
        );
        self.pin(host, &recalled.host, recalled.rank);
        // The next Pick tells indexd, so that it counts this request as
        // queued work there (≈ 4 bytes of JSON per token: an estimate).
        let new_tokens = u32::try_from(turn.new_bytes / BYTES_PER_TOKEN).unwrap_or(u32::MAX);
        let now = now_ms(host);
        completed::push_continued(
            host,
            &self.id,
            &recalled.host,
            recalled.rank,
            new_tokens,
            now,
        );
        Ok(self.finish_turn(
            host,
            Reason::Continued,
            Some(routed),
            recalled.rank,
            Via::Callback,
            recalled.local_turns.saturating_add(1),
        ))
    }

    /// indexd could not route this request (`reason`): send it where its
    /// conversation went before, if the memory knows ([`memo`]), else let
    /// Envoy choose.
    pub(super) fn unrouted(
        &mut self,
        host: &mut dyn Host,
        routed: Routed,
        reason: Reason,
        via: Via,
    ) -> Action {
        if let Some((target, rank)) = memo::recall(host, &routed.prints)
            && valid_address(&target)
        {
            log::debug!("{}: {} -> {target} (remembered)", self.id, reason.label());
            self.pin(host, &target, rank);
            return self.finish(host, Reason::Remembered, Some(routed), rank, via);
        }
        self.conclude_routed(host, routed, reason, via)
    }
}
