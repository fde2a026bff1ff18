//! Arbitrary bytes as a tokenizer answer (`/tokenize` or a render
//! endpoint): never a panic, and ids only from a well-formed answer.
#![no_main]

use kvroute_filter::tokenize;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(ids) = tokenize::parse_token_ids(data) {
        assert!(ids.len() <= data.len());
    }
});
