#!/usr/bin/env python3
"""Compares two id files of the live_ids.py / expected.py format (one JSON
object per line: {"id", "tokens"} or {"id", "error"}); prints the first
differences and exits non-zero on any.

    python compare_ids.py A.jsonl B.jsonl
"""
import json
import sys


def load(path):
    with open(path, encoding="utf-8") as f:
        return {r["id"]: r for r in map(json.loads, f)}


def main(a_path, b_path):
    a, b = load(a_path), load(b_path)
    bad = []
    for i in sorted(a.keys() | b.keys()):
        x, y = a.get(i, {}), b.get(i, {})
        if x.get("tokens") != y.get("tokens") or ("error" in x) != ("error" in y):
            bad.append(i)
    for i in bad[:10]:
        x, y = a.get(i, {}), b.get(i, {})
        tx, ty = x.get("tokens") or [], y.get("tokens") or []
        at = next((k for k, (p, q) in enumerate(zip(tx, ty)) if p != q), min(len(tx), len(ty)))
        print(f"#{i}: first difference at token {at} ({len(tx)} vs {len(ty)} tokens)"
              f" {x.get('error', '')} {y.get('error', '')}".rstrip())
    print(f"{len(bad)} mismatches of {len(a)}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(*sys.argv[1:])
