//! Where conversations went: a small memory in the VM's shared data that
//! keeps conversations on their replica while indexd cannot answer (down,
//! restarting, its breaker open).
//!
//! A conversation's next turn repeats its previous request and adds to it:
//! chat `messages` and Responses `input` items grow at the end. So each
//! answered request is remembered under a fingerprint of all its items
//! (`[instructions], item₁ … itemₙ`, with the API, model and `cache_salt`),
//! and a request that indexd cannot route looks up the fingerprints of its
//! own prefixes, longest first: the previous turn's is among them. A
//! fingerprint digests each item's length and its first and last bytes, not
//! all of it: cheap on every request, and a rare collision only sends a
//! request where another conversation went (what least-request might do).
//!
//! The memory is direct-mapped: [`SLOTS`] shared-data keys, each holding
//! the last fingerprint that landed in it and its replica. Bounded, no
//! eviction pass; a write is one shared-data call, a lookup one per item,
//! and lookups happen only when indexd is not answering.

use std::hash::{DefaultHasher, Hash, Hasher};

use serde_json::value::RawValue;

use crate::config::Api;
use crate::host::SharedData;
use crate::request::ParsedRequest;

/// Slots of the memory.
pub const SLOTS: u64 = 4096;
/// Bytes of an item's start and end that its digest reads.
const EDGE: usize = 256;
/// Items looked up at most (the longest prefixes first).
const MAX_LOOKUPS: usize = 64;

fn slot_key(fingerprint: u64) -> String {
    format!("kvroute.memo.{}", fingerprint % SLOTS)
}

/// The fingerprints of every prefix of a request's items, shortest first
/// (empty for a request with no items to follow, e.g. completions).
pub fn fingerprints(req: &ParsedRequest<'_>, model: &str) -> Vec<u64> {
    let items: Vec<&RawValue> = match req.api {
        Api::Chat => raw_items(req.raw("messages")),
        Api::Responses => match req.raw("input") {
            Some(input) if input.get().trim_start().starts_with('[') => raw_items(Some(input)),
            Some(input) => vec![input],
            None => Vec::new(),
        },
        Api::Completions => Vec::new(),
    };
    if items.is_empty() {
        return Vec::new();
    }
    let mut h = DefaultHasher::new();
    (req.api as u8, model, req.cache_salt.as_deref()).hash(&mut h);
    if let Some(instructions) = req.raw("instructions") {
        digest(instructions.get().as_bytes(), &mut h);
    }
    items
        .iter()
        .map(|item| {
            digest(item.get().as_bytes(), &mut h);
            h.finish()
        })
        .collect()
}

fn raw_items(list: Option<&RawValue>) -> Vec<&RawValue> {
    list.and_then(|l| serde_json::from_str::<Vec<&RawValue>>(l.get()).ok())
        .unwrap_or_default()
}

/// Adds one item's length, start and end to the running hash.
fn digest(bytes: &[u8], h: &mut DefaultHasher) {
    bytes.len().hash(h);
    bytes.get(..EDGE.min(bytes.len())).hash(h);
    bytes.get(bytes.len().saturating_sub(EDGE)..).hash(h);
}

/// Remembers that the request whose fingerprints end with `last` was served
/// by `host` (and `rank`).
pub fn remember(store: &mut dyn SharedData, last: u64, host: &str, rank: Option<u32>) {
    let rank = rank.map(|r| r.to_string()).unwrap_or_default();
    let value = format!("{last:x}|{host}|{rank}");
    // Last writer wins: a lost race forgets one request.
    let _ = store.set_shared(&slot_key(last), value.as_bytes(), None);
}

/// The replica (and rank) that served the longest remembered prefix.
pub fn recall(store: &dyn SharedData, fingerprints: &[u64]) -> Option<(String, Option<u32>)> {
    fingerprints.iter().rev().take(MAX_LOOKUPS).find_map(|f| {
        let (value, _) = store.get_shared(&slot_key(*f));
        let text = String::from_utf8(value?).ok()?;
        let mut parts = text.splitn(3, '|');
        let stored = u64::from_str_radix(parts.next()?, 16).ok()?;
        let host = parts.next()?.to_owned();
        let rank = parts.next().and_then(|r| r.parse().ok());
        (stored == *f && !host.is_empty()).then_some((host, rank))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::FakeHost;
    use crate::request::parse;

    fn prints(api: Api, body: &str) -> Vec<u64> {
        let req = parse(api, body.as_bytes()).unwrap();
        fingerprints(&req, "m")
    }

    #[test]
    fn a_next_turn_finds_its_previous_turn() {
        let first = r#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":"one"}]}"#;
        let next = r#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":"one"},{"role":"assistant","content":"ok"},{"role":"user","content":"two"}]}"#;
        let other = r#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":"three"}]}"#;
        let mut h = FakeHost::default();
        let a = prints(Api::Chat, first);
        remember(&mut h, *a.last().unwrap(), "10.0.0.1:8000", Some(2));
        let b = prints(Api::Chat, next);
        assert_eq!(&b[..2], &a[..], "a prefix has the prefix's fingerprints");
        assert_eq!(recall(&h, &b), Some(("10.0.0.1:8000".to_owned(), Some(2))));
        assert_eq!(recall(&h, &prints(Api::Chat, other)), None);
    }

    #[test]
    fn salt_model_and_api_keep_conversations_apart() {
        let body = |salt: &str| {
            format!(
                r#"{{"model":"m","cache_salt":"{salt}","messages":[{{"role":"user","content":"x"}}]}}"#
            )
        };
        assert_ne!(prints(Api::Chat, &body("a")), prints(Api::Chat, &body("b")));
        let a = body("a");
        let req = parse(Api::Chat, a.as_bytes()).unwrap();
        assert_ne!(fingerprints(&req, "m"), fingerprints(&req, "n"));
        assert!(prints(Api::Completions, r#"{"prompt":"x"}"#).is_empty());
        let r = prints(
            Api::Responses,
            r#"{"model":"m","instructions":"i","input":[{"role":"user","content":"x"},{"type":"function_call_output","call_id":"c","output":"y"}]}"#,
        );
        assert_eq!(r.len(), 2);
        assert_eq!(
            prints(Api::Responses, r#"{"model":"m","input":"just text"}"#).len(),
            1
        );
    }

    #[test]
    fn long_items_differ_by_their_ends_and_lengths() {
        let a = format!(
            r#"{{"messages":[{{"role":"user","content":"{}a"}}]}}"#,
            "x".repeat(2000)
        );
        let b = format!(
            r#"{{"messages":[{{"role":"user","content":"{}b"}}]}}"#,
            "x".repeat(2000)
        );
        let c = format!(
            r#"{{"messages":[{{"role":"user","content":"{}a"}}]}}"#,
            "x".repeat(2001)
        );
        assert_ne!(prints(Api::Chat, &a), prints(Api::Chat, &b));
        assert_ne!(prints(Api::Chat, &a), prints(Api::Chat, &c));
    }

    #[test]
    fn garbage_in_a_slot_is_ignored() {
        let mut h = FakeHost::default();
        let p = prints(Api::Chat, r#"{"messages":[{"role":"user","content":"x"}]}"#);
        h.set_shared(&slot_key(p[0]), b"\xff|nonsense", None)
            .unwrap();
        assert_eq!(recall(&h, &p), None);
        h.set_shared(&slot_key(p[0]), format!("{:x}||", p[0]).as_bytes(), None)
            .unwrap();
        assert_eq!(recall(&h, &p), None, "no host");
    }
}
