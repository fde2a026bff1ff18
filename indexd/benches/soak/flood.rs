//! The event flood: one ZMTP 3 PUB per simulated replica, written by hand
//! over TCP (greeting, READY, then `[topic, seq, payload]` messages as fast as
//! indexd reads them: TCP backpressure sets the pace, nothing is dropped).
//!
//! Each replica serves prompts of 64 blocks of 16 tokens: an 8-block system
//! prefix every replica shares, then 56 blocks of its own, published as two
//! `BlockStored` batches (32 blocks each, vLLM's map shape with `extra_keys`),
//! then one `BlockRemoved` for the prompt served 512 prompts earlier (the
//! engine's own evictions). So each replica keeps about 28,700 blocks and 64
//! replicas about 1.8 M: past a 1 M `max_index_entries`, indexd evicts too.
//!
//! The fleet mix ([`Mix`]) adds what a fleet with offloading does besides:
//! every other prompt, the prompt served `KEPT / 2` earlier moves to the CPU
//! tier (a `BlockStored` with `medium: CPU` and no tokens, as vLLM's offloading
//! connector sends it) and leaves it again when evicted; every
//! `restart_every` prompts the replica restarts (`AllBlocksCleared`, then its
//! prompts start over; the first restart comes at a random point, so the
//! replicas do not restart together). And it can pace each replica (prompts per second)
//! instead of flooding.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use bytes::{Bytes, BytesMut};
use indexd::zmtp::encode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Tokens per block (indexd's `block_size`).
pub const BLOCK: u32 = 16;
/// Blocks of the shared system prefix.
pub const SYSTEM: u64 = 8;
/// Blocks per prompt.
pub const PROMPT: u64 = 64;
/// Blocks in a prompt's first batch (its second has the rest).
pub const FIRST: u64 = 32;
/// Prompts a replica keeps before evicting the oldest.
pub const KEPT: u64 = 512;

/// What each replica publishes besides stores and evictions, and how fast.
#[derive(Clone, Copy, Debug, Default)]
pub struct Mix {
    /// Offload every other prompt to the CPU tier half-way to its eviction.
    pub tier_moves: bool,
    /// Restart after this many prompts (0: never).
    pub restart_every: u64,
    /// Prompts per second per replica (0: as fast as indexd reads).
    pub prompts_per_second: f64,
}

/// What the flood has sent, for rates.
#[derive(Debug, Default)]
pub struct Counters {
    /// Messages (batches) written.
    pub batches: AtomicU64,
    /// Blocks stored in them.
    pub blocks: AtomicU64,
}

/// One replica's progress: the last prompt whose batches were all written.
#[derive(Debug, Default)]
pub struct Progress {
    /// Prompts completed (0: none yet).
    pub prompts: AtomicU64,
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The engine hash of block `b` of prompt `p` on replica `r`.
pub fn hash(r: u64, p: u64, b: u64) -> u64 {
    if b < SYSTEM {
        0xa000_0000_0000_0000 | b
    } else {
        splitmix((r << 40) ^ (p << 8) ^ b) | 1
    }
}

/// The tokens of block `b` of prompt `p` on replica `r`.
pub fn tokens(r: u64, p: u64, b: u64) -> impl Iterator<Item = u32> {
    let seed = if b < SYSTEM {
        b
    } else {
        (r << 40) ^ (p << 8) ^ b
    };
    (0..u64::from(BLOCK)).map(move |j| (splitmix(seed.wrapping_mul(31) ^ j) % 32_000) as u32)
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    rmp::encode::write_str(out, s).unwrap();
}

/// A batch `[ts, [event]]` of one event: a map of `fields` entries, the
/// first of them `type: kind`, whose other `fields - 1` the caller writes.
fn batch(ts: f64, fields: u32, kind: &str, capacity: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(capacity);
    rmp::encode::write_array_len(&mut out, 2).unwrap();
    rmp::encode::write_f64(&mut out, ts).unwrap();
    rmp::encode::write_array_len(&mut out, 1).unwrap();
    rmp::encode::write_map_len(&mut out, fields).unwrap();
    put_str(&mut out, "type");
    put_str(&mut out, kind);
    out
}

/// `block_hashes` of prompt `p`'s own blocks (after the system prefix).
fn put_own_hashes(out: &mut Vec<u8>, r: u64, p: u64) {
    put_str(out, "block_hashes");
    rmp::encode::write_array_len(out, (PROMPT - SYSTEM) as u32).unwrap();
    for b in SYSTEM..PROMPT {
        rmp::encode::write_uint(out, hash(r, p, b)).unwrap();
    }
}

/// A `BlockStored` batch of blocks `range` of prompt `p`.
fn stored(r: u64, p: u64, range: std::ops::Range<u64>, ts: f64) -> Vec<u8> {
    let n = (range.end - range.start) as u32;
    let mut out = batch(
        ts,
        8,
        "BlockStored",
        64 + n as usize * (10 + 3 * BLOCK as usize),
    );
    put_str(&mut out, "block_hashes");
    rmp::encode::write_array_len(&mut out, n).unwrap();
    for b in range.clone() {
        rmp::encode::write_uint(&mut out, hash(r, p, b)).unwrap();
    }
    put_str(&mut out, "parent_block_hash");
    match range.start {
        0 => rmp::encode::write_nil(&mut out).unwrap(),
        s => {
            rmp::encode::write_uint(&mut out, hash(r, p, s - 1)).unwrap();
        }
    }
    put_str(&mut out, "token_ids");
    rmp::encode::write_array_len(&mut out, n * BLOCK).unwrap();
    for b in range {
        for t in tokens(r, p, b) {
            rmp::encode::write_uint(&mut out, u64::from(t)).unwrap();
        }
    }
    put_str(&mut out, "block_size");
    rmp::encode::write_uint(&mut out, u64::from(BLOCK)).unwrap();
    put_str(&mut out, "medium");
    put_str(&mut out, "GPU");
    put_str(&mut out, "lora_name");
    rmp::encode::write_nil(&mut out).unwrap();
    put_str(&mut out, "extra_keys");
    rmp::encode::write_array_len(&mut out, n).unwrap();
    for _ in 0..n {
        rmp::encode::write_nil(&mut out).unwrap();
    }
    out
}

/// A `BlockStored` batch moving prompt `p`'s own blocks to the CPU tier
/// (no tokens: the engine hashes say which blocks).
fn offloaded(r: u64, p: u64, ts: f64) -> Vec<u8> {
    let mut out = batch(ts, 6, "BlockStored", 96 + PROMPT as usize * 9);
    put_own_hashes(&mut out, r, p);
    put_str(&mut out, "parent_block_hash");
    rmp::encode::write_uint(&mut out, hash(r, p, SYSTEM - 1)).unwrap();
    put_str(&mut out, "token_ids");
    rmp::encode::write_array_len(&mut out, 0).unwrap();
    put_str(&mut out, "block_size");
    rmp::encode::write_uint(&mut out, u64::from(BLOCK)).unwrap();
    put_str(&mut out, "medium");
    put_str(&mut out, "CPU");
    out
}

/// An `AllBlocksCleared` batch.
fn cleared(ts: f64) -> Vec<u8> {
    batch(ts, 1, "AllBlocksCleared", 32)
}

/// A `BlockRemoved` batch evicting prompt `p`'s own blocks from `medium`.
fn removed(r: u64, p: u64, ts: f64, medium: &str) -> Vec<u8> {
    let mut out = batch(ts, 3, "BlockRemoved", 64 + PROMPT as usize * 9);
    put_own_hashes(&mut out, r, p);
    put_str(&mut out, "medium");
    put_str(&mut out, medium);
    out
}

/// One replica's publisher on `listener`: accepts indexd's SUB, then floods
/// until `stop`.
pub async fn publish(
    r: u64,
    listener: TcpListener,
    stop: Arc<AtomicBool>,
    counters: Arc<Counters>,
    progress: Arc<Progress>,
    mix: Mix,
) -> std::io::Result<()> {
    let (socket, _) = listener.accept().await?;
    socket.set_nodelay(true)?;
    let (mut rx, mut tx) = socket.into_split();
    // What the subscriber sends (greeting, READY, its subscription): read
    // and dropped.
    tokio::spawn(async move {
        let mut sink = vec![0u8; 4096];
        while matches!(rx.read(&mut sink).await, Ok(n) if n > 0) {}
    });
    let mut out = BytesMut::from(&encode::greeting()[..]);
    let mut ready = vec![11];
    ready.extend_from_slice(b"Socket-Type");
    ready.extend_from_slice(&3u32.to_be_bytes());
    ready.extend_from_slice(b"PUB");
    encode::put_command(&mut out, "READY", &ready);
    tx.write_all(&out).await?;
    let topic = Bytes::from(format!("kv@soak-{r}@m"));
    let mut seq = 0u64;
    let mut p = 0u64;
    // Prompts since the last restart (what the window of kept prompts counts).
    let mut since = 0u64;
    // Replicas restart at staggered times: the first after half to one and a
    // half periods, then every period.
    let mut restart_at = mix.restart_every / 2 + splitmix(r) % mix.restart_every.max(1);
    let mut pace = (mix.prompts_per_second > 0.0).then(|| {
        let mut t = tokio::time::interval(std::time::Duration::from_secs_f64(
            1.0 / mix.prompts_per_second,
        ));
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t
    });
    while !stop.load(Ordering::Relaxed) {
        if let Some(t) = pace.as_mut() {
            t.tick().await;
        }
        let ts = p as f64;
        let mut batches = Vec::with_capacity(6);
        if mix.restart_every > 0 && since == restart_at {
            batches.push(cleared(ts));
            since = 0;
            restart_at = mix.restart_every;
        }
        batches.push(stored(r, p, 0..FIRST, ts));
        batches.push(stored(r, p, FIRST..PROMPT, ts));
        let offloads = |q: u64| mix.tier_moves && q.is_multiple_of(2);
        if mix.tier_moves && since >= KEPT / 2 && offloads(p - KEPT / 2) {
            batches.push(offloaded(r, p - KEPT / 2, ts));
        }
        if since >= KEPT {
            batches.push(removed(r, p - KEPT, ts, "GPU"));
            if offloads(p - KEPT) {
                batches.push(removed(r, p - KEPT, ts, "CPU"));
            }
        }
        since += 1;
        let mut out = BytesMut::new();
        for payload in &batches {
            let frames = [
                topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                Bytes::copy_from_slice(payload),
            ];
            encode::put_message(&mut out, &frames);
            seq += 1;
        }
        tx.write_all(&out).await?;
        counters
            .batches
            .fetch_add(batches.len() as u64, Ordering::Relaxed);
        counters.blocks.fetch_add(PROMPT, Ordering::Relaxed);
        p += 1;
        progress.prompts.store(p, Ordering::Relaxed);
    }
    Ok(())
}
