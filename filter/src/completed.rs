//! What the next Pick carries to indexd: completed picks, and requests
//! routed without a Pick.
//!
//! A picked request whose replica has started answering no longer stands
//! for queued prefill work there. Rather than a call of its own per request
//! (whose answer Envoy may cancel at stream end), its id waits in a list
//! and the next Pick of any worker carries it (`completed_request_ids`).
//! A request the memory sent on without a Pick (`local_continuations`)
//! waits likewise in a second list (`continued`), so that indexd counts it
//! as queued work on its replica until its completion comes back. The lists
//! live in the VM's shared data, so a conversation's next turn carries its
//! previous turn's whichever worker takes it. A Pick reads the completions
//! first: a completion it carries was pushed after its own request's note,
//! which is then in this Pick's notes or an earlier Pick's.
//!
//! Writes use compare-and-swap with a few retries; a lost race drops one
//! entry, which indexd then forgets at its next scrape (or after
//! `pending_pick_ttl`) instead.

use kvroute_proto::v1::Continued;

use crate::host::{SharedData, SharedError};

/// The shared-data key of the completed picks.
pub const KEY: &str = "kvroute.completed.v1";
/// The shared-data key of the requests routed without a Pick.
pub const CONTINUED_KEY: &str = "kvroute.continued.v1";
/// Most entries kept per list; the oldest go first.
pub const MAX_QUEUED: usize = 256;
/// Most entries of each list one Pick carries (indexd refuses more).
pub const MAX_PER_PICK: usize = 64;
/// A note older than this is not carried: indexd's `pending_pick_ttl` (5 s
/// by default) would let it count no more anyway.
pub const NOTE_TTL_MS: u64 = 5_000;
const ATTEMPTS: usize = 4;

fn decode(bytes: Option<&[u8]>) -> Vec<&[u8]> {
    bytes
        .map(|b| b.split(|c| *c == b'\n').filter(|s| !s.is_empty()).collect())
        .unwrap_or_default()
}

fn encode(ids: &[&[u8]]) -> Vec<u8> {
    ids.join(&b'\n')
}

/// Adds `line` to the list under `key`.
fn push_line(store: &mut dyn SharedData, key: &str, line: &str) {
    if line.is_empty() || line.contains('\n') {
        return;
    }
    for _ in 0..ATTEMPTS {
        let (value, cas) = store.get_shared(key);
        let mut lines = decode(value.as_deref());
        let excess = lines.len().saturating_add(1).saturating_sub(MAX_QUEUED);
        lines.drain(..excess.min(lines.len()));
        lines.push(line.as_bytes());
        match store.set_shared(key, &encode(&lines), cas) {
            Ok(()) | Err(SharedError::Failed) => return,
            Err(SharedError::CasMismatch) => {}
        }
    }
}

/// Takes up to [`MAX_PER_PICK`] lines from the list under `key`, oldest
/// first.
fn take_lines(store: &mut dyn SharedData, key: &str) -> Vec<String> {
    for _ in 0..ATTEMPTS {
        let (value, cas) = store.get_shared(key);
        let lines = decode(value.as_deref());
        if lines.is_empty() {
            return Vec::new();
        }
        let n = lines.len().min(MAX_PER_PICK);
        let (taken, rest) = lines.split_at(n);
        match store.set_shared(key, &encode(rest), cas) {
            Ok(()) => {
                return taken
                    .iter()
                    .map(|l| String::from_utf8_lossy(l).into_owned())
                    .collect();
            }
            Err(SharedError::Failed) => return Vec::new(),
            Err(SharedError::CasMismatch) => {}
        }
    }
    Vec::new()
}

/// Adds a completed pick's `id`.
pub fn push(store: &mut dyn SharedData, id: &str) {
    push_line(store, KEY, id);
}

/// Takes up to [`MAX_PER_PICK`] completed ids, oldest first.
pub fn take(store: &mut dyn SharedData) -> Vec<String> {
    take_lines(store, KEY)
}

/// Notes request `id`, sent at `now_ms` to `address` (and `rank`) without a
/// Pick, expected to prefill `new_tokens`.
pub fn push_continued(
    store: &mut dyn SharedData,
    id: &str,
    address: &str,
    rank: Option<u32>,
    new_tokens: u32,
    now_ms: u64,
) {
    if id.contains('|') || address.contains('|') {
        return;
    }
    let rank = rank.map(|r| r.to_string()).unwrap_or_default();
    push_line(
        store,
        CONTINUED_KEY,
        &format!("{id}|{address}|{rank}|{new_tokens}|{now_ms}"),
    );
}

/// Takes up to [`MAX_PER_PICK`] notes, oldest first, aged at `now_ms`;
/// unreadable ones and those older than [`NOTE_TTL_MS`] are dropped.
pub fn take_continued(store: &mut dyn SharedData, now_ms: u64) -> Vec<Continued> {
    take_lines(store, CONTINUED_KEY)
        .iter()
        .filter_map(|line| {
            let mut parts = line.split('|');
            let (id, address, rank, tokens, at) = (
                parts.next()?,
                parts.next()?,
                parts.next()?,
                parts.next()?,
                parts.next()?,
            );
            let age = now_ms.saturating_sub(at.parse().ok()?);
            (!id.is_empty() && parts.next().is_none() && age < NOTE_TTL_MS).then_some(())?;
            Some(Continued {
                request_id: id.to_owned(),
                address: address.to_owned(),
                data_parallel_rank: if rank.is_empty() {
                    None
                } else {
                    Some(rank.parse().ok()?)
                },
                new_tokens: tokens.parse().ok()?,
                age_ms: u32::try_from(age).ok()?,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::FakeHost;

    #[test]
    fn ids_go_out_oldest_first_in_bounded_batches() {
        let mut h = FakeHost::default();
        for i in 0..100 {
            push(&mut h, &format!("id-{i}"));
        }
        let first = take(&mut h);
        assert_eq!(first.len(), MAX_PER_PICK);
        assert_eq!(first[0], "id-0");
        let second = take(&mut h);
        assert_eq!(second.len(), 100 - MAX_PER_PICK);
        assert_eq!(second.last().map(String::as_str), Some("id-99"));
        assert!(take(&mut h).is_empty());
    }

    #[test]
    fn the_list_is_bounded_and_survives_races_and_garbage() {
        let mut h = FakeHost::default();
        for i in 0..MAX_QUEUED + 10 {
            push(&mut h, &format!("{i}"));
        }
        let (value, _) = h.get_shared(KEY);
        assert_eq!(decode(value.as_deref()).len(), MAX_QUEUED);
        assert_eq!(take(&mut h)[0], "10", "the oldest were dropped");
        let mut g = FakeHost {
            shared_conflicts: 2,
            ..FakeHost::default()
        };
        push(&mut g, "a");
        push(&mut g, "bad\nid");
        push(&mut g, "");
        assert_eq!(take(&mut g), vec!["a".to_owned()]);
        g.set_shared(KEY, b"\n\n\xffx\n", None).unwrap();
        assert_eq!(take(&mut g).len(), 1);
    }

    #[test]
    fn continued_notes_round_trip_and_age_out() {
        let mut h = FakeHost::default();
        push_continued(&mut h, "id-1", "10.0.0.1:8000", Some(2), 30, 1_000);
        push_continued(&mut h, "id-2", "10.0.0.2:8000", None, 0, 1_000);
        push_continued(&mut h, "bad|id", "10.0.0.2:8000", None, 0, 1_000);
        push_continued(&mut h, "id-3", "10.0.0.2:8000", None, 0, 0);
        h.set_shared(
            CONTINUED_KEY,
            &[
                h.get_shared(CONTINUED_KEY).0.unwrap(),
                b"\nx|y|z|1|2\nid|a||1|2|3".to_vec(),
            ]
            .concat(),
            None,
        )
        .unwrap();
        let taken = take_continued(&mut h, 1_000 + NOTE_TTL_MS - 1);
        assert_eq!(
            taken,
            vec![
                Continued {
                    request_id: "id-1".into(),
                    address: "10.0.0.1:8000".into(),
                    data_parallel_rank: Some(2),
                    new_tokens: 30,
                    age_ms: 4_999,
                },
                Continued {
                    request_id: "id-2".into(),
                    address: "10.0.0.2:8000".into(),
                    data_parallel_rank: None,
                    new_tokens: 0,
                    age_ms: 4_999,
                },
            ],
            "id-3 too old, garbage dropped"
        );
        assert!(take_continued(&mut h, 0).is_empty());
        // The lists are apart.
        push(&mut h, "c");
        assert!(take_continued(&mut h, 0).is_empty());
        assert_eq!(take(&mut h), vec!["c".to_owned()]);
    }
}
