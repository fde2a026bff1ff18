//! Arbitrary text as indexd's YAML configuration (and as one `--endpoint`
//! flag). Checks: no panic; whatever parses also validates.
#![no_main]

use indexd::Config;
use indexd::config::parse_endpoint;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(config) = Config::from_yaml(text) {
        assert!(config.validate().is_ok());
    }
    let _ = parse_endpoint(text);
});
