#!/usr/bin/env bash
# Install vLLM and the modules its offloading code imports (a pinned list) into a virtualenv,
# --no-deps, from a per-machine wheel cache that is filled once.
#   usage: scripts/install-vllm.sh PYTHON CACHE_DIR REQUIREMENTS
# Exits non-zero (after saying why) when something cannot be downloaded or imported.
set -euo pipefail
py=$1 cache=$2 reqs=$3
mkdir -p "$cache"
# Offline first: nothing to fetch once the cache holds every pinned wheel.
if ! "$py" -m pip download -q --no-deps --no-index --find-links "$cache" -d "$cache" -r "$reqs" \
        >/dev/null 2>&1; then
    echo "install-vllm: filling the wheel cache $cache (once per machine; vLLM is ~340 MB)"
    "$py" -m pip download -q --no-deps --retries 1 --timeout 60 -d "$cache" -r "$reqs"
fi
"$py" -m pip install -q --no-deps --no-index --find-links "$cache" -r "$reqs"
check="import vllm.v1.kv_offload.tiering.spec, vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector"
if ! out=$("$py" -c "$check" 2>&1); then
    echo "$out" | tail -5
    echo "install-vllm: vLLM's offloading modules do not import (a module missing from $reqs?)"
    exit 1
fi
