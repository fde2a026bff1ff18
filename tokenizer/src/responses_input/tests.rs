#![allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]

use super::*;
use crate::template::ContentFormat;

/// vLLM 0.32's answers to generated bodies
/// (tests/reference/gen_responses_input.py).
const FIXTURE: &str = include_str!("../../tests/fixtures/responses_input.jsonl");

#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    Valid,
    Invalid,
    /// Declined locally: a replica answers.
    Declined,
}

/// The stages vLLM's answer covers: the validation and the conversion,
/// then the chat parser.
fn native(body: &Value) -> (Verdict, String) {
    let verdict = |e: RequestError| {
        let v = if e.is_client_error() {
            Verdict::Invalid
        } else {
            Verdict::Declined
        };
        (v, e.to_string())
    };
    let converted = match crate::responses::convert(body) {
        Ok(c) => c,
        Err(e) => return verdict(e),
    };
    match crate::responses::conversation(converted.messages, converted.late, ContentFormat::String)
    {
        Ok(_) => (Verdict::Valid, String::new()),
        Err(e) => verdict(e),
    }
}

fn body(text: &str) -> Value {
    crate::loads::parse(text.as_bytes()).unwrap()
}

/// Every body vLLM answers with a 400 is refused and every one it takes is
/// taken; every one it fails on (a 500) is declined, so that a replica
/// answers it, and so are those with images or a role that is not a string
/// (not rendered here), whatever vLLM answers.
#[test]
fn refuses_what_vllm_refuses_and_takes_what_it_takes() {
    let mut wrong = Vec::new();
    let mut statuses = std::collections::BTreeMap::new();
    for line in FIXTURE.lines() {
        let at = line.find(", \"body\": ").expect("a body");
        let head: serde_json::Value = serde_json::from_str(&format!("{}}}", &line[..at])).unwrap();
        let text = line[at + ", \"body\": ".len()..].strip_suffix('}').unwrap();
        let status = head["status"].as_u64().unwrap();
        *statuses.entry(status).or_insert(0usize) += 1;
        let (got, why) = native(&body(text));
        let declined_by_design = why.contains("multimodal") || why.contains("role that is not");
        let fine = match (status, &got) {
            (200, Verdict::Valid) | (400, Verdict::Invalid) | (500, Verdict::Declined) => true,
            (_, Verdict::Declined) => declined_by_design,
            _ => false,
        };
        if !fine {
            wrong.push(format!(
                "#{}: vLLM {status} ({}), here {got:?} ({why}): {text}",
                head["id"], head["error"]
            ));
        }
    }
    let total: usize = statuses.values().sum();
    let count = |s: u64| statuses.get(&s).copied().unwrap_or(0);
    assert!(
        total >= 400 && count(200) >= 100 && count(400) >= 100,
        "{statuses:?}"
    );
    assert!(
        wrong.is_empty(),
        "{} of {total} bodies differ:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
}

fn verdict_of(items: &str) -> Verdict {
    native(&body(&format!(r#"{{"input": [{items}]}}"#))).0
}

#[test]
fn required_fields_and_types() {
    use Verdict::*;
    for (items, want) in [
        (r#"{"role": "user", "content": "hi"}"#, Valid),
        (r#"{"role": "user"}"#, Invalid),
        (r#"{"role": "critic", "content": "hi"}"#, Invalid),
        (r#"{"role": "user", "content": 5}"#, Invalid),
        (
            r#"{"role": "user", "content": [{"type": "text", "text": "x"}]}"#,
            Invalid,
        ),
        (r#"{"role": "user", "content": "hi", "extra": [1]}"#, Valid),
        (
            r#"{"type": "function_call", "name": "f", "arguments": "{}"}"#,
            Invalid,
        ),
        (
            r#"{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}"#,
            Invalid,
        ),
        (
            r#"{"type": "function_call", "call_id": "c", "name": "f", "arguments": "", "async": "yes"}"#,
            Valid,
        ),
        (
            r#"{"type": "function_call_output", "call_id": "c"}"#,
            Invalid,
        ),
        (r#"{"type": "function_call_output", "output": "42"}"#, Valid),
        (
            r#"{"type": "function_call_output", "call_id": "c", "output": 5}"#,
            Invalid,
        ),
        (r#"{"type": "reasoning"}"#, Invalid),
        (r#"{"type": "reasoning", "summary": []}"#, Valid),
        (
            r#"{"type": "reasoning", "summary": [], "id": null}"#,
            Invalid,
        ),
        (
            r#"{"type": "custom_tool_call", "call_id": "c", "name": "f"}"#,
            Invalid,
        ),
        (
            r#"{"type": "bogus", "role": "user", "content": "hi"}"#,
            Invalid,
        ),
        (r#"{"type": "item_reference", "id": "r"}"#, Invalid),
        (r#"{"id": "r", "role": "user", "content": "hi"}"#, Valid),
        (
            r#"{"type": "mcp_call", "role": "user", "content": "hi"}"#,
            Invalid,
        ),
    ] {
        assert_eq!(verdict_of(items), want, "{items}");
    }
}

#[test]
fn assistant_messages_as_vllm_reads_them() {
    use Verdict::*;
    for (items, want) in [
        // The output message model, with vLLM's fill-in.
        (
            r#"{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x"}]}"#,
            Valid,
        ),
        (
            r#"{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x", "annotations": "s"}]}"#,
            Invalid,
        ),
        // …which vLLM's conversion fails on when no output text is first.
        (
            r#"{"type": "message", "role": "assistant", "content": []}"#,
            Declined,
        ),
        (
            r#"{"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}"#,
            Declined,
        ),
        // Without type, output text is no easy message part.
        (
            r#"{"role": "assistant", "content": [{"type": "output_text", "text": "x"}]}"#,
            Invalid,
        ),
        // The output message TypedDict, read late: a string's characters
        // are no parts, an empty object is none.
        (
            r#"{"type": "message", "role": "assistant", "id": "m", "status": "completed", "content": "abc"}"#,
            Invalid,
        ),
        (
            r#"{"type": "message", "role": "assistant", "id": "m", "status": "completed", "content": {}}"#,
            Valid,
        ),
        (
            r#"{"type": "message", "role": "assistant", "id": "m", "status": "completed", "content": [{"type": "input_file"}]}"#,
            Invalid,
        ),
        (
            r#"{"type": "message", "role": "assistant", "id": "m", "status": "completed", "content": [{"type": "input_text", "text": "x"}]}"#,
            Valid,
        ),
    ] {
        assert_eq!(verdict_of(items), want, "{items}");
    }
}

#[test]
fn an_object_input_is_its_keys() {
    assert_eq!(native(&body(r#"{"input": {}}"#)).0, Verdict::Valid);
    assert_eq!(native(&body(r#"{"input": {"a": 1}}"#)).0, Verdict::Invalid);
}

#[test]
fn lax_scalars() {
    let b = |t: &str| body(t);
    assert!(lax_int(&b("3")) && lax_int(&b("\" 3 \"")) && lax_int(&b("\"3.00\"")));
    assert!(lax_int(&b("true")) && lax_int(&b("3.0")));
    assert!(!lax_int(&b("1.5")) && !lax_int(&b("\"1e3\"")) && !lax_int(&b("\"x\"")));
    assert!(lax_bool(&b("\"Yes\"")) && lax_bool(&b("0")) && !lax_bool(&b("2")));
    assert!(lax_float(&b("\"nan\"")) && lax_float(&b("true")) && !lax_float(&b("\"x\"")));
}
