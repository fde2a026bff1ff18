//! Latency histograms as bins, read from Envoy's admin and indexd's
//! `/metrics`, differenced between two snapshots (one phase's observations
//! only), and their quantiles.
//!
//! - Envoy: `/stats?format=json&histogram_buckets=detailed` lists each
//!   histogram's cumulative log-linear bins (two significant digits: 2,300 µs
//!   is the bin `[2300, 2400)`). Envoy merges them on its stats flush
//!   (every 5 s by default), so a snapshot is taken once the filter's
//!   `filter_duration_us` count has caught up with the requests sent.
//! - indexd: a Prometheus histogram with fixed `le` buckets in seconds,
//!   converted to µs bins; its `_sum` gives the exact mean.
//!
//! A quantile is interpolated linearly inside the bin holding its rank
//! (`rank = q · count`), as Prometheus' `histogram_quantile` does.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kvroute_e2e::{Stack, http};
use serde_json::Value;

use crate::BenchError;

/// The filter's histograms in Envoy (`wasmcustom.` + the names in
/// filter/src/metrics.rs), in µs.
pub const FILTER_DURATION: &str = "wasmcustom.kvroute.filter_duration_us";
/// The filter's tokenizer callout.
pub const TOKENIZER_DURATION: &str = "wasmcustom.kvroute.tokenizer_duration_us";
/// The filter's own work on a buffered body, from its bytes to the callout
/// (the JSON parse, the fingerprints, the Pick's encoding).
pub const REQUEST_WORK: &str = "wasmcustom.kvroute.request_work_us";
/// The filter's Pick callout to indexd.
pub const INDEX_DURATION: &str = "wasmcustom.kvroute.index_duration_us";
/// indexd's time to answer a Pick (indexd/src/metrics.rs), in seconds.
pub const PICK_LATENCY: &str = "indexd_pick_latency_seconds";
/// indexd's time to tokenize a body with its own tokenizer
/// (indexd/src/tokenize.rs), in seconds.
pub const TOKENIZE_LOCAL: &str = "indexd_tokenize_local_seconds";

/// The admin query for the filter's histograms with their bins.
pub const ENVOY_QUERY: &str = "/stats?format=json&type=Histograms&histogram_buckets=detailed&filter=%5Ewasmcustom%5C.kvroute%5C.";

/// How long a snapshot waits for Envoy's stats flush.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(15);
/// How often a snapshot asks Envoy's admin again while it waits.
const FLUSH_POLL: Duration = Duration::from_millis(250);
/// One request to Envoy's admin.
const ADMIN_TIMEOUT: Duration = Duration::from_secs(5);

/// One bin: `count` observations in `[lower, lower + width)` (µs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bin {
    /// Lower bound.
    pub lower: f64,
    /// Width (0: an open top bucket, reported at its lower bound).
    pub width: f64,
    /// Observations.
    pub count: u64,
}

/// A histogram: bins by lower bound, and the exact sum when the source has one.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Hist {
    /// Bins, ascending.
    pub bins: Vec<Bin>,
    /// Exact sum of the observations (µs).
    pub sum: Option<f64>,
}

impl Hist {
    /// A histogram of `bins` (sorted here; empty bins dropped).
    pub fn new(mut bins: Vec<Bin>, sum: Option<f64>) -> Self {
        bins.retain(|b| b.count > 0);
        bins.sort_by(|a, b| a.lower.total_cmp(&b.lower));
        Self { bins, sum }
    }

    /// Observations.
    pub fn count(&self) -> u64 {
        self.bins.iter().map(|b| b.count).sum()
    }

    /// The `q` quantile, linear inside its bin (`None` when empty).
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let n = self.count();
        if n == 0 {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * n as f64;
        let mut before = 0u64;
        for b in &self.bins {
            let after = before + b.count;
            if after as f64 >= rank {
                let inside = (rank - before as f64) / b.count as f64;
                return Some(b.lower + b.width * inside.clamp(0.0, 1.0));
            }
            before = after;
        }
        self.bins.last().map(|b| b.lower + b.width)
    }

    /// The exact mean when the sum is known, else the mean of the bins' midpoints.
    pub fn mean(&self) -> Option<f64> {
        let n = self.count();
        if n == 0 {
            return None;
        }
        let total = self.sum.unwrap_or_else(|| {
            self.bins
                .iter()
                .map(|b| (b.lower + b.width / 2.0) * b.count as f64)
                .sum()
        });
        Some(total / n as f64)
    }

    /// What was observed after `earlier` (both cumulative snapshots of one histogram).
    pub fn since(&self, earlier: &Hist) -> Hist {
        let key = |b: &Bin| (b.lower.to_bits(), b.width.to_bits());
        let mut before: BTreeMap<(u64, u64), u64> = BTreeMap::new();
        for b in &earlier.bins {
            *before.entry(key(b)).or_insert(0) += b.count;
        }
        let bins = self
            .bins
            .iter()
            .map(|b| Bin {
                count: b
                    .count
                    .saturating_sub(before.get(&key(b)).copied().unwrap_or(0)),
                ..*b
            })
            .collect();
        let sum = match (self.sum, earlier.sum) {
            (Some(now), Some(then)) => Some(round_nanos(now - then)),
            (Some(now), None) => Some(now),
            _ => None,
        };
        Hist::new(bins, sum)
    }
}

/// µs rounded to the nanosecond (so bounds like 5e-6 s print as 5).
fn round_nanos(us: f64) -> f64 {
    (us * 1_000.0).round() / 1_000.0
}

/// Every histogram in an Envoy `/stats?format=json&histogram_buckets=detailed`
/// answer, by name, from its cumulative `totals`.
pub fn parse_envoy(doc: &Value) -> BTreeMap<String, Hist> {
    let mut out = BTreeMap::new();
    let details = doc["stats"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s["histograms"]["details"].as_array())
        .flatten();
    for d in details {
        let Some(name) = d["name"].as_str() else {
            continue;
        };
        let bins = d["totals"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|b| {
                Some(Bin {
                    lower: b["lower_bound"].as_f64()?,
                    width: b["width"].as_f64()?,
                    count: b["count"]
                        .as_u64()
                        .or_else(|| b["count"].as_f64().map(|c| c.round() as u64))?,
                })
            })
            .collect();
        out.insert(name.to_owned(), Hist::new(bins, None));
    }
    out
}

/// The Prometheus histogram `name` (in seconds) from exposition `text`, in
/// µs: bin `[previous le, le)` for each bucket, the `+Inf` bucket as an open
/// bin at the last bound; `None` when the text has no such histogram.
pub fn parse_prometheus_seconds(text: &str, name: &str) -> Option<Hist> {
    let bucket = format!("{name}_bucket{{le=\"");
    let sum_prefix = format!("{name}_sum");
    let mut cumulative: Vec<(f64, u64)> = Vec::new();
    let mut sum = None;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix(&bucket) {
            let Some((le, value)) = rest.split_once("\"}") else {
                continue;
            };
            let Ok(count) = value.trim().parse::<f64>() else {
                continue;
            };
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                match le.parse::<f64>() {
                    Ok(v) => round_nanos(v * 1e6),
                    Err(_) => continue,
                }
            };
            cumulative.push((le, count.round() as u64));
        } else if let Some(rest) = line.strip_prefix(&sum_prefix) {
            // `name_sum 0.0123` or `name_sum{} 0.0123`.
            let value = rest.trim_start_matches("{}").trim();
            sum = value.parse::<f64>().ok().map(|s| round_nanos(s * 1e6));
        }
    }
    if cumulative.is_empty() {
        return None;
    }
    cumulative.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut bins = Vec::with_capacity(cumulative.len());
    let (mut lower, mut below) = (0.0, 0u64);
    for (le, count) in cumulative {
        let (bin_lower, width) = if le.is_finite() {
            (lower, le - lower)
        } else {
            (lower, 0.0)
        };
        bins.push(Bin {
            lower: bin_lower,
            width: round_nanos(width),
            count: count.saturating_sub(below),
        });
        if le.is_finite() {
            lower = le;
        }
        below = below.max(count);
    }
    Some(Hist::new(bins, sum))
}

/// The filter's histograms once Envoy's stats flush has merged at least
/// `decided` filter decisions (or after [`FLUSH_TIMEOUT`], with a warning).
pub fn envoy_snapshot(stack: &Stack, decided: u64) -> Result<BTreeMap<String, Hist>, BenchError> {
    envoy_histograms(stack.envoy(), decided)
}

/// [`envoy_snapshot`] of one Envoy.
pub fn envoy_histograms(
    envoy: &kvroute_e2e::Envoy,
    decided: u64,
) -> Result<BTreeMap<String, Hist>, BenchError> {
    let url = format!("{}{}", envoy.admin_url(), ENVOY_QUERY);
    let started = Instant::now();
    loop {
        let response = http::get(&url, &[], ADMIN_TIMEOUT)?;
        let doc: serde_json::Value = serde_json::from_str(&response.body)?;
        let hists = parse_envoy(&doc);
        let seen = hists.get(FILTER_DURATION).map_or(0, Hist::count);
        if seen >= decided {
            return Ok(hists);
        }
        if started.elapsed() >= FLUSH_TIMEOUT {
            eprintln!(
                "overhead: Envoy's {FILTER_DURATION} holds {seen} of {decided} decisions after \
                 {FLUSH_TIMEOUT:?}; using it as is"
            );
            return Ok(hists);
        }
        std::thread::sleep(FLUSH_POLL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn bin(lower: f64, width: f64, count: u64) -> Bin {
        Bin {
            lower,
            width,
            count,
        }
    }

    #[test]
    fn quantiles_interpolate_inside_the_bin() {
        let h = Hist::new(vec![bin(200.0, 100.0, 2), bin(100.0, 100.0, 2)], None);
        assert_eq!(h.count(), 4);
        // rank 2 closes the first bin: its upper bound.
        assert_eq!(h.quantile(0.5), Some(200.0));
        // rank 3: half-way through [200, 300).
        assert_eq!(h.quantile(0.75), Some(250.0));
        assert_eq!(h.quantile(0.0), Some(100.0));
        assert_eq!(h.quantile(1.0), Some(300.0));
        assert_eq!(h.mean(), Some(200.0));
        assert_eq!(Hist::default().quantile(0.5), None);
        assert_eq!(Hist::new(vec![], Some(1.0)).mean(), None);
    }

    #[test]
    fn envoy_details_difference_to_one_phase() {
        let doc = |counts: [u64; 2]| {
            json!({"stats": [{"histograms": {"supported_percentiles": [50], "details": [{
                "name": INDEX_DURATION,
                "totals": [
                    {"lower_bound": 940, "width": 10, "count": counts[0]},
                    {"lower_bound": 1100, "width": 100, "count": counts[1]}
                ],
                "intervals": [], "percentiles": []
            }]}}]})
        };
        let before = parse_envoy(&doc([3, 1]));
        let after = parse_envoy(&doc([3, 5]));
        let phase = after[INDEX_DURATION].since(&before[INDEX_DURATION]);
        assert_eq!(phase.bins, vec![bin(1100.0, 100.0, 4)]);
        assert_eq!(phase.quantile(0.5), Some(1150.0));
    }

    #[test]
    fn prometheus_seconds_become_microsecond_bins() {
        let text = |b: [u64; 3], sum: f64| {
            format!(
                "# TYPE {PICK_LATENCY} histogram\n\
                 {PICK_LATENCY}_bucket{{le=\"0.000005\"}} {}\n\
                 {PICK_LATENCY}_bucket{{le=\"0.0001\"}} {}\n\
                 {PICK_LATENCY}_bucket{{le=\"+Inf\"}} {}\n\
                 {PICK_LATENCY}_sum {sum}\n{PICK_LATENCY}_count {}\n",
                b[0], b[1], b[2], b[2]
            )
        };
        let before = parse_prometheus_seconds(&text([0, 2, 2], 0.0001), PICK_LATENCY).unwrap();
        let after = parse_prometheus_seconds(&text([1, 5, 6], 0.00031), PICK_LATENCY).unwrap();
        let phase = after.since(&before);
        assert_eq!(
            phase.bins,
            vec![bin(0.0, 5.0, 1), bin(5.0, 95.0, 2), bin(100.0, 0.0, 1)]
        );
        assert_eq!(phase.sum, Some(210.0));
        assert_eq!(phase.mean(), Some(52.5));
        assert_eq!(
            parse_prometheus_seconds("other_metric 1\n", PICK_LATENCY),
            None
        );
    }
}
