#!/usr/bin/env python3
"""Writes block_keys_v2.json: golden vectors for the kvroute/v2 block-key scheme.

An implementation independent of the Rust one (PyPI's `xxhash`, which wraps
the reference C library), so that the vectors pin the scheme rather than echo
the code under test. Regenerate only together with a new scheme version:

    pip install xxhash
    python3 proto/testdata/gen_block_keys_v2.py > proto/testdata/block_keys_v2.json
"""
import json
import struct

import xxhash

PREFIX = b"kvroute/v2"


def h(data):
    # The canonical (big-endian) 16 bytes of XXH3-128, seed 0.
    return xxhash.xxh3_128_digest(data)


def root(salt):
    if salt is None:
        return h(PREFIX + b"\x01")
    return h(PREFIX + b"\x00" + salt.encode("utf-8"))


def keys(tokens, block_size, salt):
    chain = root(salt)
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start:start + block_size]
        chain = h(chain + b"".join(struct.pack("<I", t) for t in block))
        out.append("%016x" % struct.unpack("<Q", chain[:8])[0])
    return out


def tokens(seed, n):
    # A small LCG: reproducible token ids spread over the full u32 range and a
    # 32k vocabulary alike.
    out, x = [], seed
    for i in range(n):
        x = (x * 6364136223846793005 + 1442695040888963407) % 2**64
        out.append((x >> 33) % (2**32 if i % 7 == 0 else 32000))
    return out


CASES = [
    ("empty input", [], 16, None),
    ("shorter than one block", tokens(1, 15), 16, None),
    ("one block bs16 no salt", tokens(2, 16), 16, None),
    ("partial last block ignored bs16", tokens(3, 16 * 3 + 5), 16, None),
    ("bs32 no salt", tokens(4, 32 * 4), 32, None),
    ("bs64 no salt", tokens(5, 64 * 3 + 63), 64, None),
    ("bs128 no salt", tokens(6, 128 * 2), 128, None),
    ("bs64 ascii salt", tokens(5, 64 * 3 + 63), 64, "tenant-a"),
    ("bs64 other salt", tokens(5, 64 * 3 + 63), 64, "tenant-b"),
    ("bs64 empty salt", tokens(5, 64 * 2), 64, ""),
    ("bs32 unicode salt", tokens(7, 32 * 3), 32, "租户-ü-🚀"),
    ("bs16 max token ids", [0, 1, 2**32 - 1, 31999] * 4 * 2, 16, None),
    ("bs128 salt long", tokens(8, 128 * 3 + 1), 128, "s" * 128),
    # Past the 128 tokens the Rust side serialises on the stack.
    ("bs256 salt", tokens(9, 256 * 2 + 3), 256, "tenant-c"),
]


def main():
    vectors = []
    for name, toks, bs, salt in CASES:
        vectors.append({
            "name": name,
            "block_size": bs,
            "salt": salt,
            "tokens": toks,
            "root": root(salt).hex(),
            "keys": keys(toks, bs, salt),
        })
    doc = {
        "scheme": "kvroute/v2",
        "generator": "proto/testdata/gen_block_keys_v2.py",
        "vectors": vectors,
    }
    print(json.dumps(doc, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
