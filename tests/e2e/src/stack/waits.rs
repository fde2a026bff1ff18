//! Waiting for the stack's indexds: every replica seen fresh and healthy,
//! a replica's blocks ingested.

use std::time::{Duration, Instant};

use super::{RunningIndexd, Stack};
use crate::HarnessError;

impl Stack {
    /// Waits until every running indexd sees every replica fresh and healthy.
    pub fn wait_index_ready(&self, timeout: Duration) -> Result<(), HarnessError> {
        let started = Instant::now();
        for indexd in self.all_indexd() {
            let left = timeout.saturating_sub(started.elapsed());
            self.wait_one_index_ready(indexd, left)?;
        }
        Ok(())
    }

    fn wait_one_index_ready(
        &self,
        indexd: &RunningIndexd,
        timeout: Duration,
    ) -> Result<(), HarnessError> {
        let ids: Vec<indexd::EndpointId> = self.endpoints.iter().map(|e| e.id.clone()).collect();
        wait_until(
            "indexd sees every replica fresh and healthy",
            timeout,
            || {
                ids.iter().all(|id| {
                    indexd
                        .handle
                        .replica(id)
                        .is_some_and(|s| s.fresh && s.healthy)
                })
            },
        )
        .map_err(|e| match e {
            HarnessError::NotReady { what, after, .. } => {
                let status: Vec<String> = ids
                    .iter()
                    .map(|id| format!("{id}: {:?}", indexd.handle.replica(id)))
                    .collect();
                // The one line a truncated CI log keeps: which replica is not.
                let short: Vec<String> = ids
                    .iter()
                    .map(|id| match indexd.handle.replica(id) {
                        Some(s) => format!("{id} fresh={} healthy={}", s.fresh, s.healthy),
                        None => format!("{id} unknown"),
                    })
                    .collect();
                HarnessError::NotReady {
                    what: format!("{what} ({})", short.join("; ")),
                    after,
                    log: format!("{}\n{}", status.join("\n"), indexd.handle.metrics_text()),
                }
            }
            other => other,
        })
    }

    /// Waits until every running indexd holds at least `entries` blocks for
    /// replica `i` (all its data-parallel ranks together).
    pub fn wait_indexed(
        &self,
        i: usize,
        entries: usize,
        timeout: Duration,
    ) -> Result<(), HarnessError> {
        let addresses = self.replica_addresses();
        let Some(address) = addresses.get(i) else {
            return Ok(());
        };
        if let Some(replica) = self.replicas.get(i) {
            self.runtime.block_on(replica.flush_events());
        }
        if self.all_indexd().next().is_none() {
            return Ok(());
        }
        // Every rank of the server counts.
        let ids = self.endpoint_ids(address);
        wait_until("indexd ingests the replica's events", timeout, || {
            self.entries_of(&ids) >= entries
        })
    }

    /// The index entries replica `i` holds (every rank of the server) in
    /// the indexd that has ingested fewest of them: the count to add a new
    /// prompt's blocks to before [`Stack::wait_indexed`], where the replica
    /// already holds others (whose count alone would satisfy the wait).
    pub fn indexed_entries(&self, i: usize) -> usize {
        let addresses = self.replica_addresses();
        let Some(address) = addresses.get(i) else {
            return 0;
        };
        self.entries_of(&self.endpoint_ids(address))
    }

    /// The endpoints (every rank) of the server at `address`.
    fn endpoint_ids(&self, address: &str) -> Vec<indexd::EndpointId> {
        self.endpoints
            .iter()
            .filter(|e| e.id.address.to_string() == *address)
            .map(|e| e.id.clone())
            .collect()
    }

    /// The entries `ids` hold together, in the indexd with fewest.
    fn entries_of(&self, ids: &[indexd::EndpointId]) -> usize {
        self.all_indexd()
            .map(|indexd| {
                ids.iter()
                    .filter_map(|id| indexd.handle.replica(id))
                    .map(|s| s.entries)
                    .sum()
            })
            .min()
            .unwrap_or(0)
    }
}

/// Polls `done` every 10 ms until it holds or `timeout` passes.
pub fn wait_until(
    what: &str,
    timeout: Duration,
    mut done: impl FnMut() -> bool,
) -> Result<(), HarnessError> {
    let started = Instant::now();
    while !done() {
        if started.elapsed() > timeout {
            return Err(HarnessError::NotReady {
                what: what.to_owned(),
                after: timeout,
                log: String::new(),
            });
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}
