//! Arbitrary bytes as a KV-event payload: vLLM's msgpack batch decoder, then
//! what it decoded applied to an index as a replica's events are. Checks: no
//! panic; the decoder's caps hold; the index never exceeds its bound.
#![no_main]

use indexd::ReplicaSlot;
use indexd::event::KvEvent;
use indexd::index::{ApplyStats, Index};
use indexd::wire::{self, Limits};
use libfuzzer_sys::fuzz_target;

const LIMITS: Limits = Limits {
    max_frame_bytes: 1 << 16,
    max_events_per_batch: 64,
    max_blocks_per_event: 64,
    max_tokens_per_event: 4096,
    max_message_bytes: 1 << 17,
    max_publisher_connections: 1,
};

fuzz_target!(|data: &[u8]| {
    let Ok(batch) = wire::decode_batch(data, &LIMITS) else {
        return;
    };
    assert!(batch.events.len() <= LIMITS.max_events_per_batch);
    let mut index = Index::new(256, 64);
    let mut stats = ApplyStats::default();
    for (i, ev) in batch.events.iter().enumerate() {
        if let KvEvent::BlockStored(s) = ev {
            assert!(s.block_hashes.len() <= LIMITS.max_blocks_per_event);
            assert!(s.token_ids.len() <= LIMITS.max_tokens_per_event);
        }
        // Two replicas, so parents and partitions cross between them.
        index.apply(ReplicaSlot(i as u32 % 2), "m", ev, &mut stats);
        assert!(index.entries() <= 256);
    }
});
