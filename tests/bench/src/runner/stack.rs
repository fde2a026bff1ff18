//! The stack a profile runs on: fresh mock replicas and gateways per
//! profile, or fresh gateways in front of a real vLLM fleet; and the
//! replicas as the runner and the peer routers reach them.

use kvroute_e2e::{Routing, Stack, StackOptions};

use super::{MODEL, Profile, ReplicaRef, RunOptions};
use crate::fleet::{self, Fleet};
use crate::peers::Worker;
use crate::workload::Workload;
use crate::{BenchError, load_cpu};

/// Starts the profile's stack on the mock: replicas, gateways, and the
/// replicas as peers and the runner reach them.
pub(super) fn mock_stack(
    workload: &Workload,
    profile: Profile,
    options: RunOptions,
) -> Result<(Stack, Vec<ReplicaRef>, Vec<Worker>), BenchError> {
    let drop_reasoning = workload.reasoning_tokens > 0;
    let defaults = StackOptions::default();
    let stack = Stack::start(StackOptions {
        replicas: workload.replicas,
        model: MODEL.into(),
        block_size: workload.block_size,
        num_gpu_blocks: workload.gpu_blocks,
        time_scale: options.time_scale.unwrap_or(workload.time_scale),
        routing: profile.routing(),
        seed: options.seed,
        chat_template: if drop_reasoning {
            mock_vllm::ChatTemplate::DropReasoning
        } else {
            mock_vllm::ChatTemplate::RoleMarkers
        },
        reasoning_tokens: workload.reasoning_tokens,
        gateways: workload.gateways.max(1),
        filter_overrides: profile.filter_overrides(&defaults),
        kv_cache_layout: workload.kv_cache_layout.clone(),
        max_num_batched_tokens: workload.max_num_batched_tokens,
        max_model_len: workload.mock_max_model_len(defaults.max_model_len),
        indexd_speculative_ttl: profile.speculative_ttl(),
        indexd_shadow_per_second: profile.shadow_per_second(),
        indexd_balance_margin: profile.balance_margin(),
        ..defaults
    })?;
    let replicas = stack
        .replicas()
        .iter()
        .enumerate()
        .map(|(i, r)| ReplicaRef {
            name: format!("r{i}"),
            http: r.http_addr().to_string(),
            admin: Some(r.admin_addr().to_string()),
        })
        .collect();
    let workers = stack
        .replicas()
        .iter()
        .map(|r| Worker {
            url: format!("http://{}", r.http_addr()),
            events: r.events_endpoint().map(str::to_owned),
            replay: r.replay_endpoint().map(str::to_owned),
        })
        .collect();
    Ok((stack, replicas, workers))
}

/// Starts the profile's gateways in front of the fleet; the peers reach each
/// replica through its tap (which names the replica in its answers).
pub(super) fn fleet_stack(
    fleet: &Fleet,
    workload: &Workload,
    profile: Profile,
    options: RunOptions,
) -> Result<(Stack, Vec<ReplicaRef>, Vec<Worker>), BenchError> {
    let routing = profile.routing();
    let defaults = StackOptions::default();
    let filter_overrides = profile.filter_overrides(&defaults);
    let stack = Stack::start_external(
        StackOptions {
            replicas: fleet.replicas().len(),
            model: MODEL.into(),
            block_size: fleet.options().block_size,
            routing,
            seed: options.seed,
            gateways: workload.gateways.max(1),
            tokenizers: fleet::tokenizers(fleet.options().model),
            thread_label: Some(load_cpu::THREAD_LABEL.to_owned()),
            indexd_unix_socket: options.indexd_unix_socket,
            scrape_interval: options.scrape_interval.unwrap_or(defaults.scrape_interval),
            filter_overrides,
            indexd_speculative_ttl: profile.speculative_ttl(),
            indexd_shadow_per_second: profile.shadow_per_second(),
            indexd_balance_margin: profile.balance_margin(),
            ..defaults
        },
        fleet.external(),
    )?;
    if routing != Routing::LeastRequest {
        // kvroute tokenizes with its own tokenizer once it agrees with vLLM.
        fleet::wait_ready(&stack.indexd_handles(), fleet.external())?;
    }
    let replicas = fleet
        .replicas()
        .iter()
        .map(|r| ReplicaRef {
            name: r.name.clone(),
            http: r.http.to_string(),
            admin: None,
        })
        .collect();
    let workers = fleet
        .replicas()
        .iter()
        .map(|r| Worker {
            url: r.tap.clone(),
            events: None,
            replay: None,
        })
        .collect();
    Ok((stack, replicas, workers))
}
