//! Identities shared across indexd (a replica's endpoint, its dense slot, a
//! partition) and the hash map keyed by them: leaves, importing nothing of
//! indexd's own.

/// A replica's dense identity inside the index (never reused).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReplicaSlot(pub u32);

/// A model/adapter partition of the index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PartitionId(u32);

impl PartitionId {
    pub(crate) const fn new(id: u32) -> Self {
        Self(id)
    }

    /// The raw id.
    pub(crate) const fn get(self) -> u32 {
        self.0
    }
}

/// The index's hash maps: keys are XXH3 digests and engine hashes, so a
/// fast hasher (foldhash, seeded per process) does; SipHash cost a third of
/// a Pick's walk.
pub(crate) type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// A replica (one data-parallel rank of one vLLM server).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointId {
    /// The host as Envoy knows it.
    pub address: std::net::SocketAddr,
    /// The data-parallel rank inside the server, if any.
    pub rank: Option<u32>,
}

impl std::fmt::Display for EndpointId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.rank {
            Some(rank) => write!(f, "{}#{rank}", self.address),
            None => write!(f, "{}", self.address),
        }
    }
}
