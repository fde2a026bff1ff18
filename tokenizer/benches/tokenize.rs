//! Cold tokenization of a ~32k-token chat against a continuation turn (one
//! new message appended to the cached conversation), for both test models;
//! and a first turn on a new 42 KB system prompt (16.6k tokens for
//! tiny-llama, 12.5k for tiny-deepseek) alone against eight such first turns
//! (one system prompt, eight user messages) tokenized at once.
//! Model directories as in the tests ($KVROUTE_VLLM_MODEL,
//! $KVROUTE_VLLM_MODEL2; `bash .ci/deps.sh` builds them).
//!
//!     cargo bench -p kvroute-tokenizer --bench tokenize

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[path = "common/conversation.rs"]
mod conversation;

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use kvroute_tokenizer::{LoadOptions, TokenizeRequest, Tokenizer};

/// indexd's allocator, so the figures are what indexd serves.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn model(var: &str, default: &str) -> PathBuf {
    std::env::var_os(var).map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(default)
    })
}

/// Turns giving at least 32k tokens.
fn turns_for_32k(tok: &Tokenizer) -> usize {
    let mut turns = 40;
    loop {
        let req = TokenizeRequest::from_json(&conversation::body(&conversation::messages(turns)))
            .unwrap();
        if tok.tokenize(&req).unwrap().count >= 32_000 {
            return turns;
        }
        turns += 4;
    }
}

fn bench(c: &mut Criterion) {
    for (name, dir) in [
        (
            "tiny-llama",
            model("KVROUTE_VLLM_MODEL", ".cache/kvroute/tiny-llama"),
        ),
        (
            "tiny-deepseek",
            model("KVROUTE_VLLM_MODEL2", ".cache/kvroute/tiny-deepseek"),
        ),
    ] {
        let cold = Tokenizer::load(
            &dir,
            name,
            LoadOptions {
                cache_bytes: 0,
                ..LoadOptions::default()
            },
        )
        .unwrap_or_else(|e| panic!("{e}: run `bash .ci/deps.sh` first"));
        let warm = Tokenizer::load(&dir, name, LoadOptions::default()).unwrap();
        let msgs = conversation::messages(turns_for_32k(&cold));
        let base = conversation::body(&msgs);
        warm.tokenize(&TokenizeRequest::from_json(&base).unwrap())
            .unwrap();

        let mut group = c.benchmark_group(name);
        group.sample_size(20);
        group.bench_function("cold 32k chat", |b| {
            b.iter(|| {
                cold.tokenize(&TokenizeRequest::from_json(&base).unwrap())
                    .unwrap()
            })
        });
        let next = AtomicUsize::new(1_000_000);
        group.sample_size(100);
        group.bench_function("continuation (parse + render + encode)", |b| {
            b.iter_batched(
                || {
                    // A message never seen before, each iteration.
                    let mut m = msgs.clone();
                    let t = next.fetch_add(1, Ordering::Relaxed);
                    m.push(
                        serde_json::json!({"role": "user", "content": conversation::user_turn(t)}),
                    );
                    conversation::body(&m)
                },
                |body| {
                    warm.tokenize(&TokenizeRequest::from_json(&body).unwrap())
                        .unwrap()
                },
                BatchSize::PerIteration,
            )
        });
        let fresh = AtomicUsize::new(2_000_000);
        let first_turns = |n: usize| {
            let session = fresh.fetch_add(1, Ordering::Relaxed);
            let system: String = (0..24)
                .map(|t| conversation::user_turn(session * 100 + t))
                .collect();
            (0..n)
                .map(|k| {
                    conversation::body(&[
                        serde_json::json!({"role": "system", "content": system}),
                        serde_json::json!({"role": "user", "content": conversation::assistant_turn(k)}),
                    ])
                })
                .collect::<Vec<_>>()
        };
        group.sample_size(20);
        group.bench_function("first turn, new 42 KB system prompt", |b| {
            b.iter_batched(
                || first_turns(1),
                |bodies| {
                    warm.tokenize(&TokenizeRequest::from_json(&bodies[0]).unwrap())
                        .unwrap()
                },
                BatchSize::PerIteration,
            )
        });
        group.bench_function("8 first turns at once, one new 42 KB system prompt", |b| {
            b.iter_batched(
                || first_turns(8),
                |bodies| {
                    let start = std::sync::Barrier::new(bodies.len());
                    std::thread::scope(|scope| {
                        for body in &bodies {
                            let (start, warm) = (&start, &warm);
                            scope.spawn(move || {
                                start.wait();
                                warm.tokenize(&TokenizeRequest::from_json(body).unwrap())
                                    .unwrap()
                            });
                        }
                    });
                },
                BatchSize::PerIteration,
            )
        });
        group.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
