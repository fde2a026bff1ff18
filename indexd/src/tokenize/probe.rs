//! The gate's evidence: the probe set ([`probes`]), a probe round against a
//! replica ([`probe_round`]), the comparison of two outcomes ([`compare`])
//! and the task that runs the rounds ([`run`]): at start (retried while
//! inconclusive), every `gate_interval` while the gate is open, and while it
//! is closed after a pause that doubles with each strike
//! ([`super::gate`]'s rules; a gate closed by live requests starts that
//! pause at once).
//!
//! A probe the replica cannot answer (unreachable, 5xx) proves nothing: the
//! round is retried shortly. A probe the replica refuses (4xx) while the
//! local tokenizer takes it is left out of the round (and counted as
//! `result="refused"`): replicas refuse by their serving flags (tools
//! without `--enable-auto-tool-choice`, a shorter `--max-model-len`), and a
//! request a replica refuses is never served, so its ids misroute nothing.
//! A round needs at least one agreeing probe to count as clean.
//!
//! Messages probes are compared twice: their ids with the replica's
//! `/tokenize` of the chat body they convert to (the conversion's own
//! template-free form), and their count with the replica's
//! `/v1/messages/count_tokens`, which runs vLLM's own conversion.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::{Api, Limits, Replicas, TokenizeError, Tokenizers, local_ids};

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

/// Compares local and replica outcomes for one request.
pub fn compare(
    local: &Result<Vec<u32>, TokenizeError>,
    replica: &Result<Vec<u32>, TokenizeError>,
) -> Verdict {
    match (local, replica) {
        (_, Err(TokenizeError::Unavailable(why))) => Verdict::Inconclusive(why.clone()),
        // indexd could not ask the replica (a Messages body that needs the
        // model's template, with none here): nothing was compared.
        (_, Err(TokenizeError::Unsupported(why))) => {
            Verdict::Inconclusive(format!("not asked of a replica: {why}"))
        }
        (Err(TokenizeError::Cancelled), _) | (_, Err(TokenizeError::Cancelled)) => {
            Verdict::Inconclusive("cancelled".to_owned())
        }
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

/// Compares the local ids' count with a replica's `count_tokens`.
pub fn compare_count(local: usize, replica: &Result<usize, TokenizeError>) -> Verdict {
    match replica {
        Ok(n) if *n == local => Verdict::Agree,
        Ok(n) => Verdict::Mismatch(format!(
            "local gave {local} ids, the replica's count_tokens {n}"
        )),
        Err(TokenizeError::Refused { .. }) => Verdict::Refused(format!(
            "local gave {local} ids, the replica refused count_tokens"
        )),
        Err(e) => Verdict::Inconclusive(format!("count_tokens: {e}")),
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
            Api::Messages,
            format!(
                r#"{{"model":{m},"max_tokens":64,"system":[{{"type":"text","text":"You are terse. "}},{{"type":"text","text":"Cite files."}}],"messages":[{{"role":"user","content":{t}}},{{"role":"assistant","content":"Noted."}},{{"role":"user","content":[{{"type":"text","text":"And now?"}}]}}]}}"#,
                t = serde_json::to_string(text).unwrap_or_default()
            ),
        ),
        (
            Api::Messages,
            format!(
                r#"{{"model":{m},"max_tokens":64,"messages":[{{"role":"user","content":"Weather in Paris?"}},{{"role":"assistant","content":[{{"type":"tool_use","id":"toolu_1","name":"get_weather","input":{{"city":"Paris"}}}}]}},{{"role":"user","content":[{{"type":"tool_result","tool_use_id":"toolu_1","content":"21 C"}},{{"type":"text","text":"Thanks."}}]}}],"tools":[{{"name":"get_weather","description":"Weather by city","input_schema":{{"type":"object","properties":{{"city":{{"type":"string"}}}},"required":["city"]}}}}]}}"#
            ),
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
pub async fn probe_round(replicas: &dyn Replicas, tokenizers: &Tokenizers, model: &str) -> Verdict {
    let Some(local) = tokenizers.local(model) else {
        return Verdict::Inconclusive("no local tokenizer".to_owned());
    };
    let mut inconclusive = None;
    let mut agreed = 0usize;
    for (api, body) in probes(model) {
        let tokenizer = local.tokenizer.clone();
        let input = body.clone();
        let mine = tokio::task::spawn_blocking(move || {
            local_ids(&tokenizer, api, input.as_bytes(), &Limits::none()).map(|l| l.ids)
        })
        .await
        .unwrap_or_else(|e| Err(TokenizeError::Unavailable(format!("tokenizer task: {e}"))));
        let theirs = tokenizers
            .replica_ids(replicas, api, model, body.as_bytes())
            .await;
        let mut verdict = compare(&mine, &theirs);
        if api == Api::Messages
            && verdict == Verdict::Agree
            && let Ok(ids) = &mine
        {
            let counted = tokenizers
                .replica_count_tokens(replicas, model, body.as_bytes())
                .await;
            verdict = compare_count(ids.len(), &counted);
        }
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

/// The gate task of `model`: probe rounds until shutdown, each verdict
/// applied to the gate, the pause between rounds the gate's to say.
pub async fn run(
    tokenizers: Arc<Tokenizers>,
    replicas: Arc<dyn Replicas>,
    shutdown: CancellationToken,
    model: String,
) {
    let retry = Duration::from_secs(2);
    loop {
        let Some(local) = tokenizers.local(&model) else {
            return;
        };
        let verdict = probe_round(replicas.as_ref(), &tokenizers, &model).await;
        if let Verdict::Inconclusive(why) | Verdict::Refused(why) = &verdict {
            tracing::debug!(model, reason = %why, "tokenizer probe round inconclusive");
        }
        local.gate.probe_round(&verdict, Instant::now());
        let mut pause = local
            .gate
            .pause(matches!(verdict, Verdict::Inconclusive(_)), retry);
        // A change of state meanwhile (live requests closing the gate)
        // starts the pause the new state asks for.
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(pause) => break,
                () = local.gate.changed() => pause = local.gate.pause(false, retry),
            }
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
    fn probes_are_valid_json_naming_the_model() {
        for (_, body) in probes("m\"odel") {
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(v["model"], "m\"odel");
        }
    }
}
