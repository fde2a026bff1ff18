//! Drives one request through its engine, either to the end (non-streaming) or step by step for
//! a streaming response.

use tokio::sync::mpsc;

use crate::engine::Job;
use crate::generate::Output;
use crate::latency::pause;
use crate::rank::RequestGuard;

/// What a streaming request has reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Prefill done; the first token follows immediately.
    Prefilled { cached_tokens: usize },
    /// Output token `index` is decoded.
    Token(usize),
    /// All tokens out and the request accounted.
    Finished,
}

/// Runs an assigned request to completion; returns the cached prompt tokens.
pub async fn run_to_end(mut guard: RequestGuard, job: &Job, output: &Output) -> usize {
    let engine = guard.engine().clone();
    let pre = engine.prefill(job, &mut guard).await;
    engine.decode_all(output.ids.len()).await;
    engine.finish(job, pre, &output.ids, output.finish_reason);
    pre.cached_tokens
}

/// Runs an assigned request in a task, reporting each step. Dropping the receiver (client gone)
/// stops the request at its next step.
pub fn run_streaming(mut guard: RequestGuard, job: Job, output: Output) -> mpsc::Receiver<Step> {
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(async move {
        let engine = guard.engine().clone();
        let pre = engine.prefill(&job, &mut guard).await;
        if tx
            .send(Step::Prefilled {
                cached_tokens: pre.cached_tokens,
            })
            .await
            .is_err()
        {
            return;
        }
        let step = engine.decode_step();
        for i in 0..output.ids.len() {
            if i > 0 {
                pause(step).await;
            }
            if tx.send(Step::Token(i)).await.is_err() {
                return;
            }
        }
        engine.finish(&job, pre, &output.ids, output.finish_reason);
        drop(guard);
        let _ = tx.send(Step::Finished).await;
    });
    rx
}

/// The receiver as a stream of steps.
pub fn steps(rx: mpsc::Receiver<Step>) -> impl futures::Stream<Item = Step> {
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|s| (s, rx)) })
}
