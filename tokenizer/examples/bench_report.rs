//! p50s, from request bytes to token ids, of a cold ~32k-token chat
//! tokenization and of continuation turns (one new message appended to the
//! cached conversation: a typical ~500-token turn, and a short one), for one
//! model directory. Writes the cold and continuation bodies to
//! `OUT_PREFIX-cold.json` and `OUT_PREFIX-continuation.json` for
//! `benches/hf_tokenize.py`.
//!
//!     cargo run --release -p kvroute-tokenizer --example bench_report -- MODEL_DIR OUT_PREFIX

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "../benches/common/conversation.rs"]
mod conversation;

use std::time::Instant;

use kvroute_tokenizer::{LoadOptions, TokenizeRequest, Tokenizer};

/// indexd's allocator, so the figures are what indexd serves.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn p50(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Times `n` continuations whose new message is `make(i)`.
fn continuation(
    tok: &Tokenizer,
    msgs: &[serde_json::Value],
    n: usize,
    make: impl Fn(usize) -> String,
) -> (f64, f64, usize, Vec<u8>) {
    let (mut total, mut parse, mut tokens, mut first) = (Vec::new(), Vec::new(), 0, Vec::new());
    for i in 0..n {
        let mut m = msgs.to_vec();
        m.push(serde_json::json!({"role": "user", "content": make(i)}));
        let body = conversation::body(&m);
        let t = Instant::now();
        let req = TokenizeRequest::from_json(&body).unwrap();
        let parsed = t.elapsed();
        tokens = std::hint::black_box(tok.tokenize(&req).unwrap()).count;
        total.push(t.elapsed().as_secs_f64() * 1e3);
        parse.push(parsed.as_secs_f64() * 1e3);
        if i == 0 {
            first = body;
        }
    }
    (p50(total), p50(parse), tokens, first)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (dir, out) = (std::path::Path::new(&args[1]), &args[2]);
    let t0 = Instant::now();
    let cold = Tokenizer::load(
        dir,
        "cold",
        LoadOptions {
            cache_bytes: 0,
            ..LoadOptions::default()
        },
    )
    .unwrap();
    let load_ms = t0.elapsed().as_secs_f64() * 1e3;
    let warm = Tokenizer::load(dir, "warm", LoadOptions::default()).unwrap();
    let mut turns = 40;
    let msgs = loop {
        let msgs = conversation::messages(turns);
        let req = TokenizeRequest::from_json(&conversation::body(&msgs)).unwrap();
        if cold.tokenize(&req).unwrap().count >= 32_000 {
            break msgs;
        }
        turns += 2;
    };
    let base = conversation::body(&msgs);
    std::fs::write(format!("{out}-cold.json"), &base).unwrap();
    let mut cold_ms = Vec::new();
    let mut n = 0;
    for _ in 0..21 {
        let t = Instant::now();
        n = std::hint::black_box(
            cold.tokenize(&TokenizeRequest::from_json(&base).unwrap())
                .unwrap(),
        )
        .count;
        cold_ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let c = p50(cold_ms);
    warm.tokenize(&TokenizeRequest::from_json(&base).unwrap())
        .unwrap();
    let (k, kp, kn, body) =
        continuation(&warm, &msgs, 301, |i| conversation::user_turn(10_000 + i));
    std::fs::write(format!("{out}-continuation.json"), body).unwrap();
    let (s, sp, sn, _) = continuation(&warm, &msgs, 301, |i| {
        format!("Now run the tests again ({i}).")
    });
    let name = dir
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    println!(
        "| {name} | {n} | {c:.2} ms | {kn} (+{}) | {k:.3} ms ({kp:.3} parse) | 1/{:.0} | {sn} (+{}) | {s:.3} ms ({sp:.3} parse) | {load_ms:.0} ms |",
        kn - n,
        c / k,
        sn - n
    );
    let st = warm.stats().encoder.cache;
    eprintln!(
        "{name}: cache hits {} misses {} bytes {} entries {}",
        st.hits, st.misses, st.bytes, st.entries
    );
}
