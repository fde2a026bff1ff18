//! Arbitrary text as a discovery file (`endpoints:`). Checks: no panic;
//! what parses has unique identities and named models.
#![no_main]

use std::collections::HashSet;

use indexd::config::parse_discovery;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(endpoints) = parse_discovery(text) {
        let mut seen = HashSet::new();
        for e in &endpoints {
            assert!(seen.insert(e.id.clone()));
            assert!(!e.model.is_empty());
        }
    }
});
