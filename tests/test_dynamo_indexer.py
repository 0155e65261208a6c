"""A KV-event consumer nobody here wrote reads ``kvoffload serve``'s events as our router does.

NVIDIA Dynamo 1.6.1's standalone indexer (``python -m dynamo.indexer --workers
"1=tcp://...,2=tcp://..."``, from ``.venv-dynamo``: ``make dynamo-setup``) follows two real
``kvoffload serve`` backends with host tiers, over loopback, with their default events config;
``kvoffload route`` follows the same two. For every prompt of a set, Dynamo's per-worker overlap
(``POST /query``: device tokens ``gpu``, device + host tokens ``cpu``) equals what the router's
index says each backend holds (``POST /router/match``: ``device`` and ``host`` blocks), and the
set covers blocks on the device, blocks only on the host, and both workers. Before int block
hashes became the default, Dynamo rejected every batch ("data did not match any variant of
untagged enum BlockHashValue") and its index stayed empty.

Dynamo's indexer has no replay endpoint for ``--workers`` and ZMQ drops what a PUB socket sends
before a subscriber's connection is up: each backend first serves probe prompts until one of them
reaches Dynamo's index (bounded), so every later event reaches it. Without the venv the test is
skipped, or fails under ``KVOFFLOAD_REQUIRE_DYNAMO=1`` (``make test``).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_cases import Process, free_port, http_json, route, serve

from kvoffload.serving.prompts import PromptTokenizer

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent
#: The venv ``scripts/install-dynamo.sh`` builds (``make dynamo-setup``).
DYNAMO_PYTHON = ROOT / ".venv-dynamo" / "bin" / "python"
REQUIRE_ENV = "KVOFFLOAD_REQUIRE_DYNAMO"
BLOCK_SIZE = 16  # serve's and route's default
HOST_GIB = "0.01"  # the tiny model's host tier: room for every prompt below


def _require_dynamo() -> None:
    if DYNAMO_PYTHON.exists():
        return
    problem = f"{DYNAMO_PYTHON} does not exist (make dynamo-setup builds it)"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"Dynamo's indexer is required here ({REQUIRE_ENV}=1) but {problem}",
                    pytrace=False)
    pytest.skip(f"DYNAMO NOT AVAILABLE, the Dynamo indexer test DID NOT RUN: {problem}",
                allow_module_level=True)


_require_dynamo()


@contextlib.contextmanager
def dynamo_indexer(workers: dict[int, str]) -> Iterator[str]:
    """``python -m dynamo.indexer`` following ``workers`` (id -> ZMQ address); yields its URL
    once it answers /health. (It listens on every interface: it has no flag for the address.)"""
    port = free_port()
    spec = ",".join(f"{wid}={endpoint}" for wid, endpoint in workers.items())
    proc = subprocess.Popen(
        [str(DYNAMO_PYTHON), "-m", "dynamo.indexer", "--block-size", str(BLOCK_SIZE),
         "--port", str(port), "--threads", "1", "--workers", spec],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"dynamo.indexer exited {proc.returncode}: "
                                   f"{proc.stdout.read() if proc.stdout else ''}")
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=2):
                break
            if time.monotonic() > deadline:
                raise TimeoutError("dynamo.indexer not ready after 60 s")
            time.sleep(0.1)
        yield url
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def _events_endpoint(backend: Process) -> str:
    """Where ``backend`` publishes (its /kv_event_sources, the port as bound)."""
    endpoint = http_json(f"{backend.url}/kv_event_sources")["0"]["endpoint"]
    assert isinstance(endpoint, str) and endpoint.startswith("tcp://127.0.0.1:")
    return endpoint


def _complete(backend: Process, token_ids: list[int]) -> None:
    http_json(f"{backend.url}/v1/completions",
              {"model": "tiny", "prompt": token_ids, "max_tokens": 2, "temperature": 0})


def _dynamo_tokens(dynamo: str, token_ids: list[int], worker: int) -> tuple[int, int]:
    """Dynamo's overlap of ``worker`` for the prompt: (device tokens, device + host tokens)."""
    answer = http_json(f"{dynamo}/query", {"token_ids": token_ids, "model_name": "default"})
    summary = answer["instances"].get(str(worker), {"gpu": 0, "cpu": 0})
    return summary["gpu"], summary["cpu"]


def _router_tokens(router: Process, token_ids: list[int]) -> list[tuple[int, int]]:
    """The router's index, per backend in --backend order, in the same units."""
    answer = http_json(f"{router.url}/router/match", {"prompt": token_ids})
    return [(b["device"] * BLOCK_SIZE, (b["device"] + b["host"]) * BLOCK_SIZE)
            for b in answer["backends"]]


def _wait_until_followed(dynamo: str, backend: Process, worker: int,
                         tok: PromptTokenizer) -> None:
    """Probe prompts on ``backend`` until one reaches Dynamo's index: its subscription is up."""
    for attempt in range(20):
        probe = tok.encode(f"Probe {worker}.{attempt}: " + "warming the subscription up " * 4)
        _complete(backend, probe)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if _dynamo_tokens(dynamo, probe, worker)[1] > 0:
                return
            time.sleep(0.05)
    raise AssertionError(f"no event of worker {worker} reached Dynamo's index after 20 probes")


def test_dynamo_indexer_overlap_equals_the_routers_index() -> None:
    tok = PromptTokenizer("tiny")
    shared = "System: you answer questions about kvoffload, briefly and exactly. " * 4
    # On backend 1: eight long prompts through a 64-block device cache: the first ones end up on
    # the host only. On backend 2: the shared prefix with other questions (both hold it).
    topics = [tok.encode(f"Topic {i}: " + f"the quick brown fox jumps over the lazy dog {i} " * 10)
              for i in range(8)]
    questions = [tok.encode(shared + f"Question {i}?") for i in range(4)]
    with (
        serve("--kv-offloading-size", HOST_GIB) as a,
        serve("--kv-offloading-size", HOST_GIB) as b,
        dynamo_indexer({1: _events_endpoint(a), 2: _events_endpoint(b)}) as dynamo,
        route([a, b]) as router,
    ):
        _wait_until_followed(dynamo, a, 1, tok)
        _wait_until_followed(dynamo, b, 2, tok)
        for prompt in topics + questions[:2]:
            _complete(a, prompt)
        for prompt in questions[1:]:
            _complete(b, prompt)
        prompts = topics + questions + [tok.encode(shared + "A question nobody asked?")]

        def views() -> tuple[list[list[tuple[int, int]]], list[list[tuple[int, int]]]]:
            theirs = [[_dynamo_tokens(dynamo, p, w) for w in (1, 2)] for p in prompts]
            return theirs, [_router_tokens(router, p) for p in prompts]

        # Both follow the same events asynchronously: wait (bounded) until they have applied them.
        deadline = time.monotonic() + 60
        theirs, ours = views()
        while theirs != ours and time.monotonic() < deadline:
            time.sleep(0.2)
            theirs, ours = views()
        assert theirs == ours
        on_device = [gpu for per_prompt in ours for gpu, _ in per_prompt]
        host_only = [cpu for per_prompt in ours for gpu, cpu in per_prompt if gpu == 0]
        assert max(on_device) > 0 and max(host_only) > 0  # device and host tiers both compared
        assert all(cpu > 0 for _, cpu in ours[-1])  # the shared prefix, held by both
