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
//!
//! With `local_continuations`, the memory also routes continuations while
//! indexd answers: a request whose previous turn (its items up to the
//! model's last answer, [`previous_turn`]) this gateway saw answered goes
//! to that turn's replica without a Pick ([`recall_turn`]: one lookup, of
//! that exact turn, so a turn that another gateway routed since is never
//! taken for it), up to that many turns in a row.

use std::hash::{DefaultHasher, Hash, Hasher};

use kvroute_proto::turns;
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
pub fn fingerprints(req: &ParsedRequest<'_>, items: &[&RawValue], model: &str) -> Vec<u64> {
    if items.is_empty() {
        return Vec::new();
    }
    let mut h = DefaultHasher::new();
    (req.api as u8, model, req.cache_salt.as_deref()).hash(&mut h);
    // What precedes the items in the prompt: Responses `instructions`,
    // Messages `system` (chat's system prompt is one of its messages).
    let preamble = match req.api {
        Api::Responses => req.raw("instructions"),
        Api::Messages => req.raw("system"),
        Api::Completions | Api::Chat => None,
    };
    if let Some(preamble) = preamble {
        digest(preamble.get().as_bytes(), &mut h);
    }
    items
        .iter()
        .map(|item| {
            digest(item.get().as_bytes(), &mut h);
            h.finish()
        })
        .collect()
}

/// A request's conversation items: chat `messages`, Responses `input`,
/// Messages `messages` (read once per request, for [`continues`],
/// [`fingerprints`] and [`previous_turn`]).
pub fn items<'a>(req: &ParsedRequest<'a>) -> Vec<&'a RawValue> {
    match req.api {
        Api::Chat => raw_items(req.raw("messages")),
        Api::Responses => match req.raw("input") {
            Some(input) if input.get().trim_start().starts_with('[') => raw_items(Some(input)),
            Some(input) => vec![input],
            None => Vec::new(),
        },
        Api::Messages => raw_items(req.raw("messages")),
        Api::Completions => Vec::new(),
    }
}

/// Whether the model wrote the item: an assistant message, or a Responses
/// output item (`reasoning`, `function_call` and the other `*_call` items;
/// their `*_output` answers are the client's). Unreadable items count as
/// the client's.
fn from_model(item: &RawValue) -> bool {
    let Some(author) = turns::Author::of(item) else {
        return false;
    };
    author.role.as_deref() == Some("assistant")
        || author
            .kind
            .as_deref()
            .is_some_and(|k| k == "reasoning" || k.ends_with("_call"))
}

/// Whether the request continues a conversation (`PickRequest.continuation`,
/// by [`kvroute_proto::turns`]): one of its items is an earlier turn (an
/// assistant or tool message, a Responses output item), or it names a
/// `previous_response_id`. Unset for a completions prompt, which does not
/// tell. Unreadable items count as the client's.
pub fn continues(req: &ParsedRequest<'_>, items: &[&RawValue]) -> Option<bool> {
    if req.api == Api::Completions {
        return None;
    }
    // A continuation's latest answer is near the end: look there first.
    Some(
        req.previous_response_id.is_some() || items.iter().rev().any(|i| turns::is_earlier_turn(i)),
    )
}

/// The previous turn of a continuation, as the request shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PreviousTurn {
    /// Leading items of the previous turn's request.
    pub items: usize,
    /// Bytes of the items after them (the model's answer, the client's new
    /// items): what the replica has not seen yet.
    pub new_bytes: usize,
}

/// The previous turn's request: the items before the model's last answer
/// (its last run of items), if the request holds one and something precedes
/// it. A continuation repeats the previous request, adds the answer, then
/// the client's new items.
pub fn previous_turn(items: &[&RawValue]) -> Option<PreviousTurn> {
    let last = items.iter().rposition(|i| from_model(i))?;
    let first = items
        .get(..last)?
        .iter()
        .rposition(|i| !from_model(i))
        .map_or(0, |i| i.saturating_add(1));
    let new_bytes = items.get(first..)?.iter().map(|i| i.get().len()).sum();
    (first > 0).then_some(PreviousTurn {
        items: first,
        new_bytes,
    })
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

/// Where a remembered request went.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Recalled {
    /// The replica that answered it.
    pub host: String,
    /// Its data-parallel rank, if indexd named one.
    pub rank: Option<u32>,
    /// How many turns in a row, this one included, went there from the
    /// memory alone (0: indexd or Envoy chose it).
    pub local_turns: u32,
}

/// Remembers that the request whose fingerprints end with `last` was served
/// by `host` (and `rank`), the `local_turns`-th turn in a row routed from
/// the memory alone.
pub fn remember(
    store: &mut dyn SharedData,
    last: u64,
    host: &str,
    rank: Option<u32>,
    local_turns: u32,
) {
    let rank = rank.map(|r| r.to_string()).unwrap_or_default();
    let value = format!("{last:x}|{host}|{rank}|{local_turns}");
    // Last writer wins: a lost race forgets one request.
    let _ = store.set_shared(&slot_key(last), value.as_bytes(), None);
}

/// The request remembered under `fingerprint`, if its slot still holds it.
pub fn recall_turn(store: &dyn SharedData, fingerprint: u64) -> Option<Recalled> {
    let (value, _) = store.get_shared(&slot_key(fingerprint));
    let text = String::from_utf8(value?).ok()?;
    let mut parts = text.splitn(4, '|');
    let stored = u64::from_str_radix(parts.next()?, 16).ok()?;
    let host = parts.next()?.to_owned();
    let rank = parts.next().and_then(|r| r.parse().ok());
    // Written before the count existed: not a local turn.
    let local_turns = parts.next().and_then(|n| n.parse().ok()).unwrap_or(0);
    (stored == fingerprint && !host.is_empty()).then_some(Recalled {
        host,
        rank,
        local_turns,
    })
}

/// The replica (and rank) that served the longest remembered prefix.
pub fn recall(store: &dyn SharedData, fingerprints: &[u64]) -> Option<(String, Option<u32>)> {
    fingerprints
        .iter()
        .rev()
        .take(MAX_LOOKUPS)
        .find_map(|f| recall_turn(store, *f))
        .map(|r| (r.host, r.rank))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::FakeHost;
    use crate::request::parse;

    fn prints(api: Api, body: &str) -> Vec<u64> {
        let req = parse(api, body.as_bytes()).unwrap();
        fingerprints(&req, &items(&req), "m")
    }

    #[test]
    fn continuations_read_as_indexd_and_the_tokenizer_read_them() {
        // The golden bodies indexd's and the tokenizer's readings are held to.
        let golden: serde_json::Value =
            serde_json::from_str(include_str!("../../proto/testdata/turns.json")).unwrap();
        let mut read = 0;
        for case in golden["cases"].as_array().unwrap() {
            let api = match case["api"].as_str().unwrap() {
                "chat" => Api::Chat,
                "completions" => Api::Completions,
                "responses" => Api::Responses,
                "messages" => Api::Messages,
                other => panic!("api {other}"),
            };
            let body = case["body"].as_str().unwrap();
            // The filter reads only the bodies it accepts (the others go on
            // without a Pick).
            let Ok(req) = parse(api, body.as_bytes()) else {
                continue;
            };
            let expected = case["continuation"].as_bool();
            assert_eq!(continues(&req, &items(&req)), expected, "{body}");
            read += 1;
        }
        assert!(read >= 15, "only {read} golden bodies parsed");
    }

    #[test]
    fn a_next_turn_finds_its_previous_turn() {
        let first = r#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":"one"}]}"#;
        let next = r#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":"one"},{"role":"assistant","content":"ok"},{"role":"user","content":"two"}]}"#;
        let other = r#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":"three"}]}"#;
        let mut h = FakeHost::default();
        let a = prints(Api::Chat, first);
        remember(&mut h, *a.last().unwrap(), "10.0.0.1:8000", Some(2), 0);
        let b = prints(Api::Chat, next);
        assert_eq!(&b[..2], &a[..], "a prefix has the prefix's fingerprints");
        assert_eq!(recall(&h, &b), Some(("10.0.0.1:8000".to_owned(), Some(2))));
        assert_eq!(recall(&h, &prints(Api::Chat, other)), None);
    }

    #[test]
    fn a_messages_turn_finds_its_previous_turn_under_the_same_system_prompt() {
        let first = r#"{"model":"m","system":"s","messages":[{"role":"user","content":"one"}]}"#;
        let next = r#"{"model":"m","system":"s","messages":[{"role":"user","content":"one"},{"role":"assistant","content":[{"type":"tool_use","id":"t","name":"f","input":{}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":"2"}]}]}"#;
        let other_system =
            r#"{"model":"m","system":"t","messages":[{"role":"user","content":"one"}]}"#;
        let a = prints(Api::Messages, first);
        let b = prints(Api::Messages, next);
        assert_eq!(&b[..1], &a[..]);
        assert_ne!(prints(Api::Messages, other_system), a);
        assert_ne!(
            prints(
                Api::Chat,
                r#"{"model":"m","messages":[{"role":"user","content":"one"}]}"#
            ),
            a
        );
        let turn = previous_turn(&items(&parse(Api::Messages, next.as_bytes()).unwrap()));
        assert_eq!(turn.map(|t| t.items), Some(1));
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
        let list = items(&req);
        assert_ne!(
            fingerprints(&req, &list, "m"),
            fingerprints(&req, &list, "n")
        );
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

    fn turn_of(api: Api, body: &str) -> Option<usize> {
        previous_turn(&items(&parse(api, body.as_bytes()).unwrap())).map(|t| t.items)
    }

    #[test]
    fn the_previous_turn_ends_before_the_models_last_answer() {
        let chat = |items: &[&str]| {
            let items: Vec<String> = items
                .iter()
                .map(|r| format!(r#"{{"role":"{r}","content":"x"}}"#))
                .collect();
            format!(r#"{{"model":"m","messages":[{}]}}"#, items.join(","))
        };
        assert_eq!(turn_of(Api::Chat, &chat(&["system", "user"])), None);
        assert_eq!(
            turn_of(Api::Chat, &chat(&["system", "user", "assistant", "user"])),
            Some(2)
        );
        assert_eq!(
            turn_of(
                Api::Chat,
                &chat(&[
                    "system",
                    "user",
                    "assistant",
                    "tool",
                    "tool",
                    "assistant",
                    "tool"
                ])
            ),
            Some(5)
        );
        // An answer with nothing before it has no previous request.
        assert_eq!(turn_of(Api::Chat, &chat(&["assistant", "user"])), None);
        // Responses: the model's items are its last run (reasoning, calls,
        // messages); the calls' outputs and user items are the client's.
        let r = r#"{"model":"m","input":[
            {"role":"user","content":"q"},
            {"type":"reasoning","summary":[]},
            {"type":"function_call","call_id":"a","name":"f","arguments":"{}"},
            {"type":"function_call_output","call_id":"a","output":"y"},
            {"type":"reasoning","summary":[]},
            {"type":"web_search_call","id":"w","status":"completed"},
            {"type":"message","role":"assistant","content":[]},
            {"role":"user","content":"more"}]}"#;
        assert_eq!(turn_of(Api::Responses, r), Some(4));
        assert_eq!(
            turn_of(Api::Responses, r#"{"model":"m","input":"text"}"#),
            None
        );
        assert_eq!(
            turn_of(Api::Completions, r#"{"model":"m","prompt":"x"}"#),
            None
        );
        // An item without a role or type is the client's.
        assert_eq!(
            turn_of(
                Api::Responses,
                r#"{"model":"m","input":[{"content":"x"},{"role":"assistant","content":"a"},{"content":"y"}]}"#
            ),
            Some(1)
        );
    }

    #[test]
    fn a_turns_new_bytes_are_the_items_after_it() {
        let body = r#"{"model":"m","messages":[{"role":"user","content":"q"},{"role":"assistant","content":"a"},{"role":"user","content":"q2"}]}"#;
        let turn = previous_turn(&items(&parse(Api::Chat, body.as_bytes()).unwrap())).unwrap();
        assert_eq!(turn.items, 1);
        assert_eq!(
            turn.new_bytes,
            r#"{"role":"assistant","content":"a"}{"role":"user","content":"q2"}"#.len()
        );
    }

    #[test]
    fn recall_turn_reads_the_count_and_older_values() {
        let mut h = FakeHost::default();
        remember(&mut h, 7, "10.0.0.1:8000", None, 3);
        assert_eq!(
            recall_turn(&h, 7),
            Some(Recalled {
                host: "10.0.0.1:8000".into(),
                rank: None,
                local_turns: 3
            })
        );
        assert_eq!(recall_turn(&h, 7 + SLOTS), None, "same slot, other print");
        // A value written before the count existed: not a local turn.
        h.set_shared(&slot_key(9), b"9|10.0.0.2:8000|4", None)
            .unwrap();
        assert_eq!(
            recall_turn(&h, 9),
            Some(Recalled {
                host: "10.0.0.2:8000".into(),
                rank: Some(4),
                local_turns: 0
            })
        );
        assert_eq!(recall(&h, &[9]), Some(("10.0.0.2:8000".into(), Some(4))));
    }
}
