//! The golden vectors in `testdata/block_keys_v2.json` (written by an
//! independent Python implementation) checked against `kvroute_proto::keys`.
//! The same tests run natively (`cargo test`) and compiled to
//! wasm32-unknown-unknown under node (`wasm-bindgen-test-runner`), so the
//! filter and indexd provably derive identical keys.

// Under wasm the tests carry `#[wasm_bindgen_test]`, which clippy does not
// recognise as a test, so its allow-in-tests settings do not apply.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::indexing_slicing)]

use kvroute_proto::keys::{BlockKey, BlockSize, Chain, KeyChain, block_keys};
use serde::Deserialize;
use xxhash_rust::xxh3::xxh3_128;

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

const VECTORS: &str = include_str!("../testdata/block_keys_v2.json");

#[derive(Deserialize)]
struct Doc {
    scheme: String,
    vectors: Vec<Vector>,
}

#[derive(Deserialize)]
struct Vector {
    name: String,
    block_size: u32,
    salt: Option<String>,
    tokens: Vec<u32>,
    root: String,
    keys: Vec<String>,
}

fn load() -> Doc {
    serde_json::from_str(VECTORS).expect("golden vectors parse")
}

fn hex_keys(keys: &[BlockKey]) -> Vec<String> {
    keys.iter().map(ToString::to_string).collect()
}

#[test]
fn golden_vectors_match_block_keys() {
    let doc = load();
    assert_eq!(doc.scheme, kvroute_proto::SCHEME_VERSION);
    assert!(doc.vectors.len() >= 10, "the vector file lost cases");
    for v in &doc.vectors {
        let bs = BlockSize::new(v.block_size).expect("non-zero block size");
        let keys = block_keys(&v.tokens, bs, v.salt.as_deref());
        assert_eq!(hex_keys(&keys), v.keys, "vector {:?}", v.name);
        assert_eq!(
            hex::encode(Chain::root(v.salt.as_deref()).as_bytes()),
            v.root,
            "root of vector {:?}",
            v.name
        );
    }
}

#[test]
fn golden_vectors_match_streaming_form() {
    for v in &load().vectors {
        let bs = BlockSize::new(v.block_size).expect("non-zero block size");
        // Key block by block, restarting from the stored parent chain each
        // time, as indexd does with BlockStored events.
        let mut parent = Chain::root(v.salt.as_deref());
        let mut keys = Vec::new();
        for block in v.tokens.chunks_exact(v.block_size as usize) {
            let mut chain = KeyChain::from_parent(bs, parent);
            parent = chain.push_block(block).expect("full block");
            keys.push(parent.key());
        }
        assert_eq!(hex_keys(&keys), v.keys, "vector {:?}", v.name);
    }
}

#[test]
fn golden_vectors_cover_the_contract() {
    let doc = load();
    let sizes: Vec<u32> = doc.vectors.iter().map(|v| v.block_size).collect();
    for bs in [16, 32, 64, 128, 256] {
        assert!(sizes.contains(&bs), "no vector with block size {bs}");
    }
    assert!(doc.vectors.iter().any(|v| v.tokens.is_empty()));
    assert!(doc.vectors.iter().any(|v| v.salt.is_none()));
    assert!(
        doc.vectors
            .iter()
            .any(|v| v.salt.as_deref().is_some_and(|s| !s.is_ascii()))
    );
    assert!(
        doc.vectors
            .iter()
            .any(|v| v.tokens.len() % v.block_size as usize != 0 && !v.keys.is_empty()),
        "no vector with a partial last block after full ones"
    );
}

/// One knob per element of the scheme: the reference below, with exactly one
/// byte or rule changed, must disagree with the golden file.
#[derive(Clone, Copy, Debug)]
enum Mutation {
    None,
    VersionByte,
    SaltMarker,
    UnsaltedMarker,
    TokenEndianness,
    ChainLength,
    DigestByteOrder,
    KeyEndianness,
}

fn reference_keys(v: &Vector, m: Mutation) -> Vec<String> {
    let mut root = b"kvroute/v2".to_vec();
    if let Mutation::VersionByte = m {
        root[9] = b'3';
    }
    match &v.salt {
        Some(salt) => {
            root.push(if let Mutation::SaltMarker = m { 2 } else { 0 });
            root.extend_from_slice(salt.as_bytes());
        }
        None => root.push(if let Mutation::UnsaltedMarker = m {
            2
        } else {
            1
        }),
    }
    let digest = |input: &[u8]| match m {
        Mutation::DigestByteOrder => xxh3_128(input).to_le_bytes(),
        _ => xxh3_128(input).to_be_bytes(),
    };
    let mut chain = digest(&root).to_vec();
    let mut keys = Vec::new();
    for block in v.tokens.chunks_exact(v.block_size as usize) {
        let mut input = chain.clone();
        if let Mutation::ChainLength = m {
            input.truncate(8);
        }
        for t in block {
            match m {
                Mutation::TokenEndianness => input.extend_from_slice(&t.to_be_bytes()),
                _ => input.extend_from_slice(&t.to_le_bytes()),
            }
        }
        chain = digest(&input).to_vec();
        let first: [u8; 8] = chain[..8].try_into().unwrap();
        let key = match m {
            Mutation::KeyEndianness => u64::from_be_bytes(first),
            _ => u64::from_le_bytes(first),
        };
        keys.push(format!("{key:016x}"));
    }
    keys
}

#[test]
fn golden_vectors_pin_every_byte_of_the_scheme() {
    let doc = load();
    for v in &doc.vectors {
        assert_eq!(reference_keys(v, Mutation::None), v.keys, "{:?}", v.name);
    }
    for m in [
        Mutation::VersionByte,
        Mutation::SaltMarker,
        Mutation::UnsaltedMarker,
        Mutation::TokenEndianness,
        Mutation::ChainLength,
        Mutation::DigestByteOrder,
        Mutation::KeyEndianness,
    ] {
        let caught = doc.vectors.iter().any(|v| reference_keys(v, m) != v.keys);
        assert!(caught, "the vectors do not detect mutation {m:?}");
    }
}
