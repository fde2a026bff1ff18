//! The three CSV files of an overhead run: one row per request
//! (`overhead.csv`), the per-rate deltas of the filter's and indexd's latency
//! histograms (`overhead-histograms.csv`) and the run's settings
//! (`overhead-run.csv`). `overhead.md` is computed from these alone.

use serde::{Deserialize, Serialize};

use crate::sample::profile_rank;

/// One row per request.
pub const REQUESTS_CSV: &str = "overhead.csv";
/// Histogram bins (and exact sums where the source has them) per rate.
pub const HISTOGRAMS_CSV: &str = "overhead-histograms.csv";
/// `key,value` settings of the run.
pub const RUN_CSV: &str = "overhead-run.csv";
/// The report, recomputable from the three CSV files.
pub const MARKDOWN: &str = "overhead.md";

/// What one request did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestRow {
    /// [`KVROUTE`](crate::record::KVROUTE) or [`BASELINE`](crate::record::BASELINE).
    pub profile: String,
    /// The profile's request rate in this phase (requests/s).
    pub rate: f64,
    /// Index of the request in the profile's schedule at this rate.
    pub seq: u32,
    /// When it was due, since the phase began (ms, to the µs).
    pub start_ms: f64,
    /// How late the sender actually sent it (µs).
    pub lag_us: u64,
    /// Send to end of the stream (µs).
    pub latency_us: u64,
    /// HTTP status (0: no response).
    pub status: u16,
    /// Transport or protocol error (empty: none).
    pub error: String,
    /// The filter's `x-kvroute-decision` (empty without the filter).
    pub decision: String,
    /// `usage.prompt_tokens` of the reply.
    pub prompt_tokens: u64,
}

impl RequestRow {
    /// Answered 200 and streamed to `[DONE]`.
    pub fn ok(&self) -> bool {
        self.status == 200 && self.error.is_empty()
    }
}

/// `bin`: `count` observations in `[lower_us, lower_us + width_us)`; `sum`:
/// the exact sum of the histogram's observations in this phase (`sum_us`,
/// `count` of them).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HistogramRow {
    /// The phase's rate (requests/s per profile).
    pub rate: f64,
    /// `envoy` (the filter's histograms, Envoy admin) or `indexd` (its `/metrics`).
    pub source: String,
    /// The metric as its source names it.
    pub metric: String,
    /// `bin` or `sum`.
    pub kind: String,
    /// Lower bound of the bin (µs).
    pub lower_us: f64,
    /// Width of the bin (µs; 0 for the open top bucket).
    pub width_us: f64,
    /// Observations.
    pub count: u64,
    /// Sum of the observations (µs; `sum` rows only).
    pub sum_us: f64,
}

/// The canonical order of requests: rate, profile (baseline first), seq.
pub fn sort_requests(rows: &mut [RequestRow]) {
    rows.sort_by(|a, b| {
        a.rate
            .total_cmp(&b.rate)
            .then_with(|| profile_rank(&a.profile).cmp(&profile_rank(&b.profile)))
            .then_with(|| a.profile.cmp(&b.profile))
            .then_with(|| a.seq.cmp(&b.seq))
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{BASELINE, KVROUTE};

    #[test]
    fn rows_round_trip_and_sort() {
        let row = |profile: &str, rate: f64, seq: u32| RequestRow {
            profile: profile.into(),
            rate,
            seq,
            start_ms: 1.234,
            lag_us: 5,
            latency_us: 1_500,
            status: 200,
            error: String::new(),
            decision: "precise".into(),
            prompt_tokens: 1_540,
        };
        let mut rows = vec![
            row(KVROUTE, 50.0, 0),
            row(BASELINE, 50.0, 1),
            row(BASELINE, 50.0, 0),
            row(KVROUTE, 10.0, 3),
        ];
        sort_requests(&mut rows);
        let keys: Vec<(f64, &str, u32)> = rows
            .iter()
            .map(|r| (r.rate, r.profile.as_str(), r.seq))
            .collect();
        assert_eq!(
            keys,
            [
                (10.0, KVROUTE, 3),
                (50.0, BASELINE, 0),
                (50.0, BASELINE, 1),
                (50.0, KVROUTE, 0)
            ]
        );
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(REQUESTS_CSV);
        crate::sample::write_csv(&path, &rows).unwrap();
        assert_eq!(crate::sample::read_csv::<RequestRow>(&path).unwrap(), rows);
    }
}
