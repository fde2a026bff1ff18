//! Arbitrary bytes as a request body of each API: parsing, the tokenizer
//! call's body and approximate-mode keys never panic, and a body that is
//! strict JSON yields a tokenizer body that is strict JSON again. (A body
//! the filter parses may carry what only Python's `json` accepts, such as a
//! lone surrogate escape in a field it forwards untouched; the tokenizer
//! body then carries it too, and vLLM decides.)
#![no_main]

use kvroute_filter::config::{Api, TokenizerCall};
use kvroute_filter::{approximate, request, tokenize};
use kvroute_proto::BlockSize;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let [selector, body @ ..] = data else {
        return;
    };
    let api = match selector % 3 {
        0 => Api::Completions,
        1 => Api::Chat,
        _ => Api::Responses,
    };
    let Ok(req) = request::parse(api, body) else {
        return;
    };
    let strict = serde_json::from_slice::<serde_json::Value>(body).is_ok();
    for call in [TokenizerCall::Tokenize, TokenizerCall::Render] {
        let out = tokenize::request_body(call, &req, "fallback", body);
        if strict && !(call == TokenizerCall::Render && req.model.is_some()) {
            assert!(
                serde_json::from_slice::<serde_json::Value>(&out).is_ok(),
                "tokenizer body is not JSON: {}",
                String::from_utf8_lossy(&out)
            );
        }
    }
    if let Some(chunk) = BlockSize::new(u32::from(selector / 3).max(1)) {
        let (keys, len) = approximate::text_keys(&req, chunk);
        assert!(keys.len() <= len);
    }
});

