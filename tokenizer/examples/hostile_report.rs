//! Hostile bodies, timed: a Responses body of N consecutive `function_call`
//! items (vLLM merges them into one assistant message), and a completions
//! prompt that is one word of N bytes (no spaces), with the peak RSS it
//! costs. Bodies are written to `OUT_DIR` for `benches/hf_tokenize.py`-style
//! comparisons against vLLM.
//!
//!     cargo run --release -p kvroute-tokenizer --example hostile_report -- MODEL_DIR responses 8192 [OUT_DIR]
//!     cargo run --release -p kvroute-tokenizer --example hostile_report -- MODEL_DIR word 8388608
//!
//! `responses` and `word` use the default (unbounded) entry points; add
//! `--budget` to go through the budgeted ones (`responses_tokens_with`,
//! `completion_tokens_with`) with the model's caps, a 4,096-token budget
//! and a 2-second deadline.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Instant;

use kvroute_tokenizer::{Budget, LoadOptions, ResponsesRequest, TokenizeRequest, Tokenizer};

/// indexd's allocator, so the figures are what indexd serves.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// A Responses body: one user message, then `n` function calls in a row.
pub fn responses_body(n: usize) -> Vec<u8> {
    let mut s = String::from(
        r#"{"model":"m","input":[{"type":"message","role":"user","content":"run the tools"}"#,
    );
    for i in 0..n {
        s.push_str(&format!(
            r#",{{"type":"function_call","call_id":"call_{i:06}","name":"get_weather","arguments":"{{\"city\": \"c{i}\"}}"}}"#
        ));
    }
    s.push_str("]}");
    s.into_bytes()
}

/// A completions body whose prompt is one word of `n` pseudo-random
/// letters and digits.
pub fn word_body(n: usize) -> Vec<u8> {
    let alphabet = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut s = String::with_capacity(n + 32);
    s.push_str(r#"{"model":"m","prompt":""#);
    for _ in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.push(char::from(alphabet[(x % alphabet.len() as u64) as usize]));
    }
    s.push_str(r#""}"#);
    s.into_bytes()
}

/// Peak resident set (VmHWM) in KiB.
fn peak_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dir = std::path::Path::new(&args[1]);
    let what = args[2].as_str();
    let n: usize = args[3].parse().unwrap();
    let budgeted = args.iter().any(|a| a == "--budget");
    let out = args.get(4).filter(|a| !a.starts_with("--"));
    let tok = Tokenizer::load(dir, "m", LoadOptions::default()).unwrap();
    let body = match what {
        "responses" => responses_body(n),
        "word" => word_body(n),
        other => panic!("unknown case {other}"),
    };
    if let Some(out) = out {
        std::fs::create_dir_all(out).unwrap();
        std::fs::write(format!("{out}/{what}-{n}.json"), &body).unwrap();
    }
    let budget = Budget {
        max_tokens: Some(4096),
        deadline: Some(Instant::now() + std::time::Duration::from_secs(2)),
        ..Budget::with_caps(tok.caps())
    };
    let before = peak_kib();
    let t = Instant::now();
    let result: Result<(usize, bool), String> = match (what, budgeted) {
        ("responses", false) => ResponsesRequest::from_json(&body)
            .and_then(|r| tok.render_responses(&r))
            .map(|r| (r.token_ids.len(), false))
            .map_err(|e| e.to_string()),
        ("responses", true) => ResponsesRequest::from_json(&body)
            .and_then(|r| tok.responses_tokens_with(&r, &budget))
            .map(|t| (t.ids.len(), t.truncated))
            .map_err(|e| e.to_string()),
        (_, false) => TokenizeRequest::from_json(&body)
            .and_then(|r| tok.tokenize(&r))
            .map(|r| (r.count, false))
            .map_err(|e| e.to_string()),
        (_, true) => TokenizeRequest::from_json(&body)
            .and_then(|r| tok.completion_tokens_with(&r, &budget))
            .map(|t| (t.ids.len(), t.truncated))
            .map_err(|e| e.to_string()),
    };
    let took = t.elapsed();
    let after = peak_kib();
    let shown = match &result {
        Ok((count, cut)) => format!("{count} tokens{}", if *cut { " (cut)" } else { "" }),
        Err(e) => format!("refused: {}", e.chars().take(120).collect::<String>()),
    };
    println!(
        "{what} {n} ({} bytes){}: {:.1} ms, {shown}; peak RSS +{:.1} MiB ({:.1} MiB)",
        body.len(),
        if budgeted { " budgeted" } else { "" },
        took.as_secs_f64() * 1e3,
        after.saturating_sub(before) as f64 / 1024.0,
        after as f64 / 1024.0,
    );
}
