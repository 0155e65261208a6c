# Two commands on a fresh machine with Python 3.11 and make:
#   make test    set up .venv and run the whole test suite
#   make bench   set up .venv and run the main benchmark (kvoffload bench throughput --compare)
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvoffload-installed
BENCH_ARGS ?=

.PHONY: test test-core test-vllm vllm-setup bench setup lint clean redis-server

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

# The whole suite: the core tests, then the vLLM plug-in tests (which need vLLM in the venv).
test: test-core test-vllm

test-core: $(STAMP) redis-server
	$(PY) -m pytest -q --ignore-glob="tests/test_vllm_*.py"  # make test-vllm runs those

# vLLM 0.33.0 plug-in tests (tests/test_vllm_*.py, docs/vllm.md). vLLM goes into $(VENV) with
# --no-deps over our CPU torch, with the few modules its offloading code imports
# (requirements/vllm-plugin.txt); their wheels are downloaded once per machine into
# $(KVOFFLOAD_CACHE). Where that fails the tests still run and skip with a loud reason.
KVOFFLOAD_CACHE ?= $(HOME)/.cache/kvoffload
VLLM_REQS := requirements/vllm-plugin.txt
VLLM_STAMP := $(VENV)/.vllm-plugin-installed
VLLM_TESTS := tests/test_vllm_policies.py tests/test_vllm_tiers.py tests/test_vllm_spec.py \
	tests/test_vllm_connector.py tests/test_vllm_parity.py

vllm-setup: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP) $(VLLM_REQS)
	scripts/install-vllm.sh $(PY) $(KVOFFLOAD_CACHE)/wheels $(VLLM_REQS)
	touch $@

test-vllm: $(STAMP)
	$(MAKE) vllm-setup || echo "!!! vLLM could not be installed: the vLLM plug-in tests will SKIP"
	$(PY) -m pytest -q $(VLLM_TESTS) || [ $$? -eq 5 ]  # 5: all skipped, loudly (no vLLM)

bench: $(STAMP)
	$(VENV)/bin/kvoffload bench throughput --compare --repeats 3 $(BENCH_ARGS)

lint: $(STAMP)
	$(PY) -m pip install -q ruff
	$(VENV)/bin/ruff check kvoffload tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
