//! The statistics of a summary: mean, percentiles (linear interpolation
//! between closest ranks, R's type 7), the 95% confidence interval of the
//! mean from Student's t, and the busiest replica's share of a load.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// A distribution's summary (milliseconds in this crate's use).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Dist {
    /// Observations.
    pub n: usize,
    /// Arithmetic mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Half-width of the 95% CI of the mean (t with n − 1 degrees of freedom; 0 when n < 2).
    pub ci95: f64,
    /// Smallest observation.
    pub min: f64,
    /// Largest observation.
    pub max: f64,
}

impl Dist {
    /// Summarises `values` (order does not matter; empty gives all zeros).
    pub fn of(values: &[f64]) -> Self {
        let mut sorted = values.to_vec();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        if n == 0 {
            return Self::default();
        }
        let mean = mean(&sorted);
        Self {
            n,
            mean,
            p50: percentile(&sorted, 0.50),
            p99: percentile(&sorted, 0.99),
            ci95: ci95_half_width(&sorted),
            min: sorted.first().copied().unwrap_or_default(),
            max: sorted.last().copied().unwrap_or_default(),
        }
    }
}

/// Arithmetic mean (0 for none).
pub fn mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        0.0
    } else {
        values.iter().sum::<f64>() / values.len() as f64
    }
}

/// Sample standard deviation (n − 1; 0 for fewer than two).
pub fn std_dev(values: &[f64]) -> f64 {
    let n = values.len();
    if n < 2 {
        return 0.0;
    }
    let m = mean(values);
    let ss: f64 = values.iter().map(|v| (v - m) * (v - m)).sum();
    (ss / (n - 1) as f64).sqrt()
}

/// The `q` quantile of `sorted` (ascending), interpolated linearly between
/// the closest ranks (R type 7, NumPy's default).
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    let n = sorted.len();
    if n == 0 {
        return 0.0;
    }
    let h = (n - 1) as f64 * q.clamp(0.0, 1.0);
    let lo = h.floor() as usize;
    let hi = (lo + 1).min(n - 1);
    let (Some(a), Some(b)) = (sorted.get(lo), sorted.get(hi)) else {
        return 0.0;
    };
    a + (h - lo as f64) * (b - a)
}

/// Two-sided 97.5% quantiles of Student's t for 1 to 30 degrees of freedom.
const T975: [f64; 30] = [
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
    2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
    2.052, 2.048, 2.045, 2.042,
];

/// The 0.975 quantile of t with `df` degrees of freedom: the table up to 30,
/// then the Cornish–Fisher expansion around the normal (error < 0.001).
pub fn t_975(df: usize) -> f64 {
    if df == 0 {
        return f64::INFINITY;
    }
    if let Some(t) = T975.get(df - 1) {
        return *t;
    }
    let z: f64 = 1.959_964;
    let v = df as f64;
    z + (z.powi(3) + z) / (4.0 * v)
        + (5.0 * z.powi(5) + 16.0 * z.powi(3) + 3.0 * z) / (96.0 * v * v)
}

/// Half-width of the 95% confidence interval of the mean.
pub fn ci95_half_width(values: &[f64]) -> f64 {
    let n = values.len();
    if n < 2 {
        return 0.0;
    }
    t_975(n - 1) * std_dev(values) / (n as f64).sqrt()
}

/// `num / den`, or `None` when `den` is 0.
pub fn ratio(num: u64, den: u64) -> Option<f64> {
    (den > 0).then(|| num as f64 / den as f64)
}

/// `49.54%`, or `n/a`.
pub fn percent(r: Option<f64>) -> String {
    r.map_or_else(|| "n/a".to_owned(), |r| format!("{:.2}%", 100.0 * r))
}

/// The busiest replica's share of the requests in `load` (None for none).
pub fn busiest_share(load: &BTreeMap<String, usize>) -> Option<f64> {
    let total: usize = load.values().sum();
    let max = load.values().copied().max().unwrap_or(0);
    ratio(max as u64, total as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol
    }

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 0.5), 2.5);
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert_eq!(percentile(&v, 1.0), 4.0);
        // numpy.percentile([1, 2, 3, 4], 99) = 3.97
        assert!(close(percentile(&v, 0.99), 3.97, 1e-12));
        assert_eq!(percentile(&[7.0], 0.99), 7.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
    }

    #[test]
    fn ci_matches_a_hand_computation() {
        // mean 5, s = sqrt(10/4) = 1.5811, t(4) = 2.776: 2.776 * 1.5811 / sqrt(5) = 1.9630
        let v = [3.0, 4.0, 5.0, 6.0, 7.0];
        assert!(close(ci95_half_width(&v), 1.9630, 1e-3));
        assert_eq!(ci95_half_width(&[1.0]), 0.0);
        let d = Dist::of(&[7.0, 3.0, 5.0, 6.0, 4.0]);
        assert_eq!((d.n, d.mean, d.p50, d.min, d.max), (5, 5.0, 5.0, 3.0, 7.0));
    }

    #[test]
    fn t_quantiles_join_the_normal() {
        assert_eq!(t_975(1), 12.706);
        assert_eq!(t_975(30), 2.042);
        // Known values: t(0.975, 40) = 2.0211, t(0.975, 120) = 1.9799.
        assert!(close(t_975(40), 2.0211, 1e-3));
        assert!(close(t_975(120), 1.9799, 1e-3));
        assert!(t_975(100_000) > 1.959 && t_975(100_000) < 1.961);
    }

    #[test]
    fn ratio_of_nothing_is_none() {
        assert_eq!(ratio(1, 0), None);
        assert_eq!(ratio(1, 4), Some(0.25));
    }
}
