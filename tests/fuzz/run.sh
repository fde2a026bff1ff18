#!/usr/bin/env bash
# Runs every cargo-fuzz target of the filter, indexd and the tokenizer from
# its committed corpus, FUZZ_RUNS inputs each, and writes a report of the
# counts. Every input must finish within FUZZ_TIMEOUT seconds (libFuzzer's
# -timeout; FUZZ_TOKENIZER_TIMEOUT for the tokenizer): a super-linear path is
# a failure, not just a slow run. A target's large inputs, `large/TARGET/`
# beside its corpus (the tokenizer's: 30,000 function calls, 8,000 messages,
# one 30 KB word, each well under a second; 30,000 calls took ~9 s when
# merging them was quadratic), are run once each under the limit first;
# they stay out of the corpus, whose mutations would be as slow. The
# tokenizer's targets take inputs up to 64 KiB and need the test models
# (.ci/deps.sh builds them).
#   tests/fuzz/run.sh [--report FILE]
# Environment:
#   FUZZ_RUNS       inputs per target (default 10000000)
#   FUZZ_TOOLCHAIN  the pinned nightly (default nightly-2026-05-19, as the Makefile)
#   FUZZ_TARGETS    space-separated subset, e.g. "filter:config indexd:zmtp_decoder"
#   FUZZ_TIMEOUT    seconds one input may take (default 10)
#   FUZZ_TOKENIZER_TIMEOUT  the same for the tokenizer's targets (default 5)
# No sanitizer: the fuzzed code is safe Rust (the filter's only unsafe code,
# its host ABI, exists in wasm32 builds alone), and without one a target runs
# several times faster.
set -euo pipefail
cd "$(dirname "$0")/../.."
runs=${FUZZ_RUNS:-10000000}
toolchain=${FUZZ_TOOLCHAIN:-nightly-2026-05-19}
report=""
if [ "${1:-}" = "--report" ]; then report=$2; fi

say() { printf '==> %s\n' "$*"; }

# The pinned nightly: installed under its own name, or the machine's
# `nightly` if it is that build (linked, offline, under a name of ours:
# rustup reserves the official ones).
if ! rustup run "$toolchain" rustc -V >/dev/null 2>&1; then
  want=${toolchain#nightly-}
  alias="kvroute-$toolchain"
  if ! rustup run "$alias" rustc -V >/dev/null 2>&1; then
    if rustc +nightly -V 2>/dev/null | grep -q "$want"; then
      say "linking the installed nightly ($want) as $alias"
      rustup toolchain link "$alias" "$(rustc +nightly --print sysroot)"
    else
      echo "fuzz: toolchain $toolchain is not installed (rustup toolchain install $toolchain)" >&2
      exit 1
    fi
  fi
  toolchain=$alias
fi
if ! cargo "+$toolchain" fuzz --version >/dev/null 2>&1; then
  say "cargo-fuzz"
  cargo install cargo-fuzz --locked
fi

scratch=$(mktemp -d -t kvroute-fuzz.XXXXXX)
trap 'rm -rf "$scratch"' EXIT
rows=()
timeout=${FUZZ_TIMEOUT:-10}
for crate in filter indexd tokenizer; do
  dir=$crate/fuzz
  limit=$timeout
  extra=()
  if [ "$crate" = tokenizer ]; then
    limit=${FUZZ_TOKENIZER_TIMEOUT:-5}
    extra=(-max_len=65536)
  fi
  [ -d "$dir" ] || continue
  for target in $(cd "$dir" && cargo "+$toolchain" fuzz list); do
    if [ -n "${FUZZ_TARGETS:-}" ] && [[ " $FUZZ_TARGETS " != *" $crate:$target "* ]]; then
      continue
    fi
    say "$crate:$target ($runs inputs)"
    mkdir -p "$scratch/$crate-$target"
    log="$scratch/$crate-$target.log"
    started=$(date +%s)
    if [ -d "$dir/large/$target" ] && ! (cd "$dir" && cargo "+$toolchain" fuzz run -s none "$target" \
          large/"$target"/* -- -timeout="$limit") >"$log" 2>&1; then
      tail -n 40 "$log" >&2
      echo "fuzz: $crate:$target failed on a large input within ${limit} s (see $dir/large/$target/)" >&2
      exit 1
    fi
    if ! (cd "$dir" && cargo "+$toolchain" fuzz run -s none "$target" \
          "$scratch/$crate-$target" "corpus/$target" -- -runs="$runs" -timeout="$limit" \
          ${extra[@]+"${extra[@]}"} -print_final_stats=1) \
          >"$log" 2>&1; then
      tail -n 40 "$log" >&2
      echo "fuzz: $crate:$target failed to build or found a crash (its input, if any, is under $dir/artifacts/$target/)" >&2
      exit 1
    fi
    secs=$(( $(date +%s) - started ))
    done_line=$(grep -E '^Done [0-9]+ runs' "$log" | tail -n 1)
    executed=$(grep -E 'stat::number_of_executed_units' "$log" | tail -n 1 | awk '{print $2}')
    seeds=$(ls "$dir/corpus/$target" | wc -l)
    found=$(ls "$scratch/$crate-$target" | wc -l)
    echo "    $done_line"
    rows+=("| \`$crate:$target\` | ${executed:-?} | $seeds | $found | $secs |")
  done
done

table="| target | inputs run | committed seeds | new corpus entries | seconds |
|---|---:|---:|---:|---:|"
for r in "${rows[@]}"; do table="$table
$r"; done
printf '%s\n' "$table"
if [ -n "$report" ]; then
  {
    echo "# Fuzzing report"
    echo
    echo "\`make fuzz\` on $(date -u +%Y-%m-%d): $(rustc "+$toolchain" -V), no sanitizer,"
    echo "$runs inputs per target from the committed corpora (\`filter/fuzz/corpus/\`,"
    echo "\`indexd/fuzz/corpus/\`, \`tokenizer/fuzz/corpus/\`), at most ${timeout} s an input"
    echo "(${FUZZ_TOKENIZER_TIMEOUT:-5} s for the tokenizer's)."
    echo "No crash, no failed assertion, no input over the time limit."
    echo
    printf '%s\n' "$table"
  } >"$report"
  say "report: $report"
fi
