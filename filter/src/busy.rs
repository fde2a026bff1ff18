//! Which replicas indexd's latest answer called busy, for every worker.
//!
//! A Pick answer ranked over the replicas' load lists those the move rule
//! could take a conversation off now (`PickResponse.busy`: vLLM reported
//! requests waiting there in two scrapes in a row, or indexd holds a lasting
//! imbalance of conversations there). The filter keeps the latest such list
//! in the VM's shared data with the time it came, and a continuation
//! (`local_continuations`) follows its previous turn only while that list is
//! fresh (`continuation_load_ms`, 1 s by default) and does not name the
//! turn's replica. Otherwise it
//! asks for a Pick, which may move it, and whose answer refreshes the list:
//! so a gateway routing only continuations still asks indexd about once a
//! second, and a queue that lasts is seen within a scrape or two.
//!
//! The value is `<ms>` then one `address|rank` line per busy replica (rank
//! empty when none). Writes are unconditional: the latest answer wins, and a
//! lost race leaves an answer as fresh.

use kvroute_proto::v1::BusyReplica;

use crate::host::SharedData;

/// The shared-data key.
pub const KEY: &str = "kvroute.busy.v1";
/// Most replicas kept (a longer list is cut: those replicas then look free
/// until the next answer).
pub const MAX_BUSY: usize = 256;

/// What the latest answer says of one replica.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Load {
    /// A fresh answer does not name it.
    Free,
    /// A fresh answer names it.
    Busy,
    /// No answer recent enough (or none readable).
    Unknown,
}

/// Records an answer's busy replicas, received at `now_ms`.
pub fn record(store: &mut dyn SharedData, busy: &[BusyReplica], now_ms: u64) {
    let mut value = now_ms.to_string();
    for b in busy.iter().take(MAX_BUSY) {
        if b.address.contains(['\n', '|']) {
            continue;
        }
        value.push('\n');
        value.push_str(&b.address);
        value.push('|');
        if let Some(rank) = b.data_parallel_rank {
            value.push_str(&rank.to_string());
        }
    }
    // A failed write leaves the previous answer, which ages out.
    let _ = store.set_shared(KEY, value.as_bytes(), None);
}

/// What the latest answer, if at most `fresh_ms` old, says at `now_ms` of the
/// replica at `address` (and `rank`).
pub fn load_of(
    store: &dyn SharedData,
    address: &str,
    rank: Option<u32>,
    now_ms: u64,
    fresh_ms: u64,
) -> Load {
    let (Some(value), _) = store.get_shared(KEY) else {
        return Load::Unknown;
    };
    let Ok(text) = std::str::from_utf8(&value) else {
        return Load::Unknown;
    };
    let mut lines = text.split('\n');
    // A clock that went back counts as fresh for as long as it is behind.
    let fresh = lines
        .next()
        .and_then(|l| l.parse::<u64>().ok())
        .is_some_and(|at| now_ms.saturating_sub(at) <= fresh_ms);
    if !fresh {
        return Load::Unknown;
    }
    let rank = rank.map(|r| r.to_string()).unwrap_or_default();
    let named = lines.any(|l| {
        l.split_once('|')
            .is_some_and(|(a, r)| a == address && r == rank)
    });
    if named { Load::Busy } else { Load::Free }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::FakeHost;

    const FRESH: u64 = 1_000;

    fn busy(address: &str, rank: Option<u32>) -> BusyReplica {
        BusyReplica {
            address: address.to_owned(),
            data_parallel_rank: rank,
        }
    }

    #[test]
    fn a_fresh_answer_names_the_busy_and_frees_the_rest() {
        let mut host = FakeHost::default();
        assert_eq!(load_of(&host, "10.0.0.1:80", None, 0, FRESH), Load::Unknown);
        record(
            &mut host,
            &[busy("10.0.0.1:80", None), busy("10.0.0.2:80", Some(1))],
            5_000,
        );
        assert_eq!(
            load_of(&host, "10.0.0.1:80", None, 5_000, FRESH),
            Load::Busy
        );
        assert_eq!(
            load_of(&host, "10.0.0.2:80", Some(1), 5_500, FRESH),
            Load::Busy
        );
        assert_eq!(
            load_of(&host, "10.0.0.2:80", Some(0), 5_500, FRESH),
            Load::Free
        );
        assert_eq!(
            load_of(&host, "10.0.0.2:80", None, 5_500, FRESH),
            Load::Free
        );
        assert_eq!(
            load_of(&host, "10.0.0.3:80", None, 6_000, FRESH),
            Load::Free
        );
        // Older than FRESH: unknown.
        assert_eq!(
            load_of(&host, "10.0.0.3:80", None, 6_001, FRESH),
            Load::Unknown
        );
        assert_eq!(
            load_of(&host, "10.0.0.1:80", None, 6_001, FRESH),
            Load::Unknown
        );
        // The latest answer replaces the list.
        record(&mut host, &[], 6_100);
        assert_eq!(
            load_of(&host, "10.0.0.1:80", None, 6_200, FRESH),
            Load::Free
        );
    }

    #[test]
    fn unreadable_values_say_nothing() {
        let mut host = FakeHost::default();
        for bad in [&b"\xff\xfe"[..], b"", b"soon\n10.0.0.1:80|"] {
            let _ = host.set_shared(KEY, bad, None);
            assert_eq!(load_of(&host, "10.0.0.1:80", None, 0, FRESH), Load::Unknown);
        }
        // Addresses that would break the format are left out.
        record(
            &mut host,
            &[busy("10.0.0.1:80\n", None), busy("a|b", None)],
            0,
        );
        assert_eq!(load_of(&host, "10.0.0.1:80", None, 0, FRESH), Load::Free);
        assert_eq!(load_of(&host, "a", None, 0, FRESH), Load::Free);
    }
}
