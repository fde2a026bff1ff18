//! The HTTP side: Prometheus `/metrics`, `/healthz` (the process is up),
//! `/readyz` (some replica is healthy and fresh; the body also names each
//! local tokenizer's gate and each hybrid replica's KV cache groups, with
//! any indexd does not model), and the vLLM-compatible tokenizer endpoints of
//! [`crate::tokenize::http`]. With a shared token, every route but the two
//! probes requires it ([`crate::auth`]). [`serve`] accepts and serves the
//! connections, with timeouts and a connection limit.

pub(crate) mod serve;

use std::fmt::Write as _;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;

mod tokenize;

use crate::index::SharedIndex;
use crate::metrics::{gauge, label_value};
use crate::state::{Replica, Shared};
use crate::sync::{lock, read};

/// The router serving `/metrics`, `/healthz`, `/readyz`, `/tokenize` and
/// `/v1/responses/render`.
pub fn router(shared: Arc<Shared>) -> Router {
    let mut guarded = Router::new()
        .route("/metrics", get(metrics))
        .merge(tokenize::routes(&shared));
    if shared.token.is_some() {
        guarded = guarded.route_layer(axum::middleware::from_fn_with_state(
            Arc::clone(&shared),
            crate::auth::http::<Shared>,
        ));
    }
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .merge(guarded)
        .with_state(shared)
}

async fn readyz(State(shared): State<Arc<Shared>>) -> impl IntoResponse {
    let mut body = if shared.is_ready() {
        "ready\n".to_owned()
    } else {
        "no healthy, fresh replica\n".to_owned()
    };
    let now = std::time::Instant::now();
    for (model, local) in shared.tokenizers.locals() {
        let _ = writeln!(body, "tokenizer {model}: {}", local.gate.describe_at(now));
    }
    if !shared.tokenizers.replicas_render() {
        body.push_str("replica tokenizer: no render endpoints (vLLM without --enable-scale-out): chat bodies go to /tokenize, which ignores documents and reasoning_effort; bodies with truncate_prompt_tokens go unrouted\n");
    }
    if let Some(line) = shared.tokenizers.admission.describe(now) {
        let _ = writeln!(body, "{line}");
    }
    if let Some(line) = shared.untokenized.describe(now) {
        let _ = writeln!(body, "{line}");
    }
    let refused_static = shared.metrics.endpoints_refused.get(["self"]);
    let refused_now: Vec<String> = crate::sync::lock(&shared.refused_self)
        .iter()
        .map(ToString::to_string)
        .collect();
    if refused_static > 0 || !refused_now.is_empty() {
        let _ = writeln!(
            body,
            "endpoints refused as indexd's own HTTP listener ({}): {refused_static} since start{}",
            shared.http_addr(),
            if refused_now.is_empty() {
                String::new()
            } else {
                format!("; discovery lists {} now", refused_now.join(", "))
            }
        );
    }
    placement_details(&shared, now, &mut body);
    for (replica, groups, unmodelled) in shared.layouts() {
        // A model with one full-attention group is the common case: only
        // other layouts are listed.
        if !groups.contains(' ') && groups.starts_with("0:full_attention@") {
            continue;
        }
        let _ = write!(body, "kv groups {}: {groups}", replica.id());
        match unmodelled {
            Some(u) => {
                let _ = write!(
                    body,
                    " (group {} {} not modelled: {}; its Picks are approximate)",
                    u.group, u.kind, u.reason
                );
            }
            None => body.push_str(" (modelled)"),
        }
        body.push('\n');
    }
    let status = if shared.is_ready() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, body)
}

/// What the placement rules did that routing by the cost model alone would
/// not have: explorations, barred moves, replicas still filling after they
/// joined.
fn placement_details(shared: &Shared, now: std::time::Instant, body: &mut String) {
    let explorations = shared.metrics.explorations.get();
    if explorations > 0 {
        let _ = writeln!(
            body,
            "explorations: {explorations} new conversations since start went to a replica its \
             prefill speed estimate alone kept from new conversations (starve_after), or to \
             one that joined the fleet and had none yet"
        );
    }
    let cooldown = shared.metrics.moves_barred.get(["cooldown"]);
    let joining = shared.metrics.moves_barred.get(["joining"]);
    if cooldown + joining > 0 {
        let _ = writeln!(
            body,
            "moves barred since start: {cooldown} within move_cooldown of a move, {joining} to a \
             replica still filling after it joined (join_warmup)"
        );
    }
    for replica in crate::sync::read(&shared.registry).all() {
        if let Some(left) = replica.filling_for(now) {
            let _ = writeln!(
                body,
                "replica {} joined: new conversations only, no moves to it for {:.0} s more \
                 (join_warmup)",
                replica.id(),
                left.as_secs_f64().ceil()
            );
        }
    }
}

/// Rendered on the blocking pool: the page reads the index under its lock,
/// which ingest may hold for a whole batch (a purge of a large replica), and
/// a request thread parked on it would stall the Picks queued behind it.
async fn metrics(State(shared): State<Arc<Shared>>) -> impl IntoResponse {
    match tokio::task::spawn_blocking(move || render(&shared)).await {
        Ok(page) => (
            StatusCode::OK,
            [("content-type", "text/plain; version=0.0.4")],
            page,
        ),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [("content-type", "text/plain; charset=utf-8")],
            format!("metrics: {e}\n"),
        ),
    }
}

/// Per model, the pooled prefill fit of its replicas
/// (`indexd_model_prefill_tokens_per_second`, `indexd_model_prefill_samples`).
fn model_prefill(shared: &Shared, replicas: &[Arc<Replica>], prior: f64, out: &mut String) {
    let models: std::collections::BTreeSet<&str> =
        replicas.iter().map(|r| r.config.model.as_str()).collect();
    let pooled: Vec<_> = {
        let registry = read(&shared.registry);
        models
            .iter()
            .map(|m| (*m, registry.pooled_prefill(m, prior)))
            .collect()
    };
    let _ = writeln!(
        out,
        "# HELP indexd_model_prefill_tokens_per_second The model's prefill speed pooled over its replicas' samples (weights.prefill_tokens_per_second until they have enough): what a replica with few samples of its own is assumed to do.\n# TYPE indexd_model_prefill_tokens_per_second gauge"
    );
    for (model, (speed, _)) in &pooled {
        let value = speed.map_or(prior, |s| s.tokens_per_second);
        let _ = writeln!(
            out,
            "indexd_model_prefill_tokens_per_second{{model=\"{}\"}} {value}",
            label_value(model)
        );
    }
    let _ = writeln!(
        out,
        "# HELP indexd_model_prefill_samples Prefill samples pooled over the model's replicas.\n# TYPE indexd_model_prefill_samples gauge"
    );
    for (model, (_, samples)) in &pooled {
        let _ = writeln!(
            out,
            "indexd_model_prefill_samples{{model=\"{}\"}} {samples}",
            label_value(model)
        );
    }
}

/// The full metrics page.
pub fn render(shared: &Shared) -> String {
    let mut out = String::with_capacity(8192);
    shared.metrics.render(&mut out);
    shared.tokenizers.render_metrics(&mut out);
    let totals = shared.index.totals();
    let (entries, keys, bytes, spec) = (
        totals.entries,
        totals.distinct_keys,
        totals.bytes,
        totals.speculative,
    );
    gauge(
        &mut out,
        "indexd_index_entries",
        "Indexed (block, replica) entries.",
        entries as f64,
    );
    gauge(
        &mut out,
        "indexd_index_keys",
        "Distinct (model, block key) pairs.",
        keys as f64,
    );
    gauge(
        &mut out,
        "indexd_index_bytes",
        "Estimated heap bytes of the index.",
        bytes as f64,
    );
    gauge(
        &mut out,
        "indexd_speculative_entries",
        "Speculative (key, replica) entries.",
        spec as f64,
    );
    gauge(
        &mut out,
        "indexd_affinity_entries",
        "Response-id affinity entries.",
        lock(&shared.affinity).len() as f64,
    );
    gauge(
        &mut out,
        "indexd_approximate_entries",
        "Approximate-mode (key, replica) entries.",
        lock(&shared.approximate).len() as f64,
    );
    // Per model and kind, the replicas with a KV cache group indexd does not
    // model (a series while some replica has one).
    let mut unmodelled: std::collections::BTreeMap<(String, String), u32> = Default::default();
    let mut kv_groups: Vec<(String, String, usize)> = Vec::new();
    for (replica, groups, u) in shared.layouts() {
        kv_groups.push((
            replica.id().to_string(),
            replica.config.model.clone(),
            groups.split(' ').count(),
        ));
        if let Some(u) = u {
            *unmodelled
                .entry((replica.config.model.clone(), u.kind))
                .or_default() += 1;
        }
    }
    let _ = writeln!(
        out,
        "# HELP indexd_unmodelled_kv_groups Replicas whose KV cache layout has a group indexd does not model (by the first such group's kind): their Picks are answered approximate.\n# TYPE indexd_unmodelled_kv_groups gauge"
    );
    for ((model, kind), n) in &unmodelled {
        let _ = writeln!(
            out,
            "indexd_unmodelled_kv_groups{{model=\"{}\",kind=\"{}\"}} {n}",
            label_value(model),
            label_value(kind)
        );
    }
    let _ = writeln!(
        out,
        "# HELP indexd_replica_kv_groups KV cache groups the replica's events have shown since its last purge.\n# TYPE indexd_replica_kv_groups gauge"
    );
    for (endpoint, model, n) in &kv_groups {
        let _ = writeln!(
            out,
            "indexd_replica_kv_groups{{endpoint=\"{endpoint}\",model=\"{}\"}} {n}",
            label_value(model)
        );
    }
    let prior = shared.config.weights.prefill_tokens_per_second;
    let replicas = read(&shared.registry).all();
    model_prefill(shared, &replicas, prior, &mut out);
    replica_gauges(&shared.index, &replicas, prior, &mut out);
    out
}

/// Per replica: freshness, health, entries, prefill speed and samples,
/// cache size.
fn replica_gauges(index: &SharedIndex, replicas: &[Arc<Replica>], prior: f64, out: &mut String) {
    for (name, help) in [
        (
            "indexd_replica_fresh",
            "1 when the replica's event stream has no unrecovered gap.",
        ),
        (
            "indexd_replica_healthy",
            "1 when the replica's /metrics scrapes succeed.",
        ),
        ("indexd_replica_entries", "Indexed blocks per replica."),
        (
            "indexd_replica_prefill_tokens_per_second",
            "The replica's prefill speed the cost model uses: fitted from its vLLM prefill histograms, else weights.prefill_tokens_per_second.",
        ),
        (
            "indexd_replica_prefill_own_tokens_per_second",
            "The replica's prefill speed fitted from its own samples alone (0 until it has enough); the speed in use shrinks it toward its model's pooled fit (indexd_model_prefill_tokens_per_second).",
        ),
        (
            "indexd_replica_prefill_samples",
            "Prefill samples (scrape intervals with prefills) in the replica's own fit.",
        ),
        (
            "indexd_replica_prefill_overhead_seconds",
            "The replica's fitted fixed prefill time per request (0 until fitted).",
        ),
        (
            "indexd_replica_cache_blocks",
            "The replica's KV cache size in blocks, from vllm:cache_config_info (0 until seen): with its usage, what the cost model expects evicted before a request is admitted.",
        ),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for r in replicas {
            let speed = r.prefill_speed();
            let (own, samples) = r.own_prefill(prior);
            let value = match name {
                "indexd_replica_fresh" => u8::from(r.is_fresh()) as f64,
                "indexd_replica_healthy" => u8::from(r.is_healthy()) as f64,
                "indexd_replica_prefill_tokens_per_second" => {
                    speed.map_or(prior, |s| s.tokens_per_second)
                }
                "indexd_replica_prefill_own_tokens_per_second" => {
                    own.map_or(0.0, |s| s.tokens_per_second)
                }
                "indexd_replica_prefill_samples" => f64::from(samples),
                "indexd_replica_prefill_overhead_seconds" => {
                    speed.map_or(0.0, |s| s.overhead_seconds)
                }
                "indexd_replica_cache_blocks" => r.cache_blocks().unwrap_or(0.0),
                _ => index.replica_entries(r.slot) as f64,
            };
            let _ = writeln!(
                out,
                "{name}{{endpoint=\"{}\",model=\"{}\"}} {value}",
                r.id(),
                label_value(&r.config.model)
            );
        }
    }
}
