//! One request's record, and `samples.csv` (one row per request, in a fixed
//! order, so a summary recomputed from the file equals the run's).

use std::path::Path;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::BenchError;

/// What one request did. Times are milliseconds, rounded to the microsecond.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// `w1-chat`, `w1-responses`, `w2`.
    pub workload: String,
    /// `least-request`, `approximate`, `precise`.
    pub profile: String,
    /// Conversation index in the workload.
    pub conversation: u32,
    /// Request index in the conversation (0 = the first).
    pub turn: u32,
    /// `first`, `tool`, `user` or `retry` (what the request added).
    pub kind: String,
    /// `cache_salt` (empty: none).
    pub salt: String,
    /// Replica that served it (`r0`, `r1`, …; empty if none answered).
    pub replica: String,
    /// Replica that served the request this one continues (empty for the first).
    pub prev_replica: String,
    /// Replica holding the longest cached prefix at arrival (empty if none held any).
    pub oracle_replica: String,
    /// `usage.prompt_tokens` (`input_tokens` for Responses).
    pub prompt_tokens: u64,
    /// `…tokens_details.cached_tokens`.
    pub cached_tokens: u64,
    /// The best `hit_tokens` any replica's `/admin/probe` reported just before sending.
    pub oracle_cached_tokens: u64,
    /// Time to the first streamed output token.
    pub ttft_ms: f64,
    /// Time to the end of the stream.
    pub latency_ms: f64,
    /// When it was sent, since the profile's run started.
    pub start_ms: f64,
    /// The filter's `x-kvroute-decision` (empty without the filter).
    pub decision: String,
    /// HTTP status (0: no response).
    pub status: u16,
    /// Transport or protocol error (empty: none).
    pub error: String,
    /// The gateway (or router process) it was sent to, from 0.
    #[serde(default)]
    pub gateway: u32,
    /// The last fault injected before it was sent (empty: none yet).
    #[serde(default)]
    pub phase: String,
    /// `yes` when the replica ran exactly the prompt and `cache_salt` that were sent (by the
    /// mock's prompt digest), `no` when a router changed them, empty when unknown.
    #[serde(default)]
    pub intact: String,
}

impl Sample {
    /// Answered 200 without error.
    pub fn ok(&self) -> bool {
        self.status == 200 && self.error.is_empty()
    }

    /// A request continuing an earlier one of its conversation.
    pub fn is_continuation(&self) -> bool {
        self.turn > 0
    }

    /// The replica ran something else than the client sent (prompt or salt).
    pub fn rewritten(&self) -> bool {
        self.intact == "no"
    }

    /// A continuation served by another replica than the request it continues.
    pub fn moved(&self) -> bool {
        self.is_continuation()
            && !self.replica.is_empty()
            && !self.prev_replica.is_empty()
            && self.replica != self.prev_replica
    }

    /// A continuation served by the replica that served the request it continues.
    pub fn warm_return(&self) -> bool {
        self.is_continuation() && !self.replica.is_empty() && self.replica == self.prev_replica
    }
}

/// Milliseconds rounded to the microsecond (exact through the CSV).
pub fn millis(d: std::time::Duration) -> f64 {
    (d.as_secs_f64() * 1_000_000.0).round() / 1_000.0
}

/// The sticky oracle's profile name.
pub const STICKY_ORACLE: &str = "sticky-oracle";

/// Where a profile goes in tables: the baseline first, then by name.
pub(crate) fn profile_rank(profile: &str) -> u8 {
    match profile {
        "least-request" => 0,
        "kvroute-approximate" => 1,
        "kvroute-precise"
        | "kvroute-precise-local"
        | "kvroute-precise-spread"
        | "kvroute-precise-checked"
        | "kvroute-precise-by-cost" => 2,
        "vllm-router-cache-aware" => 3,
        "vllm-router-kv-aware" => 4,
        "sglang-router-cache-aware" => 5,
        "sticky-oracle" => 6,
        "sticky-oracle-held" => 7,
        _ => 8,
    }
}

/// The canonical order: workload, profile (baseline first), conversation, turn.
pub fn sort(samples: &mut [Sample]) {
    samples.sort_by(|a, b| {
        let key = |s: &Sample| {
            (
                s.workload.clone(),
                profile_rank(&s.profile),
                s.profile.clone(),
                s.conversation,
                s.turn,
            )
        };
        key(a).cmp(&key(b))
    });
}

/// Writes `rows` (samples, or the overhead run's records) as CSV with a header row.
pub fn write_csv<T: Serialize>(path: &Path, rows: &[T]) -> Result<(), BenchError> {
    let mut writer = csv::Writer::from_path(path).map_err(|e| BenchError::csv(path, e))?;
    for row in rows {
        writer
            .serialize(row)
            .map_err(|e| BenchError::csv(path, e))?;
    }
    writer.flush().map_err(|e| BenchError::io(path, e))
}

/// Reads a CSV written by [`write_csv`] (a `samples.csv`, or an overhead run's).
pub fn read_csv<T: DeserializeOwned>(path: &Path) -> Result<Vec<T>, BenchError> {
    let mut reader = csv::Reader::from_path(path).map_err(|e| BenchError::csv(path, e))?;
    reader
        .deserialize()
        .map(|row| row.map_err(|e| BenchError::csv(path, e)))
        .collect()
}

#[cfg(test)]
pub(crate) fn example(profile: &str, conversation: u32, turn: u32, replica: &str) -> Sample {
    Sample {
        workload: "w".into(),
        profile: profile.into(),
        conversation,
        turn,
        kind: if turn == 0 { "first" } else { "user" }.into(),
        salt: String::new(),
        replica: replica.into(),
        prev_replica: String::new(),
        oracle_replica: String::new(),
        prompt_tokens: 100,
        cached_tokens: 0,
        oracle_cached_tokens: 0,
        ttft_ms: 1.0,
        latency_ms: 2.0,
        start_ms: 0.0,
        decision: String::new(),
        status: 200,
        error: String::new(),
        gateway: 0,
        phase: String::new(),
        intact: "yes".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_round_trip_is_exact() {
        let mut a = example("precise", 3, 1, "r1");
        a.salt = "tenant, \"quoted\"\nnewline".into();
        a.prev_replica = "r1".into();
        a.ttft_ms = millis(std::time::Duration::from_nanos(123_456_789));
        a.latency_ms = 0.1 + 0.2;
        a.error = "timeout: 60 s".into();
        a.status = 0;
        let b = example("least-request", 0, 0, "");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("samples.csv");
        write_csv(&path, &[a.clone(), b.clone()]).unwrap();
        assert_eq!(read_csv::<Sample>(&path).unwrap(), vec![a, b]);
    }

    #[test]
    fn warm_return_needs_the_same_replica_on_a_continuation() {
        let mut s = example("p", 0, 1, "r0");
        s.prev_replica = "r0".into();
        assert!(s.warm_return());
        s.prev_replica = "r1".into();
        assert!(!s.warm_return());
        let mut first = example("p", 0, 0, "r0");
        first.prev_replica = "r0".into();
        assert!(!first.warm_return());
        let mut lost = example("p", 0, 1, "");
        lost.prev_replica = String::new();
        assert!(!lost.warm_return());
    }

    #[test]
    fn millis_round_to_microseconds() {
        assert_eq!(millis(std::time::Duration::from_nanos(1_234_567)), 1.235);
    }
}
