#!/usr/bin/env python3
"""No non-test Rust source file over 700 lines.

Usage: filesize.py [--max N]

Reads `git ls-files '*.rs'`. Test code is left out: files under a crate's
`tests/`, `benches/` or `fuzz/` directory, and files named `tests.rs`,
`proptests.rs` or `*_tests.rs` (the `#[path]` test modules). The workspace's
own top-level `tests/` holds crates (the bench, e2e, the mock): their `src/`
counts.

Exceptions, with their reason:
- tokenizer/src/pystr/tables.rs: Unicode case and whitespace tables
  generated from Python's `str` (its header says how); data, not code.
"""

import subprocess
import sys

EXCEPTIONS = {"tokenizer/src/pystr/tables.rs"}
TEST_DIRS = {"tests", "benches", "fuzz"}


def is_test(path):
    parts = path.split("/")
    name = parts[-1]
    if parts[0] == "fuzz" or any(p in TEST_DIRS for p in parts[1:-1]):
        return True
    return name in ("tests.rs", "proptests.rs") or name.endswith("_tests.rs")


def main():
    limit = 700
    if len(sys.argv) == 3 and sys.argv[1] == "--max":
        limit = int(sys.argv[2])
    elif len(sys.argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    files = subprocess.run(
        ["git", "ls-files", "*.rs"], check=True, capture_output=True, text=True
    ).stdout.split()
    over = []
    for path in files:
        if is_test(path) or path in EXCEPTIONS:
            continue
        with open(path, encoding="utf-8") as f:
            lines = sum(1 for _ in f)
        if lines > limit:
            over.append((lines, path))
    for lines, path in sorted(over, reverse=True):
        print(f"{path}: {lines} lines (at most {limit} outside tests)")
    if over:
        return 1
    print(f"no non-test source file over {limit} lines ({len(files)} files read)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
