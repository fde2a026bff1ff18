#!/usr/bin/env python3
"""Writes block_keys_v1.json: golden vectors for the kvroute/v1 block-key scheme.

An implementation independent of the Rust one (Python's hashlib), so that the
vectors pin the scheme rather than echo the code under test. Regenerate only
together with a new scheme version:

    python3 proto/testdata/gen_block_keys_v1.py > proto/testdata/block_keys_v1.json
"""
import hashlib
import json
import struct

PREFIX = b"kvroute/v1"


def root(salt):
    if salt is None:
        return hashlib.sha256(PREFIX + b"\x01").digest()[:16]
    return hashlib.sha256(PREFIX + b"\x00" + salt.encode("utf-8")).digest()[:16]


def keys(tokens, block_size, salt):
    chain = root(salt)
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start:start + block_size]
        chain = hashlib.sha256(chain + b"".join(struct.pack("<I", t) for t in block)).digest()[:16]
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
        "scheme": "kvroute/v1",
        "generator": "proto/testdata/gen_block_keys_v1.py",
        "vectors": vectors,
    }
    print(json.dumps(doc, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
