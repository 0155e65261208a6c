# Two commands on a fresh machine with Python 3.11 and make:
#   make test    set up .venv and run the whole test suite
#   make bench   set up .venv and run the main benchmark (kvoffload bench throughput --compare)
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvoffload-installed
BENCH_ARGS ?=

.PHONY: test bench setup lint clean redis-server

setup: $(STAMP) redis-server

# The remote-tier tests start real redis-server processes: Debian's package, installed here when
# missing and we are root (without root, see README "Remote tier"; the tests then fail saying so).
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server; \
		else \
			echo "redis-server is missing and we are not root: see README, Remote tier"; \
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

test: $(STAMP) redis-server
	$(PY) -m pytest -q

bench: $(STAMP)
	$(VENV)/bin/kvoffload bench throughput --compare --repeats 2 $(BENCH_ARGS)

lint: $(STAMP)
	$(PY) -m pip install -q ruff
	$(VENV)/bin/ruff check kvoffload tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
