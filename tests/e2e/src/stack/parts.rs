//! How each part of a [`super::Stack`] is configured and started: the mock
//! replicas, indexd (in process, on TCP or its Unix socket, with or without a
//! token) and Envoy's bootstrap.

use std::net::SocketAddr;
use std::time::Duration;

use indexd::ListenAddr;
use serde_json::json;
use tokio::runtime::Runtime;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::membership::{DISCOVERY_INTERVAL, Files};
use super::{DECISION_HEADER, LISTENER, OVERRIDE_HEADER, Routing, StackOptions, setup};
use crate::envoy::{
    cluster_route, eds_cluster, http_cluster, http_listener, indexd_cluster, inference_cluster,
    kvroute_filters,
};
use crate::{EnvoyConfig, HarnessError, artifacts};

/// A running in-process indexd.
pub(super) struct RunningIndexd {
    pub(super) stop: CancellationToken,
    pub(super) task: JoinHandle<Result<(), indexd::StartError>>,
    pub(super) handle: indexd::Handle,
    pub(super) http: SocketAddr,
}

pub(super) fn mock_config(options: &StackOptions) -> mock_vllm::Config {
    let mut config = mock_vllm::Config {
        served_model_names: vec![options.model.clone()],
        lora_modules: options.adapters.clone(),
        block_size: options.block_size,
        num_gpu_blocks: options.num_gpu_blocks,
        default_max_tokens: options.default_max_tokens,
        chat_template: options.chat_template,
        reasoning_tokens: options.reasoning_tokens,
        // One hash seed for all replicas, as a fleet started with one
        // PYTHONHASHSEED would have; indexd must not depend on it either way.
        hash_seed: Some("kvroute-e2e".into()),
        data_parallel_size: options.data_parallel_size,
        max_model_len: options.max_model_len,
        kv_cache_layout: options.kv_cache_layout.clone(),
        max_num_batched_tokens: options.max_num_batched_tokens,
        ..mock_vllm::Config::default()
    };
    config.latency.time_scale = options.time_scale;
    config
}

/// A 2-thread runtime, its threads named `label` when given (their CPU time
/// recorded as they exit: [`crate::threads`]).
pub(super) fn runtime(label: Option<&str>) -> Result<Runtime, HarnessError> {
    // KVROUTE_E2E_LOG=indexd=debug,mock_vllm=info shows the in-process
    // components' logs on stderr.
    if let Ok(filter) = std::env::var("KVROUTE_E2E_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .try_init();
    }
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(label) = label {
        let name = label.to_owned();
        builder
            .thread_name(label)
            .on_thread_stop(move || crate::threads::record_exit(&name));
    }
    builder
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| HarnessError::io("tokio runtime", e))
}

/// The replicas' clusters in Envoy: inference (`override_host`) and the
/// tokenizer's (for `tokenize_at: cluster`).
pub(super) const REPLICA_CLUSTERS: [&str; 2] = ["vllm", "vllm_tokenizer"];

/// The endpoints indexd knows a mock replica by: one, or one per
/// data-parallel rank (same address, its own event stream).
pub(super) fn mock_endpoints(
    options: &StackOptions,
    replica: &mock_vllm::Handle,
) -> Vec<indexd::EndpointConfig> {
    if options.data_parallel_size <= 1 {
        return vec![endpoint(
            options,
            replica.http_addr(),
            replica.events_endpoint().map(|e| (e.to_owned(), false)),
            replica.replay_endpoint().map(str::to_owned),
        )];
    }
    let replays = replica.replay_endpoints();
    replica
        .events_endpoints()
        .into_iter()
        .map(|(rank, events)| {
            let replay = replays
                .iter()
                .find(|(k, _)| *k == rank)
                .map(|(_, e)| e.clone());
            let mut e = endpoint(options, replica.http_addr(), Some((events, false)), replay);
            e.id.rank = Some(rank);
            e
        })
        .collect()
}

/// One replica as indexd knows it; `events` is `(endpoint, indexd binds)`.
pub(super) fn endpoint(
    options: &StackOptions,
    http: SocketAddr,
    events: Option<(String, bool)>,
    replay: Option<String>,
) -> indexd::EndpointConfig {
    let mut endpoint = indexd::EndpointConfig::new(http, options.model.clone());
    endpoint.adapters = options.adapters.clone();
    if let Some((events, bind)) = events {
        endpoint.events = Some(events);
        endpoint.events_bind = bind;
    }
    endpoint.replay = replay;
    endpoint.metrics_url = indexd::HttpUrl::parse(&format!("http://{http}/metrics"));
    endpoint
}

/// indexd's config; `dir` holds the token file, if any. With `membership`
/// the endpoints come from its discovery file instead (none static).
pub(super) fn indexd_config(
    options: &StackOptions,
    endpoints: &[indexd::EndpointConfig],
    grpc: ListenAddr,
    dir: &std::path::Path,
    membership: Option<&Files>,
) -> indexd::Config {
    let mut config = match membership {
        Some(files) => {
            let mut config = indexd::Config::new(Vec::new());
            config.discovery_file = Some(files.discovery_path());
            config.discovery_interval = DISCOVERY_INTERVAL;
            config
        }
        None => indexd::Config::new(endpoints.to_vec()),
    };
    config.grpc_listen = grpc;
    if options.indexd_token.is_some() {
        config.access.auth_token_file = Some(dir.join("token"));
    }
    if let Some((rate, burst)) = options.observe_limit
        && let (Some(rate), Some(burst)) = (
            std::num::NonZeroU32::new(rate),
            std::num::NonZeroU32::new(burst),
        )
    {
        config.access.observe_rate = rate;
        config.access.observe_burst = burst;
    }
    config.http_listen = SocketAddr::from(([127, 0, 0, 1], 0));
    config.scrape_interval = options.scrape_interval;
    if let Some(ttl) = options.indexd_speculative_ttl {
        config.speculative_ttl = ttl;
    }
    config.seed = Some(options.seed);
    if let Some(bs) = kvroute_proto::BlockSize::new(options.block_size) {
        config.block_size = bs;
    }
    config.tokenize.tokenizers = options.tokenizers.clone();
    if let Some(rate) = options.indexd_shadow_per_second {
        config.tokenize.gate.shadow_per_second = rate;
    }
    if let Some(margin) = options.indexd_balance_margin {
        config.weights.balance_margin = margin;
    }
    if let Some(timeout) = options.indexd_replica_timeout {
        config.tokenize.replica_timeout = timeout;
    }
    config
}

pub(super) fn start_indexd(
    runtime: &Runtime,
    config: indexd::Config,
) -> Result<(RunningIndexd, ListenAddr), HarnessError> {
    let bound = runtime
        .block_on(indexd::Server::bind(config))
        .map_err(|e| setup("indexd", e))?;
    let grpc = bound.grpc_addr();
    let http = bound.http_addr();
    let handle = bound.handle();
    let stop = CancellationToken::new();
    let task = runtime.spawn(bound.serve(stop.clone()));
    Ok((
        RunningIndexd {
            stop,
            task,
            handle,
            http,
        },
        grpc,
    ))
}

/// Envoy's bootstrap; with `membership` the replicas' clusters take their
/// hosts from the EDS files.
pub(super) fn envoy_config(
    options: &StackOptions,
    replicas: &[SocketAddr],
    indexd: &ListenAddr,
    membership: Option<&Files>,
) -> Result<EnvoyConfig, HarnessError> {
    let [inference, tokenizer] = REPLICA_CLUSTERS;
    let route = cluster_route(inference, Duration::from_secs(120));
    let mut clusters = vec![
        inference_cluster(inference, replicas, OVERRIDE_HEADER),
        http_cluster(tokenizer, replicas),
    ];
    if let Some(files) = membership {
        for cluster in &mut clusters {
            let name = cluster["name"].as_str().unwrap_or_default().to_owned();
            *cluster = eds_cluster(cluster.take(), &files.eds_path(&name), &files.eds_dir());
        }
    }
    let filters = match options.routing {
        Routing::LeastRequest => vec![],
        Routing::Precise | Routing::Approximate => {
            clusters.push(indexd_cluster("kvroute_indexd", indexd));
            // Picks carry the request body and indexd tokenizes it (the
            // mock's `/tokenize`: no local tokenizer for the mock model).
            // `filter_overrides` may choose the two-call path instead:
            // {"tokenize_at": "cluster", "tokenizer_cluster": "vllm_tokenizer"}.
            let mut plugin = json!({
                "index_cluster": "kvroute_indexd",
                "block_size": options.block_size,
                "decision_header": DECISION_HEADER,
                "mode": if options.routing == Routing::Precise { "precise" } else { "approximate" },
            });
            if let (Some(plugin), Some(token)) = (plugin.as_object_mut(), &options.indexd_token) {
                plugin.insert("index_token".into(), json!(token));
            }
            if let (Some(plugin), Some(extra)) =
                (plugin.as_object_mut(), options.filter_overrides.as_object())
            {
                for (k, v) in extra {
                    plugin.insert(k.clone(), v.clone());
                }
            }
            kvroute_filters(&artifacts::filter_wasm()?, &plugin)
        }
    };
    let mut listener = http_listener(LISTENER, filters, vec![route]);
    listener["per_connection_buffer_limit_bytes"] = json!(options.buffer_limit_bytes);
    let config = EnvoyConfig::new(vec![listener], clusters);
    Ok(match membership {
        Some(_) => config.with_node("kvroute-e2e", "kvroute-e2e"),
        None => config,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_labelled_runtime_counts_its_exited_threads() {
        let label = "parts-exit";
        let before = crate::threads::exited_cpu_ns()
            .get(label)
            .copied()
            .unwrap_or(0);
        let rt = runtime(Some(label)).unwrap();
        rt.block_on(async {
            tokio::task::spawn_blocking(|| {
                let start = std::time::Instant::now();
                while crate::threads::this_thread_cpu_ms().unwrap_or(0) < 30
                    && start.elapsed() < std::time::Duration::from_secs(10)
                {
                    std::hint::black_box((0..1_000u64).sum::<u64>());
                }
            })
            .await
            .unwrap();
        });
        drop(rt);
        let after = crate::threads::exited_cpu_ns()
            .get(label)
            .copied()
            .unwrap_or(0);
        assert!(after >= before + 30_000_000, "{before} → {after}");
    }
}
