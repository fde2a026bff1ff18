//! The figures of `overhead.md`, computed from the three CSV files alone,
//! and the Markdown itself.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::histogram::{
    Bin, FILTER_DURATION, Hist, INDEX_DURATION, PICK_LATENCY, TOKENIZER_DURATION,
};
use crate::overhead::cpu::{self, CpuFigures};
use crate::overhead::record::{HistogramRow, RequestRow};
use crate::record::{BASELINE, KVROUTE, RunRow};
use crate::stats::{self, Dist};

/// One profile at one rate.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProfileFigures {
    /// Requests scheduled.
    pub requests: usize,
    /// Requests that did not answer 200 and stream to the end.
    pub errors: usize,
    /// Latency of the successful ones (µs).
    pub latency: Dist,
    /// 99th percentile of how late requests left (µs).
    pub lag_p99: f64,
    /// Mean `usage.prompt_tokens` of the successful ones.
    pub prompt_tokens: f64,
    /// The filter's decisions and their counts (empty without the filter).
    pub decisions: BTreeMap<String, usize>,
}

impl ProfileFigures {
    fn of(rows: &[&RequestRow]) -> Self {
        let ok: Vec<&&RequestRow> = rows.iter().filter(|r| r.ok()).collect();
        let latency: Vec<f64> = ok.iter().map(|r| r.latency_us as f64).collect();
        let mut lag: Vec<f64> = rows.iter().map(|r| r.lag_us as f64).collect();
        lag.sort_by(f64::total_cmp);
        let tokens: Vec<f64> = ok.iter().map(|r| r.prompt_tokens as f64).collect();
        let mut decisions = BTreeMap::new();
        for r in rows.iter().filter(|r| !r.decision.is_empty()) {
            *decisions.entry(r.decision.clone()).or_insert(0) += 1;
        }
        Self {
            requests: rows.len(),
            errors: rows.len() - ok.len(),
            latency: Dist::of(&latency),
            lag_p99: stats::percentile(&lag, 0.99),
            prompt_tokens: stats::mean(&tokens),
            decisions,
        }
    }
}

/// One histogram over one phase (µs).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct HistFigures {
    /// Observations.
    pub count: u64,
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Mean (exact for indexd, bin midpoints for Envoy).
    pub mean: f64,
}

impl HistFigures {
    fn of(hist: &Hist) -> Option<Self> {
        Some(Self {
            count: hist.count(),
            p50: hist.quantile(0.50)?,
            p99: hist.quantile(0.99)?,
            mean: hist.mean()?,
        })
    }
}

/// Both profiles at one rate, and the histograms captured after it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RateFigures {
    /// Requests/s per profile.
    pub rate: f64,
    /// Envoy alone.
    pub baseline: ProfileFigures,
    /// Envoy + filter + indexd.
    pub kvroute: ProfileFigures,
    /// `kvroute.filter_duration_us`: request headers to resume.
    pub filter: Option<HistFigures>,
    /// `kvroute.tokenizer_duration_us`: the tokenizer call.
    pub tokenizer: Option<HistFigures>,
    /// `kvroute.index_duration_us`: the Pick call as the filter sees it.
    pub index: Option<HistFigures>,
    /// `indexd_pick_latency_seconds`: indexd answering the Pick.
    pub pick: Option<HistFigures>,
}

impl RateFigures {
    /// kvroute's median minus the baseline's.
    pub fn added_p50(&self) -> f64 {
        self.kvroute.latency.p50 - self.baseline.latency.p50
    }

    /// kvroute's p99 minus the baseline's.
    pub fn added_p99(&self) -> f64 {
        self.kvroute.latency.p99 - self.baseline.latency.p99
    }

    /// kvroute's mean minus the baseline's.
    pub fn added_mean(&self) -> f64 {
        self.kvroute.latency.mean - self.baseline.latency.mean
    }

    /// Half-width of the 95% CI of [`Self::added_mean`] (the two means' CIs
    /// combined in quadrature).
    pub fn added_mean_ci95(&self) -> f64 {
        self.kvroute.latency.ci95.hypot(self.baseline.latency.ci95)
    }

    /// The filter's median Pick call over the added median (`None` when
    /// nothing was added or no Pick was timed).
    pub fn pick_share(&self) -> Option<f64> {
        share(self.index.map(|h| h.p50), self.added_p50())
    }

    /// The filter's median tokenizer call over the added median.
    pub fn tokenizer_share(&self) -> Option<f64> {
        share(self.tokenizer.map(|h| h.p50), self.added_p50())
    }

    /// The added median less the median tokenizer call (routing overhead
    /// proper excludes the tokenizer).
    pub fn added_p50_without_tokenizer(&self) -> Option<f64> {
        self.tokenizer.map(|t| self.added_p50() - t.p50)
    }

    /// The filter's median less its median tokenizer and Pick calls: its own
    /// work (parsing, hashing) and the wait for the request body.
    pub fn filter_own_p50(&self) -> Option<f64> {
        match (self.filter, self.tokenizer, self.index) {
            (Some(f), Some(t), Some(i)) => Some(f.p50 - t.p50 - i.p50),
            _ => None,
        }
    }
}

fn share(part: Option<f64>, whole: f64) -> Option<f64> {
    part.filter(|_| whole > 0.0).map(|p| p / whole)
}

/// Everything `overhead.md` shows.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Report {
    /// The run's settings, in file order.
    pub settings: Vec<RunRow>,
    /// One entry per rate, ascending.
    pub rates: Vec<RateFigures>,
    /// CPU per request per rate (empty: the run recorded none).
    pub cpu: Vec<CpuFigures>,
}

/// Computes the report from the CSV rows.
pub fn compute(
    requests: &[RequestRow],
    histograms: &[HistogramRow],
    settings: &[RunRow],
) -> Report {
    let mut rates: Vec<f64> = requests.iter().map(|r| r.rate).collect();
    rates.sort_by(f64::total_cmp);
    rates.dedup();
    let figures = rates
        .into_iter()
        .map(|rate| {
            let of = |profile: &str| {
                let rows: Vec<&RequestRow> = requests
                    .iter()
                    .filter(|r| r.rate == rate && r.profile == profile)
                    .collect();
                ProfileFigures::of(&rows)
            };
            let hist = |source: &str, metric: &str| {
                HistFigures::of(&histogram(histograms, rate, source, metric))
            };
            RateFigures {
                rate,
                baseline: of(BASELINE),
                kvroute: of(KVROUTE),
                filter: hist("envoy", FILTER_DURATION),
                tokenizer: hist("envoy", TOKENIZER_DURATION),
                index: hist("envoy", INDEX_DURATION),
                pick: hist("indexd", PICK_LATENCY),
            }
        })
        .collect();
    Report {
        settings: settings.to_vec(),
        rates: figures,
        cpu: Vec::new(),
    }
}

/// The histogram `metric` of `source` at `rate`, rebuilt from its rows.
pub fn histogram(rows: &[HistogramRow], rate: f64, source: &str, metric: &str) -> Hist {
    let mine = rows
        .iter()
        .filter(|r| r.rate == rate && r.source == source && r.metric == metric);
    let mut bins = Vec::new();
    let mut sum = None;
    for r in mine {
        match r.kind.as_str() {
            "bin" => bins.push(Bin {
                lower: r.lower_us,
                width: r.width_us,
                count: r.count,
            }),
            "sum" => sum = Some(r.sum_us),
            _ => {}
        }
    }
    Hist::new(bins, sum)
}

/// The rows of one phase's histogram.
pub fn histogram_rows(rate: f64, source: &str, metric: &str, hist: &Hist) -> Vec<HistogramRow> {
    let row = |kind: &str, bin: Bin, sum_us: f64| HistogramRow {
        rate,
        source: source.to_owned(),
        metric: metric.to_owned(),
        kind: kind.to_owned(),
        lower_us: bin.lower,
        width_us: bin.width,
        count: bin.count,
        sum_us,
    };
    let mut rows: Vec<HistogramRow> = hist.bins.iter().map(|b| row("bin", *b, 0.0)).collect();
    if let Some(sum) = hist.sum {
        let all = Bin {
            lower: 0.0,
            width: 0.0,
            count: hist.count(),
        };
        rows.push(row("sum", all, sum));
    }
    rows
}

fn us(v: f64) -> String {
    format!("{v:.0}")
}

fn opt(v: Option<f64>, f: impl Fn(f64) -> String) -> String {
    v.map_or_else(|| "–".to_owned(), f)
}

fn pct(v: Option<f64>) -> String {
    opt(v, |s| format!("{:.0}%", s * 100.0))
}

fn pair(h: Option<HistFigures>, second: impl Fn(HistFigures) -> f64) -> String {
    opt(h.map(|h| h.p50), us) + " / " + &opt(h.map(second), us)
}

impl Report {
    /// A setting's value (`?` when the run did not record it).
    pub fn setting(&self, key: &str) -> &str {
        self.settings
            .iter()
            .find(|s| s.key == key)
            .map_or("?", |s| s.value.as_str())
    }

    /// `overhead.md`.
    pub fn to_markdown(&self) -> String {
        let mut out = String::new();
        let tokens: Vec<f64> = self
            .rates
            .iter()
            .flat_map(|r| [&r.baseline, &r.kvroute])
            .filter(|p| p.requests > p.errors)
            .map(|p| p.prompt_tokens)
            .collect();
        let _ = write!(
            out,
            "# Routing overhead: kvroute (Envoy + filter + indexd, precise) against Envoy alone\n\n\
             Open-loop streamed chat requests at fixed rates per profile (each request due on a \
             fixed schedule, whatever earlier ones are doing), the two profiles interleaved \
             request by request (kvroute at k/rate, Envoy alone half a period later), each in \
             front of {replicas} mock vLLM replicas that answer instantly (latency model \
             time_scale {ts}; the mock's own `/tokenize` is the filter's tokenizer, reached \
             through Envoy). Prompts: ~{tokens:.0} tokens on average (a shared {sys}-word system \
             prompt and a {user}-word message of their own; one token per word), max_tokens \
             {max_tokens}. Latency is send to end of stream over the successful requests, in µs.\n\n\
             Run: {cores} cores shared by the client, both Envoys, indexd and the replicas; bench \
             built `{build}`; {secs} s per rate; {senders} sender threads; {warmup} warm-up \
             requests per profile first; seed {seed}. Every figure below is recomputed from \
             `overhead.csv`, `overhead-histograms.csv` and `overhead-run.csv` by \
             `kvroute-bench summarize-overhead <dir>`.\n\n",
            replicas = self.setting("replicas"),
            ts = self.setting("time_scale"),
            tokens = stats::mean(&tokens),
            sys = self.setting("system_words"),
            user = self.setting("user_words"),
            max_tokens = self.setting("max_tokens"),
            cores = self.setting("cores"),
            build = self.setting("build"),
            secs = self.setting("secs"),
            senders = self.setting("senders"),
            warmup = self.setting("warmup"),
            seed = self.setting("seed"),
        );
        out.push_str("## Latency per profile\n\n");
        out.push_str(
            "| rate/s | profile | requests | errors | p50 µs | p99 µs | mean µs | send lag p99 µs | decisions |\n\
             |---:|---|---:|---:|---:|---:|---:|---:|---|\n",
        );
        for r in &self.rates {
            for (name, p) in [(BASELINE, &r.baseline), (KVROUTE, &r.kvroute)] {
                let decisions: Vec<String> = p
                    .decisions
                    .iter()
                    .map(|(d, n)| format!("{d} {n}"))
                    .collect();
                let _ = writeln!(
                    out,
                    "| {} | {name} | {} | {} | {} | {} | {} | {} | {} |",
                    r.rate,
                    p.requests,
                    p.errors,
                    us(p.latency.p50),
                    us(p.latency.p99),
                    us(p.latency.mean),
                    us(p.lag_p99),
                    if decisions.is_empty() {
                        "–".to_owned()
                    } else {
                        decisions.join(", ")
                    }
                );
            }
        }
        out.push_str("\n## What kvroute adds\n\n");
        out.push_str(
            "| rate/s | added p50 µs | added p99 µs | added mean µs (95% CI) | filter p50 / p99 µs | \
             tokenizer call p50 / p99 µs | Pick call p50 / p99 µs | indexd Pick p50 / mean µs | \
             Pick share of added p50 | tokenizer share of added p50 | added p50 − tokenizer p50 µs |\n\
             |---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        for r in &self.rates {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} ± {} | {} | {} | {} | {} | {} | {} | {} |",
                r.rate,
                us(r.added_p50()),
                us(r.added_p99()),
                us(r.added_mean()),
                us(r.added_mean_ci95()),
                pair(r.filter, |h| h.p99),
                pair(r.tokenizer, |h| h.p99),
                pair(r.index, |h| h.p99),
                pair(r.pick, |h| h.mean),
                pct(r.pick_share()),
                pct(r.tokenizer_share()),
                opt(r.added_p50_without_tokenizer(), us),
            );
        }
        out.push_str(&cpu::markdown(&self.cpu));
        out.push_str("\n## Reading\n\n");
        for r in &self.rates {
            let _ = writeln!(
                out,
                "- At {rate}/s kvroute added {a50} µs at the median and {a99} µs at p99 \
                 (mean {am} ± {ci} µs; each p99 rests on {nk} and {nb} successful requests). The \
                 filter held the request for {f50} µs at the median; inside that, {calls}, so \
                 the Pick call is {share} of \
                 the added median (indexd's own work on a Pick: {pick} µs on average; the rest of \
                 the call is the gRPC hop through Envoy and the wasm callout), and ≈ {own} µs are \
                 the filter's own work and the wait for the body. Errors: {eb} Envoy alone, {ek} \
                 kvroute.",
                rate = r.rate,
                a50 = us(r.added_p50()),
                a99 = us(r.added_p99()),
                am = us(r.added_mean()),
                ci = us(r.added_mean_ci95()),
                f50 = opt(r.filter.map(|h| h.p50), us),
                calls = match r.tokenizer {
                    Some(t) => format!(
                        "the tokenizer call took {} µs and the Pick call {} µs",
                        us(t.p50),
                        opt(r.index.map(|h| h.p50), us)
                    ),
                    None => format!(
                        "the Pick call, which carried the body for indexd to tokenize (one \
                         call), took {} µs",
                        opt(r.index.map(|h| h.p50), us)
                    ),
                },
                share = pct(r.pick_share()),
                pick = opt(r.pick.map(|h| h.mean), us),
                nk = r.kvroute.latency.n,
                nb = r.baseline.latency.n,
                own = opt(r.filter_own_p50(), us),
                eb = r.baseline.errors,
                ek = r.kvroute.errors,
            );
        }
        let _ = write!(
            out,
            "- Read the absolute numbers with care: everything shares {cores} cores — the client \
             and its sender threads, both Envoys (2 workers each), indexd and the mock replicas \
             (in the bench process, {runtimes}) — and the machine sees \
             twice the listed rate (both profiles). The send-lag column shows how late requests \
             left when the client itself fell behind; other builds or CI on the machine at the \
             same time land in both profiles alike, since they are interleaved.\n\
             - Where a lower rate shows higher latencies than a higher one in both profiles, \
             the likely cause is idleness: with long gaps between requests, threads and cores \
             sleep deeper and wake up slower.\n\
             - Differences of percentiles are not percentiles of differences, and the filter's \
             spans overlap: `added p50 − tokenizer p50` and the shares are indications, not an \
             exact decomposition. A share above 100% or a negative difference is noise of that \
             kind.\n\
             - The tokenizer here is the mock's (a fast Rust tokenizer on loopback); a real vLLM \
             `/tokenize` of the same prompt costs more, so the tokenizer share is a lower bound. \
             Routing overhead proper excludes the tokenizer call: last column.\n\
             - Filter figures are per-rate differences of Envoy's `/stats?format=json&histogram_buckets=detailed` \
             bins (log-linear, two significant digits; the mean from bin midpoints). indexd's Pick \
             histogram has fixed buckets (every 5–10 µs up to 50 µs, then 75, 100, 150, 250, 500 µs, …), \
             so its p50 is an interpolation inside a bucket; its mean is exact (`_sum / _count`). \
             Quantiles are linear inside the bin holding their rank.\n",
            cores = self.setting("cores"),
            runtimes = if self.cpu.is_empty() {
                "one 2-thread tokio runtime per stack"
            } else {
                "one 2-thread tokio runtime per stack and one for indexd"
            },
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(profile: &str, seq: u32, latency_us: u64, status: u16) -> RequestRow {
        RequestRow {
            profile: profile.into(),
            rate: 10.0,
            seq,
            start_ms: f64::from(seq) * 100.0,
            lag_us: u64::from(seq) * 10,
            latency_us,
            status,
            error: String::new(),
            decision: if profile == KVROUTE {
                "precise".into()
            } else {
                String::new()
            },
            prompt_tokens: 1_540,
        }
    }

    #[test]
    fn added_latency_and_shares_come_from_the_rows() {
        let requests = vec![
            req(BASELINE, 0, 1_000, 200),
            req(BASELINE, 1, 1_200, 200),
            req(BASELINE, 2, 1_400, 200),
            req(KVROUTE, 0, 2_000, 200),
            req(KVROUTE, 1, 2_400, 200),
            req(KVROUTE, 2, 9_999, 503),
        ];
        let index = Hist::new(
            vec![Bin {
                lower: 300.0,
                width: 100.0,
                count: 2,
            }],
            None,
        );
        let pick = Hist::new(
            vec![Bin {
                lower: 50.0,
                width: 50.0,
                count: 2,
            }],
            Some(150.0),
        );
        let mut hists = histogram_rows(10.0, "envoy", INDEX_DURATION, &index);
        hists.extend(histogram_rows(10.0, "indexd", PICK_LATENCY, &pick));
        let report = compute(&requests, &hists, &[]);
        let r = &report.rates[0];
        assert_eq!((r.kvroute.requests, r.kvroute.errors), (3, 1));
        assert_eq!(r.kvroute.decisions["precise"], 3);
        // kvroute p50 2200 (of 2000, 2400), baseline p50 1200.
        assert_eq!(r.added_p50(), 1_000.0);
        assert_eq!(r.added_mean(), 1_000.0);
        assert_eq!(r.index.unwrap().p50, 350.0);
        assert_eq!(r.pick_share(), Some(0.35));
        assert_eq!(r.pick.unwrap().mean, 75.0);
        assert_eq!(r.tokenizer, None);
        assert_eq!(r.tokenizer_share(), None);
        let md = report.to_markdown();
        assert!(md.contains("| 10 | 1000 | "), "{md}");
        assert!(md.contains("| 35% |"), "{md}");
    }
}
