#!/usr/bin/env bash
# Build the venv of NVIDIA Dynamo's standalone KV indexer (ai-dynamo 1.6.1 with ai-dynamo-runtime),
# a KV-event consumer nobody here wrote: tests/test_dynamo_indexer.py runs
# `$VENV/bin/python -m dynamo.indexer` against real `kvoffload serve` processes.
#   usage: scripts/install-dynamo.sh PYTHON VENV CACHE_DIR REQUIREMENTS
# Each step says what it does; on failure the script says which step failed and why, and exits
# non-zero (make test then fails: a failed install never turns into skipped tests).
# The indexer needs neither etcd nor NATS: it subscribes to the workers' ZMQ PUB sockets itself.
set -euo pipefail
python=$1 venv=$2 cache=$3 reqs=$4
py=$venv/bin/python
step=""

say() { echo "install-dynamo: $*"; }
begin() { step=$1; say "$1"; }
trap 'rc=$?; [ $rc -eq 0 ] || say "FAILED at: $step (exit $rc; the output above says why)"' EXIT

# Its own venv: Dynamo pins pydantic<=2.13.5 (ours is newer) and ships a native module
# (dynamo._core) that nothing of ours should import.
begin "1/4 venv $venv ($python)"
test -x "$py" || "$python" -m venv "$venv"

begin "2/4 wheel cache $cache"
mkdir -p "$cache"
# Offline first: nothing to fetch once the cache holds every pinned wheel. --no-deps: the list is
# complete for the indexer; ai-dynamo's own dependencies are left out (see $reqs: one of them,
# aisimulate, is a placeholder that downloads from pypi.nvidia.com at install time).
if ! "$py" -m pip download -q --no-deps --no-index --find-links "$cache" -d "$cache" -r "$reqs" \
        >/dev/null 2>&1; then
    say "  filling the cache (once per machine; ~90 MB, ai-dynamo-runtime itself 75 MB)"
    "$py" -m pip download -q --no-deps --only-binary=:all: --retries 2 --timeout 60 \
        -d "$cache" -r "$reqs"
fi

begin "3/4 ai-dynamo, ai-dynamo-runtime and the runtime's dependencies from $reqs (--no-deps)"
"$py" -m pip install -q --no-deps --no-index --find-links "$cache" -r "$reqs"

# The indexer is Rust (dynamo._core, a manylinux_2_28 x86_64/aarch64 abi3 module): its --help
# loads it, so a glibc older than 2.28 or another platform fails here, saying so.
begin "4/4 check: python -m dynamo.indexer --help"
usage=$("$py" -m dynamo.indexer --help)
case $usage in
    *--workers*) ;;
    *) say "python -m dynamo.indexer --help does not list --workers:"; echo "$usage"; exit 1 ;;
esac
say "done: $venv (indexer: $py -m dynamo.indexer)"
