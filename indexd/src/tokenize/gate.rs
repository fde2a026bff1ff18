//! The exactness gate of a local tokenizer: local ids are used for routing
//! only while they are proven equal to a replica's.
//!
//! - **Pending** at start: requests go to a replica. Once a healthy replica
//!   serves the model, the probe set ([`probes`]: chat with system prompts,
//!   content parts, tools, tool calls and results, generation-prompt and
//!   continue-final-message flags, special-token look-alikes; completions
//!   with and without special tokens; Responses with instructions, input
//!   items, function calls and outputs) is tokenized both ways.
//! - **Open** when every probe agrees (same ids, or both refuse the
//!   request). The probe set runs again every `gate_interval`, and live
//!   requests are compared too, at most `shadow_per_second` per model, in
//!   the background (shadow checks).
//! - **Closed** on any difference, until indexd restarts: routing goes on
//!   with the replicas' tokenizers. The log line says where the ids first
//!   differ; `indexd_tokenizer_gate{model}` and
//!   `indexd_tokenizer_checks_total{…,result="mismatch"}` count it, and
//!   `/readyz` names the closed models.
//!
//! A probe the replica cannot answer (unreachable, 5xx) proves nothing: the
//! round is retried shortly. A probe the replica refuses (4xx) while the
//! local tokenizer takes it is left out of the round (and counted as
//! `result="refused"`): replicas refuse by their serving flags (tools
//! without `--enable-auto-tool-choice`, a shorter `--max-model-len`), and a
//! request a replica refuses is never served, so its ids misroute nothing.
//! A round needs at least one agreeing probe to open the gate.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::{Api, TokenizeError, Tokenizers, local_ids};
use crate::metrics::label_value as escape;
use crate::state::Shared;

/// Where a gate stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateState {
    /// Not yet checked: the replicas tokenize.
    Pending,
    /// Checked: the local tokenizer is used.
    Open,
    /// A difference was seen: the replicas tokenize until restart.
    Closed,
}

impl GateState {
    fn from_u8(v: u8) -> Self {
        match v {
            1 => Self::Open,
            2 => Self::Closed,
            _ => Self::Pending,
        }
    }

    const fn as_u8(self) -> u8 {
        match self {
            Self::Pending => 0,
            Self::Open => 1,
            Self::Closed => 2,
        }
    }

    /// Its name.
    pub const fn label(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Open => "open",
            Self::Closed => "closed",
        }
    }
}

/// How one comparison ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Same ids, or both refused the request.
    Agree,
    /// Different ids, or one refused what the other took.
    Mismatch(String),
    /// The replica could not answer.
    Inconclusive(String),
    /// The replica refused what the local tokenizer took: a request its
    /// serving flags turn away (tools without `--enable-auto-tool-choice`,
    /// a prompt over its `--max-model-len`, …). Such a request is never
    /// served, so its ids cannot misroute anything; says nothing either way.
    Refused(String),
}

/// Checks counted by kind (probe, shadow) and verdict.
#[derive(Debug, Default)]
struct Counts {
    probe_agree: AtomicU64,
    probe_mismatch: AtomicU64,
    shadow_agree: AtomicU64,
    shadow_mismatch: AtomicU64,
    inconclusive: AtomicU64,
    refused: AtomicU64,
}

/// One model's gate.
#[derive(Debug)]
pub struct Gate {
    state: AtomicU8,
    /// Why it is closed (the first difference), for logs and `/readyz`.
    detail: Mutex<String>,
    counts: Counts,
    shadow_every: Option<Duration>,
    last_shadow: Mutex<Option<Instant>>,
    shadow_busy: AtomicBool,
}

impl Gate {
    /// A pending gate allowing `shadow_per_second` shadow checks.
    pub fn new(shadow_per_second: f64) -> Self {
        let shadow_every = (shadow_per_second > 0.0 && shadow_per_second.is_finite())
            .then(|| Duration::from_secs_f64(1.0 / shadow_per_second));
        Self {
            state: AtomicU8::new(GateState::Pending.as_u8()),
            detail: Mutex::new(String::new()),
            counts: Counts::default(),
            shadow_every,
            last_shadow: Mutex::new(None),
            shadow_busy: AtomicBool::new(false),
        }
    }

    /// Where it stands.
    pub fn state(&self) -> GateState {
        GateState::from_u8(self.state.load(Ordering::Acquire))
    }

    /// Why it closed (empty unless closed).
    pub fn detail(&self) -> String {
        self.detail.lock().map(|d| d.clone()).unwrap_or_default()
    }

    fn open(&self) {
        // Never reopens a closed gate.
        let _ = self.state.compare_exchange(
            GateState::Pending.as_u8(),
            GateState::Open.as_u8(),
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    fn close(&self, why: &str) -> bool {
        let was = self.state.swap(GateState::Closed.as_u8(), Ordering::AcqRel);
        if let Ok(mut d) = self.detail.lock()
            && d.is_empty()
        {
            why.clone_into(&mut d);
        }
        was != GateState::Closed.as_u8()
    }

    /// Whether a live request may be shadow-checked now (then one is in
    /// flight until [`Gate::shadow_done`]).
    pub fn take_shadow_slot(&self) -> bool {
        let Some(every) = self.shadow_every else {
            return false;
        };
        if self.shadow_busy.load(Ordering::Acquire) {
            return false;
        }
        let Ok(mut last) = self.last_shadow.lock() else {
            return false;
        };
        let now = Instant::now();
        if last.is_some_and(|t| now.saturating_duration_since(t) < every) {
            return false;
        }
        if self.shadow_busy.swap(true, Ordering::AcqRel) {
            return false;
        }
        *last = Some(now);
        true
    }

    fn shadow_done(&self) {
        self.shadow_busy.store(false, Ordering::Release);
    }

    fn count(&self, shadow: bool, verdict: &Verdict) {
        let c = &self.counts;
        let counter = match (shadow, verdict) {
            (_, Verdict::Inconclusive(_)) => &c.inconclusive,
            (_, Verdict::Refused(_)) => &c.refused,
            (false, Verdict::Agree) => &c.probe_agree,
            (false, Verdict::Mismatch(_)) => &c.probe_mismatch,
            (true, Verdict::Agree) => &c.shadow_agree,
            (true, Verdict::Mismatch(_)) => &c.shadow_mismatch,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// Compares local and replica outcomes for one request.
pub fn compare(
    local: &Result<Vec<u32>, TokenizeError>,
    replica: &Result<Vec<u32>, TokenizeError>,
) -> Verdict {
    match (local, replica) {
        (_, Err(TokenizeError::Unavailable(why))) => Verdict::Inconclusive(why.clone()),
        // The local tokenizer declines these and lets a replica tokenize.
        (Err(TokenizeError::Unsupported(_)), _) => Verdict::Agree,
        (Ok(a), Ok(b)) if a == b => Verdict::Agree,
        (Ok(a), Ok(b)) => Verdict::Mismatch(first_difference(a, b)),
        (Err(TokenizeError::Refused { .. }), Err(TokenizeError::Refused { .. })) => Verdict::Agree,
        (Ok(a), Err(e @ TokenizeError::Refused { .. })) => Verdict::Refused(format!(
            "local gave {} ids, the replica refused: {e}",
            a.len()
        )),
        (Ok(a), Err(e)) => Verdict::Mismatch(format!(
            "local gave {} ids, the replica failed: {e}",
            a.len()
        )),
        (Err(e), Ok(b)) => Verdict::Mismatch(format!(
            "local refused ({e}), the replica gave {} ids",
            b.len()
        )),
        (Err(e), Err(_)) => Verdict::Inconclusive(format!("local failed: {e}")),
    }
}

/// Where two id sequences first differ.
pub fn first_difference(local: &[u32], replica: &[u32]) -> String {
    let at = local
        .iter()
        .zip(replica)
        .position(|(a, b)| a != b)
        .unwrap_or(local.len().min(replica.len()));
    let window = |ids: &[u32]| -> Vec<u32> { ids.iter().skip(at).take(4).copied().collect() };
    format!(
        "ids differ at position {at}: local {:?}, replica {:?} (lengths {} and {})",
        window(local),
        window(replica),
        local.len(),
        replica.len()
    )
}

/// The probe set for `model`.
pub fn probes(model: &str) -> Vec<(Api, String)> {
    let m = serde_json::to_string(model).unwrap_or_else(|_| "\"\"".to_owned());
    let text = "Routing keeps a conversation where its cache is. Ünïcödé, 中文, emoji 🚀, tabs\tand  double  spaces,\nnew lines\n\n and trailing space ";
    let long = "All work and no play makes a cache cold. ".repeat(60);
    let chat = |rest: &str| (Api::Chat, format!("{{\"model\":{m},{rest}}}"));
    vec![
        chat(r#""messages":[{"role":"user","content":"Hello, world!"}]"#),
        chat(&format!(
            r#""messages":[{{"role":"system","content":"You are terse."}},{{"role":"user","content":{t}}},{{"role":"assistant","content":"Noted."}},{{"role":"user","content":"And now?"}}]"#,
            t = serde_json::to_string(text).unwrap_or_default()
        )),
        chat(
            r#""messages":[{"role":"user","content":[{"type":"text","text":"first part"},{"type":"text","text":"second part"}]}]"#,
        ),
        chat(
            r#""messages":[{"role":"system","content":"Use tools."},{"role":"user","content":"Weather in Paris?"},{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\": \"Paris\"}"}}]},{"role":"tool","tool_call_id":"call_1","content":"{\"temp\": 21}"}],"tools":[{"type":"function","function":{"name":"get_weather","description":"Weather by city","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}]"#,
        ),
        chat(
            r#""messages":[{"role":"user","content":"No generation prompt."}],"add_generation_prompt":false"#,
        ),
        chat(
            r#""messages":[{"role":"user","content":"Finish this:"},{"role":"assistant","content":"Once upon a"}],"add_generation_prompt":false,"continue_final_message":true"#,
        ),
        chat(
            r#""messages":[{"role":"user","content":"<s> </s> [INST] <|im_start|> <｜User｜> look-alikes"}]"#,
        ),
        chat(&format!(
            r#""messages":[{{"role":"user","content":{}}}]"#,
            serde_json::to_string(&long).unwrap_or_default()
        )),
        (
            Api::Completions,
            format!(r#"{{"model":{m},"prompt":"The quick brown fox jumps over the lazy dog."}}"#),
        ),
        (
            Api::Completions,
            format!(r#"{{"model":{m},"prompt":"  \n\tindented\r\nlines  "}}"#),
        ),
        (
            Api::Completions,
            format!(r#"{{"model":{m},"prompt":"no special tokens","add_special_tokens":false}}"#),
        ),
        (
            Api::Responses,
            format!(r#"{{"model":{m},"instructions":"Be brief.","input":"What is a KV cache?"}}"#),
        ),
        (
            Api::Responses,
            format!(
                r#"{{"model":{m},"input":[{{"role":"user","content":[{{"type":"input_text","text":"Weather?"}}]}},{{"type":"function_call","call_id":"c1","name":"get_weather","arguments":"{{\"city\":\"Oslo\"}}"}},{{"type":"function_call_output","call_id":"c1","output":"cold"}}],"tools":[{{"type":"function","name":"get_weather","parameters":{{"type":"object","properties":{{"city":{{"type":"string"}}}}}}}}]}}"#
            ),
        ),
    ]
}

/// One round of the probe set; the verdict of the round: the first
/// mismatch, else inconclusive if any probe was or none agreed, else agree.
/// Probes the replica refuses by its serving flags (tools, say) are left out.
pub async fn probe_round(shared: &Shared, tokenizers: &Tokenizers, model: &str) -> Verdict {
    let Some(local) = tokenizers.local(model) else {
        return Verdict::Inconclusive("no local tokenizer".to_owned());
    };
    let mut inconclusive = None;
    let mut agreed = 0usize;
    for (api, body) in probes(model) {
        let tokenizer = local.tokenizer.clone();
        let input = body.clone();
        let mine =
            tokio::task::spawn_blocking(move || local_ids(&tokenizer, api, input.as_bytes()))
                .await
                .unwrap_or_else(|e| {
                    Err(TokenizeError::Unavailable(format!("tokenizer task: {e}")))
                });
        let theirs = tokenizers
            .replica_ids(shared, api, model, body.as_bytes())
            .await;
        let verdict = compare(&mine, &theirs);
        local.gate.count(false, &verdict);
        match verdict {
            Verdict::Agree => agreed += 1,
            Verdict::Mismatch(why) => {
                return Verdict::Mismatch(format!("probe {api:?} {body}: {why}"));
            }
            Verdict::Inconclusive(why) => inconclusive = Some(why),
            Verdict::Refused(why) => {
                tracing::debug!(model, probe = %body, reason = %why, "probe refused by the replica; left out");
            }
        }
    }
    match (inconclusive, agreed) {
        (Some(why), _) => Verdict::Inconclusive(why),
        (None, 0) => Verdict::Inconclusive("the replica refused every probe".to_owned()),
        (None, _) => Verdict::Agree,
    }
}

/// Applies a verdict to `model`'s gate (logging a change).
fn settle(tokenizers: &Tokenizers, model: &str, verdict: &Verdict, what: &str) {
    let Some(local) = tokenizers.local(model) else {
        return;
    };
    match verdict {
        Verdict::Agree => {
            if local.gate.state() == GateState::Pending {
                tracing::info!(
                    model,
                    "local tokenizer agrees with the replicas on the probe set; using it"
                );
            }
            local.gate.open();
        }
        Verdict::Mismatch(why) => {
            if local.gate.close(why) {
                tracing::warn!(model, check = what, difference = %why, "local tokenizer differs from the replicas; using the replicas' tokenizer for this model until indexd restarts");
            }
        }
        Verdict::Inconclusive(why) | Verdict::Refused(why) => {
            tracing::debug!(model, check = what, reason = %why, "tokenizer check inconclusive");
        }
    }
}

/// The gate task of `model`: probe rounds at start (retried while
/// inconclusive) and every `gate_interval`, until shutdown.
pub async fn run(shared: Arc<Shared>, model: String) {
    let retry = Duration::from_secs(2);
    loop {
        let tokenizers = &shared.tokenizers;
        let verdict = probe_round(&shared, tokenizers, &model).await;
        settle(tokenizers, &model, &verdict, "probe");
        let pause = match (&verdict, tokenizers.local(&model).map(|l| l.gate.state())) {
            (_, Some(GateState::Closed) | None) => return,
            (Verdict::Inconclusive(_), _) => retry,
            _ => tokenizers.config().gate_interval,
        };
        tokio::select! {
            () = shared.shutdown.cancelled() => return,
            () = tokio::time::sleep(pause) => {}
        }
    }
}

/// Compares a live request's local ids with a replica's, in the background.
pub fn spawn_shadow_check(
    shared: Arc<Shared>,
    model: String,
    api: Api,
    body: Bytes,
    local: Vec<u32>,
) {
    let tasks = shared.tasks.clone();
    tasks.spawn(async move {
        let tokenizers = &shared.tokenizers;
        let theirs = tokenizers.replica_ids(&shared, api, &model, &body).await;
        let verdict = compare(&Ok(local), &theirs);
        if let Some(l) = tokenizers.local(&model) {
            l.gate.count(true, &verdict);
            settle(tokenizers, &model, &verdict, "shadow");
            l.gate.shadow_done();
        }
    });
}

/// The per-model series: gate, checks, cache.
pub fn render_metrics(tokenizers: &Tokenizers, out: &mut String) {
    let models: Vec<_> = tokenizers.locals().collect();
    if models.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "# HELP indexd_tokenizer_gate A local tokenizer's exactness gate: 0 pending, 1 open, 2 closed.\n# TYPE indexd_tokenizer_gate gauge"
    );
    for (model, l) in &models {
        let _ = writeln!(
            out,
            "indexd_tokenizer_gate{{model=\"{}\"}} {}",
            escape(model),
            l.gate.state().as_u8()
        );
    }
    let _ = writeln!(
        out,
        "# HELP indexd_tokenizer_checks_total Comparisons of local and replica ids, by kind and result.\n# TYPE indexd_tokenizer_checks_total counter"
    );
    for (model, l) in &models {
        let c = &l.gate.counts;
        for (kind, result, n) in [
            ("probe", "agree", &c.probe_agree),
            ("probe", "mismatch", &c.probe_mismatch),
            ("shadow", "agree", &c.shadow_agree),
            ("shadow", "mismatch", &c.shadow_mismatch),
            ("any", "inconclusive", &c.inconclusive),
            ("any", "refused", &c.refused),
        ] {
            let _ = writeln!(
                out,
                "indexd_tokenizer_checks_total{{model=\"{}\",kind=\"{kind}\",result=\"{result}\"}} {}",
                escape(model),
                n.load(Ordering::Relaxed)
            );
        }
    }
    let stats: Vec<_> = models
        .iter()
        .map(|(m, l)| (m, l.tokenizer.stats().encoder.cache))
        .collect();
    for (name, kind, help, get) in [
        (
            "indexd_tokenizer_cache_hits_total",
            "counter",
            "Text segments found in the tokenizer cache.",
            (|s: &kvroute_tokenizer::CacheStats| s.hits)
                as fn(&kvroute_tokenizer::CacheStats) -> u64,
        ),
        (
            "indexd_tokenizer_cache_misses_total",
            "counter",
            "Text segments encoded.",
            |s| s.misses,
        ),
        (
            "indexd_tokenizer_cache_evictions_total",
            "counter",
            "Tokenizer cache entries dropped to stay within the bound.",
            |s| s.evictions,
        ),
        (
            "indexd_tokenizer_cache_bytes",
            "gauge",
            "Bytes held by the tokenizer cache.",
            |s| s.bytes,
        ),
        (
            "indexd_tokenizer_cache_capacity_bytes",
            "gauge",
            "The tokenizer cache's bound.",
            |s| s.capacity_bytes,
        ),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (model, s) in &stats {
            let _ = writeln!(out, "{name}{{model=\"{}\"}} {}", escape(model), get(s));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused() -> TokenizeError {
        TokenizeError::Refused {
            status: 400,
            message: "x".into(),
        }
    }

    #[test]
    fn verdicts() {
        assert_eq!(compare(&Ok(vec![1, 2]), &Ok(vec![1, 2])), Verdict::Agree);
        assert_eq!(compare(&Err(refused()), &Err(refused())), Verdict::Agree);
        assert!(matches!(
            compare(&Ok(vec![1, 2, 3]), &Ok(vec![1, 9, 3])),
            Verdict::Mismatch(m) if m.contains("position 1")
        ));
        assert!(matches!(
            compare(&Ok(vec![1]), &Err(refused())),
            Verdict::Refused(_)
        ));
        assert!(matches!(
            compare(&Err(refused()), &Ok(vec![1])),
            Verdict::Mismatch(_)
        ));
        assert!(matches!(
            compare(
                &Ok(vec![1]),
                &Err(TokenizeError::Unavailable("down".into()))
            ),
            Verdict::Inconclusive(_)
        ));
        assert_eq!(
            first_difference(&[1, 2], &[1, 2, 3]),
            "ids differ at position 2: local [], replica [3] (lengths 2 and 3)"
        );
    }

    #[test]
    fn a_closed_gate_never_reopens_and_keeps_its_first_reason() {
        let g = Gate::new(1.0);
        assert_eq!(g.state(), GateState::Pending);
        g.open();
        assert_eq!(g.state(), GateState::Open);
        assert!(g.close("first"));
        assert!(!g.close("second"));
        g.open();
        assert_eq!(g.state(), GateState::Closed);
        assert_eq!(g.detail(), "first");
    }

    #[test]
    fn shadow_slots_are_rate_limited_and_one_at_a_time() {
        let g = Gate::new(1000.0);
        assert!(g.take_shadow_slot());
        assert!(!g.take_shadow_slot(), "one in flight");
        g.shadow_done();
        std::thread::sleep(Duration::from_millis(2));
        assert!(g.take_shadow_slot());
        assert!(!Gate::new(0.0).take_shadow_slot(), "0 disables them");
    }

    #[test]
    fn probes_are_valid_json_naming_the_model() {
        for (_, body) in probes("m\"odel") {
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(v["model"], "m\"odel");
        }
    }
}
