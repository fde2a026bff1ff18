//! Fuzz bytes as a completions prompt (added tokens and odd whitespace
//! spliced in), on one of the two test models. Checks: the split, segment
//! and cache path equals `tokenizers`' own encode; the budgeted path gives
//! the first `max_tokens` of those ids, flagged exactly when some are left
//! out; a second encode (from the cache) is the same.
#![no_main]

use kvroute_tokenizer::{Budget, TokenizeRequest};
use kvroute_tokenizer_fuzz::{budget, model, text};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let (tok, reference) = model(first & 1 == 1);
    let special = first & 2 == 2;
    let prompt = text(rest);
    let want = reference
        .encode(prompt.as_str(), special)
        .expect("tokenizers encodes any text")
        .get_ids()
        .to_vec();
    assert_eq!(
        tok.encode(&prompt, special).ok(),
        Some(want.clone()),
        "{prompt:?}"
    );
    assert_eq!(
        tok.encode(&prompt, special).ok(),
        Some(want.clone()),
        "cached: {prompt:?}"
    );
    let max = usize::from(first >> 2) * 7;
    let b = Budget {
        max_tokens: Some(max),
        ..budget(tok)
    };
    let body = serde_json::json!({"prompt": prompt, "add_special_tokens": special});
    let req = TokenizeRequest::from_json(&serde_json::to_vec(&body).expect("json"))
        .expect("a valid body");
    let got = tok
        .completion_tokens_with(&req, &b)
        .expect("within the model's caps");
    assert_eq!(got.ids, want[..want.len().min(max)]);
    assert_eq!(got.truncated, want.len() > max);
});
