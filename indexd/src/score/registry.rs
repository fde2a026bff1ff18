//! The registry of replicas: every endpoint indexd knows, by identity, in
//! the slot it was given; the model's pooled prefill fit across them.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::replica::{JOINS_AFTER, Replica};
use crate::calibrate::{PrefillSpeed, Sums};
use crate::config::EndpointConfig;
use crate::ids::{EndpointId, ReplicaSlot};

/// The replicas indexd knows, by identity.
#[derive(Debug, Default)]
pub(crate) struct Registry {
    pub(super) replicas: BTreeMap<EndpointId, Arc<Replica>>,
    next_slot: u32,
}

impl Registry {
    /// Registers an endpoint in the next slot, its tasks cancelled with
    /// `parent`; `None` if it is already known. One that joins its model's
    /// running fleet (another replica of the model registered at least
    /// [`JOINS_AFTER`] before: not the fleet found at start) fills with new
    /// conversations only for
    /// `join_warmup`: conversations stay on their warm replicas rather than
    /// move to fill it.
    pub(crate) fn add(
        &mut self,
        config: EndpointConfig,
        parent: &CancellationToken,
        join_warmup: Duration,
    ) -> Option<Arc<Replica>> {
        let now = Instant::now();
        let joins = self.replicas.values().any(|r| {
            r.config.model == config.model
                && now.saturating_duration_since(r.registered) >= JOINS_AFTER
        });
        self.insert(config, parent, join_warmup, joins)
    }

    /// Registers an endpoint as one that joins its model's running fleet,
    /// however recently the others came (tests).
    #[cfg(test)]
    pub(crate) fn add_joiner(
        &mut self,
        config: EndpointConfig,
        parent: &CancellationToken,
        join_warmup: Duration,
    ) -> Option<Arc<Replica>> {
        self.insert(config, parent, join_warmup, true)
    }

    fn insert(
        &mut self,
        config: EndpointConfig,
        parent: &CancellationToken,
        join_warmup: Duration,
        joins: bool,
    ) -> Option<Arc<Replica>> {
        if self.replicas.contains_key(&config.id) {
            return None;
        }
        let slot = ReplicaSlot(self.next_slot);
        self.next_slot = self.next_slot.saturating_add(1);
        let mut replica = Replica::new(config, slot, parent.child_token());
        let now = replica.registered;
        if joins && !join_warmup.is_zero() {
            replica.filling_until = now.checked_add(join_warmup);
        }
        let replica = Arc::new(replica);
        self.replicas
            .insert(replica.id().clone(), Arc::clone(&replica));
        Some(replica)
    }

    /// Unregisters an endpoint.
    pub(crate) fn remove(&mut self, id: &EndpointId) -> Option<Arc<Replica>> {
        self.replicas.remove(id)
    }

    /// The pooled prefill fit of `model`: its replicas' evidence summed
    /// (None: not enough yet), and the samples in it.
    pub(crate) fn pooled_prefill(&self, model: &str, prior: f64) -> (Option<PrefillSpeed>, u32) {
        let pool = self
            .replicas
            .values()
            .filter(|r| r.config.model == model)
            .fold(Sums::default(), |pool, r| pool + r.prefill_sums());
        (pool.speed(prior), pool.samples)
    }

    /// Publishes the prefill speed of every replica of `model` from its
    /// own fit and the model's pooled one (after any of them was scraped).
    pub(crate) fn settle_prefill(&self, model: &str, prior: f64) {
        let (pooled, _) = self.pooled_prefill(model, prior);
        for r in self.replicas.values().filter(|r| r.config.model == model) {
            r.settle(pooled, prior);
        }
    }

    /// All replicas.
    pub(crate) fn all(&self) -> Vec<Arc<Replica>> {
        self.replicas.values().cloned().collect()
    }

    /// The replicas serving `model` that are eligible (healthy and fresh),
    /// in [`Registry::all`]'s order, and whether any replica serves it at
    /// all.
    pub(crate) fn eligible(&self, model: &str) -> (Vec<Arc<Replica>>, bool) {
        let mut serving = false;
        let eligible = self
            .replicas
            .values()
            .filter(|r| {
                let serves = r.serves(model);
                serving |= serves;
                serves && r.is_eligible()
            })
            .cloned()
            .collect();
        (eligible, serving)
    }

    /// One replica.
    pub(crate) fn get(&self, id: &EndpointId) -> Option<Arc<Replica>> {
        self.replicas.get(id).cloned()
    }

    /// The replica an Observe may name: `id` itself; with no rank, any
    /// replica at the address; with a rank, a replica registered at the
    /// address without ranks. Never a replica at another address, nor
    /// another rank of a server registered by rank.
    pub(crate) fn observed(&self, id: &EndpointId) -> Option<Arc<Replica>> {
        if id.rank.is_none() {
            return self.find(id);
        }
        self.get(id).or_else(|| {
            self.get(&EndpointId {
                address: id.address,
                rank: None,
            })
        })
    }

    /// The replica `id` names, or, when the rank is unknown or differs, the
    /// first replica at that address.
    pub(crate) fn find(&self, id: &EndpointId) -> Option<Arc<Replica>> {
        self.get(id).or_else(|| {
            self.replicas
                .values()
                .find(|r| r.id().address == id.address)
                .cloned()
        })
    }
}
