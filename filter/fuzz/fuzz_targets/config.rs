//! Arbitrary bytes as the plugin configuration: a clear error or a valid
//! configuration, never a panic; an accepted configuration routes its own
//! default paths.
#![no_main]

use kvroute_filter::Config;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(cfg) = Config::parse(data) {
        assert!(cfg.block_size.get() >= 1);
        assert!(cfg.max_pick_keys >= 1);
        assert!(!cfg.index_cluster.is_empty());
    }
});
