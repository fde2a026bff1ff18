//! Dense identities shared by the index and the credit stores.

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
