//! Completed picks waiting for a Pick to carry them to indexd.
//!
//! A picked request whose replica has started answering no longer stands
//! for queued prefill work there. Rather than a call of its own per request
//! (whose answer Envoy may cancel at stream end), its id waits in this list
//! and the next Pick of any worker carries it (`completed_request_ids`).
//! The list lives in the VM's shared data, so a conversation's next turn
//! carries its previous turn's completion whichever worker takes it.
//!
//! Writes use compare-and-swap with a few retries; a lost race drops one id,
//! which indexd then forgets at its next scrape instead.

use crate::host::{SharedData, SharedError};

/// The shared-data key.
pub const KEY: &str = "kvroute.completed.v1";
/// Most ids kept; the oldest go first.
pub const MAX_QUEUED: usize = 256;
/// Most ids one Pick carries (indexd refuses more).
pub const MAX_PER_PICK: usize = 64;
const ATTEMPTS: usize = 4;

fn decode(bytes: Option<&[u8]>) -> Vec<&[u8]> {
    bytes
        .map(|b| b.split(|c| *c == b'\n').filter(|s| !s.is_empty()).collect())
        .unwrap_or_default()
}

fn encode(ids: &[&[u8]]) -> Vec<u8> {
    ids.join(&b'\n')
}

/// Adds `id` to the list.
pub fn push(store: &mut dyn SharedData, id: &str) {
    if id.is_empty() || id.contains('\n') {
        return;
    }
    for _ in 0..ATTEMPTS {
        let (value, cas) = store.get_shared(KEY);
        let mut ids = decode(value.as_deref());
        let excess = ids.len().saturating_add(1).saturating_sub(MAX_QUEUED);
        ids.drain(..excess.min(ids.len()));
        ids.push(id.as_bytes());
        match store.set_shared(KEY, &encode(&ids), cas) {
            Ok(()) | Err(SharedError::Failed) => return,
            Err(SharedError::CasMismatch) => {}
        }
    }
}

/// Takes up to [`MAX_PER_PICK`] ids, oldest first.
pub fn take(store: &mut dyn SharedData) -> Vec<String> {
    for _ in 0..ATTEMPTS {
        let (value, cas) = store.get_shared(KEY);
        let ids = decode(value.as_deref());
        if ids.is_empty() {
            return Vec::new();
        }
        let n = ids.len().min(MAX_PER_PICK);
        let (taken, rest) = ids.split_at(n);
        match store.set_shared(KEY, &encode(rest), cas) {
            Ok(()) => {
                return taken
                    .iter()
                    .map(|id| String::from_utf8_lossy(id).into_owned())
                    .collect();
            }
            Err(SharedError::Failed) => return Vec::new(),
            Err(SharedError::CasMismatch) => {}
        }
    }
    Vec::new()
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
}
