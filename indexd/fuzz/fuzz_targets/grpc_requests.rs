//! Arbitrary bytes as a gRPC request body, decoded as a PickRequest (byte 0
//! even; with bit 1 of byte 0 clear its key scheme is set to indexd's, so
//! that the index walk is reached, not only the mismatch path) or an
//! ObserveRequest (odd) and answered by indexd's Pick and
//! Observe against a small populated state: three replicas of two models
//! and an adapter, indexed blocks, recorded response ids. Checks: no panic;
//! a Pick names only known replicas serving its model, best first, at most
//! once each.
#![no_main]

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Instant;

use indexd::config::{Config, EndpointConfig};
use indexd::event::{BlockStored, EngineHash, EventBatch, ExtraKeys, KvEvent};
use indexd::{Shared, Tier, pick};
use kvroute_proto::v1::{ObserveRequest, PickRequest};
use libfuzzer_sys::fuzz_target;
use prost::Message;
use tokio_util::sync::CancellationToken;

fn address(i: u16) -> SocketAddr {
    SocketAddr::from(([10, 0, 0, 1], 8000 + i))
}

fn state() -> &'static Shared {
    static STATE: OnceLock<Shared> = OnceLock::new();
    STATE.get_or_init(|| {
        let mut endpoints: Vec<EndpointConfig> = (0..3)
            .map(|i| EndpointConfig::new(address(i), "m"))
            .collect();
        endpoints[1].adapters = vec!["lora".into()];
        endpoints[2].model = "other".into();
        let mut config = Config::new(endpoints.clone());
        config.block_size = kvroute_proto::BlockSize::new(4).unwrap();
        config.seed = Some(1);
        config.max_index_entries = 4096;
        config.max_speculative_entries = 4096;
        config.affinity_capacity = 1024;
        config.approximate_capacity = 4096;
        // Every input reaches Observe's checks, not its rate limit.
        config.access.observe_rate = std::num::NonZeroU32::MAX;
        config.access.observe_burst = std::num::NonZeroU32::MAX;
        let shared = Shared::new(config, CancellationToken::new());
        for (i, e) in endpoints.into_iter().enumerate() {
            let replica = shared.add_replica(e).unwrap();
            let n = 8 * (i + 1);
            let stored = KvEvent::BlockStored(BlockStored {
                block_hashes: (0..n as u64).map(EngineHash).collect(),
                parent: None,
                token_ids: (0..4 * n as u32).collect(),
                block_size: 4,
                tier: Tier::Gpu,
                lora_name: (i == 1).then(|| "lora".to_owned()),
                extra_keys: Some(vec![ExtraKeys::None; n]),
                group_idx: 0,
                kind: None,
                sliding_window: None,
            });
            shared.ingest(
                &replica,
                EventBatch {
                    ts: 0.0,
                    events: vec![stored],
                    data_parallel_rank: None,
                },
            );
        }
        for (id, i, model) in [
            ("resp_a", 0, "m"),
            ("resp_b", 1, "lora"),
            ("resp_c", 2, "other"),
        ] {
            let observed = ObserveRequest {
                model: model.into(),
                endpoint: address(i).to_string(),
                response_id: id.into(),
                ..ObserveRequest::default()
            };
            pick::observe(&shared, &observed, Instant::now()).unwrap();
        }
        shared
    })
}

fuzz_target!(|data: &[u8]| {
    let [kind, body @ ..] = data else {
        return;
    };
    let shared = state();
    let now = Instant::now();
    if kind % 2 == 0 {
        let Ok(mut req) = PickRequest::decode(body) else {
            return;
        };
        if kind & 2 == 0 {
            req.key_scheme = kvroute_proto::SCHEME_VERSION.into();
        }
        let Ok(resp) = pick::pick(shared, &req, now) else {
            return;
        };
        let mut seen = HashSet::new();
        for c in &resp.candidates {
            let addr: SocketAddr = c.address.parse().unwrap();
            assert!((8000..8003).contains(&addr.port()));
            assert!(seen.insert(addr));
            let serves = match addr.port() {
                8000 => req.model == "m",
                8001 => req.model == "m" || req.model == "lora",
                _ => req.model == "other",
            };
            assert!(serves, "{} named for {:?}", c.address, req.model);
        }
        // Best first: by cost, except that the warm replica (holding more
        // than the cheapest) stays first when moving away would not pay,
        // and that a new conversation may go first to a replica with fewer
        // conversations costing at most `balance_margin` more than the
        // cheapest (and 5 ms).
        let rest = resp.candidates.get(1..).unwrap_or_default();
        for w in rest.windows(2) {
            assert!(!(w[0].cost > w[1].cost), "not best first");
        }
        if let [first, second, ..] = resp.candidates.as_slice() {
            if first.cost > second.cost {
                let cheapest = resp
                    .candidates
                    .iter()
                    .map(|c| c.cost)
                    .fold(f64::MAX, f64::min);
                let margin = indexd::config::Weights::default().balance_margin;
                let balanced = first.cost <= cheapest + (cheapest * margin).max(0.005) + 1e-9;
                // (more credited tokens: more blocks, or as many in a
                // faster tier)
                let warm =
                    first.matched_blocks > 0 && first.matched_blocks >= second.matched_blocks;
                assert!(
                    balanced || warm,
                    "first neither holding more nor balanced: {:?}",
                    resp.candidates
                );
            }
        }
    } else if let Ok(req) = ObserveRequest::decode(body) {
        let _ = pick::observe(shared, &req, now);
    }
});
