//! The snapshot file's layout (see the parent module): a magic, a version,
//! length-prefixed postcard sections (a header, then one per replica), an
//! end marker and a CRC-32 of everything before it.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvroute_proto::keys::Chain;
use serde::ser::SerializeSeq;
use serde::{Deserialize, Serialize, Serializer};

use super::SnapshotError;
use crate::config::EndpointConfig;
use crate::event::{EngineHash, GroupKind};
use crate::ids::EndpointId;
use crate::ids::PartitionId;
use crate::index::{Applied, Layout, SavedBlock};

/// The first bytes of every snapshot file.
pub const MAGIC: &[u8; 8] = b"KVRTSNAP";
/// The format version this build writes and reads. Saved blocks carry their
/// chain values, so a new block-key scheme is a new version: 2 is the first
/// with `kvroute/v2` chains; 3 adds each block's KV cache group and each
/// replica's layout. An older file is refused and every replica resyncs from
/// seq 0.
pub const VERSION: u32 = 3;

#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Header {
    pub(super) created_unix_ms: u64,
    pub(super) block_size: u32,
}

/// One saved block. The hash is kept as fixed bytes (engine hashes are
/// uniformly distributed: a varint would be longer).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct BlockRecord {
    hash: [u8; 8],
    chain: [u8; 16],
    /// Index into the section's `partitions`.
    partition: u32,
    /// Its KV cache group.
    group: u8,
    tiers: u8,
}

/// One KV cache group of the replica's layout.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct GroupRecord {
    group: u32,
    /// vLLM's `kv_cache_spec_kind`.
    kind: String,
    sliding_window: Option<u32>,
    block_size: u32,
}

/// One replica, as read back.
#[derive(Debug, Deserialize)]
pub(crate) struct Section {
    address: String,
    rank: Option<u32>,
    model: String,
    events: Option<String>,
    replay: Option<String>,
    seq: u64,
    digest: u64,
    partitions: Vec<String>,
    groups: Vec<GroupRecord>,
    blocks: Vec<BlockRecord>,
}

/// One replica, as written: the same fields, borrowed (postcard is not
/// self-describing, so the field order and types must equal [`Section`]'s).
#[derive(Serialize)]
struct SectionOut<'a> {
    address: String,
    rank: Option<u32>,
    model: &'a str,
    events: Option<&'a str>,
    replay: Option<&'a str>,
    seq: u64,
    digest: u64,
    partitions: Vec<String>,
    groups: Vec<GroupRecord>,
    blocks: Blocks<'a>,
}

/// Saved blocks written as [`BlockRecord`]s without building them all first.
struct Blocks<'a> {
    blocks: &'a [SavedBlock],
    local: &'a HashMap<PartitionId, u32>,
}

impl Serialize for Blocks<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.blocks.len()))?;
        for b in self.blocks {
            seq.serialize_element(&BlockRecord {
                hash: b.hash.0.to_le_bytes(),
                chain: *b.chain.as_bytes(),
                partition: self.local.get(&b.partition).copied().unwrap_or(u32::MAX),
                group: u8::try_from(b.group).unwrap_or(u8::MAX),
                tiers: b.tiers,
            })?;
        }
        seq.end()
    }
}

impl Section {
    pub(super) fn id(&self) -> Option<EndpointId> {
        Some(EndpointId {
            address: self.address.parse::<SocketAddr>().ok()?,
            rank: self.rank,
        })
    }

    /// Saved for an endpoint configured exactly like `config` (same model and
    /// sources): otherwise its blocks may not be this endpoint's.
    pub(super) fn matches(&self, config: &EndpointConfig) -> bool {
        self.model == config.model
            && self.events.as_deref() == config.events.as_deref()
            && self.replay.as_deref() == config.replay.as_deref()
    }

    /// Blocks saved.
    pub(super) fn entries(&self) -> usize {
        self.blocks.len()
    }

    pub(super) fn applied(&self) -> Applied {
        Applied {
            seq: self.seq,
            digest: self.digest,
        }
    }

    /// The blocks in the index's terms; records naming no partition are
    /// dropped.
    pub(super) fn blocks(&self) -> impl Iterator<Item = (EngineHash, Chain, &str, u32, u8)> + '_ {
        self.blocks.iter().filter_map(|b| {
            let partition = self.partitions.get(usize::try_from(b.partition).ok()?)?;
            Some((
                EngineHash(u64::from_le_bytes(b.hash)),
                Chain::from_bytes(b.chain),
                partition.as_str(),
                u32::from(b.group),
                b.tiers,
            ))
        })
    }

    /// The replica's KV cache layout as saved.
    pub(super) fn layout(&self) -> Layout {
        let mut layout = Layout::default();
        for g in &self.groups {
            let kind = GroupKind::from_label(&g.kind);
            layout.learn(g.group, Some(&kind), g.sliding_window, g.block_size);
        }
        layout
    }
}

/// A snapshot read back.
#[derive(Debug)]
pub(crate) struct Loaded {
    /// Its replicas.
    pub(crate) sections: Vec<Section>,
    /// Its age when read.
    pub(crate) age: Duration,
}

/// A writer that counts and checksums what passes through.
pub(super) struct Sink {
    pub(super) out: BufWriter<File>,
    pub(super) crc: crc32fast::Hasher,
    pub(super) written: u64,
}

impl Sink {
    pub(super) fn put(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.out.write_all(bytes)?;
        self.crc.update(bytes);
        self.written += bytes.len() as u64;
        Ok(())
    }

    pub(super) fn put_section(&mut self, bytes: &[u8]) -> Result<(), SnapshotError> {
        let len = u32::try_from(bytes.len()).map_err(|_| SnapshotError::TooLarge {
            size: bytes.len() as u64,
            max: u64::from(u32::MAX),
        })?;
        self.put(&len.to_le_bytes())?;
        self.put(bytes)?;
        Ok(())
    }
}

pub(super) fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

pub(super) fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, SnapshotError> {
    postcard::to_allocvec(value).map_err(|_| SnapshotError::Corrupt("encode"))
}

/// One replica's section, encoded: its blocks oldest first, their
/// partitions named locally. Returns the bytes and the blocks written.
pub(super) fn section(
    config: &EndpointConfig,
    applied: Applied,
    layout: Option<&Layout>,
    mut blocks: Vec<SavedBlock>,
    names: HashMap<PartitionId, String>,
) -> Result<(Vec<u8>, usize), SnapshotError> {
    let groups = layout
        .into_iter()
        .flat_map(Layout::groups)
        .map(|(group, g)| GroupRecord {
            group,
            kind: g.kind.label().to_owned(),
            sliding_window: g.sliding_window,
            block_size: g.block_size,
        })
        .collect();
    blocks.sort_unstable_by_key(|b| b.order);
    let mut partitions = Vec::with_capacity(names.len());
    let mut local = HashMap::with_capacity(names.len());
    for (id, name) in names {
        local.insert(id, u32::try_from(partitions.len()).unwrap_or(u32::MAX));
        partitions.push(name);
    }
    blocks.retain(|b| local.contains_key(&b.partition));
    let section = SectionOut {
        address: config.id.address.to_string(),
        rank: config.id.rank,
        model: &config.model,
        events: config.events.as_deref(),
        replay: config.replay.as_deref(),
        seq: applied.seq,
        digest: applied.digest,
        partitions,
        groups,
        blocks: Blocks {
            blocks: &blocks,
            local: &local,
        },
    };
    Ok((encode(&section)?, blocks.len()))
}
/// Reads `u32` LE at `at`.
fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    let b: [u8; 4] = bytes.get(at..at.checked_add(4)?)?.try_into().ok()?;
    Some(u32::from_le_bytes(b))
}

/// The length-prefixed item at `*at`, advancing past it.
fn item<'a>(body: &'a [u8], at: &mut usize) -> Result<&'a [u8], SnapshotError> {
    let len = u32_at(body, *at).ok_or(SnapshotError::Corrupt("truncated"))? as usize;
    let start = *at + 4;
    let end = start
        .checked_add(len)
        .ok_or(SnapshotError::Corrupt("length"))?;
    let slice = body
        .get(start..end)
        .ok_or(SnapshotError::Corrupt("truncated"))?;
    *at = end;
    Ok(slice)
}

fn decode<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, SnapshotError> {
    match postcard::take_from_bytes(bytes) {
        Ok((value, [])) => Ok(value),
        Ok(_) => Err(SnapshotError::Corrupt("trailing bytes in a section")),
        Err(_) => Err(SnapshotError::Corrupt("undecodable section")),
    }
}

/// Parses and checks a snapshot's bytes.
pub(crate) fn parse(
    bytes: &[u8],
    block_size: u32,
    max_age: Duration,
    now: SystemTime,
) -> Result<Loaded, SnapshotError> {
    if bytes.get(..MAGIC.len()) != Some(MAGIC.as_slice()) {
        return Err(if bytes.len() < MAGIC.len() {
            SnapshotError::Corrupt("truncated")
        } else {
            SnapshotError::Foreign("magic")
        });
    }
    let version = u32_at(bytes, MAGIC.len()).ok_or(SnapshotError::Corrupt("truncated"))?;
    if version != VERSION {
        return Err(SnapshotError::Version(version));
    }
    let body_end = bytes
        .len()
        .checked_sub(4)
        .ok_or(SnapshotError::Corrupt("truncated"))?;
    let body = bytes
        .get(..body_end)
        .ok_or(SnapshotError::Corrupt("truncated"))?;
    let stored = u32_at(bytes, body_end).ok_or(SnapshotError::Corrupt("truncated"))?;
    if crc32fast::hash(body) != stored {
        return Err(SnapshotError::Corrupt("checksum"));
    }
    let mut at = MAGIC.len() + 4;
    let header: Header = decode(item(body, &mut at)?)?;
    if header.block_size != block_size {
        return Err(SnapshotError::Foreign("another block_size"));
    }
    let created = UNIX_EPOCH + Duration::from_millis(header.created_unix_ms);
    // A clock that went back makes the snapshot look new; that is fine: the
    // replays still prove every replica.
    let age = now.duration_since(created).unwrap_or(Duration::ZERO);
    if age > max_age {
        return Err(SnapshotError::TooOld { age });
    }
    let mut sections = Vec::new();
    loop {
        let section = item(body, &mut at)?;
        if section.is_empty() {
            break;
        }
        sections.push(decode(section)?);
    }
    if at != body.len() {
        return Err(SnapshotError::Corrupt("bytes after the end marker"));
    }
    Ok(Loaded { sections, age })
}
